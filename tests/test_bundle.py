"""One run bundle, opened once (`toymlx.runner.bundle.Bundle`): issue 23's ways a bundle still lost or
mixed a run, each run as a user would (real `toymlx-*` commands, files, signals, processes).

B1. `latest` missing: the resume (by a relative path too) takes the newest checkpoint, intact,
    and says so; eval and generate use it. `latest` naming a file that is gone: resume, eval
    and generate refuse, naming it and the checkpoint to pass instead.
B2. a `latest` symlink loop: one line, exit 2, for --resume, toymlx-eval and toymlx-generate.
B3. a key missing from config.json: one line naming the file and the key, nothing trained.
B4. a sweep child whose multi-threaded parent is killed gets the parent-death SIGTERM more than
    once; it still writes its final checkpoint.
and: the data file changed under its name is refused on resume, naming it; toymlx-eval reads
the run's own data; a checkpoint file put under another's name is refused by every reader;
SIGHUP stops a run like SIGTERM; a write that hits the file-size limit names the file.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from cli_errors import error_line
from test_runs import TINY, TRAIN
from toymlx_cli.eval import main as eval_main
from toymlx_cli.export import main as export_main
from toymlx_cli.generate import main as generate_main
from toymlx_cli.train import main

from toymlx.bundle.checkpoint import list_checkpoints
from toymlx.bundle.events import read_events


@pytest.fixture(scope="module")
def data(shared_file) -> str:
    return str(shared_file("text/tinystories_sample.txt"))


@pytest.fixture(scope="module")
def straight(tmp_path_factory, data) -> Path:
    """6 steps without a stop: the losses a resumed run must repeat bit for bit."""
    root = tmp_path_factory.mktemp("straight")
    assert main(["--recipe", "from-scratch", *TINY, "--data.path", data, "--runs-root",
                 str(root), "--run-id", "s", "--steps", "6", "--checkpoint-every", "2"]) == 0
    return root / "s"


@pytest.fixture(scope="module")
def stopped(tmp_path_factory, data) -> Path:
    """The same run stopped (checkpointed) at step 4, on its own copy of the data."""
    root = tmp_path_factory.mktemp("stopped")
    shutil.copy(data, root / "data.txt")
    assert main(["--recipe", "from-scratch", *TINY, "--data.path", str(root / "data.txt"),
                 "--runs-root", str(root), "--run-id", "b", "--steps", "6", "--stop-at", "4",
                 "--checkpoint-every", "2"]) == 0
    return root / "b"


def _copy(stopped: Path, tmp_path: Path) -> Path:
    run = tmp_path / "b"
    shutil.copytree(stopped, run, symlinks=True)
    return run


def _as_written_before_the_digest(run: Path) -> None:
    """The run's record as toymlx wrote it before run_start held config.json's digest (an older
    run's config.json is checked against nothing)."""
    lines = []
    for line in (run / "events.jsonl").read_text().splitlines():
        e = json.loads(line)
        if e.get("kind") == "run_start":
            e.pop("config_sha256", None)
        lines.append(json.dumps(e))
    (run / "events.jsonl").write_text("\n".join(lines) + "\n")


def _losses(run: Path) -> list[float]:
    return [e["loss"] for e in read_events(run) if e["kind"] == "step"]


# ---- B1 ---------------------------------------------------------------------------------------
def test_a_missing_latest_resumes_from_the_newest_intact_checkpoint(
        tmp_path, stopped, straight, monkeypatch, capsys):
    """A run SIGKILLed the moment its first checkpoint landed has step_N and its state, and no
    `latest`: the newest checkpoint is the one it would name; `--resume runs/X` by a relative
    path took the fallback for a foreign link (rc 2) on main."""
    run = _copy(stopped, tmp_path)
    link = run / "weights" / "latest"
    link.unlink()
    monkeypatch.chdir(tmp_path)
    assert main(["--resume", "b"]) == 0
    assert "weights/latest is missing" in capsys.readouterr().err
    (res,) = [e for e in read_events(run) if e["kind"] == "resume"]
    assert res["from_step"] == 4 and "took the newest intact checkpoint, step_4" in res["note"]
    assert _losses(run) == _losses(straight)  # bit-exact, as if never stopped
    assert os.readlink(link) == "step_6.gguf"


@pytest.mark.parametrize("reader", ["train", "eval", "generate"])
def test_a_latest_naming_a_gone_file_is_refused_naming_both(
        tmp_path, stopped, straight, monkeypatch, capsys, reader):
    """`latest` names step_6.gguf, deleted: resume went on from step_4 (retraining steps 5-6
    and setting the record past 4 aside) and eval and generate read step_4, the readers
    without a word. Now each refuses in one line naming the missing file and the checkpoint
    to pass instead; `--from step_4` then resumes as a run never stopped."""
    run = _copy(stopped, tmp_path)
    link = run / "weights" / "latest"
    link.unlink()
    os.symlink("step_6.gguf", link)
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    cmd = {"train": (main, ["--resume", "b"]), "eval": (eval_main, ["--model", "b"]),
           "generate": (generate_main, ["--model", "b", "--prompt", "a", "--max-tokens", "1"])}
    fn, argv = cmd[reader]
    assert fn(argv) == 2
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err == (
        f"toymlx-{reader}: error: b/weights/step_6.gguf: expected the run's latest checkpoint "
        "(b/weights/latest names it), found nothing there; the newest intact checkpoint is "
        "step_4: toymlx-train --resume b --from step_4 (trains the steps after 4 again), or "
        "read it as b/weights/step_4.gguf\n")
    assert not [e for e in read_events(run) if e["kind"] == "resume"]  # nothing touched
    if reader == "train":
        assert main(["--resume", "b", "--from", "step_4"]) == 0
        assert _losses(run) == _losses(straight)
        assert os.readlink(link) == "step_6.gguf"


def test_a_missing_latest_is_read_by_eval(tmp_path, stopped, capsys):
    run = _copy(stopped, tmp_path)
    (run / "weights" / "latest").unlink()
    assert eval_main(["--model", str(run)]) == 0
    assert json.loads(capsys.readouterr().out)["model"] == str(run / "weights" / "step_4.gguf")


@pytest.mark.parametrize("seq_len", [16, 40])
def test_eval_says_how_much_it_scored(tmp_path, stopped, capsys, seq_len):
    """A text run's eval scores the whole split (a run's own val_loss reads --eval-batches of
    it) and says how many tokens: every window of seq_len with disjoint targets."""
    from toymlx.data.tokenizer import Tokenizer
    from toymlx.gguf.reader import GGUFFile
    from toymlx.recipes.common import TextData, load_token_data

    run = _copy(stopped, tmp_path)
    data = run.parent / "data.txt"
    shutil.copy(stopped.parent / "data.txt", data)
    assert eval_main(["--model", str(run), "--data.path", str(data), "--split", "all",
                      "--seq-len", str(seq_len)]) == 0
    out = json.loads(capsys.readouterr().out)
    with GGUFFile(run / "weights" / "step_4.gguf") as g:
        tok = Tokenizer.from_metadata(g.metadata)
    td = load_token_data(TextData(str(data)), tok, seq_len)
    n = len(td.train) + len(td.val)
    assert (out["split"], out["seq_len"]) == ("all", seq_len)
    assert out["tokens_scored"] == (n - 1) // seq_len * seq_len > 0


# ---- B2 ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("prog,command", [
    ("toymlx-train", lambda run: main(["--resume", str(run)])),
    ("toymlx-eval", lambda run: eval_main(["--model", str(run)])),
    ("toymlx-generate", lambda run: generate_main(["--model", str(run), "--prompt", "Once"])),
])
def test_a_latest_symlink_loop_is_one_line(tmp_path, stopped, capsys, prog, command):
    run = _copy(stopped, tmp_path)
    link = run / "weights" / "latest"
    link.unlink()
    os.symlink("latest", link)  # ln -sfn latest runs/X/weights/latest
    assert command(run) == 2
    line = error_line(capsys, prog)
    assert f"{link}: expected a link to a step_N.gguf of this run, found a symlink loop" in line


