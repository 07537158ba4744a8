"""Small random GGUFs of every decoder architecture toymlx loads, written the way llama.cpp's
converter lays them out (tensor names, metadata keys, norms as stored), for tests that need
no converter: `arch_gguf(kind, path)`.

Kinds exercise every switch of the decoder: `llama3` (a rope_freqs tensor), `llama-bias`
(attention biases, which llama files may carry), `qwen2` (q/k/v biases, NEOX RoPE), `qwen3`
(q/k norms, a head wider than d_model / n_heads), `gemma2` (sandwich norms, GeGLU, a sliding
window on every other block, embedding scale, soft-capped attention scores and logits, caps
small enough to bind), `gemma3` (sandwich norms, GeGLU, sliding
window layers with their own RoPE base, linear scaling on the global layers, embedding scale,
soft-capped logits), `phi3` (fused qkv and gate_up, partial RoPE, longrope factors with an
attention factor), `smollm3` (no RoPE on every 4th block), `granite` (embedding, residual,
attention and logit scalars), `olmo2` (norms after attention and MLP only, q/k norms over the
whole projection), `qwen3-yarn` (qwen3 with YaRN: factor 4 over an original context of 8, its
ramp over frequencies 0-3 of 8 and magnitude binding in 20 tokens), `mistral3` (Ministral 3:
llama's layout, RoPE base 100 and YaRN factor 16 over 8 tokens with beta_fast 4, beta_slow
0.25 (the ramp over frequencies 0-3 of 8; llama.cpp's default betas give 0-1) and log
multiplier 0.5, and the attention temperature 0.1 on queries from position 8 on). The
tokenizer is toymlx's byte vocabulary (259 tokens).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from toymlx.data.vocab import byte_metadata
from toymlx.gguf.reader import FLOAT32, UINT32
from toymlx.gguf.writer import write_gguf

KINDS = ("llama", "llama3", "llama-bias", "qwen2", "qwen3", "gemma2", "gemma3", "phi3",
         "smollm3", "granite", "olmo2", "qwen3-yarn", "mistral3")
VOCAB = 259


def _spec(kind: str) -> dict:
    s = {"arch": kind.split("-")[0].replace("llama3", "llama"), "d": 64, "heads": 4, "kv": 2,
         "hd": 16, "ffn": 96, "layers": 2, "tied": True}
    if kind in ("qwen3", "qwen3-yarn"):
        s.update(hd=32)
    if kind == "gemma3":
        s.update(layers=6)
    if kind == "gemma2":
        s.update(layers=4, hd=32)
    if kind == "smollm3":
        s.update(layers=4)  # block 3 has no RoPE
    if kind in ("phi3", "llama", "olmo2", "mistral3"):
        s.update(tied=False)
    return s


def arch_gguf(kind: str, path: str | Path, seed: int = 0) -> Path:
    """A random-weight GGUF of `kind` (see KINDS) at `path`."""
    if kind not in KINDS:
        raise ValueError(f"kind: expected one of {KINDS}, found {kind!r}")
    s = _spec(kind)
    rng = np.random.default_rng(seed)
    arch, d, H, Hkv, hd, F = s["arch"], s["d"], s["heads"], s["kv"], s["hd"], s["ffn"]

    def mat(out, inp, std=0.08):
        return (rng.standard_normal((out, inp)) * std).astype(np.float32)

    def norm(n):  # stored as llama.cpp reads it (gemma's 1 + w already added by the converter)
        return (1.0 + 0.2 * rng.standard_normal(n)).astype(np.float32)

    def vec(n):
        return (0.1 * rng.standard_normal(n)).astype(np.float32)

    t = {"token_embd.weight": mat(VOCAB, d, 0.5), "output_norm.weight": norm(d)}
    if not s["tied"]:
        t["output.weight"] = mat(VOCAB, d)
    for i in range(s["layers"]):
        p = f"blk.{i}."
        if arch != "olmo2":
            t[p + "attn_norm.weight"] = norm(d)
        if arch == "phi3":
            t[p + "attn_qkv.weight"] = mat(H * hd + 2 * Hkv * hd, d)
        else:
            t[p + "attn_q.weight"] = mat(H * hd, d)
            t[p + "attn_k.weight"] = mat(Hkv * hd, d)
            t[p + "attn_v.weight"] = mat(Hkv * hd, d)
        if kind in ("qwen2", "llama-bias"):
            t[p + "attn_q.bias"], t[p + "attn_k.bias"] = vec(H * hd), vec(Hkv * hd)
            t[p + "attn_v.bias"] = vec(Hkv * hd)
        if kind == "llama-bias":
            t[p + "attn_output.bias"] = vec(d)
        t[p + "attn_output.weight"] = mat(d, H * hd)
        if arch in ("qwen3", "gemma3"):
            t[p + "attn_q_norm.weight"], t[p + "attn_k_norm.weight"] = norm(hd), norm(hd)
        if arch == "olmo2":  # over the whole projection
            t[p + "attn_q_norm.weight"], t[p + "attn_k_norm.weight"] = norm(H * hd), norm(Hkv * hd)
        if arch in ("gemma2", "gemma3", "olmo2"):
            t[p + "post_attention_norm.weight"] = norm(d)
        if arch != "olmo2":
            t[p + "ffn_norm.weight"] = norm(d)
        if arch == "phi3":
            t[p + "ffn_up.weight"] = mat(2 * F, d)
        else:
            t[p + "ffn_gate.weight"], t[p + "ffn_up.weight"] = mat(F, d), mat(F, d)
        t[p + "ffn_down.weight"] = mat(d, F)
        if arch in ("gemma2", "gemma3", "olmo2"):
            t[p + "post_ffw_norm.weight"] = norm(d)

    k = arch + "."
    meta = {"general.architecture": arch, "general.name": "toymlx test file",  # llama.cpp keys on "phi3" in names
            "general.file_type": 0,
            k + "context_length": 256, k + "embedding_length": d, k + "block_count": s["layers"],
            k + "feed_forward_length": F, k + "attention.head_count": H,
            k + "attention.head_count_kv": Hkv,
            k + "attention.layer_norm_rms_epsilon": 1e-6, k + "rope.freq_base": 10000.0}
    types = {"general.file_type": (UINT32, None)}
    floats = [k + "attention.layer_norm_rms_epsilon", k + "rope.freq_base"]
    if hd != d // H:
        meta[k + "attention.key_length"] = meta[k + "attention.value_length"] = hd
    if kind == "llama3":
        t["rope_freqs.weight"] = np.array([1.0, 1.0, 1.5, 2.6, 4.0, 8.0, 8.0, 8.0], np.float32)
        meta[k + "rope.freq_base"] = 500000.0
    if arch == "gemma3":
        meta.update({k + "attention.sliding_window": 4, k + "rope.freq_base": 1000000.0,
                     k + "rope.scaling.type": "linear", k + "rope.scaling.factor": 8.0,
                     k + "final_logit_softcapping": 30.0})
        floats += [k + "rope.scaling.factor", k + "final_logit_softcapping"]
    if arch == "gemma2":  # as llama.cpp's converter writes it, but caps that bind here
        meta.update({k + "attention.sliding_window": 4, k + "rope.freq_base": 20000.0,
                     k + "attn_logit_softcapping": 1.0, k + "final_logit_softcapping": 8.0,
                     k + "attention.key_length": hd, k + "attention.value_length": hd})
        floats += [k + "attn_logit_softcapping", k + "final_logit_softcapping"]
    if arch == "phi3":
        n_rot = 12  # partial rotary: 12 of 16 dims
        meta.update({k + "rope.dimension_count": n_rot, k + "rope.scaling.type": "longrope",
                     k + "rope.scaling.attn_factor": 1.19,
                     k + "rope.scaling.original_context_length": 4096})
        floats.append(k + "rope.scaling.attn_factor")
        t["rope_factors_short.weight"] = np.linspace(1.0, 3.0, n_rot // 2).astype(np.float32)
        t["rope_factors_long.weight"] = np.linspace(1.0, 30.0, n_rot // 2).astype(np.float32)
    if arch == "granite":  # each far from 1 (granite-3.3-2b's embeddings x 12 would drown the
        # blocks in this file's 0.5-std table: an adapter would move the logits less than Q4_K)
        granite = {"embedding_scale": 2.0, "residual_scale": 0.45, "attention.scale": 0.05,
                   "logit_scale": 2.5}
        meta.update({k + key: v for key, v in granite.items()})
        floats += [k + key for key in granite]
    if kind == "qwen3-yarn":  # as the converter writes Qwen3-128K's
        meta.update({k + "rope.scaling.type": "yarn", k + "rope.scaling.factor": 4.0,
                     k + "rope.scaling.original_context_length": 8})
        floats.append(k + "rope.scaling.factor")
        types[k + "rope.scaling.original_context_length"] = (UINT32, None)
    if arch == "mistral3":  # as the converter writes Ministral 3's, on a small scale
        yarn = {"rope.scaling.factor": 16.0, "rope.scaling.yarn_beta_fast": 4.0,
                "rope.scaling.yarn_beta_slow": 0.25, "rope.scaling.yarn_log_multiplier": 0.5,
                "attention.temperature_scale": 0.1, "rope.freq_base": 100.0}
        meta.update({k + "rope.scaling.type": "yarn",
                     k + "rope.scaling.original_context_length": 8,
                     **{k + key: v for key, v in yarn.items()}})
        floats += [k + key for key in yarn]
        types[k + "rope.scaling.original_context_length"] = (UINT32, None)
    for key in floats:
        types[key] = (FLOAT32, None)
    meta.update(byte_metadata())
    return write_gguf(path, meta, t, types=types)


def gemma4_args():
    """tests/hf_tiny.py's `gemma4` kind's shape (`gemma4_gguf`), the byte vocabulary."""
    from toymlx.models.llama import LlamaArgs

    big = float(np.float32(1e30))  # a proportional factor: the pair does not turn
    return LlamaArgs(vocab_size=VOCAB, d_model=64, n_layers=6, n_heads=4, n_kv_heads=1,
                     ffn_dim=128, context=256, rope_base=1e6, norm_eps=1e-6, key_length=32,
                     arch="gemma4", rope_neox=True, rope_factors=(1.0,) * 4 + (big,) * 12,
                     qk_norm=True, post_norms=True, embed_scale=True, activation="gelu_tanh",
                     attn_scale=1.0, sliding_window=8, sliding_layers=(True, False) * 3,
                     final_softcap=30.0, key_length_sliding=16,
                     ffn_dims_per_block=(128,) * 4 + (256,) * 2, v_norm=True,
                     shared_kv_layers=2, per_layer_dim=8, layer_scales=True)


def gemma4_gguf(path: str | Path, seed: int = 0) -> Path:
    """A random-weight dense Gemma 4 GGUF at `path` with no converter (tests/hf_tiny.py's
    `gemma4` kind's shape: sliding blocks of head width 16 every other one from the first, full
    ones of 32 with proportional RoPE factors, a shared-KV tail of 2 without k/v and with
    double-wide MLPs, per-layer embeddings of width 8, layer scalars, logits capped at 30),
    written by toymlx's `write_llama`, which llama.cpp reads as the converter's files
    (test_gemma4.py); the byte vocabulary, MLX's initial weights."""
    import mlx.core as mx

    from toymlx.gguf.llama import write_llama
    from toymlx.models.llama import Llama

    mx.random.seed(seed)
    model = Llama(gemma4_args())
    write_llama(path, model, byte_metadata())
    return Path(path)


