"""tyro's parse of a command's options, a command line it refuses as one line.

tyro (1.0) draws a refused command line as a box of many lines on stderr and exits 2, where
toymlx's other bad input is one line `PROG: error: ...`. tyro's own way to take that over is its
parse-error hook (`tyro._errors.on_parse_error`): the hook gets the failure as an event (the
argument, the value or the unknown tokens) before anything is printed, and raising from it
replaces tyro's print-and-exit. tyro marks that module private and experimental, so it is used
here only, in `parse_options`, which every toymlx command parses its options through. Where the
hook is missing (an older tyro), or an event is one toymlx has no words for (subcommands and
mutually exclusive groups, which no toymlx command has), or tyro's event has changed shape,
tyro's own box is printed as before: a refusal is never lost, only longer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import types
import typing
from collections.abc import Container, Sequence
from pathlib import Path
from typing import Any, Literal, Union

from toymlx_cli import readable_width
from toymlx_cli.config_file import (
    FILE_FLAG,
    MLX_LM_COMMAND_KEYS,
    closest_option,
    mlx_lm_hint,
    option_table,
    short_flags,
)


class UsageError(ValueError):
    """A command line tyro refuses, as one line naming the flag, the value given and what is
    expected."""


def parse_options(cls: type, argv: list[str], prog: str, default: Any = None,
                  description: str | None = None) -> Any:
    """tyro.cli(cls) over `argv`; UsageError (one line) for a command line it refuses. `--help`
    prints tyro's help and exits 0, as tyro does, at least `readable_width`'s columns wide."""
    import tyro

    from toymlx.bundle.options import check_no_empty_text

    try:
        from tyro._errors import on_parse_error
    except ImportError:  # a tyro without the hook: its own box
        on_parse_error = None

    def refuse(event: Any) -> None:
        try:
            line = _one_line(event, cls, argv)
        except (AttributeError, TypeError):  # an event of another shape: tyro's box
            return
        if line is not None:
            raise UsageError(line)

    if line := _run_together(cls, argv, prog):
        raise UsageError(line)
    argv = _choices_as_declared(cls, argv)
    hooked = on_parse_error(refuse) if on_parse_error else contextlib.nullcontext()
    with hooked, readable_width():
        options = tyro.cli(cls, args=argv, prog=prog, default=default, description=description)
    try:
        check_no_empty_text(options)
    except ValueError as e:
        raise UsageError(line_as_typed(str(e), argv, cls)) from None
    return options


EXAMPLES = {
    "toymlx-eval": "toymlx-eval --model runs/RUN_ID",
    "toymlx-generate": "toymlx-generate --model runs/RUN_ID --prompt TEXT",
    "toymlx-classify": "toymlx-classify --model runs/RUN_ID IMAGE",
    "toymlx-export": "toymlx-export --adapter runs/RUN_ID --fuse --out FILE.gguf",
    "toymlx-export --format modelfile": ("toymlx-export --format modelfile --adapter runs/RUN_ID "
                                         "--out FOLDER"),
}
"""A command typed as it would be, for a line naming a required option left out: what a newcomer
who types the command alone sees first; keyed by the command, or by the command and the
--format given where that format's call differs."""


def _example(prog: str, argv: list[str]) -> str | None:
    """`EXAMPLES`' command for `prog` typed with `argv`: its --format's where it has one."""
    formats = [a.partition("=")[2] or (argv[i + 1] if i + 1 < len(argv) else "")
               for i, a in enumerate(argv) if a.partition("=")[0] == "--format"]
    return EXAMPLES.get(f"{prog} --format {formats[-1]}" if formats else prog) or EXAMPLES.get(prog)


def _one_line(event: Any, cls: type, argv: list[str]) -> str | None:
    """The event (tyro._errors' ParseErrorEvent) as one line, or None for tyro's own box."""
    kind = type(event).__name__
    if kind == "UnrecognizedArgs":
        return _unrecognized(event.tokens, cls, argv, event.prog)
    if kind == "MissingArgs":
        unknown = _unknown_options(cls, argv)
        if unknown:  # `-m FILE` leaves --model missing: the unknown option is what to say
            return _unrecognized(unknown, cls, argv, event.prog)
        names = ", ".join(a.arg.display_name() for a in event.missing_arguments)
        each = " for each (they are required)" if len(event.missing_arguments) > 1 else \
            " (it is required)"
        example = _example(event.prog, argv)
        return f"{names}: expected a value{each}, got none" + (
            f"; e.g. {example} ({event.prog} --help lists every option)" if example else "")
    if kind == "MutexConflict":
        return (f"{event.first_token}, {event.second_token}: expected one of them, got both")
    if kind not in ("BadValue", "InvalidChoice", "InstantiationFailure"):
        return None
    arg = event.argument
    if arg is None:  # a value refused by the options' own constructor
        return " ".join(event.message.split())
    at, values = _given(argv, arg.lowered.name_or_flags)
    flag = argv[at].partition("=")[0] if at is not None else arg.display_name()
    if kind == "InvalidChoice":  # in the type's order (tyro's order of a bool's may vary)
        choices = _choices(arg.field.type) or list(event.choices)
        # an optional choice's None is "unset", its default, not a value anyone types
        choices = [c for c in choices if c != "None"] or choices
        from toymlx.backend.device import torch_device_hint

        hint = {"--device": torch_device_hint, "--model.preset": timm_vit_hint}.get(flag)
        return (f"{flag}: expected one of {', '.join(choices)}, got {event.value!r}"
                + (hint(event.value) if hint else ""))
    if kind == "BadValue" and event.reason == "fixed":
        return (f"{flag}: expected no value (it is fixed to {arg.field.default!r}), got "
                f"{event.offending_value!r}")
    expected = _expected(arg.field.type) or str(arg.lowered.metavar)
    if kind == "BadValue":  # too few values: the flag last, or another option after it
        after = argv[at + 1] if at is not None and at + 1 < len(argv) else None
        return (f"{flag}: expected {expected} after it, got "
                + (f"the option {after}" if after else "nothing")
                + (f"; for the file {after}, write {flag} ./{after}"  # a name starting with -
                   if after and os.path.lexists(after) else ""))
    nargs = arg.lowered.nargs
    given = " ".join(values[:nargs] if isinstance(nargs, int) else values)
    if _expected(arg.field.type) is None:  # a type toymlx has no words for: tyro's reason
        return f"{flag}: {' '.join(event.message.split())} (got {given!r})"
    return f"{flag}: expected {expected}, got {given!r}"


