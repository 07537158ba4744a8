"""Llama in mlx.nn, in llama.cpp's GGUF conventions.

Weights are `(out, in)`; RoPE rotates adjacent pairs (x[2i], x[2i+1]) as llama.cpp does for
arch "llama", so GGUF q/k weights are used as stored and never permuted. Query head h reads
kv head h // (n_heads // n_kv_heads). The math runs through the `Ops` the model is built with
(`toymlx.models.ops`): `Llama(args)` computes with MLX's own ops in float32, the trainer builds
it with the run's `Ops`. Generation uses mlx-lm's KV cache (`make_cache`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import mlx.core as mx
from mlx import nn
from mlx.utils import tree_flatten, tree_unflatten

from toymlx.models.layers import Linear, RMSNorm
from toymlx.models.ops import EXACT, Ops


@dataclass(frozen=True)
class LlamaArgs:
    vocab_size: int = 259
    """Number of token ids (rows of token_embd)."""
    d_model: int = 256
    """Hidden width (llama.embedding_length)."""
    n_layers: int = 4
    """Number of transformer blocks (llama.block_count)."""
    n_heads: int = 8
    """Query heads (llama.attention.head_count)."""
    n_kv_heads: int = 4
    """Key/value heads; fewer than n_heads means grouped-query attention."""
    ffn_dim: int = 704
    """SwiGLU hidden width (llama.feed_forward_length)."""
    context: int = 1024
    """Longest sequence the model is trained for (llama.context_length)."""
    rope_base: float = 10000.0
    """RoPE frequency base (llama.rope.freq_base)."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon (llama.attention.layer_norm_rms_epsilon)."""
    tie_embeddings: bool = True
    """Use token_embd as the output head (no output.weight)."""
    key_length: int | None = None
    """Per-head width where it is not d_model // n_heads (llama.attention.key_length)."""

    @property
    def head_dim(self) -> int:
        """Per-head width of q, k and v."""
        return self.key_length or self.d_model // self.n_heads

    def validate(self) -> None:
        """Raise ValueError naming the field when the shape is inconsistent."""
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model.{name}: expected > 0, found {getattr(self, name)}")
        if self.key_length is None and self.d_model % self.n_heads:
            raise ValueError(
                f"model.d_model: expected a multiple of n_heads={self.n_heads}, found {self.d_model}"
            )
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"model.n_kv_heads: expected a divisor of n_heads={self.n_heads}, "
                f"found {self.n_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"model head_dim: expected an even number for RoPE, found "
                             f"{self.head_dim}")


def tiny(**kw) -> LlamaArgs:
    """A 4-layer, 256-wide Llama over the byte vocabulary: trains in minutes on a CPU."""
    return replace(LlamaArgs(), **kw)


def smollm2_135m(**kw) -> LlamaArgs:
    """The SmolLM2-135M shape."""
    base = LlamaArgs(vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3,
                     ffn_dim=1536, context=8192, rope_base=100000.0, norm_eps=1e-5,
                     tie_embeddings=True)
    return replace(base, **kw)


def smollm2_360m(**kw) -> LlamaArgs:
    """The SmolLM2-360M shape."""
    base = LlamaArgs(vocab_size=49152, d_model=960, n_layers=32, n_heads=15, n_kv_heads=5,
                     ffn_dim=2560, context=8192, rope_base=100000.0, norm_eps=1e-5,
                     tie_embeddings=True)
    return replace(base, **kw)


PRESETS = {"tiny": tiny, "smollm2-135m": smollm2_135m, "smollm2-360m": smollm2_360m}

