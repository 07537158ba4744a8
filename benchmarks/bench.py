"""Benchmark toymlx's training step against PyTorch and mlx-lm; prints a table.

    python benchmarks/bench.py --quick --json bench.json    # CPU suite: 3 small workloads
    python benchmarks/bench.py --json bench.json            # + the SmolLM2-360M shapes, RSS, GGUF
    python benchmarks/bench.py --device gpu --json gpu.json # GPU suite, float32 and bfloat16
    python benchmarks/bench.py --device cpu --shapes tiny   # the GPU suite's code paths, tiny

Needs the benchmark extras: `pip install -e .[bench]` (PyTorch, mlx-lm); the GPU suite's
PyTorch rows need a CUDA build of PyTorch. The modules beside this one:

    workloads.py    what is trained: shapes, the batch, FLOPs
    toymlx_step.py  toymlx's side: each workload's recipe-built Task, stepped as train() does
    user_paths.py   what users run: the host, toymlx-train, toymlx.train, toymlx-generate
    torch_step.py   the PyTorch yardstick
    mlx_lm_step.py  the mlx-lm peer
    rounds.py       interleaved timing
    procs.py        child processes: each side's CPU step, peak RSS, GGUF I/O, data parallel
    scratch.py      temporary folders, removed however a run ends (SIGTERM too)
    cpu_suite.py    the CPU suite (float32, PyTorch CPU in a child process) and its table
    gpu_suite.py    the GPU suite (dtypes, torch.compile, MFU, peak memory) and its table

Beside them, not part of this command: graph_census.py (the primitives one LoRA step asks MLX
for, toymlx against mlx-lm, on any device), env_ab.py (toymlx's CPU step under two process
environments, in interleaved rounds: what a setting costs) and gpu_machine.sh (MLX's CUDA
wheels and toymlx onto a lent NVIDIA machine that has no network).
"""

from __future__ import annotations

import toymlx  # noqa: F401  (first: it loads OpenBLAS, which must precede mlx.core)

# isort: split
import argparse
import json
import sys
from pathlib import Path

import cpu_suite
import gpu_suite
import procs
from workloads import cpu_workloads, gpu_workloads

from toymlx.backend.device import select_device, setup_process


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cpu", "gpu"], default="cpu",
                   help="where MLX (and PyTorch) run; gpu runs the GPU suite")
    p.add_argument("--shapes", choices=["full", "tiny"], default="full",
                   help="tiny: the GPU suite at shapes a CPU trains in seconds (checks its code "
                        "paths on any device)")
    p.add_argument("--dtype", nargs="+", choices=gpu_suite.DTYPES, default=None,
                   help="GPU suite: the dtypes to run (default: float32 bfloat16)")
    p.add_argument("--quick", action="store_true",
                   help="CPU suite: the three small workloads, 4 rounds; GPU suite: 3 rounds")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--only", nargs="*", help="workload names")
    p.add_argument("--rounds", type=int,
                   help="timed rounds; the order alternates, so an even count lets each "
                        "implementation go first equally often (CPU default: 4 quick, else 6)")
    p.add_argument("--warmup", type=int, help="untimed steps before the rounds (CPU 1, GPU 2)")
    p.add_argument("--impl", nargs="*",
                   help="CPU suite: toymlx, toymlx-ref (MLX's own elementwise ops: "
                        "toymlx.backend.fastmath off), torch, torch1t (PyTorch on one thread), mlx-lm "
                        "(default: toymlx torch mlx-lm). GPU suite: toymlx, mlx-lm, torch, "
                        "torch-compile (default: all)")
    p.add_argument("--compile-backend", default="inductor",
                   help="GPU suite: torch.compile's backend for the torch-compile rows")
    p.add_argument("--dp", type=int, default=0, metavar="N",
                   help="CPU suite: also time N data-parallel ranks (one BLAS thread each) "
                        "against one process, for each selected workload")
    p.add_argument("--memory", action=argparse.BooleanOptionalAction, default=None,
                   help="CPU suite: peak RSS of each variant in a child process (default: not "
                        "--quick)")
    p.add_argument("--gguf", action=argparse.BooleanOptionalAction, default=None,
                   help="CPU suite: GGUF write/load at 360M (default: not --quick)")
    p.add_argument("--user-paths", action=argparse.BooleanOptionalAction, default=True,
                   help="CPU suite: also time what users run (toymlx-train on the real "
                        "SmolLM2-135M at the LoRA shape, toymlx.train in a process that used "
                        "mlx first, toymlx-generate beside llama.cpp; default: on, "
                        "--no-user-paths skips them); see user_paths.py")
    p.add_argument("--warm-jit", action="store_true",
                   help="CPU suite: keep mx.compile's kernel cache (first step without the g++ "
                        "build)")
    return p.parse_args(argv)


