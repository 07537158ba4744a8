"""Qwen3.5's linear-attention block: Gated DeltaNet, in llama.cpp's GGUF layout.

Three of every four Qwen3.5 blocks (`qwen35` files: 0.8B, 2B, 4B, 9B) mix tokens with a gated
delta rule instead of softmax attention; `toymlx.models.llama.Block` builds this module in
place of `Attention` where `LlamaArgs.is_linear(layer)`. Per token t of the normed input x:

1. `qkv_proj` (attn_qkv) projects x to conv_dim = 2 Hk dk + Hv dv channels, `z_proj`
   (attn_gate) to the output gate z (Hv dv), `beta_proj` (ssm_beta) and `alpha_proj`
   (ssm_alpha) to one value per value head.
2. `conv1d` (ssm_conv1d, (conv_dim, K)): a causal depthwise convolution over the last K
   tokens of each channel (zeros before the first), then SiLU; llama.cpp's `ggml_ssm_conv`
   and transformers' `causal_conv1d_fn`.
3. The channels split into q, k (Hk heads of dk) and v (Hv heads of dv); q and k are L2
   normed per head, x / sqrt(sum x^2 + eps) (llama.cpp's `build_gdn_l2_norm` with the
   file's RMS epsilon; transformers' `l2norm`), q times dk^-1/2.
4. beta = sigmoid(beta_proj x); the decay g = ssm_a * softplus(alpha_proj x + dt_bias),
   where the file's ssm_a is already -exp(A_log) (the converter stores it so) and dt_bias is
   ssm_dt.bias.
5. The gated delta rule (transformers' `torch_recurrent_gated_delta_rule`, llama.cpp's
   `build_delta_net_autoregressive`), a state S of (dk, dv) per value head from zeros:
   S <- exp(g) S;  S <- S + k (beta (v - S^T k))^T;  o = S^T q.
6. o is RMS normed per head over dv with `norm` (ssm_norm, applied as stored: no 1 + w), times
   SiLU(z) (transformers' `Qwen3_5RMSNormGated`, llama.cpp's `build_norm_gated`), then
   `out_proj` (ssm_out).

Head order. Where Hk < Hv (the 2B, 4B, 9B shapes) each k head serves Hv / Hk value heads.
Hugging Face groups them (v heads 0..r-1 read k head 0); llama.cpp's converter reorders the
value heads of every tensor that has them (`_LinearAttentionVReorderBase`: v rows of attn_qkv
and the conv, attn_gate, ssm_beta/alpha, ssm_a, ssm_dt, ssm_out's columns) to tiled order, so
that GGUF value head j reads k head j % Hk (`ggml_repeat`). toymlx keeps the file's order and
tiles q and k, so no tensor is permuted.

The recurrence is written in MLX ops, so it runs on any MLX device and MLX differentiates through
it: a prompt or training sequence `CHUNK` tokens at a time (`delta_chunks`, transformers' chunked
form), a decoded token one step (`delta_steps`, its recurrent form).
Generation keeps each block's last K-1 conv inputs and its state S (`DeltaCache`).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
from mlx import nn

from toymlx.models.layers import Linear, RMSNorm
from toymlx.models.ops import Ops


@dataclass
class DeltaCache:
    """One linear-attention block's recurrent state during generation: `conv` (B, K-1,
    conv_dim), the last K-1 inputs of the convolution, and `ssm` (B, Hv, dk, dv), the delta
    rule's state. The interface is `KVCache`'s: `offset`, `keep`, `state`."""

    conv: mx.array | None = None
    ssm: mx.array | None = None
    offset: int = 0
    """Tokens seen (the KV caches' name for it, so that a step reads any cache alike)."""

    def keep(self, n: int) -> None:
        """Forget positions n and after: all (n = 0) or none (n = offset); a recurrent state
        cannot be rewound to a position in between (`PromptCache.take` starts over)."""
        if n == self.offset:
            return
        if n != 0:
            raise ValueError(f"DeltaCache.keep: expected 0 or {self.offset} positions (a "
                             f"recurrent state cannot be rewound), found {n}")
        self.conv, self.ssm, self.offset = None, None, 0

    @property
    def state(self) -> list[mx.array]:
        """The conv inputs and the delta rule's state, to evaluate (empty before the first
        token)."""
        return [a for a in (self.conv, self.ssm) if a is not None]


def causal_conv(x: mx.array, weight: mx.array, past: mx.array | None = None
                ) -> tuple[mx.array, mx.array]:
    """SiLU of the causal depthwise convolution of x (B, T, C) by `weight` (C, K): output t is
    sum_j weight[:, j] * x[t - (K-1) + j], with `past` (B, K-1, C) before x (zeros if None).
    Returns the output (B, T, C) and the last K-1 inputs, the next call's `past`."""
    B, T, C = x.shape
    K = weight.shape[1]
    if past is None:
        past = mx.zeros((B, K - 1, C), dtype=x.dtype)
    xp = mx.concatenate([past, x], axis=1)  # (B, T+K-1, C)
    out = sum(xp[:, j:j + T] * weight[:, j] for j in range(K))  # (B, T, C)
    return nn.silu(out), xp[:, T:]


def l2_norm(x: mx.array, eps: float) -> mx.array:
    """x / sqrt(sum x^2 + eps) over the last axis."""
    return x * mx.rsqrt(mx.sum(x * x, axis=-1, keepdims=True) + eps)


CHUNK = 16
"""Tokens per chunk of `delta_chunks` (transformers' take 64; on a 2-core CPU, a forward and
backward of a Qwen3.5-0.8B-shaped block over 256 tokens took 0.3-0.8 s by 16, 0.5-1.8 s by
32, 4-7 s by 64, MLX's batched 64 x 64 products being slow there; at the default chat batch,
4 x 160 tokens, 0.26-0.39 s by 16 against 0.7-1.4 s by 32, interleaved runs at load 5; measured
with the power series for (I + A)^-1 that `unit_lower_inverse` replaced)."""


def gated_delta_rule(q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array,
                     state: mx.array | None = None) -> tuple[mx.array, mx.array]:
    """The gated delta rule over T tokens: q, k (B, T, H, dk) (q already scaled), v (B, T, H,
    dv), g and beta (B, T, H), `state` (B, H, dk, dv) (zeros if None). Returns o (B, T, H, dv)
    and the final state, float32: one token a time (`delta_steps`), several a chunk at a time
    (`delta_chunks`: as `delta_steps`, within about 1e-6 of the outputs' size of a float64
    loop, with random keys and with keys that all point one way, beta near 1)."""
    if q.shape[1] == 1:
        return delta_steps(q, k, v, g, beta, state)
    return delta_chunks(q, k, v, g, beta, state)


def delta_steps(q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array,
                state: mx.array | None = None) -> tuple[mx.array, mx.array]:
    """`gated_delta_rule` one step per token (transformers' `torch_recurrent_gated_delta_rule`):
    S <- exp(g) S; S <- S + k (beta (v - S^T k))^T; o = S^T q. Differentiated, it keeps T
    states of (dk, dv) per head for the backward pass."""
    B, T, H, dk = k.shape
    dv = v.shape[-1]
    s = mx.zeros((B, H, dk, dv), mx.float32) if state is None else state
    decay = mx.exp(g)  # (B,T,H)
    outs = []
    for t in range(T):
        s = s * decay[:, t, :, None, None]
        kt = k[:, t]  # (B,H,dk)
        mem = (s * kt[..., None]).sum(axis=-2)  # (B,H,dv): S^T k
        delta = (v[:, t] - mem) * beta[:, t, :, None]  # (B,H,dv)
        s = s + kt[..., None] * delta[..., None, :]
        outs.append((s * q[:, t, :, :, None]).sum(axis=-2))  # (B,H,dv): S^T q
    return mx.stack(outs, axis=1), s


def unit_lower_inverse(a: mx.array) -> mx.array:
    """(I + A)^-1 for A (..., C, C) strictly lower triangular, by forward substitution one row
    at a time (transformers' loop in `torch_chunk_gated_delta_rule`), vectorised over the
    leading axes: row i is e_i - sum_{j<i} A_ij row_j. The series (I - A)(I + A^2)(I + A^4)...
    gives the same matrix in exact arithmetic but sums binomial terms (up to 6435 at C = 16)
    that cancel in float32 when a chunk's keys are aligned (repeated tokens): 2e-4 off at
    C = 16 where this is 5e-7 (tests/test_qwen35.py's float64 loop). C - 1 dependent small
    products, each over all chunks at once."""
    C = a.shape[-1]
    eye = mx.eye(C, dtype=a.dtype)
    rows = [mx.broadcast_to(eye[0], (*a.shape[:-2], C))]
    for i in range(1, C):
        done = mx.stack(rows, axis=-2)  # (..., i, C): rows 0..i-1
        rows.append(eye[i] - (a[..., i:i + 1, :i] @ done)[..., 0, :])
    return mx.stack(rows, axis=-2)  # (..., C, C)


def delta_chunks(q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array,
                 state: mx.array | None = None, chunk: int = CHUNK
                 ) -> tuple[mx.array, mx.array]:
    """`gated_delta_rule` `chunk` tokens at a time (transformers' `torch_chunk_gated_delta_rule`,
    the WY form): within a chunk, with G the cumulative sum of g and A the strictly lower
    (chunk, chunk) matrix beta_i k_i.k_j exp(G_i - G_j), the state's updates are the rows of
    (I + A)^-1 applied to beta v and to beta k exp(G); the chunk's outputs read the state it
    starts from plus its own causal, decayed q k^T. (I + A)^-1 is `unit_lower_inverse`'s
    forward substitution, plain MLX ops that run on any device. Its backward pass keeps a state
    per chunk, not per token. T is padded to whole chunks with beta = g = 0 (no update, no
    decay)."""
    B, T, H, dk = k.shape
    dv, C = v.shape[-1], chunk
    pad = -T % C
    if pad:
        def padded(x: mx.array) -> mx.array:
            return mx.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))

        q, k, v, g, beta = (padded(x) for x in (q, k, v, g, beta))
    N = (T + pad) // C

    def chunks(x: mx.array) -> mx.array:  # (B, T, H, d) -> (B, H, N, C, d)
        return x.reshape(B, N, C, H, -1).transpose(0, 3, 1, 2, 4)

    q, k, v = chunks(q), chunks(k), chunks(v)
    g = mx.cumsum(chunks(g[..., None])[..., 0], axis=-1)  # (B,H,N,C): G within each chunk
    beta = chunks(beta[..., None])  # (B,H,N,C,1)
    kb, vb = k * beta, v * beta
    lower = mx.tril(mx.ones((C, C), dtype=mx.bool_))
    # exp(G_i - G_j) at j <= i (every exponent <= 0), 0 above the diagonal
    decay = mx.exp(mx.where(lower, g[..., :, None] - g[..., None, :], -mx.inf))
    a = (kb @ k.swapaxes(-1, -2)) * decay * mx.tril(mx.ones((C, C)), -1)  # (B,H,N,C,C)
    inverse = unit_lower_inverse(a)
    value = inverse @ vb  # (B,H,N,C,dv)
    k_decayed = inverse @ (kb * mx.exp(g)[..., None])  # (B,H,N,C,dk)
    s = mx.zeros((B, H, dk, dv), mx.float32) if state is None else state
    outs = []
    for i in range(N):
        qi, ki, gi = q[:, :, i], k[:, :, i], g[:, :, i]
        new = value[:, :, i] - k_decayed[:, :, i] @ s  # (B,H,C,dv)
        outs.append((qi * mx.exp(gi)[..., None]) @ s
                    + ((qi @ ki.swapaxes(-1, -2)) * decay[:, :, i]) @ new)
        last = gi[..., -1:]  # (B,H,1): the chunk's whole decay
        s = (s * mx.exp(last)[..., None]
             + (ki * mx.exp(last - gi)[..., None]).swapaxes(-1, -2) @ new)
    o = mx.stack(outs, axis=2).reshape(B, H, N * C, dv).transpose(0, 2, 1, 3)
    return o[:, :T], s


