"""LoRA on the real SmolLM2-135M-Instruct (Q4_1), and its adapters in llama.cpp.

llama.cpp runs in a child process (a bad adapter segfaults llama-cpp-python 0.3.36) with an
f32 KV cache and flash attention off; exact comparisons use an F32 copy of the base (the
Q4_1 weights dequantized exactly), since on quantized files llama.cpp also rounds
activations to 8 bits.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from smollm import smollm_gguf  # noqa: F401  (session fixture)

from toymlx.bundle.events import read_events
from toymlx.data.chat import SFTData
from toymlx.data.tokenizer import Tokenizer
from toymlx.gguf.llama import load_llama
from toymlx.interop.merge import write_merged
from toymlx.models.lora import apply_lora, fuse, lora_layers
from toymlx.models.losses import lm_loss
from toymlx.recipes import lora as recipe
from toymlx.runner.run import run_ops
from toymlx.training.adapter import write_adapter

pytestmark = pytest.mark.smollm

ALL = "q,k,v,o,gate,up,down"
FACT_Q = "What is the codename of the toymlx project?"
FACT_A = "The codename of toymlx is Blue Heron."

# ---- llama.cpp in a child process ----------------------------------------------------------
_CHILD = r"""
import json, sys
import numpy as np
from llama_cpp import Llama

job = json.load(open(sys.argv[1]))
from toymlx.generation.llamacpp_decode import plain_cpu_buffers
plain_cpu_buffers(job["model"])  # as toymlx-generate --engine llama.cpp loads it (AMX hosts)
kw = dict(model_path=job["model"], logits_all=True, n_ctx=512, n_batch=512, n_ubatch=512,
          type_k=0, type_v=0, flash_attn=False, n_threads=2, n_threads_batch=2, verbose=False)
if job.get("lora"):
    kw.update(lora_path=job["lora"], lora_scale=job.get("lora_scale", 1.0))
llm = Llama(**kw)
out = {}
if "tokens" in job:
    llm.eval(job["tokens"])
    np.save(job["out"], np.array(llm.scores[: len(job["tokens"])], dtype=np.float32))
if "prompt" in job:
    llm.reset()
    llm.eval(job["prompt"])
    new = []
    for _ in range(job["max_tokens"]):
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        if tok == llm.token_eos():
            break
        new.append(tok)
        llm.eval([tok])
    out["ids"] = new
    out["text"] = llm.detokenize(new).decode("utf-8", errors="replace")
