"""Text generation with a Llama's KV cache, and loading a model to generate from.

The prompt is run through the model once (prefill, filling the per-layer KV cache); every
later step feeds only the newest token. Temperature 0 is greedy (argmax); otherwise the
next token is drawn from the softmax at `temperature`, restricted to the smallest set of
tokens whose probability mass reaches `top_p` (nucleus sampling), with a numpy generator
seeded by `seed` so a run is reproducible.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from toymlx.gguf.reader import GGUFError, GGUFFile
from toymlx.models.llama import Llama


def sample_token(logits: np.ndarray, temperature: float, top_p: float,
                 rng: np.random.Generator) -> int:
    """One token id from a (vocab,) logits vector: argmax at temperature 0, else nucleus."""
    if temperature <= 0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    if top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        cum = np.cumsum(p[order])
        # Keep every token whose preceding mass is below top_p (always at least the top one).
        keep = order[: int(np.searchsorted(cum, top_p, side="left")) + 1]
        q = p[keep] / p[keep].sum()
        return int(keep[rng.choice(len(keep), p=q)])
    return int(rng.choice(len(p), p=p))


def generate(model: Llama, tokenizer: Any, prompt_ids: Sequence[int], max_tokens: int = 128,
             temperature: float = 0.0, top_p: float = 1.0, seed: int = 0) -> Iterator[int]:
    """Yield up to `max_tokens` new token ids after `prompt_ids`; stops before eos."""
    if len(prompt_ids) == 0:
        raise ValueError("prompt: expected at least one token, found an empty prompt")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"--top-p: expected in (0, 1], found {top_p}")
    if temperature < 0:
        raise ValueError(f"--temperature: expected >= 0, found {temperature}")
    eos = getattr(tokenizer, "eos_id", None)
    context = model.args.context
    rng = np.random.default_rng(seed)
    cache = model.make_cache()
    x = mx.array([list(prompt_ids)], dtype=mx.int32)  # (1, T)
    n = len(prompt_ids)
    for _ in range(max_tokens):
        if n >= context:  # past the trained context the model's output is meaningless
            return
        logits = model(x, cache=cache)[0, -1]  # (V,)
        if temperature <= 0:
            tok = int(mx.argmax(logits).item())
        else:
            tok = sample_token(np.array(logits.astype(mx.float32)), temperature, top_p, rng)
        if eos is not None and tok == eos:
            return
        yield tok
        x = mx.array([[tok]], dtype=mx.int32)  # (1, 1)
        n += 1


def resolve_model_path(path: str | os.PathLike) -> Path:
    """A GGUF path as given, or the checkpoint `weights/latest` names in a run directory."""
    from toymlx.checkpoint import resolve_latest

    p = Path(path)
    if p.is_dir():
        return resolve_latest(p)
    if not p.exists():
        raise FileNotFoundError(f"{p}: --model: expected a GGUF file or a run directory, "
                                "found nothing at that path")
    return p


def _lora_run_base(path: str | os.PathLike) -> str | None:
    """The `--base` a LoRA run was trained on (its config.json), when `path` is in a run."""
    import json

    p = Path(path)
    for run_dir in (p, p.parent.parent):  # the run folder, or a file in its weights/
        cfg = run_dir / "config.json"
        if cfg.is_file():
            try:
                base = json.loads(cfg.read_text())["config"]["base"]
            except (ValueError, KeyError, TypeError):
                return None
            return str(base) if base else None
    return None


def load_for_generation(path: str | os.PathLike) -> tuple[Llama, Any]:
    """(model, tokenizer) from a llama GGUF or a run directory (its `weights/latest`); a LoRA
    run's adapter comes with the base model it was trained on."""
    from toymlx.gguf.llama import args_from_gguf, load_llama
    from toymlx.tokenizer import Tokenizer

    gguf_path = resolve_model_path(path)
    g = GGUFFile(gguf_path)
    if g.metadata.get("general.type") == "adapter":
        base = g.metadata.get("toy.base")
        g.close()
        base = _lora_run_base(path) or base
        if isinstance(base, str) and Path(base).is_file():  # a LoRA run: its base + adapter
            from toymlx.lora import apply_adapter

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
