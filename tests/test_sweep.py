"""Sweeps: specs and names, locks and shards, and real tiny from-scratch sweeps (parallel
workers, skip on restart, a failing run among good ones, resume of a torn run, summary.csv
against each bundle's own events)."""

from __future__ import annotations

import csv
import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import end_child
from toymlx_cli.sweep import main as sweep_main

from toymlx import sweeps as sweep
from toymlx.backend.lock import LockHeld, acquire
from toymlx.bundle.events import read_events

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
    # named neither the --grid nor the value given ("--lr: given both as a fixed option and
    # in the sweep; keep one")
    for base, given in ((["--lr", "0.1", "--steps", "2"], "--lr 0.1"), (["--lr=0.1"], "--lr=0.1")):
        with pytest.raises(ValueError) as e:
            sweep.grid(base, {"lr": [1e-3]})
        assert str(e.value) == ("--grid lr: expected --lr in the grid or among every run's "
                                f"options, found it in both ({given}); keep one")
    with pytest.raises(ValueError) as e:
        sweep.random(["--steps", "2", "--no-compile"], {"compile": [True, False]}, 2)
    assert str(e.value) == ("--grid compile: expected --compile in the grid or among every "
                            "run's options, found it in both (--no-compile); keep one")
    with pytest.raises(ValueError, match="--run-id: the sweep sets this"):
        sweep.grid(["--run-id", "x"], {"lr": [1e-3]})
    with pytest.raises(ValueError, match="same run name"):
        sweep.grid([], {"x": ["a b", "a-b"]})
    # a misspelt key named the option it was near only where its last part was exact
    for key, want in (("lrr", "lr"), ("batchsize", "batch_size"), ("d_model", "model.d_model")):
        with pytest.raises(ValueError) as e:
            sweep.parse_axis(f"{key}=1,2", "from-scratch")
        assert str(e.value) == (f"--grid {key}: expected an option of recipe from-scratch, "
                                f"found no option --{key.replace('_', '-')} (did you mean "
                                f"{want}?)")
    # --grid recipe=lora said "found no option --recipe", as if no sweep could vary it
    with pytest.raises(ValueError) as e:
        sweep.parse_axis("recipe=lora,from-scratch", "from-scratch")
    assert str(e.value) == ("--grid recipe: expected an option of the runs, found --recipe, the "
                            "sweep's own flag (one sweep runs one recipe); to compare recipes, "
                            "run one sweep for each (toymlx-sweep --recipe lora ..., then "
                            "toymlx-sweep --recipe from-scratch ...)")
    # --grid run-id=a,b ran (minutes each) and every run failed, its folder not the sweep's
    with pytest.raises(ValueError) as e:
        sweep.grid([], {"run-id": ["a", "b"]}, recipe="from-scratch")
    assert str(e.value) == ("--grid run-id: expected an option of the runs, found --run-id, "
                            "which the sweep sets for each run; remove it")


def test_parse_axis_types_values_by_the_recipe():
    assert sweep.parse_axis("lr=1e-4,3e-4", "from-scratch") == ("lr", [1e-4, 3e-4])
    assert sweep.parse_axis("model.d_model=32,None", "from-scratch") == (
        "model.d_model", [32, None])
    assert sweep.parse_axis("lr=log:1e-4:1e-2")[1] == sweep.LogUniform(1e-4, 1e-2)
    with pytest.raises(ValueError, match="expected an integer"):
        sweep.parse_axis("steps=1.5", "from-scratch")
    # a value given twice named neither the --grid nor the value as typed
    with pytest.raises(ValueError) as e:
        sweep.parse_axis("lr=1e-3,3e-3,0.001", "from-scratch")
    assert str(e.value) == "--grid 'lr=1e-3,3e-3,0.001': expected distinct values, found 0.001 twice"
    # an empty value read as "--grid lr=: expected a number", the text typed not named
    for text in ("lr=1e-3,,3e-3", "lr=1e-3,", "lr="):
        with pytest.raises(ValueError) as e:
            sweep.parse_axis(text, "from-scratch")
        assert str(e.value) == (f"--grid {text!r}: expected KEY=V1,V2,... with no empty value "
                                "(e.g. lr=1e-4,3e-4)")


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


HOLD = """
import sys, time
from toymlx.backend.lock import acquire
lock = acquire(sys.argv[1], "test")
print("held", flush=True)
time.sleep(600)
"""


def test_lock_is_owned_by_a_live_process_and_dies_with_it(tmp_path):
    """The lock is an flock: another process is refused (told who holds it) while its holder
    lives, and takes it over the moment the holder is SIGKILLed, with no stale state left."""
    path = tmp_path / "locks" / "run.lock"
    path.parent.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(path)], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(LockHeld, match=rf"test: in use by process {holder.pid} \(.*-c"):
            acquire(path, "test")
    finally:
        end_child(holder)
    with acquire(path, "test") as lock:  # dead holder: free at once
        with pytest.raises(LockHeld, match=f"process {os.getpid()}"):
            acquire(path, "test")  # a second holder in this very process is refused too
        assert json.loads(path.read_text())["pid"] == os.getpid()
    assert not path.exists() and lock is not None  # released and removed


def test_a_lock_holder_ended_by_end_child_leaves_no_pipe_to_the_garbage_collector(tmp_path):
    """A holder's stdout pipe (text) was never closed where the test ended the holder itself
    (`kill`, `wait`) or `end_child` killed it: a ResourceWarning "unclosed file
    <_io.TextIOWrapper name=12>" at the next garbage collection, in whichever test came later
    (test_api's check of its own pipes, run after this file). Both now leave the pipe closed."""
    import gc
    import warnings

    def holder(name: str) -> subprocess.Popen:
        p = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / name)],
                             stdout=subprocess.PIPE, text=True)
        assert p.stdout.readline() == "held\n"
        return p

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        killed, ended = holder("a.lock"), holder("b.lock")
        ended.kill()  # as a test kills a holder to show that its lock dies with it
        ended.wait()
        for p in (killed, ended):
            end_child(p)
        assert (killed.returncode, ended.returncode) == (-signal.SIGKILL, -signal.SIGKILL)
        assert (killed.stdout.closed, ended.stdout.closed) == (True, True)
        del killed, ended, p
        gc.collect()
    assert [str(w.message) for w in caught if w.category is ResourceWarning] == []


# ---------------------------------------------------------------- the live view

def test_a_resumed_runs_steps_per_s_counts_only_the_steps_it_trains():
    """A resumed run's history is read before it starts; then its resume cuts events.jsonl
    back and writes it anew, which the sweep reads again from its start (`EventTail`): the
    kept steps were counted twice, and the first line after it gave the old steps' rate (400
    steps at 2 steps/s beside 20 new ones at 4: "2.049 steps/s"), not the resumed run's."""
    import io

    from toymlx.sweeps.live import LiveView, SweptRun

    def steps(first, last, seconds):  # `t` goes on from the run's clock, as events.jsonl's
        return [{"kind": "step", "step": s, "t": s * seconds, "loss": 3.0, "step_time_s": seconds}
                for s in range(first, last + 1)]

    now = [1000.0]
    out = io.StringIO()
    view = LiveView(out, True, heartbeat=60.0, clock=lambda: now[0])
    r = SweptRun(sweep.RunSpec("lr=0.001", {}, ()), Path("lr=0.001"))
    history = steps(1, 400, 0.5)
    r.absorb(history)  # read before the resumed process starts
    r.state = "running"
    view.update([r])
    resumed = [{"kind": "resume", "t": 200.0, "steps": 1000, "from_step": 400}]
    new = [{**e, "t": 200.0 + (e["step"] - 400) * 0.25} for e in steps(401, 420, 0.25)]
    r.absorb(history + resumed + new)  # the file cut back and written anew, read again
    now[0] += 60.0
    view.update([r])
    assert out.getvalue().splitlines()[-1] == (
        "sweep: after 1m00s: 1 running; lr=0.001 step 420/1000 loss 3 4 steps/s")


def test_a_log_not_a_terminal_gets_a_line_of_the_runs_in_flight_every_interval():
    """Not on a terminal (a log file, CI, nohup) a line came only on a run's change of state
    or a new validation figure: with LoRA's eval interval, ~7 minutes with nothing while the
    runs trained. Now a line of the runs in flight every `heartbeat` seconds of the view's
    clock (steps/s over the steps since the last such line, from their step times); a
    terminal keeps its table."""
    import io

    from toymlx.sweeps.live import LiveView, SweptRun

    def steps(r, first, last, seconds, loss):
        r.absorb([{"kind": "step", "step": s, "loss": loss, "step_time_s": seconds,
                   "tokens_per_s": 512.0} for s in range(first, last + 1)])

    now = [1000.0]
    out = io.StringIO()
    view = LiveView(out, True, heartbeat=60.0, clock=lambda: now[0])
    a, b, c = runs = [SweptRun(sweep.RunSpec(n, {}, ()), Path(n))
                      for n in ("lr=0.001", "lr=0.003", "lr=0.01")]
    a.state = b.state = "running"
    a.absorb([{"kind": "run_start", "config": {"steps": 1000}, "start_step": 0}])
    steps(b, 1, 400, 0.5, 3.0)  # a resumed run's history, read before it started
    b.absorb([{"kind": "resume", "steps": 1000, "from_step": 400}])
    view.update(runs)
    assert out.getvalue().splitlines() == [
        "sweep: lr=0.001  running  step 0/1000  loss -  -  -  -",
        "sweep: lr=0.003  running (resuming)  step 400/1000  loss 3  -  512 tokens/s  -"]
    steps(a, 1, 30, 0.5, 3.25)
    steps(b, 401, 430, 0.25, 2.5)
    now[0] += 59.5
    view.update(runs)
    assert len(out.getvalue().splitlines()) == 2  # not yet
    now[0] += 0.5
    view.update(runs)
    view.update(runs)  # once per interval
    assert out.getvalue().splitlines()[2:] == [
        ("sweep: after 1m00s: 2 running, 1 pending; lr=0.001 step 30/1000 loss 3.25 2 steps/s; "
         "lr=0.003 step 430/1000 loss 2.5 4 steps/s")]
    # a finished run, one that made no step since (validating), one just started
    a.state, c.state = "done", "running"
    now[0] += 60.0
    view.update(runs)
    assert out.getvalue().splitlines()[3:] == [
        "sweep: lr=0.001  done  step 30/1000  loss 3.25  -  512 tokens/s  -",
        "sweep: lr=0.01  running  step -  loss -  -  -  -",
        ("sweep: after 2m00s: 2 running, 1 done; lr=0.003 step 430/1000 loss 2.5 (no step in "
         "1m00s); lr=0.01 step 0 (starting)")]
    steps(b, 431, 436, 0.75, 2.375)
    steps(c, 1, 1, 8.0, 4.0)
    now[0] += 3600.0
    view.update(runs)
    assert out.getvalue().splitlines()[6:] == [
        ("sweep: after 1h02m: 2 running, 1 done; lr=0.003 step 436/1000 loss 2.375 1.333 "
         "steps/s; lr=0.01 step 1 loss 4 0.125 steps/s")]

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    for stream, enabled in ((Terminal(), True), (io.StringIO(), False)):  # --no-progress
        now[0] = 0.0
        view = LiveView(stream, enabled, heartbeat=60.0, clock=lambda: now[0])
        view.update(runs, force=True)
        now[0] = 120.0
        view.update(runs, force=True)
        assert "after" not in stream.getvalue()


def test_the_live_line_says_what_a_running_run_does():
    """A run's line said how the sweep started it for the whole run: "running (start) step
    40/40" for a run that had ended, its process still exiting. Now: starting (resuming) until
    its first step, plain running while it trains, "REASON, exiting" after its run_end; a
    validation of an earlier step than the one shown names its step."""
    import io

    from toymlx.sweeps.live import LiveView, SweptRun

    out = io.StringIO()
    view = LiveView(out, True, heartbeat=60.0, clock=lambda: 0.0)
    r = SweptRun(sweep.RunSpec("lr=0.001", {}, ()), Path("lr=0.001"))
    r.state, r.action, r.phase = "running", "start", "starting"  # as the sweep starts it
    r.absorb([{"kind": "run_start", "config": {"steps": 40}, "start_step": 0}])
    view.update([r])
    r.absorb([{"kind": "step", "step": s, "loss": 2.5} for s in range(1, 21)]
             + [{"kind": "eval", "step": 20, "accuracy": 0.25}]
             + [{"kind": "step", "step": s, "loss": 2.0} for s in range(21, 33)])
    view.update([r])
    r.absorb([{"kind": "step", "step": s, "loss": 1.5} for s in range(33, 41)]
             + [{"kind": "eval", "step": 40, "accuracy": 0.5},
                {"kind": "run_end", "reason": "completed"}])
    view.update([r])
    r.state = "done"  # its process exited
    view.update([r])
    assert out.getvalue().splitlines() == [
        "sweep: lr=0.001  running (starting)  step 0/40  loss -  -  -  -",
        "sweep: lr=0.001  running  step 32/40  loss 2  accuracy 0.25 (step 20)  -  -",
        "sweep: lr=0.001  running (completed, exiting)  step 40/40  loss 1.5  accuracy 0.5  -  -",
        "sweep: lr=0.001  done  step 40/40  loss 1.5  accuracy 0.5  -  -"]
    # a resume's events.jsonl, cut back and read again from its start: its old steps first,
    # then its new resume event; resuming until a step after that one
    r = SweptRun(sweep.RunSpec("lr=0.003", {}, ()), Path("lr=0.003"))
    r.state, r.phase = "running", "resuming"
    r.absorb([{"kind": "run_start", "config": {"steps": 40}, "start_step": 0},
              {"kind": "step", "step": 1, "loss": 3.0},
              {"kind": "resume", "steps": 40, "from_step": 1}])
    assert view.cells(r)[1:3] == ["running (resuming)", "1/40"]
    r.absorb([{"kind": "step", "step": 2, "loss": 2.75}])
    assert view.cells(r)[1:3] == ["running", "2/40"]


