"""The GPU route's math (`--device gpu`: bfloat16, MLX's fused kernels, the base held as on a
GPU) for every architecture toymlx reads, computed on MLX's CPU against the exact float32
forward: the logits of a forward pass and a LoRA step's gradients (tests/gpu_route.py). The same
comparison on the GPU itself is test_gpu.py's (marker `gpu`). The training step is eager here:
compiled, each architecture's bfloat16 kernels are first built by the C++ compiler (minutes on
a cold cache); test_gpu.py compiles it as the trainer does.
"""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest
from arch_files import DRAWN_KINDS
from gpu_route import (
    ALL_KINDS,
    LOGITS_TOL,
    attention_case,
    check,
    compare,
    gpu_ops,
    route_files,  # noqa: F401  (module fixture)
)

from toymlx.models.moe import gather_product
from toymlx.models.ops import EXACT


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_the_gpu_route_computes_the_exact_model(route_files, kind):  # noqa: F811
    """bfloat16 logits within LOGITS_TOL of the exact float32 ones (relative to their largest),
    all finite; the LoRA step's loss within LOSS_TOL and each gradient's cosine above
    GRAD_COSINE. CUDA's Ops (attention kept for the backward pass; Metal's recompute it, the
    same numbers here to the bit: test_gpu.py runs both where it can)."""
    check(compare(route_files[kind], gpu_ops("cuda"), mx.cpu, compiled=False), kind)


@pytest.mark.parametrize("kind", DRAWN_KINDS)
def test_the_gpu_route_in_float32_is_the_exact_model(route_files, kind):  # noqa: F811
    """`--device gpu --dtype float32`: the GPU route's kernels (mx.fast's RoPE with its
    frequencies, fused norms and attention, soft caps composed) in float32 compute the exact
    model's logits to float32's rounding (test_archs.py checks arch_gguf's kinds so)."""
    r = compare(route_files[kind], replace(gpu_ops("cuda"), dtype="float32"), mx.cpu, grads=False)
    assert r["dtype"] == r["hidden_dtype"] == "mlx.core.float32"
    assert r["logits_error"] < 2e-5, r


def test_half_precision_experts_on_the_cpu():
    """MLX's CPU GatherMM computes float32 only: `gather_product` there takes bfloat16 operands
    through float32 (the float32 product, rounded once), where MLX alone raised."""
    rng = np.random.default_rng(0)
    x = mx.array(rng.standard_normal((6, 1, 1, 16)).astype(np.float32)).astype(mx.bfloat16)
    w = mx.array(rng.standard_normal((4, 16, 8)).astype(np.float32)).astype(mx.bfloat16)
    idx = mx.array(rng.integers(0, 4, (6, 2)).astype(np.uint32))
    with mx.stream(mx.cpu):
        with pytest.raises(RuntimeError, match="GatherMM"):
            mx.eval(mx.gather_mm(x, w, rhs_indices=idx))
        got = gather_product(x, w, idx, False)
    want = np.einsum("nd,nkdo->nko", np.array(x.astype(mx.float32))[:, 0, 0],
                     np.array(w.astype(mx.float32))[np.array(idx)])
    assert got.dtype == mx.bfloat16
    assert np.array_equal(np.array(got.astype(mx.float32))[:, :, 0],
                          np.array(mx.array(want.astype(np.float32)).astype(mx.bfloat16)
                                   .astype(mx.float32)))


def test_block_held_experts_in_bfloat16():
    """A quantized base's experts stay in their GGUF blocks on a GPU too (`frozen_weights`: MLX's
    quantized layers hold 2-D matrices only), decoded and applied in bfloat16: a block's output
    and its input gradient against float32's, 80 tokens (160 pairs, sorted by expert) and 8
    (16 pairs, in token order)."""
    from toymlx.gguf.blocks import CODECS, random_blocks, split_rows
    from toymlx.gguf.reader import GGMLQuantizationType as Q
    from toymlx.models.moe import BlockExperts, MoE

    e, d, f = 8, 64, 32
    codec = CODECS[Q.Q8_0]
    rng = np.random.default_rng(0)

    def block(ops):
        m = MoE(d, e, 2, f, ops=ops)
        m.router.weight = mx.array(rng.standard_normal((e, d)).astype(np.float32))
        for name, (o, i) in (("gate_exps", (f, d)), ("up_exps", (f, d)), ("down_exps", (d, f))):
            raw = random_blocks(codec, e * o, i // codec.block_values, seed=3)
            parts = {k: mx.array(v) for k, v in split_rows(codec, raw, (e, o, i)).items()}
            setattr(m, name, BlockExperts(codec, parts, e, o, i, ops))
        return m

    exact, fast = block(EXACT), block(gpu_ops("cuda"))
    fast.router.weight = exact.router.weight
    for n in (80, 8):
        x = mx.array(rng.standard_normal((1, n, d)).astype(np.float32))
        probe = mx.array(rng.standard_normal((1, n, d)).astype(np.float32))
        outs, grads = [], []
        for m in (exact, fast):
            xm = x.astype(m.ops.mx_dtype)
            outs.append(np.array(m(xm).astype(mx.float32)))
            g = mx.grad(lambda xx, m=m, p=probe: (m(xx).astype(mx.float32) * p).sum())(xm)
            grads.append(np.array(g.astype(mx.float32)).ravel())
        err = np.abs(outs[1] - outs[0]).max() / np.abs(outs[0]).max()
        cos = grads[0] @ grads[1] / np.linalg.norm(grads[0]) / np.linalg.norm(grads[1])
        print(f"\n[gpu_route] Q8_0 experts, {n} tokens: error {err:.3g}, input grad cosine "
              f"{cos:.5f}")
        assert err < LOGITS_TOL and cos > 0.999


@pytest.mark.parametrize(("hd", "mode"), [(64, "causal"), (128, "window"), (256, "softcap"),
                                         (512, "window")])
def test_attention_of_real_head_widths(hd, mode):
    """The GPU route's attention (bfloat16, MLX's fused kernel or toymlx's capped one) against
    float32's, output and gradients, at head widths real models have. On the CPU MLX composes
    every one; which its fused kernels take differs by GPU: test_gpu.py runs all of
    ATTENTION_CASES there."""
    err, cos = attention_case(hd, mode, 48, gpu_ops("cuda"), mx.cpu)
    print(f"\n[gpu_route] attention hd {hd} {mode}: error {err:.3g}, gradient cosine {cos:.5f}")
    assert err < LOGITS_TOL and cos > 0.999
