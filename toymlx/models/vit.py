"""Vision Transformer (ViT, Dosovitskiy et al. 2020) in mlx.nn, shaped like timm's.

Images come in channels-last, `(B, H, W, C)` float32. The patch embedding is a reshape plus a
Linear whose weight is `(d_model, patch * patch * channels)`, flattened in `(ph, pw, c)` order.
That is exactly MLX's `nn.Conv2d` weight `(d_model, ph, pw, c)` reshaped to 2-D, and a timm/PyTorch
conv weight `(d_model, c, ph, pw)` after `.transpose(0, 2, 3, 1).reshape(d_model, -1)`.

Parameter names map one-to-one onto the CLIP-style vision names in gguf-py (`v.` prefix):
`patch_embed` -> `patch_embd`, `cls_token` (d,) -> `class_embd`, `pos_embed` (1+N, d) ->
`position_embd`, `layers.N` -> `blk.N`, `attn_norm` -> `ln1`, `attn.{q,k,v,o}_proj` ->
`attn_{q,k,v,out}`, `ffn_norm` -> `ln2`, `mlp.{up,down}_proj` -> `ffn_{up,down}`,
`norm` -> `post_ln`; `head` is the classifier. timm's fused `qkv` weight `(3d, d)` splits
into q, k, v in that order.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import mlx.core as mx
from mlx import nn
from mlx.utils import tree_flatten, tree_unflatten

from toymlx.models.checks import ArgsError
from toymlx.models.layers import DropPath, LayerNorm, Linear
from toymlx.models.ops import EXACT, Ops

GELU_FORMS = ("erf", "tanh", "fast")


@dataclass(frozen=True)
class ViTArgs:
    image_size: int = 28
    """Height and width of the (square) input images, in pixels."""
    patch_size: int = 4
    """Side of the square patches; must divide image_size."""
    channels: int = 1
    """Colour channels of the input (1 for grey, 3 for RGB)."""
    d_model: int = 192
    """Token width."""
    n_layers: int = 12
    """Number of transformer blocks."""
    n_heads: int = 3
    """Attention heads; must divide d_model."""
    ffn_dim: int = 768
    """Hidden width of each block's GELU MLP (timm: mlp_ratio * d_model)."""
    num_classes: int = 10
    """Number of output classes (rows of the head)."""
    norm_eps: float = 1e-6
    """LayerNorm epsilon (timm uses 1e-6)."""
    gelu: str = "erf"
    """MLP activation: "erf" (exact, as timm), "tanh" or "fast" (x*sigmoid(1.702x), about 2x
    faster on MLX's Linux CPU but a different function: keep "erf" for timm weights)."""
    drop_path: float = 0.0
    """Stochastic depth in training: block i drops its residual branches per image with
    probability drop_path * i / (n_layers - 1), as timm's drop_path_rate (0: off)."""

    @property
    def n_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def validate(self) -> None:
        """Raise ArgsError (a ValueError) naming the field when the shape is inconsistent."""
        for name in ("image_size", "patch_size", "channels", "d_model", "n_layers", "n_heads",
                     "ffn_dim", "num_classes"):
            if getattr(self, name) <= 0:
                raise ArgsError(self, name, "> 0")
        if self.image_size % self.patch_size:
            raise ArgsError(self, "patch_size", "a divisor of {image_size}",
                            alt=("image_size", "a multiple of {patch_size}"))
        if self.d_model % self.n_heads:
            raise ArgsError(self, "d_model", "a multiple of {n_heads}",
                            alt=("n_heads", "a divisor of {d_model}"))
        if not 0.0 <= self.drop_path < 1.0:
            raise ArgsError(self, "drop_path", "in [0, 1)")
        if self.gelu not in GELU_FORMS:
            raise ArgsError(self, "gelu", f"one of {', '.join(GELU_FORMS)}", repr(self.gelu))


def vit_tiny(**kw) -> ViTArgs:
    """timm `vit_tiny_patch16_224`: 224x224 RGB, 16x16 patches, 1000 classes (5,717,416 params)."""
    base = ViTArgs(image_size=224, patch_size=16, channels=3, num_classes=1000)
    return replace(base, **kw)


def vit_tiny_28(**kw) -> ViTArgs:
    """The Tiny body on 28x28 grey images (MNIST, Fashion-MNIST): 4x4 patches, 49 tokens + cls."""
    return replace(ViTArgs(image_size=28, patch_size=4, channels=1, num_classes=10), **kw)


def vit_tiny_8(**kw) -> ViTArgs:
    """The Tiny body on 8x8 grey images (UCI digits): 2x2 patches, 16 tokens + cls."""
    return replace(ViTArgs(image_size=8, patch_size=2, channels=1, num_classes=10), **kw)


PRESETS = {"vit-tiny": vit_tiny, "vit-tiny-28": vit_tiny_28, "vit-tiny-8": vit_tiny_8}


