"""Checkpoints that vouch for themselves, and retention: issue 17 cases 7 and 8.

7. a damaged GGUF (bytes overwritten in its tensor data, or cut short) or a state file of
   another checkpoint is named on --resume, with the newest intact checkpoint to go on from;
   a divergence right after a resume checks that checkpoint before blaming the learning rate;
8. --keep-last / --keep-best keep what they say (never what `latest` names).
The disk-full half of case 8 (no state file left without its GGUF) is checked by every test
in test_reliability.py through `assert_bundle_intact`.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from cli_errors import error_line
from toymlx_cli.train import main

from toymlx.bundle import checkpoint as ck
from toymlx.bundle.events import read_events
from toymlx.gguf.reader import DIGEST_KEY, GGUFFile, data_digest
from toymlx.gguf.writer import write_gguf

TINY = ["--model.d-model", "32", "--model.n-layers", "1", "--model.n-heads", "4",
        "--model.n-kv-heads", "2", "--model.ffn-dim", "64", "--model.context", "64",
        "--seq-len", "32", "--batch-size", "2", "--eval-batches", "1", "--no-compile",
        "--no-progress"]


@pytest.fixture(scope="module")
def twenty(tmp_path_factory, shared_file) -> Path:
    """A run of 30 steps stopped at 20, checkpointed every 5."""
    root = tmp_path_factory.mktemp("ck")
    assert main(["--recipe", "from-scratch", *TINY, "--data.path",
                 str(shared_file("text/tinystories_sample.txt")), "--runs-root", str(root),
                 "--run-id", "r", "--steps", "30", "--stop-at", "20", "--checkpoint-every", "5",
                 "--eval-every", "0"]) == 0
    return root / "r"


@pytest.fixture
def run(tmp_path, twenty) -> Path:
    out = tmp_path / "r"
    shutil.copytree(twenty, out, symlinks=True)
    return out


def test_checkpoints_carry_checksums_and_a_shared_id(run):
    for step, path in ck.list_checkpoints(run / "weights"):
        arrays, meta = ck.open_checkpoint(path)
        _, state = ck.load_state(ck.state_path(path))
        assert meta[ck.ID_KEY] == state["checkpoint_id"] and len(state["checkpoint_id"]) == 32
        assert meta[DIGEST_KEY] == data_digest(path, GGUFFile(path).data_start)
        assert state["sha256"] == ck.arrays_digest(arrays) and state["step"] == step
    ids = {ck.open_checkpoint(p)[1][ck.ID_KEY] for _, p in ck.list_checkpoints(run / "weights")}
    assert len(ids) == 4  # one id per checkpoint


def test_overwritten_tensor_data_is_named_with_the_intact_one(run, capsys):
    """4 KB of 0xFF in step 20's tensor data: once accepted (and blamed on the lr)."""
    path = run / "weights" / "step_20.gguf"
    start = GGUFFile(path).data_start
    with open(path, "r+b") as f:
        f.seek(start + 64)
        f.write(b"\xff" * 4096)
    assert main(["--resume", str(run)]) == 2
    line = error_line(capsys)
    assert f"{path}: tensor data: expected sha256 " in line and "the file is damaged" in line
    assert line.endswith(f"the newest intact checkpoint is step_15: toymlx-train --resume "
                         f"{run} --from step_15")
    assert main(["--resume", str(run), "--from", "step_15", "--steps", "22"]) == 0
    ev = read_events(run)
    assert [e["from_step"] for e in ev if e["kind"] == "resume"] == [15]
    assert [e["step"] for e in ev if e["kind"] == "step"] == list(range(1, 23))
    # the damaged step 20 was set aside (not deleted), and rewritten by the resumed run
    assert (run / "weights" / "superseded" / "step_20.gguf").exists()
    ck.open_checkpoint(run / "weights" / "step_20.gguf")


