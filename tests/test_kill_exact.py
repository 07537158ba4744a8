"""scripts/kill_exact.py's own verdict, with the trainer replaced by a stand-in (the real runs:
tests/test_crash_resume.py, slow)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def test_a_run_that_fails_by_itself_before_a_stop_is_a_difference(tmp_path, monkeypatch):
    """A stop whose run had already exited with an error was skipped and the run resumed: a
    crash the resume mended ended 'bit-exact' with no word of it."""
    monkeypatch.syspath_prepend(str(SCRIPTS))
    kill_exact = importlib.import_module("kill_exact")
    count = tmp_path / "count"
    fake = tmp_path / "train.py"  # the first run of "killed" fails at once, every other succeeds
    fake.write_text("import sys\nfrom pathlib import Path\n"
                    f"c = Path({str(count)!r})\n"
                    "if 'uninterrupted' in sys.argv: sys.exit(0)\n"
                    "n = int(c.read_text()) if c.exists() else 0\n"
                    "c.write_text(str(n + 1))\nsys.exit(1 if n == 0 else 0)\n")
    monkeypatch.setattr(kill_exact, "train_cmd", lambda: [sys.executable, str(fake)])
    monkeypatch.setattr(kill_exact, "outcome", lambda run: {})
    monkeypatch.setattr(kill_exact, "differences", lambda ref, got: [])
    monkeypatch.setattr(kill_exact, "MODES", ["checkpoint"])  # waits for a file never written
    (tmp_path / "runs").mkdir()
    s = kill_exact.kill_exact("from-scratch", 1, 0, 9, tmp_path / "runs")
    assert s["kills"] == [{"mode": "checkpoint", "exited": 1}]
    assert s["final_rc"] == 0
    assert s["differences"] == [
        (f"stop 0 (checkpoint): the run exited by itself with status 1 before the stop (see "
         f"{tmp_path / 'runs' / 'train.log'})")]
