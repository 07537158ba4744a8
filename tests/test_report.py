"""Reports: summaries of torn, resumed, eval-less and image-classifier bundles, and a real
sweep drawn to PNG and HTML."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
from toymlx_cli.report import main as report_main

from toymlx import sweeps as sweep
from toymlx.bundle.events import EventLog
from toymlx.runner import report

TINY = ["--model.d-model", "32", "--model.n-layers", "1", "--seq-len", "32", "--batch-size",
        "4", "--steps", "8", "--eval-every", "4", "--eval-batches", "2", "--no-compile"]


def _bundle(path: Path, segments: list[list[tuple[str, dict]]], torn_tail: bool = False,
            config: dict | None = None) -> Path:
    """A bundle with the given events, one EventLog per process segment."""
    path.mkdir(parents=True)
    if config is not None:
        (path / "config.json").write_text(json.dumps({"recipe": "from-scratch",
                                                      "config": config}))
    for seg in segments:
        log = EventLog(path / "events.jsonl")
        for kind, fields in seg:
            log.emit(kind, **fields)
        log.close()
    if torn_tail:
        with open(path / "events.jsonl", "a") as f:
            f.write('{"kind": "step", "step": 99, "lo')
    return path


def _steps(a: int, b: int, loss0: float = 5.0, unit: str = "tokens") -> list[tuple[str, dict]]:
    return [("step", {"step": s, "loss": loss0 - 0.1 * s, "lr": 1e-3,
                      f"{unit}_per_s": 1000.0 + s}) for s in range(a, b + 1)]


def test_world_size_is_the_last_segment_s(tmp_path):
    """A 2-rank run (toymlx-launch -n 2) resumed by one process (toymlx-train --resume): its
    resume event records world_size 1, but the summary said the run_start's 2."""
    start = ("run_start", {"recipe": "from-scratch", "config": {"steps": 8}, "world_size": 2,
                           "start_step": 0})
    run = _bundle(tmp_path / "r", [
        [start, *_steps(1, 4)],
        [("resume", {"from_step": 4, "steps": 8, "world_size": 1}), *_steps(5, 8),
         ("run_end", {"reason": "completed", "message": None})]], config={"steps": 8})
    (row,) = report.summarize([run])
    assert (row["status"], row["step"], row["world_size"]) == ("completed", 8, 1)
    (row,) = report.summarize([_bundle(tmp_path / "one", [[start, *_steps(1, 2)]])])
    assert row["world_size"] == 2


def test_torn_resumed_and_eval_less_bundles(tmp_path):
    start = ("run_start", {"recipe": "from-scratch", "config": {"steps": 8}, "world_size": 1,
                           "start_step": 0})
    torn = _bundle(tmp_path / "torn", [[start, *_steps(1, 3), ("eval", {"step": 2,
                                                                        "val_loss": 4.5})]],
                   torn_tail=True, config={"steps": 8, "lr": 1e-3})
    # crashed after step 6, resumed from the step-4 checkpoint: steps 5-6 were redone
    resumed = _bundle(tmp_path / "resumed", [
        [start, *_steps(1, 6), ("eval", {"step": 4, "val_loss": 4.0}),
         ("eval", {"step": 6, "val_loss": 3.0})],
        [("run_start", {**start[1], "start_step": 4}), *_steps(5, 8, loss0=6.0),
         ("eval", {"step": 8, "val_loss": 3.5}),
         ("run_end", {"reason": "completed", "message": None})]],
        config={"steps": 8, "lr": 2e-3})
    no_eval = _bundle(tmp_path / "no_eval", [[start, *_steps(1, 2)]],
                      config={"steps": 8, "lr": 3e-3})
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text(json.dumps({"recipe": "from-scratch",
                                                   "config": {"steps": 8, "lr": 4e-3}}))
    rows = {r["run"]: r for r in report.summarize([torn, resumed, no_eval, empty])}

    assert rows["torn"]["status"] == "torn" and rows["torn"]["step"] == 3
    assert rows["torn"]["best"] == rows["torn"]["final"] == 4.5
    # the redone steps replace the first segment's; its step-6 eval no longer counts
    r = rows["resumed"]
    assert r["status"] == "completed" and r["step"] == 8
    assert r["final_loss"] == pytest.approx(6.0 - 0.8)
    assert (r["best"], r["best_step"], r["final"], r["final_step"]) == (3.5, 8, 3.5, 8)
    assert r["throughput"] == pytest.approx(1004.5)  # median of steps 1-4 and 5-8
    assert rows["no_eval"]["best"] is None and rows["no_eval"]["status"] == "torn"
    assert rows["empty"]["status"] == "empty" and rows["empty"]["step"] == 0

    ordered = report.sort_rows(list(rows.values()))
    assert [x["run"] for x in ordered] == ["resumed", "torn", "no_eval", "empty"]
    params = report.add_params(ordered)
    assert params == ["lr"]  # the one config key that differs
    text = report.format_table(ordered, params)
    assert text.splitlines()[0].split()[:3] == ["run", "lr", "status"]


