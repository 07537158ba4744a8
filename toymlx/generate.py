"""Text generation from a Llama, and loading a model to generate from.

The decoding loop is mlx-lm's (`mlx_lm.generate.generate_step`: chunked prefill into the
per-layer KV caches, then one token at a time with the next step computed while the current
token is handed out) and so are the samplers (`mlx_lm.sample_utils`: temperature, top-p,
min-p, top-k, repetition penalty); toymlx adds the stopping rules (end-of-sequence token, the
trained context) and seeds MLX's generator so a run repeats exactly.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from toymlx.checkpoint import checkpoint_file
from toymlx.gguf.llama import args_from_gguf, load_llama
from toymlx.gguf.reader import GGUFError, GGUFFile
from toymlx.lora import apply_adapter
from toymlx.model_store import is_store_name
from toymlx.models.llama import Llama
from toymlx.runs import Bundle
from toymlx.tokenizer import Tokenizer


def generate(model: Llama, tokenizer: Any, prompt_ids: Sequence[int], max_tokens: int = 128,
             temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, top_k: int = 0,
             min_p: float = 0.0, repetition_penalty: float | None = None) -> Iterator[int]:
    """Yield up to `max_tokens` new token ids after `prompt_ids`; stops before eos and at the
    model's context. Temperature 0 is greedy; otherwise sampled as mlx-lm samples."""
    if len(prompt_ids) == 0:
        raise ValueError("prompt: expected at least one token, found an empty prompt")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"--top-p: expected in (0, 1], found {top_p}")
    if temperature < 0:
        raise ValueError(f"--temperature: expected >= 0, found {temperature}")
    if top_k < 0:
        raise ValueError(f"--top-k: expected >= 0 (0: off), found {top_k}")
    if not 0.0 <= min_p < 1.0:
        raise ValueError(f"--min-p: expected in [0, 1) (0: off), found {min_p}")
    if repetition_penalty is not None and repetition_penalty <= 0:
        raise ValueError(f"--repetition-penalty: expected > 0, found {repetition_penalty}")
    # past the trained context the model's output is meaningless
    budget = min(max_tokens, model.args.context - len(prompt_ids))
    if budget <= 0:
        return
    eos = getattr(tokenizer, "eos_id", None)
    mx.random.seed(seed)
    sampler = make_sampler(temp=temperature, top_p=top_p if top_p < 1.0 else 0.0,
                           min_p=min_p, top_k=top_k)
    processors = make_logits_processors(repetition_penalty=repetition_penalty)
    steps = generate_step(mx.array(list(prompt_ids), dtype=mx.int32), model,
                          max_tokens=budget, sampler=sampler, logits_processors=processors)
    for tok, _ in steps:
        if eos is not None and tok == eos:
            return
        yield int(tok)


def _lora_run_base(path: str | os.PathLike) -> str | None:
    """The `--base` a LoRA run was trained on (its config.json), when `path` is in a run."""
    bundle = Bundle.of(path)
    base = getattr(bundle.config, "base", None) if bundle is not None else None
    return str(base) if base else None


def load_for_generation(path: str | os.PathLike) -> tuple[Llama, Any]:
    """(model, tokenizer) from a llama GGUF or a run directory (its `weights/latest`); a LoRA
    run's adapter comes with the base model it was trained on."""
    gguf_path = checkpoint_file(path)
    g = GGUFFile(gguf_path)
    if g.metadata.get("general.type") == "adapter":
        base = g.metadata.get("toy.base")
        g.close()
        base = _lora_run_base(path) or base
        if isinstance(base, str) and (Path(base).is_file() or is_store_name(base)):
            model, tokenizer = load_for_generation(base)
            return apply_adapter(model, gguf_path), tokenizer
        raise GGUFError(f"{gguf_path}: metadata key 'general.type': expected a model, found a "
                        "LoRA adapter (pass its base model as --model and this as --adapter"
                        + (f"; its base {base} is not a file here)" if base else ")"))
    args_from_gguf(g)  # architecture, hyperparameters and tensor shapes, before any loading
    if "tokenizer.ggml.tokens" not in g.metadata:
        raise GGUFError(f"{gguf_path}: metadata key 'tokenizer.ggml.tokens': expected a "
                        "tokenizer in the GGUF, found missing")
    tokenizer = Tokenizer.from_metadata(g.metadata, source=gguf_path)
    g.close()
    model, g = load_llama(gguf_path)
    g.close()
    if tokenizer.vocab_size > model.args.vocab_size:
        raise GGUFError(f"{gguf_path}: tensor 'token_embd.weight': expected at least "
                        f"{tokenizer.vocab_size} rows (the tokenizer's vocabulary), found "
                        f"{model.args.vocab_size}")
    return model, tokenizer
