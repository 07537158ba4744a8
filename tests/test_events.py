"""events.jsonl: one JSON object per line, torn lines tolerated, any run id valid JSON."""

import json

from toymlx.events import EventLog, read_events


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
