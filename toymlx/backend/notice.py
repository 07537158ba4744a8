"""toymlx's warnings: Python warnings (so `python -W error`, `-W ignore::UserWarning`,
`warnings.catch_warnings()` and `pytest.warns` act on them) that Python's own printer shows as
one line, `toymlx: warning: <message>`, as toymlx prints every other message, not as
`path:line: UserWarning: ...` followed by the source line that imported toymlx."""

from __future__ import annotations

import warnings

PREFIX = "toymlx: warning: "
"""How a shown toymlx warning starts on stderr."""


class ToymlxWarning(UserWarning):
    """A warning of toymlx's. A UserWarning: the BLAS warning comes while `import toymlx` runs,
    before this class can be named in a filter, so filters on UserWarning or on the message
    are the ones that reach it (`-W error::UserWarning`, `-W "ignore:TOYMLX_BLAS"`)."""


def warn(message: str, stacklevel: int = 1) -> None:
    """Warn with `message` (one line, without the `toymlx:` prefix) as a `ToymlxWarning`:
    Python's filters decide whether it is shown, hidden or raised; shown by Python's printer,
    it is the one line `PREFIX + message`. `stacklevel` counts from the caller, as for
    `warnings.warn`. The printer's format is replaced only for this call, and only for
    toymlx's warnings: a `showwarning` someone installed (pytest, `logging.captureWarnings`,
    `catch_warnings(record=True)`) still gets the warning itself."""
    previous = warnings.formatwarning

    def one_line(msg: Warning | str, category: type[Warning], filename: str, lineno: int,
                 line: str | None = None) -> str:
        if issubclass(category, ToymlxWarning):
            return f"{PREFIX}{msg}\n"
        return previous(msg, category, filename, lineno, line)

    warnings.formatwarning = one_line
    try:
        warnings.warn(message, ToymlxWarning, stacklevel=stacklevel + 1)
    finally:
        warnings.formatwarning = previous
