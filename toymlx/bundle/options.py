"""A run's options: the run-local ones (`RunOptions`), their flag spelling, a dotted key's
value, and a saved configuration read back into its typed dataclass (`config_from_dict`)."""

from __future__ import annotations

import dataclasses
import json
import time
import types
import typing
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import tyro

from toymlx.backend.device import torch_device_hint


@dataclass
class RunOptions:
    """Where a run lives and how this process drives it (every recipe's Config has them). None
    changes what is trained, so a resume may change any of them, except `runs_root` and `run_id`,
    which name the bundle (`BUNDLE_NAME`)."""

    eval_every: int = 50
    """Steps between validation passes (0: only at the end)."""
    eval_at_start: bool = False
    """Also validate before the first step: the untrained model's figures, as the step-0 eval
    event (mlx-lm's iteration-1 val loss); a resume past step 0 does not repeat it."""
    report_every: int = 10
    """Steps between report lines on stdout (step, train loss, learning rate, steps/s,
    throughput, trained tokens or images, peak memory; mlx-lm's --steps-per-report), printed
    with or without the progress bar, also at the last step (0: none)."""
    checkpoint_every: int = 100
    """Steps between GGUF checkpoints (0: only the final one)."""
    keep_last: int = 0
    """Keep only the newest N checkpoints (0: every one); the one `latest` names always stays."""
    keep_best: int = 0
    """Also keep the N checkpoints with the lowest validation loss (evaluated at their step)."""
    compile: bool = True
    """Run the step under mx.compile (--no-compile: eager, same losses)."""
    device: Literal["auto", "gpu", "cpu"] = "auto"
    """Where MLX runs: auto picks the GPU when MLX has one."""
    runs_root: str = "runs"
    """Folder that holds run bundles."""
    run_id: str | None = None
    """Name of this run's bundle (default: timestamp + recipe, with -2, -3, ... where that
    folder is taken)."""
    resume: str | None = None
    """Continue the run bundle at this path from its latest checkpoint, with its saved
    configuration (only --steps and run-local options such as --eval-every may change)."""
    from_step: Annotated[str | None, tyro.conf.arg(name="from")] = None
    """With --resume: the checkpoint to continue from instead of the latest (step_N, or
    step_0 to start the run over from its saved configuration)."""
    overwrite: bool = False
    """Allow replacing an existing run bundle with the same run id."""
    stop_at: int | None = None
    """Stop (checkpointed, resumable) after this step, as if interrupted."""
    progress: bool = True
    """Show a progress bar."""
    cpu_streams: int = 0
    """MLX CPU streams that each run a slice of every micro-batch in parallel, with the BLAS
    threads shared out between them (MLX runs elementwise work on one thread per stream).
    0: auto (2 where MLX computes on a CPU with 2+ cores and toymlx controls its BLAS
    threads, else 1)."""
    grad_checkpoint: bool = False
    """Recompute each block's activations in the backward pass instead of keeping them: less
    memory for long sequences, about one more forward pass of time."""
    report_to: str | None = None
    """Also show the run's step, eval, checkpoint and test figures as scalars in tensorboard
    (event files in the run folder), wandb (offline without a W&B login), or both:
    tensorboard,wandb, or all (mlx-lm's --report-to; none and all as in HF Trainer; the extras
    toymlx[tensorboard], toymlx[wandb])."""
    wandb_project: str | None = None
    """The W&B project of --report-to wandb's run (mlx-lm's project_name; default: WANDB_PROJECT,
    else toymlx)."""
    force: bool = False
    """Start even when a step's estimated peak exceeds the memory available (the lora recipe
    estimates it before loading; run_start records the estimate either way)."""


RUN_LOCAL = frozenset(f.name for f in dataclasses.fields(RunOptions))
"""The run-local option keys: the fields of `RunOptions` (the one list; do not repeat it)."""
RECIPE_RUN_LOCAL = frozenset({"data.workers"})
"""Recipe options (dotted keys) that are run-local too: how this process makes the batches,
not what they hold (vit-tiny's --data.workers: the same batches with any number of threads)."""


