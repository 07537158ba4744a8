"""The benchmark's temporary folders: `scratch_folder`, removed however its block ends."""

from __future__ import annotations

import signal
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ENDING = (signal.SIGTERM, signal.SIGHUP)
"""Signals whose default ends the process without unwinding it (no `finally` or `with` block
runs): `kill`, `timeout`, a job scheduler, a closed terminal. Ctrl-C's SIGINT raises
KeyboardInterrupt already."""


def _exit(signum: int, frame: Any) -> None:
    # the process is ending: a second signal (`timeout` sends its SIGTERM to the command and
    # then to its process group, microseconds apart) must not cut the folders' removal short
    for sig in ENDING:
        signal.signal(sig, signal.SIG_IGN)
    raise SystemExit(128 + signum)  # the shell's code for a process this signal ended


@contextmanager
def scratch_folder(prefix: str) -> Iterator[Path]:
    """A new temporary folder named `prefix`..., removed when the block ends: at its end, by an
    exception, Ctrl-C, or a SIGTERM or SIGHUP (which exit 128 + the signal's number while the
    block runs, not kill the process where it stands: a CPU suite so ended left 52 MB behind)."""
    main = threading.current_thread() is threading.main_thread()  # handlers are set there only
    before = {sig: signal.signal(sig, _exit) for sig in ENDING} if main else {}
    try:
        with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
            yield Path(tmp)
    finally:
        for sig, handler in before.items():
            if signal.getsignal(sig) is _exit:  # not after a stop: the process is ending
                signal.signal(sig, handler)
