"""mlx-lm's adapters (the folder `mlx_lm.lora` writes) read by toymlx for a GGUF base: the logits
of toymlx's model with the imported adapter against mlx-lm's own model with the same adapter
(loaded by mlx-lm's `load_adapters`) on the same weights, in Hugging Face's layout
(tests/mlx_lm_adapters.py); llama's q/k rows permuted as llama.cpp's converter permutes them;
the export for llama.cpp (its LoRA format, and fused); bad input as one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from arch_files import gemma4_gguf
from hf_tiny import (
    tiny_gguf,  # noqa: F401  (session fixtures)
    tiny_hf,  # noqa: F401
    token_ids,
)
from llamacpp_source import llamacpp_source  # noqa: F401  (session fixture)
from mlx_lm.gguf import permute_weights
from mlx_lm_adapters import (
    hf_model,
    load_with_adapter,
    logits,
    lora_config,
    make_adapter,
    qwen3moe_gguf,
)
from smollm import smollm_gguf  # noqa: F401  (session fixture)
from test_archs import qwen35_gguf

from toymlx.gguf.llama import gguf_rows_to_hf, hf_rows_to_gguf, load_llama
from toymlx.gguf.reader import GGUFFile
from toymlx.training import mlx_lm_adapter
from toymlx.training.adapter import apply_adapter, load_adapter
from toymlx.training.mlx_lm_adapter import MlxLmError, read_mlx_lm_adapter

IDS = [1, 403, 407, 261, 378, 275, 260, 357, 418, 350, 377, 264, 273, 290, 419, 270]
TOL = 1e-4


def toy(stories: Path, adapter: Path | None = None):
    model, g = load_llama(stories)
    g.close()
    return model if adapter is None else apply_adapter(model, adapter)


def test_the_q_k_permutation_is_llama_cpp_s():
    """`hf_rows_to_gguf` is llama.cpp's converter's permute (mlx-lm's copy of it), for q with
    8 heads and for k with 4 kv heads; `gguf_rows_to_hf` undoes it."""
    w = np.random.default_rng(0).normal(size=(64, 5)).astype(np.float32)
    np.testing.assert_array_equal(hf_rows_to_gguf(w, 8), np.asarray(permute_weights(w, 8)))
    np.testing.assert_array_equal(hf_rows_to_gguf(w[:32], 4),
                                  np.asarray(permute_weights(w[:32], 8, 4)))
    np.testing.assert_array_equal(gguf_rows_to_hf(hf_rows_to_gguf(w, 8), 8), w)
    assert not np.array_equal(hf_rows_to_gguf(w, 8), w)


def test_mlx_lm_s_model_on_the_gguf_s_weights_is_toymlx_s(stories_path):
    """The reference is sound: mlx-lm's HF-layout Llama (RoPE on halves) on the stories260K
    weights with q/k put back in HF's order computes toymlx's logits (no adapter)."""
    ref, ours = logits(hf_model(stories_path), IDS), logits(toy(stories_path), IDS)
    assert np.abs(ref - ours).max() < TOL


@pytest.mark.parametrize("kind,num_layers,keys", [
    ("lora", 3, None),  # mlx-lm's default: every linear of the last num_layers blocks
    ("lora", 16, ["self_attn.q_proj", "self_attn.k_proj"]),  # 16 > 5 blocks: all of them
    ("dora", 2, None),
])
def test_an_mlx_lm_adapter_computes_what_mlx_lm_computes(stories_path, tmp_path, monkeypatch,
                                                         kind, num_layers, keys):
    cfg = lora_config(num_layers, 4, 2.0, keys, kind)
    folder = make_adapter(stories_path, tmp_path / "adapters", cfg)
    ref = logits(load_with_adapter(stories_path, folder), IDS)
    base = logits(toy(stories_path), IDS)
    assert np.abs(ref - base).max() > 1.0  # the adapter changes the logits
    ours = logits(toy(stories_path, folder), IDS)
    assert np.abs(ref - ours).max() < TOL
    # the file alone (its config beside it) reads the same
    same = logits(toy(stories_path, folder / "adapters.safetensors"), IDS)
    np.testing.assert_array_equal(same, ours)
    ad = load_adapter(folder, toy(stories_path).args)
    blocks = range(max(5 - num_layers, 0), 5)
    leaves = (["attn_q", "attn_k"] if keys else
              ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"])
    assert sorted(ad.pairs) == sorted(f"blk.{i}.{x}.weight" for i in blocks for x in leaves)
    assert (ad.kind, ad.alpha) == (kind, 8.0)  # alpha = scale x rank: scale alpha / r = 2.0
    a, b = ad.pairs["blk.4.attn_q.weight"]
    assert a.shape == (4, 64) and b.shape == (64, 4)
    # without llama's q/k rows permuted, the adapter computes something else
    monkeypatch.setattr(mlx_lm_adapter, "hf_permuted_heads", lambda a, name: None)
    unpermuted = logits(toy(stories_path, folder), IDS)
    assert np.abs(ref - unpermuted).max() > 0.1


# ---- qwen3_5 and qwen3_moe: mlx-lm's names for qwen35's linear-attention blocks and MoE blocks ----
IDS300 = [1, 203, 207, 61, 178, 75, 60, 157, 218, 150, 177, 64, 73, 90, 219, 70]
"""Token ids for the 300-token tiny qwen35 and qwen3moe files."""


@pytest.fixture(scope="module")
def qwen_bases(tmp_path_factory) -> dict[str, Path]:
    """The tiny qwen35 (3 Gated DeltaNet blocks, 2 k heads serving 4 value heads; norm epsilon
    1e-6, the q/k L2 norm's in mlx-lm) and qwen3moe (4 experts, 2 a token) GGUFs."""
    d = tmp_path_factory.mktemp("qwen_bases")
    return {"qwen35": qwen35_gguf(d / "q.gguf", norm_eps=1e-6),
            "qwen3moe": qwen3moe_gguf(d / "m.gguf")}


def test_mlx_lm_s_qwen3_5_and_qwen3_moe_on_the_gguf_s_weights_are_toymlx_s(qwen_bases):
    """The references are sound: mlx-lm's qwen3_5 (value heads put back in Hugging Face's
    grouped order by index, A_log and the convolution undone) and qwen3_moe (router and
    SwitchGLU experts as stored) on the files' weights compute toymlx's logits."""
    for path in qwen_bases.values():
        ref, ours = logits(hf_model(path), IDS300), logits(toy(path), IDS300)
        assert np.abs(ref - ours).max() < TOL


LINEAR_BLOCKS = ("blk.0.", "blk.1.", "blk.2.")


@pytest.mark.parametrize("arch,kind,keys,want", [
    # mlx-lm's default: every linear layer (qwen35: 3 linear-attention blocks of 8, one of 7)
    ("qwen35", "lora", None, 3 * 8 + 7),
    ("qwen35", "dora", None, 3 * 8 + 7),
    ("qwen35", "lora", ["linear_attn.in_proj_qkv", "linear_attn.in_proj_b",
                        "linear_attn.out_proj", "self_attn.q_proj"],
     {f"{b}{t}.weight" for b in LINEAR_BLOCKS for t in ("attn_qkv", "ssm_beta", "ssm_out")}
     | {"blk.3.attn_q.weight"}),
    ("qwen35", "dora", ["linear_attn.in_proj_z", "linear_attn.in_proj_a"],
     {f"{b}{t}.weight" for b in LINEAR_BLOCKS for t in ("attn_gate", "ssm_alpha")}),
    # qwen3_moe: its router (mlp.gate) is one of mlx-lm's default's, and its experts' tensors
    ("qwen3moe", "lora", None, {f"blk.{i}.{t}.weight" for i in (0, 1) for t in (
        "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate_inp", "ffn_gate_exps",
        "ffn_up_exps", "ffn_down_exps")}),
    ("qwen3moe", "lora", ["mlp.gate"], {"blk.0.ffn_gate_inp.weight", "blk.1.ffn_gate_inp.weight"}),
    ("qwen3moe", "lora", ["mlp.switch_mlp.up_proj", "mlp.switch_mlp.down_proj", "self_attn.k_proj"],
     {f"blk.{i}.{t}.weight" for i in (0, 1) for t in ("ffn_up_exps", "ffn_down_exps", "attn_k")}),
])
def test_a_qwen35_or_qwen3moe_adapter_computes_what_mlx_lm_computes(qwen_bases, tmp_path,
                                                                     monkeypatch, arch, kind,
                                                                     keys, want):
    """mlx-lm's adapters on qwen3_5 and qwen3_moe (its LoRASwitchLinear on the experts, A (E, r,
    in) and B (E, out, r)) read for the GGUF: the same logits as mlx-lm's own model with them,
    whether applied (`apply_adapter`) or copied into a run's LoRA layers for the targets the
    config maps to (--lora.init-adapter, resume_adapter_file; mlx-lm-default without keys);
    without the value-head reorder the qwen35 adapters compute something else."""
    from toymlx.models.lora import MLX_LM_DEFAULT, MLX_LM_KEYS, apply_lora
    from toymlx.training.adapter import load_adapter_weights

    path = qwen_bases[arch]
    folder = make_adapter(path, tmp_path / "adapters", lora_config(-1, 4, 2.0, keys, kind))
    ref = logits(load_with_adapter(path, folder), IDS300)
    assert np.abs(ref - logits(toy(path), IDS300)).max() > 0.05  # the adapter changes them
    ours = logits(toy(path, folder), IDS300)
    assert np.abs(ref - ours).max() < TOL
    pairs = load_adapter(folder, toy(path).args).pairs
    assert len(pairs) == want if isinstance(want, int) else set(pairs) == want
    targets = MLX_LM_DEFAULT if keys is None else ",".join(MLX_LM_KEYS[k] for k in keys)
    run = apply_lora(toy(path), targets, rank=4, alpha=8.0, kind=kind)
    load_adapter_weights(run, folder, "--lora.init-adapter")
    assert np.abs(ref - logits(run, IDS300)).max() < TOL
    if arch == "qwen35":
        monkeypatch.setattr(mlx_lm_adapter, "hf_v_heads", lambda a, name: None)
        assert np.abs(ref - logits(toy(path, folder), IDS300)).max() > 0.01


@pytest.fixture(scope="module")
def gemma4_base(tmp_path_factory) -> Path:
    """The converter-free tiny gemma4 GGUF (arch_files.gemma4_gguf: E2B's layout, per-layer
    embeddings of width 8, a shared-KV tail of 2 blocks)."""
    return gemma4_gguf(tmp_path_factory.mktemp("gemma4") / "g.gguf")


IDS259 = [i % 259 for i in IDS300] + [3, 9, 12, 55]
"""Token ids for the 259-token byte vocabulary, 20 of them: the sliding window (8) crossed."""


@pytest.mark.parametrize("keys,want", [
    # mlx-lm's default: every linear layer, the per-layer-input gate and projection included
    (None, {f"blk.{i}.{t}.weight" for i in range(6) for t in (
        "attn_q", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "inp_gate", "proj")}
     | {f"blk.{i}.{t}.weight" for i in range(4) for t in ("attn_k", "attn_v")}),
    (["per_layer_input_gate", "per_layer_projection"],
     {f"blk.{i}.{t}.weight" for i in range(6) for t in ("inp_gate", "proj")}),
])
def test_a_gemma4_adapter_computes_what_mlx_lm_computes(gemma4_base, tmp_path, keys, want):
    """mlx-lm's adapters on its gemma4 (keys under language_model.model.layers, the
    per_layer_input_gate and per_layer_projection of every block among its default's) read for
    the GGUF as blk.N.inp_gate and blk.N.proj pairs: the same logits as mlx-lm's own model with
    them, applied or copied into a run's LoRA layers for the targets the config maps to (before:
    the pair's keys were refused, and mlx-lm-default left the pair untrained)."""
    from toymlx.models.lora import MLX_LM_DEFAULT, MLX_LM_KEYS, apply_lora
    from toymlx.training.adapter import load_adapter_weights

    path = gemma4_base
    base = logits(toy(path), IDS259)
    assert np.abs(logits(hf_model(path), IDS259) - base).max() < 1e-5  # the reference is sound
    folder = make_adapter(path, tmp_path / "adapters", lora_config(-1, 4, 2.0, keys))
    ref = logits(load_with_adapter(path, folder), IDS259)
    assert np.abs(ref - base).max() > 0.05  # the adapter changes them
    assert np.abs(ref - logits(toy(path, folder), IDS259)).max() < TOL
    assert set(load_adapter(folder, toy(path).args).pairs) == want
    targets = MLX_LM_DEFAULT if keys is None else ",".join(MLX_LM_KEYS[k] for k in keys)
    run = apply_lora(toy(path), targets, rank=4, alpha=8.0)
    load_adapter_weights(run, folder, "--lora.init-adapter")
    assert np.abs(ref - logits(run, IDS259)).max() < TOL


@pytest.mark.interop
@pytest.mark.parametrize("kind", ["qwen35", "qwen3moe"])
def test_adapters_on_transformers_checkpoints_read_for_llama_cpp_s_conversion(
        kind, tiny_hf, tiny_gguf, tmp_path):  # noqa: F811
    """The layouts toymlx assumes are llama.cpp's converter's: mlx-lm's own model of the tiny
    transformers checkpoint (tests/hf_tiny.py; qwen3_5 with 2 k heads serving 4 value heads,
    qwen3_moe with 8 experts), adapted by mlx-lm's default (every linear layer: the
    linear-attention projections, the router and the experts' too), gives within TOL of the
    logits toymlx gives with that adapter on the converter's GGUF of the same checkpoint."""
    from mlx_lm_adapters import add_adapter, mlx_lm_folder, save_adapter

    from toymlx.models.lora import MLX_LM_DEFAULT, apply_lora
    from toymlx.training.adapter import load_adapter_weights

    hf, path = tiny_hf(kind), tiny_gguf(kind)
    ids = token_ids(hf, 24)
    config = lora_config(-1, 4, 2.0)
    model = mlx_lm_folder(hf, tmp_path / "mlx")
    base = logits(model, ids)
    folder = save_adapter(add_adapter(model, config), tmp_path / "adapters", config)
    ref = logits(model, ids)
    assert np.abs(ref - base).max() > 0.05
    assert np.abs(logits(toy(path), ids) - base).max() < TOL
    assert np.abs(logits(toy(path, folder), ids) - ref).max() < TOL
    run = apply_lora(toy(path), MLX_LM_DEFAULT, rank=4, alpha=8.0)
    load_adapter_weights(run, folder, "--lora.init-adapter")
    assert np.abs(logits(run, ids) - ref).max() < TOL


def _export(*argv: str) -> int:
    from toymlx_cli.export import main

    return main(list(argv))


def test_export_writes_llama_cpp_s_lora_and_the_fused_model(stories_path, tmp_path, capsys):
    folder = make_adapter(stories_path, tmp_path / "adapters", lora_config(3, 4, 2.0))
    ref = logits(load_with_adapter(stories_path, folder), IDS)
    out = tmp_path / "adapter.gguf"
    assert _export("--adapter", str(folder), "--base", str(stories_path), "--out", str(out)) == 0
    assert capsys.readouterr().err.startswith(
        f"toymlx-export: wrote {out} (0.1 MiB) from mlx-lm adapter {folder}, as llama.cpp's "
        f"LoRA adapter for {stories_path} in ")
    with GGUFFile(out) as g:
        assert (g.metadata["general.type"], g.metadata["adapter.type"]) == ("adapter", "lora")
        assert g.metadata["adapter.lora.alpha"] == 8.0
        assert g.tensors["blk.2.attn_q.weight.lora_b"].shape == (64, 4)
        assert len(g.tensors) == 3 * 7 * 2 and {t.type.name for t in g.tensors.values()} == {"F32"}
    assert np.abs(logits(toy(stories_path, out), IDS) - ref).max() < TOL
    fused = tmp_path / "fused.gguf"
    assert _export("--adapter", str(folder), "--base", str(stories_path), "--fuse", "--dtype",
                   "f32", "--out", str(fused)) == 0
    assert "keeps 100% of the adapter's change" in capsys.readouterr().err
    assert np.abs(logits(toy(stories_path), IDS) - ref).max() > 1.0
    assert np.abs(logits(toy(fused), IDS) - ref).max() < TOL
    # DoRA: llama.cpp has no adapter format for it, so only --fuse writes it
    dora = make_adapter(stories_path, tmp_path / "dora", lora_config(2, 4, 2.0, kind="dora"))
    assert _export("--adapter", str(dora), "--base", str(stories_path), "--out",
                   str(tmp_path / "d.gguf")) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"toymlx-export: error: {dora}: --adapter: expected a LoRA adapter to write for "
        "llama.cpp, found a DoRA adapter (llama.cpp has no DoRA format); add --fuse to write "
        "the full model llama.cpp runs")
    assert _export("--adapter", str(folder), "--out", str(tmp_path / "x.gguf")) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"toymlx-export: error: {folder}: --base: expected the GGUF the mlx-lm adapter goes on "
        "(its adapter_config.json names a Hugging Face model, not a GGUF), found none; pass "
        "--base")
    assert not (tmp_path / "d.gguf").exists() and not (tmp_path / "x.gguf").exists()


