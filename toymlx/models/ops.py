"""The math a model runs, chosen once and handed to the model when it is built.

A model file says *what* it computes (`self.ops.linear(x, w)`, `self.ops.attention(...)`); an
`Ops` says *how*: whose kernels, in which dtype, RoPE from which tables, and whether each block's
activations are kept or recomputed in the backward pass. Three choices are in use:

| who | `Ops` | why |
| --- | --- | --- |
| forward-only code: generation, export checks; toymlx-eval on a GPU | `Ops()` | MLX's own ops, float32, RoPE from float64 tables: logits within 1e-4 of llama.cpp |
| training where MLX computes on the CPU, and toymlx-eval there | `Ops(kernels="vectorised")` | `toymlx.backend.fastmath`'s forms: the Linux wheel's own exp/erf/softmax are scalar code (4-20x slower per element) |
| training on a GPU (Metal, CUDA) | `Ops(dtype="bfloat16", exact_rope=False)` | MLX's fused `mx.fast` kernels in half precision |

`training_ops` makes that choice for the trainer, `scoring_ops` for toymlx-eval; a benchmark or
test builds any `Ops` it wants.

Mixed precision (`dtype` other than float32), as PyTorch's autocast and mlx-lm do it:
- parameters that train stay float32: the master copy AdamW updates (its moments are float32
  too); `linear`, `embed` and the norms cast them to `dtype` where they are used, and the
  cast's backward hands float32 gradients back;
- frozen parameters (a LoRA base) are stored in `dtype` by the loader, or kept quantized;
- activations flow in `dtype`. What stays float32: the norms' statistics (MLX's fused norms
  accumulate in float32), attention's softmax (`scaled_dot_product_attention` accumulates in
  float32), the loss's logsumexp accumulation and every per-token loss from there on.
- float16 needs loss scaling (its gradients underflow): `toymlx.training.step.LossScale`.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

import mlx.core as mx
import numpy as np
from mlx import nn
from mlx.utils import tree_flatten, tree_unflatten

from toymlx.backend import device, fastmath, fpenv

Kernels = Literal["mlx", "vectorised"]
DType = Literal["float32", "bfloat16", "float16"]
DTYPES: dict[str, mx.Dtype] = {"float32": mx.float32, "bfloat16": mx.bfloat16,
                               "float16": mx.float16}


DECODE_SLICE_VALUES = 1 << 22
"""`Ops.decode_slice` where memory comes first (16 MB of float32)."""

CPU_ATTENTION_KEEP_VALUES = 4096
"""`Ops.attention_keep_limit` of training on the CPU: attention's activations kept where they take
at most 16 KiB a token and block in float32: SmolLM2-135M's rows up to 489 tokens, the tiny
Llama's up to 691; a Llama-3.2-1B shape recomputes at every length. The small models' steps are
6-16% faster (docs/RESULTS.md, session 18)."""

CUDA_ATTENTION_KEEP_VALUES = 8192
"""`Ops.attention_keep_limit` of training on a CUDA GPU: MLX's fused attention there (cuDNN's)
keeps q, k, v and its output for its backward pass, not the probabilities, so recomputing saves
only the rotated q and k and costs a second forward pass. SmolLM2-360M's 8 x 512 LoRA step
(7,040 values a token) kept it: 0.92x and 0.98x the step time in two runs, the peak within 2%
(H200, docs/RESULTS.md, session 26).
Longer rows recompute: MLX's fused backward needs a multiple of 128 rows, and elsewhere its
composed one keeps the probabilities. On Metal MLX has no fused attention backward: 0."""

CUDA_LOGITS_VALUES = 1 << 23
"""`Ops.logits_values` of training on a CUDA GPU: 32 MB of float32 logits a copy. A GPU launches
kernels for every slice or chunk: SmolLM2's 49,152-token head over 8 x 512 tokens is 48 slices
of 1024 rows at the CPU's size, 24 of 2048 at this one. On an H200 the 360M LoRA step took
0.95x the time of 2^24 values (12 slices) with 4% less peak memory, and 2^24 0.87-0.96x the
time of the CPU's sizes with 1.2-2.2 GB more (docs/RESULTS.md, session 26)."""


