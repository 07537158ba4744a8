"""Folders of image files (torchvision's ImageFolder layout) decoded with Pillow.

`root/<class name>/**/<image>`: one subfolder per class, class indices in sorted name order
(as torchvision and timm number them), files with an image extension in any depth below it.
Every image is converted to grey (`L`) or RGB, its shorter side resized to the target size
(bicubic, antialiased when shrinking) and the centre square cropped: the same preprocessing
for training, evaluation and `toymlx-classify`.
"""

from __future__ import annotations

import gzip
import io
import os
import sys
import threading
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, UnidentifiedImageError

from toymlx.backend.files import (
    IMAGE_MAGIC,
    hidden_below,
    names_below,
    not_read_line,
    not_utf8,
    shortlist,
    special_kind,
)
from toymlx.data.text import DataError

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm",
                    ".pgm", ".pbm")
"""File names (lower-cased) read as images; other files in a class folder are ignored."""

_GREY_MODES = ("1", "L", "LA", "I", "I;16", "I;16B", "I;16L", "I;16N", "F")

_NOTED_LARGE: set[Path | ImageBytes] = set()
_OPENING = threading.Lock()
"""Held while `_open` silences Pillow's large-image warning: `catch_warnings` saves and restores
the process's filters, which threads opening images at once would restore out of order."""


class ImageDataError(DataError):
    """An image data file or setting cannot be used; the message is one line naming it (a
    `DataError`, as a text or example file's is)."""


def read_file(path: Path) -> bytes:
    """A data file's bytes (a `.gz` file's decompressed), or ImageDataError naming it."""
    if kind := special_kind(path):
        raise ImageDataError(f"{path}: expected an image data file, found {kind}")
    try:
        if path.name.endswith(".gz"):
            with gzip.open(path, "rb") as f:
                return f.read()
        return path.read_bytes()
    except OSError as e:  # includes gzip.BadGzipFile
        raise ImageDataError(f"{path}: cannot read ({e.strerror or e})") from None
    except EOFError:
        raise ImageDataError(f"{path}: truncated gzip stream; re-download the file") from None


class ImageBytes:
    """One image's encoded bytes that no file name reaches (`toymlx-classify -`: stdin),
    decoded by `decode_image` as a file holding them would be; `name` ("-") stands for it in
    answers and messages."""

    def __init__(self, name: str, data: bytes) -> None:
        self.name, self.data = name, data

    def __str__(self) -> str:
        return self.name


def _remedy(path: Path | ImageBytes) -> str:
    return ("send one image file's bytes on stdin" if isinstance(path, ImageBytes)
            else "remove or replace the file")


def _open(path: Path | ImageBytes) -> Image.Image:
    try:
        # Pillow's own warning for a large image is two lines that do not name the file;
        # `_note_large` says it in one. Silenced here only: the caller's filters stay as they were
        with _OPENING, warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            im = Image.open(io.BytesIO(path.data) if isinstance(path, ImageBytes) else path)
        _note_large(path, im.size)
        return im
    except UnidentifiedImageError:
        raise ImageDataError(f"{path}: not an image Pillow can read: expected one of "
                             f"{', '.join(e[1:] for e in IMAGE_EXTENSIONS)}, found "
                             f"{_sniff(path)}; {_remedy(path)}") from None
    except OSError as e:
        if e.errno is None:  # Pillow's decoder ("Truncated File Read"): the file, not the OS
            raise ImageDataError(f"{path}: cannot decode the image ({e}): expected a whole "
                                 f"image file, found {_sniff(path)}; {_remedy(path)}") from None
        raise ImageDataError(f"{path}: cannot open ({e.strerror or e})") from None
    except (ValueError, SyntaxError, Image.DecompressionBombError) as e:
        # a header Pillow cannot parse (a PPM's "Token too long"), or past its pixel limit
        raise ImageDataError(f"{path}: cannot decode the image ({e}); {_remedy(path)}"
                             ) from None


def _note_large(path: Path | ImageBytes, size: tuple[int, int]) -> None:
    """One line on stderr, once a file, for an image over Pillow's pixel limit
    (`Image.MAX_IMAGE_PIXELS`; Pillow refuses one over twice that, as an error)."""
    limit, (w, h) = Image.MAX_IMAGE_PIXELS, size
    if limit is None or w * h <= limit or path in _NOTED_LARGE:
        return
    _NOTED_LARGE.add(path)
    print(f"toymlx: {path}: a large image, {w} x {h} = {w * h:,} pixels, over Pillow's "
          f"limit of {limit:,} for untrusted files; decoded as it is", file=sys.stderr)