def test_a_truncated_checkpoint_is_named(run, capsys):
    path = run / "weights" / "step_20.gguf"
    path.write_bytes(path.read_bytes()[:-1000])
    assert main(["--resume", str(run)]) == 2
    line = error_line(capsys)
    assert str(path) in line and "truncated" in line and "--from step_15" in line


def test_a_state_file_of_another_checkpoint_is_named(run, capsys):
    """step 5's state copied over step 20's: once resumed silently with mismatched state."""
    w = run / "weights"
    shutil.copy(w / "step_5.state.safetensors", w / "step_20.state.safetensors")
    assert main(["--resume", str(run)]) == 2
    line = error_line(capsys)
    assert f"{w / 'step_20.state.safetensors'}: checkpoint id: expected " in line
    assert "the state file of another checkpoint (step 5)" in line
    assert line.endswith(f"--resume {run} --from step_15")


def test_a_damaged_state_file_is_named(run, capsys):
    w = run / "weights"
    state = w / "step_20.state.safetensors"
    raw = bytearray(state.read_bytes())
    raw[-100:] = b"\x7f" * 100  # inside the last array's bytes
    state.write_bytes(bytes(raw))
    assert main(["--resume", str(run)]) == 2
    line = error_line(capsys)
    assert f"{state}: array data: expected sha256" in line and "--from step_15" in line


def test_a_checkpoint_with_non_finite_weights_is_refused_before_the_first_step(run, capsys):
    """A checkpoint whose checksum holds (rewritten with its id) but whose weights are not
    finite: refused when it is loaded, naming the tensor, with the intact one to go on from
    (it once trained a step and ended as diverged)."""
    path = run / "weights" / "step_20.gguf"
    g = GGUFFile(path)
    meta = {k: v for k, v in g.metadata.items() if k != DIGEST_KEY}
    tensors = {n: g.load(n) for n in g.tensors}
    tensors["blk.0.ffn_down.weight"] = np.full_like(tensors["blk.0.ffn_down.weight"], np.inf)
    n = tensors["blk.0.ffn_down.weight"].size
    write_gguf(path, meta, tensors, types=g.metadata_types)
    g.close()
    ck.open_checkpoint(path)  # verifies: the damage is not in the bytes
    assert main(["--resume", str(run)]) == 2
    assert error_line(capsys) == (
        f"toymlx-train: error: {path}: tensor 'blk.0.ffn_down.weight' (block 0): expected "
        f"finite values, found +Inf in {n} of {n} (the first, inf, at (0, 0)); the file is "
        "damaged or was written from a model that diverged: use another copy of it; the newest "
        f"intact checkpoint is step_15: toymlx-train --resume {run} --from step_15")
    assert not any(e["kind"] == "step" and e["step"] > 20 for e in read_events(run))


def test_keep_last_and_keep_best_keep_what_they_say(tmp_path, shared_file):
    root = tmp_path
    assert main(["--recipe", "from-scratch", *TINY, "--data.path",
                 str(shared_file("text/tinystories_sample.txt")), "--runs-root", str(root),
                 "--run-id", "k", "--steps", "14", "--lr", "3e-2", "--warmup", "0",
                 "--checkpoint-every", "1", "--eval-every", "1", "--keep-last", "3",
                 "--keep-best", "2"]) == 0
    run = root / "k"
    ev = read_events(run)
    val = {e["step"]: e["val_loss"] for e in ev if e["kind"] == "eval"}
    best = sorted(val, key=val.get)[:2]
    have = [s for s, _ in ck.list_checkpoints(run / "weights")]
    assert set(have) == {12, 13, 14} | set(best), (have, best, val)
    removed = [s for e in ev if e["kind"] == "checkpoint" for s in e.get("removed", [])]
    assert sorted(removed + have) == list(range(1, 15))  # each removed once, nothing else
    assert ck.resolve_latest(run).name == "step_14.gguf"
    assert sorted(p.name for p in (run / "weights").iterdir()) == sorted(
        ["latest"] + [f"step_{s}{x}" for s in have for x in (".gguf", ".state.safetensors")])


