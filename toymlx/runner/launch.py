"""Data-parallel launches that fail when a rank fails: a wrapper around `mlx.launch`.

`mlx.launch` exits 0 whatever its ranks do, and a rank whose peer died can block in an
`all_sum` forever. `launch(n, command)` runs `mlx.launch` in its own session and hands every
rank `TOYMLX_RANK_STATUS=<dir>`; `rank_status()` (around `toymlx-train`'s main) writes
`<dir>/rank<r>.start` (pid, host, its mlx.launch temp files) when a rank starts and
`<dir>/rank<r>.exit` (its exit code and error) when it ends, however it ends short of being
killed. The launch succeeds only if every rank wrote exit code 0. A rank that reports
failure, or whose process is gone without a report (killed, segfault), fails the launch: the
other ranks get `grace` seconds to end, then the whole session is terminated.

`mlx.launch` runs as `python -m toymlx.runner.launch` (`_mlx_launch_child`), tied to `toymlx-launch`
by `toymlx.backend.lifeline`: if `toymlx-launch` dies, even by SIGKILL, the launcher asks its
ranks to stop (SIGTERM: each ends after the same step, with a final checkpoint) and kills its
session `SESSION_GRACE` seconds later; each rank, tied to the launcher the same way, stops
too. No rank trains on with nothing watching it. The launcher then removes the launch's folders
(its reports where toymlx-launch made the folder, mlx.launch's files), as toymlx-launch would
have.

mlx.launch runs each rank through a bash script (over ssh on another host) that leaves two
files in that host's temp folder (`mktemp`'s, `$TMPDIR` or /tmp) for good: the rank's pidfile
(removed only by its kill path) and its hostfile (`MLX_HOSTFILE`). On this host the script makes
them in a folder of the launch's own instead, removed as it ends (`_own_temp_files`), whatever
the command. On another host each rank names them in its start report (`_mlx_temp_files`) and
removes them itself as it ends (`rank_status`); mlx.launch's kill path, which may run after, is
made to pass over a pidfile already gone (`_kill_script_tolerant`). A rank killed before it
could (SIGKILL after `grace`), or a command that is not toymlx-train, leaves them there.

A command that does not report (not toymlx-train) is judged by its exit status as mlx.launch
saw it (`_record_ends`), and gets a stop request as the signal itself (a rank of toymlx-train
gets its relay, `relayed`).
"""

from __future__ import annotations

import io
import json
import os
import random
import re
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TextIO

from toymlx.backend import atomic
from toymlx.backend.files import counted
from toymlx.backend.lifeline import PARENT_ENV, alive, child_env, module_command, watch_parent
from toymlx.backend.stop import (
    CONSOLE_GONE,
    RANK_SIGNALS,
    READER_GONE,
    SOLO_SIGNALS,
    STOP_CODES,
    StopSignals,
    ignore_stop_signals,
    killed_by,
    relayed,
    stop_outcome,
)

STATUS_ENV = "TOYMLX_RANK_STATUS"
RANKS_ENV = "TOYMLX_LAUNCH_RANKS"
"""The number of ranks of the launch, for each rank (`refused_alike`)."""
TEMP_ENV = "TOYMLX_LAUNCH_TEMP"
"""The folder of mlx.launch's files for the ranks on this host (`_own_temp_files`)."""
OWN_STATUS_ENV = "TOYMLX_LAUNCH_OWN_STATUS"
"""Set (to 1) where toymlx-launch made the report folder itself (no --status-dir): mlx.launch's
child removes it where toymlx-launch died before it could (`_mlx_launch_child`)."""
SESSION_GRACE = 60.0
"""Seconds mlx.launch's session gets to stop by itself (each rank: its step, then a final
checkpoint) once the toymlx-launch that started it died, before it is killed."""
_MKTEMP_NAME = re.compile(r"tmp\.[A-Za-z0-9]{10}")
"""The name `mktemp` gives a file it makes with no template."""
BACKENDS = ("ring", "mpi", "nccl", "jaccl", "jaccl-ring")
"""mlx.launch's backends (its `main` refuses any other)."""
_PORTS = (20000, 60000)
"""The ports `_free_port_base` chooses a ring's first port among."""
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_REPORT_NAME = re.compile(r"rank[0-9]+\.(start|exit|end|refused)")
"""The name of a rank's report in the status folder (`rank_status`)."""
_SILENT = ("ended without reporting: killed, crashed, or stopped by mlx.launch after another "
           "rank failed")


def launched_as_rank() -> bool:
    """Whether this process is a rank that mlx.launch (or MPI) started."""
    return any(k in os.environ for k in ("MLX_RANK", "OMPI_COMM_WORLD_SIZE", "MLX_HOSTFILE"))


