"""Recipe `warm-start`: a new Llama whose token table starts from a donor GGUF's.

The student embeds tokens at the donor's width through the donor's `token_embd.weight` and a
learned lens (donor width x student width) into its own width; everything else starts from
random init, the final norm's weight (with a tied head) at `warm.head_norm_weight`: first
logits of unit spread. It uses the donor's tokenizer, and its checkpoints are plain llama GGUFs
with the lens folded into `token_embd.weight` (see toymlx/recipes/warm.py; the unfolded table
and lens for resume live in `step_N.warm.safetensors` beside each checkpoint), without the
donor's `tokenizer.chat_template`: the student learns plain text alone.

`--warm.init random` keeps everything (shape, vocabulary, tokenizer, lens rule, optimizer, the
rest of the init) and replaces only the donor table's values by Gaussian noise of the same RMS:
the from-scratch baseline that isolates what the donor's table contributes.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Literal

import mlx.core as mx
import numpy as np

from toymlx.bundle import model_store
from toymlx.bundle.folder import check_model_file
from toymlx.data.merges import BYTE_TO_UNICODE
from toymlx.data.tokenizer import Tokenizer
from toymlx.data.vocab import K_MODEL, K_TOKENS, is_byte_token
from toymlx.gguf.llama import TRAINED_WINDOW, write_llama
from toymlx.gguf.reader import GGUFError
from toymlx.models.ops import Ops
from toymlx.recipes import warm
from toymlx.recipes.common import (
    LlamaOptions,
    TextData,
    check_reading,
    check_test_folder,
    check_text_seq_len,
    llama_model_info,
    lm_task,
    load_token_data,
    settle_text_run,
)
from toymlx.training.task import Task, TrainConfig, decayed


@dataclass
class WarmOptions:
    """How the donor's table is brought into the student."""

    lens: Literal["pca", "random", "identity"] = "pca"
    """Initial lens: pca (the table's top principal directions), random (a random orthonormal
    projection), identity (only when student and donor widths are equal)."""
    init: Literal["donor", "random"] = "donor"
    """Table values: donor, or random (Gaussian noise of the donor table's RMS: a baseline)."""
    freeze_embeddings: int = 0
    """Keep the donor's table fixed for the first K steps (0: never, -1: the whole run); the
    lens still trains, so the student's embeddings (table @ lens, the checkpoint's
    token_embd.weight) still change."""
    vocab: int | None = None
    """Use the first N tokens of the donor's vocabulary and table (default: all)."""


@dataclass
class Config(TrainConfig):
    """toymlx-train --recipe warm-start: a new Llama with a donor GGUF's token table."""

    donor: str | None = None
    """Llama GGUF whose token_embd.weight and tokenizer the student starts from (required)."""
    seq_len: int = 256
    """Tokens per training sequence."""
    model: LlamaOptions = field(default_factory=LlamaOptions)
    """Student shape; its vocabulary is the donor's."""
    data: TextData = field(default_factory=TextData)
    warm: WarmOptions = field(default_factory=WarmOptions)
    test: bool = False
    """At the end of a completed run, score the data folder's test.jsonl (--data.path in
    mlx-lm's layout), tokenized by the donor's tokenizer: loss and perplexity over all its
    windows of --seq-len tokens, an `eval` event with split "test" (later:
    `toymlx-eval --model RUN --split test`)."""


settle = settle_text_run
"""A new run's options that its inputs decide, given their values."""


def validate(cfg: Config) -> None:
    """Checks that need no file (the student's shape among them); the donor itself is checked
    when it is read."""
    cfg.model.build_args(vocab_size=1)  # the vocabulary is the donor's, not yet read
    check_text_seq_len(cfg)
    check_reading(cfg.data)
    if not cfg.donor:
        raise ValueError("--donor: expected a llama GGUF to take the token table from, "
                         "found none (e.g. --donor SmolLM2-135M-Instruct.Q4_1.gguf)")
    check_model_file(cfg.donor, "--donor")
    if cfg.warm.freeze_embeddings < -1:
        raise ValueError(f"--warm.freeze-embeddings: expected -1, 0 or a step count, "
                         f"found {cfg.warm.freeze_embeddings}")
    if cfg.warm.vocab is not None and cfg.warm.vocab < 1:
        raise ValueError(f"--warm.vocab: expected >= 1, found {cfg.warm.vocab}")
    if cfg.test:
        check_test_folder(cfg.data.path)


