"""`--report-to tensorboard,wandb` (mlx-lm's flag): a run's events as scalars where people
watch training.

The reporters are sinks of the run's `EventLog` (`toymlx.bundle.events`): every event it writes
to events.jsonl is handed to them as written, so what TensorBoard and W&B show is events.jsonl's
numbers, not a second account of the run. `scalars` maps an event to (step, {tag: value}):

- step: `train/loss`, `train/lr`, `train/grad_norm`, `train/tokens_per_s`, ... (every number);
- eval: `val/loss`, `val/accuracy`, ...; the test pass (`--test`): `test/loss`, `test/perplexity`;
- checkpoint: `checkpoint/step`; export: `export/bytes`, ...; run_end: `run/final_loss`, ...
  (at the final step in TensorBoard; in W&B, the run's summary rather than its history).

TensorBoard: event files in the run folder itself, so `tensorboard --logdir runs` lists each run
under its run id, with run_start's config as text (tag `config`, at step 0). A resume from step
k writes TensorBoard's restart marker (a SessionLog START at k) and then what events.jsonl keeps
at k again, so the steps of the stopped segment that the resume dropped from events.jsonl,
its run_end at k included, are dropped from the curves too.

W&B: one run named after the run id (its W&B id: `wandb_id`, the same across resumes, new for an
--overwrite; a sweep's runs grouped by sweep id) in project --wandb-project (else WANDB_PROJECT,
else toymlx), its files under `<run>/wandb` (WANDB_DIR is not used: a note says so); offline
(`wandb sync` uploads it later) unless WANDB_MODE says otherwise or a W&B login exists (WANDB_API_KEY, or api.wandb.ai in ~/.netrc). A resume from step k rewinds
that W&B run to step k (W&B's `resume_from="ID?_step=k"`: the same run id, its history cut at
k, what follows logged by the resumed run, with the run's config again); offline, the new
segment records the rewind as its branch point and `wandb sync` replays it. Where the W&B server refuses a rewind (a preview
feature), the resumed run goes to a new W&B run that names its parent and step (`fork_note`).
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import json
import math
import netrc
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

from toymlx.bundle.events import iter_events, run_start, stopped_untrained

REPORTERS = {"tensorboard": "tensorboard", "wandb": "wandb"}
"""--report-to's names -> the toymlx extra that installs each (`pip install 'toymlx[NAME]'`)."""
NOTHING_TRAINED = "nothing-trained"
"""The tag of a new run's W&B run where the run was stopped before its first step: toymlx
removes the run's folder (offline, the W&B run's files with it); online, the W&B run stays on
the server, finished with the run's exit code, this tag telling it from a run that trained."""
_SKIP = frozenset({"step", "t", "final_step", "exit_code", "start_step"})
_PREFIX = {"step": "train", "checkpoint": "checkpoint", "export": "export", "run_end": "run"}


_MODULES = {"tensorboard": "tensorboard.plugins.text.summary_v2", "wandb": "wandb"}
"""The module each reporter imports: imported when the flag is read, so a package that is there
but does not import (a broken protobuf) is one line before the run folder is made."""


ABBREVIATIONS = {"tb": "tensorboard", "wb": "wandb", "wnb": "wandb"}
"""Short names people type for the services (not taken: the hint names the full one)."""