class DepthwiseConv(nn.Module):
    """The causal depthwise convolution's weight (channels, kernel): ssm_conv1d."""

    def __init__(self, channels: int, kernel: int):
        super().__init__()
        self.weight = mx.zeros((channels, kernel))


class GatedDeltaNet(nn.Module):
    """A Qwen3.5 linear-attention mixer (see the module docstring); its output, after
    `out_proj`, is the block's attention branch."""

    def __init__(self, a, ops: Ops):  # a: the model's LlamaArgs (llama.py imports this module)
        super().__init__()
        self.ops = ops
        self.hk, self.hv, self.dk = a.ssm_k_heads, a.ssm_v_heads, a.ssm_head_dim
        self.eps = a.norm_eps
        key, value = self.hk * self.dk, self.hv * self.dk
        self.qkv_proj = Linear(a.d_model, 2 * key + value, bias=False, ops=ops)
        self.z_proj = Linear(a.d_model, value, bias=False, ops=ops)
        self.beta_proj = Linear(a.d_model, self.hv, bias=False, ops=ops)
        self.alpha_proj = Linear(a.d_model, self.hv, bias=False, ops=ops)
        self.conv1d = DepthwiseConv(2 * key + value, a.ssm_conv_kernel)
        self.ssm_a = -mx.ones((self.hv,))  # -exp(A_log), as the file stores it
        self.dt_bias = mx.zeros((self.hv,))
        self.norm = RMSNorm(self.dk, eps=a.norm_eps, ops=ops)
        self.out_proj = Linear(value, a.d_model, bias=False, ops=ops)

    def __call__(self, x: mx.array, cache: DeltaCache | None = None) -> mx.array:
        """(B, T, D) normed input -> (B, T, D) the block's attention branch; with `cache`,
        continued from its conv inputs and state, which it then holds."""
        q, k, v, g, beta, past = self.rule_inputs(x, None if cache is None else cache.conv)
        o, state = gated_delta_rule(q, k, v, g, beta, None if cache is None else cache.ssm)
        if cache is not None:
            cache.conv, cache.ssm, cache.offset = past, state, cache.offset + x.shape[1]
        return self.output(x, o)

    # In two parts around the recurrence, so that a one-token decoding step can trace them
    # (toymlx.generation.generate.CompiledDecode) and leave the rule's exp to MLX's own op.
    def rule_inputs(self, x: mx.array, past: mx.array | None = None
                    ) -> tuple[mx.array, ...]:
        """The gated delta rule's q, k (B, T, Hv, dk), v (B, T, Hv, dk), g and beta (B, T, Hv)
        for the normed x (B, T, D), float32, and the convolution's last K-1 inputs (steps 1-4
        of the module docstring; `past`: the inputs before x, zeros if None)."""
        B, T, _ = x.shape
        hk, hv, dk = self.hk, self.hv, self.dk
        mixed = self.qkv_proj(x).astype(mx.float32)  # (B,T,conv_dim)
        conv, past = causal_conv(mixed, self.conv1d.weight.astype(mx.float32), past)
        q = conv[..., :hk * dk].reshape(B, T, hk, dk)
        k = conv[..., hk * dk:2 * hk * dk].reshape(B, T, hk, dk)
        v = conv[..., 2 * hk * dk:].reshape(B, T, hv, dk)
        q = l2_norm(q, self.eps) * dk ** -0.5
        k = l2_norm(k, self.eps)
        if hv != hk:  # GGUF value head j reads k head j % hk (the converter's tiled order)
            q, k = mx.tile(q, (1, 1, hv // hk, 1)), mx.tile(k, (1, 1, hv // hk, 1))
        beta = mx.sigmoid(self.beta_proj(x).astype(mx.float32))  # (B,T,hv)
        g = self.ssm_a * nn.softplus(self.alpha_proj(x).astype(mx.float32) + self.dt_bias)
        return q, k, v, g, beta, past

    def output(self, x: mx.array, o: mx.array) -> mx.array:
        """The branch's output (B, T, D) from the normed x (B, T, D) and the rule's o (B, T, Hv,
        dk): o normed per head, times SiLU(z), then out_proj (step 6)."""
        B, T, _ = x.shape
        z = self.z_proj(x).reshape(B, T, self.hv, self.dk).astype(mx.float32)
        o = self.norm(o.astype(x.dtype)) * nn.silu(z).astype(x.dtype)  # (B,T,hv,dk)
        return self.out_proj(o.reshape(B, T, self.hv * self.dk))
