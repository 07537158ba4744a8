"""Recipe `lora`: fine-tune a GGUF (llama, qwen2, qwen3, qwen35, gemma2, gemma3, gemma4, phi3, smollm3, granite, olmo2, mistral3; mixtures of experts: qwen3moe, qwen2moe, Mixtral's llama) with chat/SFT data: LoRA, DoRA or every weight.

The base model and its tokenizer and chat template come from `--base` (any llama GGUF;
quantized files are dequantized exactly, or kept quantized with `--base-dtype quantized`).
`--fine-tune-type` (mlx-lm's flag and values):
- lora (default): checkpoints are llama.cpp LoRA adapter GGUFs, `weights/adapter_step_N.gguf`,
  usable as `llama-cli --lora`, `toymlx-generate --adapter`, or merged by `toymlx-export --fuse`.
- dora: DoRA adapters (LoRA plus a trained magnitude per output row). llama.cpp has no DoRA
  adapter format: checkpoints are toymlx adapter GGUFs (`adapter.type` dora) that toymlx reads;
  for llama.cpp, export them fused (`toymlx-export --base B --adapter RUN --fuse`).
- full: every weight of the base is trained, in float32 (a quantized base is dequantized);
  checkpoints are full GGUFs with the base's metadata, `weights/step_N.gguf`, that llama.cpp
  loads as they are, as from-scratch's are. `--full.layers N` trains the last N blocks only
  (mlx-lm's full fine-tune): the other blocks, the embeddings, the final norm and the head stay
  frozen, held as `--base-dtype` holds a LoRA base (its blocks: no float32 copy, gradient or
  optimizer state), and are written into each checkpoint as the base's decoded values.
`--fuse-at-end base` (or a type) also writes the run's `fused-TYPE.gguf` when training
completes: the base with the final adapter fused in (full: the final weights); `base`: the
file `toymlx-export --fuse` writes by default (the base's tensors kept, each adapted one in a
type that keeps its change), a type: every tensor re-quantized to it.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field, fields
from functools import partial
from pathlib import Path
from typing import Any, Literal

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np

from toymlx.backend.device import backend_info, on_gpu
from toymlx.backend.files import counted, not_a_file
from toymlx.backend.progress import draws_bars
from toymlx.bundle import model_store
from toymlx.bundle.folder import read_config, refuse_run_folder
from toymlx.bundle.inputs import DATA_FILES_KEY
from toymlx.bundle.outputs import check_output
from toymlx.data import fixture_path
from toymlx.data.chat import (
    VALID_NAMES,
    NoShapeError,
    SFTData,
    SplitExamples,
    chat_flags_on_text,
    no_chat_template,
    row_keys,
    split_files_read,
)
from toymlx.data.tokenizer import Tokenizer
from toymlx.gguf.llama import (
    CHECKPOINT_FORMAT,
    args_from_gguf,
    block_tensors,
    frozen_weights,
    gguf_targets,
    load_llama,
    load_llama_into,
)
from toymlx.gguf.quant import projection_types
from toymlx.gguf.quantize import EXPORT_TYPES, export_type, quantizer, unquantized_note
from toymlx.gguf.reader import GGUFError, GGUFFile
from toymlx.models.layers import model_bytes
from toymlx.models.lora import (
    apply_lora,
    check_targets,
    parse_targets,
    resolve_targets,
    target_blocks,
    target_reach,
)
from toymlx.models.losses import lm_held_out_rows, lm_loss
from toymlx.models.ops import Ops
from toymlx.recipes.common import check_seq_len, check_test_folder, llama_model_info
from toymlx.training import memory
from toymlx.training.adapter import load_adapter_weights, write_adapter
from toymlx.training.fused import (
    KEPT_WARNING,
    adapter_retention,
    kept_note,
    run_data_metadata,
    write_full_kept,
    write_fused_kept,
    write_like_base,
    write_reencoded,
)
from toymlx.training.optimizers import Adam
from toymlx.training.schedule import lr_at
from toymlx.training.task import Task, TrainConfig, eval_batch_limit
from toymlx.training.task import make_optimizer as adamw

DEFAULT_DATA = fixture_path("python_qa", "python_qa.jsonl")
SCHEDULES = ("constant", "cosine_decay", "linear_schedule", "exponential_decay", "step_decay")
"""--lr-schedule's MLX schedules (mlx.optimizers.schedulers, as mlx-lm's lr_schedule names
them; constant: --lr)."""


@dataclass
class LoRAOptions:
    """Which projections get adapters, and their size."""

    rank: int = 8
    """Rank r of each adapter (A is (r, n_in), B is (n_out, r))."""
    alpha: float = 16.0
    """Adapters are scaled by alpha / rank (llama.cpp applies the same)."""
    dropout: float = 0.0
    """Dropout on the adapter's input during training."""
    targets: str = "q"
    """Comma list of projections to adapt: q, k, v, o, gate, up, down (phi3's fused ones:
    qkv, o, gate_up, down; qwen35's linear-attention blocks: qkv, z, beta, alpha, out, its
    q, k, v, o being its full-attention blocks'; a mixture of experts: gate, up, down its
    experts' (a pair per expert), router its ffn_gate_inp; gemma4 E2B/E4B: also ple_gate,
    ple_proj, each block's per-layer-input gate and projection); or all-linear (Unsloth's): every
    linear projection of this base's blocks but a mixture of experts' router,
    `toymlx.models.lora.all_linear`; or mlx-lm-default (an mlx-lm config without keys): those
    and the router, `toymlx.models.lora.mlx_lm_default`; recorded as run_start's
    lora_targets_resolved."""
    layers: int | None = None
    """Adapt only the last N blocks (default: all; mlx-lm's --num-layers)."""
    init_adapter: str | None = None
    """Start the adapters from this adapter GGUF (toymlx's, or llama.cpp's LoRA format; a run
    folder: its latest), or mlx-lm's adapters (its folder or adapters.safetensors, with
    adapter_config.json beside it), instead of B = 0: a new run, checked against the base and
    these options (mlx-lm's --resume-adapter-file)."""


