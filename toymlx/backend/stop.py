"""Stop signals as counted requests to stop: `toymlx-train`'s loop (and `toymlx-launch`, which
passes them on to its ranks) reads the count where stopping is safe, so that no signal ever
raises into a step, a checkpoint write or a collective."""

from __future__ import annotations

import errno
import os
import select
import signal
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from toymlx.backend.lifeline import child_env, parent_lost

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""The stop signals: Ctrl-C, `kill` (systemd, a job scheduler), a closed terminal or ssh session."""

RELAYED = {signal.SIGTERM: signal.SIGUSR1, signal.SIGINT: signal.SIGUSR2,
           signal.SIGHUP: signal.SIGURG}
"""What `toymlx-launch` sends its ranks for each stop signal it gets (`relayed`): a rank counts
it as that signal, and tells it from the same signal of its own (`StopSignals.count`), which a
signal to every process at once also brings. SIGURG's default is to ignore it, and the kernel
sends it only to a process that asked for a socket's out-of-band data, which no rank does
(SIGWINCH would be simpler, but a rank under a plain mlx.launch in a terminal gets it at each
resize); all three exist on Linux and macOS, which have no real-time signals."""

RANK_SIGNALS = (*SIGNALS, *RELAYED.values())
"""What a data-parallel rank counts: `SIGNALS`, its own (a job scheduler, `systemctl stop` or
`kill -TERM -- -PGID` signal every process at once) and as `toymlx-launch` passes them on."""

READER_GONE = signal.SIGPIPE
"""A run's console reader gone (`toymlx-train ... | head -3`, a `less` quit): the write that
finds the pipe closed raises SIGPIPE, which a run not under `toymlx-launch` counts as a request
to stop, as Unix tools end there (and `console_gone`, polled at each step, sees it before any
write); its console output is discarded from then on (`toymlx_cli.KeepOnClosed`)."""

CONSOLE_GONE = (errno.EPIPE, errno.EIO, errno.ENOSPC)
"""A console write's errors that mean no one can read the console any more: its reader gone
(`| head`), its terminal closed (a hung-up tty answers EIO), the disk of a redirected log full."""

SOLO_SIGNALS = (*SIGNALS, READER_GONE)
"""What a run not under `toymlx-launch` counts: `SIGNALS` and its console's reader gone."""

STOP_CODES = frozenset(128 + s for s in SIGNALS)
"""The exit codes of a run stopped by a signal (`StopSignals.exit_code`)."""

WAIT_SLICE = 0.05
"""Seconds `in_child` waits at a time: about how late a stop signal's handler runs at most."""


def console_gone() -> bool:
    """Whether stdout or stderr is a pipe whose reader has gone (its write end polls POLLERR):
    a terminal, a file or a pipe still read is not."""
    poll = select.poll()
    for fd in (1, 2):
        try:
            if stat.S_ISFIFO(os.fstat(fd).st_mode):
                poll.register(fd, select.POLLOUT)
        except OSError:  # closed
            pass
    return any(events & select.POLLERR for _, events in poll.poll(0))


def relayed(signum: int) -> int:
    """The signal `toymlx-launch` passes on to its ranks for `signum` (`RELAYED`)."""
    return RELAYED.get(signum, signum)


_SENT = {v: k for k, v in RELAYED.items()}


def _named(signum: int) -> int:
    """`signum` as its sender meant it: a relayed SIGTERM (`RELAYED`) as SIGTERM."""
    return _SENT.get(signum, signum)


