"""`toymlx.backend.fastmath` (the CPU training step's elementwise math) gives the same numbers.

Each function is checked against a float64 numpy reference (values and gradients over the
whole float range, including the overflow and -inf edges), and each `Ops` method the models
call (`toymlx.models.ops`: silu_mul, attention, gelu, cross_entropy, the norms, linear) with
kernels "vectorised" against the same method with MLX's kernels, and whole models built with
either `Ops` against each other.
Tolerances: a few float32 ulp for elementwise values; 1e-5 of the largest magnitude for
attention and whole-model gradients; every result must be finite where the exact one is.
"""

from __future__ import annotations

import math
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx import nn
from mlx.utils import tree_flatten

from toymlx.backend import fastmath as fm
from toymlx.models.llama import Llama, tiny
from toymlx.models.losses import classify_loss, lm_loss
from toymlx.models.ops import Ops
from toymlx.models.vit import ViT, vit_tiny_8

FAST, MLX = Ops(kernels="vectorised"), Ops()

pytestmark = pytest.mark.usefixtures("on_cpu")


def test_a_model_runs_the_math_it_was_built_with():
    """The kernels are the model's, chosen at construction: every layer holds the same Ops,
    and a forward pass through either gives the same logits."""
    mx.random.seed(0)
    fast = ViT(vit_tiny_8(n_layers=1, d_model=24, n_heads=2, ffn_dim=32), FAST)
    ref = ViT(fast.args, MLX)
    ref.update(fast.parameters())
    held = {m.ops for _, m in fast.named_modules() if hasattr(m, "ops")}
    assert held == {FAST} and {m.ops for _, m in ref.named_modules() if hasattr(m, "ops")} == {MLX}
    x = mx.random.normal((3, 8, 8, 1))
    close(np.array(fast(x)), np.array(ref(x)), 1e-5)


def test_vectorised_kernels_need_float32():
    with pytest.raises(ValueError, match="float32"):
        Ops(kernels="vectorised", dtype="bfloat16")


EDGES = [-math.inf, -1e4, -104.0, -88.0, -87.5, -87.3, -20.0, -1e-3, -1e-30, 0.0, 1e-30, 1e-3,
         0.5, 20.0, 88.5, 88.8, 104.0, 1e4, math.inf]


def grid() -> np.ndarray:
    """Float32 inputs: a dense sweep of [-100, 100], random normals and the edges."""
    rng = np.random.default_rng(0)
    return np.concatenate([np.linspace(-100, 100, 200001), rng.standard_normal(20000) * 5,
                           EDGES]).astype(np.float32)


def test_exp_matches_float64_to_two_ulp_and_never_makes_a_subnormal():
    """Within 2 ulp wherever e**x is a normal float32; exactly 0 below -86.9 (-inf included),
    so no result is subnormal (slow on Intel cores); inf where e**x overflows; NaN for NaN."""
    x = grid()
    got = np.array(fm.exp(mx.array(x)))
    with np.errstate(over="ignore"):
        ref = np.exp(x.astype(np.float64))
    tiny, big = float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max)
    zero = got == 0
    assert (x[zero] < -86.9).all() and (zero | (x >= -86.99)).all()  # 0 only next to underflow
    assert ((got == 0) | (got >= tiny)).all()  # never subnormal
    finite = ~zero & (ref <= big)
    rel = np.abs(got[finite] - ref[finite]) / ref[finite]
    assert rel.max() < 2.4e-7, rel.max()  # 2 ulp (numpy's float32 exp: 2.0e-7 on these)
    assert (got[ref > big * (1 + 2.4e-7)] == np.inf).all()
    special = np.array(fm.exp(mx.array([-np.inf, np.inf, np.nan], mx.float32)))
    assert special[0] == 0 and special[1] == np.inf and np.isnan(special[2])
    g = np.array(mx.grad(lambda v: fm.exp(v).sum())(mx.array(x[np.abs(x) < 80])))
    np.testing.assert_allclose(g, np.exp(x[np.abs(x) < 80].astype(np.float64)), rtol=2.4e-7)


