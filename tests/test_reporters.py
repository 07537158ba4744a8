"""--report-to tensorboard,wandb: the scalars TensorBoard's and W&B's own readers find are
events.jsonl's numbers; a missing package or an unknown name is one line; a resume's dropped
steps leave the curves; a failing reporter never ends the run."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import struct
from pathlib import Path

import numpy as np
import pytest
from cli_errors import error_line
from conftest import home_elsewhere
from toymlx_cli.train import main

from toymlx.bundle import reporters
from toymlx.bundle.events import EventLog, read_events

TINY = ["--model.d-model", "32", "--model.n-layers", "1", "--model.n-heads", "4",
        "--model.n-kv-heads", "2", "--model.ffn-dim", "64", "--model.context", "64",
        "--seq-len", "32", "--batch-size", "2", "--eval-batches", "1", "--no-compile",
        "--no-progress", "--steps", "20", "--eval-every", "5", "--checkpoint-every", "10"]


@pytest.fixture(scope="module")
def text_path(shared_file) -> Path:
    return shared_file("text/tinystories_sample.txt")


def _run(root: Path, data: Path, report_to: str) -> Path:
    assert main(["--recipe", "from-scratch", *TINY, "--data.path", str(data), "--runs-root",
                 str(root), "--run-id", "r", "--report-to", report_to]) == 0
    return root / "r"


def _of(events: list[dict], kind: str, key: str, **where) -> dict[int, float]:
    return {e["step"]: e[key] for e in events if e["kind"] == kind
            and all(e.get(k) == v for k, v in where.items())}


def _accumulator(run: Path):
    from tensorboard.backend.event_processing import event_accumulator

    acc = event_accumulator.EventAccumulator(str(run), size_guidance={"scalars": 0})
    acc.Reload()
    return acc


def test_tensorboard_scalars_are_events_jsonl(tmp_path, text_path):
    pytest.importorskip("tensorboard", reason="the tensorboard extra: pip install "
                        "'toymlx[tensorboard]'")
    run = _run(tmp_path, text_path, "tensorboard")
    events = read_events(run)
    assert list(run.glob("events.out.tfevents.*")), "no event file in the run folder"
    acc = _accumulator(run)
    tb = {s.step: s.value for s in acc.Scalars("train/loss")}
    losses = _of(events, "step", "loss")
    assert sorted(tb) == list(range(1, 21)) == sorted(losses)
    # simple_value is a float32: each scalar is events.jsonl's loss rounded to float32, exactly
    assert all(tb[s] == float(np.float32(losses[s])) for s in losses)
    lr = {s.step: s.value for s in acc.Scalars("train/lr")}
    assert lr == {s: float(np.float32(v)) for s, v in _of(events, "step", "lr").items()}
    val = {s.step: s.value for s in acc.Scalars("val/loss")}
    assert val == {s: float(np.float32(v)) for s, v in _of(events, "eval", "val_loss").items()}
    assert sorted(val) == [5, 10, 15, 20]
    assert [s.step for s in acc.Scalars("checkpoint/step")] == [10, 20]
    end = events[-1]
    assert [(s.step, s.value) for s in acc.Scalars("run/final_loss")] == [
        (20, float(np.float32(end["final_loss"])))]
    # the run's config, as HF Trainer's TensorBoard callback writes its args: text at step 0
    (config,) = acc.Tensors("config")
    text = config.tensor_proto.string_val[0].decode()
    assert config.step == 0 and text.startswith("```json\n") and text.endswith("\n```")
    assert json.loads(text[len("```json\n"):-len("\n```")]) == json.loads(json.dumps(
        events[0]["config"], default=str))


def test_a_resume_drops_the_killed_segment_from_the_curves(tmp_path):
    pytest.importorskip("tensorboard", reason="the tensorboard extra")
    log = EventLog(tmp_path / "events.jsonl", sinks=reporters.open_reporters("tensorboard",
                                                                             tmp_path))
    for s in range(1, 6):
        log.emit("step", step=s, loss=10.0 - s)
    log.close()  # killed after step 5; its checkpoint was step 3
    log = EventLog(tmp_path / "events.jsonl", sinks=reporters.open_reporters("tensorboard",
                                                                             tmp_path))
    log.emit("resume", from_step=3)
    for s in range(4, 7):
        log.emit("step", step=s, loss=100.0 + s)
    log.close()
    scalars = [(e.step, e.value) for e in _accumulator(tmp_path).Scalars("train/loss")]
    assert scalars == [(1, 9.0), (2, 8.0), (3, 7.0), (4, 104.0), (5, 105.0), (6, 106.0)]


def test_a_stopped_segments_run_end_leaves_the_curves(tmp_path):
    """SIGTERM after step 5 (its checkpoint step_5, its run_end at 5), then a resume from 5 to
    7: events.jsonl drops the first run_end, so must TensorBoard; before, run/final_loss kept
    both (5, 5.0) and (7, 7.0), as did run/first_step_s."""
    pytest.importorskip("tensorboard", reason="the tensorboard extra")
    path = tmp_path / "events.jsonl"
    log = EventLog(path, sinks=reporters.open_reporters("tensorboard", tmp_path))
    for s in range(1, 6):
        log.emit("step", step=s, loss=10.0 - s)
    log.emit("checkpoint", step=5)
    log.emit("run_end", reason="interrupted", final_step=5, final_loss=5.0, exit_code=143,
             first_step_s=0.5)
    log.close()
    kept = [e for e in read_events(tmp_path) if e["kind"] != "run_end"]  # as the resume keeps
    path.write_text("".join(json.dumps(e) + "\n" for e in kept))
    log = EventLog(path, sinks=reporters.open_reporters("tensorboard", tmp_path))
    log.emit("resume", from_step=5)
    for s in (6, 7):
        log.emit("step", step=s, loss=10.0 - s)
    log.emit("run_end", reason="completed", final_step=7, final_loss=3.0, exit_code=0,
             first_step_s=0.25)
    log.close()
    acc = _accumulator(tmp_path)
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [
        (s, 10.0 - s) for s in range(1, 8)]
    assert [(e.step, e.value) for e in acc.Scalars("checkpoint/step")] == [(5, 5.0)]
    assert [(e.step, e.value) for e in acc.Scalars("run/final_loss")] == [(7, 3.0)]
    assert [(e.step, e.value) for e in acc.Scalars("run/first_step_s")] == [(7, 0.25)]


def test_missing_package_is_one_line_naming_the_extra(tmp_path, text_path, monkeypatch,
                                                      capsys):
    """wandb not installed (and, as on a machine without either extra, the check does not
    depend on tensorboard being there): one line naming the extra, no run folder."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else real(name, *a))
    assert main(["--recipe", "from-scratch", *TINY, "--data.path", str(text_path),
                 "--runs-root", str(tmp_path), "--run-id", "r", "--report-to", "wandb"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("toymlx-train: error: --report-to wandb: the wandb package is not "
                       "installed; install toymlx's wandb extra: pip install 'toymlx[wandb]'")
    assert not (tmp_path / "r").exists()


def test_unknown_service_is_refused_by_name():
    with pytest.raises(ValueError) as e:
        reporters.parse_report_to("tensorboard,swanlab")
    assert str(e.value) == ("--report-to tensorboard,swanlab: expected a comma list of "
                            "tensorboard, wandb, or all or none, found 'swanlab'")


def test_none_all_and_a_typo_as_hf_trainer_users_type_them(monkeypatch):
    """HF Trainer's `--report_to none` and `all`; a misspelt service names the close one."""
    monkeypatch.setattr(importlib, "import_module", lambda name: None)  # both extras "there"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    assert reporters.parse_report_to("none") == ()
    assert reporters.parse_report_to("None") == ()
    assert reporters.parse_report_to("all") == ("tensorboard", "wandb")
    assert reporters.parse_report_to("wandb,") == ("wandb",)
    with pytest.raises(ValueError) as e:
        reporters.parse_report_to("tensorbord")
    assert str(e.value) == ("--report-to tensorbord: expected a comma list of tensorboard, "
                            "wandb, or all or none, found 'tensorbord' (did you mean "
                            "tensorboard?)")
    with pytest.raises(ValueError) as e:
        reporters.parse_report_to("tensorboard,none")
    assert str(e.value) == ("--report-to tensorboard,none: none stands alone; expected none "
                            "or a comma list of tensorboard, wandb")


def test_a_package_that_does_not_import_is_one_line_before_the_run_folder(
        tmp_path, text_path, monkeypatch, capsys):
    """tensorboard installed but broken (its protobuf): one line naming the extra and the
    error, exit 2, no run folder; it was a traceback from the trainer after config.json and
    weights/ were made."""
    real, found = importlib.import_module, importlib.util.find_spec

    def broken(name, *a):
        if name.startswith("tensorboard"):
            raise ImportError("cannot import name 'builder' from 'google.protobuf.internal'")
        return real(name, *a)

    def installed(name, *a):  # installed, whether or not this environment has the extra
        return importlib.machinery.ModuleSpec(name, None) if name == "tensorboard" else found(
            name, *a)

    monkeypatch.setattr(importlib, "import_module", broken)
    monkeypatch.setattr(importlib.util, "find_spec", installed)
    assert main(["--recipe", "from-scratch", *TINY, "--data.path", str(text_path),
                 "--runs-root", str(tmp_path), "--run-id", "r", "--report-to",
                 "tensorboard"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("toymlx-train: error: --report-to tensorboard: the tensorboard package "
                       "does not import (ImportError: cannot import name 'builder' from "
                       "'google.protobuf.internal'); reinstall toymlx's tensorboard extra: "
                       "pip install 'toymlx[tensorboard]'")
    assert not (tmp_path / "r").exists()


def test_a_failing_reporter_is_named_once_and_dropped(tmp_path, capsys):
    seen = []

    class Broken:
        def __call__(self, ev):
            seen.append(ev["step"])
            raise OSError("disk full")

        def close(self):
            raise AssertionError("closed after it was dropped")

    log = EventLog(tmp_path / "events.jsonl", sinks=[Broken()])
    log.emit("step", step=1, loss=1.0)
    log.emit("step", step=2, loss=0.5)
    log.close()
    assert seen == [1]
    assert [e["step"] for e in read_events(tmp_path)] == [1, 2]
    assert capsys.readouterr().err.strip() == ("toymlx: --report-to: Broken stopped: OSError: "
                                               "disk full; events.jsonl goes on")


def test_scalars_of_each_event():
    assert reporters.scalars({"kind": "eval", "step": 4, "split": "test", "test_loss": 1.5,
                              "test_perplexity": 4.48, "seconds": 0.1, "t": 9.0}) == (
        4, {"test/loss": 1.5, "test/perplexity": 4.48, "test/seconds": 0.1})
    assert reporters.scalars({"kind": "eval", "step": 5, "val_loss": 2.0, "accuracy": 0.5}) == (
        5, {"val/loss": 2.0, "val/accuracy": 0.5})
    assert reporters.scalars({"kind": "run_start", "run_id": "r"}) is None
    assert reporters.scalars({"kind": "step", "step": 1, "loss": "nan", "lr": 0.1,
                              "skipped": True}) == (1, {"train/lr": 0.1})


# ---- W&B: its offline run's transaction log, read as W&B's records -----------------------------
def _wandb_records(path: Path):
    """The records of a W&B `.wandb` file: a LevelDB-style log (32 KiB blocks of chunks: CRC,
    length, type) after a 7-byte header, each record one of W&B's own protobuf `Record`s."""
    from wandb.proto import wandb_internal_pb2 as pb

    raw = path.read_bytes()
    assert raw[:4] == b":W&B", f"{path}: not a W&B transaction log"
    pos, block, data = 7, 32768, b""
    while pos + 7 <= len(raw):
        if block - pos % block < 7:  # a block's tail too short for a chunk header
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos:pos + 7])
        data += raw[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL, LAST
            rec = pb.Record()
            rec.ParseFromString(data)
            yield rec
            data = b""
        elif kind == 0:
            break


def test_wandb_offline_history_is_events_jsonl(tmp_path, text_path, monkeypatch):
    pytest.importorskip("wandb", reason="the wandb extra: pip install 'toymlx[wandb]'")
    for var in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_PROJECT", "WANDB_DIR"):
        monkeypatch.delenv(var, raising=False)
    home_elsewhere(monkeypatch, tmp_path)  # no ~/.netrc: no W&B login, so offline
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "config"))
    run = _run(tmp_path / "runs", text_path, "wandb")
    files = list((run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1, f"expected one offline W&B run in {run / 'wandb'}, found {files}"
    history: dict[int, dict] = {}
    for rec in _wandb_records(files[0]):
        if rec.WhichOneof("record_type") == "history":
            row = {(it.key or "/".join(it.nested_key)): json.loads(it.value_json)
                   for it in rec.history.item}
            history.setdefault(row["_step"], {}).update(row)
    events = read_events(run)
    losses = _of(events, "step", "loss")
    assert {s: h["train/loss"] for s, h in history.items() if "train/loss" in h} == losses
    assert {s: h["val/loss"] for s, h in history.items() if "val/loss" in h} == _of(
        events, "eval", "val_loss")
    # run_end's figures are the W&B run's summary, not a point of its history (a resume's
    # rewind to the step it resumes from would keep a stopped segment's there)
    assert not [s for s, h in history.items() if any(k.startswith("run/") for k in h)]
    summary = {}
    for rec in _wandb_records(files[0]):
        if rec.WhichOneof("record_type") == "summary":
            summary.update({(it.key or "/".join(it.nested_key)): json.loads(it.value_json)
                            for it in rec.summary.update})
    assert summary["run/final_loss"] == events[-1]["final_loss"] == losses[20]


def _wandb_segments(run: Path) -> list[tuple[str, tuple | None, dict[int, dict]]]:
    """(run id, branch point (run, value, metric) or None, {step: row}) of each offline W&B
    run in the run folder, oldest first (`wandb sync` uploads them in this order)."""
    out = []
    for path in sorted((run / "wandb").glob("offline-run-*/run-*.wandb")):
        run_id, branch, history = None, None, {}
        for rec in _wandb_records(path):
            kind = rec.WhichOneof("record_type")
            if kind == "run":
                run_id = rec.run.run_id
                if rec.run.HasField("branch_point"):
                    bp = rec.run.branch_point
                    branch = (bp.run, bp.value, bp.metric)
            elif kind == "history":
                row = {(it.key or "/".join(it.nested_key)): json.loads(it.value_json)
                       for it in rec.history.item}
                history.setdefault(row["_step"], {}).update(row)
        out.append((run_id, branch, history))
    return out


def _wandb_config(path: Path) -> dict:
    """The config an offline W&B run's file logs (its run record's, then config updates), less
    W&B's own `_` keys."""
    config = {}
    for rec in _wandb_records(path):
        kind = rec.WhichOneof("record_type")
        items = (rec.run.config.update if kind == "run" else rec.config.update
                 if kind == "config" else ())
        config.update({(it.key or "/".join(it.nested_key)): json.loads(it.value_json)
                       for it in items})
    return {k: v for k, v in config.items() if not k.startswith("_")}


def test_a_resume_at_an_earlier_step_rewinds_tensorboard_and_wandb(tmp_path, text_path,
                                                                    monkeypatch):
    pytest.importorskip("tensorboard", reason="the tensorboard extra")
    pytest.importorskip("wandb", reason="the wandb extra")
    for var in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_PROJECT", "WANDB_DIR"):
        monkeypatch.delenv(var, raising=False)
    home_elsewhere(monkeypatch, tmp_path)  # no W&B login: offline
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "config"))
    assert main(["--recipe", "from-scratch", *TINY, "--warmup", "2", "--data.path",
                 str(text_path), "--runs-root", str(tmp_path / "runs"), "--run-id", "r",
                 "--report-to", "tensorboard,wandb"]) == 0  # steps 1..20
    run = tmp_path / "runs" / "r"
    first = _of(read_events(run), "step", "loss")
    # back to step 10, on to 30: the cosine schedule now ends at 30, so steps 12..20 differ
    assert main(["--resume", str(run), "--from", "step_10", "--steps", "30"]) == 0
    events = read_events(run)
    losses = _of(events, "step", "loss")
    assert sorted(losses) == list(range(1, 31))
    # step 11's loss is taken before its update (on step 10's weights): the same in both
    assert all(losses[s] == first[s] for s in range(1, 12))
    assert all(losses[s] != first[s] for s in range(12, 21))  # the abandoned steps' numbers
    # TensorBoard's own reader: steps 11..30 are the resumed run's, none of the abandoned ones
    acc = _accumulator(run)
    tb = {s.step: s.value for s in acc.Scalars("train/loss")}
    assert len(acc.Scalars("train/loss")) == 30
    assert tb == {s: float(np.float32(v)) for s, v in losses.items()}
    assert {s.step: s.value for s in acc.Scalars("val/loss")} == {
        s: float(np.float32(v)) for s, v in _of(events, "eval", "val_loss").items()}
    # W&B: the resumed segment rewinds the same run to step 10 and logs 11..30
    (id1, branch1, h1), (id2, branch2, h2) = _wandb_segments(run)
    wid = "r-" + events[0]["run_uid"][:8]  # the run id, then its run_uid's first 8 digits
    assert id1 == id2 == wid and branch1 is None and branch2 == (wid, 10.0, "_step")
    assert sorted(h1) == list(range(1, 21)) and sorted(h2) == list(range(11, 31))
    rewound = {**{s: row for s, row in h1.items() if s <= 10}, **h2}  # the run W&B keeps
    assert {s: r["train/loss"] for s, r in rewound.items() if "train/loss" in r} == losses
    assert {s: r["val/loss"] for s, r in rewound.items() if "val/loss" in r} == _of(
        events, "eval", "val_loss")
    assert {s: r["train/loss"] for s, r in h1.items() if s > 10} == {
        s: first[s] for s in range(11, 21)}  # what the rewind drops: the first segment's
    # each segment logs the run's config (the resumed one had none), at the steps it runs to
    logged = [_wandb_config(p) for p in sorted((run / "wandb").glob("offline-run-*/run-*.wandb"))]
    config = json.loads(json.dumps(next(e for e in events if e["kind"] == "run_start")["config"]))
    assert logged == [config, {**config, "steps": 30}] and config["steps"] == 20


def test_a_server_refusing_the_rewind_gets_a_new_run_naming_its_parent(tmp_path, monkeypatch,
                                                                       capsys):
    wandb = pytest.importorskip("wandb", reason="the wandb extra")
    calls = []

    class Run:
        def __init__(self, **kw):
            self.id, self.kw = kw.get("id"), kw

        def log(self, row, step):
            calls.append(("log", self.id, step))

        def finish(self, exit_code=0):
            calls.append(("finish", self.id, exit_code))

    def init(**kw):
        calls.append(("init", kw.get("resume_from"), kw.get("id")))
        if kw.get("resume_from"):
            raise wandb.errors.CommError("rewind is not enabled for this entity")
        return Run(**kw)

    monkeypatch.setattr(wandb, "init", init)
    monkeypatch.setattr(reporters, "wandb_mode", lambda: "online")
    monkeypatch.setattr(reporters.time, "time", lambda: 1700000000.0)
    rep = reporters.WandbReporter(tmp_path / "my run")
    rep({"kind": "resume", "from_step": 7})
    rep({"kind": "step", "step": 8, "loss": 1.0})
    rep.close()
    assert calls == [("init", "my-run?_step=7", None), ("init", None, "my-run-from-7-1700000000"),
                     ("log", "my-run-from-7-1700000000", 8),
                     ("finish", "my-run-from-7-1700000000", 0)]
    assert capsys.readouterr().err.strip() == (
        "toymlx: W&B refused to rewind run my-run to step 7 for the resume of my run "
        "(CommError: rewind is not enabled for this entity); the resumed run logs to W&B run "
        "my-run-from-7-1700000000 (group my run, config toymlx_parent my-run, "
        "toymlx_from_step 7), so my-run's steps after 7 are not the resumed run's")


def test_a_resumed_segment_s_w_and_b_run_carries_the_run_s_config(tmp_path, monkeypatch):
    """The first segment's wandb.init logs run_start's config; a --resume segment's (W&B's
    rewind of the run, or the new run a server that refuses the rewind gets) logged none, so
    its W&B run had no config. Now each carries the run's config (kept in events.jsonl), at
    the steps the resume runs to."""
    wandb = pytest.importorskip("wandb", reason="the wandb extra")
    configs, refuse = [], []

    class Run:
        id = "x"

        def log(self, row, step):
            pass

        def finish(self, exit_code=0):
            pass

    def init(**kw):
        configs.append((kw.get("resume_from"), kw.get("config")))
        if kw.get("resume_from") and refuse:
            raise wandb.errors.CommError("rewind is not enabled for this entity")
        return Run()

    monkeypatch.setattr(wandb, "init", init)
    monkeypatch.setattr(reporters, "wandb_mode", lambda: "online")
    run, uid = tmp_path / "r", "0123456789abcdef"
    config = {"lr": 0.001, "steps": 20, "model": {"d_model": 32}, "report_to": "wandb"}
    for refused in (None, False, True):
        refuse[:] = [True] if refused else []
        log = EventLog(run / "events.jsonl", sinks=[reporters.WandbReporter(run, uid)])
        if refused is None:
            log.emit("run_start", run_uid=uid, config=config)
            log.emit("step", step=1, loss=1.0)
        else:
            log.emit("resume", from_step=1, steps=30)
        log.close()
    resumed = {**config, "steps": 30}
    assert configs == [(None, config), ("r-01234567?_step=1", resumed),
                       ("r-01234567?_step=1", resumed),
                       (None, {**resumed, "toymlx_parent": "r-01234567", "toymlx_from_step": 1})]


def _fake_wandb(monkeypatch, fail_rewind: BaseException | None = None) -> list[dict]:
    """wandb.init recording its arguments (no W&B run made)."""
    wandb = pytest.importorskip("wandb", reason="the wandb extra")
    inits: list[dict] = []

    class Run:
        def __init__(self, kw):
            self.id = kw.get("id")

        def log(self, row, step):
            pass

        def finish(self, exit_code=0):
            pass

    def init(**kw):
        inits.append({k: v for k, v in kw.items() if k not in ("settings", "dir", "config")})
        if kw.get("resume_from") and fail_rewind is not None:
            raise fail_rewind
        return Run(kw)

    monkeypatch.setattr(wandb, "init", init)
    return inits


def test_wandb_ids_are_per_run_and_a_sweeps_trials_are_grouped(tmp_path, monkeypatch, capsys):
    """--overwrite, or the same grid under another sweep id, is another W&B run: it used to
    reuse the run id as W&B id with resume="allow", so online (or at `wandb sync`) the new
    run's steps went into the old run's history; a sweep's trials are grouped by sweep id."""
    inits = _fake_wandb(monkeypatch)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    for sweep in ("a", "b"):
        (tmp_path / sweep).mkdir()
        (tmp_path / sweep / "sweep.json").write_text("{}")
        rep = reporters.WandbReporter(tmp_path / sweep / "lr=0.001", f"{sweep}1234567ffff")
        rep({"kind": "run_start", "config": {"lr": 0.001}})
        rep.close()
    rep = reporters.WandbReporter(tmp_path / "solo", "0123456789abcdef")
    rep({"kind": "run_start"})
    rep.close()
    assert inits == [
        {"id": "lr-0-001-a1234567", "resume": "allow", "project": "toymlx", "name": "lr=0.001",
         "mode": "offline", "group": "a"},
        {"id": "lr-0-001-b1234567", "resume": "allow", "project": "toymlx", "name": "lr=0.001",
         "mode": "offline", "group": "b"},
        {"id": "solo-01234567", "resume": "allow", "project": "toymlx", "name": "solo",
         "mode": "offline"}]
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"toymlx: W&B run solo is offline in {tmp_path / 'solo' / 'wandb'} (WANDB_MODE=offline); "
        f"upload it with: wandb sync {tmp_path / 'solo' / 'wandb'}/offline-run-*")
    # a bundle whose W&B run predates the run_uid part keeps its W&B id on resume
    (tmp_path / "old" / "wandb" / "offline-run-20261128_101010-old").mkdir(parents=True)
    assert reporters.wandb_id(tmp_path / "old", "0123456789abcdef") == "old"
    # ... a run id longer than the new id's 55 letters too: its W&B id was its first 64
    long = "lr=0.0003,batch_size=16,lora.rank=16,lora.alpha=32,warmup=100,seed=1"
    legacy = long.replace("=", "-").replace(",", "-").replace(".", "-")[:64]
    (tmp_path / long / "wandb" / f"offline-run-20261128_101010-{legacy}").mkdir(parents=True)
    assert reporters.wandb_id(tmp_path / long, "0123456789abcdef") == legacy
    assert reporters.wandb_id(tmp_path / "new" / long, "0123456789abcdef") == (
        f"{legacy[:55]}-01234567")


