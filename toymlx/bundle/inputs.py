"""The files a run reads, as its config.json records them: each data file or folder's
`fingerprint`, each model file's SHA-256, and where a later reader finds them again
(`locate_input`, `resolve_inputs`)."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from toymlx.backend.files import counted, hidden_below, names_below, special_kind
from toymlx.bundle import model_store
from toymlx.bundle.options import RunError, flag_name, found_text, option

DATA_FILES_KEY = "data_files"
"""config.json's top-level key (beside "recipe" and "config") with the fingerprint of each data
file or folder the run read, taken when it started (`fingerprint`), and its absolute path with
links resolved (`file`; `path` is the option as typed)."""
DATA_ERROR_KEY = "data_error"
"""run_end's field where a run ended on data it could not read mid-run (a streamed image that
does not decode): the one-line error naming the file. The run's data may change after it (the
file fixed), and `--resume` goes on from the checkpoint written before it."""
MODEL_FILES_KEY = "model_files"
"""config.json's top-level key with each model file the run read (`MODEL_OPTIONS`): the option
as typed (`path`), the file it named then, absolute (`file`; a path's links resolved), its size,
modification time and SHA-256 (`model_record`)."""
MODEL_OPTIONS = ("base", "donor", "tokenizer")
"""The options that name a model GGUF a run reads (lora's --base, warm-start's --donor,
from-scratch's --tokenizer)."""


WHOLE_DIGEST_BYTES = 64 * 2**20
"""Data up to this size is fingerprinted by the SHA-256 of all of it; larger data also by its
newest modification time and the SHA-256 of 16 samples of `SAMPLE_BYTES`, so a resume of a
run on many GB checks in well under a second while the data stays where it was (`same_data`);
a copy (a new modification time) is checked by all its bytes."""
SAMPLE_BYTES = 2**16


FILE_OPTIONS = ("lora.init_adapter",)
"""Options outside `data` that name a file or folder a run reads (lora's --lora.init-adapter: an
adapter GGUF or mlx-lm's adapter folder), recorded and found again as its data is
(`data_paths`), so a run started from another folder reads the same file."""


def data_paths(cfg: Any) -> dict[str, str]:
    """The data files or folders a configuration names: the `data.path`-like options (`path`,
    `*_path` under `data`) and the `FILE_OPTIONS` that are set, by dotted key."""
    data = getattr(cfg, "data", None)
    out = {} if not dataclasses.is_dataclass(data) else {
        f"data.{f.name}": v for f in dataclasses.fields(data)
        if (f.name == "path" or f.name.endswith("_path"))
        and isinstance(v := getattr(data, f.name), str)}
    return {**out, **{k: v for k in FILE_OPTIONS if isinstance(v := option(cfg, k), str)}}


def data_reads(cfg: Any, key: str, path: str | os.PathLike) -> tuple[str, ...] | None:
    """The files of the data folder `path` the option `key` of `cfg` reads, as `fingerprint`'s
    `only` (its data options' `reads_only`: an ImageFolder's images, an mlx-lm folder's split
    files, test.jsonl only for a run of --test); None: all of it."""
    reads = getattr(getattr(cfg, "data", None), "reads_only", None)
    if reads is None or not key.startswith("data."):
        return None
    return reads(str(path), bool(getattr(cfg, "test", False)))


def data_empty_as_none(cfg: Any, key: str) -> tuple[str, ...]:
    """The names of the files of a data folder that the option `key` of `cfg` reads as no file
    where they hold no example (its data options' `empty_as_none`: an mlx-lm folder's
    valid.jsonl at --data.val-fraction 0), so that such a one deleted or added is no change
    (`same_data`)."""
    names = getattr(getattr(cfg, "data", None), "empty_as_none", None)
    return names() if names is not None and key.startswith("data.") else ()


BLANK_KEY = "blank"
"""In a data folder's record of one of its files (`data_files`' "files"): true where the file
is one its run reads as none (`data_empty_as_none`) and holds whitespace alone (blank lines,
`blank_file`), not no byte, so that a resume without it, or with an empty one, is no change
(`changed_part`); left out otherwise."""


def _read_as_none(part: Any) -> bool:
    """Whether a file's record (`data_files`' "files" entry) is of a file that holds no
    example: no byte (`bytes` 0), or whitespace alone (`BLANK_KEY`)."""
    return isinstance(part, dict) and (part.get("bytes") == 0 or part.get(BLANK_KEY) is True)


def _reads(name: str, only: Sequence[str] | None) -> bool:
    """Whether a folder's file `name` (its path in the folder) is one `only` names: by its
    extension (".png") or its name ("train.jsonl"); None: every file."""
    return only is None or name in only or Path(name).suffix.lower() in only


def _files(path: Path, only: Sequence[str] | None = None) -> list[Path]:
    if path.is_dir():
        return sorted(p for p in names_below(path) if p.is_file() and not hidden_below(p, path)
                      and _reads(p.relative_to(path).as_posix(), only))
    return [path]


def _recorded_only(rec: dict[str, Any]) -> list[str] | None:
    """A record's `only` (None: every file of its folder, as records before it were taken)."""
    only = rec.get("only")
    return only if isinstance(only, list) else None


def fingerprint(path: str | os.PathLike, whole: bool = True,
                only: Sequence[str] | None = None, each: bool = False) -> dict[str, Any]:
    """What identifies a data file or folder's contents: {"bytes", "sha256"} (the SHA-256 of
    every name, size and byte), and for data over WHOLE_DIGEST_BYTES also "mtime_ns" (the
    newest) and "sample_sha256" (every name and size, and 16 samples spread over the files and
    their bytes). `whole=False`: large data without "sha256" (nothing read but the samples).
    `only`: of a folder, the files with these extensions or names alone (those its recipe
    reads, `data_reads`: an ImageFolder's images, not a notes.txt beside them; an mlx-lm
    folder's train.jsonl, valid.jsonl and test.jsonl, not its README.md), recorded as "only".
    `each` (with `whole`, of a folder): also "files", {name: {"bytes", "sha256"}} of each file
    as its own `fingerprint` names it, from the same read (each file read once, not once for
    the folder and again for itself)."""
    root = Path(path)
    if kind := special_kind(root):  # reading it would wait for a writer, or never end
        raise RunError(f"{root}: expected a data file or folder, found {kind}")
    files = _files(root, only)
    sizes = [p.stat().st_size for p in files]
    # os.fsencode: a name's own bytes, also where they are not UTF-8 (a latin-1 file name)
    head = b"".join(os.fsencode(f"{p.relative_to(root) if p != root else ''}|{n}\n")
                    for p, n in zip(files, sizes))
    large = sum(sizes) > WHOLE_DIGEST_BYTES
    out: dict[str, Any] = {"bytes": sum(sizes), **({"only": list(only)} if only else {})}
    parts: dict[str, Any] = {}
    if whole or not large:
        digest = hashlib.sha256(head)
        for p, n in zip(files, sizes):
            own = hashlib.sha256(os.fsencode(f"|{n}\n")) if each and p != root else None
            with open(p, "rb") as f:
                for block in iter(lambda f=f: f.read(2**20), b""):
                    digest.update(block)
                    if own is not None:
                        own.update(block)
            if own is not None:  # a large file's own samples too, as `fingerprint(p)` has
                parts[_text_name(p.relative_to(root))] = {
                    "bytes": n, "sha256": own.hexdigest(), **(
                        fingerprint(p, whole=False) if n > WHOLE_DIGEST_BYTES else {})}
        out["sha256"] = digest.hexdigest()
    if parts:
        out["files"] = parts
    if not large:
        return out
    digest = hashlib.sha256(head)
    for k in range(16):  # the k-th sample: from the k/15-th file, at k/15 of its bytes
        i = k * (len(files) - 1) // 15
        with open(files[i], "rb") as f:
            f.seek(max(0, (sizes[i] - SAMPLE_BYTES) * k // 15))
            digest.update(f.read(SAMPLE_BYTES))
    return {**out, "mtime_ns": max(p.stat().st_mtime_ns for p in files),
            "sample_sha256": digest.hexdigest()}


def same_data(path: str | os.PathLike, rec: dict[str, Any],
              reads: Sequence[str] | None = None, empty_as_none: Sequence[str] = ()
              ) -> tuple[bool, dict[str, Any]]:
    """(whether the data file or folder at `path` holds the contents its recorded `fingerprint`
    `rec` names, what was read as `fingerprint` names it). Large data with the recorded size,
    samples and modification time is taken as unchanged, unread; with another modification
    time (a copy, `cp` without -p) its bytes decide. RunError (one line) where they cannot: a
    record of large data without "sha256" (written before toymlx kept one) whose samples match.
    `reads`: the files of the folder its run reads (`data_reads`); a record of more than
    those that differs is then decided by the records of those files alone
    (`_same_read_files`): one without "only" (written before toymlx recorded which: every file
    of the folder), or with an `only` the run does not read all of (an mlx-lm folder's
    test.jsonl, recorded before a run of no --test left it out), or with files in hidden
    folders (recorded before `fingerprint` skipped them, as the run's reading did).
    `empty_as_none`: files of the folder read as none where they hold no example
    (`data_empty_as_none`): one of 0 bytes or blank lines alone recorded and now gone, or now
    there and not recorded, is no change, decided by the record's files (`changed_part`) where
    it has them."""
    same, now = _same_whole(path, rec)
    if not same and empty_as_none and Path(path).is_dir() and isinstance(rec.get("files"), dict):
        return changed_part(path, rec, reads=reads, empty_as_none=empty_as_none) is None, now
    only = _recorded_only(rec)
    files = rec.get("files")
    hidden = isinstance(files, dict) and any(hidden_below(Path(path, n), path) for n in files)
    if same or not reads or not Path(path).is_dir() or (
            only is not None and not hidden and (set(only) <= set(reads)
                                                 or not isinstance(files, dict))):
        return same, now  # the record covers what the run reads, or no file's own is kept
    return _same_read_files(Path(path), rec, reads, now), now


def _same_read_files(path: Path, rec: dict[str, Any], reads: Sequence[str],
                     now: dict[str, Any]) -> bool:
    """Whether the folder `path`, whose record `rec` covers every file in it (no "only") and
    differs, holds the files its run reads (`reads`) as recorded: their names, sizes and
    SHA-256s in the record's "files" (a folder of up to `FOLDER_PARTS` files); a file beside
    them (a README.md) may have changed. RunError (one line) where the record has no "files"."""
    parts = rec.get("files")
    if not isinstance(parts, dict):
        raise RunError(f"{path}: expected the run's data ({rec.get('bytes')} bytes, "
                       f"{fingerprint_note(rec)}), found other contents ({now['bytes']} bytes, "
                       f"{fingerprint_note(now)}); the run's record (written before toymlx "
                       "recorded which files of a folder a run reads) covers every file in "
                       "the folder, not each file's own, so whether a file the run reads "
                       "changed or only one beside them cannot be told: restore the folder as "
                       "it was, or start a new run on this data")
    return changed_part(path, rec, reads=reads) is None


def _same_whole(path: str | os.PathLike, rec: dict[str, Any]) -> tuple[bool, dict[str, Any]]:
    """`same_data` by the record's own fingerprint."""
    only = _recorded_only(rec)
    now = fingerprint(path, whole=False, only=only)
    if now["bytes"] != rec.get("bytes"):
        return False, now
    if "sample_sha256" not in now:  # small: all of it was read
        return now["sha256"] == rec.get("sha256"), now
    if now["sample_sha256"] != rec.get("sample_sha256"):
        return False, now
    if now["mtime_ns"] == rec.get("mtime_ns"):
        return True, now
    if not isinstance(rec.get("sha256"), str):
        t = rec.get("mtime_ns")
        when = (f"; if it is the run's data, give it the recorded modification time: touch -d "
                f"@{t // 10**9}.{t % 10**9:09d} {path}" if isinstance(t, int) else "")
        raise RunError(f"{path}: expected the run's data ({rec.get('bytes')} bytes, "
                       f"{fingerprint_note(rec)}, modification time {t}), found the same size "
                       f"and samples with modification time {now['mtime_ns']}; the run's "
                       "record holds no SHA-256 of all of it (recorded before toymlx kept one), "
                       f"so whether the rest is the same cannot be told{when}")
    now = fingerprint(path, only=only)
    return now["sha256"] == rec["sha256"], now


def _text_name(name: Path) -> str:
    """A file name as config.json's UTF-8 text can hold it: a byte that is not UTF-8 (a
    latin-1 name) as `\\xe9`; a UTF-8 name as it is."""
    return os.fsencode(name).decode("utf-8", "backslashreplace")


def data_files(cfg: Any) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """({dotted key: {"path", and its `fingerprint`}} of the data the options name (existing
    files and folders; a recipe reports a missing one itself, when it loads it), {dotted key:
    `data_index` entry}): each file of a folder fingerprinted in the read that fingerprints
    the folder; a small folder's (`FOLDER_PARTS`) under its record's "files", a larger one's
    in the index (`DATA_INDEX_FILE`), which config.json would not hold at a size it can be
    read in at every command (60,000 images: some 5 MB); a file the run reads as none that
    holds blank lines alone marked `BLANK_KEY`."""
    from toymlx.data.chat import blank_file

    out, index = {}, {}
    for key, path in data_paths(cfg).items():
        if Path(path).exists():
            only = data_reads(cfg, key, path)
            rec = fingerprint(path, only=only, each=True)
            parts = rec.pop("files", {})
            for name in data_empty_as_none(cfg, key):  # a valid.jsonl of blank lines: none
                if parts.get(name, {}).get("bytes") and blank_file(Path(path, name)):
                    parts[name][BLANK_KEY] = True
            out[key] = {"path": path, "file": os.path.realpath(path), **rec}
            if len(parts) > FOLDER_PARTS:
                index[key] = {"sha256": rec["sha256"], "files": {
                    name: [p["bytes"], p["sha256"]] for name, p in parts.items()}}
            elif parts:
                out[key]["files"] = parts
    return out, index


DATA_INDEX_FILE = "data_index.json"
"""Beside config.json, written with it where a data folder holds more than `FOLDER_PARTS`
files: {dotted key: {"sha256": the folder's, "files": {name: [bytes, sha256]}}}, each file's
size and SHA-256 as `fingerprint` names a file, read only to name the file a resume refuses
(`changed_part`)."""


def index_parts(index: Any, rec: dict[str, Any]) -> dict[str, Any] | None:
    """The files {name: {"bytes", "sha256"}} that a `DATA_INDEX_FILE` entry `index` records of
    the folder whose config.json record is `rec`; None where there is none, or it is of other
    contents than `rec` (a record a resume took as a fix since, `data_fixed`)."""
    if not isinstance(index, dict) or not isinstance(index.get("files"), dict) or \
            index.get("sha256") != rec.get("sha256"):
        return None
    return {name: {"bytes": p[0], "sha256": p[1]} for name, p in index["files"].items()
            if isinstance(p, list) and len(p) == 2}


def changed_part(path: str | os.PathLike, rec: dict[str, Any],
                 parts: dict[str, Any] | None = None,
                 reads: Sequence[str] | None = None, empty_as_none: Sequence[str] = ()
                 ) -> str | None:
    """Which file of the data folder at `path` differs from its record's "files" (a small
    folder's, `FOLDER_PARTS`; a larger one's `parts`, from `index_parts`): "a/03.png added",
    "a/03.png gone", or "train.jsonl changed (100 -> 120 bytes)", the first by name; the
    files' names and sizes first (no file read), then, where they all hold, each file's bytes
    in name order up to the first that differs (each read once); None where the record has no
    files or none differs. `reads`: as `same_data`'s, the files compared (of those the
    record's "only" names, where it has one). `empty_as_none`: as `same_data`'s, files left out
    of both sides where they hold no example (0 bytes, or blank lines alone: `_read_as_none`,
    `blank_file`)."""
    parts = rec.get("files") if isinstance(rec.get("files"), dict) else parts
    if not isinstance(parts, dict) or not Path(path).is_dir():
        return None
    only = _recorded_only(rec)
    parts = {name: part for name, part in parts.items()  # hidden: recorded before
             if _reads(name, only) and _reads(name, reads)  # `_files` skipped them, not read
             and not hidden_below(Path(path, name), path)
             and not (name in empty_as_none and _read_as_none(part))}
    now = {_text_name(p.relative_to(path)): p for p in _files(Path(path), only)
           if _reads(p.relative_to(path).as_posix(), reads)}
    sizes = {name: p.stat().st_size for name, p in now.items()}
    if empty_as_none:
        from toymlx.data.chat import blank_file

        now = {name: p for name, p in now.items()
               if not (name in empty_as_none and (not sizes[name] or blank_file(p)))}

    def said(name: str, found: int) -> str:
        return f"{name} changed ({parts[name].get('bytes')} -> {found} bytes)"

    for name in sorted(set(parts) | set(now)):
        if name not in now:
            return f"{name} gone"
        if name not in parts:
            return f"{name} added"
        if isinstance(parts[name], dict) and parts[name].get("bytes") != sizes[name]:
            return said(name, sizes[name])
    for name in sorted(now):
        was = parts[name]
        if isinstance(was, dict) and was.get("sha256") != fingerprint(now[name]).get("sha256"):
            return said(name, sizes[name])
    return None


FOLDER_PARTS = 16
"""A data folder of at most this many files (mlx-lm's train/valid/test.jsonl) records each
file's fingerprint in config.json (`data_files`' "files"), so a check that reads one of them
(`toymlx-eval --split test`: test.jsonl) compares that file alone and names it with its own
sizes; a larger folder's are in `DATA_INDEX_FILE`."""



def _file_record(path: Path, links: bool) -> dict[str, Any]:
    st = path.stat()
    # `links`: the file a link names now (`weights/latest`, `current.gguf`), so the link moving
    # on later does not make the run's input another file; a store's own links (Hugging Face's
    # snapshots) stay as named: a store name is found again by name
    return {"file": os.path.realpath(path) if links else os.path.abspath(path),
            "bytes": st.st_size, "mtime_ns": st.st_mtime_ns,
            "sha256": model_store.file_sha256(path)}


def model_record(spec: str, flag: str) -> dict[str, Any]:
    """What identifies the model file `spec` names (a path, or a store name): {"path": spec,
    "file" (absolute; a path's links resolved), "bytes", "mtime_ns", "sha256"}; for a multi-part
    GGUF (`file` its first part) the same of every part under "parts"; for a Hugging Face name
    the repository, revision (commit) and file it resolved to (`hf_repo`, `hf_revision`,
    `hf_file`)."""
    found = model_store.resolve(spec, flag)
    links = not model_store.is_store_name(spec)
    parts = model_store.gguf_parts(found.path)
    rec = {"path": spec, **_file_record(found.path, links), **found.source}
    if len(parts) > 1:
        rec["parts"] = [_file_record(p, links) for p in parts]
    return rec


def model_files(cfg: Any) -> dict[str, dict[str, Any]]:
    """{option: `model_record`} of the model files the options name (existing files; a recipe
    reports a missing one itself)."""
    out = {}
    for key in MODEL_OPTIONS:
        spec = option(cfg, key)
        if isinstance(spec, str) and (model_store.is_store_name(spec) or Path(spec).is_file()):
            out[key] = model_record(spec, flag_name(key))
    return out


def _same_file(path: Path, rec: dict[str, Any]) -> tuple[bool, str]:
    """(whether the file at `path` has the recorded contents, its SHA-256 or "" when the size
    and modification time are the recorded ones: then it is taken as unchanged, unread)."""
    st = path.stat()
    if st.st_size == rec.get("bytes") and st.st_mtime_ns == rec.get("mtime_ns"):
        return True, ""
    digest = model_store.file_sha256(path)
    return digest == rec.get("sha256"), digest


def _same_model(path: Path, rec: dict[str, Any]) -> tuple[bool, str]:
    """(whether the model at `path` has the recorded contents, what differs: "sha256 HEX12" of
    its file, or for a multi-part GGUF recorded with "parts" the part that differs or is
    missing; "" when nothing was read). Its parts are the ones its first part opens with now
    (`model_store.gguf_parts`), so a model found again elsewhere is checked there."""
    same, digest = _same_file(path, rec)
    if not same:
        return False, f"sha256 {digest[:12]}"
    parts = rec.get("parts")
    if not isinstance(parts, list):
        return True, ""
    now = model_store.gguf_parts(path)
    if len(now) != len(parts):
        return False, f"{counted(len(now), 'part')}, not {len(parts)}"
    for i, (part, want) in enumerate(zip(now[1:], parts[1:]), 2):
        same, digest = _same_file(part, want if isinstance(want, dict) else {})
        if not same:
            return False, f"part {i} {part} with sha256 {digest[:12]}"
    return True, ""


def locate_input(key: str, rec: dict[str, Any], source: str, cfg: Any = None
                 ) -> tuple[str, str]:
    """(the file, what to say about it) a run's input `key` is read from now: the absolute file
    recorded at its start while it is there (a model file: with its recorded contents), else the
    option as typed (a store name resolved again; a path from the current folder) once it has
    the recorded contents; RunError (one line naming both files) if it has others. Where
    neither is there, the option as typed: a reader that needs the file says it is missing (an
    eval of a full checkpoint needs no donor). `cfg`: the run's configuration, whose data
    options say which files of a data folder it reads (`same_contents`)."""
    flag, typed, file = flag_name(key), rec.get("path"), rec.get("file")
    if not isinstance(typed, str) or not isinstance(file, str):
        raise RunError(f"{source}: key {key!r}: expected the option as given and its absolute "
                       f"file, found {found_text(rec)}")
    model = key in MODEL_OPTIONS
    store = model and model_store.is_store_name(typed)
    if not store and Path(file).exists():
        if model:
            same, found = _same_model(Path(file), rec)
            if not same:
                raise RunError(f"{file}: {flag}: expected the file the run started on "
                               f"(sha256 {str(rec.get('sha256'))[:12]}"
                               f"{_parts_note(rec)}), found other contents ({found}); put the "
                               f"run's {key} back there")
        return file, f"{file} (the run's {flag} {typed})"
    gone = (typed, f"{typed} (the run's {flag}: {file} is gone, and so is {typed})")
    try:  # its contents compared with the record below; the blob's own SHA-256 when it loads
        other = model_store.resolve_model(typed, flag, check_digest=False) if model \
            else Path(typed)
    except model_store.ModelStoreError:
        other = None
    if store and (other is None or not same_contents(key, rec, other, cfg)[0]) \
            and Path(file).exists() and _same_model(Path(file), rec)[0]:
        # the name was pulled again, or removed, and the file the run recorded (an Ollama
        # blob, a Hugging Face snapshot) is still there with the run's contents
        now = "names another model" if other is not None else "is not in its store"
        return file, (f"{file} (the run's {flag} {typed}, which now {now}; this file, where "
                      "it led, still has the recorded SHA-256)")
    if other is None or not other.exists():  # nothing to mistake for it: whoever needs the
        return gone  # file says it is gone
    same, found, want = same_contents(key, rec, other, cfg)
    if not same:
        raise RunError(f"{os.path.abspath(other)}: {flag}: expected the run's {key}, "
                       f"recorded as {file} ({want}), found other contents ({found}); "
                       f"{'the store name now names another model' if store else 'it is gone'}"
                       f" and this file is not it: put the run's {key} back")
    used = typed if store else os.path.abspath(other)
    if store:
        return used, f"{other} ({typed}, the run's {flag}, with its recorded SHA-256)"
    kept = ("this file has its recorded SHA-256" if model else
            f"this {'folder' if other.is_dir() else 'file'} has its recorded contents")
    return used, f"{used} (the run's {flag} {typed}: {file} is gone, {kept})"


def read_as_recorded(key: str, rec: dict[str, Any], file: str) -> bool:
    """Whether `file`, read for the recorded input `key`, is where its option as recorded leads
    from here and now: the recorded absolute file, which the path as typed (from the current
    folder, links followed) names too. Only an input read from elsewhere needs saying."""
    typed = rec.get("path")
    return (isinstance(typed, str) and file == rec.get("file")
            and not (key in MODEL_OPTIONS and model_store.is_store_name(typed))
            and file in (os.path.realpath(typed), os.path.abspath(typed)))


def same_contents(key: str, rec: dict[str, Any], path: Path, cfg: Any = None
                  ) -> tuple[bool, str, str]:
    """(whether `path` holds the contents recorded for the input `key`: a model file's SHA-256
    (and its parts'), a data file or folder's `fingerprint` (`same_data`, with the files of it
    the run of configuration `cfg` reads, `data_reads`); what was found, what was recorded, as
    a message names them)."""
    if key in MODEL_OPTIONS:
        same, found = _same_model(path, {"sha256": rec.get("sha256"), "parts": rec.get("parts")})
        return same, found, f"sha256 {str(rec.get('sha256'))[:12]}{_parts_note(rec)}"
    same, now = same_data(path, rec, data_reads(cfg, key, path), data_empty_as_none(cfg, key))
    return (same, f"{now['bytes']} bytes, {fingerprint_note(now)}",
            f"{rec.get('bytes')} bytes, {fingerprint_note(rec)}")


MOVED_KEY = "inputs_moved"
"""A `resume` event's key: {option: {"path" (as given), "file" (absolute), "was" (the file
config.json records)}, and for a model file its "bytes" and "mtime_ns"} for each input the run
reads from another place than config.json records, its contents checked against config.json's
record. config.json is written once (run_start holds its digest), so a move is recorded in the
events; each resume records every move in effect, and the latest resume event's record is where
readers look first (`moved_inputs`)."""


def _latest_resume_record(events: list[dict], key: str, field: str, kind: type
                          ) -> dict[str, dict[str, Any]]:
    """{option: its record under `key`} from the latest `resume` event ({} before any), each
    record an object whose `field` is a `kind` (others, from a hand-edited file, left out)."""
    out: dict[str, dict[str, Any]] = {}
    for e in events:
        if e["kind"] == "resume":
            rec = e.get(key)
            out = {k: v for k, v in rec.items() if isinstance(v, dict)
                   and isinstance(v.get(field), kind)} if isinstance(rec, dict) else {}
    return out


def moved_inputs(events: list[dict]) -> dict[str, dict[str, Any]]:
    """{option: its `MOVED_KEY` record} from the latest `resume` event ({} before any)."""
    return _latest_resume_record(events, MOVED_KEY, "file", str)


DATA_FIXED_KEY = "data_fixed"
"""A `resume` event's key: {option: the data's `fingerprint` as the resume found it} for data
changed since the run started that the resume took as the fix of the data error the run had
ended on (run_end's `DATA_ERROR_KEY`). As with `MOVED_KEY`, each resume records every fix in
effect, and the latest resume event's record is what later resumes check the data against
(`fixed_data`)."""


def fixed_data(events: list[dict]) -> dict[str, dict[str, Any]]:
    """{option: its `DATA_FIXED_KEY` record} from the latest `resume` event ({} before any)."""
    return _latest_resume_record(events, DATA_FIXED_KEY, "bytes", int)


def _moved_record(key: str, typed: str, file: str, was: str) -> dict[str, Any]:
    rec = {"path": typed, "file": file, "was": was}
    if key in MODEL_OPTIONS:  # later readers skip hashing it again while size and time hold
        st = Path(file).stat()
        rec.update(bytes=st.st_size, mtime_ns=st.st_mtime_ns)
    return rec


class OtherContents(RunError):
    """`adopt_input`'s refusal of a file that holds other contents than the run recorded, with
    both as its message names them, so a reader that takes another file (toymlx-export's
    --base) can say so without hashing it again."""

    def __init__(self, message: str, found: str, recorded: str):
        super().__init__(message)
        self.found = found
        """what the file holds ("sha256 HEX12", "N bytes, ...")"""
        self.recorded = recorded
        """what the run recorded, in the same words"""


def adopt_input(key: str, rec: dict[str, Any], given: str, cfg: Any = None
                ) -> tuple[str, str] | None:
    """An input option given again (`--data.path data2` on a resume): None where `given` is the
    recorded file (or its store name); else (its absolute file, what to say) where it holds the
    recorded contents (`same_contents`, of the run of configuration `cfg`); RunError (one line
    naming both paths) where it is missing, `OtherContents` where it holds other contents."""
    flag, typed, file = flag_name(key), rec.get("path"), rec.get("file")
    store = key in MODEL_OPTIONS and model_store.is_store_name(given)
    if (given == typed) if store else os.path.realpath(given) == file:
        return None
    try:  # its contents are hashed below anyway: a blob's SHA-256 against its name first, so
        # a damaged one is not announced as "moved; same contents" before it is refused
        found = model_store.resolve_model(given, flag) if store else Path(given)
    except model_store.ModelStoreError as e:
        raise RunError(str(e)) from None
    where = os.path.abspath(found)
    if not found.exists():
        raise RunError(f"{where}: {flag}: expected the run's {key} (recorded as {file}), found "
                       "nothing there")
    same, now, want = same_contents(key, rec, found, cfg)
    if not same:
        raise OtherContents(f"{where}: {flag}: expected the run's {key}, recorded as {file} "
                            f"({want}), found other contents ({now}); a run keeps its inputs: "
                            f"give the path that holds the run's {key}, or start a new run on "
                            "this one", now, want)
    return (given if store else where), f"{given} (moved; same contents as the run's {typed})"


def resolve_inputs(cfg: Any, saved: dict[str, Any], source: str,
                   given: dict[str, str] | None = None,
                   moved: dict[str, dict[str, Any]] | None = None
                   ) -> tuple[Any, dict[str, str], dict[str, dict[str, Any]]]:
    """(`cfg` with each data and model path it recorded replaced by the file found for it,
    {option: what was used}, {option: its `MOVED_KEY` record where that file is not the one
    config.json records}). The file: `given`'s (an option given again, `adopt_input`), else
    where a resume recorded it moved (`moved`, while it is there), else `locate_input`'s. A
    run's paths then mean the files it started on, from whatever folder it is read."""
    cfg = copy.deepcopy(cfg)
    used, moves = {}, {}
    given, moved = given or {}, moved or {}
    for group in (DATA_FILES_KEY, MODEL_FILES_KEY):
        records = saved.get(group, {})
        if not isinstance(records, dict):
            raise RunError(f"{source}: key {group!r}: expected an object, found "
                           f"{found_text(records)}")
        for key, rec in records.items():
            if not isinstance(rec, dict) or "file" not in rec:
                continue  # written before toymlx recorded absolute files: the path as typed
            if rec.get("path") != option(cfg, key):
                raise RunError(f"{source}: key '{group}.{key}.path': expected the run's "
                               f"{flag_name(key)} {option(cfg, key)!r}, found "
                               f"{found_text(rec.get('path'))}")
            file, used[key], typed = _locate(key, rec, given.get(key), moved.get(key),
                                             f"{source}: {group}", cfg)
            store = key in MODEL_OPTIONS and model_store.is_store_name(file)
            if file != rec["file"] and not store and os.path.exists(file):
                moves[key] = _moved_record(key, typed, file, rec["file"])
            *parents, name = key.split(".")
            holder = cfg
            for part in parents:
                holder = getattr(holder, part)
            setattr(holder, name, file)
    return cfg, used, moves


def _locate(key: str, rec: dict[str, Any], given: str | None, moved: dict[str, Any] | None,
            source: str, cfg: Any) -> tuple[str, str, str]:
    """(file, what to say, the path as given for it) for one recorded input: see
    `resolve_inputs`."""
    if given is not None:
        if (adopted := adopt_input(key, rec, given, cfg)) is not None:
            return (*adopted, given)
    elif moved is not None and Path(there := moved["file"]).exists():
        flag = flag_name(key)
        if key in MODEL_OPTIONS:
            same, found = _same_model(Path(there), {**rec, "bytes": moved.get("bytes"),
                                                    "mtime_ns": moved.get("mtime_ns")})
            if not same:
                raise RunError(f"{there}: {flag}: expected the run's {key} (moved there from "
                               f"{rec.get('file')}, sha256 {str(rec.get('sha256'))[:12]}), "
                               f"found other contents ({found}); put the run's {key} back")
        return there, (f"{there} (the run's {flag} {rec.get('path')}, moved from "
                       f"{rec.get('file')}, as a resume recorded)"), str(moved.get("path", there))
    return (*locate_input(key, rec, source, cfg), str(rec.get("path")))


def _parts_note(rec: dict[str, Any]) -> str:
    parts = rec.get("parts")
    return f", and {counted(len(parts) - 1, 'more part')}" if isinstance(parts, list) else ""


def fingerprint_note(rec: dict[str, Any]) -> str:
    """A recorded fingerprint as a message names it: its digest's first 12 digits (that of all
    its bytes, else of its samples)."""
    if d := rec.get("sha256"):
        return f"sha256 {str(d)[:12]}"
    d = rec.get("sample_sha256")
    return f"samples' sha256 {str(d)[:12]}" if d else "no digest"
