"""Kill at any instant: a SIGKILLed toymlx-train leaves a bundle that loads and resumes.

The killing is done by `scripts/kill_test.py` (run here as a subprocess; `--kills 50` for long
runs): a real `toymlx-train --recipe from-scratch` checkpointing every step is killed mid-write,
right after a new checkpoint, at random times and during resume start-up, and after every kill
`latest`, every checkpoint, its resume state and events.jsonl are checked, and the next
`--resume` must start from `latest`'s step.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import end_child
from toymlx_cli.train import main

from toymlx.backend.stop import REPEAT_S
from toymlx.bundle.checkpoint import REWIND, list_checkpoints, resolve_latest
from toymlx.bundle.events import read_events
from toymlx.gguf.llama import load_llama
from toymlx.runner.bundle import Bundle
from toymlx.runner.report import summarize

REPO = Path(__file__).resolve().parents[1]
TINY = ["--model.d-model", "32", "--model.n-layers", "1", "--model.n-heads", "4",
        "--model.n-kv-heads", "2", "--model.ffn-dim", "64", "--model.context", "64",
        "--seq-len", "32", "--batch-size", "2", "--eval-batches", "1", "--no-compile",
        "--no-progress"]


def _kill_test(tmp_path: Path, kills: int, seed: int) -> dict:
    summary = tmp_path / "kills.json"
    cmd = [sys.executable, str(REPO / "scripts" / "kill_test.py"), "--kills", str(kills),
           "--seed", str(seed), "--root", str(tmp_path / "runs"), "--json", str(summary)]
    p = subprocess.run(cmd, capture_output=True, check=False, text=True, timeout=1800, cwd=REPO)
    print(p.stdout)
    assert summary.exists(), p.stdout + p.stderr[-3000:]
    s = json.loads(summary.read_text())
    assert not s["failures"], json.dumps(s["failures"], indent=1)[:4000]
    assert p.returncode == 0, p.stdout + p.stderr[-2000:]
    assert s["kills_made"] == kills and s["kills_survived"] == kills
    assert s["final_resume"]["end"]["reason"] == "completed"
    return s


def test_kill_at_any_instant(tmp_path, shared_file):
    shared_file("text/tinystories_sample.txt")  # what scripts/kill_test.py trains on
    s = _kill_test(tmp_path, kills=6, seed=0)
    assert s["resumes_checked"] >= 2  # resumed runs that reached run_start before the kill


@pytest.mark.slow
def test_kill_at_any_instant_many(tmp_path, shared_file):
    shared_file("text/tinystories_sample.txt")  # what scripts/kill_test.py trains on
    s = _kill_test(tmp_path, kills=40, seed=1)
    assert s["mid_write"] >= 1  # at least one kill left a half-written file behind
    assert set(s["modes"]) == {"tmp", "new-gguf", "after-ckpt", "startup"}


@pytest.mark.slow
@pytest.mark.parametrize(("config", "sig", "shared"), [
    ("from-scratch", "KILL", "text/tinystories_sample.txt"),
    ("lora", "INT", "models/stories260K.gguf"),
])
def test_a_run_stopped_and_resumed_again_and_again_ends_bit_exact(tmp_path, shared_file, config,
                                                                   sig, shared):
    """scripts/kill_exact.py: stopped at start, mid-step, mid-validation and mid-checkpoint,
    resumed each time, the run's losses, final tensors and optimizer state equal an
    uninterrupted run's bit for bit. A stop can miss its moment on a busy machine (a LoRA
    adapter's checkpoint is on disk for about a millisecond): then the whole check runs again
    with other moments, each attempt bit-exact, until one has made all four stops (3 at most)."""
    shared_file(shared)
    made = []
    for seed in range(3):
        summary = tmp_path / f"exact{seed}.json"
        cmd = [sys.executable, str(REPO / "scripts" / "kill_exact.py"), config, "--kills", "4",
               "--signal", sig, "--seed", str(seed), "--root", str(tmp_path / f"runs{seed}"),
               "--json", str(summary)]
        p = subprocess.run(cmd, capture_output=True, check=False, text=True, timeout=1800,
                           cwd=REPO)
        assert summary.exists(), p.stdout + p.stderr[-3000:]
        s = json.loads(summary.read_text())
        assert s["differences"] == [], p.stdout
        assert s["final_rc"] == 0 and p.returncode == 0
        made = [k["mode"] for k in s["kills"] if "exited" not in k]
        if len(made) == 4:
            break
    assert made == ["startup", "step", "eval", "checkpoint"]


def _moved_out(events: Path, line: int) -> str:
    """What a resume says of the garbled `line` of `events` it moved out."""
    return (f"{events}: line {line}: expected an event (one JSON object a line), found a "
            "garbled line that no kill or resume explains: the file was damaged; moved to "
            "events.superseded.jsonl")


def test_resume_after_a_torn_event_line(tmp_path, shared_file, capsys):
    """A kill mid-emit leaves half a line; the resumed run's events must still be readable. A
    garbled line no kill leaves (damage) is named as the resume moves it out; the torn one is
    not."""
    data = str(shared_file("text/tinystories_sample.txt"))
    run = tmp_path / "r"
    assert main(["--recipe", "from-scratch", *TINY, "--steps", "6", "--stop-at", "3",
                 "--checkpoint-every", "1", "--data.path", data, "--runs-root", str(tmp_path),
                 "--run-id", "r"]) == 0
    events = run / "events.jsonl"
    lines = events.read_bytes().splitlines(keepends=True)
    at = next(i for i, x in enumerate(lines) if b'"checkpoint"' in x)  # step 1's checkpoint
    lines[at] = lines[at][:30] + b"\x00" * 8 + lines[at][38:]
    lines[-1] = lines[-1][: len(lines[-1]) // 2]  # the run_end line, torn
    events.write_bytes(b"".join(lines))
    capsys.readouterr()
    assert main(["--resume", str(run), "--no-progress"]) == 0
    damage = _moved_out(events, at + 1)
    assert damage in capsys.readouterr().err
    ev = read_events(run)
    assert [e["kind"] for e in ev].count("run_start") == 1
    (res,) = [e for e in ev if e["kind"] == "resume"]
    assert res["from_step"] == 3 and res["previous_end"] == "torn"  # its run_end was torn
    assert res["note"] == damage  # the torn run_end line is not named
    assert res["damaged_lines"] == [at + 1]  # the file holds no other trace of it
    with pytest.warns(UserWarning) as said:  # toymlx-report, later, still says it
        summarize([run])
    assert [str(w.message) for w in said] == [
        (f"{events}: line {at + 1} as it stood before the resume from step 3: a garbled line "
         "that no kill or resume explains, moved to events.superseded.jsonl: the file was "
         "damaged")]
    assert [e["step"] for e in ev if e["kind"] == "step"] == [1, 2, 3, 4, 5, 6]
    assert ev[-1]["kind"] == "run_end" and ev[-1]["reason"] == "completed"
    assert ev[-1]["final_step"] == 6
    load_llama(resolve_latest(run))
    # step 5's line garbled in place: a resume refuses the gap, naming the line
    lines = events.read_bytes().splitlines(keepends=True)
    at = next(i for i, x in enumerate(lines) if b'"step": 5,' in x and b'"kind": "step"' in x)
    lines[at] = lines[at][:10] + b"\x00" * 4 + lines[at][14:]
    events.write_bytes(b"".join(lines))
    capsys.readouterr()
    assert main(["--resume", str(run), "--steps", "8", "--no-progress"]) == 2
    assert capsys.readouterr().err == (
        f"toymlx-train: error: {events}: --resume: expected each step once up to the "
        f"checkpoint's step 6, found no step 5 (line {at + 1} garbled: the file was damaged); "
        "resuming would leave step 5 missing for good: put the run's events.jsonl back, or go "
        "on from a checkpoint before it with --from step_4\n")


def test_a_resume_line_edited_by_hand_is_damage_not_a_restart(tmp_path, shared_file, capsys):
    """A resume event whose from_step was edited into text still parses: the next resume
    stopped on "invalid literal for int() with base 10: 'x'"; it is damage like a garbled
    line, named and moved out as one, and the run goes on to its end."""
    data = str(shared_file("text/tinystories_sample.txt"))
    run = tmp_path / "r"
    assert main(["--recipe", "from-scratch", *TINY, "--steps", "6", "--stop-at", "2",
                 "--checkpoint-every", "1", "--data.path", data, "--runs-root", str(tmp_path),
                 "--run-id", "r"]) == 0
    assert main(["--resume", str(run), "--stop-at", "4", "--no-progress"]) == 0
    events = run / "events.jsonl"
    lines = events.read_bytes().splitlines(keepends=True)
    at = next(i for i, x in enumerate(lines) if b'"kind": "resume"' in x)
    lines[at] = lines[at].replace(b'"from_step": 2', b'"from_step": "x"')
    events.write_bytes(b"".join(lines))
    capsys.readouterr()
    assert main(["--resume", str(run), "--no-progress"]) == 0
    damage = _moved_out(events, at + 1)
    assert f"toymlx-train: {damage}\n" in capsys.readouterr().err
    ev = read_events(run)
    assert [e["from_step"] for e in ev if e["kind"] == "resume"] == [4]
    assert [e["step"] for e in ev if e["kind"] == "step"] == [1, 2, 3, 4, 5, 6]
    assert ev[-1]["kind"] == "run_end" and ev[-1]["reason"] == "completed"
    assert b'"from_step": "x"' in (run / "events.superseded.jsonl").read_bytes()


def _signal_args(shared_file, root: Path) -> list[str]:
    return ["--recipe", "from-scratch", *TINY, "--steps", "600", "--checkpoint-every", "1000",
            "--eval-every", "0", "--data.path", str(shared_file("text/tinyshakespeare.txt")),
            "--runs-root", str(root)]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, shared_file):
    """The losses of the first n steps of the 600-step run never stopped, as `losses(n)`: a run
    of the same options stopped at n (`--stop-at`: the same schedule), made once, to 40 steps
    or the longest n asked beyond them. The resumed runs are compared over the steps after their stop,
    not all 600 (~10 s of steps per run on 2 busy cores)."""
    root = tmp_path_factory.mktemp("sig")
    made: list[float] = []

    def losses(n: int) -> list[float]:
        if len(made) < n:
            run_id = f"full-{max(n, 40)}"
            assert main([*_signal_args(shared_file, root), "--stop-at", run_id[5:],
                         "--run-id", run_id]) == 0
            made[:] = [e["loss"] for e in read_events(root / run_id) if e["kind"] == "step"]
        return made[:n]

    return losses


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_mid_step_checkpoints_the_step_it_names(tmp_path, shared_file, uninterrupted,
                                                         sig):
    """SIGTERM/Ctrl-C mostly land inside a step, after its update began: the checkpoint of
    step N once held step N+1's weights, so the resumed losses drifted from an uninterrupted
    run. Now the step finishes first and the resume is exact."""
    exe = Path(sys.executable).parent / "toymlx-train"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "toymlx_cli.train"]
    # 600 steps of ~5 ms: the signal lands mid-run even when this poll is slow (with 300, one
    # run in ~8 under heavy outside load failed here, its message unrecorded)
    p = subprocess.Popen(cmd + _signal_args(shared_file, tmp_path) + ["--run-id", "part"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    events = tmp_path / "part" / "events.jsonl"
    t0 = time.monotonic()
    while b'"step": 8,' not in (events.read_bytes() if events.exists() else b""):
        assert p.poll() is None, f"the run ended before step 8: {p.stderr.read()[-2000:]}"
        assert time.monotonic() - t0 < 300
        time.sleep(0.005)
    p.send_signal(sig)
    _, err = p.communicate(timeout=300)
    assert p.returncode == 128 + sig, err[-2000:]  # the shell's convention: 143, 130
    end = read_events(tmp_path / "part")[-1]
    assert end["reason"] == "interrupted" and 8 <= end["final_step"] < 600, end
    assert (end["exit_code"], end["signal"]) == (128 + sig, sig.name), end
    assert [s for s, _ in list_checkpoints(tmp_path / "part" / "weights")] == [end["final_step"]]
    until = min(end["final_step"] + 10, 600)  # a checkpoint of the wrong step tells at its next step
    assert main(["--resume", str(tmp_path / "part"), "--stop-at", str(until),
                 "--no-progress"]) == 0
    resumed = [e["loss"] for e in read_events(tmp_path / "part") if e["kind"] == "step"]
    assert len(resumed) == until
    assert max(abs(a - b) for a, b in zip(resumed, uninterrupted(until))) <= 1e-6


def test_one_signal_sent_to_the_run_and_its_group_at_once_keeps_the_final_checkpoint(
        tmp_path, shared_file):
    """`timeout 600 toymlx-train ...` sends its SIGTERM to the command and then to the
    command's process group, microseconds apart: counted as two requests, the second left the
    run at once, "without finishing it; no checkpoint was written", in about half the runs.
    One signal sent twice at once (`REPEAT_S`) is one request: the step in flight finishes
    and its checkpoint is written, every time."""
    exe = Path(sys.executable).parent / "toymlx-train"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "toymlx_cli.train"]
    for i in range(3):  # the main job's steps (~0.2 s): the signals come while one is evaluated
        p = subprocess.Popen(cmd + ["--recipe", "vit-tiny", "--steps", "400", "--eval-every",
                                    "0", "--no-progress", "--runs-root", str(tmp_path),
                                    "--run-id", f"t{i}"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             start_new_session=True)  # a group of its own, as timeout's
        events = tmp_path / f"t{i}" / "events.jsonl"
        t0 = time.monotonic()
        try:
            while b'"step": 3,' not in (events.read_bytes() if events.exists() else b""):
                assert p.poll() is None, f"the run ended before step 3: {p.stderr.read()[-2000:]}"
                assert time.monotonic() - t0 < 300
                time.sleep(0.005)
            os.kill(p.pid, signal.SIGTERM)  # as coreutils' timeout: the command, then its group
            os.killpg(p.pid, signal.SIGTERM)
            _, err = p.communicate(timeout=300)
        finally:
            end_child(p)
        assert p.returncode == 143, err[-2000:]
        end = read_events(tmp_path / f"t{i}")[-1]
        assert end["message"] == ("stopped by SIGTERM; resume "
                                  f"with --resume {tmp_path / f't{i}'}"), end
        assert [s for s, _ in list_checkpoints(tmp_path / f"t{i}" / "weights")] == [
            end["final_step"]]


MID = ["--recipe", "from-scratch", "--model.d-model", "256", "--model.n-layers", "3",
       "--model.n-heads", "4", "--model.n-kv-heads", "2", "--model.ffn-dim", "768",
       "--model.context", "64", "--seq-len", "32", "--batch-size", "2", "--eval-every", "0",
       "--no-compile", "--no-progress", "--steps", "100000"]


@pytest.mark.parametrize("second", ["at-once", "mid-write", "after-0.5s"])
def test_a_second_ctrl_c_never_ends_in_a_traceback(tmp_path, shared_file, second):
    """Ctrl-C twice: the first stops after the step in flight and writes a final checkpoint,
    the second skips that checkpoint if it has not begun (or, come while the step is
    evaluated, leaves at once without it), or lets a begun one finish (2.5M parameters: ~30 MB
    written, so `mid-write` lands inside it). Every way: exit 130, no traceback, run_end last,
    and `latest` a verified checkpoint the run resumes from."""
    from toymlx.bundle.checkpoint import open_checkpoint

    run = tmp_path / "r"
    exe = Path(sys.executable).parent / "toymlx-train"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "toymlx_cli.train"]
    # mid-write: no periodic checkpoint, so the one written after the first Ctrl-C is the
    # final one, always; else one every 4 steps for the skipped final one to fall back on
    every = "1000000" if second == "mid-write" else "4"
    p = subprocess.Popen(cmd + MID + ["--checkpoint-every", every, "--data.path",
                                      str(shared_file("text/tinyshakespeare.txt")),
                                      "--runs-root", str(tmp_path), "--run-id", "r"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:  # a 100000-step run: never left running when this test fails before it ends
        t0 = time.monotonic()
        ready = ((lambda: any(e["kind"] == "step" and e["step"] >= 4 for e in read_events(run)))
                 if second == "mid-write" else (run / "weights" / "step_4.gguf").exists)
        while not ready():
            assert p.poll() is None, p.stderr.read()[-3000:]
            assert time.monotonic() - t0 < 300
            time.sleep(0.01)
        time.sleep(0.1)
        p.send_signal(signal.SIGINT)
        caught = None
        if second == "at-once":
            p.send_signal(signal.SIGINT)
        elif second == "after-0.5s":  # a second request (REPEAT_S): "at-once" is one
            time.sleep(0.5)
            p.send_signal(signal.SIGINT)
        else:
            while p.poll() is None and caught is None:
                if any(".tmp-" in f.name for f in (run / "weights").iterdir()):
                    p.send_signal(signal.SIGINT)
                    caught = time.monotonic()
                time.sleep(0.0005)
        _, err = p.communicate(timeout=300)
    finally:
        end_child(p)
    assert p.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    end = read_events(run)[-1]
    assert end["kind"] == "run_end" and end["reason"] == "interrupted", end
    latest = resolve_latest(run)
    open_checkpoint(latest)
    step = int(latest.name[len("step_"):-len(".gguf")])
    if "skipped its checkpoint" in end["message"]:
        assert step < end["final_step"] and step % 4 == 0
    elif "left at once" in end["message"]:  # the second came while a step was evaluated
        assert step <= end["final_step"] and step % 4 == 0
    else:
        assert step == end["final_step"]
    if second == "mid-write":
        assert caught is not None, "the final checkpoint write was never seen in flight"
        assert step == end["final_step"]  # a write begun is finished
    assert not [f for f in (run / "weights").iterdir() if ".tmp-" in f.name]
    assert main(["--resume", str(run), "--steps", str(end["final_step"] + 1)]) == 0
    assert read_events(run)[-1]["final_step"] == end["final_step"] + 1


class _Killed(BaseException):
    """A kill -9 in place of one file operation (no handler runs for it but `finally`)."""


_FILE_OPS = ("replace", "rename", "unlink", "symlink", "fsync")
"""The calls that change a bundle on disk (an append is made durable by its fsync)."""


def _outcome(run: Path) -> dict:
    """What a resumed run ends with: its figures, its resume event's account of the cut, and
    the files the cut set aside (bytes)."""
    ev = read_events(run)
    (res,) = [e for e in ev if e["kind"] == "resume"]
    aside = run / "weights" / "superseded"
    return {"losses": [(e["kind"], e["step"], e.get("loss", e.get("val_loss"))) for e in ev
                       if e["kind"] in ("step", "eval")],
            "end": {k: ev[-1][k] for k in ("kind", "reason", "final_step", "final_loss")},
            "resume": {k: res.get(k) for k in ("from_step", "set_aside", "dropped_events",
                                               "previous_end", "note")},
            "superseded": (run / "events.superseded.jsonl").read_bytes(),
            "weights": sorted(p.name for p in (run / "weights").iterdir()),
            "aside": sorted(p.name for p in aside.iterdir()) if aside.is_dir() else []}


@pytest.mark.parametrize("back_to", [2, 0])
def test_a_cut_back_killed_at_each_file_operation_reads_as_made_and_the_next_resume_ends_it(
        tmp_path, shared_file, monkeypatch, back_to):
    """`--resume --from step_2` cuts the bundle back (latest, later checkpoints, events): a kill
    after the events were cut and before `latest` moved left `latest` naming step_4, which
    toymlx-eval RUN then scored, and a plain --resume refused the record. Killed at each file
    operation of the cut now, the bundle reads as it was (no cut begun) or as cut (latest's
    reader takes step_2; step_0: no checkpoint), and the next resume (the same command, or a
    plain --resume) ends with the uninterrupted resume's losses, account and files."""
    data = str(shared_file("text/tinystories_sample.txt"))
    made = tmp_path / "made" / "r"
    assert main(["--recipe", "from-scratch", *TINY, "--steps", "4", "--warmup", "0",
                 "--checkpoint-every", "2", "--data.path", data, "--runs-root",
                 str(made.parent), "--run-id", "r"]) == 0
    events = (made / "events.jsonl").read_bytes()
    again = ["--from", f"step_{back_to}", "--no-progress"]

    def copy(name: str) -> Path:
        return Path(shutil.copytree(made, tmp_path / name / "r", symlinks=True))

    whole = copy("whole")
    assert main(["--resume", str(whole), *again]) == 0
    want = _outcome(whole)
    assert want["resume"]["set_aside"] == [s for s in (2, 4) if s > back_to]

    kill = {"armed": False, "left": 0}

    def killing(name: str, op):
        def call(*a, **k):
            if kill["armed"]:
                if kill["left"] == 0:
                    raise _Killed(name)
                kill["left"] -= 1
            return op(*a, **k)
        return call

    for name in _FILE_OPS:
        monkeypatch.setattr(os, name, killing(name, getattr(os, name)))
    rewind = Bundle.rewind

    def armed(self, *a):
        kill["armed"] = True
        try:
            return rewind(self, *a)
        finally:
            kill["armed"] = False

    monkeypatch.setattr(Bundle, "rewind", armed)
    at = 0
    while True:
        run = copy(f"kill{at}")
        kill["left"] = at
        try:
            assert main(["--resume", str(run), *again]) == 0
            break  # the cut made all its operations: no kill left to try
        except _Killed:
            kill["left"] = -1  # the next process lives
        if (run / REWIND).exists():  # begun: read as made
            if back_to:
                assert resolve_latest(run) == run / "weights" / f"step_{back_to}.gguf"
            else:
                with pytest.raises(FileNotFoundError, match=(
                        "found no checkpoint: .*rewinding.json: a resume --from step_0 was "
                        "stopped while it cut the run back to step_0 .the run starts over.; "
                        f"toymlx-train --resume {run} finishes the cut$")):
                    resolve_latest(run)
        else:  # not begun (the record stays until the resume event holds the cut)
            assert (run / "events.jsonl").read_bytes() == events
            assert os.readlink(run / "weights" / "latest") == "step_4.gguf"
        plain = (run / REWIND).exists() and at % 2
        assert main(["--resume", str(run), *([] if plain else again)]) == 0
        got = _outcome(run)
        if plain:  # said once, before the first step
            note = (f"{run / REWIND}: a resume --from step_{back_to} was stopped while it cut "
                    f"the run back: finishing the cut, the run resumes from step_{back_to}")
            assert got["resume"].pop("note") == note
            assert got["resume"].pop("from_step") == want["resume"]["from_step"]
            got["resume"] = {**got["resume"], "note": want["resume"]["note"],
                             "from_step": want["resume"]["from_step"]}
        assert got == want, at
        assert not (run / REWIND).exists()
        at += 1
    assert at >= 10  # the record, latest, the checkpoints set aside, the events' copy and cut