@dataclass(frozen=True)
class Ops:
    """How a model computes: kernels, dtype, RoPE tables, activation recomputation and how much
    of a block-held weight is decoded at once."""

    kernels: Kernels = "mlx"
    """mlx: MLX's ops and fused `mx.fast` kernels. vectorised: `toymlx.backend.fastmath`'s forms with
    hand-written backward passes, for MLX's CPU (float32 only)."""
    kernel_forms: bool = False
    """vectorised only: fastmath's exp and erf asked of MLX as its own exp and erf ops, which this
    process's compiled kernels compute as the same polynomials, bit for bit, in one fused loop
    instead of 2-6 (`toymlx.backend.device.kernel_forms`, checked at set-up): a ViT-Tiny GELU's
    forward and backward 2.2x faster, the same numbers. Only for code run under `mx.compile`:
    ops evaluated one at a time run MLX's library exp (other values, scalar speed)."""
    dtype: DType = "float32"
    """The activations' dtype (trainable weights stay float32 and are cast where used)."""
    exact_rope: bool = True
    """RoPE from cos/sin tables computed in float64; False: `mx.fast.rope` (angles in
    float32: ~3e-5 in SmolLM2's logits, nothing to training)."""
    grad_checkpoint: bool = False
    """Recompute each block's activations in the backward pass (`mx.checkpoint`): less memory
    for long sequences, one more forward pass of time."""
    subnormals: fpenv.Subnormals = "keep"
    """flush: the CPU threads that evaluate a training step or a held-out pass treat subnormal
    floats (below 1.18e-38) as zero (`toymlx.backend.fpenv`): Intel cores compute on them through
    microcode assists, and a LoRA step took 4-6x as long with them. keep: IEEE arithmetic."""
    decode_slice: int | None = DECODE_SLICE_VALUES
    """Most values of a block-held weight (`toymlx.models.layers.BlockLinear`) decoded to float
    at once, in the product and in its backward pass; None: each weight whole. Smaller slices
    hold less memory and cost time (docs/RESULTS.md, issue 34)."""
    attention_keep_limit: int = 0
    """Most values per token that a block's attention may keep for the backward pass (its
    heads' probabilities, q and k rotated, its output: `toymlx.models.llama.attention_values`)
    instead of recomputing them there (`recomputed`); 0: always recomputed. Keeping skips a
    second forward pass of attention, a sixth of a small model's CPU step; recomputing keeps
    long sequences and many heads in the memory people have."""
    logits_values: int | None = None
    """Most logits (tokens x vocabulary) a loss computes at once: a frozen head's slice of rows
    (`toymlx.models.losses.head_slices`), a trained head's chunk of tokens (`logits_chunk`).
    None: the sizes for a CPU's caches and memory (`losses.HEAD_SLICE_VALUES`, 4 MB of float32,
    and `losses.LOGITS_CHUNK_VALUES`, 16 MB). A CUDA GPU pays kernel launches for each slice,
    so it computes fewer, larger ones (`CUDA_LOGITS_VALUES`)."""

    def __post_init__(self) -> None:
        if self.kernels not in ("mlx", "vectorised"):
            raise ValueError(f"kernels: expected mlx or vectorised, found {self.kernels!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: expected one of {', '.join(DTYPES)}, found {self.dtype!r}")
        if self.subnormals not in ("flush", "keep"):
            raise ValueError(f"subnormals: expected flush or keep, found {self.subnormals!r}")
        if self.logits_values is not None and self.logits_values < 1:
            raise ValueError(f"logits_values: expected a positive number of logits or None, "
                             f"found {self.logits_values}")
        if self.attention_keep_limit < 0:
            raise ValueError(f"attention_keep_limit: expected >= 0 values a token (0: always "
                             f"recompute), found {self.attention_keep_limit}")
        if self.decode_slice is not None and self.decode_slice < 1:
            raise ValueError(f"decode_slice: expected a positive number of values or None (whole "
                             f"weights), found {self.decode_slice}")
        if self.kernels == "vectorised" and self.dtype != "float32":
            raise ValueError(f"kernels vectorised: expected dtype float32 (toymlx.backend.fastmath's "
                             f"forms are float32 only), found {self.dtype}; use kernels mlx")
        if self.kernel_forms and self.kernels != "vectorised":
            raise ValueError(f"kernel_forms: expected kernels vectorised (fastmath's forms), "
                             f"found kernels {self.kernels}")

    @property
    def mx_dtype(self) -> mx.Dtype:
        return DTYPES[self.dtype]

    def describe(self) -> dict[str, Any]:
        """What run_start records (`subnormals` as it takes effect on this platform)."""
        return {**asdict(self), "subnormals": fpenv.describe(self.subnormals)}

    # ---- casts ------------------------------------------------------------------------------
    def cast(self, x: mx.array) -> mx.array:
        """x in the compute dtype when that is a half type; float32 Ops leave dtypes as they
        come (so a model cast to float64 computes in float64, as the exactness tests do)."""
        if self.dtype == "float32" or x.dtype == self.mx_dtype:
            return x
        return x.astype(self.mx_dtype)

    # ---- the kernels ------------------------------------------------------------------------
    def linear(self, x: mx.array, weight: mx.array, bias: mx.array | None = None) -> mx.array:
        """x @ weight.T (+ bias), weight (out, in) as `nn.Linear` stores it."""
        if self.kernels == "vectorised":
            # weight gradients come out row-major like the weight (see fastmath.linear)
            return fastmath.linear(x, weight, bias)
        x, w = self.cast(x), self.cast(weight)
        return x @ w.T if bias is None else mx.addmm(self.cast(bias), x, w.T)

    def heads(self, x: mx.array, weight: mx.array, bias: mx.array, n_heads: int,
              scale: float = 1.0) -> mx.array:
        """(x @ weight.T + bias) * scale split into heads, (B,T,D) -> (B,H,T,hd): attention's
        q, k or v from a biased projection (ViT's), head-major as its products read it."""
        if self.kernels == "vectorised":
            return fastmath.heads(fastmath.linear(x, weight), bias, n_heads, scale)
        B, T, _ = x.shape
        h = self.linear(x, weight, bias).reshape(B, T, n_heads, -1).transpose(0, 2, 1, 3)
        return h if scale == 1.0 else h * scale

    def embed(self, table: mx.array, tokens: mx.array) -> mx.array:
        """Rows of the token table, in the compute dtype."""
        return self.cast(table[tokens])

    def unembed(self, h: mx.array, table: mx.array) -> mx.array:
        """Logits from a tied token table: h @ table.T."""
        return self.cast(h) @ self.cast(table).T

    def rms_norm(self, x: mx.array, weight: mx.array, eps: float) -> mx.array:
        if self.kernels == "vectorised":
            return fastmath.rms_norm(x, weight, eps)
        return mx.fast.rms_norm(x, self.cast(weight), eps)

    def layer_norm(self, x: mx.array, weight: mx.array | None, bias: mx.array | None,
                   eps: float) -> mx.array:
        if self.kernels == "vectorised":
            return fastmath.layer_norm(x, weight, bias, eps)
        w = None if weight is None else self.cast(weight)
        b = None if bias is None else self.cast(bias)
        return mx.fast.layer_norm(x, w, b, eps)

    def silu_mul(self, gate: mx.array, up: mx.array) -> mx.array:
        """silu(gate) * up: SwiGLU."""
        if self.kernels == "vectorised":
            return fastmath.silu(gate, self.kernel_forms) * up
        return nn.silu(gate) * up

    def gelu_mul(self, gate: mx.array, up: mx.array) -> mx.array:
        """gelu_tanh(gate) * up: GeGLU as Gemma computes it (GELU's tanh form), its backward
        pass keeping gate, up and the tanh."""
        return _gelu_tanh_mul(gate, up)[0]

    def gelu(self, x: mx.array, form: str = "erf") -> mx.array:
        """GELU: erf (exact, timm's), tanh or fast (x * sigmoid(1.702 x))."""
        if form == "erf":
            return (fastmath.gelu(x, self.kernel_forms) if self.kernels == "vectorised"
                    else nn.gelu(x))
        if form == "tanh":
            return nn.gelu_approx(x)
        if form == "fast":
            return nn.gelu_fast_approx(x)
        raise ValueError(f"gelu: expected erf, tanh or fast, found {form!r}")

    def attention(self, q: mx.array, k: mx.array, v: mx.array, scale: float,
                  causal: bool, window: int | None = None,
                  softcap: float | None = None) -> mx.array:
        """softmax(q k^T scale [causal]) v for q (B,H,T,hd), k/v (B,Hkv,S,hd); q's T rows are
        the last T of the S positions; query head h reads kv head h // (H // Hkv). `window`
        (causal only): each query sees the keys fewer than `window` positions back. `softcap`:
        the scores soft-capped to +-softcap (softcap * tanh(scores / softcap)) before the mask,
        which MLX's fused kernel cannot do (`capped_attention`)."""
        if self.kernels == "vectorised":
            return fastmath.attention(q, k, v, scale, causal=causal, window=window,
                                      in_kernel=self.kernel_forms, softcap=softcap)
        T, S = q.shape[2], k.shape[2]
        if window is not None and S > window:
            mask = attention_mask(T, S, window)
        else:
            mask = "causal" if causal and T > 1 else None
        if softcap:
            return capped_attention(q, k, v, scale, softcap,
                                    attention_mask(T, S) if mask == "causal" else mask)
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)

    def rope_tables(self, rope: Rope, head_dim: int, offset: int, T: int) -> RopeTables:
        """cos and sin (T, dims/2) of positions offset..offset+T-1 (float64-computed, cached),
        for `rope(..., tables=)`; exact_rope only."""
        if not self.exact_rope:
            raise ValueError("rope tables: expected exact_rope=True (mx.fast.rope computes "
                             "its own angles)")
        return _rope_tables(rope, rope.dims or head_dim, int(offset), T)

    def rope(self, x: mx.array, rope: Rope, offset: int = 0,
             tables: RopeTables | None = None) -> mx.array:
        """RoPE over x (B,H,T,hd) at positions offset.. offset+T-1, as `rope` says: the first
        `rope.dims` of each head rotated (the rest passed through), adjacent pairs (x[2i],
        x[2i+1]: llama.cpp's for arch llama) or halves (x[i], x[i+dims/2]: its NEOX form).
        `tables` (`rope_tables`, exact_rope only): those positions' cos and sin, given as
        arrays so a traced function takes them as inputs instead of baking one offset in."""
        dims, T = rope.dims or x.shape[-1], x.shape[-2]
        if tables is not None and not self.exact_rope:
            raise ValueError("rope: tables need exact_rope=True")
        if not self.exact_rope:
            # YaRN's mix is no uniform scale: its wavelengths carry the scale, the kernel none
            freqs = _rope_wavelengths(rope, dims) if rope.factors or rope.yarn else None
            out = mx.fast.rope(x, dims, traditional=not rope.neox,
                               base=None if freqs is not None else rope.base,
                               scale=1.0 if rope.yarn else rope.scale, offset=offset,
                               freqs=freqs)
            mscale = rope.mscale
            if rope.temperature is not None:  # (T, 1): one magnitude per position, x's dtype
                mscale = mx.array(rope.magnitudes(int(offset), T)[:, None].astype(np.float32)
                                  ).astype(out.dtype)
            if isinstance(mscale, float) and mscale == 1.0:
                return out
            if dims == x.shape[-1]:
                return out * mscale
            return mx.concatenate([out[..., :dims] * mscale, out[..., dims:]], axis=-1)
        cos, sin = tables or _rope_tables(rope, dims, int(offset), T)  # (T, dims/2) each
        if x.dtype != mx.float32:
            cos, sin = cos.astype(x.dtype), sin.astype(x.dtype)
        xr, rest = (x, None) if dims == x.shape[-1] else (x[..., :dims], x[..., dims:])
        if not rope.neox and rest is None and x.dtype == mx.float32:
            rot = mx.stack([cos, sin], axis=-1).view(mx.complex64)[..., 0]  # (T, dims/2)
            return _rotate_pairs(x, rot)
        if rope.neox:
            x0, x1 = xr[..., : dims // 2], xr[..., dims // 2:]  # (B,H,T,dims/2) each
            out = mx.concatenate([x0 * cos - x1 * sin, x0 * sin + x1 * cos], axis=-1)
        else:
            x0, x1 = xr[..., 0::2], xr[..., 1::2]  # (B,H,T,dims/2) each
            out = mx.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], axis=-1)  # (...,dims/2,2)
            out = out.reshape(xr.shape)
        return out if rest is None else mx.concatenate([out, rest], axis=-1)

    def exp_values(self, x: mx.array) -> mx.array:
        """e**x for a hand-written backward pass (no autodiff of its own on the vectorised
        kernels), float32."""
        if self.kernels == "vectorised":
            return fastmath.exp_values(x, self.kernel_forms)
        return mx.exp(x)

    def row_sum(self, x: mx.array) -> mx.array:
        """Sum over the last axis, kept as a size-1 axis."""
        return fastmath.row_sum(x) if self.kernels == "vectorised" else x.sum(-1, keepdims=True)

    def cross_entropy(self, logits: mx.array, targets: mx.array) -> mx.array:
        """Per-position cross-entropy over the last axis, float32, no reduction."""
        if self.kernels == "vectorised":
            return fastmath.cross_entropy(logits, targets, self.kernel_forms)
        picked = mx.take_along_axis(logits, targets[..., None], -1)[..., 0]
        lse = mx.logsumexp(logits, axis=-1)  # MLX's kernel accumulates in float32
        return _widen(lse) - _widen(picked)

    def keeps_attention(self, values_per_token: int) -> bool:
        """Whether a block's attention, which would keep `values_per_token` values a token for
        the backward pass, keeps them (`attention_keep_limit`) rather than recomputing them."""
        return values_per_token <= self.attention_keep_limit

    def recomputed(self, fn: Callable[..., mx.array], params: dict, *arrays: mx.array
                   ) -> mx.array:
        """fn(params, *arrays) (`params`: the trainable arrays fn reads), whose backward pass
        recomputes fn's forward instead of keeping its activations, as FlashAttention's
        backward recomputes the scores: a block's attention holds q, k and v, not its
        probabilities (GQA heads x visible keys a token, more than d_model). The recomputation
        waits for the cotangent (`mx.depends`), so one block's runs at a time. With
        grad_checkpoint the whole block is recomputed already: fn as it is."""
        if self.grad_checkpoint:
            return fn(params, *arrays)
        return recompute_in_backward(fn, params, *arrays)

    def block(self, layer: nn.Module, *args: Any) -> mx.array:
        """layer(*args), or with grad_checkpoint the same, its activations recomputed in the
        backward pass instead of kept, with the same random masks (dropout, stochastic depth)
        as the forward pass drew (`_checkpointed`): the gradient is the one without it."""
        if not self.grad_checkpoint:
            return layer(*args)
        return _checkpointed(layer)(layer.trainable_parameters(), *args)


def attention_mask(T: int, S: int, window: int | None = None) -> mx.array:
    """(T,S) bool: which of S keys each of the last T positions sees (causal; `window`: only
    the keys fewer than `window` positions back)."""
    dist = mx.arange(S - T, S)[:, None] - mx.arange(S)[None]  # (T,S) query - key
    return dist >= 0 if window is None else (dist >= 0) & (dist < window)


def capped_attention(q: mx.array, k: mx.array, v: mx.array, scale: float, softcap: float,
                     mask: mx.array | None) -> mx.array:
    """softmax(softcap * tanh(q k^T scale / softcap) [mask]) v, composed of MLX's ops on any
    device: q (B,H,T,hd), k/v (B,Hkv,S,hd), query head h reading kv head h // (H // Hkv), `mask`
    (T,S) bool or None. The capped scores and their softmax are float32 whatever the dtype, as
    MLX's fused kernel accumulates them."""
    B, H, T, hd = q.shape
    n_kv = k.shape[1]
    rep = H // n_kv
    qg = q.reshape(B, n_kv, rep * T, hd)  # (B,Hkv,rep*T,hd): head h = kv * rep + r
    s = ((qg * scale) @ k.swapaxes(-1, -2)).astype(mx.float32)  # (B,Hkv,rep*T,S)
    s = softcap * mx.tanh(s / softcap)
    if mask is not None:
        s = mx.where(mx.tile(mask, (rep, 1)), s, -mx.inf)
    p = mx.softmax(s, axis=-1).astype(v.dtype)
    return (p @ v).reshape(B, H, T, hd)  # (B,H,T,hd)


