"""Llama in mlx.nn, in llama.cpp's GGUF conventions.

Weights are `(out, in)`; RoPE rotates adjacent pairs (x[2i], x[2i+1]) as llama.cpp does for
arch "llama", so GGUF q/k weights are used as stored and never permuted. Query head h reads
kv head h // (n_heads // n_kv_heads).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import mlx.core as mx
from mlx import nn

from toymlx import fastmath
from toymlx.models.layers import Linear, RMSNorm


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
    head_dim: int | None = None
    """Per-head width; defaults to d_model // n_heads."""

    @property
    def hd(self) -> int:
        return self.head_dim or self.d_model // self.n_heads

    def validate(self) -> None:
        """Raise ValueError naming the field when the shape is inconsistent."""
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model.{name}: expected > 0, found {getattr(self, name)}")
        if self.head_dim is None and self.d_model % self.n_heads:
            raise ValueError(
                f"model.d_model: expected a multiple of n_heads={self.n_heads}, found {self.d_model}"
            )
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"model.n_kv_heads: expected a divisor of n_heads={self.n_heads}, "
                f"found {self.n_kv_heads}"
            )
        if self.hd % 2:
            raise ValueError(f"model head_dim: expected an even number for RoPE, found {self.hd}")


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

def silu_mul(gate: mx.array, up: mx.array) -> mx.array:
    """silu(gate) * up (SwiGLU); on the CPU through `toymlx.fastmath` (same values, ~4x faster)."""
    if fastmath.enabled():
        return fastmath.silu(gate) * up
    return nn.silu(gate) * up


def causal_attention(q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
    """softmax(q k^T scale, causal) v: q (B,H,T,hd) are the last T of the S positions in k, v
    (B,Hkv,S,hd) (GQA: query head h reads kv head h // (H // Hkv)).

    MLX's fused kernel, except where `toymlx.fastmath` is on (the CPU): there the explicit form
    with its vectorised softmax.
    """
    if fastmath.enabled():
        return fastmath.attention(q, k, v, scale, causal=True)
    mask = "causal" if q.shape[2] > 1 else None
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


class ExactRoPE:
    """Adjacent-pair RoPE with cos/sin tables computed in float64.

    mx.fast.rope forms angles in float32, which on SmolLM2 (base 1e5) costs ~3e-5 in the
    logits against llama.cpp; exact tables keep toymlx within ~6e-5 of an fp64 forward. The
    tables are constants of the traced step, and applying them is only multiplies and adds.
    """

    def __init__(self, dims: int, base: float):
        self.dims, self.base = dims, base
        self._cache: dict[tuple[int, int], tuple[mx.array, mx.array]] = {}

    def tables(self, offset: int, T: int) -> tuple[mx.array, mx.array]:
        key = (offset, T)
        if key not in self._cache:
            import numpy as np

            inv = self.base ** (-np.arange(0, self.dims, 2, dtype=np.float64) / self.dims)
            ang = np.arange(offset, offset + T, dtype=np.float64)[:, None] * inv  # (T, hd/2)
            tabs = (mx.array(np.cos(ang).astype(np.float32)),
                    mx.array(np.sin(ang).astype(np.float32)))
            if len(self._cache) > 64:  # generation walks offsets one by one
                self._cache.clear()
            self._cache[key] = tabs
        return self._cache[key]

    def __call__(self, x: mx.array, offset: int = 0) -> mx.array:
        cos, sin = self.tables(offset, x.shape[-2])
        x0, x1 = x[..., 0::2], x[..., 1::2]  # (B,H,T,hd/2) each
        out = mx.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], axis=-1)  # (B,H,T,hd/2,2)
        return out.reshape(x.shape)


