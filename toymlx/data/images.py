"""Image-classification data: digits fixture / IDX / npz / CIFAR / ImageFolder -> split ->
normalised batches.

Design choices:
- Every source gives images `(N, H, W, C)` (uint8 or float) and labels `(N,)` int64: arrays in
  memory, or for an ImageFolder too large for memory (`stream`) an `ImageFiles` list that
  decodes the images a batch asks for. The split and the batches are numpy, and the trainer
  turns them into `mx.array`s.
- Pixels are scaled to [0, 1] by their format's range: 255 for 8-bit pixels (image files,
  CIFAR, MNIST's IDX, a uint8 .npz), 16 for the UCI digits (counts of 0..16); a float .npz by
  its largest value. Then they are standardised per channel with the mean/std of the training
  split only. (An 8-bit set scaled by its own maximum gave a dark set other units than the same
  images as files, which toymlx-classify divides by 255.)
- The train/validation split uses a fixed permutation (`SPLIT_SEED`), never the run's seed,
  so validation is identical across seeds. A directory holding both `train-*` and `t10k-*`
  IDX pairs, or CIFAR's batches, uses the official split instead (t10k / test_batch is
  validation); `val_path` names a separate validation set, and `test_path` a held-out test
  set (scored once, by `--test`), each taken whole.
- `train_batch` is a pure function of `(seed, step)`: the sample stream walks epochs, each
  shuffled by `np.random.default_rng([seed, epoch])`; augmentation (`toymlx.data.augment`, in
  [0, 1] space before standardising) draws from `np.random.default_rng([seed, step, 1])`, and
  mixup/cutmix from `[seed, step, 2]`. Resuming at step s needs no loader state, and
  `Prefetcher` can compute the next steps' batches in background threads.
"""

from __future__ import annotations

import zipfile
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NamedTuple

import numpy as np
from PIL import Image

from toymlx.backend.files import counted, nothing_there, shortlist
from toymlx.data import augment as A
from toymlx.data import fixture_path
from toymlx.data.cifar import batch_files, is_cifar, load_cifar
from toymlx.data.image_folder import (
    IMAGE_EXTENSIONS,
    SPLIT_NAMES,
    ImageDataError,
    ImageFiles,
    files_below,
    not_read_note,
    probe,
    read_file,
    resize_and_crop,
    scan_image_folder,
    split_folders,
    subfolders,
)

SPLIT_SEED = 20240601
"""Seed of the fixed train/validation permutation (independent of the run's seed)."""

DIGITS_NPZ = fixture_path("digits", "digits.npz")
DIGITS_SCALE = 16.0
"""The UCI digits' pixels are counts of 0..16 (each of a 4x4 block of a 32x32 bitmap)."""

_IDX_IMAGES, _IDX_LABELS = 0x00000803, 0x00000801  # ubyte data, 3 dims / 1 dim


STREAM_ABOVE_MB = 2048
"""An ImageFolder whose decoded training images would take more than this many MB streams from
disk unless `stream` says otherwise."""

DEFAULT_FOLDER_SIZE = 224
"""Image side for an ImageFolder of mixed sizes when none is given (timm's ViT-Tiny input)."""

def read_idx(path: str | Path, magic: int) -> np.ndarray:
    """One IDX ubyte file (MNIST layout) as a uint8 array, checking magic number and size."""
    path = Path(path)
    data = read_file(path)
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


def _pixel_scale(x: np.ndarray) -> float | None:
    """What divides an array's pixels into [0, 1]: 255 for 8-bit ones (as image files), None
    (the set's maximum) for floats."""
    return 255.0 if x.dtype == np.uint8 else None


def _idx_in_dir(folder: Path, prefix: str) -> Path | None:
    for suffix in ("", ".gz"):
        p = folder / f"{prefix}-images-idx3-ubyte{suffix}"
        if p.exists():
            return p
    return None