# ---- B3 ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("path,key", [
    (["lr"], "config.lr"), (["seed"], "config.seed"), (["data"], "config.data"),
    (["model", "d_model"], "config.model.d_model"), (["data", "path"], "config.data.path"),
    (["report_every"], "config.report_every"), (["report_to"], "config.report_to"),
])
def test_a_key_missing_from_config_json_is_named(tmp_path, stopped, capsys, path, key):
    run = _copy(stopped, tmp_path)
    saved = json.loads((run / "config.json").read_text())
    d = saved["config"]
    for k in path[:-1]:
        d = d[k]
    del d[path[-1]]
    (run / "config.json").write_text(json.dumps(saved))
    events = (run / "events.jsonl").read_bytes()
    assert main(["--resume", str(run)]) == 2
    line = error_line(capsys)
    assert f"{run / 'config.json'}: key {key!r}: expected the run's saved" in line, line
    assert "found no key" in line
    assert (run / "events.jsonl").read_bytes() == events  # nothing trained


def test_a_bundle_written_before_config_format_2_still_resumes(tmp_path, stopped, straight):
    """A config.json without `format` (toymlx before this check) lacks the options added since:
    they take their defaults, which keep the old behaviour, and the run resumes exactly."""
    run = _copy(stopped, tmp_path)
    saved = json.loads((run / "config.json").read_text())
    del saved["format"]
    del saved["config"]["compile"]  # as if written before the option existed (default True)
    (run / "config.json").write_text(json.dumps(saved))
    _as_written_before_the_digest(run)
    assert main(["--resume", str(run)]) == 0
    assert _losses(run) == _losses(straight)


def test_a_config_format_2_bundle_resumes_with_report_every_s_default(tmp_path, stopped,
                                                                        straight, capsys):
    """--report-every came with config.json format 3: a format-2 file without it resumes, the
    option at its default (10), exactly."""
    run = _copy(stopped, tmp_path)
    saved = json.loads((run / "config.json").read_text())
    saved["format"] = 2
    del saved["config"]["report_every"]
    (run / "config.json").write_text(json.dumps(saved))
    _as_written_before_the_digest(run)
    assert main(["--resume", str(run)]) == 0
    assert _losses(run) == _losses(straight)
    assert "step 6/6: train loss " in capsys.readouterr().out  # at the last step