def _rank() -> int | None:
    for k in ("MLX_RANK", "OMPI_COMM_WORLD_RANK"):
        if os.environ.get(k, "").isdigit():
            return int(os.environ[k])
    return None


def _write(path: Path, record: dict) -> None:
    atomic.write_text(path, json.dumps(record))


@dataclass
class RankStatus:
    code: int = 1
    """The exit code to report (set it to the command's return value)."""


@contextmanager
def rank_status() -> Iterator[RankStatus]:
    """Under `launch`, record this rank's start and how it ended; a no-op otherwise."""
    folder, rank = os.environ.get(STATUS_ENV), _rank()
    status = RankStatus()
    if not folder or rank is None:
        yield status
        return
    base = Path(folder) / f"rank{rank}"
    start = {"pid": os.getpid(), "host": socket.gethostname(), **_mlx_temp_files()}
    _write(base.with_suffix(".start"), start)
    error = None
    try:
        yield status
    except SystemExit as e:
        status.code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        raise
    except KeyboardInterrupt:
        status.code, error = 130, "KeyboardInterrupt"
        raise
    except BaseException as e:
        status.code, error = 1, f"{type(e).__name__}: {e}"
        raise
    finally:
        _remove_temp_files(start)
        _write(base.with_suffix(".exit"), {"code": status.code, "error": error})


def refused_alike(line: str, wait: float = 30.0) -> int:
    """Exit status 2 after `line`, a refusal of the command line that every rank meets alike
    before the ranks can meet (each parses the same one: `toymlx-train --stpes 3`): under
    `launch`, said by rank 0 alone, as `run._refused` says a refusal after they met. Each rank
    printed it: N identical lines under `toymlx-launch -n N`. mlx.launch stops the other ranks
    (SIGTERM) once one has exited non-zero, so no rank exits before all have refused: another
    rank ignores stop signals, says so (`rank<r>.refused`) and waits for rank 0's exit report;
    rank 0 says the line and waits for every rank's `.refused` (a rank still starting was
    stopped, "toymlx-train: stopped by SIGTERM"). After `wait` seconds (a rank did not refuse
    alike) a rank goes on alone, rank 1 and up saying the line themselves."""
    folder, rank = os.environ.get(STATUS_ENV), _rank()
    if not folder or rank is None:
        print(line, file=sys.stderr, flush=True)
        return REFUSED
    status, end = Path(folder), time.time() + wait
    if rank == 0:
        print(line, file=sys.stderr, flush=True)
        others = range(1, int(os.environ.get(RANKS_ENV, "1")))
        while time.time() < end and not all(
                any((status / f"rank{r}.{s}").exists() for s in ("refused", "exit"))
                for r in others):
            time.sleep(0.05)
        return REFUSED
    ignore_stop_signals()
    atomic.write_text(status / f"rank{rank}.refused", "")
    zero = status / "rank0"
    while not zero.with_suffix(".exit").exists():
        start = _read(zero.with_suffix(".start"))
        if (time.time() > end or start is not None and start.get("host") == socket.gethostname()
                and not alive(int(start.get("pid", 0)))):
            print(line, file=sys.stderr, flush=True)
            break
        time.sleep(0.05)
    return REFUSED


def _mktemp_file(entry: os.DirEntry | Path) -> bool:
    """Whether `entry` is a plain file (no link) named as `mktemp` names one."""
    try:
        return (bool(_MKTEMP_NAME.fullmatch(entry.name))
                and stat.S_ISREG(os.lstat(entry).st_mode))
    except OSError:
        return False


def _holds(path: str | os.PathLike, content: str) -> bool:
    """Whether file `path` holds exactly `content` (its size checked before it is read)."""
    try:
        if os.lstat(path).st_size != len(content):
            return False
        with open(path) as f:
            return f.read() == content
    except (OSError, UnicodeDecodeError):
        return False


def _mlx_temp_files() -> dict[str, str]:
    """This rank's files that mlx.launch's launch script made with `mktemp` and never removes:
    its hostfile (`MLX_HOSTFILE`) and its pidfile (the script's PID, which is this process's:
    the script execs the rank), the newest `tmp.*` file in the temp folder that holds exactly
    that PID (an older one is a leftover of an earlier process with the same PID). Only those
    directly in `mktemp`'s temp folder, named as `mktemp` names them: anything else is not
    mlx.launch's to remove."""
    tmp = Path(os.environ.get("TMPDIR") or "/tmp")
    out: dict[str, str] = {}
    host = Path(os.environ.get("MLX_HOSTFILE", ""))
    if host.parent == tmp and _mktemp_file(host):
        out["hostfile"] = str(host)
    pid = f"{os.getpid()}\n"
    newest = None
    try:
        with os.scandir(tmp) as entries:
            for e in entries:
                if (e.name != host.name and _mktemp_file(e) and _holds(e.path, pid)
                        and (newest is None or e.stat().st_mtime_ns > newest[0])):
                    newest = (e.stat().st_mtime_ns, e.path)
    except OSError:
        pass
    if newest:
        out["pidfile"] = newest[1]
    return out