def is_run_local(key: str) -> bool:
    """Whether the option `key` (dotted) is run-local: a `RunOptions` field (or one below it)
    or one of `RECIPE_RUN_LOCAL`; a resume may change it, and a sweep's table leaves it out."""
    return key.split(".")[0] in RUN_LOCAL or key in RECIPE_RUN_LOCAL
BUNDLE_NAME = ("runs_root", "run_id")
"""The run-local options that name the bundle: on --resume they must be the bundle's own."""
BUNDLE_PICK = ("runs_root", "run_id", "resume", "from_step", "overwrite")
"""The run-local options that pick the bundle and its checkpoint (a sweep sets them per run)."""


class RunError(ValueError):
    """A run folder that cannot be used as asked; one line naming the path."""


def default_run_id(recipe: str, t: float | None = None) -> str:
    """The run id of a run started at time `t` (default: now) without --run-id."""
    return f"{time.strftime('%Y%m%d-%H%M%S', time.localtime(t))}-{recipe}"


def flag_name(key: str) -> str:
    """Dotted option key to its command-line flag: model.d_model -> --model.d-model."""
    return "--from" if key == "from_step" else "--" + key.replace("_", "-")



def option(cfg: Any, key: str) -> Any:
    """The value of a dotted option key (`data.path`) of a config, None where it has none."""
    for part in key.split("."):
        cfg = getattr(cfg, part, None)
    return cfg



def option_items(cfg: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, value) of every option of a (nested) config dataclass."""
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if dataclasses.is_dataclass(v):
            yield from option_items(v, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", v



def check_no_empty_text(cfg: Any, prefix: str = "") -> None:
    """ValueError (one line) naming the flag of the first text option given as an empty string
    whose default is not one: `--run-id ""` fell back to the default run id, `--data.path ""`
    read the current folder, `--resume ""` started a new run, all without a word."""
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if dataclasses.is_dataclass(v):
            check_no_empty_text(v, f"{prefix}{f.name}.")
        elif v == "" and f.default != "":
            flag = flag_name(prefix + f.name)
            default = ("" if f.default is dataclasses.MISSING else
                       f"; omit {flag} for its default (<timestamp>-<recipe>)"
                       if f.name == "run_id" else f"; omit {flag} for its default"
                       + ("" if f.default is None else f" ({f.default})"))
            raise ValueError(f"{flag}: expected a non-empty {_TEXT_KIND.get(f.name, 'path')}, "
                             f"got an empty string{default}")


_TEXT_KIND = {"run_id": "folder name", "resume": "run folder", "targets": "list of layer names", "system": "message",
              "from_step": "checkpoint name (step_N)", "report_to": "list of reporters",
              "wandb_project": "W&B project name"}
"""What a text option holds where it is not a path, for `check_no_empty_text`'s line."""


class _Mismatch(Exception):
    def __init__(self, expected: str):
        self.expected = expected


def found_text(v: Any) -> str:
    """A JSON value as an error message shows what it found: its text (cut at 40) and kind."""
    kind = {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
            type(None): "null", int: "an integer", float: "a number"}.get(type(v), type(v).__name__)
    text = json.dumps(v)
    return f"{text if len(text) <= 40 else text[:37] + '...'} ({kind})"


def type_mismatch(t: Any, v: Any) -> str | None:
    """What the annotation `t` expects ("an integer", "one of ...") where the JSON value `v` is
    not of it, else None: `_coerce`'s check for a caller with its own message."""
    try:
        _coerce(t, v, "", "")
    except _Mismatch as m:
        return m.expected
    return None


def choice_as_declared(choices: Sequence[Any], value: Any) -> Any:
    """The one string of `choices` that `value` spells in another case (Q4_K_M for q4_k_m:
    llama-quantize takes its type names in any case and lists them in capitals), else None.
    `value` itself where it is one of them."""
    if value in choices or not isinstance(value, str):
        return value if value in choices else None
    same = [c for c in choices if isinstance(c, str) and c.casefold() == value.casefold()]
    return same[0] if len(same) == 1 else None


