"""events.jsonl: one JSON object per line, torn lines tolerated, any run id valid JSON."""

import json

from toymlx.events import EventLog, kind_of, read_events


def test_weird_strings_and_numbers_stay_valid_json(tmp_path):
    rid = 'run "quoted" \\back\\slash ünïcödé 🚀\n\ttab'
    log = EventLog(tmp_path / "events.jsonl")
    log.emit("run_start", run_id=rid, path=str(tmp_path / rid), loss=float("nan"))
    log.emit("run_end", reason="completed", final_loss=float("inf"))
    log.close()
    lines = (tmp_path / "events.jsonl").read_text(encoding="utf-8").splitlines()
    assert len(lines) == 2
    first = json.loads(lines[0])
    assert first["run_id"] == rid and first["loss"] == "nan"
    assert json.loads(lines[1])["final_loss"] == "inf"


def test_torn_last_line_is_skipped(tmp_path):
    p = tmp_path / "events.jsonl"
    log = EventLog(p)
    for i in range(3):
        log.emit("step", step=i + 1, loss=1.0)
    log.close()
    with open(p, "ab") as f:
        f.write(b'{"event": "step", "step": 4, "lo')
    evs = read_events(p)
    assert [e["step"] for e in evs] == [1, 2, 3]
    assert read_events(tmp_path / "missing.jsonl") == []


def _log(path, segments):
    for seg in segments:
        log = EventLog(path / "events.jsonl")
        for kind, fields in seg:
            log.emit(kind, **fields)
        log.close()


def test_cut_back_leaves_one_run_with_each_step_once(tmp_path):
    """A resume from step 4 of a run killed after step 6: steps 5-6, their eval and the
    run_end go to events.superseded.jsonl; a torn line goes too."""
    from toymlx.events import SUPERSEDED, cut_back

    steps = [("step", {"step": s, "loss": 1.0 / s}) for s in range(1, 7)]
    _log(tmp_path, [[("run_start", {"start_step": 0}), *steps[:4],
                     ("checkpoint", {"step": 4}), *steps[4:], ("eval", {"step": 6}),
                     ("run_end", {"reason": "interrupted"})]])
    with open(tmp_path / "events.jsonl", "ab") as f:
        f.write(b'{"event": "step", "st')
    cut = cut_back(tmp_path, 4)
    kept = read_events(tmp_path)
    assert [kind_of(e) for e in kept] == ["run_start", "step", "step", "step", "step",
                                          "checkpoint"]
    assert cut.dropped == 5 and cut.previous_end == "interrupted"
    assert cut.t == max(e["t"] for e in read_events(tmp_path / SUPERSEDED) + kept)
    gone = (tmp_path / SUPERSEDED).read_text().splitlines()
    assert len(gone) == 5 and gone[-1] == '{"event": "step", "st'
    assert [json.loads(x)["step"] for x in gone[:3]] == [5, 6, 6]
    assert cut_back(tmp_path, 4).dropped == 0  # nothing past step 4 any more


def test_cut_back_turns_an_older_toymlx_resume_into_one_run(tmp_path):
    """Bundles of toymlx < 0.2 logged a resume as a second run_start (from its start_step);
    cutting one back keeps one run_start and each step once."""
    from toymlx.events import cut_back

    seg1 = [("run_start", {"start_step": 0}), *[("step", {"step": s}) for s in range(1, 7)],
            ("run_end", {"reason": "interrupted"})]
    seg2 = [("run_start", {"start_step": 4}), *[("step", {"step": s}) for s in range(5, 9)],
            ("run_end", {"reason": "completed"})]
    _log(tmp_path, [seg1, seg2])
    cut = cut_back(tmp_path, 8)
    kept = read_events(tmp_path)
    assert [kind_of(e) for e in kept].count("run_start") == 1
    assert [e["step"] for e in kept if kind_of(e) == "step"] == list(range(1, 9))
    assert "run_end" not in [kind_of(e) for e in kept]
    assert cut.previous_end == "completed" and cut.dropped == 5  # steps 5-6, run_start, 2 ends
