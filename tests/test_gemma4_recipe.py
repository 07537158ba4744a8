"""Gemma 4 through the commands a user runs, on a converter-free file (tests/arch_files.py's
`gemma4_gguf`: every piece of the converter's tiny `gemma4` kind, the byte vocabulary): a
`toymlx-train --recipe lora` run stopped after a checkpoint and resumed is the uninterrupted run
bit for bit (LoRA and full fine-tune: the shared-KV tail, per-layer embeddings and layer
scalars go through the resume state); a base with a NaN or infinity in one of gemma4's own
tensors, or an infinite sliding RoPE base or logit cap, is refused at load, naming it; LoRA
targets that none of the --lora.layers blocks has (k,v on the shared-KV tail) are one line;
the per-layer-input gate and projection (ple_gate, ple_proj) are adapted where mlx-lm's keys
adapt them, in the block's forward as numpy fp64 computes it, and exported under llama.cpp's
names. llama.cpp comparisons of gemma4 runs: test_gemma4.py and test_hf_tiny.py (interop).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from arch_files import gemma4_gguf

from toymlx.gguf.llama import load_llama
from toymlx.gguf.reader import GGUFError, GGUFFile
from toymlx.gguf.writer import write_gguf


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return gemma4_gguf(tmp_path_factory.mktemp("gemma4") / "gemma4.gguf")


def _text_folder(path: Path) -> Path:
    """mlx-lm's data layout with text records."""
    path.mkdir()
    for split, n in (("train", 12), ("valid", 2)):
        (path / f"{split}.jsonl").write_text("".join(json.dumps({
            "text": f"Once upon a time there was a number {i}. It liked {i * 3 % 7} friends."})
            + "\n" for i in range(n)))
    return path


def _events(run: Path, kind: str) -> list[tuple]:
    rows = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    return [(e["step"], e.get("loss"), e.get("val_loss")) for e in rows if e["kind"] == kind]


@pytest.mark.parametrize("fine_tune", ["lora", "full"])
def test_a_stopped_and_resumed_run_is_the_uninterrupted_one_bit_for_bit(base, tmp_path,
                                                                       fine_tune):
    """4 compiled steps, checkpoints every 2, stopped after step 2's and resumed: every step's
    and validation's loss and every checkpoint's tensors equal the uninterrupted run's."""
    from toymlx_cli.train import main as train

    data = _text_folder(tmp_path / "data")
    args = ["--recipe", "lora", "--base", str(base), "--runs-root", str(tmp_path),
            "--data.path", str(data), "--steps", "4", "--batch-size", "2", "--seq-len", "32",
            "--lr", "1e-2", "--warmup", "1", "--eval-every", "2", "--eval-batches", "1",
            "--checkpoint-every", "2", "--no-progress", "--fine-tune-type", fine_tune]
    if fine_tune == "lora":
        args += ["--lora.targets", "q,k,v,o,gate,up,down", "--lora.rank", "4"]
    assert train([*args, "--run-id", "whole"]) == 0
    assert train([*args, "--run-id", "cut", "--stop-at", "2"]) == 0
    assert train(["--resume", str(tmp_path / "cut"), "--no-progress"]) == 0
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    steps = _events(whole, "step")
    assert len(steps) == 4 and steps[-1][1] < steps[0][1]  # it trains
    assert _events(cut, "step") == steps and _events(cut, "eval") == _events(whole, "eval")
    files = sorted(p.name for p in (whole / "weights").glob("*.gguf"))
    assert len(files) == 2
    for name in files:
        a, b = GGUFFile(whole / "weights" / name), GGUFFile(cut / "weights" / name)
        assert set(a.tensors) == set(b.tensors)
        moved = [n for n in a.tensors if not np.array_equal(a.load(n), b.load(n))]
        assert not moved, (name, moved)
    if fine_tune == "full":  # gemma4's own tensors are trained and kept
        a0, a4 = GGUFFile(base), GGUFFile(whole / "weights" / files[-1])
        for n in ("per_layer_token_embd.weight", "blk.5.layer_output_scale.weight"):
            assert not np.array_equal(a0.load(n), a4.load(n)), n