def test_the_runs_notes_are_said_once_each_naming_the_run_up_to_a_cap(tmp_path):
    """A run's notes (rows cut at --seq-len, a warm-up longer than --steps) reached only its
    log: the user watching the sweep never saw them. Now each distinct note is said once,
    numbered, naming the first run that said it; not a step's line, nor a run's refusal or
    last line (the sweep reports those), nor a note the sweep said before its runs; after
    `shown` notes, one line names the logs; at the end, by its number, which runs said each
    (only the first was named: one run's note read as every run's)."""
    import io

    from toymlx.sweeps.live import LiveView, RunNotes, SweptRun

    cut = ("toymlx: data/train.jsonl: train: of 80 examples, 3 cut to their first 257 tokens "
           "(--seq-len 256)")
    notes = RunNotes(tmp_path / "logs", said=["data: no valid.jsonl: ..."], shown=2)
    assert notes.lines("lr=0.001", [
        "step 2/10: train loss 5.5270, lr 3.000e-04", cut, "toymlx: data: no valid.jsonl: ...",
        "toymlx-train: error: training split: expected at least 33 tokens",
        "toymlx: completed at step 10. held-out: val_loss 5.4711. bundle: runs/s/lr=0.001",
        "toymlx-train: interrupted before the first step; nothing was trained", cut]) == [
        f"sweep: note 1 (lr=0.001): {cut}"]
    assert notes.lines("lr=0.003", [cut, "toymlx-train: --warmup 20 ... --lr 0.003",
                                    "toymlx: warning: TOYMLX_BLAS ...",
                                    "toymlx-train: --warmup 20 ... --lr 0.01"]) == [
        "sweep: note 2 (lr=0.003): toymlx-train: --warmup 20 ... --lr 0.003",
        f"sweep: more than 2 notes from the runs: the rest are in their logs ({tmp_path / 'logs'})"]
    assert notes.lines("lr=0.01", ["toymlx: another note"]) == []
    # at the end, which runs said each note shown: a later run's repeat was named nowhere;
    # "started now": the runs of this invocation, not those an earlier one ran (skipped now)
    assert notes.lines("lr=0.01", [cut, cut, "toymlx-train: --warmup 20 ... --lr 0.003"]) == []
    assert notes.said_by(["lr=0.001", "lr=0.003", "lr=0.01"]) == [
        "sweep: note 1 was said by every run started now (3)",
        "sweep: note 2 was said by 2 of the 3 runs started now: lr=0.003, lr=0.01"]
    assert notes.said_by(["lr=0.001", "lr=0.003", "lr=0.01", "lr=0.1", "lr=1", "lr=10"],
                         names=2) == [
        "sweep: note 1 was said by 3 of the 6 runs started now: lr=0.001, lr=0.003, and 1 more",
        "sweep: note 2 was said by 2 of the 6 runs started now: lr=0.003, lr=0.01"]
    assert notes.said_by(["lr=0.001"]) == []  # one run: its line named it
    # a run's note of run-options.json is the sweep's of the -c file it copies, said before
    # the runs (mlx-lm's `key 'adapter_path': not used` was said twice, once naming each)
    said = "mlx_lm_lora.yaml: key 'adapter_path': not used (--runs-root ...)"
    notes = RunNotes(tmp_path / "logs", said=[said],
                     copies={"runs/s/run-options.json": "mlx_lm_lora.yaml"})
    assert notes.lines("lr=1e-05", [
        "toymlx-train: runs/s/run-options.json: key 'adapter_path': not used (--runs-root ...)",
        "toymlx-train: runs/s/run-options.json: key 'iters': another note"]) == [
        ("sweep: note 1 (lr=1e-05): toymlx-train: runs/s/run-options.json: key 'iters': "
         "another note")]

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    # on a terminal, above the table, which is drawn again below them
    out = Terminal()
    view = LiveView(out, True, clock=lambda: 0.0)
    r = SweptRun(sweep.RunSpec("lr=0.001", {}, ()), Path("lr=0.001"))
    r.state = "running"
    view.update([r], force=True)
    table = out.getvalue()
    view.say([f"sweep: lr=0.001: {cut}"])
    assert table.count("\n") == 2  # its header and its run, redrawn in full below the note
    assert out.getvalue() == f"{table}\x1b[2F\x1b[Jsweep: lr=0.001: {cut}\n{table}"
    for enabled in (True, False):  # lines, and --no-progress: said all the same
        out = io.StringIO()
        LiveView(out, enabled).say(["sweep: lr=0.001: toymlx: a note"])
        assert out.getvalue() == "sweep: lr=0.001: toymlx: a note\n"


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
        # each run's log holds its report lines: the step-10 one, and each validation's
        log = (root / "logs" / f"{p.name}.log").read_text()
        step10 = next(e for e in read_events(p) if e["kind"] == "step" and e["step"] == 10)
        assert re.search(r"^step 10/10: train loss \S+, lr \S+, \S+ steps/s, \S+ tokens/s, "
                         rf"{step10['trained_tokens']} tokens trained, ", log, re.MULTILINE), log
        for e in (e for e in read_events(p) if e["kind"] == "eval"):
            assert f"step {e['step']}: val_loss {e['val_loss']:.4f} ({e['seconds']:.2f} s)" \
                in log

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
    out, err = capsys.readouterr()
    assert "lr=0.001_model.ffn_dim=32" in out  # the printed table
    assert err.splitlines()[0] == f"sweep {root}: 4 runs, 4 on this shard (0/1), 2 workers"
    best = min(runs, key=lambda p: min(_evals(p)))  # from the bundles, not the summary
    steps = {e["val_loss"]: e["step"] for e in read_events(best) if e["kind"] == "eval"}
    value = min(_evals(best))
    assert err.splitlines()[-1] == (f"sweep: best {best.name}: val_loss {value:.4g} at step "
                                    f"{steps[value]} (lowest of 4 completed runs)")

    before = {p.name: (p / "events.jsonl").read_bytes() for p in runs}
    specs = sweep.grid(TINY, {"lr": [1e-3, 3e-3], "model.ffn_dim": [32, 64]},
                       recipe="from-scratch")
    result = sweep.run_sweep("from-scratch", specs, tmp_path, workers=2, sweep_id="s4",
                             progress=False, report_png=False)
    assert result.states == {p.name: "skipped" for p in runs}
    assert {p.name: (p / "events.jsonl").read_bytes() for p in runs} == before
    # said up front (with no progress view the table was all a run again printed)
    assert capsys.readouterr().err.splitlines()[0] == (
        f"sweep {root}: 4 runs, 4 on this shard (0/1), 2 workers; 4 finished before, skipped")


def test_a_note_a_run_says_in_its_log_is_said_by_the_sweep_once(tmp_path, capsys):
    """Both runs say the same note in their logs (the recipe's --warmup 20 is longer than
    --steps 2): the sweep says it once, naming the run that said it first (before, it was in
    the logs alone), and at the end that both said it."""
    argv = ["--recipe", "from-scratch", "--grid", "model.ffn_dim=32,64", "--runs-root",
            str(tmp_path), "--sweep-id", "n", "--no-progress", "--no-report", *TINY,
            "--steps", "2"]
    assert sweep_main(argv) == 0
    err = capsys.readouterr().err.splitlines()
    logs = tmp_path / "n" / "logs"
    warmup = [x for x in (logs / "model.ffn_dim=32.log").read_text().splitlines()
              if x.startswith("toymlx-train: --warmup 20 (the recipe's default) is longer")]
    assert len(warmup) == 1 and warmup[0] in (logs / "model.ffn_dim=64.log").read_text()
    assert [x for x in err if x.startswith("sweep: note ")] == [
        f"sweep: note 1 (model.ffn_dim=32): {warmup[0]}",
        "sweep: note 1 was said by every run started now (2)"]  # and at the end, that both said it


def test_failing_run_is_reported_and_the_others_complete(tmp_path, capsys):
    """A run that fails on its data (val_fraction 0.999999 leaves no training window: found
    when the run reads it) fails alone; a diverged one is a result."""
    argv = ["--recipe", "from-scratch", "--grid", "lr=1e-3,1e8", "--grid",
            "data.val_fraction=0.1,0.999999", "--workers", "2", "--runs-root", str(tmp_path),
            "--sweep-id", "bad", "--no-progress", "--no-report", *TINY]
    assert sweep_main(argv) == 1
    err = capsys.readouterr().err
    ok, short = "lr=0.001_data.val_fraction=0.1", "lr=0.001_data.val_fraction=0.999999"
    big, big_short = "lr=1e+08_data.val_fraction=0.1", "lr=1e+08_data.val_fraction=0.999999"
    assert re.search(f"FAILED {re.escape(short)}: toymlx-train: error: .*training split: "
                     r"expected at least 33 tokens \(a window of --seq-len 32", err), err
    rows = {r["run"]: r for r in _csv(tmp_path / "bad" / "summary.csv")}
    assert rows[ok]["status"] == "completed"
    assert float(rows[ok]["final"]) == _evals(tmp_path / "bad" / ok)[-1]
    assert rows[short]["status"] == rows[big_short]["status"] == "failed"
    from toymlx.recipes.common import default_corpus

    # the default text's ids: the byte tokenizer's BOS, then one a byte (the Python
    # documentation's topic pages differ between Python patch releases)
    ids = len(default_corpus()[0].encode("utf-8")) + 1
    assert rows[short]["message"].endswith(
        "training split: expected at least 33 tokens (a window of --seq-len 32 and the token "
        f"after it), found 0 (of the text's {ids}); use a longer text or --data.val-fraction "
        "0.999 or less")
    # a diverged run is a result, reported as such (and not run again on a restart)
    assert rows[big]["status"] == "diverged"
    assert re.search(rf"DIVERGED {re.escape(big)}: (loss|gradient norm) became nan", err), err
    assert list(rows) == [ok, short, big, big_short]  # no metric: last, in grid order
    result = sweep.run_sweep("from-scratch", sweep.grid(TINY, {
        "lr": [1e-3, 1e8], "data.val_fraction": [0.1, 0.999999]}), tmp_path, sweep_id="bad",
        progress=False, report_png=False, retry_failed=False)
    assert result.states == {ok: "skipped", short: "failed", big: "skipped",
                             big_short: "failed"}
    log = (tmp_path / "bad" / "logs" / f"{short}.log").read_text()
    assert "training split: expected at least 33 tokens" in log and log.count("start:") == 1


def test_a_run_holding_an_offline_w_and_b_run_not_uploaded_is_not_started_over(tmp_path,
                                                                              capsys):
    """A sweep starts a torn run without a checkpoint over with --overwrite, which keeps an
    offline W&B run `wandb sync` never uploaded: the run failed on the child's line, "pass
    --overwrite again ... or choose another --run-id", neither of them the sweep user's to do.
    Now the sweep says it before starting the run: the `wandb sync` line, then run the sweep
    again, nothing removed; once synced, the sweep starts the run over."""
    import shlex

    argv = ["--recipe", "from-scratch", "--grid", "lr=1e-3", "--runs-root", str(tmp_path),
            "--sweep-id", "w", "--no-progress", "--no-report", *TINY]
    assert sweep_main(argv) == 0
    run = tmp_path / "w" / "lr=0.001"
    # killed after its steps, before its checkpoint: the sweep starts it over
    events = [line for line in (run / "events.jsonl").read_text().splitlines()
              if json.loads(line)["kind"] not in ("checkpoint", "run_end")]
    (run / "events.jsonl").write_text("\n".join(events) + "\n")
    for f in (run / "weights").glob("*.gguf"):
        f.unlink()
    offline = run / "wandb" / "offline-run-20261205_074400-abc"  # as W&B offline writes it
    offline.mkdir(parents=True)
    (offline / "run-abc.wandb").write_bytes(b"the run's only copy")
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert sweep_main(argv) == 1
    said = (f"sweep: FAILED lr=0.001: {run}: starting it over: expected its offline W&B run "
            "uploaded first (wandb sync leaves a *.wandb.synced file beside each .wandb file it "
            f"uploads), found {offline.name} without one; nothing was removed: upload it with: "
            f"wandb sync {shlex.quote(str(offline))}, then run the sweep again; or, to lose it, "
            f"remove {run / 'wandb'} first (log: {tmp_path / 'w' / 'logs' / 'lr=0.001.log'})")
    assert said in capsys.readouterr().err.splitlines()
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
    (offline / "run-abc.wandb.synced").touch()  # as `wandb sync` marks what it uploaded
    assert sweep_main(argv) == 0
    assert not offline.exists() and [e["kind"] for e in read_events(run)][-1] == "run_end"


