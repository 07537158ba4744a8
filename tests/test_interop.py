"""toymlx against llama.cpp (llama-cpp-python): logits, tokenizers, the real SmolLM2.

Every llama.cpp call runs in a child process (tests/llamacpp_runner.py), so a segfault on a
bad file fails one test instead of killing pytest. llama.cpp runs with an f32 KV cache and
flash attention off, the configuration in which it matches an exact fp32 forward. Each test
prints the figures it measured (run with -s to see them).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from llamacpp_runner import llamacpp_logits, llamacpp_tokenize
from smollm import smollm_gguf  # noqa: F401  (session fixture)

from toymlx.bundle.checkpoint import resolve_latest
from toymlx.generation.generate import load_for_generation
from toymlx.gguf.reader import GGUFFile
from toymlx.gguf.writer import write_gguf

pytestmark = pytest.mark.interop

TOL = 1e-4
TEXT = ("Once upon a time, there was a little girl named Lily. She loved to play outside in "
        "the park with her friends. One day, she saw a big red ball under a tree.")
VARIED = [
    "",
    "hello",
    "Hello, world! 123 + 456 = 579.",
    "  leading and   multiple spaces, trailing  ",
    "tabs\tand\nnewlines\n\nand a blank line\r\nand CRLF",
    "Unicode: héllo wörld, naïve café, Ünïcödé",
    "日本語のテキスト and 中文, Ελληνικά, русский",
    "emoji 🙂🚀 and symbols ✓ ∑ → ©",
    "def f(x):\n    return x ** 2  # code\n",
    "\n starts with a newline",
    " Once upon a time",
]


def report(what: str, **figures) -> None:
    """Print one measured figure set (collected into docs/RESULTS.md by hand)."""
    print(f"\n[interop] {what}: " + json.dumps(figures, default=float))


def toy_logits(model, ids: list[int]) -> np.ndarray:
    return np.array(model(mx.array([ids]))[0].astype(mx.float32))  # (T, V)


def compare_logits(path: Path, what: str, ids: list[int], model=None) -> float:
    """Max abs difference between llama.cpp's and toymlx's logits for `ids` on `path`."""
    if model is None:
        model, _ = load_for_generation(path)
    t0 = time.perf_counter()
    mine = toy_logits(model, ids)
    t_toy = time.perf_counter() - t0
    ref, info = llamacpp_logits(path, ids)
    assert ref.shape == mine.shape, (ref.shape, mine.shape)
    diff = float(np.abs(ref - mine).max())
    top1 = float((ref.argmax(-1) == mine.argmax(-1)).mean())
    report(what, n_tokens=len(ids), max_abs_diff=diff, logit_scale=float(np.abs(ref).max()),
           top1_agreement=top1, toymlx_forward_s=round(t_toy, 3),
           llamacpp_eval_s=round(info["eval_s"], 3))
    return diff


# ---- from-scratch checkpoints made by really running toymlx-train ------------------------
SHAPE = ["--model.d-model", "64", "--model.n-layers", "2", "--model.ffn-dim", "160",
         "--model.context", "256"]
RUNS = {
    "mha-tied": ["--model.n-heads", "4", "--model.n-kv-heads", "4"],
    "gqa-tied": ["--model.n-heads", "4", "--model.n-kv-heads", "2"],
    "gqa-untied": ["--model.n-heads", "8", "--model.n-kv-heads", "2",
                   "--model.tie-embeddings", "False"],
}
PRECISION_RUNS = {  # (training dtype, checkpoint tensor type) -> extra flags
    "bf16-trained-f32": ["--dtype", "bfloat16"],
    "bf16-trained-bf16": ["--dtype", "bfloat16", "--save-dtype", "bf16"],
    "f32-trained-f16": ["--save-dtype", "f16"],
}
TOKENIZER_RUNS = {  # --tokenizer's GGUF (llama.cpp's vocab-only files), by run name
    "gpt-2-bpe": "tokenizers/ggml-vocab-gpt-2.gguf",
    "smollm2-bpe": "tokenizers/ggml-vocab-smollm2.gguf",
}
SAVE_TOL = {"f32": TOL, "f16": 2e-3, "bf16": 2e-2}
"""llama.cpp's CPU matmuls round the activations to the weights' type (F16 and BF16 weights
get F16 and BF16 activations), which an exact forward of the same weights does not; those
margins are ~3x what that rounding cost here (F16 6.4e-4, BF16 7.9e-3; docs/RESULTS.md)."""


@pytest.fixture(scope="session")
def train_run(tmp_path_factory, shared_file):
    """Train a tiny from-scratch run on first request (cached per name); return its folder."""
    root = tmp_path_factory.mktemp("runs")
    done: dict[str, Path] = {}

    def run(name: str) -> Path:
        if name in done:
            return done[name]
        cmd = [sys.executable, "-m", "toymlx_cli.train", "--recipe", "from-scratch",
               "--runs-root", str(root), "--run-id", name, "--steps", "40", "--batch-size", "8",
               "--seq-len", "64", "--lr", "1e-2", "--warmup", "2", "--eval-every", "0",
               "--eval-batches", "1", "--checkpoint-every", "0", "--no-compile",
               "--no-progress", "--data.path", str(shared_file("text/tinystories_sample.txt")),
               *SHAPE, *{**RUNS, **PRECISION_RUNS}.get(name, RUNS["gqa-tied"])]
        if name in TOKENIZER_RUNS:
            cmd += ["--tokenizer", str(shared_file(TOKENIZER_RUNS[name]))]
        t0 = time.perf_counter()
        r = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, f"toymlx-train failed for {name}:\n{r.stderr[-3000:]}"
        wall = round(time.perf_counter() - t0, 2)
        report(f"toymlx-train from-scratch {name}", train_wall_s=wall)
        done[name] = root / name
        return done[name]

    return run


@pytest.mark.parametrize("name", list(RUNS))
def test_from_scratch_checkpoint_logits_match_llamacpp(train_run, name):
    run = train_run(name)
    ckpt = resolve_latest(run)
    g = GGUFFile(ckpt)
    tied = "untied" not in name
    assert ("output.weight" in g.tensors) == (not tied)
    heads = g.metadata["llama.attention.head_count"]
    kv = g.metadata["llama.attention.head_count_kv"]
    assert (kv < heads) == name.startswith("gqa")
    model, tok = load_for_generation(run)  # the run directory itself, as --model takes it
    ids = tok.encode(TEXT)[:64]
    assert len(ids) >= 32
    diff = compare_logits(ckpt, f"from-scratch {name} ({heads} heads / {kv} kv, "
                          f"{'tied' if tied else 'untied'}) logits", ids, model)
    assert diff <= TOL


@pytest.mark.parametrize("name", list(PRECISION_RUNS))
def test_half_precision_runs_load_in_llamacpp(train_run, name):
    """A bf16-trained run's F32 checkpoint matches llama.cpp to 1e-4 like any other; F16 and
    BF16 checkpoints load too, their logits within what llama.cpp's activation rounding costs."""
    run = train_run(name)
    ckpt = resolve_latest(run)
    save = name.rsplit("-", 1)[1]
    g = GGUFFile(ckpt)
    want = {"f32": "F32", "f16": "F16", "bf16": "BF16"}[save]
    assert g.tensors["blk.0.attn_q.weight"].type.name == want
    assert g.tensors["blk.0.attn_norm.weight"].type.name == "F32"
    model, tok = load_for_generation(run)
    ids = tok.encode(TEXT)[:64]
    diff = compare_logits(ckpt, f"from-scratch {name} logits (checkpoint {want})", ids, model)
    assert diff <= SAVE_TOL[save]