def test_retention_never_removes_what_latest_names(tmp_path):
    w = tmp_path
    for s in (1, 2, 3):
        (w / f"step_{s}.gguf").write_bytes(b"g")
        (w / f"step_{s}.state.safetensors").write_bytes(b"s")
        (w / f"step_{s}.warm.safetensors").write_bytes(b"w")
    ck.update_latest(w, w / "step_1.gguf")  # as after a resume from step 1
    keep = ck.retained([1, 2, 3], 3, keep_last=1, keep_best=0, scores={})
    assert keep == {3}
    assert ck.prune(w, keep) == [2]
    assert sorted(p.name for p in w.iterdir()) == [
        "latest", "step_1.gguf", "step_1.state.safetensors", "step_1.warm.safetensors",
        "step_3.gguf", "step_3.state.safetensors", "step_3.warm.safetensors"]
    # the best by validation loss can be old ones; unscored checkpoints are never "best"
    scores = {1: 0.5, 2: 0.1, 3: 0.9, 4: 0.2, 5: 0.8}
    assert ck.retained(range(1, 7), 6, keep_last=2, keep_best=2, scores=scores) == {2, 4, 5, 6}
    assert ck.retained(range(1, 7), 6, keep_last=0, keep_best=1, scores=scores) == {2, 6}


def test_a_checkpoint_removed_by_a_training_run_is_named_as_such(run):
    """A command read a run's latest checkpoint, then the run (still training, --keep-last)
    removed it: reading the file again says so, naming the run, not a flag the user never
    gave."""
    latest = ck.checkpoint_file(run)
    assert latest.name == "step_20.gguf"
    latest.unlink()
    with pytest.raises(FileNotFoundError) as e:
        ck.checkpoint_file(latest, "--adapter")
    assert str(e.value) == (
        f"{latest}: the checkpoint is gone: the run {run} removed it after it was read as the "
        "run's latest (a run still training keeps only its last --keep-last checkpoints); run "
        "the command again to read the run's new latest")
    with pytest.raises(FileNotFoundError, match="--adapter: expected a GGUF file or a run"):
        ck.checkpoint_file(run / "step_20.gguf", "--adapter")  # not in a run's weights/


def test_a_run_still_training_without_a_checkpoint_says_so(tmp_path):
    """toymlx-eval / -generate / -classify on a run started seconds ago said "found no
    checkpoint", as for a run that ended without one. Its lock held by a live process, the
    line now says the run is still training, by which process, and when its first checkpoint
    comes; the lock is only tested (still held, its file intact, after)."""
    import os

    from toymlx.backend.lock import LOCK_FILE, acquire, holder

    run = tmp_path / "run"
    (run / "weights").mkdir(parents=True)
    bare = f"{run}: expected a run bundle with weights/latest, found no checkpoint"
    with pytest.raises(FileNotFoundError) as e:
        ck.checkpoint_file(run)
    assert str(e.value) == bare
    with acquire(run / LOCK_FILE, "run bundle") as lock:
        with pytest.raises(FileNotFoundError) as e:
            ck.checkpoint_file(run)
        assert str(e.value) == (f"{bare}; the run is still training (process {os.getpid()}) "
                                "and has written none yet: its first comes at "
                                "--checkpoint-every or when it stops")
        assert holder(lock.path)["pid"] == os.getpid()
        with pytest.raises(ValueError, match="in use by process"):
            acquire(run / LOCK_FILE, "run bundle")  # still ours
    with pytest.raises(FileNotFoundError) as e:
        ck.checkpoint_file(run)
    assert str(e.value) == bare