def test_a_full_disk_in_the_cut_back_says_what_it_left_and_the_next_resume_ends_it(
        tmp_path, shared_file, capsys, monkeypatch):
    """A full disk while `--resume --from` cut the run back ended in a bare "[Errno 28] No
    space left on device" (events.superseded.jsonl's append named no file), a half-written
    line left in that file. Now the line names the file and what the bundle is (unchanged, or
    read as cut), the append is cut off again, and once there is room the next resume ends
    with the uninterrupted one's losses."""
    import errno

    from toymlx.runner import bundle as run_bundle

    data = str(shared_file("text/tinystories_sample.txt"))
    made = tmp_path / "made" / "r"
    assert main(["--recipe", "from-scratch", *TINY, "--steps", "4", "--warmup", "0",
                 "--checkpoint-every", "2", "--data.path", data, "--runs-root",
                 str(made.parent), "--run-id", "r"]) == 0
    (made / "events.superseded.jsonl").write_bytes(b'{"kind": "step"}\n')  # an earlier cut's
    runs = {name: Path(shutil.copytree(made, tmp_path / name / "r", symlinks=True))
            for name in ("whole", "record", "append")}
    assert main(["--resume", str(runs["whole"]), "--from", "step_2", "--no-progress"]) == 0
    full = OSError(errno.ENOSPC, "No space left on device")

    def no_room(path, text):
        raise OSError(full.errno, full.strerror, str(path))

    monkeypatch.setattr(run_bundle.atomic, "write_text", no_room)
    capsys.readouterr()
    run = runs["record"]
    assert main(["--resume", str(run), "--from", "step_2", "--no-progress"]) == 2
    assert capsys.readouterr().err == (
        f"toymlx-train: error: {run}: --resume: could not cut the run back to step_2 ([Errno 28] "
        f"No space left on device: '{run / REWIND}'); nothing was changed: make room (or make it "
        "writable) and run the same command again\n")
    assert os.readlink(run / "weights" / "latest") == "step_4.gguf"
    monkeypatch.undo()
    write = os.write

    def half(fd, data):  # the cut's append alone writes through os.write
        write(fd, bytes(data[:10]))
        raise full

    monkeypatch.setattr(os, "write", half)
    run = runs["append"]
    assert main(["--resume", str(run), "--from", "step_2", "--no-progress"]) == 2
    monkeypatch.undo()
    aside = run / "events.superseded.jsonl"
    assert capsys.readouterr().err == (
        f"toymlx-train: error: {run}: --resume: could not cut the run back to step_2 ([Errno 28] "
        f"No space left on device: '{aside}'); it reads as cut back (rewinding.json): make room "
        f"(or make it writable), then toymlx-train --resume {run} finishes the cut\n")
    assert aside.read_bytes() == b'{"kind": "step"}\n'  # its 10 bytes cut off again
    assert resolve_latest(run) == run / "weights" / "step_2.gguf"
    with pytest.warns(UserWarning) as said:  # toymlx-report says the cut is under way
        summarize([run])
    assert [str(w.message) for w in said] == [(
        f"{run / REWIND}: a resume --from step_2 was stopped while it cut the run back to "
        "step_2 (its checkpoint, as every reader takes it): its row shows the record as the cut "
        f"left it; toymlx-train --resume {run} finishes the cut")]
    assert main(["--resume", str(run), "--from", "step_4", "--no-progress"]) == 2
    assert capsys.readouterr().err == (
        f"toymlx-train: error: {run / REWIND}: --from step_4: expected step_2 or an earlier "
        "checkpoint: a resume --from step_2 was stopped while it cut the run back, part of what "
        "followed step_2 is set aside; resume with --from step_2, or an earlier step\n")
    record = (run / REWIND).read_bytes()
    (run / REWIND).write_bytes(b"{}")  # not one toymlx wrote: named, not taken as no cut
    with pytest.raises(ValueError, match=(
            f"^{run / REWIND}: expected the cut-back of an interrupted resume --from .keys step, "
            "set_aside, .*found b'{}'; remove it, then resume with --from the step that resume "
            "went back to$")):
        resolve_latest(run)
    (run / REWIND).write_bytes(record)
    for name in ("record", "append"):
        assert main(["--resume", str(runs[name]), "--from", "step_2", "--no-progress"]) == 0
        assert _outcome(runs[name]) == _outcome(runs["whole"])