def test_from_scratch_byte_tokenizer_matches_llamacpp(train_run):
    ckpt = resolve_latest(train_run("mha-tied"))
    _, tok = load_for_generation(ckpt)
    check_tokenizer(ckpt, tok, VARIED, "from-scratch byte tokenizer")


# ---- stories260K (a llama2.c model converted by llama.cpp's own tools) --------------------
@pytest.mark.parametrize("name", list(TOKENIZER_RUNS))
def test_from_scratch_on_a_gguf_tokenizer_matches_llamacpp(train_run, shared_file, name):
    """`--tokenizer FILE.gguf`: the model's vocabulary is the file's (GPT-2's 50,257 tokens,
    SmolLM2's 49,152), and its checkpoint tokenizes, and gives logits, as llama.cpp does."""
    run = train_run(name)
    ckpt = resolve_latest(run)
    vocab = GGUFFile(shared_file(TOKENIZER_RUNS[name])).metadata["tokenizer.ggml.tokens"]
    g = GGUFFile(ckpt)
    assert g.metadata["tokenizer.ggml.tokens"] == vocab
    assert tuple(g.tensors["token_embd.weight"].shape) == (len(vocab), 64)
    model, tok = load_for_generation(run)
    check_tokenizer(ckpt, tok, VARIED, f"from-scratch {name} tokenizer")
    ids = tok.encode(TEXT)[:64]
    assert len(ids) >= 32
    assert compare_logits(ckpt, f"from-scratch {name} logits", ids, model) <= TOL


def test_stories_logits_match_llamacpp(stories_path):
    model, tok = load_for_generation(stories_path)
    ids = tok.encode(TEXT)
    assert len(ids) >= 32
    assert compare_logits(stories_path, "stories260K logits", ids, model) <= TOL


