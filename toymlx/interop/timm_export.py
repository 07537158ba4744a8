"""A toymlx ViT as a timm `vit_tiny_patch16_224` state dict in safetensors, with its config.

| timm name | toymlx path | how |
| --- | --- | --- |
| `patch_embed.proj.weight` | `patch_embed.weight` (D, p*p*C) over (ph, pw, c) | reshape (D, p, p, C), transpose to the conv's (D, C, p, p) |
| `patch_embed.proj.bias` | `patch_embed.bias` | as is |
| `cls_token` | `cls_token` (D,) | (1, 1, D) |
| `pos_embed` | `pos_embed` (1+N, D) | (1, 1+N, D) |
| `blocks.i.norm1`, `.norm2` | `layers.i.attn_norm`, `.ffn_norm` | as is |
| `blocks.i.attn.qkv` | `layers.i.attn.{q,k,v}_proj` | rows concatenated q, k, v: (3D, D) |
| `blocks.i.attn.proj` | `layers.i.attn.o_proj` | as is |
| `blocks.i.mlp.fc1`, `.fc2` | `layers.i.mlp.up_proj`, `.down_proj` | as is |
| `norm`, `head` | `norm`, `head` | as is |

timm's model is then `timm.create_model("vit_tiny_patch16_224", **model_args)` with
`model_args = {num_classes, img_size, patch_size, in_chans}` (plus `embed_dim`, `depth`,
`num_heads`, `mlp_ratio`, `act_layer` where the model differs from ViT-Tiny's), and
`load_state_dict` takes the file as it is (strict). Inputs: timm takes NCHW float tensors; a
toymlx checkpoint's images are standardised as `(pixels / 255 - mean) / std` per channel
(`pretrained_cfg.mean` / `std` in config.json, the same numbers as the checkpoint's
`toy.pixel_mean` / `toy.pixel_std`), which is exactly timm's `ToTensor()` + `Normalize(mean,
std)` on 8-bit images.

Written to a folder: `model.safetensors` and `config.json` in the layout timm reads from the
Hugging Face hub or a local folder (`timm.create_model("local-dir:<folder>", pretrained=True)`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from toymlx.backend.atomic import atomic_open, discard, output_folder, room_for, write_text
from toymlx.models.vit import ViT, ViTArgs

TIMM_ARCH = "vit_tiny_patch16_224"
_TINY = {"embed_dim": 192, "depth": 12, "num_heads": 3, "mlp_ratio": 4.0}
_ACT = {"erf": None, "tanh": "gelu_tanh", "fast": "quick_gelu"}  # timm's names for toymlx's GELUs


def timm_model_args(a: ViTArgs) -> dict[str, Any]:
    """The `timm.create_model(TIMM_ARCH, **kwargs)` that builds this shape."""
    out: dict[str, Any] = {"num_classes": a.num_classes, "img_size": a.image_size,
                           "patch_size": a.patch_size, "in_chans": a.channels}
    shape = {"embed_dim": a.d_model, "depth": a.n_layers, "num_heads": a.n_heads,
             "mlp_ratio": a.ffn_dim / a.d_model}
    out.update({k: v for k, v in shape.items() if v != _TINY[k]})
    if _ACT[a.gelu]:
        out["act_layer"] = _ACT[a.gelu]
    return out


def timm_state_dict(model: ViT) -> dict[str, np.ndarray]:
    """timm's parameter names and layouts (float32 numpy) for a toymlx ViT."""
    a = model.args
    p = {k: np.asarray(v.astype(mx.float32)) for k, v in tree_flatten(model.parameters())}
    d, ps, c = a.d_model, a.patch_size, a.channels
    out = {
        "cls_token": p["cls_token"].reshape(1, 1, d),
        "pos_embed": p["pos_embed"][None],  # (1, 1+N, D)
        # (D, ph*pw*C) -> (D, ph, pw, C) -> conv (D, C, ph, pw)
        "patch_embed.proj.weight": p["patch_embed.weight"].reshape(d, ps, ps, c)
        .transpose(0, 3, 1, 2),
        "patch_embed.proj.bias": p["patch_embed.bias"],
    }
    for i in range(a.n_layers):
        t, s = f"blocks.{i}.", f"layers.{i}."
        for leaf in ("weight", "bias"):
            out[t + f"norm1.{leaf}"] = p[s + f"attn_norm.{leaf}"]
            out[t + f"attn.qkv.{leaf}"] = np.concatenate(
                [p[s + f"attn.{n}_proj.{leaf}"] for n in "qkv"])  # (3D, D) / (3D,)
            out[t + f"attn.proj.{leaf}"] = p[s + f"attn.o_proj.{leaf}"]
            out[t + f"norm2.{leaf}"] = p[s + f"ffn_norm.{leaf}"]
            out[t + f"mlp.fc1.{leaf}"] = p[s + f"mlp.up_proj.{leaf}"]
            out[t + f"mlp.fc2.{leaf}"] = p[s + f"mlp.down_proj.{leaf}"]
    for leaf in ("weight", "bias"):
        out[f"norm.{leaf}"] = p[f"norm.{leaf}"]
        out[f"head.{leaf}"] = p[f"head.{leaf}"]
    return {k: np.ascontiguousarray(v, np.float32) for k, v in out.items()}


