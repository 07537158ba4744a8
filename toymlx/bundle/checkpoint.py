"""Checkpoint files in a run bundle: writing, verifying, choosing one to resume from, retention.

Layout under `runs/<id>/weights/`: `<prefix><step>.gguf` (the model or adapter), beside it
`<prefix><step>.state.safetensors` (optimizer state, step) for exact resume, any other
`<prefix><step>.*` side file a recipe writes, and `latest`, a relative symlink to the newest
GGUF. The state is written before the GGUF and the link is swapped last, each atomically, so at
any instant `latest` names a complete file whose state is also complete; a write that fails
removes what it had written, so no state file is ever left without its GGUF.

The GGUF records the SHA-256 of its tensor data (`toy.tensor_sha256`, written by
`gguf.writer`) and the state file that of its arrays; both carry one id for the step
(`toy.checkpoint_id`). `open_checkpoint` checks all three, so a damaged file or a state file of
another checkpoint is named instead of resumed.
"""

from __future__ import annotations

import errno
import glob
import hashlib
import json
import os
import re
import shlex
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from toymlx.backend import atomic
from toymlx.backend.files import counted, empty_folder, nothing_there, shortlist
from toymlx.backend.lock import LOCK_FILE, held_by
from toymlx.bundle.model_store import hf_name_hint, is_store_name, resolve_model
from toymlx.gguf.reader import GGUFError, GGUFFile

LATEST = "latest"
ID_KEY = "toy.checkpoint_id"
"""GGUF metadata key (and `checkpoint_id` in the state): the id the pair of files shares."""
RUN_KEY = "toy.run_uid"
"""GGUF metadata key (and `run_uid` in the state): the id of the run that wrote the pair, as its
run_start records it (a run folder's name alone is not unique across runs roots)."""
SUPERSEDED = "superseded"
"""weights/ subfolder for checkpoints past the step a resume went back to."""
_STEP = re.compile(r"(?:\w+?_)?step_(\d+)\.gguf")
REWIND = "rewinding.json"
"""At the top of a run folder while a resume cuts it back to a checkpoint (`Bundle.rewind`):
the cut's step and what it sets aside and drops, written before its first change and removed
once the resume event records them, so that a cut a kill interrupted reads as made
(`latest_checkpoint`) and the next resume finishes it, with that account."""
_REWIND_KEYS = {"step": int, "set_aside": list, "exports_set_aside": dict,
                "dropped_events": int, "previous_end": str, "damaged_lines": list,
                "t": (int, float)}


class ResumeError(ValueError):
    """A checkpoint or its resume state that cannot continue this run; one line naming it."""


def train_command(args: list[str]) -> str:
    """`toymlx-train ARGS` as a shell takes it (each argument quoted where it must be): the whole
    command a refusal gives, not "pass --resume", since a resume takes the run's saved options
    and the command that made the run plus --resume is refused where it gave a -c file."""
    return shlex.join(["toymlx-train", *args])


def state_path(ckpt: Path) -> Path:
    return ckpt.with_name(ckpt.name[: -len(".gguf")] + ".state.safetensors")


def companions(ckpt: Path) -> list[Path]:
    """The files that belong to checkpoint `ckpt` besides itself (state, side files)."""
    stem = ckpt.name[: -len(".gguf")]
    return sorted(p for p in ckpt.parent.glob(f"{glob.escape(stem)}.*") if p != ckpt)


def update_latest(weights: Path, target: Path) -> None:
    """Point `weights/latest` at `target` (relative), replacing it atomically."""
    atomic.symlink(target.name, weights / LATEST)


def arrays_digest(arrays: dict[str, Any]) -> str:
    """SHA-256 over the arrays' names, dtypes, shapes and bytes, in name order."""
    digest = hashlib.sha256()
    for k in sorted(arrays):
        a = mx.contiguous(arrays[k])
        digest.update(f"{k}|{a.dtype}|{tuple(a.shape)}|".encode())
        digest.update(memoryview(a).cast("B"))
    return digest.hexdigest()


def save_state(path: Path, arrays: dict[str, Any], meta: dict[str, Any]) -> None:
    """Write resume state atomically: arrays plus JSON metadata (with their digest)."""
    mx.eval(list(arrays.values()))
    meta = {**meta, "sha256": arrays_digest(arrays)}
    # Through a Python file, so a full disk raises OSError(ENOSPC) like every other write of
    # the bundle (MLX's own file writer raises a bare RuntimeError).
    with atomic.atomic_open(path) as f:
        mx.save_safetensors(f, arrays, metadata={"toy": json.dumps(meta)})