@dataclass
class FullOptions:
    """Which weights a full fine-tune (--fine-tune-type full) trains."""

    layers: int | None = None
    """Train only the last N blocks (mlx-lm's full fine-tune with --num-layers N): the other
    blocks, the token embeddings, the final norm and the output head stay the base's, held as
    --base-dtype says. Default: every weight, embeddings, norms and head included."""


@dataclass
class ChatDataOptions:
    """Supervised fine-tuning examples (JSONL: text, prompt/completion or messages [+ tools];
    CSV/TSV: text or prompt/completion columns)."""

    path: str | None = None
    """An example file (.jsonl or .json; a .csv or .tsv with a header row: text,
    prompt,completion or instruction,input,output columns; any other file: plain text, its
    documents at blank lines), or a folder in mlx-lm's layout: train.jsonl, optional
    valid.jsonl (else the split below) and test.jsonl (--test), each may be .json, .csv or .tsv
    instead; default: the Python stdlib Q&A shipped in toymlx/fixtures/python_qa/."""
    mask_prompt: bool = True
    """Train on the answers only (prompts and chat headers get no loss)."""
    train_turns: Literal["assistant", "last"] = "assistant"
    """With --data.mask-prompt, which messages of a `messages` record train: assistant: every
    assistant turn; last: the last message only, whatever its role, as mlx-lm's --mask-prompt
    (from the end of the conversation before it, past the assistant's header when the message
    is the assistant's, to the end)."""
    pack: bool = True
    """Concatenate examples into full rows (--data.no-pack: one example per row, a training
    batch padded to its longest row rounded up to a multiple of 32)."""
    val_fraction: float = 0.1
    """Fraction of the examples, from the end of the file, held out for validation (not used
    when a data folder has valid.jsonl)."""
    drop_tools: bool = False
    """Leave out each `messages` record's "tools" (function schemas) before its chat template
    renders it, a line at the start saying how many: for a base whose template never reads
    them, which refuses them otherwise (mlx-lm drops them unsaid)."""
    keys: tuple[str, ...] = ()
    """Row keys read under other names, as KEY=NAME (KEY: prompt, completion, text or
    messages): `--data.keys prompt=question completion=answer` trains {"question", "answer"}
    rows as prompt and completion (mlx-lm's prompt_feature, completion_feature, text_feature,
    chat_feature)."""

    @staticmethod
    def reads_only(path: str, test: bool) -> tuple[str, ...] | None:
        """The names of the files read in the data folder `path` by a run of --test `test`
        (`chat.split_files_read`): what the run's record of its data (config.json's
        data_files) covers."""
        return split_files_read(path, test)

    def empty_as_none(self) -> tuple[str, ...]:
        """The files of a data folder read as none where empty (no byte, or blank lines alone:
        `chat.blank_file`; a record of its data that differs by an empty one alone is the same
        data): valid.jsonl (or .json, .csv, .tsv) at
        --data.val-fraction 0, as `chat.SplitExamples.of` reads it; at another fraction an
        empty one is refused as it is read, none (its last part validates)."""
        return VALID_NAMES if self.val_fraction == 0 else ()


