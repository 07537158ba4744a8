"""Use a trained ViT: classify image files, and report accuracy per class with a confusion matrix.

A checkpoint carries what it needs: its shape (`vit.*`), input normalisation (`toy.pixel_*`)
and class names (`toy.class_names`). Image files are decoded as training decoded them
(`toymlx.data.image_folder.decode_image`: grey or RGB, shorter side resized, centre crop), scaled
by 1/255 and standardised with the checkpoint's mean and std.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import mlx.core as mx
import numpy as np

from toymlx.backend.atomic import atomic_open, output_folder
from toymlx.backend.files import counted, nothing_there, special_kind
from toymlx.backend.progress import pass_bar
from toymlx.bundle.checkpoint import checkpoint_file
from toymlx.data.image_folder import (
    IMAGE_EXTENSIONS,
    ImageBytes,
    ImageDataError,
    decode_image,
    files_below,
    not_read_note,
)
from toymlx.gguf.llama import ARCHS
from toymlx.gguf.reader import VOCAB_ONLY, GGUFError, GGUFFile
from toymlx.gguf.vit import class_names, load_vit
from toymlx.models.vit import ViT


def listed(files: Any) -> list[Any]:
    """`files`, images in any iterable (a list, `Path.glob`'s generator, which had no len()), as
    a list; TypeError naming `files` for one file given instead (a str was read a character at
    a time: "/: cannot open (Is a directory)"), or for what is not a collection of them."""
    if isinstance(files, (str, bytes, os.PathLike)):
        raise TypeError(f"files: expected a list of image files, found one {type(files).__name__}"
                        f" ({files!r}); pass [{files!r}]")
    if not isinstance(files, Iterable):  # `top_k(5)` was "object of type 'int' has no len()"
        raise TypeError(f"files: expected a list of image files, found {type(files).__name__} "
                        f"({files!r})")
    return list(files)


@dataclass
class Classifier:
    """A ViT checkpoint with its preprocessing and class names."""

    model: ViT
    names: list[str]
    mean: np.ndarray
    std: np.ndarray
    scale: float
    path: Path

    @classmethod
    def load(cls, model: str | Path) -> Classifier:
        path = checkpoint_file(model)
        with GGUFFile(path) as g:
            arch, vocab_only = g.metadata.get("general.architecture"), not g.tensors
        if vocab_only:  # whatever its architecture: no command runs it (not toymlx-generate)
            raise GGUFError(f"{path}: expected a ViT checkpoint (an image classifier), found "
                            f"a {arch!r} vocabulary only: {VOCAB_ONLY}")
        if arch in ARCHS:  # a language model's run or file: named as typed, its file beside
            given = path if Path(model) == path else f"{model} ({path})"
            raise GGUFError(f"{given}: metadata key 'general.architecture': expected 'vit' (an "
                            f"image classifier), found {arch!r}, a language model: "
                            f"toymlx-generate --model {model} uses it")
        vit, norm, g = load_vit(path)
        vit.eval()
        c = vit.args.channels
        mean = np.asarray(norm.get("toy.pixel_mean", [0.0] * c), np.float32)
        std = np.asarray(norm.get("toy.pixel_std", [1.0] * c), np.float32)
        return cls(vit, class_names(g), mean, std, float(norm.get("toy.pixel_scale", 255.0)),
                   path)

    @property
    def image_size(self) -> int:
        return self.model.args.image_size

    @property
    def channels(self) -> int:
        return self.model.args.channels

    def read(self, files: Sequence[Path]) -> np.ndarray:
        """Image files -> (N, S, S, C) float32, standardised as the model was trained."""
        return self._standardised(np.stack([decode_image(f, self.image_size, self.channels)
                                            for f in listed(files)]))

    def _standardised(self, x: np.ndarray) -> np.ndarray:
        return ((x.astype(np.float32) / 255.0 - self.mean) / self.std).astype(np.float32)

    def probabilities(self, images: np.ndarray, batch_size: int = 64) -> np.ndarray:
        """Softmax over the classes, (N, K) float32, for standardised images."""
        out = []
        for i in range(0, len(images), batch_size):
            logits = self.model(mx.array(images[i:i + batch_size]))
            out.append(np.asarray(mx.softmax(logits.astype(mx.float32), axis=-1)))
        return np.concatenate(out) if out else np.zeros((0, len(self.names)), np.float32)

    def top_k(self, files: Sequence[Path], k: int = 5, batch_size: int = 64
              ) -> list[list[tuple[str, float]]]:
        """For each file the k most probable (class name, probability), most probable first."""
        res, files = [], listed(files)
        for i in range(0, len(files), batch_size):
            res += self._ranked(self.probabilities(self.read(files[i:i + batch_size]),
                                                   batch_size), k)
        return res

    def each_top_k(self, files: Sequence[Input], k: int = 5, batch_size: int = 64
                   ) -> Iterator[tuple[Input, list[tuple[str, float]] | ImageDataError]]:
        """(file, its `top_k`) in order, a batch at a time as each is computed; a file that
        cannot be decoded comes with its ImageDataError instead (and an ImageDataError of
        `image_files` with itself), and the others are classified (one corrupt image in a
        folder of thousands no longer costs every answer)."""
        files = listed(files)
        for i in range(0, len(files), batch_size):
            chunk, read, failed = files[i:i + batch_size], [], {}
            for f in chunk:
                try:
                    if isinstance(f, ImageDataError):  # a name that gave no image
                        failed[f] = f
                    else:
                        read.append(decode_image(f, self.image_size, self.channels))
                except ImageDataError as e:
                    failed[f] = e
            x = np.stack(read) if read else np.zeros((0, 0), np.float32)
            tops = iter(self._ranked(self.probabilities(self._standardised(x), batch_size), k)
                        if read else [])
            for f in chunk:
                yield f, failed[f] if f in failed else next(tops)

    def _ranked(self, p: np.ndarray, k: int) -> list[list[tuple[str, float]]]:
        order = np.argsort(-p, axis=1, kind="stable")[:, :k]
        return [[(self.names[j], float(row[j])) for j in o] for row, o in zip(p, order)]


STDIN_IMAGE_LIMIT = 256 * 2**20
"""Most bytes `-` takes from stdin: an uncompressed RGB image at Pillow's pixel limit
(`Image.MAX_IMAGE_PIXELS`, 89,478,485 pixels x 3 bytes). An endless stream (`yes |`) would be
read until memory ran out; a larger image is classified by its file's name."""


def stdin_image(stream: BinaryIO | None) -> ImageBytes:
    """The one image whose bytes `stream` (stdin) holds, named "-"; ImageDataError for a
    terminal, a closed or empty stdin, or more than STDIN_IMAGE_LIMIT bytes."""
    if stream is None:
        raise ImageDataError("-: expected one image's bytes on stdin, found stdin closed")
    if stream.isatty():  # an image is never typed: reading would wait for Ctrl-D
        raise ImageDataError("-: expected one image's bytes piped or redirected to stdin "
                             "(cat x.png | toymlx-classify --model RUN -), found a terminal")
    try:
        data = stream.read(STDIN_IMAGE_LIMIT + 1)
    except OSError as e:  # `< folder`: EISDIR
        raise ImageDataError(f"-: cannot read stdin ({e.strerror or e})") from None
    if not data:
        raise ImageDataError("-: expected one image's bytes on stdin, found none (stdin was "
                             "empty)")
    if len(data) > STDIN_IMAGE_LIMIT:
        raise ImageDataError(f"-: expected one image's bytes on stdin, at most "
                             f"{STDIN_IMAGE_LIMIT:,} bytes (an uncompressed RGB image at "
                             "Pillow's pixel limit), found more; is stdin an endless stream? "
                             "A larger image: give its file's name")
    return ImageBytes("-", data)


Input = Path | ImageBytes | ImageDataError
"""An image to classify: a file, the bytes read from stdin, or why a name gave none."""


def image_files(paths: Iterable[str | Path], stdin: BinaryIO | None = None) -> list[Input]:
    """Files named on the command line, folders expanded to the images below them (sorted),
    "-" one image read from `stdin` (a file named "-": "./-"). A name that gives no image
    (nothing there, an empty folder, a FIFO, stdin empty) is its ImageDataError in its place,
    so that the others are still classified, as `file` and `identify` go on over a glob."""
    paths = [str(p) for p in paths]
    if (n := paths.count("-")) > 1:
        raise ImageDataError(f"IMAGE_OR_DIR: expected '-' (one image read from stdin) at most "
                             f"once, found it {n} times; name the other images by their files")
    out: list[Input] = []
    for name in paths:
        try:
            out += [stdin_image(stdin)] if name == "-" else _expand(Path(name))
        except ImageDataError as e:
            out.append(e)
    return out


def input_name(f: Path | ImageBytes) -> str:
    """The name an answer is printed under: the file's path, with the "./" that Path drops
    kept before a name starting with "-" (a file named "-" is "./-", stdin's image "-")."""
    name = str(f)
    return f"./{name}" if isinstance(f, Path) and name.startswith("-") else name


def _expand(p: Path) -> list[Path]:
    name = input_name(p)
    if p.is_dir():
        found, others = files_below(p)
        if note := not_read_note(p, others):  # as training says it: not dropped without a word
            print(f"toymlx: {note}", file=sys.stderr)
        if not found:
            raise ImageDataError(f"{name}: expected image files ({', '.join(IMAGE_EXTENSIONS)}) "
                                 "in the folder, found none")
        return found
    if p.is_file():
        return [p]
    if kind := special_kind(p):
        raise ImageDataError(f"{name}: expected an image file or a folder, found {kind}; for "
                             "one image sent on stdin, name it -")
    raise ImageDataError(f"{name}: expected an image file or a folder, found {nothing_there(p)}")


def predict(clf: Classifier, batches: Iterable[dict[str, np.ndarray]], images: int = 0,
            progress: str | None = None) -> tuple[np.ndarray, np.ndarray, float]:
    """(predicted, true labels, summed cross-entropy) over validation batches (label -1:
    padding, dropped). `progress`: the name of a bar on stderr where that is a terminal
    (`pass_bar`), counting the images scored (their labels) of `images`."""
    preds, labels, loss = [], [], 0.0
    with pass_bar(images, progress, "image") as bar:
        for b in batches:
            x, y = b["images"].reshape(-1, *b["images"].shape[-3:]), b["labels"].reshape(-1)
            keep = y >= 0
            logits = clf.model(mx.array(x)).astype(mx.float32)
            ce = np.asarray(clf.model.ops.cross_entropy(logits, mx.array(np.maximum(y, 0))))
            preds.append(np.asarray(mx.argmax(logits, axis=-1))[keep])
            labels.append(y[keep])
            loss += float(ce[keep].sum())
            if bar is not None:
                bar.update(int(keep.sum()))
    return np.concatenate(preds), np.concatenate(labels), loss


def confusion(pred: np.ndarray, true: np.ndarray, k: int) -> np.ndarray:
    """(K, K) counts: row = true class, column = predicted class."""
    m = np.zeros((k, k), np.int64)
    np.add.at(m, (true, pred), 1)
    return m


def report(m: np.ndarray, names: list[str]) -> dict[str, Any]:
    """Accuracy, per-class accuracy (recall) and the matrix, JSON-ready."""
    total = int(m.sum())
    per = {n: (float(m[i, i] / m[i].sum()) if m[i].sum() else None, int(m[i].sum()))
           for i, n in enumerate(names)}
    return {"accuracy": float(np.trace(m) / total) if total else 0.0, "images": total,
            "per_class": {n: {"accuracy": a, "images": c} for n, (a, c) in per.items()},
            "confusion": m.tolist()}


def format_report(m: np.ndarray, names: list[str]) -> str:
    """A text table of per-class accuracy, then the confusion matrix (rows: true class)."""
    r = report(m, names)
    w = max(5, *(len(n) for n in names))
    lines = [f"accuracy {r['accuracy']:.4f} on {counted(r['images'], 'image')}", "",
             f"{'class':<{w}}  images  accuracy"]
    for n in names:
        a, c = r["per_class"][n]["accuracy"], r["per_class"][n]["images"]
        lines.append(f"{n:<{w}}  {c:>6}  {'-' if a is None else f'{a:.4f}':>8}")
    # each column as wide as its whole class name: cut to 6 characters, two names sharing their
    # first six (airplane_a, airplane_b) headed two columns alike
    cws = [max(4, len(n) + 1, len(str(int(m[:, j].max()))) + 1)
           for j, n in enumerate(names)]
    lines += ["", "confusion matrix (rows: true class, columns: predicted)",
              " " * w + "".join(f"{n:>{cw}}" for n, cw in zip(names, cws))]
    for i, n in enumerate(names):
        lines.append(f"{n:<{w}}" + "".join(f"{v:>{cw}}" for v, cw in zip(m[i], cws)))
    return "\n".join(lines)


def plot_confusion(m: np.ndarray, names: list[str], out: str | Path) -> Path:
    """The confusion matrix as a PNG (rows normalised to each class's count)."""
    import matplotlib  # the report extra; imported here so classification needs no matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    k = len(names)
    norm = m / np.maximum(m.sum(axis=1, keepdims=True), 1)
    size = min(2 + 0.45 * k, 24)
    fig, ax = plt.subplots(figsize=(size, size * 0.9))
    im = ax.imshow(norm, cmap="Blues", vmin=0, vmax=1)
    ax.set_xticks(range(k), names, rotation=90 if k > 10 else 45, ha="right" if k <= 10 else "center")
    ax.set_yticks(range(k), names)
    ax.set_xlabel("predicted class")
    ax.set_ylabel("true class")
    if k <= 30:
        for i in range(k):
            for j in range(k):
                if m[i, j]:
                    ax.text(j, i, str(m[i, j]), ha="center", va="center", fontsize=8,
                            color="white" if norm[i, j] > 0.5 else "black")
    fig.colorbar(im, ax=ax, fraction=0.046, label="fraction of the true class")
    ax.set_title(f"accuracy {np.trace(m) / max(m.sum(), 1):.4f} on "
                 f"{counted(int(m.sum()), 'image')}")
    fig.tight_layout()
    out = Path(out)
    # its folder made as toymlx-export's --out is: a missing one was an errno line, after the work
    with output_folder(out.parent), atomic_open(out) as f:
        fig.savefig(f, format="png", dpi=110)
    plt.close(fig)
    return out
