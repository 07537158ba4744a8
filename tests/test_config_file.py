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
    assert c["data"] == {"path": data, "val_fraction": 0.2, "read_as": "text"}  # a .txt
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
    # PyYAML's "found character ..." was "found found character ..."
    ("\t steps: 1\n", "tab.yaml", ("{p}: expected YAML, found character '\\t' that cannot "
                                    "start any token at line 1 column 1")),
    # with --recipe, a file holding no option ran every default, the file said nothing of
    ("", "empty.yaml", "{p}: expected a mapping of options, found an empty file"),
    ("# lr: 1e-3\n\n", "commented.yaml", "{p}: expected a mapping of options, found only comments"),
    ("{}", "empty.json", "{p}: expected a mapping of options, found an empty mapping"),
    ('{"lr": 1e-3,}', "bad.json", ("{p}: expected JSON, found Expecting property name enclosed in "
     "double quotes at line 1 column 13")),
    ("- lr\n", "list.yaml", "{p}: expected a mapping of option: value, found a list"),
    ("lora:\n  rnak: 4\n", "typo.yaml", ("{p}: key 'lora.rnak': expected an option of toymlx-train "
     "--recipe lora, found an unknown key; did you mean lora.rank?")),
    ("iters: 100\nlr: 1e-3\n", "mlx.yaml", ("{p}: key 'lr': expected a key of mlx-lm's lora "
     "config (the file is read as mlx-lm's, for its 'iters'), found an unknown key")),
    ("lr: fast\n", "type.yaml", ("{p}: key 'lr': expected a number, found \"fast\" (a string); fix "
     "it, or remove the key to take its default")),
    ("resume: runs/x\n", "resume.yaml", ("{p}: key 'resume': expected on the command line "
     "(--resume), found it in a config file")),
    # nanoGPT's config/train_shakespeare_char.py (before: "expected a mapping of option: value,
    # found a string", its lines read as one YAML string)
    ("out_dir = 'out-shakespeare-char'\nblock_size = 256 # context\n", "train_char.py",
     ("{p}: -c/--config: expected a YAML or JSON file, found a Python file (nanoGPT's "
      "config/*.py are not run); write its settings as YAML, one `option: value` a line "
      "(block_size = 256: seq_len: 256)")),
])
def test_bad_config_files_are_one_line(tmp_path, capsys, text, name, want):
    p = tmp_path / name
    p.write_text(text)
    rc = main(["--recipe", "lora", "-c", str(p), "--runs-root", str(tmp_path)])
    assert rc == 2
    assert error_line(capsys) == "toymlx-train: error: " + want.format(p=p)
    assert not any(x.is_dir() for x in tmp_path.iterdir())


@pytest.mark.parametrize("text,want", [
    ("steps: 5\n", ("{p}: expected a 'recipe' key (one of from-scratch, warm-start, lora, "
     "vit-tiny), found none; or give --recipe NAME")),
    ("", "{p}: expected a mapping of options, found an empty file"),
])
def test_a_file_that_names_no_recipe_is_one_line_naming_it(tmp_path, capsys, text, want):
    """`toymlx-train -c FILE` without --recipe: a file with no `recipe` key, or an empty one,
    printed tyro's general usage (status 2) without naming the file."""
    p = tmp_path / "c.yaml"
    p.write_text(text)
    assert main(["-c", str(p), "--runs-root", str(tmp_path)]) == 2
    assert error_line(capsys) == "toymlx-train: error: " + want.format(p=p)
    assert not any(x.is_dir() for x in tmp_path.iterdir())


