"""events.jsonl in the toy/v1 format: every event of a completed, stopped, interrupted,
diverged and torn (killed) bundle checked against /work/shared/TOY_V1.md's table, the
validator's own rules, and bundles written before `kind` (the `event` key) still read."""

from __future__ import annotations

import copy
import datetime as dt
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from toymlx_cli.eval import main as eval_main
from toymlx_cli.train import main

import toymlx
from toymlx import report
from toymlx.events import EventLog, check_toy_v1, parse_event, read_events

TINY = ["--model.d-model", "32", "--model.n-layers", "1", "--model.n-heads", "4",
        "--model.n-kv-heads", "2", "--model.ffn-dim", "64", "--model.context", "64",
        "--seq-len", "32", "--batch-size", "2", "--eval-batches", "1", "--no-compile",
        "--no-progress"]


@pytest.fixture(scope="module")
def data(shared_data: Path) -> str:
    return str(shared_data / "text" / "tinystories_sample.txt")


def _args(root: Path, run_id: str, data: str, *extra: str) -> list[str]:
    return ["--recipe", "from-scratch", *TINY, "--data.path", data, "--runs-root", str(root),
            "--run-id", run_id, *extra]


def _steps(events: list[dict]) -> list[dict]:
    return [e for e in events if e["kind"] == "step"]


@pytest.fixture(scope="module")
def completed(tmp_path_factory, data) -> Path:
    root = tmp_path_factory.mktemp("completed")
    assert main(_args(root, "c", data, "--steps", "4", "--eval-every", "2",
                      "--checkpoint-every", "2")) == 0
    return root / "c"


# ---- writing ---------------------------------------------------------------------------------

def test_weird_strings_and_numbers_stay_valid_json(tmp_path):
    rid = 'run "quoted" \\back\\slash ünïcödé 🚀\n\ttab'
    log = EventLog(tmp_path / "events.jsonl")
    log.emit("run_start", run_id=rid, path=str(tmp_path / rid), loss=float("nan"))
    log.emit("run_end", reason="completed", grad_norm=float("inf"))
    log.close()
    lines = (tmp_path / "events.jsonl").read_text(encoding="utf-8").splitlines()
    assert len(lines) == 2
    first = json.loads(lines[0])
    assert first["run_id"] == rid and first["loss"] == "nan"
    assert json.loads(lines[1])["grad_norm"] == "inf"


def test_emit_writes_what_toy_v1_fixes_for_each_kind(tmp_path):
    log = EventLog(tmp_path / "events.jsonl")
    start = log.emit("run_start", run_id="r", git=None)
    step = log.emit("step", step=1, loss=2.5)
    end = log.emit("run_end", reason="completed", final_step=1, final_loss=log.loss_at(1))
    log.close()
    assert [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()] == [
        start, step, end]
    assert list(start)[:2] == ["kind", "t"] and start["kind"] == "run_start"
    assert start["schema"] == "toy/v1" and start["phase"] == "train"
    assert start["toymlx_version"] == toymlx.__version__
    assert "git" not in start  # toy/v1: only when the run knows its commit
    assert dt.datetime.fromisoformat(start["started_at"]).tzinfo is not None
    assert step["phase"] == "train" and "event" not in step
    assert dt.datetime.fromisoformat(end["ended_at"]) >= dt.datetime.fromisoformat(
        start["started_at"])
    assert end["final_loss"] == 2.5


def test_loss_at_reads_earlier_segments_of_the_bundle(tmp_path):
    p = tmp_path / "events.jsonl"
    first = EventLog(p)
    for s, loss in [(1, 3.0), (2, 2.0), (3, 1.5)]:
        first.emit("step", step=s, loss=loss)
    first.close()
    again = EventLog(p)  # a resumed process: its own steps are not emitted yet
    assert again.loss_at(2) == 2.0 and again.loss_at(3) == 1.5
    assert again.loss_at(0) is None and again.loss_at(9) is None
    again.emit("step", step=3, loss=1.25)  # step 3 redone after a torn resume: newest wins
    assert again.loss_at(3) == 1.25
    again.close()
    assert EventLog(p, enabled=False).loss_at(3) == 1.25


# ---- reading -----------------------------------------------------------------------------------