def load_state(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(arrays, metadata) of a state file; ResumeError naming it if missing or damaged."""
    if not path.exists():
        raise ResumeError(f"{path}: resume state: expected present beside the checkpoint, "
                          "found missing")
    try:
        arrays, meta = mx.load(str(path), return_metadata=True)
        meta = json.loads(meta["toy"])
    except (ValueError, RuntimeError, KeyError) as e:
        raise ResumeError(f"{path}: resume state: expected a toymlx state file, found "
                          f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                          ) from None
    want = meta.get("sha256")
    if want is not None:
        got = arrays_digest(arrays)
        if got != want:
            raise ResumeError(f"{path}: array data: expected sha256 {want[:16]} (recorded when "
                              f"it was written), found {got[:16]}: the file is damaged")
    return arrays, meta


def verify_gguf(path: Path) -> dict[str, Any]:
    """The GGUF's metadata, after checking its tensor data against `toy.tensor_sha256`
    (files without the key, written by older versions, are only parsed)."""
    try:
        with GGUFFile(path) as g:
            g.verify_digest()
            return dict(g.metadata)
    except GGUFError as e:
        raise ResumeError(str(e) if str(path) in str(e) else f"{path}: {e}") from None


def open_checkpoint(ckpt: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(state arrays, GGUF metadata) of a checkpoint whose GGUF, state file and shared id all
    check out; ResumeError naming the file that does not."""
    check_name(ckpt)
    meta = verify_gguf(ckpt)
    arrays, state = load_state(state_path(ckpt))
    gid, sid = meta.get(ID_KEY), state.get("checkpoint_id")
    if (gid is not None or sid is not None) and gid != sid:
        raise ResumeError(f"{state_path(ckpt)}: checkpoint id: expected {gid} (that of "
                          f"{ckpt.name}), found {sid}: the state file of another checkpoint "
                          f"(step {state.get('step')})")
    step = checkpoint_step(ckpt)
    if state.get("step") != step or meta.get("general.step", step) != step:
        raise ResumeError(f"{ckpt}: step: expected {step} (its name), found "
                          f"{meta.get('general.step')} in the GGUF and {state.get('step')} in "
                          f"{state_path(ckpt).name}")
    return arrays, meta


def nonfinite_tensor(path: Path) -> str | None:
    """The name of the first tensor of a GGUF holding NaN or inf, None if all are finite."""
    with GGUFFile(path) as g:
        for name in g.tensors:
            try:
                g.load(name)  # GGUFFile.load refuses non-finite values
            except GGUFError:
                return name
    return None


def load_checked(load: Callable[[Path, Any], None], path: Path, model: Any) -> None:
    """`load(path, model)` for resume, then ResumeError unless every parameter kept its shape.

    Recipes load with `strict=False` (MLX then checks no shapes), so a checkpoint of another
    shape would otherwise slip in and fail later inside a matmul, naming no file.
    """
    before = {k: tuple(v.shape) for k, v in tree_flatten(model.parameters())}
    try:
        load(path, model)
    except ValueError as e:  # GGUFError and friends already name the file
        raise ResumeError(str(e) if str(path) in str(e) else f"{path}: {e}") from None
    after = {k: tuple(v.shape) for k, v in tree_flatten(model.parameters())}
    for k, shape in before.items():
        if after.get(k) != shape:
            raise ResumeError(f"{path}: parameter {k!r} shape: expected {shape} (this run's "
                              f"model), found {after.get(k)}; was the model shape changed on "
                              "--resume?")


def save_checkpoint(weights: Path, prefix: str, step: int, write: Callable[[Path], None],
                    state_arrays: dict[str, Any], state_meta: dict[str, Any]) -> Path:
    """State, then model file, then link: the order that keeps `latest` always valid. On any
    failure (a full disk) every file of this checkpoint is removed again."""
    # the run's folder removed by hand while it trained (a sweep's run deleted mid-way): made
    # again, it held weights/ alone, a folder that is no run, which the sweep run again then
    # refused to --overwrite every time; the run now fails, its folder left gone
    if not weights.parent.is_dir():
        raise FileNotFoundError(errno.ENOENT, "expected the run's folder, found it removed "
                                f"while the run trained; step {step} not saved",
                                str(weights.parent))
    weights.mkdir(exist_ok=True)
    ckpt = weights / f"{prefix}{step}.gguf"
    try:
        save_state(state_path(ckpt), state_arrays, state_meta)
        write(ckpt)
        update_latest(weights, ckpt)
    except BaseException:
        if _latest_target(weights) != ckpt.name:
            remove_checkpoint(ckpt)
        raise
    return ckpt


def remove_checkpoint(ckpt: Path) -> None:
    """Delete a checkpoint: the GGUF first (from then on it is no checkpoint), then its side
    files; a crash in between leaves side files that `clean_temporaries` removes."""
    ckpt.unlink(missing_ok=True)
    for p in companions(ckpt):
        p.unlink(missing_ok=True)


def _latest_target(weights: Path) -> str | None:
    try:
        return os.readlink(weights / LATEST)
    except OSError:
        return None


def checkpoint_file(path: str | os.PathLike, flag: str = "--model", check_digest: bool = True
                    ) -> Path:
    """The one "file or run folder -> weights" resolver: a GGUF path as given, or the
    checkpoint of a run folder (`latest_checkpoint`), or a model in Ollama's or LM Studio's
    store (`model_store.resolve`, which takes `check_digest`); FileNotFoundError naming `flag`,
    ResumeError (one line) for a broken `latest` or a checkpoint whose recorded step or id
    disagrees with its name."""
    if is_store_name(path):
        return resolve_model(path, flag, check_digest)
    p = Path(path)
    if (p / "adapters.safetensors").is_file() or (
            p.suffix == ".safetensors" and p.is_file()
            and (p.parent / "adapter_config.json").is_file()):
        raise ValueError(f"{p}: {flag}: expected a GGUF file or a run directory, found mlx-lm's "
                         f"adapters; convert them for their base: toymlx-export --adapter {p} "
                         "--base BASE.gguf --out adapter.gguf")
    if p.is_dir() and not empty_folder(p):
        p = latest_checkpoint(p)[0]
    elif not p.exists() or p.is_dir():
        run = p.parent.parent
        if (p.parent.name == "weights" and checkpoint_step(p) is not None
                and (run / "events.jsonl").is_file()):
            # a run still training with --keep-last deletes checkpoints it replaced, also one
            # this command chose as the run's latest a moment before
            raise FileNotFoundError(
                f"{p}: the checkpoint is gone: the run {run} removed it after it was read as the "
                "run's latest (a run still training keeps only its last --keep-last "
                "checkpoints); run the command again to read the run's new latest")
        raise FileNotFoundError(f"{p}: {flag}: expected a GGUF file or a run directory, found "
                                f"{nothing_there(p)}{hf_name_hint(path)}")
    check_name(p)
    check_own(p, flag)
    return p


def check_own(ckpt: Path, flag: str, fix: str = "", meta: dict[str, Any] | None = None,
              events: list[dict] | None = None, damaged: list[int] | None = None) -> None:
    """ResumeError unless a checkpoint in a run's weights/ (beside its events.jsonl) was written
    by that run (its `RUN_KEY` against run_start's run_uid) or adopted by it (a resume event
    naming it: --from step_N): another run's pair copied into weights/ is refused by every
    reader, as by a resume. `fix`: what else to do. `meta` (the checkpoint's metadata), and
    `events` and `damaged` (the run's, as `read_log` reads them), where the caller has read
    them already. The refusal names events.jsonl's garbled lines: one may be the resume event
    that adopted the checkpoint, so the record, not the file, may be at fault. Files outside a
    run pass."""
    from toymlx.bundle.events import EVENTS_FILE, damage_note, read_log, run_start

    run = ckpt.parent.parent
    if events is None:
        if ckpt.parent.name != "weights" or not (run / EVENTS_FILE).is_file():
            return
        log = read_log(run)
        events, damaged = log.events, log.damaged
    start = run_start(events) or {}
    ours = start.get("run_uid")
    if not isinstance(ours, str):
        return  # a record with no run_start: the run's own readers name what is missing
    if f"weights/{ckpt.name}" in {e.get("checkpoint") for e in events if e["kind"] == "resume"}:
        return
    if meta is None:
        try:
            with GGUFFile(ckpt) as g:
                meta = dict(g.metadata)
        except GGUFError:
            return  # not a GGUF: the loader says so, naming the file
    if meta.get(RUN_KEY) != ours:
        note = damage_note(run / EVENTS_FILE, damaged or [])
        if note:
            step = checkpoint_step(ckpt)
            note = (f"; {note}, and the resume event adopting this checkpoint (--from "
                    f"step_{'N' if step is None else step}) may be "
                    f"{'that line' if len(damaged) == 1 else 'one of them'}: if the run adopted "
                    "it, put the run's events.jsonl back instead")
        raise ResumeError(f"{ckpt}: {flag}: expected a checkpoint of this run (run_uid {ours}), "
                          f"found one of run_uid {meta.get(RUN_KEY) or '(none recorded)'} (run "
                          f"{meta.get('general.run_id')!r}); put this run's checkpoint "
                          f"back{fix}{note or ''}")
    model, config = start.get("model"), start.get("config")
    check_recorded_model(ckpt, meta, model if isinstance(model, dict) else {}, fix)
    check_recorded_classes(ckpt, meta, config if isinstance(config, dict) else {}, fix)


# Checkpoint metadata that changes what a model computes without changing a tensor's shape
# (`toy.tensor_sha256` covers the tensor data only), against run_start's `model` record (a
# vit run's epsilon, heads, activation and input normalisation: recorded since session 42).
_MODEL_KEYS = {"adapter.lora.alpha": "lora_alpha", "{arch}.rope.freq_base": "rope_base",
               "{arch}.attention.layer_norm_rms_epsilon": "norm_eps",
               "{arch}.context_length": "context", "{arch}.attention.head_count": "n_heads",
               "{arch}.attention.head_count_kv": "n_kv_heads",
               "vit.attention.layer_norm_epsilon": "norm_eps", "vit.attention.head_count": "n_heads",
               "vit.gelu": "gelu", "toy.pixel_scale": "pixel_scale",
               "toy.pixel_mean": "pixel_mean", "toy.pixel_std": "pixel_std"}
# model record keys a run_start written before them lacks: a resume compares them only where
# the run recorded them (`Bundle.check_model`)
LATER_MODEL_KEYS = ("norm_eps", "pixel_scale", "pixel_mean", "pixel_std", "lora_blocks_reached",
                    "lora_reach")


def _same_value(got: Any, want: Any) -> bool | None:
    """Whether metadata value `got` is the recorded `want` (numbers and lists of them compared
    as the GGUF stores them, `as_stored`); None where `want` records nothing comparable."""
    if isinstance(want, str):
        return got == want
    if isinstance(want, bool):
        return None
    if isinstance(want, (int, float)):  # a list there (per-layer head counts): not comparable
        return bool(as_stored(got) == as_stored(want)) if isinstance(got, (int, float)) else None
    if isinstance(want, list) and all(isinstance(v, (int, float)) for v in want):
        return (isinstance(got, list) and len(got) == len(want)
                and all(isinstance(v, (int, float)) for v in got)
                and all(bool(as_stored(g) == as_stored(w)) for g, w in zip(got, want)))
    return None


def check_recorded_model(ckpt: Path, meta: dict[str, Any], model: dict[str, Any],
                         fix: str = "") -> None:
    """ResumeError where a run's checkpoint holds a value of `_MODEL_KEYS` other than the one
    its run_start records (compared as the GGUF stores it, `_same_value`): a metadata value
    edited or damaged would otherwise be read silently (LoRA alpha, RoPE base, norm epsilon,
    context length, head counts, a ViT's GELU and pixel normalisation). A key the record lacks (a run recorded before it) or
    the file lacks (its loader names it) is not compared. `fix`: what else to do, as
    `check_own`'s."""
    arch = meta.get("general.architecture")
    for pattern, field in _MODEL_KEYS.items():
        key = pattern.format(arch=arch)
        got, want = meta.get(key), model.get(field)
        if got is not None and _same_value(got, want) is False:
            raise ResumeError(f"{ckpt}: metadata key {key!r}: expected {_shown(want)} (the run's "
                              f"model {field}, as run_start records it), found {_shown(got)}: "
                              f"the file was edited or damaged; put this run's checkpoint "
                              f"back{fix}")


def check_recorded_classes(ckpt: Path, meta: dict[str, Any], config: dict[str, Any],
                           fix: str = "") -> None:
    """ResumeError where a ViT checkpoint's `toy.class_names` are not those its run_start
    records (`class_names`: the first `RECORDED_CLASS_NAMES`; `class_count` and
    `class_names_sha256`: the whole list, recorded since session 43): names swapped or edited
    would otherwise label every image wrongly. What the record lacks is not compared; a list
    shorter than `RECORDED_CLASS_NAMES` recorded without a count is the whole list."""
    from toymlx.gguf.vit import RECORDED_CLASS_NAMES, class_names_sha256

    got, want = meta.get("toy.class_names"), config.get("class_names")
    if not (_strings(got) and _strings(want)):
        return  # nothing recorded, or a list the loader refuses, naming the file
    key, back = "metadata key 'toy.class_names'", f"put this run's checkpoint back{fix}"
    for i, (w, g) in enumerate(zip(want, got)):
        if w != g:
            raise ResumeError(f"{ckpt}: {key}: item {i}: expected {w!r} (the run's class name, "
                              f"as run_start records it), found {g!r}: the file was edited or "
                              f"damaged; {back}")
    count = config.get("class_count")
    if not isinstance(count, int) and len(want) < RECORDED_CLASS_NAMES:
        count = len(want)
    if isinstance(count, int) and len(got) != count:
        raise ResumeError(f"{ckpt}: {key}: expected {count} names (the run's classes, as "
                          f"run_start records them), found {len(got)}: the file was edited or "
                          f"damaged; {back}")
    digest = config.get("class_names_sha256")
    if isinstance(digest, str) and class_names_sha256(got) != digest:
        # the first names agree (compared above): the difference lies past them
        raise ResumeError(f"{ckpt}: {key}: expected the run's {len(got)} names (sha256 "
                          f"{digest[:12]}, as run_start records them), found others (sha256 "
                          f"{class_names_sha256(got)[:12]}; the first {len(want)}, those "
                          f"run_start lists, agree): the file was edited or damaged; {back}")


def _strings(v: Any) -> bool:
    """Whether `v` is a list of strings."""
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


def as_stored(v: float) -> int | np.float32:
    """A metadata number as a GGUF holds it, to compare a value given with one read back: an
    integer exactly (a context of 2**24 + 1 is not 2**24), a float as float32 (--lora.alpha 0.3
    reads back as 0.30000001192092896)."""
    return v if isinstance(v, int) else np.float32(v)


def _shown(v: Any) -> str:
    """A recorded or found value as the refusal names it: a number as `as_stored(v)` in its
    shortest text that reads back as itself (1e-05, 10000, 1.0000001e-05: two values that
    differ never look the same), a list item by item, anything else as repr."""
    if isinstance(v, list):
        return "[" + ", ".join(_shown(x) for x in v) + "]"
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, int):
        return str(v)
    short = f"{v:g}"
    return short if np.float32(float(short)) == np.float32(v) else str(np.float32(v))


