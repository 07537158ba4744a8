"""MLX's Adam and AdamW, their update computed so that a compiled step updates in place.

In a compiled step `mx.compile` fuses MLX's Adam update of a parameter into one kernel with
three outputs (the new parameter, m and v), and MLX never hands the buffer of an input of a
many-output kernel to an output (each output holds its own reference to the inputs, so none is
the only one: `array::is_donatable`). Every trained parameter, m and v was therefore
allocated anew while the old ones were held: the step's peak grew by 3x the trained float32
bytes (Llama-3.2-1B's last 2 blocks fully trained: 1.46 GB of 5.6 GB). Here the new m and v
reach the parameter's update through a reshape, which `mx.compile` does not fuse: three
one-output kernels, each writing into its old array's buffer. The same operations in the same
order as MLX's: the same values, bit for bit.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.optimizers as optim


def unfused(x: mx.array) -> mx.array:
    """x as a view that `mx.compile` does not fuse into the kernel that reads it (a reshape
    there and back: no copy for a row-contiguous x)."""
    return x.reshape(-1).reshape(x.shape)


class Adam(optim.Adam):
    """MLX's Adam (the same state, the same values), each of its three outputs a kernel of its
    own (the module's docstring)."""

    def apply_single(self, gradient: mx.array, parameter: mx.array, state: dict) -> mx.array:
        lr = self.learning_rate.astype(gradient.dtype)
        b1, b2 = self.betas
        m = b1 * state["m"] + (1 - b1) * gradient
        v = b2 * state["v"] + (1 - b2) * mx.square(gradient)
        state["m"], state["v"] = m, v
        m, v = unfused(m), unfused(v)
        if self.bias_correction:
            c1 = (lr / (1 - b1**self.step)).astype(gradient.dtype)
            c2 = mx.rsqrt(1 - b2**self.step).astype(gradient.dtype)
            return parameter - c1 * m / (mx.sqrt(v) * c2 + self.eps)
        return parameter - lr * m / (mx.sqrt(v) + self.eps)


class AdamW(optim.AdamW, Adam):
    """MLX's AdamW (decoupled weight decay) on `Adam`'s update: MLX's AdamW.apply_single decays
    the parameter and hands it to the next class in line, here toymlx's Adam."""