@dataclass
class Config(TrainConfig):
    """toymlx-train --recipe lora --base MODEL.gguf: fine-tune a model (LoRA, DoRA or full)."""

    base: str | None = None
    """The llama GGUF to adapt (required); its tokenizer and chat template are used."""
    fine_tune_type: Literal["lora", "dora", "full"] = "lora"
    """lora: llama.cpp LoRA adapters; dora: DoRA adapters (no llama.cpp format: toymlx adapter
    GGUFs, exported fused by toymlx-export --fuse); full: every weight (--full.layers N: the
    last N blocks'), checkpoints full GGUFs (the --lora.* options do not apply)."""
    base_dtype: Literal["auto", "blocks", "quantized", "float32", "bfloat16", "float16"] = "auto"
    """How the frozen base holds its weights. blocks: every quantized matrix as the file's own
    blocks (about the file's size in memory), decoded to float32 where it is used (the float32
    base's values exactly); quantized: the Q4_0/Q4_1/Q8_0 projections as MLX's quantized layers
    (its fast path on a GPU), other quantized matrices as blocks; a float type: every weight
    dequantized to it (4 or 2 bytes a weight). auto: quantized on a GPU; on the CPU float32 where
    a step with the float32 base takes at most half the memory available and --grad-checkpoint
    does not put memory first (the same values, without decoding every weight twice a step),
    else blocks. A full fine-tune holds every weight float32 (auto or float32); with
    --full.layers N its trained blocks are float32 and the frozen rest held as this says."""
    seq_len: int = 256
    """Tokens per training row (longer examples are cut)."""
    lora: LoRAOptions = field(default_factory=LoRAOptions)
    full: FullOptions = field(default_factory=FullOptions)
    data: ChatDataOptions = field(default_factory=ChatDataOptions)
    steps: int = 100
    """Optimizer steps to train for (the schedule's length)."""
    batch_size: int = 4
    """Rows per micro-batch."""
    lr: float = 2e-4
    """Peak learning rate, reached after warm-up."""
    warmup: int = 10
    """Steps of linear warm-up (kept as given when longer than --steps, with a line saying
    the lr never reaches --lr)."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay, on the trained arrays --weight-decay-scope names (default:
    matrices; all: also DoRA magnitudes, and a full fine-tune's norms and biases)."""
    optimizer: Literal["adamw", "adam", "sgd", "adafactor", "muon"] = "adamw"
    """The optimizer (mlx-lm's --optimizer): adamw and adam take --beta1/--beta2, --adam-eps and
    --bias-correction (adamw also --weight-decay); sgd, adafactor and muon run with MLX's
    defaults."""
    lr_schedule: Literal[("warmup-cosine", *SCHEDULES)] = "warmup-cosine"  # type: ignore[valid-type]
    """warmup-cosine: toymlx's (--warmup steps up to --lr, cosine down to --min-lr-ratio); any
    other is MLX's schedule of that name called with --lr-schedule-args, after --warmup steps
    rising from --warmup-init to its first argument, as mlx-lm's lr_schedule; constant: --lr
    throughout after the warm-up."""
    lr_schedule_args: tuple[float, ...] = ()
    """The arguments of an MLX schedule (mlx-lm's lr_schedule.arguments: cosine_decay takes
    initial lr, decay steps[, end lr])."""
    warmup_init: float = 0.0
    """With an MLX --lr-schedule: the learning rate the --warmup steps start from."""
    eval_every: int = 25
    """Steps between validation passes (0: only at the end)."""
    checkpoint_every: int = 50
    """Steps between adapter checkpoints (0: only the final one)."""
    test: bool = False
    """At the end of a completed run, score the data folder's test.jsonl: held-out loss and
    perplexity, an `eval` event with split "test" (mlx-lm's --test; later:
    `toymlx-eval --model RUN --split test`)."""
    fuse_at_end: Literal[("base", *EXPORT_TYPES)] | None = None  # type: ignore[valid-type]
    """When training completes, also write <run>/fused-TYPE.gguf: the base with the final
    adapter fused in (--fine-tune-type full: the final weights), as `toymlx-export --fuse`
    writes it: base = its default (the base's tensors byte for byte, each adapted one in the
    smallest type that keeps its change, named after the base's own type, e.g. q4_k_m), or
    every tensor re-quantized to the type named."""


@contextlib.contextmanager
def keys_hint(keys: Sequence[str]) -> Iterator[None]:
    """Reading records (a run's; toymlx-eval's): a record with none of the keys a shape is read
    from (`NoShapeError`), where no --data.keys was given (`keys`: the pairs, as given), adds
    how to name its own keys."""
    try:
        yield
    except NoShapeError as e:
        if keys:  # the keys given name other parts than the record has
            raise
        raise NoShapeError(f"{e}; --data.keys reads a record's own keys as these, KEY=NAME "
                           "pairs: prompt=NAME completion=NAME (or text=NAME, or messages=NAME)"
                           ) from None