def load_npz(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """A `.npz` with `x` (N, H, W[, C]) and `y` (N,) integer labels."""
    path = Path(path)
    # np.load tries anything that is not a zip archive as a pickle, and its "allow_pickle"
    # advice would be wrong here: an .npz is a zip archive, or unreadable
    if path.is_file() and not zipfile.is_zipfile(path):
        raise ImageDataError(f"{path}: cannot read as a numpy .npz archive (not a zip archive)")
    try:
        with np.load(path, allow_pickle=False) as z:
            missing = [k for k in ("x", "y") if k not in z.files]
            if missing:
                raise ImageDataError(f"{path}: missing array(s) {', '.join(missing)}: expected "
                                     f"x (N,H,W[,C]) and y (N,), found {', '.join(z.files)}")
            x, y = z["x"], z["y"]
    # a damaged archive fails in zipfile, zlib or numpy's header parser
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as e:
        if isinstance(e, ImageDataError):
            raise
        raise ImageDataError(f"{path}: cannot read as a numpy .npz archive "
                             f"({type(e).__name__}: {e})") from None
    if x.ndim == 3:
        x = x[..., None]  # (N, H, W, 1)
    if x.ndim != 4:
        raise ImageDataError(f"{path}: x: expected shape (N,H,W[,C]), found {x.shape}")
    _, h, w, c = x.shape
    if c not in (1, 3) and h in (1, 3, 4) and w == c:
        raise ImageDataError(f"{path}: x: expected (N,H,W,C) with channels last, found "
                             f"{x.shape}: channels first, as PyTorch stores them; save "
                             "x.transpose(0, 2, 3, 1)")
    if c not in (1, 3):
        raise ImageDataError(f"{path}: x: expected 1 (grey) or 3 (RGB) channels last, found {c}"
                             + (": drop alpha with x[..., :3]" if c == 4 else ""))
    if y.ndim != 1 or len(y) != len(x) or not np.issubdtype(y.dtype, np.integer):
        raise ImageDataError(f"{path}: y: expected ({len(x)},) integer labels, found "
                             f"{y.shape} {y.dtype}")
    if x.dtype != np.uint8:
        x = x.astype(np.float32)
        bad = np.flatnonzero(~np.isfinite(x).reshape(len(x), -1).all(axis=1))
        if len(bad):
            raise ImageDataError(f"{path}: x: expected finite pixel values, found NaN or "
                                 f"infinity in {counted(len(bad), 'image')} (the first: "
                                 f"x[{bad[0]}])")
    return x, y.astype(np.int64)


@dataclass
class Raw:
    """One source as found: images (array or files), labels, and what it says about itself."""

    x: np.ndarray | ImageFiles
    y: np.ndarray
    source: str
    n_train: int | None = None
    """Where an official split puts its first validation image (None: no split of its own)."""
    class_names: list[str] = field(default_factory=list)
    """Names of the classes by index, where the source has them (folders, CIFAR meta)."""
    scale: float | None = None
    """What divides the pixels into [0, 1]: the format's range (`_pixel_scale`,
    `DIGITS_SCALE`); None for a float array: the set's maximum."""
    label_key: str = "labels"
    """What holds the labels, for messages (a .npz's array `y`)."""
    notes: list[str] = field(default_factory=list)
    """Lines for the console about how the source was read (a folder's size chosen for it)."""


def _load_arrays(p: Path) -> Raw:
    if is_cifar(p) or (p.is_file() and _is_pickle(p)):
        x, y, n_train, names = load_cifar(p)
        return Raw(x, y, str(p), n_train, names, 255.0)
    if p.is_dir():
        train, test = _idx_in_dir(p, "train"), _idx_in_dir(p, "t10k")
        if train and test:
            (xa, ya), (xb, yb) = load_idx(train), load_idx(test)
            if xa.shape[1:] != xb.shape[1:]:
                raise ImageDataError(f"{test}: image size mismatch: expected {xa.shape[1:3]} "
                                     f"as in {train.name}, found {xb.shape[1:3]}")
            x = np.concatenate([xa, xb])
            return Raw(x, np.concatenate([ya, yb]), str(p), len(xa), scale=_pixel_scale(x))
        if train or test:
            x, y = load_idx(train or test)
            return Raw(x, y, str(train or test), scale=_pixel_scale(x))
        loose = sum(1 for f in p.iterdir() if not f.name.startswith(".")
                    and f.suffix.lower() in IMAGE_EXTENSIONS and f.is_file())
        if loose:  # one class's folder, or a flat folder of unlabelled images
            raise ImageDataError(
                f"{p}: {counted(loose, 'image')} and no class subfolders: expected class "
                "subfolders of image files (ImageFolder: an image's class is its folder's "
                f"name); give the folder that holds the class folders (as {p.parent} holds "
                f"{p.name}/), or put each class's images in a subfolder named for it")
        raise ImageDataError(f"{p}: no images found: expected class subfolders of image files "
                             "(ImageFolder), CIFAR python batches, or IDX files "
                             "(train-/t10k-images-idx3-ubyte[.gz] with their labels)")
    if p.suffix == ".npz":
        x, y = load_npz(p)
        return Raw(x, y, str(p), scale=_pixel_scale(x), label_key="y")
    if "idx3" in p.name:
        x, y = load_idx(p)
        return Raw(x, y, str(p), scale=_pixel_scale(x))
    if p.suffix.lower() in IMAGE_EXTENSIONS:
        raise ImageDataError(f"{p}: a single image: expected a data set (a folder of class "
                             "subfolders, CIFAR batches, IDX or .npz); toymlx-classify "
                             "classifies single images")
    raise ImageDataError(f"{p}: unknown image data format: expected a folder of class "
                         "subfolders, CIFAR python batches (folder, .tar.gz or batch file), an "
                         "IDX *-images-idx3-ubyte[.gz] file or a .npz with x and y")


def _is_pickle(p: Path) -> bool:
    try:
        with p.open("rb") as f:
            return f.read(1) == b"\x80"  # the PROTO opcode every pickle since protocol 2 opens with
    except OSError:
        return False


def _is_image_folder(p: Path) -> bool:
    return p.is_dir() and not is_cifar(p) and not _idx_in_dir(p, "train") \
        and not _idx_in_dir(p, "t10k") and any(d.is_dir() for d in p.iterdir())


def files_read(path: str | Path) -> tuple[str, ...] | None:
    """The extensions of the files `load_images` reads in the folder `path`: an ImageFolder's
    images (not a notes.txt beside them, which a resume's data check then ignores); None for
    other data (all of a CIFAR or IDX folder's files)."""
    return IMAGE_EXTENSIONS if _is_image_folder(Path(path)) else None


def source_files(path: str | Path, trained: bool = False) -> list[Path]:
    """The files `load_images` reads from `path` (an ImageFolder's images in its class folders;
    an IDX folder's images and labels; a CIFAR folder's batches; a file as itself), or with
    `trained` those its training images come from (an IDX folder's train-* beside t10k-*, a
    CIFAR folder's training batches: not their official test set); of a folder of images
    without class folders (one class's, refused by the loader), its images; none where `path`
    is not there (the loader says so)."""
    p = Path(path)
    if not p.exists():
        return []
    if _is_image_folder(p):
        return [f for d in subfolders(p) for f in files_below(d)[0]]
    if is_cifar(p) and p.is_dir():
        return batch_files(p, trained)
    if not p.is_dir():
        return [p]
    train, test = _idx_in_dir(p, "train"), _idx_in_dir(p, "t10k")
    if not (train or test):
        return files_below(p)[0]  # a class's folder: its images
    read = [train] if trained and train and test else [f for f in (train, test) if f]
    return [f for images in read for f in (images, _labels_for(images))]


def _load_raw(path: str | None, size: int | None, channels: int | None,
              stream: bool | None, workers: int, min_classes: int = 2) -> Raw:
    """A source as images of one square size: arrays as stored, or a folder resized to `size`
    (default: its images' common square size, else DEFAULT_FOLDER_SIZE) and `channels`
    (default: 3 when any image has colour)."""
    if path is None:
        if not DIGITS_NPZ.exists():
            raise ImageDataError(f"{DIGITS_NPZ}: the default digits data is missing from this "
                                 "toymlx installation; reinstall toymlx or pass --data.path")
        x, y = load_npz(DIGITS_NPZ)
        return Raw(x, y, "uci-digits", scale=DIGITS_SCALE)
    p = Path(path)
    if not p.exists():
        raise ImageDataError(f"{p}: expected a folder of images or a data set file, found "
                             f"{nothing_there(p)}")
    if not _is_image_folder(p):
        return _load_arrays(p)
    files, y, names, others = scan_image_folder(p, min_classes)
    colour, sizes = probe(files, workers)
    notes = [n for n in [not_read_note(p, others)] if n]
    if loose := sorted(f.name for f in p.iterdir() if f.suffix.lower() in IMAGE_EXTENSIONS
                       and not f.name.startswith(".") and f.is_file()):
        notes.append(f"{p}: {counted(len(loose), 'image file')} directly in it, in no class "
                     f"folder ({', '.join(loose[:3])}{' ...' if len(loose) > 3 else ''}): not "
                     "read (an image's class is the subfolder it is in); move "
                     f"{'it' if len(loose) == 1 else 'them'} into one")
    if size is None:
        (w, h), = sizes if len(sizes) == 1 else ((0, 1),)
        size = w if w == h and w <= DEFAULT_FOLDER_SIZE else DEFAULT_FOLDER_SIZE
        if size != w or w != h:  # not their own size: a run decoding 10 px icons at 224 says so
            side = sorted(min(s) for s in sizes)
            found = (f", all {w}x{h}" if len(sizes) == 1 else f" of {len(sizes)} sizes (shorter "
                     f"side {side[0]} to {side[-1]} px)")
            notes.append(f"{p}: {counted(len(files), 'image')}{found}: each resized and "
                         f"centre-cropped to {size}x{size} (the default for images not all of "
                         "one square size up to 224; --data.image-size to choose)")
    lazy = ImageFiles(files, size, channels or (3 if colour else 1))
    if stream is None:
        stream = np.prod(lazy.shape) / 2**20 > STREAM_ABOVE_MB
    return Raw(lazy if stream else lazy.decode_all(workers), y, str(p), None, names, 255.0,
               notes=notes)


def _conform(x: np.ndarray | ImageFiles, size: int | None, channels: int | None,
             where: str) -> np.ndarray | ImageFiles:
    """Arrays resized (shorter side, centre crop, bicubic) and converted to grey/RGB as asked."""
    if isinstance(x, ImageFiles):
        if (size or x.size) != x.size or (channels or x.channels) != x.channels:
            x = ImageFiles(x.files, size or x.size, channels or x.channels)
        return x
    n, h, w, c = x.shape
    if channels is not None and channels != c:
        if c == 3 and channels == 1:
            x = (x.astype(np.float32) @ np.array([0.299, 0.587, 0.114], np.float32))[..., None]
        elif c == 1 and channels == 3:
            x = np.repeat(x, 3, axis=-1)
        else:
            raise ImageDataError(f"{where}: channels: expected 1 or 3 to convert, found {c}")
    if size is not None and (h, w) != (size, size):
        out = np.empty((n, size, size, x.shape[-1]), np.float32)
        for i in range(n):
            for ch in range(x.shape[-1]):
                im = Image.fromarray(np.asarray(x[i, :, :, ch], np.float32), mode="F")
                (nw, nh), (left, top) = resize_and_crop(w, h, size)
                im = im.resize((nw, nh), Image.Resampling.BICUBIC)
                out[i, :, :, ch] = np.asarray(im.crop((left, top, left + size, top + size)))
        x = out
    return x


def _map_classes(raw: Raw, classes: list[str], where: str) -> np.ndarray:
    """raw's labels re-indexed into `classes` by name (sources with names), else kept."""
    if not raw.class_names:
        if len(raw.y) and int(raw.y.max()) >= len(classes):
            raise ImageDataError(f"{where}: label {int(raw.y.max())}: expected < {len(classes)} "
                                 "(the classes of the training set or checkpoint)")
        return raw.y
    unknown = [n for n in raw.class_names if n not in classes]
    if unknown:
        raise ImageDataError(f"{where}: class {unknown[0]!r}: expected one of the "
                             f"{len(classes)} classes {classes[:8]}{' ...' if len(classes) > 8 else ''}"
                             ", found a class the model does not know")
    index = np.array([classes.index(n) for n in raw.class_names], np.int64)
    return index[raw.y]


class Prefetcher:
    """`fn(step)` for the next steps computed ahead by background threads.

    `fn` must be a pure function of the step (as every `train_batch` is), so prefetching
    changes no value: asking for step s returns fn(s) and queues s+1 .. s+depth (never past
    `stop`). A step asked for out of order is computed on the spot. Errors reach the caller.
    """

    def __init__(self, fn: Callable[[int], Any], workers: int, stop: int, depth: int = 0):
        self.fn, self.stop, self.depth = fn, stop, depth or 2 * workers
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="toymlx-data")
        self.pending: dict[int, Future] = {}

    def __call__(self, step: int) -> Any:
        fut = self.pending.pop(step, None)
        for s in [s for s in self.pending if s < step]:  # a jump back (resume): drop them
            self.pending.pop(s).cancel()
        for s in range(step + 1, min(step + 1 + self.depth, self.stop)):
            if s not in self.pending:
                self.pending[s] = self.pool.submit(self.fn, s)
        return fut.result() if fut is not None else self.fn(step)