def _session_ended(pgid: int, wait: float = 5.0) -> bool:
    """Whether no process is left in process group `pgid` (mlx.launch's session: it and its
    ranks), waiting up to `wait` seconds for the last to go (a SIGKILLed rank is reaped by
    init after its launcher)."""
    end = time.time() + wait
    while True:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        if time.time() > end:
            return False
        time.sleep(0.1)


def _remove_temp_files(start: dict) -> None:
    """Remove the mlx.launch temp files a rank's start report `start` names
    (`_mlx_temp_files`), on the host this runs on: the pidfile only while it still holds that
    rank's PID."""
    files = [(start.get("hostfile"), None), (start.get("pidfile"), f"{start.get('pid')}\n")]
    for path, content in files:
        if (isinstance(path, str) and _mktemp_file(Path(path))
                and (content is None or _holds(path, content))):
            try:
                Path(path).unlink(missing_ok=True)
            except OSError:
                pass


def _remove_mlx_temp_files(status_dir: Path, n: int) -> None:
    """Remove the temp files each rank on this host named in its start report and left, killed
    before it removed them itself (`rank_status`), once mlx.launch's session has ended: its
    kill path reads (then removes) a pidfile while any rank may still be stopped. A rank that
    never reported leaves its files. Only an mlx.launch whose script `_own_temp_files` could
    not reword leaves any here: otherwise they are in the launch's own folder, removed whole."""
    host = socket.gethostname()
    for r in range(n):
        start = _read(status_dir / f"rank{r}.start")
        if start and start.get("host") == host:
            _remove_temp_files(start)


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _mlx_launch_child() -> None:
    """`mlx.launch` (arguments from sys.argv) in this process, which stops with its whole
    session when the `toymlx-launch` that started it dies; its ranks watch it in turn."""
    from mlx._distributed_utils import launch as mlx_launch  # mlx.launch's own module

    if not colour_wanted(sys.stderr):  # before sys.stderr is the relay, which is no terminal
        _without_colour(mlx_launch)
    _quiet_stops(mlx_launch)
    _terminate_unstopped(mlx_launch)
    _kill_script_tolerant(mlx_launch)
    temp = Path(os.environ[TEMP_ENV])
    status = Path(os.environ[STATUS_ENV])
    _own_temp_files(mlx_launch, temp)
    _record_ends(mlx_launch, status)
    # what toymlx-launch removes as it ends, left to us once it died (kill -9) before it could
    orphaned = [temp, *([status] if os.environ.get(OWN_STATUS_ENV) == "1" else [])]
    lost: list[bool] = []

    def end_session() -> None:
        # we lead the session: every rank stops after its step, and we end when they have;
        # one blocked in C++ (a collective) runs no handler, so the session is killed after,
        # this process with it: the launch's folders go first
        lost.append(True)
        os.killpg(os.getpgrp(), signal.SIGTERM)
        time.sleep(SESSION_GRACE)
        for folder in orphaned:
            shutil.rmtree(folder, ignore_errors=True)
        os.killpg(os.getpgrp(), signal.SIGKILL)
    watch_parent(end_session)
    # A stop signal reaches every rank (toymlx-launch passes it on to the session; a SIGTERM
    # to every process at once reaches them itself), which stops after the same step;
    # mlx.launch's own KeyboardInterrupt (or death by SIGHUP or SIGTERM) would stop relaying
    # the ranks' output, have toymlx-launch report them failed while they write their final
    # checkpoint and, on its way out, have them stopped mid-checkpoint. A handler, not SIG_IGN:
    # the ranks must not inherit an ignored signal.
    for sig in RANK_SIGNALS:
        signal.signal(sig, lambda signum, frame: None)
    os.environ[PARENT_ENV] = str(os.getpid())  # the ranks are our children
    sys.argv[0] = "mlx.launch"
    sys.stdout, sys.stderr = _relay(sys.stdout), _relay(sys.stderr)
    try:
        mlx_launch.main()
    finally:  # toymlx-launch removes them too, unless it was killed (`end_session`)
        for folder in orphaned if lost else [temp]:  # toymlx-launch still reads the reports
            shutil.rmtree(folder, ignore_errors=True)