TIMM_VIT_SIZES = {"tiny": (192, 3, 12), "small": (384, 6, 12), "base": (768, 12, 12),
                  "large": (1024, 16, 24)}
"""timm's ViTs by name: width, heads, blocks (each with an MLP 4 x the width)."""


def timm_vit_hint(value: object) -> str:
    """After a --model.preset value refused: timm's ViT name (`vit_small_patch16_224`) as
    vit-tiny's options ("; timm's vit_tiny_patch16_224 is vit-tiny here"); "" for another."""
    m = re.fullmatch(r"(?:timm/)?vit_(tiny|small|base|large)_patch(\d+)_(\d+)(?:\.\w+)?",
                     str(value))
    if not m:
        return ""
    (d, heads, layers), patch, size = TIMM_VIT_SIZES[m[1]], int(m[2]), int(m[3])
    if (m[1], patch, size) == ("tiny", 16, 224):
        return f"; timm's {value} is vit-tiny here"
    return (f"; timm's {value} is vit-tiny's ViT at its size here: --model.d-model {d} "
            f"--model.n-heads {heads} --model.n-layers {layers} --model.ffn-dim {4 * d} "
            f"--model.patch-size {patch} --data.image-size {size}")


_KINDS = {int: ("an integer", "integers"), float: ("a number", "numbers"),
          str: ("a value", "values"), bool: ("True or False", "True or False values"),
          Path: ("a path", "paths")}


def _bare(tp: Any) -> Any:
    """A type without its Annotated wrappers (tyro.conf.arg, Positional)."""
    while typing.get_origin(tp) is typing.Annotated:
        tp = typing.get_args(tp)[0]
    return tp


def _expected(tp: Any, plural: bool = False) -> str | None:
    """What an option of type `tp` takes, in words (`an integer or None`); None for a type
    without words here."""
    tp = _bare(tp)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return "one of " + ", ".join(str(a) for a in args)
    if origin in (Union, types.UnionType):
        kinds = [_expected(a, plural) for a in args if a is not type(None)]
        if None in kinds:
            return None
        return " or ".join(kinds + (["None"] if type(None) in args else []))
    if origin in (list, tuple, Sequence) and args:
        return _expected(args[0], plural=True)
    return _KINDS[tp][plural] if tp in _KINDS else None


def _choices(tp: Any) -> list[str] | None:
    """The values of a type of few values (Literal, bool, None, unions of them) in its
    declared order; None for another type."""
    tp = _bare(tp)
    if typing.get_origin(tp) is Literal:
        return [str(a) for a in typing.get_args(tp)]
    if typing.get_origin(tp) in (Union, types.UnionType):
        parts = [_choices(a) for a in typing.get_args(tp)]
        return None if None in parts else [c for p in parts for c in p]
    return ["True", "False"] if tp is bool else ["None"] if tp is type(None) else None


def _given(argv: list[str], names: Sequence[str]) -> tuple[int | None, list[str]]:
    """(where in argv, the values given) at the last use of an option (tyro takes the last);
    (None, []) where argv does not name it."""
    spelt = {n.replace("_", "-") for n in names}
    for i in range(len(argv) - 1, -1, -1):
        flag, eq, value = argv[i].partition("=")
        if flag.replace("_", "-") in spelt:
            values = [value] if eq else []  # `--x=1 2`: tyro takes 1 and 2, as `--x 1 2`
            for token in argv[i + 1:]:
                if token.startswith("--"):
                    break
                values.append(token)
            return i, values
    return None, []


def _run_together(cls: type, argv: list[str], prog: str) -> str | None:
    """The line for the unknown options of `argv` where one starts with a one-letter option of
    `cls` (toymlx-generate's -n, -s, -p): argparse reads llama.cpp's -ngl as -n with the value
    `gl` and -sp as -s with `p`, so tyro would name the wrong flag or a stray value; None where
    there is no such token."""
    short = short_flags(cls)
    unknown = _unknown_options(cls, argv)
    if not any(not t.startswith("--") and t[:2] in short for t in unknown):
        return None
    return _unrecognized(unknown, cls, argv, prog)


def _unknown_options(cls: type, argv: list[str]) -> list[str]:
    """The tokens of `argv` that look like options `cls` does not have (`-m`, `--lora`)."""
    flags, short = _flags(cls), short_flags(cls)
    return [t for t in argv if t.startswith("-") and not _is_number(t) and t not in ("-", "--")
            and t.partition("=")[0].lstrip("-").replace("-", "_") not in flags
            and t.partition("=")[0] not in ("-h", "--help", *short)]


def flag_as_typed(argv: list[str], cls: type, name: str) -> str | None:
    """The option `name` (a field of `cls`, dotted where nested) as the command line `argv`
    spells it at its last use, as tyro takes it: an alias as typed (toymlx-eval's --limit,
    mlx_lm.evaluate's, for --max-examples; toymlx-generate's -n), so a line about it names what
    the user wrote; None where argv does not give it."""
    want = tuple(name.split("."))
    at, _ = _given(argv, ["--" + k for k, path in option_table(cls).items() if path == want]
                   + [a for a, field in short_flags(cls).items() if (field,) == want])
    return None if at is None else argv[at].partition("=")[0]


