"""Model-shaped Q4_K_M GGUFs with random weights, the files issue 34's memory rows train on.

There is no model hub here, so the benchmark writes the files people run at their shapes:

| name | arch | d | layers | ffn | heads q/kv | head | vocabulary | output |
| --- | --- | --- | --- | --- | --- | --- | --- | --- |
| gemma-3-270m | gemma3 | 640 | 18 | 2048 | 4/1 | 256 | 262,144, synthetic SentencePiece | tied |
| llama-3.2-1b | llama | 2048 | 16 | 8192 | 32/8 | 64 | SmolLM2's 49,152 | tied |
| llama-3.2-3b | llama | 3072 | 28 | 8192 | 24/8 | 128 | SmolLM2's 49,152 | tied |
| llama-3.1-8b | llama | 4096 | 32 | 14336 | 32/8 | 128 | SmolLM2's 49,152 (not Llama 3's 128,256) | untied |
| qwen3-1.7b | qwen3 | 2048 | 28 | 6144 | 16/8 | 128 | Qwen2's 151,936 + Qwen3's added tokens | tied |
| gemma-4-e2b | gemma4 | 1536 | 35 | 6144 (12288 in the 20 shared-KV layers) | 8/1 | 256 sliding, 512 full | 262,144, synthetic SentencePiece | tied |
| qwen3.5-0.8b | qwen35 | 1024 | 24 (18 linear) | 3584 | 8/2 | 256 | 248,320, Qwen2's BPE padded | tied |
| qwen3-30b-a3b | qwen3moe | 2048 | 48 | 128 experts of 768, 8 used | 32/4 | 128 | as qwen3-1.7b | untied |
| qwen3-30b-a3b-2l | qwen3moe | the same, 2 layers (its file's blocks, at 1/24 of the layers) | | | | | | |

Gemma 4 E2B's (google/gemma-4-E2B's text config): every 5th layer full attention, window 512,
the last 20 layers reading layers 13's and 14's keys and values, per-layer embeddings of 256
(its 262,144 x 8,960 table, most of the file), proportional RoPE (`rope_freqs`: a quarter of the
full layers' pairs turn), layer scalars 1, logits capped at 30.

Weights are N(0, 0.02) and norms 1; the Llama shapes carry no `rope_freqs` (Llama 3's RoPE
scaling changes no array's size). The Llama shapes take the real SmolLM2-135M-Instruct GGUF's
tokenizer metadata as it is (`user_paths.smollm_gguf`); Gemma 3's 262,144-token vocabulary is
`synthetic_spm`, a SentencePiece vocabulary of that size that toymlx's `Tokenizer` and llama.cpp
load. Qwen3 takes llama.cpp's `models/ggml-vocab-qwen2.gguf` (Qwen2's BPE, which Qwen3 keeps)
with Qwen3's added tokens written over the padding ids 151646-151668 (`<think>` is 151667),
Qwen3's ids (eos `<|im_end|>`, pad and bos `<|endoftext|>`, no bos added) and Qwen3's real chat
template (`models/templates/Qwen-Qwen3-0.6B.jinja`), from llama.cpp's source tree
(`qwen3_vocab`). Qwen3.5 (`qwen35_vocab`) takes `models/ggml-vocab-qwen35.gguf` the same way:
that file is Qwen2's 151,936 tokens and merges under Qwen3.5's pre-tokenizer (`qwen35`), not
Qwen3.5's own 248K BPE, which the tree does not carry; it is padded with `[PADn]` tokens to
Qwen3.5's 248,320 rows (the embedding's real size) and carries Qwen3.5's chat template
(`models/templates/Qwen3.5-4B.jinja`). Qwen3.5-0.8B's text config: 3 of every 4 blocks Gated
DeltaNet (16 k and 16 v heads of 128, kernel 4), full attention 8/2 heads of 256 with RoPE on
the first 64 dimensions (base 1e7). The F16 model is streamed to disk one tensor at a time (gguf-py's `GGUFWriter`: tensor
infos first, then each tensor's data as it is drawn, so an 8B's 16 GB never sits in memory),
llama.cpp's own quantizer (`llama_model_quantize`, as `llama-quantize F16 OUT Q4_K_M`) writes
the file, and the F16 is deleted. Files are kept in a cache folder and reused.

    python benchmarks/shapes.py llama-3.2-1b gemma-3-270m [--cache DIR]
    python benchmarks/shapes.py --write-vocab smollm2-vocab.gguf   # for $TOYMLX_SHAPES_VOCAB

prints one JSON line per file: its path, size, and (when written now) seconds, the peak RSS of
this process (`ru_maxrss`: run one name per process to measure each) and of llama.cpp's
quantizer, which runs in a child process (`quantizer_peak_rss_mb`: the 1B shape's 738 MB, this
process's 363).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFValueType, GGUFWriter

from toymlx.backend import atomic
from toymlx.gguf.llama import ARCHS, expected_shapes, llama_metadata
from toymlx.gguf.quantize import llama_quantize
from toymlx.gguf.reader import GGUFFile
from toymlx.models.llama import LlamaArgs

DEFAULT_CACHE = Path.home() / ".cache" / "toymlx" / "shapes"
FILE_TYPE = "q4_k_m"
STD = 0.02
CHUNK_VALUES = 1 << 24
"""Random values drawn at once while a tensor is made (64 MB of float32)."""
F32_MATRICES = ("ssm_conv1d.weight",)
"""Matrices llama.cpp's converter writes F32 (qwen35's convolution: its quantizer keeps them
as they are, and ggml's ssm_conv reads F32 weights)."""


