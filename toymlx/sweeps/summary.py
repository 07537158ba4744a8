"""A sweep's summary: every run listed in its sweep.json, printed, written as summary.csv and
summary.jsonl (best first) and drawn as report.png (`summarize_sweep`)."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

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

    @property
    def failed(self) -> list[str]:
        return [n for n, s in self.states.items() if s == "failed"]

    @property
    def ok(self) -> bool:
        return not self.failed and "interrupted" not in self.states.values()


def summarize_sweep(sweep_dir: str | os.PathLike, report_png: bool = True,
                    stream: TextIO | None = None) -> SweepResult:
    """Summary of every run listed in sweep_dir/sweep.json: printed, written as summary.csv
    and summary.jsonl (best first), and drawn as report.png when matplotlib is installed."""
    sweep_dir = Path(sweep_dir)
    stream = stream or sys.stderr
    names = report.sweep_order(sweep_dir)
    rows = report.summarize([sweep_dir / n for n in names])
    for r in rows:  # runs that failed before writing a bundle: the sweep's own record
        if r["status"] in ("missing", "empty"):
            try:
                st = json.loads((sweep_dir / ".status" / f"{r['run']}.json").read_text())
            except (OSError, ValueError):
                r["status"] = "pending" if r["status"] == "missing" else r["status"]
                continue
            if st.get("state") == "failed":
                r["status"], r["message"] = "failed", st.get("message")
                r["wall_s"] = round(st["wall_s"], 2) if st.get("wall_s") else None
    rows = report.sort_rows(rows)
    params = report.add_params(rows)
    report.write_summary(rows, params, sweep_dir)
    print(report.format_table(rows, params), flush=True)
    if report_png:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            stream.write("sweep: matplotlib is not installed (pip install 'toymlx[report]'); "
                         "no report.png\n")
        else:
            report.render([Path(r["path"]) for r in rows], sweep_dir / "report.png", rows,
                          params)
    stream.write(f"sweep: summary in {sweep_dir / 'summary.csv'}\n")
    return SweepResult(sweep_dir, rows, params, {})