def test_torn_last_line_is_skipped(tmp_path):
    p = tmp_path / "events.jsonl"
    log = EventLog(p)
    for i in range(3):
        log.emit("step", step=i + 1, loss=1.0)
    log.close()
    with open(p, "ab") as f:
        f.write(b'{"kind": "step", "step": 4, "lo')
    evs = read_events(p)
    assert [e["step"] for e in evs] == [1, 2, 3]
    assert read_events(tmp_path / "missing.jsonl") == []


def test_parse_event_accepts_kind_and_the_older_event_key():
    assert parse_event(b'{"kind": "step", "step": 1}') == {"kind": "step", "step": 1}
    old = parse_event('{"event": "eval", "t": 1.5, "step": 2}')
    assert old == {"kind": "eval", "t": 1.5, "step": 2} and next(iter(old)) == "kind"
    for bad in (b'{"kind": "st', b"[1, 2]", b'{"step": 1}', b'{"kind": 3}', b"\xff\xfe",
                b""):
        assert parse_event(bad) is None, bad


# ---- bundles against TOY_V1.md ------------------------------------------------------------------

def test_completed_bundle_is_toy_v1(completed):
    evs = read_events(completed)
    assert check_toy_v1(evs) == []
    raw = [json.loads(x) for x in (completed / "events.jsonl").read_text().splitlines()]
    assert all("kind" in e and "event" not in e for e in raw)  # on disk, not only as read
    assert [e["kind"] for e in evs].count("run_start") == 1
    start, end = evs[0], evs[-1]
    assert start["config"]["context"] == 32 and start["toymlx_version"] == toymlx.__version__
    assert [s["step"] for s in _steps(evs)] == [1, 2, 3, 4]
    assert all(s["phase"] == "train" for s in _steps(evs))
    assert (end["reason"], end["final_step"], end["exit_code"]) == ("completed", 4, 0)
    assert end["final_loss"] == _steps(evs)[-1]["loss"]


def test_stopped_bundle_is_toy_v1(tmp_path, data):
    assert main(_args(tmp_path, "s", data, "--steps", "6", "--stop-at", "3")) == 0
    evs = read_events(tmp_path / "s")
    assert check_toy_v1(evs) == []
    end = evs[-1]
    assert (end["reason"], end["final_step"], end["exit_code"]) == ("stopped", 3, 0)
    assert end["final_loss"] == _steps(evs)[2]["loss"]


def _train_process(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "toymlx_cli.train", *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _wait_for_step(p: subprocess.Popen, events: Path, step: int) -> None:
    t0 = time.monotonic()
    while f'"step": {step},'.encode() not in (events.read_bytes() if events.exists() else b""):
        assert p.poll() is None, f"the run ended before step {step}: {p.stderr.read()[-2000:]}"
        assert time.monotonic() - t0 < 300
        time.sleep(0.005)


def test_interrupted_bundle_is_toy_v1(tmp_path, data):
    p = _train_process(_args(tmp_path, "i", data, "--steps", "600", "--eval-every", "0"))
    _wait_for_step(p, tmp_path / "i" / "events.jsonl", 3)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=300)
    assert p.returncode == 130, err[-2000:]
    evs = read_events(tmp_path / "i")
    assert check_toy_v1(evs) == []
    end = evs[-1]
    assert end["reason"] == "interrupted" and end["exit_code"] == 130
    assert 3 <= end["final_step"] < 600
    assert end["final_loss"] == next(s["loss"] for s in _steps(evs)
                                     if s["step"] == end["final_step"])


def test_torn_bundle_is_toy_v1(tmp_path, data):
    p = _train_process(_args(tmp_path, "k", data, "--steps", "600", "--eval-every", "0"))
    events = tmp_path / "k" / "events.jsonl"
    _wait_for_step(p, events, 3)
    p.kill()
    p.communicate(timeout=60)
    with open(events, "ab") as f:  # a kill mid-write leaves half a line
        f.write(b'{"kind": "step", "t": 1.0, "phase": "tra')
    evs = read_events(tmp_path / "k")
    assert check_toy_v1(evs) == []
    assert "run_end" not in [e["kind"] for e in evs] and len(_steps(evs)) >= 3
    assert report.summarize_run(tmp_path / "k")["status"] == "torn"