@pytest.mark.parametrize(("tensor", "value"), [
    ("per_layer_token_embd.weight", np.nan),
    ("per_layer_model_proj.weight", np.inf),
    ("blk.2.layer_output_scale.weight", np.nan),
    ("blk.0.attn_k_norm.weight", -np.inf),  # a sliding block's
])
def test_a_damaged_gemma4_tensor_is_refused_at_load_by_name(base, tmp_path, capsys, tensor,
                                                            value):
    """One value NaN or infinite in a tensor only gemma4 has: load_llama (both ways it holds a
    base) and toymlx-train refuse the file in one line naming it and the tensor."""
    from toymlx_cli.train import main as train

    g = GGUFFile(base)
    t = {n: g.load(n) for n in g.tensors}
    t[tensor] = t[tensor].copy()
    t[tensor].flat[t[tensor].size // 2] = value
    bad = write_gguf(tmp_path / "bad.gguf", dict(g.metadata), t, types=dict(g.metadata_types))
    kind = "NaN" if np.isnan(value) else "+Inf" if value > 0 else "-Inf"
    want = (f"bad.gguf: tensor '{tensor}'" + (" (block " + tensor.split(".")[1] + ")"
                                              if tensor.startswith("blk.") else "")
            + f": expected finite values, found {kind} in 1 of {t[tensor].size}")
    for weights in ("float32", "blocks"):
        with pytest.raises(GGUFError, match=want.replace("(", r"\(").replace(")", r"\)")
                           .replace(".", r"\.").replace("+", r"\+")):
            load_llama(bad, weights=weights)
    capsys.readouterr()
    assert train(["--recipe", "lora", "--base", str(bad), "--runs-root", str(tmp_path / "runs"),
                  "--steps", "1", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert want in err and len(err.strip().splitlines()) == 1, err


def test_targets_the_chosen_blocks_all_lack_are_one_line(base, tmp_path, capsys):
    """--lora.layers 2 picks the shared-KV tail, which has no k or v: asking for k,v only there
    would train nothing (MLX failed on an empty gradient) and is refused by name; with q too,
    as with --lora.layers 3 (block 3 has k), each block gets the targets it has."""
    from toymlx_cli.train import main as train

    from toymlx.models.lora import apply_lora, lora_layers

    capsys.readouterr()
    assert train(["--recipe", "lora", "--base", str(base), "--runs-root", str(tmp_path),
                  "--steps", "1", "--no-progress", "--lora.targets", "k,v",
                  "--lora.layers", "2"]) == 2
    assert capsys.readouterr().err.strip().endswith(
        "--lora.targets: expected a projection that blocks 4-5 (the last 2 of this gemma4 "
        "base, --lora.layers) have: q,o,gate,up,down,ple_gate,ple_proj; found k,v, none of which "
        "they have, so nothing would train: add one of theirs or raise --lora.layers")
    assert list(tmp_path.iterdir()) == []  # no run folder
    tail = lora_layers(apply_lora(load_llama(base)[0], "q,k,v", layers=2, rank=2))
    assert sorted(tail) == ["layers.4.attn.q_proj", "layers.5.attn.q_proj"]
    wrapped = lora_layers(apply_lora(load_llama(base)[0], "q,k", layers=3, rank=2))
    assert sorted(wrapped) == ["layers.3.attn.k_proj", "layers.3.attn.q_proj",
                               "layers.4.attn.q_proj", "layers.5.attn.q_proj"]


@pytest.mark.parametrize("key", ["rope.freq_base_swa", "final_logit_softcapping"])
@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_a_gemma4_key_that_is_not_finite_is_refused_by_name(base, tmp_path, key, value):
    """An infinite sliding RoPE base (no sliding block would rotate) or logit cap (every logit
    0 * inf = NaN) loaded before; now both, and NaN, are one line naming the key."""
    g = GGUFFile(base)
    assert "gemma4." + key in g.metadata  # write_llama writes both
    bad = write_gguf(tmp_path / "bad.gguf", {**g.metadata, "gemma4." + key: value},
                     {n: g.load(n) for n in g.tensors}, types=dict(g.metadata_types))
    with pytest.raises(GGUFError, match=rf"bad\.gguf: metadata key 'gemma4\.{key}': expected "
                                        rf"a finite value >(= 0 \(0: no cap\)| 0), found "
                                        rf"{value}$"):
        load_llama(bad)


def _mlx_lm_gemma4():
    """mlx-lm's own gemma4 text model of `gemma4_gguf`'s shape (E2B's layout: per-layer
    embeddings of width 8, a shared-KV tail of 2 blocks without k and v)."""
    from mlx_lm.models import gemma4_text

    return gemma4_text.Model(gemma4_text.ModelArgs(
        model_type="gemma4_text", hidden_size=64, num_hidden_layers=6, intermediate_size=128,
        num_attention_heads=4, head_dim=16, global_head_dim=32, num_key_value_heads=1,
        vocab_size=300, vocab_size_per_layer_input=300, num_kv_shared_layers=2,
        hidden_size_per_layer_input=8, layer_types=["sliding_attention", "full_attention"] * 3))


@pytest.mark.parametrize("keys", [None, ["per_layer_input_gate", "per_layer_projection"],
                                  ["self_attn.k_proj", "per_layer_projection"]])
def test_mlx_lm_s_keys_adapt_the_modules_mlx_lm_adapts(base, keys):
    """An mlx-lm config's lora_parameters.keys (none: mlx-lm's default) adapts, block by block,
    the modules mlx-lm's own linear_to_lora_layers wraps on mlx-lm's gemma4 of the same shape:
    the per-layer-input gate and projection (blk.N.inp_gate, blk.N.proj) of every block
    included (before: the default left them out and those keys were refused)."""
    from mlx_lm.tuner.lora import LoRALinear as MlxLmLoRA
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from toymlx_cli.mlx_lm_config import mlx_lm_options

    from toymlx.models.lora import MLX_LM_KEYS, TARGETS, apply_lora, lora_layers

    theirs = _mlx_lm_gemma4()
    theirs.freeze()
    linear_to_lora_layers(theirs, 6, {"rank": 2, "scale": 1.0, "dropout": 0.0, "keys": keys})
    want = {f"layers.{i}.{TARGETS[MLX_LM_KEYS[p]]}" for i, block in enumerate(theirs.layers)
            for p, m in block.named_modules() if isinstance(m, MlxLmLoRA)}
    params = {"rank": 2, "scale": 1.0, "dropout": 0.0, **({"keys": keys} if keys else {})}
    options, _, _ = mlx_lm_options({"lora_parameters": params}, "f.yaml")
    ours = set(lora_layers(apply_lora(load_llama(base)[0], options["lora.targets"], rank=2)))
    assert ours == want
    assert {f"layers.{i}.ple_gate" for i in range(6)} <= ours or keys is not None
    assert len(ours) == {None: 6 * 9 - 2 * 2, "per_layer_input_gate": 12,
                         "self_attn.k_proj": 4 + 6}[keys[0] if keys else None]


def test_the_per_layer_input_pair_s_adapters_are_in_the_block_s_forward(base):
    """LoRA on ple_gate and ple_proj: the block's per-layer-input branch, from its own forward
    (`close` with the per-layer input less without it, over its output scale), is numpy fp64's
    norm((Wp + s Bp Ap) (gelu_tanh((Wg + s Bg Ag) h) * ple)) on the same h."""
    import mlx.core as mx

    from toymlx.models.lora import apply_lora

    model = apply_lora(load_llama(base)[0], "ple_gate,ple_proj", rank=3, alpha=6.0)
    rng = np.random.default_rng(0)
    blk = model.layers[4]  # a shared-KV block: the pair is in every block
    for m in (blk.ple_gate, blk.ple_proj):
        m.lora_b = mx.array(rng.standard_normal(m.lora_b.shape).astype(np.float32) * 0.5)
    x, a = (mx.array(rng.standard_normal((1, 5, 64)).astype(np.float32)) for _ in range(2))
    ple = mx.array(rng.standard_normal((1, 5, 8)).astype(np.float32))
    s_out = float(blk.out_scale.weight[0])
    h = np.array(blk.close(x, a), np.float64) / s_out
    got = np.array(blk.close(x, a, ple), np.float64) / s_out - h

    def adapted(m):
        w, b, a = (np.array(t, np.float64) for t in (m.linear.weight, m.lora_b, m.lora_a))
        return w + m.scale * b @ a

    g = h @ adapted(blk.ple_gate).T
    g = 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3)))
    y = (g * np.array(ple, np.float64)) @ adapted(blk.ple_proj).T
    want = (y / np.sqrt((y ** 2).mean(-1, keepdims=True) + blk.ple_norm.eps)
            * np.array(blk.ple_norm.weight, np.float64))
    base_branch = np.array(load_llama(base)[0].layers[4].close(x, a, ple), np.float64) / s_out - h
    assert np.abs(want - base_branch).max() > 0.1  # the adapters move the branch
    assert np.abs(got - want).max() < 1e-4


