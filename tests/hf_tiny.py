"""Tiny random-weight Hugging Face checkpoints, converted to GGUF by llama.cpp's own converter.

The GGUFs people download come from llama.cpp's `convert_hf_to_gguf.py` run on a Hugging Face
checkpoint (then, often, `llama-quantize`). This module makes the same kind of file without
downloading a model: `tiny_hf_checkpoint(kind, dir)` builds a small model with `transformers`'
own config and model classes, fills it with seeded random weights (norm weights and biases
random too, so a loader that drops or misreads one shows up in the logits), and saves it;
`gguf_from_hf(dir, out)` runs the converter from llama.cpp's source tree (tests/
llamacpp_source.py) in a child process; `llamacpp_quantize(src, dst, "Q4_K_M")` quantizes the
result the way `llama-quantize` does (llama.cpp's `llama_model_quantize` through
llama-cpp-python, in a child process: tests/llamacpp_runner.py). `hf_logits` gives the
Hugging Face model's own float32 logits, a second reference beside llama.cpp's.

Kinds (`KINDS`; each with a `-q` twin whose hidden size 256 and feed-forward size 512 give
rows that K-quants can hold, for `llamacpp_quantize`):

    llama          Llama 2 / TinyLlama layout: SentencePiece vocab, untied output, GQA 4/2
    llama3         Llama 3.2 layout: byte-level BPE (pre "llama-bpe"), tied, rope_theta 5e5,
                   "llama3" RoPE scaling (the converter writes `rope_freqs.weight`)
    mistral        MistralForCausalLM, Mistral-Nemo style: head_dim 32 != hidden/heads,
                   rope_theta 1e6, untied, SentencePiece vocab, no sliding window
    qwen2          Qwen2.5 layout: q/k/v biases, tied, byte-level BPE (pre "qwen2")
    qwen3          Qwen3 layout: q/k RMS norms, head_dim 32 with hidden 64 and 4 heads, tied
    gemma3         Gemma 3 text (Gemma3ForCausalLM): 6 layers, sliding window 8 on layers
                   0-4 and global attention on layer 5 (transformers' default layer_types
                   and llama.cpp's pattern of 6 agree; the converter writes no pattern),
                   MQA 4/1, head_dim 32, query_pre_attn_scalar = head_dim, local RoPE base
                   1e4 / global 1e6, tied, gemma-style SentencePiece vocab
    gemma2         Gemma 2 (Gemma2ForCausalLM): 4 layers, sliding window 8 on layers 0 and 2
                   (transformers' and llama.cpp's alternation agree), head_dim 32,
                   query_pre_attn_scalar = head_dim, attention scores soft-capped at 0.5 and
                   logits at 2 (Gemma 2's are 50 and 30; these bind on these weights: without
                   them transformers' logits move by 0.07 and 0.2), rope_theta 1e4 (the
                   converter writes no RoPE base), tied, gemma-style SentencePiece vocab
    phi3           Phi-3-mini layout: fused qkv and gate_up, untied, SentencePiece vocab
                   with Phi-3's special tokens, sliding_window 2047 (llama.cpp ignores it;
                   the 40-token tests stay far inside it)
    phi3-partial   Phi-4-mini style: partial_rotary_factor 0.75, tied
    phi3-longrope  Phi-3-128k style: "longrope" scaling with short and long factors,
                   original context 32, so a context above 32 uses the long factors in both
                   llama.cpp (it decides on n_ctx, 64 in llamacpp_runner) and transformers
                   (it decides on the sequence length: keep test sequences above 32 tokens)
    smollm3        SmolLM3ForCausalLM: 4 layers, the 4th without RoPE (no_rope_layer_interval
                   4, llama.cpp's fixed rule), tied, byte-level BPE (Llama 3's)
    granite        GraniteForCausalLM (Granite 3.x dense): granite-3.3-2b's embedding (12) and
                   residual (0.22) multipliers, attention_multiplier 0.05, logits_scaling 2.5,
                   tied, byte-level BPE
    olmo2          Olmo2ForCausalLM (OLMo 2): norms after attention and MLP only, q/k RMS norms
                   over the whole projection, untied, byte-level BPE
    phi4-mini      Phi-4-mini-instruct's layout: phi3 with partial_rotary_factor 0.75 and
                   "longrope" factors for the rotated part only (original context 32, as
                   phi3-longrope), GQA 4/2, tied, sliding_window 262144, and a byte-level BPE
                   vocabulary with GPT-4o's regex (pre "gpt-4o", tokenizer_class GPT2Tokenizer)
    qwen3-yarn     qwen3 with Qwen3-128K's "yarn" RoPE scaling (factor 4), original context 16
                   and rope_theta 1e6: YaRN's ramp runs over frequencies 0-2 of 16 (one half
                   mixed) and cos/sin are magnified by 1 + 0.1 ln 4; transformers' YaRN does
                   not depend on the sequence length, so both references agree at any length
    ministral3     Ministral3ForCausalLM (Ministral 3, llama.cpp's mistral3): llama's layout,
                   "yarn" factor 16 over original context 16, beta_fast 4 and beta_slow 0.5
                   (the ramp over frequencies 0-3; llama.cpp's defaults 32/1 would give 0-2),
                   mscale_all_dim 0.5 (magnitude (1 + 0.1 ln 16) / (1 + 0.05 ln 16)), and
                   Llama 4's attention temperature 0.1 over the original context: queries at
                   positions 16-31 times 1 + 0.1 ln 2, 32-47 times 1 + 0.1 ln 3; untied,
                   SentencePiece vocab, Ministral-3-14B-Reasoning-2512's chat template
    qwen35         Qwen3_5ForCausalLM (Qwen3.5 dense text): 4 layers, Gated DeltaNet linear
                   attention on layers 0-2 (2 k heads of 16 serving 4 value heads, conv kernel
                   4) and gated full attention on layer 3 (head_dim 32, a quarter rotated,
                   mrope_section [2, 1, 1] interleaved), tied, byte-level BPE cut from
                   ggml-vocab-qwen35 (pre "qwen35"); converted with --no-mtp (the converter
                   asserts MTP weights otherwise; transformers' model has none)
    gemma4         Gemma 4 text (Gemma4ForCausalLM, E2B's layout): 6 layers, sliding (window 8)
                   and full attention alternating from a sliding one, sliding heads 16 wide
                   and full ones 32 (-q: 64, 128), MQA 4/1, "proportional" RoPE 0.25 on the
                   full layers (the converter's rope_freqs), the last 2 layers reading layers
                   2's and 3's keys and values with MLPs twice as wide (E2B's
                   use_double_wide_mlp), per-layer embeddings of 8 (-q: 64), random
                   layer scalars, logits capped at 2 (binds), tied, a SentencePiece-style BPE
                   tokenizer.json (Gemma 4's merges) for the converter's LlamaHfVocab
    qwen3moe       Qwen3MoeForCausalLM (Qwen3-30B-A3B's layout): qwen3's attention, every
                   block's MLP 8 experts of width ff / 2 with 2 used per token, their
                   weights renormalized (norm_topk_prob, as Qwen3-30B-A3B has it), byte-level
                   BPE (pre "qwen2")
    mixtral        MixtralForCausalLM (Mixtral-8x7B's layout, converted as a `llama` file with
                   experts): 8 experts of width ff, 2 used, GQA 4/2, untied, SentencePiece vocab
    qwen2moe       Qwen2MoeForCausalLM (Qwen1.5-MoE-A2.7B's layout): qwen2's attention (q/k/v
                   biases), 8 experts of width ff / 2, 2 used, weights not renormalized, and a
                   shared expert of width ff behind a sigmoid gate; untied, byte-level BPE

The tokenizer. The converter needs one in the checkpoint folder, and the real vocabularies
(32k to 262k tokens) would make the embedding most of the file. Each checkpoint therefore
gets a 512-token vocabulary cut from the real one that llama.cpp ships for tokenizer tests
(`models/ggml-vocab-*.gguf` in the same source tree):

- SentencePiece kinds (llama, mistral, gemma2, gemma3, phi3*): a `tokenizer.model` holding the
  first pieces of ggml-vocab-llama-spm.gguf / ggml-vocab-phi-3.gguf (for Gemma behind gemma's
  special tokens pad/eos/bos/unk/mask/start_of_turn/end_of_turn), with byte fallback, written
  as the SentencePiece protobuf directly. The converter reads it as it reads any
  `tokenizer.model`: no change to the converter. The cut holds merged pieces ("er", "▁t")
  without the characters alone ("e", "▁"), which llama.cpp (and toymlx) still merge.
- Byte-level BPE kinds (llama3, qwen2, qwen3, phi4-mini, qwen35): a `tokenizer.json` (HF
  `tokenizers`) with the family's 256 byte tokens, its first merges whose parts stay in the
  cut vocabulary, its pre-tokenizer regex and a few of its special tokens. The converter identifies BPE
  pre-tokenizers by a hash of the token ids of a fixed text; a cut vocabulary gives other ids,
  so the hash is not recognised. The one shim (`_child_convert`): the converter's
  `TextModel.get_vocab_base_pre` is wrapped so that, when its own table does not know the
  hash, it returns the pre-tokenizer name the checkpoint declares in `toymlx_tiny.json`
  ("llama-bpe", "qwen2", "gpt-4o" or "qwen35", the regex the tokenizer was built with). Nothing
  else in the converter is touched (but qwen35's --no-mtp, above): the hyperparameter,
  tensor-name, permutation and extra-tensor code under test runs as llama.cpp ships it.

Token ids for tests: `token_ids(kind, n)` gives seeded ids below the vocabulary's special
tokens (the first is the BOS id where the family has one). Test modules import the
fixtures with the one they use: `from hf_tiny import tiny_gguf, tiny_hf  # noqa: F401` and
`from llamacpp_source import llamacpp_source  # noqa: F401`.

Script use (the child processes):
    python hf_tiny.py convert TREE HF_DIR OUT.gguf OUTTYPE PRE
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

SCRIPT = Path(__file__).resolve()
VOCAB = 512  # tokens in every tiny checkpoint's vocabulary
MANIFEST = "toymlx_tiny.json"
BASE_KINDS = ("llama", "llama3", "mistral", "qwen2", "qwen3", "gemma3", "phi3", "phi3-partial",
              "phi3-longrope", "gemma2", "smollm3", "granite", "olmo2", "phi4-mini",
              "qwen3-yarn", "ministral3", "qwen35", "gemma4",
              "qwen3moe", "mixtral", "qwen2moe")
# a kind's weights are seeded by its place here: kinds added later (from phi4-mini on) go after
# the first ones' -q twins, so that no kind's weights change when one is added
_FIRST = BASE_KINDS[:BASE_KINDS.index("phi4-mini")]
KINDS = (_FIRST + tuple(f"{k}-q" for k in _FIRST)
         + tuple(k for b in BASE_KINDS[len(_FIRST):] for k in (b, f"{b}-q")))
MINISTRAL3_TEMPLATE = "mistralai-Ministral-3-14B-Reasoning-2512.jinja"
"""The ministral3 kind's chat template (llama.cpp's models/templates), which the converter
writes as tokenizer.chat_template."""
# Types `llamacpp_quantize` accepts (llama.cpp's LLAMA_FTYPE_MOSTLY_<name>).
QUANT_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K_S", "Q3_K_M", "Q3_K_L",
               "Q4_K_S", "Q4_K_M", "Q5_K_S", "Q5_K_M", "Q6_K", "IQ4_NL", "IQ4_XS", "F16",
               "BF16")


class ConversionError(RuntimeError):
    """llama.cpp's converter failed in the child process."""


