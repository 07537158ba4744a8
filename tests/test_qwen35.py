"""Qwen3.5 (`qwen35`): the tiny converted checkpoint (tests/hf_tiny.py kind qwen35: 3 Gated
DeltaNet blocks and a gated full-attention one, 2 k heads serving 4 value heads) trained with
LoRA, its adapter applied by llama.cpp, its fused export loaded by llama.cpp, quantized copies,
cached decoding against the full forward, and the files toymlx refuses. Its logits against
llama.cpp's and transformers' are test_hf_tiny.py's (kinds qwen35, qwen35-q).
"""

from __future__ import annotations

import json
import re
import shutil
import time

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
import pytest
from hf_tiny import (
    llamacpp_quantize,
    tiny_gguf,  # noqa: F401  (session fixtures)
    tiny_hf,  # noqa: F401
    token_ids,
)
from llamacpp_runner import llamacpp_logits, llamacpp_logits_lora
from llamacpp_source import llamacpp_source  # noqa: F401  (session fixture)

from toymlx.gguf.llama import args_from_gguf, load_llama, write_llama
from toymlx.gguf.reader import GGUFError, GGUFFile
from toymlx.gguf.writer import write_gguf
from toymlx.interop.merge import write_merged
from toymlx.models.gated_delta import delta_chunks, delta_steps
from toymlx.models.lora import apply_lora, block_targets, lora_layers
from toymlx.models.losses import lm_loss
from toymlx.models.ops import training_ops
from toymlx.training.adapter import write_adapter
from toymlx.training.step import make_step

N_TOKENS = 40
TOL = 1e-4  # float32 files: what every other kind holds against llama.cpp (measured ~2e-5)
ALL = "q,k,v,o,gate,up,down,qkv,z,beta,alpha,out"


def report(what: str, **figures) -> None:
    print(f"\n[qwen35] {what}: " + json.dumps(figures, default=float))


def logits(model, ids) -> np.ndarray:
    return np.array(model(mx.array([ids]))[0].astype(mx.float32))


@pytest.mark.parametrize("keys", ["random", "aligned"])
@pytest.mark.parametrize("chunk", [None, 4, 16, 64])
def test_gated_delta_rule_matches_a_float64_loop(chunk, keys):
    """The recurrence against numpy in float64, written from transformers'
    `torch_recurrent_gated_delta_rule` (state (dk, dv) per head, decay, delta update, read):
    one step per token (chunk None) and by chunks (4: two chunks and a padded one; 16, the
    default, and 64: one padded chunk), from zeros and from a given state; and the chunked
    form's gradients are the step form's. Random keys, decays and betas over 11 tokens; and
    64 tokens whose keys all point one way (unit length, as `l2_norm` leaves them: repeated
    tokens, padding) with beta 0.999 and no decay, where the chunk's (I + A)^-1 has entries
    near +-1 everywhere below the diagonal: summed as the series (I - A)(I + A^2)(I + A^4)
    (I + A^8), whose binomial terms cancel in float32, chunks of 16 were 2.5e-4 off (64:
    overflowed)."""
    rng = np.random.default_rng(0)
    if keys == "random":
        B, T, H, d = 2, 11, 3, 5
        q, k, v = (rng.standard_normal((B, T, H, d)) * 0.5 for _ in range(3))
        g, beta = -rng.random((B, T, H)), rng.random((B, T, H))
    else:
        B, T, H, d = 2, 64, 3, 8
        q, v = (rng.standard_normal((B, T, H, d)) * 0.5 for _ in range(2))
        k = rng.standard_normal((B, 1, H, d))
        k = np.repeat(k / np.linalg.norm(k, axis=-1, keepdims=True), T, axis=1)
        g, beta = np.zeros((B, T, H)), np.full((B, T, H), 0.999)
    s0 = rng.standard_normal((B, H, d, d)) * 0.3
    s = s0.copy()
    want = np.zeros((B, T, H, d))
    for t in range(T):
        s = s * np.exp(g[:, t])[..., None, None]
        mem = np.einsum("bhkv,bhk->bhv", s, k[:, t])
        s = s + np.einsum("bhk,bhv->bhkv", k[:, t], (v[:, t] - mem) * beta[:, t, :, None])
        want[:, t] = np.einsum("bhkv,bhk->bhv", s, q[:, t])
    args = [mx.array(x.astype(np.float32)) for x in (q, k, v, g, beta)]
    state = mx.array(s0.astype(np.float32))
    got, last = (delta_steps(*args, state) if chunk is None
                 else delta_chunks(*args, state, chunk=chunk))
    assert float(np.abs(np.array(got) - want).max()) < 1e-5
    assert float(np.abs(np.array(last) - s).max()) < 1e-5
    if chunk is not None:
        def loss(fn, *xs):
            o, st = fn(*xs)
            return (o * o).sum() + st.sum()

        ref = mx.grad(lambda *xs: loss(delta_steps, *xs), argnums=(0, 1, 2, 3, 4))(*args)
        grads = mx.grad(lambda *xs: loss(lambda *ys: delta_chunks(*ys, chunk=chunk), *xs),
                        argnums=(0, 1, 2, 3, 4))(*args)
        for r, x in zip(ref, grads, strict=True):
            assert float(mx.abs(r - x).max()) < 1e-4


