"""The live view of a sweep: each run's progress read from its growing events.jsonl
(`EventTail`, absorbed into a `SweptRun`) and shown as a table (`LiveView`), and the notes its
log says (`RunNotes`) said above it."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from toymlx.backend.lock import Lock
from toymlx.bundle.events import parse_event
from toymlx.runner import report
from toymlx.runner.api import HELD, NOTE
from toymlx.sweeps.spec import RunSpec

HEARTBEAT_S = 60.0
"""Seconds between the lines that say how the runs in flight progress, when the view is not
a terminal (a log file, CI, nohup): the other lines come only when a run's state or validation
figure changes, which left a log silent for minutes while the runs trained."""


class LineTail:
    """New complete lines of a growing file (a torn last line waits). A file replaced, or cut
    back (a resume's events.jsonl, cut to its checkpoint), is read again from its start."""

    def __init__(self, path: Path, skip_existing: bool = False):
        self.path = path
        self.ino, self.offset = None, 0
        if skip_existing and path.is_file():
            st = path.stat()
            self.ino, self.offset = st.st_ino, st.st_size

    def lines(self) -> list[bytes]:
        try:
            with open(self.path, "rb") as f:
                st = os.fstat(f.fileno())
                if st.st_ino != self.ino or st.st_size < self.offset:
                    self.ino, self.offset = st.st_ino, 0
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return []
        end = data.rfind(b"\n") + 1
        self.offset += end
        return data[:end].splitlines()


class EventTail(LineTail):
    """New complete events of a growing events.jsonl (`LineTail`)."""

    def read(self) -> list[dict]:
        events = (parse_event(raw) for raw in self.lines())
        return [ev for ev in events if ev is not None]


NOTES_SHOWN = 20
"""The most distinct notes of its runs a sweep says on its console (`RunNotes`); the rest are in
the runs' logs alone: a note naming a run's own value (the warm-up's names --lr) is one a run,
and a grid of 100 learning rates would say 100."""


def run_note(line: str) -> str | None:
    """What a line of a run's log notes (its text after `toymlx: ` or `toymlx-train: `), None
    for any other line: a step's, or the run's refusal or last line (`HELD`), which the sweep
    says itself (its table, and a FAILED line)."""
    m = NOTE.match(line)
    return None if m is None or HELD.match(line) else line[m.end():]


class RunNotes:
    """The notes runs say in their logs (`run_note`: rows cut at --seq-len, a warm-up longer
    than --steps), for the sweep's console: each distinct one once, numbered, naming the first
    run that said it, up to `shown`, then one line naming `logs`, which hold the rest; at the
    sweep's end, which runs said each (`said_by`). During a sweep they reached only the logs,
    and the user watching it never saw them; then only the first run was named, and a note of
    one run read as one of all."""

    def __init__(self, logs: Path, said: Iterable[str] = (), shown: int = NOTES_SHOWN,
                 copies: Mapping[str, str] | None = None):
        self.logs, self.shown = logs, shown
        self.said = set(said)
        """The notes said (the sweep's own of the runs' examples, said before any run)"""
        self.copies = dict(copies or {})
        """{a file the runs read: the file it is a copy of, as `said` names it}: a run's note
        of the sweep folder's run-options.json is the sweep's of the -c file it copies, said
        before any run (it was said twice, once naming each)."""
        self.count = 0
        self.by: dict[str, list[str]] = {}
        """Each note said on the console, in the order of their numbers: the runs that said it,
        the first first."""

    def lines(self, run: str, lines: Iterable[str]) -> list[str]:
        """The console lines for `lines` of run `run`'s log: `sweep: note N (RUN): LINE` for a
        note not said before."""
        out = []
        for line in lines:
            note = run_note(line)
            if note is None:
                continue
            for copy, file in self.copies.items():
                note = note.replace(copy, file)
            if note in self.by:
                self.by[note] += [run] if run not in self.by[note] else []
                continue
            if note in self.said:
                continue
            self.said.add(note)
            self.count += 1
            if self.count <= self.shown:
                self.by[note] = [run]
                out.append(f"sweep: note {self.count} ({run}): {line}")
            elif self.count == self.shown + 1:
                out.append(f"sweep: more than {self.shown} notes from the runs: the rest are in "
                           f"their logs ({self.logs})")
        return out

    def said_by(self, runs: Sequence[str], names: int = 4) -> list[str]:
        """For the sweep's end: which of `runs` (those this sweep started) said each note, by
        its number (`sweep: note 2 was said by 2 of the 3 runs started now: lr=0.001,
        lr=0.003`, `names` at most, or `note 1 was said by every run started now (3)`); none
        where one run was started (its line named it). "now": runs an earlier sweep of the same
        id ran, skipped this time, are not counted ("of the 3 runs started" read as the
        sweep's all)."""
        if len(runs) < 2:
            return []
        out = []
        for i, who in enumerate(self.by.values(), 1):
            if len(who) == len(runs):
                whom = f"every run started now ({len(runs)})"
            else:
                more = f", and {len(who) - names} more" if len(who) > names else ""
                whom = (f"{len(who)} of the {len(runs)} runs started now: "
                        f"{', '.join(who[:names])}{more}")
            out.append(f"sweep: note {i} was said by {whom}")
        return out


@dataclass
class SweptRun:
    spec: RunSpec
    dir: Path
    state: str = "pending"
    """pending, waiting, running, done, skipped, failed, stopped, interrupted, elsewhere"""
    torn: bool = False
    """A failed run whose bundle ends without a run_end (killed: kill -9, out of memory): shown
    `torn`, as the table and summary.csv say (`shown`), where the sweep's line said FAILED."""
    proc: subprocess.Popen | None = None
    lock: Lock | None = None
    """This sweep's claim on the run, held while its child trains."""
    log: Any = None
    tail: EventTail | None = None
    log_tail: LineTail | None = None
    """The lines its child adds to its log, read for their notes (`RunNotes`)."""
    action: str = ""
    """How this sweep started its child: start, restart or resume (its log says so)."""
    phase: str = ""
    """What a running run is doing that its steps do not show, for the live view: starting,
    restarting or resuming until its first step, then "" (training), and after its run_end
    "REASON, exiting" (`absorb`); the action alone, shown for the whole run, read "running
    (start) step 40/40" for a run that had ended."""
    step: int = 0
    steps: int | None = None
    loss: float | None = None
    metric: str = "val_loss"
    val: float | None = None
    val_step: int | None = None
    rate: float | None = None
    unit: str = ""
    timed_steps: int = 0
    step_seconds: float = 0.0
    """How many step events were read that give their time, and those times' sum (steps/s
    over a span: the difference of two readings, as train's report line computes it)."""
    timed_t: float = -math.inf
    """The latest `t` of those steps: a resume's events.jsonl, cut back and written anew, is
    read again from its start (`EventTail`), and the steps it kept, read before, are not
    counted again (a run's `t` never goes back, a resume's clock going on from its last)."""
    started: float = 0.0
    wall: float | None = None
    message: str | None = None
    reason: str | None = None
    """run_end reason seen in this attempt's events"""
    wait_until: float = 0.0
    retry_at: float = 0.0
    """While "waiting" for another process to release the bundle: until when, and when next."""

    @property
    def shown(self) -> str:
        """The run's state as the sweep's lines say it: `torn` for a failed run killed."""
        return "torn" if self.state == "failed" and self.torn else self.state

    def absorb(self, events: list[dict]) -> None:
        for e in events:
            kind = e["kind"]
            if kind == "run_start":
                self.steps = (e.get("config") or {}).get("steps", self.steps)
                self.step = int(e.get("start_step") or 0)
            elif kind == "resume":
                self.steps = e.get("steps", self.steps)
                self.step = int(e.get("from_step") or 0)
                self.phase = "resuming"  # a resume's file read again: the old steps came first
            elif kind == "step":
                self.step = e.get("step", self.step)
                self.phase = ""
                self.loss = report.number(e.get("loss"))
                t = report.number(e.get("t"))
                if (dt := report.number(e.get("step_time_s"))) is not None and (
                        t is None or t > self.timed_t):
                    self.timed_steps += 1
                    self.step_seconds += dt
                    self.timed_t = self.timed_t if t is None else t
                for k, v in e.items():
                    if k.endswith("_per_s"):
                        self.rate, self.unit = report.number(v), k.replace("_per_s", "/s")
            elif kind == "eval":
                if "accuracy" in e:
                    self.metric = "accuracy"
                self.val = report.number(e.get(self.metric))
                self.val_step = e.get("step")
            elif kind == "run_end":
                self.reason, self.message = e.get("reason"), e.get("message")
                self.phase = f"{self.reason or 'ended'}, exiting"

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None


def _elapsed(seconds: float) -> str:
    """45s, 2m05s, 1h02m."""
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"


class LiveView:
    """The live progress table: redrawn in place on a TTY; otherwise one line per change of a
    run's state or validation figure, and every `heartbeat` seconds (read from `clock`) one
    line of the runs in flight (`heartbeat_line`)."""

    def __init__(self, stream: TextIO, enabled: bool, heartbeat: float = HEARTBEAT_S,
                 clock: Callable[[], float] = time.monotonic):
        self.stream, self.enabled = stream, enabled
        self.tty = enabled and hasattr(stream, "isatty") and stream.isatty()
        self.drawn = 0
        self.shown: list[SweptRun] = []
        """The runs of the table last drawn on the terminal (`say` draws it again)"""
        self.last: dict[str, str] = {}
        self.t_draw = 0.0
        self.heartbeat, self.clock = heartbeat, clock
        self.t_start = self.t_beat = clock()
        self.timed: dict[str, tuple[int, float, float]] = {}
        """Each running run's (timed_steps, step_seconds, clock) at the last heartbeat (or when
        first seen running): its steps/s since then."""

    def cells(self, r: SweptRun) -> list[str]:
        steps = f"{r.step}/{r.steps}" if r.steps else str(r.step or "-")
        wall = r.wall if r.wall is not None else (time.time() - r.started if r.started else None)
        state = r.shown + (f" ({r.phase})" if r.phase and r.state == "running" else "")
        # a validation of an earlier step than the one shown says which
        val = f"{r.metric} {report.fmt(r.val)}" + (
            f" (step {r.val_step})" if r.val_step not in (None, r.step) else "")
        return [r.spec.name, state, steps, report.fmt(r.loss),
                val if r.val is not None else "-",
                f"{report.fmt(r.rate)} {r.unit}" if r.rate is not None else "-",
                f"{wall:.0f}s" if wall is not None else "-"]

    def say(self, lines: list[str]) -> None:
        """Write `lines` (the runs' notes: `RunNotes`) whether or not progress is shown; on a
        terminal above the table, drawn again below them (written under it, they were drawn
        over at the next redraw)."""
        if not lines:
            return
        table = self.tty and self.drawn
        if table:  # back to the table's first line, and the screen cleared from there
            self.stream.write(f"\x1b[{self.drawn}F\x1b[J")
            self.drawn = 0
        self.stream.write("".join(f"{x}\n" for x in lines))
        self.stream.flush()
        if table:
            self.update(self.shown, force=True)

    def update(self, runs: list[SweptRun], force: bool = False) -> None:
        if not self.enabled:
            return
        if self.tty:
            self.shown = runs
            now = time.time()
            if not force and now - self.t_draw < 0.5:
                return
            self.t_draw = now
            shown = runs
            room = shutil.get_terminal_size((100, 40)).lines - 3
            if len(runs) > room:  # too tall to redraw in place: the live runs, and counts
                shown = [r for r in runs if r.state == "running"][:max(room - 1, 1)]
            rows = [["run", "state", "step", "loss", "val", "speed", "time"]]
            rows += [self.cells(r) for r in shown]
            widths = [max(len(x[i]) for x in rows) for i in range(len(rows[0]))]
            text = ["  ".join(c.ljust(w) for c, w in zip(x, widths)).rstrip() for x in rows]
            if shown is not runs:
                counts: dict[str, int] = {}
                for r in runs:
                    counts[r.shown] = counts.get(r.shown, 0) + 1
                text.append(", ".join(f"{n} {k}" for k, n in counts.items()))
            if self.drawn > len(text):  # a shorter table: clear the old tail too
                text += [""] * (self.drawn - len(text))
            up = f"\x1b[{self.drawn}F" if self.drawn else ""
            self.stream.write(up + "".join(f"\x1b[2K{t}\n" for t in text))
            self.stream.flush()
            self.drawn = len(text)
            return
        for r in runs:  # plain lines: a run's state, or a new validation figure
            key = f"{r.shown}|{r.val}"
            if self.last.get(r.spec.name) != key and r.state not in ("pending",):
                self.last[r.spec.name] = key
                c = self.cells(r)
                self.stream.write(f"sweep: {c[0]}  {c[1]}  step {c[2]}  loss {c[3]}  {c[4]}  "
                                  f"{c[5]}  {c[6]}\n")
                self.stream.flush()
        running = [r for r in runs if r.state == "running"]
        now = self.clock()
        for r in running:
            self.timed.setdefault(r.spec.name, (r.timed_steps, r.step_seconds, now))
        if running and now - self.t_beat >= self.heartbeat:
            self.stream.write(self.heartbeat_line(runs, now) + "\n")
            self.stream.flush()

    def heartbeat_line(self, runs: list[SweptRun], now: float) -> str:
        """`sweep: after 2m00s: 2 running, 1 pending; lr=0.001 step 120/1000 loss 3.214 2.5
        steps/s; lr=0.003 step 0 (starting)`: the time since the view started, how many runs
        are in each state, and each running run's step, latest train loss and steps/s over its
        steps since the last such line (their step times, as train's report line counts them);
        the next line counts from `now`."""
        counts: dict[str, int] = {"running": 0}
        for r in runs:
            counts[r.shown] = counts.get(r.shown, 0) + 1
        parts = []
        for r in (r for r in runs if r.state == "running"):
            n0, s0, t0 = self.timed.get(r.spec.name, (r.timed_steps, r.step_seconds, now))
            n, s = r.timed_steps - n0, r.step_seconds - s0
            self.timed[r.spec.name] = (r.timed_steps, r.step_seconds, now)
            part = f"{r.spec.name} step {r.step}" + (f"/{r.steps}" if r.steps else "")
            part += f" loss {report.fmt(r.loss)}" if r.loss is not None else ""
            if n > 0 and s > 0:
                part += f" {report.fmt(n / s)} steps/s"
            elif not r.timed_steps or t0 > self.t_beat:  # first seen since the last line
                part += " (starting)"
            else:  # validating, checkpointing
                part += f" (no step in {_elapsed(now - t0)})"
            parts.append(part)
        self.t_beat = now
        return (f"sweep: after {_elapsed(now - self.t_start)}: "
                + ", ".join(f"{n} {k}" for k, n in counts.items()) + "; " + "; ".join(parts))
