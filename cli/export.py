"""toymlx-export --base BASE.gguf [--adapter RUN|ADAPTER.gguf --fuse] --out OUT.gguf [--dtype]."""

from __future__ import annotations

import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from toymlx_cli import version_text

import toymlx  # noqa: F401  (loads the optimised BLAS before mlx)

PROG = "toymlx-export"


@dataclass
class Args:
    """Write a llama GGUF for llama.cpp: a base with a LoRA adapter fused in, or re-encoded.

    --adapter A --fuse: the base with W + (alpha/r) B A in every adapted weight.
    --adapter A alone:  the adapter GGUF itself, checked against the base.
    no --adapter:       the base re-encoded at --dtype (e.g. an F32 copy of a Q4_1 file).
    """

    base: str
    """The llama GGUF the adapter was trained on (its tokenizer and metadata are kept)."""
    out: str
    """Where to write the GGUF (atomically)."""
    adapter: str | None = None
    """A LoRA adapter GGUF, or a LoRA run directory (its weights/latest)."""
    fuse: bool = False
    """Merge the adapter into the base weights (a full model for llama.cpp without --lora)."""
    dtype: Literal["f32", "f16", "bf16", "q8_0"] | None = None
    """Tensor type of the written model's matrices (default: f32, or q8_0 for a Q8_0 base)."""


def run(args: Args) -> int:
    from toymlx.atomic import atomic_open
    from toymlx.gguf.llama import load_llama
    from toymlx.lora import apply_adapter, resolve_adapter_path, write_merged

    out = Path(args.out)
    if args.fuse and not args.adapter:
        raise ValueError("--fuse: expected --adapter (the adapter to merge), found none")
    t0 = time.perf_counter()
    if args.adapter and not args.fuse:
        if args.dtype:
            raise ValueError("--dtype: only applies to a written model (with --fuse or "
                             "without --adapter); an adapter is written as F32")
        src = resolve_adapter_path(args.adapter)
        model, g = load_llama(args.base)
        apply_adapter(model, src, g.metadata.get("general.architecture", "llama"))
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(src, "rb") as f, atomic_open(out) as dst:
            shutil.copyfileobj(f, dst)
        what = f"adapter {src}"
    else:
        write_merged(out, args.base, args.adapter, args.dtype)
        what = f"{args.base}" + (f" + adapter {args.adapter} (fused)" if args.adapter else "")
    print(f"{PROG}: wrote {out} ({out.stat().st_size / 2**20:.1f} MiB) from {what} in "
          f"{time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    import tyro

    argv = sys.argv[1:] if argv is None else argv
    if "--version" in argv:
        print(version_text())
        return 0
    args = tyro.cli(Args, args=argv, prog=PROG,
                    description=Args.__doc__)
    try:
        return run(args)
    except (ValueError, OSError, KeyError, TypeError) as e:  # GGUFError is a ValueError
        print(f"{PROG}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
