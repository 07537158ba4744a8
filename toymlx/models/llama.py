"""The Llama-family decoder in mlx.nn, in llama.cpp's GGUF conventions.

One decoder computes every architecture toymlx loads from GGUF (`LlamaArgs.arch`): llama
(Llama 1-3, Mistral, SmolLM2, TinyLlama), qwen2, qwen3, gemma2, gemma3 (text), phi3, smollm3,
granite, olmo2, mistral3 (Ministral 3: llama's switches, YaRN RoPE and an attention
temperature on the queries) and gemma4 (dense, text). They are one transformer with a handful of
switches, each a field of `LlamaArgs`:

| switch | llama | qwen2 | qwen3 | gemma2 | gemma3 | phi3 | smollm3 | granite | olmo2 | gemma4 |
| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |
| RoPE pairs | adjacent | halves (NEOX) | halves | halves | halves | halves | adjacent | adjacent | halves | halves |
| blocks without RoPE | | | | | | | every 4th | | | |
| q/k/v biases | optional | yes | | | | | | | | |
| q/k RMSNorm before RoPE | | | per head | | per head | | | | whole | per head |
| embeddings times sqrt(d_model) | | | | yes | yes | | | | | yes |
| embeddings, residual branches, 1/logits times a file's scalar | | | | | | | | yes | | |
| norms before attention and MLP | yes | yes | yes | yes | yes | yes | yes | yes | | yes |
| norms after attention and MLP | | | | yes | yes | | | | yes | yes |
| gated activation | SiLU | SiLU | SiLU | GELU (tanh) | GELU (tanh) | SiLU | SiLU | SiLU | SiLU | GELU (tanh) |
| fused projections | | | | | | qkv, gate_up | | | | |
| sliding-window layers | | | | 1 of 2 | 5 of 6 | | | | | per file |
| soft-capped attention scores | | | | yes | | | | | | |

gemma4 has more (toymlx/gguf/gemma4.py says what each is): sliding and full blocks of different
head widths (`key_length_sliding`, `kv_heads_per_block`), MLP widths per block
(`ffn_dims_per_block`), unscaled scores (`attn_scale` 1),
values RMS-normed (`v_norm`), v = k's projection where a block has no v_proj (`k_eq_v`), a tail
of blocks attending over an earlier block's keys and values (`shared_kv_layers`, `kv_source`),
per-layer embeddings added after each MLP (`per_layer_dim`, `Llama.per_layer_inputs`) and a
scalar per block (`layer_scales`).

qwen3moe is qwen3 with each block's MLP a mixture of experts (`n_experts`,
`toymlx.models.moe.MoE`).

qwen35 (Qwen3.5, dense) is qwen3's block with two more switches: `attn_out_gate` (each head's
attention output times the sigmoid of a gate its q projection carries) and `linear_layers`
(3 of every 4 blocks mix tokens by Gated DeltaNet linear attention instead,
`toymlx.models.gated_delta`); RoPE turns the first quarter of each head (`rope_dims`).

Weights are `(out, in)`; q/k keep the file's RoPE layout (llama.cpp's converter permutes
llama's q/k for adjacent pairs; the NEOX architectures keep Hugging Face's halves), so no
weight is ever permuted. Query head h reads kv head h // (n_heads // n_kv_heads). The math runs through the `Ops` the model is built with
(`toymlx.models.ops`): `Llama(args)` computes with MLX's own ops in float32, the trainer builds
it with the run's `Ops`. Generation keeps keys and values in `models/kv_cache.py` (`make_cache`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import mlx.core as mx
from mlx import nn
from mlx.utils import tree_flatten, tree_unflatten

from toymlx.models.checks import ArgsError
from toymlx.models.gated_delta import DeltaCache, GatedDeltaNet
from toymlx.models.kv_cache import KVCache, SharedKV
from toymlx.models.layers import Embedding, Linear, RMSNorm
from toymlx.models.moe import MoE
from toymlx.models.ops import EXACT, Ops, Rope, RopeTables, yarn_corr_dims


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
    # ---- the architecture switches (set from a GGUF's metadata; see the module docstring)
    arch: str = "llama"
    """llama.cpp's general.architecture: llama, qwen2, qwen3, gemma2, gemma3, phi3, smollm3,
    granite, olmo2, mistral3 or qwen35."""
    rope_neox: bool = False
    """RoPE rotates halves (x[i], x[i+d/2]) instead of adjacent pairs."""
    rope_dims: int | None = None
    """Rotated width per head where it is less than head_dim (rope.dimension_count)."""
    rope_factors: tuple[float, ...] | None = None
    """Per-frequency divisors of the RoPE angles (Llama 3's rope_freqs, Phi-3's short factors)."""
    rope_scale: float = 1.0
    """Position scale of RoPE (1 / rope.scaling.factor with linear scaling)."""
    rope_mscale: float = 1.0
    """Magnitude of RoPE's cos and sin (rope.scaling.attn_factor)."""
    rope_yarn: bool = False
    """RoPE scaled by YaRN (rope.scaling.type yarn): rope_scale interpolates the slow
    frequencies only, and cos and sin are magnified (`yarn_rope`)."""
    rope_yarn_beta: tuple[float, float] = (32.0, 1.0)
    """YaRN's beta_fast and beta_slow: the rotations over the original context that bound its
    ramp (rope.scaling.yarn_beta_fast / yarn_beta_slow, which llama.cpp reads for mistral3)."""
    rope_yarn_log_mul: float = 0.0
    """YaRN's mscale_all_dim (rope.scaling.yarn_log_multiplier, mistral3's): the magnitude is
    (1 + 0.1 ln f) / (1 + 0.1 * this * ln f) where it is not 0."""
    rope_orig_context: int | None = None
    """The original context that YaRN's ramp and mistral3's attention temperature count in
    (rope.scaling.original_context_length; None: `context`)."""
    attn_temperature: float = 0.0
    """Queries times 1 + this * ln(floor(pos / original context) + 1) after RoPE (mistral3's
    attention.temperature_scale, Llama 4's scaling); 0: none."""
    attn_bias: bool = False
    """q, k and v projections carry biases (qwen2)."""
    out_bias: bool = False
    """The attention output projection carries a bias (llama files may)."""
    qk_norm: bool = False
    """Per-head RMSNorm of q and k before RoPE (qwen3, gemma3)."""
    qk_norm_whole: bool = False
    """RMSNorm of q and k over the whole projection, every head at once, before RoPE (olmo2)."""
    pre_norms: bool = True
    """RMSNorm of each block's input to attention and to the MLP (all but olmo2)."""
    post_norms: bool = False
    """RMSNorm of each block's attention and MLP outputs before the residual add (gemma2,
    gemma3, olmo2)."""
    embed_scale: bool = False
    """Token embeddings times sqrt(d_model) (gemma2, gemma3)."""
    activation: str = "silu"
    """The gated MLP's activation: silu (SwiGLU) or gelu_tanh (GeGLU, gemma2 and gemma3)."""
    fused_qkv: bool = False
    """q, k and v as one projection `qkv_proj` (phi3's attn_qkv)."""
    fused_gate_up: bool = False
    """gate and up as one projection `gate_up_proj`, gate first (phi3's ffn_up)."""
    attn_scale: float | None = None
    """Scale of q k^T where it is not head_dim ** -0.5."""
    sliding_window: int | None = None
    """Keys a sliding layer's query sees (itself included)."""
    sliding_layers: tuple[bool, ...] | None = None
    """Which blocks use the sliding window (gemma2: every other one from the first; gemma3: all
    but every sixth)."""
    rope_base_sliding: float = 10000.0
    """RoPE base of the sliding layers (rope.freq_base_swa; gemma2's default is rope_base)."""
    final_softcap: float | None = None
    """Logits soft-capped to +-cap by cap * tanh(logits / cap) (final_logit_softcapping)."""
    attn_softcap: float | None = None
    """Attention scores (q k^T times the query scale) soft-capped to +-cap by
    cap * tanh(scores / cap) before the mask and softmax (gemma2's attn_logit_softcapping)."""
    no_rope_interval: int = 0
    """RoPE skipped on every n-th block, counting from 1 (smollm3: 4); 0: every block rotates."""
    embedding_multiplier: float = 1.0
    """Token embeddings times this (granite.embedding_scale)."""
    residual_multiplier: float = 1.0
    """Each block's attention and MLP outputs times this before their residual adds
    (granite.residual_scale)."""
    logits_scaling: float = 1.0
    """Logits divided by this (granite.logit_scale)."""
    n_experts: int = 0
    """Experts of each block's mixture-of-experts MLP (expert_count); 0: a dense MLP."""
    n_experts_used: int = 0
    """Experts each token is routed to (expert_used_count)."""
    expert_ffn_dim: int | None = None
    """An expert's SwiGLU width (expert_feed_forward_length); None: ffn_dim // n_experts_used,
    llama.cpp's default."""
    moe_norm_topk: bool = True
    """The chosen experts' router probabilities divided by their sum (qwen3moe, Mixtral: always;
    qwen2moe: never)."""
    shared_expert_ffn_dim: int = 0
    """Width of a shared expert every token takes beside its routed ones
    (expert_shared_feed_forward_length, qwen2moe); 0: none."""
    attn_out_gate: bool = False
    """The q projection carries a second half per head, whose sigmoid gates that head's
    attention output before o_proj (qwen35's full-attention blocks)."""
    linear_layers: tuple[bool, ...] | None = None
    """Which blocks mix tokens by Gated DeltaNet linear attention instead of softmax attention
    (qwen35: 3 of every 4; `toymlx.models.gated_delta`)."""
    ssm_conv_kernel: int = 4
    """Tokens the linear blocks' causal convolution spans (ssm.conv_kernel)."""
    ssm_head_dim: int = 128
    """Width of a linear block's k and v heads, its state being (width, width) per value head
    (ssm.state_size)."""
    ssm_k_heads: int = 16
    """q/k heads of a linear block (ssm.group_count)."""
    ssm_v_heads: int = 16
    """Value heads of a linear block, a multiple of ssm_k_heads (ssm.time_step_rank)."""
    # ---- gemma4's (module docstring of toymlx.gguf.gemma4 for what each is and where from)
    key_length_sliding: int | None = None
    """Per-head width of the sliding blocks where it is not head_dim (attention.key_length_swa;
    head_dim is then the full-attention blocks')."""
    rope_dims_sliding: int | None = None
    """Rotated width per head of the sliding blocks (rope.dimension_count_swa); None: the whole
    head (gemma2 and gemma3 files: their rope_dims)."""
    ffn_dims_per_block: tuple[int, ...] | None = None
    """MLP hidden width of each block where they are not all ffn_dim (a feed_forward_length
    array: gemma4's E2B doubles it in its shared-KV tail, use_double_wide_mlp)."""
    kv_heads_per_block: tuple[int, ...] | None = None
    """Key/value heads of each block where they are not all n_kv_heads (a head_count_kv
    array)."""
    v_norm: bool = False
    """Each value head RMS-normed without a weight before attention."""
    k_eq_v: bool = False
    """The full-attention blocks have no v_proj: their values are their keys' projection,
    before the keys' norm and RoPE (attention_k_eq_v)."""
    shared_kv_layers: int = 0
    """The last n blocks project no keys or values: each attends over those of an earlier
    block (`kv_source`, llama.cpp's rule) with its own queries (attention.shared_kv_layers)."""
    per_layer_dim: int = 0
    """Width of each block's per-layer embedding input (PLE; embedding_length_per_layer_input);
    0: none."""
    layer_scales: bool = False
    """Each block's output times a scalar of its own (`out_scale`, layer_output_scale)."""

    @property
    def head_dim(self) -> int:
        """Per-head width of q, k and v (of the full-attention blocks where the sliding ones
        differ: `layer_head_dim`)."""
        return self.key_length or self.d_model // self.n_heads

    def layer_head_dim(self, layer: int) -> int:
        """Per-head width of block `layer`'s q, k and v."""
        if self.key_length_sliding and self.is_sliding(layer):
            return self.key_length_sliding
        return self.head_dim

    def layer_ffn(self, layer: int) -> int:
        """MLP hidden width of block `layer`."""
        return self.ffn_dims_per_block[layer] if self.ffn_dims_per_block else self.ffn_dim

    @property
    def expert_width(self) -> int:
        """An expert's SwiGLU width."""
        return self.expert_ffn_dim or self.ffn_dim // max(self.n_experts_used, 1)

    def kv_heads(self, layer: int) -> int:
        """Key/value heads of block `layer`."""
        return self.kv_heads_per_block[layer] if self.kv_heads_per_block else self.n_kv_heads

    def kv_source(self, layer: int) -> int | None:
        """The block whose keys and values block `layer` attends over, where it projects none of
        its own (the last `shared_kv_layers`): llama.cpp's rule (llama-model.cpp, the KV cache's
        `reuse` for gemma3n and gemma4), the last block with its own for a full-attention
        block, the one before that for a sliding one; None: its own."""
        first = self.n_layers - self.shared_kv_layers
        if layer < first:
            return None
        return first - (2 if self.is_sliding(layer) else 1)

    def kv_role(self, layer: int) -> str | None:
        """"reader" (attends over `kv_source`'s keys and values), "source" (a reader's source)
        or None."""
        if self.kv_source(layer) is not None:
            return "reader"
        readers = range(self.n_layers - self.shared_kv_layers, self.n_layers)
        return "source" if any(self.kv_source(r) == layer for r in readers) else None

    def validate(self) -> None:
        """Raise ArgsError (a ValueError) naming the field when the shape is inconsistent."""
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_dim",
                     "context"):
            if getattr(self, name) <= 0:
                raise ArgsError(self, name, "> 0")
        if self.key_length is None and self.d_model % self.n_heads:
            raise ArgsError(self, "d_model", "a multiple of {n_heads}",
                            alt=("n_heads", "a divisor of {d_model}"))
        if self.n_heads % self.n_kv_heads:
            raise ArgsError(self, "n_kv_heads", "a divisor of {n_heads}",
                            alt=("n_heads", "a multiple of {n_kv_heads}"))
        if not self.rope_base > 0:  # 0, negative or nan: every rotation is nan from step 0
            raise ArgsError(self, "rope_base", "> 0")
        if self.head_dim % 2 and self.key_length is not None:
            raise ArgsError(self, "key_length", "an even number for RoPE")
        if self.head_dim % 2:  # d_model // n_heads
            raise ArgsError(self, "d_model", "a multiple of 2 x {n_heads} (an even width per "
                            "head for RoPE)", alt=("n_heads", ("a divisor of {d_model} leaving "
                                                              "an even width per head for RoPE")))
        if self.activation not in ("silu", "gelu_tanh"):
            raise ArgsError(self, "activation", "silu or gelu_tanh", repr(self.activation))
        for name in ("final_softcap", "attn_softcap"):  # cap * tanh(x / cap): nan at 0
            cap = getattr(self, name)
            if cap is not None and not cap > 0:
                raise ArgsError(self, name, "> 0 or None (no cap)")
        if self.qk_norm and self.qk_norm_whole:
            raise ArgsError(self, "qk_norm_whole", "False where qk_norm is True (per head or "
                            "whole, not both)")
        if self.no_rope_interval < 0:
            raise ArgsError(self, "no_rope_interval", ">= 0 (0: every block rotates)")
        for name in ("embedding_multiplier", "residual_multiplier", "logits_scaling"):
            if not 0 < getattr(self, name) < float("inf"):  # nan too
                raise ArgsError(self, name, "a finite number > 0")
        if self.n_experts and not 1 <= self.n_experts_used <= self.n_experts:
            raise ArgsError(self, "n_experts_used", "1..{n_experts}")
        if self.n_experts and self.expert_width <= 0:
            raise ArgsError(self, "expert_ffn_dim", "> 0")
        if self.linear_layers is not None:
            if len(self.linear_layers) != self.n_layers:
                raise ArgsError(self, "linear_layers", "one entry per block of {n_layers}",
                                f"{len(self.linear_layers)}")
            for name in ("ssm_conv_kernel", "ssm_head_dim", "ssm_k_heads", "ssm_v_heads"):
                if getattr(self, name) <= 0:
                    raise ArgsError(self, name, "> 0")
            if self.ssm_v_heads % self.ssm_k_heads:
                raise ArgsError(self, "ssm_v_heads", "a multiple of {ssm_k_heads}")
        if self.sliding_layers is not None and len(self.sliding_layers) != self.n_layers:
            raise ArgsError(self, "sliding_layers", "one entry per block of {n_layers}",
                            f"{len(self.sliding_layers)}")
        if self.rope_orig_context is not None and self.rope_orig_context <= 0:
            raise ArgsError(self, "rope_orig_context", "> 0 or None (the context)")
        if not all(0 < b < float("inf") for b in self.rope_yarn_beta):
            raise ArgsError(self, "rope_yarn_beta", "two finite numbers > 0")
        if not 0 < self.rope_scale < float("inf"):
            raise ArgsError(self, "rope_scale", "a finite number > 0")
        self._validate_gemma4()

    def _validate_gemma4(self) -> None:
        """The per-block shapes (sliding head width, kv heads per block) and the shared-KV
        tail: each reader's source a block of its own kind, as transformers reads it too."""
        if self.key_length_sliding is not None and (self.key_length_sliding <= 0
                                                    or self.key_length_sliding % 2):
            raise ArgsError(self, "key_length_sliding", "an even number > 0 for RoPE")
        if self.ffn_dims_per_block is not None and (
                len(self.ffn_dims_per_block) != self.n_layers
                or min(self.ffn_dims_per_block) <= 0):
            raise ArgsError(self, "ffn_dims_per_block", "a width > 0 per block of {n_layers}")
        if self.kv_heads_per_block is not None:
            if len(self.kv_heads_per_block) != self.n_layers:
                raise ArgsError(self, "kv_heads_per_block", "one entry per block of {n_layers}",
                                f"{len(self.kv_heads_per_block)}")
            if any(n <= 0 or self.n_heads % n for n in self.kv_heads_per_block):
                raise ArgsError(self, "kv_heads_per_block", "divisors of {n_heads}")
        if self.per_layer_dim < 0:
            raise ArgsError(self, "per_layer_dim", ">= 0 (0: no per-layer embeddings)")
        n = self.shared_kv_layers
        if n == 0:
            return
        if not 0 < n <= self.n_layers - 2:
            raise ArgsError(self, "shared_kv_layers", "0..{n_layers} - 2 (llama.cpp reads "
                            "the last two blocks with their own keys and values)")
        for r in range(self.n_layers - n, self.n_layers):
            s = self.kv_source(r)
            assert s is not None
            if (self.is_sliding(s) != self.is_sliding(r) or self.kv_heads(s) != self.kv_heads(r)
                    or self.layer_head_dim(s) != self.layer_head_dim(r)):
                raise ArgsError(self, "shared_kv_layers", "a tail whose blocks read a block of "
                                "their own kind (llama.cpp reads block "
                                f"{s} for block {r}, transformers the last of its kind)")

    def rope(self, layer: int, query: bool = False) -> Rope:
        """Block `layer`'s RoPE (the Gemmas' sliding layers have their own base and width, and
        no scaling or factors: gemma4's rope_freqs are its full-attention blocks'); `query`: the
        queries', with mistral3's attention temperature where it has one."""
        if self.is_sliding(layer):
            return Rope(self.rope_base_sliding, self.rope_dims_sliding, self.rope_neox)
        yarn, mscale = self.yarn_rope()
        temperature = None
        if query and self.attn_temperature:
            temperature = (self.attn_temperature, self.rope_orig_context or self.context)
        return Rope(self.rope_base, self.rope_dims, self.rope_neox, self.rope_factors,
                    self.rope_scale, mscale, yarn, temperature)

    def yarn_rope(self) -> tuple[tuple[float, float] | None, float]:
        """(YaRN's correction dims or None, the magnitude of cos and sin), as llama.cpp sets
        them up (llama_context's constructor, then ggml's `rope_yarn`): with factor
        f = 1/rope_scale, ext_factor 1 and llama.cpp's mscale 1, the magnitude is
        rope_mscale * g(f, 1) / g(f, log_mul) (rope_yarn_log_mul set; g(f, 1) alone where not),
        g(f, m) = 1 + 0.1 m ln f for f > 1 (else 1): ggml multiplies by 1 + 0.1 ln f, which
        llama.cpp divides out beforehand.

        Where transformers' `_compute_yarn_parameters` differs: it applies a config's
        `attention_factor` (llama.cpp's converter writes it as rope.scaling.yarn_attn_factor,
        which llama.cpp's loaders of these architectures do not read) and uses a config's
        `mscale` beside `mscale_all_dim` (llama.cpp assumes mscale 1 but for deepseek2), and
        its ramp divides by high - low where llama.cpp's by max(0.001, high - low)."""
        if not self.rope_yarn:
            return None, self.rope_mscale
        dims = self.rope_dims or self.head_dim
        dims_lh = yarn_corr_dims(dims, self.rope_orig_context or self.context, self.rope_base,
                                 *self.rope_yarn_beta)
        f = 1.0 / self.rope_scale

        def g(m: float) -> float:
            return 1.0 if f <= 1.0 else 1.0 + 0.1 * m * math.log(f)

        mscale = g(1.0) / g(self.rope_yarn_log_mul) if self.rope_yarn_log_mul else g(1.0)
        return dims_lh, self.rope_mscale * mscale

    def is_sliding(self, layer: int) -> bool:
        return bool(self.sliding_window and self.sliding_layers and self.sliding_layers[layer])

    def is_linear(self, layer: int) -> bool:
        """Block `layer` is a Gated DeltaNet linear-attention block (qwen35)."""
        return bool(self.linear_layers and self.linear_layers[layer])

    def has_rope(self, layer: int) -> bool:
        """Block `layer` rotates q and k (smollm3's every 4th does not: llama.cpp's rule)."""
        return not (self.no_rope_interval and (layer + 1) % self.no_rope_interval == 0)


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