def test_a_local_error_at_the_rewind_is_not_taken_for_a_refusal(tmp_path, monkeypatch):
    """Only W&B's own errors mean the server refused the rewind; a local one (its folder not
    writable) drops the reporter with its own error, not a forked W&B run named after it."""
    inits = _fake_wandb(monkeypatch, NotADirectoryError(20, "Not a directory"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    log = EventLog(tmp_path / "events.jsonl",
                   sinks=[reporters.WandbReporter(tmp_path / "r", "0123456789abcdef")])
    log.emit("resume", from_step=10)
    log.emit("step", step=11, loss=1.0)
    log.close()
    assert [i.get("resume_from") for i in inits] == ["r-01234567?_step=10"]
    assert [e["step"] for e in read_events(tmp_path) if e["kind"] == "step"] == [11]


def test_an_abbreviation_names_the_service(monkeypatch):
    """--report-to tb (wb, wnb) was refused with no hint: difflib finds nothing that close."""
    for short, full in (("tb", "tensorboard"), ("wb", "wandb"), ("WnB", "wandb")):
        with pytest.raises(ValueError) as e:
            reporters.parse_report_to(f"{short},tensorboard")
        assert str(e.value) == (f"--report-to {short},tensorboard: expected a comma list of "
                                f"tensorboard, wandb, or all or none, found {short.lower()!r} "
                                f"(did you mean {full}?)")


def test_the_w_and_b_project_is_the_option_s_then_wandb_project(tmp_path, monkeypatch, capsys):
    """--wandb-project (mlx-lm's project_name) is passed to wandb.init as project=; without
    it WANDB_PROJECT, else toymlx. WANDB_DIR is not used, and a note says where the files go."""
    inits = _fake_wandb(monkeypatch)
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setenv("WANDB_PROJECT", "from-env")
    monkeypatch.delenv("WANDB_DIR", raising=False)
    for project in ("sql-lora", None):
        sinks = reporters.open_reporters("wandb", tmp_path / "r", "0123456789abcdef", project)
        sinks[0]({"kind": "run_start"})
        sinks[0].close()
    monkeypatch.delenv("WANDB_PROJECT")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "elsewhere"))
    rep = reporters.WandbReporter(tmp_path / "r", "0123456789abcdef")
    rep({"kind": "run_start"})
    rep.close()
    assert [i["project"] for i in inits] == ["sql-lora", "from-env", "toymlx"]
    assert capsys.readouterr().err.strip() == (
        f"toymlx: WANDB_DIR={tmp_path / 'elsewhere'} is not used: W&B's files for r go in its "
        f"run folder, {tmp_path / 'r' / 'wandb'}")


