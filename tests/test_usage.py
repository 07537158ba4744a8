"""A command line tyro refuses (cli/usage.py): one line `PROG: error: FLAG: expected ..., got ...`
on stderr and exit status 2, for every toymlx command that parses with tyro; `--help` is still
tyro's full help."""

from __future__ import annotations

import pytest
from toymlx_cli.train import main

LORA = "toymlx-train --recipe lora"


def only_line(capsys) -> str:
    """The whole of stderr, which must be one line (no box, no traceback)."""
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.endswith("\n"), err
    return err[:-1]


@pytest.mark.parametrize("args,want", [
    # a mistyped value
    (["--steps", "abc"], "--steps: expected an integer, got 'abc'"),
    (["--steps=abc"], "--steps: expected an integer, got 'abc'"),
    (["--steps", "1", "--steps", "x"], "--steps: expected an integer, got 'x'"),  # tyro: last
    (["--lr", "1e-4x"], "--lr: expected a number, got '1e-4x'"),
    (["--lora.layers", "q"], "--lora.layers: expected an integer or None, got 'q'"),
    # an unknown flag, with the flag tyro would suggest
    (["--stpes", "3"], (f"--stpes: expected an option of {LORA}, got an unknown one; did you "
                        "mean --steps?")),
    (["--rank", "4"], (f"--rank: expected an option of {LORA}, got an unknown one; did you mean "
                       "--lora.rank?")),
    (["--stpes=3", "--lrr", "1"], (f"--stpes: expected an option of {LORA}, got an unknown one; "
                                   f"did you mean --steps?; --lrr: expected an option of {LORA}, "
                                   "got an unknown one; did you mean --lr?")),
    (["--zzzzzz"], f"--zzzzzz: expected an option of {LORA}, got an unknown one"),
    (["stray"], f"'stray': expected an option of {LORA}, got a value no option takes"),
    (["--lora.targets", "q", "k"], (f"'k': expected an option of {LORA}, got a value no option "
                                    "takes (after --lora.targets q)")),
    # a missing value
    (["--steps"], "--steps: expected an integer after it, got nothing"),
    (["--steps", "--lr", "1e-4"], "--steps: expected an integer after it, got the option --lr"),
    # a bad choice of a Literal
    (["--fine-tune-type", "fulll"], ("--fine-tune-type: expected one of lora, dora, full, got "
                                     "'fulll'")),
    (["--optimizer", "adamx"], ("--optimizer: expected one of adamw, adam, sgd, adafactor, "
                                "muon, got 'adamx'")),
    (["--data.train-turns", "first"], ("--data.train-turns: expected one of assistant, last, "
                                       "got 'first'")),
    (["--weight-decay-scope", "vectors"], ("--weight-decay-scope: expected one of matrices, "
                                           "all, got 'vectors'")),
    # a bad bool: a flag given a value, either spelling
    (["--compile=maybe"], ("--compile: expected no value (a flag; --no-compile sets it false), "
                           "got 'maybe'")),
    (["--compile", "maybe"], ("--compile: expected no value (a flag; --no-compile sets it "
                              "false), got 'maybe'")),
    (["--no-compile=yes"], ("--no-compile: expected no value (a flag; --compile sets it true), "
                            "got 'yes'")),
])
def test_a_refused_lora_command_line_is_one_line(capsys, tmp_path, monkeypatch, args, want):
    monkeypatch.chdir(tmp_path)  # ./runs, the default --runs-root
    assert main(["--recipe", "lora", *args]) == 2
    assert only_line(capsys) == f"toymlx-train: error: {want}"
    assert list(tmp_path.iterdir()) == []  # refused before any run folder


def test_a_bad_bool_value_names_its_choices(capsys, tmp_path):
    """A `bool | None` option takes True, False or None as a value."""
    assert main(["--recipe", "vit-tiny", "--runs-root", str(tmp_path),
                 "--data.augment", "maybe"]) == 2
    assert only_line(capsys) == ("toymlx-train: error: --data.augment: expected one of True, "
                                 "False, None, got 'maybe'")