def test_a_sweep_from_the_folder_holding_a_clone_runs(tmp_path, capsys, monkeypatch):
    """A `toymlx/` folder where the sweep is started (the parent of a clone) shadowed an
    editable install's package in every run's `python -m` child: each run FAILED with
    "cannot import name '__version__' from 'toymlx'"."""
    (tmp_path / "toymlx").mkdir()
    monkeypatch.chdir(tmp_path)
    argv = ["--recipe", "from-scratch", "--grid", "lr=1e-3", "--runs-root", "runs",
            "--sweep-id", "here", "--no-progress", "--no-report", *TINY]
    assert sweep_main(argv) == 0, capsys.readouterr().err
    rows = _csv(tmp_path / "runs" / "here" / "summary.csv")
    assert [r["status"] for r in rows] == ["completed"]


def test_a_run_a_full_disk_failed_is_resumed_from_its_checkpoint(tmp_path, capsys,
                                                                   monkeypatch):
    """A run the disk filled under (ENOSPC at its 3rd checkpoint) is failed; the sweep says its
    checkpoints are intact, and the same command once there is room resumes it from step 4
    (before: retried from step 0 with --overwrite, its checkpoints deleted: a full disk cost
    every run it stopped all of its steps)."""
    from toymlx_cli.train import main as train_main

    import toymlx.bundle.checkpoint as ck

    calls, save = {"n": 0}, ck.save_state

    def full(path, arrays, meta):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return save(path, arrays, meta)

    args = [*TINY, "--checkpoint-every", "2"]
    monkeypatch.setattr(ck, "save_state", full)
    run = tmp_path / "s" / "lr=0.001"
    assert train_main(["--recipe", "from-scratch", "--runs-root", str(tmp_path / "s"),
                       "--run-id", run.name, *args, "--lr", "0.001"]) == 1
    monkeypatch.undo()
    assert [ev["reason"] for ev in read_events(run) if ev["kind"] == "run_end"] == ["error"]
    capsys.readouterr()
    argv = ["--recipe", "from-scratch", "--grid", "lr=1e-3", "--runs-root", str(tmp_path),
            "--sweep-id", "s", "--no-progress", "--no-report", *args]
    assert sweep_main([*argv, "--no-retry-failed"]) == 1
    assert (f"sweep: {run.name}: its checkpoints are intact: free space (or make the folder "
            "writable) and run the command again without --no-retry-failed; it resumes from "
            "them\n") in capsys.readouterr().err
    assert sweep_main(argv) == 0
    assert "resume: toymlx-train --resume" in (tmp_path / "s" / "logs" / f"{run.name}.log"
                                               ).read_text()
    events = read_events(run)
    assert [ev["from_step"] for ev in events if ev["kind"] == "resume"] == [4]
    assert [ev["step"] for ev in events if ev["kind"] == "step"] == list(range(1, 11))


KILLER = """#!{python}
# the sweep's python: runs its toymlx-train child, and kills it and itself (kill -9, as the
# out-of-memory killer does) once the run has written its second checkpoint
import os, signal, subprocess, sys, time
from pathlib import Path
args = sys.argv[1:]
run = Path(args[args.index("--runs-root") + 1]) / args[args.index("--run-id") + 1]
child = subprocess.Popen([{python!r}, *args])
while child.poll() is None:
    events = run / "events.jsonl"
    if events.is_file() and events.read_text().count('"kind": "checkpoint"') >= 2:
        child.kill()
        child.wait()
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.02)
sys.exit(child.returncode)
"""


NOTER = """#!{python}
# the sweep's python: says a note as a run's toymlx-train says one, then is that toymlx-train
import os, sys
sys.stderr.write("toymlx-train: a note the sweep said before\\n")
sys.stderr.flush()
os.execv({python!r}, [{python!r}, *sys.argv[1:]])
"""


def test_a_run_s_note_the_sweep_said_before_is_not_said_again(tmp_path, capsys):
    """`toymlx-sweep -c mlx_lm_lora.yaml` said "key 'adapter_path': not used" before its runs,
    then again as "sweep: note 1" from the first run: run_sweep's `said` (the notes said
    before) was replaced by its table of run states before it reached the runs' notes."""
    noter = tmp_path / "noter"
    noter.write_text(NOTER.format(python=sys.executable))
    noter.chmod(0o755)
    specs = sweep.grid([*TINY, "--steps", "2"], {"lr": [1e-3]}, recipe="from-scratch")
    result = sweep.run_sweep("from-scratch", specs, tmp_path, sweep_id="n", progress=False,
                             report_png=False, python=str(noter),
                             said=["a note the sweep said before"])
    assert result.states == {"lr=0.001": "done"}
    assert "a note the sweep said before" in (tmp_path / "n" / "logs" / "lr=0.001.log"
                                              ).read_text()
    said = [x for x in capsys.readouterr().err.splitlines() if x.startswith("sweep: note")]
    assert not any("a note the sweep said before" in x for x in said), said


def test_a_killed_run_is_said_to_resume_from_its_checkpoints_and_does(tmp_path, capsys):
    """A run killed mid-way (kill -9, the out-of-memory killer): the sweep said "FAILED ...
    killed by SIGKILL" and the table "torn" (now both say torn), and nothing said that the same
    command resumes it from its checkpoints, not from step 0 (the full disk's line said so of
    its runs alone), nor, running it again, that it does."""
    killer = tmp_path / "killer"
    killer.write_text(KILLER.format(python=sys.executable))
    killer.chmod(0o755)
    specs = sweep.grid([*TINY, "--steps", "60", "--checkpoint-every", "2"], {"lr": [1e-3]},
                       recipe="from-scratch")
    run = tmp_path / "s" / "lr=0.001"
    result = sweep.run_sweep("from-scratch", specs, tmp_path, sweep_id="s", progress=False,
                             report_png=False, python=str(killer))
    assert result.states == {"lr=0.001": "failed"}
    saved = [ev["step"] for ev in read_events(run) if ev["kind"] == "checkpoint"]
    assert len(saved) >= 2 and saved[-1] < 60
    err = capsys.readouterr().err
    assert "sweep: TORN lr=0.001: killed by SIGKILL" in err and "FAILED" not in err
    assert _csv(tmp_path / "s" / "summary.csv")[0]["status"] == "torn"
    assert err.endswith("sweep: lr=0.001: its checkpoints are intact: run the same command "
                        "again; it resumes from them\n")
    result = sweep.run_sweep("from-scratch", specs, tmp_path, sweep_id="s", progress=False,
                             report_png=False, retry_failed=False)
    assert result.states == {"lr=0.001": "failed"}
    err = capsys.readouterr().err
    # the first line says what the sweep does with it (with --no-progress, nothing else did)
    first = f"sweep {tmp_path / 's'}: 1 run, 1 on this shard (0/1), 1 worker; 1 "
    assert err.splitlines()[0] == first + "failed before, reported (--no-retry-failed)"
    assert err.endswith("sweep: lr=0.001: its checkpoints are intact: run the command again "
                        "without --no-retry-failed; it resumes from them\n")
    result = sweep.run_sweep("from-scratch", specs, tmp_path, sweep_id="s", progress=False,
                             report_png=False)
    assert result.states == {"lr=0.001": "done"}
    assert capsys.readouterr().err.splitlines()[0] == first + "to resume from their checkpoints"
    assert [ev["from_step"] for ev in read_events(run) if ev["kind"] == "resume"] == [saved[-1]]


def test_a_run_s_record_a_full_disk_refuses_does_not_end_the_sweep(tmp_path, capsys,
                                                                     monkeypatch):
    """The sweep's record of how a run ended (.status/RUN.json) cannot be written (a full
    disk): one line names it, and the sweep goes on to its other runs and its summary (before:
    toymlx-sweep ended there, exit 2, the other runs killed and no summary written)."""
    from toymlx.sweeps import supervisor

    write = supervisor.atomic.write_text

    def full(path, text):
        if ".status" in str(path) and "lr=0.001" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return write(path, text)

    monkeypatch.setattr(supervisor.atomic, "write_text", full)
    argv = ["--recipe", "from-scratch", "--grid", "lr=1e-3,2e-3", "--runs-root", str(tmp_path),
            "--sweep-id", "s", "--no-progress", "--no-report", *TINY]
    assert sweep_main(argv) == 0
    err = capsys.readouterr().err
    status = tmp_path / "s" / ".status" / "lr=0.001.json"
    assert (f"sweep: lr=0.001: could not record how it ended ([Errno 28] No space left on "
            f"device: '{status}')\n") in err
    assert [r["status"] for r in _csv(tmp_path / "s" / "summary.csv")] == ["completed"] * 2


def test_a_run_log_a_full_disk_refuses_is_named(tmp_path, capsys, monkeypatch):
    """A run's log cannot be written (a full disk): the sweep's error names the log (before:
    "[Errno 28] No space left on device", no file)."""
    from toymlx.sweeps import supervisor

    class Full:
        def __init__(self, f):
            self.f = f

        def write(self, b):
            return len(b)

        def flush(self):
            raise OSError(errno.ENOSPC, "No space left on device")

        def __getattr__(self, name):
            return getattr(self.f, name)

    monkeypatch.setattr(supervisor, "open", lambda path, mode: Full(open(path, mode)),  # noqa: SIM115
                        raising=False)
    argv = ["--recipe", "from-scratch", "--grid", "lr=1e-3", "--runs-root", str(tmp_path),
            "--sweep-id", "s", "--no-progress", "--no-report", *TINY]
    assert sweep_main(argv) == 2
    log = tmp_path / "s" / "logs" / "lr=0.001.log"
    assert capsys.readouterr().err.endswith(
        f"toymlx-sweep: error: [Errno 28] No space left on device: '{log}'\n")


