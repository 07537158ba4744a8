"""Benchmark toymlx's training step against PyTorch CPU and mlx-lm; prints a table.

    python scripts/bench.py --quick --json bench.json     # three small workloads, ~minutes
    python scripts/bench.py --json bench.json             # + the SmolLM2-360M shapes, RSS, GGUF

Needs the benchmark extras: `pip install -e .[bench]` (PyTorch CPU, mlx-lm).
"""

from toymlx.bench import main

if __name__ == "__main__":
    raise SystemExit(main())
