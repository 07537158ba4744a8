"""Gemma 4 (general.architecture gemma4) on the converter's own files of the tiny `gemma4`
checkpoint (tests/hf_tiny.py: sliding and full blocks of different head widths, proportional
RoPE, a shared-KV tail, per-layer embeddings, layer scalars, capped logits): toymlx's logits
against llama.cpp's and transformers', its quantized twin against llama.cpp, a LoRA step,
generation with the KV cache, the adapter and the fused export in llama.cpp. Logits from token
ids (no tokenizer needed: test_hf_tiny.py's gemma4 case checks the tokenizer). What each piece
is: toymlx/gguf/gemma4.py.
"""

from __future__ import annotations

import json
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest
from hf_tiny import (
    hf_logits,
    llamacpp_quantize,
    tiny_gguf,  # noqa: F401  (session fixtures)
    tiny_hf,  # noqa: F401
    token_ids,
)
from llamacpp_runner import llamacpp_logits, llamacpp_logits_lora
from llamacpp_source import llamacpp_source  # noqa: F401  (session fixture)

from toymlx.gguf.llama import args_from_gguf, load_llama
from toymlx.gguf.reader import GGUFError, GGUFFile
from toymlx.interop.merge import write_merged
from toymlx.models.lora import apply_lora
from toymlx.models.losses import lm_loss
from toymlx.models.ops import training_ops
from toymlx.training.adapter import write_adapter

pytestmark = pytest.mark.interop

N = 40  # crosses the sliding window (8) five times
GELU_TOL = 5e-3  # llama.cpp's float16 GELU table (test_hf_tiny.py), on logits capped at 2
HF_TOL = 1e-4


def report(what: str, **figures) -> None:
    print(f"\n[gemma4] {what}: " + json.dumps(figures, default=float))


def logits(model, ids) -> np.ndarray:
    return np.array(model(mx.array([ids]))[0].astype(mx.float32))


def adam_steps(model, hf_dir, steps: int, lr: float) -> tuple[list[float], dict]:
    """`steps` Adam steps of the model's trainable parameters on one fixed batch (2 rows of N
    seeded ids): each step's loss before it, and the first step's gradients."""
    import mlx.optimizers as optim

    ids = mx.array([token_ids(hf_dir, N + 1, seed=s) for s in range(2)])
    batch = {"inputs": ids[:, :-1], "targets": ids[:, 1:], "mask": mx.ones((2, N))}
    opt = optim.Adam(learning_rate=lr)

    def loss_fn(params):
        model.update(params)
        return lm_loss(model, batch)[0]

    losses, first = [], {}
    for _ in range(steps):
        loss, grads = mx.value_and_grad(loss_fn)(model.trainable_parameters())
        first = first or grads
        opt.update(model, grads)
        mx.eval(model.parameters(), loss)
        losses.append(float(loss))
    return losses, first


def test_the_file_is_gemma4_with_every_piece(tiny_gguf):  # noqa: F811
    """The converter's file has what the tests below exercise: both head widths, a shared-KV
    tail without keys and values and with wider MLPs, per-layer embeddings, layer scalars,
    rope_freqs."""
    g = GGUFFile(tiny_gguf("gemma4"))
    a = args_from_gguf(g)
    assert (a.arch, a.head_dim, a.key_length_sliding, a.shared_kv_layers, a.per_layer_dim,
            a.layer_scales, a.attn_scale, a.final_softcap) == ("gemma4", 32, 16, 2, 8, True,
                                                               1.0, 2.0)
    assert a.sliding_layers == (True, False) * 3 and a.sliding_window == 8
    assert a.ffn_dims_per_block == (128,) * 4 + (256,) * 2  # use_double_wide_mlp
    assert [a.kv_source(i) for i in range(6)] == [None] * 4 + [2, 3]
    big = float(np.float32(1e30))  # proportional: a quarter of the pairs turn
    assert a.rope_factors == (1.0,) * 4 + (big,) * 12
    assert "blk.4.attn_k.weight" not in g.tensors and "blk.3.attn_k.weight" in g.tensors


def test_logits_match_llamacpp_and_transformers(tiny_hf, tiny_gguf):  # noqa: F811
    ids = token_ids(tiny_hf("gemma4"), N)
    ref = hf_logits(tiny_hf("gemma4"), ids)
    cpp, _ = llamacpp_logits(tiny_gguf("gemma4"), ids)
    mine = logits(load_llama(tiny_gguf("gemma4"))[0], ids)
    d_hf, d_cpp = float(np.abs(mine - ref).max()), float(np.abs(mine - cpp).max())
    report("logits", toymlx_vs_hf=d_hf, toymlx_vs_llamacpp=d_cpp,
           llamacpp_vs_hf=float(np.abs(cpp - ref).max()), logit_std=float(ref.std()))
    assert d_hf < HF_TOL and d_cpp < GELU_TOL


