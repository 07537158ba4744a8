"""The run bundle's event log, `runs/<run_id>/events.jsonl`, in the toy/v1 format.

This module owns the format: `EventLog.emit` is the only writer, `read_events`/`iter_events`
(and `parse_event` for a reader following a growing file) the only readers, and
`check_toy_v1` says where a bundle's events depart from it. One JSON object per line,
flushed and fsynced per event, so a crash loses at most the line being written; readers skip
a torn last line, and `scan` tells such a line from damage (a garbled line no crash explains),
which a reader then names (`Log.damaged`). A resume first cuts the log back to its checkpoint
(`cut_back`), so a run killed and resumed any number of times still reads as one run: one
run_start, each step once, at most one run_end, and `t` never going back (toymlx's `resume`
event marks where).

toy/v1 names each event's type under `kind` (`run_start`, `step`, `run_end`; toymlx adds
`eval`, `checkpoint`, `resume`, ...). Bundles written before toymlx 0.2 named it `event`; the
readers return those events with `kind` like any other.

One departure from toy/v1, which has no value for it: where no step completed (a run stopped
or diverged before its first step ended), run_end's `final_loss` is null.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import math
import os
import platform
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from toymlx import __version__
from toymlx.backend import atomic
from toymlx.backend.files import shortlist, special_kind

EVENTS_FILE = "events.jsonl"
"""A bundle's event log, beside config.json."""

SCHEMA = "toy/v1"
_LEGACY_KIND = "event"  # what toymlx < 0.2 wrote in place of `kind`