def attention_values(a: LlamaArgs, seq_len: int) -> int:
    """Values per token that one block's attention keeps for the backward pass when it is not
    recomputed there (`Ops.keeps_attention`): q and k normed and rotated, its output, and each
    head's probabilities against about 5/8 of `seq_len` keys (toymlx's blocked causal attention
    computes 5/8 of the score matrix at 256 positions, and nearly half at long lengths)."""
    q, kv = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
    return 2 * q + kv + (5 * a.n_heads * seq_len) // 8


class Attention(nn.Module):
    def __init__(self, a: LlamaArgs, ops: Ops, layer: int):
        super().__init__()
        self.ops = ops
        self.args = a
        hd, n_kv = a.layer_head_dim(layer), a.kv_heads(layer)
        self.n_heads, self.n_kv, self.head_dim = a.n_heads, n_kv, hd
        self.scale = a.attn_scale or hd ** -0.5
        self.rope = a.rope(layer) if a.has_rope(layer) else None
        # the queries' RoPE: mistral3's attention temperature scales theirs alone
        self.q_rope = a.rope(layer, query=True) if a.has_rope(layer) else None
        self.window = a.sliding_window if a.is_sliding(layer) else None
        self.softcap = a.attn_softcap
        self.own_kv = a.kv_source(layer) is None  # False: reads an earlier block's (gemma4)
        self.v_norm, self.eps = a.v_norm, a.norm_eps
        q, kv = a.n_heads * hd, n_kv * hd
        self.out_gate = a.attn_out_gate
        if a.fused_qkv:
            self.qkv_proj = Linear(a.d_model, q + 2 * kv, bias=a.attn_bias, ops=ops)
        else:
            self.q_proj = Linear(a.d_model, 2 * q if a.attn_out_gate else q, bias=a.attn_bias,
                                 ops=ops)
            if self.own_kv:
                self.k_proj = Linear(a.d_model, kv, bias=a.attn_bias, ops=ops)
            if self.own_kv and not (a.k_eq_v and not a.is_sliding(layer)):
                self.v_proj = Linear(a.d_model, kv, bias=a.attn_bias, ops=ops)
        self.o_proj = Linear(q, a.d_model, bias=a.out_bias, ops=ops)
        if a.qk_norm or a.qk_norm_whole:  # per head (hd values) or whole (q, kv values)
            self.q_norm = RMSNorm(q if a.qk_norm_whole else hd, eps=a.norm_eps, ops=ops)
            if self.own_kv:
                self.k_norm = RMSNorm(kv if a.qk_norm_whole else hd, eps=a.norm_eps, ops=ops)
        self.qk_norm, self.qk_norm_whole = a.qk_norm, a.qk_norm_whole

    # Training and scoring call it whole (__call__); generation in two parts, around its KV
    # cache (qkv, then attend); o_proj is Block.finish's.
    def __call__(self, x: mx.array, kv: tuple[mx.array, mx.array] | None = None,
                 hand_on: bool = False) -> Any:
        """(B,T,H*hd): attention of the normed x over its own T positions, before o_proj (no
        cache: training and scoring). From the projections on, the backward pass recomputes
        what it needs (`Ops.recomputed`: q/k norms, RoPE, the scores and their softmax), unless
        that takes few enough values a token to keep (`Ops.keeps_attention`). gemma4's shared-KV
        tail: `kv`, an earlier block's keys and values (B,Hkv,T,hd), normed and rotated, for a
        block that reads them; `hand_on`, a block whose readers take its own: it returns (o, k,
        v), k and v computed outside the recomputation, arrays of the forward pass that its
        readers' gradients flow back through."""
        q, k, v = self.project(x)
        q, gate = self.split_gate(q)
        if hand_on:  # its q is unused here: MLX computes it inside attend alone
            _, k, v = self.heads(q, k, v, 0)
            kv = (k, v)
        norm_names = ("q_norm",) if kv is not None else ("q_norm", "k_norm")
        norms = {n: self[n].trainable_parameters() for n in norm_names if n in self}

        def attend(p: dict, q: mx.array, k: mx.array, v: mx.array) -> mx.array:
            self.update(p)  # trainable norm weights as inputs, so their gradients flow
            if kv is not None:  # k, v in heads already: q alone normed and rotated
                return self.attend(self.heads(q, None, None, 0)[0], k, v)
            return self.attend(*self.heads(q, k, v, 0))

        k, v = kv if kv is not None else (k, v)
        if self.ops.keeps_attention(attention_values(self.args, x.shape[1])):
            o = attend(norms, q, k, v)
        else:
            o = self.ops.recomputed(attend, norms, q, k, v)
            self.update(norms)  # the recomputation leaves its inner arrays in the module
        o = self.gated(o, gate)
        return (o, k, v) if hand_on else o

    def split_gate(self, q: mx.array) -> tuple[mx.array, mx.array | None]:
        """q (B,T,H*hd) and the output gate (B,T,H*hd) of the q projection (B,T,H*2hd), whose
        head h holds its q then its gate (qwen35's attn_q); (q, None) without a gate."""
        if not self.out_gate:
            return q, None
        B, T, _ = q.shape
        qg = q.reshape(B, T, self.n_heads, 2 * self.head_dim)
        flat = (B, T, self.n_heads * self.head_dim)
        return qg[..., :self.head_dim].reshape(flat), qg[..., self.head_dim:].reshape(flat)

    @staticmethod
    def gated(o: mx.array, gate: mx.array | None) -> mx.array:
        """The attention's output (B,T,H*hd) times sigmoid(gate), where there is one."""
        return o if gate is None else o * mx.sigmoid(gate).astype(o.dtype)

    def qkv(self, x: mx.array, offset: int, tables: RopeTables | None = None,
            q_tables: RopeTables | None = None) -> tuple[mx.array, mx.array, mx.array]:
        """q (B,H,T,hd), k and v (B,Hkv,T,hd) of x (B,T,D) at positions offset..offset+T-1:
        projected, q and k normed (qk_norm) and rotated (`tables`: that position's RoPE tables,
        `Ops.rope_tables`, for a step traced once and called at every position; `q_tables`:
        the queries' own, where `q_rope` is not `rope`)."""
        return self.heads(*self.project(x), offset, tables, q_tables)

    def project(self, x: mx.array) -> tuple[mx.array, Any, Any]:
        """q (B,T,H*hd), k and v (B,T,Hkv*hd): the projections of x (B,T,D); k and v None in a
        block that reads an earlier one's (`own_kv`), v k's where it has no v_proj (k_eq_v)."""
        if "qkv_proj" not in self:
            if not self.own_kv:
                return self.q_proj(x), None, None
            k = self.k_proj(x)
            return self.q_proj(x), k, self.v_proj(x) if "v_proj" in self else k
        q_w, kv_w = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        qkv = self.qkv_proj(x)  # (B,T,q+2kv): q, then k, then v
        return qkv[..., :q_w], qkv[..., q_w:q_w + kv_w], qkv[..., q_w + kv_w:]

    def heads(self, q: mx.array, k: mx.array, v: mx.array, offset: int,
              tables: RopeTables | None = None, q_tables: RopeTables | None = None
              ) -> tuple[mx.array, mx.array, mx.array]:
        """The projections split into heads: q (B,H,T,hd), k and v (B,Hkv,T,hd), q and k normed
        (qk_norm, qk_norm_whole) and rotated at positions offset..offset+T-1 (unless the block
        has no RoPE)."""
        B, T, _ = q.shape
        hd = self.head_dim
        if self.qk_norm_whole:  # over each token's H*hd (Hkv*hd) values
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.reshape(B, T, self.n_heads, hd)  # (B,T,H,hd)
        if self.qk_norm:  # over each head's hd values
            q = self.q_norm(q)
        q = q.transpose(0, 2, 1, 3)  # (B,H,T,hd)
        if self.rope is not None:
            q = self.ops.rope(q, self.q_rope, offset, tables if q_tables is None else q_tables)
        if k is None:  # a block reading an earlier one's keys and values
            return q, k, v
        k = k.reshape(B, T, self.n_kv, hd)  # (B,T,Hkv,hd)
        if self.qk_norm:
            k = self.k_norm(k)
        k = k.transpose(0, 2, 1, 3)  # (B,Hkv,T,hd)
        v = v.reshape(B, T, self.n_kv, hd)
        if self.v_norm:  # weightless (gemma4)
            v = self.ops.rms_norm(v, mx.ones((hd,), v.dtype), self.eps)
        v = v.transpose(0, 2, 1, 3)  # (B,Hkv,T,hd)
        if self.rope is not None:
            k = self.ops.rope(k, self.rope, offset, tables)
        return q, k, v

    def attend(self, q: mx.array, k: mx.array, v: mx.array, cache: Any = None) -> mx.array:
        """(B,T,H*hd): attention over `cache`'s positions with k, v appended (or over k, v
        alone), before o_proj."""
        B, _, T, _ = q.shape
        if cache is not None and k is None:  # an earlier block's (`SharedKV`)
            k, v = cache.fetch(T)
        elif cache is not None:
            k, v = cache.update_and_fetch(k, v)  # (B,Hkv,S,hd): every position so far
        o = self.ops.attention(q, k, v, self.scale, causal=True, window=self.window,
                               softcap=self.softcap)  # (B,H,T,hd)
        return o.transpose(0, 2, 1, 3).reshape(B, T, -1)  # (B,T,H*hd)