def test_a_w_and_b_project_without_w_and_b_is_one_line(tmp_path, capsys):
    """--wandb-project without --report-to wandb named a project no run went to, without a
    word: refused before the run, naming both flags."""
    runs = tmp_path / "runs"
    for report in ([], ["--report-to", "tensorboard"]):
        assert main(["--recipe", "vit-tiny", "--wandb-project", "p", *report, "--runs-root",
                     str(runs)]) == 2
        assert error_line(capsys) == (
            "toymlx-train: error: --wandb-project: expected with --report-to wandb (it names "
            f"that run's W&B project), found --report-to {report[1] if report else 'none'}")
    assert not runs.exists()


def _stopped_in_the_validation_at_step_0(monkeypatch) -> None:
    """A SIGTERM as --eval-at-start's pass begins: the loop has begun (run_start written, sent
    to the reporters), no step trained."""
    import os
    import signal

    from toymlx.training.evaluate import Evaluator

    evaluate = Evaluator.__call__

    def stopped(self, *a, **k):
        os.kill(os.getpid(), signal.SIGTERM)
        return evaluate(self, *a, **k)

    monkeypatch.setattr(Evaluator, "__call__", stopped)


def wandb_offline(monkeypatch, tmp_path) -> None:
    """W&B offline (WANDB_MODE), no login nor project from the environment, its cache and
    config under `tmp_path`."""
    for var in ("WANDB_API_KEY", "WANDB_PROJECT", "WANDB_DIR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    home_elsewhere(monkeypatch, tmp_path)
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "config"))