def test_the_sliding_window_binds(tiny_hf, tiny_gguf):  # noqa: F811
    """Without the window the logits past position 8 move far beyond the tolerances above
    (and the first 8 not at all): the comparisons test it."""
    ids = token_ids(tiny_hf("gemma4"), N)
    model, g = load_llama(tiny_gguf("gemma4"))
    want = logits(model, ids)
    from toymlx.gguf.llama import load_llama_weights
    from toymlx.models.llama import Llama

    wide = Llama(replace(model.args, sliding_window=1000))
    load_llama_weights(g, wide)
    moved = float(np.abs(logits(wide, ids)[8:] - want[8:]).max())
    early = float(np.abs(logits(wide, ids)[:8] - want[:8]).max())
    report("window", max_move_past_8=moved, max_move_first_8=early)
    assert moved > 0.05 and early < 1e-5


def test_generation_with_the_cache_is_the_full_forward(tiny_hf, tiny_gguf):  # noqa: F811
    """A prompt of 5, then token by token past the window: every position's logits are the
    full forward's, eager and through generate's traced decoder (CompiledDecode)."""
    from toymlx.generation.generate import CompiledDecode
    from toymlx.models.ops import Ops

    ids = token_ids(tiny_hf("gemma4"), N)
    model, _ = load_llama(tiny_gguf("gemma4"), Ops(exact_rope=True))
    full = logits(model, ids)
    for decoder in (model, CompiledDecode(model)):
        cache = decoder.make_cache()
        steps = [np.array(decoder(mx.array([ids[:5]]), cache)[0])]
        steps += [np.array(decoder(mx.array([[t]]), cache)[0]) for t in ids[5:]]
        d = float(np.abs(np.concatenate(steps) - full).max())
        report(f"cache {type(decoder).__name__}", max_abs_vs_full=d)
        assert d < 1e-4


@pytest.mark.parametrize("grad_checkpoint", [False, True])
def test_a_lora_step_lowers_the_loss(tiny_hf, tiny_gguf, grad_checkpoint):  # noqa: F811
    """LoRA on q,k,v,o,gate,up,down (the shared-KV blocks: q,o,gate,up,down), the training Ops:
    five Adam steps on one batch lower its loss; the base stays frozen."""
    from mlx.utils import tree_flatten

    ops = training_ops(False, grad_checkpoint=grad_checkpoint)
    model, _ = load_llama(tiny_gguf("gemma4"), ops)
    apply_lora(model, "q,k,v,o,gate,up,down", rank=4, alpha=8.0)
    trained = [k for k, _ in tree_flatten(model.trainable_parameters())]
    assert all(".lora_" in k for k in trained)
    assert not any(f"layers.{i}.attn.{p}" in k for k in trained for i in (4, 5)
                   for p in ("k_proj", "v_proj"))
    assert len(trained) == 2 * (7 * 4 + 5 * 2)
    losses, _ = adam_steps(model, tiny_hf("gemma4"), 5, 1e-2)
    report(f"lora steps grad_checkpoint={grad_checkpoint}", losses=losses)
    assert losses[-1] < losses[0] - 0.1