def _clean(v: Any) -> Any:
    """JSON-safe: NaN/inf become strings, numpy/mlx scalars become Python numbers."""
    if isinstance(v, float):
        return v if math.isfinite(v) else str(v)
    if isinstance(v, dict):
        return {str(k): _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    if isinstance(v, (str, int, bool)) or v is None:
        return v
    if hasattr(v, "item"):
        return _clean(v.item())
    return str(v)


def _fixed(kind: str) -> dict[str, Any]:
    """The fields toy/v1 fixes for an event of `kind` (constants and timestamps)."""
    if kind == "run_start":
        return {"schema": SCHEMA, "started_at": now_iso(), "phase": "train",
                "toymlx_version": __version__}
    if kind == "step":
        return {"phase": "train"}
    if kind == "run_end":
        return {"ended_at": now_iso()}
    return {}


class EventLog:
    """Append-only writer of one run's events."""

    def __init__(self, path: str | os.PathLike, enabled: bool = True, t_offset: float = 0.0,
                 sinks: list[Any] | None = None):
        self.path = Path(path)
        self.enabled = enabled
        self.sinks = list(sinks or [])
        """Called with each event as written (`toymlx.bundle.reporters`: --report-to), so they
        see events.jsonl's records; one that fails is named once and dropped, never the run."""
        self.t0 = time.time() - t_offset  # a resumed run's clock goes on from its last event
        self._f = None
        self._last_loss: tuple[Any, float] = (None, math.nan)  # (step, loss) last emitted
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # unbuffered bytes: what a failed write left can be cut off (`emit`), where a
            # text file's buffer kept it and wrote it out again at close
            self._f = open(self.path, "ab", buffering=0)  # noqa: SIM115 -- held for the run
            # A crash mid-emit leaves a torn last line; end it, or the first event appended
            # on resume (its run_start) would be glued to it and skipped by read_events.
            if self._f.tell():
                with open(self.path, "rb") as f:
                    f.seek(-1, os.SEEK_END)
                    torn = f.read(1) != b"\n"
                if torn:  # on a full disk: the error names events.jsonl
                    self._append(b"\n")

    def emit(self, kind: str, **fields: Any) -> dict:
        """Write one event: `kind`, `t` and what toy/v1 fixes for the kind (schema, phase,
        started_at/ended_at, toymlx_version), then the caller's fields; returns the event."""
        loss = fields.get("loss")
        if kind == "step" and isinstance(loss, float) and math.isfinite(loss):
            self._last_loss = (fields.get("step"), loss)
        if kind == "run_start" and "git" in fields and fields["git"] is None:
            del fields["git"]  # toy/v1: `git` appears only when the run knows its commit
        ev = {"kind": kind, "t": round(time.time() - self.t0, 4), **_fixed(kind),
              **_clean(fields)}
        if self._f is not None:
            self._append((json.dumps(ev, ensure_ascii=False, allow_nan=False) + "\n"
                          ).encode("utf-8"))
        for sink in list(self.sinks):
            try:
                sink(ev)
            except Exception as e:  # noqa: BLE001 -- a reporter's failure must not end the run
                self._drop(sink, e)
        return ev

    def _append(self, line: bytes) -> None:
        """`line` at the end of the file, fsynced; a write that fails (a full disk) is cut off
        again, so the file still ends at its last whole event."""
        end = self._f.seek(0, os.SEEK_END)
        try:
            rest = memoryview(line)
            while rest:  # a full disk cuts a write short first, then refuses the next
                rest = rest[self._f.write(rest):]
            os.fsync(self._f.fileno())
        except OSError as e:
            with contextlib.suppress(OSError):
                self._f.truncate(end)
            raise atomic.named(e, self.path) from None

    def _drop(self, sink: Any, e: BaseException) -> None:
        self.sinks.remove(sink)
        print(f"toymlx: --report-to: {type(sink).__name__} stopped: {type(e).__name__}: "
              f"{' '.join(str(e).split())}; events.jsonl goes on", file=sys.stderr)

    def loss_at(self, step: int) -> float | None:
        """The finite loss logged for `step` (its newest step event; earlier segments of a
        resumed run included), None if there is none: run_end's `final_loss`."""
        if self._last_loss[0] == step:
            return self._last_loss[1]
        found = None
        for ev in iter_events(self.path):
            if ev["kind"] == "step" and ev.get("step") == step:
                found = ev.get("loss")
        return found if isinstance(found, float) else None

    def close(self) -> None:
        for sink in list(self.sinks):
            try:
                sink.close()
            except Exception as e:  # noqa: BLE001 -- as in emit
                self._drop(sink, e)
        self.sinks = []
        if self._f is not None:
            self._f.close()
            self._f = None


RESTARTS = ("run_start", "resume")
"""What a process going on with a killed run writes first. Lines that are no event just before
one of them are the torn line the kill left (and what a kill during the restart left): a resume
moves such lines out now (`cut_back`), older toymlx left them, its resume a second run_start."""


_RESTART_FIELDS = {"run_start": {"start_step": int}, "resume": {"from_step": int, "steps": int,
                                                                  "checkpoint": str}}
"""The fields of a restart event that `cut_back` and the readers act on, by their type (each
may be missing or null: older toymlx wrote fewer)."""


def restart_problem(ev: dict) -> str | None:
    """Why a run_start or resume event cannot be what toymlx wrote (a field of its
    `_RESTART_FIELDS` of another type, a step below 0: a line edited by hand that still
    parses), None where it can: such a line is damage, not a restart (`scan`)."""
    for key, want in _RESTART_FIELDS.get(ev["kind"], {}).items():
        v = ev.get(key)
        if v is not None and (not isinstance(v, want) or isinstance(v, bool)
                              or (want is int and v < 0)):
            return (f"key {key!r}: expected {'a step' if want is int else 'a path'}, found "
                    f"{json.dumps(v)}")
    return None


def scan(lines: Iterable[bytes]) -> Iterator[tuple[int, bytes, dict | None, str | None]]:
    """Each line of an events.jsonl, in order, as (its number from 1, the line, its event or
    None, what a line that is no event is): "torn" where a crash explains it (the last line cut
    short: a kill mid-write, or a write still under way; lines just before a run_start or
    resume: a killed run's torn line, then its restart), "damaged" where nothing does (a garbled
    line among the events, or a whole line at the end: the file was changed after it was
    written), "blank" for an empty line (nothing lost). A run_start or resume line that
    parses but holds what toymlx never writes there (`restart_problem`) is no event either: no
    restart it explains, damage like a garbled line. The one reading of the lines every reader
    shares (`iter_events`, `read_log`, `cut_back`)."""
    held: list[tuple[int, bytes]] = []  # lines that are no event, until the next event says why
    for n, raw in enumerate(lines, 1):
        ev = parse_event(raw)
        if ev is not None and restart_problem(ev) is not None:
            ev = None
        if ev is None:
            held.append((n, raw))
            continue
        why = "torn" if ev["kind"] in RESTARTS else "damaged"
        for m, bad in held:
            yield m, bad, None, why if bad.strip() else "blank"
        held = []
        yield n, raw, ev, None
    for m, bad in held:
        yield m, bad, None, ("blank" if not bad.strip() else "damaged" if bad.endswith(b"\n")
                             else "torn")


def _log_path(path: str | os.PathLike) -> Path:
    """The events.jsonl of a bundle folder or the file itself; ValueError (one line) where it is
    a FIFO, a device or a socket, which is read no further."""
    p = Path(path)
    if not p.is_file():  # a folder, or one not made yet (a run starting while it is read)
        p = p / "events.jsonl"
    if kind := special_kind(p):  # a FIFO or a device is no log: reading it could wait forever
        raise ValueError(f"{p}: expected a regular file (the run's event log), found {kind}; "
                         f"put the run's events.jsonl back in its place")
    return p


def _scan_file(p: Path) -> Iterator[tuple[int, bytes, dict | None, str | None]]:
    """`scan` of the file `p`; nothing where it is missing."""
    try:
        f = open(p, "rb")  # noqa: SIM115 (a missing file ends the iterator; closed just below)
    except (FileNotFoundError, NotADirectoryError):
        return
    with f:
        yield from scan(f)


@dataclass
class Log:
    """A bundle's events as read (`read_log`), and its lines that were no event."""

    path: Path
    events: list[dict]
    lines: int
    """How many lines the file had."""
    torn: list[int]
    """The numbers (from 1) of the lines a crash explains (`scan`): skipped in silence."""
    damaged: list[int]
    """The numbers of the garbled lines no crash explains: the reader names them."""

    @property
    def cut_short(self) -> bool:
        """Whether the last line is cut short (what a kill mid-write leaves, or a write still
        under way): the run may have gone on past its last event."""
        return self.lines in self.torn


def damage_note(path: Path, damaged: list[int]) -> str | None:
    """One line naming the `damaged` lines of the events file `path` (`Log.damaged`), None where
    there are none; the caller adds what it does without them."""
    if not damaged:
        return None
    what = "a garbled line" if len(damaged) == 1 else "garbled lines"
    return (f"{path}: {line_numbers(damaged)}: expected an event (one JSON object a line), found "
            f"{what} that no kill or resume explains: the file was damaged")


def line_numbers(n: list[int]) -> str:
    """"line 7", "lines 3 and 4", "lines 2, 5, 9 and 2 more"."""
    return (f"line {n[0]}" if len(n) == 1 else
            f"lines {', '.join(map(str, n[:-1]))} and {n[-1]}" if len(n) <= 3 else
            f"lines {shortlist([str(k) for k in n], 3)}")


def read_log(path: str | os.PathLike) -> Log:
    """The events of a bundle folder or events.jsonl (see `read_events`), with the lines that
    were no event, torn or damaged (`scan`)."""
    p = _log_path(path)
    log = Log(p, [], 0, [], [])
    for n, _, ev, what in _scan_file(p):
        log.lines = n
        if ev is not None:
            log.events.append(ev)
        elif what in ("torn", "damaged"):
            getattr(log, what).append(n)
    return log


def read_events(path: str | os.PathLike) -> list[dict]:
    """All complete events of a bundle; a torn or garbled line is skipped, not fatal."""
    return read_log(path).events


def parse_event(raw: bytes | str) -> dict | None:
    """One events.jsonl line as an event with `kind` (also from the older `event` key), or
    None for a torn, garbled or non-event line."""
    try:
        ev = json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError):  # RecursionError: nested deep
        return None
    if not isinstance(ev, dict):
        return None
    if isinstance(ev.get("kind"), str):
        return ev
    if isinstance(ev.get(_LEGACY_KIND), str):
        return {"kind": ev.pop(_LEGACY_KIND), **ev}
    return None