def data_notes(cfg: Config) -> list[str]:
    """What the run says of its examples before its base is read (a folder without valid.jsonl
    validated by train.jsonl's last part, which mlx-lm would train on: `SplitExamples.note`),
    for toymlx-sweep to say once; DataError for examples that cannot be read, or 'messages'
    ones on a base file without a chat template (each run refused them after reading its
    base; a store name's file is left to the run)."""
    with keys_hint(cfg.data.keys):
        ex = SplitExamples.of(cfg.data.path or DEFAULT_DATA, cfg.data.val_fraction,
                              keys=row_keys(cfg.data.keys))
    chat = next((e for e in ex.train + ex.val if e.messages is not None), None)
    if chat is not None and not model_store.is_store_name(cfg.base) and Path(cfg.base).is_file():
        with GGUFFile(cfg.base) as g:
            if not g.metadata.get("tokenizer.chat_template"):
                raise no_chat_template(chat.source, str(cfg.base), chat.read_from)
    return [ex.note] if ex.note else []


def validate(cfg: Config) -> None:
    """Check the LoRA options before anything is loaded; ValueError names the flag."""
    if not cfg.base:
        raise ValueError("--base: expected the path of a GGUF to adapter-train, found "
                         "none (e.g. --base SmolLM2-135M-Instruct.Q4_1.gguf)")
    refuse_run_folder(cfg.base, "--base")
    # headers alone until the run is known to fit: an Ollama blob's SHA-256 in `build`
    base = model_store.resolve_model(cfg.base, "--base", check_digest=False)
    if base.is_dir() and (base / "config.json").is_file():  # mlx-lm's --model, an mlx-lm config's model
        raise ValueError(f"{cfg.base}: --base: expected an existing GGUF file, found a Hugging "
                         "Face model folder (config.json, as mlx-lm's --model takes); pass the "
                         "same model's GGUF as --base (on the command line it overrides an "
                         "mlx-lm config's model; adapters mlx-lm trained on the folder are read "
                         "for it)")
    if not base.is_file():
        raise ValueError(f"{cfg.base}: --base: expected an existing GGUF file, found "
                         f"{not_a_file(base)}{model_store.hf_name_hint(cfg.base)}")
    parse_targets(cfg.lora.targets, lambda: _base_targets(base))
    if cfg.fuse_at_end:  # the type is checked now, not after training
        with GGUFFile(base) as g:
            fuse_type(cfg.fuse_at_end, g)
    if cfg.lora.rank < 1:
        raise ValueError(f"--lora.rank: expected >= 1, found {cfg.lora.rank}")
    if cfg.lora.alpha <= 0:
        raise ValueError(f"--lora.alpha: expected > 0, found {cfg.lora.alpha}")
    if not 0.0 <= cfg.lora.dropout < 1.0:
        raise ValueError(f"--lora.dropout: expected in [0, 1), found {cfg.lora.dropout}")
    if (cfg.fine_tune_type == "full" and cfg.full.layers is None
            and cfg.base_dtype not in ("auto", "float32")):
        raise ValueError(f"--base-dtype: expected auto or float32 with --fine-tune-type full "
                         f"(every weight is trained, in float32; --full.layers N leaves the "
                         f"other blocks frozen), found {cfg.base_dtype}")
    if cfg.fine_tune_type == "full" and cfg.lora.init_adapter:
        raise ValueError("--lora.init-adapter: expected with --fine-tune-type lora or dora, "
                         "found full (fuse the adapter into the base with toymlx-export --fuse, "
                         "and fine-tune that)")
    schedule(cfg)  # its arguments checked now, not at the first step
    check_seq_len(cfg.seq_len, None)  # its bound above, the base's context, once that is read
    if cfg.test:
        check_test_folder(cfg.data.path)
    if not 0.0 <= cfg.data.val_fraction < 1.0:
        raise ValueError(f"--data.val-fraction: expected in [0, 1), found "
                         f"{cfg.data.val_fraction}")
    row_keys(cfg.data.keys)


