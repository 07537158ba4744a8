"""Mixed precision (`--dtype`), the checkpoints' tensor type (`--save-dtype`), float16's loss
scale and activation checkpointing (`--grad-checkpoint`), on the CPU.

Half precision runs ~25x slower than float32 on MLX's CPU, so the models here are small; the
rules under test (float32 master weights and moments, half-precision activations, losses
within a stated distance of float32's, exact resume) are the same on a GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType as Q
from mlx import nn
from mlx.utils import tree_flatten
from toymlx_cli.train import main

from toymlx.backend import device
from toymlx.bundle.checkpoint import resolve_latest, state_path
from toymlx.bundle.events import read_events
from toymlx.gguf.llama import load_llama
from toymlx.gguf.reader import GGUFFile
from toymlx.gguf.writer import encode_tensor
from toymlx.models.llama import Llama, attention_values, tiny
from toymlx.models.lora import apply_lora
from toymlx.models.losses import classify_loss, lm_loss
from toymlx.models.ops import Ops, scoring_ops, training_ops
from toymlx.models.vit import ViT, ViTArgs
from toymlx.training.step import LossScale, make_step

LLAMA = ["--model.d-model", "64", "--model.n-layers", "2", "--model.n-heads", "4",
         "--model.n-kv-heads", "2", "--model.ffn-dim", "128", "--seq-len", "64",
         "--batch-size", "8", "--eval-batches", "1", "--no-progress", "--lr", "3e-3",
         "--warmup", "5"]
VIT = ["--model.d-model", "48", "--model.n-layers", "2", "--model.n-heads", "2",
       "--model.ffn-dim", "96", "--batch-size", "32", "--no-progress", "--lr", "1e-3",
       "--warmup", "5"]


def _steps(run: Path) -> list[dict]:
    return [e for e in read_events(run) if e["kind"] == "step"]


def _train(tmp: Path, run_id: str, recipe: str, *args: str) -> Path:
    assert main(["--recipe", recipe, "--runs-root", str(tmp), "--run-id", run_id, *args]) == 0
    return tmp / run_id


@pytest.fixture(scope="module")
def text_file(shared_file) -> str:
    return str(shared_file("text/tinyshakespeare.txt"))


def test_training_ops_resolve_auto_per_device():
    # MLX's exp and erf where this process's kernels were checked to compute fastmath's forms
    assert training_ops(on_gpu=False) == Ops(kernels="vectorised", decode_slice=None,
                                             subnormals="flush", attention_keep_limit=4096,
                                             kernel_forms=device.kernel_forms())
    assert not training_ops(on_gpu=False, compiled=False).kernel_forms  # eager: composed forms
    assert training_ops(False, subnormals="keep").subnormals == "keep"
    # block-held weights: whole, except where --grad-checkpoint asks for memory first
    assert training_ops(False, grad_checkpoint=True).decode_slice == 1 << 22
    assert scoring_ops(on_gpu=False).decode_slice == 1 << 22
    gpu = training_ops(on_gpu=True)
    assert (gpu.kernels, gpu.dtype, gpu.exact_rope) == ("mlx", "bfloat16", False)
    # attention recomputed in the backward pass on Metal; kept for short rows on CUDA
    assert gpu.attention_keep_limit == (0 if sys.platform == "darwin" else 8192)
    # a GPU's loss reads the logits in fewer, larger slices; the CPU's at its own sizes
    cuda = sys.platform != "darwin"  # a GPU here is CUDA's; Metal keeps the CPU's sizes
    assert (gpu.logits_values, training_ops(on_gpu=False).logits_values) == (
        1 << 23 if cuda else None, None)
    assert training_ops(True, grad_checkpoint=True).logits_values is None  # memory first
    assert training_ops(False, "bfloat16").kernels == "mlx"  # fastmath is float32 only
    with pytest.raises(ValueError, match="--kernels vectorised: expected --dtype float32"):
        training_ops(False, "float16", "vectorised")


def _half_llama_args(text_file: str) -> list[str]:
    return ["--steps", "30", "--eval-every", "0", "--data.path", text_file, *LLAMA]


@pytest.fixture(scope="module")
def llama_f32_losses(tmp_path_factory, text_file) -> list[float]:
    """The float32 losses both half-precision runs are held to (one run, read only)."""
    run = _train(tmp_path_factory.mktemp("f32"), "f32", "from-scratch",
                 *_half_llama_args(text_file))
    return [e["loss"] for e in _steps(run)]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_llama_follows_float32(tmp_path, text_file, llama_f32_losses, dtype):
    """30 steps of the tiny Llama in half precision stay within 0.05 nats of float32's losses
    at every step (measured: bf16 ~0.01-0.02, f16 ~0.002); master weights and moments stay
    float32, and run_start records the math."""
    ref = llama_f32_losses
    run = _train(tmp_path, dtype, "from-scratch", *_half_llama_args(text_file), "--dtype", dtype)
    steps = _steps(run)
    got = [e["loss"] for e in steps]
    gap = np.abs(np.array(got) - np.array(ref))
    print(f"{dtype} vs float32, tiny Llama, 30 steps: max |loss gap| {gap.max():.4f}, "
          f"final {got[-1]:.4f} vs {ref[-1]:.4f}")
    assert gap.max() < 0.05 and got[-1] < got[0] - 1.0
    start = read_events(run)[0]
    assert start["math"] == {"kernels": "mlx", "kernel_forms": False, "dtype": dtype,
                             "exact_rope": True,
                             "grad_checkpoint": False, "decode_slice": None,
                             "subnormals": "flush", "attention_keep_limit": 4096,
                             "logits_values": None}
    if dtype == "float16":
        assert all(e["loss_scale"] > 0 for e in steps) and "skipped" in steps[0]
    g = GGUFFile(resolve_latest(run))  # the default checkpoint stays F32
    assert {t.type for t in g.tensors.values()} == {Q.F32}


def test_bf16_vit_follows_float32(tmp_path):
    """ViT on the digits (mixup on: per-step losses are noisy, and rounding moves the two runs
    apart step by step): each 10-step window's mean loss within 0.05 nats of float32's
    (measured ~0.02), the held-out loss within 0.05."""
    common = ["--steps", "30", "--eval-every", "0", *VIT]
    runs = {d: _train(tmp_path, d, "vit-tiny", *common, "--dtype", d)
            for d in ("float32", "bfloat16")}
    ref, got = ([e["loss"] for e in _steps(runs[d])] for d in ("float32", "bfloat16"))
    windows = np.abs(np.reshape(got, (3, 10)).mean(1) - np.reshape(ref, (3, 10)).mean(1))
    val = {d: next(e["val_loss"] for e in read_events(r) if e["kind"] == "eval")
           for d, r in runs.items()}
    print(f"bfloat16 vs float32, ViT on the digits, 30 steps: 10-step window gaps "
          f"{np.round(windows, 4).tolist()}, held-out {val['bfloat16']:.4f} vs "
          f"{val['float32']:.4f}")
    assert windows.max() < 0.05 and abs(val["bfloat16"] - val["float32"]) < 0.05
    assert np.mean(got[-10:]) < np.mean(got[:10]) - 0.3


def test_mixed_precision_keeps_float32_masters():
    """Activations in bf16, trainable weights and AdamW's moments float32, gradients float32."""
    mx.random.seed(0)
    model = Llama(tiny(d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=64),
                  Ops(dtype="bfloat16"))
    tokens = mx.array(np.random.default_rng(0).integers(0, 259, (2, 17)).astype(np.int32))
    assert model(tokens[:, :-1]).dtype == mx.bfloat16
    opt = optim.AdamW(1e-3)
    step = make_step(model, lm_loss, opt)
    batch = {"inputs": tokens[None, :, :-1], "targets": tokens[None, :, 1:],
             "mask": mx.ones((1, 2, 16))}
    out = step(batch)
    mx.eval(out, model.state, opt.state)
    assert out["loss"].dtype == mx.float32 and np.isfinite(out["loss"].item())
    assert {v.dtype for _, v in tree_flatten(model.parameters())} == {mx.float32}
    moments = [v for k, v in tree_flatten(opt.state) if k.endswith(("m", "v"))]
    assert moments and {v.dtype for v in moments} == {mx.float32}


