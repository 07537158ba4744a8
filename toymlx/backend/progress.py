"""The progress bar of one pass over work that ends (an evaluation pass, tokenizing a file or a
split's examples): drawn on stderr only where that is a terminal (a log file or a pipe gets
none: tqdm's redraws would fill it), and gone once the pass is done, so that the lines a run
prints stay as they are. The training loop's own bar (`toymlx.training.trainer`) stays on
screen and has its own rules (rank 0, `--no-progress`)."""

from __future__ import annotations

import contextlib
import sys
from typing import Any

from tqdm import tqdm


def pass_bar(total: int, desc: str | None, unit: str, least: int = 2, **kwargs: Any) -> Any:
    """A context manager giving a tqdm bar of `total` `unit`s named `desc`, or None where none is
    drawn: `desc` None (the caller shows no progress), `total` under `least` (too little work
    to show), or stderr not a terminal. `kwargs` go to tqdm (`unit_scale=True` for bytes)."""
    if desc is None or total < least or not sys.stderr.isatty():
        return contextlib.nullcontext(None)
    return tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True, leave=False,
                file=sys.stderr, **kwargs)