def test_a_new_run_stopped_before_its_first_step_tags_its_w_and_b_run(tmp_path, monkeypatch):
    """A new run stopped before its first step is removed, folder and all (its offline W&B run
    in wandb/ with it), but an online W&B run stayed on the server, finished like any other,
    nothing telling it from a run that trained. Now it is tagged nothing-trained (W&B's own
    file records it); a resumed run's segment, or a run that trained a step, is not."""
    wandb = pytest.importorskip("wandb", reason="the wandb extra")
    wandb_offline(monkeypatch, tmp_path)
    ends = {"new": ("run_start", 0), "resumed": ("resume", 0), "trained": ("run_start", 1)}
    for name, (first, step) in ends.items():
        run = tmp_path / name
        log = EventLog(run / "events.jsonl",
                       sinks=[reporters.WandbReporter(run, "0123456789abcdef")])
        log.emit(first, **({"from_step": 0} if first == "resume" else {"config": {}}))
        log.emit("run_end", reason="interrupted", final_step=step, exit_code=143,
                 signal="SIGTERM")
        log.close()
    wandb.teardown()  # W&B's service has written every file out
    found = {}
    for name in ends:
        (path,) = (tmp_path / name / "wandb").glob("offline-run-*/run-*.wandb")
        records = list(_wandb_records(path))
        found[name] = ([tuple(r.run.tags) for r in records if r.WhichOneof("record_type") == "run"],
                       [r.exit.exit_code for r in records if r.WhichOneof("record_type") == "exit"])
    assert found == {"new": ([(), ("nothing-trained",)], [143]), "resumed": ([()], [143]),
                     "trained": ([()], [143])}