def check_applies(cfg: Config, given: Collection[str] = ()) -> None:
    """A new run's options checked for ones set where they do not apply: --lora.* with
    --fine-tune-type full (no adapters are trained), --full.* with lora or dora; ValueError
    naming the first; and --lr-schedule-args, --warmup-init and --min-lr-ratio where the
    --lr-schedule does not read them (each was taken and ignored), and --data.mask-prompt or
    --data.train-turns given on text rows (`chat_flags_on_text`). Set: other than its default,
    or among `given`, the command line's flags (`--lora.targets q`, the default, given)."""
    flags = {f.partition("=")[0].replace("_", "-") for f in given}

    def is_set(flag: str, value: Any, default: Any) -> bool:
        return value != default or flag in flags

    # toymlx's defaults, so refused only where given: text rows have no prompt to mask and no
    # turns to pick (a file's `mask_prompt: false` is a given --data.mask-prompt too)
    chat = flags - ({"--data.mask-prompt"} if not cfg.data.mask_prompt else set())
    if cfg.data.path:
        chat_flags_on_text(cfg.data.path, chat, row_keys(cfg.data.keys),
                           ("train", "valid", "test") if cfg.test else ("train", "valid"))
    cosine = cfg.lr_schedule == "warmup-cosine"
    if cosine and cfg.lr_schedule_args:  # constant's: refused by `schedule`
        raise ValueError(f"--lr-schedule-args: expected none with --lr-schedule warmup-cosine "
                         f"(--lr, --warmup and --min-lr-ratio shape it), found "
                         f"{list(cfg.lr_schedule_args)}; give an MLX --lr-schedule to use them")
    if cosine and is_set("--warmup-init", cfg.warmup_init, Config.warmup_init):
        raise ValueError(f"--warmup-init: expected with an MLX --lr-schedule (warmup-cosine "
                         f"rises from --lr / --warmup), found {cfg.warmup_init} with "
                         "--lr-schedule warmup-cosine")
    if not cosine and is_set("--min-lr-ratio", cfg.min_lr_ratio, Config.min_lr_ratio):
        raise ValueError(f"--min-lr-ratio: expected with --lr-schedule warmup-cosine (the floor "
                         f"of its decay), found {cfg.min_lr_ratio} with --lr-schedule "
                         f"{cfg.lr_schedule}")
    if cfg.fine_tune_type != "full":
        for f in fields(FullOptions):
            v = getattr(cfg.full, f.name)
            if is_set(f"--full.{f.name.replace('_', '-')}", v, getattr(FullOptions(), f.name)):
                raise ValueError(f"--full.{f.name.replace('_', '-')}: expected no value with "
                                 f"--fine-tune-type {cfg.fine_tune_type} (it steers a full "
                                 f"fine-tune), found {v!r}; remove it (--lora.{f.name} for "
                                 "the adapters), or train --fine-tune-type full")
        return
    for f in fields(LoRAOptions):
        v = getattr(cfg.lora, f.name)
        if is_set(f"--lora.{f.name.replace('_', '-')}", v, getattr(LoRAOptions(), f.name)):
            raise ValueError(f"--lora.{f.name.replace('_', '-')}: expected no value with "
                             f"--fine-tune-type full (every weight is trained, no adapters), "
                             f"found {v!r}; remove it, or train --fine-tune-type lora or dora")


def schedule(cfg: Config) -> Callable[[Any], Any]:
    """The learning rate as a function of the optimizer step (0-based; Python ints and mlx
    arrays), from --lr-schedule; ValueError naming the flag for arguments MLX refuses."""
    if cfg.lr_schedule == "warmup-cosine":
        return partial(lr_at, base_lr=cfg.lr, warmup=cfg.warmup, total=cfg.steps,
                       min_ratio=cfg.min_lr_ratio)
    if cfg.lr_schedule == "constant":
        if cfg.lr_schedule_args:
            raise ValueError(f"--lr-schedule-args: expected none with --lr-schedule constant "
                             f"(it is --lr), found {list(cfg.lr_schedule_args)}")
        main, first = (lambda step: mx.array(cfg.lr, mx.float32)), cfg.lr
    else:
        try:
            main = getattr(optim.schedulers, cfg.lr_schedule)(*cfg.lr_schedule_args)
            first = float(main(mx.array(0)))
        except (TypeError, ValueError) as e:
            # `--flag: ...`, so that an mlx-lm config's error names its lr_schedule.arguments
            raise ValueError(f"--lr-schedule-args: expected the arguments of MLX's "
                             f"{cfg.lr_schedule}, found {list(cfg.lr_schedule_args)} ({e})"
                             ) from None
    if not cfg.warmup:
        return main
    warm = optim.schedulers.linear_schedule(cfg.warmup_init, first, cfg.warmup)
    return optim.schedulers.join_schedules([warm, main], [cfg.warmup + 1])


def make_optimizer(cfg: Config) -> optim.Optimizer:
    """--optimizer with --lr-schedule; toymlx's AdamW (matrices decayed) for adamw."""
    lr = schedule(cfg)
    if cfg.optimizer == "adamw":
        return adamw(cfg, lr)
    if cfg.optimizer == "adam":
        return Adam(learning_rate=lr, betas=[cfg.beta1, cfg.beta2], eps=cfg.adam_eps,
                    bias_correction=cfg.bias_correction)
    return {"sgd": optim.SGD, "adafactor": optim.Adafactor, "muon": optim.Muon}[cfg.optimizer](
        learning_rate=lr)