@pytest.mark.parametrize("extra", [["--lr", "1e30"], ["--lr", "1e3", "--warmup", "3",
                                                        "--grad-clip", "0"]])
def test_diverged_bundle_is_toy_v1_with_the_last_finite_loss(tmp_path, data, extra):
    assert main(_args(tmp_path, "d", data, "--steps", "40", "--warmup", "0", *extra)) == 2
    evs = read_events(tmp_path / "d")
    assert check_toy_v1(evs) == []
    end, steps = evs[-1], _steps(evs)
    assert end["reason"] == "diverged" and end["final_step"] >= 1
    assert end["final_loss"] == next(s["loss"] for s in steps if s["step"] == end["final_step"])


def test_no_step_completed_writes_a_null_final_loss(tmp_path, data):
    """Weights that overflow in step 1's update: no step completed, so there is no loss to
    report; toy/v1 has no value for that, toymlx writes null (the one documented departure)."""
    assert main(_args(tmp_path, "w", data, "--steps", "5", "--lr", "1e38", "--weight-decay",
                      "100", "--warmup", "0", "--checkpoint-every", "1")) == 2
    end = read_events(tmp_path / "w")[-1]
    assert end["final_step"] == 0 and end["final_loss"] is None
    assert check_toy_v1(read_events(tmp_path / "w")) == []


def test_vit_and_lora_bundles_are_toy_v1(tmp_path, stories_path):
    assert main(["--recipe", "vit-tiny", "--model.d-model", "32", "--model.n-layers", "1",
                 "--model.n-heads", "2", "--model.ffn-dim", "64", "--batch-size", "16",
                 "--steps", "2", "--no-compile", "--no-progress", "--runs-root", str(tmp_path),
                 "--run-id", "v"]) == 0
    assert main(["--recipe", "lora", "--base", str(stories_path), "--steps", "2",
                 "--batch-size", "2", "--seq-len", "64", "--eval-batches", "1", "--no-compile",
                 "--no-progress", "--runs-root", str(tmp_path), "--run-id", "l"]) == 0
    for rid, arch in (("v", "vit"), ("l", "llama")):
        evs = read_events(tmp_path / rid)
        assert check_toy_v1(evs) == [], rid
        assert evs[0]["model"]["arch"] == arch and evs[-1]["reason"] == "completed"
    assert read_events(tmp_path / "l")[0]["config"]["context"] == 64


# ---- the validator's own rules ------------------------------------------------------------------

def _bad(events: list[dict], where: int, **change) -> list[dict]:
    """A copy of `events` with event `where` changed: `host__arch=...` sets
    ev["host"]["arch"], a value of `...` deletes the key."""
    out = copy.deepcopy(events)
    for key, value in change.items():
        *parents, last = key.split("__")
        target = out[where]
        for k in parents:
            target = target[k]
        if value is ...:
            del target[last]
        else:
            target[last] = value
    return out


@pytest.mark.parametrize("where, change, problem", [
    (-1, {"final_loss": "nan"}, ("event {n} (run_end): key 'final_loss': expected number, "
                                'found "nan"')),
    (-1, {"final_loss": None}, "key 'final_loss': expected number, found null"),
    (-1, {"ended_at": ...}, "key 'ended_at': missing"),
    (-1, {"ended_at": "yesterday"}, "key 'ended_at': expected ISO-8601 string"),
    (-1, {"exit_code": 1}, "key 'exit_code': expected 0 for reason \"completed\", found 1"),
    (-1, {"final_step": 4.0}, "key 'final_step': expected int, found 4.0"),
    (1, {"phase": ...}, "event 2 (step): key 'phase': missing"),
    (1, {"phase": "eval"}, "key 'phase': expected \"train\", found \"eval\""),
    (1, {"step": 0}, "key 'step': expected >= 1 (1-indexed), found 0"),
    (1, {"loss": True}, "key 'loss': expected number, found true"),
    (0, {"schema": "toy/v2"}, "key 'schema': expected \"toy/v1\""),
    (0, {"git": None}, "key 'git': expected an object or no key, found null"),
    (0, {"git": {"sha": "abc"}}, "key 'git.branch': missing"),
    (0, {"host__arch": ...}, "key 'host.arch': missing"),
    (0, {"backend__kind": 3}, "key 'backend.kind': expected string, found 3"),
    (0, {"model__vocab": ...}, "key 'model.vocab': missing"),
    (0, {"config__context": ...}, "key 'config.context': missing"),
    (0, {"config__lr": "3e-3"}, "key 'config.lr': expected number"),
    (0, {"started_at": 12}, "key 'started_at': expected ISO-8601 string, found 12"),
])
def test_validator_names_each_departure(completed, where, change, problem):
    evs = read_events(completed)
    bad = _bad(evs, where if where >= 0 else len(evs) + where, **change)
    found = check_toy_v1(bad)
    assert len(found) == 1 and problem.format(n=len(evs)) in found[0], found