class MLP(nn.Module):
    def __init__(self, a: LlamaArgs, ops: Ops, layer: int = 0):
        super().__init__()
        self.ops = ops
        self.activation = a.activation
        f = a.layer_ffn(layer)
        if a.fused_gate_up:
            self.gate_up_proj = Linear(a.d_model, 2 * f, bias=False, ops=ops)
        else:
            self.gate_proj = Linear(a.d_model, f, bias=False, ops=ops)
            self.up_proj = Linear(a.d_model, f, bias=False, ops=ops)
        self.down_proj = Linear(f, a.d_model, bias=False, ops=ops)

    def __call__(self, x: mx.array) -> mx.array:
        if "gate_up_proj" in self:
            gu = self.gate_up_proj(x)  # (B,T,2F): gate, then up
            n = gu.shape[-1] // 2
            gate, up = gu[..., :n], gu[..., n:]
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        act = self.ops.silu_mul if self.activation == "silu" else self.ops.gelu_mul
        return self.down_proj(act(gate, up))


class Scale(nn.Module):
    """x times one trained scalar, `weight` (1,) (gemma4's layer_output_scale), in x's dtype:
    the float32 weight times a bfloat16 x made every later block's residual stream float32."""

    def __init__(self):
        super().__init__()
        self.weight = mx.ones((1,))

    def __call__(self, x: mx.array) -> mx.array:
        return x * self.weight.astype(x.dtype)