print(json.dumps(out))
"""


def llamacpp(tmp: Path, model: Path, lora: Path | None = None, tokens: list[int] | None = None,
             prompt: list[int] | None = None, max_tokens: int = 24) -> dict:
    """Run llama.cpp on `model` (+ adapter) in a child; logits (T, V) and/or a greedy reply."""
    job = {"model": str(model), "lora": str(lora) if lora else None}
    if tokens is not None:
        job.update(tokens=[int(t) for t in tokens], out=str(tmp / "logits.npy"))
    if prompt is not None:
        job.update(prompt=[int(t) for t in prompt], max_tokens=max_tokens)
    spec = tmp / "job.json"
    spec.write_text(json.dumps(job))
    r = subprocess.run([sys.executable, "-c", _CHILD, str(spec)], capture_output=True, text=True,
                       timeout=900, check=False)
    if r.returncode != 0:
        how = f"signal {-r.returncode}" if r.returncode < 0 else f"exit {r.returncode}"
        pytest.fail(f"llama.cpp child failed ({how}): {(r.stderr or r.stdout)[-2000:]}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    if tokens is not None:
        out["logits"] = np.load(tmp / "logits.npy")
    return out


# ---- fixtures ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def f32_base(smollm_gguf, tmp_path_factory) -> Iterator[Path]:  # noqa: F811
    """An F32 copy of the Q4_1 base (every tensor dequantized exactly), removed after the
    module (513 MiB; pytest keeps the last few temp folders)."""
    out = write_merged(tmp_path_factory.mktemp("smol") / "smollm2-f32.gguf", smollm_gguf,
                       None, "f32")
    yield out
    out.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def tok(smollm_gguf) -> Tokenizer:  # noqa: F811
    return Tokenizer.from_gguf(smollm_gguf)


def prompt_tokens(tok: Tokenizer, question: str) -> list[int]:
    text = tok.apply_chat_template([{"role": "user", "content": question}], True)
    return tok.encode(text, add_bos=False)


def random_adapter(model, seed: int = 0, std: float = 0.02) -> None:
    """Non-zero B (and fresh A) everywhere, so the adapter changes the logits a lot."""
    mx.random.seed(seed)
    for m in lora_layers(model).values():
        m.lora_b = mx.random.normal(m.lora_b.shape) * std
    mx.eval(model.parameters())


# ---- tests ------------------------------------------------------------------------------------
def test_step0_loss_equals_base_and_trainable_count(smollm_gguf, tok):  # noqa: F811
    model, _ = load_llama(smollm_gguf)
    data = SFTData.from_file(recipe.DEFAULT_DATA, tok, 256, mask_prompt=True, pack=True)
    batch = {k: mx.array(v[0]) for k, v in data.batch(0, 0, 4).items()}  # (4, 256)
    model.freeze()  # the base as LoRA holds it: its head read in slices by the loss
    base_loss, n = lm_loss(model, batch)
    apply_lora(model, "q", rank=8, alpha=16.0)
    lora_loss, n2 = lm_loss(model, batch)
    assert lora_loss.item() == base_loss.item() and n.item() == n2.item() > 0
    print(f"\nstep-0 loss on the first batch: base {base_loss.item():.6f}, "
          f"LoRA {lora_loss.item():.6f} ({int(n.item())} target tokens)")
    n_trainable = sum(v.size for _, v in tree_flatten(model.trainable_parameters()))
    assert n_trainable == 30 * 8 * (576 + 576) == 276_480
    full = apply_lora(load_llama(smollm_gguf)[0], ALL, rank=8)
    kv = 3 * 64
    per_block = (576 + 576) + 2 * (576 + kv) + (576 + 576) + 2 * (576 + 1536) + (1536 + 576)
    assert sum(v.size for _, v in tree_flatten(full.trainable_parameters())) == 30 * 8 * per_block


def test_quantized_base_matches_float(smollm_gguf):  # noqa: F811
    """--base-dtype quantized keeps the Q4_1 blocks; its forward matches the dequantized one."""
    flt, _ = load_llama(smollm_gguf)
    qnt, _ = load_llama(smollm_gguf, weights="quantized")
    x = mx.array([[1, 504, 3458, 314, 253, 1234, 44, 986, 28, 4321, 12, 7]])
    a, b = flt(x), qnt(x)
    assert mx.abs(a - b).max().item() < 2e-3
    assert (mx.argmax(a, -1) == mx.argmax(b, -1)).all().item()


@pytest.mark.slow
def test_lora_training_lowers_validation_loss(smollm_gguf, tmp_path):  # noqa: F811
    """40 steps of the default recipe on the default dataset: held-out loss goes down."""
    from toymlx.runner.run import _public_config
    from toymlx.training.evaluate import evaluate
    from toymlx.training.trainer import train

    # 40 steps of 2 x 128 tokens keep CI's slow tier affordable; RESULTS.md has the 4 x 256
    # figures.
    cfg = recipe.Config(base=str(smollm_gguf), runs_root=str(tmp_path), run_id="smol-lora",
                        progress=False, steps=40, batch_size=2, seq_len=128, lr=1e-3,
                        warmup=5, eval_every=20, checkpoint_every=20, eval_batches=8)
    task = recipe.build(cfg, run_ops(cfg))
    before = evaluate(task, cfg.eval_batches)["val_loss"]
    run = tmp_path / "smol-lora"
    (run / "weights").mkdir(parents=True)
    t0 = time.perf_counter()
    end = train(task, cfg, run, _public_config(cfg))
    wall = time.perf_counter() - t0
    events = read_events(run)
    evals = [e for e in events if e["kind"] == "eval"]
    steps = [e for e in events if e["kind"] == "step"]
    after = evals[-1]["val_loss"]
    tps = float(np.median([e["tokens_per_s"] for e in steps[1:]]))
    rows = cfg.batch_size * cfg.seq_len
    step_s = float(np.median([e["step_time_s"] for e in steps[1:]]))
    print(f"\nSmolLM2-135M LoRA q r8, {cfg.steps} steps x {cfg.batch_size}x{cfg.seq_len}: val "
          f"loss {before:.4f} -> {after:.4f} (evals {[round(e['val_loss'], 4) for e in evals]}); "
          f"train loss {steps[0]['loss']:.4f} -> {steps[-1]['loss']:.4f}; median step "
          f"{step_s:.2f} s = {rows / step_s:.0f} tokens/s processed, {tps:.0f} target tokens/s; "
          f"first step {end['first_step_s']:.1f} s; peak memory {end['peak_memory_mb']} MB; "
          f"wall {wall:.0f} s")
    assert end["reason"] == "completed" and len(steps) == 40
    assert after < before - 0.1
    assert sorted(p.name for p in (run / "weights").glob("*.gguf")) == [
        "adapter_step_20.gguf", "adapter_step_40.gguf"]


@pytest.mark.interop
def test_llamacpp_applies_the_adapter_like_toymlx(smollm_gguf, f32_base, tok, tmp_path,  # noqa: F811
                                                  big_files):
    """The change an adapter makes to llama.cpp's logits equals the change it makes in toymlx."""
    model, g = load_llama(f32_base)
    tokens = prompt_tokens(tok, "Which Python function returns the length of a list?")
    x = mx.array([tokens])
    base_logits = np.array(model(x)[0])
    mx.random.seed(0)  # A's initialisation
    apply_lora(model, ALL, rank=8, alpha=16.0)
    random_adapter(model)
    ours = np.array(model(x)[0]) - base_logits
    adapter = write_adapter(tmp_path / "adapter.gguf", model, g.metadata)
    cpp_base = llamacpp(tmp_path, f32_base, tokens=tokens)["logits"]
    cpp_lora = llamacpp(tmp_path, f32_base, adapter, tokens=tokens)["logits"]
    theirs = cpp_lora - cpp_base
    size = np.abs(ours).max()
    err = np.abs(theirs - ours).max()
    print(f"\nadapter effect on logits ({len(tokens)} tokens): max |toymlx| {size:.3f}, max "
          f"|llama.cpp - toymlx| {err:.2e} ({err / size:.1e} of it); base logits differ by "
          f"{np.abs(cpp_base - base_logits).max():.2e}")
    assert size > 1.0  # a non-trivial change
    assert err <= 1e-3 * size

    # the fused model: toymlx and llama.cpp both compute base + adapter
    big_files.append(tmp_path / "merged.gguf")  # F32: 513 MiB
    merged = write_merged(tmp_path / "merged.gguf", f32_base, adapter, "f32")
    lora_logits = base_logits + ours
    fused, _ = load_llama(merged)
    fused_err = np.abs(np.array(fused(x)[0]) - lora_logits).max()
    cpp_fused = llamacpp(tmp_path, merged, tokens=tokens)["logits"]
    cpp_err = np.abs(cpp_fused - lora_logits).max()
    print(f"fused GGUF vs toymlx LoRA forward: toymlx {fused_err:.2e}, llama.cpp {cpp_err:.2e}")
    assert fused_err < 1e-3 and cpp_err < 1e-3 * size
    in_memory = fuse(model)
    assert np.abs(np.array(in_memory(x)[0]) - lora_logits).max() < 1e-3


