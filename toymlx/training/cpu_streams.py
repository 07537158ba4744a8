"""The training step spread over MLX CPU streams, so that every core does elementwise work.

MLX runs a stream's elementwise ops on one thread; only its BLAS calls use more. On a
multi-core CPU the step therefore cuts each micro-batch into n equal slices along the batch
axis and runs the slices' forward and backward concurrently, one compiled `value_and_grad`
per stream (separate compiled functions, because `mx.compile` merges equal subexpressions
across streams and a stream that reads the other's constants gets unvectorised kernels). A
compiled update sums the slices exactly as gradient accumulation does and runs each
parameter's gradient sum, clip and AdamW update on a "home" stream chosen by its shape. The
BLAS threads are shared out between the streams while the step is evaluated
(`step_blas_threads`). A micro-batch that does not split evenly runs on one stream.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.optimizers as optim
from mlx import nn
from mlx.utils import tree_flatten

from toymlx.backend import device, fpenv
from toymlx.training.step import make_step, make_update, micro_batch_grads, step_state


def stream_count(requested: int, world: Any = None, scaled: bool = False) -> int:
    """How many CPU streams the step uses: `requested` (--cpu-streams), or for 0 (auto) 2 where
    MLX computes on a CPU with 2+ cores and toymlx controls the BLAS threads; always 1 on a
    GPU, across data-parallel ranks, and with a float16 loss scale."""
    if requested < 0:
        raise ValueError(f"--cpu-streams: expected >= 0 (0: auto), found {requested}")
    if mx.default_device() != mx.cpu or (world is not None and world.size() > 1) or scaled:
        return 1
    if requested:
        return requested
    return 2 if (os.cpu_count() or 1) >= 2 and device.blas_threads() is not None else 1


def step_blas_threads(n_streams: int) -> int | None:
    """BLAS threads per call while a step with `n_streams` streams is evaluated (None: leave
    them as they are): the cores shared out, so the streams' matmuls do not oversubscribe."""
    total = device.blas_threads()
    return None if n_streams == 1 or total is None else max(1, total // n_streams)


def _stream_homes(model: nn.Module, streams: list) -> dict[tuple[int, ...], Any]:
    """A stream for each trainable parameter shape, balancing the parameter counts: a shape's
    parameters share one stream, because `mx.compile` merges equal broadcasts across streams
    and a kernel fed another stream's broadcast runs unvectorised."""
    sizes: dict[tuple[int, ...], int] = {}
    for _, p in tree_flatten(model.trainable_parameters()):
        sizes[tuple(p.shape)] = sizes.get(tuple(p.shape), 0) + p.size
    load, home = [0] * len(streams), {}
    for shape, n in sorted(sizes.items(), key=lambda kv: -kv[1]):
        i = load.index(min(load))
        home[shape], load[i] = streams[i], load[i] + n
    return home


def _update_on_homes(optimizer: optim.Optimizer, place: Callable[[Callable], Callable]) -> None:
    """Make the optimizer run each parameter's update where `place` says: its `apply_single`
    (and a MultiOptimizer's parts') wrapped once, on this optimizer object only."""
    for o in getattr(optimizer, "optimizers", [optimizer]):
        if getattr(o, "_toymlx_placed", False):
            continue
        inner = o.apply_single
        o.apply_single = lambda g, p, st, inner=inner: place(lambda p_: inner(g, p_, st))(p)
        o._toymlx_placed = True


def subnormals_of(model: nn.Module) -> fpenv.Subnormals:
    """The model's `Ops.subnormals` (keep for a plain `mlx.nn` module, which has no `Ops`)."""
    ops = getattr(model, "ops", None)
    return "keep" if ops is None else ops.subnormals


def new_streams(n: int, subnormals: fpenv.Subnormals) -> list:
    """`n` new MLX CPU streams whose threads compute with subnormal floats as `subnormals` says
    (`toymlx.backend.fpenv`). MLX runs a CPU stream's ops on a thread of its own, made by the
    thread that first evaluates something on the stream, and a thread starts with the
    floating-point mode of the thread that made it: so each stream's first evaluation happens
    here, in that mode."""
    with fpenv.subnormals(subnormals):
        streams = [mx.new_stream(mx.cpu) for _ in range(n)]
        mx.eval([mx.add(mx.zeros((1,), stream=s), 1.0, stream=s) for s in streams])
    return streams


def make_stream_step(model: nn.Module, loss_fn: Callable, optimizer: optim.Optimizer,
                     streams: list, grad_clip: float = 1.0, compile: bool = True
                     ) -> Callable[[dict[str, mx.array]], dict]:
    """`toymlx.step.make_step`'s step with each micro-batch split over the CPU `streams`
    (`new_streams`); call it with the first of them as MLX's stream (`mx.stream`)."""
    n_streams = len(streams)
    home = _stream_homes(model, streams)

    def place(fn: Callable) -> Callable:
        """fn, run on the home stream of its first argument's shape (if it has one)."""
        def run(x: mx.array, *rest: Any) -> mx.array:
            if tuple(x.shape) not in home:
                return fn(x, *rest)
            with mx.stream(home[tuple(x.shape)]):
                return fn(x, *rest)
        return run

    _update_on_homes(optimizer, place)
    grads_of = micro_batch_grads(model, loss_fn)
    update = make_update(model, optimizer, grad_clip, place=place)
    whole = make_step(model, loss_fn, optimizer, grad_clip, compile=compile)
    rng = [mx.random.state]  # dropout draws: a pure function of the step's seed
    # one compiled function per stream (distinct callables: mx.compile caches traces per
    # function, and each stream's trace must keep its own stream)
    per_stream = [mx.compile(lambda m: grads_of(m), inputs=[model.state, rng], outputs=rng)
                  if compile else grads_of for _ in streams]
    state = step_state(model, optimizer)
    update = mx.compile(update, inputs=state, outputs=state) if compile else update

    def split_step(batch: dict[str, mx.array]) -> dict[str, mx.array]:
        accum, size = next(iter(batch.values())).shape[:2]
        if size % n_streams:
            return whole(batch)
        k, parts = size // n_streams, []
        for i in range(accum):
            for j, (st, fn) in enumerate(zip(streams, per_stream)):
                with mx.stream(st):
                    parts.append(fn({key: v[i, j * k:(j + 1) * k] for key, v in batch.items()}))
        return update(parts)

    return split_step