@pytest.mark.parametrize("resumed", [False, True])
def test_a_stop_in_the_validation_at_step_0_leaves_no_new_run(tmp_path, shared_file, capsys,
                                                               monkeypatch, resumed):
    """A SIGTERM during --eval-at-start's pass (the loop has begun: run_start is written) kept
    the new run's folder, its run_end "interrupted ... before step 1, nothing trained", where
    docs/RUNS.md says a stop before the first step removes it: the same command then refused
    the folder. Now it goes, with the line a stop before the loop gives; a resumed run (here
    --from step_0) keeps its folder and record."""
    from toymlx.training.evaluate import Evaluator

    data = str(shared_file("text/tinystories_sample.txt"))
    run = tmp_path / "r"
    cmd = ["--recipe", "from-scratch", *TINY, "--steps", "2", "--data.path", data,
           "--runs-root", str(tmp_path), "--run-id", "r", "--eval-at-start"]
    if resumed:  # validated at step 0 by the resume alone
        assert main(cmd[:-1]) == 0
    evaluate = Evaluator.__call__

    def stopped(self, *a, **k):
        os.kill(os.getpid(), signal.SIGTERM)
        return evaluate(self, *a, **k)

    monkeypatch.setattr(Evaluator, "__call__", stopped)
    capsys.readouterr()
    assert main(["--resume", str(run), "--from", "step_0", "--eval-at-start", "--no-progress"]
                if resumed else cmd) == 143
    err = capsys.readouterr().err.splitlines()[-1]
    if resumed:
        end = read_events(run)[-1]
        assert (end["reason"], end["final_step"], end["signal"]) == ("interrupted", 0, "SIGTERM")
        assert err.startswith("toymlx: interrupted at step 0: stopped by SIGTERM before step 1")
        return
    assert err == "toymlx-train: stopped by SIGTERM before the first step; nothing was trained"
    assert not run.exists()
    monkeypatch.setattr(Evaluator, "__call__", evaluate)
    assert main(cmd) == 0  # the same command starts it