def line_as_typed(line: str, argv: list[str], cls: type) -> str:
    """`line` with each flag of an option of `cls` that its refusal proper names (up to its
    first "; ", `FILE_FLAG`: not inside a path or another word) as the command line `argv`
    spells that option (`flag_as_typed`: `-n` for --max-tokens, `--temp` for --temperature,
    `--weight_decay` for --weight-decay), where `argv` gives it; a flag `argv` does not give
    stays as it is, and so does the advice after the "; ", which names options by their own
    flags as --help lists them (`mlx_lm.generate's -m is --max-tokens`, not `... is -n`). For a
    refusal, which a command's checks word with the options' own flags: `--num-samples 2:
    expected a --prompt` after `-p "" --num-samples 2` named a flag the user never typed."""
    table = option_table(cls)

    def typed(m: re.Match) -> str:
        path = table.get(m[1].replace("-", "_"))
        return (flag_as_typed(argv, cls, ".".join(path)) if path else None) or m[0]

    said, sep, advice = line.partition("; ")
    return FILE_FLAG.sub(typed, said) + sep + advice


def _field_type(cls: type, path: tuple[str, ...]) -> Any:
    """The type of the field of `cls` at `path` (an `option_table` value, dotted where nested)."""
    node, tp = cls, None
    for name in path:
        tp = typing.get_type_hints(node)[name]
        node = tp if dataclasses.is_dataclass(tp) else node
    return tp


def _choices_as_declared(cls: type, argv: list[str]) -> list[str]:
    """`argv` with a choice typed in another case as the option declares it: llama-quantize
    takes its type names in any case and lists them in capitals (Q4_K_M), so `--dtype Q4_K_M`
    was refused where q4_k_m is offered. Only a value that matches one choice (not None, True,
    False: no value a choice stands for) is changed."""
    from toymlx.bundle.options import choice_as_declared

    table, out = option_table(cls), list(argv)
    for i, token in enumerate(argv):
        flag, eq, value = token.partition("=")
        path = table.get(flag[2:].replace("-", "_")) if flag.startswith("--") else None
        if path is None or not eq and i + 1 >= len(argv):
            continue
        value = value if eq else argv[i + 1]
        choices = [c for c in _choices(_field_type(cls, path)) or []
                   if c not in ("None", "True", "False")]
        if value not in choices and (same := choice_as_declared(choices, value)) is not None:
            if eq:
                out[i] = f"{flag}={same}"
            else:
                out[i + 1] = same
    return out


def _flags(cls: type) -> dict[str, bool]:
    """Every option of `cls` spelled as `option_table` spells them, tyro's `no_x` of a plain
    bool included -> whether it is a flag that takes no value (a plain bool)."""
    out = {}
    for key, path in option_table(cls).items():
        tp = _field_type(cls, path)
        out[key] = tp is bool
        if tp is bool:
            group, dot, leaf = key.rpartition(".")
            out[f"{group}{dot}no_{leaf}"] = True
    return out


PeerFlags = dict[str, tuple[tuple[str, str], ...]]
"""Another tool's flag as its users type it -> (an option the command must have, what to say
after the unknown flag) pairs; the first pair whose option the command has is said, in place
of the closest option by spelling, which misleads for these (block_size: --batch-size, --opt:
--stop-at, --amp: --warmup, init_from: --from). A flag with no counterpart is said where an
option of the commands it concerns is (`steps`: every toymlx-train recipe)."""

LLAMA_CPP_FLAGS: PeerFlags = {
    "-m": (("max_tokens", ("llama.cpp's -m is --model here, mlx_lm.generate's -m is "
                           "--max-tokens")),
           ("model", "did you mean --model?")),
    "--n-predict": (("max_tokens", "did you mean --max-tokens?"),),
    "-s": (("seed", "did you mean --seed?"),),
    "--lora": (("adapter", "llama.cpp's --lora FILE is --adapter FILE here (or the run's folder)"),
               ("model", ("llama.cpp's --lora FILE: here --model takes the LoRA run's folder "
                          "(its base and adapter), or a fused GGUF")),
               ("lora.init_adapter", ("llama.cpp's --lora FILE is --lora.init-adapter FILE here "
                                      "(the run's adapters start from it)"))),
    # llama.cpp's --lora-scaled FILE S (llama-cli, llama-server, llama-export-lora), and the
    # LoRA scale as mlx-lm's and PEFT's users spell it (closest by spelling: --lr-schedule)
    **dict.fromkeys(("--lora-scaled", "--lora-scale", "--lora_scaled", "--lora_scale"), (
        ("lora.alpha", ("llama.cpp's --lora-scaled FILE S and mlx-lm's LoRA scale are the "
                        "adapters' scale, here --lora.alpha / --lora.rank (scale 20 at rank 8: "
                        "--lora.alpha 160); --lora.init-adapter FILE starts them from a file")),
        ("adapter", ("llama.cpp's --lora-scaled FILE S is --adapter FILE here (or the run's "
                     "folder), at the scale it was trained with (S 1; no option scales it)")),
        ("model", ("llama.cpp's --lora-scaled FILE S: here --model takes the LoRA run's folder "
                   "(its base and adapter), at the scale it was trained with (S 1)")))),
    **dict.fromkeys(("-ngl", "--n-gpu-layers", "--gpu-layers"), (
        ("device", ("llama.cpp's -ngl is --device gpu here (the whole model on MLX's GPU; "
                    "--device cpu: none of it)")),)),
    **dict.fromkeys(("-cnv", "--conversation"), (("chat", "llama.cpp's -cnv is --chat here"),)),
    "--ctx-size": (("context_shift", ("llama.cpp's --ctx-size has no counterpart here: the "
                                      "model's own context is read (a from-scratch run's "
                                      "--seq-len), the text shifted past it "
                                      "(--no-context-shift stops there)")),
                   ("seq_len", "llama.cpp's --ctx-size is --seq-len here")),
    **dict.fromkeys(("-f", "--file"), (("prompt", "llama.cpp's -f FILE is --prompt - < FILE here"),)),
}
"""llama.cpp's flags (llama-cli, llama-completion, llama-perplexity) as its users type them
(toymlx-generate takes -p, -n, -s, -sys and --system-prompt as aliases; -s is named here for
toymlx-train); -m, which mlx_lm.generate spells for --max-tokens, is both where the command has
both; --lora is the adapter, or the run folder where a command takes the adapter with its base;
--lora-scaled too, at the adapter's own scale (a toymlx adapter is applied at its alpha / rank,
llama.cpp's S 1), or --lora.alpha where a run sets that scale."""

