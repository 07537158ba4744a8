"""lm_loss with its logits in chunks of tokens equals the whole-logits loss: values and
gradients, on MLX's ops and on the vectorised CPU kernels, tied, untied, soft-capped and LoRA."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx import nn
from mlx.utils import tree_flatten

from toymlx.models.llama import Llama, tiny
from toymlx.models.lora import apply_lora
from toymlx.models.losses import LOGITS_CHUNK_VALUES, lm_loss, logits_chunk
from toymlx.models.ops import CUDA_LOGITS_VALUES, Ops


def _whole_logits_loss(model: nn.Module, batch: dict) -> mx.array:
    """The loss as toymlx computed it before chunking: [B, T, V] logits in one piece."""
    ce = model.ops.cross_entropy(model(batch["inputs"]), batch["targets"])
    return (ce * batch["mask"]).sum() / mx.maximum(batch["mask"].sum(), 1.0)


def _batch(vocab: int, B: int = 2, T: int = 40) -> dict:
    rng = np.random.default_rng(0)
    mask = (rng.random((B, T)) > 0.2).astype(np.float32)
    mask[1, 30:] = 0  # a padded tail
    return {"inputs": mx.array(rng.integers(0, vocab, (B, T))),
            "targets": mx.array(rng.integers(0, vocab, (B, T))),
            "mask": mx.array(mask)}


def _model(ops: Ops, lora: bool, **kw) -> Llama:
    mx.random.seed(1)
    model = Llama(tiny(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, **kw), ops)
    if lora:
        apply_lora(model, ("q", "v"), rank=4)
        # lora_b nonzero, so that lora_a's gradient is too
        model.update({"layers": [{"attn": {k: {"lora_b": mx.random.normal(
            getattr(layer.attn, k).lora_b.shape, scale=0.1)} for k in ("q_proj", "v_proj")}}
            for layer in model.layers]})
    return model


CASES = [
    ("mlx", {}, False), ("vectorised", {}, False),
    ("mlx", {"tie_embeddings": False}, False), ("vectorised", {"tie_embeddings": False}, False),
    ("mlx", {"final_softcap": 3.0}, False), ("vectorised", {"final_softcap": 3.0}, False),
    ("mlx", {}, True), ("vectorised", {"tie_embeddings": False}, True),
]


@pytest.mark.parametrize("kernels,args,lora", CASES)
def test_chunked_loss_and_gradients_equal_whole_logits(kernels, args, lora):
    model = _model(Ops(kernels=kernels), lora, **args)
    batch = _batch(model.args.vocab_size)
    whole_loss, whole_g = nn.value_and_grad(model, _whole_logits_loss)(model, batch)
    params = model.trainable_parameters()
    for chunk in (32, 7, 80):  # 80 = B*T: one piece, nothing recomputed
        (loss, n), g = nn.value_and_grad(model, lambda m, b, c=chunk: lm_loss(m, b, c))(
            model, batch)
        model.update(params)
        assert float(n) == float(batch["mask"].sum())
        assert abs(float(loss) - float(whole_loss)) <= 1e-6
        gw, gc = dict(tree_flatten(whole_g)), dict(tree_flatten(g))
        assert sorted(gw) == sorted(gc) and len(gw) > 0
        for name, want in gw.items():
            np.testing.assert_allclose(np.asarray(gc[name]), np.asarray(want),
                                       rtol=0, atol=1e-5, err_msg=name)
    if lora:  # the frozen token table gets no gradient, chunked or not
        assert not any(k.startswith(("embed", "output")) for k in gw)
    else:
        assert model.head_key() + ".weight" in gw


def test_chunked_loss_compiled_equals_eager():
    model = _model(Ops(kernels="vectorised"), False)
    batch = _batch(model.args.vocab_size)
    params = model.trainable_parameters()
    grad = nn.value_and_grad(model, lambda m, b: lm_loss(m, b, 32))
    (eager, _), ge = grad(model, batch)
    model.update(params)

    @mx.compile
    def step(b):
        (loss, _), g = grad(model, b)
        return loss, g
    compiled, gc = step(batch)
    model.update(params)
    assert abs(float(compiled) - float(eager)) <= 1e-6
    for (k, a), (_, b) in zip(tree_flatten(ge), tree_flatten(gc)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=0, atol=1e-5, err_msg=k)


def test_logits_chunk_sizes():
    assert logits_chunk(262144) == 32  # Gemma 3: 16 x 262,144 = LOGITS_CHUNK_VALUES; at least 32
    assert logits_chunk(49152) == 64  # SmolLM2: 85 rounded down to a multiple of 32
    assert logits_chunk(259) == LOGITS_CHUNK_VALUES // 259 // 32 * 32
    assert logits_chunk(10 ** 7) == 32
    # a GPU's Ops.logits_values (2^23): SmolLM2's 8 x 1024 tokens in 52 chunks of 160, not 128
    assert logits_chunk(49152, CUDA_LOGITS_VALUES) == 160


def test_head_slice_sizes():
    """Rows of a frozen head read at once: HEAD_SLICE_VALUES (2^20) over the wider of tokens and
    width, a multiple of 256, at least HEAD_SLICE_MIN_ROWS (1024)."""
    from toymlx.models.losses import head_slices

    gemma = head_slices(262144, 512, 640)  # 2^20 / 640 = 1638 -> 1536 rows
    assert gemma[0] == (0, 1536) and len(gemma) == 171 and gemma[-1] == (170 * 1536, 262144)
    assert head_slices(49152, 512, 576)[0] == (0, 1792)  # SmolLM2: 1820 -> 1792
    assert head_slices(49152, 2048, 576)[0] == (0, 1024)  # 512 rows -> the 1024-row floor
    llama3 = head_slices(128256, 512, 4096)  # 256 -> 1024 rows: 126 slices
    assert llama3[0] == (0, 1024) and len(llama3) == 126 and llama3[-1][1] == 128256
    assert head_slices(259, 4, 8) == [(0, 259)]  # a vocabulary under one slice
    # a GPU's Ops.logits_values (2^23): SmolLM2 over 8 x 512 tokens, 24 slices of 2048 rows
    gpu = head_slices(49152, 4096, 960, CUDA_LOGITS_VALUES)
    assert gpu[0] == (0, 2048) and len(gpu) == 24


def _primitives(*outputs: mx.array, tmp_path) -> set[str]:
    """The names of the primitives that compute `outputs` (their lazy graph, MLX's dot export)."""
    import re

    path = tmp_path / "graph.dot"
    mx.export_to_dot(str(path), *outputs)
    return set(re.findall(r'label ="([^"]+)", shape=rectangle', path.read_text()))


def test_targets_in_slices_against_numpy_and_without_kernels_of_their_own(tmp_path):
    """Each target's column in each slice of a frozen head, and whether it lies there, as numpy
    computes them (a last slice shorter than the rest included); the computation holds no op
    `mx.compile` fuses with the slice width as a constant (a remainder, floor division or
    minimum: each built a CPU kernel for every vocabulary and batch size)."""
    from toymlx.models.losses import _targets_in_slices, head_slices

    vocab = 3000  # 1024-row slices: 1024, 1024, 952
    slices = head_slices(vocab, 1024, 64)
    assert [b - a for a, b in slices] == [1024, 1024, 952]
    t = np.array([0, 1023, 1024, 2047, 2048, 2999, 2100, 5], np.int32)
    got = _targets_in_slices(mx.array(t), slices)
    fused_with_constants = {"Remainder", "FloorDivide", "Divide", "Minimum", "Subtract"}
    # (read before anything evaluates them: an evaluated array keeps no graph)
    assert not _primitives(*[x for pair in got for x in pair], tmp_path=tmp_path) & \
        fused_with_constants
    for (a, b), (col, inside) in zip(slices, got):
        want_inside = (t >= a) & (t < b)
        assert np.array_equal(np.array(inside)[:, 0], want_inside)
        assert np.array_equal(np.array(col)[:, 0][want_inside], (t - a)[want_inside])
        assert np.array(col).min() >= 0 and np.array(col).max() < b - a  # every gather in range


def _wide_vocab_model() -> tuple[Llama, dict]:
    """A 1-block model with a 16,384-token vocabulary, only its q projection trainable, and a
    batch of 2 x 256 tokens."""
    mx.random.seed(0)
    model = Llama(tiny(vocab_size=16384, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2,
                       ffn_dim=64), Ops(kernels="vectorised"))
    model.freeze()
    model.layers[0].attn.q_proj.unfreeze()
    batch = _batch(16384, B=2, T=256)
    mx.eval(model.parameters(), batch)
    return model, batch


@pytest.mark.parametrize("head", ["frozen", "trained"])
def test_a_gpus_logits_values_give_the_cpus_loss_and_gradients(head):
    """`Ops.logits_values` sizes the loss's slices and chunks, not its numbers: 2^23 values (a
    GPU's: one slice of the 16,384-row head, one chunk of the 512 tokens) against the CPU's sizes
    (8 slices of 2048 rows; 2 chunks of 256 tokens): loss within 1e-6, gradients within 1e-5."""
    from toymlx.models import losses

    assert len(losses.head_slices(16384, 512, 32)) == 8 and logits_chunk(16384) == 256
    results = []
    for values in (None, CUDA_LOGITS_VALUES):
        mx.random.seed(0)
        model = Llama(tiny(vocab_size=16384, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2,
                           ffn_dim=64), Ops(logits_values=values))
        model.freeze()
        model.layers[0].attn.q_proj.unfreeze()
        if head == "trained":
            model.embed.unfreeze()
        assert (model.frozen_head() is None) == (head == "trained")
        batch = _batch(16384, B=2, T=256)
        (loss, _), g = nn.value_and_grad(model, lm_loss)(model, batch)
        results.append((loss.item(), dict(tree_flatten(g))))
    (cpu_loss, cpu_g), (gpu_loss, gpu_g) = results
    assert abs(gpu_loss - cpu_loss) < 1e-6
    assert cpu_g.keys() == gpu_g.keys()
    for k in cpu_g:
        np.testing.assert_allclose(np.array(gpu_g[k]), np.array(cpu_g[k]), atol=1e-5, rtol=0)


def _gradient_peak(model: Llama, batch: dict, loss_fn) -> int:
    """MLX's peak above the memory in use before one gradient of `loss_fn`."""
    grad = nn.value_and_grad(model, loss_fn)
    mx.synchronize()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    (loss, _), g = grad(model, batch)
    mx.eval(loss, g)
    peak = mx.get_peak_memory() - base
    del loss, g
    return peak


def test_chunked_logits_never_live_whole():
    """The peak of a gradient through a trained head above the weights: chunks of 32 tokens
    against all 512 tokens' logits at once (vocabulary 16,384: 32 MB a copy whole)."""
    model, batch = _wide_vocab_model()
    model.embed.unfreeze()  # the tied head trains: the token-chunked path
    assert model.frozen_head() is None
    peaks = {chunk: _gradient_peak(model, batch, lambda m, b, c=chunk: lm_loss(m, b, c))
             for chunk in (512, 32)}
    whole_copy = 512 * 16384 * 4
    assert peaks[512] > 4 * whole_copy  # the whole logits, several copies of them
    # one chunk of 32 at a time: 1/16 of the whole (2.2 whole copies measured, against 17)
    assert peaks[32] < peaks[512] / 6


def test_a_frozen_head_in_slices_never_holds_the_whole_logits(monkeypatch):
    """A LoRA-style gradient (head frozen): the head read 1,024 rows at a time peaks below a
    quarter of reading all 16,384 rows at once (512 tokens: 32 MB a copy whole)."""
    from toymlx.models import losses

    model, batch = _wide_vocab_model()
    assert model.frozen_head() is model.embed
    peaks = {}
    for rows in (16384, 1024):
        monkeypatch.setattr(losses, "head_slices", lambda v, n, d, values=None, r=rows: [
            (a, min(a + r, v)) for a in range(0, v, r)])
        peaks[rows] = _gradient_peak(model, batch, lambda m, b: lm_loss(m, b))
    whole_copy = 512 * 16384 * 4
    assert peaks[16384] > 2 * whole_copy
    assert peaks[1024] < peaks[16384] / 4


def test_a_frozen_head_is_read_once_a_training_step(monkeypatch):
    """With grad (the training loss), the forward pass accumulates the input gradient, so the
    backward pass reads no slice of the head again: 16 slices read once each, against twice
    each by the held-out path's recomputing backward (grad False)."""
    from toymlx.models import losses

    model, batch = _wide_vocab_model()
    monkeypatch.setattr(losses, "head_slices", lambda v, n, d, values=None: [
        (a, min(a + 1024, v)) for a in range(0, v, 1024)])
    real = losses.row_reader
    reads = []

    def counting(layer):
        arrays, rows = real(layer)
        return arrays, lambda arrs, a, b: reads.append((a, b)) or rows(arrs, a, b)

    monkeypatch.setattr(losses, "row_reader", counting)
    for grad, want in ((True, 16), (False, 32)):
        reads.clear()

        def loss(m, b, grad=grad):
            h = m.hidden(b["inputs"])
            return losses.masked_ce_sum(m, h, b["targets"], b["mask"], 512, grad=grad)

        value, grads = nn.value_and_grad(model, loss)(model, batch)
        mx.eval(value, grads)
        assert len(reads) == want, (grad, len(reads))