def test_a_full_disk_at_the_summary_names_the_file_and_still_reports_the_runs(
        tmp_path, capsys, monkeypatch):
    """The disk fills as report.png is drawn (measured: a sweep on a 180 KiB tmpfs whose
    second run failed at its checkpoint): the sweep ended on "toymlx-sweep: error: [Errno 28]
    ... report.png", exit 2, without its FAILED lines. Now one line names report.png, the
    rest of the summary is written and reported, exit 1, and the same command writes it."""
    from toymlx.runner import report

    def full(rows, out, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", str(out))

    monkeypatch.setattr(report, "render", full)
    argv = ["--recipe", "from-scratch", "--grid", "data.val_fraction=0.1,0.999999",
            "--runs-root", str(tmp_path), "--sweep-id", "full", "--no-progress", *TINY]
    assert sweep_main(argv) == 1
    err = capsys.readouterr().err
    png = tmp_path / "full" / "report.png"
    assert (f"sweep: error: could not write report.png ([Errno 28] No space left on device: "
            f"'{png}'); the runs are as the table says: free space and run the same command "
            "again to write it (completed runs are skipped)\n") in err
    assert "FAILED data.val_fraction=0.999999: toymlx-train: error:" in err
    assert f"sweep: summary in {tmp_path / 'full' / 'summary.csv'}" in err
    assert [r["status"] for r in _csv(tmp_path / "full" / "summary.csv")] == ["completed",
                                                                              "failed"]
    assert not png.exists()
    monkeypatch.undo()
    assert sweep_main([*argv, "--no-retry-failed"]) == 1  # the failed run, reported again
    assert png.stat().st_size > 0 and "could not write" not in capsys.readouterr().err


@pytest.mark.parametrize("how,want", [
    (["--grid", "lr=1e-3,-1"], "run lr=-1: --lr: expected > 0, found -1.0"),
    (["--grid", "lr=1e-3,inf"], "run lr=inf: --lr: expected a finite number, found inf"),
    (["-c", "{file}"], "run warmup=-1: --warmup: expected >= 0, found -1"),
])
def test_a_bad_grid_value_fails_before_any_run_starts(tmp_path, capsys, how, want):
    """Each run that had a bad value used to start and fail on its own, the others running."""
    from cli_errors import error_line

    cfg = tmp_path / "sweep.yaml"
    cfg.write_text("recipe: from-scratch\ngrid: {warmup: [1, -1]}\n")
    argv = ["--recipe", "from-scratch", *[a.format(file=cfg) for a in how], "--runs-root",
            str(tmp_path / "runs"), "--no-progress", "--no-report", *TINY]
    assert sweep_main(argv) == 2
    assert error_line(capsys, "toymlx-sweep") == (f"toymlx-sweep: error: {want}; no run was "
                                                  "started")
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("grids", [["lr=1e-3", "lr=3e-3"],
                                   ["model.ffn_dim=32", "model.ffn-dim=64"]])
def test_one_key_in_two_grid_flags_is_refused(tmp_path, capsys, grids):
    """The second --grid of a key replaced the first: `--grid lr=1e-3 --grid lr=3e-3` ran
    lr=0.003 alone, the lr=0.001 run never made and nothing said."""
    from cli_errors import error_line

    argv = ["--recipe", "from-scratch", "--grid", grids[0], "--grid", grids[1], "--runs-root",
            str(tmp_path / "runs"), "--no-progress", "--no-report", *TINY]
    assert sweep_main(argv) == 2
    key = grids[1].partition("=")[0]
    assert error_line(capsys, "toymlx-sweep") == (
        f"toymlx-sweep: error: --grid {grids[1]}: expected each option in one --grid, found it "
        f"also in --grid {grids[0]}; give its values together (--grid {key}=V1,V2)")
    assert not (tmp_path / "runs").exists()


def test_a_changed_sweep_under_the_same_id_is_refused_naming_the_changed_keys(tmp_path, capsys):
    """Re-running `toymlx-sweep -c FILE` after editing it reported the old runs as completed
    and rewrote run-options.json; a new --sweep-id runs the edited sweep."""
    from cli_errors import error_line

    cfg = tmp_path / "sweep.yaml"
    text = (f"recipe: from-scratch\nsweep_id: s\nruns_root: {tmp_path}\nno_progress: true\n"
            "no_report: true\ngrid: {lr: [1e-3]}\nsteps: 2\nmodel: {d_model: 32, n_layers: 1}\n"
            "seq_len: 32\nbatch_size: 4\neval_batches: 1\ncompile: false\n")
    cfg.write_text(text)
    assert sweep_main(["-c", str(cfg)]) == 0
    root = tmp_path / "s"
    kept = {p: p.read_bytes() for p in (root / "sweep.json", root / "run-options.json",
                                        root / "lr=0.001" / "config.json")}
    cfg.write_text(text.replace("steps: 2", "steps: 3").replace("n_layers: 1", "n_layers: 2"))
    capsys.readouterr()
    assert sweep_main(["-c", str(cfg)]) == 2
    assert error_line(capsys, "toymlx-sweep") == (
        f"toymlx-sweep: error: {root}: --sweep-id s: expected the options this sweep was "
        "started with, found model.n_layers (2 now, 1 when the sweep started), steps (3 now, 2 "
        "when the sweep started) changed; give a new --sweep-id to run the changed sweep, or put "
        "them back")
    assert {p: p.read_bytes() for p in kept} == kept
    # a flag that changes every run's options, under the same id
    assert sweep_main(["-c", str(cfg), "--sweep-id", "s", "--", "--warmup", "1"]) == 2
    assert ("found model.n_layers (2 now, 1 when the sweep started), steps (3 now, 2 when the "
            "sweep started), --warmup (1 now, not given when the sweep started) changed"
            ) in error_line(capsys, "toymlx-sweep")
    # more values in the grid add runs; the runs already there are the same
    cfg.write_text(text.replace("[1e-3]", "[1e-3, 2e-3]"))
    assert sweep_main(["-c", str(cfg)]) == 0
    assert json.loads((root / "lr=0.002" / "config.json").read_text())["config"]["steps"] == 2
    # a new id runs the edited sweep
    cfg.write_text(text.replace("steps: 2", "steps: 3"))
    assert sweep_main(["-c", str(cfg), "--sweep-id", "s3"]) == 0
    saved = json.loads((tmp_path / "s3" / "lr=0.001" / "config.json").read_text())
    assert saved["config"]["steps"] == 3
    assert {p: p.read_bytes() for p in kept if p.name != "sweep.json"} == {
        p: v for p, v in kept.items() if p.name != "sweep.json"}


def test_another_grid_under_the_same_id_is_refused_naming_both_grids(tmp_path, capsys):
    """`--grid lr=...` then `--grid model.ffn_dim=...` under one --sweep-id: the new grid's
    runs, named by another key, matched none recorded, so nothing was "changed"; they ran into
    the same folder, and the table, summary and report mixed the two grids. Now refused as
    changed options are, naming the folder, both grids' keys and the fix; more values of the
    same keys still add runs."""
    from cli_errors import error_line

    flags = ["--recipe", "from-scratch", "--runs-root", str(tmp_path), "--sweep-id", "s",
             "--no-progress", "--no-report", *TINY, "--steps", "2"]
    assert sweep_main(["--grid", "lr=1e-3", *flags]) == 0
    root = tmp_path / "s"
    record = (root / "sweep.json").read_bytes()
    fix = "give a new --sweep-id to run the changed sweep, or put them back"
    for grids, keys in (
            (["--grid", "model.ffn_dim=32"], "model.ffn_dim now, lr when the sweep started"),
            (["--grid", "lr=1e-3", "--grid", "model.ffn_dim=32"],
             "lr x model.ffn_dim now, lr when the sweep started")):
        capsys.readouterr()
        assert sweep_main([*grids, *flags]) == 2
        assert error_line(capsys, "toymlx-sweep") == (
            f"toymlx-sweep: error: {root}: --sweep-id s: expected the options this sweep was "
            f"started with, found the grid's keys ({keys}) changed; {fix}")
    assert (root / "sweep.json").read_bytes() == record
    assert sorted(p.name for p in root.iterdir() if (p / "config.json").is_file()) == [
        "lr=0.001"]
    # the same keys in another order name the same runs otherwise: each would run twice
    assert sweep_main(["--grid", "lr=1e-3", "--grid", "model.ffn_dim=32", *flags,
                       "--sweep-id", "t"]) == 0
    capsys.readouterr()
    assert sweep_main(["--grid", "model.ffn_dim=32", "--grid", "lr=1e-3", *flags,
                       "--sweep-id", "t"]) == 2
    assert error_line(capsys, "toymlx-sweep") == (
        f"toymlx-sweep: error: {tmp_path / 't'}: --sweep-id t: expected the options this sweep "
        "was started with, found the grid's keys (model.ffn_dim x lr now, lr x model.ffn_dim "
        f"when the sweep started: runs are named by the keys in order) changed; {fix}")
    # more values of the same key add a run to the same sweep
    assert sweep_main(["--grid", "lr=1e-3,3e-3", *flags]) == 0
    assert [r["name"] for r in _sweep_json(root)["runs"]] == ["lr=0.001", "lr=0.003"]


def test_a_folder_of_two_grids_mixed_by_an_earlier_toymlx_is_refused_naming_each(tmp_path,
                                                                                capsys):
    """An earlier toymlx ran another grid's runs into a sweep folder (`--grid lr=...`, then
    `--grid model.ffn_dim=...` under one --sweep-id; its sweep.json merged both). Since that is
    refused, either grid run again there went on all the same, the two still in one table and
    report. Now either is refused, naming each grid's runs and what to do; nothing written."""
    from cli_errors import error_line

    from toymlx.sweeps.spec import write_sweep_file

    root = tmp_path / "s"
    root.mkdir()
    # what the old toymlx wrote: each start's runs merged into the record
    write_sweep_file(root, "from-scratch", sweep.grid(
        TINY, {"lr": [1e-3, 3e-3, 1e-2, 3e-2, 0.1]}, recipe="from-scratch"))
    write_sweep_file(root, "from-scratch", sweep.grid(
        TINY, {"model.ffn_dim": [32]}, recipe="from-scratch"))
    record = (root / "sweep.json").read_bytes()
    flags = ["--recipe", "from-scratch", "--runs-root", str(tmp_path), "--sweep-id", "s",
             "--no-progress", "--no-report", *TINY]
    for grid in ("lr=1e-3,3e-3", "model.ffn_dim=32", "seed=1,2"):
        capsys.readouterr()
        assert sweep_main(["--grid", grid, *flags]) == 2
        assert error_line(capsys, "toymlx-sweep") == (
            f"toymlx-sweep: error: {root / 'sweep.json'}: expected the runs of one grid, found "
            "2 grids' runs mixed in one sweep folder by an earlier toymlx (lr: lr=0.001, "
            "lr=0.003, lr=0.01, lr=0.03, and 1 more; model.ffn_dim: model.ffn_dim=32); give a "
            "new --sweep-id to run a grid in a folder of its own (the runs here stay as they "
            f"are: toymlx-report {root} shows them)")
    assert (root / "sweep.json").read_bytes() == record
    assert sorted(p.name for p in root.iterdir()) == [".locks", "sweep.json"]  # no run started


def _live_states(stream) -> list[str]:
    """The state column of each run's live line (not a terminal: `sweep: RUN  STATE  step`)."""
    return re.findall(r"^sweep: \S+  (.+?)  step ", stream.getvalue(), re.MULTILINE)


def test_torn_run_is_resumed_from_its_checkpoint(tmp_path):
    import io

    specs = sweep.grid([*TINY, "--checkpoint-every", "5", "--stop-at", "5"], {"lr": [2e-3]})
    live = io.StringIO()
    first = sweep.run_sweep("from-scratch", specs, tmp_path, sweep_id="t", stream=live,
                            report_png=False)
    assert first.states == {"lr=0.002": "stopped"}
    # how the run was started only until its first step ("running (start)" was shown the
    # whole run, "step 40/40" too); after its run_end, what the child is doing: exiting
    states = _live_states(live)
    assert states[0] == "running (starting)" and states[-1] == "stopped", states
    assert set(states[1:-1]) <= {"running", "running (stopped, exiting)"}, states
    run = tmp_path / "t" / "lr=0.002"
    lines = (run / "events.jsonl").read_bytes().splitlines(keepends=True)
    assert json.loads(lines[-1])["kind"] == "run_end"
    (run / "events.jsonl").write_bytes(b"".join(lines[:-1]) + lines[-1][:20])  # torn, no end
    live = io.StringIO()
    second = sweep.run_sweep("from-scratch", specs, tmp_path, sweep_id="t", stream=live,
                             report_png=False)
    assert second.states == {"lr=0.002": "done"}
    states = _live_states(live)
    assert states[0] == "running (resuming)" and states[-1] == "done", states
    assert set(states[1:-1]) <= {"running", "running (completed, exiting)"}, states
    events = read_events(run)
    assert [e["kind"] for e in events].count("run_start") == 1
    assert [e["from_step"] for e in events if e["kind"] == "resume"] == [5]
    assert [e["step"] for e in events if e["kind"] == "step"] == list(range(1, 11))
    assert events[-1]["reason"] == "completed"
    assert "resume: toymlx-train --resume" in (tmp_path / "t" / "logs" / "lr=0.002.log").read_text()


# slow: its per-run lock is tested in the default tier by a live holder the sweep leaves alone
# (test_a_run_another_process_owns_is_waited_for_then_left_alone) and a second acquire refused
# (test_lock_is_owned_by_a_live_process_and_dies_with_it); here, two real sweeps race for it
@pytest.mark.slow
def test_two_machines_over_one_folder_run_each_run_once(tmp_path):
    """Two sweep processes over one runs folder, both told they own every run (shard 0/1):
    each run happens exactly once. The second to take the shard's lock while the first holds
    it is refused before it writes anything (exit 2, naming the first); one that comes after
    the first has ended finds every run done (exit 0)."""
    cmd = [sys.executable, "-m", "toymlx_cli.sweep", "--recipe", "from-scratch", "--grid",
           "lr=1e-3,2e-3,3e-3", "--runs-root", str(tmp_path), "--sweep-id", "two",
           "--no-progress", "--no-report", *TINY, "--steps", "4"]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    codes = [p.returncode for p in procs]
    assert sorted(codes) in ([0, 0], [0, 2]), outs
    for code, (_, err) in zip(codes, outs):
        if code == 2:
            assert "the sweep: in use by process" in err, err
    for lr in ("0.001", "0.002", "0.003"):
        events = read_events(tmp_path / "two" / f"lr={lr}")
        assert [e["kind"] for e in events].count("run_start") == 1
        assert events[-1]["reason"] == "completed"
    assert not list((tmp_path / "two" / ".locks").iterdir())  # every lock released


def test_a_closed_console_stops_the_sweep_as_ctrl_c_does_and_keeps_its_summary(tmp_path):
    """`toymlx-sweep ... 2>&1 | head -3`: the sweep once went on to its last run after head
    had ended (the shell waits for it: a prompt that hangs for the whole sweep), while
    `toymlx-train ... | head -3` stops. Now the reader gone is a stop request as in a run: the
    run in flight checkpoints and ends, the summary is written, the exit status is 141
    (128 + SIGPIPE), as after Ctrl-C."""
    cmd = [sys.executable, "-m", "toymlx_cli.sweep", "--recipe", "from-scratch", "--grid",
           "lr=1e-3,2e-3", "--runs-root", str(tmp_path), "--sweep-id", "closed",
           "--no-progress", *TINY, "--steps", "100000", "--eval-every", "0",
           "--checkpoint-every", "0"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    root = tmp_path / "closed"
    t0 = time.monotonic()
    events = root / "lr=0.001" / "events.jsonl"
    try:
        while '"kind": "step"' not in (events.read_text() if events.exists() else ""):
            assert p.poll() is None and time.monotonic() - t0 < 120  # until a step is trained
            time.sleep(0.2)
        p.stdout.close()
        assert p.wait(timeout=120) == 128 + signal.SIGPIPE
    finally:  # a sweep that does not stop would train for hours: its runs stop with it
        end_child(p)
    states = {r["run"]: r["status"] for r in _csv(root / "summary.csv")}
    assert states["lr=0.001"] == "interrupted", states
    events = read_events(root / "lr=0.001")
    assert events[-1]["kind"] == "run_end" and events[-1]["reason"] == "interrupted"
    assert events[-1]["final_step"] < 100000
    assert (root / "lr=0.001" / "weights" / f"step_{events[-1]['final_step']}.gguf").is_file()
    assert not (root / "lr=0.002").exists()  # never started: the sweep stopped first


def _descendants(pid: int) -> list[int]:
    """Every live process under `pid` (pgrep -P, on Linux and macOS alike)."""
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True,
                         check=False).stdout.split()
    kids = [int(x) for x in out]
    return kids + [d for k in kids for d in _descendants(k)]


def _running(pid: int) -> bool:
    """Alive and not a zombie (a container's pid 1 may never reap an orphan)."""
    out = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True,
                         check=False).stdout.strip()
    return bool(out) and not out.startswith("Z")


