"""Small image data sets written by the tests: an ImageFolder of PNG/JPEG files, CIFAR
python batches in the real pickle layout and MNIST's IDX files."""

from __future__ import annotations

import gzip
import pickle
import tarfile
from pathlib import Path

import numpy as np
from PIL import Image

CLASSES = ("bird", "cat", "frog")


def make_image_folder(root: Path, per_class: int = 10, seed: int = 0) -> Path:
    """root/<class>/<i>.png|jpg: colour and grey images of mixed sizes, each class with its own
    dominant channel (so a model can learn them)."""
    rng = np.random.default_rng(seed)
    for k, name in enumerate(CLASSES):
        d = root / name
        d.mkdir(parents=True)
        for i in range(per_class):
            h, w = (int(v) for v in rng.integers(9, 30, 2))
            img = rng.integers(0, 60, (h, w, 3)).astype(np.uint8)
            img[..., k] += 180
            if i % 3 == 0:
                Image.fromarray(img[..., k], "L").save(d / f"{i:02d}.png")
            elif i % 3 == 1:
                Image.fromarray(img, "RGB").save(d / f"{i:02d}.png")
            else:
                Image.fromarray(img, "RGB").save(d / f"{i:02d}.jpg", quality=95)
    return root


def cifar_batch(n: int, seed: int, classes: int = 10, fine: bool = False) -> dict:
    """One batch as CIFAR's python pickles hold it: bytes keys, (n, 3072) uint8 rows of 1024
    red, 1024 green, 1024 blue values (each 32x32 row-major), labels as a list."""
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 256, (n, 32, 32, 3)).astype(np.uint8)
    y = [int(v) for v in rng.integers(0, classes, n)]
    rows = x.transpose(0, 3, 1, 2).reshape(n, 3072)
    key = b"fine_labels" if fine else b"labels"
    return {b"batch_label": b"testing batch", key: y, b"data": rows,
            b"filenames": [f"img_{i}.png".encode() for i in range(n)]}


def write_pickle(path: Path, obj) -> Path:
    with open(path, "wb") as f:
        pickle.dump(obj, f, protocol=2)
    return path


def make_cifar10(folder: Path, per_batch: int = 6, archive: bool = False) -> Path:
    """cifar-10-batches-py/ with data_batch_1..5, test_batch, batches.meta (or its .tar.gz)."""
    d = folder / "cifar-10-batches-py"
    d.mkdir(parents=True)
    for i in range(1, 6):
        write_pickle(d / f"data_batch_{i}", cifar_batch(per_batch, i))
    write_pickle(d / "test_batch", cifar_batch(per_batch, 99))
    names = [b"airplane", b"automobile", b"bird", b"cat", b"deer", b"dog", b"frog", b"horse",
             b"ship", b"truck"]
    write_pickle(d / "batches.meta", {b"label_names": names, b"num_cases_per_batch": per_batch,
                                      b"num_vis": 3072})
    if not archive:
        return d
    out = folder / "cifar-10-python.tar.gz"
    with tarfile.open(out, "w:gz") as tar:
        tar.add(d, arcname="cifar-10-batches-py")
    return out


def write_idx(path: Path, arr: np.ndarray, magic: int | None = None) -> Path:
    """An IDX ubyte file (gzip when the name ends in .gz)."""
    magic = (0x0800 | arr.ndim) if magic is None else magic
    data = magic.to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in arr.shape)
    data += arr.astype(np.uint8).tobytes()
    path.write_bytes(gzip.compress(data) if path.name.endswith(".gz") else data)
    return path


def fake_pair(folder: Path, prefix: str, n: int, seed: int = 0) -> Path:
    """MNIST's `{prefix}-images-idx3-ubyte` of n random 6x6 images and its labels file."""
    rng = np.random.default_rng(seed)
    write_idx(folder / f"{prefix}-labels-idx1-ubyte", rng.integers(0, 10, n))
    return write_idx(folder / f"{prefix}-images-idx3-ubyte", rng.integers(0, 256, (n, 6, 6)))
