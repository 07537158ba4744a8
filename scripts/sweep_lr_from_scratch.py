"""Learning-rate sweep for the from-scratch recipe on a small Llama (public API only).

    python scripts/sweep_lr_from_scratch.py [--lrs 3e-4,1e-3,3e-3,1e-2,3e-2] [--steps 300]
        [--workers 2] [--runs-root runs] [--shard 0/1]

Runs land in RUNS_ROOT/lr-from-scratch/lr=<value>/ with summary.csv, summary.jsonl and
report.png beside them; running it again skips the runs that completed.
"""

from __future__ import annotations

import argparse
import sys

from toymlx.sweeps import grid, run_sweep

SHAPE = {"model.d_model": 64, "model.n_layers": 2, "model.n_heads": 4, "model.n_kv_heads": 2,
         "model.ffn_dim": 192, "seq_len": 64, "batch_size": 8, "warmup": 20, "eval_every": 25,
         "eval_batches": 4, "checkpoint_every": 0}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lrs", default="3e-4,1e-3,3e-3,1e-2,3e-2", help="comma-separated peak LRs")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--runs-root", default="runs")
    p.add_argument("--sweep-id", default="lr-from-scratch")
    p.add_argument("--shard", default="0/1", help="I/N: this machine's share of the runs")
    a = p.parse_args()
    lrs = [float(x) for x in a.lrs.split(",")]
    specs = grid({**SHAPE, "steps": a.steps}, {"lr": lrs}, recipe="from-scratch")
    i, n = (int(x) for x in a.shard.split("/"))
    result = run_sweep("from-scratch", specs, a.runs_root, workers=a.workers, shard=(i, n),
                       sweep_id=a.sweep_id)
    best = next((r for r in result.rows  # best first; a diverged run is no answer
                 if r["status"] == "completed" and r["best"] is not None), None)
    if best is not None:
        print(f"best: lr={best['params']['lr']:g}, val_loss {best['best']:.4f} at step "
              f"{best['best_step']} ({result.sweep_dir / 'report.png'})")
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