# ---- the kinds --------------------------------------------------------------------------
@dataclass(frozen=True)
class Spec:
    kind: str
    family: str  # llama | mistral | mixtral | qwen2 | qwen2moe | qwen3 | qwen3moe | gemma2
    # | gemma3 | phi3 | smollm3 | granite | olmo2 | ministral3 | qwen35 | gemma4
    tokenizer: str  # spm-llama | spm-gemma | spm-phi3 | bpe-llama3 | bpe-qwen2 | bpe-gpt4o
    # | bpe-qwen35 | bpe-gemma4
    hidden: int
    ff: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int | None  # None: hidden // heads
    tied: bool
    extra: dict = field(default_factory=dict)


def spec(kind: str) -> Spec:
    """The shape and layout of `kind` (see the module docstring)."""
    base, q = (kind[:-2], True) if kind.endswith("-q") else (kind, False)
    if base not in BASE_KINDS:
        raise ValueError(f"unknown tiny kind {kind!r}; expected one of {', '.join(KINDS)}")
    h, ff = (256, 512) if q else (64, 128)
    wide = 128 if q else 32  # head_dim that differs from hidden // heads
    s = {"kind": kind, "hidden": h, "ff": ff, "layers": 2, "heads": 4, "kv_heads": 2,
         "head_dim": None}
    if base == "llama":
        return Spec(**s, family="llama", tokenizer="spm-llama", tied=False)
    if base == "llama3":
        return Spec(**s, family="llama", tokenizer="bpe-llama3", tied=True)
    if base == "mistral":
        return Spec(**{**s, "head_dim": wide}, family="mistral", tokenizer="spm-llama",
                    tied=False)
    if base == "qwen2":
        return Spec(**s, family="qwen2", tokenizer="bpe-qwen2", tied=True)
    if base == "qwen3":
        return Spec(**{**s, "head_dim": wide}, family="qwen3", tokenizer="bpe-qwen2", tied=True)
    if base == "gemma3":
        return Spec(**{**s, "layers": 6, "kv_heads": 1, "head_dim": wide}, family="gemma3",
                    tokenizer="spm-gemma", tied=True)
    if base == "gemma2":
        return Spec(**{**s, "layers": 4, "head_dim": wide}, family="gemma2",
                    tokenizer="spm-gemma", tied=True)
    if base == "phi3":
        return Spec(**s, family="phi3", tokenizer="spm-phi3", tied=False)
    if base == "smollm3":
        return Spec(**{**s, "layers": 4}, family="smollm3", tokenizer="bpe-llama3", tied=True)
    if base == "granite":
        return Spec(**s, family="granite", tokenizer="bpe-llama3", tied=True)
    if base == "olmo2":
        return Spec(**s, family="olmo2", tokenizer="bpe-llama3", tied=False)
    if base == "phi4-mini":
        return Spec(**s, family="phi3", tokenizer="bpe-gpt4o", tied=True,
                    extra={"partial_rotary_factor": 0.75, "longrope": True,
                           "sliding_window": 262144})
    if base == "qwen3-yarn":
        return Spec(**{**s, "head_dim": wide}, family="qwen3", tokenizer="bpe-qwen2", tied=True,
                    extra={"yarn": True})
    if base == "ministral3":
        return Spec(**{**s, "head_dim": wide}, family="ministral3", tokenizer="spm-llama",
                    tied=False)
    if base == "qwen35":  # 3 Gated DeltaNet blocks, then a full-attention one; 2 k heads, 4 v
        lin = 64 if q else 16
        return Spec(**{**s, "layers": 4, "head_dim": wide}, family="qwen35",
                    tokenizer="bpe-qwen35", tied=True,
                    extra={"linear_key_head_dim": lin, "linear_value_head_dim": lin,
                           "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                           "mrope_section": [6, 5, 5] if q else [2, 1, 1]})
    if base == "gemma4":
        return Spec(**{**s, "layers": 6, "kv_heads": 1, "head_dim": 64 if q else 16},
                    family="gemma4", tokenizer="bpe-gemma4", tied=True,
                    extra={"global_head_dim": wide, "ple": 64 if q else 8})
    if base == "qwen3moe":
        return Spec(**{**s, "head_dim": wide}, family="qwen3moe", tokenizer="bpe-qwen2",
                    tied=True, extra={"experts": 8, "experts_used": 2, "expert_ff": ff // 2})
    if base == "qwen2moe":
        return Spec(**s, family="qwen2moe", tokenizer="bpe-qwen2", tied=False,
                    extra={"experts": 8, "experts_used": 2, "expert_ff": ff // 2})
    if base == "mixtral":
        return Spec(**s, family="mixtral", tokenizer="spm-llama", tied=False,
                    extra={"experts": 8, "experts_used": 2})
    if base == "phi3-partial":
        return Spec(**s, family="phi3", tokenizer="spm-phi3", tied=True,
                    extra={"partial_rotary_factor": 0.75})
    return Spec(**s, family="phi3", tokenizer="spm-phi3", tied=False, extra={"longrope": True})


def _rope(theta: float, **scaling) -> dict:
    return {"rope_type": "default", "rope_theta": theta, **scaling}


def hf_config(sp: Spec, tok: dict):
    """The transformers config object for `sp` (`tok`: the tokenizer's special ids)."""
    import transformers as tf

    common = {"vocab_size": VOCAB, "hidden_size": sp.hidden, "intermediate_size": sp.ff,
              "num_hidden_layers": sp.layers, "num_attention_heads": sp.heads,
              "num_key_value_heads": sp.kv_heads, "tie_word_embeddings": sp.tied,
              "bos_token_id": tok.get("bos"), "eos_token_id": tok.get("eos"),
              "pad_token_id": tok.get("pad")}
    if sp.head_dim is not None:
        common["head_dim"] = sp.head_dim
    hd = sp.head_dim or sp.hidden // sp.heads
    if sp.family == "llama":
        if sp.tokenizer == "bpe-llama3":
            # Llama 3.2: rope_theta 5e5 and llama3 scaling; original context 64 puts the
            # head_dim 16 frequencies on both sides of the smooth band (factors 1, mixed, 8).
            rope = _rope(500000.0, rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                         high_freq_factor=4.0, original_max_position_embeddings=64)
            return tf.LlamaConfig(**common, max_position_embeddings=131072, rms_norm_eps=1e-5,
                                  rope_parameters=rope)
        return tf.LlamaConfig(**common, max_position_embeddings=2048, rms_norm_eps=1e-5,
                              rope_parameters=_rope(10000.0))
    if sp.family == "mistral":
        return tf.MistralConfig(**common, max_position_embeddings=32768, rms_norm_eps=1e-5,
                                sliding_window=None, rope_parameters=_rope(1000000.0))
    if sp.family == "qwen2":
        return tf.Qwen2Config(**common, max_position_embeddings=32768, rms_norm_eps=1e-6,
                              use_sliding_window=False, rope_parameters=_rope(1000000.0))
    if sp.family == "qwen3" and sp.extra.get("yarn"):
        rope = _rope(1000000.0, rope_type="yarn", factor=4.0, original_max_position_embeddings=16)
        return tf.Qwen3Config(**common, max_position_embeddings=64, rms_norm_eps=1e-6,
                              attention_bias=False, use_sliding_window=False,
                              rope_parameters=rope)
    if sp.family == "qwen3":
        return tf.Qwen3Config(**common, max_position_embeddings=40960, rms_norm_eps=1e-6,
                              attention_bias=False, use_sliding_window=False,
                              rope_parameters=_rope(1000000.0))
    if sp.family == "ministral3":
        rope = _rope(10000.0, rope_type="yarn", type="yarn", factor=16.0,
                     original_max_position_embeddings=16, max_position_embeddings=256,
                     beta_fast=4.0, beta_slow=0.5, mscale=1.0, mscale_all_dim=0.5,
                     llama_4_scaling_beta=0.1)
        return tf.Ministral3Config(**common, max_position_embeddings=256, rms_norm_eps=1e-5,
                                   rope_parameters=rope)
    if sp.family == "qwen3moe":
        return tf.Qwen3MoeConfig(**common, max_position_embeddings=40960, rms_norm_eps=1e-6,
                                 attention_bias=False, use_sliding_window=False,
                                 rope_parameters=_rope(1000000.0),
                                 num_experts=sp.extra["experts"],
                                 num_experts_per_tok=sp.extra["experts_used"],
                                 moe_intermediate_size=sp.extra["expert_ff"],
                                 norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    if sp.family == "qwen2moe":
        return tf.Qwen2MoeConfig(**common, max_position_embeddings=32768, rms_norm_eps=1e-6,
                                 use_sliding_window=False, rope_parameters=_rope(1000000.0),
                                 num_experts=sp.extra["experts"],
                                 num_experts_per_tok=sp.extra["experts_used"],
                                 moe_intermediate_size=sp.extra["expert_ff"],
                                 shared_expert_intermediate_size=sp.ff, norm_topk_prob=False,
                                 decoder_sparse_step=1, mlp_only_layers=[], qkv_bias=True)
    if sp.family == "mixtral":
        return tf.MixtralConfig(**common, max_position_embeddings=32768, rms_norm_eps=1e-5,
                                sliding_window=None, rope_parameters=_rope(1000000.0),
                                num_local_experts=sp.extra["experts"],
                                num_experts_per_tok=sp.extra["experts_used"])
    if sp.family == "gemma3":
        return tf.Gemma3TextConfig(
            **common, max_position_embeddings=32768, rms_norm_eps=1e-6, sliding_window=8,
            query_pre_attn_scalar=hd, hidden_activation="gelu_pytorch_tanh",
            rope_parameters={"full_attention": _rope(1000000.0),
                             "sliding_attention": _rope(10000.0)})
    if sp.family == "gemma4":
        return tf.Gemma4TextConfig(
            **common, max_position_embeddings=131072, rms_norm_eps=1e-6, sliding_window=8,
            hidden_activation="gelu_pytorch_tanh", final_logit_softcapping=2.0,
            layer_types=["sliding_attention", "full_attention"] * (sp.layers // 2),
            global_head_dim=sp.extra["global_head_dim"], num_kv_shared_layers=2,
            use_double_wide_mlp=True,
            hidden_size_per_layer_input=sp.extra["ple"], vocab_size_per_layer_input=VOCAB,
            rope_parameters={"sliding_attention": _rope(10000.0),
                             "full_attention": {"rope_type": "proportional",
                                                "partial_rotary_factor": 0.25,
                                                "rope_theta": 1000000.0}})
    if sp.family == "gemma2":
        return tf.Gemma2Config(
            **common, max_position_embeddings=8192, rms_norm_eps=1e-6, sliding_window=8,
            query_pre_attn_scalar=hd, hidden_activation="gelu_pytorch_tanh",
            attn_logit_softcapping=0.5, final_logit_softcapping=2.0,
            rope_parameters=_rope(10000.0))
    if sp.family == "smollm3":
        return tf.SmolLM3Config(**common, max_position_embeddings=65536, rms_norm_eps=1e-6,
                                use_sliding_window=False, no_rope_layer_interval=4,
                                rope_parameters=_rope(5000000.0))
    if sp.family == "granite":
        return tf.GraniteConfig(**common, max_position_embeddings=131072, rms_norm_eps=1e-5,
                                rope_parameters=_rope(10000000.0), embedding_multiplier=12.0,
                                residual_multiplier=0.22, attention_multiplier=0.05,
                                logits_scaling=2.5)
    if sp.family == "qwen35":
        lin = {k: v for k, v in sp.extra.items() if k.startswith("linear_")}
        rope = _rope(10000000.0, partial_rotary_factor=0.25, mrope_interleaved=True,
                     mrope_section=sp.extra["mrope_section"])
        return tf.Qwen3_5TextConfig(**common, max_position_embeddings=262144, rms_norm_eps=1e-6,
                                    linear_conv_kernel_dim=4, full_attention_interval=4,
                                    rope_parameters=rope, **lin)
    if sp.family == "olmo2":
        return tf.Olmo2Config(**common, max_position_embeddings=4096, rms_norm_eps=1e-6,
                              rope_parameters=_rope(500000.0))
    # phi3
    rot = sp.extra.get("partial_rotary_factor", 1.0)
    partial = {"partial_rotary_factor": rot} if rot != 1.0 else {}
    if sp.extra.get("longrope"):
        n = int(hd * rot) // 2  # a factor per rotated pair
        g = np.random.default_rng(7)
        rope = _rope(10000.0, rope_type="longrope",
                     short_factor=[round(float(x), 4) for x in 1.0 + 0.5 * g.random(n)],
                     long_factor=[round(float(x), 4) for x in 1.0 + 3.0 * g.random(n)],
                     original_max_position_embeddings=32, **partial)
        return tf.Phi3Config(**common, max_position_embeddings=128, rms_norm_eps=1e-5,
                             original_max_position_embeddings=32,
                             sliding_window=sp.extra.get("sliding_window", 2047),
                             rope_parameters=rope)
    rope = _rope(10000.0, **partial)
    return tf.Phi3Config(**common, max_position_embeddings=4096, rms_norm_eps=1e-5,
                         original_max_position_embeddings=4096, sliding_window=2047,
                         rope_parameters=rope)


def _model_class(sp: Spec):
    import transformers as tf

    return {"llama": tf.LlamaForCausalLM, "mistral": tf.MistralForCausalLM,
            "qwen2": tf.Qwen2ForCausalLM, "qwen3": tf.Qwen3ForCausalLM,
            "qwen3moe": tf.Qwen3MoeForCausalLM, "mixtral": tf.MixtralForCausalLM,
            "qwen2moe": tf.Qwen2MoeForCausalLM,
            "gemma2": tf.Gemma2ForCausalLM, "gemma3": tf.Gemma3ForCausalLM,
            "gemma4": tf.Gemma4ForCausalLM,
            "phi3": tf.Phi3ForCausalLM, "smollm3": tf.SmolLM3ForCausalLM,
            "granite": tf.GraniteForCausalLM, "olmo2": tf.Olmo2ForCausalLM,
            "ministral3": tf.Ministral3ForCausalLM,
            "qwen35": tf.Qwen3_5ForCausalLM}[sp.family]


# ---- tokenizers -------------------------------------------------------------------------
def _vocab_gguf(tree: Path, name: str) -> dict:
    from toymlx.gguf.reader import read_metadata

    return read_metadata(tree / "models" / f"ggml-vocab-{name}.gguf")


def _pb_varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # negative int32 as protobuf writes it: ten bytes of two's complement
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _pb_field(num: int, value) -> bytes:
    if isinstance(value, (bool, int)):
        return _pb_varint(num << 3) + _pb_varint(int(value))
    if isinstance(value, float):
        return _pb_varint(num << 3 | 5) + struct.pack("<f", value)
    data = value.encode() if isinstance(value, str) else value
    return _pb_varint(num << 3 | 2) + _pb_varint(len(data)) + data


def spm_model_bytes(pieces: list[tuple[str, float, int]], *, add_dummy_prefix: bool,
                    unk: int, bos: int, eos: int, pad: int) -> bytes:
    """A SentencePiece BPE `ModelProto` (byte fallback) for `pieces` (text, score, type).

    Types are SentencePiece's (and GGUF's): 1 normal, 2 unknown, 3 control, 4 user-defined,
    5 unused, 6 byte. Written field by field (sentencepiece_model.proto), no protobuf needed.
    SentencePiece finds bos/eos/pad by their text (trainer_spec.*_piece): both are written.
    """
    out = bytearray()
    for text, score, ttype in pieces:
        out += _pb_field(1, _pb_field(1, text) + _pb_field(2, float(score)) + _pb_field(3, ttype))
    trainer = (_pb_field(3, 2) + _pb_field(4, len(pieces)) + _pb_field(35, True)
               + _pb_field(40, unk) + _pb_field(41, bos) + _pb_field(42, eos) + _pb_field(43, pad))
    for num, i in ((45, unk), (46, bos), (47, eos), (48, pad)):
        if i >= 0:
            trainer += _pb_field(num, pieces[i][0])
    out += _pb_field(2, trainer)
    normalizer = (_pb_field(1, "identity") + _pb_field(3, add_dummy_prefix) + _pb_field(4, False)
                  + _pb_field(5, True))
    out += _pb_field(3, normalizer)
    return bytes(out)


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


def _spm_tokenizer(tree: Path, which: str, out: Path) -> dict:
    """tokenizer.model (+ tokenizer_config.json) of VOCAB tokens; returns the special ids."""
    meta = _vocab_gguf(tree, "phi-3" if which == "spm-phi3" else "llama-spm")
    toks, scores = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.scores"]
    types = meta["tokenizer.ggml.token_type"]
    added: dict[int, str] = {}
    if which == "spm-gemma":
        head = [("<pad>", 0.0, 3), ("<eos>", 0.0, 3), ("<bos>", 0.0, 3), ("<unk>", 0.0, 2),
                ("<mask>", 0.0, 4), ("<start_of_turn>", 0.0, 3), ("<end_of_turn>", 0.0, 3)]
        rest = [(t, s, ty) for t, s, ty in zip(toks, scores, types, strict=True)
                if ty in (1, 6)]  # llama's byte tokens and normal pieces, in order
        pieces = head + rest[:VOCAB - len(head)]
        ids = {"pad": 0, "eos": 1, "bos": 2, "unk": 3}
        cfg = {"tokenizer_class": "GemmaTokenizer", "bos_token": "<bos>", "eos_token": "<eos>",
               "pad_token": "<pad>", "unk_token": "<unk>", "add_bos_token": True,
               "add_eos_token": False}
        model = spm_model_bytes(pieces, add_dummy_prefix=False, unk=3, bos=2, eos=1, pad=0)
    else:
        n_added = 0
        if which == "spm-phi3":
            # Phi-3: tokenizer.model holds llama's 32000 pieces; its specials are added tokens
            specials = ["<|endoftext|>", "<|assistant|>", "<|system|>", "<|end|>", "<|user|>"]
            n_added = len(specials)
            added = {VOCAB - n_added + i: s for i, s in enumerate(specials)}
        n = VOCAB - n_added
        pieces = list(zip(toks[:n], scores[:n], types[:n], strict=True))
        ids = {"unk": 0, "bos": 1, "eos": 2}
        cfg = {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>",
               "unk_token": "<unk>", "add_bos_token": True, "add_eos_token": False,
               "legacy": False}
        if added:
            ids["eos"] = next(i for i, s in added.items() if s == "<|endoftext|>")
            cfg["eos_token"] = "<|endoftext|>"
            cfg["added_tokens_decoder"] = {
                str(i): {"content": s, "lstrip": False, "normalized": False, "rstrip": False,
                         "single_word": False, "special": True} for i, s in added.items()}
        model = spm_model_bytes(pieces, add_dummy_prefix=True, unk=0, bos=1, eos=2, pad=-1)
    (out / "tokenizer.model").write_bytes(model)
    cfg["model_max_length"] = 4096
    _write_json(out / "tokenizer_config.json", cfg)
    return {**ids, "first_special": min([VOCAB, *added]) if which != "spm-gemma" else VOCAB,
            "first_normal": 7 if which == "spm-gemma" else 3}


LLAMA3_PAT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+"
              r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_PAT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
             r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen3.5's: qwen2's with combining marks (\p{M}) inside letter runs
QWEN35_PAT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
              r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# GPT-4o's (Phi-4's tokenizer.json), as Hugging Face writes it
_CASED = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"
_UNCASED = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_APOS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
GPT4O_PAT = (rf"[^\r\n\p{{L}}\p{{N}}]?{_CASED}*{_UNCASED}+{_APOS}"
             rf"|[^\r\n\p{{L}}\p{{N}}]?{_CASED}+{_UNCASED}*{_APOS}"
             r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _bpe_tokenizer(tree: Path, which: str, out: Path) -> dict:
    """tokenizer.json (+ tokenizer_config.json) of VOCAB tokens; returns the special ids."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
    )

    if which == "bpe-llama3":
        meta = _vocab_gguf(tree, "llama-bpe")
        specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                    "<|end_header_id|>", "<|eot_id|>"]
        pat, pre = LLAMA3_PAT, "llama-bpe"
    elif which == "bpe-gpt4o":  # Llama 3's vocabulary under Phi-4-mini's regex and specials
        meta = _vocab_gguf(tree, "llama-bpe")
        specials = ["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
        pat, pre = GPT4O_PAT, "gpt-4o"
    elif which == "bpe-qwen35":
        meta = _vocab_gguf(tree, "qwen35")
        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        pat, pre = QWEN35_PAT, "qwen35"
    else:
        meta = _vocab_gguf(tree, "qwen2")
        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        pat, pre = QWEN2_PAT, "qwen2"
    n = VOCAB - len(specials)
    toks = meta["tokenizer.ggml.tokens"][:n]
    vocab = {t: i for i, t in enumerate(toks)}
    # byte-level BPE: all 256 byte symbols must be in the cut vocabulary
    from tokenizers.pre_tokenizers import ByteLevel
    missing = [c for c in ByteLevel.alphabet() if c not in vocab]
    if missing:
        raise RuntimeError(f"{which}: byte symbols {missing[:5]} beyond the first {n} tokens")
    merges = []
    for m in meta["tokenizer.ggml.merges"]:
        a, b = m.split(" ")
        if a in vocab and b in vocab and a + b in vocab:
            merges.append((a, b))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=which == "bpe-llama3"))
    if which in ("bpe-qwen2", "bpe-qwen35"):
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pat), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    sid = {s: n + i for i, s in enumerate(specials)}
    assert all(tok.token_to_id(s) == i for s, i in sid.items())
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
           "model_max_length": 131072,
           "added_tokens_decoder": {str(i): {"content": s, "lstrip": False, "normalized": False,
                                             "rstrip": False, "single_word": False,
                                             "special": True} for s, i in sid.items()}}
    if which == "bpe-llama3":
        bos = sid["<|begin_of_text|>"]
        tok.post_processor = processors.TemplateProcessing(
            single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
            special_tokens=[("<|begin_of_text|>", bos)])
        ids = {"bos": bos, "eos": sid["<|eot_id|>"]}
        cfg.update(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
    elif which == "bpe-gpt4o":  # the converter reads a BPE vocabulary by this class alone
        ids = {"bos": None, "eos": sid["<|end|>"], "pad": sid["<|endoftext|>"]}
        cfg.update(tokenizer_class="GPT2Tokenizer", bos_token="<|endoftext|>",
                   eos_token="<|end|>", pad_token="<|endoftext|>", add_bos_token=False)
    else:
        ids = {"bos": None, "eos": sid["<|im_end|>"], "pad": sid["<|endoftext|>"]}
        cfg.update(bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                   add_bos_token=False)
    tok.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", cfg)
    return {**ids, "pre": pre, "first_special": n, "first_normal": 0, "merges": len(merges)}


def _gemma4_tokenizer(tree: Path, out: Path) -> dict:
    """tokenizer.json (+ tokenizer_config.json) of VOCAB tokens cut from Gemma 4's: its
    specials, 256 byte-fallback tokens, printable ASCII, "▁" and newline, then the pieces its
    merges make of those in rank order; spaces normalized to "▁" (SentencePiece-style BPE, as
    llama.cpp's gemma4 tokenizer reads it). Returns the special ids."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    meta = _vocab_gguf(tree, "gemma-4")
    toks, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<|turn>", "<turn|>"]
    known = {t for t, ty in zip(toks, types, strict=True) if ty == 1}
    pieces = specials + [t for t, ty in zip(toks, types, strict=True) if ty == 6]
    pieces += [t for t in toks if len(t) == 1 and t in known
               and ((t.isascii() and t.isprintable()) or t in "▁\n")]
    have, merges = set(pieces), []
    for m in meta["tokenizer.ggml.merges"]:
        if len(pieces) >= VOCAB:
            break
        cut = m.find(" ", 1)
        a, b = m[:cut], m[cut + 1:]
        if a in have and b in have and a + b in known and a + b not in have:
            pieces.append(a + b)
            have.add(a + b)
            merges.append((a, b))
    vocab = {t: i for i, t in enumerate(pieces)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True,
                               unk_token="<unk>"))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse()])
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    tok.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>",
        "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>",
        "mask_token": "<mask>", "model_max_length": 131072})
    return {"pad": 0, "eos": 1, "bos": 2, "unk": 3, "first_special": len(pieces),
            "first_normal": len(specials), "merges": len(merges)}


# ---- the checkpoint ---------------------------------------------------------------------
def _randomize(model, seed: int, gemma: bool, unscaled_scores: bool = False) -> None:
    """Seeded weights: matrices and embeddings N(0, 0.05), biases N(0, 0.05), norm weights
    1 + N(0, 0.1) as applied (gemma2/3 store w with (1 + w) applied: N(0, 0.1) stored; gemma4
    stores w as applied), gemma4's layer scalars (buffers) 1 + N(0, 0.1). `unscaled_scores`
    (gemma4: q k^T times 1): the q and k norms' weights times head_dim^-1/4, so that the scores
    are O(1) as a trained model's are (else random heads of 128 give scores of ~10, whose
    softmax turns on the quantizer's rounding: Q4_K_M moved the tiny model's logits by 2.3)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            r = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if "norm" in name:
                p.copy_(0.1 * r if gemma else 1.0 + 0.1 * r)
                if unscaled_scores and name.endswith(("q_norm.weight", "k_norm.weight")):
                    p.mul_(p.shape[0] ** -0.25)
            else:
                p.copy_(0.05 * r)
        for name, b in sorted(model.named_buffers()):
            if name.endswith("layer_scalar"):
                b.copy_(1.0 + 0.1 * torch.randn(b.shape, generator=g, dtype=torch.float32))


def tiny_hf_checkpoint(kind: str, out_dir: str | Path, tree: str | Path | None = None,
                       seed: int = 0) -> Path:
    """Write a tiny random-weight HF checkpoint of `kind` (config.json, model.safetensors,
    tokenizer files, `toymlx_tiny.json`) into `out_dir`; `tree` is llama.cpp's source tree
    (default: tests/llamacpp_source.fetch_source()). Deterministic in (kind, seed)."""
    import torch

    if tree is None:
        from llamacpp_source import fetch_source
        tree = fetch_source()
    tree, out = Path(tree), Path(out_dir)
    sp = spec(kind)
    out.mkdir(parents=True, exist_ok=True)
    if sp.tokenizer.startswith("spm"):
        tok = _spm_tokenizer(tree, sp.tokenizer, out)
    elif sp.tokenizer == "bpe-gemma4":
        tok = _gemma4_tokenizer(tree, out)
    else:
        tok = _bpe_tokenizer(tree, sp.tokenizer, out)
    if sp.family == "ministral3":  # Ministral 3's chat template, where its tokenizer has it
        cfg = json.loads((out / "tokenizer_config.json").read_text(encoding="utf-8"))
        cfg["chat_template"] = (tree / "models" / "templates" / MINISTRAL3_TEMPLATE).read_text(
            encoding="utf-8")
        _write_json(out / "tokenizer_config.json", cfg)
    config = hf_config(sp, tok)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = _model_class(sp)(config).to(torch.float32).eval()
    _randomize(model, seed * 1000 + KINDS.index(kind),
               gemma=sp.family in ("gemma2", "gemma3"), unscaled_scores=sp.family == "gemma4")
    model.save_pretrained(out)
    _write_json(out / MANIFEST, {"kind": kind, "family": sp.family, "tokenizer": sp.tokenizer,
                                 "pre": tok.get("pre"), "seed": seed,
                                 "special_ids": {k: tok.get(k) for k in ("bos", "eos", "pad",
                                                                          "unk")},
                                 "first_normal": tok["first_normal"],
                                 "first_special": tok["first_special"], "vocab": VOCAB})
    return out


def manifest(hf_dir: str | Path) -> dict:
    return json.loads((Path(hf_dir) / MANIFEST).read_text())


def token_ids(hf_dir: str | Path, n: int = 40, seed: int = 0) -> list[int]:
    """`n` seeded ids of ordinary tokens of the checkpoint, after its BOS where it has one."""
    m = manifest(hf_dir)
    g = np.random.default_rng(seed)
    ids = g.integers(m["first_normal"], m["first_special"], size=n).tolist()
    if m["special_ids"]["bos"] is not None:
        ids[0] = m["special_ids"]["bos"]
    return ids


def hf_logits(hf_dir: str | Path, tokens: list[int]) -> np.ndarray:
    """The HF model's own float32 logits (T, V) for `tokens` (eager attention)."""
    import torch
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32,
                                                    attn_implementation="eager").eval()
    with torch.no_grad():
        out = model(torch.tensor([tokens], dtype=torch.long)).logits[0]
    return out.float().numpy()


# ---- conversion -------------------------------------------------------------------------
def gguf_from_hf(hf_dir: str | Path, out_path: str | Path, outtype: str = "f32",
                 tree: str | Path | None = None, timeout: float = 900) -> dict:
    """Convert `hf_dir` with llama.cpp's `convert_hf_to_gguf.py` (its own gguf-py first on
    the path) into `out_path`; returns {"seconds", "log"}. Raises ConversionError."""
    if tree is None:
        from llamacpp_source import fetch_source
        tree = fetch_source()
    tree, hf_dir, out_path = Path(tree), Path(hf_dir), Path(out_path)
    pre = manifest(hf_dir).get("pre") if (hf_dir / MANIFEST).is_file() else None
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tree / "gguf-py"), str(tree)]
                                        + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.pop("NO_LOCAL_GGUF", None)
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, str(SCRIPT), "convert", str(tree), str(hf_dir),
                        str(out_path), outtype, pre or ""], check=False, capture_output=True,
                       text=True, timeout=timeout, env=env)
    dt = time.perf_counter() - t0
    if r.returncode != 0 or not out_path.is_file():
        raise ConversionError(f"convert_hf_to_gguf.py on {hf_dir} failed (exit {r.returncode}): "
                              f"{(r.stderr or r.stdout).strip()[-3000:]}")
    return {"seconds": dt, "log": r.stderr}