class _ConsoleFd(io.RawIOBase):
    """A console descriptor whose writes, once no one can read them (`CONSOLE_GONE`), are
    discarded."""

    def __init__(self, fd: int):
        super().__init__()
        self._fd = fd
        self._gone = False

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._fd

    def write(self, b) -> int:
        if not self._gone:
            try:
                return os.write(self._fd, b)
            except OSError as e:
                if e.errno not in CONSOLE_GONE:
                    raise
                self._gone = True
        return len(b)


def _relay(stream: TextIO) -> TextIO:
    """`stream` (sys.stdout, sys.stderr) as mlx.launch relays the ranks' output through it
    (`.buffer.write`), discarding it once the console cannot be written: `toymlx-launch ... |
    head -1`, `>/dev/full` or a hung-up terminal raised in mlx.launch's relay loop, a
    BrokenPipeError or OSError traceback with the ranks still training, and its loop ended."""
    return io.TextIOWrapper(io.BufferedWriter(_ConsoleFd(stream.fileno())),
                            encoding=stream.encoding, errors=stream.errors, line_buffering=True)


def colour_wanted(stream: TextIO) -> bool:
    """Whether `stream` may carry ANSI colour codes: a terminal, with NO_COLOR unset or empty
    (no-color.org) and TERM other than dumb."""
    if os.environ.get("NO_COLOR") or os.environ.get("TERM") == "dumb":
        return False
    try:
        return stream.isatty()
    except (ValueError, OSError):  # a closed stream
        return False


def _without_colour(mlx_launch: ModuleType) -> None:
    """mlx.launch's "[INFO] ..." and "[WARN] ..." lines (`log`, `log_warning`) in its words
    without the ANSI colour codes it wraps them in whatever its stderr is: under NO_COLOR=1,
    TERM=dumb or into a file they came out as `^[[33m[WARN] Node with rank 0 exited with code 3
    ^[[0m`."""
    def log(verbose: bool, *args: object, **kwargs: object) -> None:
        if verbose:
            print("[INFO]", *args, **{**kwargs, "file": sys.stderr})

    def log_warning(*args: object, **kwargs: object) -> None:
        print("[WARN]", *args, **{**kwargs, "file": sys.stderr})
    mlx_launch.log, mlx_launch.log_warning = log, log_warning


REFUSED = 2
"""The exit code of a command that refused its options before doing anything (toymlx's
commands, argparse's, tyro's), having said why in one line."""


def _quiet_stops(mlx_launch: ModuleType) -> None:
    """mlx.launch's "[WARN] Node with rank R exited with code C" lines, less those of ranks
    stopped by a signal (C in `STOP_CODES`) or refusing the command line (`REFUSED`): a stop
    is no failure, a refusal says itself, and toymlx-launch itself names every rank that did
    not end cleanly (`failures`). Any other line, or one mlx words differently, still shows."""
    warn = mlx_launch.log_warning

    def log_warning(*args: object, **kwargs: object) -> None:
        m = re.fullmatch(r"Node with rank \d+ exited with code (-?\d+)",
                         " ".join(map(str, args)))
        code = None if m is None else int(m[1])  # -15: killed by SIGTERM, as 143 says
        if code is None or (128 - code if code < 0 else code) not in STOP_CODES | {REFUSED}:
            warn(*args, **kwargs)
    mlx_launch.log_warning = log_warning


def _terminate_unstopped(mlx_launch: ModuleType) -> None:
    """mlx.launch's `RemoteProcess.terminate` (which stops the other ranks once one fails) with
    the stop signals blocked in its thread, so in the shell it runs to kill a rank: a stop
    passed on to the session while that shell ran (a SIGTERM to every process as a rank failed
    from it) killed the shell, and mlx.launch printed a CalledProcessError traceback. The
    signals are meant for the ranks, which get them; blocked, they reach mlx.launch's main
    thread, whose handler ignores them, and the shell ends with them still pending."""
    terminate = mlx_launch.RemoteProcess.terminate

    def unstopped(self: object) -> None:
        old = signal.pthread_sigmask(signal.SIG_BLOCK, RANK_SIGNALS)
        try:
            terminate(self)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)
    mlx_launch.RemoteProcess.terminate = unstopped


def _kill_script_tolerant(mlx_launch: ModuleType) -> None:
    """mlx.launch's kill script for a rank (`RemoteProcess.make_kill_script`: read its pidfile,
    kill that PID, `rm` the pidfile) ending with status 0 where the pidfile is gone: the rank
    removes it as it ends (`rank_status`), and the script's failing `rm` had mlx.launch, which
    runs it with `check=True`, print a CalledProcessError traceback. With no pidfile it prints
    0, "not killed", as for a rank that had ended."""
    make = mlx_launch.RemoteProcess.make_kill_script

    def make_kill_script(pidfile: str) -> str:
        return f"{make(pidfile)} || true"
    mlx_launch.RemoteProcess.make_kill_script = staticmethod(make_kill_script)


