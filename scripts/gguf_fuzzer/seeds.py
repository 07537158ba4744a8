"""The seed files every case mutates: real GGUFs that toymlx reads today.

A checkpoint written by a 2-step `toymlx-train --recipe from-scratch` run; the same model with
its projections in the quantized types `load_llama(weights="quantized")` keeps (plus one tensor of each other
type); a LoRA adapter for it written by `toymlx.training.adapter.write_adapter`; `stories260K.gguf`; and the
llama.cpp tokenizer GGUFs from ../shared/data (cut to 1500 tokens, and whole with `full`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as T
from gguf.quants import quantize

from toymlx.gguf.llama import load_llama
from toymlx.gguf.reader import GGUFFile
from toymlx.gguf.writer import QuantTensor, write_gguf
from toymlx.models.lora import apply_lora, lora_layers
from toymlx.training.adapter import write_adapter

REPO = Path(__file__).resolve().parents[2]
SHARED = Path(os.environ.get("TOYMLX_SHARED", REPO.parent / "shared")) / "data"


def build_seeds(folder: Path, full: bool = True) -> dict[str, str]:
    """Write the seed files into `folder` and return {name: path}; `full` adds the 50k-token
    vocabularies as they are (each costs ~1 s per case to read and build). Missing shared files
    are listed in `folder/seeds.json`'s notes."""
    folder.mkdir(parents=True, exist_ok=True)
    notes = {"toy-checkpoint": "2-step toymlx-train --recipe from-scratch checkpoint"}
    toy = folder / "toy-checkpoint.gguf"
    shutil.copyfile(_train_two_steps(folder / "runs"), toy)
    seeds = {"toy-checkpoint": str(toy)}
    mixed = folder / "toy-mixed-types.gguf"
    _write_mixed_types(toy, mixed)
    seeds["toy-mixed-types"] = str(mixed)
    zoo = folder / "type-zoo.gguf"
    _write_type_zoo(toy, zoo)
    seeds["type-zoo"] = str(zoo)
    seeds["lora-adapter"] = str(_write_adapter(folder, toy))
    p = SHARED / "models" / "stories260K.gguf"
    if p.is_file():
        seeds["stories260K"] = str(p)
    else:
        notes["stories260K"] = f"missing {p}"
    for name in ("llama-spm", "gpt-2", "smollm2"):
        p = SHARED / "tokenizers" / f"ggml-vocab-{name}.gguf"
        if not p.is_file():
            notes[f"vocab-{name}"] = f"missing {p}"
            continue
        small = folder / f"vocab-{name}-1500.gguf"
        _small_vocab(p, small, 1500)
        seeds[f"vocab-{name}-1500"] = str(small)
        if full:
            seeds[f"vocab-{name}"] = str(p)
    (folder / "seeds.json").write_text(json.dumps({"seeds": seeds, "notes": notes}, indent=1))
    return seeds


def _train_two_steps(runs: Path) -> Path:
    """A real checkpoint: 2 steps of a tiny from-scratch run."""
    entry = "import sys; from toymlx_cli.train import main; sys.exit(main(sys.argv[1:]))"
    cmd = [sys.executable, "-c", entry, "--recipe", "from-scratch", "--steps", "2",
           "--model.d-model", "32", "--model.n-layers", "1", "--model.n-heads", "4",
           "--model.n-kv-heads", "2", "--model.ffn-dim", "64", "--model.context", "64",
           "--seq-len", "32", "--batch-size", "2", "--warmup", "1", "--eval-batches", "1",
           "--no-compile", "--no-progress", "--runs-root", str(runs), "--run-id", "seed",
           "--data.path", str(SHARED / "text" / "tinystories_sample.txt")]
    p = subprocess.run(cmd, capture_output=True, check=False, text=True, timeout=300)
    latest = runs / "seed" / "weights" / "latest"
    if p.returncode != 0 or not latest.exists():
        raise RuntimeError(f"the seed checkpoint's 2-step toymlx-train run failed "
                           f"(exit {p.returncode}):\n{p.stderr[-4000:]}")
    return latest.resolve()


