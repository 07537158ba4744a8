"""The one check every command that writes makes before it writes: never over what it reads.

`check_output(out, inputs, flag, owns)` refuses, with one line naming both paths, an output
path that
- is one of the command's inputs: the same file after resolving symlinks and `..`, or a hard
  link to it (same device and inode), or holds an input (a folder written into: a run folder
  with --overwrite), or lies inside an input folder (a data folder, a run read); an input in a
  run bundle brings the files its config.json records (`recorded_inputs`: the run's data and
  model files, which eval and export read through it);
- lies inside a run bundle (`is_bundle`) other than the ones the command owns (`owns`: the run
  a training writes its --fuse-at-end file into); `runs/<id>/weights/latest`, a link, counts as
  inside its bundle whether or not it resolves;
- lies inside a model store: Ollama's (`$OLLAMA_MODELS`, `~/.ollama/models`, their blobs/ and
  manifests/) or LM Studio's models folder (`toymlx.bundle.model_store` finds both);
- is a FIFO, a device or a socket (`special_kind`): a file is written beside its name and
  renamed over it, which would replace /dev/null itself, run as root, with a regular file;
- is a folder where a file is written (that rename fails, after the work), or a file where a
  folder is (`folder`);
- exists already, where the command writes a file only with --overwrite (`overwrite` False:
  toymlx-export's, toymlx-report's and toymlx-eval --plot's files, as toymlx-train's run
  folder), so an earlier output or a file of the user's own is never replaced without a word.
Nothing is written by the check, so a refused command leaves every file as it was.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from toymlx.backend.files import special_kind
from toymlx.bundle import model_store
from toymlx.bundle.folder import saved_config
from toymlx.bundle.inputs import DATA_FILES_KEY, MODEL_FILES_KEY
from toymlx.bundle.options import flag_name

BUNDLE_MARKS = ("config.json", "events.jsonl", "weights", ".lock")
"""What a run bundle (`toymlx.runner.bundle`) holds: config.json and events.jsonl once it has started,
weights/ and .lock from the moment toymlx-train creates it."""


class OutputError(ValueError):
    """An output path that would overwrite an input, a run bundle or a model store."""


def _real(path: str | os.PathLike) -> Path:
    return Path(os.path.realpath(path))


def _same_file(a: Path, b: Path) -> bool:
    """Whether `a` and `b` are one file (links followed; hard links too)."""
    try:
        sa, sb = os.stat(a), os.stat(b)
    except OSError:
        return False
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def is_bundle(folder: Path) -> bool:
    """Whether `folder` is a run bundle: config.json with events.jsonl, or weights/ beside
    config.json, events.jsonl or .lock (a run that has not logged yet)."""
    has = [(folder / m).exists() for m in BUNDLE_MARKS]
    config, events, weights, lock = has
    return (config and events) or (weights and (config or events or lock))


def bundle_of(path: Path) -> Path | None:
    """The run bundle `path` lies in (or is), by its real and its written location."""
    for p in (_real(path), Path(os.path.abspath(path))):
        for folder in (p, *p.parents):
            if folder.is_dir() and is_bundle(folder):
                return folder
    return None


def store_of(path: Path) -> tuple[str, Path] | None:
    """(store name, its folder) of the Ollama or LM Studio store `path` lies in."""
    real = _real(path)
    for name, roots in (("Ollama's model store", model_store.ollama_roots()),
                        ("LM Studio's models folder", model_store.lmstudio_roots())):
        for root in roots:
            if real == _real(root) or real.is_relative_to(_real(root)):
                return name, root
    return None


def recorded_inputs(bundle: Path) -> list[tuple[str, str]]:
    """("the run's FLAG", absolute file) of each data and model file a run bundle's config.json
    records: what a command given the run (eval, export) reads through it. [] for a
    config.json that cannot be read (`saved_config`): the command reading it says why."""
    saved = saved_config(bundle) or {}
    found = []
    for group in (DATA_FILES_KEY, MODEL_FILES_KEY):
        records = saved.get(group)
        for key, rec in (records.items() if isinstance(records, dict) else ()):
            if isinstance(rec, dict) and isinstance(rec.get("file"), str):
                found.append((f"run's {flag_name(key)}", rec["file"]))
    return found


def _with_recorded(inputs: Iterable[tuple[str, str | os.PathLike | None]]
                   ) -> list[tuple[str, str | os.PathLike | None]]:
    """`inputs`, each one in a run bundle followed by the files that run records."""
    out = []
    for what, given in inputs:
        out.append((what, given))
        if (given is not None and not model_store.is_store_name(given) and Path(given).exists()
                and (bundle := bundle_of(Path(given))) is not None):
            out.extend(recorded_inputs(bundle))
    return out


def check_output(out: str | os.PathLike, inputs: Iterable[tuple[str, str | os.PathLike | None]],
                 flag: str = "--out", owns: Iterable[str | os.PathLike] = (),
                 folder: bool = False, overwrite: bool = True) -> Path:
    """`out` as a Path, after refusing (OutputError, one line naming both paths) an output
    that is a FIFO, device or socket, a folder where a file is written (a file where a
    `folder` is), is or holds one of `inputs` ((flag, path) pairs; None and missing paths
    skipped; one in a run bundle brings the files that run records), lies in one of the input
    folders, in a run bundle not in `owns`, or in a model store; and, unless `overwrite`, a
    file that exists already (naming --overwrite, the command's flag to replace it)."""
    out = Path(out)
    if kind := special_kind(out):
        raise OutputError(f"{out}: {flag}: expected a regular file or a new name, found {kind} "
                          f"(writing would replace it with a regular file); choose another "
                          f"{flag}")
    real = _real(out)
    for what, given in _with_recorded(inputs):
        if given is None or model_store.is_store_name(given):
            continue  # a store name: its file lies in a store, which is refused below
        src = Path(given)
        if not src.exists():
            continue
        src_real = _real(src)
        if _same_file(out, src) or real == src_real:
            kind = "folder" if src_real.is_dir() else "file"
            raise OutputError(f"{out}: {flag}: expected a new {'folder' if folder else 'file'}, "
                              f"found the {what} {kind} {src} itself (the same {kind}); writing "
                              f"it would destroy the input: choose another {flag}")
        if src_real.is_relative_to(real):
            raise OutputError(f"{out}: {flag}: expected a path that holds no input, found the "
                              f"{what} {src} inside it; choose another {flag}")
        if src_real.is_dir() and real.is_relative_to(src_real):
            raise OutputError(f"{out}: {flag}: expected a path outside the inputs, found it "
                              f"inside the {what} folder {src}; choose another {flag}")
    bundle = bundle_of(out)
    if bundle is not None and not any(_real(bundle) == _real(o) for o in owns):
        raise OutputError(f"{out}: {flag}: expected a path outside run bundles, found it inside "
                          f"the run bundle {bundle} (its checkpoints, weights/latest and "
                          f"config.json are the run's own); choose another {flag}")
    store = store_of(out)
    if store is not None:
        raise OutputError(f"{out}: {flag}: expected a path outside model stores, found it "
                          f"inside {store[0]} {store[1]} (its files are named by their "
                          f"contents); choose another {flag}")
    above = next((a for a in out.parents if a.exists()), None)
    if above is not None and not above.is_dir():  # its folder would be made: "File exists"
        raise OutputError(f"{out}: {flag}: expected a path in a folder, found {above} is a "
                          f"file, not a folder; choose another {flag}")
    if not folder and out.is_dir():  # found only at the end, after the work, by the rename
        raise OutputError(f"{out}: {flag}: expected a file name, found a folder; name a file "
                          f"in it, or choose another {flag}")
    if folder and out.exists() and not out.is_dir():
        raise OutputError(f"{out}: {flag}: expected a folder (new or existing), found a file; "
                          f"choose another {flag}")
    if not folder and not overwrite and os.path.lexists(out):  # a dangling link's too
        raise OutputError(f"{out}: {flag}: expected a new file, found an existing file; pass "
                          f"--overwrite to replace it, or choose another {flag}")
    return out
