"""Training-time image augmentation in numpy, on batches `(N, H, W, C)` float32 in [0, 1].

Every function takes its randomness from a `np.random.Generator` that the caller seeds from
`(seed, step)`, so an augmented batch is a pure function of the run's seed and the step and a
resumed run draws exactly what an uninterrupted one would.

- `pad_crop`: a random crop of the image padded by `pad` zero pixels (a shift of up to `pad`
  pixels per axis), as in the CIFAR ResNet recipes.
- `resized_crop`: timm's RandomResizedCrop: a box of `scale` x the area and an aspect ratio in
  [3/4, 4/3], resampled bilinearly to the full size.
- `hflip`: a horizontal flip with probability 1/2 (off where orientation matters: digits).
- `trivial_augment`: TrivialAugment (Muller & Hutter 2021): one op per image, drawn uniformly
  with a uniform magnitude, from identity, shear, translate, rotate, brightness, contrast,
  colour, sharpness, posterize, solarize and autocontrast (torchvision's standard ranges;
  equalize is left out). Geometric ops fill with 0.
- `mix_batch`: mixup (Zhang et al. 2018) or cutmix (Yun et al. 2019) of each micro-batch with a
  permutation of itself, the loss mixed by `mix_lam`; with both on, timm's choice of one of
  the two per micro-batch with probability 1/2.
"""

from __future__ import annotations

import math

import numpy as np


def affine(x: np.ndarray, mat: np.ndarray) -> np.ndarray:
    """Resample each image bilinearly through its 2x3 matrix, filling with 0 outside.

    `mat` (N, 2, 3) maps an output pixel's (col, row, 1), measured from the image centre, to
    the input position it reads, also from the centre.
    """
    n, h, w, c = x.shape
    rows, cols = np.mgrid[0:h, 0:w].astype(np.float32)
    cy, cx = (h - 1) / 2, (w - 1) / 2
    grid = np.stack([cols.ravel() - cx, rows.ravel() - cy, np.ones(h * w, np.float32)])  # (3, HW)
    src = mat.astype(np.float32) @ grid  # (N, 2, HW)
    sx, sy = src[:, 0] + cx + 1, src[:, 1] + cy + 1  # in the 1-pixel zero-padded image
    x0, y0 = np.floor(sx), np.floor(sy)
    fx, fy = (sx - x0)[..., None], (sy - y0)[..., None]  # (N, HW, 1)
    padded = np.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0))).reshape(n, -1, c)  # (N, (H+2)(W+2), C)
    x0 = np.clip(x0.astype(np.int64), 0, w + 1)
    y0 = np.clip(y0.astype(np.int64), 0, h + 1)
    x1, y1 = np.clip(x0 + 1, 0, w + 1), np.clip(y0 + 1, 0, h + 1)

    def at(yy: np.ndarray, xx: np.ndarray) -> np.ndarray:
        return np.take_along_axis(padded, (yy * (w + 2) + xx)[..., None], axis=1)  # (N, HW, C)

    out = ((1 - fy) * ((1 - fx) * at(y0, x0) + fx * at(y0, x1))
           + fy * ((1 - fx) * at(y1, x0) + fx * at(y1, x1)))
    return out.reshape(n, h, w, c).astype(np.float32)


def pad_crop(x: np.ndarray, pad: int, rng: np.random.Generator) -> np.ndarray:
    """Shift each image by (dy, dx) in [-pad, pad]^2, filling with zeros."""
    n, h, w, _ = x.shape
    padded = np.pad(x, ((0, 0), (pad, pad), (pad, pad), (0, 0)))  # (n, H+2p, W+2p, C)
    dy, dx = rng.integers(-pad, pad + 1, size=(2, n))
    rows = (pad - dy)[:, None] + np.arange(h)  # (n, H)
    cols = (pad - dx)[:, None] + np.arange(w)  # (n, W)
    return padded[np.arange(n)[:, None, None], rows[:, :, None], cols[:, None, :]]