def _garble(run: Path, at: int, cut_tail: bool = False) -> None:
    """Line `at` (from 1) of the run's events.jsonl garbled in place; `cut_tail`: the file cut
    off in the middle of its last line, as a copy or a disk may."""
    p = run / "events.jsonl"
    lines = p.read_bytes().splitlines(keepends=True)
    lines[at - 1] = lines[at - 1][:12] + b"\x00\x00\x00" + lines[at - 1][20:]
    if cut_tail:
        lines[-1] = lines[-1][:25]
    p.write_bytes(b"".join(lines))


def test_a_garbled_line_no_resume_explains_is_named_once(tmp_path, recwarn):
    """A completed run whose events.jsonl has a garbled middle line and a cut-off tail showed as
    "torn" with no word; a killed and resumed run's torn line still goes in silence."""
    start = ("run_start", {"recipe": "from-scratch", "config": {"steps": 4}, "start_step": 0})
    end = ("run_end", {"reason": "completed", "message": None})
    cfg = {"steps": 4, "lr": 1e-3}
    damaged = _bundle(tmp_path / "damaged", [[start, *_steps(1, 4), end]], config=cfg)
    _garble(damaged, 3, cut_tail=True)  # step 2's line, and the run_end's
    # killed mid-write after step 2, then resumed: the torn line ends just before the resume
    resumed = _bundle(tmp_path / "resumed", [[start, *_steps(1, 2)]], torn_tail=True,
                      config=cfg)
    log = EventLog(resumed / "events.jsonl")
    log.emit("resume", from_step=2, steps=4)
    for kind, fields in [*_steps(3, 4), end]:
        log.emit(kind, **fields)
    log.close()

    rows = {r["run"]: r for r in report.summarize([damaged, resumed])}
    events = damaged / "events.jsonl"
    assert [str(w.message) for w in recwarn] == [(
        f"{events}: line 3: expected an event (one JSON object a line), found a garbled line "
        "that no kill or resume explains: the file was damaged; its last line, 6, is cut short "
        "too, so its status \"torn\" (no run_end) may be the damage's, not a kill's; its row "
        "shows what the other lines tell")]
    # the rows as the files tell them: the damaged run's step 2 and run_end are gone
    assert (rows["damaged"]["status"], rows["damaged"]["step"]) == ("torn", 4)
    assert rows["damaged"]["final_loss"] == pytest.approx(4.6)
    assert (rows["resumed"]["status"], rows["resumed"]["step"]) == ("completed", 4)


def test_a_garbled_line_of_a_completed_run_is_named_without_its_status(tmp_path, recwarn):
    """Damage that leaves run_end in place: the warning names the line, the status stands."""
    run = _bundle(tmp_path / "r", [[("run_start", {"recipe": "from-scratch", "config": {
        "steps": 3}}), *_steps(1, 3), ("run_end", {"reason": "completed", "message": None})]],
        config={"steps": 3})
    _garble(run, 2)
    (row,) = report.summarize([run])
    assert [str(w.message) for w in recwarn] == [(
        f"{run / 'events.jsonl'}: line 2: expected an event (one JSON object a line), found a "
        "garbled line that no kill or resume explains: the file was damaged; its row shows "
        "what the other lines tell")]
    assert (row["status"], row["step"]) == ("completed", 3)


