"""Run bundles: where a run lives, its options, and the one object every reader opens it by.

A bundle is `<runs_root>/<run_id>/`: `config.json` (written once, when the run starts),
`events.jsonl` (`toymlx.bundle.events`), `weights/` (`toymlx.bundle.checkpoint`) and, while a process trains
into it, `.lock` (`toymlx.backend.lock`: one writer, so a second `toymlx-train` on the bundle fails with
one line naming the first).

- `RunOptions` are the options of where a run lives and how this process drives it; none of
  them changes what is trained, so a resume may change any of them except the two that name
  the bundle. Every other option (the training configuration) must equal the saved one; only
  `--steps` may extend the run (recorded in the `resume` event).
- `Bundle.open(path)` reads and checks `config.json` once (every key present and typed, the
  recipe's own checks), and the events once; training (`toymlx.runner.run`), toymlx-eval, -generate,
  -export, -report and the sweep all open a run this way. For a resume it then plans where to
  continue (`plan_resume`: the checkpoint verified, `latest` missing or dangling falling back to
  the newest intact one), checks the model and the data files against what the run recorded,
  and cuts the bundle back to that checkpoint (`rewind`), handing the loop a finished `Resume`.
"""


from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

from toymlx import __version__
from toymlx.backend import atomic
from toymlx.backend.files import counted, special_kind
from toymlx.backend.lock import LOCK_FILE, Lock
from toymlx.bundle import checkpoint as ck
from toymlx.bundle import events as ev
from toymlx.bundle.folder import (
    CONFIG_FILE,
    CONFIG_FORMAT,
    UNWRITABLE,
    added_since,
    as_before,
    config_digest,
    lock_run,
    read_config,
)
from toymlx.bundle.inputs import (
    DATA_ERROR_KEY,
    DATA_FILES_KEY,
    DATA_INDEX_FILE,
    MODEL_FILES_KEY,
    MODEL_OPTIONS,
    adopt_input,
    changed_part,
    data_empty_as_none,
    data_paths,
    data_reads,
    fingerprint,
    fingerprint_note,
    fixed_data,
    index_parts,
    moved_inputs,
    read_as_recorded,
    resolve_inputs,
    same_data,
)
from toymlx.bundle.model_store import is_store_name
from toymlx.bundle.options import (
    BUNDLE_NAME,
    RunError,
    config_from_dict,
    flag_name,
    found_text,
    is_run_local,
    option,
    option_items,
)
from toymlx.bundle.resume import Resume