KERNELS = ("embed", "linear", "rms_norm", "layer_norm", "rope", "attention", "silu_mul", "gelu",
           "unembed")


@pytest.mark.parametrize("which", ["llama-exact-rope", "llama-fast-rope", "llama-lora", "vit"])
def test_half_precision_activations_never_widen(monkeypatch, which):
    """In a bfloat16 forward every kernel the model asks its `Ops` for returns bfloat16: one
    float32 operand (a RoPE table, a bias, a position embedding) would silently promote the rest
    of the block to float32, which the final logits' dtype does not show (the next linear casts
    back) and which costs a GPU half its speed. Only the loss is float32."""
    seen: list[tuple[str, mx.Dtype]] = []

    def spy(name: str):
        kernel = getattr(Ops, name)

        def call(self, *args, **kw):
            out = kernel(self, *args, **kw)
            seen.append((name, out.dtype))
            return out
        return call

    for name in KERNELS:
        monkeypatch.setattr(Ops, name, spy(name))
    mx.random.seed(0)
    ops = Ops(dtype="bfloat16", exact_rope=which != "llama-fast-rope")
    if which == "vit":
        model = ViT(ViTArgs(image_size=8, patch_size=4, channels=3, d_model=32, n_layers=1,
                            n_heads=2, ffn_dim=64, num_classes=5), ops)
        batch = {"images": mx.random.uniform(shape=(2, 8, 8, 3)), "labels": mx.array([1, 3])}
        loss_fn = classify_loss
    else:
        model = Llama(tiny(d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=64), ops)
        if which == "llama-lora":
            apply_lora(model, ("q", "v", "down"))
        tokens = mx.array(np.random.default_rng(0).integers(0, 259, (2, 17)).astype(np.int32))
        batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": mx.ones((2, 16))}
        loss_fn = lm_loss
    (loss, _), grads = nn.value_and_grad(model, loss_fn)(model, batch)
    mx.eval(loss, grads)
    widened = sorted({name for name, dtype in seen if dtype != mx.bfloat16})
    assert seen and not widened, f"{which}: float32 out of {widened}"
    assert loss.dtype == mx.float32
    assert {v.dtype for _, v in tree_flatten(grads)} == {mx.float32}  # masters' gradients