def test_missing_file_and_resume_with_config(tmp_path, capsys):
    assert main(["--recipe", "lora", "-c", str(tmp_path / "nope.yaml")]) == 2
    assert error_line(capsys) == (f"toymlx-train: error: {tmp_path / 'nope.yaml'}: -c/--config: "
                                  "expected a readable UTF-8 YAML or JSON file, found No such "
                                  "file or directory")
    # llama.cpp's -c 4096, its context size: what -c is here, and what sets the context
    assert main(["--recipe", "lora", "-c", "4096"]) == 2
    assert error_line(capsys) == ("toymlx-train: error: 4096: -c/--config: expected a readable "
                                  "UTF-8 YAML or JSON file, found No such file or directory "
                                  "(llama.cpp's -c is its context size; here -c names a config "
                                  "file: --seq-len sets a row's tokens, and generation reads the "
                                  "model's context)")


def test_a_config_file_given_with_resume_gives_the_command_that_works(tmp_path, capsys):
    """`-c FILE --resume RUN` said "give either --resume or -c" and left the user to write the
    command: the refusal now ends with it, the line as typed without -c FILE, shell-quoted as
    the taken-folder refusal's (`train_command`)."""
    run, path = tmp_path / "my runs" / "r", tmp_path / "c.yaml"
    path.write_text("lr: 1.0\n")
    assert main(["--resume", str(run), "-c", str(path), "--steps", "20"]) == 2
    assert error_line(capsys) == (
        f"toymlx-train: error: -c/--config {path}: a resumed run keeps its saved configuration "
        f"(only --steps and run-local options may change); give either --resume or -c/--config: "
        f"toymlx-train --resume '{run}' --steps 20")


def test_a_gguf_given_as_the_config_file_is_named(tmp_path, capsys):
    """`-c model.gguf` (a model where the config file goes) said "'utf-8' codec can't decode
    byte 0x80 in position 9: invalid start byte"."""
    p = tmp_path / "m.gguf"
    p.write_bytes(b"GGUF\x03\x00\x00\x00" + bytes(range(128, 256)))
    assert main(["--recipe", "lora", "-c", str(p)]) == 2
    assert error_line(capsys) == (f"toymlx-train: error: {p}: -c/--config: expected a readable "
                                  "UTF-8 YAML or JSON file, found a GGUF model file (a model is "
                                  "--base, --donor or --model)")


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
        "unknown key; did you mean model?")


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
        "an unknown key; did you mean out?")


def test_sweep_passes_the_file_to_every_run_before_its_grid_values():
    from toymlx import sweeps as sweep

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


# ---- issue 39: config files that never misread ---------------------------------------------
NOT_JSON = "expected a JSON value (a string, number, true/false, null, list or mapping), found"


@pytest.mark.parametrize("command", ["train", "eval", "generate", "sweep"])
@pytest.mark.parametrize("text,want", [
    ("run_id: 2024-01-01\n", (f"key 'run_id': {NOT_JSON} a date: 2024-01-01; quote it for a "
     "string")),
    ("run_id: 2024-01-01 10:30:00\n", (f"key 'run_id': {NOT_JSON} a timestamp: 2024-01-01 "
     "10:30:00; quote it for a string")),
    ("run_id: !!binary aGk=\n", f"key 'run_id': {NOT_JSON} binary data (!!binary): b'hi'"),
    ("lora:\n  targets: !!set {q}\n", f"key 'lora.targets': {NOT_JSON} a set (!!set): {{'q'}}"),
    ("grid:\n  lr: [1e-3, 2024-01-01]\n", (f"key 'grid.lr[1]': {NOT_JSON} a date: 2024-01-01; "
     "quote it for a string")),
])
def test_values_json_cannot_hold_are_one_line_in_every_command(tmp_path, capsys, command, text,
                                                               want):
    """A YAML date, timestamp, !!binary or !!set crashed every -c command with `Object of type
    date is not JSON serializable` while its error was being built."""
    from toymlx_cli.eval import main as eval_main
    from toymlx_cli.generate import main as generate_main
    from toymlx_cli.sweep import main as sweep_main

    p = tmp_path / "odd.yaml"
    p.write_text(text)
    run, prog = {"train": (lambda a: main(["--recipe", "lora", *a]), "toymlx-train"),
                 "eval": (eval_main, "toymlx-eval"), "generate": (generate_main, "toymlx-generate"),
                 "sweep": (sweep_main, "toymlx-sweep")}[command]
    assert run(["-c", str(p)]) == 2
    assert error_line(capsys, prog) == f"{prog}: error: {p}: {want}"
    assert p.read_text() == text