def test_a_config_format_5_lora_run_takes_the_options_6_added_at_their_defaults():
    """--weight-decay-scope, --eval-at-start and --data.train-turns came with config.json format
    6: a format-5 file lacks them (one inside `data`) and reads as those runs trained; a format-6
    file without one is damage, named by its key and flag."""
    import dataclasses

    from toymlx.bundle.folder import added_since
    from toymlx.bundle.options import RunError, config_from_dict
    from toymlx.recipes import lora

    d = json.loads(json.dumps(dataclasses.asdict(lora.Config(base="b.gguf"))))  # as saved
    del d["weight_decay_scope"], d["eval_at_start"], d["data"]["train_turns"]
    cfg = config_from_dict(lora.Config, d, "c.json", optional=added_since(5))
    assert (cfg.weight_decay_scope, cfg.eval_at_start, cfg.data.train_turns) == (
        "matrices", False, "assistant")
    with pytest.raises(RunError) as e:
        config_from_dict(lora.Config, d, "c.json", optional=added_since(6))
    assert str(e.value) == ("c.json: key 'config.data.train_turns': expected the run's saved "
                            "--data.train-turns value, found no key; put it back as the run's "
                            "run_start event records it")


def test_a_config_format_6_run_takes_wandb_project_at_its_default():
    """--wandb-project came with config.json format 7: a format-6 file lacks it and reads as
    those runs reported (None: WANDB_PROJECT, else toymlx); a format-7 file without it is
    damage."""
    import dataclasses

    from toymlx.bundle.folder import CONFIG_FORMAT, added_since
    from toymlx.bundle.options import RunError, config_from_dict
    from toymlx.recipes import lora

    d = json.loads(json.dumps(dataclasses.asdict(lora.Config(base="b.gguf"))))  # as saved
    del d["wandb_project"]
    assert config_from_dict(lora.Config, d, "c.json", optional=added_since(6)).wandb_project \
        is None
    assert CONFIG_FORMAT >= 7
    with pytest.raises(RunError) as e:
        config_from_dict(lora.Config, d, "c.json", optional=added_since(7))
    assert str(e.value).startswith("c.json: key 'config.wandb_project': expected the run's "
                                   "saved --wandb-project value, found no key")


def test_an_older_config_json_reads_adam_s_eps_and_bias_correction_as_those_runs_had_them():
    """--adam-eps and --bias-correction came with config.json format 9 (mlx-lm's
    optimizer_config eps and bias_correction): a format-8 file lacks them and reads as those
    runs trained (MLX's 1e-8, no bias correction), so its --resume is exact; a format-9 file
    without them is damage."""
    import dataclasses

    from toymlx.bundle.folder import CONFIG_FORMAT, added_since
    from toymlx.bundle.options import RunError, config_from_dict
    from toymlx.recipes import lora

    d = json.loads(json.dumps(dataclasses.asdict(lora.Config(base="b.gguf"))))  # as saved
    del d["adam_eps"], d["bias_correction"]
    cfg = config_from_dict(lora.Config, d, "c.json", optional=added_since(8))
    assert (cfg.adam_eps, cfg.bias_correction) == (1e-8, False)
    assert CONFIG_FORMAT >= 9
    with pytest.raises(RunError) as e:
        config_from_dict(lora.Config, d, "c.json", optional=added_since(9))
    assert str(e.value).startswith("c.json: key 'config.adam_eps': expected the run's saved "
                                   "--adam-eps value, found no key")


# ---- a .jsonl data file, read as text by the runs before --data.read-as ------------------------
@pytest.fixture(scope="module")
def records(tmp_path_factory, data) -> Path:
    """A .jsonl file of {"text": ...} records: each line of the stories one record."""
    path = tmp_path_factory.mktemp("records") / "stories.jsonl"
    lines = [ln for ln in Path(data).read_text(encoding="utf-8").splitlines() if ln.strip()]
    path.write_text("".join(json.dumps({"text": ln}) + "\n" for ln in lines[:80]),
                    encoding="utf-8")
    return path


def _records_run(root: Path, run_id: str, records: Path, *more: str) -> Path:
    assert main(["--recipe", "from-scratch", *TINY, "--data.path", str(records), "--runs-root",
                 str(root), "--run-id", run_id, "--steps", "6", "--checkpoint-every", "2",
                 *more]) == 0
    return root / run_id


@pytest.fixture(scope="module")
def as_text(tmp_path_factory, records) -> Path:
    """6 steps on the .jsonl read as text, as toymlx read every single file before it read
    records: the losses a resumed older run must repeat bit for bit."""
    return _records_run(tmp_path_factory.mktemp("as_text"), "t", records, "--data.read-as",
                        "text")


def _as_format_7(run: Path) -> None:
    """config.json as toymlx wrote it before --data.read-as (format 7, no data.read_as), and
    run_start as it recorded it: the digest of that config.json, its options without it."""
    from toymlx.bundle.folder import config_digest

    saved = json.loads((run / "config.json").read_text())
    saved["format"] = 7
    del saved["config"]["data"]["read_as"]
    (run / "config.json").write_text(json.dumps(saved, indent=2))
    lines = []
    for line in (run / "events.jsonl").read_text().splitlines():
        e = json.loads(line)
        if e["kind"] == "run_start":
            e["config_sha256"] = config_digest(saved)
            del e["config"]["data"]["read_as"]
        lines.append(json.dumps(e))
    (run / "events.jsonl").write_text("\n".join(lines) + "\n")