class Block(nn.Module):
    def __init__(self, a: LlamaArgs, ops: Ops, layer: int = 0):
        super().__init__()
        self.ops = ops
        if a.pre_norms:
            self.attn_norm = RMSNorm(a.d_model, eps=a.norm_eps, ops=ops)
            self.ffn_norm = RMSNorm(a.d_model, eps=a.norm_eps, ops=ops)
        self.linear = a.is_linear(layer)
        self.attn = GatedDeltaNet(a, ops) if self.linear else Attention(a, ops, layer)
        shared = (MLP(replace(a, ffn_dim=a.shared_expert_ffn_dim), ops)
                  if a.shared_expert_ffn_dim else None)
        self.mlp = (MoE(a.d_model, a.n_experts, a.n_experts_used, a.expert_width,
                        a.moe_norm_topk, ops, shared) if a.n_experts else MLP(a, ops, layer))
        if a.post_norms:
            self.attn_post_norm = RMSNorm(a.d_model, eps=a.norm_eps, ops=ops)
            self.ffn_post_norm = RMSNorm(a.d_model, eps=a.norm_eps, ops=ops)
        if a.per_layer_dim:  # gemma4's per-layer embedding input, after the MLP
            self.ple_gate = Linear(a.d_model, a.per_layer_dim, bias=False, ops=ops)
            self.ple_proj = Linear(a.per_layer_dim, a.d_model, bias=False, ops=ops)
            self.ple_norm = RMSNorm(a.d_model, eps=a.norm_eps, ops=ops)
        if a.layer_scales:
            self.out_scale = Scale()
        self.pre_norms, self.post_norms = a.pre_norms, a.post_norms
        self.residual_multiplier = a.residual_multiplier
        self.has_ple, self.kv_role = bool(a.per_layer_dim), a.kv_role(layer)

    def __call__(self, x: mx.array, *inputs: mx.array, cache: Any = None) -> Any:
        """The block's output (B,T,D). `inputs`: its per-layer embedding input (B,T,P) where
        the model has them (per_layer_dim), then, without a cache, the keys and values
        (B,Hkv,T,hd) of its `kv_source` where it reads an earlier block's. Without a cache a
        block that is a source returns (output, its keys, its values)."""
        ple = inputs[0] if self.has_ple else None
        if self.linear:  # Gated DeltaNet: its own output projection, its own cache
            return self.close(x, self.attn(self.pre(x, "attn_norm"), cache), ple)
        if cache is not None and self.attn.out_gate:
            q, k, v = self.attn.project(self.pre(x, "attn_norm"))
            q, gate = self.attn.split_gate(q)
            o = self.attn.attend(*self.attn.heads(q, k, v, cache.offset), cache)
            return self.finish(x, self.attn.gated(o, gate), ple)
        if cache is not None:
            return self.finish(x, self.attn.attend(*self.start(x, cache.offset), cache), ple)
        kv = tuple(inputs[-2:]) if self.kv_role == "reader" else None
        out = self.attn(self.pre(x, "attn_norm"), kv, hand_on=self.kv_role == "source")
        if self.kv_role == "source":
            return self.finish(x, out[0], ple), out[1], out[2]
        return self.finish(x, out, ple)

    # A block in three parts, so that a one-token decoding step can trace the two whose shapes
    # stay the same at every position (toymlx.generation.generate.CompiledDecode):
    # start (norm, q/k/v, RoPE) -> attn.attend (the KV cache, attention) -> finish.
    def start(self, x: mx.array, offset: int, tables: RopeTables | None = None,
              q_tables: RopeTables | None = None) -> tuple[mx.array, mx.array, mx.array]:
        """q, k, v of the normed x (`Attention.qkv`)."""
        return self.attn.qkv(self.pre(x, "attn_norm"), offset, tables, q_tables)

    def finish(self, x: mx.array, o: mx.array, ple: mx.array | None = None) -> mx.array:
        """The block's output from its input x and the attention's `o` (before o_proj): both
        residual branches, the MLP's included, then gemma4's per-layer input `ple` (B,T,P)
        and output scale."""
        return self.close(x, self.attn.o_proj(o), ple)

    def close(self, x: mx.array, a: mx.array, ple: mx.array | None = None) -> mx.array:
        """The block's output from its input x and its attention branch `a` (after o_proj)."""
        x = x + self.branch(self.attn_post_norm(a) if self.post_norms else a)
        m = self.mlp(self.pre(x, "ffn_norm"))
        x = x + self.branch(self.ffn_post_norm(m) if self.post_norms else m)
        if ple is not None:  # gelu_tanh(gate x) * ple, projected back and normed
            x = x + self.ple_norm(self.ple_proj(self.ops.gelu_mul(self.ple_gate(x), ple)))
        return self.out_scale(x) if "out_scale" in self else x

    def pre(self, x: mx.array, norm: str) -> mx.array:
        """x as a residual branch reads it: normed by `norm` (attn_norm or ffn_norm), or as it
        is where the block has no pre-norms (olmo2)."""
        return self[norm](x) if self.pre_norms else x

    def branch(self, y: mx.array) -> mx.array:
        """A residual branch's output as it is added: times residual_multiplier (granite)."""
        r = self.residual_multiplier
        return y if r == 1.0 else y * r


