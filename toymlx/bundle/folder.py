"""A run folder: created and owned for a fresh run (`prepare_run_dir`, its lock), its
config.json written once (`save_config`) and read back as saved (`read_config`)."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import errno
import hashlib
import json
import os
import re
import shlex
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from toymlx.backend import atomic
from toymlx.backend.files import json_fault, not_a_file, nothing_there, shortlist, special_kind
from toymlx.backend.lock import LOCK_FILE, Lock, acquire
from toymlx.bundle import checkpoint as ck
from toymlx.bundle.events import EVENTS_FILE, SUPERSEDED, read_log, run_start
from toymlx.bundle.inputs import (
    DATA_FILES_KEY,
    DATA_INDEX_FILE,
    MODEL_FILES_KEY,
    data_files,
    model_files,
)
from toymlx.bundle.model_store import gpt2_hint, hf_name_hint, is_store_name
from toymlx.bundle.options import RunError, flag_name, found_text, option
from toymlx.bundle.reporters import (
    WANDB_SYNCED,
    offline_wandb,
    online_wandb,
    unsynced_wandb,
)

CONFIG_FILE = "config.json"
CONFIG_KEYS = frozenset({"format", "recipe", "config", DATA_FILES_KEY, MODEL_FILES_KEY})
"""Every top-level key of config.json (`save_config`)."""
WRITE_TEST = ".write-test"
"""Written and removed again as a fresh run takes its folder: the folder is writable."""
UNWRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT)
"""The errors of a folder that refuses writes: read-only, not ours, immutable, full."""


def lock_run(run_dir: Path) -> Lock:
    """Own the bundle for this process's life (LockHeld naming the owner if another has it)."""
    return acquire(run_dir / LOCK_FILE, f"{run_dir}: run bundle")


def check_folder_name(name: str, flag: str) -> None:
    """RunError unless `name` is one folder name that prints on one line: no "/", not "", "."
    or "..", and no control character (a newline in a run id split every line naming the run,
    the final one included)."""
    if "/" in name or name in ("", ".", "..") or any(ord(c) < 32 or ord(c) == 127 for c in name):
        raise RunError(f"{flag}: expected a single folder name, found {name!r}")


def prepare_run_dir(root: str, run_id: str, overwrite: bool, default_id: bool = False,
                    options: Any = None) -> tuple[Path, Lock, str | None]:
    """Create and own runs/<id> for a fresh start, failing before any training if another
    process owns it, if it holds a run (unless `overwrite`, or the run is `options`'s and
    trained nothing: `started_over`), or if it cannot be written. `default_id` (no --run-id
    given): the id is toymlx's, so a taken one gets a suffix (`claim_run_dir`) instead of
    failing. `options`: the new run's config (the recipe's settled), as config.json will record
    it. Returns the folder, its lock, and the line saying a run was started over (else None)."""
    check_folder_name(run_id, "--run-id")
    run_dir = Path(root) / run_id
    created = False  # by this call: only then is the folder ours to remove on a failure
    try:
        if default_id:
            run_dir = claim_run_dir(Path(root), run_id)
            created = True
        else:
            created = _make_dir(run_dir)
        lock = lock_run(run_dir)
    except OSError as e:
        if created:  # a full disk: the folder was made, its lock file not
            _remove_empty(run_dir)
        raise RunError(_cannot_take(run_dir, e)) from None
    try:
        held = [p for p in run_dir.iterdir() if p.name != LOCK_FILE]
        what = folder_kind(run_dir, held)
        again = (started_over(run_dir, options) if what in ("run", "unstarted")
                 and not overwrite and options is not None else None)
        if held and not overwrite and what != "empty" and again is None:
            raise RunError(_taken_message(run_dir, what, held))
        if what == "other":  # --overwrite replaces a run, never a folder of someone's files
            raise RunError(f"{run_dir}: --overwrite: expected a run bundle (toymlx's "
                           f"{CONFIG_FILE} and {EVENTS_FILE}) or an empty folder, found a folder "
                           f"that is not a run, holding {_names(held)}; nothing was removed: "
                           "choose another --run-id or --runs-root")
        if foreign := not_written_by_toymlx(run_dir):  # a run's folder, and someone's files in it
            raise RunError(f"{run_dir}: --overwrite: expected only the files toymlx writes in "
                           f"a run bundle, found others too: {shortlist(foreign, 4)}; nothing was "
                           "removed: move them out of the run folder, or choose another "
                           "--run-id or --runs-root")
        if overwrite and (unsynced := wandb_to_upload(run_dir)):
            raise RunError(f"{run_dir}: --overwrite: " + upload_first(
                run_dir, unsynced, "pass --overwrite again") + ", or choose another --run-id")
        for p in held:  # --overwrite, "empty" or started over: ours, nobody writes into it
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
        (run_dir / "weights").mkdir(exist_ok=True)
        atomic.write_bytes(run_dir / WRITE_TEST, b"ok")
        (run_dir / WRITE_TEST).unlink()
    except OSError as e:
        lock.release()
        if created:
            _remove_empty(run_dir)
        raise RunError(_cannot_take(run_dir, e)) from None
    except BaseException:
        lock.release()
        raise
    return run_dir, lock, again


