"""A frozen base held as the file's own quantized blocks (toymlx.gguf.blocks, BlockLinear):
every type decodes to gguf-py's float32 values bit for bit, and a model holding its blocks
computes the float32-held model's logits and LoRA gradients exactly, without keeping every
layer's float weights through the backward pass."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
import pytest
from gguf import quants
from gguf.constants import GGMLQuantizationType as T
from mlx import nn
from mlx.utils import tree_flatten

from toymlx.data.tokenizer import byte_tokenizer
from toymlx.gguf.blocks import CODECS, decode_rows, held_bytes, random_blocks, split_rows
from toymlx.gguf.llama import load_llama, write_llama
from toymlx.gguf.reader import GGUFFile
from toymlx.gguf.writer import QuantTensor, write_gguf
from toymlx.models.layers import BlockEmbedding, BlockLinear
from toymlx.models.llama import Llama, tiny
from toymlx.models.lora import apply_lora, lora_layers
from toymlx.models.losses import lm_loss
from toymlx.models.ops import Ops
from toymlx.training.step import make_step

ARGS = tiny(d_model=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=512, context=128)
TRAINING = Ops(kernels="vectorised")  # the CPU training step's math


def test_every_listed_type_has_a_codec():
    """The types the issue lists, the ones people download."""
    names = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"]
    assert {t.name for t in CODECS} == set(names)


@pytest.mark.parametrize("t", list(CODECS), ids=lambda t: t.name)
def test_every_codec_decodes_gguf_py_values_bit_for_bit(t):
    """Each type's decode, eager and compiled, and rows taken as an embedding takes them,
    equals gguf-py's dequantization of the same bytes exactly; the held arrays are within 4%
    of the file's bytes."""
    codec = CODECS[t]
    rows, n_in = 5, 3 * codec.block_values
    raw = random_blocks(codec, rows, 3)
    want = quants.dequantize(raw.reshape(rows, -1), t)  # (rows, n_in) float32
    parts = {k: mx.array(v) for k, v in split_rows(codec, raw, (rows, n_in)).items()}
    np.testing.assert_array_equal(np.array(decode_rows(codec, parts, (rows,))), want)
    compiled = mx.compile(lambda p: decode_rows(codec, p, (rows,)))
    np.testing.assert_array_equal(np.array(compiled(parts)), want)
    ids = mx.array([[4, 0], [2, 2]])
    taken = decode_rows(codec, {k: v[ids] for k, v in parts.items()}, (2, 2))
    np.testing.assert_array_equal(np.array(taken), want[np.array(ids)])
    assert raw.nbytes <= held_bytes(codec, (rows, n_in)) <= 1.04 * raw.nbytes


# ---- whole models ------------------------------------------------------------------------
def quantized_file(path: Path, kinds: list[T]) -> Path:
    """A random Llama whose matrices are written by gguf-py's quantizer, cycling `kinds`."""
    mx.random.seed(5)
    f32 = path.with_suffix(".f32.gguf")
    write_llama(f32, Llama(ARGS), byte_tokenizer().to_metadata(), name="tiny")
    with GGUFFile(f32) as g:
        tensors = {}
        for i, name in enumerate(g.tensors):
            w = g.load(name)
            t = kinds[i % len(kinds)]
            tensors[name] = QuantTensor(t, quants.quantize(w, t), w.shape) if w.ndim == 2 else w
        meta = {k: v for k, v in g.metadata.items() if k != "toy.tensor_sha256"}
    return write_gguf(path, meta, tensors)


def logits_and_grads(path: Path, weights: str, ops: Ops, kind: str = "lora",
                     chunk: int | None = None) -> tuple[np.ndarray, float, dict]:
    model, g = load_llama(path, ops, weights)
    g.close()
    mx.random.seed(7)
    apply_lora(model, "q,v,down", rank=4, kind=kind)
    mx.random.seed(1)
    for m in lora_layers(model).values():
        m.lora_b = mx.random.normal(m.lora_b.shape) * 0.1
    rng = np.random.default_rng(0)
    batch = {"inputs": mx.array(rng.integers(0, 259, (2, 16))),
             "targets": mx.array(rng.integers(0, 259, (2, 16))), "mask": mx.ones((2, 16))}
    logits = model(batch["inputs"])
    loss, grads = nn.value_and_grad(model, lambda m, b: lm_loss(m, b, chunk)[0])(model, batch)
    return np.array(logits), float(loss), {k: np.array(v) for k, v in tree_flatten(grads)}