def check_name(ckpt: Path) -> None:
    """ResumeError unless a checkpoint named `<prefix>step_N.gguf` records step N (and, with its
    state file beside it, the same checkpoint id): a file copied over another is refused, not
    read under the other's name. Reads metadata only; other files pass."""
    step = checkpoint_step(ckpt)
    if step is None:
        return
    try:
        with GGUFFile(ckpt) as g:
            meta = {k: g.metadata.get(k) for k in ("general.step", ID_KEY)}
    except GGUFError:
        return  # not a GGUF: the loader says so, naming the file
    if meta["general.step"] is not None and meta["general.step"] != step:
        raise ResumeError(f"{ckpt}: metadata key 'general.step': expected {step} (its name), "
                          f"found {meta['general.step']}: the file of another checkpoint was "
                          "put under this name")
    st = state_path(ckpt)
    state = _state_header(st) if st.exists() else {}
    sid = state.get("checkpoint_id") if state.get("step") == step else None
    # a state file of this step with another id: the GGUF is the stranger (a state file of
    # another step is named by `open_checkpoint`, for a resume, the one reader that uses it)
    if meta[ID_KEY] is not None and sid is not None and sid != meta[ID_KEY]:
        raise ResumeError(f"{ckpt}: checkpoint id: expected {sid} (that of {st.name}), found "
                          f"{meta[ID_KEY]}: the file of another checkpoint was put under this "
                          "name")


