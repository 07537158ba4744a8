"""`--report-to tensorboard,wandb` (mlx-lm's flag): a run's events as scalars where people
watch training.

The reporters are sinks of the run's `EventLog` (`toymlx.bundle.events`): every event it writes
to events.jsonl is handed to them as written, so what TensorBoard and W&B show is events.jsonl's
numbers, not a second account of the run. `scalars` maps an event to (step, {tag: value}):

- step: `train/loss`, `train/lr`, `train/grad_norm`, `train/tokens_per_s`, ... (every number);
- eval: `val/loss`, `val/accuracy`, ...; the test pass (`--test`): `test/loss`, `test/perplexity`;
- checkpoint: `checkpoint/step`; export: `export/bytes`, ...; run_end: `run/final_loss`.

TensorBoard: event files in the run folder itself, so `tensorboard --logdir runs` lists each run
under its run id. A resume writes TensorBoard's restart marker (a SessionLog START at the first
step it trains), so the steps of the killed segment that the resume dropped from events.jsonl are
dropped from the curves too. W&B: one run named after the run id, its files under
`<run>/wandb`; offline (`wandb sync` uploads it later) unless WANDB_MODE says otherwise or a
W&B login exists (WANDB_API_KEY, or api.wandb.ai in ~/.netrc). A resume from step k rewinds
that W&B run to step k (W&B's `resume_from="ID?_step=k"`: the same run id, its history cut at
k, what follows logged by the resumed run); offline, the new segment records the rewind as its
branch point and `wandb sync` replays it. Where the W&B server refuses a rewind (a preview
feature), the resumed run goes to a new W&B run that names its parent and step (`fork_note`).
"""

from __future__ import annotations

import importlib.util
import math
import netrc
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

REPORTERS = {"tensorboard": "tensorboard", "wandb": "wandb"}
"""--report-to's names -> the toymlx extra that installs each (`pip install 'toymlx[NAME]'`)."""
_SKIP = frozenset({"step", "t", "final_step", "exit_code", "start_step"})
_PREFIX = {"step": "train", "checkpoint": "checkpoint", "export": "export", "run_end": "run"}


def parse_report_to(value: str | None) -> tuple[str, ...]:
    """--report-to's services, in order; ValueError naming the flag for an unknown name or one
    whose package is not installed (one line naming the extra)."""
    if not value:
        return ()
    names = [n.strip().lower() for n in value.split(",") if n.strip()]
    unknown = [n for n in names if n not in REPORTERS]
    if unknown:  # every name checked before any package, so a typo is named first
        raise ValueError(f"--report-to {value}: expected a comma list of "
                         f"{', '.join(REPORTERS)}, found {unknown[0]!r}")
    for n in names:
        if importlib.util.find_spec(n) is None:
            raise ValueError(f"--report-to {n}: the {n} package is not installed; install "
                             f"toymlx's {REPORTERS[n]} extra: pip install 'toymlx[{REPORTERS[n]}]'")
    return tuple(dict.fromkeys(names))


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def scalars(ev: dict) -> tuple[int, dict[str, float]] | None:
    """(step, {tag: value}) of an event for the reporters, None for one with no step or no
    number (run_start, resume)."""
    kind = ev.get("kind")
    step = ev.get("final_step") if kind == "run_end" else ev.get("step")
    if not isinstance(step, int) or isinstance(step, bool):
        return None
    if kind == "eval":
        split = "test" if ev.get("split") == "test" else "val"
        tags = {f"{split}/{k.removeprefix(split + '_')}": float(v) for k, v in ev.items()
                if k not in _SKIP and _number(v)}
    elif kind == "checkpoint":
        tags = {"checkpoint/step": float(step)}
    elif kind in _PREFIX:
        tags = {f"{_PREFIX[kind]}/{k}": float(v) for k, v in ev.items()
                if k not in _SKIP and _number(v)}
    else:
        return None
    return (step, tags) if tags else None


