"""One writer per run bundle, and resumes that keep the run: issue 17 cases 2-5, run as a user
would (real `toymlx-train` processes and signals where a second process is the point).

2. a second writer (--resume, --overwrite, a fresh start) of a live bundle is refused, naming
   the process that owns it;
3. a resume that changes an option other than --steps (or a run-local one) is refused;
4. a hand-broken config.json gives one line naming the key, never a traceback;
5. a run killed before its first checkpoint says how many steps were lost and how to start it
   over, and that command gives one clean run.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_errors import error_line
from toymlx_cli.train import main

from toymlx.bundle.checkpoint import list_checkpoints
from toymlx.bundle.events import SUPERSEDED, read_events
from toymlx.bundle.folder import lock_run

TINY = ["--model.d-model", "32", "--model.n-layers", "1", "--model.n-heads", "4",
        "--model.n-kv-heads", "2", "--model.ffn-dim", "64", "--model.context", "64",
        "--seq-len", "32", "--batch-size", "2", "--eval-batches", "1", "--eval-every", "0",
        "--no-compile", "--no-progress"]
TRAIN = [sys.executable, "-m", "toymlx_cli.train"]


@pytest.fixture(scope="module")
def data(shared_file) -> str:
    return str(shared_file("text/tinystories_sample.txt"))


def _digest(run: Path) -> dict[str, str]:
    return {str(p.relative_to(run)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run.rglob("*")) if p.is_file()}


def _start(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen(TRAIN + args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)


def _wait_for_step(p: subprocess.Popen, run: Path, step: int) -> None:
    t0 = time.monotonic()
    while not any(e["kind"] == "step" and e["step"] >= step for e in read_events(run)):
        assert p.poll() is None, p.stderr.read()[-3000:]
        assert time.monotonic() - t0 < 120
        time.sleep(0.05)


def _one_run(run: Path) -> list[dict]:
    """The events, after checking they read as one toy/v1 run: one run_start first, each step
    once from 1, at most one run_end and last."""
    ev = read_events(run)
    kinds = [e["kind"] for e in ev]
    assert kinds[0] == "run_start" and kinds.count("run_start") == 1, kinds
    assert kinds.count("run_end") <= 1 and ("run_end" not in kinds or kinds[-1] == "run_end")
    steps = [e["step"] for e in ev if e["kind"] == "step"]
    assert steps == list(range(1, len(steps) + 1)), steps
    return ev


# ---- 2. two writers ------------------------------------------------------------------------
def test_a_second_writer_of_a_live_bundle_is_refused(tmp_path, data, capsys):
    run = tmp_path / "live2"
    p = _start(["--recipe", "from-scratch", *TINY, "--data.path", data, "--runs-root",
                str(tmp_path), "--run-id", "live2", "--steps", "100000", "--checkpoint-every",
                "5"])
    try:
        _wait_for_step(p, run, 6)
        config = (run / "config.json").read_bytes()
        fresh = ["--recipe", "from-scratch", *TINY, "--data.path", data, "--runs-root",
                 str(tmp_path), "--run-id", "live2", "--steps", "150"]
        for argv in (["--resume", str(run), "--steps", "150"],
                     ["--resume", str(run), "--lr", "1e-3", "--steps", "150"],
                     [*fresh, "--overwrite"], fresh):
            assert main(argv) == 2
            line = error_line(capsys)
            assert f"{run}: run bundle: in use by process {p.pid} (" in line, line
            assert "toymlx_cli.train" in line and "--run-id live2" in line, line
        assert (run / "config.json").read_bytes() == config
        assert p.poll() is None  # the owner trained on, untouched
    finally:
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=120)
    assert p.returncode == 130, err[-2000:]
    ev = _one_run(run)
    assert ev[-1]["reason"] == "interrupted"
    final = ev[-1]["final_step"]
    assert [s for s, _ in list_checkpoints(run / "weights")][-1] == final
    # once the owner is gone the bundle is free: the resume continues it
    assert main(["--resume", str(run), "--steps", str(final + 2)]) == 0
    ev = _one_run(run)
    assert ev[-1]["reason"] == "completed" and ev[-1]["final_step"] == final + 2
    assert not (run / ".lock").exists()


def test_runs_started_in_one_second_without_a_run_id_never_collide(tmp_path, data, capsys,
                                                                    monkeypatch):
    """The default id is a timestamp to the second: a run started in the second another
    claimed it takes the first free suffix (its folder made atomically), while a --run-id the
    user gave is still refused as taken."""
    monkeypatch.setattr("toymlx.runner.run.default_run_id", lambda recipe, t=None: "same-sec")
    taken = tmp_path / "same-sec"
    taken.mkdir()
    with lock_run(taken):  # another run, in its first second
        argv = ["--recipe", "from-scratch", *TINY, "--data.path", data, "--runs-root",
                str(tmp_path), "--steps", "1"]
        assert main(argv) == 0
        assert main(argv) == 0
        assert main([*argv, "--run-id", "same-sec"]) == 2
        assert f"{taken}: run bundle: in use by process {os.getpid()} (" in error_line(capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["same-sec", "same-sec-2", "same-sec-3"]
    for run_id in ("same-sec-2", "same-sec-3"):
        assert _one_run(tmp_path / run_id)[0]["run_id"] == run_id
        saved = json.loads((tmp_path / run_id / "config.json").read_text())
        assert saved["config"]["run_id"] == run_id
    assert list(taken.iterdir()) == []


# ---- 3. strict resume ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def stopped(tmp_path_factory, data) -> Path:
    """A run of 6 steps stopped (checkpointed) at step 4."""
    root = tmp_path_factory.mktemp("strict")
    assert main(["--recipe", "from-scratch", *TINY, "--data.path", data, "--runs-root",
                 str(root), "--run-id", "base", "--steps", "6", "--stop-at", "4",
                 "--checkpoint-every", "2"]) == 0
    return root / "base"


@pytest.mark.parametrize("flag,given,key,saved", [
    ("--seq-len", "16", "seq_len", "32"),
    ("--batch-size", "4", "batch_size", "2"),
    ("--seed", "1", "seed", "0"),
    ("--lr", "0.001", "lr", "0.003"),
    ("--warmup", "3", "warmup", "20"),
    ("--run-id", "elsewhere", "run_id", "'base'"),
    ("--runs-root", "{other_root}", "runs_root", "{root}"),
    ("--model.d-model", "64", "model.d_model", "32"),
])
def test_resume_with_a_changed_option_is_refused(tmp_path, stopped, capsys, data, flag,
                                                 given, key, saved):
    run = tmp_path / "base"
    shutil.copytree(stopped, run, symlinks=True)
    other = tmp_path / "other.txt"
    shutil.copy(data, other)
    fill = {"other": str(other), "data": repr(data), "other_root": str(tmp_path / "r2"),
            "root": repr(str(stopped.parent))}
    before = _digest(run)
    assert main(["--resume", str(run), flag, given.format(**fill)]) == 2
    line = error_line(capsys)
    assert f"--resume: {flag}: expected the run's saved {key} = {saved.format(**fill)}" in line
    assert given.format(**fill) in line and "start a new run" in line
    assert _digest(run) == before  # nothing written, config.json least of all


def test_resume_with_other_data_is_refused_and_a_copy_is_taken(tmp_path, stopped, capsys,
                                                                data):
    """--data.path on a resume names data, not an option to change: a copy with the recorded
    contents is read (data moved; see test_run_inputs), other contents are one line naming both
    files, and nothing is written. It was refused as a changed option either way."""
    run = tmp_path / "base"
    shutil.copytree(stopped, run, symlinks=True)
    other = tmp_path / "other.txt"
    other.write_text(Path(data).read_text()[::-1])  # same size, other contents
    before = _digest(run)
    assert main(["--resume", str(run), "--data.path", str(other)]) == 2
    assert error_line(capsys).startswith(
        f"toymlx-train: error: {other}: --data.path: expected the run's data.path, recorded as "
        f"{Path(data).resolve()} ({other.stat().st_size} bytes, sha256 ")
    assert _digest(run) == before
    shutil.copy(data, other)
    assert main(["--resume", str(run), "--data.path", str(other)]) == 0
    assert (f"toymlx-train: --resume reads --data.path from {other} (moved; same contents as "
            f"the run's {data})\n") in capsys.readouterr().err


def test_resume_may_extend_steps_and_change_run_local_options(tmp_path, stopped):
    run = tmp_path / "base"
    shutil.copytree(stopped, run, symlinks=True)
    config = (run / "config.json").read_bytes()
    assert main(["--resume", str(run), "--steps", "9", "--eval-every", "3",
                 "--checkpoint-every", "3", "--keep-last", "2"]) == 0
    assert (run / "config.json").read_bytes() == config  # never rewritten
    ev = _one_run(run)
    (res,) = [e for e in ev if e["kind"] == "resume"]
    assert (res["from_step"], res["steps"], res["previous_steps"]) == (4, 9, 6)
    assert res["previous_end"] == "stopped" and res["dropped_events"] == 1  # its run_end
    assert [e["step"] for e in ev if e["kind"] == "eval"] == [6, 9]
    assert ev[-1]["reason"] == "completed" and ev[-1]["final_step"] == 9
    assert [s for s, _ in list_checkpoints(run / "weights")] == [6, 9]  # --keep-last 2
    ts = [e["t"] for e in ev]
    assert ts == sorted(ts)  # the clock goes on from the first process's
    # the extension is the run's length from now on: a plain resume keeps it
    assert main(["--resume", str(run)]) == 2  # nothing left to train at 9 of 9
    assert main(["--resume", str(run), "--steps", "10"]) == 0
    assert [e["steps"] for e in read_events(run) if e["kind"] == "resume"] == [9, 10]


# ---- 4. config.json validated ---------------------------------------------------------------
@pytest.mark.parametrize("edit,want", [
    (lambda c: [1, 2], 'expected an object with "recipe" and "config" keys, found [1, 2] (a list)'),
    (lambda c: {**c, "config": {**c["config"], "steps": "forty"}},
     "key 'config.steps': expected an integer, found \"forty\" (a string)"),
    (lambda c: {**c, "config": {**c["config"], "model": None}},
     "key 'config.model': expected an object of options, found null (null)"),
    # an edited recipe is named as the edit (it was "key 'config.seq_len': expected an option
    # of this recipe", "key 'recipe': --recipe: expected one of ...")
    (lambda c: {**c, "recipe": "vit-tiny"},
     ("key 'recipe': expected \"from-scratch\" (recorded when the run started), found "
      "\"vit-tiny\": config.json was edited after the run started: put it back")),
    (lambda c: {**c, "recipe": "no-such"},
     ("key 'recipe': expected \"from-scratch\" (recorded when the run started), found "
      "\"no-such\"")),
    (lambda c: {**c, "config": {**c["config"], "lr": True}},
     "key 'config.lr': expected a number, found true (a boolean)"),
    (lambda c: {**c, "config": {**c["config"], "steps": -5}}, "--steps: expected >= 1"),
    (lambda c: {**c, "config": {**c["config"], "nonsense": 1}},
     "key 'config.nonsense': expected an option of this recipe"),
    (lambda c: "{not json", "expected JSON, found Expecting property name"),
])
def test_a_broken_config_json_is_one_line(tmp_path, stopped, capsys, edit, want):
    run = tmp_path / "base"
    shutil.copytree(stopped, run, symlinks=True)
    saved = json.loads((run / "config.json").read_text())
    new = edit(saved)
    (run / "config.json").write_text(new if isinstance(new, str) else json.dumps(new))
    assert main(["--resume", str(run)]) == 2
    line = error_line(capsys)
    assert f"{run / 'config.json'}: " in line and want in line, line


# ---- 5. killed before its first checkpoint ---------------------------------------------------
def test_a_run_stopped_at_step_1_before_its_first_checkpoint_says_1_step_lost(tmp_path, data,
                                                                             capsys):
    """A run whose record ends at step 1, no checkpoint written: "(1 steps lost)" read wrong.
    Made in-process: a 1-step run, its checkpoint and run_end taken away."""
    run = tmp_path / "one"
    assert main(["--recipe", "from-scratch", *TINY, "--data.path", data, "--runs-root",
                 str(tmp_path), "--run-id", "one", "--steps", "1"]) == 0
    shutil.rmtree(run / "weights")
    (run / "weights").mkdir()
    events = run / "events.jsonl"
    lines = events.read_text().splitlines(keepends=True)
    events.write_text("".join(x for x in lines
                              if json.loads(x)["kind"] not in ("run_end", "checkpoint")))
    capsys.readouterr()
    assert main(["--resume", str(run)]) == 2
    line = error_line(capsys)
    assert line == (f"toymlx-train: error: {run}: --resume: found no checkpoint: the run stopped "
                    "at step 1, before its first checkpoint (1 step lost); start it over with "
                    f"its saved configuration: toymlx-train --resume {run} --from step_0"), line


def test_a_run_whose_checkpoints_were_removed_is_not_told_it_never_wrote_one(tmp_path, data,
                                                                            capsys):
    """weights/ emptied by hand after checkpoints at steps 1 and 2: the resume said "the run
    stopped at step 2, before its first checkpoint", which events.jsonl's checkpoint events
    contradict. Now it names the checkpoints the record holds, to put back."""
    run = tmp_path / "r"
    assert main(["--recipe", "from-scratch", *TINY, "--data.path", data, "--runs-root",
                 str(tmp_path), "--run-id", "r", "--steps", "2", "--checkpoint-every",
                 "1"]) == 0
    for f in (run / "weights").iterdir():
        f.unlink()
    capsys.readouterr()
    assert main(["--resume", str(run), "--steps", "3"]) == 2
    assert error_line(capsys) == (
        f"toymlx-train: error: {run / 'weights'}: --resume: expected the run's checkpoints "
        "(events.jsonl records them up to step_2), found none; put them back to resume from "
        "them, or start the run over with its saved configuration: toymlx-train --resume "
        f"{run} --from step_0")


def test_a_run_killed_before_its_first_checkpoint_starts_over(tmp_path, data, capsys):
    run = tmp_path / "early"
    fresh = ["--recipe", "from-scratch", *TINY, "--data.path", data, "--runs-root",
             str(tmp_path), "--run-id", "early", "--steps", "100000", "--checkpoint-every",
             "100000"]
    p = _start(fresh)
    _wait_for_step(p, run, 5)
    p.kill()
    p.wait()
    lost = max(e["step"] for e in read_events(run) if e["kind"] == "step")
    assert main(["--resume", str(run)]) == 2
    line = error_line(capsys)
    assert (f"found no checkpoint: the run stopped at step {lost}, before its first checkpoint "
            f"({lost} steps lost)") in line
    command = f"toymlx-train --resume {run} --from step_0"
    assert line.endswith(command), line
    assert main(fresh[:-4] + ["--steps", "3"]) == 2  # the run id is taken ...
    assert f"--resume {run} --from step_0 to start it over" in error_line(capsys)  # ... said
    assert main([*command.split()[1:], "--steps", "6"]) == 0  # the command it gave, shortened
    ev = _one_run(run)
    (res,) = [e for e in ev if e["kind"] == "resume"]
    assert res["from_step"] == 0 and res["checkpoint"] is None and res["previous_end"] == "torn"
    assert res["dropped_events"] >= lost
    assert len((run / SUPERSEDED).read_text().splitlines()) == res["dropped_events"]
    assert ev[-1]["reason"] == "completed" and ev[-1]["final_step"] == 6
    # the same run again: steps in warm-up have the same learning rate whatever --steps is
    first = [e["loss"] for e in read_events(run / SUPERSEDED) if e["kind"] == "step"][:6]
    assert [e["loss"] for e in ev if e["kind"] == "step"][:len(first)] == first


def test_locks_of_dead_owners_do_not_block(tmp_path, data):
    """A SIGKILLed owner leaves its lock file behind; the kernel has already released it."""
    run = tmp_path / "k"
    p = _start(["--recipe", "from-scratch", *TINY, "--data.path", data, "--runs-root",
                str(tmp_path), "--run-id", "k", "--steps", "100000", "--checkpoint-every", "2"])
    _wait_for_step(p, run, 3)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    assert (run / ".lock").exists() and json.loads((run / ".lock").read_text())["pid"] == p.pid
    last = list_checkpoints(run / "weights")[-1][0]
    assert main(["--resume", str(run), "--steps", str(last + 2)]) == 0


def test_a_resume_on_a_read_only_disk_says_what_to_do(tmp_path, stopped, capsys, monkeypatch):
    """Measured on a tmpfs remounted read-only: "error: [Errno 30] Read-only file system:
    '.../.lock'", a file the user never made, and nothing on what to do."""
    import errno

    from toymlx.backend import lock

    run = tmp_path / "base"
    shutil.copytree(stopped, run, symlinks=True)
    before, real_open = _digest(run), os.open

    def ro(path, *a, **k):
        if str(path).endswith(".lock"):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_open(path, *a, **k)

    monkeypatch.setattr(lock.os, "open", ro)
    assert main(["--resume", str(run)]) == 2
    assert error_line(capsys) == (
        f"toymlx-train: error: {run}: --resume: expected a run folder it can write (its "
        f"checkpoints, events.jsonl, its lock file), found Read-only file system at "
        f"{run / '.lock'}; make room or make it writable, or copy the run to a disk that is "
        "(cp -a) and resume the copy")
    assert _digest(run) == before