def report_names(value: str | None, where: str | None = None) -> tuple[str, ...]:
    """--report-to's services, in order, by name alone (no package looked for); `none` (HF
    Trainer's) is none and `all` is every one. ValueError naming the flag (or `where`, a config
    file's key: mlx-lm's report_to is read by this same parser) for an unknown name (with the
    close one, or the full name of an abbreviation)."""
    if not value:
        return ()
    names = [n.strip().lower() for n in value.split(",") if n.strip()]
    if names in (["none"], ["all"]):
        names = [] if names == ["none"] else list(REPORTERS)
    alone = [n for n in names if n in ("none", "all")]
    if alone:
        raise ValueError(f"{where or '--report-to ' + value}: {alone[0]} stands alone; expected "
                         f"{alone[0]} or a comma list of {', '.join(REPORTERS)}")
    unknown = [n for n in names if n not in REPORTERS]
    if unknown:  # every name checked before any package, so a typo is named first
        close = [ABBREVIATIONS[unknown[0]]] if unknown[0] in ABBREVIATIONS else (
            difflib.get_close_matches(unknown[0], [*REPORTERS, "none", "all"], n=1,
                                      cutoff=0.75))  # swanlab is not wandb
        raise ValueError(f"{where or '--report-to ' + value}: expected a comma list of "
                         f"{', '.join(REPORTERS)}, or all or none, found {unknown[0]!r}"
                         + (f" (did you mean {close[0]}?)" if close else ""))
    return tuple(dict.fromkeys(names))


def parse_report_to(value: str | None, where: str | None = None) -> tuple[str, ...]:
    """`report_names`, each service's package found and imported: else ValueError, one line
    naming the extra that installs it."""
    names = report_names(value, where)
    for n in names:
        extra = f"toymlx's {REPORTERS[n]} extra: pip install 'toymlx[{REPORTERS[n]}]'"
        if importlib.util.find_spec(n) is None:
            raise ValueError(f"{where or '--report-to ' + n}: the {n} package is not "
                             f"installed; install {extra}")
        try:
            importlib.import_module(_MODULES[n])
        except Exception as e:  # noqa: BLE001 -- any failure to import is the same advice
            raise ValueError(f"{where or '--report-to ' + n}: the {n} package does not import "
                             f"({type(e).__name__}: {' '.join(str(e).split())[:200]}); "
                             f"reinstall {extra}") from None
    return names


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


def _next_second(run_dir: Path) -> None:
    """Wait, where an event file in `run_dir` was made in this second, for the next: TensorBoard
    reads a folder's event files in the order of their names (`events.out.tfevents.SECONDS.HOST.
    PID.N`, N a count of the process's writers, not zero-padded), so a resume's file made in its
    run's second by the same process (`toymlx.train` in a loop, a test) could sort before the
    run's (N 10 before 9) and its restart marker be read first, the dropped steps kept."""
    made = [int(m.group(1)) for p in run_dir.glob("events.out.tfevents.*")
            if (m := re.match(r"events\.out\.tfevents\.(\d+)\.", p.name))]
    if made and max(made) == int(now := time.time()):
        time.sleep(math.floor(now) + 1 - now)


class TensorBoardReporter:
    """Scalars in a TensorBoard event file in the run folder (TensorBoard's own writer)."""

    def __init__(self, run_dir: Path):
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._pb, self._summary = event_pb2, summary_pb2
        self.run_dir = Path(run_dir)
        _next_second(self.run_dir)
        self._writer = EventFileWriter(str(run_dir), flush_secs=10)

    def __call__(self, ev: dict) -> None:
        pb = self._pb
        k = ev.get("from_step")
        if ev.get("kind") == "resume" and isinstance(k, int) and not isinstance(k, bool):
            # TensorBoard's restart marker: its readers drop what was logged from step k on,
            # the stopped segment's run_end at k included; what events.jsonl keeps at k (the
            # step, its eval and checkpoint) is written again after it
            self._writer.add_event(pb.Event(wall_time=time.time(), step=k,
                                            session_log=pb.SessionLog(
                                                status=pb.SessionLog.START)))
            for kept in iter_events(self.run_dir):
                if k == 0 and kept.get("kind") == "run_start" and isinstance(
                        kept.get("config"), dict):
                    self._config(kept["config"])  # at step 0: the marker dropped it
                if kept.get("kind") != "run_end" and kept.get("step") == k:
                    self._add(kept)
            return
        if ev.get("kind") == "run_start" and isinstance(ev.get("config"), dict):
            self._config(ev["config"])
        self._add(ev)

    def _config(self, config: dict) -> None:
        """run_start's config as TensorBoard text (tag `config`, its TEXT tab), as HF Trainer
        writes its args: a JSON block, at step 0."""
        from tensorboard.plugins.text.summary_v2 import text_pb

        text = "```json\n" + json.dumps(config, indent=1, sort_keys=True, default=str) + "\n```"
        self._writer.add_event(self._pb.Event(wall_time=time.time(), step=0,
                                              summary=text_pb("config", text)))

    def _add(self, ev: dict) -> None:
        found = scalars(ev)
        if found is None:
            return
        pb, (step, tags) = self._pb, found
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


