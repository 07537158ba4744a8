"""Memory and speed of LoRA at the sizes people run: `toymlx-train --recipe lora`, the command
users run, in a child process per row; the row's peak RSS (the child's and its children's,
from `wait4`), MLX's peak (run_end's `peak_memory`, where the run records it), the median step
time of the steps after the first two, and tokens per second.

Rows (a name each; `--only` picks):
- `smollm2-blocks` / `smollm2-float32`: the real SmolLM2-135M-Instruct Q4_1 at the benchmark's
  LoRA shape (4 x 256, q, rank 8, packed), the base held as its blocks against float32: the same
  file in the same run, so their step-time ratio compares.
- `smollm2-chat`: the same file and recipe on the mlx-lm user's unpacked chat rows
  (`--data.no-pack`: one example per row, batch 4, at most 256 tokens, each batch cut to its
  longest row rounded up to 32).
- `mlx-lm-packed` / `mlx-lm-chat`: mlx-lm's own QLoRA of the same weights (its 4-bit model, its
  trainer) on the same two data shapes (`mlx_lm_qlora.py`); the toymlx/mlx-lm ratios of peak
  RSS and step time are printed per shape (`PEERS`).
- `1b-blocks` / `1b-float32`: the Llama-3.2-1B-shaped Q4_K_M (`shapes.py`) at 4 x 256, q
  (`1b-1-stream`, `1b-float32-1-stream`: the same with `--cpu-streams 1`);
  `1b-1x512`, `3b-1x512`, `8b-1x512`: 1 x 512, q,v, rank 8, `--grad-checkpoint`, 3 steps (the
  issue's sizes); `1b-full-2`, `3b-full-2`, `8b-full-2`: mlx-lm's full fine-tune of the last 2 blocks
  (`--fine-tune-type full --full.layers 2`, the frozen rest as blocks) at 1 x 512,
  `--grad-checkpoint`, 3 steps; `gemma-4x256`: the Gemma-3-270M shape (262,144-token vocabulary) at 4 x 256.
- each row's adapter is loaded with its base in llama.cpp (`llamacpp_ok`: its logits of a
  few tokens are finite), where llama-cpp-python is installed.

    python benchmarks/memory.py [--only smollm2-blocks smollm2-float32 ...] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from scratch import scratch_folder
from user_paths import host_info, smollm_gguf


@dataclass(frozen=True)
class Row:
    name: str
    model: str
    """smollm2, or a shapes.py name"""
    batch: int
    seq: int
    targets: str = "q"
    base_dtype: str = "auto"
    grad_checkpoint: bool = False
    steps: int = 6
    extra: tuple[str, ...] = ()
    """more toymlx-train options"""
    pack: bool = True
    """packed rows (the recipe's default), else one example per row (`--data.no-pack`)"""
    runner: str = "toymlx"
    full_layers: int | None = None
    """a full fine-tune of the last N blocks (`--fine-tune-type full --full.layers N`) instead
    of LoRA on `targets`"""
    """toymlx (`toymlx-train`), or mlx-lm (`mlx_lm_qlora.measure`: `steps` iterations)"""


ROWS = {r.name: r for r in (
    Row("smollm2-blocks", "smollm2", 4, 256, base_dtype="blocks"),
    Row("smollm2-float32", "smollm2", 4, 256, base_dtype="float32"),
    Row("smollm2-1-stream", "smollm2", 4, 256, base_dtype="blocks", extra=("--cpu-streams", "1")),
    Row("smollm2-gc", "smollm2", 4, 256, base_dtype="blocks", grad_checkpoint=True),
    Row("smollm2-chat", "smollm2", 4, 256, pack=False),
    Row("mlx-lm-packed", "smollm2", 4, 256, steps=4, runner="mlx-lm"),
    Row("mlx-lm-chat", "smollm2", 4, 256, steps=4, pack=False, runner="mlx-lm"),
    Row("1b-blocks", "llama-3.2-1b", 4, 256, base_dtype="blocks", steps=4),
    Row("1b-float32", "llama-3.2-1b", 4, 256, base_dtype="float32", steps=4),
    Row("1b-1-stream", "llama-3.2-1b", 4, 256, base_dtype="blocks", steps=4,
        extra=("--cpu-streams", "1")),
    Row("1b-float32-1-stream", "llama-3.2-1b", 4, 256, base_dtype="float32", steps=4,
        extra=("--cpu-streams", "1")),
    Row("1b-1x512", "llama-3.2-1b", 1, 512, "q,v", grad_checkpoint=True, steps=3),
    Row("3b-1x512", "llama-3.2-3b", 1, 512, "q,v", grad_checkpoint=True, steps=3),
    Row("8b-1x512", "llama-3.1-8b", 1, 512, "q,v", grad_checkpoint=True, steps=3),
    Row("1b-full-2", "llama-3.2-1b", 1, 512, grad_checkpoint=True, steps=3,
        full_layers=2),
    Row("3b-full-2", "llama-3.2-3b", 1, 512, grad_checkpoint=True, steps=3,
        full_layers=2),
    Row("8b-full-2", "llama-3.1-8b", 1, 512, grad_checkpoint=True, steps=3,
        full_layers=2),
    Row("gemma-4x256", "gemma-3-270m", 4, 256, steps=4),
    Row("gemma-4x256-gc", "gemma-3-270m", 4, 256, grad_checkpoint=True, steps=4),
)}
PEERS = (("smollm2-blocks", "mlx-lm-packed"), ("smollm2-chat", "mlx-lm-chat"))
"""toymlx's row and mlx-lm's on the same data shape: their ratios are printed."""


def model_file(name: str) -> Path:
    if name == "smollm2":
        return smollm_gguf()
    from shapes import shape_file

    return shape_file(name)[0]


def command(row: Row, base: Path, runs: Path) -> list[str]:
    cmd = [sys.executable, "-m", "cli.train", "--recipe", "lora", "--base", str(base),
           "--steps", str(row.steps), "--batch-size", str(row.batch), "--seq-len", str(row.seq),
           *(["--lora.targets", row.targets, "--lora.rank", "8"] if row.full_layers is None
             else ["--fine-tune-type", "full", "--full.layers", str(row.full_layers)]),
           "--base-dtype", row.base_dtype, "--eval-every", "0", "--eval-batches", "1", "--checkpoint-every", "0",
           "--warmup", "1", "--no-progress", "--runs-root", str(runs), "--run-id", row.name]
    return (cmd + (["--grad-checkpoint"] if row.grad_checkpoint else [])
            + ([] if row.pack else ["--data.no-pack"]) + list(row.extra))


def run_row(row: Row, runs: Path) -> dict[str, Any]:
    """The command in a child; its peak RSS from wait4 (children included)."""
    base = model_file(row.model)
    if row.runner == "mlx-lm":
        from mlx_lm_qlora import measure

        return measure("packed" if row.pack else "chat", row.steps, base)
    cmd = command(row, base, runs)
    t0 = time.perf_counter()
    child = subprocess.Popen(cmd, cwd=HERE.parent, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    out = child.stdout.read()
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    rec: dict[str, Any] = {"row": row.name, "file": base.name,
                           "file_mb": round(base.stat().st_size / 1e6, 1),
                           "shape": f"{row.batch}x{row.seq}",
                           "targets": row.targets if row.full_layers is None
                           else f"full, last {row.full_layers} blocks",
                           "base_dtype": row.base_dtype, "grad_checkpoint": row.grad_checkpoint,
                           "rc": child.returncode, "wall_s": round(wall, 1),
                           "peak_rss_gb": round(usage.ru_maxrss * 1024 / 1e9, 3),
                           "minor_faults": usage.ru_minflt,
                           "command": " ".join(["toymlx-train", *cmd[3:]])}
    if child.returncode != 0:
        rec["error"] = out.strip().splitlines()[-1] if out.strip() else ""
        return rec
    from toymlx.bundle.events import read_events, run_start  # a torn or damaged line is skipped

    events = read_events(runs / row.name)
    steps = [e for e in events if e["kind"] == "step"]
    end = next(e for e in events if e["kind"] == "run_end")
    start = run_start(events)
    times = [e["step_time_s"] for e in steps[2:]] or [e["step_time_s"] for e in steps]
    rec.update(steps=len(steps), step_s=round(statistics.median(times), 3),
               trained_tokens_per_s=round(statistics.median(
                   e["tokens_per_s"] for e in (steps[2:] or steps)), 1),
               first_step_s=steps[0]["step_time_s"], loss=[round(e["loss"], 4) for e in steps],
               base_held_gb=round(start["model"].get("base_held_bytes", 0) / 1e9, 3))
    if row.pack:  # unpacked batches are cut to their longest row: batch x seq overstates them
        rec["tokens_per_s"] = round(row.batch * row.seq / statistics.median(times), 1)
    for k in ("peak_memory_mb", "peak_rss_mb"):  # MLX's count and the process's, run_end's
        if k in end:
            rec[f"run_end_{k}"] = end[k]
    rec["llamacpp_ok"] = adapter_in_llamacpp(base, runs / row.name, row.full_layers is None)
    return rec


def adapter_in_llamacpp(base: Path, run: Path, adapter: bool = True) -> bool | None:
    """llama.cpp loads the base with the run's final adapter (or the run's final full
    checkpoint, where `adapter` is false) and gives finite logits."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return None
    sys.path.insert(0, str(HERE.parent / "tests"))
    import numpy as np
    from llamacpp_runner import llamacpp_logits

    final = (run / "weights" / "latest").resolve()
    logits, _ = (llamacpp_logits(base, [1, 2, 3, 4], lora=final) if adapter
                 else llamacpp_logits(final, [1, 2, 3, 4]))
    return bool(np.isfinite(logits).all())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", nargs="*", default=list(ROWS), choices=list(ROWS))
    p.add_argument("--json", type=Path)
    p.add_argument("--repeat", type=int, default=1,
                   help="run the chosen rows this many times, interleaved (a, b, a, b, ...)")
    args = p.parse_args(argv)
    host = host_info()
    print(json.dumps({"host": host}), flush=True)
    results = []
    with scratch_folder("toymlx-memory-") as tmp:
        for i, name in enumerate(list(args.only) * args.repeat):
            rec = run_row(ROWS[name], tmp / str(i))
            print(json.dumps(rec), flush=True)
            results.append(rec)
    by: dict[str, dict[str, Any]] = {}  # repeats: the median step time, the highest peak
    for r in results:
        if "step_s" in r:
            seen = by.setdefault(r["row"], {**r, "step_times": []})
            seen["step_times"].append(r["step_s"])
            seen["step_s"] = statistics.median(seen["step_times"])
            seen["peak_rss_gb"] = max(seen["peak_rss_gb"], r["peak_rss_gb"])
    for a, b in (("smollm2-blocks", "smollm2-float32"), ("1b-blocks", "1b-float32"),
                 ("1b-1-stream", "1b-float32"), ("1b-1-stream", "1b-float32-1-stream")):
        if a in by and b in by and "step_s" in by[a] and "step_s" in by[b]:
            print(f"{a} / {b} step time: {by[a]['step_s'] / by[b]['step_s']:.3f}x; peak RSS "
                  f"{by[a]['peak_rss_gb']} / {by[b]['peak_rss_gb']} GB", flush=True)
    for a, b in PEERS:
        if a in by and b in by and "step_s" in by[a] and "step_s" in by[b]:
            print(f"{a} / {b} (toymlx / mlx-lm, {by[b]['data']}): peak RSS "
                  f"{by[a]['peak_rss_gb'] / by[b]['peak_rss_gb']:.3f}x ({by[a]['peak_rss_gb']} / "
                  f"{by[b]['peak_rss_gb']} GB), step time {by[a]['step_s'] / by[b]['step_s']:.3f}x "
                  f"({by[a]['step_s']} / {by[b]['step_s']} s), trained tokens/s "
                  f"{by[a]['trained_tokens_per_s'] / by[b]['trained_tokens_per_s']:.3f}x",
                  flush=True)
    if args.json:
        args.json.write_text(json.dumps({"host": host, "rows": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