def test_a_removed_run_names_its_online_w_and_b_run_and_takes_its_files(tmp_path, text_path,
                                                                          monkeypatch, capsys):
    """End to end: a new run with --report-to all stopped in --eval-at-start's pass goes with
    its TensorBoard file and W&B files (all in the run folder); its W&B run, online, finishes
    with the run's exit status and the tag, and the run's line says it stays on the server."""
    pytest.importorskip("tensorboard", reason="the tensorboard extra")
    wandb = pytest.importorskip("wandb", reason="the wandb extra")
    made = []

    class Run:  # what an online wandb.init leaves locally: wandb/run-DATE-ID
        def __init__(self, kw):
            self.tags, self.finished, self.summary = (), None, {}
            (Path(kw["dir"]) / "wandb" / f"run-20261205_000000-{kw['id']}").mkdir(parents=True)
            made.append(self)

        def log(self, row, step):
            pass

        def finish(self, exit_code=0):
            self.finished = exit_code

    monkeypatch.setattr(wandb, "init", lambda **kw: Run(kw))
    monkeypatch.setattr(reporters, "wandb_mode", lambda: "online")
    _stopped_in_the_validation_at_step_0(monkeypatch)
    runs = tmp_path / "runs"
    assert main(["--recipe", "from-scratch", *TINY, "--data.path", str(text_path), "--runs-root",
                 str(runs), "--run-id", "r", "--report-to", "all", "--eval-at-start"]) == 143
    assert capsys.readouterr().err.splitlines()[-1] == (
        "toymlx-train: stopped by SIGTERM before the first step; nothing was trained; its W&B "
        "run stays on W&B's server, tagged nothing-trained")
    assert not runs.exists()  # the run folder, TensorBoard's and W&B's files, the runs root
    assert [(r.tags, r.finished) for r in made] == [(("nothing-trained",), 143)]