def iter_events(path: str | os.PathLike) -> Iterator[dict]:
    """The events of a bundle folder or events.jsonl, one by one (see `read_events`); ValueError
    (one line) where events.jsonl is a FIFO, a device or a socket, which is read no further."""
    for _, _, ev, _ in _scan_file(_log_path(path)):
        if ev is not None:
            yield ev


def stopped_untrained(end: dict) -> bool:
    """Whether run_end `end` is of a run stopped (a signal) before it trained its first step,
    at step 0: a new run's folder then goes (`toymlx.runner.run`), and its W&B run is tagged
    `NOTHING_TRAINED` (`toymlx.bundle.reporters`); a resumed run's stays."""
    return end.get("reason") == "interrupted" and end.get("final_step") == 0


def run_start(events: Iterable[dict]) -> dict | None:
    """The first run_start of `events` (a list, or `iter_events`, then read no further), None
    where there is none: the one lookup of what a run recorded when it started."""
    return next((e for e in events if e.get("kind") == "run_start"), None)


SUPERSEDED = "events.superseded.jsonl"
"""Beside events.jsonl: the lines a resume took out of it, appended in their order."""
DAMAGED_KEY = "damaged_lines"
"""A `resume` event's key: the numbers (from 1, as they stood) of the garbled lines no kill or
resume explains (`Log.damaged`) that its `cut_back` moved to `SUPERSEDED`; events.jsonl holds
no trace of them but this, which later readers say (`moved_damage`)."""


