"""Sweeps: specs and names, locks and shards, and real tiny from-scratch sweeps (parallel
workers, skip on restart, a failing run among good ones, resume of a torn run, summary.csv
against each bundle's own events)."""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from toymlx_cli.sweep import main as sweep_main

from toymlx import sweep
from toymlx.events import read_events

# eager steps: no g++ JIT on a cold cache (compile == eager is tested in test_trainer)
TINY = ["--model.d-model", "32", "--model.n-layers", "1", "--seq-len", "32", "--batch-size",
        "4", "--steps", "10", "--eval-every", "5", "--eval-batches", "2", "--no-compile"]


def _evals(run: Path) -> list[float]:
    return [e["val_loss"] for e in read_events(run) if e["kind"] == "eval"]


def _csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


# ---------------------------------------------------------------- specs, names, keys

def test_grid_flags_names_and_order():
    specs = sweep.grid(["--steps", "10"], {"lr": [1e-4, 3e-4], "model.d_model": [32, 64]},
                       recipe="from-scratch")
    assert [s.name for s in specs] == ["lr=0.0001_model.d_model=32", "lr=0.0001_model.d_model=64",
                                       "lr=0.0003_model.d_model=32", "lr=0.0003_model.d_model=64"]
    assert specs[1].args == ("--steps", "10", "--lr", "0.0001", "--model.d-model", "64")
    assert specs[1].params == {"lr": 1e-4, "model.d_model": 64}
    # plain bools become tyro's --x / --no-x flags; dict bases are rendered the same way
    s = sweep.grid({"steps": 5, "data.val_fraction": 0.2}, {"compile": [False]},
                   recipe="from-scratch")[0]
    assert s.args == ("--steps", "5", "--data.val-fraction", "0.2", "--no-compile")
    assert sweep.value_args("data.mask_prompt", False) == ["--data.no-mask-prompt"]


def test_grid_rejects_bad_keys_and_clashes():
    with pytest.raises(ValueError, match="--grid lora.rank: expected an option of recipe"):
        sweep.grid([], {"lora.rank": [4]}, recipe="from-scratch")
    with pytest.raises(ValueError, match="--lr: given both"):
        sweep.grid(["--lr", "0.1"], {"lr": [1e-3]})
    with pytest.raises(ValueError, match="--run-id: the sweep sets this"):
        sweep.grid(["--run-id", "x"], {"lr": [1e-3]})
    with pytest.raises(ValueError, match="same run name"):
        sweep.grid([], {"x": ["a b", "a-b"]})


def test_parse_axis_types_values_by_the_recipe():
    assert sweep.parse_axis("lr=1e-4,3e-4", "from-scratch") == ("lr", [1e-4, 3e-4])
    assert sweep.parse_axis("model.d_model=32,None", "from-scratch") == (
        "model.d_model", [32, None])
    assert sweep.parse_axis("lr=log:1e-4:1e-2")[1] == sweep.LogUniform(1e-4, 1e-2)
    with pytest.raises(ValueError, match="expected a int"):
        sweep.parse_axis("steps=1.5", "from-scratch")


def test_random_is_deterministic_distinct_and_bounded():
    space = {"lr": sweep.LogUniform(1e-4, 1e-2), "model.n_layers": [1, 2]}
    a = sweep.random([], space, 6, seed=3)
    b = sweep.random([], space, 6, seed=3)
    assert [s.name for s in a] == [s.name for s in b]
    assert len({s.name for s in a}) == 6
    assert all(1e-4 <= s.params["lr"] <= 1e-2 for s in a)
    assert [s.name for s in sweep.random([], space, 6, seed=4)] != [s.name for s in a]
    # a space with 2 points gives 2 runs, not 5 repeats
    assert len(sweep.random([], {"lr": [1e-3, 2e-3]}, 5)) == 2


def test_shards_partition_the_runs():
    specs = sweep.grid([], {"lr": [1e-4, 2e-4, 3e-4, 4e-4, 5e-4]})
    parts = [sweep.shard_specs(specs, (i, 3)) for i in range(3)]
    assert sorted(s.name for p in parts for s in p) == sorted(s.name for s in specs)
    assert parts == [sweep.shard_specs(specs, (i, 3)) for i in range(3)]
    with pytest.raises(ValueError, match="--shard"):
        sweep.shard_specs(specs, (3, 3))


def test_lock_is_exclusive_and_stale_locks_are_taken_over(tmp_path):
    lock = tmp_path / "locks" / "run.lock"
    assert sweep.try_lock(lock)
    assert not sweep.try_lock(lock)  # held by this live process
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    info = json.loads(lock.read_text())
    lock.write_text(json.dumps({**info, "pid": int(dead)}))
    assert sweep.try_lock(lock)  # its holder on this host is gone
    other = {"host": "another-machine", "pid": 1}
    lock.write_text(json.dumps(other))
    assert not sweep.try_lock(lock, timeout=60)  # fresh, held elsewhere
    os.utime(lock, (0, 0))
    assert sweep.try_lock(lock, timeout=60)  # no heartbeat for ages: stale


# ---------------------------------------------------------------- real sweeps

