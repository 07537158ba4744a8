"""From a parsed config to a finished run: checks, device, the owned run folder, task, loop.

    toymlx-train --recipe R ...      fresh: own runs/<id> (a lock for the process's life),
                                     write config.json once, build, train
    toymlx-train --resume RUN ...    own RUN (`Bundle`, opened once), check the options and
                                     the data against its config.json, pick
                                     and verify the checkpoint, build, cut the bundle back to
                                     that checkpoint, train on (a `resume` event, no new run_start)
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import mlx.core as mx

from toymlx.backend.device import kernel_build_failure, on_gpu, select_device, setup_process
from toymlx.backend.files import not_utf8, special_kind
from toymlx.backend.stop import how_stopped, ignore_stop_signals, stop_outcome
from toymlx.bundle import checkpoint as ck
from toymlx.bundle.events import read_events, stopped_untrained
from toymlx.bundle.folder import prepare_run_dir, save_config
from toymlx.bundle.inputs import MODEL_OPTIONS, data_paths
from toymlx.bundle.options import RunError, default_run_id, flag_name, option
from toymlx.bundle.outputs import check_output
from toymlx.bundle.reporters import NOTHING_TRAINED, offline_wandb, online_wandb
from toymlx.bundle.resume import Resume
from toymlx.models.ops import Ops, training_ops
from toymlx.runner.bundle import Bundle
from toymlx.runner.launch import launched_as_rank
from toymlx.training.task import (
    Task,
    TrainConfig,
    check_batch_fits,
    check_config,
    half_precision_note,
    warmup_note,
)
from toymlx.training.trainer import resume_from, train


def run_ops(cfg: TrainConfig) -> Ops:
    """The math a run's model computes with (`--dtype`, `--kernels`, `--grad-checkpoint`,
    `--subnormals`, `--no-compile` on the selected device): chosen here, once, and handed to the
    recipe's `build`."""
    return training_ops(on_gpu(), cfg.dtype, cfg.kernels, cfg.grad_checkpoint, cfg.subnormals,
                        compiled=cfg.compile)


def init_distributed() -> Any:
    """The mx.distributed group when launched by mlx.launch with >1 ranks, else None; OSError
    (one line) when the ranks cannot connect (MLX raises a bare RuntimeError: a traceback)."""
    if not launched_as_rank():
        check_peer_launcher()
        return None
    if _one_rank_hostfile():
        return None
    try:
        world = mx.distributed.init()
    except RuntimeError as e:
        why = " ".join(str(e).split())
        hint = ("; a port of the ring is in use: give toymlx-launch another --port, or none (it "
                "picks free ones)" if "bind" in why else "")
        raise OSError(f"data parallel: expected the ranks to connect, found {why}{hint}"
                      ) from None
    return world if world.size() > 1 else None


def check_peer_launcher() -> None:
    """ValueError when torchrun or accelerate launch started this process as one of several
    (WORLD_SIZE > 1): toymlx reads mlx.launch's ranks only, so each process trained alone on
    the whole batch, into its own run folder, and every one exited 0."""
    size = os.environ.get("WORLD_SIZE", "").strip()
    if size in ("", "0", "1"):
        return
    n = size if size.isdigit() else "N"
    raise ValueError(f"WORLD_SIZE={size}: expected ranks started by toymlx-launch, found "
                     f"torchrun's or accelerate's environment (toymlx does not read WORLD_SIZE, "
                     f"RANK, LOCAL_RANK: each process would train alone on the whole batch); use "
                     f"toymlx-launch -n {n} -- toymlx-train ..., or unset WORLD_SIZE")


class RanksAlike(ValueError):
    """A refusal every data-parallel rank of `world` meets alike, from what they all share (the
    options, the number of ranks): rank 0 says it, once for the launch (`_refused`), where each
    rank said it (`toymlx-launch -n 8`: the same line eight times)."""

    def __init__(self, message: str, world: Any):
        super().__init__(message)
        self.world = world


def check_shards(batch_size: int, world: Any) -> None:
    """RanksAlike (a ValueError) unless the global --batch-size splits evenly over the
    data-parallel ranks: found at the first step, it left a run folder (run_start, run_end
    "error") that the next try had to --overwrite, and exit status 1."""
    n = 1 if world is None else world.size()
    if batch_size % n:
        lower, upper = batch_size // n * n, -(-batch_size // n) * n
        fits = f"--batch-size {lower} or {upper}" if lower else f"--batch-size {upper}"
        raise RanksAlike(f"--batch-size: expected a multiple of the {n} data-parallel ranks "
                         f"(it is global, split over them), found {batch_size}; use {fits}",
                         world)


