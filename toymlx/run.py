"""From a parsed config to a finished run: checks, device, run folder, task, loop."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from toymlx.device import on_gpu
from toymlx.models.ops import Ops, training_ops
from toymlx.trainer import TrainConfig


def validate_train_config(cfg: TrainConfig) -> None:
    """Every shared option checked up front; ValueError names the flag."""
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
        ("--eval-batches", cfg.eval_batches >= 1, ">= 1", cfg.eval_batches),
        ("--checkpoint-every", cfg.checkpoint_every >= 0, ">= 0", cfg.checkpoint_every),
        ("--seed", cfg.seed >= 0, ">= 0", cfg.seed),
        ("--cpu-streams", cfg.cpu_streams >= 0, ">= 0 (0: auto)", cfg.cpu_streams),
    ]
    for flag, ok, want, found in checks:
        if not ok:
            raise ValueError(f"{flag}: expected {want}, found {found}")
    if cfg.stop_at is not None and cfg.stop_at < 1:
        raise ValueError(f"--stop-at: expected >= 1, found {cfg.stop_at}")


def check_batch_fits(batch_size: int, info: dict[str, Any]) -> None:
    """--batch-size against the training set the task reports (a batch must fit in it)."""
    if "train_tokens" in info and "seq_len" in info:
        n = (info["train_tokens"] - 1) // info["seq_len"]
        what = f"{n} windows of --seq-len {info['seq_len']} in {info['train_tokens']} tokens"
    elif "train_rows" in info:
        n, what = info["train_rows"], f"{info['train_rows']} rows"
    elif "train_images" in info:
        n, what = info["train_images"], f"{info['train_images']} images"
    else:
        return
    if batch_size > n:
        raise ValueError(f"--batch-size: expected at most {n} (the training split of "
                         f"{info.get('data_source', 'the data')} holds {what}), found "
                         f"{batch_size}; use a smaller --batch-size or more data")


def run_ops(cfg: TrainConfig) -> Ops:
    """The math a run's model computes with (`--dtype`, `--kernels`, `--grad-checkpoint` on the
    selected device): chosen here, once, and handed to the recipe's `build`."""
    return training_ops(on_gpu(), cfg.dtype, cfg.kernels, cfg.grad_checkpoint)


def init_distributed() -> Any:
    """The mx.distributed group when launched by mlx.launch with >1 ranks, else None."""
    if not any(k in os.environ for k in ("MLX_RANK", "OMPI_COMM_WORLD_SIZE", "MLX_HOSTFILE")):
        return None
    import mlx.core as mx

    world = mx.distributed.init()
    return world if world.size() > 1 else None


def run_training(recipe: str, module: ModuleType, cfg: TrainConfig) -> int:
    """Run one recipe with a parsed config; returns the process exit code."""
    from toymlx import checkpoint as ck
    from toymlx.device import select_device, setup_process
    from toymlx.models.ops import check_checkpointable
    from toymlx.runs import RunError, check_resume, prepare_run_dir, save_config
    from toymlx.trainer import train

    # before MLX evaluates anything; activation checkpointing wants MLX's narrow order
    setup_process(wide_evaluation=not cfg.grad_checkpoint)
    created: Path | None = None
    try:
        validate_train_config(cfg)
        if hasattr(module, "validate"):
            module.validate(cfg)
        select_device(cfg.device)
        ops = run_ops(cfg)
        world = init_distributed()
        rank0 = world is None or world.rank() == 0
        resume_from = None
        if cfg.resume:
            run_dir = Path(cfg.resume)
            resume_from = ck.resolve_latest(run_dir)
        else:
            run_id = cfg.run_id or _shared_run_id(recipe, world)
            if rank0:
                run_dir = prepare_run_dir(cfg.runs_root, run_id, cfg.overwrite)
                created = run_dir
            else:
                run_dir = Path(cfg.runs_root) / run_id
            cfg.run_id = run_id
        if rank0 and resume_from is None:
            save_config(run_dir, recipe, cfg)
        task = module.build(cfg, ops)
        if ops.grad_checkpoint:
            check_checkpointable(task.model)
        check_batch_fits(cfg.batch_size, task.config_info)
        if resume_from is not None:  # checked before config.json is replaced
            check_resume(run_dir, recipe, task.model_info)
            if rank0:
                save_config(run_dir, recipe, cfg)
    except (ValueError, OSError, KeyError) as e:
        if created is not None and not any(p.is_file() for p in created.rglob("*")
                                           if p.name != "config.json"):
            shutil.rmtree(created, ignore_errors=True)
        print(f"toymlx-train: error: {e}", file=sys.stderr)
        return 2
    try:
        end = train(task, cfg, run_dir, _public_config(cfg), world=world,
                    resume_from=resume_from)
    except (RunError, ck.ResumeError) as e:
        print(f"toymlx-train: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        try:
            kept = (f"earlier checkpoints are intact (weights/latest -> "
                    f"{os.readlink(run_dir / 'weights' / ck.LATEST)})")
        except OSError:
            kept = "no checkpoint was completed"
        print(f"toymlx-train: error: {run_dir}: could not write the run bundle ({e}); {kept}",
              file=sys.stderr)
        return 1
    if rank0:
        _final_line(task, run_dir, end)
    return int(end["exit_code"])


def _public_config(cfg: TrainConfig) -> dict[str, Any]:
    from toymlx.runs import config_to_dict

    d = config_to_dict(cfg)
    for k in ("progress",):
        d.pop(k, None)
    return d


def _shared_run_id(recipe: str, world: Any) -> str:
    """One default run id for all ranks: rank 0's clock, broadcast by an all_sum."""
    import time

    if world is None:
        return _unique(recipe)
    import mlx.core as mx

    t = int(time.time()) if world.rank() == 0 else 0
    t = int(mx.distributed.all_sum(mx.array(t, dtype=mx.int64), group=world).item())
    return f"{time.strftime('%Y%m%d-%H%M%S', time.localtime(t))}-{recipe}"


def _unique(recipe: str) -> str:
    from toymlx.runs import default_run_id

    return default_run_id(recipe)


def _final_line(task, run_dir: Path, end: dict) -> None:
    from toymlx.events import read_events

    evals = [e for e in read_events(run_dir) if e["kind"] == "eval"]
    last = evals[-1] if evals else {}
    figures = ", ".join(f"{k} {v:.4f}" for k, v in last.items()
                        if k not in ("kind", "t", "step") and isinstance(v, float))
    msg = f"{end['reason']} at step {end['final_step']}"
    if end.get("message"):
        msg += f": {end['message']}"
    print(f"toymlx: {msg}. held-out: {figures or 'n/a'}. bundle: {run_dir}", file=sys.stderr)
