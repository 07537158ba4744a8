"""Every decoder architecture toymlx loads (llama incl. Llama 3's rope_freqs, qwen2, qwen3,
gemma2, gemma3, phi3, smollm3, granite, olmo2): logits against an independent float64 numpy
forward (tests/reference.py), the training kernels against the exact ones, LoRA adapters and
fused exports round-tripped, and every unknown architecture, key or tensor refused by name. The llama.cpp comparisons of the
same files are in the interop tier at the end.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from arch_files import KINDS, arch_gguf, qwen35_args
from mlx.utils import tree_flatten, tree_unflatten
from reference import forward, load_reference

from toymlx.data.vocab import byte_metadata
from toymlx.gguf.llama import (
    SUPPORTED,
    args_from_gguf,
    llama_metadata,
    load_llama,
    write_llama,
)
from toymlx.gguf.reader import GGUFError, GGUFFile
from toymlx.gguf.writer import write_gguf
from toymlx.interop.merge import write_merged
from toymlx.models.llama import Llama
from toymlx.models.lora import apply_lora
from toymlx.models.ops import Ops
from toymlx.training.adapter import write_adapter

IDS = [int(x) for x in np.random.default_rng(1).integers(3, 259, 20)]


@pytest.fixture(autouse=True)
def _same_draws():
    """Every test draws the same LoRA matrices: MLX seeds its default key from the clock, and
    gemma's adapters in llama.cpp (its float16 GELU table) are 3.1e-3 to 3.9e-3 off over 8
    draws, so a rare draw crossed the 5e-3 margin in CI."""
    mx.random.seed(0)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("archs")
    return {k: arch_gguf(k, d / f"{k}.gguf") for k in KINDS}


def logits(model, ids=IDS) -> np.ndarray:
    return np.array(model(mx.array([ids]))[0].astype(mx.float32))  # (T, V)


def report(what: str, **figures) -> None:
    print(f"\n[archs] {what}: " + json.dumps(figures, default=float))


@pytest.mark.parametrize("kind", KINDS)
def test_logits_match_float64_reference(files, kind):
    model, _ = load_llama(files[kind])
    assert model.args.arch == kind.split("-")[0].replace("llama3", "llama")
    hp, w = load_reference(files[kind])
    ref = forward(hp, w, IDS)
    diff = float(np.abs(logits(model) - ref).max())
    report(kind, max_abs_diff=diff, logit_scale=float(np.abs(ref).max()))
    assert diff < 1e-4


def test_each_switch_changes_the_logits(files):
    """The switches are read, not defaulted: the Llama 3 file without its rope_freqs tensor,
    gemma2 without its attention soft cap, and gemma3 without its sliding window, compute other
    logits; smollm3's every 4th block skips RoPE, and each granite scalar changes the logits;
    olmo2's q/k norms span the whole projection, and its blocks have no pre-norms."""
    model, _g = load_llama(files["llama3"])
    assert model.args.rope_factors == (1.0, 1.0, 1.5, 2.6, 4.0, 8.0, 8.0, 8.0) or \
        np.allclose(model.args.rope_factors, (1.0, 1.0, 1.5, 2.6, 4.0, 8.0, 8.0, 8.0))
    gemma, _ = load_llama(files["gemma3"])
    assert gemma.args.sliding_layers == (True,) * 5 + (False,)
    assert (gemma.args.sliding_window, gemma.args.rope_scale) == (4, 0.125)
    phi, _ = load_llama(files["phi3"])
    assert (phi.args.rope_dims, phi.args.rope_mscale) == (12, pytest.approx(1.19))
    hp, w = load_reference(files["llama3"])
    del w["rope_freqs.weight"]
    assert np.abs(forward(hp, w, IDS) - logits(model)).max() > 0.1
    gemma2, _ = load_llama(files["gemma2"])
    a = gemma2.args
    assert (a.sliding_layers, a.sliding_window) == ((True, False) * 2, 4)
    assert (a.attn_softcap, a.final_softcap, a.rope_base_sliding) == (1.0, 8.0, a.rope_base)
    assert (a.qk_norm, a.attn_scale) == (False, 32 ** -0.5)
    hp, w = load_reference(files["gemma2"])
    assert np.abs(forward({**hp, "attn_softcap": 0.0}, w, IDS) - logits(gemma2)).max() > 0.1
    smol, _ = load_llama(files["smollm3"])
    assert [smol.args.has_rope(i) for i in range(4)] == [True, True, True, False]
    rotated = Llama(replace(smol.args, no_rope_interval=0))
    rotated.update(smol.parameters())
    assert np.abs(logits(rotated) - logits(smol)).max() > 0.1
    granite, _ = load_llama(files["granite"])
    a = granite.args
    assert (a.embedding_multiplier, a.residual_multiplier, a.attn_scale, a.logits_scaling) == \
        (2.0, pytest.approx(0.45), pytest.approx(0.05), 2.5)
    for field in ("embedding_multiplier", "residual_multiplier", "attn_scale", "logits_scaling"):
        plain = Llama(replace(a, **{field: None if field == "attn_scale" else 1.0}))
        plain.update(granite.parameters())
        assert np.abs(logits(plain) - logits(granite)).max() > 0.01, field  # 100x the margin
    olmo, _ = load_llama(files["olmo2"])
    block = olmo.layers[0]
    assert "attn_norm" not in block and "ffn_norm" not in block
    assert (block.attn.q_norm.weight.shape, block.attn.k_norm.weight.shape) == ((64,), (32,))