def _own_temp_files(mlx_launch: ModuleType, folder: Path) -> None:
    """mlx.launch's launch script for a rank on this host with its pidfile and hostfile in
    `folder` (the launch's own temporary folder, removed as it ends) instead of two `mktemp`
    files in $TMPDIR that it never removes: a command that does not report to toymlx-launch
    (`python -c ...`), or a launch killed, left them there. A script worded otherwise by another
    MLX keeps mktemp's files (each toymlx-train rank still removes its own: `rank_status`)."""
    make = mlx_launch.RemoteProcess.make_launch_script

    def make_launch_script(rank: int, python: object, cwd: object, files: object, env: object,
                           command: object, is_local: bool) -> str:
        script = make(rank, python, cwd, files, env, command, is_local)
        if not is_local:  # another host's temp folder: its ranks remove their own
            return script
        for name, path in (("pidfile", f"rank{rank}.pid"), ("fname", f"rank{rank}.hosts")):
            script = script.replace(f"{name}=$(mktemp); ",
                                    f"{name}={shlex.quote(str(folder / path))}; ")
        return script
    mlx_launch.RemoteProcess.make_launch_script = staticmethod(make_launch_script)


def _record_ends(mlx_launch: ModuleType, status_dir: Path) -> None:
    """Each rank's exit status as mlx.launch saw it, in `<status_dir>/rank<r>.end`: a command
    that does not report itself (`rank_status`: not toymlx-train) is then named by its exit
    code, which the launch passes on; it was "never reported starting" and exit status 1."""
    init = mlx_launch.RemoteProcess.__init__
    exit_status = mlx_launch.RemoteProcess.exit_status.fget

    def __init__(self: object, rank: int, *args: object, **kwargs: object) -> None:
        self._toymlx_rank = rank
        init(self, rank, *args, **kwargs)

    def ended(self: object) -> tuple[int | None, bool]:
        code, killed = exit_status(self)
        if code is not None:
            _write(status_dir / f"rank{self._toymlx_rank}.end", {"code": code, "killed": killed})
        return code, killed
    mlx_launch.RemoteProcess.__init__ = __init__
    mlx_launch.RemoteProcess.exit_status = property(ended)


def failures(status_dir: Path, n: int, final: bool) -> dict[int, tuple[int | None, str]]:
    """rank -> (exit code or None, why) for each failed rank, from the status files; with
    `final`, a rank that left no exit report counts as failed."""
    out: dict[int, tuple[int | None, str]] = {}
    host = socket.gethostname()
    for r in range(n):
        end = _read(status_dir / f"rank{r}.exit")
        if end is not None:
            code = end.get("code")
            if code != 0:
                out[r] = (code, f"exit code {code}" + (f": {end['error']}"
                                                       if end.get("error") else ""))
            continue
        start = _read(status_dir / f"rank{r}.start")
        gone = (start is not None and start.get("host") == host
                and not alive(int(start.get("pid", 0))))
        if gone and _read(status_dir / f"rank{r}.exit") is None:  # it may have just reported
            out[r] = (None, _SILENT)
        elif start is None and (end := _read(status_dir / f"rank{r}.end")):
            out.update(_unreported(r, end))  # not toymlx-train: its exit status, as mlx.launch saw
        elif final and _read(status_dir / f"rank{r}.exit") is None:
            out[r] = (None, "never reported starting" if start is None else _SILENT)
    return out


def _unreported(r: int, end: dict) -> dict[int, tuple[int | None, str]]:
    """{r: (exit code, why)} for rank `r`, which never reported (`rank_status`), from how
    mlx.launch saw it end (`_record_ends`): nothing where it exited 0."""
    code = end.get("code")
    if not isinstance(code, int) or code == 0:
        return {}
    if code < 0:
        return {r: (128 - code, f"ended by {killed_by(code)}")}
    return {r: (code, f"exit code {code}")}