def test_validator_checks_the_order(completed):
    evs = read_events(completed)
    assert check_toy_v1(evs[1:]) == ["run_start: expected exactly one, found 0"]
    assert check_toy_v1([evs[0], *evs]) == ["run_start: expected exactly one, found 2"]
    assert check_toy_v1([evs[1], evs[0], *evs[2:]]) == [("run_start: expected first, found at "
                                                         "event 2")]
    assert check_toy_v1([*evs, evs[-1]]) == ["run_end: expected at most one, found 2"]
    moved = [*evs[:-2], evs[-1], evs[-2]]
    assert check_toy_v1(moved) == [(f"run_end: expected last, found at event {len(evs) - 1} "
                                   f"of {len(evs)}")]
    assert check_toy_v1(evs[:-1]) == []  # torn: no run_end at all
    raw = [json.loads(x) for x in (completed / "events.jsonl").read_text().splitlines()]
    old = [{"event": e.pop("kind"), **e} for e in raw]  # as a toy/v1 reader sees 0.1's bundles
    assert "event 1 (None): key 'kind': expected a string, found null" in check_toy_v1(old)


# ---- bundles written before `kind` -------------------------------------------------------------

def _as_toymlx_0_1(run: Path) -> None:
    """Rewrite a bundle's events as toymlx 0.1 wrote them: `event`, no phase on steps, no
    ended_at or version, final_loss NaN (a string) when no step was finite."""
    out = []
    for line in (run / "events.jsonl").read_text().splitlines():
        e = json.loads(line)
        kind = e.pop("kind")
        if kind == "step":
            e.pop("phase")
        e.pop("ended_at", None)
        e.pop("toymlx_version", None)
        out.append(json.dumps({"event": kind, **e}))
    (run / "events.jsonl").write_text("\n".join(out) + "\n")


def test_a_bundle_with_the_older_event_key_reads_reports_evaluates_and_resumes(
        tmp_path, data, capsys):
    run = tmp_path / "old"
    assert main(_args(tmp_path, "old", data, "--steps", "4", "--stop-at", "2",
                      "--checkpoint-every", "2", "--eval-every", "2")) == 0
    _as_toymlx_0_1(run)
    assert '"event": "run_start"' in (run / "events.jsonl").read_text()
    evs = read_events(run)
    assert [e["kind"] for e in evs] == ["run_start", "step", "step", "eval", "checkpoint",
                                        "run_end"]
    row = report.summarize_run(run)
    assert (row["status"], row["step"], row["final_step"]) == ("stopped", 2, 2)
    assert row["final_loss"] == evs[2]["loss"] and row["final"] == evs[3]["val_loss"]

    capsys.readouterr()
    assert eval_main(["--model", str(run), "--data-path", data, "--seq-len", "32"]) == 0
    assert json.loads(capsys.readouterr().out)["model"].endswith("step_2.gguf")

    assert main(["--resume", str(run), "--no-progress"]) == 0  # check_resume reads run_start
    evs = read_events(run)
    assert [s["step"] for s in _steps(evs)] == [1, 2, 3, 4]
    assert evs[-1]["kind"] == "run_end" and evs[-1]["reason"] == "completed"
    row = report.summarize_run(run)
    assert (row["status"], row["step"]) == ("completed", 4)


def test_resume_still_checks_the_model_of_an_old_bundle(tmp_path, data, capsys):
    run = tmp_path / "old"
    assert main(_args(tmp_path, "old", data, "--steps", "4", "--stop-at", "2")) == 0
    _as_toymlx_0_1(run)
    capsys.readouterr()
    assert main(["--resume", str(run), "--model.d-model", "64", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "model d_model: expected 32 (the run's), found 64" in err, err