def test_a_resume_that_changes_steps_says_the_schedule_moved(tmp_path, shared_file, capsys):
    """--steps extended on a completed run: the cosine schedule spans the new total, so the
    learning rate jumped back up (3.0e-05 at the old last step to 1.6e-04 on vit-tiny, 20 ->
    40 steps) with no word. Now one line names both rates; the losses are unchanged."""
    data = str(shared_file("text/tinystories_sample.txt"))
    run = tmp_path / "r"
    assert main(["--recipe", "from-scratch", *TINY, "--steps", "4", "--warmup", "0",
                 "--checkpoint-every", "2", "--data.path", data, "--runs-root", str(tmp_path),
                 "--run-id", "r"]) == 0
    capsys.readouterr()
    assert main(["--resume", str(run), "--steps", "8", "--no-progress"]) == 0
    lr = {e["step"]: e["lr"] for e in read_events(run) if e["kind"] == "step"}
    assert lr[5] > 3 * lr[4]  # the old schedule's end against the new one's middle
    assert (f"step 5: --steps 8 (the run had 4): the learning-rate schedule now spans 8 steps, "
            f"so step 5 trains at lr {lr[5]:.3e}, where step 4 trained at {lr[4]:.3e}"
            ) in capsys.readouterr().out.splitlines()
    assert main(["--resume", str(run), "--steps", "9", "--from", "step_8", "--no-progress"]) == 0
    assert "the learning-rate schedule now spans 9 steps" in capsys.readouterr().out