SPECIAL = [-math.inf, -100.0, -87.5, -20.0, -1.0, 0.0, 1.0, 20.0, 100.0, math.inf, math.nan]


@pytest.mark.parametrize("ours,theirs", [
    (fm.exp, mx.exp), (fm.sigmoid, mx.sigmoid), (fm.silu, nn.silu), (fm.gelu, nn.gelu),
    (fm.erf, mx.erf)])
def test_nan_and_infinities_come_out_as_mlxs_own_ops_give_them(ours, theirs):
    """NaN stays NaN and +-inf give what MLX's own op gives (the vectorised forms once turned
    NaN into ordinary numbers: exp(NaN) = 3.4e38, sigmoid(NaN) = 1)."""
    v = mx.array(SPECIAL, mx.float32)
    got, want = np.array(ours(v)), np.array(theirs(v))
    assert (np.isnan(got) == np.isnan(want)).all(), (got, want)
    keep = ~np.isnan(want)
    # (a subnormal of MLX's, e**-87.5 = 1e-38, is 0 here)
    np.testing.assert_allclose(got[keep], want[keep], rtol=2e-6, atol=np.finfo(np.float32).tiny)
    rows = mx.array([[0.0, -math.inf, 1.0], [math.nan, 0.0, 0.0], [-math.inf] * 3], mx.float32)
    for ours_rows, theirs_rows in [(fm.softmax(rows), mx.softmax(rows, -1)),
                                   (fm.logsumexp(rows), mx.logsumexp(rows, -1, keepdims=True))]:
        got, want = np.array(ours_rows), np.array(theirs_rows)
        assert (np.isnan(got) == np.isnan(want)).all(), (got, want)
        np.testing.assert_allclose(got[~np.isnan(want)], want[~np.isnan(want)], rtol=2e-6)
    assert np.array(fm.softmax(rows))[0, 1] == 0.0  # a masked score is exactly 0


def _erf64(x: np.ndarray) -> np.ndarray:
    return np.vectorize(math.erf)(x.astype(np.float64))


def test_erf_and_gelu_match_float64():
    x = grid()
    err = np.abs(np.array(fm.erf(mx.array(x))) - _erf64(x)).max()
    mlx_err = np.abs(np.array(mx.erf(mx.array(x))) - _erf64(x)).max()  # 5.3e-7 here
    assert err < 4e-7 and err <= mlx_err, (err, mlx_err)
    x = x[np.isfinite(x)]
    x64 = x.astype(np.float64)
    cdf = 0.5 * (1 + _erf64(x64 / math.sqrt(2)))
    ref = x64 * cdf
    got = np.array(fm.gelu(mx.array(x)))
    assert (np.abs(got - ref) <= 2.4e-7 * np.abs(ref) + 2e-7 * np.maximum(np.abs(x64), 1) * (
        x64 < 0)).all()
    dref = cdf + x64 * np.exp(-x64 ** 2 / 2) / math.sqrt(2 * math.pi)
    g = np.array(mx.grad(lambda v: fm.gelu(v).sum())(mx.array(x)))
    np.testing.assert_allclose(g, dref, rtol=0, atol=5e-7)
    ours = np.array(fm.gelu(mx.array(x)))
    mlx = np.array(nn.gelu(mx.array(x)))
    assert np.abs(ours - ref).max() <= 4 * max(np.abs(mlx - ref).max(), 1e-7)


def test_sigmoid_matches_float64():
    x = grid()
    x = x[np.isfinite(x)]
    with np.errstate(over="ignore"):
        ref = 1 / (1 + np.exp(-x.astype(np.float64)))
    got = np.array(fm.sigmoid(mx.array(x)))
    np.testing.assert_allclose(got, ref, rtol=4e-7, atol=1e-38)
    g = np.array(mx.grad(lambda v: fm.sigmoid(v).sum())(mx.array(x)))
    # s (1 - s) in float32, as MLX's own sigmoid backward: good to ~eps absolute
    np.testing.assert_allclose(g, ref * (1 - ref), rtol=0, atol=1.5e-7)