def test_a_run_that_stopped_before_its_first_checkpoint_gives_the_command_that_trains_it(
        tmp_path):
    """toymlx-eval --model RUN / toymlx-export --adapter RUN on a run that stopped before its
    first checkpoint said "found no checkpoint" alone; a run bundle (its config.json) now gets
    the command that starts it over, as --resume's own refusal gives it (shell-quoted)."""
    run = tmp_path / "my runs" / "r"
    (run / "weights").mkdir(parents=True)
    (run / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError) as e:
        ck.checkpoint_file(run)
    assert str(e.value) == (f"{run}: expected a run bundle with weights/latest, found no "
                            "checkpoint; the run stopped before its first checkpoint: start it "
                            "over with its saved configuration, toymlx-train --resume "
                            f"'{run}' --from step_0")


def test_a_folder_of_runs_given_as_one_run_names_them(tmp_path):
    """`--model runs` (the runs root, or a sweep's folder) or `--model runs/a/weights` read
    "expected a run bundle with weights/latest, found no checkpoint", as for a run that wrote
    none."""
    for name in ("b", "a"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
    (tmp_path / "not-a-run").mkdir()
    with pytest.raises(FileNotFoundError) as e:
        ck.latest_checkpoint(tmp_path)
    assert str(e.value) == (f"{tmp_path}: expected a run bundle with weights/latest, found a "
                            f"folder of 2 run bundles (a, b); name one of them, e.g. "
                            f"{tmp_path / 'a'}")
    with pytest.raises(FileNotFoundError, match="found no checkpoint; the run stopped before"):
        ck.latest_checkpoint(tmp_path / "a")
    (tmp_path / "a" / "weights").mkdir()
    with pytest.raises(FileNotFoundError) as e:  # its weights/: "found no checkpoint" too
        ck.latest_checkpoint(tmp_path / "a" / "weights")
    assert str(e.value) == (f"{tmp_path / 'a' / 'weights'}: expected a run bundle with "
                            f"weights/latest, found the weights folder of the run "
                            f"{tmp_path / 'a'}; name the run: {tmp_path / 'a'}")


def test_an_empty_folder_given_as_a_run_is_named_with_its_flag(tmp_path):
    """`--lora.init-adapter empty/` (or `--model empty/`) read "empty: expected a run bundle
    with weights/latest, found no checkpoint", naming no flag; an empty folder is nothing there,
    said as for a missing path."""
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError) as e:
        ck.checkpoint_file(tmp_path / "empty", "--lora.init-adapter")
    assert str(e.value) == (f"{tmp_path / 'empty'}: --lora.init-adapter: expected a GGUF file or "
                            "a run directory, found an empty folder")


def test_a_recorded_model_value_is_compared_and_shown_as_the_gguf_holds_it(tmp_path):
    """`check_recorded_model` compared every value as float32: a context of 2**24 + 1 edited to
    2**24 passed (both round to 2**24), and a norm epsilon one float32 step off read "expected
    1e-05 ..., found 1e-05". Integers are compared exactly, floats as float32 and shown in the
    shortest text that tells them apart; values the GGUF holds as float32 still pass."""
    meta = {"general.architecture": "llama", "llama.context_length": 2**24,
            "llama.attention.layer_norm_rms_epsilon": float(np.float32(1e-5)),
            "llama.rope.freq_base": 10000}
    ck.check_recorded_model(tmp_path, meta, {"context": 2**24, "norm_eps": 1e-5,
                                             "rope_base": 10000.0})
    with pytest.raises(ck.ResumeError) as e:
        ck.check_recorded_model(tmp_path, meta, {"context": 2**24 + 1})
    assert "'llama.context_length': expected 16777217 (the run's model context" in str(e.value)
    assert "found 16777216:" in str(e.value)
    off = float(np.nextafter(np.float32(1e-5), np.float32(1)))
    with pytest.raises(ck.ResumeError) as e:
        ck.check_recorded_model(tmp_path, {**meta, "llama.attention.layer_norm_rms_epsilon": off},
                                {"norm_eps": 1e-5})
    assert "expected 1e-05 (the run's model norm_eps" in str(e.value)
    assert "found 1.0000001e-05:" in str(e.value)


