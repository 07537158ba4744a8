"""The training loop every recipe shares, around one compiled step.

A recipe builds a `Task` (model, loss, batches, how to save and load a checkpoint); `train`
runs it: each optimizer step taken by a `Stepper` (the step from `training_step`,
`toymlx.step.make_step`: gradient accumulation, data-parallel sums, clipping, AdamW with
warm-up + cosine LR; on a multi-core CPU spread over streams by `toymlx.cpu_streams`; the
benchmark steps its toymlx rows through the same `Stepper`), periodic validation in eval mode,
checkpoints on a schedule and at the end through a `Checkpointer` (verified, with retention),
the run bundle's events (run_end from one place), and SIGINT/SIGTERM as requests to stop
(`StopSignals`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import signal
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
from mlx import nn
from mlx.utils import tree_flatten, tree_unflatten
from tqdm import tqdm

from toymlx.backend import device, lifeline
from toymlx.backend.device import backend_info
from toymlx.bundle import checkpoint as ck
from toymlx.bundle.events import EventLog, git_info, host_info, now_iso
from toymlx.bundle.options import RunOptions, flag_name
from toymlx.bundle.resume import Resume, intact_hint
from toymlx.gguf.reader import DIGEST_KEY
from toymlx.training import cpu_streams
from toymlx.training.schedule import lr_at
from toymlx.training.step import LossScale, make_step


@dataclass
class TrainingOptions:
    """What the shared training loop trains (every recipe has them): a resume keeps them,
    but for --steps, which may extend the run."""

    steps: int = 200
    """Optimizer steps to train for (the schedule's length)."""
    batch_size: int = 16
    """Sequences or images per micro-batch (global, over all data-parallel ranks)."""
    grad_accum: int = 1
    """Micro-batches whose gradients are summed into one optimizer step."""
    lr: float = 3e-3
    """Peak learning rate, reached after warm-up."""
    warmup: int = 20
    """Steps of linear warm-up from lr/warmup to lr."""
    min_lr_ratio: float = 0.1
    """Floor of the cosine decay, as a fraction of lr."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay, applied to matrices only (not norms or biases)."""
    beta1: float = 0.9
    """AdamW first-moment decay."""
    beta2: float = 0.95
    """AdamW second-moment decay."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0 turns clipping off)."""
    eval_batches: int = 8
    """Most validation batches per pass."""
    seed: int = 0
    """Seed for initialisation, data order and dropout."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Activations' dtype: auto is bfloat16 on a GPU and float32 on the CPU (MLX's half
    precision CPU kernels are ~25x slower). Trainable weights and AdamW's moments stay
    float32; float16 trains with a dynamic loss scale."""
    save_dtype: Literal["f32", "f16", "bf16"] = "f32"
    """Tensor type of the matrices in checkpoint GGUFs (norms stay F32); with f16/bf16 the
    resume state also keeps the float32 weights, so resume stays exact."""
    kernels: Literal["auto", "mlx", "vectorised"] = "auto"
    """Whose elementwise kernels the model trains with: auto is toymlx's vectorised CPU forms
    (toymlx.fastmath) for float32 on the CPU, MLX's own elsewhere."""


@dataclass
class TrainConfig(RunOptions, TrainingOptions):
    """Options of the shared training loop (every recipe has them): what is trained
    (`TrainingOptions`, listed first), and where the run lives and how this process drives it
    (`runs.RunOptions`, whose fields are the run-local options)."""


MAX_INT = 2**31 - 1
"""The largest integer option (steps, sizes, seeds): MLX and numpy index with 32 and 64 bits,
and anything larger is a typo that would fail deep inside them."""


def _numbers(cfg: Any, prefix: str = "") -> list[tuple[str, int | float]]:
    """(dotted key, value) of every number option of a (nested) config."""
    out = []
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if dataclasses.is_dataclass(v):
            out += _numbers(v, f"{prefix}{f.name}.")
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out.append((prefix + f.name, v))
    return out


def check_config(module: ModuleType, cfg: TrainConfig, new_run: bool = False) -> None:
    """Every option checked up front, the shared ones here and the rest by the recipe's
    `validate`: ValueError naming the flag (for command-line input and config.json alike).
    `new_run`: also the recipe's `check_applies`, which refuses an option set where it does not
    apply (a saved run is opened as it was written)."""
    for key, v in _numbers(cfg):
        if isinstance(v, float) and not math.isfinite(v):
            raise ValueError(f"{flag_name(key)}: expected a finite number, found {v}")
        if isinstance(v, int) and abs(v) > MAX_INT:
            raise ValueError(f"{flag_name(key)}: expected at most {MAX_INT} in size, found {v}")
    checks = [
        ("--steps", cfg.steps >= 1, ">= 1", cfg.steps),
        ("--batch-size", cfg.batch_size >= 1, ">= 1", cfg.batch_size),
        ("--grad-accum", cfg.grad_accum >= 1, ">= 1", cfg.grad_accum),
        ("--lr", cfg.lr > 0, "> 0", cfg.lr),
        ("--warmup", cfg.warmup >= 0, ">= 0", cfg.warmup),
        ("--min-lr-ratio", 0 <= cfg.min_lr_ratio <= 1, "in [0, 1]", cfg.min_lr_ratio),
        ("--weight-decay", cfg.weight_decay >= 0, ">= 0", cfg.weight_decay),
        ("--beta1", 0 <= cfg.beta1 < 1, "in [0, 1)", cfg.beta1),
        ("--beta2", 0 <= cfg.beta2 < 1, "in [0, 1)", cfg.beta2),
        ("--grad-clip", cfg.grad_clip >= 0, ">= 0", cfg.grad_clip),
        ("--eval-every", cfg.eval_every >= 0, ">= 0", cfg.eval_every),
        ("--report-every", cfg.report_every >= 0, ">= 0 (0: no report lines)", cfg.report_every),
        ("--eval-batches", cfg.eval_batches >= 1, ">= 1", cfg.eval_batches),
        ("--checkpoint-every", cfg.checkpoint_every >= 0, ">= 0", cfg.checkpoint_every),
        ("--keep-last", cfg.keep_last >= 0, ">= 0 (0: keep every checkpoint)", cfg.keep_last),
        ("--keep-best", cfg.keep_best >= 0, ">= 0", cfg.keep_best),
        ("--seed", cfg.seed >= 0, ">= 0", cfg.seed),
        ("--cpu-streams", 0 <= cfg.cpu_streams <= 64, "0..64 (0: auto)", cfg.cpu_streams),
    ]
    for flag, ok, want, found in checks:
        if not ok:
            raise ValueError(f"{flag}: expected {want}, found {found}")
    if cfg.stop_at is not None and cfg.stop_at < 1:
        raise ValueError(f"--stop-at: expected >= 1, found {cfg.stop_at}")
    if cfg.from_step is not None and not cfg.resume:
        raise ValueError("--from: expected with --resume RUN (it picks that run's checkpoint), "
                         "found no --resume")
    if cfg.resume and cfg.overwrite:
        raise ValueError("--overwrite: replaces a bundle with a new run, so it cannot go with "
                         "--resume; give one of them")
    if hasattr(module, "validate"):
        module.validate(cfg)
    if new_run and hasattr(module, "check_applies"):
        module.check_applies(cfg)


@dataclass
class Task:
    """What a recipe hands the loop."""

    recipe: str
    model: nn.Module
    loss_fn: Callable[[nn.Module, dict], tuple[mx.array, mx.array]]
    """(model, micro-batch) -> (mean loss, count); pure, compiled."""
    train_batch: Callable[[int], dict[str, np.ndarray]]
    """step index (0-based) -> global batch with a leading (accum,) axis; pure in the step."""
    val_batches: list[dict[str, np.ndarray]]
    save: Callable[[Path, nn.Module, dict[str, Any]], None]
    """Write the checkpoint file for this model (extra metadata given)."""
    load: Callable[[Path, nn.Module], None]
    """Load a checkpoint written by `save` back into the model (for resume)."""
    model_info: dict[str, Any]
    config_info: dict[str, Any] = field(default_factory=dict)
    metrics_fn: Callable[[nn.Module, dict], dict[str, mx.array]] | None = None
    """(model, batch) -> sums incl. "n" (default: loss-weighted sums); eval only."""
    unit: str = "tokens"
    """What the loss counts, for throughput ("tokens" or "images")."""
    count: Callable[[dict[str, np.ndarray]], int] | None = None
    prefix: str = "step_"
    """Checkpoint file prefix under weights/."""
    checkpoint_meta: Callable[[], dict[str, Any]] | None = None
    optimizer: Callable[[TrainConfig], optim.Optimizer] | None = None
    """Build the optimizer (default: `make_optimizer`); lets a recipe give a parameter group
    its own schedule, as a pure function of the optimizer step."""
    test_batches: list[dict[str, np.ndarray]] = field(default_factory=list)
    """Held-out test batches scored once when the run completes (an `eval` event with split
    "test"); empty: no test (a recipe fills it for `--test`)."""
    finish: Callable[[Path], dict[str, Any]] | None = None
    """After a completed run's final checkpoint (rank 0): write what the recipe makes of it in
    the run folder (the lora recipe's --fuse-at-end model); returns the `export` event's
    fields (its `path` relative to the run folder)."""
    memory: dict[str, Any] | None = None
    """The step's estimated peak against the memory available (`toymlx.memory.check_fits`),
    for run_start; None where the recipe makes no estimate."""


def make_optimizer(cfg: TrainConfig) -> optim.Optimizer:
    sched = partial(lr_at, base_lr=cfg.lr, warmup=cfg.warmup, total=cfg.steps,
                    min_ratio=cfg.min_lr_ratio)
    kw = {"learning_rate": sched, "betas": [cfg.beta1, cfg.beta2], "eps": 1e-8}
    decay = optim.AdamW(weight_decay=cfg.weight_decay, **kw)
    no_decay = optim.AdamW(weight_decay=0.0, **kw)
    return optim.MultiOptimizer([decay, no_decay], [lambda path, w: w.ndim >= 2])


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
    nothing but the order of the additions."""

    def __init__(self, task: Task, compile: bool = True, n_streams: int = 1,
                 blas_threads: int | None = None):
        self.task, self.blas_threads = task, blas_threads
        fn, model = task.metrics_fn or _loss_metrics(task.loss_fn), task.model
        self.streams = [mx.default_stream(mx.default_device())] + [
            mx.new_stream(mx.cpu) for _ in range(n_streams - 1)]

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

    def __call__(self, max_batches: int | None = None, split: str = "val") -> dict[str, float]:
        """Metrics over the validation batches (`split="test"`: the test batches), the first
        `max_batches`; the loss is `<split>_loss`, and a test split's other metrics are
        `test_<name>` (test_accuracy) so that they never read as the validation figures."""
        totals: dict[str, float] = {}
        model = self.task.model
        was_training = model.training
        model.eval()
        batches = self.task.test_batches if split == "test" else self.task.val_batches
        try:
            for b in batches[:max_batches]:
                for i in range(next(iter(b.values())).shape[0]):  # the micro-batch axis
                    parts = self._sums({k: v[i] for k, v in b.items()})
                    with device.use_blas_threads(self.blas_threads):
                        mx.eval(parts)
                    for sums in parts:
                        for k, v in sums.items():
                            totals[k] = totals.get(k, 0.0) + float(v.item())
        finally:
            model.train(was_training)
        n = totals.pop("n", 0.0) or 1.0
        return {(f"{split}_{k}" if k == "loss" or split == "test" else k): v / n
                for k, v in totals.items()}


def command_evaluator(task: Task) -> Evaluator:
    """The `Evaluator` of a command outside a run (toymlx-eval): compiled, over the CPU streams
    and BLAS threads a run on this machine would step with."""
    n = cpu_streams.stream_count(0)
    return Evaluator(task, True, n, cpu_streams.step_blas_threads(n))


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


def _shard(batch: dict[str, np.ndarray], world: Any) -> dict[str, np.ndarray]:
    """This rank's slice of a global batch (axis 1 is the batch axis under accum)."""
    if world is None or world.size() == 1:
        return batch
    r, n = world.rank(), world.size()
    out = {}
    for k, v in batch.items():
        if v.shape[1] % n:
            raise ValueError(f"--batch-size: expected a multiple of the {n} data-parallel "
                             f"ranks, found {v.shape[1]}")
        per = v.shape[1] // n
        out[k] = v[:, r * per:(r + 1) * per]
    return out


def step_seed(seed: int, step: int) -> int:
    """The random seed of optimizer step `step` (0-based) of a run seeded `seed`."""
    return int(np.random.SeedSequence([seed, step]).generate_state(1, np.uint64)[0] >> 1)


def _named(step: int | None) -> str:
    return "none" if step is None else f"step {step}"


def _finite(model: nn.Module) -> bool:
    """Whether every trainable parameter is finite (one reduction, checked before writing)."""
    flags = [mx.all(mx.isfinite(v)) for _, v in tree_flatten(model.trainable_parameters())]
    return bool(mx.all(mx.stack(flags)).item()) if flags else True


def training_step(model: nn.Module, loss_fn: Callable, optimizer: optim.Optimizer,
                  cfg: TrainConfig, world: Any = None, scale: LossScale | None = None
                  ) -> tuple[Callable, int]:
    """(step, CPU streams) of this run: `toymlx.step.make_step`, or on a multi-core CPU the same
    spread over streams (`toymlx.cpu_streams`). Build it after the optimizer state is final
    (resume): the compiled step holds on to the state's containers."""
    n = cpu_streams.stream_count(cfg.cpu_streams, world, scaled=scale is not None)
    if n > 1:
        return cpu_streams.make_stream_step(model, loss_fn, optimizer, n, cfg.grad_clip,
                                            cfg.compile), n
    return make_step(model, loss_fn, optimizer, cfg.grad_clip, world, cfg.compile, scale), 1


class Stepper:
    """Optimizer steps of a task taken exactly as `train` takes them (the loop and the benchmark
    both step through it): the optimizer (the task's, else `make_optimizer`) initialised on the
    trainable parameters, the float16 loss scale, and, once `build` has run, the compiled step
    of `training_step` with the BLAS threads it evaluates under."""

    def __init__(self, task: Task, cfg: TrainConfig, world: Any = None):
        self.task, self.cfg, self.world, self.model = task, cfg, world, task.model
        self.optimizer = (task.optimizer or make_optimizer)(cfg)
        self.optimizer.init(self.model.trainable_parameters())
        # float16 gradients underflow without a loss scale (see LossScale)
        self.scale = LossScale() if self.model.ops.dtype == "float16" else None
        self.n_streams: int | None = None
        """CPU streams the built step spreads over (None: not built yet)."""
        self.blas_threads: int | None = None
        """BLAS threads per call while the step is evaluated (None: left as they are)."""
        self._fn: Callable | None = None

    def build(self) -> None:
        """Evaluate the weights and optimizer state and build the compiled step. Call it after a
        resume has restored the optimizer state: the compiled step holds on to its containers."""
        mx.eval(self.model.parameters(), self.optimizer.state)
        self._fn, self.n_streams = training_step(self.model, self.task.loss_fn, self.optimizer,
                                                 self.cfg, self.world, self.scale)
        self.blas_threads = cpu_streams.step_blas_threads(self.n_streams)

    def step(self, s: int, global_batch: dict[str, np.ndarray]) -> dict[str, mx.array]:
        """Optimizer step `s` (0-based) on `global_batch` (this rank's shard of it), evaluated
        with the model and optimizer state; returns the step's outputs (loss, grad_norm, and the
        loss scale's with float16)."""
        if self._fn is None:
            raise RuntimeError("Stepper.step: expected build() to have run, found no step")
        batch = {k: mx.array(v) for k, v in _shard(global_batch, self.world).items()}
        # Randomness (dropout) is a pure function of (seed, step), like the data, so a
        # resumed run draws exactly what an uninterrupted one would.
        mx.random.seed(step_seed(self.cfg.seed, s))
        out = self._fn(batch)
        with device.use_blas_threads(self.blas_threads):
            mx.eval(out, self.model.state, self.optimizer.state)
        return out


def resume_arrays(optimizer: optim.Optimizer, scale: LossScale | None, model: nn.Module,
                  exact_weights: bool) -> dict[str, mx.array]:
    """What a checkpoint's resume state holds besides the GGUF: the optimizer state, the loss
    scale, and (when the GGUF rounds them: --save-dtype f16/bf16) the float32 weights."""
    arrays = {"opt." + k: v for k, v in tree_flatten(optimizer.state)}
    if scale is not None:
        arrays.update({"scale." + k: v for k, v in scale.state.items()})
    if exact_weights:
        arrays.update({"param." + k: v for k, v in tree_flatten(model.trainable_parameters())})
    return arrays


def restore_resume_arrays(arrays: dict[str, mx.array], optimizer: optim.Optimizer,
                          scale: LossScale | None, model: nn.Module) -> None:
    """Put `resume_arrays`' contents back (after the GGUF itself was loaded into the model)."""
    def part(prefix: str) -> list[tuple[str, mx.array]]:
        return [(k[len(prefix):], v) for k, v in arrays.items() if k.startswith(prefix)]

    optimizer.state = tree_unflatten(part("opt."))
    if scale is not None and part("scale."):
        scale.state.update(dict(part("scale.")))
    if part("param."):
        model.update(tree_unflatten(part("param.")))


class StopSignals:
    """SIGINT, SIGTERM and SIGHUP (a closed terminal or ssh session) as requests to stop,
    counted. The handler only counts: no signal ever raises into a step or a checkpoint write,
    so none ends in a traceback or a half-done write. The loop stops after the step in flight
    and writes a final checkpoint; a second request skips that checkpoint if it has not begun
    (one being written is finished).

    The death of the parent that started this process (`toymlx.lifeline`) is one request,
    however many SIGTERMs it brings: Linux sends the parent-death signal again as each thread of
    a multi-threaded parent exits, and those repeats must not skip the final checkpoint."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self, enabled: bool):
        self.enabled, self.count = enabled, 0
        self.parent_lost = False
        self._old: dict[int, Any] = {}

    def _count(self, signum: int, frame: Any) -> None:
        if signum == signal.SIGTERM and lifeline.parent_lost():
            if self.parent_lost:
                return
            self.parent_lost = True
        self.count += 1

    def __enter__(self) -> StopSignals:  # noqa: PYI034
        if self.enabled:
            for sig in self.SIGNALS:
                self._old[sig] = signal.signal(sig, self._count)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


class Checkpointer:
    """Writes one run's checkpoints (weights, optimizer state, one id shared by both), applies
    the retention policy (--keep-last, --keep-best) and emits the `checkpoint` events."""

    def __init__(self, task: Task, optimizer: optim.Optimizer, scale: LossScale | None,
                 cfg: TrainConfig, run_dir: Path, log: EventLog, write: bool, last: int | None,
                 kept: list[dict]):
        self.task, self.optimizer, self.scale, self.cfg = task, optimizer, scale, cfg
        self.log, self.write = log, write
        self.run_dir, self.weights = run_dir, run_dir / "weights"
        self.last = last
        """The step of the newest checkpoint (None: none yet)."""
        self.scores = {e["step"]: e["val_loss"] for e in kept
                       if e["kind"] == "eval" and isinstance(e.get("val_loss"), float)}
        """step -> validation loss there (the bundle's events a resume kept), for --keep-best."""

    def score(self, step: int, metrics: dict[str, float]) -> None:
        if isinstance(metrics.get("val_loss"), float) and math.isfinite(metrics["val_loss"]):
            self.scores[step] = metrics["val_loss"]

    def save(self, step: int) -> dict | None:
        """Write the checkpoint of `step` (rank 0, which gets its `checkpoint` event back; the
        others only follow along)."""
        self.last = step
        if not self.write:
            return None
        ckpt_id = uuid.uuid4().hex
        extra = {"general.step": step, "general.run_id": self.run_dir.name, ck.ID_KEY: ckpt_id}
        if self.task.checkpoint_meta:
            extra.update(self.task.checkpoint_meta())
        model = self.task.model
        path = ck.save_checkpoint(self.weights, self.task.prefix, step,
                                  lambda p: self.task.save(p, model, extra),
                                  resume_arrays(self.optimizer, self.scale, model,
                                                exact_weights=self.cfg.save_dtype != "f32"),
                                  {"step": step, "recipe": self.task.recipe,
                                   "checkpoint_id": ckpt_id})
        removed = []
        if self.cfg.keep_last or self.cfg.keep_best:
            steps = [s for s, _ in ck.list_checkpoints(self.weights)]
            removed = ck.prune(self.weights, ck.retained(steps, step, self.cfg.keep_last,
                                                         self.cfg.keep_best, self.scores))
        return self.log.emit("checkpoint", step=step, path=str(path.relative_to(self.run_dir)),
                             **({"removed": removed} if removed else {}))


def report_line(window: list[dict], unit: str, before: int, steps: int) -> str:
    """The report line of the step events `window` (the steps since the last line; `before`:
    the `trained_<unit>` count before its first step), every figure from those events: the
    mean train loss over the window, the last step's learning rate, steps/s and <unit>/s over
    the window's step times, the <unit> trained so far and the peak memory (MLX's and the
    process's RSS) as the last step event records them."""
    last = window[-1]
    seconds = sum(e["step_time_s"] for e in window)
    trained = last[f"trained_{unit}"]

    def per_s(n: float) -> float:
        return n / seconds if seconds > 0 else math.inf

    return (f"step {last['step']}/{steps}: train loss "
            f"{sum(e['loss'] for e in window) / len(window):.4f}, lr {last['lr']:.3e}, "
            f"{per_s(len(window)):.3f} steps/s, {per_s(trained - before):.1f} {unit}/s, "
            f"{trained} {unit} trained, peak memory {last['peak_memory_mb']} MB (MLX), "
            + (f"{rss} MB (RSS)" if (rss := last.get("peak_rss_mb")) is not None
               else "RSS not reported"))


def eval_line(ev: dict) -> str:
    """The line of an `eval` event: its figures and how long the pass took."""
    figures = ", ".join(f"{k} {v:.4f}" for k, v in ev.items()
                        if isinstance(v, float) and k not in ("t", "seconds"))
    where = "test" if ev.get("split") == "test" else f"step {ev['step']}"
    return f"{where}: {figures} ({ev['seconds']:.2f} s)"


def checkpoint_line(ev: dict, run_dir: Path) -> str:
    """The line of a `checkpoint` event: the file written (and what retention removed)."""
    removed = (f"; removed {', '.join(f'step_{s}' for s in ev['removed'])}"
               if ev.get("removed") else "")
    return f"step {ev['step']}: checkpoint {run_dir / ev['path']}{removed}"


class _Loop:
    """One run of the loop: the step reached, how the run ends, and the pieces acting on them.
    `run` emits run_start (or a resume event), trains, and emits run_end from one place."""

    def __init__(self, task: Task, cfg: TrainConfig, run_dir: Path, world: Any,
                 resume: Resume | None):
        self.task, self.cfg, self.run_dir, self.world = task, cfg, run_dir, world
        self.resume = resume
        self.rank0 = world is None or world.rank() == 0
        self.model = task.model
        device.setup_process(wide_evaluation=not cfg.grad_checkpoint)
        self.stepper = Stepper(task, cfg, world)
        self.optimizer, self.scale = self.stepper.optimizer, self.stepper.scale
        self.start = 0
        if resume is not None and resume.checkpoint is not None:
            ck.load_checked(task.load, resume.checkpoint, self.model)
            restore_resume_arrays(resume.state, self.optimizer, self.scale, self.model)
            self.start = resume.step
        # after the resume restored the optimizer state: the compiled step holds its containers
        self.stepper.build()
        self.evaluator = Evaluator(task, cfg.compile, self.stepper.n_streams,
                                   self.stepper.blas_threads)
        est = (task.memory or {}).get("estimate")  # a step's transient memory bounds what is kept
        device.bound_kept_buffers(None if est is None else
                                  (est["activations_mb"] + est["logits_mb"]) << 20)
        self.log = EventLog(run_dir / "events.jsonl", enabled=self.rank0,
                            t_offset=resume.t if resume is not None else 0.0)
        self.ckpt = Checkpointer(task, self.optimizer, self.scale, cfg, run_dir, self.log,
                                 self.rank0, self.start if self.start else None,
                                 resume.kept if resume is not None else [])
        self.count = task.count or (lambda b: int(np.prod(next(iter(b.values())).shape[:2])))
        self.step = self.start
        """The last step whose update is in the weights."""
        self.reason, self.exit_code, self.message = "completed", 0, None
        self.t_first: float | None = None
        self.last_eval: dict[str, float] = {}
        self.trained = self._trained_before()
        """Tokens (images) trained on so far: the step events' `trained_<unit>`."""
        self.window: list[dict] = []
        """The step events since the last report line."""
        self.reported = self.trained
        """`trained` before the window's first step."""

    def run(self, run_config: dict[str, Any]) -> dict[str, Any]:
        self._announce(run_config)
        # Data parallel: a rank blocked in an all_sum whose peer died never returns to Python,
        # so a handler would never run and mlx.launch would wait on it forever; keep SIGTERM's
        # default (exit) there and leave a torn bundle that --resume continues.
        solo = self.world is None or self.world.size() == 1
        with StopSignals(self.rank0 and solo) as stop, self._progress() as bar:
            try:
                self._train(stop, bar)
                if self.reason == "completed" and self.task.test_batches and not stop.count:
                    self._test(bar)
                if self.reason == "completed" and self.rank0 and self.task.finish:
                    self._finish(bar)
            except KeyboardInterrupt:  # where Python's own SIGINT handler is left (ranks)
                self._end("interrupted", 130, f"interrupted during step {self.step + 1}; resume "
                          f"with --resume {self.run_dir} from {_named(self.ckpt.last)}")
            except BaseException as e:
                self._end("error", 1, f"{type(e).__name__}: {e}")
                raise
            finally:
                end = self.log.emit("run_end", reason=self.reason, final_step=self.step,
                                    final_loss=self.log.loss_at(self.step),
                                    exit_code=self.exit_code,
                                    message=self.message, first_step_s=self.t_first,
                                    **device.peak_memory())
                self.log.close()
        return end

    def _finish(self, bar: Any) -> None:
        """The recipe's export of the finished run, as an `export` event; a failure (a full
        disk) ends the run as an error that names the checkpoint, which stays intact."""
        if bar is not None:
            bar.write(f"training completed: writing the recipe's export of {_named(self.step)}")
        t0 = time.perf_counter()
        try:
            fields = self.task.finish(self.run_dir)
        except (OSError, ValueError) as e:
            self._end("error", 1, f"training completed and {_named(self.step)} was written, but "
                      f"its export failed: {' '.join(str(e).split())}; rerun the export alone "
                      "(toymlx-export) once the cause is fixed")
            return
        self.log.emit("export", step=self.step, seconds=round(time.perf_counter() - t0, 2),
                      **fields)

    def _end(self, reason: str, exit_code: int, message: str | None) -> None:
        self.reason, self.exit_code, self.message = reason, exit_code, message

    def _announce(self, run_config: dict[str, Any]) -> None:
        """run_start (a fresh run, or a resumed one whose events lack it), then the resume
        event."""
        r, st = self.resume, self.stepper
        if r is None or not r.has_start:
            n_trainable = sum(v.size for _, v in tree_flatten(self.model.trainable_parameters()))
            n_total = sum(v.size for _, v in tree_flatten(self.model.parameters()))
            self.log.emit(
                "run_start", run_id=self.run_dir.name, recipe=self.task.recipe,
                host=host_info(), backend=backend_info(), math=self.model.ops.describe(),
                git=git_info(), step_parallelism={"cpu_streams": st.n_streams, "blas_threads":
                                                  st.blas_threads or device.blas_threads()},
                model={**self.task.model_info, "n_params": n_total, "n_trainable": n_trainable},
                config={**run_config, **self.task.config_info},
                world_size=1 if self.world is None else self.world.size(), start_step=self.start,
                memory={**(self.task.memory or {}), "kept": device.kept_buffers()})
        if r is not None:
            self.log.emit(
                "resume", started_at=now_iso(), from_step=r.step, steps=self.cfg.steps,
                **({"previous_steps": r.steps_before} if r.steps_before != self.cfg.steps else {}),
                checkpoint=None if r.checkpoint is None else str(
                    r.checkpoint.relative_to(self.run_dir)),
                dropped_events=r.dropped, previous_end=r.previous_end,
                **({"note": r.note} if r.note else {}),
                **({"set_aside": r.set_aside} if r.set_aside else {}),
                host=host_info(), backend=backend_info(), git=git_info(),
                world_size=1 if self.world is None else self.world.size())

    def _trained_before(self) -> int:
        """Tokens (images) trained on before this process's first step: what the kept step
        event of the resumed step records, else (a bundle written before the field, or
        none) counted again from the steps' batches."""
        key = f"trained_{self.task.unit}"
        r = self.resume
        kept = [e.get(key) for e in (r.kept if r is not None else [])
                if e["kind"] == "step" and e.get("step") == self.start]
        if kept and isinstance(kept[-1], int):
            return kept[-1]
        return sum(self.count(self.task.train_batch(s)) for s in range(self.start))

    def _say(self, line: str, bar: Any) -> None:
        """A report line on stdout (rank 0): under the progress bar when it is shown."""
        if not self.rank0:
            return
        if bar is not None:
            bar.write(line, file=sys.stdout)
        else:
            print(line, flush=True)

    def _progress(self) -> Any:
        # The bar is drawn on stderr: only where that is a terminal (a log file or a pipe
        # gets the report lines alone).
        if not (self.rank0 and self.cfg.progress and sys.stderr.isatty()):
            return contextlib.nullcontext(None)
        return tqdm(total=self.cfg.steps, initial=self.start, desc=self.task.recipe, unit="step",
                    dynamic_ncols=True, file=sys.stderr)

    def _train(self, stop: StopSignals, bar: Any) -> None:
        cfg = self.cfg
        for s in range(self.start, cfg.steps):
            if not self._step(s, bar):
                return
            done = s + 1
            if cfg.report_every and (done % cfg.report_every == 0 or done == cfg.steps):
                self._say(report_line(self.window, self.task.unit, self.reported, cfg.steps), bar)
                self.window, self.reported = [], self.trained
            if not stop.count and ((cfg.eval_every and done % cfg.eval_every == 0)
                                   or done == cfg.steps):
                self._evaluate(done, bar)
            due = cfg.checkpoint_every and done % cfg.checkpoint_every == 0
            if due and not self._checkpoint(done, bar):
                return
            if stop.count:
                return self._interrupted(stop, bar)
            if cfg.stop_at is not None and cfg.stop_at <= done < cfg.steps:
                self.reason = "stopped"
                break
        self._checkpoint(self.step, bar)

    def _step(self, s: int, bar: Any) -> bool:
        """Optimizer step `s` (0-based) and its event; False if the run diverged in it."""
        t0 = time.perf_counter()
        global_batch = self.task.train_batch(s)
        n_items = self.count(global_batch)
        out = self.stepper.step(s, global_batch)
        dt = time.perf_counter() - t0
        self.t_first = dt if self.t_first is None else self.t_first
        loss, gnorm_v = float(out["loss"].item()), float(out["grad_norm"].item())
        # float16: an overflowing step was skipped (nothing changed but the loss scale)
        scaled = {"loss_scale": float(out["loss_scale"].item()),
                  "skipped": bool(out["skipped"].item())} if self.scale is not None else {}
        lr = lr_at(s, self.cfg.lr, self.cfg.warmup, self.cfg.steps, self.cfg.min_lr_ratio)
        # A non-finite gradient norm with a finite loss has already made the update NaN
        # (unless the loss scale skipped that update).
        checked = (("loss", loss),) if scaled.get("skipped") else (
            ("loss", loss), ("gradient norm", gnorm_v))
        for what, v in checked:
            if not math.isfinite(v):
                self._diverged(f"{what} became {v} at step {s + 1} (lr {lr:.3g})", s)
                return False
        self.step = s + 1
        self.trained += n_items
        rate = n_items / dt
        unit = self.task.unit
        self.window.append(self.log.emit(
            "step", step=s + 1, loss=loss, lr=lr, grad_norm=gnorm_v, **scaled,
            **{f"{unit}_per_s": round(rate, 2), "step_time_s": round(dt, 4),
               f"trained_{unit}": self.trained}, **device.peak_memory()))
        if bar is not None:
            acc = (f" val_acc {self.last_eval['accuracy']:.3f}" if "accuracy" in self.last_eval
                   else "")
            bar.set_postfix_str(f"loss {loss:.4f}{acc} lr {lr:.2e} "
                                f"{rate:,.0f} {self.task.unit}/s")
            bar.update(1)
        return True

    def _evaluate(self, step: int, bar: Any) -> None:
        t0 = time.perf_counter()
        metrics = self.evaluator(self.cfg.eval_batches)
        self.last_eval = metrics
        self.ckpt.score(step, metrics)
        self._say(eval_line(self.log.emit("eval", step=step, **metrics,
                                          seconds=round(time.perf_counter() - t0, 3))), bar)

    def _test(self, bar: Any) -> None:
        """The completed run's held-out test figures (`--test`), once at the end: the loss and
        the task's metrics (a classifier's test_accuracy), and a language model's perplexity."""
        t0 = time.perf_counter()
        metrics = self.evaluator(split="test")
        if self.task.unit == "tokens":
            metrics["test_perplexity"] = math.exp(metrics["test_loss"])
        self._say(eval_line(self.log.emit("eval", step=self.step, split="test", **metrics,
                                          seconds=round(time.perf_counter() - t0, 3))), bar)

    def _checkpoint(self, step: int, bar: Any) -> bool:
        """The checkpoint of `step`, unless written; False (the run diverged) if the weights
        are not finite."""
        if self.ckpt.last == step or step == 0:
            return True
        # A finite loss does not prove finite weights: the update after it can overflow
        # (huge lr times weight decay). Bad weights are never written.
        if not _finite(self.model):
            self._diverged(f"weights became non-finite at step {step}", step - 1)
            return False
        ev = self.ckpt.save(step)
        if ev is not None:
            self._say(checkpoint_line(ev, self.run_dir), bar)
        return True

    def _interrupted(self, stop: StopSignals, bar: Any) -> None:
        resume = f"resume with --resume {self.run_dir}"
        if stop.count > 1 and self.ckpt.last != self.step:
            self._end("interrupted", 130, f"interrupted after step {self.step}; a second signal "
                      f"skipped its checkpoint: {resume} (from {_named(self.ckpt.last)})")
        elif self._checkpoint(self.step, bar):
            self._end("interrupted", 130, f"interrupted after step {self.step}; {resume}")

    def _diverged(self, what: str, good_step: int) -> None:
        """End as diverged with `good_step` the last step with good weights. Right after a
        resume the checkpoint it started from is checked first: damage there, not the learning
        rate, would explain it."""
        self.step = good_step
        r, suspect = self.resume, ""
        if r is not None and r.checkpoint is not None and good_step == r.step:
            suspect = f", the first step after resuming from {r.checkpoint.name}"
            try:
                _, meta = ck.open_checkpoint(r.checkpoint)
                bad = ck.nonfinite_tensor(r.checkpoint)
            except ck.ResumeError as e:
                meta, bad, suspect = {}, None, f"{suspect}, which is damaged ({e})"
            hint = intact_hint(self.run_dir, r.step)
            if bad is not None:
                suspect += f", which holds non-finite weights ({bad}): {hint}"
            elif "damaged" in suspect:
                suspect += f": {hint}"
            elif DIGEST_KEY not in meta:
                suspect += (", which carries no checksum to check it by: if the learning rate "
                            f"is not the cause, {hint}")
            else:
                suspect += " (checked: intact and finite, so the cause is the run's settings)"
        self._end("diverged", 2, f"{what}{suspect}; stopped without checkpointing the bad "
                  f"weights; last good checkpoint: {_named(self.ckpt.last)}")


def train(task: Task, cfg: TrainConfig, run_dir: Path, run_config: dict[str, Any],
          world: Any = None, resume: Resume | None = None) -> dict[str, Any]:
    """Run the loop; returns the run_end event. Rank 0 alone writes the bundle."""
    return _Loop(task, cfg, run_dir, world, resume).run(run_config)
