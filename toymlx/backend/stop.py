"""Stop signals as counted requests to stop: `toymlx-train`'s loop (and `toymlx-launch`, which
passes Ctrl-C on to its ranks) reads the count where stopping is safe, so that no signal ever
raises into a step, a checkpoint write or a collective."""

from __future__ import annotations

import signal
from typing import Any

from toymlx.backend.lifeline import parent_lost


class StopSignals:
    """SIGINT, SIGTERM and SIGHUP (a closed terminal or ssh session) as requests to stop,
    counted. The handler only counts: no signal ever raises into a step or a checkpoint write,
    so none ends in a traceback or a half-done write. The loop stops after the step in flight
    and writes a final checkpoint; a second request skips that checkpoint if it has not begun
    (one being written is finished).

    The death of the parent that started this process (`toymlx.backend.lifeline`) is one request,
    however many SIGTERMs it brings: Linux sends the parent-death signal again as each thread of
    a multi-threaded parent exits, and those repeats must not skip the final checkpoint.

    A data-parallel rank counts SIGINT alone (`RANK_SIGNALS`; so does `toymlx-launch`, which
    passes each Ctrl-C on to its ranks), and the ranks stop after the same step, the one after
    the step in flight (the loop's `_stops`). SIGTERM keeps its default (exit) there, which is
    how mlx.launch and the lifeline end a rank blocked in an all_sum whose peer died (blocked
    in C++, it never runs a Python handler)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    RANK_SIGNALS = (signal.SIGINT,)

    def __init__(self, signals: tuple[int, ...] = SIGNALS):
        self.signals = signals
        self._terms = self._others = 0
        self._old: dict[int, Any] = {}

    def _count(self, signum: int, frame: Any) -> None:
        if signum == signal.SIGTERM:
            self._terms += 1
        else:
            self._others += 1

    @property
    def count(self) -> int:
        """Requests so far. SIGTERMs are told apart when the count is read, not as they come:
        the first parent-death signal can arrive while the parent still looks alive (one of
        its threads exiting first), and counted then as a request of its own it made the
        repeats a second request."""
        terms = 1 if self._terms > 1 and parent_lost() else self._terms
        return self._others + terms

    def ignore(self) -> None:
        """Ignore every stop signal from now until the process exits (nothing is put back)."""
        for sig in self.SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        self._old = {}

    def __enter__(self) -> StopSignals:  # noqa: PYI034
        for sig in self.signals:
            self._old[sig] = signal.signal(sig, self._count)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
