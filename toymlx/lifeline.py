"""Children that do not outlive the toymlx process that started them.

`toymlx-sweep` and `toymlx-launch` start their children with `child_env()`, which names the
parent in `TOYMLX_PARENT_PID`; a child calls `watch_parent()` first thing. When that parent
dies, however it dies (SIGKILL included), the child is told at once: on Linux the kernel sends
it SIGTERM (PR_SET_PDEATHSIG), and everywhere a thread that polls the parent does the same (or
calls `on_loss`). `toymlx-train` treats that SIGTERM as a stop: it finishes the step in
flight, writes a final checkpoint and `run_end`, and exits; a re-run then resumes it.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping

PARENT_ENV = "TOYMLX_PARENT_PID"
_PR_SET_PDEATHSIG = 1  # <sys/prctl.h>


def child_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """`env` (default: this process's) plus the variable that ties a child to this process."""
    return {**(os.environ if env is None else env), PARENT_ENV: str(os.getpid())}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def watch_parent(on_loss: Callable[[], None] | None = None, every: float = 0.5) -> bool:
    """If this process was started with `child_env()`, act when that parent dies: `on_loss()`,
    by default SIGTERM to this process. Returns whether a watch was set up."""
    text = os.environ.get(PARENT_ENV, "")
    if not text.isdigit():
        return False
    parent = int(text)
    direct = os.getppid() == parent  # else a wrapper (a shell) stands between us
    act = on_loss or (lambda: os.kill(os.getpid(), signal.SIGTERM))
    if on_loss is None and direct and sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        except (OSError, AttributeError):
            pass  # the polling thread below still covers it

    def gone() -> bool:
        # A killed parent stays a zombie (kill(pid, 0) succeeds) until its own parent reaps
        # it, but we are re-parented at once: for a direct child that is the quicker sign.
        return (direct and os.getppid() != parent) or not _alive(parent)

    if gone():  # it died before we got here
        act()
        return True

    def poll() -> None:
        while not gone():
            time.sleep(every)
        act()
    threading.Thread(target=poll, name="toymlx-parent-watch", daemon=True).start()
    return True
