"""Warm start vs from-scratch: same student, seed, data and steps; only the table's init differs.

Each run is `toymlx-train --recipe warm-start` in its own process. "scratch" is
`--warm.init random`: the same student (donor-width table + lens, the donor's vocabulary and
tokenizer, the same lens rule, optimizer and init of everything else) with the table drawn
from a Gaussian of the donor table's RMS instead of taken from the donor. Prints seed, student, mode and the final
validation loss, then the mean per student and mode.

    python scripts/warm_vs_scratch.py                       # defaults below, ~12 min on 2 cores
    python scripts/warm_vs_scratch.py --seeds 0 1 --steps 100
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from toymlx.bundle.events import read_events

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data"
STUDENTS = {
    # name: (lens, student shape flags)
    "w32-pca": ("pca", ["--model.d-model", "32", "--model.n-heads", "4",
                        "--model.n-kv-heads", "2", "--model.ffn-dim", "96"]),
    "w64-identity": ("identity", ["--model.d-model", "64", "--model.n-heads", "8",
                                  "--model.n-kv-heads", "4", "--model.ffn-dim", "172"]),
}
MODES = {"warm": ["--warm.init", "donor"], "scratch": ["--warm.init", "random"]}


def train_cmd() -> list[str]:
    exe = shutil.which("toymlx-train")
    return [exe] if exe else [sys.executable, "-m", "toymlx_cli.train"]


def final_val_loss(run_dir: Path) -> float:
    evals = [e for e in read_events(run_dir) if e["kind"] == "eval"]
    if not evals:
        raise RuntimeError(f"{run_dir}: expected eval events, found none")
    return float(evals[-1]["val_loss"])


def run(args: argparse.Namespace, root: Path, seed: int, student: str, mode: str) -> float:
    lens, shape = STUDENTS[student]
    run_id = f"{student}-{mode}-s{seed}"
    cmd = [*train_cmd(), "--recipe", "warm-start", "--donor", str(args.donor),
           "--data.path", str(args.data), "--warm.lens", lens, *MODES[mode], *shape,
           "--model.n-layers", str(args.layers), "--seq-len", str(args.seq_len),
           "--batch-size", str(args.batch_size), "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--lr", str(args.lr),
           "--eval-every", "0", "--eval-batches", str(args.eval_batches),
           "--checkpoint-every", "0", "--seed", str(seed), "--runs-root", str(root),
           "--run-id", run_id, "--overwrite", "--no-progress", *args.extra]
    done = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{run_id}: toymlx-train exited {done.returncode}:\n{done.stderr}")
    return final_val_loss(root / run_id)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--donor", type=Path, default=SHARED / "models" / "stories260K.gguf")
    p.add_argument("--data", type=Path, default=SHARED / "text" / "tinyshakespeare.txt")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--students", nargs="+", default=list(STUDENTS), choices=list(STUDENTS))
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--eval-batches", type=int, default=16)
    p.add_argument("--runs-root", type=Path, default=None,
                   help="keep the run bundles here (default: a temporary folder)")
    p.add_argument("extra", nargs="*", help="more toymlx-train flags, after --")
    args = p.parse_args(argv)

    tmp = None if args.runs_root else tempfile.TemporaryDirectory(prefix="warm_vs_scratch-")
    root = args.runs_root or Path(tmp.name)
    rows = []
    print(f"{'seed':>4}  {'student':<13} {'mode':<8} {'val_loss':>8}", flush=True)
    try:
        for seed in args.seeds:
            for student in args.students:
                for mode in MODES:
                    loss = run(args, root, seed, student, mode)
                    rows.append((seed, student, mode, loss))
                    print(f"{seed:>4}  {student:<13} {mode:<8} {loss:8.4f}", flush=True)
    finally:
        if tmp is not None:
            tmp.cleanup()
    print(f"\nmeans over seeds {args.seeds} ({args.steps} steps):")
    for student in args.students:
        m = {mode: [r[3] for r in rows if r[1] == student and r[2] == mode] for mode in MODES}
        wins = sum(w < s for w, s in zip(m["warm"], m["scratch"]))
        means = {k: sum(v) / len(v) for k, v in m.items()}
        print(f"  {student:<13} warm {means['warm']:.4f}  scratch {means['scratch']:.4f}  "
              f"diff {means['warm'] - means['scratch']:+.4f}  warm better on {wins}/{len(m['warm'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