def wandb_to_upload(run_dir: Path) -> list[Path]:
    """The offline W&B runs that replacing `run_dir` would lose (`unsynced_wandb`: W&B has no
    copy of them), none where the run trained nothing: those hold nothing to upload (as
    `started_over` says, removing them). --overwrite and a sweep starting a run over ask it."""
    unsynced = unsynced_wandb(run_dir)
    return unsynced if unsynced and untrained_events(run_dir) is None else []


def upload_first(run_dir: Path, unsynced: list[Path], then: str) -> str:
    """Why a run in `run_dir` is not replaced: its offline W&B runs `unsynced`
    (`wandb_to_upload`) were never uploaded; the `wandb sync` line that uploads them, `then`
    what to do again (the replacement goes on, as with a run synced or without W&B), or how to
    lose them. The caller names what replaces it (--overwrite, a sweep) and adds its own way out."""
    return (f"expected its offline W&B run uploaded first (wandb sync leaves a *{WANDB_SYNCED} "
            f"file beside each .wandb file it uploads), found "
            f"{shortlist([p.name for p in unsynced], 4)} without one; nothing was removed: "
            f"upload it with: {_sync_line(unsynced)}, then {then}; or, to lose it, remove "
            f"{run_dir / 'wandb'} first")


def _sync_line(unsynced: list[Path]) -> str:
    """The `wandb sync` command line that uploads the offline W&B runs `unsynced`."""
    return shlex.join(["wandb", "sync", *map(str, unsynced)])


def _cannot_take(run_dir: Path, e: OSError) -> str:
    """Why a fresh run cannot take `run_dir`: the error, the path it names (the runs root a
    read-only disk refused, the lock file a full one did) and what to do."""
    fix = "make room or make it writable, or " if e.errno in UNWRITABLE else ""
    return (f"{run_dir}: --runs-root: expected a folder it can write (the run's folder, its "
            f"lock file, config.json, events.jsonl and checkpoints), found {e.strerror or e} at "
            f"{e.filename or run_dir}; {fix}choose another --runs-root")


def _make_dir(run_dir: Path) -> bool:
    """Make `run_dir` (and the runs root): whether this call made it. Asked of mkdir itself,
    not of an exists() before it: a folder another process made in between is not ours."""
    try:
        run_dir.mkdir(parents=True)
    except FileExistsError:
        if not run_dir.is_dir():
            raise
        return False
    return True


def _remove_empty(run_dir: Path) -> None:
    """Remove the run folder this call made, and its weights/, where nothing else is in them."""
    for folder in (run_dir / "weights", run_dir):
        with contextlib.suppress(OSError):
            folder.rmdir()


def claim_run_dir(root: Path, run_id: str) -> Path:
    """root/<run_id>, else root/<run_id>-2, -3, ...: the first that this call creates. The
    default id is a timestamp to the second, so two runs started in one second share it;
    os.mkdir fails for all but one of them, which makes the claim atomic."""
    root.mkdir(parents=True, exist_ok=True)
    n = 1
    while True:
        run_dir = root / (run_id if n == 1 else f"{run_id}-{n}")
        try:
            os.mkdir(run_dir)
            return run_dir
        except FileExistsError:
            n += 1


