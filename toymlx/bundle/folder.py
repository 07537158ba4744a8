"""A run folder: created and owned for a fresh run (`prepare_run_dir`, its lock), its
config.json written once (`save_config`) and read back as saved (`read_config`)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import Any

from toymlx.backend import atomic
from toymlx.backend.lock import LOCK_FILE, Lock, acquire
from toymlx.bundle import checkpoint as ck
from toymlx.bundle.inputs import DATA_FILES_KEY, MODEL_FILES_KEY, data_files, model_files
from toymlx.bundle.options import RunError, found_text

CONFIG_FILE = "config.json"
CONFIG_KEYS = frozenset({"format", "recipe", "config", DATA_FILES_KEY, MODEL_FILES_KEY})
"""Every top-level key of config.json (`save_config`)."""


def lock_run(run_dir: Path) -> Lock:
    """Own the bundle for this process's life (LockHeld naming the owner if another has it)."""
    return acquire(run_dir / LOCK_FILE, f"{run_dir}: run bundle")


def prepare_run_dir(root: str, run_id: str, overwrite: bool) -> tuple[Path, Lock]:
    """Create and own runs/<id> for a fresh start, failing before any training if another
    process owns it, if it holds a run (unless `overwrite`), or if it cannot be written."""
    if "/" in run_id or run_id in ("", ".", ".."):
        raise RunError(f"--run-id: expected a single folder name, found {run_id!r}")
    run_dir = Path(root) / run_id
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        lock = lock_run(run_dir)
    except OSError as e:
        raise RunError(f"{run_dir}: runs folder: expected writable, found "
                       f"{e.strerror or e}; choose another --runs-root") from None
    try:
        held = [p for p in run_dir.iterdir() if p.name != LOCK_FILE]
        if held and not overwrite:
            hint = ("" if ck.list_checkpoints(run_dir / "weights")
                    else f" (--resume {run_dir} --from step_0 to start it over)")
            raise RunError(f"{run_dir}: run bundle already exists; pass --resume {run_dir} to "
                           f"continue it{hint}, --overwrite to replace it, or choose another "
                           "--run-id")
        for p in held:  # --overwrite: we own the folder, so nobody is writing into it
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
        (run_dir / "weights").mkdir(exist_ok=True)
        atomic.write_bytes(run_dir / ".write-test", b"ok")
        (run_dir / ".write-test").unlink()
    except OSError as e:
        lock.release()
        raise RunError(f"{run_dir}: runs folder: expected writable, found "
                       f"{e.strerror or e}; choose another --runs-root") from None
    except BaseException:
        lock.release()
        raise
    return run_dir, lock


CONFIG_FORMAT = 4
"""config.json's `format`. 2 (toymlx 0.2 on): every option is written, so a missing key is
damage and refused. A config.json without `format` (written before) is read as it was then: an
option it lacks (one added since) takes its default, which keeps the old behaviour. An option
added from now on must bump this and be let off for older formats in `ADDED_IN`."""
ADDED_IN = {3: ("report_every",), 4: ("report_to", "optimizer", "lr_schedule", "lr_schedule_args",
                                                  "warmup_init")}
"""format -> the top-level options it added: a config.json of an older format (2 on) lacks
them, and they take their defaults there (the training those runs had: toymlx's AdamW and
schedule, no reporters)."""


def added_since(fmt: int) -> frozenset[str]:
    """The options a config.json of format `fmt` was written without (`ADDED_IN`)."""
    return frozenset(k for f, keys in ADDED_IN.items() if fmt < f for k in keys)


def save_config(run_dir: Path, recipe: str, cfg: Any) -> None:
    """Write config.json (once, when the run starts): the recipe, every option as given, and
    the absolute file and fingerprint of each data and model file the options name."""
    atomic.write_text(run_dir / CONFIG_FILE, json.dumps(
        {"format": CONFIG_FORMAT, "recipe": recipe, "config": dataclasses.asdict(cfg),
         DATA_FILES_KEY: data_files(cfg), MODEL_FILES_KEY: model_files(cfg)}, indent=2,
        ensure_ascii=False))



def read_config(run_dir: Path, flag: str) -> dict[str, Any]:
    """config.json as saved, checked for shape (not yet types): recipe, config, data_files."""
    p = run_dir / CONFIG_FILE
    if not run_dir.is_dir():
        raise RunError(f"{run_dir}: {flag}: expected a run bundle folder, found "
                       f"{'a file' if run_dir.exists() else 'nothing'}")
    try:
        saved = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise RunError(f"{p}: {flag}: expected the run's saved config, found no file (a run "
                       "folder of toymlx-train has one)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise RunError(f"{p}: expected a readable UTF-8 file, found {e}") from None
    except json.JSONDecodeError as e:
        raise RunError(f"{p}: expected JSON, found {e.msg} at line {e.lineno} column "
                       f"{e.colno}") from None
    if not isinstance(saved, dict) or not isinstance(saved.get("config"), dict):
        raise RunError(f"{p}: expected an object with \"recipe\" and \"config\" keys, found "
                       f"{found_text(saved)}")
    if not isinstance(saved.get("recipe"), str):
        raise RunError(f"{p}: key 'recipe': expected a recipe name, found "
                       f"{found_text(saved.get('recipe'))}")
    if not isinstance(saved.get(DATA_FILES_KEY, {}), dict):
        raise RunError(f"{p}: key {DATA_FILES_KEY!r}: expected an object, found "
                       f"{found_text(saved[DATA_FILES_KEY])}")
    return saved


def saved_config(run_dir: str | os.PathLike) -> dict[str, Any] | None:
    """config.json as saved, unchecked, or None where there is none or it is not an object
    with a "config" object: for a summary of a bundle that `Bundle.open` refuses (toymlx-report
    shows what it can of a damaged run). Everything else opens bundles with `Bundle.open`."""
    try:
        saved = json.loads((Path(run_dir) / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        return None
    return saved if isinstance(saved, dict) and isinstance(saved.get("config"), dict) else None