CLASS_MAP = "class_map.txt"
"""The class names one a line, in the model's order, as timm's `class_map` (`create_dataset`,
train.py's `--class-map`) reads them: timm's folder reader numbers class folders in natural
order (class2 before class10), toymlx in torchvision's (class10 before class2), so without it
timm scored a model of numbered folders against other classes' labels."""


def timm_config(a: ViTArgs, norm: dict[str, Any], class_names: list[str]) -> dict[str, Any]:
    """config.json as timm's hub export writes it (architecture, model_args, pretrained_cfg)."""
    scale = float(norm.get("toy.pixel_scale", 255.0))
    return {
        "architecture": TIMM_ARCH,
        "num_classes": a.num_classes,
        "num_features": a.d_model,
        "global_pool": "token",
        "model_args": timm_model_args(a),
        "label_names": list(class_names),
        "pretrained_cfg": {
            "input_size": [a.channels, a.image_size, a.image_size],
            "fixed_input_size": True,
            "interpolation": "bicubic",
            "crop_pct": 1.0,
            "crop_mode": "center",
            "mean": [float(v) for v in norm.get("toy.pixel_mean", [0.0] * a.channels)],
            "std": [float(v) for v in norm.get("toy.pixel_std", [1.0] * a.channels)],
            "num_classes": a.num_classes,
            "first_conv": "patch_embed.proj",
            "classifier": "head",
        },
        # toymlx scaled its training pixels by this before the mean/std (255 for 8-bit images;
        # 16 for the UCI digits, whose values are 0..16); timm ignores keys it does not know here
        "toymlx": {"pixel_scale": scale},
    }


def write_safetensors(path: Path, tensors: dict[str, np.ndarray],
                      metadata: dict[str, str]) -> None:
    """A safetensors file (F32 tensors, string metadata), written atomically; a full disk's
    error says what its tensors take against what is free (`room_for`)."""
    with room_for(sum(4 * np.size(v) for v in tensors.values())), atomic_open(path) as f:
        mx.save_safetensors(f, {k: mx.array(v, dtype=mx.float32) for k, v in tensors.items()},
                            metadata=metadata)


def export_timm(out: str | os.PathLike, model: ViT, norm: dict[str, Any],
                class_names: list[str]) -> list[Path]:
    """Write `out` (a .safetensors file) or `out/model.safetensors` + `out/config.json` (a
    folder, timm's hub layout); returns the files written. A failed write leaves nothing it
    wrote, nor a folder it made."""
    out = Path(out)
    cfg = timm_config(model.args, norm, class_names)
    meta = {"format": "pt", "timm_architecture": TIMM_ARCH,
            "timm_model_args": json.dumps(cfg["model_args"]),
            "pretrained_cfg": json.dumps(cfg["pretrained_cfg"]),
            "label_names": json.dumps(cfg["label_names"])}
    tensors = timm_state_dict(model)
    if out.suffix == ".safetensors":
        with output_folder(out.parent):  # a failed write leaves no empty folder it made
            write_safetensors(out, tensors, meta)
        return [out]
    with output_folder(out):  # a failed write leaves no empty folder it made
        write_safetensors(out / "model.safetensors", tensors, meta)
        try:
            write_text(out / "config.json", json.dumps(cfg, indent=2) + "\n")
            write_text(out / CLASS_MAP, "".join(f"{n}\n" for n in class_names))
        except BaseException:  # all or nothing: no weights left without the config they need
            discard(out / "model.safetensors")
            discard(out / "config.json")
            raise
    return [out / "model.safetensors", out / "config.json", out / CLASS_MAP]