def test_sweep_of_four_runs_completes_skips_on_restart_and_summary_matches(tmp_path, capsys):
    argv = ["--recipe", "from-scratch", "--grid", "lr=1e-3,3e-3", "--grid",
            "model.ffn_dim=32,64", "--workers", "2", "--runs-root", str(tmp_path),
            "--sweep-id", "s4", "--no-progress", "--no-report", *TINY]
    assert sweep_main(argv) == 0
    root = tmp_path / "s4"
    runs = sorted(p for p in root.iterdir() if (p / "events.jsonl").is_file())
    assert [p.name for p in runs] == ["lr=0.001_model.ffn_dim=32", "lr=0.001_model.ffn_dim=64",
                                      "lr=0.003_model.ffn_dim=32", "lr=0.003_model.ffn_dim=64"]
    for p in runs:
        assert read_events(p)[-1]["reason"] == "completed"
        assert json.loads((p / "config.json").read_text())["config"]["steps"] == 10

    rows = _csv(root / "summary.csv")
    assert sorted(r["run"] for r in rows) == [p.name for p in runs]
    for r in rows:  # the table's figures are the bundle's own, to the last digit
        evals = _evals(root / r["run"])
        assert float(r["final"]) == evals[-1]
        assert float(r["best"]) == min(evals)
        assert r["status"] == "completed" and r["metric"] == "val_loss"
        assert float(r["lr"]) == json.loads((root / r["run"] / "config.json").read_text())[
            "config"]["lr"]
    assert [float(r["best"]) for r in rows] == sorted(float(r["best"]) for r in rows)
    assert len((root / "summary.jsonl").read_text().splitlines()) == 4
    assert "lr=0.001_model.ffn_dim=32" in capsys.readouterr().out  # the printed table

    before = {p.name: (p / "events.jsonl").read_bytes() for p in runs}
    specs = sweep.grid(TINY, {"lr": [1e-3, 3e-3], "model.ffn_dim": [32, 64]},
                       recipe="from-scratch")
    result = sweep.run_sweep("from-scratch", specs, tmp_path, workers=2, sweep_id="s4",
                             progress=False, report_png=False)
    assert result.states == {p.name: "skipped" for p in runs}
    assert {p.name: (p / "events.jsonl").read_bytes() for p in runs} == before


def test_failing_run_is_reported_and_the_others_complete(tmp_path, capsys):
    argv = ["--recipe", "from-scratch", "--grid", "lr=1e-3,-1,1e8", "--workers", "2",
            "--runs-root", str(tmp_path), "--sweep-id", "bad", "--no-progress", "--no-report",
            *TINY]
    assert sweep_main(argv) == 1
    err = capsys.readouterr().err
    assert "FAILED lr=-1: toymlx-train: error: --lr: expected > 0, found -1.0" in err
    rows = {r["run"]: r for r in _csv(tmp_path / "bad" / "summary.csv")}
    assert rows["lr=0.001"]["status"] == "completed"
    assert float(rows["lr=0.001"]["final"]) == _evals(tmp_path / "bad" / "lr=0.001")[-1]
    assert rows["lr=-1"]["status"] == "failed"
    assert "--lr: expected > 0" in rows["lr=-1"]["message"]
    # a diverged run is a result, reported as such (and not run again on a restart)
    assert rows["lr=1e+08"]["status"] == "diverged"
    assert re.search(r"DIVERGED lr=1e\+08: (loss|gradient norm) became nan", err), err
    assert list(rows) == ["lr=0.001", "lr=-1", "lr=1e+08"]  # no metric: last, in grid order
    result = sweep.run_sweep("from-scratch", sweep.grid(TINY, {"lr": [1e-3, -1, 1e8]}),
                             tmp_path, sweep_id="bad", progress=False, report_png=False,
                             retry_failed=False)
    assert result.states == {"lr=0.001": "skipped", "lr=-1": "failed", "lr=1e+08": "skipped"}
    assert "--lr: expected > 0" in (tmp_path / "bad" / "logs" / "lr=-1.log").read_text()
    assert (tmp_path / "bad" / "logs" / "lr=-1.log").read_text().count("start:") == 1


def test_torn_run_is_resumed_from_its_checkpoint(tmp_path):
    specs = sweep.grid([*TINY, "--checkpoint-every", "5", "--stop-at", "5"], {"lr": [2e-3]})
    first = sweep.run_sweep("from-scratch", specs, tmp_path, sweep_id="t", progress=False,
                            report_png=False)
    assert first.states == {"lr=0.002": "stopped"}
    run = tmp_path / "t" / "lr=0.002"
    lines = (run / "events.jsonl").read_bytes().splitlines(keepends=True)
    assert json.loads(lines[-1])["kind"] == "run_end"
    (run / "events.jsonl").write_bytes(b"".join(lines[:-1]) + lines[-1][:20])  # torn, no end
    second = sweep.run_sweep("from-scratch", specs, tmp_path, sweep_id="t", progress=False,
                             report_png=False)
    assert second.states == {"lr=0.002": "done"}
    events = read_events(run)
    starts = [e for e in events if e["kind"] == "run_start"]
    assert [s["start_step"] for s in starts] == [0, 5]
    assert events[-1]["reason"] == "completed"
    assert "resume: toymlx-train --resume" in (tmp_path / "t" / "logs" / "lr=0.002.log").read_text()


def test_two_machines_over_one_folder_run_each_run_once(tmp_path):
    """Two sweep processes over one runs folder, both told they own every run (shard 0/1):
    the per-run lock files make each run happen exactly once."""
    cmd = [sys.executable, "-m", "toymlx_cli.sweep", "--recipe", "from-scratch", "--grid",
           "lr=1e-3,2e-3,3e-3", "--runs-root", str(tmp_path), "--sweep-id", "two",
           "--no-progress", "--no-report", *TINY, "--steps", "4"]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    for lr in ("0.001", "0.002", "0.003"):
        events = read_events(tmp_path / "two" / f"lr={lr}")
        assert [e["kind"] for e in events].count("run_start") == 1
        assert events[-1]["reason"] == "completed"
    assert not list((tmp_path / "two" / ".locks").iterdir())  # every lock released