def test_a_run_records_how_it_read_its_data_file(tmp_path, records, data):
    """config.json (format 8) holds --data.read-as as the run read its file: records for a
    .jsonl, text for a text file, none for a data folder (always records); by the file the
    run reads, also where a -c file named another."""
    folder = tmp_path / "mlx_lm_data"
    folder.mkdir()
    shutil.copy(records, folder / "train.jsonl")
    (tmp_path / "c.yaml").write_text(f"recipe: from-scratch\ndata:\n  path: {data}\n")
    got = {}
    for name, path, more in [("jsonl", records, []), ("txt", data, []),
                             ("folder", folder, []),
                             ("over_c", records, ["-c", str(tmp_path / "c.yaml")])]:
        assert main([*more, "--recipe", "from-scratch", *TINY, "--data.path", str(path),
                     "--runs-root", str(tmp_path), "--run-id", name, "--steps", "1"]) == 0
        saved = json.loads((tmp_path / name / "config.json").read_text())
        assert saved["format"] >= 8  # format 8 on holds data.read_as
        got[name] = saved["config"]["data"]["read_as"]
    assert got == {"jsonl": "records", "txt": "text", "folder": None, "over_c": "records"}


def test_the_text_reading_of_a_jsonl_file_is_its_bytes(records):
    """--data.read-as text gives the ids of the file's bytes, JSON and all (hand-computed: BOS 1,
    then byte b as id b + 3), as toymlx read any single file before it read records."""
    import numpy as np

    from toymlx.data.tokenizer import byte_tokenizer
    from toymlx.recipes.common import TextData, load_token_data

    td = load_token_data(TextData(str(records), 0.1, "text"), byte_tokenizer(), 32)
    want = [1] + [b + 3 for b in records.read_bytes()]
    assert np.concatenate([td.train, td.val]).tolist() == want
    rec = load_token_data(TextData(str(records)), byte_tokenizer(), 32)  # the default: records
    assert len(rec.train) + len(rec.val) < len(want)  # their texts alone


def test_an_older_run_on_a_jsonl_file_resumes_reading_it_as_text(tmp_path, records, as_text,
                                                                  capsys):
    """A run started before toymlx read a .jsonl --data.path as its records (config.json
    format 7, no data.read_as) trained on the file's text: its resume reads it so, says so in
    one line (and its resume event), and repeats the losses of a run on the text straight
    through, where the records' reading trains on other tokens. toymlx-eval of it reads the
    data as the run did, and says so."""
    run = _records_run(tmp_path, "o", records, "--data.read-as", "text", "--stop-at", "4")
    _as_format_7(run)
    capsys.readouterr()
    assert main(["--resume", str(run)]) == 0
    note = (f"{records}: --data.path read as text (--data.read-as text), as the run read it: "
            f"{run / 'config.json'} (format 7) predates --data.read-as, and then a single "
            "--data.path file was read as plain text whatever its name, a .jsonl's JSON included")
    assert f"toymlx-train: {note}\n" in capsys.readouterr().err
    assert [e["note"] for e in read_events(run) if e["kind"] == "resume"] == [note]
    assert _losses(run) == _losses(as_text)
    as_records = _records_run(tmp_path, "r", records)
    assert _losses(as_records)[0] != _losses(as_text)[0]
    capsys.readouterr()
    scores = []
    for r in (run, as_text):
        assert eval_main(["--model", str(r), "--no-progress"]) == 0
        out = capsys.readouterr()
        scores.append({k: json.loads(out.out)[k] for k in ("val_loss", "tokens_scored")})
        assert (f"toymlx-eval: {note}" in out.err) == (r == run), out.err
    assert scores[0] == scores[1]


def test_an_older_run_read_otherwise_than_its_record_says_is_refused(tmp_path, records, capsys):
    """A config.json without data.read_as whose run read its .jsonl as records (a toymlx of the
    days between the two changes): read as text its data gives other token counts than
    run_start recorded, and the resume refuses in one line, nothing trained."""
    run = _records_run(tmp_path, "w", records, "--stop-at", "4")
    start = next(e for e in read_events(run) if e["kind"] == "run_start")["config"]
    _as_format_7(run)
    events = (run / "events.jsonl").read_bytes()
    capsys.readouterr()
    assert main(["--resume", str(run)]) == 2
    line = error_line(capsys)
    assert line.startswith(f"toymlx-train: error: {records}: --resume: expected "
                           f"{start['train_tokens']} train_tokens, {start['val_tokens']} "
                           "val_tokens (the run's, as it read its data when it started), found "), line
    assert ("this toymlx reads the data otherwise than the one that started the run "
            "(--data.read-as text taken for a config.json without it); resume it with that "
            "toymlx") in line
    assert (run / "events.jsonl").read_bytes() == events


