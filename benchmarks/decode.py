"""How fast a block-held weight decodes, against the product it feeds, in one process.

For each GGUF type a frozen base keeps as blocks (`toymlx.gguf.blocks.CODECS`): a 4096 x 4096
weight of random blocks decoded to float32 by the compiled codec (what `BlockLinear` runs inside
the step), beside MLX's own `mx.dequantize` of a 4-bit weight of the same shape and the float32
product of 512 rows by that weight (one forward matmul of a 1 x 512 LoRA step), on this device.

    python benchmarks/decode.py [--n 4096] [--rows 512] [--repeat 7]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

import toymlx  # noqa: F401  (OpenBLAS before mlx)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from user_paths import host_info

from toymlx.gguf.blocks import CODECS, decode_rows, random_blocks, split_rows


def timed(fn, *args, repeat: int) -> float:
    """Median seconds of `fn(*args)` evaluated, after one untimed call."""
    mx.eval(fn(*args))
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        mx.eval(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--rows", type=int, default=512)
    p.add_argument("--repeat", type=int, default=7)
    args = p.parse_args(argv)
    n = args.n
    print(json.dumps({"host": host_info(), "device": str(mx.default_device())}), flush=True)
    w = mx.random.normal((n, n)) * 0.02
    x = mx.random.normal((args.rows, n))
    matmul = timed(lambda a, b: a @ b.T, x, w, repeat=args.repeat)
    wq, sc, bi = mx.quantize(w, group_size=32, bits=4)
    mlx_deq = timed(mx.compile(lambda a, b, c: mx.dequantize(a, b, c, group_size=32, bits=4)),
                    wq, sc, bi, repeat=args.repeat)
    print(json.dumps({"row": f"float32 product {args.rows} x {n} by {n} x {n}",
                      "ms": round(matmul * 1e3, 2)}), flush=True)
    print(json.dumps({"row": "mx.dequantize 4-bit, group 32", "ms": round(mlx_deq * 1e3, 2),
                      "ns_per_value": round(mlx_deq * 1e9 / n / n, 2),
                      "of_product": round(mlx_deq / matmul, 3)}), flush=True)
    for t, codec in CODECS.items():
        raw = random_blocks(codec, n, n // codec.block_values)
        parts = {k: mx.array(v) for k, v in split_rows(codec, raw, (n, n)).items()}
        s = timed(mx.compile(lambda p, c=codec: decode_rows(c, p, (n,))), parts,
                  repeat=args.repeat)
        print(json.dumps({"row": f"decode {t.name}", "ms": round(s * 1e3, 2),
                          "ns_per_value": round(s * 1e9 / n / n, 2),
                          "of_product": round(s / matmul, 3)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
