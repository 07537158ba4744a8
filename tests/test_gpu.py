"""The GPU route (Metal on a Mac, CUDA on Linux), run where MLX has a GPU (marker `gpu`).

What these check is what differs from the CPU: training in bfloat16 with MLX's fused kernels,
the fast RoPE, quantized LoRA bases that stay quantized, and float32 matmuls that CUDA runs as
TF32 (so exact interop comparisons belong on the CPU). Every architecture's GPU-route model on
the GPU against the exact float32 one on the CPU: `test_every_architecture_on_the_gpu`
(test_gpu_route.py runs the same math on MLX's CPU).
"""

from __future__ import annotations

from pathlib import Path

import gpu_route
import mlx.core as mx
import numpy as np
import pytest
from gpu_route import route_files  # noqa: F401  (module fixture)
from toymlx_cli.train import main

from toymlx.backend import fpenv
from toymlx.backend.device import gpu_kind
from toymlx.bundle.events import read_events
from toymlx.models.llama import Llama, tiny
from toymlx.models.ops import CUDA_ATTENTION_KEEP_VALUES, CUDA_LOGITS_VALUES, EXACT, training_ops

pytestmark = pytest.mark.gpu


def test_vit_tiny_trains_in_bf16_on_the_gpu(tmp_path: Path):
    """The main job on its default data with --device gpu: bfloat16 by default, MLX's kernels,
    held-out accuracy well above chance after 200 steps."""
    assert main(["--recipe", "vit-tiny", "--device", "gpu", "--steps", "200", "--no-progress",
                 "--runs-root", str(tmp_path), "--run-id", "g"]) == 0
    events = read_events(tmp_path / "g")
    start = events[0]
    assert start["backend"]["kind"] in ("metal", "cuda")
    keep = 0 if start["backend"]["kind"] == "metal" else CUDA_ATTENTION_KEEP_VALUES
    assert start["math"] == {"kernels": "mlx", "kernel_forms": False, "dtype": "bfloat16",
                             "exact_rope": False, "grad_checkpoint": False, "decode_slice": None,
                             "subnormals": fpenv.describe("flush"), "attention_keep_limit": keep,
                             "logits_values": None if keep == 0 else CUDA_LOGITS_VALUES}
    acc = [e["accuracy"] for e in events if e["kind"] == "eval"][-1]
    assert acc > 0.8, acc


def test_gpu_training_math_matches_the_exact_forward():
    """A Llama built with the GPU's training Ops (bf16, fused kernels, mx.fast.rope) against
    the exact float32 forward on the CPU: the same logits to bfloat16's precision."""
    mx.random.seed(0)
    args = tiny(d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=256)
    tokens = mx.array(np.random.default_rng(0).integers(0, 259, (2, 64)).astype(np.int32))
    with mx.stream(mx.cpu):
        exact = Llama(args, EXACT)
        want = np.array(exact(tokens))
    fast = Llama(args, training_ops(on_gpu=True))
    fast.update(exact.parameters())
    with mx.stream(mx.gpu):
        got = np.array(fast(tokens).astype(mx.float32))
    err = np.abs(got - want).max() / np.abs(want).max()
    print(f"GPU bf16 training forward vs exact float32 (CPU): max rel err {err:.3g}")
    assert err < 3e-2


def test_float32_matmul_on_the_gpu_is_close_not_exact():
    """CUDA runs float32 matmuls on TF32 tensor cores (relative error ~3e-4 at 512^3, against
    ~1e-6 on the CPU): float32 interop margins are measured on the CPU."""
    a = mx.random.normal((512, 512), key=mx.random.key(1))
    b = mx.random.normal((512, 512), key=mx.random.key(2))
    want = np.array(a, np.float64) @ np.array(b, np.float64)
    with mx.stream(mx.gpu):
        got = np.array(a @ b)
    err = np.abs(got - want).max() / np.abs(want).max()
    print(f"float32 512^3 matmul on the GPU: max rel err {err:.3g}")
    assert err < 2e-3


@pytest.mark.parametrize("ops", ["cuda", "metal"])
@pytest.mark.parametrize("kind", gpu_route.ALL_KINDS)
def test_every_architecture_on_the_gpu(route_files, kind, ops):  # noqa: F811
    """The GPU route's model on mx.gpu (CUDA's Ops: attention kept for the backward pass;
    Metal's: recomputed, the CPU's logits slices), its LoRA step compiled as the trainer compiles
    it, against the exact float32 model on the CPU (tests/gpu_route.py): the bounds
    test_gpu_route.py holds on MLX's CPU."""
    r = gpu_route.compare(route_files[kind], gpu_route.gpu_ops(ops), mx.gpu, compiled=True)
    gpu_route.check(r, f"{kind} on the GPU ({ops}'s Ops)")


@pytest.mark.parametrize("T", [48, 256])
@pytest.mark.parametrize(("hd", "mode"), gpu_route.ATTENTION_CASES)
def test_attention_of_every_head_width_on_the_gpu(hd, mode, T):
    """The GPU route's attention on mx.gpu (its fused kernel where MLX takes the width, causal,
    windowed or capped; 256 rows: a multiple of 128, cuDNN's fused backward) against float32's
    on the CPU: output and q, k, v gradients (tests/gpu_route.py)."""
    err, cos = gpu_route.attention_case(hd, mode, T, gpu_route.gpu_ops(gpu_kind()), mx.gpu)
    print(f"\n[gpu] attention hd {hd} {mode} T {T}: error {err:.3g}, gradient cosine {cos:.5f}")
    assert err < gpu_route.LOGITS_TOL and cos > 0.999
