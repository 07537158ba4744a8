"""scripts/sweep_*.py, the sweeps users copy: the run they name as best completed.

A run that diverged holds a validation figure (its best before it blew up); the rows come
completed runs first (`report.sort_rows`), so where no run completed, a script that took the
first row with a figure named the diverged run as the sweep's answer. The sweep itself is
replaced by its rows: what is checked is the scripts' own choice, not the sweep machinery
(tests/test_sweep.py).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from toymlx.runner.report import sort_rows

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def _row(status: str, best: float, **params) -> dict:
    return {"status": status, "best": best, "best_step": 50, "metric": "val_loss",
            "params": params}


@pytest.mark.parametrize("script, param, argv", [
    ("sweep_lr_from_scratch.py", "lr", []),
    ("sweep_lora_rank.py", "lora.rank", ["--base", "BASE"]),
])
def test_best_is_a_completed_run(script, param, argv, tmp_path, monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location(script[:-3], SCRIPTS / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    base = tmp_path / "base.gguf"
    base.write_bytes(b"GGUF")
    argv = [str(base) if a == "BASE" else a for a in argv]
    monkeypatch.setattr(sys, "argv", [script, *argv])
    diverged = _row("diverged", 1.25, **{param: 3})

    def best_line(rows: list[dict]) -> list[str]:
        monkeypatch.setattr(module, "run_sweep", lambda *a, **k: SimpleNamespace(
            rows=sort_rows(rows), sweep_dir=tmp_path, ok=False))
        assert module.main() == 1
        return [x for x in capsys.readouterr().out.splitlines() if x.startswith("best:")]

    line, = best_line([diverged, _row("completed", 2.5, **{param: 7})])
    assert "val_loss 2.5000" in line and "=7" in line, line
    assert best_line([diverged]) == []  # no run completed: no answer
