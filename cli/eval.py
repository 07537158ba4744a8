"""toymlx-eval --model runs/<id>|ckpt.gguf: evaluate a checkpoint on held-out data.

A ViT checkpoint reports loss and accuracy on the validation split of its image data (or on
every image with --split all); a llama checkpoint reports loss and perplexity on a text file.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from toymlx_cli import version_text

import toymlx  # noqa: F401  (loads the optimised BLAS before mlx)


@dataclass
class Args:
    """Evaluate a toymlx checkpoint (ViT or Llama)."""

    model: str
    """A checkpoint GGUF or a run directory (uses weights/latest)."""
    data_path: str | None = None
    """Images (IDX/.npz; default the digits fixture) or a UTF-8 text file for a Llama."""
    split: Literal["val", "all"] = "val"
    """Evaluate the validation split (the same fixed split training used) or every example."""
    batch_size: int = 256
    """Examples per forward pass."""
    seq_len: int = 256
    """Llama only: tokens per window."""
    device: Literal["auto", "gpu", "cpu"] = "auto"
    """Where MLX runs."""


def main(argv: list[str] | None = None) -> int:
    import tyro

    argv = sys.argv[1:] if argv is None else argv
    if "--version" in argv:
        print(version_text())
        return 0
    from toymlx.device import setup_process

    setup_process()
    args = tyro.cli(Args, args=argv, prog="toymlx-eval")
    try:
        out = evaluate(args)
    except (ValueError, OSError) as e:
        print(f"toymlx-eval: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(out))
    return 0


def evaluate(args: Args) -> dict:
    import mlx.core as mx
    import numpy as np

    from toymlx.checkpoint import resolve_latest
    from toymlx.device import select_device
    from toymlx.gguf.reader import GGUFFile
    from toymlx.trainer import Task
    from toymlx.trainer import evaluate as run_eval

    select_device(args.device)
    path = Path(args.model)
    if path.is_dir():
        path = resolve_latest(path)
    arch = GGUFFile(path).architecture
    if arch == "vit":
        from toymlx.data.images import load_images
        from toymlx.gguf.vit import load_vit
        from toymlx.losses import classify_loss, classify_metrics

        model, norm, _ = load_vit(path)
        data = load_images(args.data_path, val_fraction=0.0 if args.split == "all" else 0.1,
                           augment=False)
        if args.split == "all":
            data.val_x, data.val_y = data.train_x, data.train_y
        if norm:  # the checkpoint's own normalisation, not this data's statistics
            data.scale = float(norm["toy.pixel_scale"])
            data.mean = np.asarray(norm["toy.pixel_mean"], np.float32)
            data.std = np.asarray(norm["toy.pixel_std"], np.float32)
        task = Task("eval", model, classify_loss, lambda s: {}, data.val_batches(
            args.batch_size, pad_last=True), None, None, {}, metrics_fn=classify_metrics)
        m = run_eval(task)
        return {"model": str(path), "data": data.source, "images": len(data.val_y), **m}
    if arch == "llama":
        from toymlx.data.text import TokenData
        from toymlx.gguf.llama import load_llama
        from toymlx.losses import lm_loss
        from toymlx.recipes.common import TextData, load_token_data
        from toymlx.tokenizer import Tokenizer

        model, g = load_llama(path)
        tok = Tokenizer.from_metadata(g.metadata, source=str(path))
        td = load_token_data(TextData(args.data_path), tok, args.seq_len)
        if args.split == "all":
            td = TokenData(td.train, np.concatenate([td.train, td.val]), td.source)
        vb = td.val_batches(max(1, args.batch_size // 16), args.seq_len, 10**9)
        task = Task("eval", model, lm_loss, lambda s: {}, vb, None, None, {})
        m = run_eval(task)
        mx.eval()
        return {"model": str(path), "data": td.source, **m,
                "perplexity": math.exp(m["val_loss"])}
    raise ValueError(f"{path}: metadata key 'general.architecture': expected 'vit' or 'llama', "
                     f"found {arch!r}")


if __name__ == "__main__":
    sys.exit(main())