def test_accuracy_is_the_metric_of_classifier_runs(tmp_path):
    run = _bundle(tmp_path / "vit", [[
        ("run_start", {"recipe": "vit-tiny", "config": {"steps": 4}}),
        *_steps(1, 4, unit="images"),
        ("eval", {"step": 2, "val_loss": 1.0, "accuracy": 0.9}),
        ("eval", {"step": 4, "val_loss": 0.8, "accuracy": 0.85})]])
    r = report.summarize_run(run)
    assert (r["metric"], r["best"], r["best_step"], r["final"]) == ("accuracy", 0.9, 2, 0.85)
    assert r["unit"] == "images/s"


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_report_of_a_sweep_renders_png_and_html(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="the report extra: pip install 'toymlx[report]'")
    specs = sweep.grid(TINY, {"lr": [1e-3, 4e-3]}, recipe="from-scratch")
    result = sweep.run_sweep("from-scratch", specs, tmp_path, workers=2, sweep_id="sw",
                             progress=False)
    assert result.ok
    png = tmp_path / "sw" / "report.png"
    w, h = _png_size(png)
    assert w > 1000 and h > 400 and png.stat().st_size > 30_000
    assert [r["run"] for r in result.rows] == ["lr=0.004", "lr=0.001"]  # best val_loss first
    assert result.params == ["lr"]
    # one recipe: the table as before, the swept option and the figures (no recipe column)
    assert report.table_rows(result.rows, result.params)[0] == ["run", "lr", *report.COLUMNS]

    # a torn bundle next to the sweep: drawn and listed, not an error
    torn = _bundle(tmp_path / "torn", [[("run_start", {"recipe": "from-scratch",
                                                       "config": {"steps": 8}}),
                                        *_steps(1, 3)]], torn_tail=True)
    out = tmp_path / "r.html"
    assert report_main([str(tmp_path / "sw"), str(torn), "--out", str(out)]) == 0
    page = out.read_text()
    assert page.count("<tr") == 4 and "data:image/png;base64," in page
    printed = capsys.readouterr().out
    assert "lr=0.004" in printed and "torn" in printed
    assert report_main([str(tmp_path / "nothing-here")]) == 2


