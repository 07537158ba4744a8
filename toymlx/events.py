"""The run bundle's event log: `runs/<run_id>/events.jsonl`, written only through here.

One JSON object per line, flushed and fsynced per event, so a crash loses at most the line
being written. Readers skip a torn last line. A resume first cuts the log back to its
checkpoint (`cut_back`), so a run killed and resumed any number of times still reads as one
run: one run_start, each step once, at most one run_end, and `t` never going back.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from toymlx import atomic

SCHEMA = "toy/v1"


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


class EventLog:
    """Append-only writer of one run's events."""

    def __init__(self, path: str | os.PathLike, enabled: bool = True, t_offset: float = 0.0):
        self.path = Path(path)
        self.enabled = enabled
        self.t0 = time.time() - t_offset  # a resumed run's clock goes on from its last event
        self._f = None
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._f = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 -- held for the run
            # A crash mid-emit leaves a torn last line; end it, or the first event appended
            # on resume (its run_start) would be glued to it and skipped by read_events.
            if self._f.tell():
                with open(self.path, "rb") as f:
                    f.seek(-1, os.SEEK_END)
                    torn = f.read(1) != b"\n"
                if torn:
                    self._f.write("\n")

    def emit(self, kind: str, **fields: Any) -> dict:
        ev = {"event": kind, "t": round(time.time() - self.t0, 4), **_clean(fields)}
        if self._f is not None:
            self._f.write(json.dumps(ev, ensure_ascii=False, allow_nan=False) + "\n")
            self._f.flush()
            os.fsync(self._f.fileno())
        return ev

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def read_events(path: str | os.PathLike) -> list[dict]:
    """All complete events of a bundle; a torn or garbled line is skipped, not fatal."""
    return list(iter_events(path))


def iter_events(path: str | os.PathLike) -> Iterator[dict]:
    p = Path(path)
    if p.is_dir():
        p = p / "events.jsonl"
    if not p.exists():
        return
    with open(p, "rb") as f:
        for raw in f:
            try:
                ev = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError):
                continue
            if isinstance(ev, dict) and "event" in ev:
                yield ev


SUPERSEDED = "events.superseded.jsonl"
"""Beside events.jsonl: the lines a resume took out of it, appended in their order."""
_STEPPED = ("step", "eval", "checkpoint")


@dataclass
class Cut:
    """What `cut_back` did to a bundle's events."""

    dropped: int
    """Lines moved to events.superseded.jsonl (events past the step, the old run_end, torn
    lines, and the extra run_starts of bundles written before resume events existed)."""
    previous_end: str
    """The dropped run_end's reason, or "torn" when the run had none (it was killed)."""
    t: float
    """The latest `t` of any event, kept or dropped: the resumed clock starts there."""
    kept: list[dict]
    """The events that remain."""


def kind_of(ev: dict) -> str | None:
    """An event's type, under `kind` (toy/v1) or `event` (bundles of older toymlx versions)."""
    return ev.get("kind", ev.get("event"))


def cut_back(run_dir: str | os.PathLike, step: int) -> Cut:
    """Rewrite a bundle's events.jsonl, atomically, as the run stood at the checkpoint of
    `step`: the `step`/`eval`/`checkpoint` events past it, `resume` events from past it, and
    the run_end go to events.superseded.jsonl. A resumed run then reads as one run: one
    run_start, each step once, one run_end (toy/v1)."""
    path = Path(run_dir) / "events.jsonl"
    raw = path.read_bytes().splitlines(keepends=True) if path.exists() else []
    parsed: list[dict | None] = []
    for line in raw:
        try:
            ev = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            ev = None
        parsed.append(ev if isinstance(ev, dict) and kind_of(ev) else None)
    drop = [ev is None for ev in parsed]

    def back_to(k: int, upto: int) -> None:  # drop what lies past step k among lines < upto
        for i in range(upto):
            ev = parsed[i]
            if ev is None or drop[i]:
                continue
            kind, s = kind_of(ev), ev.get("step")
            if (kind == "run_end" or (kind in _STEPPED and isinstance(s, int) and s > k)
                    or (kind == "resume" and int(ev.get("from_step") or 0) > k)):
                drop[i] = True

    starts = 0
    for i, ev in enumerate(parsed):
        if ev is None:
            continue
        if kind_of(ev) == "run_start":
            starts += 1
            if starts > 1:  # an older toymlx's resume: a second run_start from its start_step
                back_to(int(ev.get("start_step") or 0), i)
                drop[i] = True
    back_to(step, len(parsed))
    ends = [ev for ev, d in zip(parsed, drop) if ev is not None and d and kind_of(ev) == "run_end"]
    times = [ev["t"] for ev in parsed if ev is not None and isinstance(ev.get("t"), (int, float))]
    gone = [line if line.endswith(b"\n") else line + b"\n" for line, d in zip(raw, drop) if d]
    if gone:  # first the copy, then the cut: a crash in between duplicates, never loses
        with open(path.with_name(SUPERSEDED), "ab") as f:
            f.writelines(gone)
            f.flush()
            os.fsync(f.fileno())
        atomic.write_bytes(path, b"".join(line for line, d in zip(raw, drop) if not d))
    return Cut(dropped=len(gone), previous_end=ends[-1].get("reason", "unknown") if ends
               else "torn", t=max(times, default=0.0),
               kept=[ev for ev, d in zip(parsed, drop) if ev is not None and not d])


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