def test_float16_loss_scale_skips_overflow_and_grows():
    """An overflowing step changes nothing but the scale (halved); after growth_interval good
    steps the scale doubles."""
    mx.random.seed(1)
    model = Llama(tiny(d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=64),
                  Ops(dtype="float16"))
    tokens = mx.array(np.random.default_rng(1).integers(0, 259, (2, 17)).astype(np.int32))
    batch = {"inputs": tokens[None, :, :-1], "targets": tokens[None, :, 1:],
             "mask": mx.ones((1, 2, 16))}
    opt = optim.AdamW(1e-2)
    opt.init(model.trainable_parameters())
    scale = LossScale(init=2.0**15, growth_interval=2)
    step = make_step(model, lm_loss, opt, scale=scale)
    before = {k: np.array(v) for k, v in tree_flatten(model.parameters())}
    scale.state["scale"] = mx.array(1e30)  # the loss times this overflows float16's backward
    out = step(batch)
    mx.eval(out, model.state, opt.state, scale.state)
    assert bool(out["skipped"].item()) and np.isfinite(out["loss"].item())
    assert scale.state["scale"].item() == pytest.approx(5e29, rel=1e-6)
    for k, v in tree_flatten(model.parameters()):
        np.testing.assert_array_equal(np.array(v), before[k])
    assert int(opt.state["step"].item()) == 0  # the optimizer did not move either
    scale.state["scale"] = mx.array(1024.0)
    for _ in range(2):
        out = step(batch)
        mx.eval(out, model.state, opt.state, scale.state)
        assert not bool(out["skipped"].item())
    assert scale.state["scale"].item() == 2048.0 and int(opt.state["step"].item()) == 2
    moved = [k for k, v in tree_flatten(model.parameters())
             if not np.array_equal(np.array(v), before[k])]
    assert moved