NANOGPT_FLAGS: PeerFlags = {
    "max_iters": (("steps", "nanoGPT's max_iters is toymlx's --steps"),),
    "learning_rate": (("lr", "nanoGPT's learning_rate is toymlx's --lr"),),
    "n_layer": (("model.n_layers", "nanoGPT's n_layer is toymlx's --model.n-layers"),
                ("lora.layers", ("nanoGPT's n_layer is toymlx's --model.n-layers, which a "
                                 "fine-tune does not take: the --base GGUF's own (--lora.layers "
                                 "N adapts its last N)"))),
    "n_head": (("model.n_heads", "nanoGPT's n_head is toymlx's --model.n-heads"),
               ("lora.layers", ("nanoGPT's n_head is toymlx's --model.n-heads, which a "
                                "fine-tune does not take: the --base GGUF's own"))),
    "n_embd": (("model.d_model", "nanoGPT's n_embd is toymlx's --model.d-model"),
               ("lora.layers", ("nanoGPT's n_embd is toymlx's --model.d-model, which a "
                                "fine-tune does not take: the --base GGUF's own"))),
    "block_size": (("seq_len", ("nanoGPT's block_size is toymlx's --seq-len (the model's longest: "
                                "--model.context)")),
                   ("model.patch_size", ("nanoGPT's block_size is toymlx's --seq-len, which "
                                         "vit-tiny does not take: its sequence is the image's "
                                         "patches, (--data.image-size / --model.patch-size)^2 "
                                         "of them"))),
    "gradient_accumulation_steps": (("grad_accum", ("nanoGPT's gradient_accumulation_steps is "
                                                    "toymlx's --grad-accum")),),
    "log_interval": (("report_every", "nanoGPT's log_interval is toymlx's --report-every"),),
    "eval_interval": (("eval_every", "nanoGPT's eval_interval is toymlx's --eval-every"),),
    "eval_iters": (("eval_batches", "nanoGPT's eval_iters is toymlx's --eval-batches"),),
    "warmup_iters": (("warmup", "nanoGPT's warmup_iters is toymlx's --warmup"),),
    "lr_decay_iters": (("steps", ("nanoGPT's lr_decay_iters is toymlx's --steps (the cosine "
                                  "decays over the whole run)")),),
    "min_lr": (("min_lr_ratio", ("nanoGPT's min_lr is toymlx's --min-lr-ratio x --lr (6e-5 of "
                                 "6e-4: 0.1)")),),
    "decay_lr": (("min_lr_ratio", ("nanoGPT's decay_lr False is toymlx's --min-lr-ratio 1 (no "
                                   "decay)")),),
    "out_dir": (("runs_root", ("nanoGPT's out_dir is toymlx's --runs-root and --run-id "
                               "(runs/RUN_ID)")),
                ("model", "nanoGPT's out_dir is toymlx's --model RUN_FOLDER")),
    "init_from": (("resume", "nanoGPT's init_from 'resume' is toymlx's --resume RUN_FOLDER"),
                  ("model", "nanoGPT's init_from is toymlx's --model RUN_FOLDER")),
    "eval_only": (("resume", "nanoGPT's eval_only is toymlx-eval --model RUN_FOLDER"),),
    "always_save": (("checkpoint_every", ("nanoGPT's always_save is toymlx's default (--keep-last "
                                          "N: fewer)")),),
    "wandb_log": (("report_to", "nanoGPT's wandb_log is toymlx's --report-to wandb"),),
    "dataset": (("data.image_size", ("nanoGPT's dataset is toymlx's --data.path (images here: "
                                     "class folders, MNIST's IDX files or a .npz)")),
                ("data.path", ("nanoGPT's dataset is toymlx's --data.path (a text file, not "
                               "prepare.py's .bin)")),),
    "dropout": (("model.drop_path", ("nanoGPT's dropout has no toymlx option (vit-tiny's "
                                     "regularizer is --model.drop-path, stochastic depth)")),
                ("steps", "nanoGPT's dropout has no toymlx option (its Llama has no dropout)"),),
    "bias": (("model.patch_size", ("nanoGPT's bias has no toymlx option (vit-tiny's ViT has "
                                   "biases, as timm's)")),
             ("steps", "nanoGPT's bias has no toymlx option (its Llama has no biases)"),),
    "backend": (("steps", ("nanoGPT's backend is toymlx-launch -n N -- toymlx-train ... (data "
                           "parallel)")),),
    "start": (("prompt", "nanoGPT's start is toymlx's --prompt TEXT (a file: --prompt - < FILE)"),),
    "max_new_tokens": (("max_tokens", "nanoGPT's max_new_tokens is toymlx's --max-tokens"),),
}
"""nanoGPT's train.py and sample.py settings (`--block_size=64`), by name."""

NANOGPT_SAMPLE_FLAGS: PeerFlags = {
    "dtype": (("max_tokens", ("nanoGPT's dtype has no toymlx-generate option: it holds the "
                              "model's weights as float32 on a CPU where memory allows, else as "
                              "the file's blocks")),),
    "compile": (("max_tokens", ("nanoGPT's compile has no toymlx-generate option: on a CPU its "
                                "one-token steps are traced with mx.compile already")),),
}
"""sample.py's settings that toymlx-train has as options (--dtype, --compile) and
toymlx-generate chooses itself (sample.py's `--dtype=float32` said only "got an unknown one");
said only to toymlx-generate, never as "not an option of" another command."""