def left_waiting(bad: dict[int, tuple[int | None, str]], grace: float
                 ) -> dict[int, tuple[int | None, str]]:
    """`bad` (`failures`) after a stop passed on to the ranks, where toymlx-launch killed those
    still running after --grace seconds, once the others had stopped by the signal: a rank that
    stops before its first step (Ctrl-C while the ranks set up) ends alone, and a rank already
    waiting for it in a collective (connecting, in C++, where no signal handler runs) can never
    end by itself. Those ranks stopped as the others did (their exit code, said in one line
    naming the rank they waited for), not failed: the launch said "ended without reporting:
    killed, crashed, ..." and "failed: 2 of 2 ranks did not finish cleanly" for a Ctrl-C."""
    stopped = {r: code for r, (code, _) in bad.items() if code in STOP_CODES}
    if not stopped or any(code is not None and code not in STOP_CODES
                          for code, _ in bad.values()):
        return bad
    first, code = min(stopped.items())
    why = (f"stopped: killed after --grace {grace:g} s, still waiting for rank {first}, which "
           f"had stopped (exit code {code}) before it could meet it")
    return {r: (code, why) if w == _SILENT else (c, w) for r, (c, w) in bad.items()}


def failure_lines(bad: dict[int, tuple[int | None, str]], n: int) -> list[str]:
    """The launch's closing summary of its failed ranks (`failures`): one line per outcome,
    naming the ranks that share it ("ranks 0, 2-7: ended without reporting ..."), first the
    outcome of the lowest rank, then the count. A line per rank made `-n 64` print 64
    where one rank failed and mlx.launch stopped the rest."""
    groups: dict[str, list[int]] = {}
    for r, (_, why) in sorted(bad.items()):
        groups.setdefault(why, []).append(r)
    return [f"{_ranks(ranks)}: {why}" for why, ranks in groups.items()] + [
        f"failed: {len(bad)} of {counted(n, 'rank')} did not finish cleanly"]


