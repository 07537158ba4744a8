"""Streaming an ImageFolder from disk: images/s with and without background decoding.

Writes a synthetic ImageFolder of JPEG photos-sized files (default 640 files of 320x240, 10
classes), then measures, alternating the two variants `--rounds` times:
1. the loader alone: `ImageSet.train_batch` per step (decode + resize + augment + normalise)
   in the calling thread, against `Prefetcher` with `--workers` background threads;
2. training: `toymlx-train --recipe vit-tiny --data.stream True` with `--data.workers 0` and
   `--data.workers N`, median images/s of the steps after the first (events.jsonl).

Prints figures and the ratio; asserts nothing (this machine's timings are noisy).
    python scripts/bench_image_loading.py [--files 640] [--size 64] [--steps 24]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image
from toymlx_cli.train import main as train_main

from toymlx.bundle.events import read_events
from toymlx.data.images import Augment, Prefetcher, load_images


def make_folder(root: Path, files: int, classes: int = 10, seed: int = 0) -> Path:
    """JPEGs of 320x240 with smooth colour fields (compress like photos, unlike noise)."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:240, 0:320] / 80.0
    for i in range(files):
        d = root / f"class_{i % classes}"
        d.mkdir(parents=True, exist_ok=True)
        f = rng.uniform(0.5, 3, (3, 2))
        img = np.stack([np.sin(f[c, 0] * xx + f[c, 1] * yy + c) for c in range(3)], -1)
        img = ((img + 1) * 110 + rng.integers(0, 30, (240, 320, 3))).clip(0, 255)
        Image.fromarray(img.astype(np.uint8)).save(d / f"{i:05d}.jpg", quality=90)
    return root


def loader_rate(root: Path, size: int, workers: int, steps: int, batch: int) -> float:
    """Images/s of train_batch for `steps` steps, in this thread or prefetched."""
    data = load_images(str(root), 0.0, Augment(crop="resized", flip=True, trivial=True),
                       image_size=size, stream=True)
    fn = lambda s: data.train_batch(s, 0, batch)
    get = Prefetcher(fn, workers, steps) if workers else fn
    t0 = time.perf_counter()
    for s in range(steps):
        get(s)
    return steps * batch / (time.perf_counter() - t0)


def train_rate(root: Path, size: int, workers: int, steps: int, batch: int, runs: Path,
               tag: str) -> float:
    """Median images/s of a streamed vit-tiny run's steps (the first, compiling, left out)."""
    args = ["--recipe", "vit-tiny", "--data.path", str(root), "--data.image-size", str(size),
            "--data.stream", "True", "--data.workers", str(workers), "--steps", str(steps),
            "--batch-size", str(batch), "--eval-every", "0", "--checkpoint-every", "0",
            "--eval-batches", "1", "--data.val-fraction", "0.05", "--runs-root", str(runs),
            "--run-id", tag, "--no-progress"]
    assert train_main(args) == 0
    rates = [e["images_per_s"] for e in read_events(runs / tag) if e["kind"] == "step"]
    return statistics.median(rates[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=640)
    ap.add_argument("--size", type=int, default=64, help="image side the model sees")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--no-train", action="store_true", help="time the loader only")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = make_folder(Path(tmp) / "photos", a.files)
        rows: dict[str, list[float]] = {}
        for r in range(a.rounds):
            for w in (0, a.workers):
                rows.setdefault(f"loader, workers {w}", []).append(
                    loader_rate(root, a.size, w, a.steps, a.batch))
                if not a.no_train:
                    rows.setdefault(f"training, workers {w}", []).append(train_rate(
                        root, a.size, w, a.steps, a.batch, Path(tmp) / "runs", f"r{r}w{w}"))
        print(f"{a.files} JPEGs 320x240 -> {a.size}x{a.size}, batch {a.batch}, "
              f"{a.steps} steps, {a.rounds} rounds (median images/s)")
        med = {k: statistics.median(v) for k, v in rows.items()}
        for k, v in rows.items():
            print(f"  {k:<22} {med[k]:8.1f}   ({', '.join(f'{x:.1f}' for x in v)})")
        for what in ("loader", "training"):
            a0, a1 = med.get(f"{what}, workers 0"), med.get(f"{what}, workers {a.workers}")
            if a0 and a1:
                print(f"  {what}: background decoding {a1 / a0:.2f}x the images/s of none")


if __name__ == "__main__":
    main()
