"""What a recipe and the training loop agree on: the options every recipe's `Config` derives
from (`TrainingOptions`, and `TrainConfig` with the run's own `RunOptions`), their checks before
anything is built (`check_config`), what a recipe's `build(cfg, ops)` returns (`Task`), and the
optimizer the options make (`make_optimizer`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
from mlx import nn

from toymlx.backend.files import counted
from toymlx.bundle.options import RunOptions, flag_name
from toymlx.bundle.reporters import parse_report_to, report_names
from toymlx.models.checks import ArgsError, field_name
from toymlx.training.optimizers import AdamW
from toymlx.training.schedule import lr_at


@dataclass
class TrainingOptions:
    """What the shared training loop trains (every recipe has them): a resume keeps them,
    but for --steps, which may extend the run."""

    steps: int = 200
    """Optimizer steps to train for (the schedule's length)."""
    batch_size: int = 16
    """Sequences or images per micro-batch (global, over all data-parallel ranks)."""
    grad_accum: int = 1
    """Micro-batches per optimizer step, their gradients averaged as one batch of
    --batch-size x --grad-accum rows (over every scored token or image of the step)."""
    lr: float = 3e-3
    """Peak learning rate, reached after warm-up."""
    warmup: int = 20
    """Steps of linear warm-up from lr/warmup to lr (kept as given when longer than --steps,
    with a line saying the lr never reaches --lr)."""
    min_lr_ratio: float = 0.1
    """Floor of the cosine decay, as a fraction of lr."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay, on the arrays --weight-decay-scope names."""
    weight_decay_scope: Literal["matrices", "all"] = "matrices"
    """What AdamW's --weight-decay falls on: matrices (not norms, biases or DoRA magnitudes) or
    all (every trained array, as MLX's AdamW and mlx-lm's adamw decay)."""
    beta1: float = 0.9
    """AdamW first-moment decay."""
    beta2: float = 0.95
    """AdamW second-moment decay."""
    adam_eps: float = 1e-8
    """AdamW's (and the lora recipe's adam's) epsilon, added to the second moment's root (MLX's
    default; mlx-lm's optimizer_config eps)."""
    bias_correction: bool = False
    """Divide AdamW's (and lora's adam's) moments by 1 - beta^step (off: MLX's default, as
    mlx-lm trains unless its optimizer_config sets bias_correction)."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0 turns clipping off)."""
    eval_batches: int = 8
    """Most validation batches per pass (-1: every batch, mlx-lm's --val-batches -1)."""
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
    subnormals: Literal["flush", "keep"] = "flush"
    """flush: the CPU threads that compute a step treat subnormal floats (below 1.18e-38) as
    zero, as PyTorch's set_flush_denormal does (Intel CPUs compute on them 4-6x slower, with
    no visible change to the losses); keep: exact IEEE arithmetic."""


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


def preset_overrides(options: Any) -> dict[str, Any]:
    """The fields of a recipe's model `options` (cfg.model) that were given, over the preset's:
    every one but `preset` that is not None."""
    return {f.name: getattr(options, f.name) for f in dataclasses.fields(options)
            if f.name != "preset" and getattr(options, f.name) is not None}


def model_error(e: ArgsError, options: Any,
                more: dict[str, tuple[str, Any]] | None = None) -> ValueError:
    """A model's ArgsError as toymlx-train's flags name it: a field of the recipe's model
    `options` (cfg.model) by `flag_name`, one that another option sets by `more` ({field: (its
    flag, the value given or None)}: vit's image_size, --data.image-size), any other as the
    model names it; where the fault is of two fields, told of the one given, and a field of
    `options` not given, named beside it, as the preset's value."""
    flags = {f.name: (flag_name(f"model.{f.name}"), getattr(options, f.name))
             for f in dataclasses.fields(options)} | (more or {})
    given = {k for k, (_, v) in flags.items() if v is not None}
    preset = {f.name for f in dataclasses.fields(options)} - given - set(more or {})
    return ValueError(e.text(lambda f: flags[f][0] if f in flags else field_name(f), given,
                             preset))


def eval_batch_limit(eval_batches: int) -> int | None:
    """--eval-batches as the most validation batches a pass scores: None for -1, every batch
    (mlx-lm's --val-batches -1, which config.json then records as such)."""
    return None if eval_batches == -1 else eval_batches


def check_config(module: ModuleType, cfg: TrainConfig, new_run: bool = False,
                 given: Collection[str] = ()) -> None:
    """Every option checked up front, the shared ones here and the rest by the recipe's
    `validate`: ValueError naming the flag (for command-line input and config.json alike).
    `new_run`: also the recipe's `check_applies`, which refuses an option set where it does not
    apply (a saved run is opened as it was written), or given on the command line (`given`,
    its flags) at its default."""
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
        ("--adam-eps", cfg.adam_eps > 0, "> 0", cfg.adam_eps),
        ("--grad-clip", cfg.grad_clip >= 0, ">= 0", cfg.grad_clip),
        ("--eval-every", cfg.eval_every >= 0, ">= 0", cfg.eval_every),
        ("--report-every", cfg.report_every >= 0, ">= 0 (0: no report lines)", cfg.report_every),
        ("--eval-batches", cfg.eval_batches >= 1 or cfg.eval_batches == -1,
         ">= 1, or -1 (every validation batch)", cfg.eval_batches),
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
    # the flags' meaning before the packages: a --wandb-project meant for W&B is said first
    if new_run and cfg.wandb_project and "wandb" not in report_names(cfg.report_to):
        raise ValueError(f"--wandb-project: expected with --report-to wandb (it names that "
                         f"run's W&B project), found --report-to {cfg.report_to or 'none'}")
    parse_report_to(cfg.report_to)
    if hasattr(module, "validate"):
        module.validate(cfg)
    if new_run and hasattr(module, "check_applies"):
        module.check_applies(cfg, given)


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
    batch_widths: Callable[[range], np.ndarray] | None = None
    """steps -> the last axis of each step's `train_batch`, without building the batches, for
    a recipe whose batches differ in width (unpacked rows); None: every batch has one shape."""
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
    lr_fn: Callable[[int], Any] | None = None
    """The learning rate of optimizer step s (0-based) that `optimizer`'s schedule gives, for
    the step events (default: `lr_at` with the shared options)."""
    test_batches: list[dict[str, np.ndarray]] = field(default_factory=list)
    """Held-out test batches scored once when the run completes (an `eval` event with split
    "test"); empty: no test (a recipe fills it for `--test`)."""
    finish: Callable[[Path], dict[str, Any]] | None = None
    """After a completed run's final checkpoint (rank 0): write what the recipe makes of it in
    the run folder (the lora recipe's --fuse-at-end model); returns the `export` event's
    fields (its `path` relative to the run folder)."""
    export_later: Callable[[Path], str] | None = None
    """run folder -> the `toymlx-export` line that writes `finish`'s export of the finished
    run beside it, named (besides the resume) when a stop leaves the export undone."""
    memory: dict[str, Any] | None = None
    """The step's estimated peak against the memory available (`toymlx.memory.check_fits`),
    for run_start; None where the recipe makes no estimate."""


def check_batch_fits(batch_size: int, info: dict[str, Any]) -> None:
    """--batch-size against the training set a task reports (`Task.config_info`: a batch must
    fit in it), checked by the runner after `build`, and by vit-tiny as soon as its images are
    read. LoRA's rows are checked by the recipe as it reads them (`lora.check_train_batch`: the
    file they came from, the examples packed into them)."""
    if "train_tokens" in info and "seq_len" in info:
        n = (info["train_tokens"] - 1) // info["seq_len"]
        what = (f"{counted(n, 'window')} of --seq-len {info['seq_len']} in "
                f"{info['train_tokens']} tokens")
    elif "train_images" in info:
        n, what = info["train_images"], counted(info["train_images"], "image")
    else:
        return
    if batch_size > n:
        raise ValueError(f"--batch-size: expected at most {n} (the training split of "
                         f"{info.get('data_source', 'the data')} holds {what}), found "
                         f"{batch_size}; use --batch-size {n} or less, or more data")


def warmup_note(cfg: TrainConfig) -> str | None:
    """One line when --warmup (given, or the recipe's default) is not shorter than --steps, None
    otherwise: the lr never reaches --lr (longer), or reaches it at the last update and never
    decays (as long). The warm-up is kept as given, as mlx-lm's and nanoGPT's schedules keep
    theirs (a pure function of the step that a longer run, or a resume with more --steps,
    continues), and said. A default is said as the recipe's (`--steps 4` of lora, whose default
    --warmup 10 the user may not know, trained at a rising lr throughout, silently)."""
    if cfg.warmup < cfg.steps:
        return None
    default = next(f.default for f in dataclasses.fields(cfg) if f.name == "warmup")
    warmup = f"--warmup {cfg.warmup}" + (" (the recipe's default)" if cfg.warmup == default
                                         else "")
    if cfg.warmup == cfg.steps:
        return (f"{warmup} is as long as --steps {cfg.steps}: the learning rate reaches --lr "
                f"{cfg.lr:g} only at the last step and never decays; lower --warmup for a "
                "decay")
    return (f"{warmup} is longer than --steps {cfg.steps}: the learning rate is still warming "
            f"up when the run ends ({cfg.steps}/{cfg.warmup} of the way) and never reaches --lr "
            f"{cfg.lr:g}; lower --warmup to reach it")


def half_precision_note(dtype: str, gpu: bool) -> str | None:
    """One line when --dtype asks for half precision on the CPU, None otherwise: MLX's
    bfloat16/float16 CPU kernels have no BLAS, and a step runs ~20x slower than in float32
    (docs/RESULTS.md, r-cpu-half), which nothing else would say. Kept as asked (a user may
    want the GPU's numerics on a CPU), and said, as warmup_note says its case."""
    if gpu or dtype not in ("bfloat16", "float16"):
        return None
    return (f"--dtype {dtype} on the CPU: MLX computes half precision there without BLAS, "
            f"~20x slower a step than float32; --dtype auto (float32 on the CPU) trains faster")


def decayed(cfg: TrainingOptions) -> Callable[[str, Any], bool]:
    """Whether AdamW's weight decay falls on a trained array (path, array), as
    --weight-decay-scope says: a matrix (ndim >= 2), or any."""
    if cfg.weight_decay_scope == "all":
        return lambda path, w: True
    return lambda path, w: w.ndim >= 2


def make_optimizer(cfg: TrainConfig, lr: Callable[[Any], Any] | None = None) -> optim.Optimizer:
    """AdamW (`toymlx.training.optimizers`: MLX's, updating in place) with decoupled weight
    decay on the arrays --weight-decay-scope names (`decayed`; the other group is empty under
    all, so that the optimizer state has one layout); the learning rate `lr` of the step
    (default: warm-up + cosine, `lr_at`)."""
    sched = lr or partial(lr_at, base_lr=cfg.lr, warmup=cfg.warmup, total=cfg.steps,
                          min_ratio=cfg.min_lr_ratio)
    kw = {"learning_rate": sched, "betas": [cfg.beta1, cfg.beta2], "eps": cfg.adam_eps,
          "bias_correction": cfg.bias_correction}
    decay = AdamW(weight_decay=cfg.weight_decay, **kw)
    no_decay = AdamW(weight_decay=0.0, **kw)
    return optim.MultiOptimizer([decay, no_decay], [decayed(cfg)])