@pytest.mark.parametrize("text,name,want", [
    ("steps: 2\nsteps: 3\n", "twice.yaml",
     "key 'steps': expected once in its mapping, found it twice (lines 1 and 2); keep one"),
    ("lora:\n  rank: 4\n  alpha: 8\n  rank: 16\n", "nested.yaml",
     "key 'rank': expected once in its mapping, found it twice (lines 2 and 4); keep one"),
    ("{steps: 2, steps: 3}\n", "flow.yaml",
     "key 'steps': expected once in its mapping, found it twice (lines 1 and 1); keep one"),
    ('{"steps": 2, "steps": 3}', "twice.json",
     "key 'steps': expected once in its object, found twice; keep one"),
    ("batch-size: 2\nbatch_size: 3\n", "spellings.yaml", ("keys 'batch-size' and 'batch_size': "
     "expected one of them (both set --batch-size), found both; keep one")),
    ("lora.rank: 4\nlora:\n  rank: 8\n", "dotted.yaml", ("keys 'lora.rank' and 'lora: {rank}': "
     "expected one of them (both set --lora.rank), found both; keep one")),
    ('{"lora": {"rank": 8}, "lora.rank": 4}', "dotted.json", ("keys 'lora: {rank}' and "
     "'lora.rank': expected one of them (both set --lora.rank), found both; keep one")),
])
def test_a_key_given_twice_or_under_two_spellings_names_both(tmp_path, capsys, text, name, want):
    """The last one used to win silently (`steps: 2` then `steps: 3` ran 3 steps)."""
    p = tmp_path / name
    p.write_text(text)
    assert main(["--recipe", "lora", "-c", str(p), "--runs-root", str(tmp_path)]) == 2
    assert error_line(capsys) == f"toymlx-train: error: {p}: {want}"
    assert not any(x.is_dir() for x in tmp_path.iterdir())


def test_an_alias_and_its_option_in_one_file_name_both(tmp_path, capsys):
    """toymlx-eval's --data-path is also --data.path; toymlx-sweep's random_seed is --seed."""
    from toymlx_cli.eval import main as eval_main
    from toymlx_cli.sweep import main as sweep_main

    p = tmp_path / "eval.yaml"
    p.write_text("model: m.gguf\ndata_path: a.txt\ndata.path: b.txt\n")
    assert eval_main(["-c", str(p)]) == 2
    assert error_line(capsys, "toymlx-eval") == (
        f"toymlx-eval: error: {p}: keys 'data_path' and 'data.path': expected one of them (both "
        "set --data-path), found both; keep one")
    p = tmp_path / "sweep.yaml"
    p.write_text("recipe: from-scratch\nsweep-id: a\nsweep_id: b\ngrid: {lr: [1e-3]}\n")
    assert sweep_main(["-c", str(p)]) == 2
    assert error_line(capsys, "toymlx-sweep") == (
        f"toymlx-sweep: error: {p}: keys 'sweep-id' and 'sweep_id': expected one of them (both "
        "set --sweep-id), found both; keep one")


def test_yaml_numbers_are_yaml_1_2s():
    """YAML 1.1's sexagesimal (`1:0` = 60), octal (`010` = 8), underscores and yes/no/on/off
    stay strings, so an option wanting a number or a boolean refuses them; 1.2's forms read."""
    import yaml
    from toymlx_cli.config_file import _Loader

    got = yaml.load("a: 1:0\nb: 010\nc: 1_000\nd: yes\ne: on\nf: 1e-5\ng: .5\nh: +3\n"
                    "i: 0o17\nj: 0x1F\nk: -.inf\nl: True\nm: ~\nn: 1.\no: -0\n", Loader=_Loader)
    assert got == {"a": "1:0", "b": "010", "c": "1_000", "d": "yes", "e": "on", "f": 1e-5,
                   "g": 0.5, "h": 3, "i": 15, "j": 31, "k": float("-inf"), "l": True,
                   "m": None, "n": 1.0, "o": 0}
    assert [type(got[k]) for k in "fhn"] == [float, int, float]


