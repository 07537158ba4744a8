"""Image-classification data: digits fixture / IDX / npz -> split -> normalised batches.

Design choices:
- Every loader returns images `(N, H, W, C)` (uint8 or float) and labels `(N,)` int64; the
  split and the batches are numpy, and the trainer turns them into `mx.array`s.
- Pixels are scaled to [0, 1] by the set's maximum value (16 for the UCI digits, 255 for
  MNIST), then standardised per channel with the mean/std of the training split only.
- The train/validation split uses a fixed permutation (`SPLIT_SEED`), never the run's seed,
  so validation is identical across seeds. A directory holding both `train-*` and `t10k-*`
  IDX pairs uses the official split instead (t10k is validation).
- `train_batch` is a pure function of `(seed, step)`: the sample stream walks epochs, each
  shuffled by `np.random.default_rng([seed, epoch])`; augmentation (a shift of up to
  `max_shift` pixels with zero padding, in [0, 1] space before standardising) draws from
  `np.random.default_rng([seed, step, 1])`. Resuming at step s needs no loader state.
"""

from __future__ import annotations

import gzip
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from toymlx.data import fixture_path

SPLIT_SEED = 20240601
"""Seed of the fixed train/validation permutation (independent of the run's seed)."""

DIGITS_NPZ = fixture_path("digits", "digits.npz")

_IDX_IMAGES, _IDX_LABELS = 0x00000803, 0x00000801  # ubyte data, 3 dims / 1 dim


class ImageDataError(ValueError):
    """An image data file or setting cannot be used; the message is one line."""


def _read_bytes(path: Path) -> bytes:
    try:
        if path.name.endswith(".gz"):
            with gzip.open(path, "rb") as f:
                return f.read()
        return path.read_bytes()
    except OSError as e:  # includes gzip.BadGzipFile
        raise ImageDataError(f"{path}: cannot read ({e.strerror or e})") from None
    except EOFError:
        raise ImageDataError(f"{path}: truncated gzip stream; re-download the file") from None


def read_idx(path: str | Path, magic: int) -> np.ndarray:
    """One IDX ubyte file (MNIST layout) as a uint8 array, checking magic number and size."""
    path = Path(path)
    data = _read_bytes(path)
    ndim = magic & 0xFF
    header = 4 + 4 * ndim
    what = "images" if magic == _IDX_IMAGES else "labels"
    if len(data) < header:
        raise ImageDataError(f"{path}: truncated IDX header: expected {header} bytes, "
                             f"found {len(data)}")
    found = int.from_bytes(data[:4], "big")
    if found != magic:
        raise ImageDataError(f"{path}: bad IDX magic number: expected 0x{magic:08x} (ubyte "
                             f"{what}, {ndim}-D), found 0x{found:08x}")
    dims = tuple(int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim))
    need = header + int(np.prod(dims))
    if len(data) != need:
        kind = "truncated" if len(data) < need else "trailing bytes"
        raise ImageDataError(f"{path}: {kind}: expected {need} bytes (header {header} + "
                             f"{'x'.join(map(str, dims))}), found {len(data)}")
    return np.frombuffer(data, np.uint8, offset=header).reshape(dims)


def _labels_for(images: Path) -> Path:
    name = images.name
    if "images-idx3" not in name:
        raise ImageDataError(f"{images}: expected an IDX images file named "
                             "*-images-idx3-ubyte[.gz] (its labels beside it)")
    base = name.replace("images-idx3", "labels-idx1")
    stem = base.removesuffix(".gz")
    for cand in (images.with_name(base), images.with_name(stem), images.with_name(stem + ".gz")):
        if cand.exists():
            return cand
    raise ImageDataError(f"{images}: labels file not found: expected {images.with_name(base)}")