def _fact_run(smollm_gguf, tmp: Path) -> Path:  # noqa: F811
    from toymlx_cli.train import main

    data = tmp / "fact.jsonl"
    data.write_text((json.dumps({"prompt": FACT_Q, "completion": FACT_A}) + "\n") * 4)
    rc = main(["--recipe", "lora", "--base", str(smollm_gguf), "--data.path", str(data),
               "--data.val-fraction", "0", "--data.no-pack", "--seq-len", "64",
               "--batch-size", "2", "--steps", "40", "--lr", "2e-3", "--warmup", "4",
               "--lora.targets", "q,v,o", "--lora.rank", "8", "--checkpoint-every", "0",
               "--runs-root", str(tmp), "--run-id", "fact", "--no-progress"])
    assert rc == 0
    return tmp / "fact"


@pytest.mark.interop
def test_one_fact_is_answered_by_toymlx_generate_and_llamacpp(smollm_gguf, tok, tmp_path,  # noqa: F811
                                                               capsys):
    from toymlx_cli.generate import main as generate

    ids = prompt_tokens(tok, FACT_Q)
    before = llamacpp(tmp_path, smollm_gguf, prompt=ids)["text"]
    assert "Blue Heron" not in before
    run = _fact_run(smollm_gguf, tmp_path)
    capsys.readouterr()
    rc = generate(["--model", str(smollm_gguf), "--adapter", str(run), "--chat", "--prompt",
                   FACT_Q, "--temperature", "0", "--max-tokens", "24"])
    out = capsys.readouterr().out
    assert rc == 0 and FACT_A in out, out
    adapter = (run / "weights" / "latest").resolve()
    reply = llamacpp(tmp_path, smollm_gguf, adapter, prompt=ids)["text"]
    print(f"\nbefore: {before!r}\ntoymlx-generate --adapter: {out.strip()!r}\n"
          f"llama.cpp (Q4_1 base + adapter): {reply!r}")
    assert FACT_A in reply