def assert_same_model(path: Path, ops: Ops, kind: str = "lora", chunk: int | None = None
                      ) -> None:
    flt = logits_and_grads(path, "float32", ops, kind, chunk)
    blk = logits_and_grads(path, "blocks", ops, kind, chunk)
    np.testing.assert_array_equal(blk[0], flt[0])
    assert blk[1] == flt[1]
    assert blk[2].keys() == flt[2].keys() and len(flt[2]) == (18 if kind == "dora" else 12)
    for k in flt[2]:
        np.testing.assert_array_equal(blk[2][k], flt[2][k], err_msg=k)


@pytest.mark.parametrize("ops", [TRAINING, Ops(), Ops(grad_checkpoint=True)],
                         ids=["vectorised", "mlx", "grad-checkpoint"])
def test_block_base_computes_the_float32_base(tmp_path, ops):
    """gguf-py's types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) mixed in one file: the block-held base's
    logits, loss and LoRA gradients equal the float32-held base's bit for bit."""
    path = quantized_file(tmp_path / "mixed.gguf", [T.Q4_0, T.Q8_0, T.Q4_1, T.Q5_0, T.Q5_1])
    model, _ = load_llama(path, ops, "blocks")
    assert isinstance(model.embed, BlockEmbedding)
    assert isinstance(model.layers[0].attn.q_proj, BlockLinear)
    assert_same_model(path, ops)


def test_the_loss_in_chunks_computes_the_same_on_blocks(tmp_path):
    """The loss with the head's rows read in slices (a block-held head decodes a slice at a
    time): the same loss and gradients as the float32 base's."""
    path = quantized_file(tmp_path / "mixed.gguf", [T.Q8_0, T.Q4_0])
    assert_same_model(path, TRAINING, chunk=8)


@pytest.mark.parametrize("kind", ["tied", "untied", "softcap"])
@pytest.mark.parametrize("ops", [TRAINING, Ops()], ids=["vectorised", "mlx"])
def test_a_frozen_head_read_in_slices_gives_the_whole_logits_loss(kind, ops, monkeypatch):
    """frozen_head_cross_entropy over 64-row slices (a 259-token vocabulary: 5 slices) against
    the cross-entropy of the whole logits: loss within 1e-6, LoRA and input gradients 1e-5."""
    from toymlx.models import losses

    monkeypatch.setattr(losses, "head_slices", lambda v, n, d, values=None: [(a, min(a + 64, v))
                                                             for a in range(0, v, 64)])
    args = tiny(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, context=64,
                tie_embeddings=kind != "untied", final_softcap=3.0 if kind == "softcap" else None)
    mx.random.seed(2)
    model = Llama(args, ops)
    apply_lora(model, "q,v", rank=4)
    for m in lora_layers(model).values():
        m.lora_b = mx.random.normal(m.lora_b.shape) * 0.1
    assert model.frozen_head() is not None
    rng = np.random.default_rng(0)
    batch = {"inputs": mx.array(rng.integers(0, 259, (2, 24))),
             "targets": mx.array(rng.integers(0, 259, (2, 24))),
             "mask": mx.array((rng.random((2, 24)) > 0.3).astype(np.float32))}

    def whole(m, b):
        ce = m.ops.cross_entropy(m(b["inputs"]), b["targets"])
        return (ce * b["mask"]).sum() / b["mask"].sum()

    want, g_want = nn.value_and_grad(model, whole)(model, batch)
    got, g_got = nn.value_and_grad(model, lambda m, b: lm_loss(m, b)[0])(model, batch)
    assert abs(float(got) - float(want)) < 1e-6
    for (k, a), (_, b) in zip(tree_flatten(g_want), tree_flatten(g_got), strict=True):
        np.testing.assert_allclose(np.array(b), np.array(a), atol=1e-5, err_msg=k)


def test_dora_on_a_block_base_computes_the_float32_base(tmp_path):
    """DoRA's row norms of W + scale B A decode the block-held W: the same values too."""
    path = quantized_file(tmp_path / "mixed.gguf", [T.Q4_1, T.Q8_0])
    assert_same_model(path, TRAINING, kind="dora")