def donor_tokenizer(donor: warm.Donor, vocab: int) -> Tokenizer:
    """The donor's tokenizer cut to its first `vocab` tokens (merges into cut tokens dropped)."""
    meta = donor.metadata
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list):
        raise GGUFError(f"{donor.path}: metadata key 'tokenizer.ggml.tokens': expected a "
                        "token list (the student uses the donor's tokenizer), found missing")
    if len(tokens) < vocab:
        raise GGUFError(f"{donor.path}: metadata key 'tokenizer.ggml.tokens': expected at "
                        f"least {vocab} tokens (rows of token_embd.weight), found {len(tokens)}")
    meta = {k: v for k, v in meta.items() if k.startswith("tokenizer.")}
    if vocab < len(tokens):
        check_bytes_kept(meta, vocab)
        for k in ("tokens", "scores", "token_type"):
            if isinstance(meta.get(f"tokenizer.ggml.{k}"), list):
                meta[f"tokenizer.ggml.{k}"] = meta[f"tokenizer.ggml.{k}"][:vocab]
        kept = set(tokens[:vocab])
        if "tokenizer.ggml.merges" in meta:
            meta["tokenizer.ggml.merges"] = [
                m for m in meta["tokenizer.ggml.merges"]
                if all(p in kept for p in m.split(" ", 1)) and m.replace(" ", "", 1) in kept]
        for k, v in list(meta.items()):
            if k.endswith("_token_id") and isinstance(v, int) and vocab <= v < 2**32 - 1:
                raise ValueError(f"--warm.vocab: expected more than {k}={v} tokens, found {vocab}")
    return Tokenizer.from_metadata(meta)


def byte_tokens_end(meta: dict) -> int:
    """One past the last id of a vocabulary's byte tokens, which spell any text: SentencePiece's
    `<0xXX>` (its byte fallback), byte-level BPE's 256 byte characters; 0 for none."""
    tokens, model = meta.get(K_TOKENS) or [], meta.get(K_MODEL)
    is_byte = (is_byte_token if model == "llama" else
               frozenset(BYTE_TO_UNICODE.values()).__contains__ if model == "gpt2" else None)
    return 1 + max((i for i, t in enumerate(tokens) if is_byte(t)), default=-1) if is_byte else 0


def check_bytes_kept(meta: dict, vocab: int) -> None:
    """ValueError (one line) for a `--warm.vocab` that cuts the donor's byte tokens: a text's
    character whose bytes' tokens were cut became SentencePiece's unknown token, or with
    byte-level BPE nothing at all (`--warm.vocab 100` of SmolLM2 read "naïve world" as
    "naveworld"), and the run trained on that without a word."""
    end = byte_tokens_end(meta)
    if vocab < end:
        lost = ("read as the unknown token" if meta.get(K_MODEL) == "llama" else
                "left out of the text")
        raise ValueError(f"--warm.vocab: expected at least {end} (the donor's byte tokens, "
                         f"which spell any text, end at id {end - 1}), found {vocab}: a "
                         f"character whose bytes' tokens are cut would be {lost}")