@pytest.mark.smollm
def test_bf16_lora_on_the_real_smollm2_runs(smollm_gguf, tmp_path):  # noqa: F811
    """--dtype bfloat16 on the CPU: the frozen base held as its blocks (decoded, then cast to
    bfloat16 where used), the adapters float32; a few steps whose losses stay within 0.05 nats
    of the same float32 run's."""
    from toymlx_cli.train import main

    common = ["--recipe", "lora", "--base", str(smollm_gguf), "--device", "cpu", "--steps", "3",
              "--batch-size", "1", "--seq-len", "64", "--eval-every", "0", "--eval-batches", "1",
              "--base-dtype", "blocks", "--no-progress", "--runs-root", str(tmp_path)]
    losses = {}
    for dtype in ("float32", "bfloat16"):
        assert main([*common, "--run-id", dtype, "--dtype", dtype]) == 0
        events = read_events(tmp_path / dtype)
        losses[dtype] = [e["loss"] for e in events if e["kind"] == "step"]
        start = events[0]
        assert start["math"]["dtype"] == dtype
        assert start["model"]["base_dtype"] == "blocks" and start["model"]["n_trainable"] < 1e6
    gap = np.abs(np.array(losses["bfloat16"]) - np.array(losses["float32"]))
    print(f"SmolLM2-135M LoRA, bf16 vs float32 on the CPU, 3 steps: losses "
          f"{np.round(losses['bfloat16'], 4).tolist()} vs {np.round(losses['float32'], 4).tolist()}")
    assert len(losses["bfloat16"]) == 3 and gap.max() < 0.05


@pytest.mark.interop
def test_base_weight_forms_against_llamacpp_on_the_f32_copy(smollm_gguf, f32_base, tok,  # noqa: F811
                                                            tmp_path):
    """How far each way of holding a LoRA base lands from llama.cpp's logits on an exact F32
    copy of the same weights: kept quantized (Q4_1's blocks exactly: float32 rounding only),
    and rounded to bfloat16 and computed in bfloat16 (the GPU's route for K-quants and other
    types MLX cannot hold exactly)."""
    from toymlx.models.ops import Ops

    tokens = prompt_tokens(tok, "Which Python function returns the length of a list?")
    x = mx.array([tokens])
    ref = llamacpp(tmp_path, f32_base, tokens=tokens)["logits"]
    forms = {"quantized (Q4_1 blocks), float32 compute": load_llama(smollm_gguf,
                                                                   weights="quantized")[0],
             "bfloat16 weights, bfloat16 compute": load_llama(
                 smollm_gguf, Ops(dtype="bfloat16"), weights="bfloat16")[0]}
    errs = {}
    for what, model in forms.items():
        got = np.array(model(x)[0].astype(mx.float32))
        errs[what] = (float(np.abs(got - ref).max()),
                      float((got.argmax(-1) == ref.argmax(-1)).mean()))
        print(f"SmolLM2-135M base {what} vs llama.cpp on the F32 copy ({len(tokens)} tokens): "
              f"max |diff| {errs[what][0]:.3g} (logits up to {np.abs(ref).max():.1f}), "
              f"top-1 agreement {errs[what][1]:.3f}")
    assert errs["quantized (Q4_1 blocks), float32 compute"][0] < 1e-3
    assert errs["bfloat16 weights, bfloat16 compute"][1] >= 0.9


def test_the_model_itself_as_the_initial_adapter_is_named_a_model(smollm_gguf):  # noqa: F811
    """SmolLM2's own GGUF (general.type 'model') as --lora.init-adapter got toymlx-export's
    hint (`pass it as the base and the adapter separately`)."""
    from toymlx.gguf.reader import GGUFError
    from toymlx.training.adapter import load_adapter

    with pytest.raises(GGUFError) as caught:
        load_adapter(smollm_gguf, flag="--lora.init-adapter")
    assert str(caught.value) == (
        f"{smollm_gguf}: --lora.init-adapter: expected an adapter GGUF (a lora run's "
        "adapter_step_N.gguf, or llama.cpp's) or a lora run's folder, found a llama model, not "
        "an adapter (general.type 'model', no lora_a/lora_b tensors); pass it as --base to "
        "fine-tune it")