# ------------------------------------------------------------- a stop while MLX builds kernels
COLD = ["--recipe", "from-scratch", *[a for a in TINY if a != "--no-compile"], "--steps", "3",
        "--eval-every", "0"]
"""A compiled run: its first step builds MLX's CPU kernels, tens of them, in a fresh folder."""


def _compiling(pid: int) -> bool:
    """Whether g++'s compiler proper (cc1plus) runs under process `pid`: MLX is building a
    kernel inside a step, and the shell it started the build with waits for it (a signal in
    the instant that shell starts ends it, and the step fails: `CutShort`)."""
    todo = [str(pid)]
    while todo:
        for task in Path(f"/proc/{todo.pop()}/task").glob("*"):
            try:
                children = (task / "children").read_text().split()
            except OSError:
                continue
            for child in children:
                try:
                    if Path(f"/proc/{child}/comm").read_text().strip() == "cc1plus":
                        return True
                except OSError:
                    continue
                todo.append(child)
    return False


def _compilers_in(folder: Path) -> list[str]:
    """The processes still building a kernel in `folder` (a run that left them behind)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes()
        except OSError:
            continue
        if b"g++" in text and str(folder).encode() in text:
            found.append(cmdline.parent.name)
    return found


class _Cold:
    """`COLD` started in a fresh kernel folder (its own process group, as a terminal's job),
    once its first step is building a kernel; its output's lines are read as they come."""

    def __init__(self, tmp_path: Path, shared_file):
        import os
        import threading

        (tmp_path / "tmp").mkdir()
        self.env = {**os.environ, "TOYMLX_KERNEL_CACHE": str(tmp_path / "kernels"),
                    "TMPDIR": str(tmp_path / "tmp")}
        exe = Path(sys.executable).parent / "toymlx-train"
        self.cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "toymlx_cli.train"]
        self.p = p = subprocess.Popen(
            self.cmd + COLD + ["--data.path", str(shared_file("text/tinyshakespeare.txt")),
                               "--runs-root", str(tmp_path), "--run-id", "r"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=self.env,
            start_new_session=True)
        self.out: list[str] = []
        self.err: list[str] = []
        self.readers = [threading.Thread(target=lambda f=f, into=into: into.extend(
            line.rstrip("\n") for line in iter(f.readline, "")), daemon=True)
            for f, into in ((p.stdout, self.out), (p.stderr, self.err))]
        for t in self.readers:
            t.start()
        t0 = time.monotonic()
        # run_start is written just before the loop: a kernel built after it is step 1's
        while not (any(e["kind"] == "run_start" for e in read_events(tmp_path / "r"))
                   and _compiling(p.pid)):
            assert p.poll() is None, self.err[-30:]
            assert time.monotonic() - t0 < 600, "the first step built no kernel"
            time.sleep(0.01)

    def said(self, start: str) -> str:
        """The first line on stdout that starts with `start`, waited for while it runs."""
        t0 = time.monotonic()
        while not (said := [line for line in self.out if line.startswith(start)]):
            assert self.p.poll() is None and time.monotonic() - t0 < 120, self.out
            time.sleep(0.01)
        return said[0]

    def end(self, timeout: float) -> int:
        """Its exit status, once it has ended and its output is read."""
        try:
            self.p.wait(timeout)
        finally:
            if self.p.poll() is None:
                self.p.kill()
                self.p.wait()
        for t in self.readers:
            t.join(60)
        return self.p.returncode


NOTICE = ("step 1: SIGINT came: stopping after this step (MLX is building its CPU kernels: a "
          "cold start; later runs reuse them); a second SIGINT leaves at once, without it")


@pytest.mark.slow  # a cold kernel build in a fresh folder: ~14 s each
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MLX's CPU kernels: g++, Linux")
def test_a_second_ctrl_c_while_the_first_step_builds_kernels_leaves_at_once(tmp_path,
                                                                           shared_file):
    """A cold first step builds MLX's kernels inside one `mx.eval` (ViT-Tiny's: ~50 kernels,
    40 s on 2 cores), where Python runs no signal handler: a Ctrl-C there went unseen until the
    step ended, and a second one was not even counted (Python runs a handler once for signals
    that came together). Now the first is answered at once with what the run waits for, and
    the second leaves at once: nothing was trained, so the new run's folder is removed (the
    same command starts it over), and the kernel being built is finished by its compiler, so
    the restarted run finds every library whole."""
    run = tmp_path / "r"
    cold = _Cold(tmp_path, shared_file)
    cold.p.send_signal(signal.SIGINT)
    assert cold.said("step 1: SIGINT") == NOTICE
    time.sleep(2 * REPEAT_S)  # a person reads the notice: within REPEAT_S it is the same request
    cold.p.send_signal(signal.SIGINT)
    code, err = cold.end(120), "\n".join(cold.err)
    assert code == 130, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    # nothing was trained: the new run's folder goes, and the same command starts it over
    assert cold.err[-1] == "toymlx-train: interrupted before the first step; " \
        "nothing was trained", err[-3000:]
    assert not run.exists()
    t0 = time.monotonic()
    while _compilers_in(tmp_path / "tmp"):  # the build in flight, left to finish
        assert time.monotonic() - t0 < 120
        time.sleep(0.05)
    again = subprocess.run([*cold.cmd, *COLD, "--data.path",
                            str(shared_file("text/tinyshakespeare.txt")), "--runs-root",
                            str(tmp_path), "--run-id", "r", "--no-progress"], env=cold.env,
                           capture_output=True, text=True, timeout=600, check=False)
    assert again.returncode == 0, again.stderr[-3000:]
    assert read_events(run)[-1]["final_step"] == 3


@pytest.mark.slow  # a cold kernel build in a fresh folder: ~14 s each
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MLX's CPU kernels: g++, Linux")
def test_a_terminal_s_ctrl_c_in_a_cold_first_step_spares_mlx_s_kernel_build(tmp_path,
                                                                           shared_file):
    """A terminal's Ctrl-C goes to every process of its job, MLX's kernel build (g++, started
    by the shell) too: the build died and the step failed with MLX's error. toymlx's g++ shim
    now ignores it, so the step ends, its checkpoint is written, and the run stops as after
    any step."""
    import os

    run = tmp_path / "r"
    cold = _Cold(tmp_path, shared_file)
    os.killpg(cold.p.pid, signal.SIGINT)
    code, err = cold.end(600), "\n".join(cold.err)
    assert code == 130, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert NOTICE in cold.out
    end = read_events(run)[-1]
    assert (end["reason"], end["final_step"], end["exit_code"], end["signal"],
            end["message"]) == ("interrupted", 1, 130, "SIGINT",
                                f"by SIGINT (Ctrl-C); resume with --resume {run}")
    assert [s for s, _ in list_checkpoints(run / "weights")] == [1]


def test_signals_that_come_while_the_main_thread_waits_are_each_counted():
    """Python runs a signal's handler in its main thread, once for signals of one kind that
    came while that thread waited in C (a step's `mx.eval`; here a read): two Ctrl-Cs there
    were counted as one request, so the second never skipped the final checkpoint. Each one
    counts now."""
    import os
    import threading

    from toymlx.backend.stop import SOLO_SIGNALS, StopSignals

    done_r, done_w = os.pipe()

    def twice() -> None:  # delivered to this thread while the main one waits in its read
        time.sleep(0.2)
        for _ in range(2):
            signal.pthread_kill(threading.get_ident(), signal.SIGINT)
            time.sleep(2 * REPEAT_S)  # apart: sent at once, they are one request
        os.write(done_w, b"x")

    with StopSignals(SOLO_SIGNALS) as stop:
        t = threading.Thread(target=twice)
        t.start()
        assert os.read(done_r, 1) == b"x"
        t.join()
        assert (stop.count, stop.name, stop.exit_code) == (2, "SIGINT", 130)
    assert stop.count == 2
    os.close(done_r)
    os.close(done_w)


def test_a_call_that_fails_once_a_stop_came_is_cut_short():
    """MLX's kernel build, run by the shell in the terminal's job, dies with the same Ctrl-C
    where toymlx's g++ shim is off (TOYMLX_KERNEL_LOOPS=off), and the step's `mx.eval` raises:
    inside `waiting` that error, after a stop request, is `CutShort`, a stop (no traceback, the
    signal's exit status) that names it; without a request it passes as it is."""
    from toymlx.backend.stop import SOLO_SIGNALS, CutShort, StopSignals

    with StopSignals(SOLO_SIGNALS) as stop:
        with pytest.raises(CutShort) as cut, stop.waiting(lambda: None, lambda: 0):
            signal.raise_signal(signal.SIGTERM)
            raise RuntimeError("[Compile::eval_cpu] Failed to load compiled function")
        assert (cut.value.signum, str(cut.value.cause)) == (
            signal.SIGTERM, "[Compile::eval_cpu] Failed to load compiled function")
        with pytest.raises(RuntimeError, match="its own"), stop.waiting(lambda: None, lambda: 0):
            raise RuntimeError("its own")
    assert stop.count == 1


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MLX's CPU kernels: g++, Linux")
def test_a_kernel_library_a_stop_left_half_written_is_removed(tmp_path, monkeypatch):
    """A Ctrl-C that killed MLX's kernel build halfway left a truncated library in the kernel
    folder, which MLX found there and failed to load in every later run ("file too short").
    Named in the step's error after a stop, that library is removed; a path elsewhere is left
    alone, and another error removes nothing."""
    import mlx.core as mx

    from toymlx.backend import device

    folder = tmp_path / "mlx" / mx.__version__ / "cpu"
    folder.mkdir(parents=True)
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # MLX's kernel folder is $TMPDIR/mlx/...
    lib = folder / "libCf4IBroadcastBDf4OAddAC_VV_f4f4_6142509188972423790_strided_4.so"
    lib.write_bytes(b"\x7fELF")
    error = RuntimeError(f"Could not load C++ shared library {lib}: file too short")
    assert device.drop_unloadable_kernel(error) == str(lib) and not lib.exists()
    other = tmp_path / "libOther.so"
    other.write_bytes(b"\x7fELF")
    assert device.drop_unloadable_kernel(
        RuntimeError(f"Could not load C++ shared library {other}: file too short")) is None
    assert other.exists()
    assert device.drop_unloadable_kernel(
        RuntimeError("[Compile::eval_cpu] Failed to compile function")) is None


_KILLED_AT = {
    "eval": "from toymlx.training.evaluate import Evaluator as At; name = '__call__'",
    "step": "from toymlx.training.trainer import Stepper as At; name = 'step'",
    "checkpoint": "from toymlx.training.trainer import Checkpointer as At; name = 'save'",
}
"""Where `_killed_run` kills toymlx-train: the --eval-at-start pass, the first step (its batch
read, before its update), the first checkpoint (its step's event written)."""


def _killed_run(cmd: list[str], at: str) -> None:
    """Run toymlx-train `cmd` in a child that kills itself with SIGKILL (kill -9: no handler,
    no `finally`) as it enters `_KILLED_AT[at]`."""
    code = (f"import os, signal, sys\n{_KILLED_AT[at]}\n"
            "setattr(At, name, lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL))\n"
            "from toymlx_cli.train import main\nsys.exit(main(sys.argv[1:]))")
    p = subprocess.run([sys.executable, "-c", code, *cmd], capture_output=True, text=True, check=False,
                       timeout=300)
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]