def _child_convert(tree: str, hf_dir: str, out: str, outtype: str, pre: str) -> None:
    import runpy

    sys.path[0:0] = [str(Path(tree) / "gguf-py"), tree]  # sys.path[0]: the converter's tree
    from conversion import base  # the converter's own package, from `tree`

    if pre:
        known = base.TextModel.get_vocab_base_pre

        def declared_pre(self, tokenizer) -> str:
            """The converter's hash table first; the checkpoint's declared name if unknown."""
            try:
                return known(self, tokenizer)
            except NotImplementedError:
                base.logger.warning(f"toymlx hf_tiny shim: cut vocabulary, BPE pre-tokenizer "
                                    f"taken from {MANIFEST}: {pre!r}")
                return pre

        base.TextModel.get_vocab_base_pre = declared_pre
    converter = str(Path(tree) / "convert_hf_to_gguf.py")
    sys.argv = [converter, hf_dir, "--outfile", out, "--outtype", outtype]
    said = Path(hf_dir) / MANIFEST
    if said.is_file() and manifest(hf_dir)["family"] == "qwen35" and not json.loads(
            (Path(hf_dir) / "config.json").read_text()).get("mtp_num_hidden_layers"):
        sys.argv.append("--no-mtp")  # its converter asserts MTP weights unless told there are
        # none (transformers' model has none; tests/test_qwen35.py adds some)
    runpy.run_path(converter, run_name="__main__")


