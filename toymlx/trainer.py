"""The training loop every recipe shares, around one compiled step.

A recipe builds a `Task` (model, loss, batches, how to save and load a checkpoint); `train`
runs it: one `mx.compile`d `value_and_grad` step with the model, optimizer and random state
as its declared state (on a multi-core CPU: the same, one compiled `value_and_grad` per
MLX CPU stream on a slice of each micro-batch, see `make_step`), gradient accumulation over a
leading micro-batch axis, data-parallel gradient sums over `mx.distributed` ranks, warm-up +
cosine LR, clipping, periodic validation, checkpoints on a schedule and at the end, and the
run bundle's events.
"""

from __future__ import annotations

import math
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Literal

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
from mlx import nn
from mlx.utils import tree_flatten, tree_unflatten

from toymlx import checkpoint as ck
from toymlx import cpu_streams, device
from toymlx.device import backend_info
from toymlx.events import EventLog, git_info, host_info
from toymlx.schedule import lr_at
from toymlx.step import LossScale, make_step


@dataclass
class TrainConfig:
    """Options of the shared training loop (every recipe has them)."""

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
    eval_every: int = 50
    """Steps between validation passes (0: only at the end)."""
    eval_batches: int = 8
    """Most validation batches per pass."""
    checkpoint_every: int = 100
    """Steps between GGUF checkpoints (0: only the final one)."""
    seed: int = 0
    """Seed for initialisation, data order and dropout."""
    compile: bool = True
    """Run the step under mx.compile (--no-compile: eager, same losses)."""
    device: Literal["auto", "gpu", "cpu"] = "auto"
    """Where MLX runs: auto picks the GPU when MLX has one."""
    runs_root: str = "runs"
    """Folder that holds run bundles."""
    run_id: str | None = None
    """Name of this run's bundle (default: timestamp + recipe)."""
    resume: str | None = None
    """Continue the run bundle at this path from its latest checkpoint."""
    overwrite: bool = False
    """Allow replacing an existing run bundle with the same run id."""
    stop_at: int | None = None
    """Stop (checkpointed, resumable) after this step, as if interrupted."""
    progress: bool = True
    """Show a progress bar."""
    cpu_streams: int = 0
    """MLX CPU streams that each run a slice of every micro-batch in parallel, with the BLAS
    threads shared out between them (MLX runs elementwise work on one thread per stream).
    0: auto (2 where MLX computes on a CPU with 2+ cores and toymlx controls its BLAS
    threads, else 1)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Activations' dtype: auto is bfloat16 on a GPU and float32 on the CPU (MLX's half
    precision CPU kernels are ~25x slower). Trainable weights and AdamW's moments stay
    float32; float16 trains with a dynamic loss scale."""
    save_dtype: Literal["f32", "f16", "bf16"] = "f32"
    """Tensor type of the matrices in checkpoint GGUFs (norms stay F32); with f16/bf16 the
    resume state also keeps the float32 weights, so resume stays exact."""
    grad_checkpoint: bool = False
    """Recompute each block's activations in the backward pass instead of keeping them: less
    memory for long sequences, about one more forward pass of time."""
    kernels: Literal["auto", "mlx", "vectorised"] = "auto"
    """Whose elementwise kernels the model trains with: auto is toymlx's vectorised CPU forms
    (toymlx.fastmath) for float32 on the CPU, MLX's own elsewhere."""


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


def make_optimizer(cfg: TrainConfig) -> optim.Optimizer:
    sched = partial(lr_at, base_lr=cfg.lr, warmup=cfg.warmup, total=cfg.steps,
                    min_ratio=cfg.min_lr_ratio)
    kw = {"learning_rate": sched, "betas": [cfg.beta1, cfg.beta2], "eps": 1e-8}
    decay = optim.AdamW(weight_decay=cfg.weight_decay, **kw)
    no_decay = optim.AdamW(weight_decay=0.0, **kw)
    return optim.MultiOptimizer([decay, no_decay], [lambda path, w: w.ndim >= 2])


def evaluate(task: Task, max_batches: int | None = None) -> dict[str, float]:
    """Validation metrics over the task's held-out batches (count-weighted)."""
    totals: dict[str, float] = {}
    fn = task.metrics_fn or _loss_metrics(task.loss_fn)
    for b in task.val_batches[:max_batches]:
        for i in range(next(iter(b.values())).shape[0]):  # the leading micro-batch axis
            sums = fn(task.model, {k: mx.array(v[i]) for k, v in b.items()})
            mx.eval(sums)
            for k, v in sums.items():
                totals[k] = totals.get(k, 0.0) + float(v.item())
    n = totals.pop("n", 0.0) or 1.0
    out = {("val_loss" if k == "loss" else k): v / n for k, v in totals.items()}
    return out


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


