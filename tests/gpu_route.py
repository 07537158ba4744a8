"""The GPU route's math against the exact float32 forward, for every architecture toymlx reads.

`--device gpu` trains with `training_ops(on_gpu=True)`: bfloat16 activations, MLX's fused
`mx.fast` kernels (rms_norm, rope, scaled_dot_product_attention), a frozen base held as
`frozen_weights(True)` says (float matrices in bfloat16). MLX runs the same ops and dtypes on
its CPU, so the math is checked here on any machine (test_gpu_route.py) and on a GPU where one
exists (test_gpu.py, marker `gpu`), with `compare`: the logits of one forward pass, and the
gradients of a LoRA step (the trainer's `micro_batch_grads` of `lm_loss`, compiled), against
the exact model's.

Files: arch_files.py's `arch_gguf` kinds and its `drawn_gguf` ones (gemma4, qwen35, the three
mixtures of experts), whose weights are drawn so that rounding them to bfloat16 moves the exact
logits by 0.2-1.2% (measured): a model where rounding the weights alone moves them by 9%
(gemma4_gguf's, MLX's initial weights: the route's logits 13% off) cannot tell a wrong kernel
from bfloat16.

A mixture of experts takes the exact model's experts (`pin_routes`): where two experts'
router probabilities nearly tie, bfloat16 may choose the other, as any other rounding would
(tests/test_moe.py measures the margins), a different model from there on.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from arch_files import DRAWN_KINDS, KINDS, arch_gguf, drawn_gguf
from mlx.utils import tree_flatten, tree_unflatten

from toymlx.gguf.llama import frozen_weights, load_llama
from toymlx.models.llama import Llama
from toymlx.models.lora import apply_lora
from toymlx.models.losses import lm_loss
from toymlx.models.moe import MoE
from toymlx.models.ops import Ops, training_ops
from toymlx.training.step import micro_batch_grads

ALL_KINDS = (*KINDS, *DRAWN_KINDS)
LOGITS_TOL = 3e-2
"""Largest |fast - exact| / max |exact| of the logits: bfloat16's precision over a few blocks."""
GRAD_COSINE = 0.95
"""Smallest cosine between a LoRA parameter's fast and exact gradients: 0.9988-0.9999 on most
files, 0.977 on gemma4's (6 blocks; rounding its weights alone gives 0.9976), so bfloat16's
own rounding, on a GPU in another order, has room; a gradient missing a term or a slope is far
off."""
LOSS_TOL = 3e-3
"""Largest relative difference of the fast and exact losses (measured: up to 1.1e-3)."""
B, T = 2, 48
"""A batch: 96 tokens, sliding windows (4, 8) crossed, 192 (token, expert) pairs sorted by
expert (more than `toymlx.models.moe.SORT_FROM`)."""


def write_file(kind: str, folder: Path) -> Path:
    """The GGUF of `kind` (ALL_KINDS) in `folder`."""
    make = drawn_gguf if kind in DRAWN_KINDS else arch_gguf
    return make(kind, folder / f"{kind}.gguf")


@pytest.fixture(scope="module")
def route_files(tmp_path_factory) -> dict[str, Path]:
    """Every kind's file (`write_file`), by kind: `from gpu_route import route_files`."""
    d = tmp_path_factory.mktemp("gpu_route")
    return {k: write_file(k, d) for k in ALL_KINDS}


def gpu_ops(gpu: str) -> Ops:
    """What `training_ops(on_gpu=True)` chooses on a CUDA machine (Linux) or on a Mac (metal):
    attention kept for the backward pass, larger logits slices / always recomputed."""
    return training_ops(on_gpu=True, metal=gpu == "metal")


def batch(vocab: int, seed: int = 0) -> dict[str, mx.array]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, min(vocab, 259), (B, T + 1)).astype(np.int32)
    return {"inputs": mx.array(ids[:, :-1]), "targets": mx.array(ids[:, 1:]),
            "mask": mx.ones((B, T))}


def chosen_experts(exact: Llama, tokens: mx.array) -> list[mx.array]:
    """The experts (N, k) each mixture-of-experts block of `exact` chooses for `tokens`."""
    moes = [layer.mlp for layer in exact.layers if isinstance(layer.mlp, MoE)]
    chosen: list[mx.array] = []
    for moe in moes:
        def recording(h: mx.array, route: Any = moe.route) -> tuple[mx.array, mx.array]:
            idx, w = route(h)
            chosen.append(idx)
            return idx, w

        moe.route = recording
    exact(tokens)
    for moe in moes:
        del moe.route
    mx.eval(chosen)
    return chosen


def pin_routes(model: Llama, chosen: list[mx.array]) -> None:
    """Make `model`'s mixture-of-experts blocks take the experts `chosen` (`chosen_experts` of
    the exact model), weighted by their own router: see the module docstring."""
    moes = [layer.mlp for layer in model.layers if isinstance(layer.mlp, MoE)]
    for moe, idx in zip(moes, chosen, strict=True):
        moe.route = (lambda h, moe=moe, idx=idx: (idx, moe.weights(moe.probabilities(h), idx)))