TIMM_FLAGS: PeerFlags = {
    "--data-dir": (("data.path", ("timm's --data-dir is --data.path here (class subfolders, or "
                    "train/ and val/ of them)")),),
    "--epochs": (("steps", ("timm's --epochs is --steps here: optimizer steps, an epoch being "
                  "the training images / --batch-size")),),
    "--warmup-epochs": (("warmup", "timm's --warmup-epochs is --warmup here, in steps"),),
    "--img-size": (("data.image_size", "timm's --img-size is --data.image-size here"),),
    "--input-size": (("data.image_size", ("timm's --input-size C H W is --data.image-size H "
                      "here (square images; --data.channels C)")),),
    "-b": (("batch_size", "timm's -b is --batch-size here"),),
    "-j": (("data.workers", "timm's -j is --data.workers here"),),
    "--smoothing": (("label_smoothing", "timm's --smoothing is --label-smoothing here"),),
    "--drop-path": (("model.drop_path", "timm's --drop-path is --model.drop-path here"),),
    "--aa": (("data.trivial_augment", ("timm's --aa is --data.trivial-augment here "
              "(TrivialAugment, timm's --aa trivialaugment; no RandAugment)")),),
    "--hflip": (("data.flip", "timm's --hflip is --data.flip here (on or off)"),),
    "--scale": (("data.crop_scale", "timm's --scale MIN MAX is --data.crop-scale MIN here"),),
    "--clip-grad": (("grad_clip", "timm's --clip-grad is --grad-clip here"),),
    "--min-lr": (("min_lr_ratio", "timm's --min-lr is --min-lr-ratio here, a fraction of --lr"),),
    "--output": (("runs_root", "timm's --output is --runs-root here"),),
    "--experiment": (("run_id", "timm's --experiment is --run-id here"),),
    "--amp": (("dtype", "timm's --amp is --dtype bfloat16 here (float16: with a loss scale)"),),
    "--model": (("model.preset", ("timm's --model vit_tiny_patch16_224 is --model.preset "
                 "vit-tiny here (the recipe is the model; --model.* set its shape)")),),
    "--sched": (("lr_schedule", "timm's --sched is --lr-schedule here"),
                ("min_lr_ratio", ("the schedule is linear warm-up then cosine decay, the only "
                 "one (--warmup, --min-lr-ratio)")),),
    "--reprob": (("data.augment", ("random erasing has no counterpart here (--data.crop, "
                  "--data.flip, --data.trivial-augment, --data.mixup, --data.cutmix)")),),
    "--pretrained": (("model.preset", ("vit-tiny trains from scratch; there are no pretrained "
                      "weights to start from")),),
    "--num-classes": (("model.preset", ("the classes are the data's (class folders, or the "
                       "labels)")),),
    # flags whose closest spelling is another idea (--drop: --model.drop-path, --channels-last:
    # --data.channels, --model-ema: --model.n-heads, --initial-checkpoint: --grad-checkpoint)
    "--drop": (("model.drop_path", ("timm's --drop (dropout) has no counterpart here; the "
                "regularizer is --model.drop-path (timm's --drop-path)")),),
    "--channels-last": (("data.channels", ("timm's --channels-last (PyTorch's memory layout) "
                         "has no counterpart here; --data.channels is the images' channel "
                         "count (1 or 3)")),),
    "--model-ema": (("model.preset", ("timm's --model-ema has no counterpart here (no weight "
                     "averaging): each checkpoint holds the trained weights")),),
    "--initial-checkpoint": (("model.preset", ("timm's --initial-checkpoint has no counterpart "
                              "here: vit-tiny starts from random init (--resume RUN goes on "
                              "with a run of toymlx's)")),),
    "--eval-metric": (("keep_best", ("timm's --eval-metric has no counterpart here: --keep-best "
                       "N keeps the N checkpoints of lowest val_loss")),),
    "--checkpoint-hist": (("keep_last", ("timm's --checkpoint-hist is --keep-last here "
                           "(--keep-best N: the N of lowest val_loss)")),),
    "--ratio": (("data.crop_scale", ("timm's --ratio has no counterpart here: --data.crop "
                 "resized draws the aspect ratio in timm's default range, 3/4 to 4/3")),),
    "--warmup-lr": (("warmup", ("timm's --warmup-lr has no counterpart here: the warm-up rises "
                     "linearly from --lr / --warmup to --lr")),),
    "--lr-base": (("lr", ("timm's --lr-base has no counterpart here: --lr is the peak rate as "
                   "given, not scaled by --batch-size / 256")),),
    "--log-interval": (("report_every", "timm's --log-interval is --report-every here"),),
    "--dataset": (("data.path", ("timm's --dataset is --data.path here (class folders, CIFAR's "
                   "python batches, MNIST's IDX files or a .npz; no torch/ or hfds/ names)")),),
    **dict.fromkeys(("--train-split", "--val-split"), (
        ("data.val_path", ("timm's --train-split and --val-split are the folders train/ and "
                           "val/ (or validation/) under --data.path here, or --data.path TRAIN "
                           "--data.val-path VAL")),)),
    "--class-map": (("data.path", ("timm's --class-map has no counterpart here: the classes "
                     "are the class folders in sorted order (toymlx-export writes "
                     "class_map.txt for timm)")),),
    **dict.fromkeys(("--mean", "--std"), (
        ("data.image_size", ("timm's --mean and --std have no counterpart here: each channel is "
                             "standardised by the training split's own mean and std (in the "
                             "checkpoint)")),)),
    "--interpolation": (("data.image_size", ("timm's --interpolation has no counterpart here: "
                         "images are resized bicubic, as timm's vit_tiny_patch16_224")),),
    "--crop-pct": (("data.image_size", ("timm's --crop-pct has no counterpart here: the shorter "
                    "side is resized to --data.image-size and centre-cropped (crop_pct 1.0)")),),
}
"""timm's train.py flags."""