def wandb_id(run_dir: Path, run_uid: str | None = None) -> str:
    """The W&B run id of a toymlx run: its run id, in the letters W&B takes, then the first 8
    hex digits of its run_uid, so that another run under the same id (--overwrite, the same
    grid in another sweep, another runs root) is a new W&B run, not a resume of the old one.
    A bundle whose W&B run was named before the run_uid part keeps that id (`wandb/` holds it):
    the run id's first 64 letters, where the new id keeps 55 before its run_uid part."""
    name = re.sub(r"[^A-Za-z0-9_-]", "-", Path(run_dir).name)
    legacy = name[:64]
    if run_uid is None or any((Path(run_dir) / "wandb").glob(f"*run-*_*-{legacy}")):
        return legacy
    return f"{name[:55]}-{run_uid[:8]}"


def wandb_group(run_dir: Path) -> str | None:
    """A sweep's id for the runs of a sweep (its folder holds sweep.json), so W&B groups its
    trials; None for a run of its own (WANDB_RUN_GROUP still applies)."""
    parent = Path(run_dir).resolve().parent
    return parent.name if (parent / "sweep.json").is_file() else None


def online_wandb(run_dir: Path) -> bool:
    """Whether the run folder holds a W&B run made online (W&B's `wandb/run-*` folders; an
    offline run's are `offline-run-*`): the W&B server keeps it when the folder goes."""
    return any((Path(run_dir) / "wandb").glob("run-*"))


def offline_wandb(run_dir: Path) -> bool:
    """Whether the run folder holds an offline W&B run (`wandb/offline-run-*`, the files the
    start's `wandb sync` line names): nothing of it is on a server, so it goes with the folder."""
    return any((Path(run_dir) / "wandb").glob("offline-run-*"))


WANDB_SYNCED = ".wandb.synced"
"""The suffix of the marker `wandb sync` leaves beside each `.wandb` file it uploaded
(`run-ID.wandb.synced`: wandb's own `_is_synced` in cli/beta_sync.py, which `wandb sync`
skips; `wandb clean` keeps a run without it unless --include-unsynced)."""


def unsynced_wandb(run_dir: Path) -> list[Path]:
    """The offline W&B runs in the run folder (`wandb/offline-run-*`, oldest first, the order
    `wandb sync` must upload a resume's segments in) with a `.wandb` file no `wandb sync`
    uploaded (no `WANDB_SYNCED` marker beside it): their files are the only copy of the run."""
    return sorted(p for p in (Path(run_dir) / "wandb").glob("offline-run-*")
                  if any(not f.with_suffix(WANDB_SYNCED).exists() for f in p.glob("*.wandb")))