def test_a_closed_stdout_still_writes_the_report(tmp_path):
    """`toymlx-report A B | head -1`: the table's reader goes, the report file is still drawn
    and the exit status is 0 (it was "error: [Errno 32] Broken pipe", status 2)."""
    import subprocess
    import sys

    runs = [str(_bundle(tmp_path / n, [[("run_start", {"recipe": "from-scratch",
                                                        "config": {"steps": 3}}),
                                         *_steps(1, 3)]])) for n in ("a", "b")]
    out = tmp_path / "r.html"
    p = subprocess.Popen([sys.executable, "-m", "toymlx_cli.report", *runs, "--out", str(out)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    p.stdout.close()  # `| head -0`
    err = p.stderr.read()
    assert (p.wait(timeout=120), err) == (0, f"toymlx-report: wrote {out}\n")
    assert "data:image/png;base64," in out.read_text()


def test_an_out_it_cannot_draw_is_refused_before_the_table(tmp_path, capsys):
    from toymlx_cli.report import main

    run = _bundle(tmp_path / "a", [[("run_start", {"recipe": "from-scratch",
                                                   "config": {"steps": 3}}), *_steps(1, 3)]])
    assert main([str(run), "--out", str(tmp_path / "rep.pdf")]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == ("toymlx-report: error: --out: expected a .png or .html file name, found "
                   "'rep.pdf'\n")


def test_an_out_it_cannot_write_is_one_line_naming_it(tmp_path, capsys, monkeypatch):
    """A full disk (or --out /proc/x/r.png) was the bare "[Errno 28] No space left on device"
    ("[Errno 2] No such file or directory: '/proc/x'"): no flag, no file."""
    import contextlib
    import errno

    from toymlx_cli.report import main

    @contextlib.contextmanager
    def full(path, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")
        yield

    run = _bundle(tmp_path / "a", [[("run_start", {"recipe": "from-scratch",
                                                   "config": {"steps": 3}}), *_steps(1, 3)]])
    monkeypatch.setattr(report.atomic, "atomic_open", full)
    out = tmp_path / "rep.png"
    assert main([str(run), "--out", str(out)]) == 2
    assert capsys.readouterr().err == (
        f"toymlx-report: error: {out}: --out: could not write the report ([Errno 28] No space "
        f"left on device: '{out}'); nothing was written under this name\n")
    assert not out.exists()


def test_toymlx_report_alone_reports_the_runs_folder_here(tmp_path, capsys, monkeypatch):
    """`toymlx-report` with no folder was argparse's "the following arguments are required";
    alone it now reports ./runs (where toymlx-train and toymlx-sweep write), and where there is
    none it says so in one line."""
    pytest.importorskip("matplotlib", reason="the report extra: pip install 'toymlx[report]'")
    monkeypatch.chdir(tmp_path)
    assert report_main([]) == 2
    assert capsys.readouterr().err == (
        "toymlx-report: error: runs: expected the runs folder toymlx-train writes here "
        "(toymlx-report alone reports it), found nothing at that path; name the runs: "
        "toymlx-report RUN_OR_SWEEP_DIR ...\n")
    for name in ("a", "b"):
        _bundle(tmp_path / "runs" / name, [[("run_start", {"recipe": "from-scratch",
                                                            "config": {"steps": 3}}),
                                            *_steps(1, 3)]])
    assert report_main(["--out", "r.html"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in table[2:]] == ["a", "b"]
    assert (tmp_path / "r.html").is_file()


def test_a_parameter_column_gives_each_value_as_the_runs_name_does(tmp_path):
    """A sweep's data.val_fraction=0.1,0.999999: the table's column read 0.1 and 1 (4 digits),
    its run named data.val_fraction=0.999999; now each value as its run's name gives it, in
    the printed table and the drawn and HTML ones (`table_texts`), the figures still to 4."""
    rows = [{"run": f"data.val_fraction={v}", "path": str(tmp_path / str(v)),
             "params": {"data.val_fraction": v, "lr": lr}, "status": "completed", "step": 2,
             "final_loss": 5.1454315, "metric": "val_loss", "best": 4.9, "best_step": 2,
             "final": 4.9, "throughput": 1131.98, "unit": "tokens/s", "wall_s": 0.55}
            for v, lr in ((0.1, 1e8), (0.999999, 0.000123456), (0.5, None))]
    params = ["data.val_fraction", "lr"]
    assert [row[1:3] for row in report.table_texts(*report.table_rows(rows, params), params)] == [
        ["0.1", "1e+08"], ["0.999999", "0.000123456"], ["0.5", "-"]]
    assert [line.split()[:4] for line in report.format_table(rows, params).splitlines()[2:]] == [
        ["data.val_fraction=0.1", "0.1", "1e+08", "completed"],
        ["data.val_fraction=0.999999", "0.999999", "0.000123456", "completed"],
        ["data.val_fraction=0.5", "0.5", "-", "completed"]]
    assert report.value_text(0.1 + 0.2) == "0.30000000000000004"  # exact: no two runs one text


def test_the_table_lines_up_numbers_and_keeps_the_csv_exact(tmp_path):
    """The printed table left-aligned numbers at 4 significant digits each (5.145 over 4.9,
    1132 over 931.4, wall_s 0.55 over 0.9); now a measured column shows one number of decimals
    and numbers sit right in their columns; summary.csv keeps every digit."""
    rows = [{"run": "a", "path": str(tmp_path / "a"), "params": {"lr": 0.003}, "status": "completed",
             "step": 4, "final_loss": 5.1454315, "metric": "val_loss", "best": 4.9, "best_step": 4,
             "final": 4.9, "throughput": 1131.98, "unit": "tokens/s", "wall_s": 0.55},
            {"run": "bb", "path": str(tmp_path / "bb"), "params": {"lr": 0.001}, "status": "torn",
             "step": 12, "final_loss": 5.3383, "metric": "val_loss", "best": None,
             "best_step": None, "final": None, "throughput": 931.395, "unit": "tokens/s",
             "wall_s": 0.9}]
    assert report.format_table(rows, ["lr"]).splitlines() == [
        ("run     lr  status     step  final_loss  metric     best  best_step  final  throughput"
        "  unit      wall_s"),
        ("---  -----  ---------  ----  ----------  --------  -----  ---------  -----  ----------"
        "  --------  ------"),
        ("a    0.003  completed     4       5.145  val_loss  4.900          4  4.900       1,132"
        "  tokens/s    0.55"),
        ("bb   0.001  torn         12       5.338  val_loss      -          -      -         931"
        "  tokens/s    0.90")]
    report.write_summary(rows, ["lr"], tmp_path)
    lines = (tmp_path / "summary.csv").read_text().splitlines()
    assert lines[0] == ("run,lr,status,step,final_loss,metric,best,best_step,final,throughput,"
                        "unit,wall_s,message,path")
    assert lines[1].startswith("a,0.003,completed,4,5.1454315,val_loss,4.9,4,4.9,1131.98,"
                               "tokens/s,0.55,,")


def test_a_resume_that_changed_steps_shows_the_new_length(tmp_path):
    """`toymlx-train --resume runs/a --steps 30` on a run started with --steps 20: its row's
    `steps` column said 20 beside `completed 30` (config.json is written once)."""
    start = ("run_start", {"recipe": "from-scratch", "config": {"steps": 20}, "world_size": 1})
    end = ("run_end", {"reason": "completed", "message": None})
    a = _bundle(tmp_path / "a", [[start, *_steps(1, 20), end],
                                 [("resume", {"from_step": 20, "steps": 30}), *_steps(21, 30),
                                  end]], config={"steps": 20, "lr": 1e-3})
    b = _bundle(tmp_path / "b", [[start, *_steps(1, 20), end]], config={"steps": 20, "lr": 1e-3})
    rows = report.summarize([a, b])
    assert report.add_params(rows) == ["steps"]
    assert [(r["run"], r["params"], r["step"]) for r in rows] == [
        ("a", {"steps": 30}, 30), ("b", {"steps": 20}, 20)]


def test_runs_of_other_recipes_are_labelled_by_their_names(tmp_path):
    """Runs of two recipes side by side differ in every option one of them lacks: the legend
    was one line of them all ("steps=10 base=- fine_tune_type=- lora.rank=- ... donor=-"), a
    5,482-pixel-wide report.png; a sweep's few values still label its runs."""
    def start(recipe):
        return ("run_start", {"recipe": recipe, "config": {}})
    a = _bundle(tmp_path / "lm", [[start("from-scratch"), *_steps(1, 2)]],
                config={"steps": 10, "lr": 3e-3, "seq_len": 64, "model": {"preset": "tiny"}})
    b = _bundle(tmp_path / "chat", [[start("lora"), *_steps(1, 2)]],
                config={"steps": 10, "lr": 2e-4, "seq_len": 64, "base": "smol.gguf",
                        "lora": {"rank": 8, "alpha": 16}})
    rows = report.summarize([a, b])
    assert report.add_params(rows) == []  # one run of each recipe: nothing differs within one
    assert report.all_options(rows) == ["lr", "model.preset", "base", "lora.rank", "lora.alpha"]
    c = _bundle(tmp_path / "lm2", [[start("from-scratch"), *_steps(1, 2)]],
                config={"steps": 10, "lr": 1e-3, "seq_len": 64, "model": {"preset": "tiny"}})
    rows = report.summarize([a, c])
    assert report.add_params(rows) == ["lr"]
    assert [report.run_label(r) for r in rows] == ["lr=0.003", "lr=0.001"]


def test_runs_of_several_recipes_show_their_recipe_and_what_differs_within_one(tmp_path,
                                                                              capsys):
    """A vit-tiny, a from-scratch and two lora runs (ranks 2 and 4) side by side: the table was
    every option any run has (41 columns for one run of each, report.png 3,623 px wide); now
    run, recipe, the options that differ among runs of the same recipe (lora.rank), and the
    figures. The legend names the runs by folder; summary.csv keeps every differing option."""
    pytest.importorskip("matplotlib", reason="the report extra: pip install 'toymlx[report]'")
    import mlx.core as mx
    from test_lora import ARGS, mlx_lm_folder, tok_meta
    from toymlx_cli.train import main as train_main

    from toymlx.gguf.llama import write_llama
    from toymlx.models.llama import Llama

    mx.random.seed(3)
    write_llama(tmp_path / "base.gguf", Llama(ARGS), tok_meta(), name="tiny test llama")
    mlx_lm_folder(tmp_path / "chat")
    (tmp_path / "t.txt").write_text("Once upon a time there was a report. " * 60)
    runs = tmp_path / "runs"
    common = ["--steps", "2", "--batch-size", "2", "--eval-every", "2", "--eval-batches", "1",
              "--no-progress", "--no-compile", "--runs-root", str(runs)]
    for run_id, argv in (
            ("v", ["--recipe", "vit-tiny", "--model.d-model", "32", "--model.n-layers", "1",
                   "--model.n-heads", "2", "--model.ffn-dim", "64"]),
            ("f", ["--recipe", "from-scratch", "--data.path", str(tmp_path / "t.txt"),
                   "--model.d-model", "32", "--model.n-layers", "1", "--seq-len", "32"]),
            *((f"l{r}", ["--recipe", "lora", "--base", str(tmp_path / "base.gguf"),
                         "--data.path", str(tmp_path / "chat"), "--seq-len", "64",
                         "--lora.rank", str(r)]) for r in (2, 4))):
        assert train_main([*argv, *common, "--run-id", run_id]) == 0
    dirs = [runs / n for n in ("v", "f", "l2", "l4")]
    rows = report.summarize(dirs)
    params = report.add_params(rows)
    assert params == ["lora.rank"]
    header, cells = report.table_rows(rows, params)
    assert header == ["run", "recipe", "lora.rank", *report.COLUMNS]
    assert [c[:3] for c in cells] == [["v", "vit-tiny", None], ["f", "from-scratch", None],
                                      ["l2", "lora", 2], ["l4", "lora", 4]]
    assert len(report.all_options(rows)) > 20  # what the table showed before
    report.write_summary(rows, params, tmp_path)
    csv_header = (tmp_path / "summary.csv").read_text().splitlines()[0].split(",")
    assert csv_header[:len(header)] == header and csv_header[-2:] == ["message", "path"]
    assert csv_header[len(header):-2] == [k for k in report.all_options(rows) if k != "lora.rank"]
    capsys.readouterr()
    assert report_main([*map(str, dirs), "--out", str(tmp_path / "r.png")]) == 0
    assert capsys.readouterr().out.splitlines()[0].split() == header
    w, _ = _png_size(tmp_path / "r.png")
    assert w < 1800  # the curves' width: the table fits under them


def test_a_diverged_runs_huge_loss_keeps_the_other_losses_decimals(tmp_path):
    """A vit-tiny sweep with lr=1e4 diverged at 2.73e+18: the column's decimals were set by it,
    so the completed runs' final losses 2.166 and 2.228 were printed as 2 and 2."""
    def row(run, status, final_loss, best):
        return {"run": run, "path": str(tmp_path / run), "params": {}, "status": status,
                "step": 12, "final_loss": final_loss, "metric": "accuracy", "best": best,
                "best_step": 12 if best else None, "final": best, "throughput": 3222.775,
                "unit": "images/s", "wall_s": 0.76}
    rows = [row("a", "completed", 2.166159152984619, 0.375),
            row("b", "completed", 2.227750301361084, 0.3125),
            row("c", "diverged", 2.730013154732933e+18, None)]
    texts = report.table_texts(*report.table_rows(rows, []))
    assert [t[3] for t in texts] == ["2.166", "2.228", "2.73e+18"]
    assert [t[5] for t in texts] == ["0.3750", "0.3125", "-"]
    rows[2]["final_loss"] = float("nan")
    texts = report.table_texts(*report.table_rows(rows, []))
    assert [t[3] for t in texts] == ["2.166", "2.228", "nan"]


def test_a_run_without_a_bundle_adds_no_recipe_column(tmp_path):
    """A sweep's run that failed before writing its bundle (a data file that is not there), or
    has not started, has no recipe: it was counted as a second one, so the table grew a recipe
    column and summary.csv every option of the runs (steps, batch_size, ... 20 columns)."""
    start = ("run_start", {"recipe": "from-scratch", "config": {"steps": 3}, "world_size": 1})
    a = _bundle(tmp_path / "a", [[start, *_steps(1, 3), ("eval", {"step": 3, "val_loss": 4.2}),
                                  ("run_end", {"reason": "completed", "message": None})]],
                config={"steps": 3, "lr": 3e-3, "batch_size": 2})
    rows = report.summarize([a, tmp_path / "b"])
    assert [r["recipe"] for r in rows] == ["from-scratch", None]
    assert report.recipes(rows) == ["from-scratch"]
    assert report.format_table(rows, []).splitlines()[0].split() == [
        "run", "status", "step", "final_loss", "metric", "best", "best_step", "final",
        "throughput", "unit", "wall_s"]
    report.write_summary(rows, [], tmp_path)
    assert (tmp_path / "summary.csv").read_text().splitlines()[0] == (
        "run,status,step,final_loss,metric,best,best_step,final,throughput,unit,wall_s,message,"
        "path")
    assert report.recipes([{"recipe": None}]) == ["-"]


def test_toymlx_report_of_a_sweep_shows_a_run_that_failed_before_its_bundle_as_failed(
        tmp_path, capsys):
    """toymlx-report runs/SWEEP showed such a run `missing` (its wall time `-`) where the
    sweep's own summary said `failed`, with the sweep's record of it (.status/RUN.json)."""
    root = tmp_path / "sw"
    start = ("run_start", {"recipe": "from-scratch", "config": {"steps": 3}, "world_size": 1})
    _bundle(root / "lr=0.003", [[start, *_steps(1, 3), ("eval", {"step": 3, "val_loss": 4.25}),
                                 ("run_end", {"reason": "completed", "message": None})]],
            config={"steps": 3, "lr": 3e-3})
    runs = [{"name": n, "params": {"lr": v}, "args": ["--lr", str(v)]}
            for n, v in (("lr=0.003", 3e-3), ("lr=0.001", 1e-3), ("lr=0.01", 1e-2))]
    (root / "sweep.json").write_text(json.dumps({"recipe": "from-scratch", "sweep_id": "sw",
                                                 "runs": runs}))
    (root / ".status").mkdir()
    (root / ".status" / "lr=0.001.json").write_text(json.dumps({
        "state": "failed", "exit_code": 2, "wall_s": 2.7907,
        "message": "toymlx-train: error: nope.txt: cannot read data file"}))
    assert report_main([str(root), "--out", str(tmp_path / "rep.html")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[:3] for line in lines[2:]] == [
        ["lr=0.003", "0.003", "completed"], ["lr=0.001", "0.001", "failed"],
        ["lr=0.01", "0.01", "pending"]]
    assert lines[3].endswith("2.79")


def test_a_bundle_every_other_reader_refuses_is_reported_with_a_warning(tmp_path):
    """config.json edited to the wrong types: eval, generate, export and resume refuse the run
    in one line; the report drew the edited values ("ten" steps) as the run's without a word.
    It still shows the row, and now says why the run is refused, naming the file and key."""
    from toymlx_cli.train import main as train_main

    from toymlx.backend.notice import ToymlxWarning

    assert train_main(["--recipe", "from-scratch", *TINY[:-3], "--steps", "2", "--no-compile",
                       "--no-progress", "--runs-root", str(tmp_path), "--run-id", "a"]) == 0
    config = tmp_path / "a" / "config.json"
    saved = json.loads(config.read_text())
    saved["config"]["steps"] = "ten"
    config.write_text(json.dumps(saved))
    with pytest.warns(ToymlxWarning) as seen:
        (row,) = report.summarize([tmp_path / "a"])
    assert [str(w.message) for w in seen] == [
        (f"{config}: key 'config.steps': expected an integer, found \"ten\" (a string); fix it "
         "to the run's value; its row shows what its files still tell")]
    assert row["status"] == "completed"


def test_a_folder_of_sweeps_is_named_and_a_run_named_twice_is_shown_once(tmp_path):
    """`toymlx-report runs` (sweeps inside) said "found neither"; `toymlx-report runs/s
    runs/s/b` showed run b twice."""
    sweep_dir = tmp_path / "runs" / "s"
    for name in ("a", "b"):
        _bundle(sweep_dir / name, [[("run_start", {}), *_steps(1, 2)]])
    (sweep_dir / "sweep.json").write_text(json.dumps({"runs": [{"name": "a"}, {"name": "b"}]}))
    with pytest.raises(ValueError) as e:
        report.expand_dirs([tmp_path / "runs"])
    assert str(e.value) == (f"{tmp_path / 'runs'}: expected a run bundle (events.jsonl or "
                            "config.json) or a folder of run bundles, found a folder of sweeps "
                            f"(s): name them, as in toymlx-report {sweep_dir}")
    assert report.expand_dirs([sweep_dir, sweep_dir / "b", sweep_dir / ".." / "s" / "a"]) == [
        sweep_dir / "a", sweep_dir / "b"]


def test_a_runs_weights_folder_or_one_of_its_files_names_the_run(tmp_path):
    """`toymlx-report runs/r/weights` said "found neither", `runs/r/config.json` or a
    checkpoint "found a file", as for a file of no run; now each names the run to give, as
    toymlx-eval --model does for weights/."""
    run = _bundle(tmp_path / "r", [[("run_start", {}), *_steps(1, 2)]], config={"steps": 2})
    (run / "weights").mkdir()
    (run / "weights" / "step_2.gguf").write_bytes(b"GGUF")
    (tmp_path / "other.txt").write_text("x")
    in_run = "expected a run bundle or sweep folder, found a file of the run"
    cases = [(run / "weights", (f"{run / 'weights'}: expected a run bundle (events.jsonl or "
                                "config.json) or a folder of run bundles, found the weights "
                                f"folder of the run {run}; name the run: {run}")),
             *((run / name, f"{run / name}: {in_run} {run}; name the run: {run}")
               for name in ("config.json", "events.jsonl", "weights/step_2.gguf")),
             (tmp_path / "other.txt", (f"{tmp_path / 'other.txt'}: expected a run bundle or "
                                       "sweep folder, found a file"))]
    for given, found in cases:
        with pytest.raises(ValueError) as e:
            report.expand_dirs([given])
        assert str(e.value) == found


def test_a_run_training_now_is_running_not_torn(tmp_path):
    """toymlx-report on a run whose process trains it now (its lock held) said "torn", the
    status of a killed run; now "running". Once the lock is dropped (the process killed, the
    system releases it), "torn" again."""
    from toymlx.backend.lock import LOCK_FILE, acquire

    start = ("run_start", {"recipe": "from-scratch", "config": {"steps": 8}, "world_size": 1,
                           "start_step": 0})
    run = _bundle(tmp_path / "live", [[start, *_steps(1, 3)]], config={"steps": 8})
    lock = acquire(run / LOCK_FILE, "toymlx-train")
    try:
        (row,) = report.summarize([run])
        assert (row["status"], row["step"]) == ("running", 3)
    finally:
        lock.release()
    (row,) = report.summarize([run])
    assert (row["status"], row["step"]) == ("torn", 3)


def test_a_report_it_drew_is_drawn_again_and_any_other_file_refused(tmp_path, capsys,
                                                                    monkeypatch):
    """`toymlx-report` run twice as the runs went on refused its own report.png ("expected a
    new file"), printing no table: the report it drew (marked `toymlx-report` in the PNG's
    Software chunk, the HTML's generator tag) is drawn afresh; a file it did not draw under
    that name is still refused, kept byte for byte."""
    pytest.importorskip("matplotlib", reason="the report extra: pip install 'toymlx[report]'")
    from toymlx.runner.report import is_report

    monkeypatch.chdir(tmp_path)
    _bundle(tmp_path / "runs" / "a", [[("run_start", {"recipe": "from-scratch",
                                                       "config": {"steps": 3}}), *_steps(1, 3)]])
    for out in ("report.png", "r.html"):
        assert report_main(["--out", out]) == 0
        first = (tmp_path / out).read_bytes()
        assert is_report(out)
        _bundle(tmp_path / "runs" / "b", [[("run_start", {"recipe": "from-scratch",
                                                           "config": {"steps": 3}}),
                                           *_steps(1, 3)]])
        capsys.readouterr()
        assert report_main(["--out", out]) == 0  # the same command, a run later
        o = capsys.readouterr()
        assert [line.split()[0] for line in o.out.splitlines()[2:]] == ["a", "b"]
        assert o.err == f"toymlx-report: wrote {out}\n"
        assert (tmp_path / out).read_bytes() != first and is_report(out)
        shutil.rmtree(tmp_path / "runs" / "b")
    mine = b"\x89PNG\r\n\x1a\n my own plot, its Software chunk matplotlib's"
    (tmp_path / "mine.png").write_bytes(mine)
    (tmp_path / "mine.html").write_text("<html><meta name='generator' content='other'>")
    for out in ("mine.png", "mine.html"):
        kept = (tmp_path / out).read_bytes()
        assert not is_report(out)
        assert report_main(["--out", out]) == 2
        assert capsys.readouterr().err == (
            f"toymlx-report: error: {out}: --out: expected a new file, found an existing file; "
            "pass --overwrite to replace it, or choose another --out\n")
        assert (tmp_path / out).read_bytes() == kept


def test_a_stop_while_the_report_is_drawn_is_one_line_and_no_half_file(tmp_path, capsys,
                                                                        monkeypatch):
    """Ctrl-C while toymlx-report drew its report ended in a KeyboardInterrupt traceback; now
    one line saying nothing was written and how to finish, exit status 130, the existing --out
    file as it was and no temporary beside it."""
    import os
    import signal
    import time

    pytest.importorskip("matplotlib")
    import matplotlib.figure

    from toymlx.backend.stop import SIGNALS

    def cut(self, f, *args, **kw):
        f.write(b"\x89PNG half a report")
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while report.png is written
        time.sleep(5)  # not reached: the handler raises at once
        raise AssertionError("the stop was not raised")

    run = _bundle(tmp_path / "a", [[("run_start", {"recipe": "from-scratch",
                                                   "config": {"steps": 3}}), *_steps(1, 3)]])
    out = tmp_path / "rep.png"
    assert report_main([str(run), "--out", str(out)]) == 0
    drawn = out.read_bytes()
    capsys.readouterr()
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", cut)
    before = {s: signal.getsignal(s) for s in SIGNALS}
    try:
        assert report_main([str(run), "--out", str(out)]) == 130
    finally:
        for s, h in before.items():  # a stop leaves them ignored until the process exits
            signal.signal(s, h)
    assert capsys.readouterr().err == (
        "\ntoymlx-report: interrupted; no report was written (an existing --out file is as it "
        "was): run it again to draw it\n")
    assert out.read_bytes() == drawn
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []
