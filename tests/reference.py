"""An independent float64 numpy Llama forward, reading GGUF with gguf-py (not toymlx).

Written from llama.cpp's conventions: (out, in) weights, RMSNorm, adjacent-pair RoPE,
GQA head h -> kv head h // (n_head // n_kv), SwiGLU FFN, tied output when output.weight is absent.
"""

from __future__ import annotations

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize


def _field(r: GGUFReader, key: str, default=None):
    f = r.fields.get(key)
    if f is None:
        return default
    v = f.parts[f.data[0]]
    return v.tobytes().decode() if f.types[0].name == "STRING" else v.item()


def load_reference(path) -> tuple[dict, dict[str, np.ndarray]]:
    r = GGUFReader(str(path))
    arch = _field(r, "general.architecture")
    hp = {
        "d": _field(r, f"{arch}.embedding_length"),
        "n_layers": _field(r, f"{arch}.block_count"),
        "n_heads": _field(r, f"{arch}.attention.head_count"),
        "eps": _field(r, f"{arch}.attention.layer_norm_rms_epsilon"),
        "base": _field(r, f"{arch}.rope.freq_base", 10000.0),
    }
    hp["n_kv"] = _field(r, f"{arch}.attention.head_count_kv", hp["n_heads"])
    w = {}
    for t in r.tensors:
        shape = tuple(int(x) for x in reversed(t.shape))  # ne -> numpy (out, in)
        w[t.name] = np.asarray(dequantize(t.data, t.tensor_type), np.float64).reshape(shape)
    return hp, w


def forward(hp: dict, w: dict[str, np.ndarray], tokens: list[int]) -> np.ndarray:
    """Logits (T, vocab) in float64."""
    d, H, Hkv = hp["d"], hp["n_heads"], hp["n_kv"]
    hd = d // H
    T = len(tokens)

    def rms(x, g):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + hp["eps"]) * g

    inv = hp["base"] ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)  # (hd/2,)
    ang = np.arange(T)[:, None] * inv[None, :]  # (T, hd/2)
    cos, sin = np.cos(ang), np.sin(ang)

    def rope(x):  # x (T, heads, hd); rotate pairs (2i, 2i+1)
        x0, x1 = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = x0 * cos[:, None] - x1 * sin[:, None]
        out[..., 1::2] = x0 * sin[:, None] + x1 * cos[:, None]
        return out

    x = w["token_embd.weight"][tokens]  # (T, d)
    causal = np.triu(np.full((T, T), -np.inf), 1)
    for i in range(hp["n_layers"]):
        p = f"blk.{i}."
        h = rms(x, w[p + "attn_norm.weight"])
        q = rope((h @ w[p + "attn_q.weight"].T).reshape(T, H, hd))
        k = rope((h @ w[p + "attn_k.weight"].T).reshape(T, Hkv, hd))
        v = (h @ w[p + "attn_v.weight"].T).reshape(T, Hkv, hd)
        out = np.empty((T, H, hd))
        for hh in range(H):
            kv = hh // (H // Hkv)
            s = q[:, hh] @ k[:, kv].T / np.sqrt(hd) + causal
            s = np.exp(s - s.max(-1, keepdims=True))
            out[:, hh] = (s / s.sum(-1, keepdims=True)) @ v[:, kv]
        x = x + out.reshape(T, d) @ w[p + "attn_output.weight"].T
        h = rms(x, w[p + "ffn_norm.weight"])
        g = h @ w[p + "ffn_gate.weight"].T
        x = x + ((g / (1 + np.exp(-g))) * (h @ w[p + "ffn_up.weight"].T)) @ w[p + "ffn_down.weight"].T
    x = rms(x, w["output_norm.weight"])
    head = w.get("output.weight", w["token_embd.weight"])
    return x @ head.T
