"""events.jsonl in the toy/v1 format: every event of a completed, stopped, interrupted,
diverged and torn (killed) bundle checked against /work/shared/TOY_V1.md's table, the
validator's own rules, and bundles written before `kind` (the `event` key) still read."""

from __future__ import annotations

import datetime as dt
import errno
import json
from pathlib import Path

import pytest
from toymlx_cli.train import main

import toymlx
from toymlx.bundle.events import (
    EventLog,
    damage_note,
    iter_events,
    parse_event,
    read_events,
    read_log,
    restart_problem,
    run_start,
)

TINY = ["--model.d-model", "32", "--model.n-layers", "1", "--model.n-heads", "4",
        "--model.n-kv-heads", "2", "--model.ffn-dim", "64", "--model.context", "64",
        "--seq-len", "32", "--batch-size", "2", "--eval-batches", "1", "--no-compile",
        "--no-progress"]


@pytest.fixture(scope="module")
def data(shared_file) -> str:
    return str(shared_file("text/tinystories_sample.txt"))


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


_EV = b'{"kind": "step", "step": 1}\n'
_START, _RESUME = b'{"kind": "run_start"}\n', b'{"kind": "resume", "from_step": 1}\n'


@pytest.mark.parametrize(("lines", "torn", "damaged"), [
    ([_START, _EV, b'{"kind": "st'], [3], []),  # killed mid-write (or a write under way)
    ([_START, _EV, b'{"kind": "st\n', _RESUME, _EV], [3], []),  # killed, then resumed
    ([_START, b'{"ki\n', b'{"kind": "run_st\n', _START, _EV], [2, 3], []),  # older toymlx
    ([_START, _EV, b"\n", _EV], [], []),  # a blank line loses nothing
    ([_START, b'{"kind": "st\x00\x00ep"}\n', _EV, b'{"kind": "run_e'], [4], [2]),
    ([_START, _EV, b"[1, 2]\n", b"garbage\n"], [], [3, 4]),  # whole lines at the end
    # a resume line edited by hand that still parses: no restart, and explains nothing
    ([_START, _EV, b'{"kind": "resume", "from_step": "x"}\n', _EV], [], [3]),
    ([_START, _EV, b'{"kind": "st\n', b'{"kind": "resume", "checkpoint": 4}\n', _EV], [], [3, 4]),
    ([_START, b'{"kind": "run_start", "start_step": -1}\n', _EV], [], [2]),
])
def test_scan_tells_a_killed_run_s_torn_lines_from_damage(tmp_path, lines, torn, damaged):
    """A line that is no event is torn where a crash explains it (the last line cut short, or
    lines just before a run_start or resume); anything else is damage, named by its number."""
    p = tmp_path / "events.jsonl"
    p.write_bytes(b"".join(lines))
    log = read_log(tmp_path)
    assert (log.torn, log.damaged, log.lines) == (torn, damaged, len(lines))
    assert log.events == read_events(p) and len(log.events) == sum(
        (e := parse_event(x)) is not None and restart_problem(e) is None for x in lines)
    assert log.cut_short == (not lines[-1].endswith(b"\n"))


def test_damage_note_names_the_file_and_the_lines(tmp_path):
    p = tmp_path / "events.jsonl"
    tail = ("expected an event (one JSON object a line), found {} that no kill or resume "
            "explains: the file was damaged")
    assert damage_note(p, []) is None
    assert damage_note(p, [7]) == f"{p}: line 7: " + tail.format("a garbled line")
    assert damage_note(p, [3, 4]) == f"{p}: lines 3 and 4: " + tail.format("garbled lines")
    assert damage_note(p, [2, 5, 9, 11, 12]) == (f"{p}: lines 2, 5, 9 and 2 more: "
                                                + tail.format("garbled lines"))


def test_run_start_is_the_first_one_and_reads_an_iterator_no_further(tmp_path):
    """One lookup of a run's run_start for every reader (Bundle.start_event, check_own,
    toymlx-generate's trained window, the export's own validation loss)."""
    p = tmp_path / "events.jsonl"
    lines = [{"kind": "step", "step": 0}, {"kind": "run_start", "run_uid": "a"},
             {"kind": "run_start", "run_uid": "b"}, {"kind": "run_end"}]
    p.write_text("".join(json.dumps(e) + "\n" for e in lines))
    assert run_start(read_events(p)) == {"kind": "run_start", "run_uid": "a"}
    it = iter_events(p)
    assert run_start(it)["run_uid"] == "a"
    assert next(it)["run_uid"] == "b"  # the lookup stopped at the first: the rest is unread
    assert run_start([lines[0], lines[3]]) is None
    assert run_start([]) is None