def _base_targets(base: Path) -> dict[str, str]:
    """`gguf_targets` of the base's architecture, read from its header, for --lora.targets
    given in llama.cpp's tensor names; an architecture not known where the header cannot be
    read (a hint's read: the base is checked, and named, when it loads)."""
    try:
        with GGUFFile(base, whole=False) as g:
            arch = g.architecture
    except (GGUFError, OSError):
        arch = None
    return gguf_targets(arch if isinstance(arch, str) else None)


def fuse_type(choice: str, g: GGUFFile) -> str:
    """--fuse-at-end resolved to a file type ("base": the base's own); ValueError naming the
    flag when nothing here writes it."""
    dtype = export_type(g) if choice == "base" else choice
    try:
        quantizer(dtype)
    except ValueError as e:
        raise ValueError(f"--fuse-at-end {choice}: {e}") from None
    return dtype


def resolve_base_dtype(choice: str, gpu: bool, memory_first: bool,
                       step_bytes: Callable[[str], int]) -> str:
    """--base-dtype resolved: how the frozen base holds its weights (`load_llama`'s weights).
    auto: on a GPU `frozen_weights` (MLX's quantized layers, its fast path). On the CPU, float32
    where a training step with the float32 base (`step_bytes("float32")`, the memory estimate)
    takes at most half the memory available, unless `memory_first` (--grad-checkpoint): the
    blocks' values exactly, without decoding every weight in each pass of every step (on 2
    Intel Xeon cores 1.2-1.3x a float32-held step's time, 1.08x on an AMD Zen 5). Else the
    file's blocks, about the file's size in memory."""
    if choice != "auto":
        return choice
    if gpu or memory_first:
        return frozen_weights(gpu)
    return "float32" if memory.within_half_available(step_bytes("float32"))[0] else "blocks"


def loading_note(path: Path, types: str, dtype: str, est: memory.Estimate,
                 fits: dict[str, Any]) -> str | None:
    """The line said before a large base loads (`memory.loading_note`), with the step's
    estimated peak against the memory available; None for a small one."""
    note = memory.loading_note(path, types, f"{dtype} (--base-dtype)", est.base)
    if note is None:
        return None
    have = fits["available_mb"]
    return (f"{note}; a training step needs about {est.total / memory.GB:.1f} GB"
            + ("" if have is None else f" of the {have * 2**20 / memory.GB:.1f} GB available"))


def check_train_batch(batch_size: int, data: SFTData) -> None:
    """--batch-size against the training rows: ValueError naming the file they came from
    (train.jsonl alone; the run's general check, `runner.run.check_batch_fits`, covers the other
    recipes' windows and images), and for packed
    rows the examples they pack into (6 short examples are 2 rows of 256 tokens, not 6;
    mlx-lm's one example a row is --data.no-pack)."""
    rows, fit = len(data.train["inputs"]), data.fits.get("train")
    if batch_size <= rows:
        return
    if not data.pack or fit is None or fit.examples <= rows:
        raise ValueError(f"--batch-size: expected at most {rows} (the training split of "
                         f"{data.source.of('train')} holds {counted(rows, 'row')}), found "
                         f"{batch_size}; use --batch-size {rows} or less, or more data")
    raise ValueError(f"--batch-size: expected at most {rows} (the {fit.examples} training "
                     f"examples of {data.source.of('train')} pack into "
                     f"{counted(rows, 'row')} of --seq-len {data.seq_len}), found "
                     f"{batch_size}; use --batch-size {rows}, "
                     "--data.no-pack (one example a row), or more data")


