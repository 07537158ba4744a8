"""Linear, RMSNorm and LayerNorm that compute through the `Ops` they are built with.

Each keeps `mlx.nn`'s parameters, names and initialisation (checkpoints, LoRA wrapping and
`nn.quantize` see an `nn.Linear`), and hands its math to `ops` (`toymlx.models.ops`), so a
model built with `Ops(kernels="vectorised")` trains through toymlx.fastmath's forms and one
built with `Ops()` runs MLX's own kernels, with nothing else deciding which.
"""

from __future__ import annotations

import mlx.core as mx
from mlx import nn

from toymlx.models.ops import EXACT, Ops


class Linear(nn.Linear):
    """`nn.Linear` (weight (out, in), optional bias) computing `ops.linear`."""

    def __init__(self, input_dims: int, output_dims: int, bias: bool = True, ops: Ops = EXACT):
        super().__init__(input_dims, output_dims, bias=bias)
        self.ops = ops

    def __call__(self, x: mx.array) -> mx.array:
        return self.ops.linear(x, self.weight, self.get("bias"))


class QuantizedLinear(nn.QuantizedLinear):
    """`nn.QuantizedLinear` (a frozen, quantized base projection) whose output is in the
    compute dtype: its scales stay float32, so the file's blocks are held exactly."""

    def __init__(self, input_dims: int, output_dims: int, bias: bool, group_size: int,
                 bits: int, ops: Ops = EXACT):
        super().__init__(input_dims, output_dims, bias=bias, group_size=group_size, bits=bits)
        self.ops = ops

    def __call__(self, x: mx.array) -> mx.array:
        return self.ops.cast(super().__call__(x))


class RMSNorm(nn.RMSNorm):
    """`nn.RMSNorm` computing `ops.rms_norm`."""

    def __init__(self, dims: int, eps: float = 1e-5, ops: Ops = EXACT):
        super().__init__(dims, eps=eps)
        self.ops = ops

    def __call__(self, x: mx.array) -> mx.array:
        return self.ops.rms_norm(x, self.weight, self.eps)


class LayerNorm(nn.LayerNorm):
    """`nn.LayerNorm` (affine) computing `ops.layer_norm`."""

    def __init__(self, dims: int, eps: float = 1e-5, ops: Ops = EXACT):
        super().__init__(dims, eps=eps)
        self.ops = ops

    def __call__(self, x: mx.array) -> mx.array:
        return self.ops.layer_norm(x, self.get("weight"), self.get("bias"), self.eps)


class DropPath(nn.Module):
    """Stochastic depth on a residual branch: in training each example keeps the branch with
    probability 1 - p, scaled by 1 / (1 - p); evaluation and p = 0 pass it through."""

    def __init__(self, p: float = 0.0):
        super().__init__()
        self.p = float(p)

    def __call__(self, y: mx.array) -> mx.array:
        if not (self.training and self.p > 0):
            return y
        keep = mx.random.bernoulli(1.0 - self.p, (y.shape[0],) + (1,) * (y.ndim - 1))
        return y * keep.astype(y.dtype) / (1.0 - self.p)  # (B, 1, ..., 1) per example


def check_checkpointable(model: nn.Module) -> None:
    """ValueError when `--grad-checkpoint` would give wrong gradients: a recomputed block draws
    new random masks (MLX's random state moves on), so dropout and stochastic depth must be off."""
    for path, m in model.named_modules():
        if isinstance(m, nn.Dropout) and getattr(m, "_p_1", 1.0) < 1.0:
            what = f"dropout {1.0 - m._p_1:g}"
        elif isinstance(m, DropPath) and m.p > 0:
            what = f"stochastic depth {m.p:g}"
        else:
            continue
        raise ValueError(f"--grad-checkpoint: expected no dropout or stochastic depth in the "
                         f"model (a recomputed block draws new random masks), found {what} at "
                         f"{path or 'the model'}; set it to 0 or drop --grad-checkpoint")


def submodule(model: nn.Module, path: str) -> nn.Module:
    """The module at a dotted path such as `layers.3.attn.q_proj`."""
    obj: nn.Module = model
    for part in path.split("."):
        obj = obj[int(part)] if isinstance(obj, list) else getattr(obj, part)
    return obj


def replace_submodule(model: nn.Module, path: str, module: nn.Module) -> None:
    """Put `module` at a dotted path such as `layers.3.attn.q_proj`."""
    parent, _, leaf = path.rpartition(".")
    setattr(submodule(model, parent) if parent else model, leaf, module)