@pytest.mark.parametrize("rows", [[0.0, -math.inf, 1.0, 2.0], [-1e4, 1e4, 0.0, 3.0],
                                  [5.0, 5.0, 5.0, 5.0]])
def test_softmax_and_logsumexp_rows(rows):
    x = np.array(rows, np.float32)[None]
    x64 = x.astype(np.float64)
    m = x64.max(-1, keepdims=True)
    e = np.exp(x64 - m)
    np.testing.assert_allclose(np.array(fm.softmax(mx.array(x))), e / e.sum(-1, keepdims=True),
                               rtol=3e-7, atol=1e-30)
    np.testing.assert_allclose(np.array(fm.logsumexp(mx.array(x)))[:, 0], np.log(e.sum(-1)) + m[:, 0],
                               rtol=3e-7)
    # all -inf: exp saturates at e**-86.5, so a tiny value stands in for log(0)
    assert np.array(fm.logsumexp(mx.array([[-math.inf, -math.inf]])))[0, 0] < -85


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
    got, got_g = value_and_grads(FAST.silu_mul, (g, u))
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
    got, got_g = value_and_grads(lambda a, b, c: FAST.attention(a, b, c, scale, True), (q, k, v))
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
    got, (got_g,) = value_and_grads(lambda x: FAST.cross_entropy(x, targets), (logits,))
    ref, (ref_g,) = value_and_grads(
        lambda x: nn.losses.cross_entropy(x, targets, reduction="none"), (logits,))
    np.testing.assert_allclose(got, ref, rtol=2e-6, atol=2e-6)
    close(got_g, ref_g, 1e-5)


def test_llama_loss_and_grads_equal_reference_forms():
    """The whole lm_loss (fast forms) against the model with MLX's ops and nn cross_entropy."""
    mx.random.seed(3)
    model = Llama(tiny(d_model=64, n_layers=2, n_heads=8, n_kv_heads=2, ffn_dim=160), FAST)
    ref_model = Llama(model.args, MLX)
    ref_model.update(model.parameters())
    rng = np.random.default_rng(0)
    toks = mx.array(rng.integers(0, 259, (3, 25)).astype(np.int32))
    batch = {"inputs": toks[:, :-1], "targets": toks[:, 1:],
             "mask": mx.array((rng.random((3, 24)) < 0.8).astype(np.float32))}

    def ref_loss(m, b):
        ce = nn.losses.cross_entropy(m(b["inputs"]), b["targets"], reduction="none")
        return (ce * b["mask"]).sum() / b["mask"].sum(), b["mask"].sum()

    (loss, _), grads = nn.value_and_grad(model, lm_loss)(model, batch)
    mx.eval(loss, grads)
    (ref, _), ref_grads = nn.value_and_grad(ref_model, ref_loss)(ref_model, batch)
    mx.eval(ref, ref_grads)
    assert abs(loss.item() - ref.item()) <= 2e-6 * abs(ref.item())
    ref_flat = dict(tree_flatten(ref_grads))
    for name, g in tree_flatten(grads):
        close(np.array(g), np.array(ref_flat[name]), 1e-5)


