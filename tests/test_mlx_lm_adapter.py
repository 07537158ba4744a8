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
from mlx_lm.gguf import permute_weights
from mlx_lm_adapters import hf_model, load_with_adapter, logits, lora_config, make_adapter

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
        ": expected rank 4 and alpha 16.0 (this run's), found rank 4 and alpha 8.0 (mlx-lm's "
        "lora_parameters rank 4 and scale 2: --lora.alpha is scale x rank)")
    assert not (tmp_path / "a16").exists()


def _broken(folder: Path, edit) -> Path:
    """A copy of the adapter folder with its tensors (a dict) changed by `edit`."""
    out = folder.parent / f"broken{len(list(folder.parent.iterdir()))}"
    shutil.copytree(folder, out)
    w = dict(mx.load(str(out / "adapters.safetensors")))
    edit(w)
    mx.save_safetensors(str(out / "adapters.safetensors"), w)
    return out


def test_bad_adapters_are_one_line_naming_file_and_key(stories_path, tmp_path):
    folder = make_adapter(stories_path, tmp_path / "adapters", lora_config(2, 4, 2.0))
    args = toy(stories_path).args
    st = "adapters.safetensors"

    def line(path) -> str:
        with pytest.raises(MlxLmError) as e:
            read_mlx_lm_adapter(path, args)
        assert "\n" not in str(e.value)
        return str(e.value)

    lone = tmp_path / "lone"
    lone.mkdir()
    shutil.copy(folder / st, lone / st)
    assert line(lone) == (
        f"{lone}/adapter_config.json: expected mlx-lm's adapter config beside {st} (mlx_lm.lora "
        "writes both; it gives lora_parameters.scale and rank), found no file; copy it from the "
        "adapter's folder")
    deep = _broken(folder, lambda w: w.update({
        "model.layers.7.self_attn.q_proj.lora_a": w["model.layers.4.self_attn.q_proj.lora_a"],
        "model.layers.7.self_attn.q_proj.lora_b": w["model.layers.4.self_attn.q_proj.lora_b"]}))
    assert line(deep) == (
        f"{deep}/{st}: key 'model.layers.7.self_attn.q_proj.lora_a': expected a block of the "
        "base's 5 (0..4), found block 7 (wrong base?)")
    early = _broken(folder, lambda w: w.update({
        "model.layers.0.self_attn.q_proj.lora_a": w["model.layers.4.self_attn.q_proj.lora_a"],
        "model.layers.0.self_attn.q_proj.lora_b": w["model.layers.4.self_attn.q_proj.lora_b"]}))
    assert line(early) == (
        f"{early}/{st}: key 'model.layers.0.self_attn.q_proj.lora_a': expected blocks 3..4 "
        "(num_layers 2 in adapter_config.json: the last 2), found block 0")
    key = "model.layers.3.mlp.down_proj.lora_a"
    rank8 = _broken(folder, lambda w: w.update({key: mx.zeros((172, 8))}))
    assert line(rank8) == (
        f"{rank8}/{st}: key '{key}': expected shape (172, 4) (the base's blk.3.ffn_down.weight "
        "(64, 172), lora_parameters.rank 4 in adapter_config.json), found (172, 8)")
    half = _broken(folder, lambda w: w.pop("model.layers.4.mlp.up_proj.lora_b"))
    assert line(half) == (
        f"{half}/{st}: key 'model.layers.4.mlp.up_proj.lora_b': expected present (with lora_a), "
        "found missing")
    other = _broken(folder, lambda w: w.update({"model.embed_tokens.lora_a": mx.zeros((2, 2))}))
    assert line(other) == (
        f"{other}/{st}: key 'model.embed_tokens.lora_a': expected model.layers.N.<module>.lora_a, "
        ".lora_b (or DoRA's .m) with <module> one of self_attn.q_proj, self_attn.k_proj, "
        "self_attn.v_proj, self_attn.qkv_proj, self_attn.o_proj, mlp.gate_proj, mlp.up_proj, "
        "mlp.gate_up_proj, mlp.down_proj, found another key")
    fused = _broken(folder, lambda w: w.update(
        {"model.layers.4.self_attn.qkv_proj.lora_a": mx.zeros((64, 4))}))
    assert line(fused) == (
        f"{fused}/{st}: key 'model.layers.4.self_attn.qkv_proj.lora_a': expected a projection "
        "this llama base has (self_attn.q_proj, self_attn.k_proj, self_attn.v_proj, "
        "self_attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj), found self_attn.qkv_proj")
    full = ("key 'fine_tune_type': expected 'lora' or 'dora' (an adapter), found 'full' (a "
            "full fine-tune's weights, not an adapter)")
    no_scale = ("key 'lora_parameters.scale': expected a number > 0 (mlx-lm's scale, toymlx's "
                "alpha / rank), found null")
    for conf, want in (({"fine_tune_type": "full"}, full),
                       ({"lora_parameters": {"rank": 4, "dropout": 0.0}}, no_scale)):
        bad = _broken(folder, lambda w: None)
        c = json.loads((bad / "adapter_config.json").read_text())
        (bad / "adapter_config.json").write_text(json.dumps({**c, **conf}))
        assert line(bad) == f"{bad}/adapter_config.json: {want}"
    magnitude = _broken(folder, lambda w: w.update(
        {"model.layers.4.self_attn.q_proj.m": mx.ones((64,))}))
    assert line(magnitude) == (
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
