"""A task's held-out metrics (validation, the test split, `toymlx-eval`): the forward pass only,
compiled once per run and spread over the training step's CPU streams (`Evaluator`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np

from toymlx.backend import device
from toymlx.backend.files import counted
from toymlx.backend.progress import pass_bar
from toymlx.backend.stop import CutShort
from toymlx.training import cpu_streams
from toymlx.training.step import micro_batch
from toymlx.training.task import Task


class Evaluator:
    """A task's metrics over its held-out batches (validation, or the test split), as one
    pass of the forward: count-weighted sums of `metrics_fn` (default: the loss), in eval mode
    (dropout off; the model's mode restored afterwards), computed with the model's own `Ops`
    (the training step's kernels). Built once per run and reused: with `compile`, the metrics
    function is `mx.compile`d once, and traced once per batch shape (held-out batches of
    chat rows are cut to their longest row rounded up to a multiple of 32,
    `toymlx.data.chat.sft_val_batches`, so there are few); with `n_streams` > 1 (a multi-core
    CPU, as the training step has it) each micro-batch's rows are split over that many MLX
    CPU streams, one compiled function each, evaluated together under `blas_threads` BLAS
    threads per call (`toymlx.cpu_streams`). Metrics are sums over rows, so a split changes
    nothing but the order of the additions. With `progress` (a name, toymlx-eval's), a pass
    draws a progress bar on stderr where that is a terminal (a pass of a whole data folder
    takes minutes on a CPU), counting the rows it scored (`unit`s: windows, chat rows) of the
    pass's total (`scored_rows`); a run's own passes sit under its step bar."""

    def __init__(self, task: Task, compile: bool = True, n_streams: int = 1,
                 blas_threads: int | None = None, progress: str | None = None,
                 unit: str = "row"):
        self.task, self.blas_threads, self.progress = task, blas_threads, progress
        self.unit = unit
        fn, model = task.metrics_fn or _loss_metrics(task.loss_fn), task.model
        on_cpu = mx.default_device() == mx.cpu
        self.subnormals = cpu_streams.subnormals_of(model)
        self.streams = (cpu_streams.new_streams(n_streams, self.subnormals) if on_cpu
                        else [mx.default_stream(mx.default_device())])

        def metrics(batch: dict[str, mx.array]) -> dict[str, mx.array]:
            return fn(model, batch)

        # one compiled function per stream: mx.compile caches its traces per function, and
        # each stream's trace must keep its own stream (see toymlx.cpu_streams)
        self.fns = [mx.compile(lambda batch: metrics(batch), inputs=[model.state])
                    if compile else metrics for _ in self.streams]

    def _sums(self, micro: dict[str, np.ndarray]) -> list[dict[str, mx.array]]:
        """The metrics' sums of one micro-batch (B, ...), its rows split over the streams as
        evenly as they go (a stream that gets no row is left out), unevaluated."""
        n, size = len(self.streams), next(iter(micro.values())).shape[0]
        cuts = [size * j // n for j in range(n + 1)]
        out = []
        for a, b, st, fn in zip(cuts, cuts[1:], self.streams, self.fns):
            if b > a:
                with mx.stream(st):
                    out.append(fn({k: mx.array(v[a:b]) for k, v in micro.items()}))
        return out

    def __call__(self, max_batches: int | None = None, split: str = "val",
                 stop: Callable[[], int] | None = None,
                 waiting: Callable[[], Any] | None = None) -> dict[str, Any] | None:
        """Metrics over the validation batches (`split="test"`: the test batches), the first
        `max_batches`; the loss is `<split>_loss`, and a test split's other metrics are
        `test_<name>` (test_accuracy) so that they never read as the validation figures.
        `stop` (requests to stop so far) is read before each micro-batch: None once it is
        non-zero, the pass abandoned (a long --test pass must not hold off a Ctrl-C).
        `waiting`: the context each micro-batch is evaluated in, one call that cannot be cut
        (`toymlx.backend.stop.StopSignals.waiting`); a micro-batch a stop cut short (MLX's
        kernel build stopped by the same Ctrl-C) abandons the pass too. A metric named
        `ROW_PREFIX`... (`lm_held_out_rows`) is each row's own: returned as
        `<split>_<name>` (val_row_loss), (rows,) float64 in the order the batches hold them,
        not summed."""
        totals: dict[str, float] = {}
        rows: dict[str, list[np.ndarray]] = {}
        model = self.task.model
        was_training = model.training
        model.eval()
        batches = self.task.test_batches if split == "test" else self.task.val_batches
        batches = batches[:max_batches]
        try:
            with self._bar(batches) as bar:
                for b in batches:
                    for i in range(next(iter(b.values())).shape[0]):  # the micro-batch axis
                        if stop is not None and stop():
                            return None
                        micro = micro_batch(b, i)
                        parts = self._sums(micro)
                        try:
                            with (device.evaluating(self.blas_threads, self.subnormals),
                                  (waiting or contextlib.nullcontext)()):
                                mx.eval(parts)
                        except CutShort:
                            return None
                        for sums in parts:
                            for k, v in sums.items():
                                if k.startswith(ROW_PREFIX):  # (B,): each row's own, in order
                                    rows.setdefault(k, []).append(np.array(v, np.float64))
                                else:
                                    totals[k] = totals.get(k, 0.0) + float(v.item())
                        if bar is not None:
                            bar.update(scored_rows(micro))
        finally:
            model.train(was_training)
        n = totals.pop("n", 0.0) or 1.0
        return {**{(f"{split}_{k}" if k == "loss" or split == "test" else k): v / n
                   for k, v in totals.items()},
                **{f"{split}_{k}": np.concatenate(v) for k, v in rows.items()}}

    def _bar(self, batches: list[dict[str, Any]]) -> Any:
        """The pass's progress bar over the rows `batches` hold (None: none drawn), where they
        hold more than one (`pass_bar`). A pass of one call (a split of no more rows than a
        held-out call takes, `held_out_call_rows`) would sit at 0% until it ends, all its rows
        scored at once (counting them one by one would take calls of other sizes, other
        sums): it says so in place of the bar, "scoring 15 rows in one pass"."""
        if self.progress is None:
            return pass_bar(0, None, self.unit)
        calls = [scored_rows(micro_batch(b, i)) for b in batches
                 for i in range(next(iter(b.values())).shape[0])]
        total = sum(calls)
        if len(calls) == 1:
            return pass_bar(total, f"{self.progress}: scoring {counted(total, self.unit)} in "
                            "one pass", self.unit, bar_format="{desc}")
        return pass_bar(total, self.progress, self.unit)


ROW_PREFIX = "row_"
"""A metric of each row (B,), not a sum over them: `Evaluator` returns these rows joined."""


def scored_rows(micro: dict[str, Any]) -> int:
    """The rows of a micro-batch that hold a scored target (a 1 in `mask`, else a `labels` of 0
    or more): what a pass's bar counts, the padding rows that fill a last batch left out."""
    m = np.asarray(micro["mask"]) != 0 if "mask" in micro else np.asarray(micro["labels"]) >= 0
    return int(m.reshape(m.shape[0], -1).any(axis=1).sum())


def command_evaluator(task: Task, progress: str | None = None, unit: str = "row") -> Evaluator:
    """The `Evaluator` of a command outside a run (toymlx-eval): compiled, over the CPU streams
    and BLAS threads a run on this machine would step with; `progress` names its bar, counting
    `unit`s."""
    n = cpu_streams.stream_count(0)
    return Evaluator(task, True, n, cpu_streams.step_blas_threads(n), progress, unit)


def evaluate(task: Task, max_batches: int | None = None, split: str = "val"
             ) -> dict[str, float]:
    """One `Evaluator` pass, eager, on one stream (for a single pass outside a run: a test's
    reference figure); see `Evaluator.__call__`."""
    return Evaluator(task, compile=False)(max_batches, split)


def _loss_metrics(loss_fn):
    def fn(model, batch):
        loss, n = loss_fn(model, batch)
        n = n.astype(mx.float32)
        return {"loss": loss * n, "n": n}
    return fn
