"""`--version` on every console script: toymlx's version (written once), MLX's, and the BLAS
MLX's CPU matmuls call (its kernel set)."""

from __future__ import annotations

import importlib

import mlx.core as mx
import pytest

import toymlx
from toymlx.backend.device import blas_summary

COMMANDS = ["train", "generate", "export", "eval", "sweep", "report", "launch", "classify"]


@pytest.mark.parametrize("name", COMMANDS)
def test_every_command_prints_its_version(name, capsys):
    main = importlib.import_module(f"toymlx_cli.{name}").main
    try:
        rc = main(["--version"])
    except SystemExit as e:  # argparse's version action exits
        rc = e.code
    assert rc == 0
    assert capsys.readouterr().out == \
        f"toymlx {toymlx.__version__} (mlx {mx.__version__}; BLAS {blas_summary()})\n"


def test_version_wins_over_a_recipe_and_launch_passes_it_on(capsys):
    from toymlx_cli.launch import main as launch
    from toymlx_cli.train import main as train

    assert train(["--recipe", "vit-tiny", "--version"]) == 0
    assert capsys.readouterr().out.startswith(f"toymlx {toymlx.__version__} (mlx ")
    # after `--` the flag belongs to the launched command: launch goes on to check -n
    assert launch(["-n", "0", "--", "toymlx-train", "--version"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "-n: expected >= 1 ranks, found 0" in err
