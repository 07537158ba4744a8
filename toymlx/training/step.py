"""The compiled training step: value_and_grad, gradient accumulation, all-reduce, clip, update.

`make_step` builds it once per run; the trainer calls it once per optimizer step with a batch
whose leading axis holds the micro-batches, `(accum, B, ...)`. The step is one `mx.compile`d
function whose declared state is the model, the optimizer, MLX's random state (dropout) and,
for float16, the loss scale. On a multi-core CPU `toymlx.cpu_streams` builds the same step from
the same two halves (`micro_batch_grads`, `make_update`), spread over MLX CPU streams.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
from mlx import nn
from mlx.utils import tree_flatten, tree_map

from toymlx.backend.device import on_gpu

Part = tuple[mx.array, mx.array, Any]
"""One micro-batch's (loss * n, n, gradients * n): the summands of a count-weighted mean."""


class LossScale:
    """Dynamic loss scaling for float16 training (as PyTorch's GradScaler).

    float16 gradients below 6e-8 flush to zero, and a language model's mean loss over a few
    thousand tokens has per-logit gradients of 1e-5..1e-9; so the loss is multiplied by `scale`
    before the backward pass and the gradients divided by it after. A step whose gradients
    overflow is skipped (weights and optimizer untouched) and the scale halved; after
    `growth_interval` good steps in a row the scale doubles. The state is two arrays, part of
    the compiled step's state and of every checkpoint's resume state."""

    def __init__(self, init: float = 2.0**15, growth_interval: int = 500):
        self.growth_interval = int(growth_interval)
        self.state: dict[str, mx.array] = {"scale": mx.array(init, mx.float32),
                                           "good_steps": mx.array(0, mx.int32)}

    def advance(self, ok: mx.array) -> None:
        """The state after a step whose gradients were finite (`ok`) or not."""
        good = mx.where(ok, self.state["good_steps"] + 1, 0)
        grow = good >= self.growth_interval
        scale = self.state["scale"]
        self.state["scale"] = mx.where(ok, mx.where(grow, scale * 2.0, scale), scale * 0.5)
        self.state["good_steps"] = mx.where(grow, 0, good)


def micro_batch_grads(model: nn.Module, loss_fn: Callable, scale: LossScale | None = None
                      ) -> Callable[[dict[str, mx.array]], Part]:
    """micro-batch -> (loss * n, n, gradients * n); with a loss scale, all three scaled by it.

    The gradients are those of loss * n: the backward pass starts from n instead of 1, where
    multiplying each gradient by n afterwards was a kernel a parameter (two on a 2-stream CPU
    step). With a float16 loss scale it starts from the scale alone and the gradients are
    multiplied by n afterwards: n times larger values would overflow float16's range."""
    def summed_loss(m: nn.Module, batch: dict[str, mx.array]) -> tuple[mx.array, mx.array]:
        loss, n = loss_fn(m, batch)
        n = n.astype(mx.float32)
        return (loss * n if scale is None else loss * scale.state["scale"]), n

    loss_and_grad = nn.value_and_grad(model, summed_loss)

    def grads_of(micro: dict[str, mx.array]) -> Part:
        params = model.trainable_parameters()
        (value, n), g = loss_and_grad(model, micro)
        model.update(params)  # value_and_grad leaves its tracers in the model
        if scale is None:
            return value, n, g
        return value * n, n, tree_map(lambda x: x * n, g)

    return grads_of


def _here(fn: Callable) -> Callable:
    return fn