@pytest.mark.parametrize("text,want", [
    ("steps: 1:0\n", "key 'steps': expected an integer, found \"1:0\" (a string)"),
    ("steps: 010\n", "key 'steps': expected an integer, found \"010\" (a string)"),
    ("compile: yes\n", "key 'compile': expected true or false, found \"yes\" (a string)"),
])
def test_yaml_1_1_numbers_are_refused_where_a_number_is_expected(tmp_path, capsys, data, text,
                                                                 want):
    """`steps: 1:0` ran 60 steps and `steps: 010` ran 8."""
    p = tmp_path / "n.yaml"
    p.write_text(text)
    assert main(["--recipe", "from-scratch", "-c", str(p), *TINY, "--data.path", data,
                 "--runs-root", str(tmp_path), "--stop-at", "1", "--no-compile"]) == 2
    assert error_line(capsys) == (f"toymlx-train: error: {p}: {want}; fix it, or remove the key "
                                  "to take its default")


def test_a_run_config_beside_other_options_is_refused_not_half_read(tmp_path, capsys, data):
    """`recipe:` plus a `config:` mapping was read as a run's config.json, its other top-level
    keys ignored."""
    p = tmp_path / "mixed.yaml"
    p.write_text(f"recipe: from-scratch\nconfig:\n  data: {{path: {data}}}\nsteps: 3\n")
    assert main(["-c", str(p), *TINY, "--runs-root", str(tmp_path), "--stop-at", "1",
                 "--no-compile"]) == 2
    assert error_line(capsys) == (
        f"toymlx-train: error: {p}: key 'steps': expected a run's config.json (keys config, "
        "data_files, format, model_files, recipe) or a file of options, found both (a 'config' "
        "mapping beside other options); move the options into one of them")
    assert not any(x.is_dir() for x in tmp_path.iterdir())


FULL_LORA = ("--lora.rank: expected no value with --fine-tune-type full (every weight is "
             "trained, no adapters), found 4; remove it, or train --fine-tune-type lora or dora")


def test_an_option_that_does_not_apply_is_named(tmp_path, capsys, stories_path):
    """`--lora.rank` with `--fine-tune-type full` was accepted and recorded."""
    # on main these trained: --stop-at 1 keeps such a run short
    flags = ["--recipe", "lora", "--base", str(stories_path), "--runs-root", str(tmp_path),
             "--stop-at", "1", "--no-compile", "--seq-len", "32", "--no-progress"]
    assert main([*flags, "--fine-tune-type", "full", "--lora.rank", "4"]) == 2
    assert error_line(capsys) == f"toymlx-train: error: {FULL_LORA}"
    p = tmp_path / "full.yaml"
    p.write_text("fine_tune_type: full\nlora: {rank: 4}\n")
    assert main([*flags, "-c", str(p)]) == 2
    # the file's key, the one to remove, with the file (it named the flag alone)
    assert error_line(capsys) == f"toymlx-train: error: {FULL_LORA}".replace(
        "--lora.rank", f"{p}: key 'lora: {{rank}}'")
    p.write_text("fine_tune_type: full\nlora.dropout: 0.1\n")
    assert main([*flags, "-c", str(p)]) == 2
    assert error_line(capsys) == f"toymlx-train: error: {FULL_LORA}".replace(
        "--lora.rank", f"{p}: key 'lora.dropout'").replace("found 4", "found 0.1")
    p.write_text("fine_tune_type: full\nlora: {rank: 4}\n")  # the flag over the file's key
    assert main([*flags, "-c", str(p), "--lora.rank", "2"]) == 2
    assert error_line(capsys) == f"toymlx-train: error: {FULL_LORA}".replace("4", "2")
    assert [x.name for x in tmp_path.iterdir()] == ["full.yaml"]