@dataclass
class ImageSet:
    """A train/validation split of labelled images with fixed normalisation."""

    train_x: np.ndarray | ImageFiles
    """Training images (N, H, W, C) as stored (uint8 or float32), not normalised"""
    train_y: np.ndarray
    val_x: np.ndarray | ImageFiles
    val_y: np.ndarray
    scale: float
    """Pixels are divided by this (the format's range, or a float set's maximum) to land in
    [0, 1]"""
    mean: np.ndarray
    """Per-channel mean of the scaled training pixels, (C,)"""
    std: np.ndarray
    """Per-channel std of the scaled training pixels, (C,)"""
    num_classes: int
    source: str = "<images>"
    class_names: list[str] = field(default_factory=list)
    """Class names by index (folder names, CIFAR's meta; "0", "1", ... for unnamed labels)"""
    augment: Augment = field(default_factory=lambda: Augment())
    """Training-time augmentation (never on validation)"""
    scale_fixed: bool = False
    """Whether `scale` is the format's (255 for 8-bit pixels, 16 for the UCI digits) rather
    than the largest value found in a float set"""
    test_x: np.ndarray | ImageFiles | None = None
    """Held-out test images (`test_path`), None without a test set"""
    test_y: np.ndarray | None = None
    test_source: str | None = None
    val_scale: float | None = None
    """What divides the validation pixels into [0, 1] where they are a set of their own
    (`val_path`), by its own format as `scale` is the training images' (PNGs validating a run
    on a float .npz are over 255 still); None: `scale` (a split of the same set)"""
    test_scale: float | None = None
    """The same for the test set (`test_path`)"""
    notes: list[str] = field(default_factory=list)
    """Lines for the console about the data as loaded (classes with no training image)"""
    split_note: str | None = None
    """A training set given without validation images: the line saying how many images its
    fixed seeded split holds out and how to give a split instead (`seeded_split_note`)"""
    _perms: dict[tuple[int, int], np.ndarray] = field(default_factory=dict, repr=False)

    @property
    def image_shape(self) -> tuple[int, int, int]:
        return tuple(self.train_x.shape[1:])  # (H, W, C)

    @property
    def streamed(self) -> bool:
        return isinstance(self.train_x, ImageFiles)

    def normalise(self, x: np.ndarray, scale: float | None = None) -> np.ndarray:
        """Stored pixels -> float32 standardised with the training statistics (`scale`: what
        divides these pixels into [0, 1]; default: the training images' `scale`)."""
        return ((x.astype(np.float32) / (scale or self.scale) - self.mean) / self.std
                ).astype(np.float32)

    def _epoch_perm(self, seed: int, epoch: int) -> np.ndarray:
        key = (seed, epoch)
        perm = self._perms.get(key)
        if perm is None:  # a cache only: the result is a pure function of the key
            if len(self._perms) > 4:
                self._perms.clear()
            perm = np.random.default_rng([seed, epoch]).permutation(len(self.train_x))
            self._perms[key] = perm
        return perm

    def train_batch(self, step: int, seed: int, batch_size: int, accum: int = 1
                    ) -> dict[str, np.ndarray]:
        """Images (accum, B, H, W, C) float32 and labels (accum, B) int32 for one step (with
        `mix_labels` / `mix_lam` (accum, B) when mixup or cutmix is on)."""
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
        x = self.augment.apply(x, np.random.default_rng([seed, step, 1]))
        x = ((x - self.mean) / self.std).astype(np.float32)
        batch = {"images": x.reshape(accum, batch_size, *self.image_shape),  # (A, B, H, W, C)
                 "labels": self.train_y[idx].astype(np.int32).reshape(accum, batch_size)}
        if self.augment.mixup > 0 or self.augment.cutmix > 0:
            batch = A.mix_batch(batch, self.augment.mixup, self.augment.cutmix,
                                np.random.default_rng([seed, step, 2]))
        return batch

    def val_batches(self, batch_size: int, pad_last: bool = False) -> Sequence[dict]:
        """The whole validation split in order, each batch (1, B, ...); the last may be smaller,
        or with `pad_last` be filled with zero images labelled -1 (padding to ignore). Batches
        are made when read (a streamed set decodes them then)."""
        return self.batches_of(self.val_x, self.val_y, batch_size, pad_last, self.val_scale)

    def test_batches(self, batch_size: int, pad_last: bool = False) -> Sequence[dict]:
        """The whole test set as `val_batches` gives the validation split ([] without one)."""
        if self.test_x is None or self.test_y is None:
            return []
        return self.batches_of(self.test_x, self.test_y, batch_size, pad_last, self.test_scale)

    def batches_of(self, x: np.ndarray | ImageFiles, y: np.ndarray, batch_size: int,
                   pad_last: bool = False, scale: float | None = None) -> Sequence[dict]:
        """Images `x` with labels `y` as `val_batches` gives the validation split, their pixels
        divided by `scale` (default: the training images' `scale`)."""
        if batch_size < 1:
            raise ImageDataError(f"batch_size: expected >= 1, found {batch_size}")
        return _ValBatches(self, x, y, batch_size, pad_last, scale)

    def describe(self) -> dict[str, Any]:
        """Sizes for logging."""
        test = {} if self.test_y is None else {"test_source": self.test_source,
                                                "test_images": len(self.test_y)}
        return {"source": self.source, "train_images": len(self.train_x),
                "val_images": len(self.val_x), **test, "image_shape": list(self.image_shape),
                "num_classes": self.num_classes, "streamed": self.streamed}