def test_the_per_layer_input_pair_exports_as_llama_cpp_names_it(base, tmp_path):
    """The adapter file names the pair's tensors as llama.cpp's gemma4 does (blk.N.inp_gate,
    blk.N.proj, each built with build_lora_mm, so llama.cpp applies them: test_gemma4.py), reads
    back onto a fresh base with the same logits, and the merged export (--fuse's) folds them
    into the base's blk.N.inp_gate / blk.N.proj."""
    import mlx.core as mx

    from toymlx.interop.merge import write_merged
    from toymlx.models.lora import apply_lora
    from toymlx.training.adapter import apply_adapter, write_adapter

    model, g = load_llama(base)
    apply_lora(model, "ple_gate,ple_proj", rank=2, alpha=4.0, layers=2)
    rng = np.random.default_rng(1)
    for i in (4, 5):
        for m in (model.layers[i].ple_gate, model.layers[i].ple_proj):
            m.lora_b = mx.array(rng.standard_normal(m.lora_b.shape).astype(np.float32) * 0.5)
    ad = write_adapter(tmp_path / "adapter.gguf", model, dict(g.metadata))
    f = GGUFFile(ad)
    assert sorted(f.tensors) == [f"blk.{i}.{t}.weight.{h}" for i in (4, 5)
                                 for t in ("inp_gate", "proj") for h in ("lora_a", "lora_b")]
    assert f.metadata["toy.lora.targets"] == "ple_gate,ple_proj"
    ids = mx.array([[1, 5, 9, 14, 3, 7]])
    mine = np.array(model(ids))
    back = np.array(apply_adapter(load_llama(base)[0], ad)(ids))
    merged = write_merged(tmp_path / "merged.gguf", base, ad, "f32")
    fused = np.array(load_llama(merged)[0](ids))
    assert np.abs(mine - np.array(load_llama(base)[0](ids))).max() > 1e-3
    assert np.abs(back - mine).max() < 1e-5 and np.abs(fused - mine).max() < 1e-4