def test_a_removed_run_says_its_offline_w_and_b_files_went_with_it(tmp_path, text_path,
                                                                   monkeypatch, capsys):
    """End to end, W&B offline (no login): the line at the start names the offline run's files
    to `wandb sync`; a new run stopped in --eval-at-start's pass is then removed, those files
    with it, and its last line said only "nothing was trained", leaving the sync line naming a
    path that is gone. The last line now says the offline W&B run went with the folder."""
    wandb = pytest.importorskip("wandb", reason="the wandb extra")
    wandb_offline(monkeypatch, tmp_path)
    _stopped_in_the_validation_at_step_0(monkeypatch)
    runs = tmp_path / "runs"
    try:
        assert main(["--recipe", "from-scratch", *TINY, "--data.path", str(text_path),
                     "--runs-root", str(runs), "--run-id", "r", "--report-to", "wandb",
                     "--eval-at-start"]) == 143
    finally:
        wandb.teardown()
    err = capsys.readouterr().err.splitlines()
    assert f"upload it with: wandb sync {runs / 'r' / 'wandb'}/offline-run-*" in "\n".join(err)
    assert err[-1] == ("toymlx-train: stopped by SIGTERM before the first step; nothing was "
                       "trained; its offline W&B run went with its folder: there is nothing to "
                       "wandb sync")
    assert not runs.exists()