@pytest.mark.parametrize("kind", KINDS)
def test_training_kernels_match_exact(files, kind):
    """The CPU training Ops (vectorised kernels) and the GPU's (fast RoPE with its frequencies
    argument) compute the same model as the exact forward."""
    exact = logits(load_llama(files[kind])[0])
    for ops in (Ops(kernels="vectorised"), Ops(exact_rope=False)):
        got = logits(load_llama(files[kind], ops)[0])
        diff = float(np.abs(got - exact).max())
        assert diff < 2e-4, (ops, diff)


@pytest.mark.parametrize("kind", KINDS)
def test_generation_cache_matches_full_forward(files, kind):
    """Token-by-token decoding with the KV cache (sliding windows crossed) gives the full
    forward's logits."""
    model, _ = load_llama(files[kind])
    full = logits(model)
    cache = model.make_cache()
    steps = [np.array(model(mx.array([[t]]), cache)[0, -1]) for t in IDS]
    assert np.abs(np.stack(steps) - full).max() < 1e-4


def qwen35_gguf(path: Path, seed: int = 0, norm_eps: float = 1e-5) -> Path:
    """A random-weight qwen35 GGUF (3 Gated DeltaNet blocks and a gated full-attention one, 2 k
    heads serving 4 value heads) over the byte vocabulary, written by toymlx: decays, dt biases
    and convolutions drawn too, so the recurrence carries something from token to token.
    `norm_eps` 1e-6 is Qwen3.5's own, and the q/k L2 norm's epsilon in transformers and mlx-lm
    (llama.cpp and toymlx take the file's RMS epsilon for it)."""
    args = replace(qwen35_args(), norm_eps=norm_eps)
    mx.random.seed(seed)
    model = Llama(args)
    rng = np.random.default_rng(seed)

    def drawn(name: str, w: mx.array) -> mx.array:
        if name.endswith(".ssm_a"):  # -exp(A_log), A in [0.1, 2]
            return mx.array(-rng.uniform(0.1, 2.0, w.shape).astype(np.float32))
        if name.endswith((".dt_bias", "norm.weight")):
            return w + mx.array(0.2 * rng.standard_normal(w.shape).astype(np.float32))
        return w * 4  # N(0, 0.08), as the other kinds' files

    model.update(tree_unflatten([(k, drawn(k, v)) for k, v in tree_flatten(model.parameters())]))
    write_llama(path, model, byte_metadata())
    return path


@pytest.fixture(scope="module")
def decoding_files(files, tmp_path_factory):
    """`files` and a qwen35 one (`qwen35_gguf`)."""
    return {**files, "qwen35": qwen35_gguf(tmp_path_factory.mktemp("qwen35") / "q.gguf")}


@pytest.mark.parametrize("kind", [*KINDS, "qwen35"])
def test_compiled_decoding_is_the_eager_model_bit_for_bit(decoding_files, kind):
    """generate's CPU decoder (CompiledDecode: each block's start and finish traced once, the
    KV cache and attention eager) against the model itself: a prompt, then token by token past
    the sliding windows, the same logits to the bit; and weights changed after the steps were
    traced (an adapter applied) are the ones used."""
    from mlx.utils import tree_map

    from toymlx.generation.generate import CompiledDecode

    model, _ = load_llama(decoding_files[kind])
    decoder = CompiledDecode(model)
    for start in (4, 1):  # a prompt; one token (qwen35: the first step starts the states)
        eager, traced = model.make_cache(), decoder.make_cache()
        prompt, rest = mx.array([IDS[:start]]), IDS[start:]
        assert mx.array_equal(model(prompt, eager), decoder(prompt, traced))
        for t in rest:
            want, got = model(mx.array([[t]]), eager), decoder(mx.array([[t]]), traced)
            assert mx.array_equal(want, got), (kind, t, float(mx.abs(want - got).max()))
    model.update(tree_map(lambda w: w * 1.5, model.parameters()))
    assert mx.array_equal(model(mx.array([[7]]), eager), decoder(mx.array([[7]]), traced))