class Stopped(KeyboardInterrupt):
    """A stop signal before training counts them (`stops_raise`), raised as Ctrl-C raises
    KeyboardInterrupt."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def stop_outcome(signum: int | None) -> tuple[str, int]:
    """A stop by `signum` in words and its exit code, 128 + the signal's number (the shell's
    convention): ("stopped by SIGTERM", 143), ("interrupted", 130) for Ctrl-C or None (a
    data-parallel rank stopped by another rank's request)."""
    signum = signum or signal.SIGINT
    name = signal.Signals(signum).name
    return "interrupted" if signum == signal.SIGINT else f"stopped by {name}", 128 + signum


def how_stopped(e: KeyboardInterrupt) -> tuple[str, int]:
    """`stop_outcome` of a KeyboardInterrupt: `Stopped`'s signal, else Ctrl-C."""
    return stop_outcome(e.signum if isinstance(e, Stopped) else None)


@contextmanager
def stops_raise(signals: tuple[int, ...]) -> Iterator[None]:
    """While the block runs, each of `signals` raises `Stopped` as Ctrl-C raises
    KeyboardInterrupt: before the loop (parsing, loading, building), where nothing is trained
    yet, a SIGTERM or SIGHUP ends the process as Ctrl-C does there, with a line and its own
    exit code, not killed without a word (or, on a rank, reported as a failure). The loop's
    `StopSignals` counts them instead while it runs. Only the first raises: the process is
    ending, and a rank gets a whole-group signal twice (its own, then toymlx-launch's relay),
    so after one the block ignores them, and so does the process after the block, until it
    exits: put back, a rank's default for a relay (exit) killed it before it reported how it
    ended. Without a stop, the handlers before are put back after, where the block left
    `_raise` in place (not where it ignored them until exit)."""
    stopped = False

    def _raise(signum: int, frame: Any) -> None:
        nonlocal stopped
        if not stopped:
            stopped = True
            raise Stopped(_named(signum))
    old = {sig: signal.signal(sig, _raise) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in old.items():
            if signal.getsignal(sig) is _raise:
                signal.signal(sig, signal.SIG_IGN if stopped else handler)


def in_child(what: str, module: str, args: list[str], data: bytes | memoryview = b"",
             show_stderr: bool = False) -> bytes:
    """The output of `python -m module *args` fed `data`, for a long computation that is one
    call into C, in which Python runs no signal handler (numpy's SVD of SmolLM2's 49152 x 576
    token table, warm-start's pca lens, held a SIGTERM for 6-7 s; llama.cpp's quantizer holds
    its process seconds per GB, and ctypes drops a KeyboardInterrupt raised in its log
    callback). Here the handler runs within `WAIT_SLICE`, as this process waits for the child
    in slices (not in one wait: the kernel may hand the signal to another thread, which only
    flags it for this one's next bytecode), and the exception it raises (`stops_raise`'s or
    `StopSignals.raising`'s `Stopped`, Ctrl-C) kills the child and passes on. A child, not a
    thread: a numpy call abandoned in a thread hung the process's exit (OpenBLAS's exit handler
    joins its workers). It runs in a session of its own (a terminal's Ctrl-C reaches this
    process alone) and tied to this one (`child_env`; it calls `watch_parent`), so it dies with
    it. Its output goes to a temporary file, not a pipe, so that waiting in slices needs no
    reader (Python 3.11's `communicate` with a timeout stops writing its input after the first
    slice). Its stderr is kept for the error, or with `show_stderr` left on this process's (a
    progress bar), and then the child says why it failed on stdout. OSError naming `what` and
    the child's last line on that stream (else how it ended) if it fails."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        child = subprocess.Popen([sys.executable, "-m", module, *args], stdin=subprocess.PIPE,
                                 stdout=out, stderr=None if show_stderr else err,
                                 start_new_session=True, env=child_env())
        try:
            try:
                with child.stdin:  # the child reads it as it comes
                    child.stdin.write(data)
            except BrokenPipeError:  # it failed before reading it all: it says why
                pass
            while True:
                try:
                    child.wait(WAIT_SLICE)
                    break
                except subprocess.TimeoutExpired:  # a slice over: signal handlers have run
                    pass
        finally:
            if child.poll() is None:  # stopped while it runs: no point in its finishing
                child.kill()
                child.wait()
        if child.returncode != 0:
            code, said = child.returncode, out if show_stderr else err
            said.seek(0)
            why = (said.read().decode("utf-8", "replace").strip().splitlines() or [""])[-1] or (
                f"killed by signal {-code}" if code < 0 else f"exit status {code}")
            raise OSError(f"{what}: its process ({sys.executable} -m {module}) failed: {why}")
        out.seek(0)
        return out.read()


def ignore_stop_signals() -> None:
    """Ignore every stop signal, relayed ones too, from now until the process exits."""
    for sig in RANK_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


class StopSignals:
    """SIGINT, SIGTERM and SIGHUP (a closed terminal or ssh session) as requests to stop,
    counted. The handler only counts: no signal ever raises into a step or a checkpoint write,
    so none ends in a traceback or a half-done write. The loop stops after the step in flight
    and writes a final checkpoint; a second request skips that checkpoint if it has not begun
    (one being written is finished). The one exception is work that writes nothing but whole
    files atomically (a recipe's export after a completed run): inside `raising`, a request
    also raises `Stopped` into it, which abandons it at once, its temporaries removed.

    The death of the parent that started this process (`toymlx.backend.lifeline`) is one request,
    however many SIGTERMs it brings: Linux sends the parent-death signal again as each thread of
    a multi-threaded parent exits, and those repeats must not skip the final checkpoint.

    The first signal names how the run ended: its exit code is 128 + its number, the shell's
    convention (`exit_code`: 130 for Ctrl-C, 143 for SIGTERM, 129 for SIGHUP).

    A data-parallel rank counts `RANK_SIGNALS`: its own, and those `toymlx-launch` (counting
    `SIGNALS`) passes on to every rank (`relayed`); the ranks stop after the same step, the one
    after the step in flight (the loop's `_stops`). A signal for `toymlx-launch` reaches the
    ranks as another (`RELAYED`: SIGTERM as SIGUSR1); one for every process at once (a job
    scheduler, `systemctl stop`, `kill -INT -- -PGID` of each group) reaches a rank twice,
    itself and relayed, and that is one request: each signal counts as the more of its two
    kinds. A rank blocked in C++ (an all_sum whose peer hangs) runs no Python handler, so a
    SIGTERM no longer ends it: toymlx-launch does, with SIGKILL, `grace` seconds after a rank
    fails or a second request, and mlx.launch's session does when toymlx-launch dies
    (`toymlx.runner.launch`)."""

    def __init__(self, signals: tuple[int, ...] = SIGNALS):
        self.signals = signals
        self._own: dict[int, int] = dict.fromkeys(SIGNALS, 0)
        """Each stop signal's count as this process got it."""
        self._relayed: dict[int, int] = dict.fromkeys(SIGNALS, 0)
        """Each stop signal's count as toymlx-launch passed it on (`RELAYED`)."""
        self._console = 0
        self.first: int | None = None
        """The first stop signal (a relayed SIGTERM as SIGTERM), None before one came."""
        self.last: int | None = None
        """The latest stop signal, as `first`."""
        self._old: dict[int, Any] = {}
        self._raise = False
        """Inside `raising`: the next request raises `Stopped` as well as being counted."""

    def _count(self, signum: int, frame: Any) -> None:
        if signum == READER_GONE:
            if self._console:  # its second stream (`2>&1 | head`): the same request
                return
            self._console = 1
        elif signum in _SENT:
            self._relayed[_SENT[signum]] += 1
        else:
            self._own[signum] += 1
        self.last = _named(signum)
        if self.first is None:
            self.first = self.last

    def _signal(self, signum: int, frame: Any) -> None:
        """The stop signals' handler: counts the request (`_count`); inside `raising`, raises
        it too."""
        self._count(signum, frame)
        if self._raise:
            self._raise = False  # once: a second must not cut into the first's clean-up
            raise Stopped(self.last or signum)

    @contextmanager
    def raising(self) -> Iterator[None]:
        """While the block runs, a stop request raises `Stopped` (its signal) into it, as Ctrl-C
        raises KeyboardInterrupt, besides being counted; a request counted before the block
        raises on entry. Only for work that writes nothing but whole files through
        `toymlx.backend.atomic` (which removes its temporary when an exception passes), so that a
        long export (a fused GGUF) is abandoned at once, not held until it ends. Python runs
        the handler between bytecodes: a single long call into C finishes first, so the
        longest, llama.cpp's quantizer, runs in a child process, killed when this raises
        (`toymlx.gguf.quantize.llama_quantize`)."""
        if self.count:
            raise Stopped(self.first or signal.SIGINT)
        self._raise = True
        try:
            yield
        finally:
            self._raise = False

    @property
    def count(self) -> int:
        """Requests so far. SIGTERMs are told apart when the count is read, not as they come:
        the first parent-death signal can arrive while the parent still looks alive (one of
        its threads exiting first), and counted then as a request of its own it made the
        repeats a second request. A relayed signal and the same signal of the rank's own are
        the same request where both came (a signal to every process at once), so for each
        signal the more of the two counts, not their sum. A console pipe whose reader has gone
        is seen here too (polled, no write needed), so that `| head -3` stops the run after the
        step in flight, not at its next report line (a LoRA run's 10 steps later)."""
        if READER_GONE in self.signals and not self._console and console_gone():
            self._count(READER_GONE, None)  # gone since the last line: stop now, not there
        own = dict(self._own)
        if own[signal.SIGTERM] > 1 and parent_lost():
            own[signal.SIGTERM] = 1
        # a console gone is a request only alone: a lost parent also closes its pipe, and that
        # closed pipe must not skip the final checkpoint as a second request would
        return sum(max(own[s], self._relayed[s]) for s in SIGNALS) or self._console

    @property
    def exit_code(self) -> int:
        """The first signal's exit code (`stop_outcome`); 130 before one came."""
        return stop_outcome(self.first)[1]

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
            self._old[sig] = signal.signal(sig, self._signal)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
