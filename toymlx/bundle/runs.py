"""Run bundles: where a run lives, its options, and the one object every reader opens it by.

A bundle is `<runs_root>/<run_id>/`: `config.json` (written once, when the run starts),
`events.jsonl` (`toymlx.bundle.events`), `weights/` (`toymlx.bundle.checkpoint`) and, while a process trains
into it, `.lock` (`toymlx.backend.lock`: one writer, so a second `toymlx-train` on the bundle fails with
one line naming the first).

- `RunOptions` are the options of where a run lives and how this process drives it; none of
  them changes what is trained, so a resume may change any of them except the two that name
  the bundle. Every other option (the training configuration) must equal the saved one; only
  `--steps` may extend the run (recorded in the `resume` event).
- `Bundle.open(path)` reads and checks `config.json` once (every key present and typed, the
  recipe's own checks), and the events once; training (`toymlx.runner.run`), toymlx-eval, -generate,
  -export, -report and the sweep all open a run this way. For a resume it then plans where to
  continue (`plan_resume`: the checkpoint verified, `latest` missing or dangling falling back to
  the newest intact one), checks the model and the data files against what the run recorded,
  and cuts the bundle back to that checkpoint (`rewind`), handing the loop a finished `Resume`.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import os
import shutil
import time
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Annotated, Any, Literal

import tyro

from toymlx.backend import atomic
from toymlx.backend.lock import LOCK_FILE, Lock, acquire
from toymlx.bundle import checkpoint as ck
from toymlx.bundle import events as ev
from toymlx.bundle import model_store

CONFIG_FILE = "config.json"
DATA_FILES_KEY = "data_files"
"""config.json's top-level key (beside "recipe" and "config") with the fingerprint of each data
file or folder the run read, taken when it started (`fingerprint`), and its absolute path
(`file`; `path` is the option as typed)."""
MODEL_FILES_KEY = "model_files"
"""config.json's top-level key with each model file the run read (`MODEL_OPTIONS`): the option
as typed (`path`), the file it named then, absolute (`file`), its size, modification time and
SHA-256 (`model_record`)."""
CONFIG_KEYS = frozenset({"format", "recipe", "config", DATA_FILES_KEY, MODEL_FILES_KEY})
"""Every top-level key of config.json (`save_config`)."""
MODEL_OPTIONS = ("base", "donor")
"""The options that name a model GGUF a run reads (lora's --base, warm-start's --donor)."""


@dataclass
class RunOptions:
    """Where a run lives and how this process drives it (every recipe's Config has them). None
    changes what is trained, so a resume may change any of them, except `runs_root` and `run_id`,
    which name the bundle (`BUNDLE_NAME`)."""

    eval_every: int = 50
    """Steps between validation passes (0: only at the end)."""
    report_every: int = 10
    """Steps between report lines on stdout (step, train loss, learning rate, steps/s,
    throughput, trained tokens or images, peak memory; mlx-lm's --steps-per-report), printed
    with or without the progress bar, also at the last step (0: none)."""
    checkpoint_every: int = 100
    """Steps between GGUF checkpoints (0: only the final one)."""
    keep_last: int = 0
    """Keep only the newest N checkpoints (0: every one); the one `latest` names always stays."""
    keep_best: int = 0
    """Also keep the N checkpoints with the lowest validation loss (evaluated at their step)."""
    compile: bool = True
    """Run the step under mx.compile (--no-compile: eager, same losses)."""
    device: Literal["auto", "gpu", "cpu"] = "auto"
    """Where MLX runs: auto picks the GPU when MLX has one."""
    runs_root: str = "runs"
    """Folder that holds run bundles."""
    run_id: str | None = None
    """Name of this run's bundle (default: timestamp + recipe)."""
    resume: str | None = None
    """Continue the run bundle at this path from its latest checkpoint, with its saved
    configuration (only --steps and run-local options such as --eval-every may change)."""
    from_step: Annotated[str | None, tyro.conf.arg(name="from")] = None
    """With --resume: the checkpoint to continue from instead of the latest (step_N, or
    step_0 to start the run over from its saved configuration)."""
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
    grad_checkpoint: bool = False
    """Recompute each block's activations in the backward pass instead of keeping them: less
    memory for long sequences, about one more forward pass of time."""
    force: bool = False
    """Start even when a step's estimated peak exceeds the memory available (the lora recipe
    estimates it before loading; run_start records the estimate either way)."""


RUN_LOCAL = frozenset(f.name for f in dataclasses.fields(RunOptions))
"""The run-local option keys: the fields of `RunOptions` (the one list; do not repeat it)."""
BUNDLE_NAME = ("runs_root", "run_id")
"""The run-local options that name the bundle: on --resume they must be the bundle's own."""
BUNDLE_PICK = ("runs_root", "run_id", "resume", "from_step", "overwrite")
"""The run-local options that pick the bundle and its checkpoint (a sweep sets them per run)."""


class RunError(ValueError):
    """A run folder that cannot be used as asked; one line naming the path."""


def default_run_id(recipe: str, t: float | None = None) -> str:
    """The run id of a run started at time `t` (default: now) without --run-id."""
    return f"{time.strftime('%Y%m%d-%H%M%S', time.localtime(t))}-{recipe}"


def flag_name(key: str) -> str:
    """Dotted option key to its command-line flag: model.d_model -> --model.d-model."""
    return "--from" if key == "from_step" else "--" + key.replace("_", "-")


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


CONFIG_FORMAT = 3
"""config.json's `format`. 2 (toymlx 0.2 on): every option is written, so a missing key is
damage and refused. A config.json without `format` (written before) is read as it was then: an
option it lacks (one added since) takes its default, which keeps the old behaviour. An option
added from now on must bump this and be let off for older formats in `ADDED_IN`."""
ADDED_IN = {3: ("report_every",)}
"""format -> the top-level options it added: a config.json of an older format (2 on) lacks
them, and they take their defaults there (none changes what is trained)."""


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


# ---- the data a run reads --------------------------------------------------------------------
WHOLE_DIGEST_BYTES = 64 * 2**20
"""Data up to this size is fingerprinted by the SHA-256 of all of it; larger data by its size,
newest modification time and the SHA-256 of 16 samples of `SAMPLE_BYTES`, so a resume of a
run on many GB checks in well under a second."""
SAMPLE_BYTES = 2**16


def data_paths(cfg: Any) -> dict[str, str]:
    """The data files or folders a configuration names: the `data.path`-like options (`path`,
    `*_path` under `data`) that are set, by dotted key."""
    data = getattr(cfg, "data", None)
    if not dataclasses.is_dataclass(data):
        return {}
    return {f"data.{f.name}": v for f in dataclasses.fields(data)
            if (f.name == "path" or f.name.endswith("_path"))
            and isinstance(v := getattr(data, f.name), str)}


def _files(path: Path) -> list[Path]:
    if path.is_dir():
        return sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
    return [path]


def fingerprint(path: str | os.PathLike) -> dict[str, Any]:
    """What identifies a data file or folder's contents: {"bytes", "sha256"} (every name and
    byte, for data up to WHOLE_DIGEST_BYTES), or {"bytes", "mtime_ns", "sample_sha256"} for
    larger data (every name and size, and 16 samples spread over the files and their bytes)."""
    root = Path(path)
    files = _files(root)
    sizes = [p.stat().st_size for p in files]
    digest = hashlib.sha256()
    for p, n in zip(files, sizes):
        digest.update(f"{p.relative_to(root) if p != root else ''}|{n}\n".encode())
    large = sum(sizes) > WHOLE_DIGEST_BYTES
    if not large:
        for p in files:
            with open(p, "rb") as f:
                for block in iter(lambda f=f: f.read(2**20), b""):
                    digest.update(block)
        return {"bytes": sum(sizes), "sha256": digest.hexdigest()}
    for k in range(16):  # the k-th sample: from the k/15-th file, at k/15 of its bytes
        i = k * (len(files) - 1) // 15
        with open(files[i], "rb") as f:
            f.seek(max(0, (sizes[i] - SAMPLE_BYTES) * k // 15))
            digest.update(f.read(SAMPLE_BYTES))
    return {"bytes": sum(sizes), "mtime_ns": max(p.stat().st_mtime_ns for p in files),
            "sample_sha256": digest.hexdigest()}


def data_files(cfg: Any) -> dict[str, dict[str, Any]]:
    """{dotted key: {"path", and its `fingerprint`}} of the data the options name (existing
    files and folders; a recipe reports a missing one itself, when it loads it)."""
    out = {}
    for key, path in data_paths(cfg).items():
        if Path(path).exists():
            out[key] = {"path": path, "file": os.path.abspath(path), **fingerprint(path)}
    return out


def option(cfg: Any, key: str) -> Any:
    """The value of a dotted option key (`data.path`) of a config, None where it has none."""
    for part in key.split("."):
        cfg = getattr(cfg, part, None)
    return cfg


def model_record(spec: str, flag: str) -> dict[str, Any]:
    """What identifies the model file `spec` names (a path, or a store name): {"path": spec,
    "file" (absolute), "bytes", "mtime_ns", "sha256"}."""
    path = model_store.resolve_model(spec, flag)
    st = path.stat()
    return {"path": spec, "file": os.path.abspath(path), "bytes": st.st_size,
            "mtime_ns": st.st_mtime_ns, "sha256": model_store.file_sha256(path)}


def model_files(cfg: Any) -> dict[str, dict[str, Any]]:
    """{option: `model_record`} of the model files the options name (existing files; a recipe
    reports a missing one itself)."""
    out = {}
    for key in MODEL_OPTIONS:
        spec = option(cfg, key)
        if isinstance(spec, str) and (model_store.is_store_name(spec) or Path(spec).is_file()):
            out[key] = model_record(spec, flag_name(key))
    return out


def _same_model(path: Path, rec: dict[str, Any]) -> tuple[bool, str]:
    """(whether the file at `path` has the recorded contents, its SHA-256 or "" when the size
    and modification time are the recorded ones: then it is taken as unchanged, unread)."""
    st = path.stat()
    if st.st_size == rec.get("bytes") and st.st_mtime_ns == rec.get("mtime_ns"):
        return True, ""
    digest = model_store.file_sha256(path)
    return digest == rec.get("sha256"), digest


def locate_input(key: str, rec: dict[str, Any], source: str) -> tuple[str, str]:
    """(the file, what to say about it) a run's input `key` is read from now: the absolute file
    recorded at its start while it is there (a model file: with its recorded contents), else the
    option as typed (a store name resolved again; a path from the current folder) once it has
    the recorded contents; RunError (one line naming both files) if it has others. Where
    neither is there, the option as typed: a reader that needs the file says it is missing (an
    eval of a full checkpoint needs no donor)."""
    flag, typed, file = flag_name(key), rec.get("path"), rec.get("file")
    if not isinstance(typed, str) or not isinstance(file, str):
        raise RunError(f"{source}: key {key!r}: expected the option as given and its absolute "
                       f"file, found {_found(rec)}")
    model = key in MODEL_OPTIONS
    store = model and model_store.is_store_name(typed)
    if not store and Path(file).exists():
        if model:
            same, found = _same_model(Path(file), rec)
            if not same:
                raise RunError(f"{file}: {flag}: expected the file the run started on "
                               f"(sha256 {str(rec.get('sha256'))[:12]}), found other contents "
                               f"(sha256 {found[:12]}); put the run's {key} back there")
        return file, f"{file} (the run's {flag} {typed})"
    gone = (typed, f"{typed} (the run's {flag}: {file} is gone, and so is {typed})")
    try:
        other = model_store.resolve_model(typed, flag) if model else Path(typed)
    except model_store.ModelStoreError:
        return gone
    if not other.exists():  # nothing to mistake for it: whoever needs the file says it is gone
        return gone
    if model:
        same, found = _same_model(other, {"sha256": rec.get("sha256")})
        want = f"sha256 {str(rec.get('sha256'))[:12]}"
    else:
        now = fingerprint(other)
        same, found, want = now == {k: rec.get(k) for k in now}, _fp(now)[7:], _fp(rec)
    if not same:
        raise RunError(f"{os.path.abspath(other)}: {flag}: expected the run's {key}, "
                       f"recorded as {file} ({want}), found other contents (sha256 "
                       f"{found[:12]}); "
                       f"{'the store name now names another model' if store else 'it is gone'}"
                       f" and this file is not it: put the run's {key} back")
    used = typed if store else os.path.abspath(other)
    if store:
        return used, f"{other} ({typed}, the run's {flag}, with its recorded SHA-256)"
    return used, (f"{used} (the run's {flag} {typed}: {file} is gone, this file has its "
                  "recorded SHA-256)")


def resolve_inputs(cfg: Any, saved: dict[str, Any], source: str
                   ) -> tuple[Any, dict[str, str]]:
    """(`cfg` with each data and model path it recorded replaced by the file `locate_input`
    finds for it (a store name stays a name: it is resolved by name), {option: what was used}).
    A run's paths then mean the files it started on, from whatever folder it is read."""
    cfg = copy.deepcopy(cfg)
    used = {}
    for group in (DATA_FILES_KEY, MODEL_FILES_KEY):
        records = saved.get(group, {})
        if not isinstance(records, dict):
            raise RunError(f"{source}: key {group!r}: expected an object, found "
                           f"{_found(records)}")
        for key, rec in records.items():
            if not isinstance(rec, dict) or "file" not in rec:
                continue  # written before toymlx recorded absolute files: the path as typed
            if rec.get("path") != option(cfg, key):
                raise RunError(f"{source}: key '{group}.{key}.path': expected the run's "
                               f"{flag_name(key)} {option(cfg, key)!r}, found "
                               f"{_found(rec.get('path'))}")
            file, used[key] = locate_input(key, rec, f"{source}: {group}")
            *parents, name = key.split(".")
            holder = cfg
            for part in parents:
                holder = getattr(holder, part)
            setattr(holder, name, file)
    return cfg, used


# ---- reading config.json back --------------------------------------------------------------
class _Mismatch(Exception):
    def __init__(self, expected: str):
        self.expected = expected


def _found(v: Any) -> str:
    kind = {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
            type(None): "null", int: "an integer", float: "a number"}.get(type(v), type(v).__name__)
    text = json.dumps(v)
    return f"{text if len(text) <= 40 else text[:37] + '...'} ({kind})"


def _coerce(t: Any, v: Any, key: str, source: str, complete: bool = True) -> Any:
    """`v` as the annotation `t` wants it; _Mismatch (what was expected) if it cannot be."""
    origin, args = typing.get_origin(t), typing.get_args(t)
    if origin in (typing.Union, types.UnionType):
        wants = []
        for a in args:
            try:
                return _coerce(a, v, key, source, complete)
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
            return config_from_dict(t, v, source, key + ".", complete)
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
        items = [_coerce(inner, x, key, source, complete) for x in v] if inner is not Any else list(v)
        return tuple(items) if origin is tuple else items
    return v



def config_from_dict(cls: type, d: dict[str, Any], source: str = "saved config",
                     prefix: str = "config.", complete: bool = True,
                     optional: frozenset[str] = frozenset()) -> Any:
    """Rebuild a (nested) config dataclass from its saved dict, every value checked against
    its field's type, every option present; RunError naming `source`, the key, the expected and
    the found value. config.json is written whole when a run starts, so a missing key is damage:
    taking its default would train another run under this one's name. `complete=False` (a
    config file given with -c, which sets only some options) lets the others take defaults;
    `optional` names the top-level keys that may be missing (added after the file's format)."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    kw = {}
    for k, v in d.items():
        if k not in names:
            raise RunError(f"{source}: key {prefix + k!r}: expected an option of this recipe, "
                           "found an unknown key (written for another recipe, or by a newer "
                           "toymlx?)")
        try:
            kw[k] = _coerce(hints[k], v, prefix + k, source, complete)
        except _Mismatch as m:
            raise RunError(f"{source}: key {prefix + k!r}: expected {m.expected}, found "
                           f"{_found(v)}; " + ("fix it to the run's value" if complete else
                                               "fix it, or remove the key to take its default")
                           ) from None
    missing = [k for k in names if k not in d and k not in optional]
    if missing and complete:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise RunError(f"{source}: key {prefix + missing[0]!r}: expected the run's saved "
                       f"{flag_name(missing[0])} value, found no key{more}; put it back as the "
                       "run's run_start event records it")
    return cls(**kw)


def _read_config(run_dir: Path, flag: str) -> dict[str, Any]:
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
                       f"{_found(saved)}")
    if not isinstance(saved.get("recipe"), str):
        raise RunError(f"{p}: key 'recipe': expected a recipe name, found "
                       f"{_found(saved.get('recipe'))}")
    if not isinstance(saved.get(DATA_FILES_KEY, {}), dict):
        raise RunError(f"{p}: key {DATA_FILES_KEY!r}: expected an object, found "
                       f"{_found(saved[DATA_FILES_KEY])}")
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


def _options(cfg: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if dataclasses.is_dataclass(v):
            yield from _options(v, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", v


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
    note: str | None = None
    """Why this checkpoint and not the one `latest` names (it was missing or dangling)."""
    dropped: int = 0
    previous_end: str = "torn"
    t: float = 0.0
    kept: list[dict] = field(default_factory=list, repr=False)
    """The events the bundle keeps (cut back to `step`)."""
    set_aside: list[int] = field(default_factory=list)

    @property
    def has_start(self) -> bool:
        """Whether the kept events hold the run's run_start."""
        return any(e["kind"] == "run_start" for e in self.kept)


def intact_hint(run_dir: Path, below: int | None) -> str:
    """Where to go on from when a checkpoint (at step `below`) cannot be used: the newest
    intact one before it, as the command that resumes from it."""
    step = ck.newest_intact(run_dir / "weights", below)
    if step is None:
        return (f"no intact checkpoint is left: start over with toymlx-train --resume {run_dir} "
                "--from step_0")
    return f"the newest intact checkpoint is step_{step}: toymlx-train --resume {run_dir} " \
           f"--from step_{step}"


# ---- the bundle ------------------------------------------------------------------------------
class Bundle:
    """One run bundle, opened once: its saved configuration (read and checked once), its
    events, its checkpoints. `Bundle.open` is how every reader and the resume open a run."""

    def __init__(self, path: Path, recipe: str, module: ModuleType, config: Any,
                 saved: dict[str, Any], events: list[dict]):
        self.path, self.recipe, self.module = path, recipe, module
        self.config = config
        """The recipe's Config as the run was started, `steps` as its last resume extended it."""
        self.saved = saved
        """config.json as read (`recipe`, `config`, `data_files`)."""
        self.events = events
        """events.jsonl as read at open (as a resume's `rewind` left it, after)."""
        self.used: dict[str, str] = {}
        """Per input option (`base`, `data.path`, ...): the file read for it, and why that one
        (`resolve_inputs`), for the readers to say."""

    @classmethod
    def open(cls, path: str | os.PathLike, flag: str = "--resume") -> Bundle:
        """Read a run folder's config.json (strictly: RunError naming the file and the key, as
        for command-line input; `flag` names the option that gave the folder) and its events."""
        from toymlx.recipes import get_recipe
        from toymlx.training.trainer import check_config

        path = Path(path)
        saved = _read_config(path, flag)
        source = str(path / CONFIG_FILE)
        try:
            module = get_recipe(saved["recipe"])
        except ValueError as e:
            raise RunError(f"{source}: key 'recipe': {e}") from None
        fmt = saved.get("format", 1)
        if not isinstance(fmt, int) or isinstance(fmt, bool):
            raise RunError(f"{source}: key 'format': expected an integer (toymlx writes "
                           f"{CONFIG_FORMAT}), found {_found(fmt)}")
        cfg = config_from_dict(module.Config, saved["config"], source, complete=fmt >= 2,
                               optional=added_since(fmt))  # see CONFIG_FORMAT
        cfg, used = resolve_inputs(cfg, saved, source)
        events = ev.read_events(path)
        cfg.steps = _planned_steps(events, cfg.steps)
        try:
            check_config(module, cfg)
        except ValueError as e:
            raise RunError(f"{source}: {e}") from None
        bundle = cls(path, saved["recipe"], module, cfg, saved, events)
        bundle.used = used
        return bundle

    @classmethod
    def of(cls, path: str | os.PathLike, flag: str = "--model") -> Bundle | None:
        """The bundle a run folder, or a checkpoint file in its weights/, belongs to; None for
        a path outside any run (a GGUF of its own)."""
        p = Path(path)
        for run_dir in (p, p.parent.parent) if p.parent.name == "weights" else (p,):
            if (run_dir / CONFIG_FILE).is_file():
                return cls.open(run_dir, flag)
        return None

    # ---- owning it, for a resume
    def own(self) -> Lock:
        """Take the bundle's lock (LockHeld naming the owner); the caller holds it while it
        trains. What `open` read stays valid: only an owner writes the bundle, one that still
        owns it is refused here, and `rewind` cuts back the events file as it is then."""
        return lock_run(self.path)

    def resume_defaults(self, given: Any) -> Any:
        """The saved configuration as the options a resume starts from: continuing to the end,
        into this bundle."""
        cfg = dataclasses.replace(self.config)
        cfg.stop_at, cfg.resume, cfg.overwrite = None, str(given), False
        return cfg

    def check_options(self, recipe: str, given: Any) -> None:
        """RunError unless `given` (a resume's options) keeps the run's recipe and every saved
        option but --steps and the run-local ones (the bundle's name included)."""
        if recipe != self.recipe:
            raise RunError(f"{self.path}: --resume: expected a run of recipe {recipe!r}, found "
                           f"a {self.recipe!r} run")
        was = dict(_options(self.config))
        changed = [(k, was.get(k), v) for k, v in _options(given)
                   if k != "steps" and (k.split(".")[0] not in RUN_LOCAL or k in BUNDLE_NAME)
                   and was.get(k) != v]
        if not changed:
            return
        k, old, new = changed[0]
        more = (f" (and {len(changed) - 1} more: "
                f"{', '.join(flag_name(c[0]) for c in changed[1:])})" if len(changed) > 1 else "")
        raise RunError(f"{self.path}: --resume: {flag_name(k)}: expected the run's saved {k} = "
                       f"{old!r}, found {new!r}{more}; a resumed run keeps its configuration "
                       "(only --steps and run-local options such as --eval-every may change): "
                       "start a new run to change it")

    def check_data(self) -> None:
        """RunError naming the file unless every data file the run recorded at its start
        still has the contents it had (its fingerprint)."""
        for key, rec in self.saved.get(DATA_FILES_KEY, {}).items():
            # the file `resolve_inputs` found for it (the path as typed in older bundles)
            path = option(self.config, key) if isinstance(rec, dict) else None
            if not isinstance(path, str):
                raise RunError(f"{self.path / CONFIG_FILE}: key '{DATA_FILES_KEY}.{key}': "
                               f"expected a path and its fingerprint, found {_found(rec)}")
            if not Path(path).exists():
                raise RunError(f"{path}: {flag_name(key)}: expected the run's data "
                               f"({rec.get('bytes')} bytes when it started), found nothing "
                               "there; put it back to resume")
            now = fingerprint(path)
            was = {k: rec.get(k) for k in now}
            if now != was:
                what = ("its size" if now["bytes"] != was["bytes"] else "its contents")
                raise RunError(f"{path}: {flag_name(key)}: expected the data the run started "
                               f"on ({was['bytes']} bytes, {_fp(was)}), found {what} changed "
                               f"({now['bytes']} bytes, {_fp(now)}); a resumed run trains on "
                               "its own data: restore it, or start a new run on this data")

    def plan_resume(self, from_text: str | None, steps: int) -> Resume:
        """The checkpoint to continue from (`--from`, else the one `latest` names), verified;
        RunError or ResumeError (one line, with the command that works) when there is none."""
        weights = self.path / "weights"
        note = None
        if from_text is not None:
            step = ck.parse_from(from_text)
            if step == 0:
                return self._check_steps(Resume(0, None, steps_before=self.config.steps), steps)
            ckpt = ck.find_checkpoint(weights, step)
        else:
            if not ck.list_checkpoints(weights):
                lost = max((e["step"] for e in self.events
                            if e["kind"] == "step" and isinstance(e.get("step"), int)), default=0)
                raise RunError(f"{self.path}: --resume: found no checkpoint: the run stopped at "
                               f"step {lost}, before its first checkpoint ({lost} steps lost); "
                               "start it over with its saved configuration: toymlx-train "
                               f"--resume {self.path} --from step_0")
            ckpt, note = ck.latest_checkpoint(self.path)
            step = ck.checkpoint_step(ckpt)
        try:
            arrays, _ = ck.open_checkpoint(ckpt)
        except ck.ResumeError as e:
            raise ck.ResumeError(f"{e}; {intact_hint(self.path, step)}") from None
        return self._check_steps(Resume(step, ckpt, state=arrays, steps_before=self.config.steps,
                                        note=note), steps)

    def _check_steps(self, resume: Resume, steps: int) -> Resume:
        if steps <= resume.step:
            raise RunError(f"{self.path}: --steps: expected more than the checkpoint's step "
                           f"{resume.step} to train on, found {steps} (pass --steps N to "
                           "extend the run)")
        return resume

    def check_model(self, model_info: dict[str, Any], dtype: str | None = None) -> None:
        """RunError unless the model built now has the run's shape (and compute `dtype`:
        `--dtype auto` resolves by device, and --device may change on resume)."""
        start = next((e for e in self.events if e["kind"] == "run_start"), None)
        if start is None:  # nothing recorded: the checkpoint load still checks every shape
            return
        trained = (start.get("math") or {}).get("dtype")
        if dtype is not None and trained is not None and trained != dtype:
            raise RunError(f"{self.path}: --resume: compute dtype: expected {trained} (the "
                           f"run's), found {dtype} (--dtype auto on this device); resume it on "
                           "a device where it resolves the same")
        # the base's path as typed is no test: the file is checked by its recorded SHA-256 when
        # the bundle opens, and a resume reads it by its absolute path
        skip = ("n_params", "n_trainable", *MODEL_OPTIONS)
        was = {k: v for k, v in start.get("model", {}).items() if k not in skip}
        now = {k: v for k, v in json.loads(json.dumps(model_info, default=str)).items()
               if k not in skip}
        for k in sorted(set(was) | set(now)):
            if was.get(k) != now.get(k):
                raise RunError(f"{self.path}: --resume: model {k}: expected {was.get(k)!r} (the "
                               f"run's), found {now.get(k)!r}; a resumed run keeps its model "
                               "(start a new run to change it)")

    def rewind(self, resume: Resume) -> None:
        """Cut the bundle back to `resume.step` (only while owning it, just before training):
        the events past it to events.superseded.jsonl, later checkpoints to
        weights/superseded/, `latest` to the checkpoint, and temporaries of killed writers
        removed."""
        cut = ev.cut_back(self.path, resume.step)
        resume.dropped, resume.previous_end, resume.t = cut.dropped, cut.previous_end, cut.t
        resume.kept = cut.kept
        self.events = cut.kept
        weights = self.path / "weights"
        weights.mkdir(exist_ok=True)
        resume.set_aside = ck.set_aside_after(weights, resume.step)
        ck.clean_temporaries(weights)


def run_base(path: str | os.PathLike, flag: str = "--model") -> tuple[str, str] | None:
    """(the base model, what to say about it) of the LoRA run `path` is (a run folder) or lies
    in (a checkpoint in its weights/): the file its config.json recorded, as `Bundle.open`
    found and checked it; None outside a run, or for a run without --base."""
    bundle = Bundle.of(path, flag)
    base = getattr(bundle.config, "base", None) if bundle is not None else None
    if not base:
        return None
    return str(base), bundle.used.get("base", f"{base} (the run's --base)")


def _fp(rec: dict[str, Any]) -> str:
    d = rec.get("sha256") or rec.get("sample_sha256")
    return f"sha256 {str(d)[:12]}" if d else "no digest"


def _planned_steps(events: list[dict], config_steps: int) -> int:
    """The run's total steps: config.json's, or as the latest `resume` event extended them."""
    for e in reversed(events):
        if e["kind"] == "resume" and isinstance(e.get("steps"), int):
            return e["steps"]
    return config_steps
