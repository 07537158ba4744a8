"""Run-bundle folders: naming, creation checks, the saved config, and resume lookup."""

from __future__ import annotations

import dataclasses
import json
import os
import time
import typing
from pathlib import Path
from typing import Any

CONFIG_FILE = "config.json"


class RunError(ValueError):
    """A run folder that cannot be used as asked; one line naming the path."""


def default_run_id(recipe: str) -> str:
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{recipe}"


def prepare_run_dir(root: str, run_id: str, overwrite: bool) -> Path:
    """Create runs/<id>, failing before any training if it exists or cannot be written."""
    root_p = Path(root)
    if "/" in run_id or run_id in ("", ".", ".."):
        raise RunError(f"--run-id: expected a single folder name, found {run_id!r}")
    run_dir = root_p / run_id
    if run_dir.exists() and any(run_dir.iterdir()):
        if not overwrite:
            raise RunError(f"{run_dir}: run bundle already exists; pass --resume {run_dir} to "
                           "continue it, --overwrite to replace it, or choose another --run-id")
        import shutil

        shutil.rmtree(run_dir)
    try:
        (run_dir / "weights").mkdir(parents=True, exist_ok=True)
        probe = run_dir / ".write-test"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as e:
        raise RunError(f"{run_dir}: runs folder: expected writable, found "
                       f"{e.strerror or e}; choose another --runs-root") from None
    return run_dir


def config_to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def config_from_dict(cls: type, d: dict[str, Any]) -> Any:
    """Rebuild a (nested) config dataclass from `config_to_dict` output; unknown keys fail."""
    hints = typing.get_type_hints(cls)
    kw = {}
    names = {f.name for f in dataclasses.fields(cls)}
    for k, v in d.items():
        if k not in names:
            raise RunError(f"saved config: key {k!r}: expected one of {sorted(names)}, "
                           "found an unknown key (was it written by another toymlx version?)")
        t = hints[k]
        if dataclasses.is_dataclass(t) and isinstance(v, dict):
            v = config_from_dict(t, v)
        elif isinstance(v, list):
            v = tuple(v) if typing.get_origin(t) is tuple else v
        kw[k] = v
    return cls(**kw)


def save_config(run_dir: Path, recipe: str, cfg: Any) -> None:
    tmp = run_dir / f".{CONFIG_FILE}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps({"recipe": recipe, "config": config_to_dict(cfg)}, indent=2,
                              ensure_ascii=False))
    os.replace(tmp, run_dir / CONFIG_FILE)


def load_config(run_dir: str | os.PathLike) -> tuple[str, dict[str, Any]]:
    """(recipe, config dict) saved when the run started."""
    p = Path(run_dir) / CONFIG_FILE
    if not Path(run_dir).is_dir():
        raise RunError(f"{run_dir}: --resume: expected a run bundle folder, found "
                       f"{'a file' if Path(run_dir).exists() else 'nothing'}")
    try:
        saved = json.loads(p.read_text())
        return saved["recipe"], saved["config"]
    except (OSError, ValueError, KeyError) as e:
        raise RunError(f"{p}: --resume: expected the run's saved config, found "
                       f"{type(e).__name__}: {e}") from None


def check_resume(run_dir: str | os.PathLike, recipe: str, model_info: dict[str, Any]) -> None:
    """RunError unless the bundle was trained by `recipe` with this model shape."""
    from toymlx.events import read_events

    saved_recipe, _ = load_config(run_dir)
    if saved_recipe != recipe:
        raise RunError(f"{run_dir}: --resume: expected a run of recipe {recipe!r}, found a "
                       f"{saved_recipe!r} run")
    start = next((e for e in read_events(run_dir) if e["kind"] == "run_start"), None)
    if start is None:  # nothing recorded: the checkpoint load still checks every shape
        return
    was = {k: v for k, v in start.get("model", {}).items() if k not in ("n_params", "n_trainable")}
    now = json.loads(json.dumps(model_info, default=str))
    for k in sorted(set(was) | set(now)):
        if was.get(k) != now.get(k):
            raise RunError(f"{run_dir}: --resume: model {k}: expected {was.get(k)!r} (the run's), "
                           f"found {now.get(k)!r}; a resumed run keeps its model (start a new "
                           "run to change it)")