@pytest.mark.parametrize("at", ["eval", "step"])
def test_a_new_run_killed_before_its_first_step_is_started_over_by_the_same_command(
        tmp_path, shared_file, capsys, at):
    """kill -9 (or a power cut) during a new run's --eval-at-start pass or its first step left
    its folder (config.json, run_start, TensorBoard's file), and the same command was refused:
    "run bundle already exists; pass --resume ... (--resume ... --from step_0 to start it
    over)". The folder provably trained nothing, so the same command now starts it over, in
    one line, to the losses of a run never killed; other options, a folder with a step
    trained, or a file of the user's in it are refused as before, nothing removed."""
    data = str(shared_file("text/tinystories_sample.txt"))
    root = tmp_path / "runs"
    run = root / "r"
    # with the tensorboard extra, the killed run's event file goes with it too (the README's
    # install has no extras: the start-over is checked there without it)
    tb = importlib.util.find_spec("tensorboard") is not None
    cmd = ["--recipe", "from-scratch", *TINY, "--steps", "2", "--checkpoint-every", "1",
           "--data.path", data, "--runs-root", str(root), "--run-id", "r", "--eval-at-start",
           *(["--report-to", "tensorboard"] if tb else [])]
    _killed_run(cmd, at)
    assert [e["kind"] for e in read_events(run)] == ["run_start", "eval"][:1 + (at == "step")]
    left = sorted(p.name for p in run.iterdir() if p.name != ".lock")  # the dead one's lock
    assert [n for n in left if not n.startswith("events.out.tfevents.")] == [
        "config.json", "events.jsonl", "weights"], left
    refused = (f"toymlx-train: error: {run}: run bundle already exists; continue it with "
               f"toymlx-train --resume {run} (toymlx-train --resume {run} --from step_0 to start "
               "it over), pass --overwrite to replace it, or choose another --run-id")
    capsys.readouterr()
    assert main([*cmd, "--steps", "3"]) == 2  # other options: not the same run
    assert capsys.readouterr().err.strip() == refused
    assert sorted(p.name for p in run.iterdir() if p.name != ".lock") == left
    (run / "notes.txt").write_text("mine")  # a file of the user's: never removed
    assert main(cmd) == 2
    assert capsys.readouterr().err.strip() == refused
    (run / "notes.txt").unlink()
    assert main(cmd) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0] == (f"toymlx-train: {run}: the run of these same options there was killed "
                      "during its first step or the validation before it, before it trained a "
                      "step (no step in events.jsonl, no checkpoint): starting it over")
    events = read_events(run)
    assert [e["kind"] for e in events].count("run_start") == 1
    assert len(list(run.glob("events.out.tfevents.*"))) == tb  # the killed run's went with it
    assert main([*cmd, "--run-id", "never-killed"]) == 0
    again = [(e["kind"], e.get("step"), e.get("loss", e.get("val_loss"))) for e in events
             if e["kind"] in ("step", "eval")]
    assert again == [(e["kind"], e.get("step"), e.get("loss", e.get("val_loss")))
                     for e in read_events(root / "never-killed") if e["kind"] in ("step", "eval")]
    assert len(again) == 4  # the validations at steps 0 and 2, two steps