def test_a_killed_sweep_leaves_no_children_and_its_rerun_gives_clean_bundles(tmp_path):
    """Issue 17 case 1: `kill -9` of a sweep once left its runs training with parent 1, and the
    re-run resumed them a second time (two run_starts, 190 steps for 150). Now the children
    stop (checkpoint, run_end) when the sweep dies, and the re-run gives each bundle one
    run_start, each step once and one run_end."""
    cmd = [sys.executable, "-m", "toymlx_cli.sweep", "--recipe", "from-scratch", "--grid",
           "lr=1e-3,3e-3", "--grid", "seed=1", "--workers", "2", "--runs-root",
           str(tmp_path), "--sweep-id", "k", "--no-progress", "--no-report", *TINY,
           "--steps", "100", "--checkpoint-every", "10", "--eval-every", "50"]
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    root = tmp_path / "k"
    t0 = time.monotonic()
    while len(list(root.glob("*/weights/step_10.gguf"))) < 2:
        assert p.poll() is None, p.stderr.read()[-3000:]
        assert time.monotonic() - t0 < 120
        time.sleep(0.05)
    children = _descendants(p.pid)
    assert len(children) == 2
    p.kill()
    p.wait()
    t0 = time.monotonic()
    while any(_running(c) for c in children):
        assert time.monotonic() - t0 < 60, "a run outlived its killed sweep"
        time.sleep(0.1)
    stopped = [d for d in root.iterdir() if (d / "events.jsonl").exists()]
    assert len(stopped) == 2
    for d in stopped:  # each saw its sweep die, finished its step and checkpointed
        end = read_events(d)[-1]
        assert end["kind"] == "run_end" and end["reason"] == "interrupted", end
        assert f"step_{end['final_step']}.gguf" == os.readlink(d / "weights" / "latest"), (
            read_events(d)[-4:], sorted(x.name for x in (d / "weights").iterdir()))
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert again.returncode == 0, again.stderr[-3000:]
    for d in sorted(p for p in root.iterdir() if (p / "config.json").exists()):
        ev = read_events(d)
        kinds = [e["kind"] for e in ev]
        assert kinds.count("run_start") == 1 and kinds[0] == "run_start", d
        assert kinds.count("run_end") == 1 and ev[-1]["reason"] == "completed", d
        assert [e["step"] for e in ev if e["kind"] == "step"] == list(range(1, 101)), d
        assert kinds.count("resume") == (1 if d in stopped else 0), d
    rows = {r["run"]: r for r in _csv(root / "summary.csv")}
    assert len(rows) == 2 and {r["status"] for r in rows.values()} == {"completed"}
    assert {int(r["step"]) for r in rows.values()} == {100}


# SIGTERM in the slow tier: the sweep counts it by the same StopSignals as SIGHUP (its count and
# 143 are tested in test_distributed), so the SIGHUP case runs this path in the default tier
@pytest.mark.parametrize("sig", [signal.SIGHUP,
                                 pytest.param(signal.SIGTERM, marks=pytest.mark.slow)])
def test_a_closed_terminal_or_kill_stops_the_sweep_with_its_summary(tmp_path, sig):
    """SIGHUP (a closed terminal or ssh session) killed the sweep at once: no summary, its
    runs stopped only by their lifeline. Now SIGHUP and SIGTERM stop it as Ctrl-C does (each
    run checkpoints, the summary is written) and its exit code is 128 + the signal's number."""
    cmd = [sys.executable, "-m", "toymlx_cli.sweep", "--recipe", "from-scratch", "--grid",
           "lr=1e-3,3e-3", "--workers", "2", "--runs-root", str(tmp_path), "--sweep-id", "h",
           "--no-progress", "--no-report", *TINY, "--steps", "100000", "--checkpoint-every",
           "10", "--eval-every", "0"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    root = tmp_path / "h"
    t0 = time.monotonic()
    while len(list(root.glob("*/weights/step_10.gguf"))) < 2:
        assert p.poll() is None, p.stderr.read()[-3000:]
        assert time.monotonic() - t0 < 120
        time.sleep(0.05)
    p.send_signal(sig)
    _, err = p.communicate(timeout=180)
    assert p.returncode == 128 + sig, err[-3000:]
    assert "sweep: interrupted; run the same command again to resume" in err
    rows = _csv(root / "summary.csv")
    assert len(rows) == 2 and {r["status"] for r in rows} == {"interrupted"}, rows
    for d in (x for x in root.iterdir() if (x / "events.jsonl").exists()):
        end = read_events(d)[-1]
        assert end["kind"] == "run_end" and end["reason"] == "interrupted", end
        assert f"step_{end['final_step']}.gguf" == os.readlink(d / "weights" / "latest")


def test_a_run_another_process_owns_is_waited_for_then_left_alone(tmp_path, capsys):
    """The sweep never touches a bundle some live process still owns (here: holds its lock).
    It waits up to `busy_wait` seconds for the owner, as for a killed sweep's child writing
    its last checkpoint, then leaves the run to it, saying so and calling its best "so far"
    (it called its one completed run the best, exit 0, while the other sweep's still
    trained); an owner that ends in time is followed."""
    specs = sweep.grid([*TINY, "--steps", "4"], {"lr": [2e-3], "seed": [1, 2]})
    run = tmp_path / "o" / "lr=0.002_seed=1"
    run.mkdir(parents=True)
    started = '{"recipe": "from-scratch", "config": {}}'  # a run killed before its first step
    (run / "config.json").write_text(started)
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run / ".lock")],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        t0 = time.monotonic()
        result = sweep.run_sweep("from-scratch", specs, tmp_path, sweep_id="o", progress=False,
                                 report_png=False, busy_wait=1.0)
        assert result.states == {"lr=0.002_seed=1": "elsewhere", "lr=0.002_seed=2": "done"}
        assert time.monotonic() - t0 >= 1.0
        assert (run / "config.json").read_text() == started  # untouched
        err = capsys.readouterr().err
        assert re.search(r"^sweep: best so far lr=0\.002_seed=2: val_loss [0-9.]+ at step 4 "
                         r"\(lowest of 1 completed run; 1 run still running elsewhere\)$", err,
                         re.MULTILINE), err
        assert err.endswith("sweep: 1 run still running elsewhere, so this summary is partial: "
                            f"the other process's end, or toymlx-report {tmp_path / 'o'} once "
                            "they end, gives the whole sweep\n")
        threading.Timer(0.5, holder.kill).start()  # the owner ends while the sweep waits
        result = sweep.run_sweep("from-scratch", specs, tmp_path, sweep_id="o", progress=False,
                                 report_png=False, busy_wait=60.0)
        assert result.states == {"lr=0.002_seed=1": "done", "lr=0.002_seed=2": "skipped"}
    finally:
        end_child(holder)


# ---------------------------------------------------------------- a sweep in one file

def _sweep_json(root: Path) -> dict:
    return json.loads((root / "sweep.json").read_text())


def test_two_sweeps_of_one_id_with_other_options_started_at_once_one_is_refused(
        tmp_path, monkeypatch):
    """Two sweeps of one --sweep-id with other options, started at the same instant, both
    passed the "options changed" check before either wrote sweep.json, and both ran. The
    check and the write are now under one lock: here the test is the first sweep, between its
    check and its write (holding that lock); the second waits for it, then is refused with
    the one-line message, and the first one's record stands."""
    from toymlx.sweeps import supervisor
    from toymlx.sweeps.spec import write_sweep_file

    first = sweep.grid([*TINY, "--steps", "3"], {"lr": [1e-3]}, recipe="from-scratch")
    second = sweep.grid([*TINY, "--steps", "2"], {"lr": [1e-3]}, recipe="from-scratch")
    root, made = tmp_path / "s", tmp_path / "first"
    (root / ".locks").mkdir(parents=True)
    made.mkdir()
    write_sweep_file(made, "from-scratch", first)  # what the first sweep writes
    # the second sweep at the lock, or (no lock) past its check: then the first one writes
    reached = threading.Event()
    real_acquire, real_changed = supervisor.acquire, supervisor.changed_options

    def acquire(path, *args, **kw):
        if Path(path) == root / ".locks" / "sweep.json.lock":
            reached.set()
        return real_acquire(path, *args, **kw)

    def changed_options(*args, **kw):
        out = real_changed(*args, **kw)
        reached.set()
        return out

    monkeypatch.setattr(supervisor, "acquire", acquire)
    monkeypatch.setattr(supervisor, "changed_options", changed_options)
    outcome: list = []

    def second_sweep():
        try:
            outcome.append(sweep.run_sweep("from-scratch", second, tmp_path, sweep_id="s",
                                           progress=False, report_png=False))
        except ValueError as e:
            outcome.append(e)

    with real_acquire(root / ".locks" / "sweep.json.lock", "the first sweep"):
        thread = threading.Thread(target=second_sweep)
        thread.start()
        assert reached.wait(120), "the second sweep never reached the check"
        shutil.copyfile(made / "sweep.json", root / "sweep.json")
    thread.join(300)
    assert [str(x) for x in outcome] == [
        (f"{root}: --sweep-id s: expected the options this sweep was started with, found "
         "--steps (2 now, 3 when the sweep started) changed; give a new --sweep-id to run the "
         "changed sweep, or put them back")]
    assert (root / "sweep.json").read_bytes() == (made / "sweep.json").read_bytes()
    assert not (root / "lr=0.001").exists()


def test_sweep_from_a_file_runs_the_runs_of_the_same_flags(tmp_path, capsys):
    """The whole sweep in one -c file: the same run names, configurations and losses as the
    same sweep from flags; flags given (a --grid key, a run option) override the file."""
    cfg = tmp_path / "sweep.yaml"
    cfg.write_text(f"""recipe: from-scratch
grid: {{lr: [0.5], model.ffn_dim: [32, 64]}}
sweep-id: file
runs_root: {tmp_path}
workers: 2
no_progress: true
no_report: true
seed: 3            # the runs' training seed, as in toymlx-train -c
steps: 5
model: {{d_model: 32, n_layers: 1}}
seq_len: 32
batch_size: 4
eval_every: 5
eval_batches: 2
compile: false
""")
    # --grid lr replaces the file's lr values only; --steps overrides the file's steps
    assert sweep_main(["-c", str(cfg), "--grid", "lr=1e-3", "--steps", "3"]) == 0
    assert sweep_main(["--recipe", "from-scratch", "--grid", "lr=1e-3", "--grid",
                       "model.ffn_dim=32,64", "--workers", "2", "--runs-root", str(tmp_path),
                       "--sweep-id", "flags", "--no-progress", "--no-report", *TINY,
                       "--steps", "3", "--eval-every", "5", "--seed", "3"]) == 2
    assert "--seed: expected with --random N" in capsys.readouterr().err  # the sweep's --seed
    assert sweep_main(["--recipe", "from-scratch", "--grid", "lr=1e-3", "--grid",
                       "model.ffn_dim=32,64", "--workers", "2", "--runs-root", str(tmp_path),
                       "--sweep-id", "flags", "--no-progress", "--no-report", *TINY,
                       "--steps", "3", "--eval-every", "5", "--", "--seed", "3"]) == 0
    names = ["lr=0.001_model.ffn_dim=32", "lr=0.001_model.ffn_dim=64"]
    for sid in ("file", "flags"):
        assert [r["name"] for r in _sweep_json(tmp_path / sid)["runs"]] == names
    assert _sweep_json(tmp_path / "file")["run_options"]["steps"] == 5
    for name in names:
        a, b = (json.loads((tmp_path / sid / name / "config.json").read_text())
                for sid in ("file", "flags"))
        for c in (a["config"], b["config"]):
            assert c.pop("runs_root").endswith(("/file", "/flags"))
            assert c.pop("run_id") == name
        assert a == b
        assert (a["config"]["steps"], a["config"]["seed"], a["config"]["lr"]) == (3, 3, 1e-3)
        losses = [[e["loss"] for e in read_events(tmp_path / sid / name) if e["kind"] == "step"]
                  for sid in ("file", "flags")]
        assert losses[0] == losses[1] and len(losses[0]) == 3


@pytest.mark.parametrize("sig, line, code", [
    (signal.SIGINT, "interrupted", 130), (signal.SIGTERM, "stopped by SIGTERM", 143)])