def _state_header(path: Path) -> dict[str, Any]:
    """A state file's toymlx metadata from its safetensors header alone ({} if unreadable)."""
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(min(n, 2**24)))
        meta = json.loads(header.get("__metadata__", {}).get("toy", "{}"))
    except (OSError, ValueError, AttributeError):
        return {}
    return meta if isinstance(meta, dict) else {}


def hf_model_folder(folder: str | os.PathLike) -> str | None:
    """What a Hugging Face model folder given where a GGUF or a run goes is ("a Hugging Face
    model folder (config.json and model.safetensors, ...)"), None for any other path."""
    from toymlx.bundle.events import EVENTS_FILE

    folder = Path(folder)
    if (folder.is_dir() and (folder / "config.json").is_file()
            and not (folder / EVENTS_FILE).is_file() and not (folder / "weights").exists()
            and (st := sorted(p.name for p in folder.glob("*.safetensors")))):
        if is_timm_config(folder / "config.json"):  # toymlx-export --format safetensors's
            return (f"a timm model folder (config.json and {shortlist(st, 2)}, as "
                    "toymlx-export --format safetensors writes from a run; toymlx reads the "
                    "run, or a GGUF of its weights/)")
        # mlx-lm's --model (an mlx-community conversion, a transformers checkpoint): its
        # config.json made it look like a run that had written no checkpoint yet
        return (f"a Hugging Face model folder (config.json and {shortlist(st, 2)}, as mlx-lm's "
                "--model takes; toymlx reads that model's GGUF file instead)")
    return None