class Attention(nn.Module):
    def __init__(self, a: ViTArgs, ops: Ops):
        super().__init__()
        self.ops = ops
        self.n_heads, self.head_dim = a.n_heads, a.head_dim
        self.scale = a.head_dim ** -0.5
        self.q_proj = Linear(a.d_model, a.d_model, ops=ops)
        self.k_proj = Linear(a.d_model, a.d_model, ops=ops)
        self.v_proj = Linear(a.d_model, a.d_model, ops=ops)
        self.o_proj = Linear(a.d_model, a.d_model, ops=ops)

    def __call__(self, x: mx.array) -> mx.array:
        B, T, _ = x.shape
        H, ops = self.n_heads, self.ops
        q = ops.heads(x, self.q_proj.weight, self.q_proj.bias, H, self.scale)  # (B,H,T,hd)
        k = ops.heads(x, self.k_proj.weight, self.k_proj.bias, H)  # (B,H,T,hd)
        v = ops.heads(x, self.v_proj.weight, self.v_proj.bias, H)  # (B,H,T,hd)
        o = ops.attention(q, k, v, 1.0, causal=False)  # (B,H,T,hd), q already scaled
        o = o.transpose(0, 2, 1, 3).reshape(B, T, -1)  # (B,T,D)
        return self.o_proj(o)


class MLP(nn.Module):
    def __init__(self, a: ViTArgs, ops: Ops):
        super().__init__()
        self.ops, self.gelu = ops, a.gelu
        self.up_proj = Linear(a.d_model, a.ffn_dim, ops=ops)
        self.down_proj = Linear(a.ffn_dim, a.d_model, ops=ops)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(self.ops.gelu(self.up_proj(x), self.gelu))


class Block(nn.Module):
    def __init__(self, a: ViTArgs, ops: Ops, drop_path: float = 0.0):
        super().__init__()
        self.attn_norm = LayerNorm(a.d_model, eps=a.norm_eps, ops=ops)
        self.attn = Attention(a, ops)
        self.ffn_norm = LayerNorm(a.d_model, eps=a.norm_eps, ops=ops)
        self.mlp = MLP(a, ops)
        self.drop_path = DropPath(drop_path)

    def __call__(self, x: mx.array) -> mx.array:
        x = x + self.drop_path(self.attn(self.attn_norm(x)))
        return x + self.drop_path(self.mlp(self.ffn_norm(x)))


class ViT(nn.Module):
    def __init__(self, args: ViTArgs, ops: Ops = EXACT):
        super().__init__()
        args.validate()
        self.args, self.ops = args, ops
        a = args
        self.patch_embed = Linear(a.patch_size * a.patch_size * a.channels, a.d_model, ops=ops)
        self.cls_token = mx.zeros((a.d_model,))
        self.pos_embed = mx.zeros((1 + a.n_patches, a.d_model))
        self.layers = [Block(a, ops, a.drop_path * i / max(a.n_layers - 1, 1))
                       for i in range(a.n_layers)]
        self.norm = LayerNorm(a.d_model, eps=a.norm_eps, ops=ops)
        self.head = Linear(a.d_model, a.num_classes, ops=ops)
        self._init_weights()

    def _init_weights(self) -> None:
        # timm's default ("init_weights_vit_timm"): trunc_normal_(std=.02) for every Linear weight
        # and the position and class embeddings; zero biases; LayerNorms at (1, 0). timm cuts at
        # +-2 absolute, i.e. +-100 std, so that is a plain N(0, .02) (a cut at +-2 std would
        # shrink the std to .0176).
        def init(path: str, w: mx.array) -> mx.array:
            if path.endswith("norm.weight"):
                return w
            if path.endswith(".bias"):
                return mx.zeros_like(w)
            return mx.random.normal(w.shape, scale=0.02)

        self.update(tree_unflatten([(k, init(k, v)) for k, v in tree_flatten(self.parameters())]))

    def patchify(self, images: mx.array) -> mx.array:
        """(B, H, W, C) -> (B, N, p*p*C): patches row-major, features flattened (ph, pw, c)."""
        a = self.args
        if images.ndim != 4 or tuple(images.shape[1:]) != (a.image_size, a.image_size, a.channels):
            raise ValueError(
                f"ViT input: expected (B, {a.image_size}, {a.image_size}, {a.channels}) images, "
                f"found {tuple(images.shape)}; set --model.image_size/--model.channels to match "
                "the data")
        B, p, g = images.shape[0], a.patch_size, a.image_size // a.patch_size
        x = images.reshape(B, g, p, g, p, a.channels)  # (B, gh, ph, gw, pw, C)
        x = x.transpose(0, 1, 3, 2, 4, 5)  # (B, gh, gw, ph, pw, C)
        return x.reshape(B, g * g, p * p * a.channels)  # (B, N, p*p*C)

    def __call__(self, images: mx.array) -> mx.array:
        ops = self.ops
        x = self.patch_embed(ops.cast(self.patchify(images)))  # (B, N, D)
        cls = mx.broadcast_to(ops.cast(self.cls_token), (x.shape[0], 1, x.shape[2]))  # (B,1,D)
        x = mx.concatenate([cls, x], axis=1) + ops.cast(self.pos_embed)  # (B, 1+N, D)
        for layer in self.layers:
            x = ops.block(layer, x)
        x = self.norm(x[:, 0])  # (B, D): only the cls token reaches the head
        return self.head(x)  # (B, num_classes)