def test_a_stop_while_the_runs_are_checked_is_one_line(tmp_path, capsys, monkeypatch, sig,
                                                          line, code):
    """Ctrl-C (or a kill) while the sweep checks its runs (a lora run's examples read:
    seconds) ended in a KeyboardInterrupt traceback, or for a kill, with no line at all; now
    one line, the signal's exit status, and no sweep folder."""
    import toymlx_cli.sweep as cli

    from toymlx.backend.stop import SIGNALS

    def check_runs(*args, **kw):
        os.kill(os.getpid(), sig)  # the signal comes while the runs are checked
        time.sleep(5)  # not reached: the handler raises at once
        raise AssertionError("the stop was not raised")

    def unhandled(signum, frame):  # the sweep's own handler not in place: fail, not die
        raise AssertionError(f"{signal.Signals(signum).name} reached no handler of the sweep")

    monkeypatch.setattr(cli, "_check_runs", check_runs)
    before = {s: signal.getsignal(s) for s in SIGNALS}
    try:
        signal.signal(sig, unhandled)
        assert sweep_main(["--recipe", "from-scratch", "--grid", "lr=1e-3", "--runs-root",
                           str(tmp_path / "runs"), "--no-progress", *TINY]) == code
    finally:
        for s, h in before.items():  # a stop leaves them ignored until the process exits
            signal.signal(s, h)
    assert capsys.readouterr().err == (f"toymlx-sweep: {line} before any run started; nothing "
                                       "was run\n")
    assert not (tmp_path / "runs").exists()


def test_an_empty_sweep_id_is_refused_not_replaced_by_the_hashed_one(tmp_path, capsys):
    """`--sweep-id ""` (`--sweep-id "$ID"` with ID unset) ran the sweep under the id toymlx
    makes when none is given, unsaid."""
    from cli_errors import error_line

    assert sweep_main(["--recipe", "from-scratch", "--grid", "lr=1e-3", "--runs-root",
                       str(tmp_path), "--sweep-id", "", "--no-progress", *TINY]) == 2
    assert error_line(capsys, "toymlx-sweep") == (
        "toymlx-sweep: error: --sweep-id: expected a single folder name, found ''")
    assert list(tmp_path.iterdir()) == []