def _one_rank_hostfile() -> bool:
    """Whether mlx.launch started this process as its only rank: for `-n 1` it hands the rank
    an MLX_HOSTFILE holding no hosts (a blank line), which MLX's ring backend then fails to
    parse ("[json.exception.parse_error.101] ... unexpected end of input"): one process,
    nothing to connect to."""
    hostfile = os.environ.get("MLX_HOSTFILE")
    if not hostfile:
        return False
    try:
        with open(hostfile, "rb") as f:
            return not f.read(4096).strip()
    except OSError:
        return False


@dataclass
class _Prepared:
    run_dir: Path
    task: Task
    world: Any
    resume: Resume | None
    used: dict[str, str]
    """A resume's inputs read from elsewhere than recorded: the file read for each, and why that
    one (`Bundle.told`)."""
    made: list[Path] = field(default_factory=list)
    """A new run's --runs-root folders that rank 0 made (`missing_folders`): removed with the run
    where it trained nothing (`remove_new_run`)."""


def _stopped_before_the_first_step(e: KeyboardInterrupt) -> int:
    """The line of a stop (Ctrl-C, or a signal `stops_raise` raised) that came before the
    loop's first step, and its exit code."""
    what, code = how_stopped(e)
    print(f"toymlx-train: {what} before the first step; nothing was trained", file=sys.stderr)
    return code


def _never_trained(run: _Prepared, end: dict) -> bool:
    """Whether `end` (run_end) is a new run's, stopped before its first step once the loop
    had begun (during the validation at step 0, or while step 1's batch was read): its folder
    goes, as one stopped before the loop leaves none (rank 0 removes it)."""
    return (run.resume is None and (run.world is None or run.world.rank() == 0)
            and stopped_untrained(end))


def _ended(run: _Prepared, end: dict) -> int:
    """The run's last line for `end` (run_end), and its exit code; a new run that never
    trained (`_never_trained`) is removed, its line the one a stop before the loop gives."""
    if not _never_trained(run, end):
        _final_line(run.run_dir, end)
        return int(end["exit_code"])
    kept = (f"; its W&B run stays on W&B's server, tagged {NOTHING_TRAINED}"
            if online_wandb(run.run_dir) else
            "; its offline W&B run went with its folder: there is nothing to wandb sync"
            if offline_wandb(run.run_dir) else "")
    remove_new_run(run.run_dir, run.made)
    what, code = stop_outcome(signal.Signals[end.get("signal") or "SIGINT"])
    print(f"toymlx-train: {what} before the first step; nothing was trained{kept}",
          file=sys.stderr)
    return code