def load_idx(images: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """An IDX images file and the matching labels file beside it -> (N, H, W, 1), (N,)."""
    images = Path(images)
    labels = _labels_for(images)
    x = read_idx(images, _IDX_IMAGES)
    y = read_idx(labels, _IDX_LABELS)
    if len(y) != len(x):
        raise ImageDataError(f"{labels}: label count mismatch: expected {len(x)} (images in "
                             f"{images.name}), found {len(y)}")
    return x[..., None], y.astype(np.int64)  # (N, H, W, 1)


def _idx_in_dir(folder: Path, prefix: str) -> Path | None:
    for suffix in ("", ".gz"):
        p = folder / f"{prefix}-images-idx3-ubyte{suffix}"
        if p.exists():
            return p
    return None


def load_npz(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """A `.npz` with `x` (N, H, W[, C]) and `y` (N,) integer labels."""
    path = Path(path)
    try:
        with np.load(path, allow_pickle=False) as z:
            missing = [k for k in ("x", "y") if k not in z.files]
            if missing:
                raise ImageDataError(f"{path}: missing array(s) {', '.join(missing)}: expected "
                                     f"x (N,H,W[,C]) and y (N,), found {', '.join(z.files)}")
            x, y = z["x"], z["y"]
    except (OSError, ValueError) as e:
        if isinstance(e, ImageDataError):
            raise
        raise ImageDataError(f"{path}: cannot read as .npz ({e})") from None
    if x.ndim == 3:
        x = x[..., None]  # (N, H, W, 1)
    if x.ndim != 4:
        raise ImageDataError(f"{path}: x: expected shape (N,H,W[,C]), found {x.shape}")
    if y.ndim != 1 or len(y) != len(x) or not np.issubdtype(y.dtype, np.integer):
        raise ImageDataError(f"{path}: y: expected ({len(x)},) integer labels, found "
                             f"{y.shape} {y.dtype}")
    if x.dtype != np.uint8:
        x = x.astype(np.float32)
    return x, y.astype(np.int64)


def _load_raw(path: str | None) -> tuple[np.ndarray, np.ndarray, str, int | None]:
    """(x, y, source, n_train or None for a split by val_fraction)."""
    if path is None:
        if not DIGITS_NPZ.exists():
            raise ImageDataError(f"{DIGITS_NPZ}: the default digits data is missing from this "
                                 "toymlx installation; reinstall toymlx or pass --data.path")
        x, y = load_npz(DIGITS_NPZ)
        return x, y, "uci-digits", None
    p = Path(path)
    if p.is_dir():
        train, test = _idx_in_dir(p, "train"), _idx_in_dir(p, "t10k")
        if train and test:
            (xa, ya), (xb, yb) = load_idx(train), load_idx(test)
            if xa.shape[1:] != xb.shape[1:]:
                raise ImageDataError(f"{test}: image size mismatch: expected {xa.shape[1:3]} "
                                     f"as in {train.name}, found {xb.shape[1:3]}")
            return np.concatenate([xa, xb]), np.concatenate([ya, yb]), str(p), len(xa)
        if train or test:
            x, y = load_idx(train or test)
            return x, y, str(train or test), None
        raise ImageDataError(f"{p}: no IDX files: expected train-images-idx3-ubyte[.gz] "
                             "and/or t10k-images-idx3-ubyte[.gz] with their labels")
    if not p.exists():
        raise ImageDataError(f"{p}: no such file or directory")
    if p.suffix == ".npz":
        x, y = load_npz(p)
    else:
        x, y = load_idx(p)
    return x, y, str(p), None


@dataclass
class ImageSet:
    """A train/validation split of labelled images with fixed normalisation."""

    train_x: np.ndarray
    """Training images (N, H, W, C) as stored (uint8 or float32), not normalised"""
    train_y: np.ndarray
    val_x: np.ndarray
    val_y: np.ndarray
    scale: float
    """Pixels are divided by this (the set's maximum) to land in [0, 1]"""
    mean: np.ndarray
    """Per-channel mean of the scaled training pixels, (C,)"""
    std: np.ndarray
    """Per-channel std of the scaled training pixels, (C,)"""
    num_classes: int
    source: str = "<images>"
    augment: bool = True
    """Random shifts on training batches (never on validation)"""
    max_shift: int = 1
    """Largest shift in pixels, per axis"""
    _perms: dict[tuple[int, int], np.ndarray] = field(default_factory=dict, repr=False)

    @property
    def image_shape(self) -> tuple[int, int, int]:
        return tuple(self.train_x.shape[1:])  # (H, W, C)

    def normalise(self, x: np.ndarray) -> np.ndarray:
        """Stored pixels -> float32 standardised with the training statistics."""
        return ((x.astype(np.float32) / self.scale - self.mean) / self.std).astype(np.float32)

    def _epoch_perm(self, seed: int, epoch: int) -> np.ndarray:
        key = (seed, epoch)
        if key not in self._perms:  # a cache only: the result is a pure function of the key
            if len(self._perms) > 4:
                self._perms.clear()
            self._perms[key] = np.random.default_rng([seed, epoch]).permutation(len(self.train_x))
        return self._perms[key]

    def _shift(self, x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Shift each image by (dy, dx) in [-s, s]^2, filling with zeros."""
        s = self.max_shift
        n, h, w, _ = x.shape
        padded = np.pad(x, ((0, 0), (s, s), (s, s), (0, 0)))  # (n, H+2s, W+2s, C)
        dy, dx = rng.integers(-s, s + 1, size=(2, n))
        rows = (s - dy)[:, None] + np.arange(h)  # (n, H)
        cols = (s - dx)[:, None] + np.arange(w)  # (n, W)
        return padded[np.arange(n)[:, None, None], rows[:, :, None], cols[:, None, :]]

    def train_batch(self, step: int, seed: int, batch_size: int, accum: int = 1
                    ) -> dict[str, np.ndarray]:
        """Images (accum, B, H, W, C) float32 and labels (accum, B) int32 for one step."""
        if step < 0 or seed < 0 or batch_size < 1 or accum < 1:
            raise ImageDataError(f"{self.source}: expected step, seed >= 0 and batch_size, "
                                 f"accum >= 1, found {step}, {seed}, {batch_size}, {accum}")
        n, per_step = len(self.train_x), batch_size * accum
        k = step * per_step + np.arange(per_step)  # positions in the endless sample stream
        epochs, pos = k // n, k % n
        idx = np.empty(per_step, np.int64)
        for e in np.unique(epochs):
            sel = epochs == e
            idx[sel] = self._epoch_perm(seed, int(e))[pos[sel]]
        x = self.train_x[idx].astype(np.float32) / self.scale  # (A*B, H, W, C) in [0, 1]
        if self.augment and self.max_shift > 0:
            x = self._shift(x, np.random.default_rng([seed, step, 1]))
        x = ((x - self.mean) / self.std).astype(np.float32)
        return {"images": x.reshape(accum, batch_size, *self.image_shape),  # (A, B, H, W, C)
                "labels": self.train_y[idx].astype(np.int32).reshape(accum, batch_size)}

    def val_batches(self, batch_size: int, pad_last: bool = False) -> list[dict[str, np.ndarray]]:
        """The whole validation split in order, each batch (1, B, ...); the last may be smaller,
        or with `pad_last` be filled with zero images labelled -1 (padding to ignore)."""
        if batch_size < 1:
            raise ImageDataError(f"batch_size: expected >= 1, found {batch_size}")
        out = []
        for i in range(0, len(self.val_x), batch_size):
            x, y = self.normalise(self.val_x[i:i + batch_size]), self.val_y[i:i + batch_size]
            if pad_last and len(y) < batch_size:
                x = np.concatenate([x, np.zeros((batch_size - len(y), *x.shape[1:]), x.dtype)])
                y = np.concatenate([y, np.full(batch_size - len(y), -1, y.dtype)])
            out.append({"images": x[None], "labels": y.astype(np.int32)[None]})
        return out

    def describe(self) -> dict[str, Any]:
        """Sizes for logging."""
        return {"source": self.source, "train_images": len(self.train_x),
                "val_images": len(self.val_x), "image_shape": list(self.image_shape),
                "num_classes": self.num_classes}


def _channel_stats(x: np.ndarray, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel mean and std of x / scale, (C,) float32, in chunks (MNIST: no 376 MB copy)."""
    s1 = np.zeros(x.shape[-1], np.float64)
    s2 = np.zeros(x.shape[-1], np.float64)
    for i in range(0, len(x), 4096):
        c = x[i:i + 4096].astype(np.float64) / scale
        s1 += c.sum(axis=(0, 1, 2))
        s2 += (c * c).sum(axis=(0, 1, 2))
    m = len(x) * x.shape[1] * x.shape[2]
    mean = s1 / m
    std = np.sqrt(np.maximum(s2 / m - mean * mean, 0.0))
    return mean.astype(np.float32), np.where(std > 0, std, 1.0).astype(np.float32)


def load_images(path: str | None = None, val_fraction: float = 0.1, augment: bool = True,
                max_shift: int = 1) -> ImageSet:
    """Load images (None: the UCI digits fixture; an IDX file or folder; a .npz) and split them.

    A folder with both train-* and t10k-* IDX pairs keeps that split and ignores val_fraction.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ImageDataError(f"val_fraction: expected a value in [0, 1), found {val_fraction}")
    if max_shift < 0:
        raise ImageDataError(f"max_shift: expected >= 0, found {max_shift}")
    x, y, source, n_train = _load_raw(path)
    if len(x) == 0:
        raise ImageDataError(f"{source}: no images")
    if y.min() < 0:
        raise ImageDataError(f"{source}: labels: expected integers >= 0, found {y.min()}")
    if n_train is None:
        perm = np.random.default_rng(SPLIT_SEED).permutation(len(x))
        n_val = round(len(x) * val_fraction)
        val_idx, train_idx = np.sort(perm[:n_val]), np.sort(perm[n_val:])
    else:
        train_idx, val_idx = np.arange(n_train), np.arange(n_train, len(x))
    if len(train_idx) == 0:
        raise ImageDataError(f"{source}: training split is empty ({len(x)} images, "
                             f"val_fraction={val_fraction})")
    scale = float(x.max()) or 1.0
    mean, std = _channel_stats(x[train_idx], scale)
    return ImageSet(x[train_idx], y[train_idx], x[val_idx], y[val_idx], scale, mean, std,
                    int(y.max()) + 1, source, augment, max_shift)