@dataclass(frozen=True)
class Shape:
    """A model shape to write: its arguments and where its vocabulary comes from."""

    name: str
    args: LlamaArgs
    vocab: str
    """"smollm2": the real SmolLM2 GGUF's tokenizer; "synthetic": `synthetic_spm`; "qwen3":
    `qwen3_vocab`; "qwen35": `qwen35_vocab`."""


def _llama(d: int, layers: int, ffn: int, heads: int, kv: int, tied: bool) -> LlamaArgs:
    return LlamaArgs(vocab_size=49152, d_model=d, n_layers=layers, n_heads=heads, n_kv_heads=kv,
                     ffn_dim=ffn, context=8192, rope_base=500000.0, norm_eps=1e-5,
                     tie_embeddings=tied)


def _gemma3_270m() -> LlamaArgs:
    n_layers = 18
    return replace(LlamaArgs(), arch="gemma3", **ARCHS["gemma3"].switches, vocab_size=262144,
                   d_model=640,
                   n_layers=n_layers, n_heads=4, n_kv_heads=1, key_length=256, ffn_dim=2048,
                   context=32768, rope_base=1e6, norm_eps=1e-6, tie_embeddings=True,
                   sliding_window=512,
                   sliding_layers=tuple(i % 6 < 5 for i in range(n_layers)))  # 5 of 6 slide