def test_a_weight_decoded_in_slices_computes_the_same(tmp_path):
    """At most 4096 values decoded at once (16 row slices of a 256 x 256 weight in the product,
    one 32-value block column at a time for the input gradient): the float32 base's logits and
    LoRA gradients to float32 rounding."""
    from toymlx.models import layers

    path = quantized_file(tmp_path / "mixed.gguf", [T.Q4_0, T.Q8_0])
    flt = logits_and_grads(path, "float32", TRAINING)
    sliced = replace(TRAINING, decode_slice=4096)
    assert len(layers.slices(256, max(1, sliced.decode_slice // 256))) == 16
    blk = logits_and_grads(path, "blocks", sliced)
    np.testing.assert_allclose(blk[0], flt[0], rtol=0, atol=1e-5)
    for k in flt[2]:
        np.testing.assert_allclose(blk[2][k], flt[2][k], rtol=0, atol=1e-6, err_msg=k)


def test_the_compiled_step_trains_the_same(tmp_path):
    """Three compiled AdamW steps: the same losses and adapters from blocks as from floats."""
    path = quantized_file(tmp_path / "q4.gguf", [T.Q4_0, T.Q8_0])
    out = {}
    for weights in ("float32", "blocks"):
        model, _ = load_llama(path, TRAINING, weights)
        mx.random.seed(7)
        apply_lora(model, "q,v", rank=4)
        step = make_step(model, lm_loss, optim.AdamW(1e-2))
        rng = np.random.default_rng(3)
        losses = []
        for _ in range(3):
            b = {"inputs": mx.array(rng.integers(0, 259, (1, 2, 16))),
                 "targets": mx.array(rng.integers(0, 259, (1, 2, 16))),
                 "mask": mx.ones((1, 2, 16))}
            losses.append(float(step(b)["loss"]))
        out[weights] = losses, {k: np.array(v) for k, v in
                                tree_flatten(model.trainable_parameters())}
    assert out["blocks"][0] == out["float32"][0]
    for k, v in out["float32"][1].items():
        np.testing.assert_array_equal(out["blocks"][1][k], v, err_msg=k)


def test_the_backward_pass_does_not_keep_every_float_weight(tmp_path):
    """A deep, narrow-batch model: the float32-held base peaks above its float weights; the
    block-held one stays near its blocks plus one layer's floats (were the decoded weights
    kept for the backward pass, it would peak above the float32 base)."""
    args = tiny(d_model=256, n_layers=8, n_heads=4, n_kv_heads=2, ffn_dim=1024, context=64)
    mx.random.seed(5)
    f32 = tmp_path / "deep.f32.gguf"
    write_llama(f32, Llama(args), byte_tokenizer().to_metadata(), name="deep")
    with GGUFFile(f32) as g:
        tensors = {n: QuantTensor(T.Q4_0, quants.quantize(g.load(n), T.Q4_0), g.tensors[n].shape)
                   if len(g.tensors[n].shape) == 2 else g.load(n) for n in g.tensors}
        meta = {k: v for k, v in g.metadata.items() if k != "toy.tensor_sha256"}
    path = write_gguf(tmp_path / "deep.gguf", meta, tensors)
    batch = {"inputs": mx.zeros((1, 8), mx.int32), "targets": mx.ones((1, 8), mx.int32),
             "mask": mx.ones((1, 8))}
    peaks = {}
    for weights in ("float32", "blocks"):
        model, _ = load_llama(path, Ops(), weights)
        apply_lora(model, "q,v,down", rank=4)
        mx.eval(model.parameters())
        mx.clear_cache()
        mx.reset_peak_memory()
        loss, grads = nn.value_and_grad(model, lambda m, b: lm_loss(m, b)[0])(model, batch)
        mx.eval(loss, grads)
        peaks[weights] = mx.get_peak_memory()
        del model, loss, grads
    float_bytes = 4 * sum(int(np.prod(s)) for s in tensors_shapes(args))
    assert peaks["float32"] > float_bytes
    assert peaks["blocks"] < 0.5 * float_bytes, (peaks, float_bytes)


def tensors_shapes(args) -> list[tuple[int, ...]]:
    from toymlx.gguf.llama import expected_shapes

    return list(expected_shapes(args).values())


# ---- every type, from llama.cpp's own quantizer ------------------------------------------
LLAMA_CPP_TYPES = ["q4_k_m", "q2_k", "q3_k_m", "q5_k_m", "q6_k", "q8_0", "q4_0", "q4_1",
                   "q5_0", "q5_1", "iq4_nl", "iq4_xs"]


@pytest.fixture(scope="module")
def llama_cpp_files(tmp_path_factory) -> dict[str, Path]:
    """A random 256-wide Llama quantized by llama.cpp into each file type (K-quants need rows
    of 256)."""
    from toymlx.interop.merge import write_merged

    d = tmp_path_factory.mktemp("llamacpp_types")
    mx.random.seed(5)
    f32 = d / "f32.gguf"
    write_llama(f32, Llama(ARGS), byte_tokenizer().to_metadata(), name="tiny")
    return {t: write_merged(d / f"{t}.gguf", f32, None, t) for t in LLAMA_CPP_TYPES}


@pytest.mark.interop
def test_llama_cpp_files_cover_every_codec(llama_cpp_files):
    seen = set()
    for p in llama_cpp_files.values():
        with GGUFFile(p) as g:
            seen |= {t.type for t in g.tensors.values()}
    assert set(CODECS) <= seen


@pytest.mark.interop
@pytest.mark.parametrize("qtype", LLAMA_CPP_TYPES)
def test_every_llama_cpp_type_computes_the_float32_base(llama_cpp_files, qtype):
    """Each file llama.cpp's quantizer writes: block-held logits and LoRA gradients equal the
    float32-held base's bit for bit, under the CPU training step's math."""
    assert_same_model(llama_cpp_files[qtype], TRAINING)


@pytest.mark.interop
def test_q4_k_as_mlx_quantized_layers_holds_the_file_exactly(llama_cpp_files):
    """The GPU route (--base-dtype quantized): Q4_K projections become MLX's affine groups of 32
    (float32 scales d*sc, biases -dmin*m) that dequantize to gguf-py's values exactly; the Q6_K
    ones keep their blocks; the model computes the float32 base's logits."""
    from toymlx.gguf.quant import gguf_to_mlx_quant

    path = llama_cpp_files["q4_k_m"]
    with GGUFFile(path) as g:
        q4k = [n for n, t in g.tensors.items() if t.type == T.Q4_K and n.startswith("blk.")]
        for name in q4k:
            w, s, b, bits = gguf_to_mlx_quant(g, name)
            deq = mx.dequantize(mx.array(w), mx.array(s), mx.array(b), group_size=32, bits=bits)
            np.testing.assert_array_equal(np.array(deq), g.load(name))
        q6k = next(n for n, t in g.tensors.items() if t.type == T.Q6_K and n.startswith("blk."))
    model, _ = load_llama(path, Ops(), "quantized")
    from toymlx.gguf.llama import gguf_to_toy
    from toymlx.models.layers import submodule

    assert isinstance(submodule(model, gguf_to_toy(q4k[0])[:-7]), nn.QuantizedLinear)
    assert isinstance(submodule(model, gguf_to_toy(q6k)[:-7]), BlockLinear)
    flt, _ = load_llama(path, Ops(), "float32")
    tokens = mx.array([[1, 72, 101, 108, 108, 111, 35, 120]])
    assert mx.abs(model(tokens) - flt(tokens)).max().item() < 1e-4


@pytest.mark.parametrize("slice_values", [None, 64])
def test_a_block_held_tensors_pages_go_before_mlx_copies_it(tmp_path, monkeypatch,
                                                             slice_values):
    """A block-held tensor's pages of the file mapping are dropped once its codec's arrays are
    split out (copies), before MLX copies those: the tensor resident twice while it loads, not
    three times; a tensor of more than `SLICE_VALUES` values a slice of rows at a time, each
    slice's pages dropped after its split. Gemma 4 E2B's shape (its 1.8 GiB Q6_K per-layer
    table) peaked at 6,056 MiB of RSS while loading, above its training step's."""
    from toymlx.gguf import llama

    path = quantized_file(tmp_path / "q8.gguf", [T.Q8_0])
    want = load_llama(path, TRAINING, "blocks")[0]
    if slice_values:
        monkeypatch.setattr(llama, "SLICE_VALUES", slice_values)
    events = []
    release = GGUFFile.release
    monkeypatch.setattr(GGUFFile, "release",
                        lambda self, name, rows=None: (events.append(("release", name, rows)),
                                                       release(self, name, rows))[1])
    split = llama.split_rows
    monkeypatch.setattr(llama, "split_rows",
                        lambda codec, raw, shape: (events.append(("split", shape)),
                                                   split(codec, raw, shape))[1])
    block_layer = llama._block_layer

    def layer(g, name, ops, bias=None):
        events.append(("layer", name))
        out = block_layer(g, name, ops, bias)
        events.append(("copied", name))
        return out

    monkeypatch.setattr(llama, "_block_layer", layer)
    model = load_llama(path, TRAINING, "blocks")[0]
    held = [e[1] for e in events if e[0] == "layer"]
    assert "token_embd.weight" in held and "blk.0.attn_q.weight" in held
    sliced = False
    for name in held:
        at, end = events.index(("layer", name)), events.index(("copied", name))
        shape = GGUFFile(path).tensors[name].shape
        n_rows, step = int(np.prod(shape[:-1])), max(1, (slice_values or 2**62) // shape[-1])
        slices = [(s, min(s + step, n_rows)) for s in range(0, n_rows, step)]
        # each slice split, then its pages released, before MLX copies it (in loaded_rows)
        splits = [i for i in range(at, end) if events[i][0] == "split"]
        assert [events[i][1][0] for i in splits] == [b - a for a, b in slices], name
        for i, rows in zip(splits, slices):
            assert events[i + 1] == ("release", name, None if len(slices) == 1 else rows)
        sliced |= len(slices) > 1
    assert sliced == bool(slice_values)
    for (k, a), (_, b) in zip(sorted(tree_flatten(model.parameters())),
                              sorted(tree_flatten(want.parameters()))):
        assert np.array_equal(np.array(a), np.array(b)), k