class _Stop(Exception):
    pass


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


def train(task: Task, cfg: TrainConfig, run_dir: Path, run_config: dict[str, Any],
          world: Any = None, resume_from: Path | None = None) -> dict[str, Any]:
    """Run the loop; returns the run_end event. Rank 0 alone writes the bundle."""
    rank0 = world is None or world.rank() == 0
    model = task.model
    weights = run_dir / "weights"
    log = EventLog(run_dir / "events.jsonl", enabled=rank0)
    device.setup_process(wide_evaluation=not cfg.grad_checkpoint)
    optimizer = (task.optimizer or make_optimizer)(cfg)
    optimizer.init(model.trainable_parameters())
    # float16 gradients underflow without a loss scale (see LossScale)
    scale = LossScale() if model.ops.dtype == "float16" else None
    start_step = 0
    if resume_from is not None:
        ck.load_checked(task.load, resume_from, model)
        arrays, meta = ck.load_state(ck.state_path(resume_from))
        restore_resume_arrays(arrays, optimizer, scale, model)
        start_step = int(meta["step"])
        if rank0:
            ck.clean_temporaries(weights)
    mx.eval(model.parameters(), optimizer.state)
    n_trainable = sum(v.size for _, v in tree_flatten(model.trainable_parameters()))
    n_total = sum(v.size for _, v in tree_flatten(model.parameters()))

    step_fn, n_streams = training_step(model, task.loss_fn, optimizer, cfg, world, scale)
    step_threads = cpu_streams.step_blas_threads(n_streams)
    log.emit("run_start", run_id=run_dir.name, recipe=task.recipe, host=host_info(),
             backend=backend_info(),
             math=model.ops.describe(), git=git_info(), step_parallelism={"cpu_streams": n_streams,
                                               "blas_threads": step_threads
                                               or device.blas_threads()},
             model={**task.model_info, "n_params": n_total,
                                    "n_trainable": n_trainable},
             config={**run_config, **task.config_info},
             world_size=1 if world is None else world.size(),
             resumed_from=None if resume_from is None else str(resume_from),
             start_step=start_step)

    last_ckpt = start_step if resume_from is not None else None
    state = {"step": start_step}

    def write_ckpt(step: int) -> Path | bool | None:
        """The checkpoint of `step`; False (and reason "diverged") if its weights are bad."""
        nonlocal last_ckpt, reason, exit_code, message
        if last_ckpt == step:
            return None
        # A finite loss does not prove finite weights: the update after it can overflow
        # (huge lr times weight decay). Bad weights are never written.
        if not _finite(model):
            reason, exit_code = "diverged", 2
            message = (f"weights became non-finite at step {step}; stopped without "
                       f"checkpointing them; last good checkpoint: {_named(last_ckpt)}")
            state["step"] = step - 1
            return False
        if not rank0:
            return None
        arrays = resume_arrays(optimizer, scale, model, exact_weights=cfg.save_dtype != "f32")
        extra = {"general.step": step, "general.run_id": run_dir.name}
        if task.checkpoint_meta:
            extra.update(task.checkpoint_meta())
        path = ck.save_checkpoint(weights, task.prefix, step,
                                  lambda p: task.save(p, model, extra),
                                  arrays, {"step": step, "recipe": task.recipe})
        last_ckpt = step
        log.emit("checkpoint", step=step, path=str(path.relative_to(run_dir)))
        return path

    mid_step = [False]  # True while the weights are between two steps
    pending: list[int] = []

    def on_sigterm(signum, frame):
        # Mid-step the weights are already (lazily) the next step's: let the step finish and
        # stop at its end, so the final checkpoint holds exactly the step it is named after.
        # A second signal stops at once.
        if mid_step[0] and not pending:
            pending.append(signum)
            return
        raise KeyboardInterrupt

    # Data parallel: a rank blocked in an all_sum whose peer died never returns to Python, so
    # a Python handler would never run and mlx.launch would wait on it forever; keep SIGTERM's
    # default (exit) there and leave a torn bundle that --resume continues.
    solo = world is None or world.size() == 1
    old_term = signal.signal(signal.SIGTERM, on_sigterm) if rank0 and solo else None
    old_int = signal.signal(signal.SIGINT, on_sigterm) if rank0 and solo else None
    bar = None
    if rank0 and cfg.progress:
        from tqdm import tqdm

        bar = tqdm(total=cfg.steps, initial=start_step, desc=task.recipe, unit="step",
                   dynamic_ncols=True, file=sys.stderr)
    reason, message, exit_code = "completed", None, 0
    t_first = None
    last_eval: dict[str, float] = {}
    try:
        count = task.count or (lambda b: int(np.prod(next(iter(b.values())).shape[:2])))
        for s in range(start_step, cfg.steps):
            t0 = time.perf_counter()
            global_batch = task.train_batch(s)
            n_items = count(global_batch)
            batch = {k: mx.array(v) for k, v in _shard(global_batch, world).items()}
            # Randomness (dropout) is a pure function of (seed, step), like the data, so a
            # resumed run draws exactly what an uninterrupted one would.
            mx.random.seed(step_seed(cfg.seed, s))
            mid_step[0] = True
            out = step_fn(batch)
            with device.use_blas_threads(step_threads):
                mx.eval(out, model.state, optimizer.state)
            dt = time.perf_counter() - t0
            t_first = t_first if t_first is not None else dt
            loss_v, gnorm_v = float(out["loss"].item()), float(out["grad_norm"].item())
            # float16: an overflowing step was skipped (nothing changed but the loss scale)
            scaled = {"loss_scale": float(out["loss_scale"].item()),
                      "skipped": bool(out["skipped"].item())} if scale is not None else {}
            state["step"] = s + 1
            mid_step[0] = False
            lr = lr_at(s, cfg.lr, cfg.warmup, cfg.steps, cfg.min_lr_ratio)
            # A non-finite gradient norm with a finite loss has already made the update NaN
            # (unless the loss scale skipped that update).
            checked = (("loss", loss_v),) if scaled.get("skipped") else (
                ("loss", loss_v), ("gradient norm", gnorm_v))
            bad = next(((w, v) for w, v in checked if not math.isfinite(v)), None)
            if bad is not None:
                reason, exit_code = "diverged", 2
                message = (f"{bad[0]} became {bad[1]} at step {s + 1} (lr {lr:.3g}); stopped "
                           f"without checkpointing the bad weights; last good checkpoint: "
                           f"{_named(last_ckpt)}")
                state["step"] = s  # the weights of step s+1 are bad
                raise _Stop
            rate = n_items / dt
            log.emit("step", step=s + 1, loss=loss_v, lr=lr, grad_norm=gnorm_v, **scaled,
                     **{f"{task.unit}_per_s": round(rate, 2), "step_time_s": round(dt, 4)})
            if bar is not None:
                acc = f" val_acc {last_eval['accuracy']:.3f}" if "accuracy" in last_eval else ""
                bar.set_postfix_str(f"loss {loss_v:.4f}{acc} lr {lr:.2e} "
                                    f"{rate:,.0f} {task.unit}/s")
                bar.update(1)
            done = s + 1
            if (cfg.eval_every and done % cfg.eval_every == 0) or done == cfg.steps:
                metrics = evaluate(task, cfg.eval_batches)
                last_eval = metrics
                log.emit("eval", step=done, **metrics)
                if bar is not None:
                    bar.write(f"step {done}: " + ", ".join(f"{k} {v:.4f}"
                                                           for k, v in metrics.items()))
            due = cfg.checkpoint_every and done % cfg.checkpoint_every == 0
            if due and write_ckpt(done) is False:
                raise _Stop
            if pending:
                raise KeyboardInterrupt
            if cfg.stop_at is not None and done >= cfg.stop_at and done < cfg.steps:
                reason = "stopped"
                raise _Stop
        if write_ckpt(state["step"]) is False:
            raise _Stop
    except _Stop:
        if reason == "stopped":
            write_ckpt(state["step"])
    except KeyboardInterrupt:
        reason, exit_code = "interrupted", 130
        if mid_step[0]:  # the weights belong to no step: keep the last checkpoint
            message = (f"interrupted during step {state['step'] + 1} (its update is dropped); "
                       f"resume with --resume {run_dir} from {_named(last_ckpt)}")
        else:
            message = f"interrupted after step {state['step']}; resume with --resume {run_dir}"
            write_ckpt(state["step"])
    except Exception as e:
        reason, exit_code = "error", 1
        message = f"{type(e).__name__}: {e}"
        log.emit("run_end", reason=reason, final_step=state["step"],
                 final_loss=log.loss_at(state["step"]), exit_code=exit_code, message=message)
        log.close()
        raise
    finally:
        if bar is not None:
            bar.close()
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)
        if old_int is not None:
            signal.signal(signal.SIGINT, old_int)
    end = log.emit("run_end", reason=reason, final_step=state["step"],
                   final_loss=log.loss_at(state["step"]), exit_code=exit_code, message=message,
                   first_step_s=t_first, peak_memory_mb=round(mx.get_peak_memory() / 2**20, 1))
    log.close()
    return end