class TensorBoardReporter:
    """Scalars in a TensorBoard event file in the run folder (TensorBoard's own writer)."""

    def __init__(self, run_dir: Path):
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._pb, self._summary = event_pb2, summary_pb2
        self._writer = EventFileWriter(str(run_dir), flush_secs=10)

    def __call__(self, ev: dict) -> None:
        pb = self._pb
        if ev.get("kind") == "resume" and isinstance(ev.get("from_step"), int):
            # TensorBoard's restart marker: its readers drop what was logged from this step on
            self._writer.add_event(pb.Event(wall_time=time.time(), step=ev["from_step"] + 1,
                                            session_log=pb.SessionLog(
                                                status=pb.SessionLog.START)))
            return
        found = scalars(ev)
        if found is None:
            return
        step, tags = found
        values = [self._summary.Summary.Value(tag=k, simple_value=v) for k, v in tags.items()]
        self._writer.add_event(pb.Event(wall_time=time.time(), step=step,
                                        summary=self._summary.Summary(value=values)))
        if ev.get("kind") in ("checkpoint", "run_end"):
            self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def wandb_mode() -> str:
    """WANDB_MODE if set, else online with a W&B login (WANDB_API_KEY, or api.wandb.ai in
    ~/.netrc) and offline without one."""
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    try:
        return "online" if netrc.netrc().authenticators("api.wandb.ai") else "offline"
    except (OSError, netrc.NetrcParseError):
        return "offline"


def wandb_id(run_dir: Path) -> str:
    """The W&B run id of a toymlx run: its run id, in the letters W&B takes."""
    return re.sub(r"[^A-Za-z0-9_-]", "-", Path(run_dir).name)[:64]


class WandbReporter:
    """One W&B run named after the run id, its files under `<run>/wandb` (offline without a
    login: `wandb_mode`); run_start's config becomes the W&B run's config. A resume (its first
    event) rewinds that W&B run to the step resumed from."""

    def __init__(self, run_dir: Path):
        self.run_dir, self._run = run_dir, None

    def _start(self, ev: dict) -> None:
        import wandb

        mode, name, wid = wandb_mode(), self.run_dir.name, wandb_id(self.run_dir)
        k = ev.get("from_step") if ev.get("kind") == "resume" else None
        common = {"project": os.environ.get("WANDB_PROJECT", "toymlx"), "name": name,
                  "mode": mode, "dir": str(self.run_dir),
                  "settings": wandb.Settings(silent=True, console="off")}
        if not isinstance(k, int) or isinstance(k, bool):
            self._run = wandb.init(id=wid, resume="allow", config=ev.get("config") or {},
                                   **common)
        else:
            try:  # the steps after k that the resume dropped leave the W&B run's history
                self._run = wandb.init(resume_from=f"{wid}?_step={k}", **common)
            except Exception as e:  # noqa: BLE001 -- a server without W&B's rewind preview
                self._run = wandb.init(id=f"{wid}-from-{k}-{int(time.time())}", group=name,
                                       config={"toymlx_parent": wid, "toymlx_from_step": k},
                                       **common)
                print(fork_note(name, wid, k, self._run.id, e), file=sys.stderr)
        if mode == "offline":
            print(f"toymlx: W&B run {name} is offline in {self.run_dir / 'wandb'} (no W&B login); "
                  f"upload it with: wandb sync {self.run_dir / 'wandb'}/offline-run-*"
                  + (" (in this order: a resume's segment rewinds the run to its step)"
                     if k is not None else ""), file=sys.stderr)

    def __call__(self, ev: dict) -> None:
        if self._run is None:
            self._start(ev)
        found = scalars(ev)
        if found is not None:
            self._run.log(found[1], step=found[0])
        if ev.get("kind") == "run_end":
            self.close(int(ev.get("exit_code") or 0))

    def close(self, exit_code: int = 0) -> None:
        if self._run is not None:
            self._run.finish(exit_code=exit_code)
            self._run = None


def fork_note(name: str, wid: str, k: int, new_id: str, why: Exception) -> str:
    """The line saying that a resume went to a new W&B run, and why."""
    return (f"toymlx: W&B refused to rewind run {wid} to step {k} for the resume of {name} "
            f"({type(why).__name__}: {' '.join(str(why).split())[:200]}); the resumed run logs "
            f"to W&B run {new_id} (group {name}, config toymlx_parent {wid}, toymlx_from_step "
            f"{k}), so {wid}'s steps after {k} are not the resumed run's")


def open_reporters(report_to: str | None, run_dir: Path) -> list[Any]:
    """The sinks --report-to names, writing into the run folder `run_dir`."""
    kinds = {"tensorboard": TensorBoardReporter, "wandb": WandbReporter}
    return [kinds[n](Path(run_dir)) for n in parse_report_to(report_to)]