def _sniff(path: Path | ImageBytes) -> str:
    try:
        if isinstance(path, ImageBytes):
            head, size = path.data[:16], len(path.data)
        else:
            with path.open("rb") as f:
                head, size = f.read(16), os.fstat(f.fileno()).st_size
    except OSError:
        return "an unreadable file"
    if not head:
        return "an empty file"
    kind = next((k for magic, k in IMAGE_MAGIC if head.startswith(magic)),
                "WEBP" if head[:4] == b"RIFF" and head[8:12] == b"WEBP" else None)
    if kind is not None:  # its kind, with a header Pillow cannot parse: a file cut short
        return f"a {kind} file of {size} bytes whose header Pillow cannot read (cut short?)"
    return f"bytes {head[:8]!r}"


def is_colour(path: Path) -> bool:
    """Whether the file's stored pixels have colour (reads the header only: `has_colour`)."""
    with _open(path) as im:
        return has_colour(im)


def has_colour(im: Image.Image) -> bool:
    """Whether an opened image's stored pixels can have colour: not a grey mode, nor a palette
    of greys alone (a GIF or palette PNG of grey digits; read with the header, no pixel
    decoded). Counted as colour, one such file made a grey set train as RGB, with flips."""
    if im.mode in _GREY_MODES:
        return False
    if im.mode in ("P", "PA"):
        pal = im.getpalette()  # [r, g, b, r, g, b, ...]
        return pal is None or any(pal[i] != pal[i + 1] or pal[i] != pal[i + 2]
                                  for i in range(0, len(pal) - 2, 3))
    return True


def image_size(path: Path) -> tuple[int, int]:
    """(width, height) from the header."""
    with _open(path) as im:
        return im.size


