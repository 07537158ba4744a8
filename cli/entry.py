"""Ctrl-C from a console command's first import to its end: one line and exit status 130.

The console scripts pip writes (`toymlx-train`: `from toymlx_cli.train import main`, then
`sys.exit(main())`) import the whole command before its `main` runs: MLX, numpy, tyro, for half
a second. A Ctrl-C then raised KeyboardInterrupt into an import, outside every command's own
handling: a traceback. So this module, imported first by the package (`toymlx_cli/__init__.py`)
and with nothing but the standard library, holds a Ctrl-C that comes while the command imports
(`hold_interrupts`), and each command's `main`, wrapped by `console_command`, raises it as soon
as it is called, where a Ctrl-C after start-up is handled too: `PROG: interrupted while
starting; nothing was done`, exit 130.

Only a process started as a command (`started_as_command`: a console script, or
`python -m toymlx_cli.NAME`) holds them: a script or a test that imports toymlx_cli keeps its
Ctrl-C as Python gives it. A process that ignores SIGINT (started in the background by a
script) goes on ignoring it.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import signal
import sys
from collections.abc import Callable

COMMANDS = ("train", "generate", "export", "eval", "sweep", "report", "launch", "classify")
"""The console commands: `toymlx-NAME` runs `toymlx_cli.NAME:main` (pyproject.toml's
[project.scripts])."""

_held: list[int] = []
"""The Ctrl-Cs that came while the command imported (`hold_interrupts`)."""


def _hold(signum: int, frame: object) -> None:
    """SIGINT's handler while a command imports: counted, raised once its `main` runs."""
    _held.append(signum)


def started_as_command() -> bool:
    """Whether this process was started as a toymlx console command: a console script
    (`toymlx-train`), or `python -m toymlx_cli.NAME` (whose package imports while `sys.argv[0]`
    is still "-m")."""
    argv0 = sys.argv[0] if sys.argv else ""
    name = os.path.basename(argv0)
    if name.startswith("toymlx-") and name[len("toymlx-"):] in COMMANDS:
        return True
    full = getattr(sys, "orig_argv", [])
    return argv0 == "-m" and any(a == "-m" and b in {f"toymlx_cli.{c}" for c in COMMANDS}
                                 for a, b in itertools.pairwise(full))


def hold_interrupts() -> None:
    """Hold a Ctrl-C that comes from now until a command's `main` is called
    (`console_command`), where this process was started as a command and SIGINT has Python's
    own handler."""
    if started_as_command() and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _hold)


hold_interrupts()  # on import: the package imports this module before anything else


class _WhileStarting(KeyboardInterrupt):
    """A Ctrl-C held while the command imported (`hold_interrupts`), raised in its `main`."""


def _started() -> None:
    """Python's own SIGINT handler back in place of `_hold`; `_WhileStarting` where a Ctrl-C
    came while the command imported."""
    if signal.getsignal(signal.SIGINT) is _hold:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if _held:
        _held.clear()
        raise _WhileStarting


def console_command(prog: str) -> Callable[[Callable[..., int]], Callable[..., int]]:
    """Wrap a console command's `main(argv=None) -> int`: a Ctrl-C held while it imported
    (`hold_interrupts`) is raised as it is called, and a stop that no handling of its own
    caught (KeyboardInterrupt, or `Stopped` for a SIGTERM or SIGHUP where it raises them) is
    one line on stderr, `PROG: interrupted`, and the exit status 128 + the signal's number."""

    def wrap(main: Callable[..., int]) -> Callable[..., int]:
        @functools.wraps(main)
        def command(argv: list[str] | None = None) -> int:
            try:
                _started()
                return main(argv)
            except KeyboardInterrupt as e:
                from toymlx.backend.stop import how_stopped

                what, code = how_stopped(e)
                starting = isinstance(e, _WhileStarting)
                # on a line of its own: the terminal's ^C may have left one open; a console
                # that cannot be written loses the line, not the exit status
                with contextlib.suppress(OSError, ValueError, AttributeError):
                    print(f"\n{prog}: {what}"
                          + (" while starting; nothing was done" if starting else ""),
                          file=sys.stderr)
                return code

        return command

    return wrap