def moved_damage(events: list[dict]) -> str | None:
    """What the resumes among `events` moved out of events.jsonl as damage (their
    `DAMAGED_KEY`), as a message says it; None where they moved none."""
    moved = [(e[DAMAGED_KEY], e.get("from_step")) for e in events if e["kind"] == "resume"
             and isinstance(e.get(DAMAGED_KEY), list) and e[DAMAGED_KEY]
             and all(isinstance(n, int) for n in e[DAMAGED_KEY])]
    if not moved:
        return None
    what = "a garbled line" if sum(len(n) for n, _ in moved) == 1 else "garbled lines"
    where = "; ".join(f"{line_numbers(n)} as it stood before the resume from step {k}"
                      for n, k in moved)
    return (f"{where}: {what} that no kill or resume explains, moved to {SUPERSEDED}: the file "
            "was damaged")


_STEPPED = ("step", "eval", "checkpoint", "export")


@dataclass
class Cut:
    """What `cut_back` did to a bundle's events."""

    dropped: int
    """Lines moved to events.superseded.jsonl (events past the step, the old run_end, torn
    lines, and the extra run_starts of bundles written before resume events existed)."""
    previous_end: str
    """The dropped run_end's reason, or "torn" when the run had none (it was killed)."""
    damaged: list[int]
    """The numbers of the dropped lines that were damage, not torn (`scan`), as they stood."""
    t: float
    """The latest `t` of any event, kept or dropped: the resumed clock starts there."""
    kept: list[dict]
    """The events that remain."""


def cut_back(run_dir: str | os.PathLike, step: int, dry_run: bool = False) -> Cut:
    """Rewrite a bundle's events.jsonl, atomically, as the run stood at the checkpoint of
    `step`: the `step`/`eval`/`checkpoint`/`export` events past it, `resume` events from past
    it, and the run_end go to events.superseded.jsonl. A resumed run then reads as one run: one
    run_start, each step once, one run_end (toy/v1). `dry_run`: what the cut would do, with
    nothing written."""
    path = Path(run_dir) / "events.jsonl"
    lines = list(_scan_file(path))
    raw = [line for _, line, _, _ in lines]
    parsed = [ev for _, _, ev, _ in lines]
    drop = [ev is None for ev in parsed]

    def back_to(k: int, upto: int) -> None:  # drop what lies past step k among lines < upto
        for i in range(upto):
            ev = parsed[i]
            if ev is None or drop[i]:
                continue
            kind, s = ev["kind"], ev.get("step")
            if (kind == "run_end" or (kind in _STEPPED and isinstance(s, int) and s > k)
                    or (kind == "resume" and int(ev.get("from_step") or 0) > k)):
                drop[i] = True

    starts = 0
    for i, ev in enumerate(parsed):
        if ev is None:
            continue
        if ev["kind"] == "run_start":
            starts += 1
            if starts > 1:  # an older toymlx's resume: a second run_start from its start_step
                back_to(int(ev.get("start_step") or 0), i)
                drop[i] = True
    back_to(step, len(parsed))
    ends = [ev for ev, d in zip(parsed, drop) if ev is not None and d and ev["kind"] == "run_end"]
    times = [ev["t"] for ev in parsed if ev is not None and isinstance(ev.get("t"), (int, float))]
    gone = [line if line.endswith(b"\n") else line + b"\n" for line, d in zip(raw, drop) if d]
    if gone and not dry_run:  # first the copy, then the cut: a crash in between never loses
        moved = b"".join(gone)
        aside = path.with_name(SUPERSEDED)
        if not _ends_with(aside, moved):  # the copy a cut killed before its cut already made
            _append_whole(aside, moved)
        atomic.write_bytes(path, b"".join(line for line, d in zip(raw, drop) if not d))
    return Cut(dropped=len(gone), previous_end=ends[-1].get("reason", "unknown") if ends
               else "torn", damaged=[n for n, _, _, what in lines if what == "damaged"],
               t=max(times, default=0.0),
               kept=[ev for ev, d in zip(parsed, drop) if ev is not None and not d])


