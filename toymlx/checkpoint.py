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
from pathlib import Path
from typing import Any, Callable

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
        mx.save_safetensors(str(tmp), arrays, metadata={"toy": json.dumps(meta)})
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def load_state(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    import mlx.core as mx

    if not path.exists():
        raise FileNotFoundError(f"{path}: resume state: expected present beside the checkpoint, "
                                "found missing")
    arrays, meta = mx.load(str(path), return_metadata=True)
    return arrays, json.loads(meta["toy"])


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