def build(cfg: Config, ops: Ops) -> Task:
    validate(cfg)
    mx.random.seed(cfg.seed)
    full = cfg.fine_tune_type == "full"
    some = full and cfg.full.layers is not None  # a full fine-tune of the last N blocks
    # a path, or ollama:NAME / lmstudio:NAME / hf:...; an Ollama blob's SHA-256 (a read of the
    # whole file) checked once the run fits, before its weights load
    src = model_store.resolve(cfg.base, "--base", check_digest=False)
    with GGUFFile(src.path) as g:
        types = "/".join(sorted(set(projection_types(g).values())))
        a = args_from_gguf(g)
        # before the memory estimate, whose advice for a window past the context is "try a
        # smaller --seq-len" among others
        check_seq_len(cfg.seq_len, a.context, f" (the context of --base {cfg.base})")
        targets: tuple[str, ...] = ()
        if not full:  # before the memory estimate, which sizes each target's projection
            targets = resolve_targets(cfg.lora.targets, a)  # all-linear as this base's, ...
            check_targets(targets, a, cfg.lora.layers)
        trained_blocks = target_blocks(a.n_layers, cfg.full.layers, "--full.layers")
        trained = block_tensors(g.tensors, trained_blocks) if some else frozenset()

        streams = memory.step_streams(cfg.cpu_streams, cfg.batch_size)
        blas = backend_info().get("blas")  # the CPU's BLAS holds memory of its own (None: GPU)

        def step_estimate(held: str) -> memory.Estimate:
            return memory.estimate(
                g, held=held, full=full, targets=targets,
                rank=cfg.lora.rank, layers=cfg.full.layers if full else cfg.lora.layers,
                dora=cfg.fine_tune_type == "dora", batch_size=cfg.batch_size,
                seq_len=cfg.seq_len, ops=ops, streams=streams, blas=blas)

        dtype = "float32" if full and not some else resolve_base_dtype(
            cfg.base_dtype, on_gpu(), cfg.grad_checkpoint, lambda held: step_estimate(held).total)
        est = step_estimate(dtype)
        # a float-held base (--base-dtype float32, or auto with memory to spare) its blocks
        # would hold in less: the advice when the step does not fit
        blocks_smaller = (not full and dtype in ("float32", "bfloat16", "float16")
                          and step_estimate("blocks").total < est.total)
        fits = memory.check_fits(est, f"--base {cfg.base}", cfg.force,
                                 cfg.grad_checkpoint, blocks_smaller, streams)
    model_store.check_digests(src, "--base")  # a store's blob is its name's before it is read
    with GGUFFile(src.path) as g:
        tok = Tokenizer.from_metadata(dict(g.metadata), source=src.path)  # errors name the GGUF
    # the data read and tokenized before the weights load: a record it refuses (a typo in the
    # file) is said at once, not after minutes of loading a large base
    with keys_hint(cfg.data.keys):
        data = SFTData.from_file(cfg.data.path or DEFAULT_DATA, tok, cfg.seq_len,
                                 cfg.data.mask_prompt, cfg.data.pack, cfg.data.val_fraction,
                                 turns=cfg.data.train_turns, progress=cfg.progress,
                                 keys=row_keys(cfg.data.keys), drop_tools=cfg.data.drop_tools,
                                 test=cfg.test)
    data.check_held_out(cfg.test)
    check_train_batch(cfg.batch_size, data)
    # rows cut or left out at --seq-len are said once, as mlx-lm warns of truncation
    for note in data.notes(cfg.test):
        print(f"toymlx: {note}", file=sys.stderr)
    if note := loading_note(src.path, types, dtype, est, fits):
        print(f"toymlx: {note}", file=sys.stderr)
    model, g = load_llama(src.path, ops, dtype, trained)
    if some:  # mlx-lm's full fine-tune: model.freeze(), then each trained block unfrozen
        model.freeze()
        for i in trained_blocks:
            model.layers[i].unfreeze()
    meta = dict(g.metadata)
    g.close()
    args = model.args
    base_meta = {"general.architecture": meta.get("general.architecture", "llama"),
                 "general.name": meta.get("general.name", Path(cfg.base).stem)}
    base_label = cfg.base if src.store else Path(cfg.base).name  # a store name: anywhere
    info = llama_model_info(args)
    info.update(base=str(cfg.base), base_name=base_meta["general.name"], base_type=types,
                base_dtype=dtype, base_held_bytes=model_bytes(model))
    if full:
        def save(path: Path, m, extra: dict) -> None:
            with GGUFFile(src.path) as base:
                write_like_base(path, base, m, cfg.save_dtype,
                                {**extra, "toy.base": base_label,
                                 "toy.checkpoint_format": CHECKPOINT_FORMAT})

        load, prefix = load_llama_into, "step_"
        info.update(full_layers=len(trained_blocks))
    else:
        target_blocks(args.n_layers, cfg.lora.layers)  # --lora.layers checked against the base
        apply_lora(model, targets, cfg.lora.layers, cfg.lora.rank, cfg.lora.alpha,
                   cfg.lora.dropout, kind=cfg.fine_tune_type)
        if cfg.lora.init_adapter:
            load_adapter_weights(model, cfg.lora.init_adapter, "--lora.init-adapter")

        def save(path: Path, m, extra: dict) -> None:
            write_adapter(path, m, base_meta, {**extra, "toy.base": base_label},
                          dtype=cfg.save_dtype)

        def load(path: Path, m) -> None:
            load_adapter_weights(m, path)

        prefix = "adapter_step_"
        reached, note = target_reach(args, targets, target_blocks(args.n_layers, cfg.lora.layers))
        if note is not None:  # qwen35's default q: its full-attention blocks alone
            print(f"toymlx: {note}", file=sys.stderr)
        info.update(lora_rank=cfg.lora.rank, lora_alpha=cfg.lora.alpha,
                    lora_targets=",".join(targets), lora_layers=cfg.lora.layers or args.n_layers,
                    lora_blocks_reached=reached, **({"lora_reach": note} if note else {}))
    if src.digest:  # a resume re-resolves the name: refused if the tag now names another blob
        info["base_sha256"] = src.digest.removeprefix("sha256:")

    def finish(run_dir: Path) -> dict:
        """--fuse-at-end: the base + the final adapter (weights/latest) as one GGUF; a full
        fine-tune's final checkpoint re-encoded (`write_reencoded` either way)."""
        with GGUFFile(src.path) as g:
            dtype = fuse_type(cfg.fuse_at_end, g)
        bars = cfg.progress and draws_bars()  # as the run's own: none drawn into a log
        out = check_output(run_dir / f"fused-{dtype}.gguf", [("--base", src.path)],
                           "--fuse-at-end", owns=[run_dir])
        # what the file records of this run, its data's fingerprint as config.json holds it
        run = run_data_metadata(cfg, read_config(run_dir, "--fuse-at-end").get(
            DATA_FILES_KEY, {}).get("data.path"))
        if full:
            if cfg.fuse_at_end == "base":  # the file that keeps the fine-tune (toymlx.gguf.fuse)
                kept = write_full_kept(out, src.path, run_dir, progress=bars, run_data=run).kept
            else:
                write_reencoded(out, run_dir, None, dtype, progress=bars, run_data=run)
                kept = None
            warn_unquantized(out, dtype)
            return {"path": out.name, "type": dtype, "quantizer": quantizer(dtype),
                    "bytes": out.stat().st_size,
                    **({"fine_tune_kept": round(kept, 4)} if kept is not None else {})}
        if cfg.fuse_at_end == "base":  # the file that keeps the fine-tune (toymlx.gguf.fuse)
            kept = write_fused_kept(out, src.path, run_dir, progress=bars, run_data=run).kept
        else:
            write_reencoded(out, src.path, run_dir, dtype, progress=bars, run_data=run)
            retention = adapter_retention(out, src.path, run_dir)
            kept = retention.kept
            if kept < KEPT_WARNING:
                print(f"toymlx: {out} {kept_note(retention, dtype, '--fuse-at-end')}",
                      file=sys.stderr)
        warn_unquantized(out, dtype)
        return {"path": out.name, "type": dtype, "quantizer": quantizer(dtype),
                "bytes": out.stat().st_size, "adapter_kept": round(kept, 4)}

    def warn_unquantized(out: Path, dtype: str) -> None:
        """The matrices a type asked for (not "base": the base's own types) left out of it, as
        toymlx-export's --dtype says them."""
        if cfg.fuse_at_end != "base" and (left := unquantized_note(out, dtype)):
            print(f"toymlx: warning: {out}: {left}", file=sys.stderr)

    def export_later(run_dir: Path) -> str:
        """The toymlx-export line that writes the file `finish` writes, beside the run
        (toymlx-export keeps out of run folders; `toymlx-train --resume` writes it inside)."""
        with GGUFFile(src.path) as g:
            dtype = fuse_type(cfg.fuse_at_end, g)
        what = f"--base {run_dir}" if full else f"--adapter {run_dir} --fuse"
        typed = "" if cfg.fuse_at_end == "base" else f" --dtype {dtype}"
        return f"toymlx-export {what}{typed} --out {run_dir}-fused-{dtype}.gguf"

    # n_params and n_trainable are added by the trainer to run_start's model record
    return Task(
        recipe="lora", model=model, loss_fn=lm_loss, metrics_fn=lm_held_out_rows,
        train_batch=lambda s: data.batch(s, cfg.seed, cfg.batch_size, cfg.grad_accum),
        batch_widths=None if data.pack else (
            lambda steps: data.batch_widths(steps, cfg.seed, cfg.batch_size, cfg.grad_accum)),
        val_batches=data.val_batches(cfg.batch_size, eval_batch_limit(cfg.eval_batches),
                                     cfg.grad_checkpoint),
        save=save, load=load, model_info=info,
        config_info={"context": cfg.seq_len, "base_dtype_resolved": dtype,
                     **({} if full else {"lora_targets_resolved": ",".join(targets)}),
                     "data_source": str(data.source),
                     **({"test_source": data.test_source,
                         "test_rows": len(data.test["inputs"])} if data.test is not None
                        else {}),
                     "train_rows": len(data.train["inputs"]), "val_rows": len(data.val["inputs"]),
                     "train_target_tokens": int(data.train["mask"].sum()),
                     "n_truncated": data.n_truncated, **src.record("base")},
        unit="tokens", count=lambda b: int(np.sum(b["mask"])),
        prefix=prefix,
        test_batches=data.test_batches(cfg.batch_size, cfg.grad_checkpoint) if cfg.test else [],
        finish=finish if cfg.fuse_at_end else None,
        export_later=export_later if cfg.fuse_at_end else None, memory=fits,
        optimizer=make_optimizer,
        lr_fn=None if cfg.lr_schedule == "warmup-cosine" else schedule(cfg))
