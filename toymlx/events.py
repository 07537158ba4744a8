"""The run bundle's event log: `runs/<run_id>/events.jsonl`, written only through here.

One JSON object per line, flushed and fsynced per event, so a crash loses at most the line
being written. Readers skip a torn last line.
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
from pathlib import Path
from typing import Any

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

    def __init__(self, path: str | os.PathLike, enabled: bool = True):
        self.path = Path(path)
        self.enabled = enabled
        self.t0 = time.time()
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