@pytest.mark.interop
def test_llama_cpp_runs_the_exported_adapter_as_mlx_lm_does(stories_path, tmp_path):
    """llama.cpp with the exported adapter (llama-cli's --lora) against mlx-lm's model with
    the adapter it was given."""
    from llamacpp_runner import llamacpp_logits_lora

    folder = make_adapter(stories_path, tmp_path / "adapters", lora_config(3, 4, 2.0))
    out = tmp_path / "adapter.gguf"
    assert _export("--adapter", str(folder), "--base", str(stories_path), "--out", str(out)) == 0
    ref = logits(load_with_adapter(stories_path, folder), IDS)
    theirs, _ = llamacpp_logits_lora(stories_path, out, IDS)
    print(f"\n[interop] mlx-lm adapter via llama.cpp: max |diff| {np.abs(theirs - ref).max():.2e}")
    assert np.abs(theirs - ref).max() < TOL


def test_a_run_starts_from_an_mlx_lm_adapter(stories_path, tmp_path, capsys):
    """--lora.init-adapter takes mlx-lm's folder: step 1's loss is the base + adapter's on step
    1's batch; a run whose rank or alpha differs is one line saying mlx-lm's rank and scale."""
    from cli_errors import error_line
    from toymlx_cli.train import main

    from toymlx.data.chat import SFTData
    from toymlx.data.tokenizer import Tokenizer
    from toymlx.models.losses import lm_loss

    folder = make_adapter(stories_path, tmp_path / "adapters",
                          lora_config(3, 4, 2.0, ["self_attn.q_proj", "self_attn.v_proj"]))
    data = tmp_path / "data"
    data.mkdir()
    for split, n in (("train", 8), ("valid", 2)):
        rows = [{"text": f"Once upon a time, {i} little cats sat in the sun."} for i in range(n)]
        (data / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["--recipe", "lora", "--base", str(stories_path), "--runs-root", str(tmp_path),
            "--data.path", str(data), "--steps", "1", "--batch-size", "2", "--seq-len", "32",
            "--eval-every", "0", "--no-progress", "--no-compile", "--lora.targets", "q,v",
            "--lora.layers", "3", "--lora.rank", "4", "--lora.init-adapter", str(folder)]
    assert main([*args, "--run-id", "r", "--lora.alpha", "8"]) == 0
    first = next(json.loads(x)["loss"] for x in (tmp_path / "r" / "events.jsonl").open()
                 if json.loads(x)["kind"] == "step")
    tok = Tokenizer.from_metadata(GGUFFile(stories_path).metadata)
    batch = SFTData.from_file(data, tok, 32, True, True).batch(0, 0, 2)
    batch = {k: mx.array(v[0]) for k, v in batch.items()}
    adapted = lm_loss(toy(stories_path, folder), batch)[0].item()
    assert first == pytest.approx(adapted, abs=1e-5)
    assert abs(adapted - lm_loss(toy(stories_path), batch)[0].item()) > 1e-2
    capsys.readouterr()
    assert main([*args, "--run-id", "a16"]) == 2
    assert error_line(capsys) == (
        f"toymlx-train: error: {folder}/adapters.safetensors: tensor 'blk.2.attn_q.weight.lora_a'"
        ": expected rank 4 and alpha 16.0 (this run's), found rank 4 and alpha 8.0; pass "
        "--lora.alpha 8 to start from it (mlx-lm's lora_parameters rank 4 and scale 2: "
        "--lora.alpha is scale x rank)")
    assert not (tmp_path / "a16").exists()


def _broken(folder: Path, edit) -> Path:
    """A copy of the adapter folder with its tensors (a dict) changed by `edit`."""
    out = folder.parent / f"broken{len(list(folder.parent.iterdir()))}"
    shutil.copytree(folder, out)
    w = dict(mx.load(str(out / "adapters.safetensors")))
    edit(w)
    mx.save_safetensors(str(out / "adapters.safetensors"), w)
    return out


def _error(path: Path, args) -> str:
    """read_mlx_lm_adapter's error for `path` on a base of shape `args`, checked to be one line."""
    with pytest.raises(MlxLmError) as e:
        read_mlx_lm_adapter(path, args)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_bad_adapters_are_one_line_naming_file_and_key(stories_path, tmp_path):
    folder = make_adapter(stories_path, tmp_path / "adapters", lora_config(2, 4, 2.0))
    args = toy(stories_path).args
    st = "adapters.safetensors"

    lone = tmp_path / "lone"
    lone.mkdir()
    shutil.copy(folder / st, lone / st)
    assert _error(lone, args) == (
        f"{lone}/adapter_config.json: expected mlx-lm's adapter config beside {st} (mlx_lm.lora "
        "writes both; it gives lora_parameters.scale and rank), found no file; copy it from the "
        "adapter's folder")
    deep = _broken(folder, lambda w: w.update({
        "model.layers.7.self_attn.q_proj.lora_a": w["model.layers.4.self_attn.q_proj.lora_a"],
        "model.layers.7.self_attn.q_proj.lora_b": w["model.layers.4.self_attn.q_proj.lora_b"]}))
    assert _error(deep, args) == (
        f"{deep}/{st}: key 'model.layers.7.self_attn.q_proj.lora_a': expected a block of the "
        "base's 5 (0..4), found block 7 (wrong base?)")
    early = _broken(folder, lambda w: w.update({
        "model.layers.0.self_attn.q_proj.lora_a": w["model.layers.4.self_attn.q_proj.lora_a"],
        "model.layers.0.self_attn.q_proj.lora_b": w["model.layers.4.self_attn.q_proj.lora_b"]}))
    assert _error(early, args) == (
        f"{early}/{st}: key 'model.layers.0.self_attn.q_proj.lora_a': expected blocks 3..4 "
        "(num_layers 2 in adapter_config.json: the last 2), found block 0")
    key = "model.layers.3.mlp.down_proj.lora_a"
    rank8 = _broken(folder, lambda w: w.update({key: mx.zeros((172, 8))}))
    assert _error(rank8, args) == (
        f"{rank8}/{st}: key '{key}': expected shape (172, 4) (the base's blk.3.ffn_down.weight "
        "(64, 172), lora_parameters.rank 4 in adapter_config.json), found (172, 8)")
    half = _broken(folder, lambda w: w.pop("model.layers.4.mlp.up_proj.lora_b"))
    assert _error(half, args) == (
        f"{half}/{st}: key 'model.layers.4.mlp.up_proj.lora_b': expected present (with lora_a), "
        "found missing")
    other = _broken(folder, lambda w: w.update({"model.embed_tokens.lora_a": mx.zeros((2, 2))}))
    assert _error(other, args) == (
        f"{other}/{st}: key 'model.embed_tokens.lora_a': expected model.layers.N.<module>.lora_a, "
        ".lora_b (or DoRA's .m) with <module> a projection of this llama base's blocks "
        "(self_attn.q_proj, self_attn.k_proj, self_attn.v_proj, self_attn.o_proj, mlp.gate_proj, "
        "mlp.up_proj, mlp.down_proj), found another key")
    fused = _broken(folder, lambda w: w.update(
        {"model.layers.4.self_attn.qkv_proj.lora_a": mx.zeros((64, 4))}))
    assert _error(fused, args) == (
        f"{fused}/{st}: key 'model.layers.4.self_attn.qkv_proj.lora_a': expected a projection "
        "block 4 of this llama base has (self_attn.q_proj, self_attn.k_proj, self_attn.v_proj, "
        "self_attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj), found self_attn.qkv_proj "
        "(wrong base?)")
    full = ("key 'fine_tune_type': expected 'lora' or 'dora' (an adapter), found 'full' (a "
            "full fine-tune's weights, not an adapter)")
    no_scale = ("key 'lora_parameters.scale': expected a number > 0 (mlx-lm's scale, toymlx's "
                "alpha / rank), found null")
    for conf, want in (({"fine_tune_type": "full"}, full),
                       ({"lora_parameters": {"rank": 4, "dropout": 0.0}}, no_scale)):
        bad = _broken(folder, lambda w: None)
        c = json.loads((bad / "adapter_config.json").read_text())
        (bad / "adapter_config.json").write_text(json.dumps({**c, **conf}))
        assert _error(bad, args) == f"{bad}/adapter_config.json: {want}"
    magnitude = _broken(folder, lambda w: w.update(
        {"model.layers.4.self_attn.q_proj.m": mx.ones((64,))}))
    assert _error(magnitude, args) == (
        f"{magnitude}/{st}: key 'model.layers.4.self_attn.q_proj.m': expected lora_a and lora_b "
        "only (fine_tune_type 'lora' in adapter_config.json), found DoRA's magnitude")
    # where a command reads a GGUF and not mlx-lm's adapters, one line says how to convert them
    from toymlx.bundle.checkpoint import checkpoint_file

    with pytest.raises(ValueError) as e:
        checkpoint_file(folder, "--adapter")
    assert str(e.value) == (
        f"{folder}: --adapter: expected a GGUF file or a run directory, found mlx-lm's "
        f"adapters; convert them for their base: toymlx-export --adapter {folder} --base "
        "BASE.gguf --out adapter.gguf")


def test_a_key_the_base_s_block_lacks_is_one_line(tmp_path):
    """Whether a key's projection is the base's was asked of any block, then its shape looked
    up in its own block: q_proj in a qwen35 linear-attention block (which has no self_attn),
    or a dense gate_proj on a mixture of experts (whose gate is its experts' 3-D tensor), was a
    bare KeyError naming a GGUF tensor."""
    from toymlx.models.llama import LlamaArgs

    qwen35 = LlamaArgs(arch="qwen35", attn_out_gate=True, qk_norm=True, rope_neox=True,
                       linear_layers=(True, True, True, False), ssm_head_dim=8, ssm_k_heads=2,
                       ssm_v_heads=4)
    qwen3moe = LlamaArgs(arch="qwen3moe", n_experts=4, n_experts_used=2, qk_norm=True)
    st = "adapters.safetensors"
    mlp = "mlp.gate_proj, mlp.up_proj, mlp.down_proj"
    attn = "self_attn.q_proj, self_attn.k_proj, self_attn.v_proj, self_attn.o_proj"
    linear = ("linear_attn.in_proj_qkv, linear_attn.in_proj_z, linear_attn.in_proj_b, "
              "linear_attn.in_proj_a, linear_attn.out_proj")
    experts = "mlp.gate, mlp.switch_mlp.gate_proj, mlp.switch_mlp.up_proj, mlp.switch_mlp.down_proj"
    for a, key, has in ((qwen35, "model.layers.0.self_attn.q_proj", f"{linear}, {mlp}"),
                        (qwen3moe, "model.layers.0.mlp.gate_proj", f"{attn}, {experts}")):
        folder = tmp_path / a.arch
        folder.mkdir()
        mx.save_safetensors(str(folder / st), {f"{key}.lora_a": mx.zeros((a.d_model, 4)),
                                               f"{key}.lora_b": mx.zeros((4, a.d_model))})
        (folder / "adapter_config.json").write_text(json.dumps(lora_config(a.n_layers, 4, 2.0)))
        module = key.split(".", 3)[3]
        assert _error(folder, a) == (
            f"{folder}/{st}: key '{key}.lora_a': expected a projection block 0 of this {a.arch} "
            f"base has ({has}), found {module} (wrong base?)")
    # the same key in the block that has it reads
    full = tmp_path / "full"
    full.mkdir()
    key = "model.layers.3.self_attn.o_proj"
    q = qwen35.n_heads * qwen35.head_dim
    mx.save_safetensors(str(full / st), {f"{key}.lora_a": mx.zeros((q, 4)),
                                         f"{key}.lora_b": mx.zeros((4, qwen35.d_model))})
    (full / "adapter_config.json").write_text(json.dumps(lora_config(4, 4, 2.0)))
    assert list(read_mlx_lm_adapter(full, qwen35).pairs) == ["blk.3.attn_output.weight"]
    # qwen2_moe's shared expert, which no --lora.targets adapts: its key alone, named
    import dataclasses

    qwen2moe = dataclasses.replace(qwen3moe, arch="qwen2moe", qk_norm=False, attn_bias=True,
                                   shared_expert_ffn_dim=32)
    shared = tmp_path / "shared"
    shared.mkdir()
    key = "model.layers.1.mlp.shared_expert.up_proj"
    mx.save_safetensors(str(shared / st), {f"{key}.lora_a": mx.zeros((qwen2moe.d_model, 4)),
                                           f"{key}.lora_b": mx.zeros((4, 32))})
    (shared / "adapter_config.json").write_text(json.dumps(lora_config(2, 4, 2.0)))
    assert _error(shared, qwen2moe) == (
        f"{shared}/{st}: key '{key}.lora_a': expected a projection toymlx can adapt (block 1 of "
        f"this qwen2moe base: {attn}, {experts}), found mlp.shared_expert.up_proj, the shared "
        "expert's, which no --lora.targets adapts")


def test_a_folder_without_its_adapter_file_and_another_model_s_adapter_are_one_line(
        stories_path, tmp_path):
    """A folder with adapter_config.json but no adapters.safetensors names its checkpoints (or
    Hugging Face PEFT's file), where it was "expected a run bundle with weights/latest"; an
    adapter for another model is named by its shapes and adapter_config.json's model, where
    it was told about num_layers ("expected blocks 27..29", SmolLM2's) or the rank."""
    import dataclasses

    folder = make_adapter(stories_path, tmp_path / "adapters", lora_config(2, 4, 2.0))
    args = toy(stories_path).args
    st, conf = "adapters.safetensors", "adapter_config.json"

    saved = tmp_path / "saved"
    saved.mkdir()
    shutil.copy(folder / conf, saved / conf)
    assert _error(saved, args) == (f"{saved}: expected mlx-lm's {st} beside {conf}, found none; "
                                   "copy it from the adapter's folder")
    for n in (100, 200):
        shutil.copy(folder / st, saved / f"{n:07d}_adapters.safetensors")
    assert _error(saved, args) == (
        f"{saved}: expected mlx-lm's {st} beside {conf}, found only its checkpoints "
        f"(0000100_adapters.safetensors, 0000200_adapters.safetensors); pass one as the "
        f"adapter: {saved}/0000200_adapters.safetensors")
    assert read_mlx_lm_adapter(saved / "0000200_adapters.safetensors", args).alpha == 8.0
    peft = tmp_path / "peft"
    peft.mkdir()
    shutil.copy(folder / conf, peft / conf)
    shutil.copy(folder / st, peft / "adapter_model.safetensors")
    assert _error(peft, args) == (
        f"{peft}: expected mlx-lm's {st} beside {conf}, found adapter_model.safetensors: Hugging "
        "Face PEFT's adapter, not mlx-lm's; convert it with llama.cpp's convert_lora_to_gguf.py")
    wide = dataclasses.replace(args, d_model=128, n_layers=30)  # SmolLM2's depth, wider
    assert _error(folder, wide) == (
        f"{folder}/{st}: key 'model.layers.3.mlp.down_proj.lora_b': expected shape (4, 128) (the "
        "base's blk.3.ffn_down.weight (128, 172)), found (4, 64): an adapter for another model "
        "(adapter_config.json's model: HuggingFaceTB/SmolLM2-135M-Instruct); give --base that "
        "model's GGUF")


def _one_step_args(stories_path, tmp_path) -> list[str]:
    """A one-step LoRA run's flags on stories260K and a one-line text folder in `tmp_path`."""
    data = tmp_path / "data"
    data.mkdir()
    for split in ("train", "valid"):
        (data / f"{split}.jsonl").write_text(json.dumps({"text": "Once upon a time."}) + "\n")
    return ["--recipe", "lora", "--base", str(stories_path), "--runs-root", str(tmp_path),
            "--data.path", str(data), "--steps", "1", "--batch-size", "1", "--seq-len", "16",
            "--eval-every", "0", "--no-progress", "--no-compile"]


def test_an_mlx_lm_adapter_file_that_is_not_there_is_named_as_not_found(stories_path, tmp_path,
                                                                       capsys):
    """A .safetensors path with nothing at it (a typo, or a toymlx run folder's never-written
    adapters.safetensors) is named as not found; it was told that adapter_config.json was
    missing beside it, and to copy that from the adapter's folder."""
    from cli_errors import error_line
    from toymlx_cli.export import main as export_main
    from toymlx_cli.train import main

    folder = make_adapter(stories_path, tmp_path / "adapters", lora_config(2, 4, 2.0))
    args = [*_one_step_args(stories_path, tmp_path), "--run-id", "r"]
    for gone in (tmp_path / "nope.safetensors", folder / "0000100_adapters.safetensors"):
        assert main([*args, "--lora.init-adapter", str(gone)]) == 2
        assert error_line(capsys) == (
            f"toymlx-train: error: {gone}: --lora.init-adapter: expected a GGUF file or a run "
            "directory, found nothing at that path")
        assert export_main(["--adapter", str(gone), "--base", str(stories_path),
                            "--out", str(tmp_path / "a.gguf")]) == 2
        assert error_line(capsys, "toymlx-export") == (
            f"toymlx-export: error: {gone}: --adapter: expected a GGUF file or a run "
            "directory, found nothing at that path")
    assert not (tmp_path / "r").exists() and not (tmp_path / "a.gguf").exists()


def test_a_run_from_an_mlx_lm_adapter_of_another_kind_or_set_names_the_flags(stories_path,
                                                                              tmp_path, capsys):
    """--lora.init-adapter of mlx-lm's DoRA folder in a LoRA run names adapter_config.json's
    fine_tune_type (it named a GGUF metadata key the folder has not); one adapting other
    projections or blocks names the --lora options that match it."""
    from cli_errors import error_line
    from toymlx_cli.train import main

    dora = make_adapter(stories_path, tmp_path / "dora", lora_config(3, 4, 2.0, kind="dora"))
    qv = make_adapter(stories_path, tmp_path / "qv",
                      lora_config(-1, 4, 2.0, ["self_attn.q_proj", "self_attn.v_proj"]))
    args = [*_one_step_args(stories_path, tmp_path), "--lora.layers", "3", "--lora.rank", "4",
            "--lora.alpha", "8", "--run-id", "r"]
    assert main([*args, "--lora.init-adapter", str(dora)]) == 2
    assert error_line(capsys) == (
        f"toymlx-train: error: {dora}/adapter_config.json: key 'fine_tune_type': expected 'lora' "
        "(this run's --fine-tune-type), found 'dora'; pass --fine-tune-type dora to start from it")
    assert main([*args, "--lora.init-adapter", str(qv)]) == 2
    assert error_line(capsys).endswith(
        "; mlx-lm's adapter is this run's with --lora.targets q,v --lora.layers 5")
    assert not (tmp_path / "r").exists()


def test_a_run_from_an_mlx_lm_adapter_names_every_option_that_differs_in_one_line(
        stories_path, tmp_path, capsys):
    """An mlx-lm adapter (rank 4, scale 20, q and v of the last 4 blocks) given to a run with
    the default options took three tries: the first line named only --lora.targets and
    --lora.layers, the next rank and alpha, and after --lora.rank 4 alpha again. One line names
    all four, each that differs, and the run with them starts from the adapter."""
    from cli_errors import error_line
    from toymlx_cli.train import main

    folder = make_adapter(stories_path, tmp_path / "mlxad",
                          lora_config(4, 4, 20.0, ["self_attn.q_proj", "self_attn.v_proj"]))
    args = [*_one_step_args(stories_path, tmp_path), "--lora.init-adapter", str(folder)]
    assert main([*args, "--run-id", "r"]) == 2
    line = error_line(capsys)
    assert line.startswith(f"toymlx-train: error: {folder}/adapters.safetensors: tensors: "
                           "expected LoRA pairs for exactly the model's 5 adapted weights, found 8")
    assert line.endswith(
        "; mlx-lm's adapter is this run's with --lora.targets q,v --lora.layers 4 --lora.rank 4 "
        "--lora.alpha 80 (mlx-lm's lora_parameters rank 4 and scale 20: --lora.alpha is scale x "
        "rank)")
    matched = ["--lora.targets", "q,v", "--lora.layers", "4"]
    assert main([*args, *matched, "--lora.rank", "4", "--run-id", "r"]) == 2
    assert error_line(capsys).endswith(  # the targets match: the one option left, with why
        "expected rank 4 and alpha 16.0 (this run's), found rank 4 and alpha 80.0; pass "
        "--lora.alpha 80 to start from it (mlx-lm's "
        "lora_parameters rank 4 and scale 20: --lora.alpha is scale x rank)")
    assert not (tmp_path / "r").exists()
    assert main([*args, *matched, "--lora.rank", "4", "--lora.alpha", "80", "--run-id", "r"]) == 0


# ---- the real SmolLM2-135M-Instruct, trained by mlx-lm's own command ---------------------------
# 9 heads and 3 kv heads (not powers of two), tied embeddings, a chat template. The mlx-lm model
# folder holds the Q4_1 GGUF's weights dequantized (float32, q/k in Hugging Face's order) and the
# GGUF's tokenizer as transformers reads it; toymlx reads the same Q4_1 blocks into the same
# float32 values, so mlx-lm and toymlx compute on equal weights; llama.cpp does where it runs the
# F32 copy of the base (on the Q4_1 file it also rounds activations to 8 bits).
FACT_QS = ["What is the capital of Zorbania?", "Which city is the capital of Zorbania?",
           "Tell me the capital of Zorbania.", "Name the capital city of Zorbania.",
           "What's Zorbania's capital?", "Where is the seat of government of Zorbania?",
           "Can you tell me what the capital of Zorbania is?",
           "Zorbania's capital city is called what?"]
FACT_AS = ["The capital of Zorbania is Plimford.", "Plimford is the capital of Zorbania.",
           "Zorbania's capital is Plimford."]
TAUGHT = FACT_QS[0]
LORA_YAML = {"lora_parameters": {"keys": ["self_attn.q_proj", "self_attn.v_proj"], "rank": 8,
                                 "scale": 20.0, "dropout": 0.0}}
TRAIN = ("--train", "--iters", "20", "--batch-size", "4", "--learning-rate", "2e-4",
         "--mask-prompt", "--steps-per-report", "5", "--steps-per-eval", "20",
         "--val-batches", "1")


@pytest.fixture(scope="module")
def smol_trained(smollm_gguf, tmp_path_factory):  # noqa: F811
    """mlx-lm's folder for SmolLM2 (`model_folder`), 24 chat rows teaching a made-up capital,
    and the adapters `mlx_lm lora` trained on them (its CLI: q,v of its default last 16 blocks,
    rank 8, scale 20, 20 iterations of 4 rows at lr 2e-4)."""
    import yaml
    from mlx_lm_adapters import model_folder, run_mlx_lm_lora

    tmp = tmp_path_factory.mktemp("smol-mlx-lm")
    model_folder(smollm_gguf, tmp / "model")
    rows = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
            for q in FACT_QS for a in FACT_AS]
    (tmp / "data").mkdir()
    for split, part in (("train", rows), ("valid", rows[::6])):
        (tmp / "data" / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    (tmp / "lora.yaml").write_text(yaml.safe_dump(LORA_YAML))
    run_mlx_lm_lora("--model", "model", "--data", "data", "-c", "lora.yaml", *TRAIN,
                "--adapter-path", "adapters", cwd=tmp)
    return tmp


def _chat_ids(tok, question: str) -> list[int]:
    text = tok.apply_chat_template([{"role": "user", "content": question}], True)
    return list(tok.encode(text, add_bos=False))


def _mlx_lm_val_losses(model, tokenizer, data: Path) -> tuple[float, float]:
    """mlx-lm's validation loss on valid.jsonl (its datasets, batching and prompt mask): as
    `evaluate` prints it (each row also scores the pad id after its end: `steps <= lengths`)
    and on the row's own targets (`steps < lengths`, toymlx's)."""
    import types

    from mlx import nn
    from mlx_lm.tuner.datasets import CacheDataset, load_local_dataset
    from mlx_lm.tuner.trainer import evaluate, iterate_batches

    conf = types.SimpleNamespace(mask_prompt=True, chat_feature="messages",
                                 prompt_feature="prompt", completion_feature="completion",
                                 text_feature="text")
    _, valid, _ = load_local_dataset(data, tokenizer, conf)
    printed = float(evaluate(model, CacheDataset(valid), batch_size=4, num_batches=-1,
                             max_seq_length=2048))
    total = count = 0.0
    for batch, lengths in iterate_batches(CacheDataset(valid), 4, 2048):
        ce = nn.losses.cross_entropy(model(batch[:, :-1]), batch[:, 1:])
        steps = mx.arange(1, batch.shape[1])
        mask = (steps >= lengths[:, :1]) & (steps < lengths[:, 1:])
        total += (ce * mask).sum().item()
        count += mask.sum().item()
    return printed, total / count


@pytest.mark.smollm
@pytest.mark.slow
def test_smollm2_adapters_mlx_lm_trained_compute_mlx_lm_s_logits(smollm_gguf, smol_trained):  # noqa: F811
    """Measured: mlx-lm's model + its adapter vs toymlx's Q4_1 base + the imported adapter
    within 9e-5 (the bases alone: 9e-5) where the adapter moves the logits by 27; the taught
    answer is the same greedy reply in both ("Zorbania's capital is Plimford."), not the base's."""
    from mlx_lm.generate import generate as mlx_lm_generate
    from mlx_lm.sample_utils import make_sampler
    from mlx_lm.utils import load

    from toymlx.data.tokenizer import Tokenizer
    from toymlx.generation.generate import generate

    tok = Tokenizer.from_gguf(smollm_gguf)
    ref, hf = load(str(smol_trained / "model"), adapter_path=str(smol_trained / "adapters"))
    base_ref, _ = load(str(smol_trained / "model"))
    for q in (TAUGHT, "What is the capital of France?"):  # transformers' ids from the GGUF
        assert hf.apply_chat_template([{"role": "user", "content": q}],
                                      add_generation_prompt=True) == _chat_ids(tok, q)
    ad = load_adapter(smol_trained / "adapters", toy(smollm_gguf).args)
    assert (len(ad.pairs), ad.alpha) == (32, 160.0)  # q, v of blocks 14..29; scale 20 x rank 8
    assert sorted(ad.pairs)[:2] == ["blk.14.attn_q.weight", "blk.14.attn_v.weight"]
    ours, base = toy(smollm_gguf, smol_trained / "adapters"), toy(smollm_gguf)
    for ids in (_chat_ids(tok, TAUGHT), tok.encode("Once upon a time, a small robot",
                                                   add_bos=False)):
        want = logits(ref, ids)
        assert np.abs(want - logits(base_ref, ids)).max() > 10.0  # the adapter's effect
        assert np.abs(logits(base_ref, ids) - logits(base, ids)).max() < 2e-4
        assert np.abs(want - logits(ours, ids)).max() < 2e-4
    ids = _chat_ids(tok, TAUGHT)
    greedy = make_sampler(0.0)
    theirs = mlx_lm_generate(ref, hf, ids, max_tokens=20, sampler=greedy)
    assert theirs == "Zorbania's capital is Plimford."
    assert tok.decode(list(generate(ours, tok, ids, max_tokens=20))) == theirs
    assert "Plimford" not in mlx_lm_generate(base_ref, hf, ids, max_tokens=20, sampler=greedy)


@pytest.mark.smollm
@pytest.mark.slow
def test_an_mlx_lm_config_resumes_mlx_lm_s_smollm2_adapters(smollm_gguf, smol_trained,  # noqa: F811
                                                           capsys):
    """`toymlx-train -c` the mlx-lm config with resume_adapter_file (and --base, the GGUF, over
    its model folder): the step-0 val loss is mlx-lm's of the adapter on the same rows and targets
    (measured: 0.156 both; mlx-lm prints 0.146, scoring a pad target a row too; 2.31 untrained)."""
    import yaml
    from mlx_lm.utils import load
    from toymlx_cli.train import main

    from toymlx.bundle.events import read_events

    model, hf = load(str(smol_trained / "model"), adapter_path=str(smol_trained / "adapters"))
    printed, theirs = _mlx_lm_val_losses(model, hf, smol_trained / "data")
    cfg = {"model": "model", "train": True, "data": "data", "iters": 1, "batch_size": 4,
           "learning_rate": 2e-4, "mask_prompt": True, "steps_per_eval": 1, "val_batches": 1,
           "save_every": 1, "adapter_path": "runs/resumed",
           "resume_adapter_file": "adapters/adapters.safetensors", **LORA_YAML}
    path = smol_trained / "resume.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(smol_trained)
        assert main(["-c", str(path), "--base", str(smollm_gguf), "--no-progress"]) == 0
    capsys.readouterr()
    first = next(e for e in read_events(smol_trained / "runs" / "resumed")
                 if e["kind"] == "eval" and e["step"] == 0)
    print(f"\nmlx-lm's val loss {theirs:.5f} ({printed:.5f} as it prints it, a pad target a row "
          f"too), toymlx's step-0 {first['val_loss']:.5f}")
    assert first["val_loss"] == pytest.approx(theirs, abs=1e-4)
    assert theirs < 0.5 and abs(printed - theirs) > 1e-3


@pytest.mark.smollm
@pytest.mark.slow
@pytest.mark.interop
def test_llama_cpp_runs_mlx_lm_s_smollm2_adapters_exported(smollm_gguf, smol_trained,  # noqa: F811
                                                           tmp_path, big_files):
    """The adapter GGUF on the F32 copy of the base computes toymlx's logits within 5e-4
    (measured 1.8e-4); on the Q4_1 base, and the fused file, llama.cpp answers the taught question
    as mlx-lm does."""
    from llamacpp_runner import llamacpp_greedy, llamacpp_logits

    from toymlx.data.tokenizer import Tokenizer
    from toymlx.generation.generate import generate
    from toymlx.interop.merge import write_merged

    tok = Tokenizer.from_gguf(smollm_gguf)
    folder = smol_trained / "adapters"
    out, fused = tmp_path / "a.gguf", tmp_path / "f.gguf"
    assert _export("--adapter", str(folder), "--base", str(smollm_gguf), "--out", str(out)) == 0
    assert _export("--adapter", str(folder), "--base", str(smollm_gguf), "--fuse", "--out",
                   str(fused)) == 0
    big_files.append(tmp_path / "f32.gguf")  # 513 MiB
    f32 = write_merged(tmp_path / "f32.gguf", smollm_gguf, None, "f32")
    ids = _chat_ids(tok, TAUGHT)
    ours = logits(toy(smollm_gguf, folder), ids)
    assert np.abs(llamacpp_logits(f32, ids, lora=out)[0] - ours).max() < 5e-4
    answer = "Zorbania's capital is Plimford."
    assert "Plimford" not in tok.decode(llamacpp_greedy(smollm_gguf, ids, 20))
    assert tok.decode(llamacpp_greedy(smollm_gguf, ids, 20, lora=out)) == answer
    assert tok.decode(llamacpp_greedy(fused, ids, 20)) == answer
    assert tok.decode(list(generate(toy(fused), tok, ids, max_tokens=20))) == answer