def folder_kind(run_dir: Path, held: list[Path]) -> str:
    """What a folder a fresh run would take holds: "empty" (nothing, or only what a run killed
    as it started leaves: an empty weights/, a killed writer's temporaries), "run" (toymlx's config.json and events.jsonl), "unstarted" (a run killed
    before its first event: toymlx's config.json, no checkpoint, no events.jsonl) or
    "other" (anything else: not ours to replace)."""
    weights = run_dir / "weights"
    if all((p == weights and p.is_dir() and not p.is_symlink() and not any(p.iterdir()))
           or (p.is_file() and not p.is_symlink() and atomic.is_stale(p)) for p in held):
        return "empty"
    config, events = run_dir / CONFIG_FILE, run_dir / EVENTS_FILE
    if not config.is_file() or config.is_symlink() or saved_config(run_dir) is None:
        return "other"
    if events.is_file() and not events.is_symlink():
        return "run"
    rest = [p for p in held if p not in (config, weights)]
    if not rest and not (weights.exists() and ck.list_checkpoints(weights)):
        return "unstarted"
    return "other"


RUN_FILES = re.compile(rf"{re.escape(CONFIG_FILE)}|{re.escape(EVENTS_FILE)}|"
                       rf"{re.escape(SUPERSEDED)}|{re.escape(LOCK_FILE)}|{re.escape(WRITE_TEST)}|"
                       rf"{re.escape(ck.REWIND)}|{re.escape(DATA_INDEX_FILE)}|"
                       r"events\.out\.tfevents\..+|fused-[^/]+\.gguf")
"""The files toymlx writes at the top of a run folder: config.json, data_index.json (a data
folder's files), events.jsonl and events.superseded.jsonl (a resume's cut), rewinding.json (a
resume's cut under way), the lock and the write test, TensorBoard's event files (--report-to
tensorboard) and a lora run's fused-TYPE.gguf (--fuse-at-end). Its folders: weights/ and W&B's
wandb/ (--report-to wandb; W&B's own tree, taken whole)."""
CHECKPOINT_FILES = re.compile(rf"{re.escape(ck.LATEST)}|(?:\w+?_)?step_\d+\..+")
"""What weights/ and weights/superseded/ hold: `latest`, and each checkpoint's GGUF, state
and side files (`<prefix><step>.*`, `toymlx.bundle.checkpoint`)."""


UNTRAINED_EVENTS = frozenset({"run_start", "eval", "run_end"})
"""The events a run writes before its first step: run_start, --eval-at-start's eval at step
0, a run_end at step 0 (an error there); any other (a step, a checkpoint, a resume) means more."""
CUT_FILES = (SUPERSEDED, ck.REWIND)
"""What a resume's cut leaves at the top of a run folder (`RUN_FILES`): a run that has them was
resumed, so it had a record before."""


def started_over(run_dir: Path, options: Any) -> str | None:
    """The line saying a fresh run of `options` starts `run_dir` over, where the folder
    provably holds nothing trained of a run of the same options: its config.json records
    `options` (the same command; --overwrite aside, which says what to do with a folder, not
    what the run is), and it trained nothing (`untrained_events`): what a kill -9 during the
    startup, --eval-at-start or the first step leaves. None otherwise: the folder is refused
    as before."""
    saved = saved_config(run_dir)
    given = json.loads(json.dumps(dataclasses.asdict(options)))
    if saved is None or ({k: v for k, v in saved["config"].items() if k != "overwrite"}
                         != {k: v for k, v in given.items() if k != "overwrite"}):
        return None
    events = untrained_events(run_dir)
    if events is None:
        return None
    ends = [e for e in events if e["kind"] == "run_end"]
    when = (f"ended ({ends[-1].get('reason')}) at step 0" if ends else "was killed during its "
            "first step or the validation before it" if run_start(events) else "was killed as "
            "it started")
    return (f"{run_dir}: the run of these same options there {when}, before it trained a step "
            "(no step in events.jsonl, no checkpoint): starting it over"
            + ("; its W&B run stays on W&B's server, which marks it crashed"
               if online_wandb(run_dir) else
               "; its offline W&B run goes with it: there is nothing of it to wandb sync"
               if offline_wandb(run_dir) else ""))


def untrained_events(run_dir: Path) -> list[dict] | None:
    """The events of a run folder that provably holds nothing trained (`started_over`'s test,
    whatever its options), else None: events.jsonl, if any, holds only what a run writes before
    its first step (`UNTRAINED_EVENTS`, none past step 0, no garbled line), and there is no
    checkpoint (in weights/ or set aside), no resume's cut, no export, and only files toymlx
    writes (`not_written_by_toymlx`)."""
    weights, events = run_dir / "weights", []
    if (run_dir / EVENTS_FILE).exists():
        log = read_log(run_dir)
        events = log.events
        if log.damaged or any(e["kind"] not in UNTRAINED_EVENTS
                              or e.get("step", e.get("final_step", 0)) != 0 for e in log.events):
            return None
    if (ck.list_checkpoints(weights) or (weights / ck.SUPERSEDED).exists()
            or any((run_dir / name).exists() for name in CUT_FILES)
            or any(run_dir.glob("fused-*.gguf")) or not_written_by_toymlx(run_dir)):
        return None
    return events