def test_overwrite_keeps_an_offline_w_and_b_run_until_wandb_sync_uploaded_it(
        tmp_path, text_path, monkeypatch, capsys):
    """--overwrite on a run folder holding an offline W&B run (no login) deleted its files,
    never uploaded: lost. Now --overwrite (toymlx.train's overwrite=True too) is refused while a
    .wandb file lacks the marker `wandb sync` leaves beside it, naming the folder and the
    `wandb sync` line, nothing removed; once synced, or where the run trained nothing,
    --overwrite replaces the run as before."""
    import shlex

    import toymlx

    wandb = pytest.importorskip("wandb", reason="the wandb extra")
    wandb_offline(monkeypatch, tmp_path)
    runs = tmp_path / "runs"
    flags = ["--recipe", "from-scratch", *TINY, "--steps", "2", "--data.path", str(text_path),
             "--runs-root", str(runs), "--run-id", "r", "--report-to", "wandb"]
    try:
        assert main(flags) == 0
        run = runs / "r"
        (offline,) = (run / "wandb").glob("offline-run-*")
        (log,) = offline.glob("run-*.wandb")
        def files() -> dict:  # W&B's service may still append to its own logs/ after a run
            return {p: b"" if "logs" in p.relative_to(run).parts else p.read_bytes()
                    for p in run.rglob("*") if p.is_file()}

        before = files()
        capsys.readouterr()
        assert main([*flags, "--overwrite"]) == 2
        said = (f"{run}: --overwrite: expected its offline W&B run uploaded first (wandb sync "
                "leaves a *.wandb.synced file beside each .wandb file it uploads), found "
                f"{offline.name} without one; nothing was removed: upload it with: wandb sync "
                f"{shlex.quote(str(offline))}, then pass --overwrite again; or, to lose it, "
                f"remove {run / 'wandb'} first, or choose another --run-id")
        assert error_line(capsys) == f"toymlx-train: error: {said}"
        with pytest.raises(toymlx.OptionError) as caught:
            toymlx.train("from-scratch", data={"path": str(text_path)}, runs_root=str(runs),
                         run_id="r", report_to="wandb", overwrite=True, echo=False)
        assert str(caught.value) == "toymlx-train: error: " + said.replace(
            "--overwrite", "overwrite=True").replace("--run-id", "run_id")
        assert files() == before
        log.with_name(log.name + ".synced").touch()  # as `wandb sync` marks what it uploaded
        assert main([*flags, "--overwrite"]) == 0
        assert offline.name not in {p.name for p in (run / "wandb").glob("offline-run-*")}
        # a run killed in its first step trained nothing: its offline W&B run, unsynced, holds
        # nothing to upload (as the same options started over say), so --overwrite replaces it
        (offline,) = (run / "wandb").glob("offline-run-*")
        events = run / "events.jsonl"
        events.write_text(events.read_text().splitlines(keepends=True)[0])  # run_start alone
        for p in (run / "weights").iterdir():
            p.unlink()
        assert main([*flags, "--steps", "3", "--overwrite"]) == 0
    finally:
        wandb.teardown()
    assert offline.name not in {p.name for p in (run / "wandb").glob("offline-run-*")}


