"""Stop signals as counted requests to stop: `toymlx-train`'s loop (and `toymlx-launch`, which
passes them on to its ranks) reads the count where stopping is safe, so that no signal ever
raises into a step, a checkpoint write or a collective."""

from __future__ import annotations

import contextlib
import errno
import os
import select
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from toymlx.backend.lifeline import DEATH_SEEN_S, child_env, module_command, parent_lost

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

REPEAT_S = 0.2
"""A stop signal of the kind this process counted last that comes within this many seconds of
it is that request again, not a second one: `timeout` sends its signal to the command and then
to the command's process group, which holds the command (microseconds apart), and a script's
`kill PID; kill -- -PGID` does the same. Counted as two, they left half of `timeout 600
toymlx-train ...` runs at once, without their final checkpoint. A person's second Ctrl-C comes
later (or a third does: hammered every 0.15 s, the third counts)."""

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


class CutShort(Stopped):
    """A stop request that came while a call that cannot be cut ran (`StopSignals.waiting`),
    and the call then failed: `cause`, the exception it raised (MLX's, when the terminal's
    Ctrl-C also stopped the compiler building one of its kernels)."""

    def __init__(self, signum: int, cause: BaseException):
        super().__init__(signum)
        self.cause = cause
        self.dropped: str | None = None
        """What the caller removed that the failed call left (a half-built kernel library)."""


def stop_outcome(signum: int | None) -> tuple[str, int]:
    """A stop by `signum` in words and its exit code, 128 + the signal's number (the shell's
    convention): ("stopped by SIGTERM", 143), ("interrupted", 130) for Ctrl-C or None (a
    data-parallel rank stopped by another rank's request)."""
    signum = signum or signal.SIGINT
    return ("interrupted" if signum == signal.SIGINT else f"stopped by {signal_name(signum)}",
            128 + signum)


def signal_name(signum: int | None) -> str:
    """A stop signal's name ("SIGTERM"; None: Ctrl-C's, as `stop_outcome` reads it)."""
    return signal.Signals(signum or signal.SIGINT).name