def test_the_per_layer_input_pair_on_a_base_without_it_is_one_line():
    """ple_gate or ple_proj on a base without per-layer embeddings (gemma4 31B's shape, a llama)
    is one line naming the target, what it is and the base's targets (before the fix: an
    unknown target)."""
    from dataclasses import replace

    from arch_files import gemma4_args

    from toymlx.models.llama import LlamaArgs
    from toymlx.models.lora import check_targets

    big = replace(gemma4_args(), k_eq_v=True, shared_kv_layers=0, per_layer_dim=0,
                  ffn_dims_per_block=None)
    with pytest.raises(ValueError) as e:
        check_targets(("q", "ple_proj"), big)
    assert str(e.value) == ("--lora.targets: ple_proj is the per-layer-input projection of a "
                            "gemma4 base with per-layer embeddings (E2B/E4B, blk.N.proj); this "
                            "gemma4 base has q,k,v,o,gate,up,down")
    with pytest.raises(ValueError) as e:
        check_targets(("ple_gate",), LlamaArgs())
    assert str(e.value) == ("--lora.targets: ple_gate is the per-layer-input gate of a gemma4 "
                            "base with per-layer embeddings (E2B/E4B, blk.N.inp_gate); this llama "
                            "base has q,k,v,o,gate,up,down")
