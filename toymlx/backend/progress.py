"""The progress bar of one pass over work that ends (an evaluation pass, tokenizing a file or a
split's examples): drawn on stderr only where that is a terminal (a log file or a pipe gets
none: tqdm's redraws would fill it), and gone once the pass is done, so that the lines a run
prints stay as they are. The training loop's own bar (`toymlx.training.trainer`) stays on
screen and has its own rules (rank 0, `--no-progress`); `draws_bars` decides for both."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any

from tqdm import tqdm


def draws_bars() -> bool:
    """Whether a progress bar shows on stderr: a terminal that reports a width. tqdm draws
    nothing at all on one of 0 columns (a pty nobody gave a size, as `script` run from a job
    makes), so a run there sat silent between its report lines; such a terminal gets what a log
    gets instead (the report lines, and a line for each slow step between them)."""
    if not sys.stderr.isatty():
        return False
    try:
        return os.get_terminal_size(sys.stderr.fileno()).columns > 0
    except (AttributeError, OSError):  # a stand-in stream with no descriptor: taken at its word
        return True


def pass_bar(total: int, desc: str | None, unit: str, least: int = 2, **kwargs: Any) -> Any:
    """A context manager giving a tqdm bar of `total` `unit`s named `desc`, or None where none is
    drawn: `desc` None (the caller shows no progress), `total` under `least` (too little work
    to show), or stderr not a terminal that draws one (`draws_bars`). `kwargs` go to tqdm
    (`unit_scale=True` for bytes)."""
    if desc is None or total < least or not draws_bars():
        return contextlib.nullcontext(None)
    return tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True, leave=False,
                file=sys.stderr, **kwargs)