def make_optimizer(cfg: Config):
    """AdamW groups as usual, the table's with an LR that is 0 for the first K steps.

    A pure function of the optimizer step inside the one compiled step: with lr 0, AdamW leaves
    the table bit-identical (decay included) while its moments still track its gradients.
    """
    import mlx.core as mx
    import mlx.optimizers as optim

    from toymlx.training.optimizers import AdamW
    from toymlx.training.schedule import lr_at

    k = cfg.warm.freeze_embeddings
    sched = partial(lr_at, base_lr=cfg.lr, warmup=cfg.warmup, total=cfg.steps,
                    min_ratio=cfg.min_lr_ratio)

    def gated(step):
        return mx.where(step >= k, sched(step), 0.0)

    kw = {"betas": [cfg.beta1, cfg.beta2], "eps": cfg.adam_eps,
          "bias_correction": cfg.bias_correction}
    groups = [AdamW(learning_rate=gated, weight_decay=cfg.weight_decay, **kw),
              AdamW(learning_rate=sched, weight_decay=cfg.weight_decay, **kw),
              AdamW(learning_rate=sched, weight_decay=0.0, **kw)]
    return optim.MultiOptimizer(groups, [lambda path, w: path == "embed.weight",
                                         decayed(cfg)])


def build(cfg: Config, ops: Ops) -> Task:
    validate(cfg)
    w = cfg.warm
    donor = warm.read_donor(model_store.resolve_model(cfg.donor, "--donor"), w.vocab)
    print(f"toymlx: {donor.note(cfg.donor)}", file=sys.stderr)
    tok = donor_tokenizer(donor, donor.table.shape[0])
    vocab = tok.vocab_size
    table = donor.table[:vocab]
    args = cfg.model.build_args(vocab)
    # the data before the lens: a bad --data.path is refused without waiting for the SVD
    data = load_token_data(cfg.data, tok, cfg.seq_len, cfg.test, progress=cfg.progress)
    top = max(int(ids.max(initial=0)) for ids in (data.train, data.val, data.test)
              if ids is not None)
    if top >= vocab:
        raise ValueError(f"--warm.vocab: expected every token id of {data.source} below "
                         f"{vocab}, found {top}; use a larger --warm.vocab")
    rng = np.random.default_rng([cfg.seed, 0x5741524D])  # apart from the model's init stream
    if w.init == "random":
        table = rng.normal(0.0, warm.rms(table), table.shape).astype(np.float32)
    lens = warm.make_lens(w.lens, table, args.d_model, rng)
    mx.random.seed(cfg.seed)
    model = warm.WarmLlama(args, donor.width, ops)
    model.set_embedding(table, lens)
    if args.tie_embeddings:  # an untied head starts at a from-scratch model's 0.02 already
        weight = warm.head_norm_weight(np.array(model.embed.folded()))
        model.norm.weight = mx.full(model.norm.weight.shape, weight, dtype=mx.float32)
    if w.freeze_embeddings == -1:
        model.embed.freeze(keys=["weight"])
    tok_meta = tok.to_metadata(chat_template=False)  # trained on plain text alone
    info = {"donor": donor.path, "donor_width": donor.width, "donor_tensor_type":
            donor.tensor_type, "lens": w.lens, "init": w.init,
            "freeze_embeddings": w.freeze_embeddings, "vocab": vocab}
    meta = {TRAINED_WINDOW: cfg.seq_len, "toy.warm.donor": donor.path, "toy.warm.donor_width": donor.width,
            "toy.warm.lens": w.lens, "toy.warm.init": w.init}

    def save(path: Path, m: warm.WarmLlama, extra: dict) -> None:
        warm.save_warm_state(path, m, {**info, "step": extra.get("general.step")})
        write_llama(path, m, tok_meta, {**meta, **extra}, name="toymlx warm-start",
                    tensors=warm.folded_tensors(m), dtype=cfg.save_dtype)

    task = lm_task("warm-start", cfg, cfg.seq_len, model, data, save, warm.load_warm_checkpoint,
                   config_info={"tokenizer": f"donor ({donor.path})", **info},
                   model_info={**llama_model_info(args), "donor_width": donor.width,
                               "lens": w.lens})
    if w.freeze_embeddings > 0:
        task.optimizer = make_optimizer
    return task
