"""LoRA rank sweep over a base GGUF (public API only).

    python scripts/sweep_lora_rank.py --base SmolLM2-135M-Instruct.Q4_1.gguf
        [--ranks 2,4,8,16] [--steps 100] [--lr 2e-4] [--workers 1] [--runs-root runs]
        [--shard 0/1] [-- other toymlx-train options, e.g. --data.path my.jsonl]

Each rank is its own run bundle in RUNS_ROOT/lora-rank-<base name>/lora.rank=<r>/; alpha is
kept at 2 x rank (the adapters' scale alpha/rank stays fixed, so ranks compare on capacity).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from toymlx.sweeps import grid, run_sweep


def main() -> int:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", required=True, help="the llama GGUF to adapt")
    p.add_argument("--ranks", default="2,4,8,16", help="comma-separated LoRA ranks")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--runs-root", default="runs")
    p.add_argument("--sweep-id", help="default: lora-rank-<base file name>")
    p.add_argument("--shard", default="0/1", help="I/N: this machine's share of the runs")
    a = p.parse_args(argv)
    if not Path(a.base).is_file():
        print(f"sweep_lora_rank: error: {a.base}: --base: expected a GGUF file, found nothing",
              file=sys.stderr)
        return 2
    ranks = [int(x) for x in a.ranks.split(",")]
    specs = []
    for r in ranks:  # alpha follows the rank, so it is part of each run's fixed options
        base = ["--base", a.base, "--steps", str(a.steps), "--lr", repr(a.lr),
                "--lora.alpha", str(2.0 * r), *extra]
        specs += grid(base, {"lora.rank": [r]}, recipe="lora")
    i, n = (int(x) for x in a.shard.split("/"))
    sweep_id = a.sweep_id or f"lora-rank-{Path(a.base).stem}"
    result = run_sweep("lora", specs, a.runs_root, workers=a.workers, shard=(i, n),
                       sweep_id=sweep_id)
    best = next((r for r in result.rows  # best first; a diverged run is no answer
                 if r["status"] == "completed" and r["best"] is not None), None)
    if best is not None:
        print(f"best: lora.rank={best['params']['lora.rank']}, val_loss {best['best']:.4f} "
              f"({result.sweep_dir / 'report.png'})")
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