HF_FLAGS: PeerFlags = {
    "per_device_train_batch_size": (("batch_size", ("HF Trainer's per_device_train_batch_size is "
                                                    "toymlx's --batch-size")),),
    "gradient_accumulation_steps": (("grad_accum", ("HF Trainer's gradient_accumulation_steps is "
                                                    "toymlx's --grad-accum")),),
    "max_steps": (("steps", "HF Trainer's max_steps is toymlx's --steps"),),
    "num_train_epochs": (("steps", ("HF Trainer's num_train_epochs is toymlx's --steps, in "
                                    "optimizer steps (an epoch: the training rows / (--batch-size "
                                    "x --grad-accum))")),),
    "warmup_steps": (("warmup", "HF Trainer's warmup_steps is toymlx's --warmup"),),
    "warmup_ratio": (("warmup", ("HF Trainer's warmup_ratio is toymlx's --warmup, in steps (the "
                                 "ratio x --steps)")),),
    "lr_scheduler_type": (("lr_schedule", (
        "HF Trainer's lr_scheduler_type is toymlx's --lr-schedule, whose default warmup-cosine "
        "decays to --min-lr-ratio (0.1) x --lr: HF's cosine is --min-lr-ratio 0, its linear "
        "--lr-schedule linear_schedule --lr-schedule-args LR 0 STEPS-WARMUP (2e-4 0 55 for "
        "--steps 60 --warmup 5), its constant_with_warmup --lr-schedule constant")),),
    "max_grad_norm": (("grad_clip", "HF Trainer's max_grad_norm is toymlx's --grad-clip"),),
    "adam_beta2": (("beta2", ("HF Trainer's adam_beta2 is toymlx's --beta2 (HF's default 0.999; "
                              "toymlx's 0.95)")),),
    "adam_beta1": (("beta1", "HF Trainer's adam_beta1 is toymlx's --beta1"),),
    "adam_epsilon": (("adam_eps", "HF Trainer's adam_epsilon is toymlx's --adam-eps"),),
    "logging_steps": (("report_every", "HF Trainer's logging_steps is toymlx's --report-every"),),
    "eval_steps": (("eval_every", "HF Trainer's eval_steps is toymlx's --eval-every"),),
    "save_steps": (("checkpoint_every", "HF Trainer's save_steps is toymlx's --checkpoint-every"),),
    "save_total_limit": (("keep_last", "HF Trainer's save_total_limit is toymlx's --keep-last"),),
    "output_dir": (("runs_root", ("HF Trainer's output_dir is toymlx's --runs-root and --run-id "
                                  "(runs/RUN_ID)")),),
    "resume_from_checkpoint": (("resume", ("HF Trainer's resume_from_checkpoint is toymlx's "
                                           "--resume RUN_FOLDER")),),
    "bf16": (("steps", ("HF Trainer's bf16 is toymlx's --dtype bfloat16 (auto: bfloat16 on a "
                        "GPU, float32 on the CPU)")),),
    "fp16": (("steps", "HF Trainer's fp16 is toymlx's --dtype float16 (with a loss scale)"),),
    "gradient_checkpointing": (("grad_checkpoint", ("HF Trainer's gradient_checkpointing is "
                                                    "toymlx's --grad-checkpoint")),),
    "use_gradient_checkpointing": (("grad_checkpoint", ("Unsloth's use_gradient_checkpointing is "
                                                        "toymlx's --grad-checkpoint")),),
    "packing": (("data.pack", ("TRL's packing is toymlx's --data.pack, on by default (packing "
                               "False: --data.no-pack)")),),
    "dataset_text_field": (("data.path", ("TRL's dataset_text_field has no toymlx option: a "
                                          "record's keys name its shape (text, prompt and "
                                          "completion, messages, Alpaca's instruction, input and "
                                          "output)")),),
    "r": (("lora.rank", "PEFT's r is toymlx's --lora.rank"),),
    "lora_alpha": (("lora.alpha", ("PEFT's lora_alpha is toymlx's --lora.alpha (the adapters "
                                   "scaled by alpha / rank, as PEFT's)")),),
    "lora_dropout": (("lora.dropout", "PEFT's lora_dropout is toymlx's --lora.dropout"),),
    "target_modules": (("lora.targets", ("PEFT's target_modules is toymlx's --lora.targets, in "
                                         "short names (q_proj, ..., down_proj: "
                                         "q,k,v,o,gate,up,down; all-linear as PEFT's: every "
                                         "linear projection of the base's blocks)")),),
    "use_rslora": (("lora.alpha", ("PEFT's use_rslora has no toymlx option: the adapters are "
                                   "scaled by --lora.alpha / rank (rsLoRA's alpha / sqrt(rank): "
                                   "--lora.alpha alpha x sqrt(rank))")),),
    "random_state": (("seed", "Unsloth's random_state is toymlx's --seed"),),
    "load_in_4bit": (("base_dtype", ("Unsloth's load_in_4bit is a 4-bit --base GGUF (Q4_K_M, "
                                     "Q4_1) with --base-dtype blocks (its own blocks in memory; "
                                     "auto holds them where memory is short)")),),
    "model_name": (("base", "Unsloth's model_name is toymlx's --base (a GGUF, or hf:USER/REPO)"),),
    "train_on_responses_only": (("data.mask_prompt", (
        "Unsloth's train_on_responses_only is toymlx's default, --data.mask-prompt "
        "(--data.no-mask-prompt trains on the prompts too)")),),
    "quantization_method": (("fuse_at_end", ("Unsloth's quantization_method is toymlx's "
                                             "--fuse-at-end TYPE (or toymlx-export --fuse --dtype "
                                             "TYPE)")),
                            ("adapter", ("Unsloth's quantization_method is toymlx-export's "
                                         "--dtype (with --fuse: --dtype q4_k_m)"))),
}
"""Hugging Face's (Trainer's, TRL's SFTConfig's, PEFT's LoraConfig's) and Unsloth's settings
(Unsloth's notebooks: r, lora_alpha, target_modules, max_steps, ...), by name; a setting spelt
as toymlx's option (seed, weight_decay, report_to) needs none, mlx-lm's (learning_rate,
max_seq_length) is said by `mlx_lm_hint`."""