def test_float16_gradients_need_the_loss_scale():
    """Why float16 trains with a loss scale: without it most of a language model's small
    gradients flush to zero; with it they match float32's."""
    mx.random.seed(2)
    ref = Llama(tiny(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128))
    tokens = mx.array(np.random.default_rng(2).integers(0, 259, (8, 65)).astype(np.int32))
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": mx.ones((8, 64))}

    def grads(model, s):
        def loss(m, b):
            value, n = lm_loss(m, b)
            return value * s, n
        _, g = nn.value_and_grad(model, loss)(model, batch)
        return {k: np.array(v) / s for k, v in tree_flatten(g)}

    want = grads(ref, 1.0)
    half = Llama(ref.args, Ops(dtype="float16"))
    half.update(ref.parameters())

    def rel_err(g):
        return max(np.linalg.norm(g[k] - want[k]) / np.linalg.norm(want[k]) for k in want)

    plain, scaled = rel_err(grads(half, 1.0)), rel_err(grads(half, 2.0**15))
    print(f"float16 gradient error vs float32 (worst tensor): unscaled {plain:.3g}, "
          f"scaled 2^15 {scaled:.3g}")
    assert scaled < 0.05 and plain > 3 * scaled


def test_save_dtype_writes_half_tensors_and_resume_stays_exact(tmp_path, text_file, capsys):
    """--save-dtype bf16: matrices BF16 (norms F32) in the GGUF, the float32 weights in the
    resume state; a run resumed from it gives bit-identical losses to an uninterrupted one.
    --dtype bfloat16 on the CPU is said (~20x slower than float32 there)."""
    common = ["--steps", "8", "--checkpoint-every", "4", "--eval-every", "0",
              "--data.path", text_file, "--dtype", "bfloat16", "--save-dtype", "bf16", *LLAMA]
    full = [e["loss"] for e in _steps(_train(tmp_path, "full", "from-scratch", *common))]
    assert capsys.readouterr().err.count("toymlx-train: --dtype bfloat16 on the CPU: MLX "
                                         "computes half precision there without BLAS") == 1
    part = _train(tmp_path, "part", "from-scratch", *common, "--stop-at", "4")
    ckpt = resolve_latest(part)
    g = GGUFFile(ckpt)
    types = {n: t.type for n, t in g.tensors.items()}
    assert {types[n] for n in types if n.endswith("norm.weight")} == {Q.F32}
    assert {types[n] for n in types if not n.endswith("norm.weight")} == {Q.BF16}
    assert g.metadata["general.file_type"] == 32  # LLAMA_FTYPE_MOSTLY_BF16
    state = mx.load(str(state_path(ckpt)))
    assert any(k.startswith("param.") for k in state)
    assert main(["--resume", str(part), "--no-progress"]) == 0
    resumed = [e["loss"] for e in _steps(part)][-8:]
    assert resumed == full
    model, _ = load_llama(ckpt)  # what a reader of the file gets: the bf16-rounded weights
    assert model.layers[0].attn.q_proj.weight.dtype == mx.float32


def test_encode_tensor_bf16_rounds_to_nearest_even():
    x = np.array([[1.0, 1.00390625, 1.01171875, -2.5e-3, np.inf, np.nan, 3.0e38]], np.float32)
    t = encode_tensor("w", x, "bf16")
    back = (t.data.astype(np.uint32) << 16).view(np.float32)
    # 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties go to the even mantissa (1.0);
    # 1 + 3*2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6: ties go to 1 + 2^-6
    np.testing.assert_array_equal(back[0, :3], [1.0, 1.0, 1.015625])
    assert abs(back[0, 3] - x[0, 3]) <= abs(x[0, 3]) * 2**-8
    assert np.isinf(back[0, 4]) and np.isnan(back[0, 5]) and np.isfinite(back[0, 6])
    assert encode_tensor("n", np.ones(4, np.float32), "bf16").dtype == np.float32  # 1-D: F32