def run_training(recipe: str, module: ModuleType, cfg: TrainConfig,
                 bundle: Bundle | None = None, config_file: str | None = None,
                 name_keys: Callable[[str], str] | None = None,
                 notes: Sequence[str] = (), given: Collection[str] = ()) -> int:
    """Run one recipe with a parsed config (with `bundle`, the opened run `--resume` continues;
    `config_file`: the -c file it was read from, an input the run folder must not replace);
    returns the process exit code. `name_keys` rewrites the line of an option refused before
    the first step (an mlx-lm config's `--steps` named by the file's `iters`); `notes` (an
    mlx-lm config's) are said once the run is not refused, so a refusal stays its one line;
    `given`: the command line's flags, an option given where it does not apply refused even at
    its default (`check_config`)."""
    with contextlib.ExitStack() as owned:  # the bundle's lock, held until training has ended
        try:
            # before MLX evaluates anything; activation checkpointing wants MLX's narrow order
            setup_process(wide_evaluation=not cfg.grad_checkpoint)
            run = _prepare(recipe, module, cfg, bundle, owned, config_file, given)
        except (ValueError, OSError, KeyError) as e:
            return _refused(f"toymlx-train: error: {name_keys(str(e)) if name_keys else e}",
                            e.world if isinstance(e, RanksAlike) else None)
        except MemoryError as e:  # numpy's message names the size and shape it wanted
            print(f"toymlx-train: error: out of memory before the first step: {e}; lower "
                  "--batch-size, --seq-len or the model's size", file=sys.stderr)
            return 2
        except KeyboardInterrupt as e:  # Ctrl-C, or a stop signal (`stops_raise`)
            return _stopped_before_the_first_step(e)
        if run.resume is not None and run.resume.note:
            print(f"toymlx-train: {run.resume.note}", file=sys.stderr)
        for note in (*notes, warmup_note(cfg), half_precision_note(cfg.dtype, on_gpu())):
            if note and (run.world is None or run.world.rank() == 0):
                print(f"toymlx-train: {note}", file=sys.stderr)
        for key, note in run.used.items() if run.world is None or run.world.rank() == 0 else ():
            print(f"toymlx-train: --resume reads {flag_name(key)} from {note}",
                  file=sys.stderr)
        try:
            end = train(run.task, cfg, run.run_dir, _public_config(cfg), world=run.world,
                        resume=run.resume, launched=launched_as_rank(),
                        at_exit=lambda end: _ended(run, end))
        except (RunError, ck.ResumeError) as e:
            print(f"toymlx-train: error: {e}", file=sys.stderr)
            return 2
        except KeyboardInterrupt as e:  # a stop while the loop was set up, before run_start
            # (`stops_raise`; the loop counts them from run_start on): the weights' evaluation
            # (`Stepper.build`); a new run's folder goes, as a stop in `_prepare` leaves none
            if run.resume is None and (run.world is None or run.world.rank() == 0) and not any(
                    ev["kind"] == "run_start" for ev in read_events(run.run_dir)):
                remove_new_run(run.run_dir, run.made)
            return _stopped_before_the_first_step(e)
        except ValueError as e:  # bad input met mid-run (an image that fails to decode)
            print(f"toymlx-train: error: {e}", file=sys.stderr)
            return 1
        except OSError as e:
            if not run.run_dir.is_dir():  # removed by hand while it trained (`save_checkpoint`):
                # "--resume DIR --from step_0", the advice below, names a folder that is gone
                said = e.strerror if e.filename == str(run.run_dir) else str(e)
                # a resume's own command would now find no folder to resume
                again = ("left: run the same command again to start it over" if run.resume is None
                         else f"left to resume: start it over with toymlx-train --recipe {recipe} "
                         "and the options it was started with (its config.json went with the "
                         "folder)")
                print(f"toymlx-train: error: {run.run_dir}: {said}; nothing of the run is "
                      f"{again}", file=sys.stderr)
                return 1
            room = (ck.room_note(run.run_dir / "weights")
                    if e.errno in (errno.ENOSPC, errno.EDQUOT) else "")
            print(f"toymlx-train: error: {run.run_dir}: could not write the run bundle ({e}); "
                  f"{_kept(run.run_dir, room)}", file=sys.stderr)
            return 1
        except RuntimeError as e:  # MLX's, where its compiler failed (a full disk)
            if (why := kernel_build_failure(e, NO_KERNELS)) is None:
                raise
            print(f"toymlx-train: error: {why}; {_kept(run.run_dir)}", file=sys.stderr)
            return 1
        if _never_trained(run, end):  # removed while the run still holds it
            return _ended(run, end)
    if run.world is None or run.world.rank() == 0:
        _final_line(run.run_dir, end)
    return int(end["exit_code"])


NO_KERNELS = "train with --no-compile (no kernels to build)"
"""toymlx-train's way round a kernel build that fails (`kernel_build_failure`)."""


def _kept(run_dir: Path, room: str = "") -> str:
    """What a run an error ended mid-run (a full disk) kept, `room` (what a checkpoint needs
    there, `room_note`), and the command that goes on once the error is mended: from the
    checkpoint `latest` names, or where none was completed, the run started over."""
    try:
        latest = os.readlink(run_dir / "weights" / ck.LATEST)
    except OSError:
        latest = ""
    step = ck.checkpoint_step(Path(latest))
    if step is None:
        return f"{resume_from(run_dir, None)}{room}"
    return (f"earlier checkpoints are intact (weights/latest -> {latest}){room}; then "
            f"{resume_from(run_dir, step)}")


def _refused(line: str, world: Any = None) -> int:
    """Exit status 2 after `line`, the error that ended a run before its first step; for a
    refusal every rank of `world` meets alike (`RanksAlike`), said by rank 0 alone, the others
    ending once it has (`_after_rank_0`)."""
    if world is None or world.rank() == 0:
        print(line, file=sys.stderr, flush=True)
    if world is not None:
        _after_rank_0(world)
    return 2


