"""The sweep's supervisor: run specs (`toymlx.sweeps.spec`) run as `toymlx-train`
subprocesses in parallel workers, resumable, shardable over machines sharing a runs folder.

    specs = grid(["--steps", "200"], {"lr": [1e-3, 3e-3], "model.d_model": [64, 128]})
    result = run_sweep("from-scratch", specs, root="runs", workers=2)

Every combination is its own run bundle, `<root>/<sweep_id>/<run name>`, named from its
values. A sweep folder also holds `sweep.json` (the specs), `logs/<run>.log` (each run's
output), `.locks/` (one `flock` per run while a sweep runs it, so two sweeps, or machines
sharing the folder over a filesystem with locks such as NFS, never run one run twice; the lock
dies with its holder; one while a starting sweep checks and writes sweep.json; and one per
shard while a sweep runs it, so that a second sweep of one id and shard is refused, and one
of another split of its runs, `--shard 0/2` beside `--shard 0/1`),
`.status/` (exit codes), and at the end `summary.csv`, `summary.jsonl` and `report.png`.
Each run is a `toymlx-train` child tied to the sweep: if the sweep is killed, its children
checkpoint and stop. Starting the same sweep again skips completed runs, resumes torn or
interrupted ones from their latest checkpoint, retries failed ones, and leaves alone any run
whose bundle another live process still owns.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from toymlx.backend import atomic
from toymlx.backend.files import counted
from toymlx.backend.lifeline import child_env, module_command
from toymlx.backend.lock import LOCK_FILE, LockHeld, acquire, described, held_by
from toymlx.backend.stop import SOLO_SIGNALS, STOP_CODES, StopSignals, how_stopped, killed_by
from toymlx.bundle.checkpoint import resolve_latest
from toymlx.bundle.events import read_events
from toymlx.bundle.folder import UNWRITABLE, check_folder_name, upload_first, wandb_to_upload
from toymlx.bundle.outputs import check_output
from toymlx.runner import report
from toymlx.sweeps.live import HEARTBEAT_S, EventTail, LineTail, LiveView, RunNotes, SweptRun
from toymlx.sweeps.spec import (
    RunSpec,
    changed_options,
    default_sweep_id,
    shard_specs,
    write_sweep_file,
)
from toymlx.sweeps.summary import SweepResult, summarize_sweep

RUN_OPTIONS_FILE = "run-options.json"
"""In the sweep folder: the options every run takes from the sweep's config file, handed to each
new run as `toymlx-train -c` (its flags, the grid's values among them, over it)."""

RECORD_LOCK = f"{report.SWEEP_FILE}.lock"
"""In the sweep folder's .locks/: held while a starting sweep checks its options against
sweep.json and writes it (no run's lock: a run's name holds "=", or is "base")."""

RECORD_WAIT_S = 30.0
"""How long a starting sweep waits for another to end that check and write (it takes
milliseconds), before it names the holder and stops."""


def shard_lock(shard: tuple[int, int]) -> str:
    """The lock in the sweep folder's .locks/ that a sweep of shard `shard` (I, N) holds while it
    runs: two sweeps of one id and shard never run at once; other shards of it do."""
    return f"sweep-shard-{shard[0]}-of-{shard[1]}.lock"


SHARD_LOCK = re.compile(r"sweep-shard-(\d+)-of-(\d+)\.lock")
"""`shard_lock`'s names: its shard's I and N."""


def _refuse_another_split(sweep_dir: Path, shard: tuple[int, int]) -> None:
    """ValueError (one line: the folder, the running sweep's shard and pid, what to do) where a
    live sweep of this folder splits its runs in other than `shard`'s N shares: each of two
    splits (`--shard 0/1` beside `--shard 0/2`) took runs the other counted as its own, each
    summary partial. A sweep of the same split (another I) runs beside it; one that has ended,
    or was killed, holds no lock (`held_by`) and blocks nothing."""
    i, n = shard
    for path in sorted((sweep_dir / ".locks").glob("sweep-shard-*-of-*.lock")):
        m = SHARD_LOCK.fullmatch(path.name)
        if m is None or int(m[2]) == n or (holder := held_by(path)) is None:
            continue
        j, k = int(m[1]), int(m[2])
        free = [f"{x}/{k}" for x in range(k)
                if held_by(sweep_dir / ".locks" / shard_lock((x, k))) is None]
        raise ValueError(
            f"{sweep_dir}: --shard: expected the split of the sweep running there ({j}/{k}, "
            f"{described(holder)}), found {i}/{n}, which shares its runs out otherwise; wait "
            f"for it to end, or stop it first (kill -INT {holder.get('pid', '?')})"
            + (f", or give {'--shard' if len(free) == 1 else 'one of --shard'} "
               f"{', '.join(free[:3])}{', ...' if len(free) > 3 else ''} (no sweep runs "
               f"{'it' if len(free) == 1 else 'them'} now)" if free else ""))


def run_state(run_dir: Path) -> str:
    """new | completed | diverged | failed (error) | resumable (torn, interrupted, stopped).

    A diverged run is a result (that configuration blows up), not a fault: like a completed
    one it is not run again."""
    status = report.run_status(read_events(run_dir))[0] if run_dir.is_dir() else "empty"
    if status in ("completed", "diverged"):
        return status
    if status == "error":
        return "failed"
    if status == "empty":
        return "new"
    return "resumable"


def _torn(run_dir: Path) -> bool:
    """Whether the run's bundle ends without a run_end (killed), as the table says `torn`."""
    return run_dir.is_dir() and report.run_status(read_events(run_dir))[0] == "torn"


def _has_checkpoint(run_dir: Path) -> bool:
    try:
        resolve_latest(run_dir)
        return True
    except (OSError, ValueError):
        return False


def resumes(run_dir: Path) -> bool:
    """Whether the sweep, running the run again, resumes it from its checkpoints (else it
    starts it over): torn (killed, by the out-of-memory killer or a kill -9) or interrupted,
    or failed on a disk that refused its writes (`failed_on_the_disk`)."""
    return ((run_state(run_dir) == "resumable" or failed_on_the_disk(run_dir))
            and _has_checkpoint(run_dir))


def failed_on_the_disk(run_dir: Path) -> bool:
    """Whether the run's last attempt ended on a disk that refused its writes (full, over
    quota, read-only: its run_end's error, or MLX's kernel build's): what it had checkpointed
    is good, so once there is room it is resumed, not started over (a full disk cost every run
    it stopped all its steps)."""
    ends = [ev for ev in read_events(run_dir) if ev["kind"] == "run_end"] if run_dir.is_dir() \
        else []
    said = str(ends[-1].get("message") or "") if ends else ""
    return (any(f"OSError: [Errno {n}] " in said for n in UNWRITABLE)
            or any(os.strerror(n) in said for n in (errno.ENOSPC, errno.EDQUOT)))


def _recorded(sweep_dir: Path, r: SweptRun, key: str = "state") -> Any:
    """A field of the sweep's record of how the run's last attempt ended (None if none)."""
    try:
        return json.loads((sweep_dir / ".status" / f"{r.spec.name}.json").read_text()).get(key)
    except (OSError, ValueError, AttributeError):
        return None


def next_step(sweep_dir: Path, r: SweptRun, retry_failed: bool) -> str:
    """What running the sweep does with run `r` now: "skip" (completed or diverged), "report"
    (failed, with `retry_failed` off), "resume" (`resumes`) or "start" (new, failed, or stopped
    before its first checkpoint: started over)."""
    state = run_state(r.dir)
    if state in ("completed", "diverged"):
        return "skip"
    if not retry_failed and (state == "failed" or _recorded(sweep_dir, r) == "failed"):
        return "report"
    return "resume" if resumes(r.dir) else "start"


def _last_error(log: Path) -> str | None:
    try:
        lines = [x.strip() for x in log.read_text(errors="replace").splitlines() if x.strip()]
    except OSError:
        return None
    for x in reversed(lines):
        if x.startswith(("toymlx-train: error:", "toymlx:")):
            return x
    return lines[-1] if lines else None


def _why_failed(code: int, log: Path) -> str:
    """Why a run failed that recorded no message of its own: killed by a signal (the system's
    out-of-memory killer, a kill -9), which no line of its log tells (its last, a step or
    checkpoint line, read as the failure), else its last error line, else its exit code."""
    last = _last_error(log)
    if code >= 0:
        return last or f"exit code {code}"
    said = last and not last.startswith("# ")  # not the sweep's own header line
    return f"killed by {killed_by(code)}" + (f" (its last line: {last})" if said else "")


class _Runner:
    """One machine's share of a sweep in flight: runs started as `toymlx-train` children,
    `workers` at a time, watched until they end, and stopped on a stop request as a run is
    (`StopSignals`: SIGINT, SIGTERM, SIGHUP for a closed terminal or ssh session, and the reader
    of its console gone, `toymlx-sweep ... 2>&1 | head -3`), the first of them kept (`first`).

    Each child is tied to this process (`lifeline`): if the sweep dies, even by SIGKILL, its
    children stop with a final checkpoint instead of training on unwatched. A child gets its
    own process group so that a terminal's Ctrl-C reaches it once, forwarded from here."""

    def __init__(self, recipe: str, sweep_dir: Path, runs: list[SweptRun], workers: int,
                 retry_failed: bool, busy_wait: float, python: str, view: LiveView,
                 stream: TextIO, run_options: Path | None = None, said: Sequence[str] = (),
                 config_file: str | None = None):
        self.recipe, self.sweep_dir, self.runs, self.workers = recipe, sweep_dir, runs, workers
        copies = {str(run_options): config_file} if run_options and config_file else {}
        self.notes = RunNotes(sweep_dir / "logs", said, copies=copies)
        """What the runs note in their logs, said on the console (`said`: said there before,
        naming `config_file`, which the runs read as its copy `run_options`)"""
        self.run_options = run_options
        """The file of options every new run takes as `-c` (None: none)."""
        self.retry_failed, self.busy_wait = retry_failed, busy_wait
        self.python, self.view, self.stream = python, view, stream
        self.env = child_env(dict(os.environ, PYTHONUNBUFFERED="1"))
        # K runs share the cores: give each run's BLAS its share instead of all of them
        self.env.setdefault("OPENBLAS_NUM_THREADS",
                            str(max(1, (os.cpu_count() or 1) // workers)))
        self.stops = StopSignals(SOLO_SIGNALS)
        self.forwarded, self.stop_by = 0, None

    @property
    def first(self) -> int | None:
        """The first stop signal (SIGPIPE for a console gone), None before one came."""
        return self.stops.first

    def run(self) -> bool:
        """Run every run; returns whether a stop request stopped the sweep."""
        on_main = threading.current_thread() is threading.main_thread()
        # off the main thread no handler can be set; a console gone is still seen (polled)
        with self.stops if on_main else contextlib.nullcontext():
            return self._run()

    def _run(self) -> bool:
        requests = 0
        try:
            pending = list(self.runs)
            while True:
                requests = self.stops.count
                active = [r for r in self.runs if r.state == "running"]
                for r in list(pending):
                    if len(active) >= self.workers or requests:
                        break
                    if r.retry_at > time.time():
                        continue
                    pending.remove(r)
                    self._start(r)
                    if r.state == "running":
                        active.append(r)
                    elif r.state == "waiting":
                        pending.append(r)
                if not active and (not pending or requests):
                    break
                for r in active:
                    r.absorb(r.tail.read())
                    self._say_notes(r)
                    if r.proc.poll() is not None:
                        self._finish(r)
                if requests > self.forwarded:
                    self._forward([r for r in self.runs if r.state == "running"], requests)
                elif self.stop_by is not None and time.time() > self.stop_by:
                    self._kill([r for r in self.runs if r.state == "running"])
                self.view.update(self.runs)
                time.sleep(0.25)
            self.view.update(self.runs, force=True)
            # which runs said each note: the first alone was named, one run's note read as all's
            self.view.say(self.notes.said_by([r.spec.name for r in self.runs if r.action]))
        finally:
            self._kill([r for r in self.runs if r.state == "running"])  # on an error here
        return requests > 0

    def _lock_path(self, r: SweptRun) -> Path:
        return self.sweep_dir / ".locks" / f"{r.spec.name}.lock"

    def _claim(self, r: SweptRun) -> bool:
        """Take this sweep's lock on the run (else another sweep runs it: "elsewhere"), and
        check that no process owns its bundle. One that does (a killed sweep's child writing its
        last checkpoint, a user's toymlx-train) is waited for up to `busy_wait` seconds
        ("waiting"), then left to it ("elsewhere")."""
        try:
            r.lock = acquire(self._lock_path(r), f"sweep run {r.spec.name}")
        except LockHeld as e:
            r.state, r.message = "elsewhere", str(e)
            return False
        try:
            if (r.dir / LOCK_FILE).exists():
                acquire(r.dir / LOCK_FILE, f"{r.dir}: run bundle").release()
        except LockHeld as e:
            r.release()
            now = time.time()
            r.wait_until = r.wait_until or now + self.busy_wait
            r.state = "waiting" if now < r.wait_until else "elsewhere"
            r.message, r.retry_at = str(e), now + 1.0
            return False
        return True

    def _start(self, r: SweptRun) -> None:
        if not self._claim(r):
            return
        step = next_step(self.sweep_dir, r, self.retry_failed)
        if step == "skip":
            r.state = "skipped"
            r.absorb(read_events(r.dir))
            r.wall = report.summarize_run(r.dir)["wall_s"]
            r.release()
            return
        if step == "report":
            r.state, r.torn = "failed", _torn(r.dir)  # as recorded by the bundle, or the sweep
            r.absorb(read_events(r.dir))
            r.message = r.message or _recorded(self.sweep_dir, r, "message")
            r.release()
            return
        if step == "resume":
            r.action = "resume"
            cmd = ["--resume", str(r.dir), "--no-progress"]
        else:  # new, failed, or stopped before its first checkpoint: start (over)
            if r.dir.exists() and (unsynced := wandb_to_upload(r.dir)):
                # said here, in the sweep's words: its child's refusal said --overwrite, which
                # the sweep passed, not its user
                r.state, r.message = "failed", f"{r.dir}: starting it over: " + upload_first(
                    r.dir, unsynced, "run the sweep again")
                r.release()
                return
            r.action = "restart" if r.dir.exists() else "start"
            cmd = ["--recipe", self.recipe, "--runs-root", str(self.sweep_dir), "--run-id",
                   r.spec.name, "--no-progress",
                   *(["-c", str(self.run_options)] if self.run_options else []), *r.spec.args,
                   *(["--overwrite"] if r.dir.exists() else [])]
        log_path = self.sweep_dir / "logs" / f"{r.spec.name}.log"
        r.log = open(log_path, "ab")  # noqa: SIM115  (open for the run's lifetime)
        try:
            r.log.write(f"# {time.strftime('%Y-%m-%d %H:%M:%S')} {r.action}: toymlx-train "
                        f"{' '.join(cmd)}\n".encode())
            r.log.flush()
        except OSError as e:  # a full disk's names no file
            with contextlib.suppress(OSError):
                r.log.close()
            r.release()
            raise atomic.named(e, log_path) from None
        # a resumed run's history is shown, but its outcome is read from what it adds
        r.tail = EventTail(r.dir / "events.jsonl", skip_existing=True)
        r.log_tail = LineTail(log_path, skip_existing=True)  # its notes: those of this attempt
        if r.action == "resume":
            r.absorb(read_events(r.dir))
        r.reason, r.message = None, None
        r.phase = {"start": "starting", "restart": "restarting", "resume": "resuming"}[r.action]
        r.proc = subprocess.Popen(module_command("toymlx_cli.train", *cmd, python=self.python),
                                  stdout=r.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                  env=self.env, start_new_session=True)
        r.state, r.started = "running", time.time()

    def _finish(self, r: SweptRun) -> None:
        code = r.proc.wait()
        r.log.close()
        r.absorb(r.tail.read())
        self._say_notes(r)
        r.wall = time.time() - r.started
        reason = r.reason
        if code == 0 and reason == "completed":
            r.state = "done"
        elif code == 0 and reason == "stopped":
            r.state = "stopped"
        elif reason == "diverged":
            r.state = "diverged"
        elif reason == "interrupted" or code in STOP_CODES or code == -signal.SIGINT:
            r.state = "interrupted"
        else:
            r.state, r.torn = "failed", _torn(r.dir)
            r.message = r.message or _why_failed(code, self.sweep_dir / "logs" /
                                                 f"{r.spec.name}.log")
        try:
            atomic.write_text(self.sweep_dir / ".status" / f"{r.spec.name}.json", json.dumps({
                "state": r.state, "exit_code": code, "message": r.message, "wall_s": r.wall,
                "host": socket.gethostname(), "finished_at": time.time()}))
        except OSError as e:  # a full disk: the sweep goes on (the run's events say how it
            # ended; before, the sweep ended here, its other runs killed, no summary written)
            self.stream.write(f"sweep: {r.spec.name}: could not record how it ended ({e})\n")
        r.release()

    def _say_notes(self, r: SweptRun) -> None:
        """The notes of the lines the run's child added to its log (`RunNotes`)."""
        lines = (x.decode(errors="replace").rstrip() for x in r.log_tail.lines())
        self.view.say(self.notes.lines(r.spec.name, lines))

    def _forward(self, active: list[SweptRun], requests: int, grace: float = 120.0) -> None:
        """Pass each new stop request on as SIGINT (the run checkpoints and ends; a second one
        skips that checkpoint); after `grace` seconds the rest are killed."""
        if not self.forwarded:
            self.stream.write(f"sweep: stopping {counted(len(active), 'run')} (they checkpoint "
                              "first)...\n")
            self.stop_by = time.time() + grace
        self.forwarded = requests
        for r in active:
            try:
                os.killpg(r.proc.pid, signal.SIGINT)
            except ProcessLookupError:
                pass

    def _kill(self, active: list[SweptRun]) -> None:
        for r in active:
            if r.proc.poll() is None:
                os.killpg(r.proc.pid, signal.SIGKILL)
            self._finish(r)


class _SaidOnStop:
    """Within it, a stop (Ctrl-C's KeyboardInterrupt, `Stopped` for SIGTERM or SIGHUP where the
    caller raises them: toymlx-sweep) is said on `stream` in one line, `sweep: interrupted
    <line>` (what it stopped and how to finish it), and passes on: a Ctrl-C while the summary
    and report.png were written ended toymlx-sweep in a traceback. `line` follows the sweep's
    phases."""

    def __init__(self, stream: TextIO, line: str):
        self.stream, self.line = stream, line

    def __enter__(self) -> _SaidOnStop:  # noqa: PYI034
        return self

    def __exit__(self, kind: object, e: BaseException | None, tb: object) -> None:
        if isinstance(e, KeyboardInterrupt):
            with contextlib.suppress(OSError, ValueError):  # a console gone: the line is lost
                self.stream.write(f"sweep: {how_stopped(e)[0]} {self.line}\n")


def run_sweep(recipe: str, specs: Sequence[RunSpec], root: str | os.PathLike = "runs",
              workers: int = 1, shard: tuple[int, int] = (0, 1), sweep_id: str | None = None,
              *, retry_failed: bool = True, progress: bool = True, stream: TextIO | None = None,
              python: str | None = None, report_png: bool = True,
              busy_wait: float = 60.0, run_options: Mapping[str, Any] | None = None,
              inputs: Sequence[tuple[str, Any]] = (), config_file: str | None = None,
              heartbeat: float = HEARTBEAT_S, run_config: bool = False,
              said: Sequence[str] = ()) -> SweepResult:
    """Run this machine's share of `specs` as `toymlx-train` subprocesses, `workers` at a
    time, under `<root>/<sweep_id>/`; then summarize the whole sweep (summary.csv/.jsonl,
    report.png). Completed (and diverged) runs are skipped, torn ones resumed, failed ones
    retried (`retry_failed`); a run whose bundle another process owns is waited for up to
    `busy_wait` seconds, then left to it. A failure is reported and does not stop the others.
    `run_options` (a config file's, as toymlx-train -c reads one) is written to the sweep
    folder's RUN_OPTIONS_FILE and given to every new run as `-c`, the specs' flags over it;
    `run_config`: they are a run's config.json's (every option of that run), written as a run's
    config.json, so that a run takes them as the settings of a run, not as options it was given
    (an option where it does not apply, at its default, is then not refused: `check_applies`).
    `inputs` ((flag, path): the runs' data and model files, as typed) and `config_file` (the -c
    file): what the sweep's folder, written into, must not hold or lie in; sweep.json records
    the files `inputs` name, which a sweep continued from another folder must name again
    (`changed_options`). With `progress` and a `stream` that is not a terminal, a line of the
    runs in flight every `heartbeat` seconds. What a run notes in its log (rows cut at --seq-len)
    is said on `stream` too, once per note (`RunNotes`), unless it is among `said` (notes the
    caller said before, as `toymlx-sweep` says those of the runs' examples)."""
    if workers < 1:
        raise ValueError(f"--workers: expected >= 1, found {workers}")
    if not specs:
        raise ValueError("sweep: expected at least one run, found none")
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError("sweep: run names repeat; give each run distinct values")
    mine = shard_specs(specs, shard)
    stream = stream or sys.stderr
    given = sweep_id is not None
    # `--sweep-id ""` (an unset $ID) ran under the hashed id, unsaid: refused as a name
    sweep_id = sweep_id if given else default_sweep_id(recipe, specs, run_options)
    check_folder_name(sweep_id, "--sweep-id")
    # each run's folder is checked by its toymlx-train; the sweep's own folder here, naming
    # the flag that put it where it is: the root first, then a given --sweep-id in that root
    # (one naming a run's folder)
    check_output(Path(root), [], "--runs-root", folder=True)
    sweep_dir = check_output(Path(root) / sweep_id, [*inputs, ("-c/--config", config_file)],
                             "--sweep-id" if given else "--runs-root", folder=True)
    try:
        (sweep_dir / ".locks").mkdir(parents=True, exist_ok=True)
    except OSError as e:  # was the bare "[Errno 2] No such file or directory: '/proc/x'"
        fix = "make room or make it writable, or " if e.errno in UNWRITABLE else ""
        flag = "--sweep-id" if given else "--runs-root"
        raise ValueError(f"{sweep_dir}: {flag}: expected a folder it can write (the sweep's "
                         f"record, logs and each run's bundle), found {e.strerror or e} at "
                         f"{e.filename or sweep_dir}; {fix}choose another --runs-root") from None
    stop = _SaidOnStop(stream, "before any run started; nothing was run")
    with stop, contextlib.ExitStack() as held:
        # the checks and the write under one lock: two sweeps of one id with other options,
        # started at once, both found no sweep.json, and both ran, each its own options; two
        # of other splits, started at once, would each miss the other's shard lock
        with acquire(sweep_dir / ".locks" / RECORD_LOCK, str(sweep_dir / report.SWEEP_FILE),
                     wait=RECORD_WAIT_S):
            # one sweep of an id (and shard) at a time: a second one started while the first
            # ran (the same command in another terminal) ran too, the runs split between them,
            # and the first to end exited 0 with a partial summary; refused now before it
            # writes anything. A flock: a sweep killed (-9) holds it no longer.
            mine_held = held.enter_context(acquire(
                sweep_dir / ".locks" / shard_lock(shard),
                f"{sweep_dir}: the sweep" + (f" (shard {shard[0]}/{shard[1]})"
                                             if shard[1] > 1 else "")))
            try:
                _refuse_another_split(sweep_dir, shard)
                changed = changed_options(sweep_dir, recipe, specs, run_options, inputs)
                if changed:
                    raise ValueError(f"{sweep_dir}: --sweep-id {sweep_id}: expected the "
                                     f"options this sweep was started with, found "
                                     f"{', '.join(changed)} changed; give a new --sweep-id to "
                                     "run the changed sweep, or put them back")
                for sub in ("logs", ".status"):
                    (sweep_dir / sub).mkdir(exist_ok=True)
                write_sweep_file(sweep_dir, recipe, specs, run_options, inputs)
                options_file = None
                if run_options:
                    options_file = sweep_dir / RUN_OPTIONS_FILE
                    atomic.write_text(options_file, json.dumps(
                        {"recipe": recipe, "config": run_options} if run_config
                        else run_options, indent=1))
            except BaseException:
                # let go before the record lock: a sweep of another split waiting for that one
                # must not find this refused one still holding its shard
                mine_held.release()
                raise
        # said up front: with --no-progress, a sweep run again printed the same table as the
        # first time, nothing telling that no run was run (nor, continued after a Ctrl-C, that
        # its runs go on from their checkpoints, not from step 0)
        runs = [SweptRun(s, sweep_dir / s.name) for s in mine]
        steps = [next_step(sweep_dir, r, retry_failed) for r in runs]
        states = {"skip": "finished before, skipped", "resume": "to resume from their checkpoints",
                  "report": "failed before, reported (--no-retry-failed)"}
        stream.write(f"sweep {sweep_dir}: {counted(len(specs), 'run')}, {len(mine)} on this shard "
                     f"({shard[0]}/{shard[1]}), {counted(workers, 'worker')}"
                     + "".join(f"; {steps.count(k)} {v}" for k, v in states.items() if k in steps)
                     + "\n")
        runner = _Runner(recipe, sweep_dir, runs, workers, retry_failed, busy_wait,
                         python or sys.executable, LiveView(stream, progress, heartbeat), stream,
                         options_file, said, config_file)
        stop.line = "while its runs ran; run the same command again to resume them"
        interrupted = runner.run()

        elsewhere = [r.spec.name for r in runs if r.state == "elsewhere"]
        files = ["summary.csv", "summary.jsonl", *(["report.png"] if report_png else [])]
        stop.line = (f"while writing its summary ({', '.join(files)} in {sweep_dir}); none was "
                     "left half-written: run the same command again to write it (its completed "
                     "runs are skipped, stopped ones resume)")
        result = summarize_sweep(sweep_dir, report_png=report_png, stream=stream,
                                 elsewhere=len(elsewhere))
        stop.line = (f"after writing its summary (in {sweep_dir}); run the same command again to "
                     "resume its stopped runs")
        result.states = {r.spec.name: r.state for r in runs}
        result.signal = runner.first
        for r in runs:
            if r.state in ("failed", "diverged"):
                stream.write(f"sweep: {r.shown.upper()} {r.spec.name}: {r.message} "
                             f"(log: {sweep_dir / 'logs' / (r.spec.name + '.log')})\n")
                # a run killed (kill -9, out of memory) is resumed too, not started over: said,
                # as a full disk's is, where the line above said only how it failed
                if r.state == "failed" and resumes(r.dir):
                    disk = ("free space (or make the folder writable) and "
                            if failed_on_the_disk(r.dir) else "")
                    again = ("run the same command again" if retry_failed else
                             "run the command again without --no-retry-failed")
                    stream.write(f"sweep: {r.spec.name}: its checkpoints are intact: "
                                 f"{disk}{again}; it resumes from them\n")
            elif r.state == "elsewhere":
                stream.write(f"sweep: {r.spec.name}: skipped here: {r.message}\n")
        if elsewhere:  # this sweep ended first: its table is not the sweep's result yet
            stream.write(f"sweep: {counted(len(elsewhere), 'run')} still running elsewhere, so "
                         f"this summary is partial: the other process's end, or toymlx-report "
                         f"{sweep_dir} once they end, gives the whole sweep\n")
        if interrupted:
            stream.write("sweep: interrupted; run the same command again to resume\n")
        return result