def not_written_by_toymlx(run_dir: Path) -> list[str]:
    """The files and folders in a run folder that no toymlx command writes there (paths
    relative to it, a folder ending in "/"), so --overwrite never removes a user's own files."""
    def folder(p: Path) -> bool:
        return p.is_dir() and not p.is_symlink()

    def foreign(d: Path, pattern: re.Pattern[str]) -> list[str]:
        out = []
        for p in sorted(d.iterdir()):
            temporary = p.name.startswith(".") and atomic.TMP_TAG in p.name  # a killed writer's
            if not folder(p) and (temporary or pattern.fullmatch(p.name)):
                continue
            out.append(f"{p.relative_to(run_dir)}{'/' if folder(p) else ''}")
        return out

    found, weights = [], run_dir / "weights"
    for name in foreign(run_dir, RUN_FILES):
        if name == "weights/":
            for inner in foreign(weights, CHECKPOINT_FILES):
                found += (foreign(weights / ck.SUPERSEDED, CHECKPOINT_FILES)
                          if inner == f"weights/{ck.SUPERSEDED}/" else [inner])
        elif name != "wandb/":
            found.append(name)
    return found


def _names(held: list[Path], shown: int = 4) -> str:
    return shortlist(sorted(p.name + ("/" if p.is_dir() and not p.is_symlink() else "")
                            for p in held), shown)


def _taken_message(run_dir: Path, what: str, held: list[Path]) -> str:
    """Why a fresh run cannot take an existing folder, by what it holds (`folder_kind`)."""
    resume = ck.train_command(["--resume", str(run_dir)])
    if what == "run":
        hint = ("" if ck.list_checkpoints(run_dir / "weights")
                else f" ({resume} --from step_0 to start it over)")
        # said here too: --overwrite would be refused until then (`upload_first`)
        upload = wandb_to_upload(run_dir)
        sync = f" once its offline W&B run is uploaded ({_sync_line(upload)})" if upload else ""
        return (f"{run_dir}: run bundle already exists; continue it with {resume}{hint}, pass "
                f"--overwrite to replace it{sync}, or choose another --run-id")
    if what == "unstarted":
        return (f"{run_dir}: a run bundle already exists but never reached its first step "
                f"({CONFIG_FILE}, no {EVENTS_FILE}); pass --overwrite to replace it, "
                f"{resume} --from step_0 to start it over, or choose another --run-id")
    return (f"{run_dir}: expected a new or empty folder for the run, found a folder that is "
            f"not a run bundle, holding {_names(held)}; choose another --run-id or --runs-root")


CONFIG_FORMAT = 10
"""config.json's `format`. 2 (toymlx 0.2 on): every option is written, so a missing key is
damage and refused. A config.json without `format` (written before) is read as it was then: an
option it lacks (one added since) takes its default, which keeps the old behaviour. An option
added from now on must bump this and be let off for older formats in `ADDED_IN`."""
ADDED_IN = {3: ("report_every",), 4: ("report_to", "optimizer", "lr_schedule", "lr_schedule_args",
                                       "warmup_init", "subnormals"), 5: ("full",),
          6: ("weight_decay_scope", "eval_at_start", "data.train_turns"), 7: ("wandb_project",),
          8: ("data.read_as",), 9: ("adam_eps", "bias_correction"), 10: ("data.drop_tools",)}
"""format -> the options it added (dotted: one of a group): a config.json of an older format
(2 on) lacks them, and they take their defaults there (the training those runs had: toymlx's
AdamW decaying matrices only and its schedule, no reporters, a full fine-tune of every weight,
every assistant turn trained, no validation before step 1, W&B's project from WANDB_PROJECT;
subnormals flushed changes no loss past float32 rounding), or their `AS_BEFORE` value."""


def added_since(fmt: int) -> frozenset[str]:
    """The options a config.json of format `fmt` was written without (`ADDED_IN`)."""
    return frozenset(k for f, keys in ADDED_IN.items() if fmt < f for k in keys)


AS_BEFORE = {"data.read_as": ("text", "data.path", ("a single --data.path file was read as "
                                                    "plain text whatever its name, a .jsonl's "
                                                    "JSON included"))}
