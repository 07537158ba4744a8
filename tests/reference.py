"""An independent float64 numpy forward of llama.cpp's decoders, reading GGUF with gguf-py (not
toymlx).

Written from llama.cpp's graph code (src/models/{llama,qwen2,qwen3,gemma2,gemma3,phi3,smollm3,
granite,olmo2}.cpp) and its RoPE (`ggml_rope_ext`): (out, in) weights; RMSNorm; RoPE on
adjacent pairs for arch llama and on halves (NEOX) for the others, angle
pos * freq_scale * base^(-2i/n_rot) / factor_i, cos and sin times attn_factor; GQA head h ->
kv head h // (n_head // n_kv); gated FFN (SiLU, or GELU's tanh form for gemma2 and gemma3;
phi3's ffn_up holds gate then up); gemma2's attention scores soft-capped before the mask; tied
output when output.weight is absent; smollm3 rotates no block il with (il + 1) % 4 == 0;
YaRN (rope.scaling.type yarn) mixes interpolated and extrapolated angles over ggml's ramp
(`yarn_angles_and_magnitude`, ggml's `rope_yarn` and llama_context's set-up in float64);
mistral3 multiplies its rotated queries by 1 + temperature_scale * ln(floor(pos / n_orig) + 1);
granite multiplies the embeddings by embedding_scale and each residual branch by
residual_scale, scales q k^T by attention.scale and divides the logits by logit_scale; olmo2
has no attn_norm/ffn_norm (its branches read the residual stream as it is) and norms q and k
over the whole projection. Each switch is read from the file the way llama.cpp reads it, with
its defaults where a key is absent.
"""

from __future__ import annotations

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

NEOX = {"qwen2", "qwen3", "gemma2", "gemma3", "phi3", "olmo2"}
GEMMA = {"gemma2", "gemma3"}
# llama.cpp's gemma2 where its file is silent (src/models/gemma2.cpp, llama-hparams.h): a 4096
# window on every other block, scores capped at 50, logits at 30, sliding RoPE base = global
GEMMA2_DEFAULTS = {"window": 4096, "pattern": 2, "attn_softcap": 50.0, "softcap": 30.0}


def _field(r: GGUFReader, key: str, default=None):
    f = r.fields.get(key)
    if f is None:
        return default
    if f.types[0].name == "ARRAY":
        return [f.parts[i].item() for i in f.data]
    v = f.parts[f.data[0]]
    return v.tobytes().decode() if f.types[0].name == "STRING" else v.item()