def _gemma4_e2b() -> LlamaArgs:
    n_layers, shared, head_full = 35, 20, 512
    turned = head_full // 2 // 4  # proportional RoPE: partial_rotary_factor 0.25
    return replace(LlamaArgs(), arch="gemma4", **ARCHS["gemma4"].switches, vocab_size=262144,
                   d_model=1536, n_layers=n_layers, n_heads=8, n_kv_heads=1,
                   key_length=head_full, key_length_sliding=256, ffn_dim=6144,
                   ffn_dims_per_block=(6144,) * (n_layers - shared) + (12288,) * shared,
                   context=131072, rope_base=1e6, norm_eps=1e-6, tie_embeddings=True,
                   sliding_window=512, sliding_layers=tuple(i % 5 < 4 for i in range(n_layers)),
                   rope_factors=(1.0,) * turned + (1e30,) * (head_full // 2 - turned),
                   shared_kv_layers=shared, per_layer_dim=256, layer_scales=True,
                   final_softcap=30.0)


def _qwen3(d: int, layers: int, ffn: int, heads: int, kv: int, tied: bool) -> LlamaArgs:
    return replace(LlamaArgs(), arch="qwen3", **ARCHS["qwen3"].switches, vocab_size=151936,
                   d_model=d, n_layers=layers, n_heads=heads, n_kv_heads=kv, key_length=128,
                   ffn_dim=ffn, context=40960, rope_base=1e6, norm_eps=1e-6,
                   tie_embeddings=tied)


def _qwen35(d: int, layers: int, ffn: int, heads: int, kv: int, v_heads: int) -> LlamaArgs:
    """Qwen3.5 dense (transformers' Qwen3_5TextConfig at the size): heads 256 wide, RoPE on a
    quarter of each (partial_rotary_factor 0.25), linear blocks of 16 k heads of 128."""
    return replace(LlamaArgs(), arch="qwen35", **ARCHS["qwen35"].switches, vocab_size=248320,
                   d_model=d, n_layers=layers, n_heads=heads, n_kv_heads=kv, key_length=256,
                   rope_dims=64, ffn_dim=ffn, context=262144, rope_base=1e7, norm_eps=1e-6,
                   tie_embeddings=True,
                   linear_layers=tuple((i + 1) % 4 != 0 for i in range(layers)),
                   ssm_conv_kernel=4, ssm_head_dim=128, ssm_k_heads=16, ssm_v_heads=v_heads)


def _qwen3_30b_a3b(layers: int) -> LlamaArgs:
    """Qwen3-30B-A3B's shape (its config.json) with `layers` blocks."""
    return replace(_qwen3(2048, layers, 6144, 32, 4, tied=False), arch="qwen3moe",
                   n_experts=128, n_experts_used=8, expert_ffn_dim=768)


SHAPES: dict[str, Shape] = {s.name: s for s in (
    Shape("gemma-3-270m", _gemma3_270m(), "synthetic"),
    Shape("llama-3.2-1b", _llama(2048, 16, 8192, 32, 8, tied=True), "smollm2"),
    Shape("llama-3.2-3b", _llama(3072, 28, 8192, 24, 8, tied=True), "smollm2"),
    Shape("llama-3.1-8b", _llama(4096, 32, 14336, 32, 8, tied=False), "smollm2"),
    Shape("qwen3-1.7b", _qwen3(2048, 28, 6144, 16, 8, tied=True), "qwen3"),
    Shape("gemma-4-e2b", _gemma4_e2b(), "synthetic"),
    Shape("qwen3.5-0.8b", _qwen35(1024, 24, 3584, 8, 2, v_heads=16), "qwen35"),
    Shape("qwen3-30b-a3b", _qwen3_30b_a3b(48), "qwen3"),
    Shape("qwen3-30b-a3b-2l", _qwen3_30b_a3b(2), "qwen3"),
)}


# ---- vocabularies --------------------------------------------------------------------------
Typed = dict[str, tuple[Any, GGUFValueType, GGUFValueType | None]]
"""GGUF metadata: key -> (value, value type, element type of an array)."""

GEMMA_TEMPLATE = (
    "{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else "
    "m['role'] }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


VOCAB_ENV = "TOYMLX_SHAPES_VOCAB"
"""A GGUF holding SmolLM2's tokenizer.* keys (`write_vocab`'s file), read instead of the real
SmolLM2 GGUF (94 MB) where set: a lent GPU machine has no network and carries 64 MiB a call
(`gpu_machine.sh prepare` carries this file, ~2 MB)."""


def smollm2_vocab() -> Typed:
    """Every tokenizer.* key of the real SmolLM2-135M-Instruct GGUF, with its own types (read
    from $TOYMLX_SHAPES_VOCAB where set)."""
    from user_paths import smollm_gguf

    with GGUFFile(os.environ.get(VOCAB_ENV) or smollm_gguf()) as g:
        return {k: (v, GGUFValueType(g.metadata_types[k][0]),
                    None if g.metadata_types[k][1] is None
                    else GGUFValueType(g.metadata_types[k][1]))
                for k, v in g.metadata.items() if k.startswith("tokenizer.")}


LLAMACPP_TREE_ENV = "TOYMLX_LLAMACPP_TREE"
"""llama.cpp's source tree (`vendor/llama.cpp` of the llama-cpp-python sdist) where set; else
the one tests/llamacpp_source.py unpacks into ~/.cache/toymlx for the installed version."""

QWEN3_ADDED = (
    "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>", "<|box_end|>",
    "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>",
    "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
    "<tool_response>", "</tool_response>", "<think>", "</think>")
"""Qwen3's added tokens from id 151646 on (its tokenizer.json); the `<|...|>` ones are special
(control), the tag ones are not (user-defined), as llama.cpp's converter types them."""


def llamacpp_tree() -> Path:
    """llama.cpp's source tree ($TOYMLX_LLAMACPP_TREE, else the tests' unpacked sdist)."""
    import importlib.metadata

    if os.environ.get(LLAMACPP_TREE_ENV):
        tree = Path(os.environ[LLAMACPP_TREE_ENV])
    else:
        version = importlib.metadata.version("llama_cpp_python")
        cache = Path(os.environ.get("TOYMLX_CACHE") or Path.home() / ".cache" / "toymlx")
        tree = cache / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
    if not (tree / "models" / "ggml-vocab-qwen2.gguf").is_file():
        raise FileNotFoundError(f"{tree}: expected llama.cpp's source tree with "
                                f"models/ggml-vocab-qwen2.gguf, found none (set "
                                f"${LLAMACPP_TREE_ENV} or run tests/test_chat_template.py once)")
    return tree


def qwen3_vocab() -> Typed:
    """Qwen3's tokenizer: llama.cpp's Qwen2 BPE vocabulary with Qwen3's added tokens, ids and
    real chat template."""
    return qwen_vocab("ggml-vocab-qwen2.gguf", "qwen2", "Qwen-Qwen3-0.6B.jinja", 151936)


def qwen35_vocab() -> Typed:
    """Qwen3.5's pre-tokenizer and chat template over llama.cpp's Qwen2 BPE vocabulary with
    Qwen3's added tokens (the ids the template's tokens take), padded to Qwen3.5's 248,320."""
    return qwen_vocab("ggml-vocab-qwen35.gguf", "qwen35", "Qwen3.5-4B.jinja", 248320)


def qwen_vocab(vocab: str, pre: str, template: str, size: int) -> Typed:
    """llama.cpp's `models/<vocab>` tokens and merges with Qwen3's added tokens written over the
    padding ids from 151646, user-defined `[PADn]` tokens up to `size`, Qwen3's ids (eos
    `<|im_end|>`, pad and bos `<|endoftext|>`, no bos added), pre-tokenizer `pre` and
    `models/templates/<template>`."""
    tree = llamacpp_tree()
    with GGUFFile(tree / "models" / vocab) as g:
        tokens = list(g.metadata["tokenizer.ggml.tokens"])
        types = list(g.metadata["tokenizer.ggml.token_type"])
        merges = list(g.metadata["tokenizer.ggml.merges"])
    first = 151646
    control, user_defined = 3, 4  # llama.cpp's token types
    for i, t in enumerate(QWEN3_ADDED):
        if tokens[first + i] != f"[PAD{first + i}]":
            raise ValueError(f"{vocab}: tokenizer.ggml.tokens[{first + i}]: "
                             f"expected [PAD{first + i}], found {tokens[first + i]!r}")
        tokens[first + i] = t
        types[first + i] = control if t.startswith("<|") else user_defined
    tokens += [f"[PAD{i}]" for i in range(len(tokens), size)]
    types += [user_defined] * (size - len(types))
    u32, arr = GGUFValueType.UINT32, GGUFValueType.ARRAY
    return {
        "tokenizer.ggml.model": ("gpt2", GGUFValueType.STRING, None),
        "tokenizer.ggml.pre": (pre, GGUFValueType.STRING, None),
        "tokenizer.ggml.tokens": (tokens, arr, GGUFValueType.STRING),
        "tokenizer.ggml.token_type": (types, arr, GGUFValueType.INT32),
        "tokenizer.ggml.merges": (merges, arr, GGUFValueType.STRING),
        "tokenizer.ggml.eos_token_id": (151645, u32, None),
        "tokenizer.ggml.padding_token_id": (151643, u32, None),
        "tokenizer.ggml.bos_token_id": (151643, u32, None),
        "tokenizer.ggml.add_bos_token": (False, GGUFValueType.BOOL, None),
        "tokenizer.chat_template": ((tree / "models" / "templates" / template).read_text(),
                                    GGUFValueType.STRING, None),
    }


def synthetic_spm(size: int) -> Typed:
    """A SentencePiece ("llama") vocabulary of `size` tokens: <unk>, <s>, </s>, Gemma's two
    turn markers, the 256 byte tokens, then every string over "▁a-z" by length (1, 2, ...),
    scored so that shorter strings merge first; a Gemma-style chat template."""
    unk, ctrl, normal, byte = 2, 3, 1, 6  # llama.cpp's token types
    tokens = ["<unk>", "<s>", "</s>", "<start_of_turn>", "<end_of_turn>"]
    types = [unk, ctrl, ctrl, ctrl, ctrl]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [byte] * 256
    alphabet = ["\u2581", *"abcdefghijklmnopqrstuvwxyz"]
    level = [""]
    while len(tokens) < size:
        level = [p + c for p in level for c in alphabet]
        take = level[: size - len(tokens)]
        tokens += take
        types += [normal] * len(take)
    scores = [0.0] * 261 + [-float(i) for i in range(size - 261)]
    return {
        "tokenizer.ggml.model": ("llama", GGUFValueType.STRING, None),
        "tokenizer.ggml.tokens": (tokens, GGUFValueType.ARRAY, GGUFValueType.STRING),
        "tokenizer.ggml.scores": (scores, GGUFValueType.ARRAY, GGUFValueType.FLOAT32),
        "tokenizer.ggml.token_type": (types, GGUFValueType.ARRAY, GGUFValueType.INT32),
        "tokenizer.ggml.bos_token_id": (1, GGUFValueType.UINT32, None),
        "tokenizer.ggml.eos_token_id": (2, GGUFValueType.UINT32, None),
        "tokenizer.ggml.unknown_token_id": (0, GGUFValueType.UINT32, None),
        "tokenizer.ggml.add_bos_token": (True, GGUFValueType.BOOL, None),
        "tokenizer.ggml.add_eos_token": (False, GGUFValueType.BOOL, None),
        "tokenizer.ggml.add_space_prefix": (False, GGUFValueType.BOOL, None),
        "tokenizer.chat_template": (GEMMA_TEMPLATE, GGUFValueType.STRING, None),
    }


def _model_metadata(a: LlamaArgs, name: str) -> Typed:
    """`llama_metadata` of the shape, typed (ints uint32, floats float32), F16 file type."""
    out: Typed = {}
    for k, v in llama_metadata(a, name).items():
        if k == "general.architecture":
            continue  # GGUFWriter writes it
        if k == "general.file_type":
            v = 1  # MOSTLY_F16
        if isinstance(v, list):  # gemma4's per-block pattern and widths, qwen35's
            # recurrent_layers and dimension_sections (llama.cpp reads INT32 and UINT32 alike)
            out[k] = (v, GGUFValueType.ARRAY, GGUFValueType.BOOL if v and isinstance(v[0], bool)
                      else GGUFValueType.INT32)
            continue
        vt = (GGUFValueType.STRING if isinstance(v, str) else GGUFValueType.FLOAT32
              if isinstance(v, float) else GGUFValueType.UINT32)
        out[k] = (v, vt, None)
    return out


# ---- writing -------------------------------------------------------------------------------
def write_vocab(path: Path) -> None:
    """A GGUF of SmolLM2's tokenizer.* keys alone, no tensors (for `VOCAB_ENV`)."""
    w = GGUFWriter(path, "llama")
    for k, (v, vt, et) in smollm2_vocab().items():
        w.add_key_value(k, v, vt, et)
    w.write_header_to_file(path)
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()


def write_f16(path: Path, a: LlamaArgs, meta: Typed, seed: int = 0,
              progress: Callable[[str], None] | None = None) -> None:
    """Stream an F16 GGUF of shape `a` to `path`: tensor infos, then each tensor's random data
    drawn and written one at a time (matrices F16 N(0, STD), vectors F32 `vector`; RoPE
    factors as `rope_freqs`)."""
    shapes = expected_shapes(a)
    if a.rope_factors is not None:
        shapes["rope_freqs.weight"] = (len(a.rope_factors),)
    w = GGUFWriter(path, a.arch)
    for k, (v, vt, et) in meta.items():
        w.add_key_value(k, v, vt, et)
    for name, shape in shapes.items():
        dt = np.float32 if len(shape) == 1 or name.endswith(F32_MATRICES) else np.float16
        w.add_tensor_info(name, shape, np.dtype(dt), int(np.prod(shape)) * np.dtype(dt).itemsize)
    w.write_header_to_file(path)
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for i, (name, shape) in enumerate(shapes.items()):
        if name == "rope_freqs.weight":
            w.write_tensor_data(np.array(a.rope_factors, np.float32))
            continue
        if len(shape) == 1:
            w.write_tensor_data(vector(name, shape, rng))
            continue
        t = np.empty(shape, np.float32 if name.endswith(F32_MATRICES) else np.float16)
        flat = t.reshape(-1, shape[-1])  # an expert tensor's (E, out, in) as E * out rows
        rows = max(1, CHUNK_VALUES // shape[-1])
        for r in range(0, flat.shape[0], rows):
            flat[r:r + rows] = rng.standard_normal((min(rows, flat.shape[0] - r), shape[-1]),
                                                   dtype=np.float32) * STD
        w.write_tensor_data(t)
        del t
        if progress and (i + 1) % 16 == 0:
            progress(f"{path.name}: {i + 1}/{len(shapes)} tensors")
    w.close()


def vector(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """A 1-D tensor's values: ones (norms, qwen35's dt bias as transformers initializes it),
    but qwen35's ssm_a, the decay rate -A with A ~ U(0.01, 16) as transformers initializes
    A_log (ones would make every linear block's state grow e-fold a token)."""
    if name.endswith(".ssm_a"):
        return -rng.uniform(0.01, 16, shape).astype(np.float32)
    return np.ones(shape, np.float32)


def shape_file(shape: str | Shape, cache: str | os.PathLike = DEFAULT_CACHE,
               progress: Callable[[str], None] | None = None) -> tuple[Path, dict[str, Any]]:
    """The Q4_K_M file of a shape (a name in SHAPES, or a Shape) in `cache`, written now unless
    already there; with what writing it took ({} when reused)."""
    if isinstance(shape, str):
        if shape not in SHAPES:
            raise ValueError(f"shape: expected one of {', '.join(SHAPES)}, found {shape!r}")
        shape = SHAPES[shape]
    name = shape.name
    cache = Path(cache)
    out = cache / f"{name}.{FILE_TYPE}.gguf"
    if out.is_file():
        return out, {}
    cache.mkdir(parents=True, exist_ok=True)
    atomic.remove_stale(out)  # the F16 and quantized temporaries of a writer that was killed
    t0 = time.perf_counter()
    vocabs = {"smollm2": smollm2_vocab, "qwen3": qwen3_vocab, "qwen35": qwen35_vocab,
              "synthetic": lambda: synthetic_spm(shape.args.vocab_size)}
    vocab = vocabs[shape.vocab]()
    n_tokens = len(vocab["tokenizer.ggml.tokens"][0])
    if n_tokens != shape.args.vocab_size:
        raise ValueError(f"{name}: tokenizer.ggml.tokens: expected {shape.args.vocab_size} "
                         f"tokens, found {n_tokens}")
    meta = {**_model_metadata(shape.args, f"{name} (random weights, toymlx benchmarks)"),
            **vocab}
    f16 = cache / f".{out.name}.f16{atomic.TMP_TAG}{os.getpid()}"
    try:
        write_f16(f16, shape.args, meta, progress=progress)
        f16_bytes = f16.stat().st_size
        t1 = time.perf_counter()
        if progress:  # the quantizer's minute (the 1B shape's: 64 s on 2 cores) is said too
            progress(f"{out.name}: quantizing the F16 to {FILE_TYPE.upper()} (llama.cpp's quantizer)")
        with atomic.atomic_path(out) as tmp:
            # its bar over the tensors where stderr is a terminal (a log gets the line above)
            llama_quantize(f16, tmp, FILE_TYPE, progress=bool(progress) and sys.stderr.isatty())
    finally:
        f16.unlink(missing_ok=True)
    t2 = time.perf_counter()
    # the quantizer runs in a child process (`llama_quantize`): its peak is the children's
    return out, {"f16_bytes": f16_bytes, "f16_seconds": round(t1 - t0, 1),
                 "quantize_seconds": round(t2 - t1, 1), "seconds": round(t2 - t0, 1),
                 "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
                 "quantizer_peak_rss_mb": round(
                     resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("names", nargs="*", help=f"some of {', '.join(SHAPES)}")
    p.add_argument("--cache", default=str(DEFAULT_CACHE), help="folder of the files")
    p.add_argument("--write-vocab", type=Path, metavar="GGUF",
                   help=f"write SmolLM2's tokenizer alone to GGUF (for ${VOCAB_ENV})")
    args = p.parse_args(argv)
    unknown = [n for n in args.names if n not in SHAPES]
    if unknown:
        p.error(f"names: expected some of {', '.join(SHAPES)}, found {unknown}")
    if not args.names and not args.write_vocab:  # nothing to do is no success
        p.error(f"names: expected some of {', '.join(SHAPES)} (or --write-vocab), found none")
    if args.write_vocab:
        write_vocab(args.write_vocab)
    for name in args.names:
        path, took = shape_file(name, args.cache,
                                progress=lambda s: print(s, file=sys.stderr, flush=True))
        print(json.dumps({"name": name, "path": str(path), "bytes": path.stat().st_size,
                          "written_now": bool(took), **took}), flush=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    raise SystemExit(main())
