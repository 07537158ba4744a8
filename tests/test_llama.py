"""The Llama forward against an independent float64 numpy forward, and model presets."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from reference import forward, load_reference

from toymlx.gguf.llama import load_llama
from toymlx.models.llama import Llama, smollm2_135m, smollm2_360m, tiny


def test_stories260k_matches_float64_numpy(stories_path):
    model, _ = load_llama(stories_path)
    hp, w = load_reference(stories_path)
    rng = np.random.default_rng(0)
    tokens = [1] + rng.integers(3, 512, size=47).tolist()
    ref = forward(hp, w, tokens)
    got = np.array(model(mx.array([tokens]))[0], dtype=np.float64)
    assert got.shape == ref.shape == (48, 512)
    assert np.abs(got - ref).max() < 1e-4


def test_stories260k_greedy_continuation_is_english(stories_path):
    model, g = load_llama(stories_path)
    vocab = g.metadata["tokenizer.ggml.tokens"]
    ids = [1] + [vocab.index(p) for p in ("▁Once", "▁upon", "▁a", "▁time")]
    cache = model.make_cache()
    logits = model(mx.array([ids]), cache=cache)
    out = []
    for _ in range(12):
        nxt = int(mx.argmax(logits[0, -1]).item())
        out.append(nxt)
        logits = model(mx.array([[nxt]]), cache=cache)
    text = "".join(vocab[i] for i in out).replace("▁", " ")
    assert text.startswith(", there was a little girl named Lily"), text


def test_kv_cache_matches_full_forward(stories_path):
    model, _ = load_llama(stories_path)
    tokens = mx.array([[1, 403, 407, 261, 378, 13, 100, 200]])
    full = model(tokens)
    cache = model.make_cache()
    step = [model(tokens[:, :5], cache=cache)]
    for t in range(5, 8):
        step.append(model(tokens[:, t:t + 1], cache=cache))
    # fp32 BLAS rounding differs between a (1,5) and a (1,8) forward by ~1e-6 of the logit
    # scale (tests/test_generate.py checks the same in float64 to 1e-10).
    tol = 2e-6 * mx.abs(full).max().item()
    assert mx.abs(mx.concatenate(step, axis=1) - full).max().item() < tol


def _n_params(args) -> int:
    m = Llama(args)
    return sum(v.size for _, v in tree_flatten(m.parameters()))


def test_presets():
    assert smollm2_135m().d_model == 576 and smollm2_135m().n_kv_heads == 3
    assert smollm2_360m().n_layers == 32 and smollm2_360m().ffn_dim == 2560
    # SmolLM2-135M has 134,515,008 parameters (tied embeddings).
    assert _n_params(smollm2_135m()) == 134_515_008
    out = Llama(tiny())(mx.array([[1, 2, 3]]))
    assert out.shape == (1, 3, 259)


@pytest.mark.parametrize("over, want", [
    ({"vocab_size": 0}, "model.vocab_size: expected > 0, found 0"),
    ({"d_model": 30}, "model.d_model: expected a multiple of model.n_heads (8), found 30"),
    ({"n_kv_heads": 3}, "model.n_kv_heads: expected a divisor of model.n_heads (8), found 3"),
    ({"rope_base": 0.0}, "model.rope_base: expected > 0, found 0.0"),
    ({"d_model": 24}, ("model.d_model: expected a multiple of 2 x model.n_heads (8) (an even "
                      "width per head for RoPE), found 24")),
    ({"key_length": 7}, "model.key_length: expected an even number for RoPE, found 7"),
    ({"activation": "relu"}, "model.activation: expected silu or gelu_tanh, found 'relu'"),
    ({"attn_softcap": 0.0}, "model.attn_softcap: expected > 0 or None (no cap), found 0.0"),
    ({"final_softcap": -30.0}, "model.final_softcap: expected > 0 or None (no cap), found -30.0"),
    ({"sliding_layers": (True,)}, ("model.sliding_layers: expected one entry per block of "
                                  "model.n_layers (4), found 1")),
])
def test_bad_args_name_the_field_and_the_fields_they_depend_on(over, want):
    """A model built from Python (or a GGUF's metadata) names its fields; toymlx-train names the
    flags instead (tests/test_trainer.py)."""
    with pytest.raises(ValueError) as caught:
        Llama(tiny(**over))
    assert str(caught.value) == want


def test_loading_a_damaged_toymlx_gguf_names_it(tmp_path):
    """A toymlx GGUF records the SHA-256 of its tensor data; load_llama checks it, so bytes
    damaged on disk fail with one line naming the file instead of loading as other weights."""
    from toymlx.gguf.llama import write_llama
    from toymlx.gguf.reader import GGUFError
    from toymlx.models.llama import Llama

    path = tmp_path / "m.gguf"
    write_llama(path, Llama(tiny(d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=64)),
                {})
    load_llama(path)  # intact
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF  # one byte of the last tensor
    path.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match=r"m\.gguf: tensor data: expected sha256 .* damaged"):
        load_llama(path)
