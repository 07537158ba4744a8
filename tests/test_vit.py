"""ViT: parameter counts, shapes, and logits against an independent float64 numpy forward."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten

from toymlx.models.vit import ViT, ViTArgs, vit_tiny, vit_tiny_8, vit_tiny_28


def n_params(model) -> int:
    return sum(v.size for _, v in tree_flatten(model.parameters()))


def test_vit_tiny_matches_timm_parameter_count():
    # timm vit_tiny_patch16_224: 5,717,416 parameters.
    assert n_params(ViT(vit_tiny())) == 5_717_416


@pytest.mark.parametrize(
    "preset, hw, c, classes, tokens",
    [(vit_tiny, 224, 3, 1000, 197), (vit_tiny_28, 28, 1, 10, 50), (vit_tiny_8, 8, 1, 10, 17)],
)
def test_preset_output_shapes(preset, hw, c, classes, tokens):
    args = preset()
    assert (args.image_size, args.channels, args.num_classes) == (hw, c, classes)
    assert (args.d_model, args.n_layers, args.n_heads, args.ffn_dim) == (192, 12, 3, 768)
    assert 1 + args.n_patches == tokens
    model = ViT(args)
    assert model.pos_embed.shape == (tokens, 192)
    out = model(mx.zeros((2, hw, hw, c)))
    mx.eval(out)
    assert np.isfinite(np.array(out)).all()
    assert out.shape == (2, classes) and out.dtype == mx.float32


def test_preset_overrides():
    a = vit_tiny_8(n_layers=6, gelu="fast")
    assert (a.n_layers, a.gelu, a.image_size, a.patch_size) == (6, "fast", 8, 2)
    assert len(ViT(a).layers) == 6


def test_bad_args_and_inputs_raise_named_errors():
    with pytest.raises(ValueError, match=r"^model.patch_size: expected a divisor of "
                       r"model.image_size \(8\), found 3$"):
        ViT(vit_tiny_8(patch_size=3))
    with pytest.raises(ValueError, match=r"^model.d_model: expected a multiple of model.n_heads "
                       r"\(5\), found 192$"):
        ViT(vit_tiny_8(n_heads=5))
    with pytest.raises(ValueError, match=r"gelu: expected one of erf, tanh, fast, found 'relu'"):
        ViT(vit_tiny_8(gelu="relu"))
    model = ViT(vit_tiny_8(n_layers=1))
    with pytest.raises(ValueError, match=r"expected \(B, 8, 8, 1\) images, found \(2, 28, 28, 1\)"):
        model(mx.zeros((2, 28, 28, 1)))


def test_init_like_timm():
    mx.random.seed(0)
    params = dict(tree_flatten(ViT(vit_tiny_8(n_layers=2)).parameters()))
    for k, v in params.items():
        v = np.array(v)
        if k.endswith("norm.weight"):
            assert (v == 1).all(), k
        elif k.endswith("bias"):
            assert (v == 0).all(), k
        else:
            assert abs(v.std() - 0.02) < 0.004, (k, v.std())


def test_patch_embedding_equals_strided_conv():
    # The documented flatten order (ph, pw, c) is MLX's conv weight (d, ph, pw, c) reshaped.
    mx.random.seed(1)
    args = ViTArgs(image_size=8, patch_size=2, channels=3, d_model=16, n_layers=1, n_heads=2,
                   ffn_dim=32, num_classes=4)
    model = ViT(args)
    x = mx.random.normal((2, 8, 8, 3))
    ours = model.patch_embed(model.patchify(x))  # (B, N, D)
    w = model.patch_embed.weight.reshape(16, 2, 2, 3)  # (D, ph, pw, C)
    conv = mx.conv2d(x, w, stride=2) + model.patch_embed.bias  # (B, 4, 4, D)
    np.testing.assert_allclose(np.array(ours), np.array(conv.reshape(2, 16, 16)), atol=1e-5)


def _layer_norm(x, w, b, eps):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


_erf = np.vectorize(math.erf)


def numpy_vit(p: dict[str, np.ndarray], a: ViTArgs, images: np.ndarray) -> np.ndarray:
    """A float64 ViT forward written from the paper/timm, not from the module under test."""
    B, H, W, _ = images.shape
    P, D, nh = a.patch_size, a.d_model, a.n_heads
    hd = D // nh
    # Patches by explicit loops, features in (ph, pw, c) order.
    patches = np.stack([images[:, i:i + P, j:j + P, :].reshape(B, -1)
                        for i in range(0, H, P) for j in range(0, W, P)], axis=1)
    x = patches @ p["patch_embed.weight"].T + p["patch_embed.bias"]
    x = np.concatenate([np.broadcast_to(p["cls_token"], (B, 1, D)), x], 1) + p["pos_embed"]
    for i in range(a.n_layers):
        blk = {k.removeprefix(f"layers.{i}."): v for k, v in p.items()
               if k.startswith(f"layers.{i}.")}
        q = blk.__getitem__
        h = _layer_norm(x, q("attn_norm.weight"), q("attn_norm.bias"), a.norm_eps)
        heads = []
        for name in ("q", "k", "v"):
            t = h @ q(f"attn.{name}_proj.weight").T + q(f"attn.{name}_proj.bias")
            heads.append(t.reshape(B, -1, nh, hd).transpose(0, 2, 1, 3))
        s = heads[0] @ heads[1].transpose(0, 1, 3, 2) / math.sqrt(hd)
        s = np.exp(s - s.max(-1, keepdims=True))
        o = (s / s.sum(-1, keepdims=True)) @ heads[2]
        o = o.transpose(0, 2, 1, 3).reshape(B, -1, D)
        x = x + o @ q("attn.o_proj.weight").T + q("attn.o_proj.bias")
        h = _layer_norm(x, q("ffn_norm.weight"), q("ffn_norm.bias"), a.norm_eps)
        h = h @ q("mlp.up_proj.weight").T + q("mlp.up_proj.bias")
        h = 0.5 * h * (1 + _erf(h / math.sqrt(2)))
        x = x + h @ q("mlp.down_proj.weight").T + q("mlp.down_proj.bias")
    cls = _layer_norm(x[:, 0], p["norm.weight"], p["norm.bias"], a.norm_eps)
    return cls @ p["head.weight"].T + p["head.bias"]


def test_forward_matches_float64_numpy():
    args = ViTArgs(image_size=8, patch_size=2, channels=2, d_model=32, n_layers=2, n_heads=4,
                   ffn_dim=64, num_classes=5)
    model = ViT(args)
    rng = np.random.default_rng(0)
    # Every parameter random (biases, norms, head included) so none can hide a bug.
    params = {k: rng.normal(0.0, 0.3, v.shape) + (1.0 if k.endswith("norm.weight") else 0.0)
              for k, v in tree_flatten(model.parameters())}
    model.update(tree_unflatten([(k, mx.array(v, dtype=mx.float32)) for k, v in params.items()]))
    images = rng.normal(size=(3, 8, 8, 2)).astype(np.float32)
    ours = np.array(model(mx.array(images)))
    ref = numpy_vit(params, args, images.astype(np.float64))
    assert ours.shape == (3, 5)
    assert np.abs(ref).max() > 0.5  # the comparison is not between near-zero logits
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=1e-4)


def test_gelu_choices_differ_slightly():
    args = ViTArgs(image_size=8, patch_size=2, d_model=32, n_layers=1, n_heads=2, ffn_dim=64)
    mx.random.seed(3)
    model = ViT(args)
    x = mx.random.normal((2, 8, 8, 1))
    exact = np.array(model(x))
    for name in ("tanh", "fast"):
        other = ViT(ViTArgs(**{**args.__dict__, "gelu": name}))
        other.update(model.parameters())
        diff = np.abs(np.array(other(x)) - exact).max()
        assert 0 < diff < 0.05, (name, diff)


def test_grad_checkpoint_recomputes_the_stochastic_depth_of_the_forward_pass():
    """--grad-checkpoint with --model.drop-path was refused (a recomputed block drew new
    masks); the recomputation draws what the forward drew: the gradients without it."""
    from dataclasses import replace

    from mlx import nn

    from toymlx.models.ops import EXACT

    x = mx.array(np.random.default_rng(0).standard_normal((8, 8, 8, 1)), mx.float32)
    y = mx.array(np.arange(8) % 10)

    def grads(checkpoint: bool, seed: int) -> dict[str, np.ndarray]:
        mx.random.seed(0)
        model = ViT(vit_tiny_8(d_model=32, n_layers=3, n_heads=2, ffn_dim=64, drop_path=0.5),
                    replace(EXACT, grad_checkpoint=checkpoint))
        model.train()
        mx.random.seed(seed)
        _, g = nn.value_and_grad(model, lambda m: nn.losses.cross_entropy(m(x), y).mean())(model)
        return {k: np.array(v) for k, v in tree_flatten(g)}

    want, got, other = grads(False, 5), grads(True, 5), grads(False, 6)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-7, err_msg=k)
    assert max(np.abs(other[k] - want[k]).max() for k in want) > 1e-4