_GELU_TANH_C = float(np.sqrt(2 / np.pi))


@mx.custom_function
def _gelu_tanh_mul(gate: mx.array, up: mx.array) -> tuple[mx.array, mx.array]:
    """(`nn.gelu_approx(gate) * up`, the tanh inside it): the same ops in the same order, so the
    same values. Its backward pass holds gate, up and the tanh: in a compiled step autodiff of
    the expression holds 6 (tokens, ffn) arrays a layer, this 3 (tests/test_fastmath.py); the
    Gemma-3-270M shape's 4 x 256 LoRA step, MLX's peak 1.84 -> 1.42 GB."""
    t = mx.tanh(_GELU_TANH_C * (gate + 0.044715 * gate**3))
    return 0.5 * gate * (1 + t) * up, t


@_gelu_tanh_mul.vjp
def _gelu_tanh_mul_vjp(primals, cotangents, outputs):
    x, up = primals
    g, t = cotangents[0], outputs[1]
    # every product starts from the cotangent, so no part of this can run (and be held) before
    # the backward pass reaches it: a subexpression of the forward's arrays alone (1 - t^2, the
    # slope) is computed in the forward pass and held, one more array a layer (4 against 3)
    a = (g * up) * 0.5
    b = a * x
    b = b - (b * t) * t  # g up x (1 - t^2) / 2
    d_gate = (a + a * t) + (b * _GELU_TANH_C + ((b * x) * x) * (3 * 0.044715 * _GELU_TANH_C))
    h = (g * 0.5) * x
    return d_gate, h + h * t