def test_vit_loss_and_grads_equal_reference_forms():
    """ViT's GELU, attention and classification loss: fastmath's forms against MLX's ops."""
    mx.random.seed(4)
    model = ViT(vit_tiny_8(n_layers=2, d_model=48, ffn_dim=96), FAST)
    ref_model = ViT(model.args, MLX)
    ref_model.update(model.parameters())
    rng = np.random.default_rng(1)
    batch = {"images": mx.array(rng.standard_normal((16, 8, 8, 1)).astype(np.float32) * 2),
             "labels": mx.array(rng.integers(0, 10, 16).astype(np.int32))}
    (loss, _), grads = nn.value_and_grad(model, classify_loss)(model, batch)
    mx.eval(loss, grads)
    (ref, _), ref_grads = nn.value_and_grad(ref_model, classify_loss)(ref_model, batch)
    mx.eval(ref, ref_grads)
    assert abs(loss.item() - ref.item()) <= 2e-6 * abs(ref.item())
    ref_flat = {k: np.array(v) for k, v in tree_flatten(ref_grads)}
    top = max(np.abs(v).max() for v in ref_flat.values())
    for name, g in tree_flatten(grads):  # gradients that are 0 in exact math are ~1e-11 noise
        b = ref_flat[name]
        np.testing.assert_allclose(np.array(g), b, rtol=0, atol=1e-5 * max(np.abs(b).max(),
                                                                           1e-4 * top))


@pytest.mark.parametrize("T, S, block", [(150, 150, 64), (70, 70, 16), (5, 40, 2), (64, 64, 64)])
def test_block_causal_attention_equals_fast_sdpa(T, S, block):
    """Query blocks that see only their visible keys give the full causal attention (T < S:
    the queries are the last T positions, as with a cache)."""
    mx.random.seed(5)
    q = mx.random.normal((2, 6, T, 8)) * 3
    k = mx.random.normal((2, 2, S, 8))
    v = mx.random.normal((2, 2, S, 8))
    got, got_g = value_and_grads(lambda a, b, c: fm.attention(a, b, c, 0.3, True, block),
                                 (q, k, v))
    ref, ref_g = value_and_grads(
        lambda a, b, c: mx.fast.scaled_dot_product_attention(a, b, c, scale=0.3, mask="causal"),
        (q, k, v))
    close(got, ref, 1e-5)
    for a, b in zip(got_g, ref_g):
        close(a, b, 1e-5)