class _ValBatches(Sequence):
    """ImageSet.val_batches (and test_batches): a list-like of batches of the images `x`,
    labels `y`, built on access and normalised with the training statistics."""

    def __init__(self, data: ImageSet, x: np.ndarray | ImageFiles, y: np.ndarray,
                 batch_size: int, pad_last: bool, scale: float | None = None):
        self.data, self.x, self.y, self.bs, self.pad = data, x, y, batch_size, pad_last
        self.scale = scale

    def __len__(self) -> int:
        return (len(self.y) + self.bs - 1) // self.bs

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        i %= len(self)
        bs = self.bs
        x = self.data.normalise(self.x[i * bs:(i + 1) * bs], self.scale)
        y = self.y[i * bs:(i + 1) * bs]
        if self.pad and len(y) < bs:
            x = np.concatenate([x, np.zeros((bs - len(y), *x.shape[1:]), x.dtype)])
            y = np.concatenate([y, np.full(bs - len(y), -1, y.dtype)])
        return {"images": x[None], "labels": y.astype(np.int32)[None]}


@dataclass(frozen=True)
class Augment:
    """What `ImageSet.train_batch` does to training images, in this order (see augment.py)."""

    crop: Literal["none", "shift", "resized"] = "none"
    """none; shift: a random crop of the image padded by `pad` zeros; resized: timm's
    RandomResizedCrop with area in [scale_min, 1]."""
    pad: int = 1
    """Largest shift in pixels per axis (crop shift)."""
    scale_min: float = 0.35
    """Smallest crop area (crop resized), as a fraction of the image."""
    flip: bool = False
    """Random horizontal flips (off where orientation matters, as for digits)."""
    trivial: bool = False
    """TrivialAugment: one random op of random strength per image."""
    mixup: float = 0.0
    """Mixup Beta(a, a) parameter (0: off)."""
    cutmix: float = 0.0
    """Cutmix Beta(a, a) parameter (0: off); with mixup too, one of the two per micro-batch."""

    def apply(self, x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Crop, flip and TrivialAugment on (N, H, W, C) images in [0, 1] (not mixup)."""
        if self.crop == "shift" and self.pad > 0:
            x = A.pad_crop(x, self.pad, rng)
        elif self.crop == "resized":
            x = A.resized_crop(x, (self.scale_min, 1.0), rng)
        if self.flip:
            x = A.hflip(x, rng)
        if self.trivial:
            x = A.trivial_augment(x, rng)
        return x

    def validate(self) -> None:
        """Raise ImageDataError naming the field when out of range."""
        if self.pad < 0:
            raise ImageDataError(f"pad: expected >= 0, found {self.pad}")
        if not 0.0 < self.scale_min <= 1.0:
            raise ImageDataError(f"scale_min: expected in (0, 1], found {self.scale_min}")
        for name in ("mixup", "cutmix"):
            if getattr(self, name) < 0:
                raise ImageDataError(f"{name}: expected >= 0 (0: off), found {getattr(self, name)}")


def _channel_stats(x: np.ndarray | ImageFiles, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel mean and std of x / scale, (C,) float32, in chunks (MNIST: no 376 MB copy);
    a streamed set uses a fixed sample of up to 2,000 images."""
    idx = np.arange(len(x))
    if isinstance(x, ImageFiles) and len(x) > 2000:
        idx = np.sort(np.random.default_rng(SPLIT_SEED).choice(len(x), 2000, replace=False))
    s1 = np.zeros(x.shape[-1], np.float64)
    s2 = np.zeros(x.shape[-1], np.float64)
    for i in range(0, len(idx), 4096):
        c = x[idx[i:i + 4096]].astype(np.float64) / scale
        s1 += c.sum(axis=(0, 1, 2))
        s2 += (c * c).sum(axis=(0, 1, 2))
    m = len(idx) * x.shape[1] * x.shape[2]
    mean = s1 / m
    std = np.sqrt(np.maximum(s2 / m - mean * mean, 0.0))
    return mean.astype(np.float32), np.where(std > 0, std, 1.0).astype(np.float32)


class HeldOut(NamedTuple):
    """A validation or test set of its own, as `_held_out` reads it."""

    x: np.ndarray | ImageFiles
    y: np.ndarray
    source: str
    scale: float
    """What divides its pixels into [0, 1] (its own format's range: `_source_scale`)"""
    notes: list[str]
    """Lines about how it was read (`Raw.notes`)"""


def _held_out(path: str, flag: str, like: np.ndarray | ImageFiles, names: list[str],
              stream: bool | None, workers: int) -> HeldOut:
    """A validation or test set of its own (`flag`: --data.val-path, --data.test-path): every
    image in it, at the size and channels of the training images `like`, labels mapped into
    the training classes `names` by name."""
    h, _, c = like.shape[1:]
    raw = _load_raw(path, h, c, stream, workers, min_classes=1)
    x = _conform(raw.x, h, c, raw.source)
    if len(x) == 0:
        raise ImageDataError(f"{raw.source}: {flag}: no images")
    return HeldOut(x, _map_classes(raw, names, raw.source), raw.source, _source_scale(raw, x),
                   raw.notes)


def _source_scale(raw: Raw, x: np.ndarray | ImageFiles) -> float:
    """What divides the pixels `x` of the source `raw` into [0, 1]: its format's range (255 for
    8-bit pixels, 16 for the UCI digits), else (a float set) its largest value."""
    return raw.scale or float(np.max(x)) or 1.0


def load_images(path: str | None = None, val_fraction: float = 0.1,
                augment: Augment | None = None, *, val_path: str | None = None,
                test_path: str | None = None, image_size: int | None = None,
                channels: int | None = None, classes: list[str] | None = None,
                stream: bool | None = None, workers: int = 2) -> ImageSet:
    """Load images and split them (or take `val_path` as the validation set); `test_path`, if
    given, is the held-out test set (`test_x`, `test_y`), taken whole as `val_path` is.

    `path`: None (the UCI digits fixture), a folder of class subfolders (ImageFolder), CIFAR
    python batches (folder, .tar.gz or one batch file), an IDX file or folder, or a .npz.
    A folder with both train-* and t10k-* IDX pairs, or CIFAR's folder or archive, keeps its
    official split and ignores val_fraction. `image_size` / `channels` resize and convert
    (default: the data's own; a folder of mixed sizes: DEFAULT_FOLDER_SIZE). `classes` maps
    labels into a given class list by name (a checkpoint's, for evaluation). `stream`: decode
    an ImageFolder from disk per batch instead of holding it in memory (None: above
    STREAM_ABOVE_MB). `workers`: threads that decode a folder.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ImageDataError(f"--data.val-fraction: expected in [0, 1), found {val_fraction}")
    if image_size is not None and image_size < 1:
        raise ImageDataError(f"image_size: expected >= 1, found {image_size}")
    if channels not in (None, 1, 3):
        raise ImageDataError(f"channels: expected 1 or 3, found {channels}")
    augment = augment or Augment()
    augment.validate()
    layout = None if path is None else split_layout(path, val_path, val_fraction,
                                                       test_path)
    raw = _load_raw(layout[0] if layout else path, image_size, channels, stream, workers,
                    1 if classes else 2)
    if classes is None:  # a training set's names become the model's (and timm's class map)
        check_class_names(raw.source, raw.class_names)
    if layout is not None:  # named as given: "data/ (val)" is its val/ folder
        raw.source, val_path, layout_note = str(path), layout[1], layout[2]
    raw.x = _conform(raw.x, image_size, channels, raw.source)
    if len(raw.x) == 0:
        raise ImageDataError(f"{raw.source}: no images")
    if raw.y.min() < 0:
        raise ImageDataError(f"{raw.source}: labels: expected integers >= 0, found {raw.y.min()}")
    names = classes or raw.class_names or [str(i) for i in range(int(raw.y.max()) + 1)]
    y = _map_classes(raw, names, raw.source)
    if classes is None:  # a training set (an evaluation maps into the checkpoint's classes)
        check_classes(raw, y, names)
    seeded = None  # the line saying a seeded split's size, where one is taken
    if val_path is not None:
        train_idx, val_idx = np.arange(raw.n_train or len(raw.x)), None
        val = _held_out(val_path, "--data.val-path", raw.x, names, stream, workers)
        val_x, val_y, val_scale, held_notes = val.x, val.y, val.scale, val.notes
    else:
        if raw.n_train is None:
            perm = np.random.default_rng(SPLIT_SEED).permutation(len(raw.x))
            n_val = round(len(raw.x) * val_fraction)
            val_idx, train_idx = np.sort(perm[:n_val]), np.sort(perm[n_val:])
            if path is not None:  # data given without a split of its own (not the digits)
                seeded = seeded_split_note(raw.source, n_val, len(raw.x), val_fraction,
                                           layout is not None)
        else:
            train_idx, val_idx = np.arange(raw.n_train), np.arange(raw.n_train, len(raw.x))
        val_x, val_y, val_scale, held_notes = _take(raw.x, val_idx), y[val_idx], None, []
    if len(train_idx) == 0:
        raise ImageDataError(f"{raw.source}: training split is empty "
                             f"({counted(len(raw.x), 'image')}, val_fraction={val_fraction})")
    train_x = _take(raw.x, train_idx)
    scale = _source_scale(raw, raw.x)
    mean, std = _channel_stats(train_x, scale)
    test = None if test_path is None else _held_out(test_path, "--data.test-path", raw.x, names,
                                                    stream, workers)
    test_x, test_y, test_source, test_scale = (None,) * 4 if test is None else test[:4]
    out = ImageSet(train_x, y[train_idx], val_x, val_y, scale, mean, std, len(names),
                   raw.source, list(names), augment, raw.scale is not None,
                   test_x=test_x, test_y=test_y, test_source=test_source,
                   val_scale=val_scale, test_scale=test_scale)
    if classes is None:
        out.notes = [n for n in [classes_note(raw, out.train_y, len(names)),
                                 val_path and unscored_note(val.source, out.val_y, names)] if n]
    out.notes[:0] = raw.notes + held_notes + (test.notes if test is not None else [])
    if classes is None:  # training on it (an evaluation trains nothing)
        out.split_note = seeded
        if layout is not None:
            out.notes.insert(0, layout_note)
    return out


def split_layout(path: str, val_path: str | None, val_fraction: float,
                 test_path: str | None = None) -> tuple[str, str | None, str] | None:
    """For a folder in timm's layout (`train/` and `val/` of class subfolders, `split_folders`):
    (the training folder, the validation set, a line saying so); None for any other source.
    A --data.val-path given is kept; without a val/ folder the split is the fixed one of train/."""
    found = split_folders(path)
    if found is None:
        return None
    train = found["train"]
    if val_path is None and "val" in found:
        val_path = str(found["val"])
        val = f"validating on {val_path}"
    elif val_path is None:  # the seeded split of train/, said by the next line
        val = f"no {'/, '.join(SPLIT_NAMES['val'])}/ folder"
    else:
        val = f"validating on --data.val-path {val_path}"
    test = (f"; {found['test']} is scored only by --data.test-path {found['test']} --test"
            if "test" in found and test_path is None else "")
    return str(train), val_path, (f"{path}: {', '.join(d.name + '/' for d in found.values())} "
                                  f"are splits (timm's layout), not classes: training on {train}, "
                                  f"{val}{test}")


def seeded_split_note(source: str, n_val: int, n: int, val_fraction: float,
                      layout: bool) -> str:
    """The line a training run prints where its data gave no validation set and a fixed
    seeded part of it validates (`SPLIT_SEED`): how many of how many images, and how to give a
    split instead (`layout`: the source is a folder in timm's layout lacking its val/)."""
    give = (f"a {source}/val/ folder of class subfolders, or --data.val-path DIR" if layout
            else "--data.val-path DIR, or --data.path a folder of train/ and val/ (timm's layout)")
    held = (f"a fixed seeded {n_val} of its {counted(n, 'image')} (--data.val-fraction "
            f"{val_fraction:g}) {'validates and is' if n_val == 1 else 'validate and are'} not "
            "trained on" if n_val else
            f"--data.val-fraction {val_fraction:g} of its {counted(n, 'image')} holds out none, "
            "so the run validates nothing")
    return f"{source}: no validation set given: {held}; to give one: {give}"


def check_classes(raw: Raw, y: np.ndarray, names: Sequence[str]) -> None:
    """ImageDataError naming the source and its labels unless they hold 2 classes or more, as
    an ImageFolder must: one class trains a model that is always right and learns nothing."""
    found = np.unique(y)
    if len(found) < 2:
        raise ImageDataError(f"{raw.source}: {raw.label_key}: expected at least 2 classes, "
                             f"found 1 ({names[int(found[0])]!r} for all "
                             f"{counted(len(y), 'image')}); a classifier needs two or more "
                             "classes")


def check_class_names(source: str, names: Sequence[str]) -> None:
    """ImageDataError naming the first class whose name a class_map.txt cannot carry as it is:
    spaces (any whitespace) at its ends, which timm's reader (`load_class_map`: each line
    `.strip()`ped) drops, so timm's class " cat" would be "cat" and its folder's images matched
    to no class; or a line break, which splits its line. Refused before training, while the
    fix is a folder's rename; torchvision would keep the name, timm would not."""
    for name in names:
        if name == name.strip() and "\n" not in name and "\r" not in name:
            continue
        fixed = " ".join(name.split())
        fault = ("a line break in it, which splits its line" if name.strip() == name else
                 f"whitespace at its ends, which timm's reader strips ({name.strip()!r})")
        fix = (f"merge its images into the folder {fixed!r}" if fixed in names else
               f"rename the folder to {fixed!r}" if fixed else "rename the folder")
        raise ImageDataError(f"{source}: class {name!r}: expected a class name that reads back "
                             "as itself from the class_map.txt toymlx-export writes for timm, "
                             f"found {fault}; {fix}")


def classes_note(raw: Raw, train_y: np.ndarray, num_classes: int) -> str | None:
    """One line when classes have no training image (labels 0, 100, 200 make 201 classes), None
    otherwise. Not refused: torchvision and timm take integer labels as class indices, gaps
    and all (a subset of a larger label set keeps its ids), so this says what the model's
    size comes from rather than stopping the run."""
    present = np.unique(train_y)
    missing = num_classes - len(present)
    if not missing:
        return None
    have = "has" if missing == 1 else "have"
    if raw.class_names:  # folders or CIFAR's meta: the classes by name, and where their images are
        count = np.bincount(raw.y, minlength=num_classes)
        absent = [k for k in range(num_classes) if k not in set(present.tolist())]
        named = ", ".join(f"{raw.class_names[k]!r} ("
                          + (f"{counted(int(count[k]), 'image')}, held out for validation"
                             if count[k] else "no image in the data") + ")"
                          for k in absent[:5]) + (" ..." if len(absent) > 5 else "")
        split = raw.n_train is None and any(count[k] for k in absent)  # the seeded split's
        return (f"{raw.source}: {missing} of the {num_classes} classes {have} no training "
                f"image: {named}; the model cannot learn {'it' if missing == 1 else 'them'}: "
                f"add images{', or lower --data.val-fraction' if split else ''}")
    return (f"{raw.source}: {raw.label_key} takes {len(present)} values in 0..{num_classes - 1} "
            f"in the training split: {missing} of the {num_classes} classes {have} no training "
            f"image")


def unscored_note(source: str, val_y: np.ndarray, names: Sequence[str]) -> str | None:
    """One line when classes have no image in a validation set of its own (a val/ folder
    without one class's subfolder), None otherwise: the held-out accuracy then left them out
    without a word. (Not for the seeded split: a set of a few dozen images leaves a class out
    of it by chance, and says its size already.)"""
    have = set(np.unique(val_y).tolist())
    absent = [names[k] for k in range(len(names)) if k not in have]
    if not absent or not len(val_y):
        return None
    return (f"{source}: {len(absent)} of the {counted(len(names), 'class', 'classes')} "
            f"{'has' if len(absent) == 1 else 'have'} no validation image "
            f"({shortlist([repr(n) for n in absent], 5)}): the held-out accuracy and loss "
            f"cover the other {len(names) - len(absent)}; add images of "
            f"{'it' if len(absent) == 1 else 'them'} to score {'it' if len(absent) == 1 else 'them'}")


def _take(x: np.ndarray | ImageFiles, idx: np.ndarray) -> np.ndarray | ImageFiles:
    if isinstance(x, ImageFiles):
        return x.subset(idx)
    return x if len(idx) == len(x) and (idx == np.arange(len(x))).all() else x[idx]