@pytest.mark.parametrize("given,want", [
    ("folder", ("--data.read-as: expected a single --data.path file, found {path}, a data "
                "folder (mlx-lm's files are always read as records, text files as text)")),
    ("txt", ("--data.read-as records: expected a .jsonl, .json, .csv or .tsv --data.path (a "
             "file of records), found {path}; any other file is read as text")),
])
def test_data_read_as_that_does_not_fit_the_path_is_one_line(tmp_path, data, capsys, given,
                                                              want):
    path = tmp_path if given == "folder" else data
    assert main(["--recipe", "from-scratch", *TINY, "--data.path", str(path), "--data.read-as",
                 "records" if given == "txt" else "text", "--runs-root", str(tmp_path / "runs"),
                 "--steps", "1"]) == 2
    assert error_line(capsys) == f"toymlx-train: error: {want.format(path=path)}"
    assert not (tmp_path / "runs").exists()


# ---- B4 ---------------------------------------------------------------------------------------
PARENT = textwrap.dedent("""
    import hashlib, subprocess, sys, threading
    from toymlx.backend.lifeline import child_env
    # A multi-threaded parent, like a sweep: as it dies, Linux hands the child to each of its
    # still running threads in turn, and sends the parent-death signal again each time.
    def spin(buf=b"x" * 2**24):
        while True:
            hashlib.sha256(buf).digest()  # outside the GIL: the threads really run
    child = subprocess.Popen(sys.argv[1:], env=child_env(), stdout=subprocess.DEVNULL)
    print(child.pid, flush=True)
    sys.stdin.readline()  # once the child trains
    for _ in range(4):
        threading.Thread(target=spin, daemon=True).start()
    print("spinning", flush=True)
    child.wait()
""")


def test_a_killed_parent_s_repeated_sigterms_do_not_skip_the_final_checkpoint(tmp_path, data):
    run = tmp_path / "c"
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, *TRAIN, "--recipe", "from-scratch", *TINY,
         "--data.path", data, "--runs-root", str(tmp_path), "--run-id", "c", "--steps",
         "100000", "--checkpoint-every", "1000", "--grad-accum", "8"],  # steps longer than
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # the signals' spread (13 ms)
    parent.stdout.readline()  # the child's pid: it is started
    while not any(e["kind"] == "step" and e["step"] >= 3 for e in read_events(run)):
        assert parent.poll() is None
        time.sleep(0.02)
    parent.stdin.write("go\n")
    parent.stdin.flush()
    assert parent.stdout.readline() == "spinning\n"
    parent.kill()
    parent.wait()
    t0 = time.monotonic()
    while read_events(run)[-1]["kind"] != "run_end":  # the child, now the init's, ends
        assert time.monotonic() - t0 < 120, "the child outlived its killed parent"
        time.sleep(0.05)
    end = read_events(run)[-1]
    assert end["kind"] == "run_end" and end["reason"] == "interrupted", end
    assert "second signal" not in end["message"], end["message"]
    assert os.readlink(run / "weights" / "latest") == f"step_{end['final_step']}.gguf"


# ---- the data file -----------------------------------------------------------------------------
@pytest.mark.parametrize("change", ["append", "same size"])
def test_a_changed_data_file_is_refused_on_resume(tmp_path, stopped, straight, capsys, change):
    run = _copy(stopped, tmp_path)
    config = json.loads((run / "config.json").read_text())
    path = Path(config["config"]["data"]["path"])
    assert config["data_files"]["data.path"]["path"] == str(path)
    kept = path.read_bytes()
    try:
        path.write_bytes(kept + b" and more." if change == "append"
                         else kept.replace(b"Once", b"Twice", 1).replace(b"upon", b"upn", 1))
        assert main(["--resume", str(run)]) == 2
        line = error_line(capsys)
        assert line.startswith(f"toymlx-train: error: {path}: --data.path: expected the data "
                               f"the run started on ({len(kept)} bytes"), line
        assert "a resumed run trains on its own data" in line
    finally:
        path.write_bytes(kept)
    assert main(["--resume", str(run)]) == 0  # its own data back: the same run goes on
    assert _losses(run) == _losses(straight)


