"""The llama <-> GGUF name map and layout conventions, in one place.

toymlx parameter paths (`layers.3.attn.q_proj.weight`) map one-to-one onto llama.cpp's tensor
names (`blk.3.attn_q.weight`); both are stored `(out, in)`, and q/k keep GGUF's adjacent-pair
RoPE layout, so no tensor is ever permuted or split into heads.
"""

from __future__ import annotations

import math
import os
import re
from typing import Any

import numpy as np

from toymlx.gguf.reader import FLOAT32, UINT32, GGUFError, GGUFFile
from toymlx.gguf.writer import write_gguf
from toymlx.models.llama import Llama, LlamaArgs

CHECKPOINT_FORMAT = "toy/gguf-v1"

_GLOBAL = {"token_embd.weight": "embed.weight", "output_norm.weight": "norm.weight",
           "output.weight": "output.weight"}
_BLOCK = {"attn_norm": "attn_norm", "attn_q": "attn.q_proj", "attn_k": "attn.k_proj",
          "attn_v": "attn.v_proj", "attn_output": "attn.o_proj", "ffn_norm": "ffn_norm",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_BLOCK_INV = {v: k for k, v in _BLOCK.items()}
_GGUF_RE = re.compile(r"blk\.(\d+)\.(\w+)\.weight")
_TOY_RE = re.compile(r"layers\.(\d+)\.(.+)\.weight")


def gguf_to_toy(name: str) -> str | None:
    """toymlx parameter path for a llama.cpp tensor name (None if not a llama weight)."""
    if name in _GLOBAL:
        return _GLOBAL[name]
    m = _GGUF_RE.fullmatch(name)
    if m and m.group(2) in _BLOCK:
        return f"layers.{m.group(1)}.{_BLOCK[m.group(2)]}.weight"
    return None


def toy_to_gguf(path: str) -> str:
    """llama.cpp tensor name for a toymlx parameter path (LoRA wrappers' `.linear` dropped)."""
    path = path.replace(".linear.weight", ".weight")
    for g, t in _GLOBAL.items():
        if path == t:
            return g
    m = _TOY_RE.fullmatch(path)
    if m and m.group(2) in _BLOCK_INV:
        return f"blk.{m.group(1)}.{_BLOCK_INV[m.group(2)]}.weight"
    raise KeyError(f"no GGUF name for parameter {path!r}")


def args_from_gguf(g: GGUFFile) -> LlamaArgs:
    """LlamaArgs from a GGUF's `llama.*` keys, checked against its tensors."""
    arch = g.metadata.get("general.architecture")
    if arch != "llama":
        raise GGUFError(f"{g.path}: metadata key 'general.architecture': expected 'llama', "
                        f"found {arch!r}")
    k = "llama."
    d = g.get(k + "embedding_length", int)
    n_heads = g.get(k + "attention.head_count", int)
    n_kv = g.get(k + "attention.head_count_kv", int, n_heads)
    if n_heads <= 0 or d <= 0 or n_kv <= 0 or n_heads % n_kv:
        raise GGUFError(f"{g.path}: metadata key 'llama.attention.head_count_kv': expected a "
                        f"positive divisor of head_count={n_heads}, found {n_kv}")
    head_dim = g.get(k + "attention.key_length", int, d // n_heads)
    rope_dims = g.get(k + "rope.dimension_count", int, head_dim)
    if rope_dims != head_dim:
        raise GGUFError(f"{g.path}: metadata key 'llama.rope.dimension_count': expected "
                        f"{head_dim} (full-head RoPE), found {rope_dims}")
    if "token_embd.weight" not in g.tensors:
        raise GGUFError(f"{g.path}: tensor 'token_embd.weight': expected present, found missing")
    vocab = g.tensors["token_embd.weight"].shape[0]
    # Bound every size before it is used: a block count of 2**40 would otherwise spin in
    # expected_shapes, and MLX's RMSNorm rejects eps <= 0 with a message naming no file.
    n_layers = g.get(k + "block_count", int)
    most = len(g.tensors) // len(_BLOCK)
    if not 1 <= n_layers <= most:
        raise GGUFError(f"{g.path}: metadata key 'llama.block_count': expected 1..{most} "
                        f"({len(_BLOCK)} tensors per block, {len(g.tensors)} in the file), "
                        f"found {n_layers}")
    context = g.get(k + "context_length", int)
    rope_base = float(g.get(k + "rope.freq_base", (int, float), 10000.0))
    norm_eps = float(g.get(k + "attention.layer_norm_rms_epsilon", (int, float)))
    for key, v in (("context_length", context), ("rope.freq_base", rope_base),
                   ("attention.layer_norm_rms_epsilon", norm_eps)):
        if not (math.isfinite(v) and v > 0):
            raise GGUFError(f"{g.path}: metadata key 'llama.{key}': expected a finite value "
                            f"> 0, found {v!r}")
    args = LlamaArgs(
        vocab_size=vocab, d_model=d, n_layers=n_layers,
        n_heads=n_heads, n_kv_heads=n_kv, ffn_dim=g.get(k + "feed_forward_length", int),
        context=context, rope_base=rope_base, norm_eps=norm_eps,
        tie_embeddings="output.weight" not in g.tensors,
        head_dim=None if head_dim == d // n_heads else head_dim)
    try:
        args.validate()
    except ValueError as e:
        raise GGUFError(f"{g.path}: {e}") from None
    check_shapes(g, args)
    return args


def expected_shapes(a: LlamaArgs) -> dict[str, tuple[int, ...]]:
    """Every llama.cpp tensor name this shape needs, with its numpy (out, in) shape."""
    q, kv = a.n_heads * a.hd, a.n_kv_heads * a.hd
    shapes = {"token_embd.weight": (a.vocab_size, a.d_model), "output_norm.weight": (a.d_model,)}
    if not a.tie_embeddings:
        shapes["output.weight"] = (a.vocab_size, a.d_model)
    per = {"attn_norm": (a.d_model,), "attn_q": (q, a.d_model), "attn_k": (kv, a.d_model),
           "attn_v": (kv, a.d_model), "attn_output": (a.d_model, q), "ffn_norm": (a.d_model,),
           "ffn_gate": (a.ffn_dim, a.d_model), "ffn_up": (a.ffn_dim, a.d_model),
           "ffn_down": (a.d_model, a.ffn_dim)}
    for i in range(a.n_layers):
        for n, s in per.items():
            shapes[f"blk.{i}.{n}.weight"] = s
    return shapes


def check_shapes(g: GGUFFile, a: LlamaArgs) -> None:
    for name, shape in expected_shapes(a).items():
        if name not in g.tensors:
            raise GGUFError(f"{g.path}: tensor {name!r}: expected present with shape {shape}, "
                            "found missing")
        found = g.tensors[name].shape
        if tuple(found) != shape:
            raise GGUFError(f"{g.path}: tensor {name!r} shape: expected {shape} from the "
                            f"llama.* hyperparameters, found {tuple(found)}")


def load_llama(path: str | os.PathLike, dtype=np.float32) -> tuple[Llama, GGUFFile]:
    """A Llama with the weights of a llama-architecture GGUF (any type gguf-py decodes)."""
    import mlx.core as mx

    g = GGUFFile(path)
    args = args_from_gguf(g)
    model = Llama(args)
    weights = []
    for n in expected_shapes(args):
        weights.append((gguf_to_toy(n), mx.array(g.load(n, dtype))))  # a copy, made now
        g.release(n)  # so the mapping's pages of it leave this process's memory
    model.load_weights(weights, strict=True)
    mx.eval(model.parameters())
    return model, g


def llama_metadata(a: LlamaArgs, name: str = "toymlx") -> dict[str, Any]:
    """The general.* and llama.* keys llama.cpp needs for this shape."""
    return {
        "general.architecture": "llama",
        "general.name": name,
        "general.file_type": 0,  # all F32
        "llama.vocab_size": a.vocab_size,
        "llama.context_length": a.context,
        "llama.embedding_length": a.d_model,
        "llama.block_count": a.n_layers,
        "llama.feed_forward_length": a.ffn_dim,
        "llama.attention.head_count": a.n_heads,
        "llama.attention.head_count_kv": a.n_kv_heads,
        "llama.attention.key_length": a.hd,
        "llama.attention.value_length": a.hd,
        "llama.rope.dimension_count": a.hd,
        "llama.rope.freq_base": float(a.rope_base),
        "llama.attention.layer_norm_rms_epsilon": float(a.norm_eps),
    }


LLAMA_TYPES = {k: (FLOAT32, None) for k in ("llama.rope.freq_base",
                                             "llama.attention.layer_norm_rms_epsilon")}
LLAMA_TYPES["general.file_type"] = (UINT32, None)


def llama_tensors(model: Llama, params: dict[str, Any] | None = None) -> dict[str, np.ndarray]:
    """llama.cpp-named float32 numpy tensors of a Llama (base weights only, no LoRA)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    flat = params if params is not None else dict(tree_flatten(model.parameters()))
    out = {}
    for name in expected_shapes(model.args):
        key = gguf_to_toy(name)
        w = flat.get(key)
        if w is None:  # a LoRA-wrapped projection keeps its base weight under `.linear`
            w = flat[key.replace(".weight", ".linear.weight")]
        out[name] = np.asarray(w.astype(mx.float32))
    return out


def write_llama(path: str | os.PathLike, model: Llama, tokenizer_meta: dict[str, Any],
                extra: dict[str, Any] | None = None, name: str = "toymlx",
                tensors: dict[str, np.ndarray] | None = None) -> None:
    """Write a llama.cpp-loadable F32 GGUF of `model` (tied models get no output.weight)."""
    tensors = tensors if tensors is not None else llama_tensors(model)
    meta = llama_metadata(model.args, name)
    meta.update(tokenizer_meta)
    meta["toy.checkpoint_format"] = CHECKPOINT_FORMAT
    meta["toy.n_params_written"] = int(sum(t.size for t in tensors.values()))
    meta.update(extra or {})
    write_gguf(path, meta, tensors, types=LLAMA_TYPES)
