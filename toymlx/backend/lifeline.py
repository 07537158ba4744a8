"""Children that do not outlive the toymlx process that started them.

`toymlx-sweep` and `toymlx-launch` start their children with `child_env()`, which names the
parent in `TOYMLX_PARENT_PID`; a child calls `watch_parent()` first thing. When that parent
dies, however it dies (SIGKILL included), the child is told at once: on Linux the kernel sends
it SIGTERM (PR_SET_PDEATHSIG); elsewhere (macOS, or a shell standing between the two) a thread
that polls the parent does the same, or calls `on_loss`; either way exactly once.
`toymlx-train` treats that SIGTERM as a stop: it finishes the step in flight, writes a final
checkpoint and `run_end`, and exits; a re-run then resumes it. Linux repeats the signal as
each thread of a dying multi-threaded parent exits; `parent_lost` tells a repeat from a second
request to stop (`toymlx.backend.stop.StopSignals`).
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


# `python -m` puts the working folder first on sys.path, where a folder named `toymlx` (the
# parent of a clone, say) shadows an editable install's package: its finder comes after the path
# entries. So the module runs from `-c`, without that entry (Python 3.10 has no `-P`). A Ctrl-C
# passed on while it still imports, before the command's own handling, is the command's one line
# and Ctrl-C's exit status, not a traceback of the import (`toymlx.train` interrupted early).
_RUN_MODULE = (
    "import runpy, sys; sys.path[:1] = [] if sys.path[:1] == [''] else sys.path[:1]\n"
    "m = sys.argv.pop(1)\n"
    "try: runpy.run_module(m, run_name='__main__', alter_sys=True)\n"
    "except KeyboardInterrupt:\n"
    "    p = m.partition('toymlx_cli.')[2]\n"
    "    sys.stderr.write(('toymlx-' + p if p else m) + ': interrupted\\n'); sys.exit(130)")


def module_command(module: str, *args: str, python: str | None = None) -> list[str]:
    """The command line that runs `module` as `python -m module args` does (default: this
    process's Python), importing toymlx from where this process does whatever folder the child
    starts in (`_RUN_MODULE`)."""
    return [python or sys.executable, "-c", _RUN_MODULE, module, *args]


def shown_command(argv: list[str]) -> list[str]:
    """`argv` as a person reads it: a `module_command` line as `python -m module args`."""
    if argv[1:3] == ["-c", _RUN_MODULE]:
        return [argv[0], "-m", *argv[3:]]
    return argv


def alive(pid: int) -> bool:
    """Whether process `pid` exists (a zombie counts; see `watch_parent`)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _pdeathsig(sig: int) -> bool:
    """Ask Linux to send `sig` to this process when its parent dies; whether it took."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


DEATH_SEEN_S = 1.0
"""How long `parent_lost` watches a parent that looks alive before it believes it: a SIGKILL'd
parent's main thread can take the signal off its pending set and be preempted before it is
marked exiting, while another of its threads exits and repeats the parent-death signal (seen
once under a load of 12 on 2 cores: a killed sweep's run took the repeat for a second request
and left without its checkpoint). A dying parent shows it within milliseconds."""

_lost = False
"""Whether `parent_lost` has seen the parent die (it does not come back)."""


def parent_lost(wait_s: float = 0.0) -> bool:
    """Whether this process was started with `child_env()` and that parent has died (a
    SIGTERM then is the parent-death signal, or a repeat of it); `wait_s`: watch a parent that
    looks alive that long before saying no (`DEATH_SEEN_S`)."""
    global _lost
    text = os.environ.get(PARENT_ENV, "")
    if _lost or not text.isdigit():
        return _lost
    deadline = time.monotonic() + wait_s
    while not (_lost := not alive(int(text)) or _dying(int(text))):
        if time.monotonic() >= deadline:
            break
        time.sleep(0.02)
    return _lost


_PF_EXITING = 0x4  # <linux/sched.h>: the task has begun to exit


def _dying(pid: int) -> bool:
    """Whether process `pid` is exiting or dead and not yet reaped (Linux's /proc; False
    elsewhere, where the parent-death signal is the watch thread's one SIGTERM). Its main
    thread is checked: the one that started us, whose exit sends the first signal, while the
    process's other threads, exiting too, still keep getppid() pointing at it. A main thread
    with a SIGKILL pending is dying too: its other threads may exit first, each exit a
    parent-death signal here, before it begins to (a `kill -9` of a sweep once left a run
    counting the second as a second request, which skipped its final checkpoint)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rpartition(b")")[2].split()
        if fields[0] in (b"Z", b"X") or bool(int(fields[6]) & _PF_EXITING):
            return True
        with open(f"/proc/{pid}/status", "rb") as f:
            return kill_pending(f.read())
    except (OSError, IndexError, ValueError):
        return False


def kill_pending(status: bytes) -> bool:
    """Whether a /proc/PID/status text shows SIGKILL pending, for the thread (SigPnd) or the
    whole process (ShdPnd): a process killed whose threads have not all begun to exit."""
    bit = 1 << (signal.SIGKILL - 1)
    for line in status.splitlines():
        key, _, value = line.partition(b":")
        if key in (b"SigPnd", b"ShdPnd") and int(value.strip() or b"0", 16) & bit:
            return True
    return False


def watch_parent(on_loss: Callable[[], None] | None = None, every: float = 0.5) -> bool:
    """If this process was started with `child_env()`, act when that parent dies: `on_loss()`,
    by default SIGTERM to this process. Returns whether a watch was set up."""
    text = os.environ.get(PARENT_ENV, "")
    if not text.isdigit():
        return False
    parent = int(text)
    direct = os.getppid() == parent  # else a wrapper (a shell) stands between us
    act = on_loss or (lambda: os.kill(os.getpid(), signal.SIGTERM))
    kernel = on_loss is None and direct and _pdeathsig(signal.SIGTERM)

    def gone() -> bool:
        # A killed parent stays a zombie (kill(pid, 0) succeeds) until its own parent reaps
        # it, but we are re-parented at once: for a direct child that is the quicker sign.
        return (direct and os.getppid() != parent) or not alive(parent)

    if gone():  # it died before we got here (so before the kernel could be told)
        act()
        return True
    if kernel:  # one SIGTERM, not two: a second one would mean "skip the final checkpoint"
        return True

    def poll() -> None:
        while not gone():
            time.sleep(every)
        act()
    threading.Thread(target=poll, name="toymlx-parent-watch", daemon=True).start()
    return True