class Attention(nn.Module):
    def __init__(self, a: LlamaArgs, ops: Ops):
        super().__init__()
        self.ops = ops
        self.n_heads, self.n_kv, self.head_dim = a.n_heads, a.n_kv_heads, a.head_dim
        self.scale = a.head_dim ** -0.5
        self.rope_base = a.rope_base
        self.q_proj = Linear(a.d_model, a.n_heads * a.head_dim, bias=False, ops=ops)
        self.k_proj = Linear(a.d_model, a.n_kv_heads * a.head_dim, bias=False, ops=ops)
        self.v_proj = Linear(a.d_model, a.n_kv_heads * a.head_dim, bias=False, ops=ops)
        self.o_proj = Linear(a.n_heads * a.head_dim, a.d_model, bias=False, ops=ops)

    def __call__(self, x: mx.array, cache: Any = None) -> mx.array:
        B, T, _ = x.shape
        hd = self.head_dim
        q = self.q_proj(x).reshape(B, T, self.n_heads, hd).transpose(0, 2, 1, 3)  # (B,H,T,hd)
        k = self.k_proj(x).reshape(B, T, self.n_kv, hd).transpose(0, 2, 1, 3)  # (B,Hkv,T,hd)
        v = self.v_proj(x).reshape(B, T, self.n_kv, hd).transpose(0, 2, 1, 3)  # (B,Hkv,T,hd)
        offset = 0 if cache is None else cache.offset
        q = self.ops.rope(q, self.rope_base, offset)
        k = self.ops.rope(k, self.rope_base, offset)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)  # (B,Hkv,S,hd): every position so far
        o = self.ops.attention(q, k, v, self.scale, causal=True)  # (B,H,T,hd)
        o = o.transpose(0, 2, 1, 3).reshape(B, T, -1)  # (B,T,H*hd)
        return self.o_proj(o)


class MLP(nn.Module):
    def __init__(self, a: LlamaArgs, ops: Ops):
        super().__init__()
        self.ops = ops
        self.gate_proj = Linear(a.d_model, a.ffn_dim, bias=False, ops=ops)
        self.up_proj = Linear(a.d_model, a.ffn_dim, bias=False, ops=ops)
        self.down_proj = Linear(a.ffn_dim, a.d_model, bias=False, ops=ops)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(self.ops.silu_mul(self.gate_proj(x), self.up_proj(x)))


class Block(nn.Module):
    def __init__(self, a: LlamaArgs, ops: Ops):
        super().__init__()
        self.attn_norm = RMSNorm(a.d_model, eps=a.norm_eps, ops=ops)
        self.attn = Attention(a, ops)
        self.ffn_norm = RMSNorm(a.d_model, eps=a.norm_eps, ops=ops)
        self.mlp = MLP(a, ops)

    def __call__(self, x: mx.array, cache: Any = None) -> mx.array:
        x = x + self.attn(self.attn_norm(x), cache)
        return x + self.mlp(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, args: LlamaArgs, ops: Ops = EXACT):
        super().__init__()
        args.validate()
        self.args, self.ops = args, ops
        self.embed = nn.Embedding(args.vocab_size, args.d_model)
        self.layers = [Block(args, ops) for _ in range(args.n_layers)]
        self.norm = RMSNorm(args.d_model, eps=args.norm_eps, ops=ops)
        if not args.tie_embeddings:
            self.output = Linear(args.d_model, args.vocab_size, bias=False, ops=ops)
        self._init_weights()

    def _init_weights(self) -> None:
        # GPT-2 style: N(0, 0.02), residual projections scaled down by depth.
        std = 0.02
        resid_std = std / (2 * self.args.n_layers) ** 0.5

        def init(path: str, w: mx.array) -> mx.array:
            if path.endswith("norm.weight"):
                return w
            s = resid_std if path.endswith(("o_proj.weight", "down_proj.weight")) else std
            return mx.random.normal(w.shape, scale=s)

        self.update(tree_unflatten([(k, init(k, v)) for k, v in tree_flatten(self.parameters())]))

    def embed_tokens(self, tokens: mx.array) -> mx.array:
        """(B, T) token ids -> (B, T, D) rows of the token table."""
        return self.ops.embed(self.embed.weight, tokens)

    def unembed(self, h: mx.array) -> mx.array:
        """(B, T, D) -> (B, T, V) logits: the tied token table, or output.weight."""
        if self.args.tie_embeddings:
            return self.ops.unembed(h, self.embed.weight)
        return self.output(h)

    def __call__(self, tokens: mx.array, cache: list[Any] | None = None) -> mx.array:
        h = self.embed_tokens(tokens)  # (B,T,D)
        for i, layer in enumerate(self.layers):
            h = self.ops.block(layer, h) if cache is None else layer(h, cache[i])
        return self.unembed(self.norm(h))  # (B,T,V)

    def make_cache(self) -> list[Any]:
        """One mlx-lm KV cache per block, for generation."""
        # imported here: mlx_lm's package imports transformers (~1.5 s), which training skips
        from mlx_lm.models.cache import KVCache

        return [KVCache() for _ in self.layers]