def _capped_attention_f64(q, k, v, scale: float, cap: float, window: int | None) -> np.ndarray:
    """float64 numpy: softmax(cap tanh(q k^T scale / cap) [causal, window]) v, the queries the
    last T of S positions, query head h reading kv head h // (H // Hkv)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    T, S, rep = q.shape[2], k.shape[2], q.shape[1] // k.shape[1]
    k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
    s = cap * np.tanh(q @ k.swapaxes(-1, -2) * scale / cap)  # (B,H,T,S)
    dist = np.arange(S - T, S)[:, None] - np.arange(S)[None]  # query - key
    s = np.where((dist >= 0) & (dist < (window or S + 1)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


@pytest.mark.parametrize("T, S, window", [(70, 70, None), (70, 70, 9), (1, 40, 9), (1, 40, None)])
def test_soft_capped_attention_equals_float64(T, S, window):
    """Gemma 2's soft-capped scores (cap * tanh(s / cap) before the mask) in fastmath's block
    attention (training on the CPU) and in Ops' composed form (MLX's ops, any device): both
    within 1e-5 of float64, their gradients equal; uncapped, the same inputs move far more."""
    mx.random.seed(6)
    q = mx.random.normal((2, 6, T, 8)) * 3
    k = mx.random.normal((2, 2, S, 8))
    v = mx.random.normal((2, 2, S, 8))
    ref = _capped_attention_f64(q, k, v, 0.3, 2.0, window)
    got = {}
    for name, ops in (("fast", FAST), ("mlx", MLX)):
        got[name] = value_and_grads(
            lambda a, b, c, ops=ops: ops.attention(a, b, c, 0.3, True, window, softcap=2.0),
            (q, k, v))
        close(got[name][0], ref, 1e-5)
    for a, b in zip(got["fast"][1], got["mlx"][1]):
        close(a, b, 1e-5)
    assert np.abs(np.array(MLX.attention(q, k, v, 0.3, True, window)) - ref).max() > 0.05


def _retained_arrays_per_layer(act, n: int = 512, f: int = 256) -> float:
    """(tokens, ffn) float32 arrays a compiled backward pass holds per `act(gate, up)` layer: the
    growth of MLX's peak from a 30-layer to a 50-layer chain, per layer (chains longer than
    the 10 tasks MLX keeps in flight, whose arrays a shorter chain would count too)."""
    x, r = mx.random.normal((n, f), key=mx.random.key(1)), mx.random.normal((n, f))

    def peak(layers: int) -> int:
        def loss(p0):
            h = x * p0
            for _ in range(layers):
                h = act(h, h * 0.5 + 1.0)
            return (h * r).sum()

        step = mx.compile(mx.value_and_grad(loss))
        p0 = mx.ones((f,))
        mx.eval(step(p0))
        mx.reset_peak_memory()
        held = mx.get_active_memory()
        mx.eval(step(p0))
        return mx.get_peak_memory() - held

    return (peak(50) - peak(30)) / 20 / (n * f * 4)


@pytest.mark.parametrize("scale", [1.0, 0.125])
def test_heads_equal_float64_projection_split_into_heads(scale):
    """`Ops.heads` ((x W^T + b) * scale as (B,H,T,hd)), both forms, plain and compiled: values
    and the gradients of x, W and b against float64 numpy."""
    B, T, D, H = 3, 7, 24, 4
    rng = np.random.default_rng(2)
    x, w, b, up = (rng.standard_normal(s).astype(np.float32)
                   for s in ((B, T, D), (D, D), (D,), (B, H, T, D // H)))
    x64, w64, b64, up64 = (a.astype(np.float64) for a in (x, w, b, up))
    want = ((x64 @ w64.T + b64) * scale).reshape(B, T, H, D // H).transpose(0, 2, 1, 3)
    g = (up64 * scale).transpose(0, 2, 1, 3).reshape(B * T, D)  # d loss / d (x W^T + b)
    want_grads = (g @ w64).reshape(B, T, D), g.T @ x64.reshape(B * T, D), g.sum(0)
    for op in (MLX, FAST):
        def loss(x, w, b, op=op):
            return (op.heads(x, w, b, H, scale) * mx.array(up)).sum()
        for fn in (lambda *a, op=op: op.heads(*a, H, scale),
                   mx.compile(lambda *a, op=op: op.heads(*a, H, scale))):
            np.testing.assert_allclose(np.array(fn(mx.array(x), mx.array(w), mx.array(b))),
                                       want, rtol=1e-5, atol=1e-5)
        grads = mx.compile(mx.grad(loss, argnums=(0, 1, 2)))(mx.array(x), mx.array(w),
                                                            mx.array(b))
        for got, ref in zip(grads, want_grads):
            np.testing.assert_allclose(np.array(got), ref, rtol=1e-5,
                                       atol=1e-5 * np.abs(ref).max())


def test_geglu_is_gelu_approx_times_up_with_float64_gradients_and_holds_less():
    """`Ops.gelu_mul` (Gemma's GeGLU): the values of `nn.gelu_approx(gate) * up` bit for bit,
    gradients against float64 calculus, and a backward pass that holds gate, up and the tanh
    alone (3 (tokens, ffn) arrays a layer; autodiff of the expression holds 6)."""
    x = grid()
    x = x[np.abs(x) < 1e3]  # x^3 stays finite in float32
    rng = np.random.default_rng(1)
    up = rng.standard_normal(x.shape).astype(np.float32)
    g, u = mx.array(x), mx.array(up)
    for op in (MLX, FAST):
        for fn in (op.gelu_mul, mx.compile(op.gelu_mul)):
            np.testing.assert_array_equal(np.array(fn(g, u)), np.array(nn.gelu_approx(g) * u))
    c = math.sqrt(2 / math.pi)
    x64, u64 = x.astype(np.float64), up.astype(np.float64)
    t = np.tanh(c * (x64 + 0.044715 * x64 ** 3))
    dgelu = 0.5 * (1 + t) + 0.5 * x64 * (1 - t * t) * c * (1 + 3 * 0.044715 * x64 ** 2)
    d_gate, d_up = mx.grad(lambda a, b: MLX.gelu_mul(a, b).sum(), argnums=(0, 1))(g, u)
    np.testing.assert_allclose(np.array(d_gate), u64 * dgelu, rtol=1e-5,
                               atol=1e-6 * np.abs(u64 * dgelu).max())
    np.testing.assert_allclose(np.array(d_up), 0.5 * x64 * (1 + t), rtol=1e-6, atol=1e-6)
    ours = _retained_arrays_per_layer(MLX.gelu_mul)
    autodiff = _retained_arrays_per_layer(lambda a, b: nn.gelu_approx(a) * b)
    assert ours <= 3.25 and autodiff >= ours + 2.5, (ours, autodiff)


@pytest.mark.parametrize("compiled", [False, True])
def test_rope_on_pairs_is_the_pairs_formula_bit_for_bit_with_float64_gradients(compiled):
    """RoPE on adjacent pairs (llama.cpp's for arch llama), float32: `Ops.rope` rotates each
    pair as one complex number. Its values and its gradient (the cotangent rotated back) are
    the pairs' formula's (x0 cos - x1 sin, x0 sin + x1 cos, and their autodiff) bit for bit, on
    a head-transposed x as the attention gives it, and within float32 of float64 calculus."""
    from toymlx.models.ops import Rope, _rope_tables

    rope = Rope(10000.0, None, False)
    rng = np.random.default_rng(5)
    B, T, H, hd, offset = 2, 7, 3, 8, 5
    x = mx.array(rng.standard_normal((B, T, H, hd)).astype(np.float32)).transpose(0, 2, 1, 3)
    w = mx.array(rng.standard_normal((B, H, T, hd)).astype(np.float32))
    cos, sin = _rope_tables(rope, hd, offset, T)

    def formula(x):
        x0, x1 = x[..., 0::2], x[..., 1::2]
        return mx.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], -1).reshape(x.shape)

    ours = (lambda x: MLX.rope(x, rope, offset))
    f = mx.compile(ours) if compiled else ours
    gf = mx.grad(lambda x: (f(x) * w).sum())
    assert _bits_equal(f(x), formula(x))
    assert _bits_equal(gf(x), mx.grad(lambda x: (formula(x) * w).sum())(x))
    # float64: the rotation by each position's angle, and its transpose for the gradient
    ang = (np.arange(offset, offset + T)[:, None]
           * 10000.0 ** (-np.arange(0, hd, 2) / hd))  # (T, hd/2)
    c, s = np.cos(ang), np.sin(ang)
    x64 = np.array(x).astype(np.float64)
    y64 = np.stack([x64[..., 0::2] * c - x64[..., 1::2] * s,
                    x64[..., 0::2] * s + x64[..., 1::2] * c], -1).reshape(x64.shape)
    w64 = np.array(w).astype(np.float64)
    g64 = np.stack([w64[..., 0::2] * c + w64[..., 1::2] * s,
                    -w64[..., 0::2] * s + w64[..., 1::2] * c], -1).reshape(w64.shape)
    np.testing.assert_allclose(np.array(f(x)), y64, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.array(gf(x)), g64, rtol=1e-6, atol=1e-6)


def _bits_equal(a: mx.array, b: mx.array) -> bool:
    a, b = np.array(a), np.array(b)
    return a.shape == b.shape and bool(np.all((a.view(np.int32) == b.view(np.int32))
                                              | (np.isnan(a) & np.isnan(b))))


def in_a_process_of_its_own(tmp_path, check: str, *args: str) -> None:
    """Run `check(device, *args)` of this file in a process set up as a command sets it up:
    `device.setup_process()` first thing, with a TMPDIR of its own, so MLX's kernel folder
    (`$TMPDIR/mlx/<version>/cpu`) is a link toymlx made to its kernel folder for this header.
    Not in pytest's process: there any test before these that compiled a step (this file's
    first ones) had MLX make that folder itself, a real folder, without toymlx's header, which
    set-up keeps as it is (and so does every later session with this TMPDIR), and the checks
    skipped ("not toymlx's for this header") when the file ran alone, in most orders, or from
    a TMPDIR used before. AssertionError with the child's last lines where a check fails."""
    import os
    import subprocess
    import sys
    if not sys.platform.startswith("linux"):
        pytest.skip("MLX's CPU kernels are built with g++ from toymlx's header on Linux only")
    (tmp_path / "tmp").mkdir()
    code = ("import sys\nfrom toymlx.backend import device\ndevice.setup_process()\n"
            "import mlx.core as mx\nmx.set_default_device(mx.cpu)\n"
            f"sys.path.insert(0, {str(Path(__file__).parent)!r})\nimport test_fastmath\n"
            f"test_fastmath.{check}(device, *{args!r})\nprint('checked')\n")
    done = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True,
                          text=True, env={**os.environ, "TMPDIR": str(tmp_path / "tmp")},
                          timeout=900)
    assert done.returncode == 0 and done.stdout.splitlines()[-1:] == ["checked"], (
        done.stdout[-2000:] + done.stderr[-4000:])