def load_reference(path) -> tuple[dict, dict[str, np.ndarray]]:
    r = GGUFReader(str(path))
    arch = _field(r, "general.architecture")
    k = arch + "."
    g2 = GEMMA2_DEFAULTS if arch == "gemma2" else {}
    base = _field(r, k + "rope.freq_base", 10000.0)
    hp = {
        "arch": arch,
        "d": _field(r, k + "embedding_length"),
        "n_layers": _field(r, k + "block_count"),
        "n_heads": _field(r, k + "attention.head_count"),
        "eps": _field(r, k + "attention.layer_norm_rms_epsilon"),
        "base": base,
        "base_swa": _field(r, k + "rope.freq_base_swa", base if g2 else 10000.0),
        "window": (_field(r, k + "attention.sliding_window", g2.get("window", 0))
                   if arch in GEMMA else 0),
        "pattern": _field(r, k + "attention.sliding_window_pattern", g2.get("pattern", 6)),
        "softcap": _field(r, k + "final_logit_softcapping", g2.get("softcap", 0.0)),
        "attn_softcap": _field(r, k + "attn_logit_softcapping", g2.get("attn_softcap", 0.0)),
        "scaling": _field(r, k + "rope.scaling.type", "linear"),
        "factor": _field(r, k + "rope.scaling.factor", 0.0),
        "attn_factor": _field(r, k + "rope.scaling.attn_factor", 1.0),
        "embedding_scale": _field(r, k + "embedding_scale", 0.0),
        "residual_scale": _field(r, k + "residual_scale", 0.0),
        "attention_scale": _field(r, k + "attention.scale", 0.0),
        "logit_scale": _field(r, k + "logit_scale", 1.0),
        "n_orig": _field(r, k + "rope.scaling.original_context_length",
                         _field(r, k + "context_length")),
        "beta_fast": _field(r, k + "rope.scaling.yarn_beta_fast", 32.0),
        "beta_slow": _field(r, k + "rope.scaling.yarn_beta_slow", 1.0),
        "log_mul": _field(r, k + "rope.scaling.yarn_log_multiplier", 0.0),
        "temperature": _field(r, k + "attention.temperature_scale", 0.0),
    }
    hp["n_kv"] = _field(r, k + "attention.head_count_kv", hp["n_heads"])
    hp["hd"] = _field(r, k + "attention.key_length", hp["d"] // hp["n_heads"])
    hp["n_rot"] = _field(r, k + "rope.dimension_count", hp["hd"])
    w = {}
    for t in r.tensors:
        shape = tuple(int(x) for x in reversed(t.shape))  # ne -> numpy (out, in)
        w[t.name] = np.asarray(dequantize(t.data, t.tensor_type), np.float64).reshape(shape)
    return hp, w


def _rms(x, g, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * g


def yarn_angles_and_magnitude(pos, n_rot, base, freq_scale, n_orig, beta_fast, beta_slow,
                              log_mul=0.0, attn_factor=1.0):
    """YaRN's angles (T, n_rot/2) and the magnitude of cos and sin, float64, transcribed from
    llama.cpp: `ggml_rope_yarn_corr_dims` (ggml.c), `rope_yarn` and `rope_yarn_ramp`
    (ggml-cpu/ops.cpp, ext_factor 1) and llama_context's yarn_attn_factor (get_mscale, the
    log multiplier's ratio, the cancellation of rope_yarn's own 1 + 0.1 ln(1/freq_scale), then
    times rope.scaling.attn_factor)."""
    def corr_dim(n_rotations):
        return n_rot * np.log(n_orig / (n_rotations * 2 * np.pi)) / (2 * np.log(base))

    low = max(0.0, np.floor(corr_dim(beta_fast)))
    high = min(n_rot - 1.0, np.ceil(corr_dim(beta_slow)))
    theta_scale = base ** (-2.0 / n_rot)
    factor = 1.0 / freq_scale

    def get_mscale(scale, mscale):
        return 1.0 if scale <= 1.0 else 0.1 * mscale * np.log(scale) + 1.0

    if log_mul:
        attn = get_mscale(factor, 1.0) / get_mscale(factor, log_mul)
    else:
        attn = get_mscale(factor, 1.0)
    attn *= 1.0 / (1.0 + 0.1 * np.log(factor))
    attn *= attn_factor
    ang = np.empty((len(pos), n_rot // 2))
    for j, p in enumerate(pos):
        theta = p  # theta_base = pos, times theta_scale per pair, as ggml_rope_cache_init
        for i0 in range(0, n_rot, 2):
            interp = freq_scale * theta
            y = (i0 // 2 - low) / max(0.001, high - low)
            mix = 1 - min(1.0, max(0.0, y))
            ang[j, i0 // 2] = interp * (1 - mix) + theta * mix
            theta *= theta_scale
    return ang, attn * (1.0 + 0.1 * np.log(1.0 / freq_scale))


def _rope(x, pos, n_rot, base, scale, factors, mscale, neox, yarn=None):
    """x (T, heads, hd): the first n_rot dims of each head rotated; `yarn`: (angles,
    magnitude) from `yarn_angles_and_magnitude` in place of linear scaling's."""
    inv = base ** (-np.arange(0, n_rot, 2, dtype=np.float64) / n_rot)  # (n_rot/2,)
    if factors is not None:
        inv = inv / factors
    ang = pos[:, None] * scale * inv[None, :]  # (T, n_rot/2)
    if yarn is not None:
        ang, mscale = yarn
    cos, sin = (np.cos(ang) * mscale)[:, None], (np.sin(ang) * mscale)[:, None]
    out = x.copy()
    if neox:
        a, b = x[..., : n_rot // 2], x[..., n_rot // 2: n_rot]
        out[..., : n_rot // 2] = a * cos - b * sin
        out[..., n_rot // 2: n_rot] = a * sin + b * cos
    else:
        a, b = x[..., 0:n_rot:2], x[..., 1:n_rot:2]
        out[..., 0:n_rot:2] = a * cos - b * sin
        out[..., 1:n_rot:2] = a * sin + b * cos
    return out


def _gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


def _gelu_fp16_table(x):
    """GELU as llama.cpp's CPU backend computes it (ggml-cpu/vec.h, GGML_GELU_FP16): the input
    rounded to float16, looked up in a float16 table of GELU; 0 below -10, x above 10."""
    y = _gelu_tanh(x.astype(np.float16).astype(np.float64)).astype(np.float16).astype(np.float64)
    return np.where(x <= -10, 0.0, np.where(x >= 10, x, y))


def forward(hp: dict, w: dict[str, np.ndarray], tokens: list[int],
            gelu_fp16: bool = False) -> np.ndarray:
    """Logits (T, vocab) in float64; `gelu_fp16`: GELU through llama.cpp's float16 table."""
    arch, d, H, Hkv, hd, eps = hp["arch"], hp["d"], hp["n_heads"], hp["n_kv"], hp["hd"], hp["eps"]
    T = len(tokens)
    pos = np.arange(T, dtype=np.float64)
    neox = arch in NEOX
    if hp["scaling"] == "longrope":
        factors, mscale = w["rope_factors_short.weight"], hp["attn_factor"]
    else:
        factors, mscale = w.get("rope_freqs.weight"), 1.0
    scale = 1.0 / hp["factor"] if hp["scaling"] == "linear" and hp["factor"] else 1.0
    yarn = None
    if hp["scaling"] == "yarn":  # this reference's files carry no rope_freqs with YaRN
        yarn = yarn_angles_and_magnitude(pos, hp["n_rot"], hp["base"],
                                         1.0 / hp["factor"] if hp["factor"] else 1.0,
                                         hp["n_orig"], hp["beta_fast"], hp["beta_slow"],
                                         hp["log_mul"], hp["attn_factor"])
    temperature = np.ones(T)
    if hp["temperature"]:  # llm_graph_input_attn_temp, mistral3's offset 0
        temperature = np.log(np.floor(pos / hp["n_orig"]) + 1.0) * hp["temperature"] + 1.0
    pattern = hp["pattern"]
    n_layers = hp["n_layers"]
    if isinstance(pattern, list):
        swa = [bool(p) for p in pattern]
    else:
        swa = [pattern == 0 or i % pattern < pattern - 1 for i in range(n_layers)]
    swa = [s and hp["window"] > 0 for s in swa]
    q_scale = 1 / np.sqrt(hd)
    if (arch, n_layers) in (("gemma2", 46), ("gemma3", 62)):  # the 27B shapes
        q_scale = 1 / np.sqrt(d / H)
    cap = hp["attn_softcap"]
    if hp["attention_scale"]:
        q_scale = hp["attention_scale"]
    resid = hp["residual_scale"] or 1.0

    x = w["token_embd.weight"][tokens]  # (T, d)
    if arch in GEMMA:
        x = x * np.sqrt(d)
    if hp["embedding_scale"]:
        x = x * hp["embedding_scale"]
    dist = pos[:, None] - pos[None, :]  # query - key
    for i in range(n_layers):
        p = f"blk.{i}."
        h = _rms(x, w[p + "attn_norm.weight"], eps) if p + "attn_norm.weight" in w else x
        if p + "attn_qkv.weight" in w:
            qkv = h @ w[p + "attn_qkv.weight"].T
            q, kk, v = np.split(qkv, [H * hd, H * hd + Hkv * hd], axis=-1)
        else:
            q, kk, v = (h @ w[p + f"attn_{n}.weight"].T + w.get(p + f"attn_{n}.bias", 0.0)
                        for n in "qkv")
        if arch == "olmo2":  # over the whole projection
            q = _rms(q, w[p + "attn_q_norm.weight"], eps)
            kk = _rms(kk, w[p + "attn_k_norm.weight"], eps)
        q, kk, v = q.reshape(T, H, hd), kk.reshape(T, Hkv, hd), v.reshape(T, Hkv, hd)
        if p + "attn_q_norm.weight" in w and arch != "olmo2":  # per head
            q = _rms(q, w[p + "attn_q_norm.weight"], eps)
            kk = _rms(kk, w[p + "attn_k_norm.weight"], eps)
        if arch == "smollm3" and (i + 1) % 4 == 0:
            pass  # no RoPE in this block
        elif swa[i]:  # Gemma's sliding layers: their own base; gemma3's without scaling
            s_swa = scale if arch == "gemma2" else 1.0
            q = _rope(q, pos, hp["n_rot"], hp["base_swa"], s_swa, None, 1.0, neox)
            kk = _rope(kk, pos, hp["n_rot"], hp["base_swa"], s_swa, None, 1.0, neox)
        else:
            q = _rope(q, pos, hp["n_rot"], hp["base"], scale, factors, mscale, neox, yarn)
            kk = _rope(kk, pos, hp["n_rot"], hp["base"], scale, factors, mscale, neox, yarn)
            q = q * temperature[:, None, None]
        keep = dist >= 0
        if swa[i]:
            keep &= dist < hp["window"]
        mask = np.where(keep, 0.0, -np.inf)
        out = np.empty((T, H, hd))
        for hh in range(H):
            kv = hh // (H // Hkv)
            s = q[:, hh] @ kk[:, kv].T * q_scale
            if cap:  # gemma2: before the mask
                s = cap * np.tanh(s / cap)
            s = s + mask
            s = np.exp(s - s.max(-1, keepdims=True))
            out[:, hh] = (s / s.sum(-1, keepdims=True)) @ v[:, kv]
        a = out.reshape(T, H * hd) @ w[p + "attn_output.weight"].T + w.get(p + "attn_output.bias",
                                                                            0.0)
        if p + "post_attention_norm.weight" in w:
            a = _rms(a, w[p + "post_attention_norm.weight"], eps)
        x = x + a * resid
        h = _rms(x, w[p + "ffn_norm.weight"], eps) if p + "ffn_norm.weight" in w else x
        if p + "ffn_gate.weight" in w:
            g, u = h @ w[p + "ffn_gate.weight"].T, h @ w[p + "ffn_up.weight"].T
        else:  # phi3: gate and up in one tensor, gate first
            g, u = np.split(h @ w[p + "ffn_up.weight"].T, 2, axis=-1)
        gelu = _gelu_fp16_table if gelu_fp16 else _gelu_tanh
        act = gelu(g) if arch in GEMMA else g / (1 + np.exp(-g))
        f = (act * u) @ w[p + "ffn_down.weight"].T
        if p + "post_ffw_norm.weight" in w:
            f = _rms(f, w[p + "post_ffw_norm.weight"], eps)
        x = x + f * resid
    x = _rms(x, w["output_norm.weight"], eps)
    logits = x @ w.get("output.weight", w["token_embd.weight"]).T / hp["logit_scale"]
    if hp["softcap"]:
        logits = hp["softcap"] * np.tanh(logits / hp["softcap"])
    return logits
