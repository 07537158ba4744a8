"""Stop signals as counted requests to stop: `toymlx-train`'s loop (and `toymlx-launch`, which
passes them on to its ranks) reads the count where stopping is safe, so that no signal ever
raises into a step, a checkpoint write or a collective."""

from __future__ import annotations

import signal
from typing import Any

from toymlx.backend.lifeline import parent_lost

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""The stop signals: Ctrl-C, `kill` (systemd, a job scheduler), a closed terminal or ssh session."""

RELAYED_TERM = signal.SIGUSR1
"""What `toymlx-launch` sends its ranks for a SIGTERM it gets (`relayed`): a rank keeps SIGTERM's
default (exit), and counts this one as that SIGTERM."""

RANK_SIGNALS = (signal.SIGINT, signal.SIGHUP, RELAYED_TERM)
"""What a data-parallel rank counts: `SIGNALS` as `toymlx-launch` passes them on."""

STOP_CODES = frozenset(128 + s for s in SIGNALS)
"""The exit codes of a run stopped by a signal (`StopSignals.exit_code`)."""


def relayed(signum: int) -> int:
    """The signal `toymlx-launch` passes on to its ranks for `signum`."""
    return RELAYED_TERM if signum == signal.SIGTERM else signum


def ignore_stop_signals() -> None:
    """Ignore every stop signal, relayed ones too, from now until the process exits."""
    for sig in (*SIGNALS, RELAYED_TERM):
        signal.signal(sig, signal.SIG_IGN)


class StopSignals:
    """SIGINT, SIGTERM and SIGHUP (a closed terminal or ssh session) as requests to stop,
    counted. The handler only counts: no signal ever raises into a step or a checkpoint write,
    so none ends in a traceback or a half-done write. The loop stops after the step in flight
    and writes a final checkpoint; a second request skips that checkpoint if it has not begun
    (one being written is finished).

    The death of the parent that started this process (`toymlx.backend.lifeline`) is one request,
    however many SIGTERMs it brings: Linux sends the parent-death signal again as each thread of
    a multi-threaded parent exits, and those repeats must not skip the final checkpoint.

    The first signal names how the run ended: its exit code is 128 + its number, the shell's
    convention (`exit_code`: 130 for Ctrl-C, 143 for SIGTERM, 129 for SIGHUP).

    A data-parallel rank counts `RANK_SIGNALS`, which `toymlx-launch` (counting `SIGNALS`)
    passes on to every rank (`relayed`), and the ranks stop after the same step, the one after
    the step in flight (the loop's `_stops`). SIGTERM keeps its default (exit) there, which is
    how mlx.launch and the lifeline end a rank blocked in an all_sum whose peer died (blocked
    in C++, it never runs a Python handler); a SIGTERM for `toymlx-launch` reaches the ranks as
    `RELAYED_TERM`."""

    def __init__(self, signals: tuple[int, ...] = SIGNALS):
        self.signals = signals
        self._terms = self._others = 0
        self.first: int | None = None
        """The first stop signal (a relayed SIGTERM as SIGTERM), None before one came."""
        self.last: int | None = None
        """The latest stop signal, as `first`."""
        self._old: dict[int, Any] = {}

    def _count(self, signum: int, frame: Any) -> None:
        if signum == signal.SIGTERM:
            self._terms += 1
        else:
            self._others += 1
        self.last = signal.SIGTERM if signum == RELAYED_TERM else signum
        if self.first is None:
            self.first = self.last

    @property
    def count(self) -> int:
        """Requests so far. SIGTERMs are told apart when the count is read, not as they come:
        the first parent-death signal can arrive while the parent still looks alive (one of
        its threads exiting first), and counted then as a request of its own it made the
        repeats a second request."""
        terms = 1 if self._terms > 1 and parent_lost() else self._terms
        return self._others + terms

    @property
    def exit_code(self) -> int:
        """128 + the first signal's number; 130 (Ctrl-C's) before one came (a data-parallel
        rank stopped by another rank's signal)."""
        return 128 + (self.first or signal.SIGINT)

    @property
    def name(self) -> str | None:
        """The first signal's name ("SIGTERM"), None before one came."""
        return None if self.first is None else signal.Signals(self.first).name

    def ignore(self) -> None:
        """Ignore every stop signal from now until the process exits (nothing is put back)."""
        ignore_stop_signals()
        self._old = {}

    def __enter__(self) -> StopSignals:  # noqa: PYI034
        for sig in self.signals:
            self._old[sig] = signal.signal(sig, self._count)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