def test_kernel_forms_compute_every_function_bit_for_bit_as_the_composed_forms(tmp_path):
    """Every fastmath function with `in_kernel` (MLX's exp and erf ops, in kernels built with
    toymlx's header), compiled as a step is, against the composed forms: the same bits for
    values and gradients over the whole float range, NaN and the infinities included."""
    in_a_process_of_its_own(tmp_path, "every_function_bit_for_bit")


def every_function_bit_for_bit(kernel_forms) -> None:
    """`test_kernel_forms_compute_every_function_bit_for_bit_as_the_composed_forms`, in a
    process set up as a command (`in_a_process_of_its_own`)."""
    assert kernel_forms.backend_info()["kernel_forms"] == "checked", kernel_forms.backend_info()
    assert kernel_forms.kernel_forms()
    from toymlx.models.ops import training_ops
    assert training_ops(False).kernel_forms and not training_ops(False, compiled=False).kernel_forms
    x = mx.array(grid())
    g = mx.array(np.random.default_rng(1).standard_normal(x.shape).astype(np.float32))
    for fn in (fm.exp, fm.erf, fm.sigmoid, fm.silu, fm.gelu):
        name = fn.__name__
        (ref, ref_g), (got, got_g) = (
            mx.compile(lambda v, c, f=forms, fn=fn: mx.vjp(lambda t: fn(t, f), [v], [c]))(x, g)
            for forms in (False, True))
        assert _bits_equal(got[0], ref[0]), name
        assert _bits_equal(got_g[0], ref_g[0]), f"{name}'s gradient"
    rows = x[: 40 * 1000].reshape(40, 1000) * 0.3
    rows = mx.where(mx.arange(1000) % 7 == 0, -mx.inf, rows)  # masked scores
    targets = mx.array(np.arange(40, dtype=np.int32) * 13 % 1000)
    cot = g[: 40 * 1000].reshape(40, 1000)
    (ref_sm, ref_ce), (got_sm, got_ce) = (
        (mx.compile(lambda v, c, f=forms: mx.vjp(lambda t: fm.softmax(t, f), [v], [c]))(rows, cot),
         mx.compile(lambda v, f=forms: mx.value_and_grad(
             lambda t: fm.cross_entropy(t, targets, f).sum())(v))(rows))
        for forms in (False, True))
    assert _bits_equal(got_sm[0][0], ref_sm[0][0]) and _bits_equal(got_sm[1][0], ref_sm[1][0])
    assert _bits_equal(got_ce[0], ref_ce[0]) and _bits_equal(got_ce[1], ref_ce[1])