def _ranks(ranks: list[int]) -> str:
    """"rank 3", or "ranks 0, 2-7" for sorted rank numbers: runs of consecutive ranks as
    first-last."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    spans = [str(a[0]) if len(a) == 1 else f"{a[0]}-{a[-1]}" for a in runs]
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(spans)


def _free_port_base(n: int) -> int:
    """A port P with P..P+n-1 free on this host (the ring backend listens on one per rank),
    so two launches on one machine do not collide on mlx.launch's fixed default."""
    for _ in range(50):
        base = random.randint(_PORTS[0], _PORTS[1] - n)
        try:
            for p in range(base, base + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
    return 32323


def launch(n: int, command: Sequence[str], *, hosts: str | None = None,
           backend: str = "ring", grace: float = 10.0, status_dir: str | None = None,
           env: Sequence[str] = (), port: int | None = None,
           stream: TextIO | None = None) -> int:
    """Run `command` as `n` ranks through mlx.launch (`n` on each of `hosts`, comma-separated,
    as mlx.launch's -n); 0 only if every rank exited 0. A stop request (Ctrl-C, SIGTERM,
    SIGHUP, or the reader of this process's output gone: `| head -1`, which the ranks, writing
    into mlx.launch's pipes, cannot see) is passed on to every rank (`_interrupt`); stopped so,
    the launch exits as one `toymlx-train` would, 128 + the first signal's number (141 for the
    reader gone)."""
    stream = stream or sys.stderr
    if n < 1:
        raise ValueError(f"-n: expected >= 1 ranks, found {n}")
    if not grace >= 0:  # nan too: the other ranks of a failed one were never stopped
        raise ValueError(f"--grace: expected seconds >= 0 (inf: wait for them), found {grace:g}")
    if port is not None and not 1 <= port <= 65536 - n:  # the ring: a port a rank, from it
        raise ValueError(f"--port: expected 1..{65536 - n} (the ring listens on {n} ports from "
                         f"it), found {port}")
    if backend not in BACKENDS:  # mlx.launch's own refusal came with "ranks never reported
        # starting" after it
        raise ValueError(f"--backend {backend}: expected one of {', '.join(BACKENDS)}")
    if backend == "mpi" and shutil.which("mpirun") is None:  # was mlx.launch's traceback
        raise ValueError("--backend mpi: expected mpirun on PATH (mlx.launch starts the ranks "
                         "with it), found none; install Open MPI, or use --backend ring")
    if hosts is not None and not all(h.strip() for h in hosts.split(",")):
        raise ValueError(f"--hosts {hosts!r}: expected a comma list of host names, found an "
                         "empty name")
    if port is None and backend == "ring" and not hosts and n > _PORTS[1] - _PORTS[0]:
        # was random's "empty range for randrange() (20000, 10001, -9999)"
        raise ValueError(f"-n: expected at most {_PORTS[1] - _PORTS[0]} ranks on this host "
                         f"(each listens on its own port, from a free run of "
                         f"{_PORTS[0]}..{_PORTS[1]}; --port P chooses the first), found {n}")
    for e in env:  # mlx.launch sets KEY= for a bare KEY and only warns of a bad name
        key, eq, _ = e.partition("=")
        if not (eq and _ENV_NAME.fullmatch(key)):
            raise ValueError(f"--env {e}: expected KEY=VALUE, KEY of letters, digits and _")
    if not command:
        raise ValueError("command: expected the command each rank runs, found none; e.g. "
                         "toymlx-launch -n 2 -- toymlx-train --recipe vit-tiny")
    if command[0].startswith("-"):  # `-- --recipe lora`: toymlx-train left out
        raise ValueError(f"command: expected the command each rank runs, found the option "
                         f"{command[0]}; did you mean -- toymlx-train {shlex.join(command)}?")
    if not hosts:
        command = [_local_command(command[0]), *command[1:]]
    own = status_dir is None
    machines = hosts.split(",") if hosts else []
    if own and (away := other_machines(machines)):
        raise ValueError(f"--hosts {hosts}: expected --status-dir FOLDER, a folder every host "
                         f"sees at the same path (a shared file system): each rank reports "
                         f"there how it ended, and a temporary folder made here does not exist "
                         f"on {', '.join(away)}")
    folder = Path(tempfile.mkdtemp(prefix="toymlx-launch-") if own else status_dir)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        found = ("a file" if isinstance(e, FileExistsError)
                 else f"{e.strerror or e} at {e.filename or folder}")
        raise ValueError(f"--status-dir {status_dir}: expected a folder the ranks can write "
                         f"their reports in, found {found}") from None
    for old in folder.glob("rank*"):
        # only the reports of an earlier launch: a folder the user named may hold their files
        # (rankings.csv was deleted with them)
        if _REPORT_NAME.fullmatch(old.name):
            old.unlink()
    if port is None and backend == "ring" and not hosts:
        port = _free_port_base(n)
    ranks = n * len(machines) if machines else n
    cmd = [*module_command("toymlx.runner.launch"), "--backend", backend, "-n", str(n),
           *(["--hosts", hosts] if hosts else []), *(["-p", str(port)] if port else []),
           "--env", f"{STATUS_ENV}={folder}", "--env", f"{RANKS_ENV}={ranks}",
           *[a for e in env for a in ("--env", e)], "--", *command]
    temp = tempfile.mkdtemp(prefix="toymlx-launch-files-")  # `_own_temp_files`
    try:
        proc = subprocess.Popen(cmd, start_new_session=True,
                                env=child_env({**os.environ, STATUS_ENV: str(folder),
                                               TEMP_ENV: temp,
                                               **({OWN_STATUS_ENV: "1"} if own else {})}))
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    failed_at, passed, killed = None, 0, False
    try:
        with StopSignals(SOLO_SIGNALS) as stop:
            while proc.poll() is None:
                if stop.count > passed:
                    passed += 1
                    # ranks that never reported (not toymlx-train's) get the signal itself:
                    # only toymlx-train knows the relayed one (`relayed`), the others died of it
                    plain = not any(folder.glob("rank*.start"))
                    if _interrupt(proc, passed, stop.last or signal.SIGINT, grace, stream,
                                  plain):
                        break
                    if passed == 2:
                        failed_at = failed_at or time.time()
                if failed_at is None:
                    bad = failures(folder, ranks, final=False)
                    if bad:
                        failed_at = time.time()
                        _say_failed(bad, grace, stream)
                elif time.time() - failed_at > grace:
                    _kill(proc)
                    killed = True
                    break
                time.sleep(0.2)
    finally:
        proc.wait()
        shutil.rmtree(temp, ignore_errors=True)  # mlx.launch, which used them, has ended
    bad = failures(folder, ranks, final=True)
    if _session_ended(proc.pid):
        _remove_mlx_temp_files(folder, ranks)
    if own:
        shutil.rmtree(folder, ignore_errors=True)
    if not bad:
        return 0
    if passed and killed:
        bad = left_waiting(bad, grace)
    if len(bad) == ranks and all(code in STOP_CODES for code, _ in bad.values()):
        # every rank stopped by a signal, as one process is: rank 0 said how, or, where the
        # reader went (passed on as Ctrl-C), as `toymlx-train ... | head` ends: 141
        waited = {r: why for r, (_, why) in bad.items() if why.startswith("stopped: ")}
        for line in failure_lines({r: (None, why) for r, why in waited.items()}, ranks)[:-1]:
            stream.write(f"toymlx-launch: {line}\n")  # the ranks `left_waiting` names
        stream.flush()
        return stop_outcome(READER_GONE)[1] if stop.first == READER_GONE else bad[0][0]
    if len(bad) == ranks and all(code == REFUSED for code, _ in bad.values()):
        # every rank refused the command as one process does (`toymlx-train --batch-size 5`:
        # rank 0's line said why): that line alone, as the command's, the exit status its 2;
        # "ranks 0-2: exit code 2" and "failed: 3 of 3 ranks ..." added nothing
        return REFUSED
    for line in failure_lines(bad, ranks):
        stream.write(f"toymlx-launch: {line}\n")
    stream.flush()
    codes = [c for c, _ in bad.values() if isinstance(c, int) and 0 < c < 256]
    # a rank's failure before the stops it brought on the others (rank 0, stopped when rank 1
    # failed, ended 143: the launch's status was the stop's, not the failure's)
    failed = [c for c in codes if c not in STOP_CODES]
    return (failed or codes or [1])[0]


def other_machines(hosts: Sequence[str]) -> list[str]:
    """Those of `hosts` that are not this machine: a name or address with no address this
    machine can bind (loopback, its own interfaces), or one that does not resolve here."""
    away = []
    for host in hosts:
        try:
            addresses = {a[4][0] for a in socket.getaddrinfo(host.strip(), None,
                                                             type=socket.SOCK_STREAM)}
        except (OSError, UnicodeError):
            away.append(host)
            continue
        if not any(_bindable(a) for a in addresses):
            away.append(host)
    return away


def _bindable(address: str) -> bool:
    """Whether this machine can bind `address` (so it is one of its own)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((address, 0))
        return True
    except OSError:
        return False


def _local_command(name: str) -> str:
    """`name`, the command each rank runs on this host, as its ranks' bash finds it: itself
    where PATH has it (or it names a file), else the script of that name beside this Python (a
    virtual environment's bin/, not activated: `.venv/bin/toymlx-launch -n 2 -- toymlx-train`,
    where each rank failed "exec: toymlx-train: not found" and the launch reported "never
    reported starting"). ValueError (one line) where neither has it."""
    if os.sep in name or shutil.which(name):
        return name
    beside = Path(sys.executable).parent / name
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    raise ValueError(f"command: expected a program each rank can run, found {name!r}, which is "
                     f"not on PATH nor beside {sys.executable}; give its path, or activate the "
                     "environment toymlx is installed in")


def _say_failed(bad: dict[int, tuple[int | None, str]], grace: float, stream: TextIO) -> None:
    """The line that starts the other ranks' `grace` seconds; none for ranks stopped by a
    signal (`STOP_CODES`): the others are ending the same way."""
    if all(code in STOP_CODES | {REFUSED} for code, _ in bad.values()):
        # a refusal (2) is said by the command, and every rank of toymlx-train refuses alike;
        # a rank left running is killed after `grace` and named in the closing lines
        return
    r, (_, why) = min(bad.items())
    stream.write(f"toymlx-launch: rank {r} failed ({why}); the other ranks get {grace:g} s to "
                 "end\n")
    stream.flush()


def _interrupt(proc: subprocess.Popen, count: int, signum: int, grace: float,
               stream: TextIO, plain: bool = False) -> bool:
    """Stop request number `count` (Ctrl-C, SIGTERM or SIGHUP: `signum`), passed on to every
    rank as its own (`relayed`; mlx.launch ignores it): the first stops them all after the same
    step, rank 0 writing a final checkpoint; the second skips that checkpoint if it has not
    begun, and the ranks get `grace` seconds before they are stopped (one blocked in a
    collective never ends by itself); a third stops them at once. The reader of this process's
    output gone (`READER_GONE`) is passed on as Ctrl-C: a rank counts no SIGPIPE. With
    `plain`, the signal itself is passed on, not its relay. Returns whether it stopped them."""
    if count > 2:
        stream.write("toymlx-launch: interrupted a third time: stopping every rank now\n")
        stream.flush()
        _kill(proc)
        return True
    gone = signum == READER_GONE
    try:
        sig = signal.SIGINT if gone else signum
        os.killpg(proc.pid, sig if plain else relayed(sig))
    except ProcessLookupError:
        return False
    if gone:
        stream.write("toymlx-launch: the reader of its output has gone: Ctrl-C passed on to "
                     "every rank (toymlx-train stops them all after the same step, with a final "
                     "checkpoint)\n")
        stream.flush()
        return False
    what = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
    stream.write(f"toymlx-launch: {what} passed on to every rank (toymlx-train stops them all "
                 f"after the same step, with a final checkpoint); {what} again to stop sooner\n"
                 if count == 1 else f"toymlx-launch: {what} passed on again; the ranks get "
                 f"{grace:g} s to end, then are stopped ({what} again: at once)\n")
    stream.flush()
    return False


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL to the launcher's whole session (it and every rank): a SIGTERM is a request to
    stop after a step there (`RANK_SIGNALS`), which a rank blocked in a collective never
    reads."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


if __name__ == "__main__":
    _mlx_launch_child()
