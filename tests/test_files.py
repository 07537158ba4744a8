"""What a path holds, said before anything opens it (`toymlx.backend.files`)."""

from __future__ import annotations

import os

import pytest
from cli_errors import error_line

from toymlx.backend.files import nothing_there


def test_nothing_there_names_a_dangling_link_a_file_as_folder_and_an_unexpanded_tilde(
        tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "plain").write_text("x")
    (tmp_path / "link.gguf").symlink_to("gone.gguf")
    assert nothing_there("missing.gguf") == "nothing at that path"
    assert nothing_there("plain/m.gguf") == "nothing at that path (plain is a file, not a folder)"
    assert nothing_there("link.gguf") == ("nothing at that path (a link to gone.gguf, which is "
                                          "missing)")
    assert nothing_there("~/m.gguf") == (
        "nothing at that path (~ is expanded only by the shell, not inside quotes, after "
        f"--opt= or in a -c file: write {os.path.expanduser('~/m.gguf')})")


@pytest.mark.parametrize("prog,argv,flag", [
    ("eval", ["--model"], "--model: expected a GGUF file or a run directory"),
    ("train", ["--recipe", "from-scratch", "--data.path"], "expected a UTF-8 text file"),
    ("train", ["--recipe", "vit-tiny", "--data.path"],
     "expected a folder of images or a data set file"),
    ("train", ["--recipe", "lora", "--base"], "--base: expected an existing GGUF file"),
])
def test_a_path_given_with_a_tilde_the_shell_left_is_named_with_its_expansion(
        tmp_path, capsys, monkeypatch, prog, argv, flag):
    """`--base='~/m.gguf'`, or `base: ~/m.gguf` in a -c file, reached the command as typed, and
    its "found nothing" (or "no such file or directory") gave no reason; it names the fix now."""
    import importlib

    monkeypatch.chdir(tmp_path)
    main = importlib.import_module(f"toymlx_cli.{prog}").main
    assert main([*argv, "~/toymlx-test-missing", "--runs-root", "runs"]
                if prog == "train" else [*argv, "~/toymlx-test-missing"]) == 2
    assert error_line(capsys, f"toymlx-{prog}") == (
        f"toymlx-{prog}: error: ~/toymlx-test-missing: {flag}, found nothing at that path (~ is "
        "expanded only by the shell, not inside quotes, after --opt= or in a -c file: write "
        f"{os.path.expanduser('~/toymlx-test-missing')})")
    assert not list(tmp_path.glob("runs/*"))  # no run folder begun