@pytest.mark.parametrize("kind", ["vit", "llama"])
def test_a_step_with_kernel_forms_is_the_composed_step_bit_for_bit(tmp_path, kind):
    """A compiled loss and gradients (ViT: GELU, attention, classification; Llama: SwiGLU,
    causal attention with its -inf mask, cross-entropy): the model's Ops with kernel_forms
    against without, every bit the same."""
    in_a_process_of_its_own(tmp_path, "step_bit_for_bit", kind)


def step_bit_for_bit(kernel_forms, kind: str) -> None:
    """`test_a_step_with_kernel_forms_is_the_composed_step_bit_for_bit`, in a process set up
    as a command (`in_a_process_of_its_own`)."""
    assert kernel_forms.backend_info()["kernel_forms"] == "checked", kernel_forms.backend_info()
    from dataclasses import replace
    mx.random.seed(5)
    rng = np.random.default_rng(2)
    if kind == "vit":
        model = ViT(vit_tiny_8(n_layers=2, d_model=48, ffn_dim=96), FAST)
        inner = ViT(model.args, replace(FAST, kernel_forms=True))
        batch = {"images": mx.array(rng.standard_normal((16, 8, 8, 1)).astype(np.float32) * 2),
                 "labels": mx.array(rng.integers(0, 10, 16).astype(np.int32))}
        loss_fn = classify_loss
    else:
        model = Llama(tiny(d_model=64, n_layers=2, n_heads=8, n_kv_heads=2, ffn_dim=160), FAST)
        inner = Llama(model.args, replace(FAST, kernel_forms=True))
        toks = mx.array(rng.integers(0, 259, (3, 90)).astype(np.int32))
        batch = {"inputs": toks[:, :-1], "targets": toks[:, 1:],
                 "mask": mx.array((rng.random((3, 89)) < 0.8).astype(np.float32))}
        loss_fn = lm_loss
    inner.update(model.parameters())
    outs = []
    for m in (model, inner):
        step = mx.compile(lambda b, m=m: nn.value_and_grad(m, loss_fn)(m, b))
        (loss, _), grads = step(batch)
        outs.append((loss, dict(tree_flatten(grads))))
    assert _bits_equal(outs[0][0], outs[1][0])
    assert all(_bits_equal(g, outs[1][1][k]) for k, g in outs[0][1].items())