@pytest.mark.parametrize("kind", KINDS)
def test_lora_adapter_and_fused_export(files, kind, tmp_path):
    """LoRA on every projection of the architecture: the adapter file re-applied to a fresh
    base, and the fused export, compute the adapted model's logits."""
    from toymlx.models.lora import TARGETS
    from toymlx.training.adapter import apply_adapter

    model, g = load_llama(files[kind])
    block = model.layers[0]
    names = [t for t, p in TARGETS.items()  # a block's own (gemma4's ple_gate) or its attn's, mlp's
             if p.rpartition(".")[2] in (block[p.partition(".")[0]] if "." in p else block)]
    fused_arch = kind == "phi3"
    assert ("qkv" in names) == fused_arch and ("q" in names) != fused_arch
    apply_lora(model, ",".join(names), rank=4, alpha=8.0)
    rng = np.random.default_rng(2)
    for layer in model.layers:
        for m in (layer.attn, layer.mlp):
            for sub in m.children().values():
                if hasattr(sub, "lora_b"):
                    sub.lora_b = mx.array(rng.standard_normal(sub.lora_b.shape).astype(np.float32)
                                          * 0.05)
    adapted = logits(model)
    base = logits(load_llama(files[kind])[0])
    assert np.abs(adapted - base).max() > 1e-2  # the adapter does something
    ad = write_adapter(tmp_path / "adapter.gguf", model, dict(g.metadata))
    again = apply_adapter(load_llama(files[kind])[0], ad)
    assert np.abs(logits(again) - adapted).max() < 1e-5
    merged = write_merged(tmp_path / "merged.gguf", files[kind], ad, "f32")
    fused, mg = load_llama(merged)
    assert set(mg.tensors) == set(GGUFFile(files[kind]).tensors)  # RoPE constants kept
    diff = float(np.abs(logits(fused) - adapted).max())
    report(f"{kind} lora", targets=names, fused_max_abs_diff=diff)
    assert diff < 1e-4


def test_phi3_targets_name_the_fused_projections(files):
    model, _ = load_llama(files["phi3"])
    with pytest.raises(ValueError, match=r"^--lora\.targets: q is part of phi3's fused qkv; "
                                         r"this phi3 base has qkv,o,gate_up,down$"):
        apply_lora(model, "q")


@pytest.mark.parametrize("kind", KINDS)
def test_a_target_the_architecture_lacks_is_one_line(files, kind, tmp_path, capsys):
    """`--lora.targets qkv` on a llama base was a bare "toymlx-train: error: 'qkv'" (the memory
    estimate's KeyError, before apply_lora's check); each architecture, each missing name."""
    from cli_errors import error_line
    from toymlx_cli.train import main

    arch = args_from_gguf(GGUFFile(files[kind])).arch
    if kind == "phi3":
        have, lines = "qkv,o,gate_up,down", {"q": "q is part of phi3's fused qkv",
                                              "up": "up is part of phi3's fused gate_up"}
    else:
        have, lines = "q,k,v,o,gate,up,down", {"qkv": "qkv is phi3's fused projection",
                                               "gate_up": "gate_up is phi3's fused projection"}
    for target, what in lines.items():
        assert main(["--recipe", "lora", "--base", str(files[kind]), "--lora.targets",
                     f"o,{target}", "--steps", "1", "--runs-root", str(tmp_path)]) == 2
        assert error_line(capsys) == (f"toymlx-train: error: --lora.targets: {what}; this {arch} "
                                      f"base has {have}")
    assert not list(tmp_path.iterdir())


# ---- toymlx writes every architecture it loads ---------------------------------------------
@pytest.mark.parametrize("kind", [k for k in KINDS if k != "phi3"])
def test_write_llama_round_trips_every_architecture(files, kind, tmp_path):
    """write_llama of a loaded model (its `<arch>.*` keys and RoPE constants from the args):
    the file loads back as the same args, tensors and logits."""
    model, g = load_llama(files[kind])
    write_llama(tmp_path / "w.gguf", model, byte_metadata())
    again, g2 = load_llama(tmp_path / "w.gguf")
    assert again.args == model.args
    assert set(g2.tensors) == set(g.tensors)
    assert g2.metadata["general.architecture"] == model.args.arch
    assert np.array_equal(logits(again), logits(model))


def _plain_phi3(files) -> Llama:
    """The phi3 file's model without longrope (partial RoPE, fused projections kept)."""
    model, _ = load_llama(files["phi3"])
    plain = Llama(replace(model.args, rope_factors=None, rope_mscale=1.0))
    plain.update(model.parameters())
    return plain


def test_write_llama_says_phi3_and_refuses_what_no_file_says(files, tmp_path):
    """phi3 with partial RoPE round-trips; longrope (toymlx holds only the short factors) and
    a switch the architecture does not have are refused by field, before anything is written."""
    model, _ = load_llama(files["phi3"])
    with pytest.raises(ValueError, match=r"expected a shape a phi3 GGUF can say, found "
                                         r"rope_factors \(phi3 files carry longrope's short and "
                                         r"long factors"):
        write_llama(tmp_path / "x.gguf", model, byte_metadata())
    plain = _plain_phi3(files)
    write_llama(tmp_path / "p.gguf", plain, byte_metadata())
    again, _ = load_llama(tmp_path / "p.gguf")
    assert again.args == plain.args and again.args.rope_dims == 12
    assert np.array_equal(logits(again), logits(plain))
    bad = replace(plain.args, arch="llama", rope_neox=False, fused_qkv=False,
                  fused_gate_up=False, qk_norm=True, rope_dims=None)
    with pytest.raises(ValueError, match=r"found qk_norm=True \(llama files compute with "
                                         r"False\)$"):
        llama_metadata(bad)
    assert not (tmp_path / "x.gguf").exists()