def check(a: argparse.Namespace, gpu: bool) -> str | None:
    """Why these flags do not fit together (None: they do)."""
    impls = gpu_suite.IMPLS if gpu else procs.IMPLS
    names = [w.name for w in (gpu_workloads(a.shapes) if gpu else cpu_workloads())]
    suite = "the GPU suite (--device gpu or --shapes tiny)" if gpu else "the CPU suite"
    bad_impl = [x for x in a.impl or [] if x not in impls]
    bad_only = [x for x in a.only or [] if x not in names]
    if bad_impl:
        return f"--impl: expected some of {', '.join(impls)} for {suite}, found {bad_impl}"
    if bad_only:
        return f"--only: expected some of {', '.join(names)} for {suite}, found {bad_only}"
    if not gpu and a.dtype not in (None, ["float32"]):
        return (f"--dtype: the CPU suite trains in float32, found {a.dtype}; use --device gpu "
                "or --shapes tiny for the other dtypes")
    cpu_only = {"--dp": a.dp, "--memory": a.memory, "--gguf": a.gguf, "--warm-jit": a.warm_jit}
    given = [k for k, v in cpu_only.items() if v]
    if gpu and given:
        return f"{', '.join(given)}: only the CPU suite has these; drop them for {suite}"
    return None


def main(argv: list[str] | None = None) -> int:
    # No restart_with_huge_pages here: this process only times. The CPU suite steps each side
    # in a process of its own (procs.ChildVariant), toymlx's with the heap its commands get.
    a = parse(argv)
    gpu = a.device == "gpu" or a.shapes == "tiny"
    problem = check(a, gpu)
    if problem is None:
        try:
            select_device(a.device)
        except ValueError as e:
            problem = str(e)
    if problem is not None:
        print(f"bench: {problem}", file=sys.stderr)
        return 2
    setup_process()  # as toymlx-train sets itself up, before MLX evaluates anything
    log = lambda s: print(s, file=sys.stderr, flush=True)
    if gpu:
        info = gpu_suite.run_gpu(
            a.device, a.shapes, tuple(a.dtype or gpu_suite.DTYPES),
            tuple(a.impl or gpu_suite.IMPLS), a.rounds or (3 if a.quick else 10),
            2 if a.warmup is None else a.warmup, a.only, a.compile_backend, a.json, log)
        table = gpu_suite.format_gpu_table(info)
    else:
        info = cpu_suite.run_all(a.quick, a.only, a.rounds, 1 if a.warmup is None else a.warmup,
                                 tuple(a.impl or cpu_suite.DEFAULT_IMPLS), a.memory, a.gguf,
                                 cold_jit=not a.warm_jit, partial_json=a.json, dp=a.dp,
                                 user_paths=a.user_paths, log=log)
        table = cpu_suite.format_table(info)
    info["argv"] = sys.argv[1:] if argv is None else argv
    print(table)
    info["table"] = table
    if a.json:
        Path(a.json).write_text(json.dumps(info, indent=1, default=float))
    return 1 if any("error" in w for w in info["workloads"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