PEER_VALUES = {"--input-size": 3, "--scale": 2, "--ratio": 2, "--mean": 3, "--std": 3,
               "--lora-scaled": 2}
"""How many values those of the peers' flags that take more than one take (timm's
`--input-size 3 32 32`, or `--input-size=3 32 32`, its `=` value the first; its `--mean` and
`--std` of three channels; llama.cpp's `--lora-scaled FILE S`): each is the flag's own, not a
value no option takes."""


LAUNCHER_FLAGS: PeerFlags = {
    flag: (("n", f"{tool} {flag} is toymlx-launch's -n"),
           ("steps", (f"{tool} {flag} is toymlx-launch's -n: toymlx-launch -n N -- toymlx-train "
                     "...")))
    for tool, spellings in (("torchrun's", ("--nproc_per_node", "--nproc-per-node")),
                            ("accelerate launch's", ("--num_processes", "--num-processes")),
                            ("mpirun's", ("-np",)))
    for flag in spellings}
"""Other launchers' flags for the number of processes, toymlx-launch's -n (argparse refused
them as "unrecognized arguments" without naming -n); given to toymlx-train itself (as
`torchrun --nproc_per_node 2 train.py` reads), the launcher to run it under."""


OPTIMIZER_FLAGS: PeerFlags = {
    flag: (("optimizer", f"{whose} is --optimizer here{values}"),
           ("weight_decay", ("this recipe trains with AdamW only (--lr, --weight-decay, "
                             "--beta1, --beta2)")))
    for flag, whose, values in (
        ("--opt", "timm's and mlx_lm.lora's --opt", ""),  # mlx-lm's: argparse's abbreviation
        ("--optim", "HF Trainer's --optim",  # of --optimizer; Unsloth's notebooks: adamw_8bit
         " (its adamw_torch and adamw_8bit: adamw, whose moments are float32)"))}
"""Other trainers' flags that choose the optimizer, for every recipe: lora's --optimizer, or
the recipe's one optimizer (the others: AdamW). Not in timm's table, which only a command that
trains images reads: lora's --opt said "a flag for images" where it has --optimizer."""


RECIPE_FLAGS: PeerFlags = {
    "--tokenizer": (("donor", ("warm-start's tokenizer is its --donor's (the table's rows are "
                               "its tokens); another GGUF's tokenizer from random init: "
                               "--recipe from-scratch --tokenizer FILE")),),
    "--donor": (("tokenizer", ("--donor is warm-start's (a GGUF's token table and tokenizer): "
                               "--recipe warm-start --donor FILE; here --tokenizer FILE takes "
                               "a GGUF's tokenizer alone")),),
    "--base": tuple((option, ("--base is lora's (fine-tunes that GGUF): --recipe lora --base "
                              f"FILE; {here}")) for option, here in (
        ("tokenizer", "here --tokenizer FILE takes its tokenizer alone"),
        ("donor", "here --donor FILE takes its token table and tokenizer"))),
}
"""The text recipes' model flags given to another of them (`toymlx-train --recipe warm-start
--tokenizer FILE` said only "got an unknown one"): whose flag it is, and this recipe's own."""


TRAIN_FLAGS: PeerFlags = {
    "--from": tuple((option, ("--from is toymlx-train's (the checkpoint a resume goes on from); "
                              "here give that checkpoint's file where you give the run folder: "
                              "RUN/weights/step_N.gguf (a LoRA run's: "
                              "RUN/weights/adapter_step_N.gguf)")) for option in ("model",
                                                                                  "adapter")),
}
"""toymlx-train's flags given to a command that reads a run (toymlx-eval, -generate, -export):
`--from step_10` was "did you mean --prompt?" or no hint, where the checkpoint is named by its
file, given where the run folder goes (--model, or toymlx-export's --adapter)."""


def peer_hint(table: PeerFlags, flag: str, options: Container[str]) -> str | None:
    """What `table` says of another tool's `flag` to a command with `options`: the text of its
    first pair whose option the command has; None for a flag the table lacks."""
    return next((text for option, text in table.get(flag, ()) if option in options), None)


