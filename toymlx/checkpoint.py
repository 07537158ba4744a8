"""Checkpoint files in a run bundle: atomic writes, the `latest` link, and resume state.

Layout under `runs/<id>/weights/`: `<prefix><step>.gguf` (the model or adapter), beside it
`<prefix><step>.state.safetensors` (optimizer moments, random state, step) for exact resume,
and `latest`, a relative symlink to the newest GGUF. The state is written before the GGUF and
the link is swapped last, each by rename, so at any instant `latest` names a complete file
whose state is also complete.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from toymlx.gguf.writer import fsync_dir

LATEST = "latest"


def state_path(ckpt: Path) -> Path:
    return ckpt.with_name(ckpt.name[: -len(".gguf")] + ".state.safetensors")


def update_latest(weights: Path, target: Path) -> None:
    """Point `weights/latest` at `target` (relative), replacing it atomically."""
    tmp = weights / f".{LATEST}.tmp-{os.getpid()}"
    tmp.unlink(missing_ok=True)
    os.symlink(target.name, tmp)
    os.replace(tmp, weights / LATEST)
    fsync_dir(weights)


def save_state(path: Path, arrays: dict[str, Any], meta: dict[str, Any]) -> None:
    """Write resume state atomically (safetensors: arrays plus a JSON metadata string)."""
    import mlx.core as mx

    tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}.safetensors")
    try:
        # Through a Python file, so a full disk raises OSError(ENOSPC) like every other
        # write of the bundle (MLX's own file writer raises a bare RuntimeError).
        with open(tmp, "wb") as f:
            mx.save_safetensors(f, arrays, metadata={"toy": json.dumps(meta)})
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class ResumeError(ValueError):
    """A checkpoint or its resume state that cannot continue this run; one line naming it."""


def load_state(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    import mlx.core as mx

    if not path.exists():
        raise ResumeError(f"{path}: resume state: expected present beside the checkpoint, "
                          "found missing")
    try:
        arrays, meta = mx.load(str(path), return_metadata=True)
        return arrays, json.loads(meta["toy"])
    except (ValueError, RuntimeError, KeyError) as e:
        raise ResumeError(f"{path}: resume state: expected a toymlx state file, found "
                          f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                          ) from None


def load_checked(load: Callable[[Path, Any], None], path: Path, model: Any) -> None:
    """`load(path, model)` for resume, then ResumeError unless every parameter kept its shape.

    Recipes load with `strict=False` (MLX then checks no shapes), so a checkpoint of another
    shape would otherwise slip in and fail later inside a matmul, naming no file.
    """
    from mlx.utils import tree_flatten

    before = {k: tuple(v.shape) for k, v in tree_flatten(model.parameters())}
    try:
        load(path, model)
    except ValueError as e:  # GGUFError and friends already name the file
        raise ResumeError(str(e) if str(path) in str(e) else f"{path}: {e}") from None
    after = {k: tuple(v.shape) for k, v in tree_flatten(model.parameters())}
    for k, shape in before.items():
        if after.get(k) != shape:
            raise ResumeError(f"{path}: parameter {k!r} shape: expected {shape} (this run's "
                              f"model), found {after.get(k)}; was the model shape changed on "
                              "--resume?")


def save_checkpoint(weights: Path, prefix: str, step: int, write: Callable[[Path], None],
                    state_arrays: dict[str, Any], state_meta: dict[str, Any]) -> Path:
    """State, then model file, then link: the order that keeps `latest` always valid."""
    weights.mkdir(parents=True, exist_ok=True)
    ckpt = weights / f"{prefix}{step}.gguf"
    save_state(state_path(ckpt), state_arrays, state_meta)
    write(ckpt)
    update_latest(weights, ckpt)
    return ckpt


def resolve_latest(run_dir: str | os.PathLike) -> Path:
    """The GGUF that `run_dir/weights/latest` names (or the run dir's newest if no link)."""
    run_dir = Path(run_dir)
    weights = run_dir / "weights"
    link = weights / LATEST
    if link.is_symlink() or link.exists():
        target = link.resolve()
        if not target.exists():
            raise FileNotFoundError(f"{link}: expected a link to an existing checkpoint, "
                                    f"found a dangling link to {os.readlink(link)}")
        return target
    found = list_checkpoints(weights)
    if not found:
        raise FileNotFoundError(f"{run_dir}: expected a run bundle with weights/latest, "
                                "found no checkpoint")
    return found[-1][1]


def list_checkpoints(weights: Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint in `weights`, oldest first."""
    out = []
    for p in weights.glob("*.gguf") if weights.is_dir() else []:
        m = re.fullmatch(r"(?:\w+?_)?step_(\d+)\.gguf", p.name)
        if m:
            out.append((int(m.group(1)), p))
    return sorted(out)


def clean_temporaries(weights: Path) -> int:
    """Remove files a killed writer left behind; return how many."""
    n = 0
    for p in weights.glob(".*.tmp-*") if weights.is_dir() else []:
        p.unlink(missing_ok=True)
        n += 1
    return n