@pytest.mark.parametrize("model", ["llama", 5, ["rope_base"]])
def test_a_run_start_whose_model_record_is_no_object_is_no_traceback(tmp_path, model):
    """An edited events.jsonl's run_start "model" as a string or number raised AttributeError
    ('str' object has no attribute 'get') in every reader of the run's checkpoint; it is read
    as no record (the run's own readers name the key, `events.check_events`)."""
    events = [{"kind": "run_start", "run_uid": "u1", "model": model}]
    meta = {ck.RUN_KEY: "u1", "general.architecture": "llama", "llama.context_length": 64}
    ck.check_own(tmp_path / "weights" / "step_1.gguf", "--model", meta=meta, events=events)


def test_refusing_another_runs_checkpoint_names_the_records_garbled_lines(tmp_path):
    """Garbled lines of events.jsonl may have held the resume event adopting the checkpoint:
    the refusal names them (one line in all), and is as before where there are none."""
    ckpt = tmp_path / "weights" / "step_2.gguf"
    events = [{"kind": "run_start", "run_uid": "u1"}]
    meta = {ck.RUN_KEY: "u2", "general.run_id": "b"}
    base = (f"{ckpt}: --resume: expected a checkpoint of this run (run_uid u1), found one of "
            "run_uid u2 (run 'b'); put this run's checkpoint back, or adopt it with --from step_2")
    for damaged, tail in (([], ""), ([3, 5], (
            f"; {tmp_path / 'events.jsonl'}: lines 3 and 5: expected an event (one JSON object a "
            "line), found garbled lines that no kill or resume explains: the file was damaged, "
            "and the resume event adopting this checkpoint (--from step_2) may be one of them: "
            "if the run adopted it, put the run's events.jsonl back instead"))):
        with pytest.raises(ck.ResumeError) as e:
            ck.check_own(ckpt, "--resume", ", or adopt it with --from step_2", meta, events,
                         damaged)
        assert str(e.value) == base + tail


def test_a_checkpoint_into_a_run_folder_removed_mid_run_is_refused(tmp_path):
    """A sweep's run folder deleted while the run trained: its next checkpoint made the folder
    again, holding weights/ alone, and the sweep run again refused to --overwrite that folder
    (no config.json, no events.jsonl) on every try."""
    run_dir = tmp_path / "lr=0.002"
    with pytest.raises(FileNotFoundError) as e:
        ck.save_checkpoint(run_dir / "weights", "step_", 200, lambda p: p.write_bytes(b""), {},
                           {"step": 200})
    assert str(e.value) == (f"[Errno 2] expected the run's folder, found it removed while the "
                            f"run trained; step 200 not saved: '{run_dir}'")
    assert not run_dir.exists()


def test_a_run_whose_folder_is_removed_mid_run_ends_in_one_line(tmp_path, capsys, monkeypatch,
                                                                 shared_file):
    """It trained on, wrote its checkpoints into the folder made again and said "completed";
    then it was told to `--resume` a folder that is gone."""
    real = ck.save_checkpoint

    def removed_first(weights: Path, *args):
        shutil.rmtree(weights.parent)
        return real(weights, *args)

    monkeypatch.setattr(ck, "save_checkpoint", removed_first)
    assert main(["--recipe", "from-scratch", *TINY, "--data.path",
                 str(shared_file("text/tinystories_sample.txt")), "--runs-root", str(tmp_path),
                 "--run-id", "gone", "--steps", "2", "--eval-every", "0"]) == 1
    assert error_line(capsys, "toymlx-train") == (
        f"toymlx-train: error: {tmp_path / 'gone'}: expected the run's folder, found it removed "
        "while the run trained; step 2 not saved; nothing of the run is left: run the same "
        "command again to start it over")
    assert not (tmp_path / "gone").exists()


