"""A sweep's summary: every run listed in its sweep.json, printed, written as summary.csv and
summary.jsonl (best first) and drawn as report.png (`summarize_sweep`)."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from toymlx.backend.files import counted
from toymlx.runner import report


@dataclass
class SweepResult:
    """What `run_sweep` did, and the summary of every run in the sweep folder."""

    sweep_dir: Path
    rows: list[dict[str, Any]]
    """summary rows (toymlx.runner.report.summarize plus `params`), best first"""
    params: list[str]
    states: dict[str, str]
    """run name -> what this call did: done, skipped, diverged, failed, stopped, interrupted,
    elsewhere (locked by another worker)"""
    signal: int | None = None
    """The stop signal that stopped this call (SIGINT, SIGTERM, SIGHUP; SIGPIPE for its console
    reader gone), None if none came."""
    unwritten: list[str] = field(default_factory=list)
    """The summary files that could not be written (a full or read-only disk), each named on
    the stream with its error."""

    @property
    def failed(self) -> list[str]:
        return [n for n, s in self.states.items() if s == "failed"]

    @property
    def ok(self) -> bool:
        return (not self.failed and "interrupted" not in self.states.values()
                and not self.unwritten)


def summarize_sweep(sweep_dir: str | os.PathLike, report_png: bool = True,
                    stream: TextIO | None = None, elsewhere: int = 0) -> SweepResult:
    """Summary of every run listed in sweep_dir/sweep.json: printed, written as summary.csv
    and summary.jsonl (best first), and drawn as report.png when matplotlib is installed;
    `elsewhere`: how many of its runs another process (a sweep of the same id) still runs."""
    sweep_dir = Path(sweep_dir)
    stream = stream or sys.stderr
    names = report.sweep_order(sweep_dir)
    rows = recorded_states(report.summarize([sweep_dir / n for n in names]))
    rows = report.sort_rows(rows)
    params = report.add_params(rows)
    unwritten = []
    # a file that cannot be written (a full disk) is named, and the rest still done: raised,
    # it ended the sweep before its FAILED lines, with exit status 2 for a failed report.png
    try:
        report.write_summary(rows, params, sweep_dir)
    except OSError as e:
        unwritten.append(_unwritten(stream, "summary.csv", e))
    print(report.format_table(rows, params), flush=True)
    if report_png:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            stream.write("sweep: matplotlib is not installed (pip install 'toymlx[report]'); "
                         "no report.png\n")
        else:
            try:
                report.render([Path(r["path"]) for r in rows], sweep_dir / "report.png", rows,
                              params)
            except OSError as e:
                unwritten.append(_unwritten(stream, "report.png", e))
    if "summary.csv" not in unwritten:
        stream.write(f"sweep: summary in {sweep_dir / 'summary.csv'}\n")
    if best := best_line(rows, elsewhere):
        stream.write(best + "\n")
    return SweepResult(sweep_dir, rows, params, {}, unwritten=unwritten)


def recorded_states(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`rows` (`report.summarize`), where a sweep's run has no bundle, with the sweep's own
    record of it (its folder's .status/RUN.json): failed (with its message and wall time)
    before it wrote one, or pending. toymlx-report of a sweep folder showed these `missing`
    where the sweep's summary said `failed`."""
    for r in rows:
        if r["status"] not in ("missing", "empty"):
            continue
        try:
            st = json.loads((Path(r["path"]).parent / ".status" / f"{r['run']}.json").read_text())
        except (OSError, ValueError):
            r["status"] = "pending" if r["status"] == "missing" else r["status"]
            continue
        if st.get("state") == "failed":
            r["status"], r["message"] = "failed", st.get("message")
            r["wall_s"] = round(st["wall_s"], 2) if st.get("wall_s") else None
    return rows


def best_line(rows: list[dict[str, Any]], elsewhere: int = 0) -> str | None:
    """"sweep: best RUN: METRIC VALUE at step S (lowest of N completed runs)", for `rows` best
    first (`report.sort_rows`): the table's first row, named as Optuna's best_trial is, with
    the number of runs exactly as good (a tie: vit-tiny's accuracy on a few images); None where
    no completed run has a validation figure. With runs still running `elsewhere` (another
    sweep of the same id), "best so far", and how many: a sweep ending first called its one
    completed run the best while the other's still trained."""
    done = [r for r in rows if r["status"] == "completed" and r.get("best") is not None]
    if not done:
        return None
    b = done[0]
    most = "highest" if report.METRICS.get(b["metric"], False) else "lowest"
    ties = sum(r["best"] == b["best"] and r["metric"] == b["metric"] for r in done[1:])
    tie = f"; {counted(ties, 'other')} as good" if ties else ""
    value = report.fmt(float(b["best"]))
    # a runner-up that reads the same to 4 digits (two lora ranks' val_loss 6.225 and 6.225,
    # the table's too): both to the digits that tell them apart, the runner-up named
    after = [r for r in done[1:] if r["metric"] == b["metric"] and r["best"] != b["best"]]
    if after and report.fmt(float(after[0]["best"])) == value:
        x, y = float(b["best"]), float(after[0]["best"])
        digits = next(d for d in range(5, 18) if f"{x:.{d}g}" != f"{y:.{d}g}")
        value = f"{x:.{digits}g}"
        tie += f"; the next, {after[0]['run']}, {y:.{digits}g}"
    if elsewhere:
        tie += f"; {counted(elsewhere, 'run')} still running elsewhere"
    return (f"sweep: best{' so far' if elsewhere else ''} {b['run']}: {b['metric']} {value} at "
            f"step {b['best_step']} ({most} of {counted(len(done), 'completed run')}{tie})")


def _unwritten(stream: TextIO, name: str, e: OSError) -> str:
    """Say that the summary file `name` could not be written, and why; returns `name`."""
    stream.write(f"sweep: error: could not write {name} ({e}); the runs are as the table "
                 "says: free space and run the same command again to write it (completed "
                 "runs are skipped)\n")
    return name
