"""Recipe `from-scratch`: a randomly initialised Llama trained on a text file (or an mlx-lm
data folder of {"text": ...} records, whose test.jsonl `--test` scores at the end).

Bytes are the vocabulary (256 byte tokens plus <unk>, <s>, </s>) unless `--tokenizer` names a
GGUF whose tokenizer to use instead (SmolLM2's 49,152 BPE tokens, say, as nanoGPT trains on
GPT-2's); either is stored in each checkpoint, so the checkpoints run in llama.cpp as they are.
A chat model's `tokenizer.chat_template` is left out: the model learns plain text alone, and
llama-cli and Ollama would wrap every prompt in turns it never saw.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx

from toymlx.bundle import model_store
from toymlx.bundle.folder import check_model_file
from toymlx.data.tokenizer import Tokenizer, byte_tokenizer
from toymlx.gguf.llama import TRAINED_WINDOW, load_llama_into, write_llama
from toymlx.gguf.reader import read_metadata, refuse_adapter
from toymlx.models.llama import Llama
from toymlx.models.ops import Ops
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
from toymlx.training.task import Task, TrainConfig


@dataclass
class Config(TrainConfig):
    """toymlx-train --recipe from-scratch: train a small Llama from random init."""

    seq_len: int = 256
    """Tokens per training sequence."""
    tokenizer: str | None = None
    """A GGUF whose tokenizer the model uses, its vocabulary the model's (only the file's
    tokenizer metadata is read, so llama.cpp's vocab-only GGUFs do too): a path, or a name as
    --base takes (ollama:NAME, lmstudio:NAME, hf:USER/REPO/FILE.gguf); default: bytes (259
    ids, one per UTF-8 byte)."""
    model: LlamaOptions = field(default_factory=LlamaOptions)
    data: TextData = field(default_factory=TextData)
    test: bool = False
    """At the end of a completed run, score the data folder's test.jsonl (--data.path in
    mlx-lm's layout): loss and perplexity over all its windows of --seq-len tokens, an `eval`
    event with split "test" (later: `toymlx-eval --model RUN --split test`)."""


settle = settle_text_run
"""A new run's options that its inputs decide, given their values."""


def validate(cfg: Config) -> None:
    """The model's shape (before any file is read: a sweep refuses a bad grid value before
    its runs start), --test's data folder with test.jsonl; the data itself is checked as it is
    read."""
    cfg.model.build_args(vocab_size=1)  # the vocabulary is the tokenizer's, not yet read
    check_text_seq_len(cfg)
    check_reading(cfg.data)
    if cfg.tokenizer is not None:
        check_model_file(cfg.tokenizer, "--tokenizer")
    if cfg.test:
        check_test_folder(cfg.data.path)


def tokenizer(cfg: Config) -> Tokenizer:
    """The model's tokenizer: --tokenizer's GGUF's, else bytes."""
    if cfg.tokenizer is None:
        return byte_tokenizer()
    path = model_store.resolve_model(cfg.tokenizer, "--tokenizer")
    meta = read_metadata(path)
    refuse_adapter(path, meta, "--tokenizer")
    return Tokenizer.from_metadata(meta, path)


def build(cfg: Config, ops: Ops) -> Task:
    tok = tokenizer(cfg)
    args = cfg.model.build_args(tok.vocab_size)
    data = load_token_data(cfg.data, tok, cfg.seq_len, cfg.test, progress=cfg.progress)
    mx.random.seed(cfg.seed)
    model = Llama(args, ops)
    tok_meta = tok.to_metadata(chat_template=False)  # trained on plain text alone

    def save(path: Path, m: Llama, extra: dict) -> None:
        write_llama(path, m, tok_meta, {TRAINED_WINDOW: cfg.seq_len, **extra},
                    name="toymlx from-scratch", dtype=cfg.save_dtype)

    return lm_task("from-scratch", cfg, cfg.seq_len, model, data, save, load_llama_into,
                   config_info={"tokenizer": "bytes" if cfg.tokenizer is None
                                             else f"gguf ({tok.source})"}, model_info=llama_model_info(args))