def test_stories_tokenizer_matches_llamacpp(stories_path):
    _, tok = load_for_generation(stories_path)
    check_tokenizer(stories_path, tok, VARIED + [TEXT], "stories260K tokenizer")


def check_tokenizer(path: Path, tok, texts: list[str], what: str, special: bool = False) -> None:
    """toymlx's ids equal llama.cpp's for every text, with and without BOS."""
    bad = []
    for add_bos in (True, False):
        ref = llamacpp_tokenize(path, texts, add_bos=add_bos, special=special)
        for text, want in zip(texts, ref):
            got = tok.encode(text, add_bos=None if add_bos else False)
            if got != want:
                bad.append(f"add_bos={add_bos} {text!r}: toymlx {got[:24]} llama.cpp {want[:24]}")
    report(what, texts=len(texts), mismatches=len(bad))
    assert not bad, "\n".join(bad)


# ---- the real SmolLM2-135M-Instruct -------------------------------------------------------
@pytest.fixture(scope="session")
def smollm_f32(smollm_gguf, tmp_path_factory):  # noqa: F811
    """An F32 copy of the Q4_1 weights: every tensor dequantized by gguf-py, metadata kept."""
    g = GGUFFile(smollm_gguf)
    tensors = {name: g.load(name, np.float32) for name in g.tensors}
    meta = dict(g.metadata)
    meta["general.file_type"] = 0  # ALL_F32
    out = tmp_path_factory.mktemp("smollm") / "SmolLM2-135M-Instruct.F32.gguf"
    write_gguf(out, meta, tensors, types=g.metadata_types)
    assert "output.weight" not in tensors  # tied embeddings
    del tensors
    yield out
    out.unlink(missing_ok=True)  # 540 MB; pytest keeps the last few temp folders


def real_text_ids(tok, shared_file, n: int) -> list[int]:
    text = shared_file("text/tinystories_sample.txt").read_text(encoding="utf-8")
    text = text.replace("<|endoftext|>", "\n\n")
    ids = tok.encode(text)
    assert len(ids) >= n
    return ids[:n]


@pytest.mark.smollm
def test_smollm_f32_copy_logits_match_llamacpp(smollm_f32, shared_file):
    model, tok = load_for_generation(smollm_f32)
    ids = real_text_ids(tok, shared_file, 64)
    diff = compare_logits(smollm_f32, "SmolLM2-135M-Instruct F32 copy logits", ids, model)
    assert diff <= TOL


@pytest.mark.smollm
def test_smollm_q4_1_top1_agreement(smollm_gguf, shared_file):  # noqa: F811
    model, tok = load_for_generation(smollm_gguf)
    ids = real_text_ids(tok, shared_file, 384)
    mine = toy_logits(model, ids)
    ref, info = llamacpp_logits(smollm_gguf, ids)
    top1 = float((ref.argmax(-1) == mine.argmax(-1)).mean())
    report("SmolLM2-135M-Instruct Q4_1 (toymlx dequantized fp32 vs llama.cpp)",
           positions=len(ids), top1_agreement=top1, max_abs_diff=float(np.abs(ref - mine).max()),
           llamacpp_eval_s=round(info["eval_s"], 3))
    assert top1 >= 0.90


@pytest.mark.smollm
def test_smollm_tokenizer_matches_llamacpp(smollm_gguf):  # noqa: F811
    _, tok = load_for_generation(smollm_gguf)
    check_tokenizer(smollm_gguf, tok, VARIED + [TEXT], "SmolLM2 tokenizer (plain text)")
    chat = [tok.apply_chat_template([{"role": "user", "content": t}]) for t in VARIED[1:5]]
    check_tokenizer(smollm_gguf, tok, chat, "SmolLM2 tokenizer (chat template, special)",
                    special=True)


@pytest.mark.smollm
def test_smollm_chat_generation_knows_paris(smollm_gguf):  # noqa: F811
    cmd = [sys.executable, "-m", "toymlx_cli.generate", "--model", str(smollm_gguf), "--chat",
           "--prompt", "What is the capital of France?", "--max-tokens", "30",
           "--temperature", "0"]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - t0
    assert r.returncode == 0, r.stderr[-2000:]
    report("toymlx-generate SmolLM2 Q4_1 --chat", wall_s=round(wall, 2), output=r.stdout.strip(),
           stats=r.stderr.strip().splitlines()[-1])
    assert "Paris" in r.stdout