"""Options of `ADDED_IN` whose default is not what the runs before them did: {dotted key: (the
value those runs had, the option naming the file it is about, what they did)}; an older
config.json that lacks one takes that value wherever a new run would settle the option
otherwise (`as_before`)."""


def as_before(cfg: Any, saved_config: dict[str, Any], fmt: int, source: str,
              settle: Callable[[Any], None] | None) -> dict[str, str]:
    """Give each `AS_BEFORE` option that `cfg` (read from `source`, a config.json of format
    `fmt` whose "config" is `saved_config`) lacks in the file the value runs had before it,
    where the recipe's `settle` (what a new run does with the options as given) gives it
    another value (not None: an option that applies); {dotted key: one line naming the file,
    for the readers to say} of each option set."""
    settled = copy.deepcopy(cfg)
    if settle is not None:
        settle(settled)
    notes = {}
    for key, (value, about, then) in AS_BEFORE.items():
        *parents, name = key.split(".")
        holder, group = cfg, saved_config
        for part in parents:
            holder = getattr(holder, part, None)
            group = group.get(part) if isinstance(group, dict) else None
        if (key not in added_since(fmt) or not dataclasses.is_dataclass(holder)
                or not isinstance(group, dict) or name in group
                or option(settled, key) in (None, value)):
            continue
        setattr(holder, name, value)
        flag = flag_name(key)
        notes[key] = (f"{option(cfg, about)}: {flag_name(about)} read as {value} ({flag} "
                      f"{value}), as the run read it: {source} (format {fmt}) predates {flag}, "
                      f"and then {then}")
    return notes


def save_config(run_dir: Path, recipe: str, cfg: Any) -> None:
    """Write config.json (once, when the run starts): the recipe, every option as given, and
    the absolute file and fingerprint of each data and model file the options name; a data
    folder of many files, each file's beside it (`DATA_INDEX_FILE`), written first."""
    data, index = data_files(cfg)
    if index:
        atomic.write_text(run_dir / DATA_INDEX_FILE, json.dumps(index, ensure_ascii=False))
    atomic.write_text(run_dir / CONFIG_FILE, json.dumps(
        {"format": CONFIG_FORMAT, "recipe": recipe, "config": dataclasses.asdict(cfg),
         DATA_FILES_KEY: data, MODEL_FILES_KEY: model_files(cfg)}, indent=2,
        ensure_ascii=False))



def _file_found(path: Path, flag: str) -> str:
    """What a file given as a run folder is: a file of a run (timm's and HF Trainer's --resume
    take a checkpoint file) names its run, and a checkpoint given to --resume the --from that
    goes on from it; any other, "a file"."""
    run = path.parent.parent if path.parent.name == "weights" else path.parent
    if not (run / CONFIG_FILE).is_file():
        return "a file"
    step = ck.checkpoint_step(Path(os.path.realpath(path)))
    start = ("" if flag != "--resume" or step is None or path.name == ck.LATEST
             else f" (--from step_{step}: from this checkpoint, not the newest)")
    return f"a file of the run {run}; name the run: {run}{start}"