# ---- the bundle ------------------------------------------------------------------------------
class Bundle:
    """One run bundle, opened once: its saved configuration (read and checked once), its
    events, its checkpoints. `Bundle.open` is how every reader and the resume open a run."""

    def __init__(self, path: Path, recipe: str, module: ModuleType, config: Any,
                 saved: dict[str, Any], log: ev.Log):
        self.path, self.recipe, self.module = path, recipe, module
        self.config = config
        """The recipe's Config as the run was started, `steps` as its last resume extended it."""
        self.saved = saved
        """config.json as read (`recipe`, `config`, `data_files`)."""
        self.log = log
        """events.jsonl as read at open, with its torn and damaged lines (`events.Log`)."""
        self.events = log.events
        """events.jsonl as read at open (as a resume's `rewind` left it, after)."""
        self.used: dict[str, str] = {}
        """Per input option (`base`, `data.path`, ...): the file read for it, and why that one
        (`resolve_inputs`), for the readers to say."""
        self.moved: dict[str, dict[str, Any]] = {}
        """Per input read from another place than config.json records (same contents): its
        `inputs.MOVED_KEY` record, which a resume writes in its `resume` event."""
        self.before: dict[str, str] = {}
        self.data_notes: list[str] = []
        self.data_fixed: dict[str, dict[str, Any]] = {}
        """{option: fingerprint} of fixed data in effect (`inputs.DATA_FIXED_KEY`), which the
        resume event records"""
        """What `check_data` accepted of changed data (the fix of a data error), for the
        resume event's note"""
        """The options an older config.json lacks that take the value its runs had then
        (`folder.as_before`): {dotted key: one line, for the readers to say}."""

    @classmethod
    def open(cls, path: str | os.PathLike, flag: str = "path",
             given: dict[str, str] | None = None) -> Bundle:
        """Read a run folder's config.json (strictly: RunError naming the file and the key, as
        for command-line input; `flag` names what gave the folder: a command's option such as
        "--resume", or by default this keyword, for a caller from Python) and its events.
        `given`: input options given again ({"data.path": "data2"}), read from there when they
        hold the recorded contents (`inputs.adopt_input`; RunError where they hold others)."""
        from toymlx.recipes import get_recipe
        from toymlx.training.task import check_config

        path = Path(path)
        saved = read_config(path, flag)
        source = str(path / CONFIG_FILE)
        log = ev.read_log(path)
        recorded = (ev.run_start(log.events) or {}).get("recipe")
        if isinstance(recorded, str) and recorded != saved["recipe"]:
            # an edited recipe: its options are refused one by one as not the new recipe's
            # ("key 'config.label_smoothing': expected an option of this recipe")
            raise RunError(f"{source}: key 'recipe': expected {json.dumps(recorded)} (recorded "
                           f"when the run started), found {json.dumps(saved['recipe'])}: "
                           "config.json was edited after the run started: put it back")
        try:
            module = get_recipe(saved["recipe"])
        except ValueError as e:
            raise RunError(f"{source}: key 'recipe': {e}") from None
        fmt = saved.get("format", 1)
        if not isinstance(fmt, int) or isinstance(fmt, bool):
            raise RunError(f"{source}: key 'format': expected an integer (toymlx writes "
                           f"{CONFIG_FORMAT}), found {found_text(fmt)}")
        if not 1 <= fmt <= CONFIG_FORMAT:  # a newer toymlx's options would be misread
            raise RunError(f"{source}: key 'format': expected 1..{CONFIG_FORMAT} (toymlx "
                           f"{__version__} writes {CONFIG_FORMAT}), found {fmt}"
                           + ("; the run was made by a newer toymlx: use that one"
                              if fmt > CONFIG_FORMAT else ""))
        cfg = config_from_dict(module.Config, saved["config"], source, complete=fmt >= 2,
                               optional=added_since(fmt))  # see CONFIG_FORMAT
        before = as_before(cfg, saved["config"], fmt, source,  # the paths as recorded
                           getattr(module, "settle", None))
        cfg, used, moved = resolve_inputs(cfg, saved, source, given, moved_inputs(log.events))
        cfg.steps = _planned_steps(log.events, cfg.steps)
        bundle = cls(path, saved["recipe"], module, cfg, saved, log)
        try:
            check_config(module, cfg)
        except ValueError as e:
            # a value refused in a file the user edited: the edit named, not only a flag nobody
            # gave (`--steps: expected >= 1`)
            edit = bundle.edit_said()
            raise RunError(f"{source}: {edit}: config.json was edited after the run started, "
                           f"and the edit is refused ({e}): put it back" if edit else
                           f"{source}: {e}") from None
        bundle.used, bundle.moved, bundle.before = used, moved, before
        return bundle

    @property
    def told(self) -> dict[str, str]:
        """The `used` inputs a resume names: those read from another file than the option as
        recorded names from here (`inputs.read_as_recorded`). Computed from `used`, `saved`
        and `config` when asked (once, by a resume), so it cannot disagree with them."""
        records = {k: r for g in (DATA_FILES_KEY, MODEL_FILES_KEY)
                   for k, r in self.saved.get(g, {}).items() if k in self.used}
        return {k: note for k, note in self.used.items()
                if not read_as_recorded(k, records[k], str(option(self.config, k)))}

    @classmethod
    def of(cls, path: str | os.PathLike, flag: str = "path") -> Bundle | None:
        """The bundle a run folder, or a checkpoint file in its weights/, belongs to; None for
        a path outside any run (a GGUF of its own). `flag` as for `open`."""
        p = Path(path)
        for run_dir in (p, p.parent.parent) if p.parent.name == "weights" else (p,):
            if (run_dir / CONFIG_FILE).is_file():
                return cls.open(run_dir, flag)
        return None

    def run_data(self) -> dict[str, Any]:
        """The `toy.run_data.*` keys a file fused from this run records
        (`toymlx.training.fused.run_data_metadata`: the settings that decide its held-out
        rows, its data's fingerprint); none for a run of another recipe."""
        from toymlx.training.fused import run_data_metadata

        if self.recipe != "lora":
            return {}
        return run_data_metadata(self.config, self.saved.get(DATA_FILES_KEY, {}).get("data.path"))

    def given_input(self, key: str, path: str) -> str | None:
        """What to say where a reader is given an input option (toymlx-eval's --data.path,
        toymlx-export's --base) that holds the run's recorded `key` from another place
        ("data2 (moved; same contents as the run's data1)"); None where it is the file the
        run recorded, other contents (a reader may score other data), or nothing recorded."""
        group = DATA_FILES_KEY if key not in MODEL_OPTIONS else MODEL_FILES_KEY
        rec = self.saved.get(group, {}).get(key)
        if not isinstance(rec, dict) or "file" not in rec:
            return None
        try:
            adopted = adopt_input(key, rec, path, self.config)
        except (RunError, OSError):
            return None
        return adopted[1] if adopted is not None else None

    def _exports_to_set_aside(self, step: int, steps: int) -> dict[str, str]:
        """The renames of each export in the run folder (a lora run's --fuse-at-end
        `fused-TYPE.gguf`, as its latest `export` event names it) that is not of the weights
        this resume ends with to `fused-TYPE.step_T.gguf`, its step T, so that a run extended by --steps (or
        resumed --from an earlier step) never shows an older export under the name its own
        takes, while it trains and after a stop that leaves its own export undone; the file is
        kept, not removed: it may be the only copy of that step's model. Only a resume that
        finishes a run trained to its end (`step` == `steps`) keeps the export of that step.
        Returns {old name: new name}; `rewind` renames them."""
        latest = {e["path"]: e for e in self.events if e["kind"] == "export"
                  and isinstance(e.get("path"), str) and isinstance(e.get("step"), int)}
        moved = {}
        for name, e in latest.items():
            old = self.path / name
            if e["step"] == step == steps or "/" in name or not old.is_file():
                continue
            moved[name] = old.with_name(f"{old.stem}.step_{e['step']}{old.suffix}").name
        return moved

    # ---- owning it, for a resume
    def own(self) -> Lock:
        """Take the bundle's lock (LockHeld naming the owner); the caller holds it while it
        trains. What `open` read stays valid: only an owner writes the bundle, one that still
        owns it is refused here, and `rewind` cuts back the events file as it is then. A folder
        it cannot write (a read-only or full disk) is RunError, before anything is read."""
        try:
            return lock_run(self.path)
        except OSError as e:
            if e.errno not in UNWRITABLE:
                raise
            raise RunError(f"{self.path}: --resume: expected a run folder it can write (its "
                           f"checkpoints, events.jsonl, its lock file), found {e.strerror} at "
                           f"{self.path / LOCK_FILE}; make room or make it writable, or copy the "
                           "run to a disk that is (cp -a) and resume the copy") from None

    def resume_defaults(self, given: Any) -> Any:
        """The saved configuration as the options a resume starts from: continuing to the end,
        into this bundle."""
        cfg = dataclasses.replace(self.config)
        cfg.stop_at, cfg.resume, cfg.overwrite = None, str(given), False
        return cfg

    def resume_run(self, recipe: str, cfg: Any, build: Callable[[], Any], dtype: str | None,
                   owned: contextlib.ExitStack | None) -> tuple[Any, Resume]:
        """Everything a resume does before its first step, in one call; returns (the task
        `build` made, the `Resume` the loop continues from). The bundle owned (its lock entered
        in `owned`: rank 0; None on other ranks), `cfg` checked against config.json
        (`check_options`) and the data against its fingerprints (`check_data`), the checkpoint
        planned and verified (`plan_resume`), the task built, its model checked against the
        run's (`check_model`, compute `dtype`), then the bundle cut back to the checkpoint
        (`rewind`; other ranks keep the events as read)."""
        if owned is not None:
            owned.enter_context(self.own())
        self.check_record(adopt=cfg.from_step is not None)
        self.check_options(recipe, cfg)
        self.check_data()
        cut = ck.read_rewind(self.path)  # a cut-back a kill interrupted: read before `latest`
        resume = self.plan_resume(self._from_with_cut(cfg.from_step, cut), cfg.steps)
        if cut is not None and cfg.from_step is None:
            resume.add_note(f"{self.path / ck.REWIND}: a resume --from step_{cut['step']} was "
                            f"stopped while it cut the run back: finishing the cut, the run "
                            f"resumes from step_{cut['step']}")
        if cfg.stop_at is not None and cfg.stop_at <= resume.step:  # it trained a step past it
            raise RunError(f"{self.path}: --stop-at: expected a step past the checkpoint's step "
                           f"{resume.step}, where the run resumes, found {cfg.stop_at}; "
                           f"--stop-at counts the run's steps: --stop-at {resume.step + 1} or "
                           "more, or --from an earlier checkpoint")
        resume.moved, resume.data_fixed = self.moved, self.data_fixed
        for note in [*self.before.values(), *self.data_notes]:
            resume.add_note(note)
        task = build()
        self.check_model(task.model_info, dtype)
        if resume.step > 0:  # step_0 starts the run over: its record goes
            self.check_data_read(task.config_info)
        if owned is not None:
            self.rewind(resume, cfg.steps)
        else:
            resume.kept = self.events
        return task, resume

    def _from_with_cut(self, from_text: str | None, cut: dict[str, Any] | None) -> str | None:
        """The --from a resume takes where a cut-back a kill interrupted (`cut`, `ck.REWIND`)
        has begun: its step for none given, a step past it refused (its checkpoints may be set
        aside, its events cut already)."""
        if cut is None:
            return from_text
        if from_text is None:
            return f"step_{cut['step']}"
        if ck.parse_from(from_text) > cut["step"]:
            raise RunError(f"{self.path / ck.REWIND}: --from {from_text}: expected "
                           f"step_{cut['step']} or an earlier checkpoint: a resume --from "
                           f"step_{cut['step']} was stopped while it cut the run back, part of "
                           f"what followed step_{cut['step']} is set aside; resume with --from "
                           f"step_{cut['step']}, or an earlier step")
        return from_text

    def check_record(self, adopt: bool) -> None:
        """RunError unless the bundle is as the run wrote it: events.jsonl holds its run_start,
        and config.json has the digest run_start recorded (naming the first key that differs).
        `adopt` (an explicit --from step_N) takes the bundle as it is now."""
        if adopt:
            return
        start = self.start_event
        events = self.path / ev.EVENTS_FILE
        if start is None:
            size = events.stat().st_size if events.is_file() else 0
            found = ("no file" if not events.exists() else f"{counted(len(self.events), 'event')} "
                     "without it" if self.events else f"{size} bytes but no event (a line "
                     "cut short or garbled)" if size else "an empty file")
            # nothing of a run yet, killed before its run_start line: events.jsonl is created
            # (empty) just before it is written
            if (not events.exists() or not self.events) and not ck.list_checkpoints(
                    self.path / "weights"):
                raise RunError(f"{events}: --resume: found {found} and no checkpoint: the run "
                               "stopped before its first step; start it over with its saved "
                               f"configuration: toymlx-train --resume {self.path} --from step_0")
            raise RunError(f"{events}: --resume: expected the run's record from its run_start, "
                           f"found {found}; resuming would start a new record and lose the "
                           "steps before: put the run's events.jsonl back, or adopt the run as "
                           "it is with --from step_N")
        want = start.get("config_sha256")
        if not isinstance(want, str) or config_digest(self.saved) == want:
            return
        theirs, ours = start.get("run_id"), self.saved["config"].get("run_id")
        if isinstance(theirs, str) and theirs != ours:  # a file copied in from another run
            raise RunError(f"{events}: --resume: expected the record of the run "
                           f"{self.path / CONFIG_FILE} holds (run_id {ours!r}), found that of "
                           f"run_id {theirs!r}: the two files belong to different runs; put "
                           "back this run's own events.jsonl (or config.json)")
        raise RunError(f"{self.path / CONFIG_FILE}: {self.edit_said()}: config.json was edited "
                       "after the run started, and a resumed run keeps its configuration: put "
                       "it back, or adopt it as it is with --from step_N")

    def edit_said(self) -> str | None:
        """How config.json differs from what the run's run_start recorded (its digest): the
        key edited, its recorded value and its value now, else both digests; None where it
        does not differ, or no record says."""
        start = self.start_event or {}
        want = start.get("config_sha256")
        if not isinstance(want, str) or config_digest(self.saved) == want:
            return None
        was = start.get("config") if isinstance(start.get("config"), dict) else {}
        edit = _edited_key(self.saved, was, want)
        return (f"key 'config.{edit[0]}': expected {json.dumps(edit[1])} (recorded when the "
                f"run started), found {json.dumps(edit[2])}" if edit is not None else
                f"expected the contents recorded when the run started (sha256 {want[:12]}), "
                f"found others (sha256 {config_digest(self.saved)[:12]})")

    @property
    def start_event(self) -> dict | None:
        """The run's run_start event, as read (None: events.jsonl lacks it)."""
        return ev.run_start(self.events)

    def check_options(self, recipe: str, given: Any) -> None:
        """RunError unless `given` (a resume's options) keeps the run's recipe and every saved
        option but --steps and the run-local ones (the bundle's name included)."""
        if recipe != self.recipe:
            raise RunError(f"{self.path}: --resume: expected a run of recipe {recipe!r}, found "
                           f"a {self.recipe!r} run")
        was = dict(option_items(self.config))
        inputs = {*data_paths(given), *MODEL_OPTIONS}  # a path given again: the same file
        changed = [(k, was.get(k), v) for k, v in option_items(given)
                   if k != "steps" and (not is_run_local(k) or k in BUNDLE_NAME)
                   and was.get(k) != v
                   and not (k in inputs and _same_place(was.get(k), v))]
        if not changed:
            return
        k, old, new = changed[0]
        more = (f" (and {len(changed) - 1} more: "
                f"{', '.join(flag_name(c[0]) for c in changed[1:])})" if len(changed) > 1 else "")
        # --test added: the run's record of its data leaves its test set out (it never read
        # it), so a resume that scored it would score a file nothing checked; toymlx-eval
        # scores it as it is, as mlx_lm.lora --test scores an adapter folder's
        fix = (f"score its test set with toymlx-eval --model {self.path} --split test, or start "
               f"a new run with {flag_name(k)}" if k == "test" and new is True
               else "start a new run to change it")
        raise RunError(f"{self.path}: --resume: {flag_name(k)}: expected the run's saved {k} = "
                       f"{old!r}, found {new!r}{more}; a resumed run keeps its configuration "
                       f"(only --steps and run-local options such as --eval-every may change): "
                       f"{fix}")

    def check_data(self) -> None:
        """RunError naming the file unless every data file the run recorded at its start
        still has the contents it had (its fingerprint)."""
        for key, rec in self.saved.get(DATA_FILES_KEY, {}).items():
            # the file `resolve_inputs` found for it (the path as typed in older bundles)
            path = option(self.config, key) if isinstance(rec, dict) else None
            if not isinstance(path, str):
                raise RunError(f"{self.path / CONFIG_FILE}: key '{DATA_FILES_KEY}.{key}': "
                               f"expected a path and its fingerprint, found {found_text(rec)}")
            data = "data" if key.startswith("data.") else key  # lora.init_adapter: an adapter
            if not Path(path).exists():  # named where the run read it: the path as typed
                # may be relative to another folder than this one
                gone = rec.get("file") if isinstance(rec.get("file"), str) else path
                raise RunError(f"{gone}: {flag_name(key)}: expected the run's {data} "
                               f"({rec.get('bytes')} bytes when it started), found nothing "
                               f"there; put it back, or give where it is now: {flag_name(key)} "
                               "PATH")
            if key in (fixed := fixed_data(self.events)):  # a fix an earlier resume took
                rec = self.data_fixed[key] = fixed[key]
            reads = data_reads(self.config, key, path)
            empty = data_empty_as_none(self.config, key)  # valid.jsonl at val-fraction 0
            same, now = same_data(path, rec, reads, empty)
            failed = next((e.get(DATA_ERROR_KEY) for e in reversed(self.events)
                           if e["kind"] == "run_end"), None)
            if not same and isinstance(failed, str):
                # the run ended on a file of it that could not be read (`Trainer._data_failed`):
                # no step trained on that file, so the data fixed since goes on from the
                # checkpoint the run wrote before it, and later resumes check this data
                self.data_fixed[key] = fingerprint(path, only=reads)
                self.data_notes.append(f"{flag_name(key)} {path}: changed since "
                                       f"({rec.get('bytes')} -> {now['bytes']} bytes), taken "
                                       f"as the fix of the data error the run ended on "
                                       f"({failed})")
                continue
            if not same:
                what = ("its size" if now["bytes"] != rec.get("bytes") else "its contents")
                part = changed_part(path, rec, self.data_index(key, rec), reads, empty)
                raise RunError(f"{path}: {flag_name(key)}: expected the {data} the run "
                               f"started on ({rec.get('bytes')} bytes, {fingerprint_note(rec)}), "
                               f"found {what} changed ({now['bytes']} bytes, "
                               f"{fingerprint_note(now)}{f': {part}' if part else ''}); a resumed "
                               f"run trains on its own {data}: restore it, or start a new run on "
                               f"this {data}")

    def data_index(self, key: str, rec: dict[str, Any]) -> dict[str, Any] | None:
        """The files of the data folder of option `key` (config.json's record `rec`) as
        `DATA_INDEX_FILE` records them (`index_parts`); None where the run has none (a folder of
        few files, a run from before toymlx wrote it, a file not JSON)."""
        try:
            index = json.loads((self.path / DATA_INDEX_FILE).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        return index_parts(index.get(key) if isinstance(index, dict) else None, rec)

    def plan_resume(self, from_text: str | None, steps: int) -> Resume:
        """The checkpoint to continue from (`--from`, else the one `latest` names), verified;
        RunError or ResumeError (one line, with the command that works) when there is none."""
        weights = self.path / "weights"
        note = None
        written = sorted({e["step"] for e in self.events if e["kind"] == "checkpoint"
                          and isinstance(e.get("step"), int)})  # as events.jsonl records them
        if weights.exists() and not weights.is_dir():
            raise RunError(f"{weights}: --resume: expected the run's checkpoint folder, found "
                           f"{special_kind(weights) or 'a file'}; "
                           + (f"the events record checkpoints up to step_{written[-1]}: put the "
                              "folder back to resume from them" if written else
                              f"remove it to start over: toymlx-train --resume {self.path} "
                              "--from step_0"))
        if from_text is not None:
            step = ck.parse_from(from_text)
            if step == 0:
                return self._check_steps(Resume(0, None, steps_before=self.config.steps), steps)
            ckpt = ck.find_checkpoint(weights, step)
        else:
            if not ck.list_checkpoints(weights) and written:  # removed: not "never written"
                raise RunError(f"{weights}: --resume: expected the run's checkpoints "
                               f"(events.jsonl records them up to step_{written[-1]}), found "
                               "none; put them back to resume from them, or start the run over "
                               "with its saved configuration: toymlx-train --resume "
                               f"{self.path} --from step_0")
            if not ck.list_checkpoints(weights):
                lost = max((e["step"] for e in self.events
                            if e["kind"] == "step" and isinstance(e.get("step"), int)), default=0)
                raise RunError(f"{self.path}: --resume: found no checkpoint: the run stopped at "
                               f"step {lost}, before its first checkpoint "
                               f"({counted(lost, 'step')} lost); "
                               "start it over with its saved configuration: toymlx-train "
                               f"--resume {self.path} --from step_0")
            ckpt, note = ck.latest_checkpoint(self.path)
            step = ck.checkpoint_step(ckpt)
        try:
            arrays, meta = ck.open_checkpoint(ckpt)
        except ck.ResumeError as e:
            raise ck.ResumeError(f"{e}; {ck.intact_hint(self.path, step)}") from None
        if from_text is None:  # --from step_N adopts the checkpoint and the record as they are
            ck.check_own(ckpt, "--resume", f", or adopt it with --from step_{step}", meta,
                         self.events, self.log.damaged)
            self._check_step_record(step)
        return self._check_steps(Resume(step, ckpt, state=arrays, steps_before=self.config.steps,
                                        note=note), steps)

    def _check_step_record(self, step: int) -> None:
        """RunError naming the first step that events.jsonl lacks up to the checkpoint's `step`
        (a line deleted by hand): the resumed run would keep it missing for good."""
        missing = next((want for _, _, want, found in ev.step_gaps(self.events) if found > want),
                       None)
        if missing is None:  # no gap: the record may still end before the checkpoint
            missing = 1 + max((e["step"] for e in self.events if e["kind"] == "step"
                               and isinstance(e.get("step"), int)), default=0)
        if missing > step:
            return
        before = [s for s, _ in ck.list_checkpoints(self.path / "weights") if s < missing]
        # a step's line garbled in place reads as a step missing: say which line it may be
        moved = ev.moved_damage(self.events)  # or garbled before, and cut out by a resume
        why = (f" ({ev.line_numbers(self.log.damaged)} garbled: the file was damaged)"
               if self.log.damaged else f" ({moved})" if moved else "")
        raise RunError(f"{self.path / ev.EVENTS_FILE}: --resume: expected each step once up to "
                       f"the checkpoint's step {step}, found no step {missing}{why}; resuming "
                       f"would leave step {missing} missing for good: put the run's events.jsonl "
                       f"back, or go on from a checkpoint before it with --from "
                       f"step_{before[-1] if before else 0}")

    def _check_steps(self, resume: Resume, steps: int) -> Resume:
        """RunError unless `steps` (the run's own --steps, or the one given) lies past the
        checkpoint: a completed run has nothing left to train without a new --steps."""
        if steps == self.config.steps and resume.step >= steps:  # no --steps past the run's
            if resume.step == steps and (end := self._unfinished()):
                # its last step and checkpoint were written, what follows them was not (the
                # final validation, --test, the recipe's export, run_end): the resume does it
                note = (f"the run trained all {counted(steps, 'step')} but did not complete "
                        f"({end}): "
                        f"finishing it from step_{steps} (what follows the last step: final "
                        "validation, --test, the export; then run_end)")
                resume.add_note(note)
                return resume
            raise RunError(f"{self.path}: completed at step {resume.step} (its --steps); pass "
                           f"--steps N (more than {resume.step}) to train on")
        if steps <= resume.step:
            raise RunError(f"{self.path}: --steps: expected more than the checkpoint's step "
                           f"{resume.step} to train on, found {steps}; --steps is the run's "
                           f"total, not steps to add (mlx-lm's --iters): --steps "
                           f"{resume.step + steps} trains {steps} more")
        return resume

    def _unfinished(self) -> str | None:
        """How the record ends when the run did not complete (None: its run_end says
        completed): "killed: no run_end" for a crash, else its run_end's reason."""
        end = next((e for e in reversed(self.events) if e["kind"] == "run_end"), None)
        if end is None:
            return "killed: events.jsonl has no run_end"
        reason = end.get("reason")
        return None if reason == "completed" else f"run_end reason {reason!r}"

    def check_model(self, model_info: dict[str, Any], dtype: str | None = None) -> None:
        """RunError unless the model built now has the run's shape (and compute `dtype`:
        `--dtype auto` resolves by device, and --device may change on resume)."""
        start = self.start_event
        if start is None:  # nothing recorded: the checkpoint load still checks every shape
            return
        trained = (start.get("math") or {}).get("dtype")
        if dtype is not None and trained is not None and trained != dtype:
            raise RunError(f"{self.path}: --resume: compute dtype: expected {trained} (the "
                           f"run's), found {dtype} (--dtype auto on this device); resume it on "
                           "a device where it resolves the same")
        # the base's path as typed is no test: the file is checked by its recorded SHA-256 when
        # the bundle opens, and a resume reads it by its absolute path
        skip = ("n_params", "n_trainable", *MODEL_OPTIONS)
        was = {k: v for k, v in start.get("model", {}).items() if k not in skip}
        now = {k: v for k, v in json.loads(json.dumps(model_info, default=str)).items()
               if k not in skip}
        for k in sorted(set(was) | set(now)):
            if k in ck.LATER_MODEL_KEYS and k not in was:
                continue  # a run recorded before toymlx recorded it
            if k.removesuffix("_sha256") in MODEL_OPTIONS and now.get(k) is None:
                continue  # a store name's blob read by its path: its contents checked as above
            if was.get(k) != now.get(k):
                raise RunError(f"{self.path}: --resume: model {k}: expected {was.get(k)!r} (the "
                               f"run's), found {now.get(k)!r}; a resumed run keeps its model "
                               "(start a new run to change it)")

    def check_data_read(self, config_info: dict[str, Any]) -> None:
        """RunError unless the data gives the token counts its run_start recorded (training,
        validation, test): the data's contents are checked by their fingerprints, and a
        toymlx that reads them otherwise (a .jsonl as records, not text) trains on other
        tokens under the run's name."""
        was = ((self.start_event or {}).get("config") or {})
        keys = [k for k in ("train_tokens", "val_tokens", "test_tokens")
                if isinstance(was.get(k), int) and isinstance(config_info.get(k), int)]
        if all(was[k] == config_info[k] for k in keys):
            return
        commit = ((self.start_event or {}).get("git") or {}).get("sha")
        taken = "".join(f" ({flag_name(k)} {option(self.config, k)} taken for a config.json "
                        "without it)" for k in self.before)
        raise RunError(f"{config_info.get('data_source')}: --resume: expected "
                       f"{', '.join(f'{was[k]} {k}' for k in keys)} (the run's, as it read its "
                       f"data when it started), found "
                       f"{', '.join(f'{config_info[k]} {k}' for k in keys)}: this toymlx "
                       f"reads the data otherwise than the one that started the run{taken}; "
                       "resume it with that toymlx" + (f" (git {str(commit)[:12]})" if commit
                                                      else "") + ", or start a new run on the "
                       "data")

    def rewind(self, resume: Resume, steps: int) -> None:
        """Cut the bundle back to `resume.step` (only while owning it, just before training
        on to `steps`): `latest` to the checkpoint, later checkpoints to weights/superseded/,
        the recipe's exports of other steps renamed (`_exports_to_set_aside`), the events past
        it to events.superseded.jsonl, temporaries of killed writers removed. The cut is planned
        and recorded in `ck.REWIND` first, which the loop removes once the resume event holds
        what it did (`Resume.cut_record`): a kill at any point leaves a bundle that reads as
        cut, and the next resume finishes that cut, with the figures it recorded, first."""
        cut = ck.read_rewind(self.path)
        try:
            (self.path / "weights").mkdir(exist_ok=True)
            if cut is not None and cut["step"] != resume.step:  # an earlier step
                self._cut_to(cut)                              # (`_from_with_cut`)
            if cut is None or cut["step"] != resume.step:
                cut = self._plan_cut(resume.step, steps, cut)
            self._cut_to(cut)
        except OSError as e:  # a full disk, or a folder made read-only since `own`
            if e.errno not in UNWRITABLE:
                raise
            begun = ck.read_rewind(self.path) is not None
            raise RunError(f"{self.path}: --resume: could not cut the run back to "
                           f"step_{resume.step} ({e}); "
                           + (f"it reads as cut back ({ck.REWIND}): make room (or make it "
                              f"writable), then toymlx-train --resume {self.path} finishes the "
                              "cut" if begun else "nothing was changed: make room (or make it "
                              "writable) and run the same command again")) from None
        resume.cut_record = self.path / ck.REWIND
        resume.set_aside, resume.exports_aside = cut["set_aside"], cut["exports_set_aside"]
        resume.dropped, resume.previous_end = cut["dropped_events"], cut["previous_end"]
        resume.t, resume.damaged = cut["t"], cut["damaged_lines"]
        for old, new in resume.exports_aside.items():
            note = (f"{self.path / old} is the export of {new.split('.')[-2]}, not of the "
                    f"weights this run ends with: renamed {new} (the run writes {old} when it "
                    "completes)")
            resume.add_note(note)
        damage = ev.damage_note(self.path / ev.EVENTS_FILE, resume.damaged)
        if damage:  # a torn line goes in silence: a kill leaves one, and this resume follows it
            note = f"{damage}; moved to {ev.SUPERSEDED}"
            resume.add_note(note)
        resume.kept = self.events

    def _plan_cut(self, step: int, steps: int, before: dict[str, Any] | None) -> dict[str, Any]:
        """What a cut-back to `step` sets aside and drops, as the bundle stands (after `before`,
        an interrupted cut to a later step just finished: its figures count too), recorded in
        `ck.REWIND` before the cut changes anything (`rewind`)."""
        cut = ev.cut_back(self.path, step, dry_run=True)
        plan = {"step": step, "set_aside": [s for s, _ in ck.list_checkpoints(
                    self.path / "weights") if s > step],
                "exports_set_aside": self._exports_to_set_aside(step, steps),
                "dropped_events": cut.dropped, "previous_end": cut.previous_end,
                "damaged_lines": cut.damaged, "t": cut.t}
        if before is not None:
            plan.update(set_aside=sorted({*before["set_aside"], *plan["set_aside"]}),
                        exports_set_aside={**before["exports_set_aside"],
                                           **plan["exports_set_aside"]},
                        dropped_events=before["dropped_events"] + cut.dropped,
                        previous_end=before["previous_end"],
                        damaged_lines=before["damaged_lines"], t=max(before["t"], cut.t))
        atomic.write_text(self.path / ck.REWIND, json.dumps(plan))
        return plan

    def _cut_to(self, plan: dict[str, Any]) -> None:
        """Make the cut-back `plan` records (`_plan_cut`); each change can be made again, so a
        cut finishes from wherever a kill stopped it."""
        weights = self.path / "weights"
        ck.set_aside_after(weights, plan["step"])
        for old, new in plan["exports_set_aside"].items():
            if (self.path / old).is_file():
                os.replace(self.path / old, self.path / new)
        self.events = ev.cut_back(self.path, plan["step"]).kept
        ck.clean_temporaries(weights)


def fused_run_data(path: str | os.PathLike, flag: str = "--adapter") -> dict[str, Any]:
    """`Bundle.run_data` of the run `path` (a run folder, or a checkpoint in its weights/)
    belongs to: what a file fused from it records; none for a file outside a run (mlx-lm's
    adapter, a GGUF of its own)."""
    bundle = Bundle.of(path, flag)
    return bundle.run_data() if bundle is not None else {}


def run_base(path: str | os.PathLike, flag: str = "--model") -> tuple[str, str] | None:
    """(the base model, what to say about it) of the LoRA run `path` is (a run folder) or lies
    in (a checkpoint in its weights/): the file its config.json recorded, as `Bundle.open`
    found and checked it; None outside a run, or for a run without --base."""
    bundle = Bundle.of(path, flag)
    base = getattr(bundle.config, "base", None) if bundle is not None else None
    if not base:
        return None
    return str(base), bundle.used.get("base", f"{base} (the run's --base)")



def _edited_key(saved: dict[str, Any], was: dict[str, Any], want: str) -> tuple[str, Any, Any] | None:
    """(dotted key, recorded value, value now) of the one option of config.json whose recorded
    value (run_start's `config`, `was`) gives back the digest run_start recorded (`want`); None
    where no single option does (several edited, or a key outside "config"). run_start records
    some options as the run resolved them (from-scratch's tokenizer None as "bytes"), so a key
    that merely differs from the record is not named: it may not be the one edited."""
    def leaves(now: dict[str, Any], rec: dict[str, Any], at: tuple[str, ...]) -> Iterator:
        for k, v in now.items():
            if k not in rec:
                continue
            if isinstance(v, dict) and isinstance(rec[k], dict):
                yield from leaves(v, rec[k], (*at, k))
            elif v != rec[k]:
                yield (*at, k), rec[k], v

    for path, recorded, now in leaves(saved["config"], was, ()):
        trial = copy.deepcopy(saved)
        inner = trial["config"]
        for k in path[:-1]:
            inner = inner[k]
        inner[path[-1]] = recorded
        if config_digest(trial) == want:
            return ".".join(path), recorded, now
    return None


def _same_place(was: Any, given: Any) -> bool:
    """Whether an input option given on a resume names the file the bundle reads for it (a
    path in any spelling; a store name as written): `Bundle.open` checked one given elsewhere
    against the recorded contents."""
    if not isinstance(was, str) or not isinstance(given, str):
        return False
    if is_store_name(was) or is_store_name(given):
        return was == given
    return os.path.realpath(was) == os.path.realpath(given)


def _planned_steps(events: list[dict], config_steps: int) -> int:
    """The run's total steps: config.json's, or as the latest `resume` event extended them."""
    for e in reversed(events):
        if e["kind"] == "resume" and isinstance(e.get("steps"), int):
            return e["steps"]
    return config_steps