def _coerce(t: Any, v: Any, key: str, source: str, complete: bool = True) -> Any:
    """`v` as the annotation `t` wants it; _Mismatch (what was expected) if it cannot be."""
    origin, args = typing.get_origin(t), typing.get_args(t)
    if origin in (typing.Union, types.UnionType):
        wants = []
        for a in args:
            try:
                return _coerce(a, v, key, source, complete)
            except _Mismatch as m:
                wants.append(m.expected)
        raise _Mismatch(" or ".join(wants))
    if t is type(None):
        if v is None:
            return None
        raise _Mismatch("null")
    if origin is Literal:
        if any(v == a and type(v) is type(a) for a in args):
            return v
        if isinstance(v, str) and (declared := choice_as_declared(args, v)) is not None:
            return declared
        raise _Mismatch("one of " + ", ".join(json.dumps(a) for a in args))
    if dataclasses.is_dataclass(t):
        if isinstance(v, dict):
            return config_from_dict(t, v, source, key + ".", complete)
        raise _Mismatch("an object of options")
    if t is bool:
        if isinstance(v, bool):
            return v
        raise _Mismatch("true or false")
    if t is int:
        if isinstance(v, int) and not isinstance(v, bool):
            return v
        raise _Mismatch("an integer")
    if t is float:
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
        raise _Mismatch("a number")
    if t is str:
        if isinstance(v, str):
            return v
        raise _Mismatch("a string")
    if origin in (tuple, list):
        if not isinstance(v, list):
            raise _Mismatch("a list")
        inner = args[0] if args else Any
        items = [_coerce(inner, x, key, source, complete) for x in v] if inner is not Any else list(v)
        return tuple(items) if origin is tuple else items
    return v



def config_from_dict(cls: type, d: dict[str, Any], source: str = "saved config",
                     prefix: str = "config.", complete: bool = True,
                     optional: frozenset[str] = frozenset()) -> Any:
    """Rebuild a (nested) config dataclass from its saved dict, every value checked against
    its field's type, every option present; RunError naming `source`, the key, the expected and
    the found value. config.json is written whole when a run starts, so a missing key is damage:
    taking its default would train another run under this one's name. `complete=False` (a
    config file given with -c, which sets only some options) lets the others take defaults;
    `optional` names the keys that may be missing (added after the file's format), dotted
    (`data.train_turns`) for one of a group of options."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    kw = {}
    for k, v in d.items():
        if k not in names:
            raise RunError(f"{source}: key {prefix + k!r}: expected an option of this recipe, "
                           "found an unknown key (written for another recipe, or by a newer "
                           "toymlx?)")
        inner = frozenset(o.split(".", 1)[1] for o in optional if o.startswith(k + "."))
        if inner and dataclasses.is_dataclass(hints[k]) and isinstance(v, dict):
            kw[k] = config_from_dict(hints[k], v, source, prefix + k + ".", complete, inner)
            continue
        try:
            kw[k] = _coerce(hints[k], v, prefix + k, source, complete)
        except _Mismatch as m:
            raise RunError(f"{source}: key {prefix + k!r}: expected {m.expected}, found "
                           f"{found_text(v)}{torch_device_hint(v) if k == 'device' else ''}; "
                           + ("fix it to the run's value" if complete else
                                               "fix it, or remove the key to take its default")
                           ) from None
    missing = [k for k in names if k not in d and k not in optional]
    if missing and complete:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        flag = flag_name((prefix + missing[0]).removeprefix("config."))  # --data.path's own
        raise RunError(f"{source}: key {prefix + missing[0]!r}: expected the run's saved "
                       f"{flag} value, found no key{more}; put it back as the "
                       "run's run_start event records it")
    return cls(**kw)