def _write_mixed_types(toy: Path, out_path: Path) -> None:
    """`toy` with its projections in the three types load_llama(weights="quantized") keeps and
    the embedding in F16 (a model every loader accepts)."""
    g = GGUFFile(toy)
    tensors = {n: g.load(n) for n in g.tensors}
    plan = {"attn_q": T.Q8_0, "attn_k": T.Q4_0, "attn_v": T.Q4_1, "attn_output": T.Q8_0,
            "ffn_gate": T.Q4_1, "ffn_up": T.Q4_0, "ffn_down": T.Q8_0, "token_embd": T.F16}
    out: dict = {}
    for n, a in tensors.items():
        kind = next((q for k, q in plan.items() if f"{k}." in n), None)
        if kind is T.F16:
            out[n] = a.astype(np.float16)
        elif kind is not None and a.shape[-1] % 32 == 0:
            out[n] = QuantTensor(kind, quantize(a, kind), a.shape)
        else:
            out[n] = a
    write_gguf(out_path, dict(g.metadata), out, types=dict(g.metadata_types))


def _write_type_zoo(toy: Path, out_path: Path) -> None:
    """`toy` plus one extra tensor of each other type: the reader decodes every type, and the
    model loaders refuse the extra tensors by name."""
    g = GGUFFile(toy)
    out: dict = {n: g.load(n) for n in g.tensors}
    rng = np.random.default_rng(0)
    for q in (T.BF16, T.Q5_0, T.Q5_1, T.Q4_K, T.Q6_K, T.IQ4_NL, T.TQ2_0, T.MXFP4):
        x = rng.standard_normal((2, 256)).astype(np.float32)
        try:
            out[f"extra.{q.name.lower()}"] = QuantTensor(q, quantize(x, q), x.shape)
        except NotImplementedError:  # gguf-py cannot encode it: random blocks decode too
            block, size = GGML_QUANT_SIZES[q]
            raw = rng.integers(0, 256, (2, 256 // block * size), dtype=np.uint8)
            out[f"extra.{q.name.lower()}"] = QuantTensor(q, raw, x.shape)
    write_gguf(out_path, dict(g.metadata), out, types=dict(g.metadata_types))


def _write_adapter(folder: Path, base: Path) -> Path:
    """A LoRA adapter GGUF for the toy base, written by toymlx.training.adapter.write_adapter."""
    mx.random.seed(0)  # the same adapter in every process: cases stay a function of the seed
    model, g = load_llama(base)
    apply_lora(model, targets="q,v,down", rank=4, alpha=8.0)
    for m in lora_layers(model).values():  # non-zero B, so the adapter does something
        m.lora_b = mx.random.normal(m.lora_b.shape) * 0.01
    path = folder / "lora-adapter.gguf"
    write_adapter(path, model, g.metadata)
    return path


def _small_vocab(src: Path, dst: Path, n: int) -> None:
    """A real vocabulary cut to its first `n` tokens (merges and special ids kept consistent)."""
    g = GGUFFile(src)
    meta, types = dict(g.metadata), dict(g.metadata_types)
    toks = meta["tokenizer.ggml.tokens"][:n]
    meta["tokenizer.ggml.tokens"] = toks
    for k in ("tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
        if k in meta:
            meta[k] = meta[k][:n]
    if "tokenizer.ggml.merges" in meta:
        have = set(toks)
        meta["tokenizer.ggml.merges"] = [
            m for m in meta["tokenizer.ggml.merges"]
            if len(m.split(" ")) == 2 and all(x in have for x in m.split(" "))
            and m.replace(" ", "") in have]
    for k, v in list(meta.items()):
        if k.endswith("_token_id") and isinstance(v, int) and v >= n:
            meta[k] = n - 1
        if k.endswith(".vocab_size"):
            meta[k] = n
    write_gguf(dst, meta, {}, types=types)
