"""The training loop every recipe shares, around one compiled step.

A recipe builds a `Task` (`toymlx.training.task`: model, loss, batches, how to save and load a
checkpoint); `train` runs it: each optimizer step taken by a `Stepper` (the step from
`training_step`, `toymlx.training.step.make_step`: gradient accumulation, data-parallel sums,
clipping, AdamW with warm-up + cosine LR; on a multi-core CPU spread over streams by
`toymlx.training.cpu_streams`; the benchmark steps its toymlx rows through the same
`Stepper`), periodic validation in eval mode (`toymlx.training.evaluate.Evaluator`),
checkpoints on a schedule and at the end through a `Checkpointer` (verified, with retention),
the run bundle's events (run_end from one place), and SIGINT/SIGTERM/SIGHUP as requests to
stop (`toymlx.backend.stop.StopSignals`), agreed by every data-parallel rank.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
from mlx import nn
from mlx.utils import tree_flatten, tree_unflatten
from tqdm import tqdm

from toymlx.backend import device
from toymlx.backend.atomic import discard, fsync_dir
from toymlx.backend.device import backend_info
from toymlx.backend.files import counted
from toymlx.backend.progress import draws_bars
from toymlx.backend.stop import (
    RANK_SIGNALS,
    READER_GONE,
    SOLO_SIGNALS,
    CutShort,
    Stopped,
    StopSignals,
    how_stopped,
    signal_name,
    stop_outcome,
)
from toymlx.bundle import checkpoint as ck
from toymlx.bundle.events import DAMAGED_KEY, EventLog, git_info, host_info, now_iso, run_start
from toymlx.bundle.folder import config_digest, saved_config
from toymlx.bundle.inputs import DATA_ERROR_KEY, DATA_FIXED_KEY, MOVED_KEY
from toymlx.bundle.reporters import open_reporters
from toymlx.bundle.resume import Resume
from toymlx.data.text import DataError
from toymlx.gguf.reader import DIGEST_KEY
from toymlx.training import cpu_streams
from toymlx.training.evaluate import ROW_PREFIX, Evaluator
from toymlx.training.schedule import lr_at
from toymlx.training.step import LossScale, agreed_requests, make_step, step_state, stop_flags
from toymlx.training.task import Task, TrainConfig, eval_batch_limit, make_optimizer


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


class DataFailed(Exception):
    """Leaves the loop from a held-out pass whose data failed (`Trainer._reading`): the run's
    end is already set."""


def _named(step: int | None) -> str:
    return "none" if step is None else f"step {step}"


def resume_from(run_dir: Path, last: int | None) -> str:
    """The command that goes on after a stop that skipped its checkpoint: from the newest one
    (`last`), or where none was written, the run started over (a plain --resume finds none)."""
    if last is None:
        return (f"no checkpoint was written: start it over with toymlx-train --resume {run_dir} "
                "--from step_0")
    return f"resume with --resume {run_dir} (from step {last})"


def _finite(model: nn.Module) -> bool:
    """Whether every trainable parameter is finite (one reduction, checked before writing)."""
    flags = [mx.all(mx.isfinite(v)) for _, v in tree_flatten(model.trainable_parameters())]
    return bool(mx.all(mx.stack(flags)).item()) if flags else True


def training_step(model: nn.Module, loss_fn: Callable, optimizer: optim.Optimizer,
                  cfg: TrainConfig, world: Any = None, scale: LossScale | None = None
                  ) -> tuple[Callable, list]:
    """(step, the streams it runs on, the first to be MLX's stream when it is called) of this
    run: `toymlx.step.make_step`, or on a multi-core CPU the same spread over streams
    (`toymlx.cpu_streams`). On the CPU the streams are new ones whose threads compute with the
    model's `Ops.subnormals`. Build it after the optimizer state is final (resume): the
    compiled step holds on to the state's containers."""
    n = cpu_streams.stream_count(cfg.cpu_streams, world, scaled=scale is not None)
    if mx.default_device() != mx.cpu:
        streams = [mx.default_stream(mx.default_device())]
    else:
        streams = cpu_streams.new_streams(n, cpu_streams.subnormals_of(model))
    if n > 1:
        return cpu_streams.make_stream_step(model, loss_fn, optimizer, streams, cfg.grad_clip,
                                            cfg.compile), streams
    return make_step(model, loss_fn, optimizer, cfg.grad_clip, world, cfg.compile,
                     scale), streams


def eval_each(*trees: Any) -> None:
    """Evaluate the arrays of `trees` one at a time (the same values as one `mx.eval` of them
    all). A stop signal's handler runs between two (Python runs none inside one `mx.eval`), so a
    stop before the loop (`toymlx.backend.stop.stops_raise`) acts within one array's evaluation:
    one `mx.eval` of a 0.6B-parameter model's random init held a SIGTERM 78 s on 2 CPU cores,
    its largest array (8192 x 2048) takes ~2 s."""
    for tree in trees:
        for _, a in tree_flatten(tree):
            if isinstance(a, mx.array):
                mx.eval(a)


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
        self.distributed = world is not None and world.size() > 1
        """Data parallel: the step sums the ranks' stop flags with their gradients."""
        self.streams: list = []
        """The streams the built step runs on (`training_step`; none: not built yet)."""
        self.blas_threads: int | None = None
        """BLAS threads per call while the step is evaluated (None: left as they are)."""
        self._fn: Callable | None = None

    def build(self) -> None:
        """Evaluate the weights and optimizer state and build the compiled step. Call it after a
        resume has restored the optimizer state: the compiled step holds on to its containers."""
        eval_each(self.model.parameters(), self.optimizer.state)
        self._fn, self.streams = training_step(self.model, self.task.loss_fn, self.optimizer,
                                               self.cfg, self.world, self.scale)
        self.blas_threads = cpu_streams.step_blas_threads(self.n_streams)

    @property
    def n_streams(self) -> int | None:
        """CPU streams the built step spreads over (None: not built yet)."""
        return len(self.streams) or None

    def step(self, s: int, global_batch: dict[str, np.ndarray], requests: int = 0,
             waiting: Callable[[], Any] | None = None) -> dict[str, mx.array]:
        """Optimizer step `s` (0-based) on `global_batch` (this rank's shard of it), evaluated
        with the model and optimizer state; returns the step's outputs (loss, grad_norm, and the
        loss scale's with float16; data parallel, "stop_flags": the ranks' `stop_flags` of their
        `requests` to stop, summed). `waiting`: the context the evaluation runs in, one call
        that cannot be cut (`StopSignals.waiting`)."""
        if self._fn is None:
            raise RuntimeError("Stepper.step: expected build() to have run, found no step")
        batch = {k: mx.array(v) for k, v in _shard(global_batch, self.world).items()}
        # Randomness (dropout) is a pure function of (seed, step), like the data, so a
        # resumed run draws exactly what an uninterrupted one would.
        mx.random.seed(step_seed(self.cfg.seed, s))
        out = self._call(batch, requests)
        with (device.evaluating(self.blas_threads, cpu_streams.subnormals_of(self.model)),
              (waiting or contextlib.nullcontext)()):
            mx.eval(out, self.model.state, self.optimizer.state)
        return out

    def _call(self, batch: dict[str, mx.array], requests: int) -> dict[str, mx.array]:
        """The built step on `batch`, unevaluated; data parallel with this rank's stop flags."""
        with mx.stream(self.streams[0]):
            if self.distributed:
                return self._fn(batch, stop_flags(requests))
            return self._fn(batch)

    def trace(self, global_batches: list[dict[str, np.ndarray]]) -> None:
        """Trace the compiled step for each batch's shape without taking a step, so that a
        later step of that shape does not stop to trace it (`mx.compile` keeps a trace per input
        shape; tracing a 30-block LoRA step takes ~1 s on a CPU core). Nothing is evaluated:
        each call's outputs are dropped and the state it updates put back as it was."""
        if self._fn is None:
            raise RuntimeError("Stepper.trace: expected build() to have run, found no step")
        if not self.cfg.compile:
            return
        state = step_state(self.model, self.optimizer, self.scale)
        for global_batch in global_batches:
            kept = _array_slots(state)
            batch = {k: mx.array(v) for k, v in _shard(global_batch, self.world).items()}
            self._call(batch, 0)
            for container, key, value in kept:
                container[key] = value


def _array_slots(tree: Any) -> list[tuple[Any, Any, mx.array]]:
    """(container, key, array) for every array in nested dicts and lists: what a compiled
    function's `outputs` replaces in place, to be put back."""
    slots: list[tuple[Any, Any, mx.array]] = []
    items = tree.items() if isinstance(tree, dict) else enumerate(tree)
    for k, v in items:
        if isinstance(v, mx.array):
            slots.append((tree, k, v))
        elif isinstance(v, (dict, list)):
            slots.extend(_array_slots(v))
    return slots


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


class Checkpointer:
    """Writes one run's checkpoints (weights, optimizer state, one id shared by both), applies
    the retention policy (--keep-last, --keep-best) and emits the `checkpoint` events."""

    def __init__(self, task: Task, optimizer: optim.Optimizer, scale: LossScale | None,
                 cfg: TrainConfig, run_dir: Path, log: EventLog, write: bool, last: int | None,
                 kept: list[dict], run_uid: str):
        self.task, self.optimizer, self.scale, self.cfg = task, optimizer, scale, cfg
        self.run_uid = run_uid
        """The run's id (run_start's `run_uid`), written into each checkpoint pair."""
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
        extra = {"general.step": step, "general.run_id": self.run_dir.name, ck.ID_KEY: ckpt_id,
                 ck.RUN_KEY: self.run_uid}
        if self.task.checkpoint_meta:
            extra.update(self.task.checkpoint_meta())
        model = self.task.model
        path = ck.save_checkpoint(self.weights, self.task.prefix, step,
                                  lambda p: self.task.save(p, model, extra),
                                  resume_arrays(self.optimizer, self.scale, model,
                                                exact_weights=self.cfg.save_dtype != "f32"),
                                  {"step": step, "recipe": self.task.recipe,
                                   "checkpoint_id": ckpt_id, "run_uid": self.run_uid})
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


QUIET_LINE_S = 60.0
"""Where no progress bar is drawn (a log file, a pipe), the longest a run goes without a line on
stdout between report lines: an 8B base's steps of a minute or more would otherwise leave
--report-every 10 silent for ten minutes or more (`step_line`)."""


def step_line(event: dict, steps: int, next_report: int) -> str:
    """The line of one step event between report lines (`QUIET_LINE_S`): its own loss and time,
    and where the next report line comes."""
    return (f"step {event['step']}/{steps}: loss {event['loss']:.4f}, {event['step_time_s']:.1f} s "
            f"this step (the report line of the steps since the last comes at step {next_report})")


def eval_line(ev: dict) -> str:
    """The line of an `eval` event: its figures and how long the pass took."""
    figures = ", ".join(f"{k} {v:.4f}" for k, v in ev.items()
                        if isinstance(v, float) and k not in ("t", "seconds"))
    where = "test" if ev.get("split") == "test" else f"step {ev['step']}"
    return f"{where}: {figures} ({ev['seconds']:.2f} s)"


def recorded_figures(metrics: dict[str, Any], split: str) -> dict[str, Any]:
    """A pass's figures as its `eval` event records them. Each row's own (`ROW_PREFIX`: a LoRA
    run's summed loss and trained tokens a row, `lm_held_out_rows`): on the validation split
    as lists in the order its batches hold the rows (val_row_loss floats, val_row_n ints), at
    most --eval-batches x --batch-size of them, from which toymlx-export --fuse takes the
    gain's standard error instead of scoring the base and base + adapter again; on the test
    split, scored whole and unbounded, left out."""
    rows = f"{split}_{ROW_PREFIX}"
    out: dict[str, Any] = {}
    for k, v in metrics.items():
        if not k.startswith(rows):
            out[k] = v
        elif split == "val":
            out[k] = [int(x) for x in v] if k == f"{rows}n" else [float(x) for x in v]
    return out


def checkpoint_line(ev: dict, run_dir: Path) -> str:
    """The line of a `checkpoint` event: the file written (and what retention removed)."""
    removed = (f"; removed {', '.join(f'step_{s}' for s in ev['removed'])}"
               if ev.get("removed") else "")
    return f"step {ev['step']}: checkpoint {run_dir / ev['path']}{removed}"


class _Loop:
    """One run of the loop: the step reached, how the run ends, and the pieces acting on them.
    `run` emits run_start (or a resume event), trains, and emits run_end from one place."""

    def __init__(self, task: Task, cfg: TrainConfig, run_dir: Path, world: Any,
                 resume: Resume | None, launched: bool = False,
                 at_exit: Callable[[dict], None] | None = None):
        self.task, self.cfg, self.run_dir, self.world = task, cfg, run_dir, world
        self.resume = resume
        self.launched = launched
        """A rank of toymlx-launch: its stop signals come relayed (`RANK_SIGNALS`)."""
        self.at_exit = at_exit
        """Called with run_end where a second stop request leaves the process at once
        (`_waiting`), which then exits without returning."""
        self.rank0 = world is None or world.rank() == 0
        self.solo = world is None or world.size() == 1
        """One process (no data-parallel peers to agree with)."""
        self.model = task.model
        device.setup_process(wide_evaluation=not cfg.grad_checkpoint)
        self.stepper = Stepper(task, cfg, world)
        self.optimizer, self.scale = self.stepper.optimizer, self.stepper.scale
        self.start = 0
        if resume is not None and resume.checkpoint is not None:
            try:
                ck.load_checked(task.load, resume.checkpoint, self.model)
            except ck.ResumeError as e:  # non-finite weights under a checksum that holds
                raise ck.ResumeError(f"{e}; {ck.intact_hint(run_dir, resume.step)}") from None
            restore_resume_arrays(resume.state, self.optimizer, self.scale, self.model)
            self.start = resume.step
        # after the resume restored the optimizer state: the compiled step holds its containers
        self.stepper.build()
        self.evaluator = Evaluator(task, cfg.compile, self.stepper.n_streams,
                                   self.stepper.blas_threads)
        est = (task.memory or {}).get("estimate")  # a step's transient memory bounds what is kept
        device.bound_kept_buffers(None if est is None else
                                  (est["activations_mb"] + est["logits_mb"]) << 20)
        kept = resume.kept if resume is not None else []
        recorded = run_start(e for e in kept if isinstance(e.get("run_uid"), str))
        self.run_uid = (recorded or {}).get("run_uid") or uuid.uuid4().hex
        """The run's id: its run_start's, or new (a fresh run, or a bundle from before it)."""
        self.log = EventLog(run_dir / "events.jsonl", enabled=self.rank0,
                            t_offset=resume.t if resume is not None else 0.0,
                            sinks=open_reporters(cfg.report_to, run_dir, self.run_uid,
                                                 cfg.wandb_project)
                            if self.rank0 else [])
        self.ckpt = Checkpointer(task, self.optimizer, self.scale, cfg, run_dir, self.log,
                                 self.rank0, self.start if self.start else None, kept,
                                 self.run_uid)
        self.count = task.count or (lambda b: int(np.prod(next(iter(b.values())).shape[:2])))
        self.step = self.start
        """The last step whose update is in the weights."""
        self.agreed = 0
        """Data parallel: the stop requests every rank knows of (`_stops`)."""
        self.reason, self.exit_code, self.message = "completed", 0, None
        self.signal: str | None = None
        self.data_error: str | None = None
        """The error of the data that ended the run (`_data_failed`), for run_end"""
        """The signal that stopped the run (run_end's `signal`), None if none did."""
        self.t_first: float | None = None
        self.recorded: list[dict] = []
        """The eval and export events this process wrote (with the kept ones: `_done`)."""
        self.abandoned: int | None = None
        """The step whose validation pass a stop abandoned (None: none)."""
        self.last_eval: dict[str, float] = {}
        self.trained = self._trained_before()
        """Tokens (images) trained on so far: the step events' `trained_<unit>`."""
        self.window, self.reported = self._window_before()
        """The step events since the last report line; `trained` before the window's first
        step."""
        self.said_at = time.monotonic()
        """When the last line went to stdout (`_say`), for `step_line`."""

    def run(self, run_config: dict[str, Any]) -> dict[str, Any]:
        self._announce(run_config)
        # a launch's only rank (-n 1) gets toymlx-launch's relays too: counted, not raised
        # into a step by toymlx-train's `stops_raise` (no final checkpoint)
        signals = SOLO_SIGNALS if self.solo and not self.launched else RANK_SIGNALS
        with StopSignals(signals) as stop, self._progress() as bar:
            together = False  # the run ended where every rank ends it (not by an exception)
            try:
                self._train(stop, bar)
                if self.reason == "completed":
                    self._wrap_up(stop, bar)
                together = True
            except DataFailed:  # ended by `_data_failed`, its steps checkpointed
                pass
            except KeyboardInterrupt as e:  # raised by code (StopSignals counts the signals),
                # or a stop that came while a step was evaluated, which then failed (`CutShort`)
                what, code = how_stopped(e)
                cut = ""
                if isinstance(e, CutShort):
                    self.signal = signal_name(e.signum)
                    cut = (f", which failed once {self.signal} came ({type(e.cause).__name__}: "
                           f"{' '.join(str(e.cause).split())[:300]})"
                           + (f"; the kernel library it stopped halfway, {e.dropped}, is "
                              "removed (the next run builds it again)" if e.dropped else ""))
                self._end("interrupted", code, f"{what} during step {self.step + 1}{cut}; "
                          f"{resume_from(self.run_dir, self.ckpt.last)}")
            except BaseException as e:
                if not self._peer_stopped(e, stop):
                    self._end("error", 1, f"{type(e).__name__}: {e}")
                    raise
                what, code = stop_outcome(stop.first)
                self.signal = stop.name
                self._end("interrupted", code, f"{what} during step {self.step + 1}, which "
                          "lost another rank (its own line says how), so it could not be "
                          f"trained; {resume_from(self.run_dir, self.ckpt.last)}")
            finally:
                end = self._run_end()
            if together and not self.solo:
                end["exit_code"] = self._leave_together(stop)
        return end

    def _peer_stopped(self, e: BaseException, stop: StopSignals) -> bool:
        """Whether `e` is a data-parallel collective that lost its peer after this rank counted
        a stop: a rank still setting up when the stop came ends at once, alone (`stops_raise`),
        and MLX's ring then fails the step's all_sum on the ranks already in the loop
        ("[ring] connection to a peer was lost"): a stop, not an error (a traceback, run_end
        "error", exit 1, and toymlx-launch's "failed: 2 of 2 ranks"). So too where the peer
        failed and the launch stopped this rank: the failing rank's line and exit code say it
        (toymlx-launch's status is the failure's)."""
        return (not self.solo and stop.count > 0 and isinstance(e, RuntimeError)
                and "connection to a peer was lost" in str(e))

    def _run_end(self) -> dict:
        """Write run_end (how the run ended: `_end`'s) and close the log; returns the event."""
        end = self.log.emit("run_end", reason=self.reason, final_step=self.step,
                            final_loss=self.log.loss_at(self.step), exit_code=self.exit_code,
                            message=self.message,
                            **({"signal": self.signal} if self.signal else {}),
                            **({DATA_ERROR_KEY: self.data_error} if self.data_error else {}),
                            first_step_s=self.t_first, **device.peak_memory())
        self.log.close()
        return end

    def _waiting(self, stop: StopSignals, bar: Any, step: int, part: str
                 ) -> Callable[[], Any] | None:
        """The context of one evaluation that cannot be cut (`StopSignals.waiting`): step
        `step` ("step"), or a batch of the validation or --test pass after it ("validation",
        "--test"). A first request there says at once what the run waits for (a cold step
        builds MLX's CPU kernels for tens of seconds: ViT-Tiny's first step ~40 s on 2 cores),
        and the run stops as ever after it; a second one leaves at once, without it: run_end
        says how to resume, from the last checkpoint, and the run's last line is printed
        (`at_exit`). Nothing is written during the evaluation, so nothing is lost that was
        saved. Only a process alone: data-parallel ranks agree on stops at a step
        (toymlx-launch ends them on a second request)."""
        if not self.solo or self.launched:
            return None
        after = "this step" if part == "step" else f"this {part} batch"
        during = f"step {step}" if part == "step" else f"the {part} pass after step {step}"

        def second() -> None:
            what, code = stop_outcome(stop.first)
            self.signal = stop.name
            self._end("interrupted", code, f"{what} during {during}: a second "
                      f"{signal_name(stop.last)} left at once, without finishing it; "
                      f"{resume_from(self.run_dir, self.ckpt.last)}")
            end = self._run_end()
            if bar is not None:
                bar.close()
            if self.at_exit is not None and self.rank0:
                self.at_exit(end)

        @contextlib.contextmanager
        def waiting() -> Any:
            since = device.kernel_stamp()

            def first() -> None:
                if stop.first == READER_GONE:  # no one reads the console
                    return
                name = stop.name
                kernels = (" (MLX is building its CPU kernels: a cold start; later runs reuse "
                           "them)" if device.building_kernels(since) else "")
                self._say(f"step {step}: {name} came: stopping after {after}{kernels}; a "
                          f"second {name} leaves at once, without it", bar)
            try:
                with stop.waiting(first, second):
                    yield
            except CutShort as e:  # a kernel build the signal stopped: never loaded again
                e.dropped = device.drop_unloadable_kernel(e.cause)
                raise
        return waiting

    def _stops(self, stop: StopSignals) -> int:
        """Stop requests so far. Data parallel: the most any rank had counted when the last step
        began, which every rank learns from that step's all_sum (`Stepper.step`), so that all
        stop after the same step: the one after the step in flight."""
        return stop.count if self.solo else self.agreed

    def _leave_together(self, stop: StopSignals) -> int:
        """Data parallel, once the run has ended on this rank: wait for every rank (rank 0 has
        then written its final checkpoint and run_end), then ignore stop signals until exit;
        returns rank 0's exit code, every rank's. mlx.launch stops the other ranks (SIGTERM) as
        soon as one exits non-zero, as each does after Ctrl-C (130): a rank leaving early cut
        rank 0 off mid-write, and one leaving just after this barrier must not cut off rank 0's
        last line or its rank status. The ranks agree on every stop up to the last step's
        all_sum, but rank 0 alone exports after it: a stop there ended rank 0 interrupted
        (143) and the others completed (0), which toymlx-launch reported as a failed rank."""
        code = mx.distributed.all_sum(mx.array(self.exit_code if self.rank0 else 0,
                                               dtype=mx.int32), group=self.world)
        mx.eval(code)
        stop.ignore()
        return int(code.item())

    def _wrap_up(self, stop: StopSignals, bar: Any) -> None:
        """What a completed run does after its last step and final checkpoint, each part unless
        the bundle already holds it (a resume finishing the run): --test's pass, then the
        recipe's export. A stop request before or during either abandons it, and the run ends
        interrupted (`_left_undone`): a `--resume` then does only what is left."""
        if self.task.test_batches and not self._done("test"):
            if self._stops(stop):
                return self._left_undone(stop, "--test", "before")
            if not self._test(bar, lambda: self._stops(stop),
                              self._waiting(stop, bar, self.step, "--test")):
                self._say(f"step {self.step}: --test abandoned ({stop.name} came during its "
                          f"pass; toymlx-train --resume {self.run_dir} scores it)", bar)
                return self._left_undone(stop, "--test", "during")
        if self.rank0 and self.task.finish and not self._done("export"):
            self._finish(bar, stop)

    def _done(self, part: str) -> bool:
        """Whether this run's end already holds `part` ("val", "test": that pass's eval event at
        the run's last step; "export": the export event there, its file in place), recorded by
        this process or kept by a resume (one killed or stopped after it)."""
        for e in [*(self.resume.kept if self.resume is not None else []), *self.recorded]:
            if e.get("step") != self.cfg.steps:
                continue
            if part == "export" and e["kind"] == "export":
                if (self.run_dir / str(e.get("path"))).is_file():
                    return True
            elif e["kind"] == "eval" and e.get("split", "val") == part:
                return True
        return False

    def _left_undone(self, stop: StopSignals, part: str | None, when: str) -> None:
        """End as interrupted by `stop`'s first signal (its exit code, its name in run_end),
        all steps trained and checkpointed, `when` ("before", "during") `part` of what the run
        was asked to do after its last step (None: the first not done): the line names what is
        left undone, from `part` on, and the resume that does only that (no step is trained
        again, and its figures and export are those of an uninterrupted run)."""
        self.signal = stop.name
        what, code = stop_outcome(stop.first)
        parts = [p for p, asked in (
            ("the final validation", bool(self.task.val_batches) and not self._done("val")),
            ("--test", bool(self.task.test_batches) and not self._done("test")),
            ("the export", self.rank0 and self.task.finish is not None
             and not self._done("export"))) if asked]
        n, resume = self.step, f"toymlx-train --resume {self.run_dir}"
        if part is None and not parts:  # all of it done: only run_end is missing
            return self._end("interrupted", code, f"{what} after step {n}, the last (its "
                             f"checkpoint written, nothing else asked for): {resume} ends it "
                             "as completed")
        part = part or parts[0]
        undone = parts[parts.index(part):] if part in parts else [part]
        alone = (f"; or {self.task.export_later(self.run_dir)} writes the export alone"
                 if "the export" in undone and self.task.export_later else "")
        self._end("interrupted", code, f"{what} {when} {part} (all {counted(n, 'step')} trained, "
                  f"checkpoint step_{n} written): left undone: {_listed(undone)}; {resume} "
                  f"finishes it without training{alone}")

    def _finish(self, bar: Any, stop: StopSignals) -> None:
        """The recipe's export of the finished run, as an `export` event; a failure (a full
        disk) ends the run as an error that names the checkpoint, which stays intact. A stop
        request abandons the export at once (`StopSignals.raising`: it writes whole files
        atomically, so its temporaries go and nothing is left under its name): the run ends
        interrupted by that signal (`_left_undone`). An export whose event cannot be written is
        removed again."""
        if bar is not None:
            bar.write(f"training completed: writing the recipe's export of {_named(self.step)}")
        t0 = time.perf_counter()
        when = "before" if stop.count else "during"
        try:
            with stop.raising():
                fields = self.task.finish(self.run_dir)
        except Stopped:
            return self._left_undone(stop, "the export", when)
        except (OSError, ValueError) as e:
            self._end("error", 1, f"training completed and {_named(self.step)} was written, but "
                      f"its export failed: {' '.join(str(e).split())}; rerun the export alone "
                      "(toymlx-export) once the cause is fixed")
            return
        try:
            self.recorded.append(self.log.emit("export", step=self.step,
                                            seconds=round(time.perf_counter() - t0, 2), **fields))
        except BaseException:
            # all or nothing: an export its events.jsonl does not record (a full disk) is
            # removed, not left as a file the run never says it wrote (a resume writes it again)
            discard(self.run_dir / fields["path"])
            raise

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
                "run_start", run_id=self.run_dir.name, run_uid=self.run_uid,
                config_sha256=_config_sha256(self.run_dir), recipe=self.task.recipe,
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
                config_sha256=_config_sha256(self.run_dir),
                **({"previous_steps": r.steps_before} if r.steps_before != self.cfg.steps else {}),
                checkpoint=None if r.checkpoint is None else str(
                    r.checkpoint.relative_to(self.run_dir)),
                dropped_events=r.dropped, previous_end=r.previous_end,
                **({"note": r.note} if r.note else {}),
                **({"set_aside": r.set_aside} if r.set_aside else {}),
                **({"exports_set_aside": r.exports_aside} if r.exports_aside else {}),
                **({MOVED_KEY: r.moved} if r.moved else {}),
                **({DATA_FIXED_KEY: r.data_fixed} if r.data_fixed else {}),
                **({DAMAGED_KEY: r.damaged} if r.damaged else {}),
                host=host_info(), backend=backend_info(), git=git_info(),
                world_size=1 if self.world is None else self.world.size())
            if r.cut_record is not None:  # the cut is in the record now (`Bundle.rewind`)
                r.cut_record.unlink(missing_ok=True)
                fsync_dir(r.cut_record.parent)

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

    def _window_before(self) -> tuple[list[dict], int]:
        """The report window as it stood after step `start`: a run resumed from step 12 with
        --report-every 10 reports steps 11-20 at step 20, as the run that never stopped does
        (11 and 12 from the kept step events); empty where a kept event lacks a figure."""
        every, key = self.cfg.report_every, f"trained_{self.task.unit}"
        kept = self.resume.kept if self.resume is not None else []
        last_line = self.start - self.start % every if every else self.start
        window = [e for e in kept if e["kind"] == "step" and last_line < e.get("step", 0)
                  <= self.start]
        before = [e.get(key) for e in kept if e["kind"] == "step" and e.get("step") == last_line]
        reported = 0 if last_line == 0 else before[-1] if before else None
        figures = ("loss", "lr", "step_time_s", key, "peak_memory_mb")
        if ([e["step"] for e in window] != list(range(last_line + 1, self.start + 1))
                or not isinstance(reported, int)
                or any(not isinstance(e.get(f), (int, float)) for e in window for f in figures)):
            return [], self.trained
        return window, reported

    def _say(self, line: str, bar: Any) -> None:
        """A report line on stdout (rank 0): under the progress bar when it is shown."""
        if not self.rank0:
            return
        self.said_at = time.monotonic()
        if bar is not None:
            bar.write(line, file=sys.stdout)
        else:
            print(line, flush=True)

    def _progress(self) -> Any:
        # The bar is drawn on stderr: only where that is a terminal that draws it (a log file
        # or a pipe gets the report lines alone, and a slow step's own line).
        if not (self.rank0 and self.cfg.progress and draws_bars()):
            return contextlib.nullcontext(None)
        return tqdm(total=self.cfg.steps, initial=self.start, desc=self.task.recipe, unit="step",
                    dynamic_ncols=True, file=sys.stderr)

    def _train(self, stop: StopSignals, bar: Any) -> None:
        cfg = self.cfg
        cache = device.cuda_kernel_cache()
        if cache is not None and not any(cache.glob("*.ptx")):
            self._say(f"step {self.start + 1}: MLX builds its CUDA kernels first, up to 2.5 "
                      f"minutes on a fresh machine (kept in {cache} for later runs)", bar)
        # the validation of the start step: --eval-at-start's at step 0; on a resume, the one
        # due there that a stop skipped or abandoned (an uninterrupted run has its figures)
        first = cfg.eval_at_start if self.start == 0 else self._eval_due(self.start)
        if first and not self._evaluated(self.start) and not self._evaluate(self.start, bar, stop):
            return self._interrupted(stop, self._stops(stop), bar)
        if note := self._schedule_note():
            self._say(note, bar)
        for s in range(self.start, cfg.steps):
            if not self._step(s, bar, stop, self._waiting(stop, bar, s + 1, "step")):
                return
            done = s + 1
            if cfg.report_every and (done % cfg.report_every == 0 or done == cfg.steps):
                self._say(report_line(self.window, self.task.unit, self.reported, cfg.steps), bar)
                self.window, self.reported = [], self.trained
            elif (cfg.report_every and bar is None and self.window
                  and time.monotonic() - self.said_at >= QUIET_LINE_S):
                due = min(cfg.steps, done - done % cfg.report_every + cfg.report_every)
                self._say(step_line(self.window[-1], cfg.steps, due), bar)
            # a stop skips (before it) or abandons (during it) the step's validation: the
            # checkpoint below is then `_interrupted`'s, and a resume from it validates first
            if not self._stops(stop) and self._eval_due(done):
                self._evaluate(done, bar, stop)
            due = cfg.checkpoint_every and done % cfg.checkpoint_every == 0
            if due and not self._stops(stop) and not self._checkpoint(done, bar):
                return
            if stops := self._stops(stop):
                return self._interrupted(stop, max(stops, stop.count), bar)
            if cfg.stop_at is not None and cfg.stop_at <= done < cfg.steps:
                self.reason = "stopped"
                break
        self._checkpoint(self.step, bar)

    def _step(self, s: int, bar: Any, stop: StopSignals,
              waiting: Callable[[], Any] | None = None) -> bool:
        """Optimizer step `s` (0-based) and its event (`stop`: this rank's requests to stop so
        far, which the step shares with the others; `waiting`: the context of its evaluation,
        `_waiting`); False if the run ended before it (a stop while its batch was read, the data
        failed) or diverged in it."""
        requests = stop.count
        t0 = time.perf_counter()
        # the first step also traces the step for every other batch width the run will see
        traced = self._trace_widths(s) if s == self.start else None
        try:
            global_batch = self.task.train_batch(s)
        except DataError as e:  # the data's own error (a file that decodes no more: one line)
            if not self.solo:  # ranks agree on checkpoints at a step: end as any error does
                raise
            self._data_failed(f"step {s + 1}'s batch cannot be read", e, bar)
            return False
        if self.solo and stop.count > requests:
            # a stop while the batch was read (a streamed set's first batches take seconds): the
            # step is not begun, so the run stops at once, as before the first step, not after it
            self._interrupted(stop, stop.count, bar)
            return False
        n_items = self.count(global_batch)
        # unpacked rows: each step's width (its batch's last axis, `Task.batch_widths`), so a
        # step's time reads against its batch's size
        width = ({"batch_width": next(iter(global_batch.values())).shape[-1]}
                 if self.task.batch_widths is not None else {})
        out = self.stepper.step(s, global_batch, requests, waiting)
        if "stop_flags" in out:  # data parallel
            self.agreed = agreed_requests(out["stop_flags"])
        dt = time.perf_counter() - t0
        self.t_first = dt if self.t_first is None else self.t_first
        loss, gnorm_v = float(out["loss"].item()), float(out["grad_norm"].item())
        # float16: an overflowing step was skipped (nothing changed but the loss scale)
        scaled = {"loss_scale": float(out["loss_scale"].item()),
                  "skipped": bool(out["skipped"].item())} if self.scale is not None else {}
        lr = self._lr(s)
        # A non-finite gradient norm with a finite loss has already made the update NaN
        # (unless the loss scale skipped that update).
        checked = (("loss", loss),) if scaled.get("skipped") else (
            ("loss", loss), ("gradient norm", gnorm_v))
        for what, v in checked:
            if not math.isfinite(v):
                self._diverged(f"{what} became {v} at step {s + 1} (lr {lr:.3g})"
                               f"{_from_the_start(what, s, self.resume, self.task.recipe)}", s)
                return False
        self.step = s + 1
        self.trained += n_items
        rate = n_items / dt
        unit = self.task.unit
        self.window.append(self.log.emit(
            "step", step=s + 1, loss=loss, lr=lr, grad_norm=gnorm_v, **scaled,
            **({"traced_widths": traced} if traced else {}), **width,
            **{f"{unit}_per_s": round(rate, 2), "step_time_s": round(dt, 4),
               f"trained_{unit}": self.trained}, **device.peak_memory()))
        if bar is not None:
            acc = (f" val_acc {self.last_eval['accuracy']:.3f}" if "accuracy" in self.last_eval
                   else "")
            bar.set_postfix_str(f"loss {loss:.4f}{acc} lr {lr:.2e} "
                                f"{rate:,.0f} {self.task.unit}/s")
            bar.update(1)
        return True

    def _lr(self, s: int) -> float:
        """The learning rate of optimizer step `s` (0-based), as the compiled step computes it."""
        if self.task.lr_fn is not None:
            return float(self.task.lr_fn(mx.array(s)))
        return lr_at(s, self.cfg.lr, self.cfg.warmup, self.cfg.steps, self.cfg.min_lr_ratio)

    def _schedule_note(self) -> str | None:
        """A resume that changed --steps: the schedule (a function of the total) now spans the
        new total, so the next step's learning rate is not the old schedule's next; one line
        saying so, with the rate the run's last step trained at and the next step's."""
        r = self.resume
        if r is None or r.steps_before == self.cfg.steps or self.start == 0:
            return None
        was = next((e.get("lr") for e in reversed(r.kept)
                    if e["kind"] == "step" and e.get("step") == self.start), None)
        last = f", where step {self.start} trained at {was:.3e}" if isinstance(was, float) else ""
        return (f"step {self.start + 1}: --steps {self.cfg.steps} (the run had "
                f"{r.steps_before}): the learning-rate schedule now spans {self.cfg.steps} "
                f"steps, so step {self.start + 1} trains at lr {self._lr(self.start):.3e}{last}")

    def _trace_widths(self, s: int) -> list[int] | None:
        """For a task whose batches differ in width (`Task.batch_widths`): trace the step for
        each width of steps s.. other than step s's (`Stepper.trace`), so that no later step
        stops for it; the widths in the order first met, s's first (None: one shape, or no
        compiled step)."""
        if self.task.batch_widths is None or not self.cfg.compile:
            return None
        end = self.cfg.steps if self.cfg.stop_at is None else min(self.cfg.stop_at, self.cfg.steps)
        widths = self.task.batch_widths(range(s, max(end, s + 1)))
        firsts = dict.fromkeys(int(w) for w in widths)  # each width once, in step order
        steps = [s + int(np.argmax(widths == w)) for w in list(firsts)[1:]]
        self.stepper.trace([self.task.train_batch(t) for t in steps])
        return list(firsts)

    def _evaluated(self, step: int) -> bool:
        """Whether the bundle's kept events (a resume's) hold the validation of `step`: a run
        started over from step_0 keeps its step-0 pass, which the same weights would repeat."""
        kept = self.resume.kept if self.resume is not None else []
        return any(e["kind"] == "eval" and e.get("step") == step
                   and e.get("split", "val") == "val" for e in kept)

    def _eval_due(self, step: int) -> bool:
        """Whether the validation pass falls after step `step` (--eval-every, and the last)."""
        every = self.cfg.eval_every
        return bool(every and step % every == 0) or step == self.cfg.steps

    def _evaluate(self, step: int, bar: Any, stop: StopSignals) -> bool:
        """The validation pass after step `step` and its `eval` event; False if a stop request
        came during it: the pass is abandoned after the micro-batch in flight (a LoRA run's
        pass takes tens of seconds, which held off a Ctrl-C and a scheduler's SIGTERM), and
        nothing is recorded. Data parallel, the ranks agree on stops only at a step, so a
        pass is not abandoned there (`_stops` does not change during it)."""
        if not self.task.val_batches:  # nothing held out (--data.val-fraction 0): no figures
            return True
        t0 = time.perf_counter()
        with self._reading("validation", step, bar):
            metrics = self.evaluator(eval_batch_limit(self.cfg.eval_batches),
                                     stop=lambda: self._stops(stop),
                                     waiting=self._waiting(stop, bar, step, "validation"))
        if metrics is None:
            self.abandoned = step
            self._say(f"step {step}: validation abandoned ({stop.name} came during its pass; "
                      "a --resume from this step runs it first)", bar)
            return False
        metrics = recorded_figures(metrics, "val")
        self.last_eval = metrics
        self.ckpt.score(step, metrics)
        self.recorded.append(self.log.emit("eval", step=step, **metrics,
                                           seconds=round(time.perf_counter() - t0, 3)))
        self._say(eval_line(self.recorded[-1]), bar)
        return True

    def _test(self, bar: Any, stops: Callable[[], int],
              waiting: Callable[[], Any] | None = None) -> bool:
        """The completed run's held-out test figures (`--test`), once at the end: the loss and
        the task's metrics (a classifier's test_accuracy), and a language model's perplexity;
        False if a stop request (`stops`) came during the pass, which is then abandoned
        (`waiting`: the context of each batch's evaluation, `_waiting`)."""
        t0 = time.perf_counter()
        with self._reading("--test", self.step, bar):
            metrics = self.evaluator(split="test", stop=stops, waiting=waiting)
        if metrics is None:
            return False
        metrics = recorded_figures(metrics, "test")
        if self.task.unit == "tokens":
            metrics["test_perplexity"] = math.exp(metrics["test_loss"])
        self.recorded.append(self.log.emit("eval", step=self.step, split="test", **metrics,
                                           seconds=round(time.perf_counter() - t0, 3)))
        self._say(eval_line(self.recorded[-1]), bar)
        return True

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

    def _interrupted(self, stop: StopSignals, requests: int, bar: Any) -> None:
        """End as interrupted after step `self.step` by `stop`'s first signal (its exit code,
        its name in run_end): with its checkpoint, unless a second request to stop
        (`requests` > 1) came before that checkpoint began."""
        self.signal = stop.name
        (what, code), resume = stop_outcome(stop.first), f"resume with --resume {self.run_dir}"
        # the run's last line reads "interrupted at step N: <this>": neither word nor step again
        how = "by SIGINT (Ctrl-C)" if what == "interrupted" else what
        if self.step == 0:  # during the step-0 validation (--eval-at-start) or batch read
            self._end("interrupted", code, f"{how} before step 1, nothing trained: start it "
                      f"over with toymlx-train --resume {self.run_dir} --from step_0")
        elif requests > 1 and self.ckpt.last != self.step:
            self._end("interrupted", code, f"{how}; a second signal skipped its checkpoint: "
                      f"{resume_from(self.run_dir, self.ckpt.last)}")
        elif not self._checkpoint(self.step, bar):
            return
        elif self.step == self.cfg.steps:  # trained to the end: what follows is left undone
            self._left_undone(stop, None, "during" if self.abandoned == self.step else "before")
        else:
            self._end("interrupted", code, f"{how}; {resume}")

    @contextlib.contextmanager
    def _reading(self, part: str, step: int, bar: Any) -> Any:
        """A held-out pass after step `step` (`part`: "validation", "--test") whose data fails
        to read (a streamed image that does not decode): ended as `_data_failed` ends a
        training batch, the trained steps checkpointed, and `DataFailed` raised to leave."""
        try:
            yield
        except DataError as e:
            if not self.solo:
                raise
            self._data_failed(f"the {part} pass after step {step} cannot read its data", e, bar)
            raise DataFailed from None

    def _data_failed(self, what: str, e: DataError, bar: Any) -> None:
        """End as an error where the data cannot be read (`what`: step 5's batch, a validation
        pass; a streamed image that does not decode, found only when a batch holds it): the
        steps trained so far are checkpointed first, so fixing the file loses nothing of them."""
        if self._checkpoint(self.step, bar):
            self.data_error = " ".join(str(e).split())
            go_on, last = resume_from(self.run_dir, self.ckpt.last), self.ckpt.last
            self._end("error", 1, f"{what}: {self.data_error}; "
                      + (f"the steps before it are kept (step {last}): fix the data, then "
                         f"{go_on}" if last else f"fix the data; {go_on}"))

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
            hint = ck.intact_hint(self.run_dir, r.step)
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