def _after_rank_0(world: Any) -> None:
    """Ignore stop signals until exit, as ranks that leave a run together do
    (`_Loop._leave_together`), and wait for every rank of `world`: rank 0 has then said why
    they end. mlx.launch stops the other ranks (SIGTERM) as soon as one exits non-zero, so a
    rank that ended first could stop rank 0 before its line (the launch then gave no reason)
    or just after it (a second line: "stopped by SIGTERM before the first step")."""
    ignore_stop_signals()
    mx.eval(mx.distributed.all_sum(mx.array(0, dtype=mx.int32), group=world))


def _prepare(recipe: str, module: ModuleType, cfg: TrainConfig, bundle: Bundle | None,
             owned: contextlib.ExitStack, config_file: str | None = None,
             given: Collection[str] = ()) -> _Prepared:
    """Everything before the first step, the bundle owned (locked) through `owned`; raises
    ValueError/OSError with one line when something is off, leaving no new bundle behind."""
    check_config(module, cfg, new_run=bundle is None and not cfg.resume, given=given)
    if cfg.resume and bundle is None:
        bundle = Bundle.open(cfg.resume, "--resume")
    select_device(cfg.device)
    ops = run_ops(cfg)
    world = init_distributed()
    check_shards(cfg.batch_size, world)  # before a bundle is made or resumed
    rank0 = world is None or world.rank() == 0
    if bundle is not None:
        task, resume = bundle.resume_run(recipe, cfg, lambda: _build(module, cfg, ops), ops.dtype,
                                         owned if rank0 else None)
        return _Prepared(bundle.path, task, world, resume, bundle.told)
    for flag, path in run_inputs(cfg):  # before the folder is made: reading one would hang
        if isinstance(path, str) and (kind := special_kind(path)):
            raise ValueError(f"{path}: {flag}: expected a regular file or a folder, found {kind}")
    check_utf8_options(asdict(cfg))
    default_id = not cfg.run_id
    cfg.run_id = cfg.run_id or _shared_run_id(recipe, world)
    run_dir = check_output(Path(cfg.runs_root) / cfg.run_id,
                           [*run_inputs(cfg), ("-c/--config", config_file)],
                           "--runs-root/--run-id", owns=[Path(cfg.runs_root) / cfg.run_id],
                           folder=True)
    if hasattr(module, "settle"):  # so config.json records what the run does, and a folder
        # the same command left (`started_over`) is compared with the options it records
        module.settle(cfg)
    made: list[Path] = []
    if rank0:
        made = missing_folders(Path(cfg.runs_root))  # ours to remove again, left empty
        run_dir, lock, again = prepare_run_dir(cfg.runs_root, cfg.run_id, cfg.overwrite,
                                               default_id, options=cfg)
        owned.enter_context(lock)
        if again:
            print(f"toymlx-train: {again}", file=sys.stderr)
    if default_id:  # the folder rank 0 claimed, maybe with a suffix
        run_dir = _shared_claim(run_dir, cfg.run_id, world)
        cfg.run_id = run_dir.name
    try:
        # the task first: its refusals read headers (a base too large for memory, from its
        # GGUF header) and come before config.json's SHA-256 of every model file, a read of a
        # whole multi-GB base; the files are hashed once either way (`file_sha256`)
        task = _build(module, cfg, ops)
        if rank0:
            save_config(run_dir, recipe, cfg)
    except BaseException:
        if rank0:  # ours, and nothing of a run in it yet
            remove_new_run(run_dir, made)
        raise
    return _Prepared(run_dir, task, world, None, {}, made)


def remove_new_run(run_dir: Path, made: list[Path]) -> None:
    """Remove a new run's folder, which trained nothing, and the --runs-root folders the run
    made (`missing_folders`, deepest first), each only where empty: another run may have
    started in it. Rank 0's job: the other ranks' folder is rank 0's."""
    shutil.rmtree(run_dir, ignore_errors=True)
    for folder in made:
        try:
            folder.rmdir()
        except OSError:
            break


def missing_folders(path: Path) -> list[Path]:
    """`path` and those of its parents that do not exist yet, deepest first: the folders a
    `mkdir(parents=True)` of it makes."""
    missing = []
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    return missing


