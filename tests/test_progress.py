"""Where progress bars are drawn (`toymlx.backend.progress`): on a terminal that has a width;
a pty of 0 columns, on which tqdm draws nothing, gets what a log gets."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import struct
import sys
import termios
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO

import pytest
from toymlx_cli.train import main

from toymlx.backend.progress import draws_bars, pass_bar
from toymlx.bundle.events import read_events


@contextmanager
def terminal(columns: int) -> Iterator[tuple[IO[str], int]]:
    """A pty `columns` wide (0: one nobody gave a size): its writable end as a text stream, and
    the descriptor its output is read from."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24 if columns else 0,
                                                          columns, 0, 0))
    stream = os.fdopen(follower, "w", buffering=1)
    try:
        yield stream, leader
    finally:
        stream.close()
        os.close(leader)


def drained(leader: int) -> str:
    """What has been written to the pty so far."""
    os.set_blocking(leader, False)
    out = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except BlockingIOError:
            return out.decode(errors="replace")
        if not chunk:
            return out.decode(errors="replace")
        out += chunk


@pytest.mark.parametrize("columns", [80, 0])
def test_a_pass_bar_is_drawn_on_a_terminal_with_a_width_only(monkeypatch, columns):
    """tqdm writes nothing at all to a terminal of 0 columns: there the bar is None (the
    caller's lines alone), as on a log; 80 columns draw it."""
    with terminal(columns) as (stream, leader):
        monkeypatch.setattr(sys, "stderr", stream)
        assert draws_bars() is (columns > 0)
        with pass_bar(5, "scoring", "row") as bar:
            assert (bar is None) is (columns == 0)
            if bar is not None:
                bar.update(5)
        monkeypatch.undo()
        shown = drained(leader)
    assert ("scoring:   0%" in shown and "0/5" in shown) if columns else shown == ""


def test_a_run_on_a_terminal_of_0_columns_prints_the_slow_step_lines(tmp_path, shared_file,
                                                                     capsys, monkeypatch):
    """A run whose stderr was a pty nobody gave a size showed nothing between its report
    lines (tqdm's bar draws nothing there, and the line a slow step prints where no bar is
    drawn was held back for it); now it gets those lines, as a log does (here every step is
    slow: QUIET_LINE_S 0)."""
    from toymlx.training import trainer

    monkeypatch.setattr(trainer, "QUIET_LINE_S", 0.0)
    data = str(shared_file("text/tinyshakespeare.txt"))
    args = ["--recipe", "from-scratch", "--model.d-model", "32", "--model.n-layers", "2",
            "--model.n-heads", "4", "--model.n-kv-heads", "2", "--model.ffn-dim", "64",
            "--seq-len", "32", "--batch-size", "4", "--eval-every", "0", "--no-compile",
            "--data.path", data, "--runs-root", str(tmp_path), "--run-id", "r", "--steps", "4",
            "--report-every", "4"]
    with terminal(0) as (stream, leader):
        monkeypatch.setattr(sys, "stderr", stream)
        assert main(args) == 0
        monkeypatch.setattr(sys, "stderr", sys.__stderr__)
        drained(leader)
    out = capsys.readouterr().out
    losses = {e["step"]: e["loss"] for e in read_events(tmp_path / "r") if e["kind"] == "step"}
    lines = {int(m[1]): float(m[2]) for m in re.finditer(
        r"^step (\d)/4: loss (\S+), \S+ s this step \(the report line of the steps since the "
        r"last comes at step 4\)$", out, re.MULTILINE)}
    assert sorted(lines) == [1, 2, 3]
    for step, loss in lines.items():
        assert loss == pytest.approx(losses[step], abs=5e-5)