# ---- warm-start: the folded export is a plain llama model llama.cpp runs ------------------
def test_warm_start_checkpoint_logits_match_llamacpp(stories_path, shared_file, tmp_path):
    from toymlx_cli.train import main

    args = ["--recipe", "warm-start", "--donor", str(stories_path), "--model.d-model", "32",
            "--model.n-layers", "2", "--model.n-heads", "4", "--model.n-kv-heads", "2",
            "--model.ffn-dim", "64", "--seq-len", "64", "--batch-size", "4", "--steps", "6",
            "--data.path", str(shared_file("text/tinyshakespeare.txt")),
            "--runs-root", str(tmp_path), "--run-id", "warm", "--no-progress"]
    assert main(args) == 0
    ckpt = resolve_latest(tmp_path / "warm")
    g = GGUFFile(ckpt)
    assert g.tensors["token_embd.weight"].shape == (512, 32)  # table @ lens, folded
    assert g.metadata["llama.context_length"] == 64  # the window trained (n_ctx_train here)
    model, tok = load_for_generation(ckpt)
    ids = tok.encode(TEXT)
    assert compare_logits(ckpt, "warm-start (pca lens, width 64 -> 32) logits", ids,
                          model) <= TOL


# ---- lora recipe: --fine-tune-type full and dora on stories260K --------------------------
def _stories_folder(root: Path, shared_file) -> Path:
    """An mlx-lm data folder of text examples (stories260K has no chat template)."""
    text = shared_file("text/tinyshakespeare.txt").read_text()
    paras = [p.strip() for p in text.split("\n\n") if len(p.strip()) > 40][:60]
    folder = root / "data"
    folder.mkdir()
    for name, part in (("train", paras[:48]), ("valid", paras[48:54]), ("test", paras[54:])):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps({"text": p}) + "\n"
                                                      for p in part))
    return folder


def test_full_fine_tune_checkpoint_logits_match_llamacpp(stories_path, shared_file, tmp_path):
    """--fine-tune-type full of stories260K: a step_N.gguf llama.cpp loads, with its logits
    equal to toymlx's, and every weight moved off the base."""
    from toymlx_cli.train import main

    args = ["--recipe", "lora", "--fine-tune-type", "full", "--base", str(stories_path),
            "--data.path", str(_stories_folder(tmp_path, shared_file)), "--seq-len", "64",
            "--batch-size", "4", "--steps", "6", "--lr", "3e-3", "--warmup", "1", "--test",
            "--runs-root", str(tmp_path), "--run-id", "full", "--no-progress"]
    assert main(args) == 0
    ckpt = resolve_latest(tmp_path / "full")
    assert ckpt.name == "step_6.gguf"
    g, b = GGUFFile(ckpt), GGUFFile(stories_path)
    assert g.metadata["tokenizer.ggml.model"] == "llama" and sorted(g.tensors) == sorted(b.tensors)
    assert np.abs(g.load("blk.4.ffn_down.weight", np.float32)
                  - b.load("blk.4.ffn_down.weight", np.float32)).max() > 1e-3
    model, tok = load_for_generation(tmp_path / "full")
    ids = tok.encode(TEXT)
    base_model, _ = load_for_generation(stories_path)
    assert np.abs(toy_logits(model, ids) - toy_logits(base_model, ids)).max() > 1e-2
    assert compare_logits(ckpt, "lora recipe --fine-tune-type full (stories260K) logits", ids,
                          model) <= TOL


def test_dora_fused_export_logits_match_llamacpp(stories_path, shared_file, tmp_path):
    """--fine-tune-type dora: llama.cpp runs the fused export with the logits of toymlx's
    base + DoRA adapter."""
    from toymlx_cli.export import main as export
    from toymlx_cli.train import main

    args = ["--recipe", "lora", "--fine-tune-type", "dora", "--base", str(stories_path),
            "--data.path", str(_stories_folder(tmp_path, shared_file)), "--seq-len", "64",
            "--batch-size", "4", "--steps", "6", "--lr", "1e-2", "--warmup", "1",
            "--lora.targets", "q,v,o,down", "--runs-root", str(tmp_path), "--run-id", "dora",
            "--no-progress"]
    assert main(args) == 0
    model, tok = load_for_generation(tmp_path / "dora")  # base + the DoRA adapter, in toymlx
    merged = tmp_path / "merged.gguf"
    assert export(["--base", str(stories_path), "--adapter", str(tmp_path / "dora"), "--fuse",
                   "--out", str(merged)]) == 0
    with GGUFFile(merged) as g:  # llama.cpp loads it with the run's data settings (ignored)
        assert (g.metadata["toy.run_data.seq_len"], g.metadata["toy.run_data.data.pack"],
                g.metadata["toy.run_data.data.val_fraction"]) == (64, True, 0.1)
    ids = tok.encode(TEXT)
    base_model, _ = load_for_generation(stories_path)
    assert np.abs(toy_logits(model, ids) - toy_logits(base_model, ids)).max() > 1e-2
    assert compare_logits(merged, "lora recipe --fine-tune-type dora, fused export (stories260K) "
                          "vs toymlx base + DoRA adapter", ids, model) <= TOL