def test_kernel_forms_are_off_without_the_header_and_the_check_says_why(tmp_path):
    """With TOYMLX_KERNEL_PCH=off MLX's kernels compute its own exp: the check finds a value
    that differs (so it can fail), set-up records why, and training asks for no kernel forms."""
    import subprocess
    import sys
    if not sys.platform.startswith("linux"):
        pytest.skip("MLX's CPU kernels are built with g++ from toymlx's header on Linux only")
    code = ("import json\nfrom toymlx.backend import device, fastmath\n"
            "device.setup_process()\nfrom toymlx.models.ops import training_ops\n"
            "print(json.dumps([device.backend_info()['kernel_forms'], fastmath.check_kernel_forms(),"
            " training_ops(False).kernel_forms]))\n")
    (tmp_path / "tmp").mkdir()  # MLX's own kernel folder too (a link into another cache)
    env = {**__import__("os").environ, "TOYMLX_KERNEL_PCH": "off", "XDG_CACHE_HOME": str(tmp_path),
           "TMPDIR": str(tmp_path / "tmp")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=600, check=True).stdout
    recorded, why, asked = __import__("json").loads(out.splitlines()[-1])
    assert recorded.startswith("off (no precompiled header: off (TOYMLX_KERNEL_PCH=off)")
    assert why is not None and why.startswith("MLX's kernels compute ") and asked is False
