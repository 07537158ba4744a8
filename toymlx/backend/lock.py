"""Exclusive ownership of a file or folder, held by a live process: an OS lock (`flock`) that the
kernel drops when its holder dies, however it dies.

    with acquire(run_dir / LOCK_FILE, "run bundle " + str(run_dir)):
        ...   # only this process writes the bundle

A pid file can outlive its process (and a recycled pid can look alive); a `flock` cannot. The
lock file holds the holder's pid, host and command line, read only to say who holds it. It is
removed when released; a waiter that locked the removed file sees that the path no longer
names its file and tries again, so two processes never both believe they hold it.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import errno
import fcntl
import json
import os
import shlex
import socket
import sys
import time
from pathlib import Path
from typing import Any

from toymlx.backend.atomic import named
from toymlx.backend.lifeline import shown_command

LOCK_FILE = ".lock"
"""The lock file's name inside a run bundle."""


class LockHeld(ValueError):
    """Another live process holds the lock; the message names it (one line)."""

    def __init__(self, what: str, holder: dict[str, Any]):
        self.holder = holder
        super().__init__(f"{what}: in use by {described(holder)}; wait for it to end, or stop "
                         f"it first (kill -INT {holder.get('pid', '?')})")


def described(holder: dict[str, Any]) -> str:
    """A lock's holder (`holder`'s record) in words: `process PID (COMMAND) [on HOST] [since
    TIME]`, the host named only where it is another machine."""
    cmd = str(holder.get("command") or "unknown command")
    cmd = cmd if len(cmd) <= 600 else cmd[:597] + "..."
    where = holder.get("host")
    return (f"process {holder.get('pid', '?')} ({cmd})"
            + (f" on {where}" if where and where != socket.gethostname() else "")
            + (f" since {holder['since']}" if holder.get("since") else ""))


class Lock:
    """A held lock; `release()` (or leaving the `with` block) gives it up."""

    def __init__(self, path: Path, fd: int):
        self.path, self._fd = path, fd

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            # a folder turned read-only keeps the file, which blocks no one (a flock dies with
            # its holder); raising here ended a run in a traceback after its error line
            with contextlib.suppress(OSError):
                self.path.unlink(missing_ok=True)  # while still held: see the module docstring
        finally:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> Lock:  # noqa: PYI034
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _me() -> dict[str, Any]:
    argv = getattr(sys, "orig_argv", None) or [sys.executable, *sys.argv]
    return {"pid": os.getpid(), "host": socket.gethostname(),
            "command": shlex.join(shown_command(argv)),
            "since": _dt.datetime.now().astimezone().isoformat(timespec="seconds")}


def holder(path: str | os.PathLike) -> dict[str, Any]:
    """What the lock file says about its holder ({} when it says nothing readable)."""
    try:
        info = json.loads(Path(path).read_text(encoding="utf-8") or "{}")
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def held_by(path: str | os.PathLike) -> dict[str, Any] | None:
    """Who holds the lock `path` now (`holder`'s record, {} if it says nothing), or None when
    no live process holds it; the lock is only tested, never taken or removed."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return holder(path)
    except OSError:
        return None
    finally:
        os.close(fd)  # drops the shared lock if it was taken
    return None


def acquire(path: str | os.PathLike, what: str, wait: float = 0.0) -> Lock:
    """Take the exclusive lock `path` (created if missing), waiting up to `wait` seconds for
    another holder to let go; LockHeld naming the holder when it still has it. `what` names
    the locked thing in messages."""
    path = Path(path)
    deadline = time.monotonic() + wait
    changed = 0
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            if time.monotonic() < deadline:
                time.sleep(0.05)
                continue
            raise LockHeld(what, holder(path)) from None
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                raise OSError(e.errno, f"{path}: expected a filesystem with file locks, found "
                                       f"none ({e.strerror}); use a local folder") from None
            raise
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if not same:  # released and removed by its last holder after we opened it
            os.close(fd)
            changed += 1
            if changed >= 20:
                raise OSError(errno.EAGAIN,
                              f"{path}: could not take the lock (it kept changing hands)")
            continue
        lock = Lock(path, fd)
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(_me()).encode(), 0)
        except OSError as e:  # a full disk: given up (not held by a leaked fd), and named
            lock.release()
            raise named(e, path) from None
        return lock