def read_config(run_dir: Path, flag: str) -> dict[str, Any]:
    """config.json as saved, checked for shape (not yet types): recipe, config, data_files."""
    p = run_dir / CONFIG_FILE
    if not run_dir.is_dir():
        raise RunError(f"{run_dir}: {flag}: expected a run bundle folder, found "
                       f"{_file_found(run_dir, flag) if run_dir.exists() else 'nothing'}")
    if kind := special_kind(p):
        raise RunError(f"{p}: {flag}: expected the run's saved config (a JSON file), found {kind}")
    try:
        saved = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        if other := ck.not_one_run(run_dir):  # the runs root, a sweep's folder, weights/
            raise RunError(f"{run_dir}: {flag}: expected a run bundle folder, found "
                           f"{other}") from None
        held = [q for q in run_dir.iterdir() if q.name != LOCK_FILE]
        if ((run_dir / LOCK_FILE).is_file() and (run_dir / "weights").is_dir()
                and folder_kind(run_dir, held) == "empty"):  # what toymlx-train made, no more
            raise RunError(f"{p}: {flag}: expected the run's saved config, found no file: the "
                           "run was killed as it started, before writing it, so nothing of it "
                           "is left; start it again with its command, which takes this folder "
                           "(without --resume)") from None
        raise RunError(f"{p}: {flag}: expected the run's saved config, found no file (a run "
                       "folder of toymlx-train has one)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise RunError(f"{p}: expected a readable UTF-8 file, found {e}") from None
    except json.JSONDecodeError as e:
        raise RunError(f"{p}: expected JSON, found {json_fault(e)}") from None
    except RecursionError:
        raise RunError(f"{p}: expected the run's saved config, found JSON nested too deeply "
                       "to read") from None
    if not isinstance(saved, dict) or not isinstance(saved.get("config"), dict):
        if other := ck.not_one_run(run_dir):  # a Hugging Face model's config.json
            raise RunError(f"{run_dir}: {flag}: expected a run bundle folder, found {other}")
        raise RunError(f"{p}: expected an object with \"recipe\" and \"config\" keys, found "
                       f"{found_text(saved)}")
    if not isinstance(saved.get("recipe"), str):
        raise RunError(f"{p}: key 'recipe': expected a recipe name, found "
                       f"{found_text(saved.get('recipe'))}")
    if not isinstance(saved.get(DATA_FILES_KEY, {}), dict):
        raise RunError(f"{p}: key {DATA_FILES_KEY!r}: expected an object, found "
                       f"{found_text(saved[DATA_FILES_KEY])}")
    return saved


def config_digest(saved: dict[str, Any]) -> str:
    """SHA-256 of config.json's contents as parsed (keys sorted), recorded in run_start: a
    resume refuses a config.json edited since (spacing and key order aside)."""
    text = json.dumps(saved, sort_keys=True, ensure_ascii=False, allow_nan=True)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def saved_config(run_dir: str | os.PathLike) -> dict[str, Any] | None:
    """config.json as saved, unchecked, or None where there is none or it is not an object
    with a "config" object: for a summary of a bundle that `Bundle.open` refuses (toymlx-report
    shows what it can of a damaged run). Everything else opens bundles with `Bundle.open`."""
    if special_kind(Path(run_dir) / CONFIG_FILE):
        return None
    try:
        saved = json.loads((Path(run_dir) / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        return None
    return saved if isinstance(saved, dict) and isinstance(saved.get("config"), dict) else None


def check_model_file(spec: str | os.PathLike, flag: str) -> None:
    """ValueError (one line naming `flag`) where a model option (`--donor`, `--tokenizer`)
    names no file: nothing at the path, a folder (a run folder: `refuse_run_folder`'s message),
    a FIFO or a device. A store name passes: its resolver names what it lacks."""
    refuse_run_folder(spec, flag)
    if is_store_name(spec) or Path(spec).is_file():
        return
    if not Path(spec).exists():
        raise ValueError(f"{spec}: {flag}: expected an existing GGUF file, found "
                         f"{nothing_there(spec)}{hf_name_hint(spec)}{gpt2_hint(spec, flag)}")
    # a Hugging Face model folder is named as --base and --model name it, not "a directory"
    raise ValueError(f"{spec}: {flag}: expected a GGUF file, found "
                     f"{ck.hf_model_folder(spec) or not_a_file(spec)}")


def refuse_run_folder(spec: str | os.PathLike, flag: str) -> None:
    """ValueError (one line) where a model option (`--base`, `--donor`) names a toymlx run
    folder: it takes a GGUF file, and the message names the run's checkpoint to pass (the file
    itself, which stays put while the run's `latest` moves on), or for a LoRA run, whose
    checkpoints are adapters, its base and `--lora.init-adapter`."""
    if is_store_name(spec) or not (Path(spec) / EVENTS_FILE).is_file():
        return
    try:
        latest = ck.latest_checkpoint(spec)[0]
    except (FileNotFoundError, ck.ResumeError):
        raise ValueError(f"{spec}: {flag}: expected a GGUF file, found a toymlx run folder with "
                         "no checkpoint") from None
    if not latest.name.startswith("adapter_"):
        fix = f"pass one of its checkpoints: {flag} {latest}"
    else:
        base = ((saved_config(spec) or {}).get(MODEL_FILES_KEY) or {}).get("base") or {}
        fix = ("its checkpoints are LoRA adapters: pass its base"
               + (f" ({flag} {base['file']})" if isinstance(base.get("file"), str) else "")
               + (f" and --lora.init-adapter {spec} to start from its adapter"
                  if flag == "--base" else ""))  # --donor, --tokenizer: the base is what they read
    raise ValueError(f"{spec}: {flag}: expected a GGUF file, found a toymlx run folder; {fix}")