def test_a_resumed_run_whose_folder_is_removed_is_not_told_to_resume_again(tmp_path, capsys,
                                                                            monkeypatch,
                                                                            shared_file):
    """The same for `--resume RUN`: "run the same command again" named a command that can only
    fail now (the folder it resumes is gone, config.json with it): it says to start over."""
    data = str(shared_file("text/tinystories_sample.txt"))
    assert main(["--recipe", "from-scratch", *TINY, "--data.path", data, "--runs-root",
                 str(tmp_path), "--run-id", "gone", "--steps", "2", "--eval-every", "0"]) == 0
    real = ck.save_checkpoint

    def removed_first(weights: Path, *args):
        shutil.rmtree(weights.parent)
        return real(weights, *args)

    monkeypatch.setattr(ck, "save_checkpoint", removed_first)
    capsys.readouterr()
    assert main(["--resume", str(tmp_path / "gone"), "--steps", "4"]) == 1
    assert error_line(capsys, "toymlx-train") == (
        f"toymlx-train: error: {tmp_path / 'gone'}: expected the run's folder, found it removed "
        "while the run trained; step 4 not saved; nothing of the run is left to resume: start "
        "it over with toymlx-train --recipe from-scratch and the options it was started with "
        "(its config.json went with the folder)")
    assert not (tmp_path / "gone").exists()


def test_from_takes_a_bare_step_number_and_a_checkpoint_file_name():
    """docs/RUNS.md: `--from 100` is taken as `step_100`, as is a checkpoint's file name. The
    words a user reaches for instead get what to write: `latest` (leave --from out), a
    checkpoint's path (its name); anything else as before."""
    assert [ck.parse_from(t) for t in ("100", "step_100", "adapter_step_100.gguf", " 7 ")] == [
        100, 100, 100, 7]
    want = "--from: expected a checkpoint such as step_20 (or 20), found "
    for text, said in [
            ("latest", ("'latest'; leave --from out to go on from the checkpoint "
                        "weights/latest names")),
            ("runs/r/weights/adapter_step_10.gguf", ("'runs/r/weights/adapter_step_10.gguf'; "
                                                     "--from picks one of the run's own "
                                                     "checkpoints by its name: --from "
                                                     "adapter_step_10.gguf")),
            ("runs/r", "'runs/r'")]:
        with pytest.raises(ValueError) as e:
            ck.parse_from(text)
        assert str(e.value) == want + said


def test_a_full_disk_names_the_room_superseded_checkpoints_hold(tmp_path, monkeypatch):
    """A full disk after `--resume --from step_3` of a 6-step vit-tiny run on a 150 MiB disk:
    weights/superseded/ held the set-aside step_6 (61.2 MiB, the room the next checkpoint
    wanted), unnamed by the error, which said only "free space". Now it says that folder can
    go and what it holds; without one, the note is as before."""
    from toymlx.backend import atomic

    weights = tmp_path / "weights"
    (weights / ck.SUPERSEDED).mkdir(parents=True)
    (weights / "step_3.gguf").write_bytes(b"\0" * (1 << 20))
    (weights / "step_3.state.safetensors").write_bytes(b"\0" * (1 << 19))
    (weights / ck.SUPERSEDED / "step_6.gguf").write_bytes(b"\0" * (1 << 20))
    (weights / ck.SUPERSEDED / "step_6.state.safetensors").write_bytes(b"\0" * (3 << 19))
    monkeypatch.setattr(atomic, "free_bytes", lambda folder: 1 << 18)
    before = ("; a checkpoint takes 1.5 MiB here (step_3's files) and 0.2 MiB are free: free "
              "space, or --runs-root on a larger disk (each checkpoint is written in full before "
              "--keep-last removes an older one)")
    assert ck.room_note(weights) == before + (
        "; weights/superseded/ (the checkpoints a --from set aside) holds 2.5 MiB and can go "
        "whole")
    shutil.rmtree(weights / ck.SUPERSEDED)
    assert ck.room_note(weights) == before