def test_gemma2_soft_caps_attention_in_every_ops(files):
    """Gemma 2's attention soft cap in each way a model computes: MLX's ops (the capped scores
    composed, as MLX's fused kernel cannot cap), the CPU's vectorised kernels, fast RoPE (a
    GPU's), and bfloat16 (a GPU's training dtype), each against the float64 reference; without
    the cap the reference moves by more than any of their margins."""
    hp, w = load_reference(files["gemma2"])
    ref = forward(hp, w, IDS)
    uncapped = float(np.abs(forward({**hp, "attn_softcap": 0.0}, w, IDS) - ref).max())
    # bfloat16: 0.14 here (the capped scores in float32 instead: 0.12), against 0.16-0.21 for
    # qwen3 and gemma3 through MLX's fused attention, whose logits reach 3x these
    for ops, tol in ((Ops(), 1e-4), (Ops(kernels="vectorised"), 1e-4),
                     (Ops(exact_rope=False), 2e-4), (Ops(dtype="bfloat16"), 0.25)):
        diff = float(np.abs(logits(load_llama(files["gemma2"], ops)[0]) - ref).max())
        report(f"gemma2 {ops.kernels} {ops.dtype} exact_rope={ops.exact_rope}",
               max_abs_diff=diff, uncapped_reference_moves=uncapped)
        assert diff < tol < uncapped


def _gemma2_file(files, tmp_path, **meta) -> str:
    """The gemma2 file with its `gemma2.*` keys changed by `meta` (None: removed)."""
    drop = [k for k, v in meta.items() if v is None]
    return _copy(files["gemma2"], tmp_path / "g.gguf",
                 {k: v for k, v in meta.items() if v is not None}, drop_meta=drop)


def test_gemma2_keys_a_file_lacks_take_llamacpp_defaults(files, tmp_path):
    """A gemma2 file without its soft caps, window or RoPE bases computes as llama.cpp does:
    attention capped at 50, logits at 30, a 4096-key window on every other block, sliding
    blocks at the file's own RoPE base; the reference (read the same way) agrees."""
    p = _gemma2_file(files, tmp_path, **{f"gemma2.{k}": None for k in (
        "attn_logit_softcapping", "final_logit_softcapping", "attention.sliding_window",
        "rope.freq_base")})
    a = args_from_gguf(GGUFFile(p))
    assert (a.attn_softcap, a.final_softcap, a.sliding_window) == (50.0, 30.0, 4096)
    assert (a.rope_base, a.rope_base_sliding, a.sliding_layers) == (10000.0, 10000.0,
                                                                     (True, False) * 2)
    hp, w = load_reference(p)
    assert np.abs(logits(load_llama(p)[0]) - forward(hp, w, IDS)).max() < 1e-4


@pytest.mark.parametrize(("meta", "message"), [
    ({"gemma2.attention.sliding_window": 0},
     (r"'gemma2\.attention\.sliding_window': expected a window > 0 \(llama\.cpp's default "
      r"4096\), found 0$")),
    ({"gemma2.attn_logit_softcapping": 0.0},
     r"'gemma2\.attn_logit_softcapping': expected a finite value > 0, found 0\.0$"),
    ({"gemma2.rope.scaling.type": "linear", "gemma2.rope.scaling.factor": 2.0},
     r"'gemma2\.rope\.scaling\.type': expected one of none for gemma2, found 'linear'$"),
    ({"gemma2.rope.freq_base_swa": 0.0},
     r"'gemma2\.rope\.freq_base_swa': expected a finite value > 0, found 0\.0$"),
])
def test_gemma2_keys_llamacpp_would_misread_are_refused(files, tmp_path, meta, message):
    """A zero window (llama.cpp would mask every key), a zero cap (a division by it), linear RoPE
    scaling (llama.cpp scales the sliding blocks too, toymlx's Gemma RoPE does not) and a zero
    RoPE base are one line naming the file and key."""
    with pytest.raises(GGUFError, match=r"g\.gguf: metadata key " + message):
        load_llama(_gemma2_file(files, tmp_path, **meta))