def test_llamacpp_applies_the_adapter_and_loads_the_fused_export(tiny_hf, tiny_gguf,  # noqa: F811
                                                                tmp_path):
    """The adapter toymlx writes, applied by llama.cpp (--lora), and the fused export: both
    compute toymlx's adapted logits; the export keeps every key and tensor of the base. Every
    projection mlx-lm's default adapts, the per-layer-input gate and projection (blk.N.inp_gate,
    blk.N.proj: llama.cpp's build_lora_mm applies their pairs) too."""
    path = tiny_gguf("gemma4")
    ids = token_ids(tiny_hf("gemma4"), N)
    model, g = load_llama(path)
    apply_lora(model, "mlx-lm-default", rank=4, alpha=8.0)
    rng = np.random.default_rng(3)
    for _, m in model.named_modules():
        if hasattr(m, "lora_b") and not isinstance(m.lora_b, dict):
            m.lora_b = mx.array(rng.standard_normal(m.lora_b.shape).astype(np.float32) * 0.05)
    mine = logits(model, ids)
    base = logits(load_llama(path)[0], ids)
    pair = [m for b in model.layers for m in (b.ple_gate, b.ple_proj)]
    kept_b = [m.lora_b for m in pair]
    for m in pair:
        m.lora_b = mx.zeros_like(m.lora_b)
    without_pair = logits(model, ids)  # what llama.cpp would compute ignoring the pair
    for m, b in zip(pair, kept_b):
        m.lora_b = b
    ad = write_adapter(tmp_path / "adapter.gguf", model, dict(g.metadata))
    assert {n for n in GGUFFile(ad).tensors if ".inp_gate." in n or ".proj." in n} == {
        f"blk.{i}.{t}.weight.{h}" for i in range(6) for t in ("inp_gate", "proj")
        for h in ("lora_a", "lora_b")}
    ref, _ = llamacpp_logits_lora(path, ad, ids)
    merged = write_merged(tmp_path / "merged.gguf", path, ad, "f32")
    fused_cpp, _ = llamacpp_logits_lora(merged, None, ids)
    fused_toy = logits(load_llama(merged)[0], ids)
    m = GGUFFile(merged)
    assert set(m.tensors) == set(g.tensors)
    kept = {k: v for k, v in g.metadata.items() if k.startswith("gemma4.")}
    assert {k: m.metadata[k] for k in kept} == kept
    d = {"adapted_vs_base": float(np.abs(mine - base).max()),
         "pair_alone": float(np.abs(mine - without_pair).max()),
         "llamacpp_lora_vs_toymlx": float(np.abs(ref - mine).max()),
         "llamacpp_fused_vs_toymlx": float(np.abs(fused_cpp - mine).max()),
         "toymlx_fused_vs_adapted": float(np.abs(fused_toy - mine).max())}
    report("adapter and fused export", **d)
    assert d["adapted_vs_base"] > 0.05 and d["pair_alone"] > 4 * GELU_TOL
    assert d["llamacpp_lora_vs_toymlx"] < GELU_TOL and d["llamacpp_fused_vs_toymlx"] < GELU_TOL
    assert d["toymlx_fused_vs_adapted"] < 1e-4


@pytest.mark.parametrize("weights", ["float32", "blocks"])
def test_q4_k_m_twin_matches_llamacpp(tiny_hf, tiny_gguf, tmp_path, weights):  # noqa: F811
    """The -q twin quantized Q4_K_M by llama.cpp's quantizer: toymlx (dequantized, or holding
    the blocks, the per-layer table gathered row by row) within the quantized kinds' margin of
    llama.cpp on the same file."""
    from toymlx.models.layers import BlockEmbedding

    dst = tmp_path / "gemma4-q-Q4_K_M.gguf"
    q = llamacpp_quantize(tiny_gguf("gemma4-q"), dst, "Q4_K_M")
    ids = token_ids(tiny_hf("gemma4-q"), N)
    got, _ = llamacpp_logits(dst, ids)
    f32, _ = llamacpp_logits(tiny_gguf("gemma4-q"), ids)
    model, _ = load_llama(dst, weights=weights)
    if weights == "blocks" and q["types"]["per_layer_token_embd.weight"] not in ("F32", "F16"):
        assert isinstance(model.ple_embed, BlockEmbedding)
    mine = logits(model, ids)
    diff = float(np.abs(got - f32).max())
    d_toy = float(np.abs(mine - got).max())
    top1 = float((mine.argmax(-1) == got.argmax(-1)).mean())
    report(f"Q4_K_M {weights}", toymlx_vs_llamacpp=d_toy, top1=top1, llamacpp_vs_its_f32=diff,
           types={n: t for n, t in q["types"].items() if not n.startswith("blk.")
                  or n.startswith("blk.0.")})
    assert d_toy <= max(diff, 0.05) and top1 >= 0.9


def test_a_mixture_of_experts_file_is_one_line(llamacpp_source):  # noqa: F811
    """llama.cpp's gemma4 vocabulary file carries the 26B-A4B's metadata (128 experts) and no
    tensors: named first as what it is, a vocabulary only (`check_model_kind`), one line."""
    path = llamacpp_source / "models" / "ggml-vocab-gemma-4.gguf"
    with pytest.raises(GGUFError) as e:
        args_from_gguf(GGUFFile(path))
    assert str(e.value) == (f"{path}: expected a model, found a 'gemma4' vocabulary only: the "
                            "file holds no tensors, a tokenizer-only GGUF (as llama.cpp's "
                            "ggml-vocab-*.gguf), not a model")