def _build(module: ModuleType, cfg: TrainConfig, ops: Ops) -> Task:
    """The recipe's task, checked: a batch fits in its training set."""
    task = module.build(cfg, ops)
    check_batch_fits(cfg.batch_size, task.config_info)
    return task


def check_utf8_options(options: dict[str, Any], prefix: str = "") -> None:
    """ValueError naming the flag of the first text option (a path, --run-id) that UTF-8
    cannot hold, a file name's byte such as 0xe9 (latin-1): config.json records every option
    as UTF-8 text, and failed on it with "'utf-8' codec can't encode character '\\udce9'"."""
    for key, value in options.items():
        if isinstance(value, dict):
            check_utf8_options(value, f"{prefix}{key}.")
        elif isinstance(value, str) and (found := not_utf8(value)):
            raise ValueError(f"{value!r}: {flag_name(prefix + key)}: expected UTF-8 text "
                             f"(config.json records it), found {found}; use a UTF-8 name")


def run_inputs(cfg: TrainConfig) -> list[tuple[str, Any]]:
    """(flag, path) of every file or folder a run reads: its data (and --lora.init-adapter)
    and its model files (what its outputs must not overwrite)."""
    keys = [*data_paths(cfg), *MODEL_OPTIONS]
    return [(flag_name(k), option(cfg, k)) for k in keys]


def _public_config(cfg: TrainConfig) -> dict[str, Any]:
    d = asdict(cfg)
    d.pop("progress", None)
    return d


def _shared_run_id(recipe: str, world: Any) -> str:
    """One default run id for all ranks: rank 0's clock, broadcast by an all_sum."""
    if world is None:
        return default_run_id(recipe)
    t = int(time.time()) if world.rank() == 0 else 0
    t = int(mx.distributed.all_sum(mx.array(t, dtype=mx.int64), group=world).item())
    return default_run_id(recipe, t)


def _shared_claim(run_dir: Path, run_id: str, world: Any) -> Path:
    """The run folder rank 0 claimed for the default `run_id` (`claim_run_dir`: it may carry a
    suffix -N), on every rank: rank 0's N, broadcast by an all_sum."""
    if world is None:
        return run_dir
    n = int(run_dir.name[len(run_id) + 1:] or 1) if world.rank() == 0 else 0
    n = int(mx.distributed.all_sum(mx.array(n, dtype=mx.int64), group=world).item())
    return run_dir.with_name(run_id if n == 1 else f"{run_id}-{n}")


def _final_line(run_dir: Path, end: dict) -> None:
    """The run's last line on stderr: how it ended, its latest held-out figures (each pass's
    step named where it is not the run's last step, as after a stop that skipped or abandoned
    the pass there) and its export of that step."""
    events = read_events(run_dir)
    evals = [e for e in events if e["kind"] == "eval"]
    at = end["final_step"]
    passes = [p[-1] for p in ([e for e in evals if e.get("split", "val") == "val"],
                              [e for e in evals if e.get("split") == "test"]) if p]
    figures = ", ".join(
        ", ".join(f"{k} {v:.4f}" for k, v in ev.items()
                  if k not in ("kind", "t", "step", "seconds") and isinstance(v, float))
        + ("" if ev.get("step") == at else f" (at step {ev.get('step')})") for ev in passes)
    msg = f"{end['reason']} at step {at}"
    if end.get("message"):
        msg += f": {end['message']}"
    exports = [e for e in events if e["kind"] == "export" and e.get("step") == at]
    made = f" export: {run_dir / exports[-1]['path']}." if exports else ""
    print(f"toymlx: {msg}. held-out: {figures or _no_figures(events, end)}.{made} bundle: "
          f"{run_dir}", file=sys.stderr)


def _no_figures(events: list[dict], end: dict) -> str:
    """The last line's words for a run without a held-out figure (events.jsonl records none):
    its data held nothing out, or no validation pass ran before it ended."""
    starts = [e.get("config", {}) for e in events if e["kind"] == "run_start"]
    # the held-out count each recipe records: lora's rows, the text recipes' tokens, vit's images
    if starts and 0 in (starts[-1].get(k) for k in ("val_rows", "val_tokens", "val_images")):
        return "none (the data holds out nothing to validate on)"
    if end["reason"] == "completed":
        return "not measured (no validation pass ran)"
    return "not measured yet (no validation before the stop)"