@pytest.mark.parametrize("text, key, found", [
    ("fine_tune_type: full\nlora: {rank: 8}\n", "lora: {rank}", "found 8"),
    ("fine_tune_type: full\nlora:\n  targets: q\n", "lora: {targets}", "found 'q'"),
    ('{"fine_tune_type": "full", "lora.init_adapter": null}', "lora.init_adapter", "found None"),
])
def test_a_file_key_at_its_default_where_it_does_not_apply_is_named(
        tmp_path, capsys, stories_path, text, key, found):
    """A -c file's key at its default (rank 8, `q`, no adapter) where it does not apply was
    taken without a word, where the same flag on the command line is refused: a file's keys
    count as given, as its flags do. A run's config.json lists every option of its run (these
    among them, at their defaults), so its keys do not: the same options from one train."""
    flags = ["--recipe", "lora", "--base", str(stories_path), "--runs-root", str(tmp_path),
             "--stop-at", "1", "--no-compile", "--seq-len", "32", "--no-progress"]
    p = tmp_path / ("options.json" if text.startswith("{") else "options.yaml")
    p.write_text(text)
    assert main([*flags, "-c", str(p)]) == 2
    assert error_line(capsys) == "toymlx-train: error: " + FULL_LORA.replace(
        "--lora.rank", f"{p}: key {key!r}").replace("found 4", found)
    assert [x.name for x in tmp_path.iterdir()] == [p.name]
    run = tmp_path / "config.json"
    run.write_text(json.dumps({"recipe": "lora", "config": {
        "fine_tune_type": "full", "lora": {"rank": 8, "targets": "q", "init_adapter": None},
        "warmup_init": 0.0, "lr_schedule": "warmup-cosine", "min_lr_ratio": 0.1}}))
    assert main([*flags, "-c", str(run), "--run-id", "r"]) == 0
    assert json.loads((tmp_path / "r" / "config.json").read_text())["config"]["fine_tune_type"] \
        == "full"


def test_a_file_key_a_later_check_refuses_names_the_file_and_key(tmp_path, capsys, data):
    """A value of a -c file refused once the options are parsed (by `check_config`, not the
    file's own type check) named the flag alone, though the value to change is the file's."""
    p = tmp_path / "o.yaml"
    p.write_text("recipe: from-scratch\nbatch-size: 0\n")
    argv = ["-c", str(p), *TINY, "--data.path", data, "--runs-root", str(tmp_path),
            "--stop-at", "1", "--no-compile"]
    assert main(argv) == 2
    assert error_line(capsys) == f"toymlx-train: error: {p}: key 'batch-size': expected >= 1, found 0"
    assert main([*argv, "--batch-size", "-1"]) == 2  # the flag's value, over the file's
    assert error_line(capsys) == "toymlx-train: error: --batch-size: expected >= 1, found -1"
    assert [x.name for x in tmp_path.iterdir()] == ["o.yaml"]