def flag_hint(flag: str, flags: dict[str, bool], prog: str) -> str | None:
    """What to say after an unknown flag: toymlx's name for llama.cpp's, another launcher's,
    another trainer's optimizer flag, timm's, mlx-lm's, Hugging Face's and Unsloth's or
    nanoGPT's flag (`PeerFlags`, `mlx_lm_hint`), else the closest option by spelling. timm's are
    said only where `prog` trains images (its texts are vit-tiny's: "the training images",
    "--model.preset vit-tiny"), mlx-lm's only where it takes a --base (lora, toymlx-export) or
    stands in for an mlx-lm command (toymlx-generate, toymlx-eval: `MLX_LM_COMMAND_KEYS`),
    Hugging Face's only where it takes a --base. A peer's flag whose counterpart `prog` lacks
    (another recipe's or command's: vit-tiny has no --seq-len, from-scratch no image flag) is
    named as that option, not matched by spelling (block_size: --batch-size, --drop-path:
    --stop-at). `flag` may be a config file's key (`lora_scale`): the peers' flags are looked up
    as the flag it spells (--lora-scale)."""
    name = flag.lstrip("-").replace("-", "_")  # nanoGPT's `--NAME=VALUE`, hyphens taken too
    spelt = flag if flag.startswith("-") else "--" + name.replace("_", "-")
    # mlx_lm.lora's flags where a --base is fine-tuned, mlx_lm.fuse's and generate's where a
    # command stands in for them (`--iters` as `iters`)
    if ("base" in flags or prog in MLX_LM_COMMAND_KEYS) and (said := mlx_lm_hint(flag, prog)):
        return said
    images = "data.image_size" in flags  # vit-tiny's option: the command trains images
    tables = ((RECIPE_FLAGS, spelt), (TRAIN_FLAGS, spelt), (LLAMA_CPP_FLAGS, spelt),
              (LAUNCHER_FLAGS, spelt),
              (OPTIMIZER_FLAGS, spelt),
              *(((TIMM_FLAGS, spelt),) if images else ()),
              *(((HF_FLAGS, name),) if "base" in flags else ()), (NANOGPT_FLAGS, name),
              (NANOGPT_SAMPLE_FLAGS, name))
    for table, key in tables:
        if said := peer_hint(table, key, flags):
            return said
    if flag in TIMM_FLAGS:  # its counterparts are vit-tiny's
        return (f"timm's {flag} is a flag for images (toymlx-train --recipe vit-tiny); not an "
                f"option of {prog}")
    if name in NANOGPT_FLAGS:
        return f"{NANOGPT_FLAGS[name][0][1]}; not an option of {prog}"
    close = closest_option(flag, flags)
    return f"did you mean {close}?" if close else None


def _takes_positionals(cls: type) -> bool:
    """Whether `cls` has a positional field (toymlx-classify's images)."""
    import tyro

    return any(tyro.conf.Positional in typing.get_args(tp)
               for tp in typing.get_type_hints(cls, include_extras=True).values())


def _unrecognized(tokens: list[str], cls: type, argv: list[str], prog: str) -> str:
    """tyro's unrecognized tokens as one line: each unknown option with the closest flag of
    `cls`; a value no option takes with the option before it (a flag that takes no value).
    Where `cls` takes positionals, tyro hands back every token after an unknown option, the
    positionals among them (`--topk 2 a.png`): no value is named there, an image being one."""
    flags = _flags(cls)
    positionals = _takes_positionals(cls)
    parts, at, owed = [], 0, 0
    for token in tokens:
        flag, eq, value = token.partition("=")
        if positionals and not (flag.startswith("-") and flag != "-" and not _is_number(flag)):
            continue
        if flag.startswith("--") or (flag.startswith("-") and not _is_number(flag)):
            hint = flag_hint(flag, flags, prog)
            parts.append(f"{flag}: expected an option of {prog}, got an unknown one"
                         + (f"; {hint}" if hint else ""))
            # the values right after it are its own (`=`'s the first), not a second finding
            owed = PEER_VALUES.get(flag, 1) - bool(eq)
            at = _position(argv, token, at, flags) + 1
            continue
        if owed and _position(argv, token, at, flags) == at:
            owed -= 1
            at += 1
            continue
        owed = 0  # another option came between: the unknown flag's values have ended
        at = _position(argv, token, at, flags)
        before, _, value = argv[at].partition("=") if at < len(argv) else ("", "", "")
        if value != token and at > 0:
            before = argv[at - 1].partition("=")[0]
        if flags.get(before.lstrip("-").replace("-", "_")):
            bool_flag = before.lstrip("-").replace("-", "_")
            group, dot, leaf = bool_flag.rpartition(".")
            other = (f"{group}{dot}{leaf[3:]}" if leaf.startswith("no_")
                     else f"{group}{dot}no_{leaf}")
            parts.append(f"{before}: expected no value (a flag; --{other.replace('_', '-')} "
                         f"{'sets it true' if leaf.startswith('no_') else 'sets it false'}), "
                         f"got {token!r}")
        else:
            # the two tokens before it, or one `--x=v` (the flag and its value)
            shown = argv[at - 1:at] if at > 0 and _is_inline(argv[at - 1]) else \
                argv[max(at - 2, 0):at]
            parts.append(f"{token!r}: expected an option of {prog}, got a value no option "
                         "takes" + (f" (after {' '.join(shown)})" if at > 0 else "")
                         + _report_to_hint(argv, at))
        at += 1  # a second token spelt the same is a later one (`32 32` named twice the first)
    return "; ".join(parts)


def _report_to_hint(argv: list[str], at: int) -> str:
    """HF Trainer's `--report_to tensorboard wandb` (a list of words): the one comma list that
    --report-to takes; "" when argv[at] is not such a word."""
    from toymlx.bundle.reporters import REPORTERS

    start = at
    while start > 0 and not argv[start - 1].startswith("-"):
        start -= 1
    flag, eq, first = argv[start - 1].partition("=") if start > 0 else ("", "", "")
    words = ([first] if eq else []) + argv[start:at + 1]
    if (flag.replace("_", "-") != "--report-to" or not eq and start == at
            or any(w.lower() not in REPORTERS for w in words[-1:])):
        return ""
    return f"; --report-to takes one comma list: --report-to {','.join(words)}"


def _position(argv: list[str], token: str, start: int, flags: dict[str, bool]) -> int:
    """Where `token` (or a flag's `--compile=token`) is in argv from `start`, passing over the
    value of an option that takes one (`1` of `--steps 1`, and of `--steps=1`, when
    `--compile=1` is refused); len(argv) where it is not."""
    for i in range(start, len(argv)):
        before = argv[i - 1].lstrip("-").replace("-", "_") if i > 0 else ""
        taken = argv[i - 1].startswith("--") and flags.get(before) is False
        name, eq, value = argv[i].partition("=")
        flag = name.startswith("--") and flags.get(name.lstrip("-").replace("-", "_")) is True
        if (argv[i] == token and not taken) or (eq and value == token and flag):
            return i
    return len(argv)


def _is_inline(token: str) -> bool:
    """`--x=v` (or `-x=v`): an option and its value in one token."""
    return token.startswith("-") and "=" in token and not _is_number(token)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