def test_write_llama_round_trips_and_llamacpp_reads_it(tiny_hf, tiny_gguf, tmp_path):  # noqa: F811
    """What a full fine-tune's checkpoint is written by (write_llama): the gemma4 keys and
    tensors from the args, read back as the same args and logits, and by llama.cpp."""
    from toymlx.gguf.llama import write_llama

    ids = token_ids(tiny_hf("gemma4"), N)
    model, g = load_llama(tiny_gguf("gemma4"))
    out = tmp_path / "w.gguf"
    write_llama(out, model, {k: v for k, v in g.metadata.items() if k.startswith("tokenizer.")})
    again, g2 = load_llama(out)
    assert again.args == model.args and set(g2.tensors) == set(g.tensors)
    mine = logits(model, ids)
    assert np.array_equal(logits(again, ids), mine)
    cpp, _ = llamacpp_logits(out, ids)
    d = float(np.abs(cpp - mine).max())
    report("write_llama in llama.cpp", max_abs=d)
    assert d < GELU_TOL


def test_a_full_fine_tune_step_lowers_the_loss(tiny_hf, tiny_gguf):  # noqa: F811
    """Every weight trained (the per-layer table, projections and layer scalars too): every
    parameter gets a gradient, and three Adam steps lower the batch's loss."""
    from mlx.utils import tree_flatten

    model, _ = load_llama(tiny_gguf("gemma4"), training_ops(False))
    losses, first = adam_steps(model, tiny_hf("gemma4"), 3, 1e-3)
    zero = [k for k, v in tree_flatten(first) if not bool(mx.any(v != 0))]
    assert not zero, zero
    report("full steps", losses=losses)
    assert losses[-1] < losses[0] - 0.1


def test_a_shared_kv_tail_recomputes_its_attention(tiny_gguf):  # noqa: F811
    """Source and reader blocks (the last 2 read blocks 2 and 3's keys and values) recompute
    their attention in the backward pass as the others do (`Ops.recomputed`): the file's shape
    with 16 heads (random weights), LoRA, 2 x 1024 tokens, peaks within 1.2x of the same model
    without sharing (MLX's count; when they kept their probabilities, 663 MB against 397, and
    354 against 338 since). And the gradients through the handed-on keys and values are those
    of the file's model keeping every attention's activations."""
    from mlx.utils import tree_flatten

    from toymlx.models.llama import Llama

    a = args_from_gguf(GGUFFile(tiny_gguf("gemma4")))
    rng = np.random.default_rng(0)

    def batch(B: int, T: int) -> dict:
        ids = rng.integers(0, a.vocab_size, (B, T + 1))
        return {"inputs": mx.array(ids[:, :-1]), "targets": mx.array(ids[:, 1:]),
                "mask": mx.ones((B, T))}

    long = batch(2, 1024)
    peaks = {}
    for shared in (0, 2):
        mx.random.seed(0)
        model = Llama(replace(a, n_heads=16, shared_kv_layers=shared), training_ops(False))
        model.freeze()
        apply_lora(model, "q,k,v,o,gate,up,down", rank=8, alpha=16.0)
        mx.eval(model.parameters())
        mx.clear_cache()
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        mx.eval(mx.value_and_grad(lambda p, m=model: (m.update(p), lm_loss(m, long)[0])[1])(
            model.trainable_parameters()))
        peaks[shared] = (mx.get_peak_memory() - base) / 1e6
    report("shared-KV peaks (MB)", **{f"shared_kv_layers_{n}": v for n, v in peaks.items()})
    assert peaks[2] < 1.2 * peaks[0]

    short = batch(2, 64)
    grads = {}
    for keep in (0, 1 << 30):  # every attention recomputed; every attention kept
        model, _ = load_llama(tiny_gguf("gemma4"),
                              replace(training_ops(False), attention_keep_limit=keep))
        grads[keep] = dict(tree_flatten(mx.grad(
            lambda p, m=model: (m.update(p), lm_loss(m, short)[0])[1])(
                model.trainable_parameters())))
    assert "layers.3.attn.k_proj.weight" in grads[0]
    for name, g in grads[0].items():
        ref = grads[1 << 30][name]
        assert float(mx.abs(g - ref).max()) <= 1e-6 * float(mx.abs(ref).max()) + 1e-12, name


