"""`-c/--config FILE` (cli/config_file.py) as a user runs it: YAML and JSON files, flags over
the file, a run's config.json starting a new run, and one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_errors import error_line
from toymlx_cli.train import main

TINY = ["--model.d-model", "32", "--model.n-layers", "1", "--model.n-heads", "4",
        "--model.n-kv-heads", "2", "--model.ffn-dim", "64", "--model.context", "64",
        "--seq-len", "32", "--eval-batches", "1", "--eval-every", "0", "--no-progress"]


@pytest.fixture(scope="module")
def data(shared_file) -> str:
    return str(shared_file("text/tinystories_sample.txt"))


def saved(run: Path) -> dict:
    return json.loads((run / "config.json").read_text())


def losses(run: Path) -> list[float]:
    return [e["loss"] for e in map(json.loads, (run / "events.jsonl").read_text().splitlines())
            if e["kind"] == "step"]


def test_yaml_file_and_flags_over_it_give_the_run_config(tmp_path, data):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"""# an mlx-lm style file, in toymlx's option names
recipe: from-scratch
lr: 1e-3            # YAML 1.1 would read this as a string
batch_size: 3
grad-accum: 2
model:
  d_model: 32
  n-layers: 1
model.n_heads: 4
data:
  path: {data}
  val_fraction: 0.2