def is_timm_config(path: Path) -> bool:
    """Whether `path` is timm's hub config.json (its `architecture` and `pretrained_cfg`, as
    `toymlx.interop.timm_export` writes), not a transformers model's (`architectures`)."""
    try:
        cfg = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(cfg, dict) and "architecture" in cfg and "pretrained_cfg" in cfg


def not_one_run(folder: str | os.PathLike) -> str | None:
    """What a folder given where one run is read holds instead, and what to name ("a folder of
    2 run bundles (a, b); name one of them, e.g. runs/a"): a runs root or a sweep's folder, or
    a run's own weights/; None for any other folder (the caller says what it lacks)."""
    from toymlx.bundle.events import EVENTS_FILE

    def bundle(p: Path) -> bool:
        return (p / "config.json").is_file() or (p / EVENTS_FILE).is_file()

    folder = Path(folder)
    if hf := hf_model_folder(folder):
        return hf
    if not folder.is_dir() or bundle(folder):
        return None
    if folder.name == "weights" and bundle(folder.parent):
        return f"the weights folder of the run {folder.parent}; name the run: {folder.parent}"
    runs = sorted(c.name for c in folder.iterdir() if c.is_dir() and bundle(c))
    if not runs:
        return None
    return (f"a folder of {counted(len(runs), 'run bundle')} "
            f"({', '.join(runs[:3])}{', ...' if len(runs) > 3 else ''}); name one of them, "
            f"e.g. {folder / runs[0]}")