# ---- what a GGUF holds ------------------------------------------------------------------
def gguf_summary(path: str | Path) -> dict:
    """architecture, metadata (token arrays shortened to their length and first items) and
    tensors {name: [type, shape]} of a GGUF, read with toymlx's reader."""
    from toymlx.gguf.reader import GGUFFile

    with GGUFFile(path) as f:
        meta = {}
        for k, v in f.metadata.items():
            if isinstance(v, list) and len(v) > 8:
                v = f"[{len(v)} items: {', '.join(repr(x) for x in v[:3])}, ...]"
            elif isinstance(v, str) and len(v) > 200:
                v = v[:200] + "..."
            meta[k] = v
        tensors = {n: [t.type_name, list(t.shape)] for n, t in f.tensors.items()}
        return {"architecture": f.architecture, "metadata": meta, "tensors": tensors}


def tensor_layout(summary: dict) -> dict:
    """Tensor names grouped: global ones, and block 0's with 'blk.N.' (the others repeat)."""
    glob, block = {}, {}
    for n, (t, shape) in summary["tensors"].items():
        if n.startswith("blk."):
            _, rest = n[4:].split(".", 1)
            block.setdefault(f"blk.N.{rest}", set()).add((t, tuple(shape)))
        else:
            glob[n] = (t, tuple(shape))
    return {"global": glob, "block": {k: sorted(v) for k, v in sorted(block.items())}}


