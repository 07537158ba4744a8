"""CIFAR-10 / CIFAR-100 "python version" batches: a folder, its .tar.gz, or one batch file.

The files are pickles of `{b"data": (N, 3072) uint8 rows (1024 red, 1024 green, 1024 blue, each
row-major 32x32), b"labels" (CIFAR-10) or b"fine_labels" (CIFAR-100): N ints, ...}`; the
class names are in `batches.meta` (`label_names`) or `meta` (`fine_label_names`). A pickle can
run code when loaded, so these are read with an unpickler that only rebuilds plain containers
and numpy arrays.
"""

from __future__ import annotations

import io
import pickle
import tarfile
from pathlib import Path
from typing import Any

import numpy as np

from toymlx.data.image_folder import ImageDataError, read_file

CIFAR10_TRAIN = tuple(f"data_batch_{i}" for i in range(1, 6))
_LAYOUTS = (  # (train batches, test batch, meta file, labels key, names key)
    (CIFAR10_TRAIN, "test_batch", "batches.meta", b"labels", b"label_names"),
    (("train",), "test", "meta", b"fine_labels", b"fine_label_names"),
)
_ALLOWED = {("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode"),
            ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
            ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar")}


class _ArraysOnly(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _ALLOWED:
            raise pickle.UnpicklingError(f"global {module}.{name} is not allowed")
        if module.startswith("numpy.core."):  # numpy 2 moved it; the old name still pickles
            module = "numpy._core." + module[len("numpy.core."):]
        return super().find_class(module, name)


def _unpickle(data: bytes, where: str) -> dict:
    try:
        out = _ArraysOnly(io.BytesIO(data), encoding="bytes").load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError,
            KeyError, ImportError, OverflowError, MemoryError) as e:  # a malformed pickle
        raise ImageDataError(f"{where}: not a CIFAR python batch ({type(e).__name__}: {e}); "
                             "expected a file from cifar-10-python.tar.gz or "
                             "cifar-100-python.tar.gz") from None
    if not isinstance(out, dict):
        raise ImageDataError(f"{where}: not a CIFAR python batch: expected a dict, found "
                             f"{type(out).__name__}")
    return {k.decode() if isinstance(k, bytes) else k: v for k, v in out.items()}


def _batch(d: dict, where: str) -> tuple[np.ndarray, np.ndarray]:
    """(N, 32, 32, 3) uint8 images and (N,) labels of one unpickled batch."""
    data = d.get("data")
    key = "labels" if "labels" in d else "fine_labels"
    if not isinstance(data, np.ndarray) or data.ndim != 2 or data.shape[1] != 3072:
        found = getattr(data, "shape", type(data).__name__)
        raise ImageDataError(f"{where}: key 'data': expected (N, 3072) uint8 rows, found {found}")
    if key not in d or len(d[key]) != len(data):
        found = len(d[key]) if key in d else "no labels or fine_labels key"
        raise ImageDataError(f"{where}: labels: expected {len(data)} (one per row of data), "
                             f"found {found}")
    x = np.asarray(data, np.uint8).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)  # (N, H, W, C)
    return np.ascontiguousarray(x), np.asarray(d[key], np.int64)


def _names(d: dict, key: bytes) -> list[str]:
    names = d.get(key.decode(), [])
    return [n.decode() if isinstance(n, bytes) else str(n) for n in names]


def is_cifar(path: Path) -> bool:
    """Whether `path` looks like CIFAR python batches (folder, archive or batch file)."""
    if path.is_dir():
        return any((path / m).exists() or any(path.glob(f"*/{m}")) for m in ("batches.meta", "meta"))
    return path.name.endswith((".tar.gz", ".tgz")) or path.name in (
        *CIFAR10_TRAIN, "test_batch", "train", "test")


def load_cifar(path: str | Path) -> tuple[np.ndarray, np.ndarray, int | None, list[str]]:
    """(images (N, 32, 32, 3) uint8, labels, n_train or None, class names) of CIFAR batches.

    A folder or archive keeps the official split (the training batches first, then the test
    batch: n_train says where); a single batch file has no split of its own.
    """
    path = Path(path)
    if path.is_file() and not path.name.endswith((".tar.gz", ".tgz")):
        x, y = _batch(_unpickle(read_file(path), str(path)), str(path))
        meta = next((path.with_name(m) for m in ("batches.meta", "meta")
                     if path.with_name(m).exists()), None)
        names = []
        if meta is not None:
            key = _LAYOUTS[0][4] if meta.name == "batches.meta" else _LAYOUTS[1][4]
            names = _names(_unpickle(read_file(meta), str(meta)), key)
        return x, y, None, _check_names(names, y, str(path))
    files = _archive_members(path) if path.is_file() else _folder_members(path)
    for train, test, meta, _, names_key in _LAYOUTS:
        if meta in files:
            missing = [m for m in (*train, test) if m not in files]
            if missing:
                raise ImageDataError(f"{path}: CIFAR batches missing: expected {', '.join(missing)} "
                                     f"beside {meta}, found {', '.join(sorted(files))}")
            parts = [_batch(_unpickle(files[m](), f"{path}:{m}"), f"{path}:{m}")
                     for m in (*train, test)]
            names = _names(_unpickle(files[meta](), f"{path}:{meta}"), names_key)
            x = np.concatenate([p[0] for p in parts])
            y = np.concatenate([p[1] for p in parts])
            return x, y, len(x) - len(parts[-1][0]), _check_names(names, y, str(path))
    raise ImageDataError(f"{path}: expected CIFAR python batches (batches.meta with data_batch_1-5 "
                         "and test_batch, or meta with train and test), found "
                         f"{', '.join(sorted(files)) or 'no such files'}")


def _check_names(names: list[str], y: np.ndarray, where: str) -> list[str]:
    if names and len(y) and int(y.max()) >= len(names):
        raise ImageDataError(f"{where}: label {int(y.max())}: expected < {len(names)} (the class "
                             "names in the meta file)")
    return names


def batch_files(path: Path, trained: bool = False) -> list[Path]:
    """The files of a CIFAR folder's batches: in `path` or its one subfolder that has the meta
    file; `trained`: the training batches alone (not test_batch, test or the meta file)."""
    for d in [path, *sorted(p for p in path.iterdir() if p.is_dir())]:
        if (d / "batches.meta").exists() or (d / "meta").exists():
            train = {n for layout in _LAYOUTS for n in layout[0]}
            return sorted(p for p in d.iterdir() if p.is_file() and (not trained
                                                                     or p.name in train))
    return []


def _folder_members(path: Path) -> dict[str, Any]:
    """{file name: reader} for the batch files in `path` or its one subfolder that has them."""
    return {p.name: (lambda p=p: read_file(p)) for p in batch_files(path)}


def _archive_members(path: Path) -> dict[str, Any]:
    """{file name: reader} of the regular files in a CIFAR .tar.gz, read into memory once."""
    try:
        with tarfile.open(path, "r:gz") as tar:
            out = {}
            for m in tar.getmembers():
                if m.isfile():
                    data = tar.extractfile(m).read()
                    out[Path(m.name).name] = lambda data=data: data
            return out
    except (OSError, tarfile.TarError, EOFError) as e:
        raise ImageDataError(f"{path}: cannot read as a .tar.gz ({e}); re-download the "
                             "archive") from None