def make_update(model: nn.Module, optimizer: optim.Optimizer, grad_clip: float, world: Any = None,
                scale: LossScale | None = None, place: Callable[[Callable], Callable] = _here
                ) -> Callable[..., dict[str, mx.array]]:
    """([Part, ...], stop flags) -> the optimizer step: sum the parts as accumulation does,
    all-reduce over data-parallel ranks (with this rank's `stop_flags`, summed into the output's
    "stop_flags"), divide by the count (and the loss scale), clip the global norm, update.

    `place(fn)` runs a per-parameter `fn` where the caller wants it (`toymlx.cpu_streams`: on
    the parameter's home stream); by default where it is."""
    distributed = world is not None and world.size() > 1

    def update(parts: list[Part], stop_flags: mx.array | None = None) -> dict[str, mx.array]:
        loss_sum, n_sum = parts[0][0], parts[0][1]
        for ls, n, _ in parts[1:]:
            loss_sum, n_sum = loss_sum + ls, n_sum + n
        grads = tree_map(place(lambda *gs: sum(gs[1:], gs[0])), *[g for _, _, g in parts])
        if distributed:
            grads, loss_sum, n_sum, stop_flags = _all_sum(grads, loss_sum, n_sum, stop_flags,
                                                          world)
        denom = n_sum if scale is None else n_sum * scale.state["scale"]
        # the norm of the mean gradient from the sums' squares, and the mean and the clip as one
        # factor that AdamW's fused kernel applies: a parameter's gradient is read by one
        # product (its squares' sum) and one update, where dividing, squaring, summing and
        # clipping were 4 more kernels each (ViT-Tiny: 800 of a GPU step's ~2,200)
        sq = [place(sum_of_squares)(g) for _, g in tree_flatten(grads)]
        norm = mx.sqrt(sum_parts(sq)).reshape(()) / denom
        clip = mx.minimum(grad_clip / (norm + 1e-6), 1.0) if grad_clip > 0 else 1.0
        mean_clipped = clip / denom  # one scalar, not one a parameter
        grads = tree_map(place(lambda g: g * mean_clipped), grads)
        out = {"loss": loss_sum / denom, "grad_norm": norm}
        if stop_flags is not None:
            out["stop_flags"] = stop_flags
        if scale is None:
            optimizer.update(model, grads)
            return out
        # float16: an overflowing step changes nothing but the scale
        ok = mx.isfinite(norm)
        params, opt_state = model.trainable_parameters(), tree_map(lambda x: x, optimizer.state)
        optimizer.update(model, grads)
        model.update(tree_map(lambda new, old: mx.where(ok, new, old),
                              model.trainable_parameters(), params))
        _keep_where(ok, optimizer.state, opt_state)
        out.update(skipped=mx.logical_not(ok), loss_scale=scale.state["scale"])
        scale.advance(ok)
        return out

    return update


def sum_of_squares(g: mx.array, cpu: bool | None = None) -> mx.array:
    """g's sum of squares in float32, shape (1, 1), in the CPU's form or a GPU's (`cpu`;
    default: the form of MLX's default device).

    On the CPU one product of g with itself: BLAS's dot, one pass over g. On a GPU MLX's
    reduction over all of g, which spreads it over the whole chip: MLX's GPU matmul gives each
    output row of a (1, n) x (n, 1) product one warp on CUDA and one threadgroup on Metal, so
    one warp read every gradient. A from-scratch 360M step at 8 x 1024 took 158 ms on an H200
    with the product against 90 ms before it (docs/RESULTS.md, session 53)."""
    g = g.astype(mx.float32)
    if not on_gpu() if cpu is None else cpu:
        return g.reshape(1, -1) @ g.reshape(-1, 1)
    return mx.sum(mx.square(g)).reshape(1, 1)


def sum_parts(parts: list[mx.array]) -> mx.array:
    """The sum of the (1, 1) arrays `parts`, as (1, 1).

    On the CPU one concatenation and one scan, its last value taken as a slice (`[-1]` is a
    gather in MLX): library code, where a chain of adds became fused kernels named after how
    many adds each held, compiled anew (g++) for each parameter count. On a GPU a tree of
    adds, which `mx.compile` fuses into kernels of up to 23 parts, where MLX's GPU
    concatenation launches a copy kernel for each part."""
    if not on_gpu():
        return mx.cumsum(mx.concatenate(parts), axis=0)[-1:]
    while len(parts) > 1:
        pairs = zip(parts[0::2], parts[1::2])
        parts = [a + b for a, b in pairs] + (parts[-1:] if len(parts) % 2 else [])
    return parts[0]


