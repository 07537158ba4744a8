"""toymlx's warnings (`toymlx.backend.notice`): one line on stderr, `toymlx: warning: ...`, and
still Python warnings that filters hide, `-W error` raises and recorders see."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest

from toymlx.backend import notice

_BAD_BLAS = ("TOYMLX_BLAS: expected 'openblas', 'reference' or the path of an LP64 BLAS library, "
             "found '/nonexistent', which could not be loaded (/nonexistent: cannot open shared "
             "object file: No such file or directory); MLX's CPU matmuls use its reference BLAS "
             "(about 30x slower)")


def _import_toymlx(tmp_path, *python_args: str,
                   script: bool = False) -> subprocess.CompletedProcess:
    """`python [ARGS] -c 'import toymlx'` (or a script file of that line) in a fresh process
    whose TOYMLX_BLAS cannot load, the way a user meets the BLAS warning."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONWARNINGS", "OPENBLAS_CORETYPE", "TOYMLX_RESTARTED")}
    env["TOYMLX_BLAS"] = "/nonexistent"
    if script:
        (tmp_path / "imp.py").write_text("import toymlx\n")
        code = [str(tmp_path / "imp.py")]
    else:
        code = ["-c", "import toymlx"]
    return subprocess.run([sys.executable, *python_args, *code], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.parametrize("script", [False, True])
def test_the_blas_warning_is_one_line(tmp_path, script):
    """Printed in Python's warnings format it read `<string>:1: UserWarning: toymlx: ...`,
    and from a script `/path/imp.py:1: UserWarning: toymlx: ...` then `  import toymlx`: two
    lines, unlike every other toymlx message."""
    p = _import_toymlx(tmp_path, script=script)
    assert p.returncode == 0
    assert p.stderr == f"toymlx: warning: {_BAD_BLAS}\n"


def test_the_blas_warning_is_still_a_warning_filters_act_on(tmp_path):
    """`-W error` raises it (the import fails, naming it), `-W ignore::UserWarning` and a
    filter on its message hide it."""
    p = _import_toymlx(tmp_path, "-W", "error")
    assert p.returncode == 1
    assert p.stderr.splitlines()[-1] == f"toymlx.backend.notice.ToymlxWarning: {_BAD_BLAS}"
    for flag in ("ignore::UserWarning", "ignore:TOYMLX_BLAS"):
        p = _import_toymlx(tmp_path, "-W", flag)
        assert (p.returncode, p.stderr) == (0, ""), flag


def test_a_recorder_gets_the_warning_and_other_warnings_keep_their_format():
    before = warnings.formatwarning
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        notice.warn("disk nearly full")
    assert [(w.category, str(w.message)) for w in caught] == [(notice.ToymlxWarning,
                                                                "disk nearly full")]
    assert caught[0].filename == __file__  # stacklevel=1: the caller's line
    assert warnings.formatwarning is before  # replaced only while it warned
    assert issubclass(notice.ToymlxWarning, UserWarning)
    assert warnings.formatwarning("x", UserWarning, "f.py", 3) == "f.py:3: UserWarning: x\n"