def relative(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


def with_lora(model: Llama, seed: int = 1) -> Llama:
    """LoRA (rank 4) on every projection, B drawn too: at B = 0 every A's gradient is 0."""
    mx.random.seed(seed)
    apply_lora(model, "all-linear", rank=4)
    rng = np.random.default_rng(seed)
    model.update(tree_unflatten([
        (k, mx.array(0.05 * rng.standard_normal(v.shape).astype(np.float32))
         if k.endswith("lora_b") else v) for k, v in tree_flatten(model.trainable_parameters())]))
    return model


def lora_grads(model: Llama, data: dict[str, mx.array], compiled: bool
               ) -> tuple[float, dict[str, np.ndarray]]:
    """The mean loss and each LoRA parameter's gradient, float64, from the trainer's
    `micro_batch_grads` (compiled as `toymlx.training.step.make_step` compiles it)."""
    grads_of = micro_batch_grads(model, lm_loss)
    if compiled:
        grads_of = mx.compile(grads_of, inputs=[model.state], outputs=[model.state])
    value, n, g = grads_of(data)
    mx.eval(value, n, g)
    n = float(n)
    return float(value) / n, {k: np.array(v.astype(mx.float32), np.float64) / n
                              for k, v in tree_flatten(g)}


def compare(path: Path, ops: Ops, stream: Any, grads: bool = True,
            compiled: bool = True) -> dict[str, Any]:
    """The model computing with `ops` (`gpu_ops`), its base held as on a GPU, on `stream` against
    the exact float32 model on the CPU: the logits' relative error, their dtype and whether all
    are finite, the final hidden states' dtype (a float32 weight met unconverted widens every
    activation after it), and with `grads` the losses and the smallest gradient cosine (and its
    parameter) of a LoRA step."""
    data = batch(load_llama(path)[0].args.vocab_size)
    tokens = data["inputs"]
    with mx.stream(mx.cpu):
        exact, _ = load_llama(path)
        want = np.array(exact(tokens))
        chosen = chosen_experts(exact, tokens)
    with mx.stream(stream):
        fast, _ = load_llama(path, ops, frozen_weights(True))
        pin_routes(fast, chosen)
        h = fast.hidden(tokens)
        out = fast.unembed(h)
        got = np.array(out.astype(mx.float32))
    res: dict[str, Any] = {"logits_error": relative(got, want), "dtype": str(out.dtype),
                           "hidden_dtype": str(h.dtype), "finite": bool(np.isfinite(got).all())}
    if not grads:
        return res
    with mx.stream(mx.cpu):
        exact = with_lora(load_llama(path)[0])
        pin_routes(exact, chosen)  # both LoRA models take the same experts
        loss, want_g = lora_grads(exact, data, compiled=False)
    with mx.stream(stream):
        fast = with_lora(load_llama(path, ops, frozen_weights(True))[0])
        pin_routes(fast, chosen)
        fast_loss, got_g = lora_grads(fast, data, compiled)
    cos = {k: float((want_g[k] * got_g[k]).sum()
                    / (np.linalg.norm(want_g[k]) * np.linalg.norm(got_g[k]) + 1e-300))
           for k in want_g}
    worst = min(cos, key=cos.get)
    res.update(loss=loss, fast_loss=fast_loss, grad_cosine=cos[worst], worst=worst,
               n_grads=len(cos))
    return res


def check(r: dict[str, Any], what: str) -> None:
    """`compare`'s figures (`what`: the file and device, printed with them) within the bounds:
    bfloat16 hidden states and logits, all finite, within LOGITS_TOL; the loss within LOSS_TOL; each gradient's
    cosine above GRAD_COSINE."""
    print(f"\n[gpu_route] {what}: " + json.dumps(r, default=str))
    assert r["dtype"] == r["hidden_dtype"] == "mlx.core.bfloat16" and r["finite"]
    assert r["logits_error"] < LOGITS_TOL
    assert abs(r["fast_loss"] - r["loss"]) <= LOSS_TOL * abs(r["loss"])
    assert r["grad_cosine"] > GRAD_COSINE, r["worst"]


ATTENTION_CASES = [(hd, mode) for hd in (64, 80, 128, 256, 512)
                   for mode in ("causal", "window", "softcap")]
"""Head widths of real models (SmolLM2 64, Phi-3 96's kin 80, Llama 128, Gemma 256, Gemma 4's
full blocks 512) that MLX's fused attention may or may not take on each GPU, each causal, with
a sliding window (gemma2/3/4's) and soft-capped (gemma2's, composed by toymlx)."""


def attention_case(hd: int, mode: str, T: int, ops: Ops, stream: Any) -> tuple[float, float]:
    """`ops.attention` on `stream` against the exact Ops' float32 one on the CPU, for 8 query
    heads over 2 kv heads of width hd and T positions (`mode`: causal, window (16 back) or
    softcap (at 1.0, which binds)): the output's relative error and the smallest cosine of the
    q, k and v gradients for one random cotangent."""
    rng = np.random.default_rng(hd + T)
    q, k, v, c = (mx.array(rng.standard_normal(s).astype(np.float32))
                  for s in ((1, 8, T, hd), (1, 2, T, hd), (1, 2, T, hd), (1, 8, T, hd)))
    kw = {"window": 16 if mode == "window" else None,
          "softcap": 1.0 if mode == "softcap" else None}

    def run(o: Ops) -> tuple[np.ndarray, list[np.ndarray]]:
        x = [a.astype(o.mx_dtype) for a in (q, k, v)]
        out, grads = mx.vjp(lambda *a: [o.attention(*a, hd ** -0.5, causal=True, **kw)], x,
                            [c.astype(o.mx_dtype)])
        return (np.array(out[0].astype(mx.float32), np.float64),
                [np.array(g.astype(mx.float32), np.float64).ravel() for g in grads])

    with mx.stream(mx.cpu):
        want, want_g = run(Ops())
    with mx.stream(stream):
        got, got_g = run(ops)
    cos = min(float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b))) for a, b in zip(want_g, got_g))
    return relative(got, want), cos
