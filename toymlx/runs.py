"""Run-bundle folders: naming, ownership, the saved config, and what a resume may change.

A bundle has one writer: the training process holds `<bundle>/.lock` (`toymlx.lock`) for its
life, so a second `toymlx-train` on the same bundle (a fresh start, `--overwrite`, `--resume`)
fails with one line naming the first. `config.json` is written once, when the run starts; it is
read back like any other input (every key checked against the recipe's options), and a resume
must not change it: the only option that may differ is `--steps` (recorded in the `resume`
event), besides the run-local ones in `RUN_LOCAL`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from toymlx import atomic
from toymlx import checkpoint as ck
from toymlx import events as ev
from toymlx.lock import LOCK_FILE, Lock, acquire

CONFIG_FILE = "config.json"
RUN_LOCAL = frozenset({
    "steps",  # extends (or shortens) the run; recorded in the resume event
    "resume", "from_step", "overwrite",  # which bundle and checkpoint to continue
    "stop_at", "progress",  # this process's stopping point and display
    "eval_every", "checkpoint_every", "keep_last", "keep_best",  # cadence and retention only
    "device", "compile", "cpu_streams", "grad_checkpoint",  # where and how the same math runs
    "fuse_at_end",  # what is written from the final weights, beside them
})
"""Options a resume may change: none of them changes what is trained. Any other option
(data, model, seed, batch, sequence length, schedule, optimizer, dtype, and any option added
later) must equal the saved one."""


class RunError(ValueError):
    """A run folder that cannot be used as asked; one line naming the path."""


def default_run_id(recipe: str) -> str:
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{recipe}"


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


def save_config(run_dir: Path, recipe: str, cfg: Any) -> None:
    """Write config.json (once, when the run starts)."""
    atomic.write_text(run_dir / CONFIG_FILE, json.dumps(
        {"recipe": recipe, "config": dataclasses.asdict(cfg)}, indent=2, ensure_ascii=False))


# ---- reading config.json back --------------------------------------------------------------
class _Mismatch(Exception):
    def __init__(self, expected: str):
        self.expected = expected


def _found(v: Any) -> str:
    kind = {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
            type(None): "null", int: "an integer", float: "a number"}.get(type(v), type(v).__name__)
    text = json.dumps(v)
    return f"{text if len(text) <= 40 else text[:37] + '...'} ({kind})"


def _coerce(t: Any, v: Any, key: str, source: str) -> Any:
    """`v` as the annotation `t` wants it; _Mismatch (what was expected) if it cannot be."""
    origin, args = typing.get_origin(t), typing.get_args(t)
    if origin in (typing.Union, types.UnionType):
        wants = []
        for a in args:
            try:
                return _coerce(a, v, key, source)
            except _Mismatch as m:
                wants.append(m.expected)
        raise _Mismatch(" or ".join(wants))
    if t is type(None):
        if v is None:
            return None
        raise _Mismatch("null")
    if origin is Literal:
        if any(v == a and type(v) is type(a) for a in args):
            return v
        raise _Mismatch("one of " + ", ".join(json.dumps(a) for a in args))
    if dataclasses.is_dataclass(t):
        if isinstance(v, dict):
            return config_from_dict(t, v, source, key + ".")
        raise _Mismatch("an object of options")
    if t is bool:
        if isinstance(v, bool):
            return v
        raise _Mismatch("true or false")
    if t is int:
        if isinstance(v, int) and not isinstance(v, bool):
            return v
        raise _Mismatch("an integer")
    if t is float:
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
        raise _Mismatch("a number")
    if t is str:
        if isinstance(v, str):
            return v
        raise _Mismatch("a string")
    if origin in (tuple, list):
        if not isinstance(v, list):
            raise _Mismatch("a list")
        inner = args[0] if args else Any
        items = [_coerce(inner, x, key, source) for x in v] if inner is not Any else list(v)
        return tuple(items) if origin is tuple else items
    return v


def config_from_dict(cls: type, d: dict[str, Any], source: str = "saved config",
                     prefix: str = "config.") -> Any:
    """Rebuild a (nested) config dataclass from its saved dict, every value checked against
    its field's type; RunError naming `source`, the key, the expected and the found value.
    Keys left out take their defaults (a bundle of an older toymlx lacks newer options)."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    kw = {}
    for k, v in d.items():
        if k not in names:
            raise RunError(f"{source}: key {prefix + k!r}: expected an option of this recipe, "
                           "found an unknown key (written for another recipe, or by a newer "
                           "toymlx?)")
        try:
            kw[k] = _coerce(hints[k], v, prefix + k, source)
        except _Mismatch as m:
            raise RunError(f"{source}: key {prefix + k!r}: expected {m.expected}, found "
                           f"{_found(v)}; fix it, or remove the key to take its default") from None
    return cls(**kw)