def llamacpp_quantize(src: str | Path, dst: str | Path, qtype: str, timeout: float = 600) -> dict:
    """Quantize GGUF `src` into `dst` as `llama-quantize src dst QTYPE` does (child process);
    returns {"seconds", "types": {tensor: type}}."""
    from llamacpp_runner import quantize

    t0 = time.perf_counter()
    quantize(src, dst, qtype, timeout=timeout)
    dt = time.perf_counter() - t0
    s = gguf_summary(dst)
    return {"seconds": dt, "types": {n: t for n, (t, _) in s["tensors"].items()}}


# ---- fixtures ---------------------------------------------------------------------------
@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory, llamacpp_source):
    """Factory: tiny_hf(kind) -> the HF checkpoint folder (made once per session)."""
    root = tmp_path_factory.mktemp("hf_tiny")
    made: dict[str, Path] = {}

    def make(kind: str) -> Path:
        if kind not in made:
            made[kind] = tiny_hf_checkpoint(kind, root / kind, tree=llamacpp_source)
        return made[kind]

    return make


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory, tiny_hf, llamacpp_source):
    """Factory: tiny_gguf(kind, outtype="f32") -> the converter's GGUF (once per session);
    tiny_gguf.seconds[(kind, outtype)] is how long the conversion took."""
    root = tmp_path_factory.mktemp("gguf_tiny")
    made: dict[tuple[str, str], Path] = {}

    def make(kind: str, outtype: str = "f32") -> Path:
        key = (kind, outtype)
        if key not in made:
            out = root / f"{kind}-{outtype}.gguf"
            try:
                info = gguf_from_hf(tiny_hf(kind), out, outtype, tree=llamacpp_source)
            except ConversionError as e:
                pytest.fail(str(e))
            make.seconds[key] = info["seconds"]
            made[key] = out
        return made[key]

    make.seconds = {}
    return make


if __name__ == "__main__":
    if len(sys.argv) == 7 and sys.argv[1] == "convert":
        _child_convert(*sys.argv[2:])
    else:
        sys.exit(f"usage: {sys.argv[0]} convert TREE HF_DIR OUT.gguf OUTTYPE PRE")