def _append_whole(path: Path, data: bytes) -> None:
    """`data` at the end of the file `path`, fsynced; a write that fails (a full disk) is cut
    off again, so the file still ends as it did, and its OSError names `path`."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        end = os.lseek(fd, 0, os.SEEK_END)
        try:
            rest = memoryview(data)
            while rest:
                rest = rest[os.write(fd, rest):]
            os.fsync(fd)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, end)
            raise OSError(e.errno, e.strerror, str(path)) from None
    finally:
        os.close(fd)


def _ends_with(path: Path, data: bytes) -> bool:
    """Whether the file `path` ends with `data` (False where there is no such file)."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            if size < len(data):
                return False
            f.seek(size - len(data))
            return f.read() == data
    except FileNotFoundError:
        return False


def host_info() -> dict:
    return {"name": platform.node(), "os": platform.system().lower(), "arch": platform.machine(),
            "python": platform.python_version()}


def git_info(cwd: str | os.PathLike | None = None) -> dict | None:
    """sha and branch of the git checkout the run is started in, if any."""
    try:
        def run(*a):
            return subprocess.run(["git", *a], cwd=cwd, capture_output=True, text=True,
                                  timeout=5, check=True).stdout.strip()
        sha = run("rev-parse", "HEAD")
        branch = run("rev-parse", "--abbrev-ref", "HEAD")
        dirty = bool(run("status", "--porcelain", "--untracked-files=no"))
        return {"sha": sha, "branch": branch, "dirty": dirty}
    except (OSError, subprocess.SubprocessError):
        return None


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).astimezone().isoformat(timespec="seconds")


# ---------------------------------------------------------------- the format, checked

_NUMBER, _INT, _STR, _ISO = "number", "int", "string", "ISO-8601 string"
_REQUIRED: dict[str, dict[str, Any]] = {
    "run_start": {"schema": SCHEMA, "t": _NUMBER, "started_at": _ISO, "run_id": _STR,
                  "phase": "train", "host": {"name": _STR, "os": _STR, "arch": _STR},
                  "backend": {"kind": _STR}, "model": {"arch": _STR},
                  "config": {"steps": _INT, "lr": _NUMBER, "seed": _INT}},
    "step": {"phase": "train", "t": _NUMBER, "step": _INT, "loss": _NUMBER},
    "run_end": {"t": _NUMBER, "ended_at": _ISO, "reason": _STR, "final_step": _INT,
                "final_loss": _NUMBER, "exit_code": _INT},
}
_LM = ("vocab", "d_model", "n_layers")
_MODEL = {"llama": _LM, "qwen2": _LM, "qwen3": _LM, "gemma2": _LM, "gemma3": _LM, "phi3": _LM,
          "smollm3": _LM, "granite": _LM, "olmo2": _LM, "mistral3": _LM, "gemma4": _LM,
          "qwen35": _LM, "qwen3moe": _LM, "qwen2moe": _LM,
          "vit": ("image_size", "patch_size", "d_model", "n_layers", "num_classes")}
"""What run_start's model carries per architecture (the language models are the decoders
`toymlx.gguf.llama.ARCHS` loads)."""


def _type_problem(v: Any, want: Any) -> str | None:
    """Why `v` is not what toy/v1 wants there (a type name or a constant), None if it is."""
    if want == _NUMBER:
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    elif want == _INT:
        ok = isinstance(v, int) and not isinstance(v, bool)
    elif want == _STR:
        ok = isinstance(v, str)
    elif want == _ISO:
        try:
            ok = isinstance(v, str) and _dt.datetime.fromisoformat(v) is not None
        except ValueError:
            ok = False
    else:
        ok, want = v == want, json.dumps(want)
    return None if ok else f"expected {want}, found {json.dumps(v)}"


