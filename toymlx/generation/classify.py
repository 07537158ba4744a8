"""Use a trained ViT: classify image files, and report accuracy per class with a confusion matrix.

A checkpoint carries what it needs: its shape (`vit.*`), input normalisation (`toy.pixel_*`)
and class names (`toy.class_names`). Image files are decoded as training decoded them
(`toymlx.data.image_folder.decode_image`: grey or RGB, shorter side resized, centre crop), scaled
by 1/255 and standardised with the checkpoint's mean and std.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from toymlx.backend.atomic import atomic_open
from toymlx.backend.files import special_kind
from toymlx.bundle.checkpoint import checkpoint_file
from toymlx.data.image_folder import (
    IMAGE_EXTENSIONS,
    ImageDataError,
    decode_image,
    images_below,
)
from toymlx.gguf.llama import ARCHS
from toymlx.gguf.reader import GGUFError, GGUFFile
from toymlx.gguf.vit import class_names, load_vit
from toymlx.models.vit import ViT


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
            arch = g.metadata.get("general.architecture")
        if arch in ARCHS:  # a language model's run or file
            raise GGUFError(f"{path}: metadata key 'general.architecture': expected 'vit' (an "
                            f"image classifier), found {arch!r}, a language model: "
                            f"toymlx-generate --model {path} uses it")
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
                                            for f in files]))

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
        res = []
        for i in range(0, len(files), batch_size):
            res += self._ranked(self.probabilities(self.read(files[i:i + batch_size]),
                                                   batch_size), k)
        return res

    def each_top_k(self, files: Sequence[Path], k: int = 5, batch_size: int = 64
                   ) -> Iterator[tuple[Path, list[tuple[str, float]] | ImageDataError]]:
        """(file, its `top_k`) in order, a batch at a time as each is computed; a file that
        cannot be decoded comes with its ImageDataError instead, and the others are classified
        (one corrupt image in a folder of thousands no longer costs every answer)."""
        for i in range(0, len(files), batch_size):
            chunk, read, failed = files[i:i + batch_size], [], {}
            for f in chunk:
                try:
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


def image_files(paths: Iterable[str | Path]) -> list[Path]:
    """Files named on the command line, folders expanded to the images below them (sorted)."""
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = images_below(p)
            if not found:
                raise ImageDataError(f"{p}: expected image files ({', '.join(IMAGE_EXTENSIONS)}) "
                                     "in the folder, found none")
            out += found
        elif p.is_file():
            out.append(p)
        elif kind := special_kind(p):
            raise ImageDataError(f"{p}: expected an image file or a folder, found {kind}")
        else:
            raise ImageDataError(f"{p}: no such file or directory")
    return out


def predict(clf: Classifier, batches: Iterable[dict[str, np.ndarray]]
            ) -> tuple[np.ndarray, np.ndarray, float]:
    """(predicted, true labels, summed cross-entropy) over validation batches (label -1:
    padding, dropped)."""
    preds, labels, loss = [], [], 0.0
    for b in batches:
        x, y = b["images"].reshape(-1, *b["images"].shape[-3:]), b["labels"].reshape(-1)
        keep = y >= 0
        logits = clf.model(mx.array(x)).astype(mx.float32)
        ce = np.asarray(clf.model.ops.cross_entropy(logits, mx.array(np.maximum(y, 0))))
        preds.append(np.asarray(mx.argmax(logits, axis=-1))[keep])
        labels.append(y[keep])
        loss += float(ce[keep].sum())
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
    lines = [f"accuracy {r['accuracy']:.4f} on {r['images']} images", "",
             f"{'class':<{w}}  images  accuracy"]
    for n in names:
        a, c = r["per_class"][n]["accuracy"], r["per_class"][n]["images"]
        lines.append(f"{n:<{w}}  {c:>6}  {'-' if a is None else f'{a:.4f}':>8}")
    cw = max(4, len(str(int(m.max()) if m.size else 0)) + 1, *(min(len(n), 6) + 1 for n in names))
    lines += ["", "confusion matrix (rows: true class, columns: predicted)",
              " " * w + "".join(f"{n[:6]:>{cw}}" for n in names)]
    for i, n in enumerate(names):
        lines.append(f"{n:<{w}}" + "".join(f"{v:>{cw}}" for v in m[i]))
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
    ax.set_title(f"accuracy {np.trace(m) / max(m.sum(), 1):.4f} on {int(m.sum())} images")
    fig.tight_layout()
    out = Path(out)
    with atomic_open(out) as f:
        fig.savefig(f, format="png", dpi=110)
    plt.close(fig)
    return out