class _FillsUp:
    """The log's file on a disk that fills after `room` more bytes: the write that crosses it
    is cut short there, as the kernel's is, then fails with ENOSPC."""

    def __init__(self, f, room: int):
        self.f, self.room = f, room

    def write(self, data):
        if len(data) > self.room:
            self.f.write(data[: self.room])
            self.room = 0
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= len(data)
        return self.f.write(data)

    def __getattr__(self, name):
        return getattr(self.f, name)


def test_a_full_disk_leaves_no_torn_line(tmp_path):
    """The disk fills in the middle of an event: events.jsonl kept its first 40 bytes (a torn
    line that jq and pandas refuse: "Expecting ',' delimiter"); it ends at the last whole
    event, and the error names the file."""
    p = tmp_path / "events.jsonl"
    log = EventLog(p)
    log.emit("step", step=1, loss=1.0)
    log._f = _FillsUp(log._f, 40)
    with pytest.raises(OSError) as e:
        log.emit("step", step=2, loss=0.5)
    assert str(e.value) == f"[Errno 28] No space left on device: '{p}'"
    with pytest.raises(OSError):  # the run's run_end, on the still full disk
        log.emit("run_end", reason="error", final_step=2)
    log.close()
    lines = p.read_bytes().splitlines(keepends=True)
    assert [json.loads(ln)["step"] for ln in lines] == [1] and lines[0].endswith(b"\n")


def test_a_torn_line_ended_on_a_full_disk_names_the_file(tmp_path, monkeypatch):
    """A resume ends the torn line a crash left (its newline) as it opens events.jsonl; on a
    full disk that write's error named no file ("[Errno 28] No space left on device")."""
    from toymlx.bundle import events

    def full_disk(path, mode="r", **kw):  # the log's appending file on a full disk
        f = open(path, mode, **kw)  # noqa: SIM115 -- the log holds it
        return _FillsUp(f, 0) if mode == "ab" else f

    p = tmp_path / "events.jsonl"
    p.write_bytes(b'{"kind": "step", "step": 1}\n{"kind": "st')
    monkeypatch.setattr(events, "open", full_disk, raising=False)
    with pytest.raises(OSError) as e:
        EventLog(p)
    assert str(e.value) == f"[Errno 28] No space left on device: '{p}'"
    assert p.read_bytes() == b'{"kind": "step", "step": 1}\n{"kind": "st'  # as it was


def _log(path, segments):
    for seg in segments:
        log = EventLog(path / "events.jsonl")
        for kind, fields in seg:
            log.emit(kind, **fields)
        log.close()


def test_cut_back_leaves_one_run_with_each_step_once(tmp_path):
    """A resume from step 4 of a run killed after step 6: steps 5-6, their eval and the
    run_end go to events.superseded.jsonl; a torn line goes too."""
    from toymlx.bundle.events import SUPERSEDED, cut_back

    steps = [("step", {"step": s, "loss": 1.0 / s}) for s in range(1, 7)]
    _log(tmp_path, [[("run_start", {"start_step": 0}), *steps[:4],
                     ("checkpoint", {"step": 4}), *steps[4:], ("eval", {"step": 6}),
                     ("run_end", {"reason": "interrupted"})]])
    with open(tmp_path / "events.jsonl", "ab") as f:
        f.write(b'{"event": "step", "st')
    cut = cut_back(tmp_path, 4)
    kept = read_events(tmp_path)
    assert [e["kind"] for e in kept] == ["run_start", "step", "step", "step", "step",
                                          "checkpoint"]
    assert cut.dropped == 5 and cut.previous_end == "interrupted"
    assert cut.damaged == []  # the torn last line is what a kill leaves
    assert cut.t == max(e["t"] for e in read_events(tmp_path / SUPERSEDED) + kept)
    gone = (tmp_path / SUPERSEDED).read_text().splitlines()
    assert len(gone) == 5 and gone[-1] == '{"event": "step", "st'
    assert [json.loads(x)["step"] for x in gone[:3]] == [5, 6, 6]
    assert cut_back(tmp_path, 4).dropped == 0  # nothing past step 4 any more