@pytest.mark.parametrize("argv, flag, found", [
    (["--lora.targets", "q"], "--lora.targets", "'q'"),
    (["--lora.rank=8"], "--lora.rank", "8"),
    (["--lora.init_adapter", "None"], "--lora.init_adapter", "None"),  # as typed
])
def test_an_option_given_at_its_default_where_it_does_not_apply_is_named(
        tmp_path, capsys, stories_path, argv, flag, found):
    """Given on the command line at its default (`q`, rank 8, no adapter), it was taken: the
    check compared values with the defaults, not the flags given."""
    flags = ["--recipe", "lora", "--base", str(stories_path), "--runs-root", str(tmp_path),
             "--stop-at", "1", "--no-compile", "--seq-len", "32", "--no-progress"]
    assert main([*flags, "--fine-tune-type", "full", *argv]) == 2
    assert error_line(capsys) == "toymlx-train: error: " + FULL_LORA.replace(
        "--lora.rank", flag).replace("found 4", f"found {found}")
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("how", ["flag", "file"])
@pytest.mark.parametrize("value,want", [
    ("inf", "--lr: expected a finite number, found inf"),
    ("nan", "--lr: expected a finite number, found nan"),
    ("-0.001", "--lr: expected > 0, found -0.001"),
])
def test_a_learning_rate_that_is_not_a_finite_positive_number_fails_validation(
        tmp_path, capsys, data, how, value, want):
    """`lr: .inf` passed validation (and trained on nan weights)."""
    if how == "flag":
        argv = ["--recipe", "from-scratch", "--lr", value]
    else:
        p = tmp_path / "lr.yaml"
        p.write_text(f"recipe: from-scratch\nlr: {({'inf': '.inf', 'nan': '.nan'}).get(value, value)}\n")
        argv = ["-c", str(p)]
    assert main([*argv, *TINY, "--data.path", data, "--runs-root", str(tmp_path), "--steps",
                 "1", "--no-compile"]) == 2
    if how == "file":  # named by the file's key, the one to change
        want = want.replace("--lr", f"{p}: key 'lr'")
    assert error_line(capsys) == f"toymlx-train: error: {want}"
    assert not any(x.is_dir() for x in tmp_path.iterdir())


@pytest.mark.parametrize("name", ["train.jsonl", "valid.jsonl", "test.jsonl"])
def test_a_data_file_that_is_a_folder_says_so(tmp_path, capsys, name):
    """A train.jsonl that is a folder read "expected train.jsonl, found train.jsonl"; a
    valid.jsonl or test.jsonl folder was ignored."""
    d = tmp_path / "data"
    d.mkdir()
    for f in ("train.jsonl", "valid.jsonl", "test.jsonl"):
        (d / f).write_text('{"text": "%s"}\n' % ("hello there, " * 20))
    (d / name).unlink()
    (d / name).mkdir()
    assert main(["--recipe", "from-scratch", *TINY, "--data.path", str(d), "--runs-root",
                 str(tmp_path / "runs"), "--steps", "1", "--no-compile"]) == 2
    assert error_line(capsys) == (f"toymlx-train: error: {d / name}: data folder: expected a "
                                  "file, found a directory")


def test_a_lone_surrogate_in_a_json_file_is_one_line(tmp_path, capsys):
    """JSON can spell a lone surrogate ("\\ud800") that no UTF-8 file, name or config.json
    can hold."""
    p = tmp_path / "s.json"
    p.write_text('{"run_id": "ab\\ud800"}')
    assert main(["--recipe", "from-scratch", "-c", str(p), "--runs-root", str(tmp_path)]) == 2
    assert error_line(capsys) == (f"toymlx-train: error: {p}: key 'run_id': expected UTF-8 text, "
                                  "found a lone surrogate U+D800 at character 2")