def read_rewind(run_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The cut-back `REWIND` records in `run_dir` (one a kill interrupted), None where there is
    none; ResumeError (one line) for a file that is not one toymlx wrote."""
    path = Path(run_dir) / REWIND
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        rec = json.loads(text)
    except ValueError:
        rec = None
    ok = (isinstance(rec, dict)
          and all(isinstance(rec.get(k), t) and not isinstance(rec.get(k), bool)
                  for k, t in _REWIND_KEYS.items())
          and rec["step"] >= 0 and all(isinstance(s, int) for s in rec["set_aside"])
          and all(isinstance(n, int) for n in rec["damaged_lines"])
          and all(isinstance(k, str) and isinstance(v, str) and "/" not in k + v
                  for k, v in rec["exports_set_aside"].items()))
    if not ok:
        raise ResumeError(f"{path}: expected the cut-back of an interrupted resume --from "
                          f"(keys {', '.join(_REWIND_KEYS)}), found {text[:80]!r}; remove it, "
                          f"then resume with --from the step that resume went back to")
    return rec


def resolve_latest(run_dir: str | os.PathLike) -> Path:
    """The checkpoint a run folder continues from (`latest_checkpoint`, without the why)."""
    return latest_checkpoint(run_dir)[0]


def latest_checkpoint(run_dir: str | os.PathLike) -> tuple[Path, str | None]:
    """(the checkpoint `run_dir/weights/latest` names, None), or where that link is missing (a
    run killed between writing its first checkpoint and linking it) and the newest checkpoint
    is intact, (that one, why it was taken). ResumeError (one line, naming the newest intact
    checkpoint to pass instead) for a link that names a file that is gone, or a missing link
    whose newest checkpoint is damaged: an older checkpoint taken without a word would lose
    the steps after it; also for a link that cannot be read, loops, or points outside the
    run's weights/. FileNotFoundError for no checkpoint."""
    run_dir = Path(run_dir)
    weights = run_dir / "weights"
    link = weights / LATEST
    if (cut := read_rewind(run_dir)) is not None:  # read before the link: `Bundle.rewind`
        return _rewound(run_dir, cut["step"])     # moves the link first, removes this last
    try:
        target = os.readlink(link)
    except FileNotFoundError:
        target = None
    except OSError as e:
        what = "a file, not a link" if e.errno == errno.EINVAL else e.strerror
        raise ResumeError(f"{link}: expected a link to a step_N.gguf of this run, found {what}; "
                          f"remove it, and the newest intact checkpoint is used") from None
    if target is not None:
        ckpt = weights / target
        inside = (os.path.realpath(ckpt.parent) == os.path.realpath(weights)
                  and checkpoint_step(ckpt) is not None)
        if not inside:
            try:
                os.stat(link)
                loop = False
            except OSError as e:
                loop = e.errno == errno.ELOOP
            raise ResumeError(f"{link}: expected a link to a step_N.gguf of this run, found "
                              f"{'a symlink loop through ' if loop else 'one to '}{target}; "
                              "remove it, and the newest intact checkpoint is used")
        ckpt = weights / ckpt.name
        if ckpt.is_file():
            return ckpt, None
        raise ResumeError(f"{ckpt}: expected the run's latest checkpoint ({link} names it), "
                          f"found nothing there; {intact_hint(run_dir, checkpoint_step(ckpt), True)}")
    found = list_checkpoints(weights)
    if not found and (other := not_one_run(run_dir)):
        raise FileNotFoundError(f"{run_dir}: expected a run bundle with weights/latest, "
                                f"found {other}")
    if not found:
        owner = held_by(run_dir / LOCK_FILE)
        live = ("" if owner is None else
                f"; the run is still training (process {owner.get('pid', '?')}) and has "
                "written none yet: its first comes at --checkpoint-every or when it stops")
        if owner is None and (run_dir / "config.json").is_file():
            # a run that stopped before its first checkpoint: what gives it one
            live = ("; the run stopped before its first checkpoint: start it over with its "
                    "saved configuration, "
                    + train_command(["--resume", str(run_dir), "--from", "step_0"]))
        raise FileNotFoundError(f"{run_dir}: expected a run bundle with weights/latest, "
                                f"found no checkpoint{live}")
    step = newest_intact(weights)
    if step != found[-1][0]:
        raise ResumeError(f"{found[-1][1]}: expected an intact checkpoint ({link} is missing, "
                          f"and this is the newest), found it damaged; "
                          f"{intact_hint(run_dir, found[-1][0], True)}")
    return weights / found[-1][1].name, \
        f"{link} is missing: took the newest intact checkpoint, step_{step}"


def _rewound(run_dir: Path, step: int) -> tuple[Path, str]:
    """`latest_checkpoint` of a run whose cut-back to `step` a kill interrupted (`REWIND`): the
    checkpoint it goes back to, as the finished cut leaves `latest`."""
    said = (f"{run_dir / REWIND}: a resume --from step_{step} was stopped while it cut the run "
            f"back to step_{step}")
    finish = f"toymlx-train --resume {run_dir} finishes the cut"
    if step == 0:
        raise FileNotFoundError(f"{run_dir}: expected a run bundle with weights/latest, found no "
                                f"checkpoint: {said} (the run starts over); {finish}")
    ckpt = next((p for s, p in list_checkpoints(run_dir / "weights") if s == step), None)
    if ckpt is None:
        raise ResumeError(f"{said}, expected its checkpoint step_{step} in weights/, found "
                          f"none; {intact_hint(run_dir, step, True)}")
    return ckpt, f"{said}: took step_{step}, the checkpoint it goes back to; {finish}"


def intact_hint(run_dir: Path, below: int | None, lost: bool = False) -> str:
    """Where to go on from when a checkpoint (at step `below`) cannot be used: the newest
    intact one before it, as the command that resumes from it; `lost`: also that the steps
    after it are trained again, and its file, for a command that reads it."""
    step = newest_intact(run_dir / "weights", below)
    if step is None:
        return (f"no intact checkpoint is left: start over with toymlx-train --resume {run_dir} "
                "--from step_0")
    hint = f"the newest intact checkpoint is step_{step}: toymlx-train --resume {run_dir} " \
           f"--from step_{step}"
    if not lost:
        return hint
    path = next(p for s, p in list_checkpoints(run_dir / "weights") if s == step)
    return f"{hint} (trains the steps after {step} again), or read it as {path}"


def checkpoint_step(ckpt: Path) -> int | None:
    m = _STEP.fullmatch(ckpt.name)
    return int(m.group(1)) if m else None


def list_checkpoints(weights: Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint in `weights`, oldest first."""
    out = []
    for p in weights.glob("*.gguf") if weights.is_dir() else []:
        step = checkpoint_step(p)
        if step is not None:
            out.append((step, p))
    return sorted(out)


def room_note(weights: Path) -> str:
    """For a write that found the disk full: the room one checkpoint takes (the newest's files)
    against what is free there, and what to do ("" where nothing can be measured)."""
    found = list_checkpoints(weights)
    if (free := atomic.free_bytes(weights if weights.is_dir() else weights.parent)) is None:
        return ""
    if not found:
        return f"; {free / 2**20:.1f} MiB are free there: free space, or --runs-root on a larger disk"
    step, newest = found[-1]
    size = sum(f.stat().st_size for f in (newest, *companions(newest)) if f.exists())
    aside = weights / SUPERSEDED
    held = sum(p.stat().st_size for p in aside.iterdir() if p.is_file()) if aside.is_dir() else 0
    return (f"; a checkpoint takes {size / 2**20:.1f} MiB here (step_{step}'s files) and "
            f"{free / 2**20:.1f} MiB are free: free space, or --runs-root on a larger disk (each "
            "checkpoint is written in full before --keep-last removes an older one)"
            + (f"; weights/{SUPERSEDED}/ (the checkpoints a --from set aside) holds "
               f"{held / 2**20:.1f} MiB and can go whole" if held else ""))


def clean_temporaries(weights: Path) -> int:
    """Remove what killed writers left behind (temporaries, side files of a checkpoint whose
    GGUF was never written or was being removed); return how many. Only while holding the run."""
    if not weights.is_dir():
        return 0
    left = [p for p in weights.iterdir() if atomic.TMP_TAG in p.name and p.name[0] == "."]
    have = {p.name[: -len(".gguf")] for _, p in list_checkpoints(weights)}
    for p in weights.iterdir():
        m = re.fullmatch(r"((?:\w+?_)?step_\d+)\.\w+\.safetensors", p.name)
        if m and m.group(1) not in have:
            left.append(p)
    for p in left:
        p.unlink(missing_ok=True)
    return len(left)


def newest_intact(weights: Path, below: int | None = None) -> int | None:
    """The step of the newest checkpoint (below step `below`) that `open_checkpoint` accepts."""
    for step, path in reversed(list_checkpoints(weights)):
        if below is not None and step >= below:
            continue
        try:
            open_checkpoint(path)
        except ResumeError:
            continue
        return step
    return None


def find_checkpoint(weights: Path, step: int) -> Path:
    """The checkpoint of `step` in `weights`; ResumeError listing the ones there are."""
    for s, p in list_checkpoints(weights):
        if s == step:
            return p
    have = ", ".join(f"step_{s}" for s, _ in list_checkpoints(weights)) or "none"
    raise ResumeError(f"{weights}: --from: expected one of the checkpoints ({have}, or step_0 "
                      f"to start over), found no step_{step}")


def parse_from(text: str) -> int:
    """`--from` text (`step_N`, `adapter_step_N.gguf`, `N`) to a step."""
    m = re.fullmatch(r"(?:\w+?_)?(?:step_)?(\d+)(?:\.gguf)?", text.strip())
    if not m:
        # the words a user reaches for: weights/latest's name, a checkpoint's path
        name = Path(text.strip()).name
        hint = ("; leave --from out to go on from the checkpoint weights/latest names"
                if text.strip() == LATEST else
                f"; --from picks one of the run's own checkpoints by its name: --from {name}"
                if "/" in text and re.fullmatch(r"(?:\w+?_)?step_\d+\.gguf", name) else "")
        raise ValueError(f"--from: expected a checkpoint such as step_20 (or 20), found "
                         f"{text!r}{hint}")
    return int(m.group(1))


def set_aside_after(weights: Path, step: int) -> list[int]:
    """Move checkpoints past `step` (with their side files) into weights/superseded/ and point
    `latest` at `step`'s (or remove it for step 0): a resume from `step` rewrites that future.
    Returns the steps moved."""
    moved = []
    keep = next((p for s, p in list_checkpoints(weights) if s == step), None)
    if keep is not None:
        update_latest(weights, keep)
    elif (weights / LATEST).is_symlink():
        (weights / LATEST).unlink()
    for s, p in list_checkpoints(weights):
        if s > step:
            aside = weights / SUPERSEDED
            aside.mkdir(exist_ok=True)
            # its side files first: a kill before the GGUF leaves it in weights/ to move again,
            # where side files left behind without it are a killed writer's (`clean_temporaries`)
            for f in (*companions(p), p):
                os.replace(f, aside / f.name)
            moved.append(s)
    if moved:
        atomic.fsync_dir(weights)
    return moved


def retained(steps: Iterable[int], latest: int | None, keep_last: int, keep_best: int,
             scores: dict[int, float]) -> set[int]:
    """The checkpoint steps a retention policy keeps: the `keep_last` newest, the `keep_best`
    with the lowest validation loss in `scores`, and always `latest`."""
    steps = sorted(steps)
    keep = set(steps[-keep_last:]) if keep_last else set()
    scored = sorted((scores[s], s) for s in steps if s in scores)
    keep |= {s for _, s in scored[:keep_best]}
    if latest is not None:
        keep.add(latest)
    return keep


def prune(weights: Path, keep: set[int]) -> list[int]:
    """Remove every checkpoint whose step is not in `keep` (never the one `latest` names);
    returns the steps removed."""
    latest = _latest_target(weights)
    removed = []
    for s, p in list_checkpoints(weights):
        if s not in keep and p.name != latest:
            remove_checkpoint(p)
            removed.append(s)
    return removed