def resize_and_crop(w: int, h: int, size: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """((width, height) the shorter side resized to `size`, (left, top) of the centre
    `size` square) for a w x h image: torchvision's `Resize(size)` then `CenterCrop(size)`
    arithmetic (the longer side truncated, the crop's offset rounded half to even), which
    timm's evaluation transform applies; rounded otherwise, a JPEG of 65 x 57 was cropped a
    pixel off timm's, and toymlx-classify's answer for it was not timm's on the same file."""
    if w <= h:
        nw, nh = size, int(size * h / w)
    else:
        nw, nh = int(size * w / h), size
    return (nw, nh), (round((nw - size) / 2.0), round((nh - size) / 2.0))


def decode_image(path: str | Path | ImageBytes, size: int, channels: int) -> np.ndarray:
    """One image file (or its bytes) -> (size, size, channels) uint8: grey or RGB, shorter
    side resized to `size`, centre-cropped."""
    path = path if isinstance(path, ImageBytes) else Path(path)
    mode = "L" if channels == 1 else "RGB"
    im = _open(path)
    try:
        with im:
            im.draft(mode, (size, size))  # JPEG: decode at a reduced scale when it is larger
            if im.mode.startswith("I;16") or im.mode in ("I", "F"):
                a = np.asarray(im, np.float32)  # 16-bit or float grey: to 8 bits
                im = Image.fromarray(np.clip(a / (257 if im.mode != "F" else 1 / 255), 0, 255)
                                     .astype(np.uint8))
            # transparency goes with the alpha (timm's convert drops it too); a palette's kept
            # as bytes made Pillow warn in two lines naming no file, once a process, each convert
            im.info.pop("transparency", None)
            im = im.convert(mode)
            (nw, nh), (left, top) = resize_and_crop(*im.size, size)
            if (nw, nh) != im.size:
                im = im.resize((nw, nh), Image.Resampling.BICUBIC)
            im = im.crop((left, top, left + size, top + size))
            a = np.asarray(im, np.uint8)
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        # Pillow reports a truncated or corrupt stream as OSError or SyntaxError
        raise ImageDataError(f"{path}: cannot decode the image ({e}); {_remedy(path)}"
                             ) from None
    return a.reshape(size, size, channels)


def images_below(folder: Path) -> list[Path]:
    """The image files below `folder` (`files_below`'s first list)."""
    return files_below(folder)[0]


def files_below(folder: Path) -> tuple[list[Path], list[Path]]:
    """(the image files below `folder` (by extension), the other files), hidden names (and
    what hidden folders hold, `hidden_below`) skipped in both, sorted, as `names_below` walks it (through linked subfolders, as torchvision's
    ImageFolder does); ImageDataError naming an image name that is a FIFO, a device or a
    socket (opening it could wait forever) or a link to nothing: skipping either would drop an
    image without a word. The other files (a notes.txt, a Thumbs.db, an iPhone's .heic, a
    Windows .jfif) are for the caller to name: they are not read."""
    found, others = [], []
    try:
        below = list(names_below(folder))
    except ValueError as e:  # a link back up the tree
        raise ImageDataError(str(e)) from None
    for p in below:
        if hidden_below(p, folder):
            continue
        if p.suffix.lower() not in IMAGE_EXTENSIONS:
            if p.is_file():
                others.append(p)
            continue
        if kind := special_kind(p):
            raise ImageDataError(f"{p}: expected an image file, found {kind}; remove it or "
                                 "put the image there")
        if p.is_symlink() and not p.exists():
            raise ImageDataError(f"{p}: expected an image file, found a link to "
                                 f"{os.readlink(p)}, which does not exist; restore its "
                                 "target or remove the link")
        if p.is_file():
            found.append(p)
    return sorted(found), sorted(others)


def not_read_note(root: Path, others: Sequence[Path]) -> str | None:
    """One line naming the files in `root`'s folders that are not read, their names not an
    image's (`files_below`'s second list), counted by extension; None for none. Left out
    without a word, a class of .heic photos or .jfif downloads trained on what remained."""
    return not_read_line(root, others, "images", IMAGE_EXTENSIONS,
                         "convert or rename any image among them to a format read")


def subfolders(root: Path) -> list[Path]:
    """The folders directly in `root` (linked ones too), hidden names skipped, sorted;
    ImageDataError naming a link to nothing among its names: a class folder linked from a
    disk not mounted dropped out of the classes without a word."""
    found = []
    for d in sorted(root.iterdir()):
        if d.name.startswith("."):
            continue
        if d.is_symlink() and not d.exists():
            raise ImageDataError(f"{d}: expected a folder of images, found a link to "
                                 f"{os.readlink(d)}, which does not exist; restore its target "
                                 "or remove the link")
        if d.is_dir():
            found.append(d)
    return found


SPLIT_NAMES = {"train": ("train", "training"),
               "val": ("val", "valid", "validation", "eval", "evaluation"), "test": ("test",)}
"""Subfolder names timm's `--data-dir` takes as splits rather than classes, by split."""


def split_folders(root: str | Path) -> dict[str, Path] | None:
    """timm's layout, `root/train/<class>/...` beside `root/val/<class>/...` (and `test/`): the
    split folders found ({"train": ..., "val": ..., "test": ...}) when every subfolder of `root`
    is named as a split, one is the training split, and it holds class subfolders; else None
    (the subfolders are classes)."""
    root = Path(root)
    if not root.is_dir():
        return None
    subs = subfolders(root)
    split_of = {d: split for d in subs for split, names in SPLIT_NAMES.items()
                if d.name in names}
    train = [d for d, split in split_of.items() if split == "train"]
    if len(split_of) != len(subs) or not train \
            or not any(d.is_dir() for t in train for d in t.iterdir()):
        return None
    found: dict[str, Path] = {}
    for d, split in split_of.items():
        if split in found:
            raise ImageDataError(f"{root}: expected one {split} folder (timm's layout), found "
                                 f"{found[split].name}/ and {d.name}/; merge or rename one")
        found[split] = d
    return found


def scan_image_folder(root: str | Path, min_classes: int = 2
                      ) -> tuple[list[Path], np.ndarray, list[str], list[Path]]:
    """(files, labels, class names, the other files not read) of an ImageFolder tree, in
    sorted order (`files_below`); a training set needs two classes, a validation or test set
    (`min_classes=1`) one."""
    root = Path(root)
    classes = [d.name for d in subfolders(root)]
    if not classes:
        raise ImageDataError(f"{root}: expected one subfolder of images per class, found no "
                             "subfolders")
    for name in classes:  # class names are text in events.jsonl and the checkpoint's metadata
        if found := not_utf8(name):
            raise ImageDataError(f"{root / name}: expected a class folder named in UTF-8 (its "
                                 f"name is the class's, recorded as text), found {found}; "
                                 "rename it")
    files: list[Path] = []
    labels: list[int] = []
    others: list[Path] = []
    for k, name in enumerate(classes):
        found, other = files_below(root / name)
        others += other
        if not found:
            raise ImageDataError(f"{root / name}: class folder has no images: expected at least "
                                 f"one file named *{', *'.join(IMAGE_EXTENSIONS[:3])}, ..., found "
                                 "none; add images or remove the folder")
        files += found
        labels += [k] * len(found)
    if len(classes) < min_classes:
        inner = [d.name for d in subfolders(root / classes[0])]
        fix = (f"; its subfolders ({shortlist(inner, 3)}) look like the classes: --data.path "
               f"{root / classes[0]}" if len(inner) >= 2 else "")  # one folder too high
        raise ImageDataError(f"{root}: expected at least 2 class subfolders, found 1 "
                             f"({classes[0]!r}); a classifier needs two or more classes{fix}")
    return files, np.asarray(labels, np.int64), classes, others


NAMED_BAD = 3
"""How many unreadable images one error line names in full (`each_image`); the rest counted."""


def each_image(fn: Callable[[int], Any], n: int, workers: int = 0, chunksize: int = 32
               ) -> list[Any]:
    """[fn(0), ..., fn(n - 1)] (by `workers` threads; 0: in this one); ImageDataError naming
    every index that failed, the first `NAMED_BAD` in full and the others counted: named one
    at a time, a set with several bad files took a run per file to find them."""
    errors: list[tuple[int, str]] = []

    def one(i: int) -> Any:
        try:
            return fn(i)
        except ImageDataError as e:
            errors.append((i, str(e)))
            return None

    if workers:
        with ThreadPoolExecutor(workers) as pool:
            got = list(pool.map(one, range(n), chunksize=chunksize))
    else:
        got = [one(i) for i in range(n)]
    if len(errors) == 1:
        raise ImageDataError(errors[0][1])
    if errors:
        named = [e.removesuffix("; remove or replace the file") for _, e in sorted(errors)]
        more = len(named) - NAMED_BAD
        raise ImageDataError(f"{len(named)} images cannot be read: {'; '.join(named[:NAMED_BAD])}"
                             + (f"; and {more} more" if more > 0 else "")
                             + "; remove or replace them")
    return got


def probe(files: Sequence[Path], workers: int) -> tuple[bool, set[tuple[int, int]]]:
    """(any colour image, the set of image sizes) from the headers of `files`."""
    def one(i: int) -> tuple[bool, tuple[int, int]]:
        with _open(files[i]) as im:
            return has_colour(im), im.size

    got = each_image(one, len(files), max(workers, 1), chunksize=64)
    return any(c for c, _ in got), {s for _, s in got}


class ImageFiles:
    """Image files that decode when indexed: `files[idx]` -> (len(idx), size, size, C) uint8."""

    dtype = np.dtype(np.uint8)

    def __init__(self, files: Sequence[Path], size: int, channels: int):
        self.files, self.size, self.channels = list(files), size, channels

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (len(self.files), self.size, self.size, self.channels)

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, idx) -> np.ndarray:
        if isinstance(idx, slice):
            idx = np.arange(len(self.files))[idx]
        idx = np.atleast_1d(np.asarray(idx))
        out = np.empty((len(idx), self.size, self.size, self.channels), np.uint8)

        def one(j: int) -> None:
            out[j] = decode_image(self.files[int(idx[j])], self.size, self.channels)

        each_image(one, len(idx))
        return out

    def subset(self, idx: np.ndarray) -> ImageFiles:
        return ImageFiles([self.files[int(i)] for i in idx], self.size, self.channels)

    def decode_all(self, workers: int) -> np.ndarray:
        """Every image in memory, decoded by `workers` threads (Pillow releases the GIL)."""
        out = np.empty(self.shape, np.uint8)

        def one(i: int) -> None:
            out[i] = decode_image(self.files[i], self.size, self.channels)

        each_image(one, len(self.files), max(workers, 1))
        return out
