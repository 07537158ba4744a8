"""Ctrl-C while a console command imports (toymlx_cli.entry): one line and exit status 130."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from toymlx_cli.entry import COMMANDS

ROOT = Path(__file__).resolve().parent.parent

CTRL_C_ON_IMPORT = """
import importlib.abc, os, signal, sys

class CtrlC(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "mlx.core":  # Ctrl-C while the command imports MLX
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)
        return None

sys.meta_path.insert(0, CtrlC())
"""
"""A sitecustomize that sends this process SIGINT as it starts importing mlx.core: Python runs
the handler at its next bytecode, inside that import, every time."""

CONSOLE_SCRIPT = """import re
import sys
from toymlx_cli.{name} import main
if __name__ == '__main__':
    sys.argv[0] = re.sub(r'(-script\\.pyw|\\.exe)?$', '', sys.argv[0])
    sys.exit(main())
"""
"""The console script pip writes for `toymlx-NAME = toymlx_cli.NAME:main`."""


def _interrupted_on_import(tmp_path: Path, argv: list[str]) -> subprocess.CompletedProcess:
    """`argv` run with SIGINT sent while it imports mlx.core (`CTRL_C_ON_IMPORT`)."""
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(CTRL_C_ON_IMPORT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(site), *filter(None, [os.environ.get("PYTHONPATH")])]))
    # Python's own SIGINT handler in the child, as in a terminal (a test runner may ignore it)
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120,
                          check=False,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


@pytest.mark.parametrize("name", COMMANDS)
def test_ctrl_c_while_a_command_imports_is_one_line_and_exit_130(tmp_path, name):
    """Ctrl-C in a command's first half-second, while it imported MLX, numpy and tyro, was a
    KeyboardInterrupt traceback (killed by SIGINT: exit status -2); now every command says so
    in one line and exits 130, as after start-up."""
    p = _interrupted_on_import(tmp_path, [sys.executable, "-m", f"toymlx_cli.{name}",
                                          "--help"])
    assert (p.returncode, p.stderr) == (
        130, f"\ntoymlx-{name}: interrupted while starting; nothing was done\n"), p.stderr
    assert p.stdout == ""  # its --help never ran


def test_ctrl_c_while_a_console_script_imports_is_one_line_and_exit_130(tmp_path):
    """The same for the console script pip writes (`toymlx-train`), which imports the command
    before it calls its main."""
    script = tmp_path / "bin" / "toymlx-train"
    script.parent.mkdir()
    script.write_text(CONSOLE_SCRIPT.format(name="train"))
    p = _interrupted_on_import(tmp_path, [sys.executable, str(script), "--recipe", "vit-tiny",
                                          "--runs-root", str(tmp_path / "runs")])
    assert (p.returncode, p.stderr) == (
        130, "\ntoymlx-train: interrupted while starting; nothing was done\n"), p.stderr
    assert not (tmp_path / "runs").exists()


def test_an_import_of_the_commands_keeps_ctrl_c_as_python_gives_it():
    """A script or a test that imports toymlx_cli (not a command) keeps its own Ctrl-C."""
    import toymlx_cli  # noqa: F401

    assert signal.getsignal(signal.SIGINT) in (signal.default_int_handler, signal.SIG_IGN,
                                               signal.SIG_DFL)


def test_the_commands_are_pyprojects_console_scripts():
    """`COMMANDS` (which processes hold a Ctrl-C while they import) names every console
    script, each `toymlx-NAME = toymlx_cli.NAME:main`."""
    text = (ROOT / "pyproject.toml").read_text()
    section = text.split("[project.scripts]", 1)[1].split("\n[", 1)[0]
    scripts = dict(re.findall(r'^(\S+) = "([^"]+)"$', section, re.MULTILINE))
    assert scripts == {f"toymlx-{c}": f"toymlx_cli.{c}:main" for c in COMMANDS}