def test_a_taken_run_id_says_overwrite_waits_for_its_offline_w_and_b_run(tmp_path, text_path,
                                                                         capsys):
    """A run id taken was refused with "pass ... --overwrite to replace it", which then was
    refused too where the run folder held an offline W&B run `wandb sync` never uploaded. Now
    the first line says so, with the `wandb sync` line; without such a run, as before."""
    import shlex

    runs = tmp_path / "runs"
    run = runs / "r"
    flags = ["--recipe", "from-scratch", *TINY, "--steps", "2", "--data.path", str(text_path),
             "--runs-root", str(runs), "--run-id", "r"]
    assert main(flags) == 0
    offline = run / "wandb" / "offline-run-20261205_074400-abc"  # as W&B offline writes it
    offline.mkdir(parents=True)
    (offline / "run-abc.wandb").write_bytes(b"the run's only copy")
    capsys.readouterr()
    assert main(flags) == 2
    head = (f"toymlx-train: error: {run}: run bundle already exists; continue it with "
            f"toymlx-train --resume {run}, pass --overwrite to replace it")
    assert error_line(capsys) == (f"{head} once its offline W&B run is uploaded (wandb sync "
                                  f"{shlex.quote(str(offline))}), or choose another --run-id")
    (offline / "run-abc.wandb.synced").touch()  # as `wandb sync` marks what it uploaded
    assert main(flags) == 2
    assert error_line(capsys) == f"{head}, or choose another --run-id"


def test_a_resumes_tensorboard_file_is_read_after_its_runs(tmp_path):
    """TensorBoard reads a run folder's event files in name order
    (`events.out.tfevents.SECONDS.HOST.PID.N`, N not zero-padded): a resume's writer made by
    the same process in the second its run's file was made, with N 10 after the run's 9, was
    read first, so its restart marker came before the steps it drops and they stayed (the
    default tier's `test_a_resume_at_an_earlier_step_rewinds_tensorboard_and_wandb`: 41
    train/loss points of 30). The resume's file now starts in a later second."""
    pytest.importorskip("tensorboard", reason="the tensorboard extra")
    import os
    import socket
    import time

    from tensorboard.summary.writer import event_file_writer

    run = tmp_path / "r"
    run.mkdir()
    made = run / (f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}."
                  f"{os.getpid()}.9")
    made.write_bytes(b"")
    uid = event_file_writer._global_uid
    was = uid._value
    uid._value = 10  # the next writer's N: "10" sorts before the run's "9" in one second
    try:
        reporter = reporters.TensorBoardReporter(run)
    finally:
        uid._value = max(uid._value, was)
    reporter.close()
    files = sorted(p.name for p in run.glob("events.out.tfevents.*"))
    assert files[0] == made.name and len(files) == 2