def saved_config(run_dir: str | os.PathLike) -> dict[str, Any] | None:
    """A run folder's config.json as saved (`recipe`, `config`, ...), or None where there is
    none or it is not such an object: for readers that then do without it (report, eval,
    generation). Resume reads it strictly, with one-line errors: `read_config`."""
    try:
        saved = json.loads((Path(run_dir) / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        return None
    return saved if isinstance(saved, dict) and isinstance(saved.get("config"), dict) else None


def read_config(run_dir: str | os.PathLike) -> tuple[str, dict[str, Any]]:
    """(recipe, config dict) saved when the run started, checked for shape (not yet types)."""
    run_dir = Path(run_dir)
    p = run_dir / CONFIG_FILE
    if not run_dir.is_dir():
        raise RunError(f"{run_dir}: --resume: expected a run bundle folder, found "
                       f"{'a file' if run_dir.exists() else 'nothing'}")
    try:
        saved = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise RunError(f"{p}: --resume: expected the run's saved config, found no file (a run "
                       "folder of toymlx-train has one)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise RunError(f"{p}: expected a readable UTF-8 file, found {e}") from None
    except json.JSONDecodeError as e:
        raise RunError(f"{p}: expected JSON, found {e.msg} at line {e.lineno} column "
                       f"{e.colno}") from None
    if not isinstance(saved, dict) or not isinstance(saved.get("config"), dict):
        raise RunError(f"{p}: expected an object with \"recipe\" and \"config\" keys, found "
                       f"{_found(saved)}")
    if not isinstance(saved.get("recipe"), str):
        raise RunError(f"{p}: key 'recipe': expected a recipe name, found "
                       f"{_found(saved.get('recipe'))}")
    return saved["recipe"], saved["config"]


def saved_steps(run_dir: str | os.PathLike, config_steps: int) -> int:
    """The run's total steps: config.json's, or as the latest `resume` event extended them."""
    for e in reversed(ev.read_events(run_dir)):
        if e["kind"] == "resume" and isinstance(e.get("steps"), int):
            return e["steps"]
    return config_steps


def _options(cfg: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if dataclasses.is_dataclass(v):
            yield from _options(v, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", v


def flag_name(key: str) -> str:
    """Dotted option key to its command-line flag: model.d_model -> --model.d-model."""
    return "--from" if key == "from_step" else "--" + key.replace("_", "-")


def check_unchanged(run_dir: Path, saved: Any, given: Any) -> None:
    """RunError unless `given` keeps every option of the saved run outside RUN_LOCAL."""
    was = dict(_options(saved))
    changed = [(k, was.get(k), v) for k, v in _options(given)
               if k.split(".")[0] not in RUN_LOCAL and was.get(k) != v]
    if not changed:
        return
    k, old, new = changed[0]
    more = (f" (and {len(changed) - 1} more: {', '.join(flag_name(c[0]) for c in changed[1:])})"
            if len(changed) > 1 else "")
    raise RunError(f"{run_dir}: --resume: {flag_name(k)}: expected the run's saved {k} = "
                   f"{old!r}, found {new!r}{more}; a resumed run keeps its configuration "
                   "(only --steps and run-local options such as --eval-every may change): "
                   "start a new run to change it")


def check_resume(run_dir: str | os.PathLike, recipe: str, model_info: dict[str, Any],
                 dtype: str | None = None) -> None:
    """RunError unless the bundle was trained by `recipe` with this model shape (and compute
    `dtype`: `--dtype auto` resolves by device, and --device may change on resume)."""
    saved_recipe, _ = read_config(run_dir)
    if saved_recipe != recipe:
        raise RunError(f"{run_dir}: --resume: expected a run of recipe {recipe!r}, found a "
                       f"{saved_recipe!r} run")
    start = next((e for e in ev.read_events(run_dir) if e["kind"] == "run_start"), None)
    if start is None:  # nothing recorded: the checkpoint load still checks every shape
        return
    trained = (start.get("math") or {}).get("dtype")
    if dtype is not None and trained is not None and trained != dtype:
        raise RunError(f"{run_dir}: --resume: compute dtype: expected {trained} (the run's), found "
                       f"{dtype} (--dtype auto on this device); resume it on a device where "
                       "it resolves the same")
    was = {k: v for k, v in start.get("model", {}).items() if k not in ("n_params", "n_trainable")}
    now = json.loads(json.dumps(model_info, default=str))
    for k in sorted(set(was) | set(now)):
        if was.get(k) != now.get(k):
            raise RunError(f"{run_dir}: --resume: model {k}: expected {was.get(k)!r} (the run's), "
                           f"found {now.get(k)!r}; a resumed run keeps its model (start a new "
                           "run to change it)")


# ---- where a resume continues ---------------------------------------------------------------
@dataclass
class Resume:
    """Where a resumed run continues, and what cutting its bundle back to there found."""

    step: int
    """The checkpoint's step (0: start over from the saved configuration)."""
    checkpoint: Path | None
    state: dict[str, Any] = field(default_factory=dict, repr=False)
    """The checkpoint's verified optimizer state arrays."""
    steps_before: int = 0
    """The run's total steps before this resume."""
    dropped: int = 0
    previous_end: str = "torn"
    t: float = 0.0
    has_start: bool = True
    """Whether the kept events hold the run's run_start."""
    set_aside: list[int] = field(default_factory=list)


def _steps_logged(run_dir: Path) -> int:
    steps = [e.get("step") for e in ev.read_events(run_dir) if e["kind"] == "step"]
    return max((s for s in steps if isinstance(s, int)), default=0)


def plan_resume(run_dir: Path, from_text: str | None, steps_before: int) -> Resume:
    """The checkpoint to continue from (`--from`, else the one `latest` names), verified;
    RunError or ResumeError (one line, with the command that works) when there is none."""
    weights = run_dir / "weights"
    if from_text is not None:
        step = ck.parse_from(from_text)
        if step == 0:
            return Resume(0, None, steps_before=steps_before)
        ckpt = ck.find_checkpoint(weights, step)
    else:
        try:
            ckpt = ck.resolve_latest(run_dir)
        except FileNotFoundError as e:
            if ck.list_checkpoints(weights):  # a dangling or missing link, files present
                raise ck.ResumeError(f"{e}; {intact_hint(run_dir, None)}") from None
            lost = _steps_logged(run_dir)
            raise RunError(f"{run_dir}: --resume: found no checkpoint: the run stopped at step "
                           f"{lost}, before its first checkpoint ({lost} steps lost); start it "
                           f"over with its saved configuration: toymlx-train --resume {run_dir} "
                           "--from step_0") from None
        step = ck.checkpoint_step(ckpt)
        if step is None or ckpt.parent != weights.resolve():
            raise ck.ResumeError(f"{weights / ck.LATEST}: expected a link to a step_N.gguf of "
                                 f"this run, found one to {ckpt}")
        ckpt = weights / ckpt.name
    try:
        arrays, _ = ck.open_checkpoint(ckpt)
    except ck.ResumeError as e:
        raise ck.ResumeError(f"{e}; {intact_hint(run_dir, step)}") from None
    return Resume(step, ckpt, state=arrays, steps_before=steps_before)


def intact_hint(run_dir: Path, below: int | None) -> str:
    """Where to go on from when a checkpoint (at step `below`) cannot be used: the newest
    intact one before it, as the command that resumes from it."""
    step = ck.newest_intact(run_dir / "weights", below)
    if step is None:
        return (f"no intact checkpoint is left: start over with toymlx-train --resume {run_dir} "
                "--from step_0")
    return f"the newest intact checkpoint is step_{step}: toymlx-train --resume {run_dir} " \
           f"--from step_{step}"


def rewind(run_dir: Path, resume: Resume) -> None:
    """Cut the bundle back to `resume.step` (only while owning it, just before training): the
    events past it to events.superseded.jsonl, later checkpoints to weights/superseded/,
    `latest` to the checkpoint, and temporaries of killed writers removed."""
    cut = ev.cut_back(run_dir, resume.step)
    resume.dropped, resume.previous_end, resume.t = cut.dropped, cut.previous_end, cut.t
    resume.has_start = any(e["kind"] == "run_start" for e in cut.kept)
    weights = run_dir / "weights"
    weights.mkdir(exist_ok=True)
    resume.set_aside = ck.set_aside_after(weights, resume.step)
    ck.clean_temporaries(weights)