def test_cut_back_turns_an_older_toymlx_resume_into_one_run(tmp_path):
    """Bundles of toymlx < 0.2 logged a resume as a second run_start (from its start_step);
    cutting one back keeps one run_start and each step once."""
    from toymlx.bundle.events import cut_back

    seg1 = [("run_start", {"start_step": 0}), *[("step", {"step": s}) for s in range(1, 7)],
            ("run_end", {"reason": "interrupted"})]
    seg2 = [("run_start", {"start_step": 4}), *[("step", {"step": s}) for s in range(5, 9)],
            ("run_end", {"reason": "completed"})]
    _log(tmp_path, [seg1, seg2])
    cut = cut_back(tmp_path, 8)
    kept = read_events(tmp_path)
    assert [e["kind"] for e in kept].count("run_start") == 1
    assert [e["step"] for e in kept if e["kind"] == "step"] == list(range(1, 9))
    assert "run_end" not in [e["kind"] for e in kept]
    assert cut.previous_end == "completed" and cut.dropped == 5  # steps 5-6, run_start, 2 ends


def test_check_toy_v1_names_a_gap_or_a_repeat_in_the_steps(completed):
    """toy/v1 logs each optimizer step once: a step line deleted by hand (step 2 of 4), or one
    repeated, is named by the format check; the bundle as written has none."""
    from toymlx.bundle.events import check_toy_v1

    events = read_events(completed)
    assert check_toy_v1(events) == []
    at = next(i for i, e in enumerate(events) if e["kind"] == "step" and e["step"] == 2)
    gap = events[:at] + events[at + 1:]
    after = next(i for i, e in enumerate(gap) if e["kind"] == "step" and e["step"] == 3)
    assert check_toy_v1(gap) == [(
        f"event {after + 1} (step): key 'step': expected 2 (each step of phase 'train' once, "
        "in order), found 3: step 2 is missing")]
    repeat = events[:at + 1] + [events[at]] + events[at + 1:]
    assert check_toy_v1(repeat) == [(
        f"event {at + 2} (step): key 'step': expected 3 (each step of phase 'train' once, "
        "in order), found 2: a step repeated or out of order")]


def test_check_toy_v1_knows_the_model_keys_of_every_architecture_toymlx_loads(completed):
    """A run_start of each decoder architecture `ARCHS` loads (smollm3, granite and olmo2 were
    unknown to the check: their model keys went unchecked) must carry the language model's
    sizes and context: one left out is named."""
    from toymlx.bundle.events import check_toy_v1
    from toymlx.gguf.llama import ARCHS

    events = read_events(completed)
    for arch in ARCHS:
        start = {**events[0], "model": {**events[0]["model"], "arch": arch}}
        assert check_toy_v1([start, *events[1:]]) == [], arch
        del start["model"]["vocab"]
        assert check_toy_v1([start, *events[1:]]) == [
            "event 1 (run_start): key 'model.vocab': missing"], arch


def test_an_events_file_that_is_a_fifo_is_named_not_read(tmp_path, capsys, data):
    """A run folder whose events.jsonl is a FIFO read as an "empty" run (toymlx-report) or "an
    empty file" (--resume); now one line names the file and what it is, and nothing waits for
    a writer."""
    import os

    from toymlx_cli.report import main as report_main

    assert main(_args(tmp_path, "run", data, "--steps", "1", "--eval-every", "0")) == 0
    run = tmp_path / "run"
    (run / "events.jsonl").unlink()
    os.mkfifo(run / "events.jsonl")
    capsys.readouterr()
    want = (f"{run / 'events.jsonl'}: expected a regular file (the run's event log), found a "
            "FIFO (named pipe); put the run's events.jsonl back in its place")
    with pytest.raises(ValueError) as e:
        read_events(run)
    assert str(e.value) == want
    assert report_main([str(run), "--out", str(tmp_path / "r.png")]) == 2
    assert capsys.readouterr().err == f"toymlx-report: error: {want}\n"
    assert main(["--resume", str(run), "--steps", "3"]) == 2
    assert capsys.readouterr().err == f"toymlx-train: error: {want}\n"