compile: false
steps: 5
seed: 7
""")
    rc = main(["-c", str(cfg), *TINY, "--runs-root", str(tmp_path), "--run-id", "r",
               "--steps", "2", "--model.n-layers", "2"])
    assert rc == 0
    got = saved(tmp_path / "r")
    assert got["recipe"] == "from-scratch"
    c = got["config"]
    assert (c["lr"], c["batch_size"], c["grad_accum"], c["seed"], c["compile"]) == (
        0.001, 3, 2, 7, False)
    assert c["data"] == {"path": data, "val_fraction": 0.2}
    assert c["model"]["d_model"] == 32 and c["model"]["n_heads"] == 4
    # flags after the file win
    assert c["steps"] == 2 and c["model"]["n_layers"] == 2
    assert len(losses(tmp_path / "r")) == 2


def test_run_from_another_runs_config_equals_the_same_flags(tmp_path, data):
    flags = ["--recipe", "from-scratch", *TINY, "--data.path", data, "--runs-root",
             str(tmp_path), "--steps", "3", "--lr", "2e-3", "--seed", "3", "--no-compile"]
    assert main([*flags, "--run-id", "a", "--stop-at", "2"]) == 0
    a = tmp_path / "a"
    # --stop-at and --run-id name and steer run a only: b runs all 3 steps into its own folder
    assert main(["-c", str(a / "config.json"), "--run-id", "b"]) == 0
    assert main([*flags, "--run-id", "c"]) == 0
    b, c = saved(tmp_path / "b"), saved(tmp_path / "c")
    assert b["config"]["run_id"] == "b" and b["config"]["stop_at"] is None
    assert {**b["config"], "run_id": "c"} == c["config"]
    assert losses(tmp_path / "b") == losses(tmp_path / "c")
    assert losses(a) == losses(tmp_path / "c")[:2]


@pytest.mark.parametrize("text,name,want", [
    ("lr: [1e-3\n", "bad.yaml",
     "{p}: expected YAML, found expected ',' or ']', but got '<stream end>' at line 2 column 1"),
    ('{"lr": 1e-3,}', "bad.json", ("{p}: expected JSON, found Expecting property name enclosed in "
     "double quotes at line 1 column 13")),
    ("- lr\n", "list.yaml", "{p}: expected a mapping of option: value, found a list"),
    ("lora:\n  rnak: 4\n", "typo.yaml", ("{p}: key 'lora.rnak': expected an option of toymlx-train "
     "--recipe lora, found an unknown key; did you mean --lora.rank?")),
    ("iters: 100\n", "mlx.yaml", ("{p}: key 'iters': expected an option of toymlx-train --recipe "
     "lora, found an unknown key; mlx-lm's iters is toymlx's --steps")),
    ("lr: fast\n", "type.yaml", ("{p}: key 'lr': expected a number, found \"fast\" (a string); fix "
     "it, or remove the key to take its default")),
    ("resume: runs/x\n", "resume.yaml", ("{p}: key 'resume': expected on the command line "
     "(--resume), found it in a config file")),
])
def test_bad_config_files_are_one_line(tmp_path, capsys, text, name, want):
    p = tmp_path / name
    p.write_text(text)
    rc = main(["--recipe", "lora", "-c", str(p), "--runs-root", str(tmp_path)])
    assert rc == 2
    assert error_line(capsys) == "toymlx-train: error: " + want.format(p=p)
    assert not any(x.is_dir() for x in tmp_path.iterdir())


def test_missing_file_and_resume_with_config(tmp_path, capsys):
    assert main(["--recipe", "lora", "-c", str(tmp_path / "nope.yaml")]) == 2
    assert error_line(capsys) == (f"toymlx-train: error: {tmp_path / 'nope.yaml'}: -c/--config: "
                                  "expected a readable UTF-8 YAML or JSON file, found No such "
                                  "file or directory")
    (tmp_path / "c.yaml").write_text("lr: 1.0\n")
    assert main(["--resume", str(tmp_path), "-c", str(tmp_path / "c.yaml")]) == 2
    assert "a resumed run keeps its saved configuration" in error_line(capsys)


def test_forward_only_command_takes_a_config_file(tmp_path, data, capsys):
    from toymlx_cli.eval import main as eval_main

    assert main(["--recipe", "from-scratch", *TINY, "--data.path", data, "--runs-root",
                 str(tmp_path), "--run-id", "m", "--steps", "1", "--no-compile"]) == 0
    capsys.readouterr()
    cfg = tmp_path / "eval.json"
    cfg.write_text(json.dumps({"model": str(tmp_path / "m"), "data.path": data, "seq-len": 8}))
    assert eval_main(["-c", str(cfg), "--seq-len", "16"]) == 0
    from_file = json.loads(capsys.readouterr().out)
    assert eval_main(["--model", str(tmp_path / "m"), "--data.path", data, "--seq-len", "16"]) == 0
    assert json.loads(capsys.readouterr().out) == from_file
    cfg.write_text(json.dumps({"modle": "x"}))
    assert eval_main(["-c", str(cfg)]) == 2
    assert error_line(capsys, "toymlx-eval") == (
        f"toymlx-eval: error: {cfg}: key 'modle': expected an option of toymlx-eval, found an "
        "unknown key; did you mean --model?")


def test_report_takes_a_config_file(tmp_path, data, capsys):
    from toymlx_cli.report import main as report

    assert main(["--recipe", "from-scratch", *TINY, "--data.path", data, "--runs-root",
                 str(tmp_path), "--run-id", "m", "--steps", "1", "--no-compile"]) == 0
    cfg = tmp_path / "report.yaml"
    cfg.write_text(f"out: {tmp_path / 'from-file.html'}\n")
    assert report(["-c", str(cfg), str(tmp_path / "m")]) == 0
    assert (tmp_path / "from-file.html").read_text().startswith("<!doctype html>")
    assert report(["-c", str(cfg), str(tmp_path / "m"), "--out", str(tmp_path / "f.html")]) == 0
    assert (tmp_path / "f.html").is_file()
    cfg.write_text("output: x.png\n")
    capsys.readouterr()
    assert report(["-c", str(cfg), str(tmp_path / "m")]) == 2
    assert error_line(capsys, "toymlx-report") == (
        f"toymlx-report: error: {cfg}: key 'output': expected an option of toymlx-report, found "
        "an unknown key; did you mean --out?")


def test_sweep_passes_the_file_to_every_run_before_its_grid_values():
    from toymlx import sweep

    specs = sweep.grid(["-c", "cfg.yaml", "--steps", "3"], {"lr": [1e-3, 2e-3]},
                       recipe="from-scratch")
    # the runs' own -c handling puts the later flags (the grid's) over the file
    assert [s.args for s in specs] == [("-c", "cfg.yaml", "--steps", "3", "--lr", "0.001"),
                                       ("-c", "cfg.yaml", "--steps", "3", "--lr", "0.002")]


def test_sweep_file_splits_the_sweeps_keys_from_the_runs():
    """toymlx-sweep -c: its own keys (either spelling) become its flags' defaults, flags over
    them; `seed` stays the runs' (the draws' seed is random_seed); the rest is the runs'."""
    from toymlx_cli.config_file import sweep_config
    from toymlx_cli.sweep import _parser

    parser = _parser()
    grid, runs = sweep_config(parser, {
        "recipe": "from-scratch", "grid": {"lr": [1e-3, 3e-3], "model": {"d-model": [64]}},
        "workers": 2, "sweep-id": "s", "random": 3, "random_seed": 7, "no_report": True,
        "seed": 1, "steps": 200, "model": {"n_layers": 2}}, "s.yaml")
    assert grid == {"lr": [1e-3, 3e-3], "model.d_model": [64]}
    assert runs == {"seed": 1, "steps": 200, "model": {"n_layers": 2}}
    a = parser.parse_args([])
    assert (a.recipe, a.workers, a.sweep_id, a.random, a.seed, a.no_report, a.grid) == (
        "from-scratch", 2, "s", 3, 7, True, [])
    a = parser.parse_args(["--workers", "4", "--random-seed", "8", "--recipe", "lora"])
    assert (a.recipe, a.workers, a.seed, a.sweep_id) == ("lora", 4, 8, "s")
    # a run's config.json: its recipe, and every option it saved (less RUN_NAMING) for the runs
    parser = _parser()
    grid, runs = sweep_config(parser, {"recipe": "lora", "config": {
        "run_id": "old", "workers": 5, "lr": 0.1}}, "config.json")
    assert (grid, runs, parser.parse_args([]).workers) == ({}, {"workers": 5, "lr": 0.1}, 1)


def test_launch_options_from_a_config_file(tmp_path, capsys):
    from toymlx_cli.launch import main as launch

    cfg = tmp_path / "launch.yaml"
    cfg.write_text("n: 2\ngrace: fast\n")
    assert launch(["-c", str(cfg), "--", "true"]) == 2
    assert error_line(capsys, "toymlx-launch") == (
        f"toymlx-launch: error: {cfg}: key 'grace': expected a number, found \"fast\"")