class WandbReporter:
    """One W&B run named after the run id, its files under `<run>/wandb` (offline without a
    login: `wandb_mode`); run_start's config becomes the W&B run's config. A resume (its first
    event) rewinds that W&B run to the step resumed from, with the run's config again
    (`_resumed_config`)."""

    def __init__(self, run_dir: Path, run_uid: str | None = None, project: str | None = None):
        self.run_dir, self.run_uid, self._run = run_dir, run_uid, None
        self.resumed = False
        """The W&B run continues a resumed run (its first event a `resume`)."""
        self.project = project
        """--wandb-project (mlx-lm's project_name); None: WANDB_PROJECT, else toymlx."""

    def _start(self, ev: dict) -> None:
        import wandb

        mode, name = wandb_mode(), self.run_dir.name
        wid, group = wandb_id(self.run_dir, self.run_uid), wandb_group(self.run_dir)
        k = ev.get("from_step") if ev.get("kind") == "resume" else None
        self.resumed = ev.get("kind") == "resume"
        project = self.project or os.environ.get("WANDB_PROJECT") or "toymlx"
        common = {"project": project, "name": name,
                  "mode": mode, "dir": str(self.run_dir),
                  "settings": wandb.Settings(silent=True, console="off"),
                  **({"group": group} if group else {})}
        if not isinstance(k, int) or isinstance(k, bool):
            self._run = wandb.init(id=wid, resume="allow", config=ev.get("config") or {},
                                   **common)
        else:
            config = self._resumed_config(ev)
            try:  # the steps after k that the resume dropped leave the W&B run's history
                self._run = wandb.init(resume_from=f"{wid}?_step={k}", config=config,
                                       **common)
            except wandb.errors.Error as e:  # a server without W&B's rewind preview
                self._run = wandb.init(id=f"{wid}-from-{k}-{int(time.time())}",
                                       **{"group": name, **common},
                                       config={**config, "toymlx_parent": wid,
                                               "toymlx_from_step": k})
                print(fork_note(name, wid, k, self._run.id, e), file=sys.stderr)
        if os.environ.get("WANDB_DIR"):
            # a run folder holds all of its run (a copied or moved folder resumes its W&B run),
            # as mlx-lm's callback keeps W&B's files in its adapter path whatever WANDB_DIR says
            print(f"toymlx: WANDB_DIR={os.environ['WANDB_DIR']} is not used: W&B's files for "
                  f"{name} go in its run folder, {self.run_dir / 'wandb'}", file=sys.stderr)
        if mode == "offline":
            why = ("WANDB_MODE=offline" if os.environ.get("WANDB_MODE") else "no W&B login")
            print(f"toymlx: W&B run {name} is offline in {self.run_dir / 'wandb'} ({why}); "
                  f"upload it with: wandb sync {self.run_dir / 'wandb'}/offline-run-*"
                  + (" (in this order: a resume's segment rewinds the run to its step)"
                     if k is not None else ""), file=sys.stderr)

    def _resumed_config(self, resume: dict) -> dict:
        """The run's config for a resumed segment's W&B run, which had none (the first
        segment's wandb.init logged it; a rewound or forked run logged nothing): run_start's
        config, kept in events.jsonl, with the `steps` the resume event says it runs to. A
        resume changes no other option that shapes what is trained (`Bundle.resume_run`); the
        run-local ones it may change (--eval-every, --report-to) are run_start's here."""
        config = (run_start(e for e in iter_events(self.run_dir)
                            if isinstance(e.get("config"), dict)) or {}).get("config", {})
        steps = resume.get("steps")
        if isinstance(steps, int) and not isinstance(steps, bool) and "steps" in config:
            config = {**config, "steps": steps}
        return config

    def __call__(self, ev: dict) -> None:
        if self._run is None:
            self._start(ev)
        found = scalars(ev)
        if found is not None and ev.get("kind") == "run_end":
            # the run's figures, not a point of its history: a resume rewinds the history to
            # the step it resumes from, which would keep a stopped segment's run_end there
            self._run.summary.update(found[1])
        elif found is not None:
            self._run.log(found[1], step=found[0])
        if ev.get("kind") == "run_end":
            if not self.resumed and stopped_untrained(ev):  # its run folder goes
                self._run.tags = (*(self._run.tags or ()), NOTHING_TRAINED)
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


def open_reporters(report_to: str | None, run_dir: Path, run_uid: str | None = None,
                   wandb_project: str | None = None) -> list[Any]:
    """The sinks --report-to names, writing into the run folder `run_dir`; `run_uid` (the
    run's, kept across resumes) makes the W&B run id (`wandb_id`); `wandb_project`: the W&B
    project (None: WANDB_PROJECT, else toymlx)."""
    kinds = {"tensorboard": lambda d: TensorBoardReporter(d),
             "wandb": lambda d: WandbReporter(d, run_uid, wandb_project)}
    return [kinds[n](Path(run_dir)) for n in parse_report_to(report_to)]
