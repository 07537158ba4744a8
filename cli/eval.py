"""toymlx-eval --model runs/<id>|ckpt.gguf: evaluate a checkpoint on held-out data.

A ViT checkpoint reports accuracy, per-class accuracy and a confusion matrix on the validation
split of its image data (the run's own data for a run directory; every image with --split all;
the run's --data.test-path with --split test; a PNG of the matrix with --plot); a llama
checkpoint reports loss and perplexity on a text file (a from-scratch or warm-start run: its
own data, and with --split test its data folder's test.jsonl); a lora run (any
--fine-tune-type) on its chat/SFT validation rows, as is its fused file outside the run (from
the run's settings the file records, `FileRun`), and with --split test (a lora run or a llama
GGUF of its own) on test.jsonl. --split test scores what `toymlx-train --test` scores.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, NamedTuple

import tyro
from toymlx_cli import console_command, run_command

import toymlx  # noqa: F401  (loads the optimised BLAS before mlx)


@dataclass
class Args:
    """Evaluate a toymlx checkpoint (ViT or Llama)."""

    model: str
    """A checkpoint GGUF or a run directory (uses weights/latest)."""
    data_path: Annotated[str | None, tyro.conf.arg(aliases=("--data.path",))] = None
    """Images (an ImageFolder, CIFAR batches, IDX, .npz); for a Llama, a UTF-8 text file or
    chat/SFT examples (a .jsonl, .json, .csv or .tsv file, or a data folder in mlx-lm's layout:
    train.jsonl, valid.jsonl, test.jsonl); default: the data of the run --model belongs to (the
    same held-out split its training evaluated), else the digits fixture or the Python docs.
    Data the run did not train on is scored whole (--split all) unless --split says otherwise;
    a data folder scored by a model outside a run (a GGUF of its own) is read as
    `mlx_lm.lora --test` reads it (`--split test`, `--seq-len` 2047, no prompt mask)."""
    split: Literal["val", "all", "test", "valid"] | None = None
    """Evaluate the validation split (the same fixed split training used; valid, mlx-lm's name
    for it, is val), every example, or the test set `toymlx-train --test` scores (mlx_lm.lora's
    --test): a ViT run's --data.test-path, a text or LoRA run's data folder's test.jsonl
    (--data.path here: every image of it, a data folder's test.jsonl, or a JSONL file of chat
    examples). Default: val on the run's own data, all on --data.path data the run did not
    train on; for a model outside a run, test on a data folder holding a test.jsonl (what
    `mlx_lm.lora --test` scores)."""
    batch_size: int | None = None
    """Examples per forward pass (a text model's windows: this over 16). Default: on a run's
    own validation split, the run's --batch-size (config.json), so that the batches are those
    its eval events scored; for a model outside a run on a data folder, 4 (mlx_lm.lora's
    batch_size: rows of up to 2047 tokens); else 256. The loss is the same at any."""
    eval_batches: int | None = None
    """A run's own validation split (--split val on its data): score its first N batches of
    --batch-size (a text run: N x --batch-size windows spread over the split), as
    `toymlx-train --eval-batches` does; -1 (mlx-lm's --val-batches -1): every row. Default:
    the run's own --eval-batches (config.json), so the loss is its last eval event's."""
    seq_len: int | None = None
    """Llama only: tokens per window, or targets per chat/SFT row (an example cut there).
    Default: a run's own --seq-len; for a model outside a run, on a data folder 2047 (mlx-lm's
    max_seq_length 2048 tokens, 2047 targets), else 256; either cut to the model's context
    where that is shorter."""
    max_examples: Annotated[int | None, tyro.conf.arg(aliases=("--limit",))] = None
    """Score only the first N examples of the split, in its fixed order (the same ones every
    call), for a quick estimate: images (a ViT), windows of --seq-len tokens (a text run),
    chat/SFT rows (a LoRA run; a Llama GGUF on chat examples); the report says N of how many.
    More than the split holds scores all of it. Default: the whole split."""
    max_examples_flag: str = dataclasses.field(init=False, default="--max-examples")
    """--max-examples as the command line spells it (--limit, mlx_lm.evaluate's), else as a -c
    file's key spells it (`limit`, `file_words`): what the report and a refusal name
    (`flag_as_typed`); not an option."""
    data_pack: Annotated[bool, tyro.conf.arg(
        name="data.pack", help_behavior_hint="(default: a run's own, else off)"),
        tyro.conf.FlagCreatePairsOff] = False
    """Chat/SFT examples: run them together into rows of --seq-len (attention crossing from one
    example into the next), as a toymlx lora run trains and validates them by default (its
    --data.pack). Default: a run's own rows (a run, or a fused file recording its run);
    for a model outside a run, one example a row (--data.no-pack)."""
    data_no_pack: Annotated[bool, tyro.conf.arg(
        name="data.no-pack", help_behavior_hint="(default: a run's own, else on)"),
        tyro.conf.FlagCreatePairsOff] = False
    """Chat/SFT examples: one example a row, cut at --seq-len, as mlx-lm's evaluate
    (`mlx_lm.lora --test`) and a toymlx lora run of --data.no-pack score them: the default for
    a model outside a run; for a run, its own (packed) rows scored so instead."""
    data_mask_prompt: Annotated[bool, tyro.conf.arg(
        name="data.mask-prompt", help_behavior_hint="(default: a run's own, else see below)"),
        tyro.conf.FlagCreatePairsOff] = False
    """Chat/SFT examples: score the answers alone (prompts and chat headers get no loss). On a
    data folder scored by a model outside a run: mlx_lm.lora's --mask-prompt (the last message
    alone); else as a toymlx lora run's --data.mask-prompt (every assistant turn, or the run's
    --data.train-turns). Default: a run's own; for a model outside a run, off on a data folder
    (mlx-lm's default: every token of a row scored), on for a single file."""
    data_no_mask_prompt: Annotated[bool, tyro.conf.arg(
        name="data.no-mask-prompt", help_behavior_hint="(default: a run's own, else see above)"),
        tyro.conf.FlagCreatePairsOff] = False
    """Chat/SFT examples: score every token of a row, prompts and chat headers too, as mlx-lm
    does without --mask-prompt and a toymlx lora run of --data.no-mask-prompt."""
    data_drop_tools: Annotated[bool, tyro.conf.arg(
        name="data.drop-tools", help_behavior_hint="(default: a run's own, else off)"),
        tyro.conf.FlagCreatePairsOff] = False
    """Chat examples: leave out each record's "tools" before the chat template renders them,
    as a lora run of --data.drop-tools does (a run's own setting by default): for a template
    that never reads them, which refuses them otherwise."""
    data_keys: Annotated[tuple[str, ...], tyro.conf.arg(
        name="data.keys", help_behavior_hint="(default: a run's own, else none)")] = ()
    """Chat/SFT examples: row keys read under other names, as KEY=NAME (KEY: prompt,
    completion, text or messages), as a lora run's --data.keys reads them: `--data.keys
    prompt=question completion=answer` scores {"question", "answer"} rows as prompt and
    completion. Default: a run's own (the keys it trained with); none for a model outside a
    run."""
    device: Literal["auto", "gpu", "cpu"] = "auto"
    """Where MLX runs."""
    plot: str | None = None
    """ViT only: also write the confusion matrix as a PNG to this path (needs matplotlib, the
    report extra)."""
    overwrite: bool = False
    """Replace an existing --plot file; without it, an existing one is refused."""
    json: bool = False
    """ViT only: print the report as JSON (per-class accuracy and the matrix) instead of text."""
    progress: bool = True
    """A progress bar on stderr where it is a terminal, counting the images, windows or chat
    rows scored of the split's total (--no-progress: none); stdout holds the report alone."""


PROG = "toymlx-eval"


def _adapter_alone(path: Path, metadata: dict[str, Any]) -> str:
    """Why a LoRA adapter GGUF outside its run is not scored (eval has no --adapter or --base),
    and the two ways that are: its run folder, or the fused model (its recorded base named)."""
    import shlex

    base = metadata.get("toy.base")
    fuse = shlex.join(["toymlx-export", "--adapter", str(path), "--base",
                       base if isinstance(base, str) else "BASE.gguf", "--fuse", "--out",
                       "fused.gguf"])
    return (f"{path}: --model: expected a model GGUF or a run folder, found a LoRA adapter "
            "outside its run (no tokenizer or base weights); give its run folder (--model "
            f"runs/RUN), or fuse it with its base first: {fuse}, then {PROG} --model fused.gguf")


@console_command("toymlx-eval")
def main(argv: list[str] | None = None) -> int:
    from toymlx_cli.config_file import given_file_keys
    from toymlx_cli.usage import flag_as_typed

    given = sys.argv[1:] if argv is None else argv
    typed = flag_as_typed(given, Args, "max_examples")

    def run(args: Args) -> int:  # the -c file read (`run_command`): its key as it spells it
        path, keys = given_file_keys(Args, given)
        args.max_examples_flag = typed or keys.get("--max-examples", args.max_examples_flag)
        return show(args, path, keys)

    # argv as given: None, the console script, sets up its streams and heap (`run_command`)
    return run_command(PROG, Args, run, argv, outputs=("plot",))


def show(args: Args, config: str | None = None, keys: dict[str, str] | None = None) -> int:
    """Evaluate and print: the text report (a ViT), or JSON. `config`, `keys`: the -c file and
    the options it sets, as `given_file_keys` reads them."""
    check_sizes(args, config, keys or {})
    out = evaluate(args)
    text = out.pop("text", None)
    print(text if text is not None and not args.json else json.dumps(json_safe(out)))
    return 0


def check_sizes(args: Args, config: str | None = None, keys: dict[str, str] | None = None
                ) -> None:
    """--batch-size and --seq-len are counts: 0 or less is a typo, never "the default". `config`
    and `keys`: the -c file and {flag: its key} of the options it sets (`given_file_keys`)."""
    if args.batch_size is not None and args.batch_size < 1:
        raise ValueError(f"--batch-size: expected >= 1 examples per forward pass, found "
                         f"{args.batch_size}")
    if args.eval_batches is not None and args.eval_batches < 1 and args.eval_batches != -1:
        raise ValueError(f"--eval-batches: expected >= 1 batches, or -1 (every validation row), "
                         f"found {args.eval_batches}")
    if args.eval_batches is not None and args.max_examples is not None:
        raise ValueError(subset_conflict(args, config, keys or {}))
    if args.data_pack and args.data_no_pack:
        raise ValueError("--data.pack, --data.no-pack: expected one of them, got both")
    if args.data_mask_prompt and args.data_no_mask_prompt:
        raise ValueError("--data.mask-prompt, --data.no-mask-prompt: expected one of them, got "
                         "both")
    if args.seq_len is not None and args.seq_len < 1:
        raise ValueError(f"--seq-len: expected >= 1 tokens (or leave it out: the run's own, "
                         f"else 256), found {args.seq_len}")
    if args.max_examples is not None and args.max_examples < 1:
        # a file's key is named by its file (`file_key_error`) from the option's flag
        flag = args.max_examples_flag if args.max_examples_flag.startswith("-") else \
            "--max-examples"
        raise ValueError(f"{flag}: expected >= 1 examples to score (or leave it out: the whole "
                         f"split), found {args.max_examples}")


def subset_conflict(args: Args, config: str | None, keys: dict[str, str]) -> str:
    """The line refusing --eval-batches with --max-examples, each named where it was given: a -c
    file's key as the file spells it (`keys`, `given_file_keys`), after the file's name, else
    the flag as typed (--limit)."""
    given = [("--eval-batches", "--eval-batches", args.eval_batches),
             ("--max-examples", args.max_examples_flag, args.max_examples)]
    said = [f"{keys[f]!r} ({value})" if f in keys else f"{typed} {value}"
            for f, typed, value in given]
    rest = (f"expected one of them ({args.max_examples_flag} scores the first N of the whole "
            "split); drop one")
    in_file = [f for f, _, _ in given if f in keys]
    if not in_file:
        return f"{' '.join(said)}: {rest}"
    if len(in_file) == 2:
        return f"{config}: keys {said[0]} and {said[1]}: {rest}"
    said = [f"key {one}" if f in keys else one for one, (f, _, _) in zip(said, given)]
    return f"{config}: {said[0]} and {said[1]}: {rest}"


def subset(limit: int | None, scored: int, total: int, split: str, unit: str,
           rows: str = "", tail: str = "", flag: str = "--max-examples") -> dict:
    """The report's words on how much of `split` --max-examples `limit` (`flag`, as typed)
    scored: `scored` of its `total` `unit`s (`unit` one, as `counted` takes it: "example";
    `tail` after it: " of 16 tokens"; `rows`: what they made, said first); nothing without the
    flag. A split of one
    is "the only validation example", not "all 1 validation examples"."""
    from toymlx.backend.files import counted

    if limit is None:
        return {}
    which = {"val": "validation ", "test": "test "}.get(split, "")
    whole = counted(total, which + unit) + tail
    part = (f"the first {scored} of {whole}" if scored < total else
            f"all {whole}" if total != 1 else f"the only {which}{unit}{tail}")
    return {"subset": f"{rows}{part} ({flag} {limit})", "scored": scored, "of": total}


class RunRows(NamedTuple):
    """Which validation rows (text windows, images) a pass against a run scores: `batches`
    batches of `batch_size` (None: every row), as the run's own validation picks them (the
    first rows; a text run's windows spread over the split); `own` where that is the run's
    own --eval-batches and --batch-size, whose loss is then its eval events'."""

    batch_size: int
    batches: int | None
    own: bool
    where: str = "its config.json"
    """Where the run's own --eval-batches and --batch-size were read (a fused file's
    toy.run_data)"""

    def words(self, scored: int, total: int, unit: str) -> dict:
        """The report's words on the rows scored (`scored` of the split's `total` `unit`s), as
        `subset` gives them for --max-examples."""
        from toymlx.backend.files import counted

        whole = counted(total, f"validation {unit}")
        if self.batches is None:
            said = f"all {whole} (--eval-batches -1)"
        else:
            part = f"{scored} of {whole}" if scored < total else f"all {whole}"
            rule = f"--eval-batches {self.batches} x --batch-size {self.batch_size}"
            more = "; --eval-batches -1 scores all" if scored < total else ""
            said = (f"the run's eval rows: {part} ({rule}, {self.where}){more}" if self.own
                    else f"{part} ({rule}){more}")
        return {"subset": said, "scored": scored, "of": total}


def run_rows(cfg: Any, eval_batches: int | None = None, batch_size: int | None = None,
             seq_len: int | None = None, where: str = "its config.json") -> RunRows:
    """The validation rows a pass against the run of config `cfg` scores: those of its own
    validation (--eval-batches x --batch-size of its config.json, the rows its eval events
    score), unless `eval_batches` (-1: every row) or `batch_size` (toymlx-eval's flags) say
    otherwise; a `seq_len` other than the run's makes other windows. The one rule toymlx-eval
    and toymlx-export --fuse score held-out rows of a run by."""
    size = cfg.batch_size if batch_size is None else batch_size
    batches = cfg.eval_batches if eval_batches is None else eval_batches
    own = (size, batches) == (cfg.batch_size, cfg.eval_batches) and seq_len in (
        None, getattr(cfg, "seq_len", None))
    return RunRows(size, None if batches == -1 else batches, own, where)


def check_no_eval_batches(args: Args, found: str) -> None:
    """--eval-batches picks a run's own validation rows: given where eval scores other data
    (`found`), it is refused in one line, not ignored."""
    if args.eval_batches is not None:
        raise ValueError(f"--eval-batches {args.eval_batches}: expected a run's own validation "
                         f"split to take batches of (--split val on its data), found {found}; "
                         "drop --eval-batches (that split is scored whole)")


def pack_flag(args: Args) -> bool | None:
    """--data.pack (True) or --data.no-pack (False) as given; None: neither (a run's own)."""
    return True if args.data_pack else False if args.data_no_pack else None


def mask_flag(args: Args) -> bool | None:
    """--data.mask-prompt (True) or --data.no-mask-prompt (False) as given; None: neither."""
    return True if args.data_mask_prompt else False if args.data_no_mask_prompt else None


def chat_flags(args: Args) -> list[str]:
    """The flags given that build chat/SFT rows (--data.pack, --data.no-mask-prompt, ...)."""
    return [name for flag, yes in ((pack_flag(args), "pack"), (mask_flag(args), "mask-prompt"))
            if flag is not None for name in [f"--data.{'' if flag else 'no-'}{yes}"]] + [
        "--data.drop-tools"] * args.data_drop_tools + ["--data.keys"] * bool(args.data_keys)


def mlx_lm_folder(args: Args, cfg: Any) -> bool:
    """Whether chat/SFT rows are built as `mlx_lm.lora --test` builds them: --data.path a data
    folder (mlx-lm's layout) scored by a model outside a run (`cfg` None), whose rows no run's
    settings decide; then `outside_rows`' settings, unless flags say."""
    return cfg is None and args.data_path is not None and Path(args.data_path).is_dir()


def chat_pack(cfg: Any, given: bool | None) -> bool:
    """Whether chat/SFT rows are packed: as given (--data.pack, --data.no-pack), else as the
    run of config `cfg` packed them (its --data.pack), else (a model outside a run) one example
    a row, as mlx-lm's evaluate scores them: a loss of each example's own tokens, whatever
    precedes it in the file."""
    if given is not None:
        return given
    data = getattr(cfg, "data", None)
    return bool(getattr(data, "pack", False))


class ChatRows(NamedTuple):
    """How a model outside a run builds chat/SFT rows (no run's settings decide them):
    --seq-len (None: eval's 256), --data.mask-prompt, --data.train-turns, `said`, the words
    naming them in eval's line (`own_rows_note`), and the rows a forward pass takes (its
    --batch-size: the loss is the same at any, the memory is not)."""

    seq_len: int | None
    mask: bool
    turns: str
    said: str
    batch_size: int


def outside_rows(args: Args, model: Any) -> ChatRows:
    """The chat/SFT rows of a model outside a run: on a data folder (`mlx_lm_folder`), those of
    `mlx_lm.lora --test`, from mlx_lm/lora.py's defaults (`MLX_LM_DEFAULTS`): max_seq_length
    2048 tokens, 2047 targets (cut to `model`'s context where shorter, as an explicit --seq-len
    over it is refused), mask_prompt off, and masked the last message alone trained (its
    mask_prompt, `MLX_LM_FIXED`); on a file, eval's own: prompts masked, assistant turns
    trained; rows a pass: mlx-lm's batch_size 4 on a data folder (2047-target rows, 256 a pass,
    held 64 x 9 x 1632^2 float32 attention probabilities at once: 8 GB of RSS for SmolLM2),
    eval's 256 on a file. --seq-len, --data.mask-prompt and --batch-size as given win."""
    from toymlx_cli.mlx_lm_config import MLX_LM_DEFAULTS, MLX_LM_FIXED

    given = mask_flag(args)
    if not mlx_lm_folder(args, None):
        mask = True if given is None else given
        return ChatRows(args.seq_len, mask, "assistant", "prompts masked, assistant turns "
                        "trained" if mask else "every token scored (--data.no-mask-prompt)",
                        args.batch_size or 256)
    longest = MLX_LM_DEFAULTS["max_seq_length"] - 1
    context = model_context(model) or longest
    seq_len = args.seq_len or min(longest, context)
    mask = MLX_LM_DEFAULTS["mask_prompt"] if given is None else given
    cut = (f"its max_seq_length {longest + 1} tokens" if seq_len == longest else
           f"its max_seq_length {longest + 1} cut to the model's context {context}")
    said = ("as mlx_lm.lora --test builds them: "
            + ("" if args.seq_len else f"--seq-len {seq_len} from {cut}, ")
            + ("prompts masked, the last message trained (its --mask-prompt)" if mask else
               "every token scored (no --mask-prompt" + (", its default)" if given is None
                                                          else ")")))
    return ChatRows(seq_len, mask, MLX_LM_FIXED["data.train_turns"] if mask else "assistant",
                    said, args.batch_size or MLX_LM_DEFAULTS["batch_size"])


def check_no_pack(args: Args, found: str) -> None:
    """--data.pack, --data.mask-prompt and their no- forms build chat/SFT rows: given where
    eval scores other data (`found`: images, text windows), refused in one line, not ignored,
    ending "drop it" as train's refusal on text rows does (`chat_flags_on_text`)."""
    if flags := chat_flags(args):
        name = ", ".join(flags)
        raise ValueError(f"{name}: expected chat/SFT examples to build rows of (a JSONL file or "
                         f"data folder of prompt/completion or messages), found {found}; drop "
                         f"{'it' if len(flags) == 1 else 'them'}")


def bar_name(args: Args) -> str | None:
    """The name of the scoring pass's progress bar, None where --no-progress hides it."""
    return PROG if args.progress else None


def check_no_plot(args: Args, found: str) -> None:
    """--plot draws a ViT's confusion matrix: given for a language model, it is refused before
    the work, not skipped with exit status 0 and no file."""
    if args.plot:
        raise ValueError(f"--plot {args.plot}: expected a ViT model (it draws the confusion "
                         f"matrix of its classes), found {found} ({args.model}); drop --plot")


def model_context(model: Any) -> int | None:
    """The context length a Llama was trained for (its GGUF's <arch>.context_length)."""
    return getattr(getattr(model, "args", None), "context", None)


def check_context(seq_len: int, model: Any, path: Any) -> None:
    """A window no longer than the model was trained for: RoPE beyond its context gives a loss
    of a model it never was."""
    context = model_context(model)
    if context is not None and seq_len > context:
        raise ValueError(f"--seq-len: expected at most {context} (the context length of "
                         f"{path}), found {seq_len}")


def check_window(n: int, seq_len: int, split: str, source: Any, whole: int) -> None:
    """The `n` tokens of the split eval scores hold one window of --seq-len and the token after
    it; else one line in eval's own flags (`TokenData`'s check speaks of training's splits)."""
    if n > seq_len:
        return
    found = f"{n} in its validation split (of its {whole})" if split == "val" else \
        f"{n} in its test set" if split == "test" else str(n)
    fixes = [f"a shorter --seq-len ({n - 1} or less)"] if n >= 2 else []
    # --split all alone is said only where the whole text holds a window: else it fails too
    every = ("--split all (every token)" if whole > seq_len else
             f"--split all (every token) with --seq-len {whole - 1} or less" if whole >= 2 else
             "a longer --data.path file")
    fixes += {"val": [every], "all": ["a longer --data.path file"],
              "test": ["a longer test set"]}[split]
    raise ValueError(f"{source}: --split {split}: expected at least {seq_len + 1} tokens to "
                     f"score (a window of --seq-len {seq_len} and the token after it), found "
                     f"{found}; use {' or '.join(fixes)}")


def json_safe(out: dict[str, Any]) -> dict[str, Any]:
    """`out` as valid JSON: a NaN or infinite number becomes null, with the reason under
    "not_finite" (JSON has no NaN; `json.dumps` would print one anyway)."""
    bad = {k: str(v) for k, v in out.items() if isinstance(v, float) and not math.isfinite(v)}
    if not bad:
        return out
    return {**{k: None if k in bad else v for k, v in out.items()},
            "not_finite": {k: f"{v}: the model's outputs are not finite on this data"
                           for k, v in bad.items()}}


def _run_bundle(model: str):
    """The run `--model` names (a run folder, or a checkpoint in its weights/), None for a GGUF
    of its own: its data is what eval reads unless told otherwise."""
    from toymlx.runner.bundle import Bundle

    return Bundle.of(model, "--model")


def check_run_data(bundle, split: str) -> None:
    """The run's own `split` scored (no --data.path): a ValueError naming the file and both
    digests unless what that split is read from still has the fingerprint config.json
    recorded when the run started, as a resume checks its data (a held-out split of changed
    data may hold rows the run trained on). Read from: for `test`, the run's test file (a
    data folder's test.jsonl, a ViT's --data.test-path); for `val`, its validation file (a
    data folder's valid.jsonl, --data.val-path), else the data whose seeded share it is; for
    `all`, every data path. A folder recorded without its files' own is checked whole; a
    split file the record leaves out (test.jsonl of a run of no --test, which never read it)
    is not checked; the data given with --data.path instead is scored as it is."""
    from toymlx.bundle.inputs import (
        DATA_FILES_KEY,
        changed_part,
        data_empty_as_none,
        data_reads,
        same_data,
    )
    from toymlx.bundle.options import option
    from toymlx.data.chat import data_files, text_folder_files

    data = getattr(bundle.config, "data", None)
    def given(key: str) -> bool:  # --data.test-path or --data.val-path, where the run gave one
        return getattr(data, key.removeprefix("data."), None) is not None

    if split == "all":
        keys = ["data.path", *(["data.val_path"] if given("data.val_path") else [])]
    else:
        keys = [f"data.{split}_path" if given(f"data.{split}_path") else "data.path"]
    what = {"test": "test ", "val": "validation ", "all": ""}[split]
    for key in keys:
        rec = bundle.saved.get(DATA_FILES_KEY, {}).get(key)
        path = option(bundle.config, key)  # the file the bundle found for it (`resolve_inputs`)
        if not isinstance(rec, dict) or not isinstance(path, str):
            continue  # not recorded (the default data)
        if not Path(path).exists():  # another split's file: the reader names what it lacks
            if key == "data.path":
                raise ValueError(f"{gone_run_data(bundle)}; put it back, or give where it is "
                                 "now: --data.path PATH")
            continue
        path = Path(path)
        part = None  # only the split's own file of a text or chat folder is read (a folder
        # of text files is one text, whose validation split is its end)
        if key == "data.path" and path.is_dir() and bundle.recipe != "vit-tiny" \
                and split != "all" and text_folder_files(path) is None:
            part = getattr(data_files(path), "test" if split == "test" else "valid")
        parts, only = rec.get("files"), rec.get("only")
        if part is not None and isinstance(only, list) and part.name not in only:
            continue  # a file the run never read (test.jsonl without --test): not recorded
        # a folder's other files (train.jsonl) may change freely
        if part is not None and isinstance(parts, dict) and isinstance(parts.get(part.name),
                                                                        dict):
            checked, rec = part, parts[part.name]
            within = f" (in {path}, recorded as {key})"
        else:
            checked, within = path, f" ({key})"
        reads, empty = data_reads(bundle.config, key, checked), data_empty_as_none(
            bundle.config, key)
        same, now = same_data(checked, rec, reads, empty)
        if not same:  # a folder: its first file changed, added or gone, where recorded
            part = changed_part(checked, rec, bundle.data_index(key, rec), reads, empty) \
                if checked == path else None
            raise ValueError(f"{checked}: --split {split}: expected the {what}data the run "
                             f"recorded at its start{within}: {_digest(rec)}; found it "
                             f"changed: {_digest(now)}{f' ({part})' if part else ''}; restore "
                             f"it, or score the data as it is now with --data.path {path}")


def gone_run_data(bundle) -> str | None:
    """Where the run's --data.path data is gone (`resolve_inputs` found it nowhere): one line
    naming the folder or file the run read, as a resume names it (the path as typed may be
    relative to another folder, and a reader would take a gone folder for a file); None where
    it is there, or not recorded (the default data)."""
    from toymlx.bundle.inputs import DATA_FILES_KEY
    from toymlx.bundle.options import option

    rec = bundle.saved.get(DATA_FILES_KEY, {}).get("data.path")
    path = option(bundle.config, "data.path")
    if not isinstance(rec, dict) or not isinstance(path, str) or Path(path).exists():
        return None
    gone = rec.get("file") if isinstance(rec.get("file"), str) else path
    return (f"{gone}: --data.path: expected the run's data ({rec.get('bytes')} bytes when it "
            "started), found nothing there")


def _digest(fp: dict) -> str:
    """A data `fingerprint` as a message names it."""
    whole = fp.get("sha256")  # large data read by its samples alone: named so
    return (f"{fp.get('bytes')} bytes, sha256 {whole}" if whole else
            f"{fp.get('bytes')} bytes, samples' sha256 {fp.get('sample_sha256')}")


def reads_run_data(args: Args, bundle) -> bool:
    """Whether eval reads the data of the run `--model` names: no --data.path, or one naming
    the run's own file, or a copy of it elsewhere (said: `Bundle.given_input`)."""
    if bundle is None or args.data_path is None:
        return bundle is not None
    from toymlx.bundle.options import option

    own = option(bundle.config, "data.path")
    if isinstance(own, str) and Path(own).resolve() == Path(args.data_path).resolve():
        return True
    if note := bundle.given_input("data.path", args.data_path):
        print(f"{PROG}: reads --data.path from {note}", file=sys.stderr)
        return True  # the run's own data, moved
    return False


RUN_DATA_NAME = "toy.run_data.*"
"""How a line names a fused file's record of its run (`toymlx.gguf.fuse.RUN_DATA`)."""


class FileRun(NamedTuple):
    """What a fused GGUF records of the LoRA run it was fused from (`RUN_DATA`,
    `toymlx.training.fused.run_data_metadata`): the run's options that decide its held-out
    rows, as a lora `Config` (its other options the defaults, which no row depends on)."""

    config: Any
    source: Path
    """The fused file"""
    given: dict[str, Any]
    """The recorded options as nested dicts (`config_from_dict`'s input)"""
    fingerprint: dict[str, Any]
    """The run's data's `fingerprint`, as its config.json recorded it ({}: none recorded)"""

    def reads(self, data_path: str | None) -> bool:
        """Whether eval scores the run's own data: no --data.path (the recorded file, refused
        in one line where it is gone or changed), or one holding the recorded contents."""
        from toymlx.bundle.inputs import same_data

        path = self.config.data.path
        if data_path is None:
            if path is not None:
                self.check_data(Path(path))
            return True
        if path is not None and Path(path).resolve() == Path(data_path).resolve():
            return not self.fingerprint or same_data(data_path, self.fingerprint)[0]
        return (bool(self.fingerprint) and Path(data_path).exists()
                and same_data(data_path, self.fingerprint)[0])

    def check_data(self, path: Path) -> None:
        """The run's data where the file says it was: ValueError naming the file and key, and
        what to do, where it is gone or holds other contents than the run read."""
        from toymlx.backend.files import nothing_there
        from toymlx.bundle.inputs import fingerprint_note, same_data
        from toymlx.gguf.fuse import RUN_DATA

        fix = ("; give the run's data with --data.path (a copy of it: the run's rows), or "
               "other data to score (scored whole)")
        if not path.exists():
            raise ValueError(f"{self.source}: metadata key '{RUN_DATA}data.path': expected the "
                             f"data the run trained on at {path}, found {nothing_there(path)}"
                             f"{fix}")
        if self.fingerprint:
            same, now = same_data(path, self.fingerprint)
            if not same:
                raise ValueError(f"{path}: expected the data the run of {self.source} trained "
                                 f"on ({fingerprint_note(self.fingerprint)}, metadata key "
                                 f"'{RUN_DATA}fingerprint.sha256'), found other contents "
                                 f"({fingerprint_note(now)}){fix}")

    def note(self, args: Args) -> str:
        """The one line saying which settings came from the file, and which from the flags."""
        from toymlx.runner.api import option_flags

        flags = {"seq_len": "--seq-len", "batch_size": "--batch-size",
                 "eval_batches": "--eval-batches"}
        mine = [f for k, f in flags.items() if getattr(args, k) is not None]
        given = {k: v for k, v in self.given.items() if k not in flags or
                 getattr(args, k) is None}
        data = dict(self.given.get("data", {}))
        if args.data_path is not None:
            data.pop("path", None)
            mine.append("--data.path")
        for key, flag in (("pack", pack_flag(args)), ("mask_prompt", mask_flag(args)),
                          ("drop_tools", args.data_drop_tools or None),
                          ("keys", args.data_keys or None)):
            if flag is not None:  # --data.pack, --data.no-mask-prompt, ...: the flag's rows
                data.pop(key, None)
        mine += chat_flags(args)
        given["data"] = data
        return (f"rows as the run built them, from {self.source}'s {RUN_DATA_NAME}: "
                f"{' '.join(option_flags(given))}"
                + ("" if "path" in data or args.data_path is not None else
                   " (the default data)")
                + (f"; from the flags here: {', '.join(mine)}" if mine else ""))


def file_run(model: str) -> FileRun | None:
    """The run a fused GGUF `model` records (`FileRun`); None for a GGUF without the record (an
    older export, another tool's file), scored as before. A recorded option of the wrong type,
    or one missing, is a ValueError naming the file and the key."""
    from toymlx.bundle.checkpoint import checkpoint_file
    from toymlx.bundle.options import config_from_dict, flag_name
    from toymlx.gguf.fuse import RUN_DATA
    from toymlx.gguf.reader import GGUFFile
    from toymlx.recipes.lora import Config
    from toymlx.training.fused import RUN_DATA_FINGERPRINT, RUN_DATA_OPTIONS

    path = checkpoint_file(model, check_digest=False)
    if not path.is_file():
        return None
    with GGUFFile(path) as g:
        rec = {k.removeprefix(RUN_DATA): v for k, v in g.metadata.items()
               if k.startswith(RUN_DATA)}
    if not rec:
        return None
    given: dict[str, Any] = {}
    for key in RUN_DATA_OPTIONS:
        if key not in rec:
            if key == "data.path":  # the shipped default data
                continue
            raise ValueError(f"{path}: metadata key '{RUN_DATA}{key}': expected the run's "
                             f"{flag_name(key)} (the file records its run's other settings), "
                             "found no key; export the fused file again from its run")
        *parents, name = key.split(".")
        holder = given
        for part in parents:
            holder = holder.setdefault(part, {})
        holder[name] = rec[key]
    cfg = config_from_dict(Config, given, str(path), prefix=RUN_DATA, complete=False)
    found = {k: rec[f"fingerprint.{k}"] for k in RUN_DATA_FINGERPRINT
             if f"fingerprint.{k}" in rec}
    return FileRun(cfg, path, given, found)


def default_split(args: Args, own: bool, outside: bool) -> str:
    """--split as given (valid as val); else val on the run's own data (`own`: the held-out
    split its training evaluated), and all on --data.path data the run did not train on: no
    part of it was held out from training, so a 10% split of it would only score fewer
    examples; for a model outside a run (`outside`), test on a data folder holding a test file,
    which is what `mlx_lm.lora --test` scores of the same folder."""
    from toymlx.data.chat import SPLIT_NAMES

    if args.split is not None:
        return "val" if args.split == "valid" else args.split  # mlx-lm's valid.jsonl
    if outside and mlx_lm_folder(args, None) and any(
            (Path(args.data_path) / name).is_file() for name in SPLIT_NAMES
            if name.startswith("test.")):
        return "test"
    return "val" if args.data_path is None or own else "all"


def _run_config(model: str):
    """The configuration of the run `--model` names, None for a GGUF of its own."""
    bundle = _run_bundle(model)
    return bundle.config if bundle is not None else None


def evaluate_images(args: Args, path: Path, rows: RunRows | None = None) -> dict:
    """Accuracy, per-class accuracy and the confusion matrix of a ViT checkpoint (`rows`: the
    first images of a run's own validation split that `run_rows` picks)."""
    import numpy as np

    from toymlx.backend import atomic
    from toymlx.backend.files import counted
    from toymlx.data.image_folder import split_folders
    from toymlx.data.images import load_images
    from toymlx.generation.classify import (
        Classifier,
        confusion,
        format_report,
        plot_confusion,
        predict,
        report,
    )

    clf = Classifier.load(path)
    cfg = _run_config(args.model)
    run = dataclasses.asdict(cfg.data) if cfg is not None and hasattr(cfg, "data") else {}
    data_path = args.data_path if args.data_path is not None else run.get("path")
    val_path = run.get("val_path") if args.data_path is None else None
    if args.split == "test":  # every image of the test set, as the run's --test scored it
        data_path = args.data_path if args.data_path is not None else run.get("test_path")
        if data_path is None:
            raise ValueError("--split test: expected a run with --data.test-path, or --data.path "
                             "naming the test images, found neither")
        val_path = None
    every = args.split in ("all", "test")
    data = load_images(data_path, 0.0 if every and not val_path else
                       run.get("val_fraction", 0.1), val_path=val_path,
                       image_size=clf.image_size, channels=clf.channels, classes=clf.names)
    # the checkpoint's mean and std, not this data's; the pixels reach [0, 1] by their own
    # format's range, as training scaled them (`ImageSet.scale`, `val_scale`): a float .npz
    # over its largest value, 8-bit pixels over 255 whatever the checkpoint trained on
    data.mean, data.std = clf.mean, clf.std
    for note in data.notes:  # how the data was read (timm's layout, images in no class folder)
        print(f"{PROG}: {note}", file=sys.stderr)
    if every and not val_path and data_path is not None \
            and "val" in (found := split_folders(data_path) or {}):
        # timm's layout scored whole: its train/ and val/ pooled, which the split's name alone
        # ("(all)") left to be guessed
        print(f"{PROG}: {data_path}: {found['train'].name}/, {found['val'].name}/ are splits "
              f"(timm's layout), not classes: scoring the images of both; --split val: "
              f"{found['val'].name}/ alone", file=sys.stderr)
    if not every and len(data.val_y) == 0:  # numpy's "need at least one array to concatenate"
        raise ValueError(f"{data.source}: --split val: expected validation images to score, "
                         f"found none: --data.val-fraction {run.get('val_fraction', 0.1)} of "
                         f"{counted(len(data.train_y), 'image')} holds none out; score them "
                         "all with "
                         "--split all")
    # (images, labels, what divides their pixels) in this order: the split's fixed order
    parts = [(data.val_x, data.val_y, data.val_scale)] + [
        (data.train_x, data.train_y, None)] * bool(every and len(data.train_y))
    total = sum(len(y) for _, y, _ in parts)
    size = rows.batch_size if rows is not None else args.batch_size or 256
    batches, left = [], total if args.max_examples is None else args.max_examples
    if rows is not None and rows.batches is not None:
        left = min(total, rows.batches * size)
    for x, y, scale in parts:
        take = min(left, len(y))
        if take:  # a streamed set's first images alone are decoded, each batch as it is scored
            x = x if take == len(y) else x.subset(np.arange(take)) if hasattr(x, "subset") \
                else x[:take]
            batches.append(data.batches_of(x, y[:take], size, scale=scale))
        left -= take
    scored = total if args.max_examples is None else min(total, args.max_examples)
    if rows is not None and rows.batches is not None:
        scored = min(total, rows.batches * size)
    pred, true, loss = predict(clf, itertools.chain.from_iterable(batches), scored,
                               bar_name(args))
    limited = (rows.words(len(true), total, "image") if rows is not None else
               subset(args.max_examples, len(true), total, args.split, "image",
                      flag=args.max_examples_flag))
    m = confusion(pred, true, len(clf.names))
    if args.plot:
        try:
            plot_confusion(m, clf.names, args.plot)
        except OSError as e:  # was the bare "[Errno 2] No such file or directory: ..."
            raise OSError(f"{args.plot}: --plot: could not write the confusion matrix "
                          f"({atomic.named(e, args.plot)}); nothing was written under this "
                          "name") from e
    out = {"model": str(path), "data": data.source, "split": args.split, **report(m, clf.names),
           f"{'test' if args.split == 'test' else 'val'}_loss": loss / max(len(true), 1),
           **limited}
    text = format_report(m, clf.names) + f"\n\nmodel {path}\ndata {data.source} ({args.split})"
    if limited and not (rows is not None and len(true) == total):  # all of it: said above
        text += f"\nscored {limited['subset']}"
    if args.plot:
        text += f"\nplot {args.plot}"
    out["text"] = text
    return out


def chat_records(path: str, keys: Sequence[str] = ()) -> bool:
    """Whether --data.path (a file, or a data folder's train.jsonl; a folder of text files
    never) holds chat/SFT examples: prompt/completion, messages, or their peers' layouts
    (ShareGPT, Alpaca, a table of them), each record read through `keys` (--data.keys's pairs).
    A Llama scores those as `evaluate_chat` does, never as the text of their JSON."""
    from toymlx.data.chat import data_files, first_kind, is_plain_text, row_keys, text_folder_files
    from toymlx.recipes.lora import keys_hint

    if text_folder_files(path) is not None:  # one text
        return False
    f = data_files(path).train
    with keys_hint(keys):
        return not is_plain_text(f) and first_kind(f, row_keys(keys)) != "text"


def evaluate_chat(args: Args, cfg: Any, rows: RunRows | None = None) -> dict:
    """Loss and perplexity of a LoRA run (base + adapter, or a full fine-tune's checkpoint) or a
    Llama checkpoint on chat/SFT examples, rows built as training built them (the run's
    --seq-len, --data.mask-prompt, --data.train-turns, --data.pack): its validation rows (a
    data folder's valid.jsonl, else the split training used), every row (--split all), or
    test.jsonl (--split test: what `toymlx-train --test` records at the end of a run); `rows`:
    those of a run's own validation split that `run_rows` picks. A model outside a run (`cfg`
    None) builds them as `outside_rows` says (a data folder: as mlx_lm.lora --test)."""
    import math

    from toymlx.backend.device import on_gpu
    from toymlx.backend.files import counted
    from toymlx.data.chat import chat_flags_on_text, row_keys
    from toymlx.generation.generate import load_for_generation, used_files
    from toymlx.gguf.llama import frozen_weights
    from toymlx.models.ops import scoring_ops
    from toymlx.recipes.lora import keys_hint

    split = args.split or "val"  # Args built in code skip `evaluate`'s `default_split`
    data = getattr(cfg, "data", None)
    path = args.data_path or getattr(data, "path", None)
    # --data.keys as given, else the run's own: checked before the model loads
    keys = args.data_keys or tuple(getattr(data, "keys", ()))
    row_keys(keys)
    if mask_flag(args) and path:  # given, before the model loads: text rows mask nothing
        chat_flags_on_text(path, ("--data.mask-prompt",), row_keys(keys),
                           ("test",) if split == "test" else ("train", "valid"), "is scored")
    model, tok = load_for_generation(args.model, weights=frozen_weights(on_gpu()),
                                     ops=scoring_ops(on_gpu()))
    if args.seq_len is not None:
        check_context(args.seq_len, model, args.model)
    print(f"{PROG}: {used_files(args.model)}", file=sys.stderr)
    pack = chat_pack(cfg, pack_flag(args))
    own = outside_rows(args, model) if cfg is None else None
    mask = own.mask if own is not None else mask_flag(args)
    run_mask = getattr(getattr(cfg, "data", None), "mask_prompt", True)
    run_drop = getattr(getattr(cfg, "data", None), "drop_tools", False)
    run_keys = row_keys(getattr(getattr(cfg, "data", None), "keys", ()))
    if rows is not None and (pack != chat_pack(cfg, None) or mask not in (None, run_mask)
                             or args.data_drop_tools > run_drop
                             or row_keys(keys) != run_keys):
        rows = rows._replace(own=False)  # other rows than the run's own
    with keys_hint(keys):
        r = chat_loss(model, tok, cfg, split, args.data_path,
                      own.seq_len if own else args.seq_len,
                      own.batch_size if own else args.batch_size or 256, first=args.max_examples,
                      progress=bar_name(args), pick=rows, pack=pack, mask=mask,
                      turns=own.turns if own else None, drop_tools=args.data_drop_tools or None,
                      keys=keys)
    # named as the run's events name them (test) and as a text checkpoint's report (val, all)
    names = ("test_loss", "test_perplexity") if split == "test" else ("val_loss", "perplexity")
    # rows: the examples of one row each (padded) or run together (packed, --data.pack)
    limited = (rows.words(r.rows, r.split_rows, "row") if rows is not None else
               subset(args.max_examples, r.examples, r.of, split, "example",
                      f"{counted(r.rows, 'row')} made of ", flag=args.max_examples_flag))
    if cfg is None:  # a model outside a run: its rows are eval's, which the user must know
        if r.held:  # mlx-lm's data folder without valid.jsonl validates nothing
            print(f"{PROG}: --split val: {r.held}, as a run holds them out; --split all scores "
                  "every example", file=sys.stderr)
        for note in r.notes:  # examples cut at --seq-len: their ends not scored
            print(f"{PROG}: {note}", file=sys.stderr)
        print(f"{PROG}: {own_rows_note(r, split, pack, own)}", file=sys.stderr)
    return {"model": str(args.model), "data": r.source, "split": split, "rows": r.rows,
            "packed": pack, "mask_prompt": r.mask, names[0]: r.loss, names[1]: math.exp(r.loss),
            "seq_len": r.seq_len, "tokens_scored": r.tokens, **limited}


def own_rows_note(r: HeldOut, split: str, pack: bool, own: ChatRows) -> str:
    """The line saying how chat/SFT rows were built for a model outside a run (a fused export
    from before toymlx recorded its run's settings, `FileRun`; a GGUF of its own): with eval's
    settings (`own`: on a data folder, mlx_lm.lora --test's), not any run's, which the file
    does not record. By default one example a row
    (`pack` False), as mlx-lm's evaluate scores them: packed (a toymlx lora run's default,
    --data.pack), each example is read after the ones before it (SmolLM2-135M on python_qa's
    53 validation examples: 2.8780 packed, 2.9515 one a row). --seq-len and --data.pack give a default run's rows (it kept
    --data.mask-prompt and --data.train-turns assistant, the settings used here), with
    --max-examples for a run whose validation scores only its first --eval-batches x
    --batch-size rows; else the run itself scores them."""
    from toymlx.backend.files import counted

    which = {"val": "validation ", "test": "test "}.get(split, "")
    given = "" if own.seq_len is not None else "default; "
    how = "packed" if pack else "one example a row, as mlx-lm's evaluate scores them"
    other = ("--data.no-pack where it kept one example a row" if pack else
             "--data.pack where it packed them (toymlx-train's default)")
    return (f"{counted(r.examples, which + 'example')} made {counted(r.rows, 'row')} of "
            f"--seq-len {r.seq_len} ({given}{how}; {own.said}): "
            f"eval's rows for a model outside a run, not a run's; to score a run's eval rows "
            f"give its --seq-len, {other}, and --max-examples its --eval-batches x "
            "--batch-size where the split makes more rows (a run of other --data.mask-prompt "
            "or --data.train-turns: toymlx-eval --model RUN, or its fused file exported again, "
            "which records them)")


class HeldOut(NamedTuple):
    """What `chat_loss` scored."""

    loss: float
    """Mean loss a trained token"""
    rows: int
    """Rows scored"""
    source: str
    """The data they came from"""
    examples: int
    """Examples tokenized into those rows (with `first`: those up to the last row's)"""
    of: int
    """Examples in the split"""
    split_rows: int
    """Rows those examples made (with `first`: those made up to it)"""
    row_loss: Any = None
    """With `per_row`: each scored row's summed loss (rows,) float64, in the scoring order"""
    row_n: Any = None
    """With `per_row`: each scored row's trained targets (rows,)"""
    seq_len: int = 0
    """Tokens a row (--seq-len: the run's, or eval's default)"""
    tokens: int = 0
    """Trained targets scored, over all the rows"""
    held: str = ""
    """--split val of data without a validation file: which examples of its training file
    were held out (its last --data.val-fraction), as a run would hold them out"""
    notes: tuple[str, ...] = ()
    """What of each split's examples was cut or left out at --seq-len (`Fit.note`), as a run
    says it of its own"""
    mask: bool = True
    """Whether prompts were masked (--data.mask-prompt): the answers alone scored"""


def chat_loss(model: Any, tok: Any, cfg: Any, split: str = "val", data_path: str | None = None,
              seq_len: int | None = None, batch_size: int = 256, first: int | None = None,
              progress: str | None = PROG, pick: RunRows | None = None,
              per_row: bool = False, pack: bool | None = None, mask: bool | None = None,
              turns: str | None = None, drop_tools: bool | None = None,
              keys: Sequence[str] | None = None) -> HeldOut:
    """What `model` scores on a LoRA run's chat/SFT rows of `split` (see `evaluate_chat`), `cfg`
    the run's configuration (None: --data.path or the default); `first`: only the first that
    many rows (--max-examples), no example after them tokenized; `pick` (instead, on the
    validation split): the rows `run_rows` picks, batched as the run's validation batches
    them (`held_out_call_rows` a call), so that the loss is its eval events'; `per_row`: each
    row's loss sum and count too (`lm_held_out_rows`); `pack`: --data.pack or --data.no-pack
    as given (None: the run's own, else one example a row, `chat_pack`); `mask`, `turns`:
    --data.mask-prompt and --data.train-turns (None: the run's own, else masked, assistant
    turns); `drop_tools`: --data.drop-tools as given (None: the run's own, else none dropped);
    `keys`: --data.keys's pairs as given (None: the run's own, else none);
    `progress`: the name of the pass's progress bar (drawn on a terminal, `Evaluator`; None:
    none)."""
    import numpy as np

    from toymlx.backend.files import counted
    from toymlx.data.chat import (
        SplitExamples,
        blank_file,
        data_files,
        empty_split_error,
        fitted_rows,
        held_out_call_rows,
        load_examples,
        row_keys,
        sft_val_batches,
        test_file,
        tools_note,
        without_tools,
    )
    from toymlx.models.losses import lm_held_out_rows, lm_held_out_sums, lm_loss
    from toymlx.recipes.lora import DEFAULT_DATA
    from toymlx.training.evaluate import command_evaluator
    from toymlx.training.task import Task

    data = dataclasses.asdict(cfg.data) if dataclasses.is_dataclass(getattr(cfg, "data", None)) \
        else {}
    path = data_path if data_path is not None else data.get("path")
    if path is None and split == "test":
        raise ValueError("--data.path: expected a data folder with test.jsonl or a JSONL file "
                         "of test examples (--split test), found none")
    if split == "test" and data_path is None and not Path(path).is_dir():
        raise ValueError(f"--split test: expected a run whose --data.path is a data folder with "
                         f"test.jsonl, found a run trained on one file, {path} (its training and "
                         "validation rows, no test set); give the test examples with --data.path")
    seq_len = seq_len or getattr(cfg, "seq_len", None) or 256
    pick = pick if split == "val" else None
    held = ""
    mask = data.get("mask_prompt", True) if mask is None else mask
    pack = chat_pack(cfg, pack)
    turns = turns or data.get("train_turns", "assistant")
    keys = row_keys(data.get("keys", ()) if keys is None else keys)
    bar = progress is not None  # tokenizing bars on a terminal, as the pass's own
    dropped = [0]  # examples whose "tools" --data.drop-tools left out (the run's, or given)
    drop_tools = data.get("drop_tools", False) if drop_tools is None else drop_tools

    def rows_of(examples: list, name: str, most: int | None) -> tuple[dict, Any]:
        if drop_tools:
            examples, n = without_tools(examples)
            dropped[0] += n
        return fitted_rows(examples, tok, seq_len, mask, pack, turns, name if bar else None,
                           first=most)

    if split == "test":
        f = test_file(path)
        examples = load_examples(f, keys)
        rows, fit = rows_of(examples, "test", first)
        source = where = str(f)
        notes = [fit.note(where, "test", seq_len, scored=True)]
        # trained: not said (a test file without examples is refused as it is read)
        trained, total, tokenized = None, len(examples), fit.examples
    else:  # the validation examples alone (val), or the training ones first (all)
        fraction = data.get("val_fraction", 0.1)
        ex = SplitExamples.of(path or DEFAULT_DATA, fraction, keys=keys)
        where, trained = ex.source.of("validation"), len(ex.train)
        if split == "val" and ex.source.valid is None and ex.val:
            held = (f"the last {len(ex.val)} of {where}'s {len(ex.train) + len(ex.val)} "
                    f"examples (--data.val-fraction {fraction}, no validation file)")
        # the file(s) the scored rows came from: valid.jsonl alone for --split val
        source = where if split == "val" else str(ex.source)
        parts = [] if split == "val" else [rows_of(ex.train, "training", first)]
        made = sum(len(r["inputs"]) for r, _ in parts)
        if first is None or made < first:
            parts.append(rows_of(ex.val, "validation", None if first is None else first - made))
        rows = {k: np.concatenate([r[k] for r, _ in parts]) for k in parts[0][0]}
        fit = parts[-1][1]  # the validation examples' unless --max-examples rows came first
        named = ([] if split == "val" else [(ex.source.of("train"), "training")]) + [
            (where, "validation")]
        notes = [f.note(src, name, seq_len, scored=True)
                 for (_, f), (src, name) in zip(parts, named)]
        total = len(ex.val) + (0 if split == "val" else len(ex.train))
        tokenized = sum(f.examples for _, f in parts)
    n = len(rows["inputs"])
    if n == 0:  # nothing to score: say why instead of a loss over no rows
        if fit.examples:
            raise empty_split_error(where, "test" if split == "test" else "validation", fit,
                                    seq_len)
        who = "the run held" if cfg is not None else "a run would hold"  # a GGUF of its own
        fraction = data.get("val_fraction", 0.1)
        valid = data_files(path or DEFAULT_DATA).valid
        if valid is not None and blank_file(valid):  # taken as none at --data.val-fraction 0
            raise ValueError(f"{valid}: --split val: expected validation rows to score, found "
                             f"none: the file is empty, and {who} out no examples of {where} "
                             f"(--data.val-fraction {fraction}); score them all with --split "
                             "all")
        raise ValueError(f"{where}: --split val: expected validation rows to score, found "
                         f"none: {who} out no examples (--data.val-fraction {fraction} of "
                         f"{counted(trained, 'example')}, no valid.jsonl); score them all with "
                         "--split all")
    if pick is None:
        bs = max(1, min(batch_size, n))
        batches = sft_val_batches(rows, bs, -(-n // bs))
    else:  # as the run's validation: its first rows, `held_out_call_rows` a call
        bs = pick.batch_size
        batches = sft_val_batches(rows, bs, pick.batches or -(-n // bs), held_out_call_rows(
            bs, bool(getattr(cfg, "grad_checkpoint", False))))
    task = Task("eval", model, lm_loss, lambda s: {}, [], None, None, {},
                metrics_fn=lm_held_out_rows if per_row else lm_held_out_sums,
                test_batches=batches)
    m = command_evaluator(task, progress, "row")(split="test")
    scored = sum(b["inputs"].shape[1] for b in batches)
    tokens = int(sum(b["mask"].sum() for b in batches))
    return HeldOut(m["test_loss"], scored, source, tokenized, total, n, m.get("test_row_loss"),
                   m.get("test_row_n"), seq_len, tokens, held,
                   tuple(note for note in [tools_note(source, dropped[0]), *notes] if note),
                   mask)


def first_windows(batches: list[dict[str, Any]], n: int | None) -> list[dict[str, Any]]:
    """The text batches (1, B, T) cut to their first `n` windows in order (None: all)."""
    if n is None:
        return batches
    out = []
    for b in batches:
        if n <= 0:
            break
        out.append({k: v[:, :n] for k, v in b.items()})
        n -= b["mask"].shape[1]
    return out


def evaluate(args: Args) -> dict:
    import mlx.core as mx
    import numpy as np

    from toymlx.backend.device import on_gpu, select_device
    from toymlx.bundle.checkpoint import checkpoint_file
    from toymlx.gguf.reader import GGUFFile
    from toymlx.models.ops import scoring_ops
    from toymlx.training.evaluate import command_evaluator
    from toymlx.training.task import Task

    select_device(args.device)
    if args.plot:
        from toymlx.bundle.outputs import check_output

        check_output(args.plot, [("--model", args.model), ("--data.path", args.data_path)],
                     "--plot", overwrite=args.overwrite)
        if Path(args.plot).suffix.lower() != ".png":  # cm.pdf held a PNG
            raise ValueError(f"--plot: expected a .png file name (the confusion matrix is "
                             f"drawn as a PNG), found {Path(args.plot).name!r}")
        try:  # before the work: the PNG is drawn after every image is scored
            import matplotlib  # noqa: F401
        except ImportError:
            raise ValueError(f"--plot {args.plot}: drawing needs matplotlib; pip install "
                             "'toymlx[report]', or drop --plot") from None
    elif args.overwrite:  # --plot is the only file eval writes
        raise ValueError("--overwrite: expected with --plot FILE (it replaces an existing "
                         "--plot file), found no --plot")
    bundle = _run_bundle(args.model)
    # a fused file outside its run: the run's rows, from the settings the file records
    fused = file_run(args.model) if bundle is None else None
    own = reads_run_data(args, bundle) if fused is None else fused.reads(args.data_path)
    outside = bundle is None and fused is None
    split = default_split(args, own, outside)
    if outside and args.split is None and split == "all" and mlx_lm_folder(args, None):
        # the guide's stand-in for `mlx_lm.lora --test`, which refuses a folder without
        # test.jsonl: its training and validation examples were scored without a word
        print(f"{PROG}: {args.data_path}: no test.jsonl, which mlx_lm.lora --test scores (it "
              "refuses a folder without one): scoring its training and validation examples "
              "(--split all); --split val scores the validation ones alone", file=sys.stderr)
    flag, args = args.max_examples_flag, dataclasses.replace(args, split=split)
    args.max_examples_flag = flag  # not an init field: replace leaves it at its default
    if bundle is not None and args.data_path is None:
        check_run_data(bundle, args.split)
    # a run's own validation split: the rows its eval events score (`run_rows`), unless
    # --max-examples asks for the first N of the whole split
    rows = None
    if fused is not None:  # as a LoRA run's folder is scored, with the file's settings
        check_no_plot(args, "a LoRA run's fused file")
        if args.split == "val" and own and args.max_examples is None:
            rows = run_rows(fused.config, args.eval_batches, args.batch_size, args.seq_len,
                            f"{fused.source.name}'s {RUN_DATA_NAME}")
        else:
            check_no_eval_batches(args, f"--split {args.split}" if own else
                                  f"--data.path {args.data_path}, data the run did not train on")
        print(f"{PROG}: {fused.note(args)}", file=sys.stderr)
        return evaluate_chat(args, fused.config, rows)
    if bundle is None:
        check_no_eval_batches(args, f"{args.model}, a model outside a run")
    elif not own:
        check_no_eval_batches(args, f"--data.path {args.data_path}, data the run did not "
                              "train on")
    elif args.split != "val":
        check_no_eval_batches(args, f"--split {args.split}")
    elif args.max_examples is None:
        text = bundle.recipe in ("from-scratch", "warm-start")  # --batch-size / 16 windows
        rows = run_rows(bundle.config, args.eval_batches, args.batch_size and (
            max(1, args.batch_size // 16) if text else args.batch_size), args.seq_len)
    if bundle is not None and bundle.recipe == "lora":
        check_no_plot(args, "a LoRA run")
        return evaluate_chat(args, bundle.config, rows)
    # the header's refusals first; an Ollama blob's SHA-256 (a read of the whole model) after
    path = checkpoint_file(args.model, check_digest=False)
    from toymlx.gguf.llama import check_model_kind

    with GGUFFile(path) as g:
        if g.metadata.get("general.type") == "adapter":  # check_model_kind's fix names flags
            raise ValueError(_adapter_alone(path, g.metadata))  # (--adapter, --base) eval lacks
        check_model_kind(g)  # a projector (mmproj), a vocabulary: said before its architecture
        arch = g.architecture
    if arch == "vit":
        if args.seq_len is not None:  # was taken and ignored, exit status 0
            raise ValueError(f"--seq-len {args.seq_len}: expected a language model (it sets "
                             f"the tokens of a window), found a ViT ({args.model}): an image "
                             "is one window; drop --seq-len")
        check_no_pack(args, f"a ViT ({args.model}), which scores images")
        return evaluate_images(args, checkpoint_file(args.model), rows)
    from toymlx.gguf.llama import ARCHS

    if arch in ARCHS:
        check_no_plot(args, f"a {arch} model")
        path = checkpoint_file(args.model)
        from toymlx.backend.device import on_gpu
        from toymlx.data.text import TokenData
        from toymlx.data.tokenizer import Tokenizer
        from toymlx.gguf.llama import frozen_weights, load_llama
        from toymlx.models.losses import lm_loss
        from toymlx.recipes.common import TextData, check_test_folder, load_token_data

        cfg = bundle.config if bundle is not None else None
        text_run = isinstance(getattr(cfg, "data", None), TextData)  # from-scratch, warm-start
        if args.split == "test" and not text_run:  # a GGUF of its own: chat/SFT test examples
            return evaluate_chat(args, cfg)
        if mlx_lm_folder(args, cfg):  # its rows, text ones too, as mlx-lm scores them
            return evaluate_chat(args, cfg)
        run_data = own and text_run  # read as the run read it (its --data.read-as)
        if args.data_path is not None and args.split != "test" and not run_data \
                and chat_records(args.data_path, args.data_keys):
            return evaluate_chat(args, cfg)  # scored as rows of prompt and answer, as trained
        text = args.data_path or (f"the text {args.model} trained on" if run_data else
                                  "the default text")
        check_no_pack(args, f"{text} (plain text, scored in windows of --seq-len tokens)")
        model, g = load_llama(path, scoring_ops(on_gpu()), weights=frozen_weights(on_gpu()))
        tok = Tokenizer.from_metadata(g.metadata, source=str(path))
        if not run_data:
            data = TextData(args.data_path)
        else:  # read as the run read it: its options, its file where it was found
            for note in bundle.before.values():  # an older run's data, read as it was then
                print(f"{PROG}: {note}", file=sys.stderr)
            data = cfg.data if args.data_path is None else dataclasses.replace(
                cfg.data, path=args.data_path)
        # a file outside a run: eval's 256 cut to the model's context, as on a data folder (a
        # warm-start or from-scratch export's is its --seq-len, 64 say: 256 was refused, naming
        # a --seq-len never given)
        seq_len = args.seq_len or getattr(cfg, "seq_len", None) or min(
            256, model_context(model) or 256)
        check_context(seq_len, model, path)
        if args.split == "test":  # the run's data folder's test.jsonl, as its --test scores it
            check_test_folder(data.path, "--split test")
        td = load_token_data(data, tok, seq_len, test=args.split == "test", windows=False,
                             progress=args.progress)
        whole = len(td.train) + len(td.val)
        if args.split == "all":
            td = TokenData(td.train, np.concatenate([td.train, td.val]), td.source)
        scored, source = (td.test, td.test_source) if args.split == "test" else (td.val,
                                                                                 td.source)
        check_window(len(scored), seq_len, args.split, source, whole)
        picked = rows if run_data else None  # a run's own rows, as its validation picks them
        bs = picked.batch_size if picked is not None else max(1, (args.batch_size or 256) // 16)
        vb = (td.test_batches(bs, seq_len) if args.split == "test" else
              td.val_batches(bs, seq_len, picked.batches or 10**9 if picked else 10**9))
        windows = (len(scored) - 1) // seq_len  # every window of the split
        vb = first_windows(vb, args.max_examples)
        limited = (picked.words(windows if picked.batches is None else
                                min(windows, picked.batches * bs), windows, "window")
                   if picked is not None else
                   subset(args.max_examples, min(windows, args.max_examples or windows),
                          windows, args.split, "window", tail=f" of {seq_len} tokens",
                          flag=args.max_examples_flag))
        task = Task("eval", model, lm_loss, lambda s: {}, vb, None, None, {})
        m = command_evaluator(task, bar_name(args), "window")()
        mx.eval()
        # how much was scored: the whole split, where a run's own val_loss reads --eval-batches
        scored = {"tokens_scored": int(sum(b["mask"].sum() for b in vb)), "seq_len": seq_len}
        if args.split == "test":  # named as the run's test event names them
            return {"model": str(path), "data": td.test_source, "split": "test",
                    "test_loss": m["val_loss"], "test_perplexity": math.exp(m["val_loss"]),
                    **scored, **limited}
        return {"model": str(path), "data": td.source, "split": args.split, **m,
                "perplexity": math.exp(m["val_loss"]), **scored, **limited}
    raise ValueError(f"{path}: metadata key 'general.architecture': expected vit or one of "
                     f"{', '.join(ARCHS)}, found {arch!r}")


if __name__ == "__main__":
    sys.exit(main())