_PEAK = """
import json
import numpy as np
import toymlx
import mlx.core as mx
from mlx import nn
from toymlx.models.lora import apply_lora
from toymlx.models.losses import classify_loss, lm_loss
from toymlx.models.llama import Llama, tiny
from toymlx.models.ops import Ops

peak = {}
for flag in ("1", "0"):  # checkpointing first: what is left of it counts against it
    mx.random.seed(3)
    args = tiny(d_model=128, n_layers=8, n_heads=4, n_kv_heads=2, ffn_dim=384)
    model = Llama(args, Ops(kernels="vectorised", grad_checkpoint=flag == "1"))
    mx.eval(model.parameters())
    tokens = mx.array(np.random.default_rng(3).integers(0, 259, (2, 1025)).astype(np.int32))
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": mx.ones((2, 1024))}
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    (loss, _), g = nn.value_and_grad(model, lm_loss)(model, batch)
    mx.eval(loss, g)
    peak[flag] = {"peak_mib": (mx.get_peak_memory() - base) / 2**20, "loss": loss.item()}
    del model, batch, tokens, loss, g
    mx.clear_cache()
print(json.dumps(peak))
"""


def test_grad_checkpoint_same_gradients_less_memory():
    """Recomputing each block in the backward pass gives the same gradients, and keeps fewer
    activations alive: peak memory of one value_and_grad of 8 blocks on 2 x 1024 tokens
    (measured here 217 -> 149 MiB; 4 blocks 197 -> 125 MiB before attention was recomputed
    without it too, 144 -> 129 after), one after the other in a fresh process with MLX's
    default evaluation width (see device.setup_process), its cache emptied between them (the
    same peaks as a process each, 231.8 and 148.4 MiB, with one process start less)."""
    mx.random.seed(3)
    args = tiny(d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=128)
    plain = Llama(args, Ops(kernels="vectorised"))
    ckpt = Llama(args, Ops(kernels="vectorised", grad_checkpoint=True))
    ckpt.update(plain.parameters())
    tokens = mx.array(np.random.default_rng(3).integers(0, 259, (2, 129)).astype(np.int32))
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": mx.ones((2, 128))}
    (l1, _), g1 = nn.value_and_grad(plain, lm_loss)(plain, batch)
    (l2, _), g2 = nn.value_and_grad(ckpt, lm_loss)(ckpt, batch)
    assert abs(l1.item() - l2.item()) <= 1e-6 * abs(l1.item())
    g2 = dict(tree_flatten(g2))
    for k, v in tree_flatten(g1):
        np.testing.assert_allclose(np.array(g2[k]), np.array(v), rtol=1e-4, atol=1e-6)

    env = {k: v for k, v in os.environ.items() if k != "MLX_BFS_MAX_WIDTH"}
    r = subprocess.run([sys.executable, "-c", _PEAK], env=env, capture_output=True, text=True,
                       timeout=300, check=True)
    peak = json.loads(r.stdout.strip().splitlines()[-1])
    print(f"grad checkpoint: peak {peak['1']['peak_mib']:.1f} MiB vs "
          f"{peak['0']['peak_mib']:.1f} MiB without")
    assert peak["1"]["loss"] == peak["0"]["loss"]
    assert peak["1"]["peak_mib"] < 0.8 * peak["0"]["peak_mib"]


def _no_recomputation(ops, fn, params, *arrays):
    """`Ops.recomputed` undone: attention's activations kept for the backward pass."""
    return fn(params, *arrays)


def _loss_and_grads(args, ops: Ops, tokens: mx.array):
    mx.random.seed(5)
    model = Llama(args, ops)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
             "mask": mx.ones(tokens[:, 1:].shape)}

    def loss(params):
        model.update(params)
        return lm_loss(model, batch)[0]

    return mx.compile(mx.value_and_grad(loss))(model.trainable_parameters())


