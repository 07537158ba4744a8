"""Greedy decoding of SmolLM2-135M-Instruct Q4_1 by toymlx's MLX engine against its peers, in one
run: tokens a second, each row's ratio to llama.cpp's and mlx-lm's in the same run, and where
the rows' tokens part from toymlx's.

Rows, their order alternating from round to round (other work on a shared machine moves every
figure; the ratios within a round are what compare):
- `toymlx-generate`: the command as users type it (`--engine mlx`, its default), in a fresh
  process; the tok/s it prints (its model load apart; its first token, prompt and tracing
  included).
- `toymlx generate()`: `toymlx.generation.generate.generate` in this process, warm: the
  decoding loop alone; `toymlx all threads`: the same with OpenBLAS on all of the process's
  threads whatever the other work on the machine (`generate` before
  `decoding_blas_threads`).
- `mlx-lm`: `mlx_lm.generate.generate_step` in this process on the same float32 values (the
  GGUF dequantized into mlx-lm's llama, `mlx_lm_side_by_side.model_folder`), same BLAS.
- `mlx-lm 4-bit` (`--mlx-lm-4bit`): that model through `nn.quantize` (group 32, 4 bits: the
  Q4_1 grid, `mx.quantized_matmul`), what mlx-lm runs for a 4-bit model.
- `llama.cpp`: llama-cpp-python on the GGUF itself, all cores, its warm second pass
  (`user_paths`).

    python benchmarks/decode_peers.py [--tokens 128] [--rounds 3] [--mlx-lm-4bit] \\
        [--mlx-lm-cache DIR] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx

import toymlx  # noqa: F401  (OpenBLAS before mlx)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mlx_lm_side_by_side import CACHE, model_folder
from user_paths import _LLAMACPP, PROMPT, _toymlx_generate, host_info, host_line, smollm_gguf

from toymlx.backend.device import blas_threads
from toymlx.generation.generate import generate, load_for_generation, load_tokenizer
from toymlx.generation.sampling import greedy


def in_process_rows(gguf: Path, ids: list[int], n: int, cache: Path, four_bit: bool
                    ) -> dict[str, Callable[[], list[int]]]:
    """The rows that decode in this process: each returns its greedy tokens."""
    from mlx import nn
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load

    model, tok = load_for_generation(gguf)
    folder = model_folder(gguf, cache)
    prompt = mx.array(ids)

    def peer_row(peer) -> Callable[[], list[int]]:
        return lambda: [int(t) for t, _ in generate_step(prompt, peer, max_tokens=n,
                                                         sampler=greedy)]

    def every_thread() -> list[int]:  # generate before its threads followed the idle cores
        mod = sys.modules[generate.__module__]
        chosen = mod.decoding_blas_threads
        mod.decoding_blas_threads = blas_threads
        try:
            return list(generate(model, tok, ids, n))
        finally:
            mod.decoding_blas_threads = chosen

    rows = {"toymlx generate()": lambda: list(generate(model, tok, ids, n)),
            "toymlx all threads": every_thread,
            "mlx-lm": peer_row(load(str(folder))[0])}
    if four_bit:
        q = load(str(folder))[0]
        nn.quantize(q, group_size=32, bits=4)
        rows["mlx-lm 4-bit"] = peer_row(q)
    return rows


def llamacpp_row(gguf: Path, ids: list[int], n: int) -> float:
    p = subprocess.run([sys.executable, "-c", _LLAMACPP, str(gguf), json.dumps(ids), str(n),
                        "0.0", "1.0"], capture_output=True, text=True, check=False)
    if p.returncode != 0:
        raise RuntimeError(f"llama.cpp failed ({p.returncode}): {p.stderr.strip()[-500:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])["tok_per_s"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=128, metavar="N",
                   help="the most tokens each row decodes after the prompt (default: 128)")
    p.add_argument("--rounds", type=int, default=3, metavar="N",
                   help="timed rounds, the rows' order reversed every other round "
                        "(default: 3)")
    p.add_argument("--mlx-lm-4bit", action="store_true", help="add mlx-lm's 4-bit row (slow "
                   "on a CPU: MLX's quantized CPU matmul)")
    p.add_argument("--mlx-lm-cache", type=Path, default=CACHE,
                   help="where mlx-lm's float32 copy of the GGUF is written once")
    p.add_argument("--json", type=Path, help="write every figure here")
    a = p.parse_args(argv)
    if a.tokens < 1 or a.rounds < 1:
        p.error(f"--tokens and --rounds: expected >= 1, found {a.tokens} and {a.rounds}")
    gguf = smollm_gguf()
    host = host_info()
    print(host_line(host), flush=True)
    tok, _ = load_tokenizer(gguf)
    ids = tok.encode(PROMPT)
    rows: dict[str, Callable[[], float | list[int]]] = {}
    rows["toymlx-generate"] = lambda: _toymlx_generate(gguf, a.tokens, 0.0, 1.0, "mlx")
    rows.update(in_process_rows(gguf, ids, a.tokens, a.mlx_lm_cache, a.mlx_lm_4bit))
    rows["llama.cpp"] = lambda: llamacpp_row(gguf, ids, a.tokens)
    tokens = {k: rows[k]() for k in rows if k not in ("toymlx-generate", "llama.cpp")}  # warm
    rates: dict[str, list[float]] = {k: [] for k in rows}
    for r in range(a.rounds):
        order = list(rows) if r % 2 == 0 else list(reversed(rows))
        for k in order:
            t = time.perf_counter()
            got = rows[k]()
            if isinstance(got, dict):  # the command: its own printed figure
                rates[k].append(got["tok_per_s"])
            elif isinstance(got, float):  # llama.cpp: its warm pass
                rates[k].append(got)
            else:
                rates[k].append(len(got) / (time.perf_counter() - t))
        print(f"round {r + 1}/{a.rounds}: " + "  ".join(f"{k} {rates[k][-1]:.1f}"
                                                         for k in order), flush=True)
    ref = tokens["toymlx generate()"]
    print(f"{'row':<20} {'tok/s (median)':>14} {'x llama.cpp':>11} {'x mlx-lm':>9}  "
          "per round x llama.cpp; tokens as toymlx's")
    for k, v in rates.items():
        per = [x / y for x, y in zip(v, rates["llama.cpp"])]
        agree = ""
        if k in tokens:
            same = next((i for i, (x, y) in enumerate(zip(ref, tokens[k])) if x != y),
                        min(len(ref), len(tokens[k])))
            agree = f"  first {same} of {len(tokens[k])}"
        print(f"{k:<20} {statistics.median(v):>14.1f} "
              f"{statistics.median(per):>11.2f} "
              f"{statistics.median(v) / statistics.median(rates['mlx-lm']):>9.2f}  "
              + " ".join(f"{x:.2f}" for x in per) + agree, flush=True)
    if a.json:
        a.json.write_text(json.dumps({"host": host, "prompt_tokens": len(ids),
                                      "max_tokens": a.tokens, "tok_per_s": rates}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