class Llama(nn.Module):
    def __init__(self, args: LlamaArgs, ops: Ops = EXACT):
        super().__init__()
        args.validate()
        self.args, self.ops = args, ops
        self.embed = Embedding(args.vocab_size, args.d_model, ops)
        self.layers = [Block(args, ops, i) for i in range(args.n_layers)]
        self.norm = RMSNorm(args.d_model, eps=args.norm_eps, ops=ops)
        if args.per_layer_dim:  # gemma4's per-layer embeddings: a table and a projection
            width = args.per_layer_dim * args.n_layers  # every block's, side by side
            self.ple_embed = Embedding(args.vocab_size, width, ops)
            self.ple_proj = Linear(args.d_model, width, bias=False, ops=ops)
            self.ple_norm = RMSNorm(args.per_layer_dim, eps=args.norm_eps, ops=ops)
        if not args.tie_embeddings:
            self.output = Linear(args.d_model, args.vocab_size, bias=False, ops=ops)
        self._init_weights()

    def _init_weights(self) -> None:
        # GPT-2 style: N(0, 0.02), residual projections scaled down by depth.
        std = 0.02
        resid_std = std / (2 * self.args.n_layers) ** 0.5

        def init(path: str, w: mx.array) -> mx.array:
            if path.endswith(("norm.weight", "out_scale.weight", ".ssm_a", ".dt_bias")):
                return w  # -1 and 0: a decay of exp(-softplus(0)) = 0.5 per token (linear)
            s = resid_std if path.endswith(("o_proj.weight", "down_proj.weight")) else std
            return mx.random.normal(w.shape, scale=s)

        self.update(tree_unflatten([(k, init(k, v)) for k, v in tree_flatten(self.parameters())]))

    def embed_tokens(self, tokens: mx.array) -> mx.array:
        """(B, T) token ids -> (B, T, D) rows of the token table (times sqrt(D) for gemma3, times
        embedding_multiplier for granite)."""
        h = self.embed(tokens)
        if self.args.embedding_multiplier != 1.0:
            h = h * self.args.embedding_multiplier
        return h * (self.args.d_model ** 0.5) if self.args.embed_scale else h

    def unembed(self, h: mx.array) -> mx.array:
        """(B, T, D) -> (B, T, V) logits: the tied token table, or output.weight; soft-capped
        where the model says so."""
        if self.args.tie_embeddings:
            logits = self.embed.as_linear(h)
        else:
            logits = self.output(h)
        cap = self.args.final_softcap
        return logits if not cap else cap * mx.tanh(logits / cap)

    def frozen_head(self) -> nn.Module | None:
        """The output head (the tied token table or `output`) when nothing of it trains (a LoRA
        base's), for a loss that reads it a slice of rows at a time; else None."""
        m = self.embed if self.args.tie_embeddings else self.output
        return None if tree_flatten(m.trainable_parameters()) else m

    def head_key(self) -> str:
        """The top-level parameter group `unembed` reads: the tied token table or output."""
        return "embed" if self.args.tie_embeddings else "output"

    def hidden(self, tokens: mx.array, cache: list[Any] | None = None) -> mx.array:
        """(B, T) token ids -> (B, T, D) final hidden states as the head reads them
        (`head_input`), before `unembed`."""
        h = self.embed_tokens(tokens)  # (B,T,D)
        ple = self.per_layer_inputs(tokens, h) if self.args.per_layer_dim else None
        shared: dict[int, tuple[mx.array, mx.array]] = {}  # a source block's keys and values
        for i, layer in enumerate(self.layers):
            inputs = () if ple is None else (ple[:, :, i, :],)
            if cache is not None:
                h = layer(h, *inputs, cache=cache[i])
                continue
            src = self.args.kv_source(i)
            out = self.ops.block(layer, h, *inputs, *(shared[src] if src is not None else ()))
            if layer.kv_role == "source":
                h, shared[i] = out[0], (out[1], out[2])
            else:
                h = out
        return self.head_input(h)

    def per_layer_inputs(self, tokens: mx.array, h: mx.array) -> mx.array:
        """(B,T,n_layers,P) every block's per-layer input (gemma4's PLE), from the ids (B,T)
        and their scaled embeddings h (B,T,D): (norm(ple_proj(h) / sqrt(D)) + ple_embed[ids]
        * sqrt(P)) / sqrt(2), llama.cpp's project_per_layer_inputs and build_inp_per_layer
        (transformers' the same)."""
        B, T = tokens.shape
        L, P = self.args.n_layers, self.args.per_layer_dim
        rows = self.ple_embed(tokens).reshape(B, T, L, P) * (P ** 0.5)
        proj = (self.ple_proj(h) * (self.args.d_model ** -0.5)).reshape(B, T, L, P)
        return (self.ple_norm(proj) + rows) * (2.0 ** -0.5)

    def head_input(self, h: mx.array) -> mx.array:
        """(B, T, D) the last block's output -> what the output head reads: normed, and divided
        by logits_scaling (granite's logits are divided by it; dividing the head's input
        instead leaves every reader of the head, a frozen one's slices too, the same)."""
        h = self.norm(h)
        s = self.args.logits_scaling
        return h if s == 1.0 else h * (1.0 / s)

    def __call__(self, tokens: mx.array, cache: list[Any] | None = None) -> mx.array:
        return self.unembed(self.hidden(tokens, cache))  # (B,T,V)

    def make_cache(self) -> list[KVCache | SharedKV | DeltaCache]:
        """One KV cache per block, for generation; a block that reads an earlier one's keys
        and values (gemma4's shared-KV tail) a view of that block's; a linear block's its conv
        inputs and state (qwen35)."""
        caches: list[KVCache | SharedKV | DeltaCache] = []
        for i, layer in enumerate(self.layers):
            src = self.args.kv_source(i)
            if layer.linear:
                caches.append(DeltaCache())
            else:
                caches.append(KVCache() if src is None else SharedKV(caches[src]))
        return caches