# ---- toymlx-eval reads the run's data -------------------------------------------------------------
def test_eval_of_a_run_reads_its_own_data(tmp_path, straight, capsys):
    """The run's final validation pass (all of its held-out windows) and toymlx-eval of the run
    report the same loss on the same text; before, eval read the Python docs."""
    run = tmp_path / "e"
    data = json.loads((straight / "config.json").read_text())["config"]["data"]["path"]
    assert main(["--recipe", "from-scratch", *TINY, "--data.path", data, "--runs-root",
                 str(tmp_path), "--run-id", "e", "--steps", "3", "--eval-batches",
                 "1000"]) == 0
    capsys.readouterr()
    final = [e for e in read_events(run) if e["kind"] == "eval"][-1]["val_loss"]
    assert eval_main(["--model", str(run)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["data"] == os.path.realpath(data)  # the file it named, links resolved (config.json)
    assert out["val_loss"] == pytest.approx(final, rel=1e-5)


# ---- a checkpoint under another's name ---------------------------------------------------------
@pytest.mark.parametrize("copied", ["gguf", "gguf and state", "another run's"])
def test_a_checkpoint_under_another_name_is_refused(tmp_path, stopped, straight, capsys,
                                                    copied):
    run = _copy(stopped, tmp_path)
    w = run / "weights"
    assert [s for s, _ in list_checkpoints(w)] == [2, 4]
    if copied == "another run's":  # the same step of another run: only the id tells
        shutil.copy(straight / "weights" / "step_4.gguf", w / "step_4.gguf")
        want = f"{w / 'step_4.gguf'}: checkpoint id: expected "
    else:
        shutil.copy(w / "step_2.gguf", w / "step_4.gguf")  # cp step_2.gguf step_4.gguf
        want = (f"{w / 'step_4.gguf'}: metadata key 'general.step': expected 4 (its name), "
                "found 2")
    if copied == "gguf and state":
        shutil.copy(w / "step_2.state.safetensors", w / "step_4.state.safetensors")
    for prog, rc in [
        ("toymlx-eval", lambda: eval_main(["--model", str(run)])),
        ("toymlx-generate", lambda: generate_main(["--model", str(run), "--prompt", "Once"])),
        ("toymlx-export", lambda: export_main(["--base", str(run), "--out",
                                               str(tmp_path / "x.gguf")])),
        ("toymlx-train", lambda: main(["--resume", str(run)])),
    ]:
        assert rc() == 2, prog
        line = error_line(capsys, prog)
        assert want in line and "the file of another checkpoint was put under this name" in line
    assert not (tmp_path / "x.gguf").exists()


def test_an_export_of_a_run_names_the_checkpoint_it_wrote(tmp_path, stopped, capsys):
    """toymlx-export --base runs/ID said "wrote x.gguf (0.1 MiB) from runs/ID", not which of
    the run's checkpoints it read (a run still training moves its latest on), where
    toymlx-generate --model runs/ID names the file."""
    run = _copy(stopped, tmp_path)
    out = tmp_path / "x.gguf"
    assert export_main(["--base", str(run), "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert err.startswith(f"toymlx-export: wrote {out} (") and err.endswith(" s\n")
    assert f" MiB) from {run / 'weights' / 'step_4.gguf'} in " in err, err


# ---- SIGHUP -----------------------------------------------------------------------------------
def test_sighup_ends_a_run_like_sigterm(tmp_path, data):
    """A closed terminal or ssh session: the run finishes its step, checkpoints, ends with
    run_end naming SIGHUP and exit code 129 (128 + 1, the shell's convention), and resumes; on
    main SIGHUP killed it with no run_end (then it ended as Ctrl-C did, 130)."""
    run = tmp_path / "h"
    p = subprocess.Popen([*TRAIN, "--recipe", "from-scratch", *TINY, "--data.path", data,
                          "--runs-root", str(tmp_path), "--run-id", "h", "--steps", "100000",
                          "--checkpoint-every", "1000"], stderr=subprocess.PIPE, text=True)
    while not any(e["kind"] == "step" and e["step"] >= 3 for e in read_events(run)):
        assert p.poll() is None, p.stderr.read()[-3000:]
        time.sleep(0.02)
    p.send_signal(signal.SIGHUP)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 129, err[-2000:]
    end = read_events(run)[-1]
    assert end["kind"] == "run_end" and end["reason"] == "interrupted", end
    assert (end["exit_code"], end["signal"]) == (129, "SIGHUP"), end
    assert "stopped by SIGHUP; resume with" in err
    assert os.readlink(run / "weights" / "latest") == f"step_{end['final_step']}.gguf"
    assert main(["--resume", str(run), "--steps", str(end["final_step"] + 1)]) == 0


# ---- write errors name the file -----------------------------------------------------------------
def test_a_file_size_limit_names_the_file(tmp_path, data):
    """`ulimit -f`: the first checkpoint's state file passes the limit (EFBIG, errno 27)."""
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.RLIM_INFINITY))

    r = subprocess.run([*TRAIN, "--recipe", "from-scratch", *TINY, "--data.path", data,
                        "--runs-root", str(tmp_path), "--run-id", "f", "--steps", "4",
                        "--checkpoint-every", "2"], preexec_fn=limit, capture_output=True,
                       text=True, timeout=300, check=False)
    assert r.returncode == 1, r.stderr[-2000:]
    (line,) = [x for x in r.stderr.splitlines() if x.startswith("toymlx-train: error:")]
    run = tmp_path / "f"
    assert (f"[Errno 27] File too large: '{run / 'weights' / 'step_2.state.safetensors'}'"
            in line), line
    assert line.endswith(f"no checkpoint was written: start it over with toymlx-train --resume "
                         f"{run} --from step_0"), line
    assert not list((run / "weights").iterdir())  # nothing half-written left behind


# ---- a closed console is not a bundle write -----------------------------------------------------
def _closed_stdout(cmd: list[str]) -> subprocess.CompletedProcess:
    """`cmd | head -0`: its stdout a pipe whose reader has already gone. Buffered, as a user's
    Python is: under PYTHONUNBUFFERED (CI sets it) every print meets the closed pipe at once, and
    a write that only Python's flush at exit makes (exit status 120) goes unseen."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    p.stdout.close()
    err = p.stderr.read()
    p.wait(timeout=300)
    return subprocess.CompletedProcess(cmd, p.returncode, None, err)


def test_a_closed_stdout_stops_the_run_as_a_signal_would(tmp_path, data, straight):
    """`toymlx-train ... | head -3`: the run trained on to its last step after head had gone, the
    shell waiting on it without a word (a closed pipe once ended it as "could not write the run
    bundle ([Errno 32] Broken pipe)" with no checkpoint). Now the closed pipe stops it as
    Ctrl-C does, after the step in flight: a checkpoint, run_end naming
    SIGPIPE, exit status 141 (128 + 13, as `yes | head -3`), and `--resume` goes on with the
    losses of a run that never stopped. An output-only command (toymlx-eval) stops quietly
    with 0, as Unix tools do."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    p = subprocess.Popen([*TRAIN, "--recipe", "from-scratch", *TINY, "--data.path", data,
                          "--runs-root", str(tmp_path), "--run-id", "p", "--steps", "6",
                          "--report-every", "1", "--checkpoint-every", "100"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    head = [p.stdout.readline() for _ in range(3)]
    p.stdout.close()
    err = p.stderr.read()
    assert p.wait(timeout=300) == 141, err[-2000:]
    assert [ln.split(":")[0] for ln in head] == ["step 1/6", "step 2/6", "step 3/6"]
    end = read_events(tmp_path / "p")[-1]
    stopped_at = end["final_step"]
    assert stopped_at in (3, 4, 5), end  # the step in flight when head closed its end
    assert (end["reason"], end["signal"], end["exit_code"]) == ("interrupted", "SIGPIPE", 141)
    assert end["message"] == ("stopped by SIGPIPE; resume with "
                              f"--resume {tmp_path / 'p'}")
    assert (tmp_path / "p" / "weights" / f"step_{stopped_at}.gguf").is_file()
    assert main(["--resume", str(tmp_path / "p")]) == 0
    losses = [(e["step"], e["loss"]) for e in read_events(tmp_path / "p") if e["kind"] == "step"]
    assert losses == [(e["step"], e["loss"]) for e in read_events(straight)
                      if e["kind"] == "step"]
    r = _closed_stdout([sys.executable, "-m", "toymlx_cli.eval", "--model", str(straight)])
    assert (r.returncode, r.stderr) == (0, "")


# toymlx-train with stdout and stderr on one pipe this process reads; the reader goes after
# run_end, before or after the final line (toymlx.runner.run._final_line)
READER_GOES_AT_THE_END = """
import os, select, sys, threading, time
import toymlx.runner.run as run
from toymlx_cli.train import main
when, args = sys.argv[1], sys.argv[2:]
r, w = os.pipe()
os.dup2(w, 1); os.dup2(w, 2); os.close(w)
leave = threading.Event()
def read():  # `head`: reads until told to go, then closes its end as its exit would
    while not leave.is_set():
        if select.select([r], [], [], 0.01)[0] and not os.read(r, 65536):
            break
    os.close(r)
reader = threading.Thread(target=read, daemon=True)
reader.start()
def reader_goes():  # its end closed by the reader itself: a read blocked on an fd closed from
    time.sleep(0.3)  # another thread still takes the next write, then fails on its own
    leave.set(); reader.join()
final = run._final_line
def _final_line(*a, **k):
    if when == "before":
        reader_goes()
    final(*a, **k)
    if when == "after":
        sys.stderr.flush(); reader_goes()
run._final_line = _final_line
code = main(args)
os.write(os.open("rc", os.O_WRONLY | os.O_CREAT), str(code).encode())
sys.exit(code)
"""


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_reader_gone_after_the_run_ended_leaves_its_exit_status(tmp_path, data, when):
    """`toymlx-train ... | head` whose reader goes only once run_end "completed" is written
    (before or after the final line): exit status 0, as run_end says, not 141; and a run that
    fails its input checks with its console closed (`2>&1 | head -0`) exits 2, its check's
    status, with no run folder. Checked when `| head` began to stop a run (both held before)."""
    script = tmp_path / "reader_goes.py"
    script.write_text(READER_GOES_AT_THE_END)
    r = subprocess.run([sys.executable, str(script), when, "--recipe", "from-scratch", *TINY,
                        "--data.path", data, "--runs-root", str(tmp_path), "--run-id", "p",
                        "--steps", "3", "--report-every", "1"], cwd=tmp_path, timeout=300,
                       check=False)
    assert (r.returncode, (tmp_path / "rc").read_text()) == (0, "0")
    end = read_events(tmp_path / "p")[-1]
    assert (end["reason"], end["exit_code"], end["final_step"]) == ("completed", 0, 3)
    rc = _closed_console([*TRAIN, "--recipe", "from-scratch", *TINY, "--data.path",
                          str(tmp_path / "missing.txt"), "--runs-root", str(tmp_path),
                          "--run-id", "bad", "--steps", "3"])
    assert rc == 2 and not (tmp_path / "bad").exists()


@pytest.mark.parametrize("prog", ["train", "eval", "generate", "export", "report", "sweep",
                                  "classify", "launch"])
def test_help_and_version_into_a_closed_pipe_are_quiet(prog):
    """`toymlx-export --help | head -1`: tyro's help met the closed pipe outside the command's
    handling, and `--version | head -0` of five commands the same: a BrokenPipeError
    traceback and exit status 1. Now each ends quietly with 0."""
    for flag in ("--help", "--version"):
        r = _closed_stdout([sys.executable, "-m", f"toymlx_cli.{prog}", flag])
        assert (flag, r.returncode, r.stderr) == (flag, 0, "")

def test_a_pipe_whose_reader_went_is_a_stop_request_before_any_write():
    """The loop polls its console: a pipe whose reader has gone is one request to stop (named
    SIGPIPE) before anything is written to it, so `| head -3` stops a run after the step in
    flight instead of at its next report line, 10 steps later by default. Not a rank's signal
    (toymlx-launch's ranks stop together), and never a second request."""
    from toymlx.backend.stop import RANK_SIGNALS, SOLO_SIGNALS, StopSignals

    read, write = os.pipe()
    saved = os.dup(1)
    try:
        os.dup2(write, 1)
        with StopSignals(SOLO_SIGNALS) as stop:
            assert (stop.count, stop.name) == (0, None)
            os.close(read)
            assert (stop.count, stop.name, stop.exit_code) == (1, "SIGPIPE", 141)
            assert stop.count == 1
        with StopSignals(RANK_SIGNALS) as stop:
            assert stop.count == 0
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(write)


def _closed_console(cmd: list[str]) -> int:
    """`cmd 2>&1 | head -0`: stdout and stderr one pipe whose reader has already gone; the
    exit status."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    p.stdout.close()
    return p.wait(timeout=300)


def test_a_closed_console_stops_the_run_once_and_a_report_is_drawn(tmp_path, data):
    """`toymlx-train ... 2>&1 | head -0`: the run trained to its end and then exited 1 with a
    BrokenPipeError on its last line (toymlx-report the same after drawing its file); later it
    trained to its end with no one reading. Now the first line that meets the closed console
    (the --warmup note) stops the run as a signal does, after step 1: exit 141, with its
    checkpoint, so stdout and stderr, one pipe, made one request (a second would skip it).
    toymlx-report draws its file and exits 0."""
    rc = _closed_console([*TRAIN, "--recipe", "from-scratch", *TINY, "--data.path", data,
                          "--runs-root", str(tmp_path), "--run-id", "p", "--steps", "3",
                          "--warmup", "5", "--report-every", "1"])  # a --warmup note too
    assert rc == 141
    end = read_events(tmp_path / "p")[-1]
    assert (end["reason"], end["signal"], end["final_step"]) == ("interrupted", "SIGPIPE", 1)
    assert (tmp_path / "p" / "weights" / "step_1.gguf").is_file()
    out = tmp_path / "r.png"
    rc = _closed_console([sys.executable, "-m", "toymlx_cli.report", str(tmp_path / "p"),
                          "--out", str(out)])
    assert rc == 0 and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("console", ["hung-up terminal", "full log disk"])
def test_a_console_that_fails_to_write_neither_stops_training_nor_loses_steps(tmp_path, data,
                                                                           console):
    """A closed terminal (a pty whose other end has gone answers writes with EIO), or stdout
    redirected to a full disk (/dev/full: ENOSPC): the next report line ended the run as
    "error: OSError: [Errno 5] Input/output error" with no checkpoint, every step since the
    last one lost. Now the console's output is discarded and the run trains to its end."""
    import os
    import pty

    cmd = [*TRAIN, "--recipe", "from-scratch", *TINY, "--data.path", data, "--runs-root",
           str(tmp_path), "--run-id", "c", "--steps", "12", "--report-every", "1"]
    if console == "full log disk":
        with open("/dev/full", "w") as full:
            rc = subprocess.run(cmd, stdout=full, stderr=full, timeout=300,
                                check=False).returncode
    else:
        master, slave = pty.openpty()
        p = subprocess.Popen(cmd, stdout=slave, stderr=slave, stdin=subprocess.DEVNULL)
        os.close(slave)
        seen = b""
        while b"step 1/" not in seen:  # training has started: the terminal goes
            seen += os.read(master, 4096)
        os.close(master)
        rc = p.wait(timeout=300)
    assert rc == 0
    end = read_events(tmp_path / "c")[-1]
    assert (end["kind"], end["reason"], end["final_step"]) == ("run_end", "completed", 12)
    assert os.readlink(tmp_path / "c" / "weights" / "latest") == "step_12.gguf"


def test_a_bundle_opened_from_python_names_the_keyword_not_a_flag(tmp_path):
    """`Bundle.open(path)` from Python names what was called (`path`), not toymlx-train's
    --resume (nor `Bundle.of` eval's --model); a command passes its own flag and keeps it."""
    from toymlx.bundle.options import RunError
    from toymlx.runner.bundle import Bundle

    assert Bundle.of(tmp_path) is None  # no config.json: a path outside any run
    gone = tmp_path / "gone"
    for call, said in ((lambda: Bundle.open(tmp_path), "path"),
                       (lambda: Bundle.open(tmp_path, "--resume"), "--resume")):
        with pytest.raises(RunError) as e:
            call()
        assert str(e.value) == (f"{tmp_path / 'config.json'}: {said}: expected the run's saved "
                                "config, found no file (a run folder of toymlx-train has one)")
    with pytest.raises(RunError) as e:
        Bundle.open(gone)
    assert str(e.value) == f"{gone}: path: expected a run bundle folder, found nothing"