def test_a_full_disk_at_the_lock_is_one_line_and_the_resume_then_works(tmp_path, stopped,
                                                                       capsys, monkeypatch):
    """A resume on a full disk failed writing its lock file's holder with a bare
    "error: [Errno 28] No space left on device" (no file), and the failed lock stayed held by a
    leaked descriptor: a retry in the same process was refused as "in use by process <itself>"."""
    import errno

    from toymlx.backend import lock

    run = tmp_path / "base"
    shutil.copytree(stopped, run, symlinks=True)
    before = _digest(run)

    def full(*_):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(lock.os, "pwrite", full)
    assert main(["--resume", str(run)]) == 2
    assert error_line(capsys) == (
        f"toymlx-train: error: {run}: --resume: expected a run folder it can write (its "
        f"checkpoints, events.jsonl, its lock file), found No space left on device at "
        f"{run / '.lock'}; make room or make it writable, or copy the run to a disk that is "
        "(cp -a) and resume the copy")
    assert _digest(run) == before and not (run / ".lock").exists()
    monkeypatch.undo()  # room again: the same process resumes it
    assert main(["--resume", str(run)]) == 0
    assert [e["from_step"] for e in read_events(run) if e["kind"] == "resume"] == [4]
    assert read_events(run)[-1]["final_step"] == 6


@pytest.mark.parametrize("name", ["bad\nname", "tab\there", "bell\x07"])
def test_a_run_or_sweep_id_with_a_control_character_is_refused(tmp_path, data, capsys, name):
    """--run-id 'bad<newline>name' trained, and every line naming the run (the final
    "bundle: runs/bad" / "name", toymlx-report's table row) came out split in two."""
    from toymlx_cli.sweep import main as sweep_main

    assert main(["--recipe", "from-scratch", *TINY, "--data.path", data, "--runs-root",
                 str(tmp_path), "--run-id", name, "--steps", "1"]) == 2
    assert error_line(capsys) == (f"toymlx-train: error: --run-id: expected a single folder "
                                  f"name, found {name!r}")
    assert sweep_main(["--recipe", "from-scratch", "--grid", "lr=1e-3", "--runs-root",
                       str(tmp_path), "--sweep-id", name, "--no-progress"]) == 2
    assert error_line(capsys, "toymlx-sweep") == (f"toymlx-sweep: error: --sweep-id: expected "
                                                  f"a single folder name, found {name!r}")
    assert list(tmp_path.iterdir()) == []