@pytest.mark.parametrize("kernels", ["vectorised", "mlx"])
@pytest.mark.parametrize("arch", ["llama", "gemma2", "gemma3"])
def test_attention_recomputed_in_the_backward_pass_gives_the_same_gradients(
        monkeypatch, kernels, arch):
    """A block's attention (q/k norms, RoPE, scores, gemma2's soft cap, softmax, values) is
    recomputed in the backward pass instead of kept (`Ops.recomputed`): the loss and every
    gradient, the trainable q/k norms' included, bit for bit those of the attention kept whole."""
    args = tiny(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128)
    if arch == "gemma3":
        args = replace(args, arch="gemma3", key_length=32, qk_norm=True, post_norms=True,
                       embed_scale=True, activation="gelu_tanh", rope_neox=True)
    if arch == "gemma2":
        args = replace(args, arch="gemma2", key_length=32, post_norms=True, embed_scale=True,
                       activation="gelu_tanh", rope_neox=True, attn_softcap=1.0,
                       final_softcap=8.0, sliding_window=16, sliding_layers=(True, False))
    tokens = mx.array(np.random.default_rng(5).integers(0, 259, (2, 97)).astype(np.int32))
    ops = Ops(kernels=kernels)
    loss, grads = _loss_and_grads(args, ops, tokens)
    monkeypatch.setattr(Ops, "recomputed", _no_recomputation)
    kept_loss, kept_grads = _loss_and_grads(args, ops, tokens)
    assert loss.item() == kept_loss.item()
    kept = dict(tree_flatten(kept_grads))
    names = [k for k, _ in tree_flatten(grads)]
    assert any("q_norm" in k for k in names) == (arch == "gemma3")
    for k, v in tree_flatten(grads):
        np.testing.assert_array_equal(np.array(v), np.array(kept[k]), err_msg=k)


def test_attention_is_kept_up_to_the_limit_and_recomputed_beyond(monkeypatch):
    """`Ops.attention_keep_limit`: a block whose attention keeps `attention_values` values a token
    keeps them at that limit and recomputes them one value below it, with the same loss and
    gradients either way."""
    args = tiny(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128)
    tokens = mx.array(np.random.default_rng(5).integers(0, 259, (2, 97)).astype(np.int32))
    need = attention_values(args, 96)
    assert need == 2 * 64 + 32 + 4 * 96 * 5 // 8
    calls = []
    real = Ops.recomputed
    monkeypatch.setattr(Ops, "recomputed", lambda ops, *a: calls.append(1) or real(ops, *a))
    results = {}
    for limit in (need, need - 1):
        calls.clear()
        results[limit] = _loss_and_grads(args, Ops(kernels="vectorised",
                                                   attention_keep_limit=limit), tokens)
        assert len(calls) == (0 if limit == need else args.n_layers), limit
    (kept_loss, kept), (loss, grads) = results[need], results[need - 1]
    assert kept_loss.item() == loss.item()
    kept = dict(tree_flatten(kept))
    for k, v in tree_flatten(grads):
        np.testing.assert_array_equal(np.array(v), np.array(kept[k]), err_msg=k)


def _kept_values_per_token_and_block(args, T: int = 128) -> float:
    """float32 values a compiled LoRA step holds per token and block: the growth of MLX's peak
    from a 30- to a 50-block model (chains longer than the 10 operations MLX allocates ahead
    of those that ran, which a shorter chain would count too)."""
    tokens = mx.array(np.random.default_rng(6).integers(0, 259, (1, T + 1)).astype(np.int32))
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": mx.ones((1, T))}

    def peak(n: int) -> int:
        model = Llama(replace(args, n_layers=n), Ops(kernels="vectorised"))
        model.freeze()
        apply_lora(model, ("q", "v"))

        def loss(params):
            model.update(params)
            return lm_loss(model, batch)[0]

        step = mx.compile(mx.value_and_grad(loss))
        params = model.trainable_parameters()
        mx.eval(step(params))
        mx.reset_peak_memory()
        held = mx.get_active_memory()
        mx.eval(step(params))
        return mx.get_peak_memory() - held

    return (peak(50) - peak(30)) / 20 / T / 4


def test_a_block_keeps_q_k_v_not_attentions_probabilities(monkeypatch):
    """With attention recomputed in the backward pass, a block no longer keeps its heads'
    probabilities (4 heads x 5/8 of 128 keys = 320 values a token here), nor q and k rotated
    and attention's output: measured here 1,432 -> 1,024 values a token and block (6 d-wide
    arrays, q, k and v as projected, SwiGLU's 4 ffn-wide ones: 1,024)."""
    args = tiny(d_model=64, n_heads=4, n_kv_heads=2, ffn_dim=128)
    recomputed = _kept_values_per_token_and_block(args)
    monkeypatch.setattr(Ops, "recomputed", _no_recomputation)
    kept = _kept_values_per_token_and_block(args)
    print(f"values a token and block: {kept:.0f} kept, {recomputed:.0f} recomputed")
    assert kept - recomputed >= 320, (kept, recomputed)
