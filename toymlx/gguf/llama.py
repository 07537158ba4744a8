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

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from toymlx.gguf.quant import GROUP_SIZE, gguf_to_mlx_quant
from toymlx.gguf.reader import FLOAT32, UINT32, GGUFError, GGUFFile
from toymlx.gguf.writer import FILE_TYPE, encode_tensor, write_gguf
from toymlx.models.layers import QuantizedLinear, replace_submodule
from toymlx.models.llama import Llama, LlamaArgs
from toymlx.models.ops import DTYPES, EXACT, Ops

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
        key_length=None if head_dim == d // n_heads else head_dim)
    try:
        args.validate()
    except ValueError as e:
        raise GGUFError(f"{g.path}: {e}") from None
    check_shapes(g, args)
    return args


def expected_shapes(a: LlamaArgs) -> dict[str, tuple[int, ...]]:
    """Every llama.cpp tensor name this shape needs, with its numpy (out, in) shape."""
    q, kv = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
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


WEIGHTS = ("float32", "bfloat16", "float16", "quantized")
"""How a loaded model holds its weights: a float dtype (exact dequantisation, then rounded to
it), or "quantized" (Q4_0/Q4_1/Q8_0 projections kept as the file's own blocks; see
`toymlx.gguf.quant`)."""


def load_llama(path: str | os.PathLike, ops: Ops = EXACT, weights: str = "float32"
               ) -> tuple[Llama, GGUFFile]:
    """A Llama that computes with `ops`, holding a llama GGUF's weights as `weights` (any
    tensor type gguf-py decodes). The one GGUF-to-Llama loader: every recipe, generation,
    evaluation and export go through it (or through `load_llama_weights`)."""
    g = GGUFFile(path)
    g.verify_digest()  # a damaged toymlx checkpoint is named here, not found in the logits
    model = Llama(args_from_gguf(g), ops)  # its random init is lazy, and replaced unevaluated
    load_llama_weights(g, model, weights)
    return model, g


def load_llama_weights(g: GGUFFile, model: Llama, weights: str = "float32",
                       skip: tuple[str, ...] = ()) -> None:
    """Copy the file's tensors (all but `skip`) into `model`, shapes checked against its args.

    Each tensor's pages of the file mapping are dropped once MLX holds its copy, so the peak
    is the model plus one tensor, not the model twice (mapping + copy). Norms stay float32;
    with "quantized" the other non-projection weights take the model's compute dtype."""
    if weights not in WEIGHTS:
        raise ValueError(f"weights: expected one of {', '.join(WEIGHTS)}, found {weights!r}")
    check_shapes(g, model.args)
    dtype = DTYPES[model.ops.dtype if weights == "quantized" else weights]
    loaded = []
    for name in expected_shapes(model.args):
        if name in skip:
            continue
        key = gguf_to_toy(name)
        if weights == "quantized" and name.startswith("blk.") and len(g.tensors[name].shape) == 2:
            replace_submodule(model, key[: -len(".weight")], _quantized_linear(g, name, model.ops))
        else:
            want = mx.float32 if name.endswith("norm.weight") else dtype
            w = mx.array(g.load(name, np.float16 if want == mx.float16 else np.float32))
            w = w if w.dtype == want else w.astype(want)
            mx.eval(w)  # the copy made now, so the mapping's pages can go
            loaded.append((key, w))
        g.release(name)
    model.load_weights(loaded, strict=False)  # every shape was checked by check_shapes
    mx.eval(model.parameters())


def load_llama_into(path: str | os.PathLike, model: Llama) -> None:
    """Resume: a llama GGUF's weights into an existing model of the same shape (float32)."""
    with GGUFFile(path) as g:
        load_llama_weights(g, model)


def _quantized_linear(g: GGUFFile, name: str, ops: Ops) -> QuantizedLinear:
    """A frozen quantized projection holding tensor `name`'s own Q4_0/Q4_1/Q8_0 blocks."""
    w, scales, biases, bits = gguf_to_mlx_quant(g, name)
    n_out, n_in = g.tensors[name].shape
    q = QuantizedLinear(n_in, n_out, bias=False, group_size=GROUP_SIZE, bits=bits, ops=ops)
    q.weight, q.scales, q.biases = mx.array(w), mx.array(scales), mx.array(biases)
    mx.eval(q.parameters())
    return q


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
        "llama.attention.key_length": a.head_dim,
        "llama.attention.value_length": a.head_dim,
        "llama.rope.dimension_count": a.head_dim,
        "llama.rope.freq_base": float(a.rope_base),
        "llama.attention.layer_norm_rms_epsilon": float(a.norm_eps),
    }


LLAMA_TYPES = {k: (FLOAT32, None) for k in ("llama.rope.freq_base",
                                             "llama.attention.layer_norm_rms_epsilon")}
LLAMA_TYPES["general.file_type"] = (UINT32, None)


def llama_tensors(model: Llama, params: dict[str, Any] | None = None) -> dict[str, np.ndarray]:
    """llama.cpp-named float32 numpy tensors of a Llama (base weights only, no LoRA)."""
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
                tensors: dict[str, np.ndarray] | None = None, dtype: str = "f32") -> None:
    """Write a llama.cpp-loadable GGUF of `model`, its matrices as `dtype` (f32, f16, bf16; norms
    stay F32); tied models get no output.weight."""
    tensors = tensors if tensors is not None else llama_tensors(model)
    meta = llama_metadata(model.args, name)
    meta.update(tokenizer_meta)
    meta["general.file_type"] = FILE_TYPE[dtype]
    meta["toy.checkpoint_format"] = CHECKPOINT_FORMAT
    meta["toy.n_params_written"] = int(sum(t.size for t in tensors.values()))
    meta.update(extra or {})
    write_gguf(path, meta, {n: encode_tensor(n, t, dtype) for n, t in tensors.items()},
               types=LLAMA_TYPES)
