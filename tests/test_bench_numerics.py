"""The CPU formulations the training step uses equal the straightforward ones.

Each fast formulation (toymlx/models/llama.py `silu_mul`, `causal_attention`;
toymlx/losses.py `cross_entropy`) is compared with MLX's own op on the same inputs: values and
gradients, float32 on the CPU. Tolerances: 2e-6 relative (+1e-7 absolute) for elementwise
values, 1e-5 of the largest magnitude for attention and for whole-model gradients; every
result must be finite, including at inputs where a naive exp overflows.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx import nn
from mlx.utils import tree_flatten

from toymlx.losses import cross_entropy, lm_loss
from toymlx.models import llama
from toymlx.models.llama import Llama, causal_attention, silu_mul, tiny


@pytest.fixture(autouse=True)
def on_cpu():
    old = mx.default_device()
    mx.set_default_device(mx.cpu)
    yield
    mx.set_default_device(old)


@pytest.fixture(autouse=True)
def _cpu_forms_on(monkeypatch):
    """These tests compare the opt-in CPU forms (TOYMLX_CPU_FORMS=1) with MLX's own ops."""
    monkeypatch.setenv("TOYMLX_CPU_FORMS", "1")


def value_and_grads(f, args):
    """f(*args) and the gradients of sum(f(*args) * w) for a fixed random w."""
    out = f(*args)
    w = mx.random.normal(out.shape, key=mx.random.key(7))
    grads = mx.grad(lambda *a: (f(*a) * w).sum(), argnums=list(range(len(args))))(*args)
    grads = grads if isinstance(grads, (list, tuple)) else [grads]
    mx.eval(out, grads)
    return np.array(out), [np.array(g) for g in grads]


def close(a: np.ndarray, b: np.ndarray, rel: float) -> None:
    assert np.isfinite(a).all() and np.isfinite(b).all()
    np.testing.assert_allclose(a, b, rtol=0, atol=rel * max(np.abs(b).max(), 1e-30))


def test_silu_mul_equals_nn_silu():
    mx.random.seed(0)
    extremes = mx.array([-1e4, -200.0, -89.0, -88.0, -87.0, -20.0, -1e-3, 0.0, 1e-3, 20.0, 88.0,
                         89.0, 200.0, 1e4])
    g = mx.concatenate([mx.random.normal((3000,)) * 4, extremes])
    u = mx.random.normal(g.shape)
    got, got_g = value_and_grads(silu_mul, (g, u))
    ref, ref_g = value_and_grads(lambda a, b: nn.silu(a) * b, (g, u))
    np.testing.assert_allclose(got, ref, rtol=2e-6, atol=1e-7)
    for a, b in zip(got_g, ref_g):
        assert np.isfinite(a).all()
        np.testing.assert_allclose(a, b, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("B, H, Hkv, T, hd", [(2, 8, 4, 33, 16), (2, 9, 3, 17, 8),
                                              (1, 4, 4, 20, 8), (1, 6, 1, 9, 4)])
@pytest.mark.parametrize("sharp", [1.0, 30.0])
def test_causal_attention_equals_fast_sdpa(B, H, Hkv, T, hd, sharp):
    mx.random.seed(1)
    q = mx.random.normal((B, H, T, hd)) * sharp  # sharp: near one-hot attention rows
    k = mx.random.normal((B, Hkv, T, hd))
    v = mx.random.normal((B, Hkv, T, hd))
    scale = hd ** -0.5
    got, got_g = value_and_grads(lambda a, b, c: causal_attention(a, b, c, scale), (q, k, v))
    ref, ref_g = value_and_grads(
        lambda a, b, c: mx.fast.scaled_dot_product_attention(a, b, c, scale=scale,
                                                             mask="causal"), (q, k, v))
    close(got, ref, 1e-5)
    for a, b in zip(got_g, ref_g):
        close(a, b, 1e-5)


@pytest.mark.parametrize("offset", [0.0, 1e3, -1e3])
def test_cross_entropy_equals_nn_cross_entropy(offset):
    mx.random.seed(2)
    logits = mx.random.normal((3, 5, 4099)) * 6 + offset
    targets = mx.random.randint(0, 4099, (3, 5))
    got, (got_g,) = value_and_grads(lambda x: cross_entropy(x, targets), (logits,))
    ref, (ref_g,) = value_and_grads(
        lambda x: nn.losses.cross_entropy(x, targets, reduction="none"), (logits,))
    np.testing.assert_allclose(got, ref, rtol=2e-6, atol=2e-6)
    close(got_g, ref_g, 1e-5)


def test_llama_loss_and_grads_equal_reference_forms(monkeypatch):
    """The whole lm_loss (fast forms) against the model with MLX's ops and nn cross_entropy."""
    mx.random.seed(3)
    model = Llama(tiny(d_model=64, n_layers=2, n_heads=8, n_kv_heads=2, ffn_dim=160))
    rng = np.random.default_rng(0)
    toks = mx.array(rng.integers(0, 259, (3, 25)).astype(np.int32))
    batch = {"inputs": toks[:, :-1], "targets": toks[:, 1:],
             "mask": mx.array((rng.random((3, 24)) < 0.8).astype(np.float32))}

    def ref_loss(m, b):
        ce = nn.losses.cross_entropy(m(b["inputs"]), b["targets"], reduction="none")
        return (ce * b["mask"]).sum() / b["mask"].sum(), b["mask"].sum()

    (loss, _), grads = nn.value_and_grad(model, lm_loss)(model, batch)
    mx.eval(loss, grads)
    monkeypatch.setattr(llama, "cpu_forms", lambda: False)
    (ref, _), ref_grads = nn.value_and_grad(model, ref_loss)(model, batch)
    mx.eval(ref, ref_grads)
    assert abs(loss.item() - ref.item()) <= 2e-6 * abs(ref.item())
    ref_flat = dict(tree_flatten(ref_grads))
    for name, g in tree_flatten(grads):
        close(np.array(g), np.array(ref_flat[name]), 1e-5)
