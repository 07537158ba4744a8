"""What the command-line tools print when they refuse: one error line, never a traceback."""

from __future__ import annotations


def error_line(capsys, prog: str = "toymlx-train") -> str:
    """The one `<prog>: error:` line printed since the last call (and nothing traceback-like)."""
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.startswith(f"{prog}: error:")]
    assert len(lines) == 1, err
    return lines[0]