def qwen35_args():
    """A qwen35 shape: 3 Gated DeltaNet blocks and a gated full-attention one, 2 k heads serving
    4 value heads, a quarter of each attention head rotated."""
    from dataclasses import replace

    from toymlx.gguf.llama import ARCHS
    from toymlx.models.llama import LlamaArgs

    return replace(LlamaArgs(), arch="qwen35", **ARCHS["qwen35"].switches, vocab_size=300,
                   d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=128, context=256,
                   key_length=32, rope_dims=8, linear_layers=(True, True, True, False),
                   ssm_conv_kernel=4, ssm_head_dim=16, ssm_k_heads=2, ssm_v_heads=4)


MOE_KINDS = ("qwen3moe", "mixtral", "qwen2moe")


def moe_args(kind: str):
    """A 2-block mixture of experts of 8 experts, 2 used per token, as tests/hf_tiny.py's kinds
    of the same names lay them out: qwen3moe (q/k norms, head width 32, experts ffn / 2 wide),
    mixtral (a llama file with experts ffn wide, untied) and qwen2moe (q/k/v biases, experts
    ffn / 2 wide, weights not renormalized, a shared expert ffn wide, untied)."""
    from toymlx.gguf.llama import ARCHS
    from toymlx.models.llama import LlamaArgs

    shape = {"vocab_size": VOCAB, "d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
             "ffn_dim": 96, "context": 256, "n_experts": 8, "n_experts_used": 2}
    if kind == "qwen3moe":
        return LlamaArgs(arch=kind, **ARCHS[kind].switches, key_length=32, expert_ffn_dim=48,
                         **shape)
    if kind == "qwen2moe":
        return LlamaArgs(arch=kind, **ARCHS[kind].switches, expert_ffn_dim=48,
                         shared_expert_ffn_dim=96, tie_embeddings=False, **shape)
    if kind == "mixtral":
        return LlamaArgs(arch="llama", expert_ffn_dim=96, tie_embeddings=False, **shape)
    raise ValueError(f"kind: expected one of {MOE_KINDS}, found {kind!r}")


