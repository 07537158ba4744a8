"""The ViT <-> GGUF name map and metadata (`general.architecture = "vit"`), in one place.

Tensor names (numpy shapes, `(out, in)` for linears):

| GGUF name | toymlx path | shape |
| --- | --- | --- |
| `patch_embd.weight`, `.bias` | `patch_embed` | (D, p*p*C) over patch pixels flattened (ph, pw, c); (D,) |
| `cls_token` | `cls_token` | (D,) |
| `pos_embd` | `pos_embed` | (1+N, D), row 0 is the class token |
| `blk.i.attn_norm.{weight,bias}` | `layers.i.attn_norm` | (D,) |
| `blk.i.attn_{q,k,v,output}.{weight,bias}` | `layers.i.attn.{q,k,v,o}_proj` | (D, D), (D,) |
| `blk.i.ffn_norm.{weight,bias}` | `layers.i.ffn_norm` | (D,) |
| `blk.i.ffn_up.{weight,bias}` | `layers.i.mlp.up_proj` | (F, D), (F,) |
| `blk.i.ffn_down.{weight,bias}` | `layers.i.mlp.down_proj` | (D, F), (D,) |
| `output_norm.{weight,bias}` | `norm` | (D,) |
| `output.{weight,bias}` | `head` | (classes, D), (classes,) |

Input normalisation (per-channel mean/std after scaling pixels by `toy.pixel_scale`) is stored
as `toy.pixel_mean` / `toy.pixel_std`, and the class names by index as `toy.class_names`, so a
checkpoint classifies raw images on its own.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from toymlx.gguf.reader import FLOAT32, GGUFError, GGUFFile
from toymlx.gguf.writer import FILE_TYPE, encode_tensor, write_gguf
from toymlx.models.ops import EXACT, Ops
from toymlx.models.vit import ViT, ViTArgs

CHECKPOINT_FORMAT = "toy/gguf-vit-v1"
_GLOBAL = {"patch_embd": "patch_embed", "output_norm": "norm", "output": "head"}
_BLOCK = {"attn_norm": "attn_norm", "attn_q": "attn.q_proj", "attn_k": "attn.k_proj",
          "attn_v": "attn.v_proj", "attn_output": "attn.o_proj", "ffn_norm": "ffn_norm",
          "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_BLOCK_INV = {v: k for k, v in _BLOCK.items()}
_GLOBAL_INV = {v: k for k, v in _GLOBAL.items()}


def toy_to_gguf(path: str) -> str:
    if path == "cls_token":
        return "cls_token"
    if path == "pos_embed":
        return "pos_embd"
    mod, leaf = path.rsplit(".", 1)
    if mod in _GLOBAL_INV:
        return f"{_GLOBAL_INV[mod]}.{leaf}"
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", mod)
    if m and m.group(2) in _BLOCK_INV:
        return f"blk.{m.group(1)}.{_BLOCK_INV[m.group(2)]}.{leaf}"
    raise KeyError(f"no GGUF name for ViT parameter {path!r}")


def vit_metadata(a: ViTArgs) -> dict[str, Any]:
    return {
        "general.architecture": "vit",
        "vit.image_size": a.image_size, "vit.patch_size": a.patch_size,
        "vit.channels": a.channels, "vit.embedding_length": a.d_model,
        "vit.block_count": a.n_layers, "vit.attention.head_count": a.n_heads,
        "vit.feed_forward_length": a.ffn_dim, "vit.class_count": a.num_classes,
        "vit.attention.layer_norm_epsilon": float(a.norm_eps), "vit.gelu": a.gelu,
    }


def write_vit(path: str | os.PathLike, model: ViT, norm: dict[str, Any],
              extra: dict[str, Any] | None = None, name: str = "toymlx vit",
              class_names: list[str] | None = None, dtype: str = "f32") -> None:
    """A GGUF of the ViT with its input normalisation and class names, its matrices as `dtype`
    (f32, f16, bf16; 1-D tensors stay F32)."""
    tensors = {toy_to_gguf(k): np.asarray(v.astype(mx.float32))
               for k, v in tree_flatten(model.parameters())}
    meta = {**vit_metadata(model.args), "general.name": name, **norm,
            "general.file_type": FILE_TYPE[dtype], "toy.checkpoint_format": CHECKPOINT_FORMAT,
            "toy.n_params_written": int(sum(t.size for t in tensors.values())), **(extra or {})}
    if class_names:
        if len(class_names) != model.args.num_classes:
            raise ValueError(f"class_names: expected {model.args.num_classes} (the head's rows), "
                             f"found {len(class_names)}")
        meta["toy.class_names"] = [str(n) for n in class_names]
    types = {k: (FLOAT32, None) for k in ("vit.attention.layer_norm_epsilon", "toy.pixel_scale")}
    write_gguf(path, meta, {n: encode_tensor(n, t, dtype) for n, t in tensors.items()},
               types=types)


def args_from_gguf(g: GGUFFile) -> ViTArgs:
    arch = g.metadata.get("general.architecture")
    if arch != "vit":
        raise GGUFError(f"{g.path}: metadata key 'general.architecture': expected 'vit', "
                        f"found {arch!r}")
    k = "vit."
    args = ViTArgs(
        image_size=g.get(k + "image_size", int), patch_size=g.get(k + "patch_size", int),
        channels=g.get(k + "channels", int), d_model=g.get(k + "embedding_length", int),
        n_layers=g.get(k + "block_count", int), n_heads=g.get(k + "attention.head_count", int),
        ffn_dim=g.get(k + "feed_forward_length", int), num_classes=g.get(k + "class_count", int),
        norm_eps=float(g.get(k + "attention.layer_norm_epsilon", (int, float))),
        gelu=g.get(k + "gelu", str, "erf"))
    try:
        args.validate()
    except ValueError as e:
        raise GGUFError(f"{g.path}: {e}") from None
    return args


def load_vit(path: str | os.PathLike, ops: Ops = EXACT) -> tuple[ViT, dict[str, Any], GGUFFile]:
    """(model computing with `ops`, normalisation dict, file) from a toymlx ViT checkpoint;
    shapes checked."""
    g = GGUFFile(path)
    g.verify_digest()  # a damaged toymlx checkpoint is named here, not found in the logits
    args = args_from_gguf(g)
    model = ViT(args, ops)
    weights = []
    for k, v in tree_flatten(model.parameters()):
        name = toy_to_gguf(k)
        if name not in g.tensors:
            raise GGUFError(f"{g.path}: tensor {name!r}: expected present with shape "
                            f"{tuple(v.shape)}, found missing")
        if tuple(g.tensors[name].shape) != tuple(v.shape):
            raise GGUFError(f"{g.path}: tensor {name!r} shape: expected {tuple(v.shape)} from "
                            f"the vit.* hyperparameters, found {g.tensors[name].shape}")
        weights.append((k, mx.array(g.load(name))))
    model.load_weights(weights, strict=True)
    norm = {k: g.metadata[k] for k in ("toy.pixel_scale", "toy.pixel_mean", "toy.pixel_std")
            if k in g.metadata}
    return model, norm, g


def class_names_sha256(names: list[str]) -> str:
    """The SHA-256 of a whole list of class names (as JSON, UTF-8): what run_start records
    beside the first `RECORDED_CLASS_NAMES` of them, so a reader can compare a long list."""
    return hashlib.sha256(json.dumps(list(names), ensure_ascii=False).encode()).hexdigest()


# class names run_start records one by one (the rest by count and `class_names_sha256`)
RECORDED_CLASS_NAMES = 100


def class_names(g: GGUFFile) -> list[str]:
    """The checkpoint's class names by index (`toy.class_names`; "0", "1", ... without them)."""
    n = g.get("vit.class_count", int)
    names = g.metadata.get("toy.class_names")
    if names is None:
        return [str(i) for i in range(n)]
    if not isinstance(names, list) or len(names) != n or not all(isinstance(s, str) for s in names):
        found = f"{len(names)} items" if isinstance(names, list) else type(names).__name__
        raise GGUFError(f"{g.path}: metadata key 'toy.class_names': expected {n} strings (one per "
                        f"class), found {found}")
    return names