def _listed(parts: list[str]) -> str:
    """"a", "a and b", "a, b and c"."""
    return parts[0] if len(parts) == 1 else f"{', '.join(parts[:-1])} and {parts[-1]}"


def _from_the_start(what: str, s: int, resume: Resume | None, recipe: str) -> str:
    """Why a run's very first step can go non-finite: its loss and gradients are computed
    from the weights the run started from, before any update, so the learning rate is not
    the cause (empty for a later step or a resumed run)."""
    if s != 0 or resume is not None:
        return ""
    start = ("the base as loaded (its adapters are still zero, so the base's own logits or "
             "their gradients are not finite; its values are finite, so their products overflow "
             "float32: check the file with llama.cpp, or train another copy of the model)"
             if recipe == "lora" else "the weights as initialised")
    return f", computed before any update from {start}: not the learning rate"


def _config_sha256(run_dir: Path) -> str | None:
    """`config_digest` of the run's config.json as it is now (None where it cannot be read)."""
    saved = saved_config(run_dir)
    return None if saved is None else config_digest(saved)


def train(task: Task, cfg: TrainConfig, run_dir: Path, run_config: dict[str, Any],
          world: Any = None, resume: Resume | None = None, launched: bool = False,
          at_exit: Callable[[dict], None] | None = None) -> dict[str, Any]:
    """Run the loop; returns the run_end event. Rank 0 alone writes the bundle. `launched`:
    this process is a rank of `toymlx-launch` (its only one for `-n 1`, `world` None), whose
    stop signals arrive relayed (`RANK_SIGNALS`). `at_exit`: called with run_end where a second
    stop request during a step's evaluation ends the process at once (`_Loop._waiting`), in
    place of returning."""
    return _Loop(task, cfg, run_dir, world, resume, launched, at_exit).run(run_config)