DRAWN_KINDS = ("gemma4", "qwen35", *MOE_KINDS)
"""The architectures `drawn_gguf` writes (those `arch_gguf` does not)."""


def drawn_gguf(kind: str, path: str | Path, seed: int = 0) -> Path:
    """A GGUF of `kind` (DRAWN_KINDS: `gemma4_args`, `qwen35_args`, `moe_args`) written by
    toymlx's `write_llama`, its weights drawn as `arch_gguf` draws them: matrices N(0, 0.08),
    token tables N(0, 0.5), norms and layer scalars 1 + 0.2 N, biases 0.1 N; qwen35's decays
    -U(0.1, 2) and dt biases 0.2 N; routers N(0, 1); gemma4's q and k norm weights a quarter
    of that: its scores are unscaled (attn_scale 1), and at full size they saturated the
    softmax, a model in which rounding the weights alone to bfloat16 moved the logits by 9%
    (1% quartered): too sensitive for the bfloat16 checks (test_gpu_route.py)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    from toymlx.gguf.llama import write_llama
    from toymlx.models.llama import Llama

    if kind not in DRAWN_KINDS:
        raise ValueError(f"kind: expected one of {DRAWN_KINDS}, found {kind!r}")
    a = {"gemma4": gemma4_args, "qwen35": qwen35_args}.get(kind, lambda: moe_args(kind))()
    model = Llama(a)
    rng = np.random.default_rng(seed)

    def drawn(name: str, w: mx.array) -> mx.array:
        z = rng.standard_normal(w.shape).astype(np.float32)
        if name.endswith(".ssm_a"):
            return mx.array(-rng.uniform(0.1, 2.0, w.shape).astype(np.float32))
        if name.endswith(("q_norm.weight", "k_norm.weight")) and kind == "gemma4":
            return mx.array(0.25 * (1.0 + 0.2 * z))
        if name.endswith(("norm.weight", "out_scale.weight")):
            return mx.array(1.0 + 0.2 * z)
        scale = (0.2 if name.endswith(".dt_bias") else 0.1 if name.endswith(".bias")
                 else 0.5 if name.endswith("embed.weight") else 1.0
                 if name.endswith("router.weight") else 0.08)
        return mx.array(scale * z)

    model.update(tree_unflatten([(k, drawn(k, v)) for k, v in tree_flatten(model.parameters())]))
    write_llama(path, model, byte_metadata())
    return Path(path)