def test_help_is_still_tyros_full_help(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--recipe", "lora", "--help"])
    assert e.value.code in (0, None)
    out = capsys.readouterr().out
    assert f"usage: {LORA}" in out
    for flag in ("--steps INT", "--fine-tune-type {lora,dora,full}", "--lora.rank INT",
                 "--compile, --no-compile"):
        assert flag in out, flag
    assert "Optimizer steps to train for" in out  # the field docstrings, as help


def test_mlx_lm_s_ways_are_options_with_help(capsys):
    """What an mlx-lm config file sets for mlx-lm's meaning is an option of its own, with its
    choices, default and docstring in --help: the turns a conversation trains, what AdamW
    decays, the validation before step 1."""
    with pytest.raises(SystemExit):
        main(["--recipe", "lora", "--help"])
    out = " ".join(capsys.readouterr().out.replace("│", " ").split())
    for text in (("--data.train-turns {assistant,last} With --data.mask-prompt, which messages "
                  "of a `messages` record train: assistant: every assistant turn; last: the "
                  "last message only"),
                 "(default: assistant)",
                 ("--weight-decay-scope {matrices,all} What AdamW's --weight-decay falls on: "
                  "matrices (not norms, biases or DoRA magnitudes) or all (every trained "
                  "array, as MLX's AdamW and mlx-lm's adamw decay). (default: matrices)"),
                 ("--eval-at-start, --no-eval-at-start Also validate before the first step: "
                  "the untrained model's figures, as the step-0 eval event (mlx-lm's "
                  "iteration-1 val loss); a resume past step 0 does not repeat it. "
                  "(default: False)")):
        assert text in out, text


@pytest.mark.parametrize("module,args,want", [
    ("export", [], "toymlx-export: error: --out: expected a value (it is required), got none"),
    ("eval", ["--model", "m", "--batch-size", "x"],
     "toymlx-eval: error: --batch-size: expected an integer, got 'x'"),
    ("eval", ["--data-path"],
     "toymlx-eval: error: --data-path: expected a value or None after it, got nothing"),
    ("generate", ["--model", "m", "--temp", "0.5"],
     ("toymlx-generate: error: --temp: expected an option of toymlx-generate, got an unknown "
     "one; did you mean --temperature?")),
    # llama.cpp's short flags: named with toymlx's, not "--model ... is required"
    ("generate", ["-m", "m.gguf", "-p", "hi", "-n", "3"],
     ("toymlx-generate: error: -m: expected an option of toymlx-generate, got an unknown one; "
      "did you mean --model?; -p: expected an option of toymlx-generate, got an unknown one; "
      "did you mean --prompt?; -n: expected an option of toymlx-generate, got an unknown one; "
      "did you mean --max-tokens?")),
    ("generate", ["--model", "m", "--n-predict", "3"],
     ("toymlx-generate: error: --n-predict: expected an option of toymlx-generate, got an "
      "unknown one; did you mean --max-tokens?")),
    ("generate", ["--prompt", "hi"],
     "toymlx-generate: error: --model: expected a value (it is required), got none"),
    ("classify", ["--model", "m", "--top-k", "three"],
     "toymlx-classify: error: --top-k: expected an integer, got 'three'"),
])
def test_the_forward_only_commands_refuse_in_one_line(capsys, module, args, want):
    import importlib

    assert importlib.import_module(f"toymlx_cli.{module}").main(args) == 2
    assert only_line(capsys) == want


def test_a_sweep_names_the_run_whose_options_are_refused(capsys, tmp_path):
    from toymlx_cli.sweep import main as sweep_main

    assert sweep_main(["--recipe", "lora", "--runs-root", str(tmp_path), "--grid",
                       "lr=1e-4,3e-4", "--", "--stpes", "3"]) == 2
    line = only_line(capsys)
    assert line.startswith("toymlx-sweep: error: run ")
    assert line.endswith(f": --stpes: expected an option of {LORA}, got an unknown one; did "
                         "you mean --steps?; no run was started")


@pytest.mark.parametrize("args,want", [
    (["--recipe", "from-scratch", "--run-id", ""],
     ("--run-id: expected a non-empty folder name, got an empty string; omit --run-id for its "
      "default (<timestamp>-<recipe>)")),
    (["--recipe", "from-scratch", "--runs-root="],
     ("--runs-root: expected a non-empty path, got an empty string; omit --runs-root for its "
     "default (runs)")),
    (["--recipe", "from-scratch", "--data.path", ""],
     ("--data.path: expected a non-empty path, got an empty string; omit --data.path for its "
     "default")),
    (["--recipe", "lora", "--lora.targets", ""],
     ("--lora.targets: expected a non-empty list of layer names, got an empty string; omit "
      "--lora.targets for its default (q)")),
    (["--resume", ""], "--resume: expected a non-empty run folder (runs/<id>), got an empty string"),
    (["--recipe", "from-scratch", "--resume="],
     "--resume: expected a non-empty run folder (runs/<id>), got an empty string"),
])
def test_an_empty_text_option_is_refused_not_a_default(capsys, tmp_path, monkeypatch, args, want):
    """An empty --run-id started a run under the default id, an empty --data.path read the
    current folder, an empty --resume started a new run: each is refused in one line."""
    monkeypatch.chdir(tmp_path)
    assert main(args) == 2
    assert only_line(capsys) == f"toymlx-train: error: {want}"
    assert list(tmp_path.iterdir()) == []


def test_an_empty_text_option_from_a_config_file_is_refused(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.yaml").write_text("run_id: ''\n")
    assert main(["--recipe", "from-scratch", "-c", "c.yaml"]) == 2
    assert only_line(capsys).startswith("toymlx-train: error: --run-id: expected a non-empty "
                                        "folder name, got an empty string")
    assert [p.name for p in tmp_path.iterdir()] == ["c.yaml"]


@pytest.mark.parametrize("module,args,want", [
    ("export", ["--model", "m", "--out", ""], ("--out: expected a non-empty path, got an empty "
                                              "string")),
    ("eval", ["--model", ""], "--model: expected a non-empty path, got an empty string"),
    ("eval", ["--model", "m", "--plot="], ("--plot: expected a non-empty path, got an empty "
                                           "string; omit --plot for its default")),
])
def test_the_forward_only_commands_refuse_an_empty_path(capsys, module, args, want):
    import importlib

    assert importlib.import_module(f"toymlx_cli.{module}").main(args) == 2
    assert only_line(capsys) == f"toymlx-{module}: error: {want}"


def test_an_empty_prompt_is_still_taken():
    """An option whose own default is the empty string (toymlx-generate's --prompt) keeps it."""
    from toymlx_cli.generate import Args
    from toymlx_cli.usage import parse_options

    assert parse_options(Args, ["--model", "m", "--prompt", ""], "toymlx-generate").prompt == ""