def test_write_llama_says_gemma2_and_refuses_what_llamacpp_would_add(files, tmp_path):
    """A gemma2 model's own RoPE base on its sliding blocks is written as rope.freq_base_swa
    (llama.cpp reads it), its caps as their keys; the 27B shape (46 blocks) scales queries by
    1/sqrt(d/heads) and round-trips; a gemma2 model without a cap or a window is refused by
    field, since llama.cpp would cap and slide it by default."""
    model, _ = load_llama(files["gemma2"])
    own = Llama(replace(model.args, rope_base_sliding=10000.0))
    own.update(model.parameters())
    write_llama(tmp_path / "own.gguf", own, byte_metadata())
    meta = GGUFFile(tmp_path / "own.gguf").metadata
    assert (meta["gemma2.rope.freq_base_swa"], meta["gemma2.attn_logit_softcapping"]) == (
        10000.0, 1.0)
    again, _ = load_llama(tmp_path / "own.gguf")
    assert again.args == own.args and np.array_equal(logits(again), logits(own))
    hp, w = load_reference(tmp_path / "own.gguf")
    assert np.abs(logits(own) - forward(hp, w, IDS)).max() < 1e-4

    a = replace(model.args, n_layers=46, sliding_layers=(True, False) * 23, attn_scale=16 ** -0.5)
    wide = Llama(a)  # random init: d/heads = 16, head width 32
    write_llama(tmp_path / "27b.gguf", wide, byte_metadata())
    again, _ = load_llama(tmp_path / "27b.gguf")
    assert again.args == a
    hp, w = load_reference(tmp_path / "27b.gguf")
    assert np.abs(logits(again) - forward(hp, w, IDS)).max() < 1e-4
    with pytest.raises(ValueError, match=r"found attn_scale=0\.1767\d+ \(gemma2 files of this "
                                         r"shape scale queries by 0\.25\)$"):
        llama_metadata(replace(a, attn_scale=32 ** -0.5))

    refused = {
        "attn_softcap": (r"attn_softcap=None \(llama\.cpp caps gemma2's attention scores at 50 "
                         r"where a file says no cap\)"),
        "final_softcap": (r"final_softcap=None \(llama\.cpp caps gemma2's logits at 30 where a "
                          r"file says no cap\)"),
        "sliding_window": (r"sliding_window=None \(llama\.cpp's gemma2 slides a 4096-key window "
                           r"over every other block from the first where a file says none\)")}
    for field, found in refused.items():
        change = {field: None} | ({"sliding_layers": None} if field == "sliding_window" else {})
        with pytest.raises(ValueError, match=("expected a shape a gemma2 GGUF can say, found "
                                              + found + "$")):
            llama_metadata(replace(model.args, **change))
    with pytest.raises(ValueError, match=r"found attn_softcap=1\.0 \(only gemma2 files say it\)$"):
        llama_metadata(replace(load_llama(files["gemma3"])[0].args, attn_softcap=1.0))
def test_the_switches_of_smollm3_granite_and_olmo2_are_their_files_alone(files, tmp_path):
    """write_llama refuses a model whose switches its architecture's files cannot say (no-RoPE
    blocks, granite's scalars, a tied olmo2), by field; the loader refuses a granite file that
    turns RoPE off and an olmo2 file without its output head, as llama.cpp would."""
    smol, _ = load_llama(files["smollm3"])
    granite, _ = load_llama(files["granite"])
    olmo, _ = load_llama(files["olmo2"])
    cases = [
        (replace(smol.args, arch="llama"), (r"found no_rope_interval=4 \(llama files compute "
                                          r"with 0\)$")),
        (replace(granite.args, arch="llama", attn_scale=None),
         (r"found embedding_multiplier=2\.0 \(only granite files say it: embedding_scale\); "
         r"residual_multiplier=0\.4499.* \(only granite files say it: residual_scale\); "
         r"logits_scaling=2\.5 \(only granite files say it: logit_scale\)$")),
        (replace(olmo.args, tie_embeddings=True),
         r"found tie_embeddings=True \(llama\.cpp's olmo2 reads an output\.weight\)$"),
    ]
    for args, want in cases:
        with pytest.raises(ValueError, match=r"expected a shape a \w+ GGUF can say, " + want):
            llama_metadata(args)
    p = _copy(files["granite"], tmp_path / "g.gguf", {"granite.rope.scaling.finetuned": False})
    with pytest.raises(GGUFError, match=r"g\.gguf: metadata key 'granite\.rope\.scaling\."
                                        r"finetuned': expected true \(granite files whose blocks "
                                        r"all skip RoPE are not supported\), found false$"):
        load_llama(p)
    g = GGUFFile(files["olmo2"])
    tied = {n: g.load(n, np.float32) for n in g.tensors if n != "output.weight"}
    p = write_gguf(tmp_path / "o.gguf", dict(g.metadata), tied, types=dict(g.metadata_types))
    with pytest.raises(GGUFError, match=r"o\.gguf: tensor 'output\.weight': expected present "
                                        r"\(olmo2 files carry their own output head\), found "
                                        r"missing$"):
        load_llama(p)


# ---- nothing is loaded and ignored --------------------------------------------------------
def _copy(src, dst, meta_update=None, drop_meta=(), tensors_update=None):
    g = GGUFFile(src)
    meta = {k: v for k, v in g.metadata.items() if k not in drop_meta}
    meta.update(meta_update or {})
    types = {k: t for k, t in g.metadata_types.items() if k in meta}
    tensors = {n: g.load(n, np.float32) for n in g.tensors}
    tensors.update(tensors_update or {})
    return write_gguf(dst, meta, tensors, types=types)


@pytest.mark.parametrize("dims,orig,base,factor,beta", [
    (32, 16, 1e6, 4.0, (32.0, 1.0)),  # the ramp over frequencies 0-2 (qwen3-yarn's shape)
    (16, 8, 100.0, 16.0, (4.0, 0.25)),  # over 0-3, with other betas (mistral3's)
    (128, 32768, 1e6, 4.0, (32.0, 1.0)),  # Qwen3-8B's YaRN (128K)
    (128, 16384, 1e6, 16.0, (32.0, 1.0)),  # Ministral 3's
    (64, 4096, 1e4, 8.0, (32.0, 1.0))])