def killed_by(code: int) -> str:
    """The name of the signal that a child's negative exit code (`Popen.returncode`) says ended
    it ("SIGKILL"; "signal 64" for one Python has no name for)."""
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


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
        child = subprocess.Popen(module_command(module, *args), stdin=subprocess.PIPE,
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

    Each signal is counted as it comes, not as Python runs its handler: Python runs a handler
    only in the main thread, between two bytecodes, and once for signals of one kind that came
    meanwhile, so a step's `mx.eval` (one call into C++: a cold first step builds MLX's CPU
    kernels for tens of seconds) held the first Ctrl-C unseen, and a second one there was not
    counted at all. Python's C-level handler writes each signal's number to a socket
    (`signal.set_wakeup_fd`) the moment it comes, and the count is read from there. Inside
    `waiting` (one such call of the loop) a thread reads it at once: the first request is
    answered with a line (`on_first`: what the call waits for), a second leaves the process
    at once (`on_second`: the run's end recorded, nothing being written then).

    The death of the parent that started this process (`toymlx.backend.lifeline`) is one request,
    however many SIGTERMs it brings: Linux sends the parent-death signal again as each thread of
    a multi-threaded parent exits, and those repeats must not skip the final checkpoint. So is
    one signal sent twice at once (`REPEAT_S`: `timeout` signals the command and its group):
    a thread reads each number as it comes, from the start, so that when is known.

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
        self._first: int | None = None
        self._last: int | None = None
        self._own_last: tuple[int, float] | None = None
        """The own signal counted last and when (`time.monotonic`): a repeat within
        `REPEAT_S` is the same request."""
        self._old: dict[int, Any] = {}
        self._raise = False
        """Inside `raising`: the next request raises `Stopped` as well as being counted."""
        self._lock = threading.RLock()
        """Held while the counts change and while `waiting`'s thread acts on them."""
        self._wake: socket.socket | None = None
        """The end of the wakeup socket that the signals' numbers are read from (None: not
        entered, or Python's wakeup fd was not to be had: the handler counts)."""
        self._wake_in: socket.socket | None = None
        self._old_wakeup = -1
        self._watcher: threading.Thread | None = None
        self._on: tuple[Callable[[], None], Callable[[], None]] | None = None
        """Inside `waiting`: its (on_first, on_second)."""
        self._told = False
        """Whether `waiting`'s on_first has run (once a run)."""

    def _count(self, signum: int, frame: Any) -> None:
        if signum == READER_GONE:
            if self._console:  # its second stream (`2>&1 | head`): the same request
                return
            self._console = 1
        elif signum in _SENT:
            self._relayed[_SENT[signum]] += 1
        else:
            now = time.monotonic()
            if self._own_last is not None and self._own_last[0] == signum \
                    and now - self._own_last[1] < REPEAT_S:
                return  # the same request sent twice at once
            self._own[signum] += 1
            self._own_last = (signum, now)
        self._last = _named(signum)
        if self._first is None:
            self._first = self._last

    def _drain(self) -> bool:
        """Count the signals whose numbers wait in the wakeup socket; whether there were any.
        Call it holding `_lock`."""
        got = False
        while self._wake is not None:
            try:
                data = self._wake.recv(4096)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:  # closed
                break
            for signum in data:
                if signum in self.signals:  # not `__exit__`'s 0, nor another handler's signal
                    self._count(signum, None)
                    got = True
            if not data:
                break
        return got

    def _signal(self, signum: int, frame: Any) -> None:
        """The stop signals' handler: counts the request where no wakeup socket does
        (`_count`); inside `raising`, raises it too."""
        if self._wake is None:
            self._count(signum, frame)
        if self._raise:
            self._raise = False  # once: a second must not cut into the first's clean-up
            raise Stopped(_named(signum))

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

    @contextmanager
    def waiting(self, on_first: Callable[[], None], on_second: Callable[[], None]
                ) -> Iterator[None]:
        """The block is one call that cannot be cut (a step's `mx.eval`: Python runs no handler
        until it returns, and a cold first step builds MLX's CPU kernels for tens of seconds):
        while it runs, a thread reads the stop signals as they come. The first request calls
        `on_first` at once (a line saying what the run waits for before it stops); a second
        (the first counted before the block included) calls `on_second`, which records how
        the run ended, and the process exits at once with the first signal's code
        (`exit_code`), the call abandoned: only for a block that writes nothing (a failure of
        `on_second` is one line on stderr, and the process exits all the same). A request that
        comes while the
        block runs and an exception then leaves it (MLX's kernel build, run by the shell in
        the terminal's process group, stopped by the same Ctrl-C) raises `CutShort` from that
        exception. Without a wakeup socket the block just runs."""
        if self._wake is None:
            yield
            return
        before = self.count
        with self._lock:
            self._on = (on_first, on_second)
        try:
            yield
        except Exception as e:
            if self.count > before:
                raise CutShort(self.first or signal.SIGINT, e) from e
            raise
        finally:
            with self._lock:  # after the thread's on_second, which never returns
                self._on = None

    def _watch(self) -> None:
        """The thread from `__enter__` on: counts each signal as its number arrives (so a
        repeat's time is known: `REPEAT_S`), and acts on it while a `waiting` block runs."""
        wake = self._wake
        while wake is not None and wake.fileno() >= 0:
            try:
                select.select([wake], [], [])
            except (OSError, ValueError):  # closed by `__exit__`
                return
            with self._lock:
                if self._wake is None:
                    return
                if not self._drain() or self._on is None:
                    continue
                on_first, on_second = self._on
                if self._requests() > 1:
                    self._leave(on_second)
                if not self._told:
                    self._told = True
                    with contextlib.suppress(OSError, ValueError):  # a console that cannot
                        on_first()  # be written: the line is lost, the run goes on

    def _leave(self, on_second: Callable[[], None]) -> None:
        """`waiting`'s second request: `on_second`, then exit at once with `exit_code`."""
        try:
            on_second()
        except BaseException as e:  # noqa: BLE001 (said; the process leaves all the same)
            with contextlib.suppress(OSError, ValueError):
                sys.stderr.write(f"toymlx: {type(e).__name__}: {e}\n")
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError, AttributeError):
                stream.flush()
        os._exit(self.exit_code)

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
        with self._lock:
            self._drain()
            if READER_GONE in self.signals and not self._console and console_gone():
                self._count(READER_GONE, None)  # gone since the last line: stop now, not there
            return self._requests()

    def _requests(self) -> int:
        """`count` of the signals counted so far."""
        own = dict(self._own)
        if own[signal.SIGTERM] > 1 and parent_lost(DEATH_SEEN_S):
            own[signal.SIGTERM] = 1
        # a console gone is a request only alone: a lost parent also closes its pipe, and that
        # closed pipe must not skip the final checkpoint as a second request would
        return sum(max(own[s], self._relayed[s]) for s in SIGNALS) or self._console

    @property
    def first(self) -> int | None:
        """The first stop signal (a relayed SIGTERM as SIGTERM), None before one came."""
        with self._lock:
            self._drain()
            return self._first

    @property
    def last(self) -> int | None:
        """The latest stop signal, as `first`."""
        with self._lock:
            self._drain()
            return self._last

    @property
    def exit_code(self) -> int:
        """The first signal's exit code (`stop_outcome`); 130 before one came."""
        return stop_outcome(self.first)[1]

    @property
    def name(self) -> str | None:
        """The first signal's name ("SIGTERM"), None before one came."""
        first = self.first
        return None if first is None else signal_name(first)

    def ignore(self) -> None:
        """Ignore every stop signal from now until the process exits (nothing is put back)."""
        ignore_stop_signals()
        self._old = {}

    def __enter__(self) -> StopSignals:  # noqa: PYI034
        for sig in self.signals:
            self._old[sig] = signal.signal(sig, self._signal)
        wake, wake_in = socket.socketpair()
        wake.setblocking(False)
        wake_in.setblocking(False)
        try:
            self._old_wakeup = signal.set_wakeup_fd(wake_in.fileno(), warn_on_full_buffer=False)
        except (ValueError, OSError):  # not to be had: the handler counts
            wake.close()
            wake_in.close()
        else:
            self._wake, self._wake_in = wake, wake_in
            self._watcher = threading.Thread(target=self._watch, name="toymlx-stop-watch",
                                             daemon=True)
            self._watcher.start()
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        if self._wake is None:
            return
        signal.set_wakeup_fd(self._old_wakeup)
        with self._lock:
            self._drain()  # the last counts stay readable
            wake, wake_in, self._wake, self._wake_in = self._wake, self._wake_in, None, None
        try:
            wake_in.send(b"\0")  # wakes the thread, which then sees no socket
        except OSError:
            pass
        if self._watcher is not None:
            self._watcher.join()
            self._watcher = None
        wake.close()
        wake_in.close()
