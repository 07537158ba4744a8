"""toymlx-classify --model runs/<id> IMAGE_OR_DIR ...: the top classes of each image, by name.

Exit status 0 when every image was classified; 2 when any name gave no answer (a missing file,
an unreadable image, an empty stdin: each its line on stderr, the others still classified) or
the command itself was refused."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import Annotated, Literal

import tyro
from toymlx_cli import console_command, run_command

import toymlx  # noqa: F401  (loads the optimised BLAS before mlx)

PROG = "toymlx-classify"


@dataclass
class Args:
    """Classify image files with a ViT checkpoint: top-k classes with probabilities."""

    inputs: Annotated[tyro.conf.Positional[list[str]], tyro.conf.arg(metavar="IMAGE_OR_DIR")]
    """Image files, folders (every image below them), or - (one image's bytes on stdin)."""
    model: str
    """A ViT checkpoint GGUF, or a run directory (its weights/latest)."""
    top_k: int = 5
    """How many classes to show per image."""
    batch_size: int = 64
    """Images per forward pass."""
    json: bool = False
    """One JSON object per image instead of text."""
    device: Literal["auto", "gpu", "cpu"] = "auto"
    """Where MLX runs."""


def run(args: Args) -> int:
    from toymlx.backend.device import select_device
    from toymlx.generation.classify import Classifier, image_files, input_name

    if not args.inputs:
        raise ValueError("IMAGE_OR_DIR: expected at least one image file or folder, found none")
    if args.top_k < 1:
        raise ValueError(f"--top-k: expected >= 1, found {args.top_k}")
    if args.batch_size < 1:
        raise ValueError(f"--batch-size: expected >= 1, found {args.batch_size}")
    select_device(args.device)
    clf = Classifier.load(args.model)
    files = image_files(args.inputs, sys.stdin.buffer if sys.stdin is not None else None)
    unread = 0
    for f, top in clf.each_top_k(files, min(args.top_k, len(clf.names)), args.batch_size):
        if isinstance(top, Exception):  # named, and the other images still classified
            unread += 1
            print(f"{PROG}: error: {top}", file=sys.stderr)
        elif args.json:
            print(json.dumps({"file": input_name(f), "top": [{"class": n, "probability": p}
                                                      for n, p in top]}))
        else:
            print(f"{input_name(f)}: " + ", ".join(f"{n} {p:.4f}" for n, p in top))
        sys.stdout.flush()
    if unread and unread < len(files):
        rest = len(files) - unread
        # the inputs named: files that are no image, missing paths and empty folders too
        print(f"{PROG}: error: {unread} of {len(files)} inputs could not be read (named "
              f"above); the other {rest} {'is' if rest == 1 else 'are'} classified",
              file=sys.stderr)
    return 2 if unread else 0


@console_command("toymlx-classify")
def main(argv: list[str] | None = None) -> int:
    return run_command(PROG, Args, run, argv)


if __name__ == "__main__":
    sys.exit(main())
