"""The tiny HF checkpoints (tests/hf_tiny.py) through llama.cpp's converter, llama.cpp and HF.

For each kind: llama.cpp's `convert_hf_to_gguf.py` makes the GGUF, llama.cpp loads it and
returns finite logits of the vocabulary's width, and those logits match the Hugging Face
model's own float32 logits on the same ids (the conversion is faithful, and there are two
references for toymlx's loader). Quantized copies (`llamacpp_quantize`) load and stay near
the float32 logits. Each test prints what it found: the GGUF's architecture, metadata and
tensor names and types (run with -s to see them).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from hf_tiny import (
    BASE_KINDS,
    VOCAB,
    gguf_summary,
    hf_logits,
    llamacpp_quantize,
    spec,
    tensor_layout,
    tiny_gguf,  # noqa: F401  (session fixtures)
    tiny_hf,  # noqa: F401
    token_ids,
)
from llamacpp_runner import llamacpp_greedy, llamacpp_logits, llamacpp_tokenize
from llamacpp_source import llamacpp_source  # noqa: F401  (session fixture)

from toymlx.data.tokenizer import Tokenizer
from toymlx.gguf.llama import load_llama, load_llama_weights
from toymlx.gguf.reader import GGUFFile
from toymlx.models.llama import Llama

pytestmark = pytest.mark.interop

N_TOKENS = 40  # crosses the Gemma sliding windows (8) and the longrope kinds' original context (32)
HF_TOL = 1e-4  # llama.cpp f32 against transformers f32 on O(1) logits (measured: ~1e-6)
# gemma2, gemma3: ~1e-3 from the first position on, most of it llama.cpp's GELU, which looks its
# values up in a float16 table (emulating that in transformers leaves 2e-4); the sliding
# window itself agrees (without it transformers moves by 0.4-1.9 after position 8)
GELU_TOL = 5e-3
# a trained gemma4 moves further: its fused file's run measured 5.1e-3 from llama.cpp (the base
# 2.1e-3), and 4e-4 (6e-4) with toymlx's GELU input and output rounded to float16 as llama.cpp's
TRAINED_GELU_TOL = 1e-2
QUANT_KINDS = ("llama-q", "qwen3-q", "gemma2-q", "gemma3-q", "gemma4-q")
# tokenized by the converter's file: the cut vocabularies hold merged pieces ("er") without
# their characters ("e"), which still merge in llama.cpp (toymlx.data.merges.build_spm)
TEXTS = ["Hello world", " Hello  world\n\nand 12345 don't", "héllo wörld 🦙", "<bos>x</s>"]
QUANT_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q4_K_M", "Q5_K_M", "Q6_K")


def report(what: str, **figures) -> None:
    print(f"\n[hf_tiny] {what}: " + json.dumps(figures, default=str))


@pytest.mark.parametrize("kind", BASE_KINDS + tuple(f"{k}-q" for k in BASE_KINDS))
def test_converted_matches_llamacpp_and_hf(kind, tiny_hf, tiny_gguf):  # noqa: F811
    hf_dir = tiny_hf(kind)
    path = tiny_gguf(kind)
    s = gguf_summary(path)
    layout = tensor_layout(s)
    report(f"{kind} gguf", architecture=s["architecture"],
           convert_s=round(tiny_gguf.seconds[(kind, "f32")], 1),
           size_kb=round(path.stat().st_size / 1024), metadata=s["metadata"],
           global_tensors=layout["global"], block_tensors=layout["block"])
    tok = Tokenizer.from_gguf(path)
    assert [tok.encode(t, parse_special=False) for t in TEXTS] == llamacpp_tokenize(path, TEXTS)
    ids = token_ids(hf_dir, N_TOKENS)
    got, info = llamacpp_logits(path, ids)
    assert got.shape == (N_TOKENS, VOCAB) and info["n_vocab"] == VOCAB
    assert np.isfinite(got).all()
    ref = hf_logits(hf_dir, ids)
    assert ref.shape == got.shape
    diff = float(np.abs(got - ref).max())
    report(f"{kind} logits", llamacpp_vs_hf_max_abs=diff, logit_std=float(ref.std()),
           n_vocab=info["n_vocab"], load_s=round(info["load_s"], 2))
    assert diff < (GELU_TOL if kind.startswith("gemma") else HF_TOL), f"{kind}: llama.cpp and transformers differ by {diff}"
    # toymlx on the converter's file: against transformers (exact GELU) and llama.cpp
    mine = toymlx_logits(path, ids, long_factors=spec(kind).extra.get("longrope", False))
    d_hf, d_cpp = float(np.abs(mine - ref).max()), float(np.abs(mine - got).max())
    report(f"{kind} toymlx", toymlx_vs_hf_max_abs=d_hf, toymlx_vs_llamacpp_max_abs=d_cpp,
           top1_vs_llamacpp=float((mine.argmax(-1) == got.argmax(-1)).mean()))
    assert d_hf < HF_TOL, f"{kind}: toymlx and transformers differ by {d_hf}"
    assert d_cpp < (GELU_TOL if kind.startswith("gemma") else HF_TOL), \
        f"{kind}: toymlx and llama.cpp differ by {d_cpp}"


def toymlx_logits(path, ids, long_factors: bool = False) -> np.ndarray:
    """toymlx's float32 logits (T, V) for `ids` on a GGUF. `long_factors`: Phi-3 longrope's
    long factors, which llama.cpp and transformers use past the original context (toymlx
    trains within it and uses the short ones; this checks the long ones compute the same)."""
    import dataclasses

    import mlx.core as mx

    model, g = load_llama(path)
    if long_factors:
        long = tuple(float(x) for x in GGUFFile(path).load("rope_factors_long.weight"))
        model = Llama(dataclasses.replace(model.args, rope_factors=long))
        load_llama_weights(g, model)
    return np.array(model(mx.array([ids]))[0].astype(mx.float32))


@pytest.mark.parametrize("qtype", QUANT_TYPES)
@pytest.mark.parametrize("kind", QUANT_KINDS)
def test_quantized_copies_load(kind, qtype, tiny_hf, tiny_gguf, tmp_path):  # noqa: F811
    src = tiny_gguf(kind)
    dst = tmp_path / f"{kind}-{qtype}.gguf"
    q = llamacpp_quantize(src, dst, qtype)
    by_type: dict[str, list[str]] = {}
    for name, t in q["types"].items():
        by_type.setdefault(t, []).append(name.replace("blk.0.", "blk.N.")
                                         if not name.startswith("blk.") or
                                         name.startswith("blk.0.") else "")
    types = {t: sorted(n for n in names if n) for t, names in by_type.items()}
    ids = token_ids(tiny_hf(kind), N_TOKENS)
    got, info = llamacpp_logits(dst, ids)
    assert got.shape == (N_TOKENS, info["n_vocab"]) and np.isfinite(got).all()
    ref, _ = llamacpp_logits(src, ids)
    diff = float(np.abs(got - ref).max())
    # toymlx on the quantized file: llama.cpp also rounds activations to 8 bits inside its
    # quantized matmuls, so the two differ by the quantization margin, not 1e-4
    mine = toymlx_logits(dst, ids)
    d_toy = float(np.abs(mine - got).max())
    top1 = float((mine.argmax(-1) == got.argmax(-1)).mean())
    report(f"{kind} {qtype} toymlx", toymlx_vs_llamacpp_max_abs=d_toy, top1=top1,
           llamacpp_vs_its_f32=diff)
    assert d_toy <= max(diff, 0.05) and top1 >= 0.9
    report(f"{kind} {qtype}", quantize_s=round(q["seconds"], 2),
           size_kb=round(dst.stat().st_size / 1024), tensor_types_global_and_block0=types,
           max_abs_vs_f32=diff, logit_std=float(ref.std()))
    assert diff < 0.5 * float(np.abs(ref).max()) + 0.5


@pytest.mark.parametrize("kind", ["phi3-longrope", "phi4-mini"])
def test_longrope_short_factors_within_the_original_context(kind, tiny_hf, tiny_gguf):  # noqa: F811
    """Within longrope's original context (32 here) transformers rotates by the short factors,
    as toymlx always does: toymlx's logits on the file are transformers' for 24 tokens (llama.cpp
    picks its factors by n_ctx, 64 in llamacpp_runner: the long ones, checked above)."""
    ids = token_ids(tiny_hf(kind), 24)
    ref = hf_logits(tiny_hf(kind), ids)
    mine = toymlx_logits(tiny_gguf(kind), ids)
    d_hf = float(np.abs(mine - ref).max())
    report(f"{kind} short factors", toymlx_vs_hf_max_abs=d_hf, logit_std=float(ref.std()))
    assert d_hf < HF_TOL, f"{kind}: toymlx and transformers differ by {d_hf}"


@pytest.mark.parametrize("kind", ["qwen3-yarn", "ministral3", "gemma4"])
def test_new_kinds_train_and_their_fused_export_runs_in_llamacpp(kind, tiny_hf, tiny_gguf,  # noqa: F811
                                                                 tmp_path):
    """The converter's YaRN files and Gemma 4's through toymlx's own paths: a LoRA run
    (toymlx-train, two rows, so every step sees the same batch; ministral3's are chats in
    Ministral 3's own template, which the converter wrote into its file) lowers its loss;
    `toymlx-export --fuse` writes a file whose architecture keys are the base's (YaRN's type,
    factor, original context, mistral3's betas, log multiplier and temperature; gemma4's
    pattern, shared-KV tail, per-layer width), which llama.cpp computes as toymlx does, and
    which is the run's base + adapter; toymlx-generate's greedy tokens from the run are
    llama.cpp's with the run's adapter (--lora), up to the end-of-turn token toymlx stops at."""
    from test_lora import number_stories_folder, recipe_args, step_losses
    from toymlx_cli.export import main as export
    from toymlx_cli.train import main as train

    from toymlx.generation.generate import generate, load_for_generation, stop_ids

    base = tiny_gguf(kind)
    data, seq = number_stories_folder(tmp_path / "data", {"train": 2, "valid": 2}), 48
    if kind == "ministral3":
        data, seq = tmp_path / "chats", 128
        data.mkdir()
        for split in ("train", "valid"):
            (data / f"{split}.jsonl").write_text("".join(json.dumps({"messages": [
                {"role": "system", "content": "Be terse."},
                {"role": "user", "content": f"Name the number {i}."},
                {"role": "assistant", "content": f"It is {i}."}]}) + "\n" for i in range(2)))
        assert "[SYSTEM_PROMPT]" in GGUFFile(base).metadata["tokenizer.chat_template"]
    args = recipe_args(base, tmp_path, data, "--lora.targets", "q,k,v,o,gate,up,down",
                       "--lora.rank", "4", "--steps", "6", "--seq-len", str(seq))
    assert train([*args, "--run-id", "r"]) == 0
    run = tmp_path / "r"
    losses = step_losses(run)
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.05, losses
    out = tmp_path / "fused.gguf"
    assert export(["--adapter", str(run), "--fuse", "--out", str(out)]) == 0
    arch = GGUFFile(base).metadata["general.architecture"]
    kept = {k: v for k, v in GGUFFile(base).metadata.items() if k.startswith(f"{arch}.")}
    assert kind == "gemma4" or kept[f"{arch}.rope.scaling.type"] == "yarn"
    fused_meta = GGUFFile(out).metadata
    assert {k: fused_meta.get(k) for k in kept} == kept
    ids = token_ids(tiny_hf(kind), N_TOKENS)
    mine = toymlx_logits(out, ids)
    ref, _ = llamacpp_logits(out, ids)
    import mlx.core as mx

    model, tok = load_for_generation(run)
    adapted = np.array(model(mx.array([ids]))[0])
    d_cpp, d_run = float(np.abs(mine - ref).max()), float(np.abs(mine - adapted).max())
    d_base = float(np.abs(adapted - toymlx_logits(base, ids)).max())
    prompt = tok.encode("Tell me about the number 3.")
    mine_ids = list(generate(model, tok, prompt, 24))
    ref_ids = llamacpp_greedy(base, prompt, 24, lora=run / "weights" / "latest")
    report(f"{kind} lora run", losses=losses, fused_toymlx_vs_llamacpp_max_abs=d_cpp,
           fused_vs_base_plus_adapter_max_abs=d_run, adapter_moves_logits_by=d_base,
           greedy_toymlx=mine_ids, greedy_llamacpp=ref_ids,
           keys={k: v for k, v in kept.items() if "rope" in k or "temperature" in k})
    assert d_cpp < (TRAINED_GELU_TOL if kind == "gemma4" else HF_TOL)
    assert d_run < 1e-4 and d_base > 1e-3
    # llama.cpp's runner stops at eos only, toymlx also at an end of turn (gemma4's <turn|>)
    n = len(mine_ids)
    assert mine_ids == ref_ids[:n], (mine_ids, ref_ids)
    assert n in (24, len(ref_ids)) or ref_ids[n] in stop_ids(tok), (mine_ids, ref_ids)