def _widen(x: mx.array) -> mx.array:
    """A half-precision array as float32 (float32 and float64 as they are)."""
    return x.astype(mx.float32) if x.dtype in (mx.bfloat16, mx.float16) else x


EXACT = Ops()
"""Forward-only code's math: MLX's ops in float32 with float64 RoPE tables."""


RopeTables = tuple[mx.array, mx.array]
"""cos and sin (T, dims/2) of T positions (`Ops.rope_tables`)."""


@dataclass(frozen=True)
class Rope:
    """One layer's rotary position embedding, as llama.cpp's `ggml_rope_ext` computes it:
    angle_i = pos * base^(-2i/dims) / factors[i] * s_i for i < dims/2, with s_i = `scale`
    (linear scaling) or YaRN's mix of it and 1 (`yarn`), cos and sin times `mscale` (and, for
    mistral3's queries, times a `temperature` of the position)."""

    base: float = 10000.0
    """Frequency base (rope.freq_base; Gemma 3's sliding layers: rope.freq_base_swa)."""
    dims: int | None = None
    """Rotated width per head (rope.dimension_count); None: the whole head."""
    neox: bool = False
    """Rotate halves (x[i], x[i+dims/2]) instead of adjacent pairs (x[2i], x[2i+1])."""
    factors: tuple[float, ...] | None = None
    """Per-frequency divisors (Llama 3's rope_freqs tensor, Phi-3's rope_factors_short)."""
    scale: float = 1.0
    """Position scale (1 / rope.scaling.factor for linear and YaRN scaling)."""
    mscale: float = 1.0
    """Magnitude of cos and sin (rope.scaling.attn_factor; with YaRN, times its own)."""
    yarn: tuple[float, float] | None = None
    """YaRN's correction dims (low, high), `yarn_corr_dims`: frequency i's s_i is
    scale * (1 - r_i) + r_i with r_i = 1 - clamp((i - low) / max(0.001, high - low), 0, 1)
    (ggml's `rope_yarn_ramp`, ext_factor 1): the fast frequencies (i <= low) keep their
    angles, the slow ones (i >= high) are interpolated by `scale`. None: no YaRN."""
    temperature: tuple[float, int] | None = None
    """(beta, length): cos and sin at position p also times 1 + beta * ln(floor(p / length)
    + 1), Llama 4's attention temperature as llama.cpp's mistral3 applies it to its queries
    (`llm_graph_input_attn_temp`, offset 0); None: none."""

    def magnitudes(self, offset: int, T: int) -> np.ndarray:
        """float64 (T,): the magnitude of cos and sin at positions offset..offset+T-1."""
        m = np.full(T, self.mscale, np.float64)
        if self.temperature is not None:
            beta, length = self.temperature
            pos = np.arange(offset, offset + T, dtype=np.float64)
            m = m * (1.0 + beta * np.log(np.floor(pos / length) + 1.0))
        return m