def test_a_random_search_of_fewer_points_than_asked_says_so(tmp_path, capsys):
    """`--random 5` over a grid of 2 points ran 2 runs, its first line's "2 runs" the only sign
    that 3 of the 5 asked for were not drawn."""
    assert sweep_main(["--recipe", "from-scratch", "--random", "5", "--grid", "lr=1e-3,2e-3",
                       "--runs-root", str(tmp_path), "--sweep-id", "r", "--no-progress",
                       "--no-report", *TINY, "--steps", "1"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[:2] == [("toymlx-sweep: --random 5: drew 2 distinct runs, not 5: the grid holds "
                        "no more; running the 2"),
                       f"sweep {tmp_path / 'r'}: 2 runs, 2 on this shard (0/1), 1 worker"]


def test_random_search_from_a_file_draws_what_the_flags_draw(tmp_path):
    """--random ranges from the file; the sweep's own options from it, flags over them. A
    shard that owns none of the runs writes sweep.json (every run's name and flags) and runs
    nothing."""
    cfg = tmp_path / "random.yaml"
    cfg.write_text(f"""recipe: from-scratch
random: 5
random_seed: 2
grid:
  lr: "log:1e-4:1e-2"
  model: {{n_layers: [1, 2], ffn_dim: [32, 64]}}
sweep_id: file
runs-root: {tmp_path}
shard: "0/1"
steps: 4
""")
    flags = ["--no-progress", "--no-report", "--shard", "9/10"]
    assert sweep_main(["-c", str(cfg), "--random", "4", "--grid", "model.n_layers=3",
                       *flags]) == 0
    assert sweep_main(["--recipe", "from-scratch", "--random", "4", "--random-seed", "2",
                       "--grid", "lr=log:1e-4:1e-2", "--grid", "model.n_layers=3", "--grid",
                       "model.ffn_dim=32,64", "--runs-root", str(tmp_path), "--sweep-id",
                       "flags", *flags, "--steps", "4"]) == 0
    file_runs = _sweep_json(tmp_path / "file")["runs"]
    flag_runs = _sweep_json(tmp_path / "flags")["runs"]
    assert len(file_runs) == 4 and {r["params"]["model.n_layers"] for r in file_runs} == {3}
    assert all(1e-4 <= r["params"]["lr"] <= 1e-2 for r in file_runs)
    # the same draws and names; a flag run carries --steps 4 that the file gives through -c
    assert [(r["name"], r["params"]) for r in file_runs] == [
        (r["name"], r["params"]) for r in flag_runs]
    assert [r["args"] for r in file_runs] == [r["args"][2:] for r in flag_runs]
    assert not [p for p in (tmp_path / "file").iterdir() if (p / "events.jsonl").exists()]


def test_an_option_spelt_with_hyphens_or_underscores_is_one_sweep(tmp_path):
    """`--grid batch-size=2,4` and `--grid batch_size=2,4` both sweep --batch-size, but made
    other run names (batch-size=2, batch_size=2), so another default sweep id and other run
    ids for the same runs. Now a key is the option's name before any id is made: flags, a
    file's grid and the API give one sweep, its runs named as config.json names the options."""
    flags = ["--recipe", "from-scratch", "--runs-root", str(tmp_path), "--no-progress",
             "--no-report", "--shard", "9/10"]  # a shard owning no run: sweep.json alone
    assert sweep_main([*flags, "--grid", "batch-size=2,4", "--grid", "model.d-model=32"]) == 0
    assert sweep_main([*flags, "--grid", "batch_size=2,4", "--grid", "model.d_model=32"]) == 0
    cfg = tmp_path / "sweep.yaml"
    cfg.write_text("grid: {batch-size: [2, 4], model: {d-model: [32]}}\n")
    assert sweep_main(["-c", str(cfg), *flags]) == 0
    want = sweep.default_sweep_id("from-scratch", sweep.grid(
        [], {"batch_size": [2, 4], "model.d_model": [32]}, recipe="from-scratch"))
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == [want]
    assert [r["name"] for r in _sweep_json(tmp_path / want)["runs"]] == [
        "batch_size=2_model.d_model=32", "batch_size=4_model.d_model=32"]
    assert [s.name for s in sweep.random([], {"model.d-model": [32]}, 1)] == [
        "model.d_model=32"]
    with pytest.raises(ValueError) as e:
        sweep.grid([], {"batch-size": [2], "batch_size": [4]}, recipe="from-scratch")
    assert str(e.value) == ("--grid batch_size: expected each option once, found --batch-size "
                            "as both batch-size and batch_size; keep one")


@pytest.mark.parametrize("text, want", [
    ("grid: {lr: 0.001}", ("key 'grid.lr': expected a list of values or a \"log:LO:HI\" range, "
     "found 0.001")),
    ("grid: {lr: [1e-3, fast]}", "key 'grid.lr': expected a number, found \"fast\""),
    ("grid: {lr: [1e-3, 0.001]}", "key 'grid.lr': expected distinct values, found 0.001 twice"),
    # a file's number named as the file holds it (it was 'expected a int, found "32.5"')
    ("grid: {model.d_model: [32, 32.5]}", ("key 'grid.model.d_model': expected an integer, "
     "found 32.5")),
    # a sweep key misspelt (it was 'key 'gird.lr': ... found an unknown key', no hint)
    ("gird: {lr: [1e-3]}", ("key 'gird': expected a key of toymlx-sweep or an option of its "
     "runs, found an unknown key; did you mean grid (toymlx-sweep's --grid)?")),
    ("grid: {lr: [1e-3]}\nworker: 2", ("key 'worker': expected a key of toymlx-sweep or an "
     "option of its runs, found an unknown key; did you mean workers (toymlx-sweep's "
     "--workers)?")),
    ("grid: {lr: 'log:1e-2:1e-4'}\nrandom: 2", ("key 'grid.lr': expected 0 < LO <= HI, found "
     "LO 1e-2 and HI 1e-4")),
    # an integer option's uniform: range was refused as a run's value ('--model.n-layers:
    # expected an integer or None, got '2.69'), naming no range
    ("grid: {model.n_layers: 'uniform:1:3'}\nrandom: 2", ("key 'grid.model.n_layers': expected "
     "int:1:3 (the option takes an integer), found uniform:1:3")),
    ("grid: {lora.rank: [4]}", ("key 'grid.lora.rank': expected an option of recipe from-scratch, "
     "found no option --lora.rank")),
    ("grid: [lr=1e-3]", ("key 'grid': expected a mapping of option: [values] or \"log:LO:HI\", "
     "found [\"lr=1e-3\"]")),
    ("grid: {lr: [1e-3]}\nworkers: two", "key 'workers': expected an integer, found \"two\""),
    # a value of the sweep's own key refused later named the flag, not the file's key
    ("grid: {lr: [1e-3]}\nworkers: 0", "key 'workers': expected >= 1, found 0"),
    ("grid: {lr: [1e-3]}\nshard: 2/2", "key 'shard': expected I/N with 0 <= I < N, found 2/2"),
    ("grid: {lr: 'log:1e-4:1e-2'}\nrandom: 0", "key 'random': expected 1..10000 runs, found 0"),
    ("grid: {lr: [1e-3]}\nsweep-id: a/b", ("key 'sweep-id': expected a single folder name, found "
     "'a/b'")),
    ("grid: {steps: [2]}\nlr: fast", ("key 'lr': expected a number, found \"fast\" (a string); "
     "fix it, or remove the key to take its default")),
    # a grid key that is also a run option of the file: the grid's values silently won
    ("grid: {lr: [1e-3, 3e-3]}\nlr: 0.01", ("keys 'lr' and 'grid.lr': expected --lr once, as "
     "every run's option or in the grid, found both (0.01 and [0.001, 0.003]); keep one")),
    ("grid: {model.n_layers: [1, 2]}\nmodel: {n-layers: 1}", ("keys 'model: {n-layers}' and "
     "'grid.model.n_layers': expected --model.n-layers once, as every run's option or in the "
     "grid, found both (1 and [1, 2]); keep one")),
    ("grid: {lr: [1e-3]}\nmodle: {d_model: 8}", ("key 'modle.d_model': expected an option of "
     "toymlx-train --recipe from-scratch, found an unknown key; did you mean model.d_model?")),
    ("grid: {lr: [1e-3]}\nrun_id: x", ("key 'run_id': expected no --run-id in a sweep file (the "
     "sweep sets it for each run), found \"x\"; remove it")),
    # W&B's parameter form (it was 'key 'grid.lr.values': ... found no option --lr.values')
    ("grid: {lr: {values: [0.001, 0.003]}}", ("key 'grid.lr': expected a list of values or a "
     "\"log:LO:HI\" range (uniform:, int:), found {\"values\": [0.001, 0.003]}: W&B's form; "
     "write lr: [V1, V2] for values, lr: \"log:MIN:MAX\" with random: N for a distribution")),
    ("grid: {lr: {min: 0.0001, max: 0.01, distribution: log_uniform_values}}", (
     "key 'grid.lr': expected a list of values or a \"log:LO:HI\" range (uniform:, int:), found "
     "{\"min\": 0.0001, \"max\": 0.01, \"distribution\": \"log_uniform_values\"}: W&B's form; "
     "write lr: [V1, V2] for values, lr: \"log:MIN:MAX\" with random: N for a distribution")),
])
def test_bad_sweep_files_are_one_line(tmp_path, capsys, text, want):
    from cli_errors import error_line

    cfg = tmp_path / "bad.yaml"
    cfg.write_text(f"recipe: from-scratch\nruns_root: {tmp_path / 'runs'}\n{text}\n")
    assert sweep_main(["-c", str(cfg)]) == 2
    assert error_line(capsys, "toymlx-sweep") == f"toymlx-sweep: error: {cfg}: {want}"
    assert not (tmp_path / "runs").exists()


def test_a_sweep_flag_over_its_file_is_named_as_the_flag(tmp_path, capsys):
    """A refusal names the file's key only where the file set the value: `--workers 0` over
    the file's `workers: 2` names --workers."""
    from cli_errors import error_line

    cfg = tmp_path / "s.yaml"
    cfg.write_text("recipe: from-scratch\ngrid: {lr: [1e-3]}\nworkers: 2\n")
    assert sweep_main(["-c", str(cfg), "--workers", "0", "--runs-root",
                       str(tmp_path / "runs")]) == 2
    assert error_line(capsys, "toymlx-sweep") == (
        "toymlx-sweep: error: --workers: expected >= 1, found 0")


@pytest.mark.parametrize("recipe, grid, want", [
    ("from-scratch", "learning_rate=1e-3,3e-3", ("--grid learning_rate: expected an option of "
     "recipe from-scratch, found no option --learning-rate; nanoGPT's learning_rate is toymlx's "
     "--lr")),
    # it was "(did you mean model.n_layers?)": right by luck of spelling, not by nanoGPT's word
    ("from-scratch", "n_layer=2,4", ("--grid n_layer: expected an option of recipe "
     "from-scratch, found no option --n-layer; nanoGPT's n_layer is toymlx's --model.n-layers")),
    ("vit-tiny", "smoothing=0.1", ("--grid smoothing: expected an option of recipe vit-tiny, "
     "found no option --smoothing; timm's --smoothing is --label-smoothing here")),
    # a misspelling keeps its spelling hint
    ("from-scratch", "lrr=1e-3", ("--grid lrr: expected an option of recipe from-scratch, found "
     "no option --lrr (did you mean lr?)")),
])
def test_a_grid_key_of_another_tool_names_toymlx_s_option(tmp_path, capsys, recipe, grid, want):
    """`--grid learning_rate=...` (nanoGPT's name) said only "found no option --learning-rate",
    where `toymlx-train --learning_rate` names --lr: a grid key now gets toymlx-train's hint
    for another tool's flag (nanoGPT's, timm's), as an mlx-lm file's grid key already did."""
    from cli_errors import error_line

    assert sweep_main(["--recipe", recipe, "--grid", grid, "--runs-root",
                       str(tmp_path / "r")]) == 2
    assert error_line(capsys, "toymlx-sweep") == f"toymlx-sweep: error: {want}"
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("typed, want", [
    (["--wrokers", "2"], ("--wrokers: expected an option of toymlx-sweep or of its runs, found "
     "an unknown one; did you mean --workers (toymlx-sweep's)?")),
    (["--no-progres"], ("--no-progres: expected an option of toymlx-sweep or of its runs, found "
     "an unknown one; did you mean --no-progress (toymlx-sweep's)?")),
    # a run option misspelt is still the run's refusal, with its hint
    (["--stpes", "3"], ("run lr=0.001: --stpes: expected an option of toymlx-train --recipe "
     "from-scratch, got an unknown one; did you mean --steps?; no run was started")),
])
def test_a_sweep_flag_misspelt_on_the_command_line_names_the_sweep_flag(tmp_path, capsys, typed,
                                                                         want):
    """`--wrokers 2` went to every run, refused as 'run lr=0.001: --wrokers: expected an option
    of toymlx-train --recipe from-scratch, got an unknown one', naming no flag of the sweep's,
    where the same typo in a sweep file (`wrokers: 2`) named --workers."""
    from cli_errors import error_line

    argv = ["--recipe", "from-scratch", "--grid", "lr=1e-3", "--runs-root", str(tmp_path / "r"),
            *typed]
    assert sweep_main(argv) == 2
    assert error_line(capsys, "toymlx-sweep") == f"toymlx-sweep: error: {want}"
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("argv", [[], ["--grid", "lr=1e-3,3e-3"]])
def test_a_sweep_without_a_recipe_names_the_recipes_and_a_sweep_as_typed(tmp_path, capsys,
                                                                         monkeypatch, argv):
    """`toymlx-sweep` alone (or with a grid and no --recipe) was argparse's usage block and "the
    following arguments are required: --recipe": one line now, the recipes and an example."""
    from cli_errors import error_line

    monkeypatch.chdir(tmp_path)
    assert sweep_main(argv) == 2
    assert error_line(capsys, "toymlx-sweep") == (
        "toymlx-sweep: error: --recipe: expected the runs' recipe (one of from-scratch, "
        "warm-start, lora, vit-tiny), found none; e.g. toymlx-sweep --recipe vit-tiny --grid "
        "lr=1e-3,3e-3 -- --steps 100")
    assert list(tmp_path.iterdir()) == []


def test_a_sweep_file_without_a_recipe_says_so_in_one_line(tmp_path, capsys):
    """It was argparse's usage and `the following arguments are required: --recipe`."""
    from cli_errors import error_line

    cfg = tmp_path / "bad.yaml"
    cfg.write_text("grid: {lr: [1e-3]}\nsteps: 2\n")
    assert sweep_main(["-c", str(cfg), "--runs-root", str(tmp_path / "runs")]) == 2
    assert error_line(capsys, "toymlx-sweep") == (
        f"toymlx-sweep: error: {cfg}: key 'recipe': expected the runs' recipe (recipe: "
        "from-scratch, or --recipe NAME), found none")
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("how,want", [
    (["--random", str(2**64), "--grid", "lr=1e-3"],
     f"--random: expected 1..10000 runs, found {2**64}"),
    (["--grid", "lr=" + ",".join(f"{i}e-4" for i in range(1, 102)), "--grid",
      "seed=" + ",".join(map(str, range(100)))],
     "--grid: expected at most 10000 runs, found 101 x 100 = 10100 combinations"),
])
def test_a_sweep_too_large_to_plan_is_one_line(tmp_path, capsys, how, want):
    """`--random 2**64` over a one-value grid drew forever (100 x N tries for N distinct runs)."""
    from cli_errors import error_line

    t0 = time.perf_counter()
    assert sweep_main(["--recipe", "from-scratch", *how, "--runs-root", str(tmp_path)]) == 2
    assert error_line(capsys, "toymlx-sweep") == f"toymlx-sweep: error: {want}"
    assert time.perf_counter() - t0 < 30 and not any(tmp_path.iterdir())


def test_a_sweep_continued_from_another_folder_must_name_the_same_input_files(tmp_path, capsys,
                                                                            monkeypatch):
    """Shard 1/2 of a sweep started in A with `--data.path data.txt`, run from B, trained on
    B/data.txt: the runs a sweep starts later read its typed paths from the current folder.
    sweep.json now records the file each typed path named, and a continuation where one names
    another file is refused (a shard of 9/10 owns none of the runs: nothing trains here)."""
    from cli_errors import error_line

    a, b = tmp_path / "A", tmp_path / "B"
    for d in (a, b):
        d.mkdir()
        (d / "data.txt").write_text(f"text of {d.name} to train on\n" * 40)
    argv = ["--recipe", "from-scratch", "--data.path", "data.txt", "--grid", "lr=1e-3",
            "--runs-root", str(tmp_path / "runs"), "--sweep-id", "s", "--shard", "9/10",
            "--no-progress", "--no-report", *TINY]
    monkeypatch.chdir(a)
    assert sweep_main(argv) == 0
    record = tmp_path / "runs" / "s" / "sweep.json"
    assert json.loads(record.read_text())["input_files"] == {
        "--data.path data.txt": str(a / "data.txt")}
    monkeypatch.chdir(b)
    capsys.readouterr()
    assert sweep_main(argv) == 2
    assert error_line(capsys, "toymlx-sweep") == (
        f"toymlx-sweep: error: {tmp_path / 'runs' / 's'}: --sweep-id s: expected the options "
        f"this sweep was started with, found --data.path (data.txt: {b / 'data.txt'} here, "
        f"{a / 'data.txt'} when the sweep started) changed; give a new --sweep-id to run the "
        "changed sweep, or put them back")
    monkeypatch.chdir(a)
    assert sweep_main(argv) == 0


@pytest.mark.parametrize("name, found", [
    ("nope.txt", "nothing at that path"),
    ("empty", "an empty folder"),
    ("dangling", "nothing at that path (a link to gone.txt, which is missing)"),
])
def test_a_data_path_that_is_not_there_fails_before_any_run_starts(tmp_path, capsys,
                                                                   monkeypatch, name, found):
    """--grid data.path=a.txt,nope.txt ran every run: those of nope.txt each failed seconds into
    its start (`cannot read data file`), found at the end of the sweep; an empty folder still
    did, and a missing path was "found nothing at nope.txt" where toymlx-train says what is
    there (`nothing_there`: a link to a missing file, a `~` the shell left)."""
    from cli_errors import error_line
    from toymlx_cli.train import main as train_main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.txt").write_text("hello world, a tiny text. " * 400)
    (tmp_path / "empty").mkdir()
    (tmp_path / "dangling").symlink_to("gone.txt")
    argv = ["--recipe", "from-scratch", "--grid", f"data.path=a.txt,{name}", "--grid",
            "lr=1e-3,3e-3", "--runs-root", "runs", "--no-progress", "--no-report", *TINY]
    assert sweep_main(argv) == 2
    assert error_line(capsys, "toymlx-sweep") == (
        f"toymlx-sweep: error: run data.path={name}_lr=0.001: --data.path {name}: expected an "
        f"existing file or folder, found {found}; no run was started")
    assert not (tmp_path / "runs").exists()
    # toymlx-train finds the same there
    assert train_main(["--recipe", "from-scratch", "--data.path", name, "--runs-root", "runs",
                       *TINY]) == 2
    assert error_line(capsys, "toymlx-train").endswith(f", found {found}")


def test_a_model_shape_that_cannot_be_built_fails_before_any_run_starts(tmp_path, capsys,
                                                                       monkeypatch):
    """--grid model.d_model=30,32 passed the sweep's check of every run's options and ran: the
    run of 30 (not a multiple of the 8 heads) FAILED at its start, found at the end."""
    from cli_errors import error_line

    monkeypatch.chdir(tmp_path)
    argv = ["--recipe", "from-scratch", "--grid", "model.d_model=30,32", "--runs-root", "runs",
            "--no-progress", "--no-report", "--steps", "1"]
    assert sweep_main(argv) == 2
    assert error_line(capsys, "toymlx-sweep") == (
        "toymlx-sweep: error: run model.d_model=30: --model.d-model: expected a multiple of "
        "--model.n-heads (8, the preset's), found 30; no run was started")
    assert not (tmp_path / "runs").exists()


def test_the_best_run_is_named_lowest_loss_or_highest_accuracy_never_a_diverged_one():
    """The sweep named no best run (the table's first row was it, unsaid); Optuna's
    best_trial, W&B's sweep view name it."""
    from toymlx.runner.report import sort_rows
    from toymlx.sweeps.summary import best_line

    def row(run, status, metric, best, step=20):
        return {"run": run, "status": status, "metric": metric, "best": best,
                "best_step": None if best is None else step}
    loss = sort_rows([row("lr=0.001", "completed", "val_loss", 3.2626),
                      row("lr=10", "diverged", "val_loss", 2.5, 4),  # better, then blew up
                      row("lr=0.003", "completed", "val_loss", 3.1439, 18),
                      row("lr=1", "failed", "val_loss", None)])
    assert best_line(loss) == ("sweep: best lr=0.003: val_loss 3.144 at step 18 (lowest of 2 "
                               "completed runs)")
    acc = sort_rows([row("lr=0.001", "completed", "accuracy", 0.3125, 12),
                     row("lr=0.003", "completed", "accuracy", 0.375, 12)])
    assert best_line(acc) == ("sweep: best lr=0.003: accuracy 0.375 at step 12 (highest of 2 "
                              "completed runs)")
    acc.append(row("lr=0.002", "completed", "accuracy", 0.375, 8))
    acc.append(row("lr=0.004", "completed", "accuracy", 0.375, 4))
    assert best_line(sort_rows(acc)) == ("sweep: best lr=0.003: accuracy 0.375 at step 12 "
                                         "(highest of 4 completed runs; 2 others as good)")
    assert best_line(sort_rows(acc[:3])).endswith("(highest of 3 completed runs; 1 other as "
                                                  "good)")
    assert best_line(sort_rows([row("lr=10", "diverged", "val_loss", 2.5, 4),
                                row("lr=1", "torn", "val_loss", None)])) is None
    # a runner-up that reads the same to 4 digits: both to the digits that tell them apart
    # (two lora ranks' val_loss 6.225 and 6.225: "best lora.rank=8", nothing to tell why)
    close = sort_rows([row("lora.rank=4", "completed", "val_loss", 6.224718, 2),
                       row("lora.rank=8", "completed", "val_loss", 6.224693, 2)])
    assert best_line(close) == ("sweep: best lora.rank=8: val_loss 6.22469 at step 2 (lowest of "
                                "2 completed runs; the next, lora.rank=4, 6.22472)")


def test_a_pending_sigkill_marks_a_dying_parent():
    """`lifeline.kill_pending` reads /proc/PID/status: SIGKILL (bit 9) pending for the thread or
    the process marks a parent killed whose main thread has not begun to exit, so the parent-
    death signal its other threads' exits repeat is not a second request (which skips the
    final checkpoint); other pending signals, or none, do not. A live process has none."""
    from toymlx.backend.lifeline import _dying, kill_pending

    status = b"Name:\tpython\nSigQ:\t0/95000\nSigPnd:\t%s\nShdPnd:\t%s\nSigBlk:\t0\n"
    assert kill_pending(status % (b"0000000000000100", b"0000000000000000"))
    assert kill_pending(status % (b"0000000000000000", b"0000000000004100"))
    assert not kill_pending(status % (b"0000000000004000", b"0000000000000002"))  # TERM, INT
    assert not kill_pending(status % (b"0000000000000000", b"0000000000000000"))
    if sys.platform.startswith("linux"):
        assert kill_pending(Path(f"/proc/{os.getpid()}/status").read_bytes()) is False
        assert _dying(os.getpid()) is False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux's /proc")
def test_a_parent_that_dies_within_the_wait_is_lost(monkeypatch):
    """`lifeline.parent_lost(wait_s)` watches a parent that still looks alive for up to
    `wait_s`: a killed parent whose main thread had not yet been marked exiting when its other
    threads repeated the parent-death signal is seen dying then, so the repeat is not a second
    request (a sweep's run once left without its final checkpoint so). A parent alive
    throughout is not lost; once seen dead it stays lost."""
    from toymlx.backend import lifeline

    monkeypatch.setattr(lifeline, "_lost", False)
    parent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
    try:
        monkeypatch.setenv(lifeline.PARENT_ENV, str(parent.pid))
        assert lifeline.parent_lost() is False  # alive, no wait
        assert lifeline.parent_lost(30.0) is True  # exits (a zombie: not reaped) within it
        parent.wait()  # reaped: gone, and lost still
        assert lifeline.parent_lost() is True
        monkeypatch.setattr(lifeline, "_lost", False)
        monkeypatch.setenv(lifeline.PARENT_ENV, str(os.getpid()))
        assert lifeline.parent_lost(0.1) is False  # alive throughout the wait
    finally:
        end_child(parent)


def test_a_run_killed_by_a_signal_is_said_to_be(tmp_path):
    """A sweep's run killed by SIGKILL (kill -9, the out-of-memory killer) was reported
    "FAILED lr=0.003: step 4: checkpoint .../step_4.gguf", its log's last line, as if that
    were the failure; now "killed by SIGKILL" with that line. A run that exits on its own is
    told by its error line, as before."""
    from toymlx.sweeps.supervisor import _why_failed

    log = tmp_path / "lr=0.003.log"
    log.write_text("step 3/12: train loss 2.6680\nstep 4: checkpoint w/step_4.gguf\n")
    assert _why_failed(-signal.SIGKILL, log) == (
        "killed by SIGKILL (its last line: step 4: checkpoint w/step_4.gguf)")
    assert _why_failed(1, log) == "step 4: checkpoint w/step_4.gguf"
    log.write_text("toymlx-train: error: x: expected y\n")
    assert _why_failed(1, log) == "toymlx-train: error: x: expected y"
    assert _why_failed(-signal.SIGSEGV, tmp_path / "none.log") == "killed by SIGSEGV"
    log.write_text("# 2026-12-04 18:33:00 start: toymlx-train --recipe vit-tiny\n")
    assert _why_failed(-signal.SIGKILL, log) == "killed by SIGKILL"  # before its first line
    assert _why_failed(3, tmp_path / "none.log") == "exit code 3"
    assert _why_failed(-50, tmp_path / "none.log") == "killed by signal 50"  # no name in Python


def test_a_sweep_file_key_that_does_not_apply_is_refused_a_run_config_is_not(
        tmp_path, capsys, stories_path):
    """A sweep file's run key where it does not apply (`lora: {rank: 8}`, its default, with a
    full fine-tune) is refused up front, named by the file's key, as toymlx-train -c refuses
    it; a run's config.json, which lists every option of its run (these at their defaults),
    sweeps: its runs take run-options.json as a run's config.json, not as options given."""
    from cli_errors import error_line

    options = {"base": str(stories_path), "fine_tune_type": "full", "lora": {"rank": 8},
               "warmup_init": 0.0, "steps": 1, "seq_len": 32, "eval_batches": 1,
               "compile": False}
    plain = tmp_path / "sweep.json"
    plain.write_text(json.dumps({"recipe": "lora", **{k: v for k, v in options.items()
                                                      if k != "warmup_init"}}))
    flags = ["--runs-root", str(tmp_path), "--no-progress", "--no-report", "--grid", "lr=1e-3"]
    assert sweep_main(["-c", str(plain), *flags]) == 2
    assert error_line(capsys, "toymlx-sweep") == (
        f"toymlx-sweep: error: run lr=0.001: {plain}: key 'lora: {{rank}}': expected no value "
        "with --fine-tune-type full (every weight is trained, no adapters), found 8; remove it, "
        "or train --fine-tune-type lora or dora; no run was started")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sweep.json"]
    run = tmp_path / "config.json"
    run.write_text(json.dumps({"recipe": "lora", "config": options}))
    # without a --grid: named alone (it said "or a grid in .../config.json", which holds none)
    assert sweep_main(["-c", str(run), *flags[:-2]]) == 2
    assert error_line(capsys, "toymlx-sweep") == (
        "toymlx-sweep: error: --grid: expected at least one KEY=V1,V2 (e.g. --grid "
        "lr=1e-4,3e-4)")
    assert sweep_main(["-c", str(run), *flags, "--sweep-id", "s"]) == 0
    assert json.loads((tmp_path / "s" / "run-options.json").read_text()) == {
        "recipe": "lora", "config": options}
    saved = json.loads((tmp_path / "s" / "lr=0.001" / "config.json").read_text())["config"]
    assert (saved["fine_tune_type"], saved["lr"], saved["steps"]) == ("full", 1e-3, 1)


def test_a_run_s_value_refused_names_its_flag_as_typed(tmp_path, capsys):
    """Every run's `--weight_decay=-1` (HF's and mlx-lm's spelling, after `--`) was refused as
    `--weight-decay`, a flag the user never typed; now as typed, as toymlx-train names it. A
    grid key's flag, which the sweep writes, keeps its own spelling."""
    from cli_errors import error_line

    argv = ["--recipe", "from-scratch", "--runs-root", str(tmp_path), "--no-progress", *TINY]
    assert sweep_main([*argv, "--grid", "lr=2e-3", "--", "--weight_decay=-1"]) == 2
    assert error_line(capsys, "toymlx-sweep") == (
        "toymlx-sweep: error: run lr=0.002: --weight_decay: expected >= 0, found -1.0; no run was "
        "started")
    assert sweep_main([*argv, "--grid", "weight_decay=-1"]) == 2
    assert error_line(capsys, "toymlx-sweep") == (
        "toymlx-sweep: error: run weight_decay=-1: --weight-decay: expected >= 0, found -1.0; no "
        "run was started")
    assert list(tmp_path.iterdir()) == []


def test_a_second_sweep_of_one_id_is_refused_while_the_first_runs(tmp_path, capsys):
    """Two sweeps of one id (and shard) at once both ran, the runs split between them, and the
    first to end exited 0 with a partial summary. The second is refused before it writes
    anything, naming the folder and the first's pid, from Python and from toymlx-sweep; a first
    that was killed (-9) blocks no one."""
    from cli_errors import error_line

    from toymlx.sweeps.supervisor import shard_lock

    specs = sweep.grid([*TINY, "--steps", "2"], {"lr": [2e-3]})
    folder = tmp_path / "s"
    (folder / ".locks").mkdir(parents=True)
    hold = "; ".join(HOLD.strip().splitlines())  # one line: the refusal names its command
    first = subprocess.Popen([sys.executable, "-c", hold, str(folder / ".locks" /
                                                            shard_lock((0, 1)))],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert first.stdout.readline().strip() == "held"
        before = sorted(p.relative_to(folder) for p in folder.rglob("*"))
        with pytest.raises(LockHeld) as e:
            sweep.run_sweep("from-scratch", specs, tmp_path, sweep_id="s", progress=False,
                            report_png=False)
        assert str(e.value).startswith(f"{folder}: the sweep: in use by process {first.pid} (")
        assert str(e.value).endswith(f"; wait for it to end, or stop it first (kill -INT "
                                     f"{first.pid})")
        assert sweep_main(["--recipe", "from-scratch", "--grid", "lr=2e-3", "--runs-root",
                           str(tmp_path), "--sweep-id", "s", "--no-progress", "--no-report",
                           *TINY, "--steps", "2"]) == 2
        assert error_line(capsys, "toymlx-sweep") == f"toymlx-sweep: error: {e.value}"
        assert sorted(p.relative_to(folder) for p in folder.rglob("*")) == before
        first.kill()  # kill -9: its lock dies with it
        first.wait()
        result = sweep.run_sweep("from-scratch", specs, tmp_path, sweep_id="s", progress=False,
                                 report_png=False)
        assert result.states == {"lr=0.002": "done"}
    finally:
        end_child(first)


def test_a_sweep_of_another_split_of_one_id_is_refused_while_the_first_runs(tmp_path, capsys):
    """`--shard 0/2` started beside a running `--shard 0/1` of one sweep folder ran: each
    run's lock kept a run from training twice at once, but the two split the runs
    differently, each taking runs the other counted as its own. It is refused before it writes
    anything, naming the folder, the running split and its pid, and what to do (a share of
    that split no sweep runs, where there is one); a first killed (-9) blocks nothing, another
    shard of the same split runs beside it, and a later sweep of another split, once the first
    has ended, runs what is left."""
    from cli_errors import error_line

    from toymlx.sweeps.supervisor import shard_lock

    specs = sweep.grid([*TINY, "--steps", "1"], {"lr": [2e-3, 3e-3]})
    folder = tmp_path / "s"
    (folder / ".locks").mkdir(parents=True)
    hold = "; ".join(HOLD.strip().splitlines())
    first = subprocess.Popen([sys.executable, "-c", hold, str(folder / ".locks" /
                                                            shard_lock((0, 1)))],
                             stdout=subprocess.PIPE, text=True)

    def run(shard):
        return sweep.run_sweep("from-scratch", specs, tmp_path, sweep_id="s", shard=shard,
                               progress=False, report_png=False)

    try:
        assert first.stdout.readline().strip() == "held"
        before = sorted(p.relative_to(folder) for p in folder.rglob("*"))
        with pytest.raises(ValueError) as e:
            run((0, 2))
        said = str(e.value)
        assert said.startswith(f"{folder}: --shard: expected the split of the sweep running "
                               f"there (0/1, process {first.pid} ("), said
        assert said.endswith(f"), found 0/2, which shares its runs out otherwise; wait for it to "
                             f"end, or stop it first (kill -INT {first.pid})"), said
        assert sweep_main(["--recipe", "from-scratch", "--grid", "lr=2e-3,3e-3", "--runs-root",
                           str(tmp_path), "--sweep-id", "s", "--shard", "0/2", "--no-progress",
                           "--no-report", *TINY, "--steps", "1"]) == 2
        assert error_line(capsys, "toymlx-sweep") == f"toymlx-sweep: error: {said}"
        assert sorted(p.relative_to(folder) for p in folder.rglob("*")) == before
        first.kill()  # kill -9: its lock file stays, held by no one
        first.wait()
    finally:
        end_child(first)
    assert (folder / ".locks" / shard_lock((0, 1))).exists()
    with acquire(folder / ".locks" / shard_lock((0, 3)), "a sweep of shard 0/3"), \
            pytest.raises(ValueError) as e:
        run((0, 2))
    assert str(e.value).endswith(f"(kill -INT {os.getpid()}), or give one of --shard 1/3, 2/3 "
                                 "(no sweep runs them now)"), str(e.value)
    with acquire(folder / ".locks" / shard_lock((1, 2)), "a sweep of shard 1/2"):
        assert run((0, 2)).states == {"lr=0.002": "done"}  # the same split: beside it
    assert run((0, 1)).states == {"lr=0.002": "skipped", "lr=0.003": "done"}


@pytest.mark.parametrize("sig, line, code", [
    (signal.SIGINT, "interrupted", 130), (signal.SIGTERM, "stopped by SIGTERM", 143)])
def test_a_stop_while_the_summary_is_written_is_one_line_and_no_half_file(
        tmp_path, capsys, monkeypatch, sig, line, code):
    """Ctrl-C while the sweep wrote its summary and drew report.png ended toymlx-sweep in a
    KeyboardInterrupt traceback (a SIGTERM killed it without a word, its report's temporary
    left); now one line saying what was stopped and how to finish it, the signal's exit status,
    no report.png half-drawn and no temporary beside it; the same command then writes it."""
    pytest.importorskip("matplotlib")
    import matplotlib.figure

    from toymlx.backend.stop import SIGNALS

    savefig = matplotlib.figure.Figure.savefig

    def cut(self, f, *args, **kw):
        f.write(b"\x89PNG half a report")
        os.kill(os.getpid(), sig)  # the stop comes while report.png is written
        time.sleep(5)  # not reached: the handler raises at once
        raise AssertionError("the stop was not raised")

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", cut)
    argv = ["--recipe", "from-scratch", "--grid", "lr=2e-3", "--runs-root", str(tmp_path),
            "--sweep-id", "s", "--no-progress", *TINY, "--steps", "2"]
    before = {s: signal.getsignal(s) for s in SIGNALS}
    try:
        assert sweep_main(argv) == code
    finally:
        for s, h in before.items():  # a stop leaves them ignored until the process exits
            signal.signal(s, h)
    err = capsys.readouterr().err
    folder = tmp_path / "s"
    assert "Traceback" not in err and err.endswith(
        f"sweep: {line} while writing its summary (summary.csv, summary.jsonl, report.png in "
        f"{folder}); none was left half-written: run the same command again to write it (its "
        "completed runs are skipped, stopped ones resume)\n"), err
    assert not (folder / "report.png").exists()
    assert sorted(p.name for p in folder.iterdir() if ".tmp-" in p.name) == []
    assert [r["status"] for r in _csv(folder / "summary.csv")] == ["completed"]
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    assert sweep_main(argv) == 0
    assert (folder / "report.png").read_bytes()[:4] == b"\x89PNG"