@pytest.mark.interop
def test_lora_trains_and_llamacpp_applies_the_adapter(tiny_hf, tiny_gguf, tmp_path):  # noqa: F811
    """Five AdamW steps of LoRA on every projection llama.cpp adapts (full attention's q, k, v,
    o; the linear blocks' qkv, z, beta, alpha, out; the MLP's) lower the loss on a fixed batch;
    the adapter toymlx writes, applied by llama.cpp (--lora), and the fused export, loaded by
    llama.cpp, give toymlx's adapted logits."""
    path = tiny_gguf("qwen35")
    ids = token_ids(tiny_hf("qwen35"), N_TOKENS)
    model, g = load_llama(path, training_ops(on_gpu=False))
    mx.random.seed(0)
    apply_lora(model, ALL, rank=4, alpha=8.0)
    paths = list(lora_layers(model))
    assert "layers.3.attn.q_proj" in paths and "layers.0.attn.q_proj" not in paths
    assert {"layers.0.attn.qkv_proj", "layers.0.attn.z_proj", "layers.0.attn.beta_proj",
            "layers.0.attn.alpha_proj", "layers.0.attn.out_proj", "layers.0.mlp.down_proj"
            } <= set(paths)
    step = make_step(model, lm_loss, optim.AdamW(1e-2))
    x = mx.array([[ids[:-1]]])
    batch = {"inputs": x, "targets": mx.array([[ids[1:]]]), "mask": mx.ones(x.shape)}
    losses, seconds = [], []
    for _ in range(6):
        t0 = time.perf_counter()
        losses.append(float(step(batch)["loss"]))
        seconds.append(time.perf_counter() - t0)
    report("lora steps", losses=losses, seconds_per_step=float(np.median(seconds[1:])),
           first_step_s=seconds[0], tokens=len(ids) - 1)
    assert losses[-1] < losses[0] - 0.05
    exact, _ = load_llama(path)
    apply_lora(exact, ALL, rank=4, alpha=8.0)
    exact.update(model.trainable_parameters())
    mine = logits(exact, ids)
    ad = write_adapter(tmp_path / "adapter.gguf", exact, dict(g.metadata))
    ref, _ = llamacpp_logits_lora(path, ad, ids)
    base, _ = llamacpp_logits(path, ids)
    merged = write_merged(tmp_path / "merged.gguf", path, ad)
    fused, _ = llamacpp_logits(merged, ids)
    d_lora, d_fused = float(np.abs(mine - ref).max()), float(np.abs(mine - fused).max())
    # llama.cpp's two routes to one model (--lora, the fused file) differ by float32 rounding
    # of its own that grows with the adapter (8.2e-5 for the adapter this run trains): toymlx
    # is held to TOL or to twice that spread, whichever is wider
    spread = float(np.abs(ref - fused).max())
    report("adapter in llama.cpp", lora_max_abs_diff=d_lora, fused_max_abs_diff=d_fused,
           llamacpp_lora_vs_fused=spread, adapter_moves_logits_by=float(np.abs(ref - base).max()))
    assert np.abs(ref - base).max() > 0.05  # the adapter is applied, and it matters
    tol = max(TOL, 2 * spread)
    assert d_lora < tol and d_fused < tol