def resized_crop(x: np.ndarray, scale: tuple[float, float], rng: np.random.Generator,
                 ratio: tuple[float, float] = (3 / 4, 4 / 3)) -> np.ndarray:
    """timm's RandomResizedCrop on each image (box area in `scale`, log-uniform aspect ratio)."""
    n, h, w, _ = x.shape
    area = rng.uniform(scale[0], scale[1], n) * h * w
    aspect = np.exp(rng.uniform(math.log(ratio[0]), math.log(ratio[1]), n))
    bw = np.minimum(np.sqrt(area * aspect), w)
    bh = np.minimum(np.sqrt(area / aspect), h)
    # box centre offset from the image centre, uniform over the positions that keep it inside
    ox = rng.uniform(-1, 1, n) * (w - bw) / 2
    oy = rng.uniform(-1, 1, n) * (h - bh) / 2
    mat = np.zeros((n, 2, 3), np.float32)
    mat[:, 0, 0], mat[:, 1, 1] = bw / w, bh / h
    mat[:, 0, 2], mat[:, 1, 2] = ox, oy
    return affine(x, mat)


def hflip(x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Flip each image left-right with probability 1/2."""
    flip = rng.random(len(x)) < 0.5
    out = x.copy()
    out[flip] = x[flip, :, ::-1]
    return out


TRIVIAL_OPS = ("identity", "shear_x", "shear_y", "translate_x", "translate_y", "rotate",
               "brightness", "contrast", "color", "sharpness", "posterize", "solarize",
               "autocontrast")
"""TrivialAugment's op list (torchvision's TrivialAugmentWide without equalize), in draw order."""


def _grey(x: np.ndarray) -> np.ndarray:
    """Luma (ITU-R 601), kept with a channel axis of 1."""
    if x.shape[-1] == 1:
        return x
    return (x[..., :3] @ np.array([0.299, 0.587, 0.114], np.float32))[..., None]


def _blend(a: np.ndarray, b: np.ndarray, f: np.ndarray) -> np.ndarray:
    """a + f (b - a) per image, clipped to [0, 1] (PIL's ImageEnhance)."""
    return np.clip(a + f[:, None, None, None] * (b - a), 0.0, 1.0)


def _smooth(x: np.ndarray) -> np.ndarray:
    """PIL's SMOOTH kernel (centre 5, the 8 neighbours 1, /13) on the interior pixels."""
    out = x.copy()
    acc = 4 * x[:, 1:-1, 1:-1]
    for dy in (-1, 0, 1):
        for dx in (-1, 0, 1):
            acc = acc + x[:, 1 + dy:x.shape[1] - 1 + dy, 1 + dx:x.shape[2] - 1 + dx]
    out[:, 1:-1, 1:-1] = acc / 13
    return out


GEOMETRIC = ("shear_x", "shear_y", "translate_x", "translate_y", "rotate")


def _matrices(name: str, m: np.ndarray, h: int, w: int) -> np.ndarray:
    """(n, 2, 3) output->input maps of a geometric op at signed magnitudes m in [-1, 1]."""
    mat = np.zeros((len(m), 2, 3), np.float32)
    mat[:, 0, 0] = mat[:, 1, 1] = 1.0
    if name == "shear_x":
        mat[:, 0, 1] = 0.3 * m
    elif name == "shear_y":
        mat[:, 1, 0] = 0.3 * m
    elif name == "translate_x":
        mat[:, 0, 2] = 0.45 * w * m
    elif name == "translate_y":
        mat[:, 1, 2] = 0.45 * h * m
    else:  # rotate, up to 30 degrees
        a = np.deg2rad(30.0 * m)
        mat[:, 0, 0], mat[:, 0, 1] = np.cos(a), -np.sin(a)
        mat[:, 1, 0], mat[:, 1, 1] = np.sin(a), np.cos(a)
    return mat


def apply_op(x: np.ndarray, name: str, m: np.ndarray) -> np.ndarray:
    """One TrivialAugment op on every image of x, at signed magnitudes m (n,) in [-1, 1]
    (ops without a direction use |m|), with torchvision's ranges: shear 0.3, translate 0.45 of
    the side, rotate 30 degrees, enhance factors 1 +- 0.9, posterize 8 -> 4 bits, solarize
    threshold 1 -> 0."""
    m = np.asarray(m, np.float32)
    if name == "identity":
        return x
    if name in GEOMETRIC:
        return affine(x, _matrices(name, m, x.shape[1], x.shape[2]))
    f, a = 1.0 + 0.9 * m, np.abs(m)[:, None, None, None]
    if name == "brightness":
        return _blend(np.zeros_like(x), x, f)
    if name == "contrast":
        return _blend(np.broadcast_to(_grey(x).mean(axis=(1, 2, 3), keepdims=True), x.shape), x, f)
    if name == "color":
        return _blend(np.broadcast_to(_grey(x), x.shape), x, f)
    if name == "sharpness":
        return _blend(_smooth(x), x, f)
    if name == "posterize":  # keep the top 8 - floor(4|m|) bits of each 8-bit value
        step = 2.0 ** np.floor(4 * a)
        return (np.floor(np.round(x * 255) / step) * step / 255).astype(np.float32)
    if name == "solarize":
        return np.where(x >= 1.0 - a, 1.0 - x, x).astype(np.float32)
    if name == "autocontrast":
        lo = x.min(axis=(1, 2), keepdims=True)
        hi = x.max(axis=(1, 2), keepdims=True)
        return np.where(hi > lo, (x - lo) / np.where(hi > lo, hi - lo, 1.0), x).astype(np.float32)
    raise ValueError(f"augment op: expected one of {', '.join(TRIVIAL_OPS)}, found {name!r}")


def trivial_augment(x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One TrivialAugment op per image with a uniform magnitude in [0, 1] of its range."""
    n = len(x)
    op = rng.integers(0, len(TRIVIAL_OPS), n)
    mag = rng.uniform(0.0, 1.0, n).astype(np.float32)
    sign = np.where(rng.random(n) < 0.5, -1.0, 1.0).astype(np.float32)
    out = x.copy()
    for k, name in enumerate(TRIVIAL_OPS):
        sel = op == k
        if sel.any():
            out[sel] = apply_op(x[sel], name, mag[sel] * sign[sel])
    return out.astype(np.float32)


def mix_batch(batch: dict[str, np.ndarray], mixup: float, cutmix: float,
              rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Mixup or cutmix of each micro-batch with a permutation of itself.

    Adds `mix_labels` (the partner's label) and `mix_lam` (the weight of the image's own label,
    one value per micro-batch), which the loss mixes as lam * CE(y) + (1 - lam) * CE(y').
    """
    x, y = batch["images"], batch["labels"]  # (A, B, H, W, C), (A, B)
    A, B, H, W, _ = x.shape
    if cutmix <= 0:  # only the draws each mode needs, in a fixed order
        use_cut, lam = np.zeros(A, bool), rng.beta(mixup, mixup, size=A)
    elif mixup <= 0:
        use_cut, lam = np.ones(A, bool), rng.beta(cutmix, cutmix, size=A)
    else:
        use_cut = rng.random(A) < 0.5
        lam = np.where(use_cut, rng.beta(cutmix, cutmix, size=A), rng.beta(mixup, mixup, size=A))
    lam = lam.astype(np.float32)
    perm = np.stack([rng.permutation(B) for _ in range(A)])  # (A, B)
    xb = np.take_along_axis(x, perm.reshape(A, B, 1, 1, 1), axis=1)
    out = np.empty_like(x)
    for a in range(A):
        if use_cut[a]:  # a box of area (1 - lam) from the partner; lam becomes the kept area
            ch, cw = int(H * math.sqrt(1 - lam[a])), int(W * math.sqrt(1 - lam[a]))
            cy, cx = rng.integers(0, H), rng.integers(0, W)
            y0, y1 = max(cy - ch // 2, 0), min(cy + ch - ch // 2, H)
            x0, x1 = max(cx - cw // 2, 0), min(cx + cw - cw // 2, W)
            out[a] = x[a]
            out[a, :, y0:y1, x0:x1] = xb[a, :, y0:y1, x0:x1]
            lam[a] = 1.0 - (y1 - y0) * (x1 - x0) / (H * W)
        else:
            out[a] = lam[a] * x[a] + (1 - lam[a]) * xb[a]
    return {**batch, "images": out.astype(np.float32),
            "mix_labels": np.take_along_axis(y, perm, axis=1),
            "mix_lam": np.repeat(lam[:, None], B, axis=1)}