def test_yarn_frequencies_are_ggml_formula(dims, orig, base, factor, beta):
    """toymlx's YaRN RoPE tables (the exact forward's and generation's) and the wavelengths
    `mx.fast.rope` gets (the GPU's training) against an fp64 numpy transcription of ggml's
    `rope_yarn` and llama_context's magnitude (tests/reference.py): angles, and cos and sin."""
    from reference import yarn_angles_and_magnitude

    from toymlx.models.llama import LlamaArgs
    from toymlx.models.ops import _rope_tables, _rope_wavelengths

    a = LlamaArgs(d_model=dims * 2, n_heads=2, n_kv_heads=2, rope_base=base,
                  rope_scale=1.0 / factor, rope_yarn=True, rope_yarn_beta=beta,
                  rope_orig_context=orig, context=orig * int(factor))
    rope = a.rope(0)
    low, high = rope.yarn
    assert 0 <= low < high <= dims - 1  # the ramp binds: some frequencies are mixed
    pos = np.array([0, 1, 7, 100, 5000, orig * factor - 1], np.float64)
    want, magnitude = yarn_angles_and_magnitude(pos, dims, base, 1.0 / factor, orig, *beta)
    assert rope.mscale == pytest.approx(magnitude, rel=1e-12)
    assert rope.mscale == pytest.approx(1 + 0.1 * np.log(factor), rel=1e-12)
    for p in pos:
        cos, sin = _rope_tables(rope, dims, int(p), 1)
        c = np.cos(want[list(pos).index(p)]) * magnitude
        s = np.sin(want[list(pos).index(p)]) * magnitude
        assert np.abs(np.array(cos)[0] - c).max() < 2e-6 and np.abs(np.array(sin)[0] - s).max() < 2e-6
    inv = 1.0 / np.array(_rope_wavelengths(rope, dims), np.float64)  # float32 wavelengths
    assert np.allclose(inv, want[1], rtol=1e-6)  # position 1's angles are the frequencies
    mixed = (np.arange(dims // 2) > low) & (np.arange(dims // 2) < high)
    plain = base ** (-np.arange(0, dims, 2) / dims)
    assert not np.allclose(want[1][mixed], plain[mixed] / factor)  # neither interpolated
    assert not np.allclose(want[1][mixed], plain[mixed])  # nor extrapolated


def test_yarn_and_temperature_switches_change_the_logits(files):
    """The YaRN files' switches bind on the 20 test tokens: without YaRN's ramp and magnitude
    (linear scaling instead), without mistral3's betas or log multiplier, or without its
    attention temperature, the float64 reference moves far from toymlx's logits."""
    for kind, changes in (("qwen3-yarn", {"scaling": "linear"}),
                          ("mistral3", {"scaling": "linear"}),
                          ("mistral3", {"beta_fast": 32.0, "beta_slow": 1.0}),
                          ("mistral3", {"log_mul": 0.0}),
                          ("mistral3", {"temperature": 0.0})):
        model, _ = load_llama(files[kind])
        hp, w = load_reference(files[kind])
        assert np.abs(forward(hp, w, IDS) - logits(model)).max() < 1e-4
        moved = float(np.abs(forward({**hp, **changes}, w, IDS) - logits(model)).max())
        report(f"{kind} without {changes}", max_abs_diff=moved)
        assert moved > 1e-2, (kind, changes)
    a = load_llama(files["mistral3"])[0].args
    assert (a.rope_yarn, a.rope_scale, a.rope_orig_context, a.rope_yarn_beta,
            a.rope_yarn_log_mul, a.attn_temperature) == \
        (True, 1 / 16, 8, (4.0, 0.25), 0.5, pytest.approx(0.1))


YARN_KEYS = {"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0,
             "rope.scaling.original_context_length": 8}
"""Qwen3-128K's YaRN keys on the scale of these files' 20 tokens."""


@pytest.mark.parametrize("kind", ["llama", "qwen2", "smollm3", "granite", "olmo2"])
def test_yarn_in_every_architecture_llamacpp_scales_alike(files, kind, tmp_path):
    """The other architectures whose llama.cpp graph takes YaRN as qwen3's does, with
    Qwen3-128K's keys: toymlx's logits are the float64 reference's, and YaRN moves them."""
    arch = args_from_gguf(GGUFFile(files[kind])).arch
    p = _copy(files[kind], tmp_path / "yarn.gguf", {f"{arch}.{k}": v for k, v in YARN_KEYS.items()})
    model, _ = load_llama(p)
    hp, w = load_reference(p)
    diff = float(np.abs(logits(model) - forward(hp, w, IDS)).max())
    moved = float(np.abs(logits(model) - logits(load_llama(files[kind])[0])).max())
    report(f"{kind} with YaRN", max_abs_diff=diff, moved_by_yarn=moved)
    assert diff < 1e-4 and moved > 1e-2


@pytest.mark.interop
@pytest.mark.parametrize("kind", ["llama", "qwen2", "smollm3", "granite", "olmo2"])
def test_yarn_in_every_architecture_matches_llamacpp(files, kind, tmp_path):
    from llamacpp_runner import llamacpp_logits

    arch = args_from_gguf(GGUFFile(files[kind])).arch
    p = _copy(files[kind], tmp_path / "yarn.gguf", {f"{arch}.{k}": v for k, v in YARN_KEYS.items()})
    ref, _ = llamacpp_logits(p, IDS)
    diff = float(np.abs(logits(load_llama(p)[0]) - ref).max())
    report(f"{kind} with YaRN vs llama.cpp", max_abs_diff=diff)
    assert diff < 1e-4


def test_yarn_keys_llamacpp_does_not_read_and_mistral3_experts(files, tmp_path):
    """The converter writes a Hugging Face config's YaRN `attention_factor` and betas into any
    architecture's file; llama.cpp's qwen3 reads neither (DeepSeek-R1-0528-Qwen3-8B's config
    says attn_factor 0.8782, llama.cpp computes with 1 + 0.1 ln 4): such a key loads where it
    says what llama.cpp computes with, and is refused by name where it does not. A mistral3
    file with experts is refused: llama.cpp's mistral3 is dense."""
    k = "qwen3.rope.scaling."
    same = _copy(files["qwen3-yarn"], tmp_path / "same.gguf",
                 {k + "yarn_attn_factor": 1 + 0.1 * np.log(4.0), k + "yarn_beta_fast": 32.0,
                  k + "yarn_ext_factor": 1.0})
    assert np.array_equal(logits(load_llama(same)[0]), logits(load_llama(files["qwen3-yarn"])[0]))
    p = _copy(files["qwen3-yarn"], tmp_path / "r1.gguf", {k + "yarn_attn_factor": 0.8782488562869419})
    with pytest.raises(GGUFError, match=r"r1\.gguf: metadata key 'qwen3\.rope\.scaling\."
                                        r"yarn_attn_factor': expected 1\.138629 \(llama\.cpp does "
                                        r"not read this key for qwen3 and computes with 1\.138629; "
                                        r"Hugging Face's model would use the file's\), found "
                                        r"0\.8782489$"):
        load_llama(p)
    p = _copy(files["mistral3"], tmp_path / "moe.gguf", {"mistral3.expert_count": 8})
    with pytest.raises(GGUFError, match=r"moe\.gguf: metadata key 'mistral3\.expert_count': "
                                        r"expected 0 \(mistral3 is dense; mixtures of experts "
                                        r"load as qwen3moe, qwen2moe, llama\), found 8$"):
        load_llama(p)


def test_unknown_tensor_is_refused_by_name(files, tmp_path):
    p = _copy(files["qwen2"], tmp_path / "x.gguf",
              tensors_update={"blk.0.attn_gate.weight": np.zeros((64, 64), np.float32)})
    with pytest.raises(GGUFError, match=r"x\.gguf: tensor 'blk\.0\.attn_gate\.weight': expected "
                                        r"only the tensors a qwen2 model of this shape computes "
                                        r"with, found this one too; not loaded"):
        load_llama(p)


def test_unknown_metadata_key_is_refused_by_name(files, tmp_path):
    p = _copy(files["llama"], tmp_path / "x.gguf", {"llama.attention.scale": 0.5})
    with pytest.raises(GGUFError, match=r"x\.gguf: metadata key 'llama\.attention\.scale': "
                                        r"expected only keys toymlx computes with"):
        load_llama(p)
    # a file that says it is one of two parts but not which (toymlx.gguf.reader reads parts)
    p = _copy(files["llama"], tmp_path / "y.gguf", {"split.count": 2})
    with pytest.raises(GGUFError, match=r"y\.gguf: metadata key 'split\.no': expected present"):
        load_llama(p)


def test_unknown_architecture_and_rope_scaling_are_refused(files, tmp_path):
    p = _copy(files["llama"], tmp_path / "x.gguf", {"general.architecture": "mamba"})
    with pytest.raises(GGUFError, match=rf"'general\.architecture': expected one of "
                                        rf"{re.escape(SUPPORTED)}, found 'mamba'"):
        load_llama(p)
    p = _copy(files["phi3"], tmp_path / "y.gguf", {"phi3.rope.scaling.type": "yarn",
                                                   "phi3.rope.scaling.factor": 4.0})
    with pytest.raises(GGUFError, match=r"'phi3\.rope\.scaling\.type': expected one of none, "
                                        r"linear, longrope for phi3, found 'yarn'"):
        load_llama(p)
    # a rope_freqs tensor whose length is not rope dims / 2
    p = _copy(files["llama3"], tmp_path / "z.gguf",
              tensors_update={"rope_freqs.weight": np.ones(5, np.float32)})
    with pytest.raises(GGUFError, match=r"tensor 'rope_freqs\.weight' shape: expected \(8,\)"):
        load_llama(p)


# ---- the same files in llama.cpp ----------------------------------------------------------
@pytest.mark.interop
@pytest.mark.parametrize("kind", KINDS)
def test_logits_match_llamacpp(files, kind):
    """llama.cpp (f32 KV cache, flash attention off) on the same files. The Gemma margin is
    llama.cpp's: its CPU GELU rounds the input to float16 and reads a float16 table."""
    from llamacpp_runner import llamacpp_logits

    model, _ = load_llama(files[kind])
    mine = logits(model)
    ref, _ = llamacpp_logits(files[kind], IDS)
    diff = float(np.abs(mine - ref).max())
    top1 = float((mine.argmax(-1) == ref.argmax(-1)).mean())
    report(f"{kind} vs llama.cpp", max_abs_diff=diff, top1=top1)
    assert diff < (5e-3 if kind.startswith("gemma") else 1e-4) and top1 == 1.0


@pytest.mark.interop
@pytest.mark.parametrize("kind", ["llama3", "qwen2", "qwen3", "gemma2", "gemma3", "phi3",
                                  "smollm3", "granite", "olmo2", "qwen3-yarn", "mistral3"])
def test_llamacpp_reads_what_write_llama_writes(files, kind, tmp_path):
    """The files write_llama writes of every architecture (phi3 without longrope) compute in
    llama.cpp what they compute in toymlx, within the margins of the converter's files."""
    from llamacpp_runner import llamacpp_logits

    model = _plain_phi3(files) if kind == "phi3" else load_llama(files[kind])[0]
    write_llama(tmp_path / "w.gguf", model, byte_metadata())
    mine = logits(model)
    ref, _ = llamacpp_logits(tmp_path / "w.gguf", IDS)
    diff = float(np.abs(mine - ref).max())
    report(f"{kind} written vs llama.cpp", max_abs_diff=diff)
    assert diff < (5e-3 if kind.startswith("gemma") else 1e-4)


@pytest.mark.interop
@pytest.mark.parametrize("kind", KINDS)
def test_llamacpp_applies_our_adapter(files, kind, tmp_path):
    """A LoRA adapter toymlx writes, loaded by llama.cpp with --lora, and the fused export
    loaded by llama.cpp: both within the file's margin of toymlx's adapted forward."""
    from llamacpp_runner import llamacpp_logits_lora

    model, g = load_llama(files[kind])
    names = "qkv,o,gate_up,down" if kind == "phi3" else "q,k,v,o,gate,up,down"
    apply_lora(model, names, rank=4, alpha=8.0)
    rng = np.random.default_rng(3)
    for _, m in model.named_modules():
        if hasattr(m, "lora_b") and not isinstance(m.lora_b, dict):
            m.lora_b = mx.array(rng.standard_normal(m.lora_b.shape).astype(np.float32) * 0.05)
    mine = logits(model)
    ad = write_adapter(tmp_path / "adapter.gguf", model, dict(g.metadata))
    ref, _ = llamacpp_logits_lora(files[kind], ad, IDS)
    merged = write_merged(tmp_path / "merged.gguf", files[kind], ad, "f32")
    ref_fused, _ = llamacpp_logits_lora(merged, None, IDS)
    tol = 5e-3 if kind.startswith("gemma") else 1e-4
    d_lora, d_fused = float(np.abs(mine - ref).max()), float(np.abs(mine - ref_fused).max())
    report(f"{kind} adapter in llama.cpp", lora_max_abs_diff=d_lora, fused_max_abs_diff=d_fused)
    assert d_lora < tol and d_fused < tol


# ---- quantized files of every architecture ---------------------------------------------------
QUANTS = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")


def _quantized_copy(src, dst, qtype: str):
    """Every matrix of `src` as `qtype` (gguf-py's quantizer), norms and RoPE constants F32."""
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import quantize

    from toymlx.gguf.writer import QuantTensor

    t = GGMLQuantizationType[qtype]
    g = GGUFFile(src)
    tensors = {}
    for n in g.tensors:
        w = g.load(n, np.float32)
        tensors[n] = QuantTensor(t, quantize(w, t), tuple(w.shape)) if w.ndim == 2 else w
    return write_gguf(dst, dict(g.metadata), tensors, types=dict(g.metadata_types))


@pytest.mark.parametrize("qtype", QUANTS)
@pytest.mark.parametrize("kind", ["llama3", "qwen2", "qwen3", "gemma2", "gemma3", "phi3",
                                  "smollm3", "granite", "olmo2"])
def test_quantized_files_of_every_architecture(files, kind, qtype, tmp_path):
    """A file in each type people download that gguf-py writes: dequantized exactly (the
    reference dequantizes the same blocks in float64); Q4_0/Q4_1/Q8_0 also held as MLX
    quantized layers (a GPU's LoRA base) computing the same model."""
    p = _quantized_copy(files[kind], tmp_path / f"{kind}-{qtype}.gguf", qtype)
    hp, w = load_reference(p)
    ref = forward(hp, w, IDS)
    got = logits(load_llama(p)[0])
    assert np.abs(got - ref).max() < 1e-4
    if qtype in ("Q8_0", "Q4_0", "Q4_1"):
        held = logits(load_llama(p, weights="quantized")[0])
        assert np.abs(held - ref).max() < 1e-3