@pytest.mark.interop
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K_M"])
def test_quantized_copies(qtype, tiny_hf, tiny_gguf, tmp_path):  # noqa: F811
    """llama-quantize's copies of the 256-wide twin: toymlx's logits on the quantized file equal
    llama.cpp's on the file's own values dequantized to F32 (llama.cpp on the quantized file
    itself also rounds activations to 8 bits inside its quantized matmuls: that margin is
    reported, toymlx's distance to it too)."""
    src = tiny_gguf("qwen35-q")
    dst = tmp_path / f"{qtype}.gguf"
    q = llamacpp_quantize(src, dst, qtype)
    ids = token_ids(tiny_hf("qwen35-q"), N_TOKENS)
    got, _ = llamacpp_logits(dst, ids)
    ref, _ = llamacpp_logits(src, ids)
    dequantized, _ = llamacpp_logits(_rewrite(dst, tmp_path / "f32.gguf",
                                              {"general.file_type": 0}), ids)
    model, _ = load_llama(dst)
    mine = logits(model, ids)
    d_exact = float(np.abs(mine - dequantized).max())
    report(f"{qtype}", toymlx_vs_llamacpp_on_its_values_max_abs=d_exact,
           toymlx_vs_llamacpp_max_abs=float(np.abs(mine - got).max()),
           llamacpp_vs_its_f32=float(np.abs(got - ref).max()),
           top1_vs_llamacpp=float((mine.argmax(-1) == got.argmax(-1)).mean()),
           types=sorted(set(q["types"].values())))
    assert d_exact < TOL


@pytest.mark.interop
def test_cached_decoding_equals_the_full_forward(tiny_gguf):  # noqa: F811
    """Prefill 7 tokens, then one token at a time through the conv/state caches of the linear
    blocks and the KV cache of the attention block: every position's logits equal the full
    forward's."""
    model, _ = load_llama(tiny_gguf("qwen35"))
    ids = [int(x) for x in np.random.default_rng(2).integers(0, 500, 20)]
    full = logits(model, ids)
    cache = model.make_cache()
    steps = [np.array(model(mx.array([ids[:7]]), cache)[0])]
    steps += [np.array(model(mx.array([[t]]), cache)[0]) for t in ids[7:]]
    diff = float(np.abs(np.concatenate(steps) - full).max())
    report("cached decoding", max_abs_diff=diff)
    assert diff < TOL  # chunks (prefill, full forward) and steps round differently


@pytest.mark.interop
def test_generation_is_llamacpps_greedy(tiny_hf, tiny_gguf):  # noqa: F811
    """`generate` (greedy) gives llama.cpp's greedy tokens; a second call through a kept
    `PromptCache` whose prompt diverges from what the caches hold starts the recurrent states
    over and still gives llama.cpp's tokens for that prompt."""
    from llamacpp_runner import llamacpp_greedy

    from toymlx.data.tokenizer import Tokenizer
    from toymlx.generation.generate import PromptCache, generate

    path = tiny_gguf("qwen35")
    model, _ = load_llama(path)
    tok = Tokenizer.from_gguf(path)
    ids = token_ids(tiny_hf("qwen35"), 12)
    kept = PromptCache()
    for prompt in (ids, ids[:6] + ids[:6]):
        mine = list(generate(model, tok, prompt, max_tokens=10, kept=kept))
        ref = llamacpp_greedy(path, prompt, 10)
        report("greedy", prompt=prompt, toymlx=mine, llamacpp=ref, reused=kept.reused)
        assert mine == ref[:len(mine)] and len(mine) >= min(len(ref), 1)