def test_the_31b_layout_keys_as_values_and_kv_heads_per_block(tiny_hf, llamacpp_source,  # noqa: F811
                                                              tmp_path):
    """Gemma 4 31B's layout, which the tiny kind lacks: full blocks without v_proj (values are
    the keys' projection, attention_k_eq_v), their own kv head count (a head_count_kv array),
    no shared-KV tail and no per-layer embeddings. The tiny kind's tokenizer files, a
    transformers model of that config, llama.cpp's converter: toymlx against both."""
    import shutil

    import torch
    import transformers as tf
    from hf_tiny import VOCAB, _randomize, gguf_from_hf

    src, hf = tiny_hf("gemma4"), tmp_path / "hf"
    hf.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "toymlx_tiny.json"):
        shutil.copy(src / name, hf / name)
    config = tf.Gemma4TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
        num_global_key_value_heads=1, attention_k_eq_v=True, num_kv_shared_layers=0,
        hidden_size_per_layer_input=0, sliding_window=8, tie_word_embeddings=True,
        layer_types=["sliding_attention", "full_attention"] * 2, final_logit_softcapping=2.0,
        rms_norm_eps=1e-6, bos_token_id=2, eos_token_id=1, pad_token_id=0,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                         "full_attention": {"rope_type": "proportional",
                                            "partial_rotary_factor": 0.25,
                                            "rope_theta": 1e6}})
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = tf.Gemma4ForCausalLM(config).to(torch.float32).eval()
    _randomize(model, 4031, gemma=False, unscaled_scores=True)
    model.save_pretrained(hf)
    path = tmp_path / "g31.gguf"
    gguf_from_hf(hf, path, tree=llamacpp_source)
    a = args_from_gguf(GGUFFile(path))
    assert a.k_eq_v and a.kv_heads_per_block == (2, 1, 2, 1) and not a.per_layer_dim
    assert "blk.1.attn_v.weight" not in GGUFFile(path).tensors
    ids = token_ids(hf, N)
    ref = hf_logits(hf, ids)
    cpp, _ = llamacpp_logits(path, ids)
    mine = logits(load_llama(path)[0], ids)
    d_hf, d_cpp = float(np.abs(mine - ref).max()), float(np.abs(mine - cpp).max())
    report("31b layout", toymlx_vs_hf=d_hf, toymlx_vs_llamacpp=d_cpp, logit_std=float(ref.std()))
    assert d_hf < HF_TOL and d_cpp < GELU_TOL


def _changed(src, dst, meta=None, drop=(), tensors=None):
    """A copy of GGUF `src` at `dst` with metadata `meta` set, keys `drop` removed and
    `tensors` added."""
    from toymlx.gguf.writer import write_gguf

    g = GGUFFile(src)
    m = {k: v for k, v in g.metadata.items() if k not in drop} | (meta or {})
    t = {n: g.load(n, np.float32) for n in g.tensors} | (tensors or {})
    return write_gguf(dst, m, t, types={k: v for k, v in g.metadata_types.items() if k in m})


@pytest.mark.parametrize(("change", "message"), [
    ({"drop": ["gemma4.attention.sliding_window_pattern"]},
     (r"metadata key 'gemma4\.attention\.sliding_window_pattern': expected a bool per block "
     r"\(6\), found None$")),
    ({"meta": {"gemma4.attention.shared_kv_layers": 3}},
     (r"shared_kv_layers.*llama\.cpp reads block 2 for block 3, transformers the last of its "
     r"kind")),
    ({"tensors": {"blk.0.ffn_gate_inp.weight": np.zeros((4, 64), np.float32)}},
     (r"tensor 'blk\.0\.ffn_gate_inp\.weight': expected a dense gemma4 \(mixture-of-experts "
     r"files are not supported\), found an expert tensor$")),
])
def test_what_llamacpp_and_transformers_would_read_apart_is_one_line(tiny_gguf, tmp_path,  # noqa: F811
                                                                    change, message):
    """No pattern, a shared-KV tail whose blocks llama.cpp and transformers would give
    different keys and values, an expert tensor: each one line naming the file and the key,
    field or tensor."""
    p = _changed(tiny_gguf("gemma4"), tmp_path / "x.gguf", **change)
    with pytest.raises(GGUFError, match=r"x\.gguf: .*" + message):
        load_llama(p)


def test_no_logit_cap_key_is_llamacpps_30(tiny_gguf, tmp_path):  # noqa: F811
    """llama.cpp caps gemma4's logits at 30 where a file has no final_logit_softcapping (what
    the converter writes for transformers' None) and not at all where it says 0."""
    none = _changed(tiny_gguf("gemma4"), tmp_path / "a.gguf",
                    drop=["gemma4.final_logit_softcapping"])
    zero = _changed(tiny_gguf("gemma4"), tmp_path / "b.gguf",
                    meta={"gemma4.final_logit_softcapping": 0.0})
    assert args_from_gguf(GGUFFile(none)).final_softcap == 30.0
    assert args_from_gguf(GGUFFile(zero)).final_softcap is None