def _check_keys(ev: dict, spec: dict[str, Any], prefix: str = "") -> list[str]:
    out = []
    for key, want in spec.items():
        name = prefix + key
        if key not in ev:
            out.append(f"key {name!r}: missing")
        elif isinstance(want, dict):
            if isinstance(ev[key], dict):
                out += _check_keys(ev[key], want, name + ".")
            else:
                out.append(f"key {name!r}: expected an object, found {json.dumps(ev[key])}")
        elif (why := _type_problem(ev[key], want)) is not None:
            out.append(f"key {name!r}: {why}")
    return out


def _event_problems(ev: dict) -> list[str]:
    """Where one event departs from TOY_V1's table (keys and types)."""
    kind = ev.get("kind")
    if not isinstance(kind, str):
        return [f"key 'kind': expected a string, found {json.dumps(kind)}"]
    out = _check_keys(ev, _REQUIRED.get(kind, {}))
    if kind == "run_start":
        model = ev["model"] if isinstance(ev.get("model"), dict) else {}
        config = ev["config"] if isinstance(ev.get("config"), dict) else {}
        out += _check_keys(model, dict.fromkeys(_MODEL.get(model.get("arch"), ()), _INT),
                           "model.")
        if _MODEL.get(model.get("arch")) is _LM:  # a language model
            out += _check_keys(config, {"context": _INT}, "config.")
        if "git" in ev:
            out += (_check_keys(ev["git"], {"sha": _STR, "branch": _STR}, "git.")
                    if isinstance(ev["git"], dict) else
                    [f"key 'git': expected an object or no key, found {json.dumps(ev['git'])}"])
    elif kind == "step" and isinstance(ev.get("step"), int) and ev["step"] < 1:
        out.append(f"key 'step': expected >= 1 (1-indexed), found {ev['step']}")
    elif kind == "run_end":
        if "final_loss" in ev and ev["final_loss"] is None and ev.get("final_step") == 0:
            out = [p for p in out if not p.startswith("key 'final_loss'")]
        if ev.get("reason") == "completed" and ev.get("exit_code") != 0:
            out.append(f"key 'exit_code': expected 0 for reason \"completed\", found "
                       f"{json.dumps(ev.get('exit_code'))}")
    return out


def step_gaps(events: list[dict]) -> list[tuple[int, str, int, int]]:
    """(event index, phase, expected step, found step) wherever a phase's step events depart
    from 1, 2, 3, ... (toy/v1: one per optimizer step): found > expected means the steps from
    expected to found - 1 are missing (a line deleted by hand); found < expected, a step
    repeated or out of order."""
    out, last = [], {}
    for i, ev in enumerate(events):
        step = ev.get("step")
        if ev.get("kind") != "step" or not isinstance(step, int) or isinstance(step, bool):
            continue  # a step event without an int step is named by _event_problems
        phase = str(ev.get("phase"))
        if step != last.get(phase, 0) + 1:
            out.append((i, phase, last.get(phase, 0) + 1, step))
        last[phase] = step
    return out


def check_toy_v1(events: list[dict]) -> list[str]:
    """Every way `events` (as `read_events` returns them) depart from toy/v1, one line each:
    required keys and their types, exactly one run_start and first, each step of a phase once
    and in order, at most one run_end and last. An empty list means a toy/v1 reader reads the
    bundle as toymlx wrote it."""
    out = [f"event {i + 1} ({ev.get('kind')}): {p}" for i, ev in enumerate(events)
           for p in _event_problems(ev)]
    for i, phase, want, found in step_gaps(events):
        what = (f"step {want} is missing" if found == want + 1 else
                f"steps {want} to {found - 1} are missing" if found > want else
                "a step repeated or out of order")
        out.append(f"event {i + 1} (step): key 'step': expected {want} (each step of phase "
                   f"{phase!r} once, in order), found {found}: {what}")
    kinds = [ev.get("kind") for ev in events]
    if kinds.count("run_start") != 1:
        out.append(f"run_start: expected exactly one, found {kinds.count('run_start')}")
    elif kinds[0] != "run_start":
        out.append(f"run_start: expected first, found at event {kinds.index('run_start') + 1}")
    if kinds.count("run_end") > 1:
        out.append(f"run_end: expected at most one, found {kinds.count('run_end')}")
    elif "run_end" in kinds and kinds[-1] != "run_end":
        out.append(f"run_end: expected last, found at event {kinds.index('run_end') + 1} of "
                   f"{len(kinds)}")
    return out