@pytest.mark.interop
def test_write_llama_writes_a_file_llamacpp_reads(tiny_hf, tiny_gguf, tmp_path):  # noqa: F811
    """`write_llama` (checkpoints, full fine-tunes) on the loaded model: toymlx reads back the
    same args, and llama.cpp computes toymlx's logits on it (its keys, the M-RoPE sections
    toymlx chooses included, are llama.cpp's)."""
    path = tiny_gguf("qwen35")
    model, g = load_llama(path)
    out = tmp_path / "written.gguf"
    write_llama(out, model, {k: v for k, v in g.metadata.items() if k.startswith("tokenizer.")})
    assert GGUFFile(out).metadata["qwen35.rope.dimension_sections"] == [2, 1, 1, 0]
    again, _ = load_llama(out)
    assert again.args == model.args
    ids = token_ids(tiny_hf("qwen35"), N_TOKENS)
    ref, _ = llamacpp_logits(out, ids)
    diff = float(np.abs(logits(model, ids) - ref).max())
    report("write_llama in llama.cpp", max_abs_diff=diff)
    assert diff < TOL


def _rewrite(src, dst, meta_edit=None, tensors_edit=None):
    """A copy of GGUF `src` at `dst` with metadata and tensors edited (dicts of name -> value,
    None removes)."""
    g = GGUFFile(src)
    meta = {k: v for k, v in g.metadata.items() if not k.startswith("GGUF.")}
    tensors = {n: g.load(n, np.float32) for n in g.tensors}
    for d, edit in ((meta, meta_edit or {}), (tensors, tensors_edit or {})):
        for k, v in edit.items():
            if v is None:
                d.pop(k, None)
            else:
                d[k] = v
    write_gguf(dst, meta, tensors)
    return dst