def _keep_where(ok: mx.array, state: Any, before: Any) -> None:
    """Each array of the (nested) optimizer state: the new value where `ok`, else the one in
    `before`; assigned in place, because the compiled step holds on to these containers."""
    items = state.items() if isinstance(state, dict) else enumerate(state)
    for k, v in list(items):
        if isinstance(v, mx.array):
            state[k] = mx.where(ok, v, before[k])
        else:
            _keep_where(ok, v, before[k])


def micro_batch(batch: dict[str, mx.array], i: int) -> dict[str, mx.array]:
    """Micro-batch `i` of a batch whose leading axis holds the micro-batches, as views: a slice
    with that axis dropped. MLX indexes `v[i]` with a gather, a copy of the micro-batch: ViT-Tiny
    224's 128 images took 4 ms of GPU time, twice in a 75 ms step on an H200 (docs/RESULTS.md,
    session 26)."""
    return {k: v[i:i + 1].squeeze(0) for k, v in batch.items()}


def make_step(model: nn.Module, loss_fn: Callable, optimizer: optim.Optimizer,
              grad_clip: float = 1.0, world: Any = None, compile: bool = True,
              scale: LossScale | None = None) -> Callable[[dict[str, mx.array]], dict]:
    """The training step: batch (accum, B, ...) -> {"loss", "grad_norm"} (plus "skipped" and
    "loss_scale" with a loss scale), updating the model and optimizer in place. Data parallel,
    it takes this rank's `stop_flags` too and returns them summed over the ranks."""
    grads_of = micro_batch_grads(model, loss_fn, scale)
    update = make_update(model, optimizer, grad_clip, world, scale)

    def step(batch: dict[str, mx.array], stop_flags: mx.array | None = None
             ) -> dict[str, mx.array]:
        accum = next(iter(batch.values())).shape[0]
        return update([grads_of(micro_batch(batch, i)) for i in range(accum)], stop_flags)

    if not compile:
        return step
    state = step_state(model, optimizer, scale)
    return mx.compile(step, inputs=state, outputs=state)


def step_state(model: nn.Module, optimizer: optim.Optimizer, scale: LossScale | None = None
               ) -> list:
    """What the compiled step reads and updates in place: the model, the optimizer, MLX's
    random state (dropout) and, for float16, the loss scale."""
    state = [model.state, optimizer.state, mx.random.state]
    if scale is not None:
        state.append(scale.state)
    return state


def stop_flags(requests: int) -> mx.array:
    """A rank's requests to stop as the step sums them over the ranks: [requests >= 1,
    requests >= 2]. Summed, each is positive where any rank's count reaches it, so
    `agreed_requests` reads the most any rank made (a sum of the counts would make the one
    Ctrl-C each rank gets a second), on the all_sum the gradients take anyway."""
    return mx.array([requests >= 1, requests >= 2], dtype=mx.float32)


def agreed_requests(summed: mx.array) -> int:
    """The most requests to stop any rank made (up to 2), from the sum of their `stop_flags`."""
    return int(mx.sum(summed > 0).item())


def _all_sum(grads: Any, loss_sum: mx.array, n_sum: mx.array, flags: mx.array | None,
             world: Any) -> tuple[Any, mx.array, mx.array, mx.array | None]:
    """Sums over the ranks in ONE all_sum of everything concatenated (`flags`: `stop_flags`, or
    None): an all_sum per tensor pays a round trip each (2 ranks on loopback: 0.66-0.97 s steps
    against 0.095 s), and so would a collective of its own for the stop flags."""
    leaves: list[mx.array] = []
    tree_map(leaves.append, grads)
    tail = [loss_sum.reshape(1), n_sum.reshape(1)] + ([] if flags is None else [flags])
    total = mx.distributed.all_sum(mx.concatenate([x.reshape(-1) for x in leaves] + tail),
                                   group=world)
    offsets = np.cumsum([0] + [x.size for x in leaves]).tolist()
    it = iter(range(len(leaves)))

    def back(x: mx.array) -> mx.array:  # the same traversal order as above
        i = next(it)
        return total[offsets[i]:offsets[i + 1]].reshape(x.shape).astype(x.dtype)
    end = offsets[-1]
    return (tree_map(back, grads), total[end], total[end + 1],
            None if flags is None else total[end + 2:])
