"""Where a resumed run continues (`Resume`, planned by `toymlx.runner.bundle.Bundle`); the
command to go on from when a checkpoint cannot be used is `toymlx.bundle.checkpoint.intact_hint`."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Resume:
    """Where a resumed run continues, and what cutting its bundle back to there found."""

    step: int
    """The checkpoint's step (0: start over from the saved configuration)."""
    checkpoint: Path | None
    state: dict[str, Any] = field(default_factory=dict, repr=False)
    """The checkpoint's verified optimizer state arrays."""
    steps_before: int = 0
    """The run's total steps before this resume."""
    note: str | None = None
    """What the resume says before its first step, and its `resume` event records (`add_note`):
    why this checkpoint and not the one `latest` names (it was missing or dangling), what it
    finishes or sets aside, how an older run's data is read."""
    dropped: int = 0
    damaged: list[int] = field(default_factory=list)
    """The garbled lines (numbers as they stood) its cut moved out of events.jsonl
    (`events.Cut.damaged`): the resume event records them (`events.DAMAGED_KEY`)."""
    previous_end: str = "torn"
    t: float = 0.0
    kept: list[dict] = field(default_factory=list, repr=False)
    """The events the bundle keeps (cut back to `step`)."""
    set_aside: list[int] = field(default_factory=list)
    exports_aside: dict[str, str] = field(default_factory=dict)
    """The recipe's exports of other steps renamed in the run folder, {old name: new name}
    (`Bundle.rewind`): the resume event records them."""
    cut_record: Path | None = None
    """The record of the cut-back that made this resume's bundle (`checkpoint.REWIND`): it stays
    until the resume event holds what the cut did, so a kill before that finishes the same cut
    again with the same account; the loop removes it once the event is written."""
    moved: dict[str, dict[str, Any]] = field(default_factory=dict)
    """The inputs read from another place than config.json records (`Bundle.moved`): the resume
    event records them (`inputs.MOVED_KEY`)."""
    data_fixed: dict[str, dict[str, Any]] = field(default_factory=dict)
    """The data changed since the run started taken as the fix of a data error (`Bundle.
    check_data`), {option: fingerprint}: the resume event records them
    (`inputs.DATA_FIXED_KEY`)."""

    def add_note(self, note: str) -> None:
        """Add `note` to what the resume says (`note`: one line, the notes joined by "; ")."""
        self.note = f"{self.note}; {note}" if self.note else note

    @property
    def has_start(self) -> bool:
        """Whether the kept events hold the run's run_start."""
        return any(e["kind"] == "run_start" for e in self.kept)