class KVCache:
    """Grows by concatenation; enough for toy-sized generation."""

    def __init__(self):
        self.keys = None
        self.values = None

    @property
    def offset(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def update(self, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        if self.keys is None:
            self.keys, self.values = k, v
        else:
            self.keys = mx.concatenate([self.keys, k], axis=2)
            self.values = mx.concatenate([self.values, v], axis=2)
        return self.keys, self.values


class Attention(nn.Module):
    def __init__(self, a: LlamaArgs):
        super().__init__()
        self.n_heads, self.n_kv, self.hd = a.n_heads, a.n_kv_heads, a.hd
        self.scale = a.hd ** -0.5
        self.q_proj = Linear(a.d_model, a.n_heads * a.hd, bias=False)
        self.k_proj = Linear(a.d_model, a.n_kv_heads * a.hd, bias=False)
        self.v_proj = Linear(a.d_model, a.n_kv_heads * a.hd, bias=False)
        self.o_proj = Linear(a.n_heads * a.hd, a.d_model, bias=False)
        self.rope = ExactRoPE(a.hd, a.rope_base)

    def __call__(self, x: mx.array, cache: KVCache | None = None) -> mx.array:
        B, T, _ = x.shape
        q = self.q_proj(x).reshape(B, T, self.n_heads, self.hd).transpose(0, 2, 1, 3)  # (B,H,T,hd)
        k = self.k_proj(x).reshape(B, T, self.n_kv, self.hd).transpose(0, 2, 1, 3)  # (B,Hkv,T,hd)
        v = self.v_proj(x).reshape(B, T, self.n_kv, self.hd).transpose(0, 2, 1, 3)  # (B,Hkv,T,hd)
        offset = 0 if cache is None else cache.offset
        q, k = self.rope(q, offset=offset), self.rope(k, offset=offset)
        if cache is not None:
            k, v = cache.update(k, v)
        o = causal_attention(q, k, v, self.scale)
        o = o.transpose(0, 2, 1, 3).reshape(B, T, -1)  # (B,T,H*hd)
        return self.o_proj(o)


class MLP(nn.Module):
    def __init__(self, a: LlamaArgs):
        super().__init__()
        self.gate_proj = Linear(a.d_model, a.ffn_dim, bias=False)
        self.up_proj = Linear(a.d_model, a.ffn_dim, bias=False)
        self.down_proj = Linear(a.ffn_dim, a.d_model, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))


class Block(nn.Module):
    def __init__(self, a: LlamaArgs):
        super().__init__()
        self.attn_norm = RMSNorm(a.d_model, eps=a.norm_eps)
        self.attn = Attention(a)
        self.ffn_norm = RMSNorm(a.d_model, eps=a.norm_eps)
        self.mlp = MLP(a)

    def __call__(self, x: mx.array, cache: KVCache | None = None) -> mx.array:
        x = x + self.attn(self.attn_norm(x), cache)
        return x + self.mlp(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        args.validate()
        self.args = args
        self.embed = nn.Embedding(args.vocab_size, args.d_model)
        self.layers = [Block(args) for _ in range(args.n_layers)]
        self.norm = RMSNorm(args.d_model, eps=args.norm_eps)
        if not args.tie_embeddings:
            self.output = Linear(args.d_model, args.vocab_size, bias=False)
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

        from mlx.utils import tree_flatten, tree_unflatten

        self.update(tree_unflatten([(k, init(k, v)) for k, v in tree_flatten(self.parameters())]))

    def embed_tokens(self, tokens: mx.array) -> mx.array:
        return self.embed(tokens)

    def __call__(self, tokens: mx.array, cache: list[KVCache] | None = None) -> mx.array:
        h = self.embed_tokens(tokens)  # (B,T,D)
        for i, layer in enumerate(self.layers):
            h = layer(h, None if cache is None else cache[i])
        h = self.norm(h)
        if self.args.tie_embeddings:
            return self.embed.as_linear(h)  # (B,T,V)
        return self.output(h)

    def make_cache(self) -> list[KVCache]:
        return [KVCache() for _ in self.layers]