def yarn_corr_dims(dims: int, orig_context: int, base: float, beta_fast: float,
                   beta_slow: float) -> tuple[float, float]:
    """YaRN's correction dims as ggml computes them (`ggml_rope_yarn_corr_dims`, float32 as
    there): the frequency index at which a frequency turns `beta_fast` (then `beta_slow`) times
    over `orig_context` positions, floored (ceiled), clamped to 0..dims-1. Transformers'
    `_compute_yarn_parameters` floors and ceils the same (its `truncate`, default true)."""
    f = np.float32

    def corr_dim(n_rot: float) -> np.float32:
        ratio = f(orig_context) / (f(n_rot) * f(2) * f(np.pi))
        return f(dims) * np.log(ratio, dtype=f) / (f(2) * np.log(f(base), dtype=f))

    low = float(np.floor(corr_dim(beta_fast)))
    high = float(np.ceil(corr_dim(beta_slow)))
    return max(0.0, low), min(float(dims - 1), high)


def _rope_inverse_wavelengths(rope: Rope, dims: int) -> np.ndarray:
    """base^(-2i/dims) / factors[i] * s_i (`Rope`), float64 (dims/2,)."""
    inv = rope.base ** (-np.arange(0, dims, 2, dtype=np.float64) / dims)
    if rope.factors:
        inv = inv / np.asarray(rope.factors, np.float64)
    if rope.yarn is None:
        return inv * rope.scale
    low, high = rope.yarn
    y = (np.arange(dims // 2, dtype=np.float64) - low) / max(0.001, high - low)
    extrapolated = 1.0 - np.clip(y, 0.0, 1.0)  # ggml's ramp_mix (ext_factor 1)
    return inv * (rope.scale * (1.0 - extrapolated) + extrapolated)


def _rope_wavelengths(rope: Rope, dims: int) -> mx.array:
    """What `mx.fast.rope`'s `freqs` takes: base^(2i/dims) * factors[i], its scale applied by
    the kernel; with YaRN, 1 / `_rope_inverse_wavelengths` (the scale in it, the kernel's 1)."""
    if rope.yarn is None:
        rope = Rope(rope.base, dims, rope.neox, rope.factors)
    return mx.array((1.0 / _rope_inverse_wavelengths(rope, dims)).astype(np.float32))


@mx.custom_function
def _rotate_pairs(x: mx.array, rot: mx.array) -> mx.array:
    """RoPE's rotation of the adjacent pairs (x[2i], x[2i+1]) of a float32 x (..., T, dims) by
    rot (T, dims/2) = cos + i sin (complex64): each pair read as one complex number and
    multiplied, the same float32 products and sums as x0 cos - x1 sin, x0 sin + x1 cos, bit for
    bit, in one loop, where the pairs' formula took two strided slices, their products and a
    stack. The backward pass rotates the cotangent back (by the conjugate) in one loop too,
    where the slices' each wrote into a zero-filled copy of x (a LoRA step on SmolLM2: 30 q and
    k rotations forward and backward)."""
    return (x.view(mx.complex64) * rot).view(mx.float32)


@_rotate_pairs.vjp
def _rotate_pairs_vjp(primals: tuple[mx.array, mx.array], cotangent: mx.array,
                      output: mx.array) -> tuple[mx.array, mx.array]:
    rot = primals[1]
    return (cotangent.view(mx.complex64) * mx.conj(rot)).view(mx.float32), mx.zeros_like(rot)


@functools.lru_cache(maxsize=64)
def _rope_tables(rope: Rope, dims: int, offset: int, T: int) -> tuple[mx.array, mx.array]:
    """cos and sin (T, dims/2) for positions offset..offset+T-1, computed in float64: with
    `mx.fast.rope`'s float32 angles SmolLM2's logits (base 1e5) move ~3e-5 from llama.cpp's.
    Cached: constants of a traced step, and generation asks for one offset after another."""
    ang = np.arange(offset, offset + T, dtype=np.float64)[:, None] * \
        _rope_inverse_wavelengths(rope, dims)  # (T, dims/2)
    m = rope.magnitudes(offset, T)[:, None]
    cos, sin = np.cos(ang) * m, np.sin(ang) * m
    return mx.array(cos.astype(np.float32)), mx.array(sin.astype(np.float32))


def recompute_in_backward(fn: Callable[..., mx.array], params: dict, *arrays: mx.array
                          ) -> mx.array:
    """fn(params, *arrays) as a custom function whose vjp recomputes fn's forward, once its
    cotangent exists (`mx.depends`), for the gradients of `params` (the trainable arrays fn
    reads) and of `arrays`: nothing of fn's inside is kept from the forward pass.
    `mx.checkpoint`'s recomputation waits for nothing, and MLX's breadth-first order then ran
    every block's (or every logits chunk's) at once. Its gradients come out together, each
    depending on the others: otherwise MLX computed one when its reader needed it, and a
    gemma4 reader block's key and value gradients, read only at their source block, kept the
    recomputed probabilities alive until then (a 16-head, 6-block LoRA step over 2 x 1024
    tokens: 663 MB against 354). `Ops.recomputed` and the trained head's logits chunks
    (`losses.masked_ce_sum`) use it."""
    @mx.custom_function
    def f(p: dict, *xs: mx.array) -> mx.array:
        return fn(p, *xs)

    @f.vjp
    def f_vjp(primals: tuple, cotangent: mx.array, output: mx.array) -> tuple:
        p, *xs = primals
        xs = list(mx.depends(xs, [cotangent]))
        flat = tree_flatten(p)
        keys, values = [k for k, _ in flat], [v for _, v in flat]
        n = len(keys)

        def of_arrays(*a: mx.array) -> mx.array:
            return fn(tree_unflatten(list(zip(keys, a[:n]))), *a[n:])

        _, grads = mx.vjp(of_arrays, [*values, *xs], [cotangent])
        grads = mx.depends(grads, grads)  # all at once: see above
        return (tree_unflatten(list(zip(keys, grads[:n]))) if keys else p, *grads[n:])

    return f(params, *arrays)


class Draws:
    """A stream of keys for the random draws of a block (`drawing_from`): `state` split as MLX
    splits its own random state, one split a draw; `count` draws taken."""

    def __init__(self, key: mx.array):
        self.state, self.count = key, 0

    def next(self) -> mx.array:
        """The next draw's key, as MLX's `KeySequence.next` gives it: split the state in two,
        keep the first half as the state, draw with the second."""
        self.state, key = mx.random.split(self.state)
        self.count += 1
        return key


_DRAWS: list[Draws] = []
"""The streams open (`drawing_from`), innermost last."""


@contextlib.contextmanager
def drawing_from(key: mx.array) -> Iterator[Draws]:
    """Within it, `next_key` gives keys split from `key` (a copy of MLX's random state): a
    block's draws made again from the same key are the same masks."""
    _DRAWS.append(Draws(key))
    try:
        yield _DRAWS[-1]
    finally:
        _DRAWS.pop()


def next_key() -> mx.array | None:
    """The key for a random draw of dropout or stochastic depth: the next of `drawing_from`'s
    stream within one; None outside (MLX's own random state)."""
    return _DRAWS[-1].next() if _DRAWS else None


def _checkpointed(layer: nn.Module) -> Callable:
    """`mx.checkpoint` of a module's call, with its trainable parameters as explicit inputs so
    their gradients flow through the recomputation. The block's random draws (dropout,
    stochastic depth) take their keys from the key MLX's random state holds when it is called,
    read outside and passed in (`drawing_from`), split as MLX splits its state: the forward pass
    draws what it would draw without checkpointing, and the recomputation in the backward pass
    draws the same masks again. (mlx-lm's recomputed blocks draw from MLX's state, moved on by
    then: new masks, and a gradient that is not that of the forward it ran.) After the forward
    the state is moved on past the block's draws, as they would have moved it."""
    drawn: list[int] = []

    def call(params: dict, key: mx.array, *args: Any) -> mx.array:
        layer.update(params)
        with drawing_from(mx.stop_gradient(key)) as draws:  # no gradient through a key
            out = layer(*args)
        drawn[:] = [draws.count]
        return out

    checkpointed = mx.checkpoint(call)

    def run(params: dict, *args: Any) -> mx.array:
        out = checkpointed(params, mx.random.state[0], *args)
        for _ in range(drawn[0]):  # each draw of MLX's own moves its state on by one split
            mx.random.uniform(shape=(1,))
        return out

    return run


def training_ops(on_gpu: bool, dtype: str = "auto", kernels: str = "auto",
                 grad_checkpoint: bool = False, subnormals: fpenv.Subnormals = "flush",
                 compiled: bool = True, metal: bool = sys.platform == "darwin") -> Ops:
    """The math of a training run: `--dtype`, `--kernels`, `--grad-checkpoint`,
    `--subnormals` and `--no-compile` resolved. `metal`: whether the GPU is a Mac's (Metal;
    else CUDA), this machine's by default (`device.gpu_kind`), passed to see the other's.

    dtype auto: bfloat16 on a GPU, float32 on the CPU (MLX's half-precision CPU kernels run
    ~25x slower than float32's). kernels auto: vectorised on the CPU in float32, else mlx.
    RoPE: fast on a GPU; exact tables on the CPU (as fast there, and exact).
    Attention's activations: kept for short sequences of small models on the CPU
    (`CPU_ATTENTION_KEEP_VALUES`) and on CUDA (`CUDA_ATTENTION_KEEP_VALUES`), else recomputed
    in the backward pass; on Metal always recomputed, for memory: MLX 0.32 trains attention
    unfused there (its probabilities would be kept).
    The loss's logits: CUDA computes fewer, larger slices of them (`CUDA_LOGITS_VALUES`: faster,
    1.2-2.2 GB more peak at SmolLM2's 8 x 512), except with grad_checkpoint; Metal, unmeasured
    and sharing the machine's memory, keeps the CPU's sizes.
    Block-held weights: decoded whole, except 16 MB at a time with grad_checkpoint. Without it
    a step keeps every block's activations, more than a weight's floats at the sizes people
    train (Llama-3.2-1B shape at 4 x 256: a block keeps 99 MB a CPU stream, its largest weight
    is 64 MB), and whole weights made that step 1.07x the float32-held step's time against
    1.10-1.12x in 16 MB slices, for 0.3 GB more. grad_checkpoint asks for memory first.
    Vectorised kernels ask MLX for its own exp and erf (`Ops.kernel_forms`) where the step is
    compiled and this process's kernels were checked to compute toymlx's forms (call
    `toymlx.backend.device.setup_process` first); the numbers are the same either way."""
    if dtype == "auto":
        dtype = "bfloat16" if on_gpu else "float32"
    if dtype not in DTYPES:
        raise ValueError(f"--dtype: expected auto, {', '.join(DTYPES)}; found {dtype!r}")
    if kernels == "auto":
        kernels = "vectorised" if not on_gpu and dtype == "float32" else "mlx"
    elif kernels == "vectorised" and dtype != "float32":
        raise ValueError(f"--kernels vectorised: expected --dtype float32 (toymlx.backend.fastmath's "
                         f"forms are float32 only), found --dtype {dtype}")
    elif kernels not in ("mlx", "vectorised"):
        raise ValueError(f"--kernels: expected auto, mlx or vectorised, found {kernels!r}")
    cuda = on_gpu and not metal
    return Ops(kernels=kernels, dtype=dtype, exact_rope=not on_gpu,
               kernel_forms=kernels == "vectorised" and compiled and device.kernel_forms(),
               grad_checkpoint=grad_checkpoint, subnormals=subnormals,
               decode_slice=DECODE_SLICE_VALUES if grad_checkpoint else None,
               attention_keep_limit=(CPU_ATTENTION_KEEP_VALUES if not on_gpu else
                                     CUDA_ATTENTION_KEEP_VALUES if cuda else 0),
               logits_values=CUDA_LOGITS_VALUES if cuda and not grad_checkpoint else None)


def scoring_ops(on_gpu: bool) -> Ops:
    """The math of held-out scoring outside a run (toymlx-eval): float32, with the training
    step's vectorised forms where MLX computes on the CPU (the same values as MLX's own ops to
    float32 rounding, several times faster there); on a GPU, where training computes in half
    precision, MLX's own float32 ops (`EXACT`). Block-held weights 16 MB at a time: a forward
    pass keeps no activations for a whole weight's floats to hide in."""
    if on_gpu:
        return EXACT
    return replace(training_ops(on_gpu, "float32"), decode_slice=DECODE_SLICE_VALUES)