def test_a_new_run_killed_after_a_step_is_not_started_over(tmp_path, shared_file, capsys):
    """A killed run with a step trained (here killed as its first checkpoint began) holds what
    a resume goes on from or a user looks at: the same command is refused as before."""
    data = str(shared_file("text/tinystories_sample.txt"))
    run = tmp_path / "r"
    cmd = ["--recipe", "from-scratch", *TINY, "--steps", "2", "--checkpoint-every", "1",
           "--data.path", data, "--runs-root", str(tmp_path), "--run-id", "r"]
    _killed_run(cmd, "checkpoint")
    assert [e["kind"] for e in read_events(run)] == ["run_start", "step"]
    capsys.readouterr()
    assert main(cmd) == 2
    assert capsys.readouterr().err.strip() == (
        f"toymlx-train: error: {run}: run bundle already exists; continue it with toymlx-train "
        f"--resume {run} (toymlx-train --resume {run} --from step_0 to start it over), pass "
        "--overwrite to replace it, or choose another --run-id")
    assert [e["kind"] for e in read_events(run)] == ["run_start", "step"]


def test_a_new_run_stopped_before_its_first_step_removes_the_runs_root_folders_it_made(
        tmp_path, shared_file, capsys, monkeypatch):
    """--runs-root a/b/c, made by the run, stayed (empty) after the run stopped before its first
    step was removed. Now the folders it made go too, each only where empty: a folder that was
    there before, or that holds anything else since, stays."""
    from toymlx.training.evaluate import Evaluator

    data = str(shared_file("text/tinystories_sample.txt"))
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    cmd = ["--recipe", "from-scratch", *TINY, "--steps", "2", "--data.path", data,
           "--runs-root", str(mine / "a" / "b" / "c"), "--run-id", "r", "--eval-at-start"]
    evaluate = Evaluator.__call__

    def stopped(self, *a, **k):
        os.kill(os.getpid(), signal.SIGTERM)
        return evaluate(self, *a, **k)

    monkeypatch.setattr(Evaluator, "__call__", stopped)
    assert main(cmd) == 143
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"]
    (mine / "a").mkdir()
    (mine / "a" / "other.txt").write_text("someone's")  # a/ is not the run's to remove now
    assert main(cmd) == 143
    assert sorted(p.relative_to(mine).as_posix() for p in mine.rglob("*")) == [
        "a", "a/other.txt", "notes.txt"]