@pytest.mark.interop
def test_the_converters_mtp_block_is_not_run(tiny_hf, tiny_gguf, tmp_path,  # noqa: F811
                                             llamacpp_source):  # noqa: F811
    """The tiny checkpoint with an MTP block (`mtp.*` tensors and `mtp_num_hidden_layers`, as
    Qwen3.5's own checkpoints carry), through llama.cpp's converter (its default keeps the block,
    as `blk.4.*` with nextn tensors): llama.cpp's plain decoding and toymlx both compute the file
    without it, the logits of the file without it."""
    from hf_tiny import gguf_from_hf
    from safetensors.numpy import load_file, save_file

    hf = tmp_path / "hf"
    shutil.copytree(tiny_hf("qwen35"), hf)
    weights = load_file(hf / "model.safetensors")
    rng = np.random.default_rng(5)
    block = "model.layers.3."  # the MTP block is a full-attention block, plus its fc and norms
    weights.update({"mtp.layers.0." + k[len(block):]: v + 0.05 * rng.standard_normal(v.shape)
                    .astype(np.float32) for k, v in weights.items() if k.startswith(block)})
    d = weights["model.norm.weight"].shape[0]
    weights.update({"mtp.fc.weight": 0.05 * rng.standard_normal((d, 2 * d)).astype(np.float32),
                    **{f"mtp.{n}.weight": np.zeros(d, np.float32) for n in (
                        "pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}})
    save_file(weights, hf / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, "mtp_num_hidden_layers": 1}))
    path = tmp_path / "mtp.gguf"
    gguf_from_hf(hf, path, "f32", tree=llamacpp_source)
    g = GGUFFile(path)
    assert (g.metadata["qwen35.block_count"], g.metadata["qwen35.nextn_predict_layers"]) == (5, 1)
    assert "blk.4.nextn.eh_proj.weight" in g.tensors and "blk.4.attn_q.weight" in g.tensors
    ids = token_ids(hf, N_TOKENS)
    model, _ = load_llama(path)
    assert model.args.n_layers == 4
    mine, plain = logits(model, ids), logits(load_llama(tiny_gguf("qwen35"))[0], ids)
    ref, _ = llamacpp_logits(path, ids)
    report("mtp file", toymlx_vs_llamacpp_max_abs=float(np.abs(mine - ref).max()))
    assert np.array_equal(mine, plain) and float(np.abs(mine - ref).max()) < TOL


@pytest.mark.interop
def test_files_toymlx_does_not_compute_are_refused(tiny_gguf, tmp_path):  # noqa: F811
    """A MoE file, M-RoPE sections that leave a rotated pair to the fourth position (llama.cpp
    would leave it unrotated), and a value width other than the key width are refused in one
    line naming the key."""
    path = tiny_gguf("qwen35")
    g = GGUFFile(path)
    cases = {
        "moe": ({"general.architecture": "qwen35moe"}, (r"'general\.architecture': expected one "
                r"of .*qwen35, found 'qwen35moe'")),
        "sections": ({"qwen35.rope.dimension_sections": [1, 1, 2, 0]},
                     (r"'qwen35\.rope\.dimension_sections': expected sections whose "
                     r"interleaving covers all 4 rotated pairs")),
        "inner": ({"qwen35.ssm.inner_size": 32}, r"'qwen35\.ssm\.inner_size': expected 64"),
    }
    for name, (meta, message) in cases.items():
        if name == "moe":
            meta = {**{k.replace("qwen35.", "qwen35moe.", 1): v for k, v in g.metadata.items()
                       if k.startswith("qwen35.")},
                    **{k: None for k in g.metadata if k.startswith("qwen35.")}, **meta}
        bad = _rewrite(path, tmp_path / f"{name}.gguf", meta)
        with pytest.raises(GGUFError, match=message):
            args_from_gguf(GGUFFile(bad))


def test_targets_per_block_kind():
    """q, k, v, o in qwen35's full-attention blocks, qkv, z, beta, alpha, out in its linear
    ones, the MLP's in both."""
    from toymlx.models.llama import LlamaArgs

    a = LlamaArgs(arch="qwen35", attn_out_gate=True, qk_norm=True, rope_neox=True,
                  linear_layers=(True, True, True, False), ssm_head_dim=8, ssm_k_heads=2,
                  ssm_v_heads=4)
    assert block_targets(a, 0) == ("qkv", "gate", "up", "down", "z", "beta", "alpha", "out")
    assert block_targets(a, 3) == ("q", "k", "v", "o", "gate", "up", "down")
    assert set(block_targets(a)) == set(block_targets(a, 0)) | set(block_targets(a, 3))


def test_all_linear_adapts_both_block_kinds_projections(tmp_path):
    """--lora.targets all-linear (PEFT's target_modules, mlx-lm's default without keys) on a
    qwen35 file: the 31 layers ALL names, the 3 linear-attention blocks' qkv, z, beta, alpha and
    out among them (before: resolved to q,k,v,o,gate,up,down on every base, 16 layers, those 15
    left out and the reach line silent, the MLP reaching every block)."""
    from test_archs import qwen35_gguf

    path = qwen35_gguf(tmp_path / "q.gguf")

    def adapted(targets: str) -> dict:
        model, g = load_llama(path)
        g.close()
        return lora_layers(apply_lora(model, targets))

    every, named = adapted("all-linear"), adapted(ALL)
    assert list(every) == list(named) and len(every) == 3 * 8 + 7
    assert {p.split(".", 2)[2] for p in every if p.startswith("layers.0.")} >= {
        "attn.qkv_proj", "attn.z_proj", "attn.beta_proj", "attn.alpha_proj", "attn.out_proj"}


def _chat_base(tiny_gguf, tmp_path):  # noqa: F811
    """The tiny converted file with a ChatML template (Qwen's turn markers; the tiny tokenizer
    has none), so that a data folder of chat records trains on it."""
    template = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + "
                "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}"
                "{{ '<|im_start|>assistant\n' }}{% endif %}")
    return _rewrite(tiny_gguf("qwen35"), tmp_path / "chat.gguf",
                    {"tokenizer.chat_template": template})


@pytest.mark.interop
@pytest.mark.parametrize("kind", ["lora", "full"])
def test_a_run_stopped_at_a_checkpoint_resumes_bit_exact(kind, tiny_gguf, tmp_path,  # noqa: F811
                                                         capsys):
    """toymlx-train --recipe lora on qwen35 with an mlx-lm data folder of chat records, 8 steps
    checkpointed every 2: stopped after step 4's checkpoint and resumed, every logged loss
    (training and held-out) and the final adapter (LoRA on every target of both block kinds)
    or weights (--fine-tune-type full) equal the uninterrupted run's, bit for bit; toymlx-eval
    on the run scores its held-out rows at the run's last validation loss."""
    from test_lora import _train, mlx_lm_folder
    from toymlx_cli.eval import main as eval_main

    base = _chat_base(tiny_gguf, tmp_path)
    common = ["--recipe", "lora", "--base", str(base), "--runs-root", str(tmp_path),
              "--data.path", str(mlx_lm_folder(tmp_path / "data")), "--steps", "8",
              "--checkpoint-every", "2", "--eval-every", "4", "--batch-size", "2",
              "--seq-len", "64", "--lr", "1e-2", "--no-progress"]
    common += (["--fine-tune-type", "full"] if kind == "full" else ["--lora.targets", ALL])
    assert _train(common + ["--run-id", "whole"]) == 0
    assert _train(common + ["--run-id", "cut", "--stop-at", "4"]) == 0
    assert (tmp_path / "cut" / "weights" / "latest").resolve().name.endswith("_4.gguf")
    assert _train(["--resume", str(tmp_path / "cut"), "--no-progress"]) == 0

    def logged(run: str) -> list:
        return [(e["kind"], e["step"], e.get("loss", e.get("val_loss")))
                for e in map(json.loads, (tmp_path / run / "events.jsonl").read_text()
                             .splitlines()) if e["kind"] in ("step", "eval")]

    whole, cut = logged("whole"), logged("cut")
    assert [s for k, s, _ in whole if k == "step"] == list(range(1, 9))
    assert whole[-1][2] < whole[0][2]  # it trains
    assert cut == whole
    a = GGUFFile((tmp_path / "whole" / "weights" / "latest").resolve())
    b = GGUFFile((tmp_path / "cut" / "weights" / "latest").resolve())
    assert sorted(a.tensors) == sorted(b.tensors)
    assert len(a.tensors) == (31 * 2 if kind == "lora" else len(GGUFFile(base).tensors))
    for name in a.tensors:
        assert np.array_equal(a.load(name, np.float32), b.load(name, np.float32)), name
    capsys.readouterr()
    assert eval_main(["--model", str(tmp_path / "cut")]) == 0
    scored = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert scored["val_loss"] == pytest.approx(whole[-1][2], abs=1e-4)  # other kernels, same math


@pytest.mark.interop
@pytest.mark.parametrize("name", ["blk.1.ssm_a", "blk.0.ssm_conv1d.weight", "blk.2.ssm_dt.bias"])
def test_a_non_finite_recurrent_parameter_is_refused_at_load(name, tiny_gguf, tmp_path):  # noqa: F811
    """A NaN or an infinity in a linear block's decay (ssm_a), convolution or dt bias is refused
    as the file is read, in one line naming the file and the tensor, however the weights are
    held."""
    path = tiny_gguf("qwen35")
    g = GGUFFile(path)
    for bad, found in ((np.nan, "NaN"), (-np.inf, "-Inf")):
        values = g.load(name, np.float32).copy()
        values.flat[1] = bad
        out = _rewrite(path, tmp_path / "bad.gguf", tensors_edit={name: values})
        for weights in ("float32", "blocks"):
            with pytest.raises(GGUFError, match=(
                    rf"^{re.escape(str(out))}: tensor '{re.escape(name)}' \(block \d\): "
                    rf"expected finite values, found {found} in 1 of")):
                load_llama(out, weights=weights)


def test_targets_that_miss_blocks_are_said():
    """Where --lora.targets reach fewer of the adapted blocks than all, `target_reach` says how
    many and which targets reach the others, in one line: qwen35's default q on a 0.8B's 24
    blocks, q and v on its last 4 (--lora.layers 4), qkv alone; targets reaching every block
    say nothing."""
    from toymlx.models.llama import LlamaArgs
    from toymlx.models.lora import target_reach

    a = LlamaArgs(arch="qwen35", n_layers=24, attn_out_gate=True, qk_norm=True,
                  rope_neox=True, linear_layers=tuple(i % 4 != 3 for i in range(24)),
                  ssm_head_dim=8, ssm_k_heads=2, ssm_v_heads=4)
    linear = "which qkv, z, beta, alpha, out, gate, up, down reach"
    assert target_reach(a, ["q"], range(24)) == (6, (
        "--lora.targets q reaches 6 of the 24 qwen35 blocks it adapts; not the other 18 "
        f"linear-attention blocks (0-2, 4-6, 8-10, 12-14, 16-18, 20-22), {linear}"))
    assert target_reach(a, ["q", "v"], range(20, 24)) == (1, (
        "--lora.targets q,v reaches 1 of the 4 qwen35 blocks it adapts; not the other 3 "
        f"linear-attention blocks (20-22), {linear}"))
    assert target_reach(a, ["qkv"], range(24)) == (18, (
        "--lora.targets qkv reaches 18 of the 24 qwen35 blocks it adapts; not the other 6 "
        "blocks (3, 7, 11, 15, 19, 23), which q, k, v, o, gate, up, down reach"))
    assert target_reach(a, ["q", "down"], range(24)) == (24, None)
    assert target_reach(a, ["q", "z"], range(24)) == (24, None)


@pytest.mark.interop
def test_the_default_targets_say_the_blocks_they_miss(tiny_gguf, tmp_path, capsys):  # noqa: F811
    """toymlx-train --recipe lora on qwen35 with the default --lora.targets (q): the console
    says in one line that q reaches 1 of the 4 blocks and which targets reach the 3
    linear-attention ones, and run_start records the count and the same line; on resume
    (the same model) nothing is refused; all targets (all-linear: PEFT's, resolved against this
    base, which run_start records) say nothing."""
    from test_lora import _train, mlx_lm_folder

    base = _chat_base(tiny_gguf, tmp_path)
    common = ["--recipe", "lora", "--base", str(base), "--runs-root", str(tmp_path),
              "--data.path", str(mlx_lm_folder(tmp_path / "data")), "--steps", "2",
              "--batch-size", "2", "--seq-len", "64", "--no-progress", "--no-compile"]
    line = ("--lora.targets q reaches 1 of the 4 qwen35 blocks it adapts; not the other 3 "
            "linear-attention blocks (0-2), which qkv, z, beta, alpha, out, gate, up, down "
            "reach")
    capsys.readouterr()
    assert _train(common + ["--run-id", "q", "--stop-at", "1"]) == 0
    assert f"toymlx: {line}\n" in capsys.readouterr().err
    start = json.loads((tmp_path / "q" / "events.jsonl").read_text().splitlines()[0])
    assert start["kind"] == "run_start"
    assert (start["model"]["lora_targets"], start["model"]["lora_blocks_reached"],
            start["model"]["lora_reach"]) == ("q", 1, line)
    assert _train(["--resume", str(tmp_path / "q"), "--no-progress"]) == 0
    assert capsys.readouterr().err.count(line) == 1
    assert _train(common + ["--run-id", "all", "--lora.targets", "all-linear"]) == 0
    assert "blocks it adapts" not in capsys.readouterr().err  # (the warm-up note: "reaches")
    start = json.loads((tmp_path / "all" / "events.jsonl").read_text().splitlines()[0])
    assert start["model"]["lora_blocks_reached"] == 4 and "lora_reach" not in start["model"]
    resolved = start["config"]["lora_targets_resolved"]
    assert sorted(resolved.split(",")) == sorted(ALL.split(","))
    assert start["model"]["lora_targets"] == resolved