def test_a_section_given_a_value_is_named_as_a_section(tmp_path, capsys):
    """`lora: 8` once got "did you mean --lr?": it is the lora section, written as a value."""
    from toymlx_cli.train import main

    f = tmp_path / "c.yaml"
    f.write_text("lora: 8\n")
    assert main(["--recipe", "lora", "-c", str(f)]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.endswith("key 'lora': expected an option of toymlx-train --recipe lora, found an "
                         "unknown key; lora is a group of options (lora.alpha, lora.dropout, "
                         "lora.init_adapter, ...): write it as a mapping, e.g. lora: "
                         "{alpha: ...}"), line
    assert "did you mean" not in line


@pytest.mark.parametrize("recipe,hint", [
    ("vit-tiny", ("nanoGPT's block_size is toymlx's --seq-len, which vit-tiny does not take: its "
                  "sequence is the image's patches, (data.image_size / model.patch_size)^2 "
                  "of them")),
    ("lora", "nanoGPT's block_size is toymlx's seq_len (the model's longest: --model.context)"),
])
def test_a_nanogpt_key_in_a_file_is_named_as_its_flag_is(tmp_path, capsys, recipe, hint):
    """`block_size: 64` in a -c file was told "did you mean --batch-size?" (by spelling), in
    every recipe; now as on the command line (`usage.flag_hint`), the recipe's options named as
    the file's keys (`file_words`: seq_len), another recipe's as its flag (--model.context)."""
    p = tmp_path / "c.yaml"
    p.write_text(f"recipe: {recipe}\nblock_size: 64\n")
    assert main(["-c", str(p), "--runs-root", str(tmp_path)]) == 2
    assert error_line(capsys) == (f"toymlx-train: error: {p}: key 'block_size': expected an "
                                  f"option of toymlx-train --recipe {recipe}, found an unknown "
                                  f"key; {hint}")


@pytest.mark.parametrize("text,key,hint", [
    *((text, key, ("llama.cpp's --lora-scaled FILE S and mlx-lm's LoRA scale are the adapters' "
                   "scale, here lora.alpha / lora.rank (scale 20 at rank 8: lora.alpha "
                   "160); lora.init_adapter FILE starts them from a file"))
      for text, key in (("lora_scale: 20\n", "lora_scale"), ("lora-scale: 20\n", "lora_scale"),
                        ('{"lora_scaled": 20}', "lora_scaled"))),
    ("ctx_size: 512\n", "ctx_size", "llama.cpp's --ctx-size is seq_len here"),
])
def test_another_tool_s_flag_as_a_key_is_named_as_the_flag_is(tmp_path, capsys, text, key, hint):
    """A file's key spelling another tool's flag (`lora_scale`, `ctx_size`) was matched by
    spelling ("did you mean --lr-schedule?", "--batch-size?"); now the hint the flag gets on the
    command line (`usage.flag_hint`)."""
    p = tmp_path / "c.yaml"
    p.write_text(text)
    assert main(["--recipe", "lora", "-c", str(p), "--runs-root", str(tmp_path)]) == 2
    assert error_line(capsys) == (f"toymlx-train: error: {p}: key {key!r}: expected an option "
                                  "of toymlx-train --recipe lora, found an unknown key; "
                                  f"{hint}")


@pytest.mark.parametrize("recipe,text,hint", [
    ("vit-tiny", "model: {n_layerz: 3}\n", ("key 'model.n_layerz': expected an option of "
     "toymlx-train --recipe vit-tiny, found an unknown key; did you mean model.n_layers?")),
    ("vit-tiny", "model: 5\n", ("key 'model': expected an option of toymlx-train --recipe "
     "vit-tiny, found an unknown key; model is a group of options (model.d_model, "
     "model.drop_path, model.ffn_dim, ...): write it as a mapping, e.g. model: "
     "{d_model: ...}")),
    ("lora", "model: base.gguf\n", ("key 'model': expected an option of toymlx-train --recipe "
     "lora, found an unknown key; mlx-lm's model is toymlx's base")),
    # before: "mlx-lm's test_batches is toymlx's --test scores all of test.jsonl; drop it"
    ("lora", "base: b.gguf\ntest_batches: 5\n", ("key 'test_batches': expected an option of "
     "toymlx-train --recipe lora, found an unknown key; mlx-lm's test_batches has no toymlx "
     "option: toymlx scores all of test.jsonl, every batch (test; its first N examples: "
     "toymlx-eval --model RUN --split test --limit N); drop it")),
])
def test_the_mlx_lm_hint_only_where_it_applies(tmp_path, capsys, recipe, text, hint):
    """vit-tiny has --model.* options: its `model.n_layerz` and `model: 5` were told "mlx-lm's
    model is toymlx's --base"; a plain `model:` in a lora file is mlx-lm's key."""
    p = tmp_path / "c.yaml"
    p.write_text(f"recipe: {recipe}\n{text}")
    assert main(["-c", str(p), "--runs-root", str(tmp_path)]) == 2
    assert error_line(capsys) == f"toymlx-train: error: {p}: {hint}"


@pytest.mark.parametrize("command,text,hint", [
    ("export", "adapter: runs/x\nadapter_path: runs/x\n", ("mlx-lm's adapter_path is "
     "toymlx-export's adapter (the run folder; mlx-lm's adapter folder with base)")),
    ("eval", "model: runs/x\nadapter_path: runs/x\n", ("mlx-lm's adapter_path is toymlx-eval's "
     "model (the run folder: its base with its adapter)")),
    ("eval", "model: runs/x\ntest_batches: 5\n", ("mlx-lm's test_batches is toymlx-eval's "
     "limit (examples: mlx-lm's batches x batch_size; its -1, every batch, is the "
     "default)")),
])
def test_an_mlx_lm_key_in_another_command_s_file_is_named_as_that_command_takes_it(
        tmp_path, capsys, command, text, hint):
    """`adapter_path` in a toymlx-export or toymlx-eval file was "toymlx's --runs-root and
    --run-id", the folder training writes, where these commands read the adapters from it."""
    from toymlx_cli.eval import main as eval_main
    from toymlx_cli.export import main as export_main

    p = tmp_path / "c.yaml"
    p.write_text(text)
    key = text.splitlines()[1].partition(":")[0]
    prog = f"toymlx-{command}"
    assert {"export": export_main, "eval": eval_main}[command](["-c", str(p)]) == 2
    assert error_line(capsys, prog) == (f"{prog}: error: {p}: key {key!r}: expected an option of "
                                        f"{prog}, found an unknown key; {hint}")


def test_file_key_error_names_the_key_a_flag_does_not_give_over_the_file():
    """The line of a later check on a file's option is told by the file's key (a path the line
    begins with kept after it); an option the command line gives over the file, or a line of
    no option, is left as it is."""
    from toymlx_cli.config_file import file_key_error, under_the_flags

    keys = {"--base": "base", "--lora.rank": "lora: {rank}", "--compile": "compile",
            "--lora.init-adapter": "lora.init_adapter"}
    assert file_key_error("m.gguf: --base: expected an existing GGUF file, found nothing at "
                          "that path", keys, "f.yaml") == (
        "f.yaml: key 'base': m.gguf: expected an existing GGUF file, found nothing at that path")
    assert file_key_error("--lora.rank: expected >= 1, found 0", keys, "f.yaml") == (
        "f.yaml: key 'lora: {rank}': expected >= 1, found 0")
    assert file_key_error("--steps: expected >= 1, found 0", keys, "f.yaml") == (
        "--steps: expected >= 1, found 0")
    assert file_key_error("out of memory", keys, "f.yaml") == "out of memory"
    assert under_the_flags(keys, ["--no-compile", "--lora.rank=2", "--lora.init_adapter",
                                  "x"]) == {"--base": "base"}


def test_a_run_folder_given_to_c_names_its_config_json(tmp_path, capsys):
    """`toymlx-train -c runs/x` (the run's settings, as the guide says of its config.json) read
    "expected a YAML or JSON file, found a directory"; now it names the run's config.json. Any
    other folder as before."""
    from toymlx_cli.train import main

    run = tmp_path / "x"
    run.mkdir()
    (run / "config.json").write_text('{"recipe": "vit-tiny", "config": {}}')
    assert main(["-c", str(run), "--run-id", "again"]) == 2
    assert error_line(capsys) == (f"toymlx-train: error: {run}: -c/--config: expected a YAML or "
                                  "JSON file, found a run folder; its options are -c "
                                  f"{run / 'config.json'}")
    assert main(["-c", str(tmp_path), "--run-id", "again"]) == 2
    assert error_line(capsys) == (f"toymlx-train: error: {tmp_path}: -c/--config: expected a "
                                  "YAML or JSON file, found a directory")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x"]
