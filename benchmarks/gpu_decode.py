"""Decoding one token at a time (issue 50: decoding on the GPU): toymlx's decoding loop on the
model as `toymlx-generate` loads it, eager (what `generate` runs on a GPU) and under
`CompiledDecode` (the traced blocks it runs on the CPU), against mlx-lm's `generate_step` on the
same weights; greedy, in interleaved rounds: tokens a second, and how many of each row's tokens
agree with toymlx's eager row.

    python benchmarks/gpu_decode.py [--device gpu] [--only lora-q-135m-8x512] [--tokens 256] \\
        [--rounds 3] [--json out.json]

The model is a GPU workload's LoRA base (`toymlx_step.recipe_inputs`: random weights, a float32
GGUF, toymlx's byte tokenizer), loaded by `load_for_generation` as toymlx-generate loads it;
mlx-lm's model class holds the file's float32 weights (`mlx_lm_step.build_peer`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator

import mlx.core as mx
import numpy as np
from toymlx_step import BASE_GGUF, recipe_inputs, weights_np
from workloads import find

from toymlx.backend.device import backend_info, on_gpu, select_device, setup_process
from toymlx.generation.generate import CompiledDecode, decode, load_for_generation
from toymlx.generation.sampling import greedy
from toymlx.gguf.llama import load_llama

PROMPT_TOKENS = 32


def decoders(workload: str) -> dict[str, Callable[[list[int], int], Iterator[int]]]:
    """Each row's decoding: prompt ids and a token count -> the greedy token ids."""
    w = find(workload)
    with recipe_inputs(w) as folder:
        model, _ = load_for_generation(folder / BASE_GGUF)
        exact, g = load_llama(folder / BASE_GGUF)  # float32, for mlx-lm's copy
        g.close()
    from mlx_lm_step import build_peer  # mlx-lm is optional (the bench extra)

    peer = build_peer(w.llama, weights_np(exact))
    del exact
    compiled = CompiledDecode(model)

    def mlx_lm_rows(prompt: list[int], n: int) -> Iterator[int]:
        from mlx_lm.generate import generate_step

        for tok, _ in generate_step(mx.array(prompt), peer, max_tokens=n, sampler=greedy):
            yield int(tok)

    return {"toymlx eager": lambda p, n: decode(model, p, n, greedy),
            "toymlx CompiledDecode": lambda p, n: decode(compiled, p, n, greedy),
            "mlx-lm": mlx_lm_rows}


def run(workload: str, n: int, rounds: int, log: Callable[[str], None]) -> dict:
    """One workload: a warm-up decode of each row (its kernels built), then `rounds` rounds of
    `n` tokens each, the rows' order alternating."""
    rows = decoders(workload)
    vocab = find(workload).llama.vocab_size
    prompt = np.random.default_rng(0).integers(0, vocab, PROMPT_TOKENS).tolist()
    tokens: dict[str, list[int]] = {}
    for name, fn in rows.items():
        t = time.perf_counter()
        tokens[name] = list(fn(prompt, n))
        log(f"  {workload} {name}: first decode {time.perf_counter() - t:.2f} s")
    times: dict[str, list[float]] = {name: [] for name in rows}
    for r in range(rounds):
        order = list(rows) if r % 2 == 0 else list(reversed(rows))
        for name in order:
            t = time.perf_counter()
            got = sum(1 for _ in rows[name](prompt, n))
            times[name].append(got / (time.perf_counter() - t))
        log(f"  {workload} round {r + 1}/{rounds}: " +
            "  ".join(f"{k} {times[k][-1]:.1f} tok/s" for k in order))
    ref = tokens["toymlx eager"]
    out = {}
    for name in rows:
        same = next((i for i, (a, b) in enumerate(zip(ref, tokens[name])) if a != b),
                    min(len(ref), len(tokens[name])))
        out[name] = {"tokens_per_s": statistics.median(times[name]),
                     "agree_with_eager": same, "tokens": len(tokens[name])}
    return {"workload": workload, "prompt_tokens": PROMPT_TOKENS, "max_tokens": n,
            "generate_uses": "toymlx eager" if on_gpu() else "toymlx CompiledDecode",
            "rows": out}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cpu", "gpu"], default="gpu")
    p.add_argument("--only", nargs="+", default=["lora-q-135m-8x512"],
                   help="GPU-suite LoRA workloads whose base is decoded (workloads.py)")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", help="write the results here")
    a = p.parse_args(argv)
    if a.tokens < 1 or a.rounds < 1:
        p.error(f"--tokens and --rounds: expected >= 1, found {a.tokens} and {a.rounds}")
    select_device(a.device)
    setup_process()
    log = lambda s: print(s, file=sys.stderr, flush=True)
    results = {"backend": backend_info(), "workloads": []}
    for name in a.only:
        res = run(name, a.tokens, a.rounds, log)
        results["workloads"].append(res)
        eager = res["rows"]["toymlx eager"]["tokens_per_s"]
        for k, r in res["rows"].items():
            print(f"{name:<20} {k:<22} {r['tokens_per_s']:8.1f} tok/s  "
                  f"x{r['tokens_per_s'] / eager:.2f} of toymlx eager  "
                  f"agrees for {r['agree_with_eager']}/{r['tokens']} tokens", flush=True)
        print(f"{name:<20} toymlx.generation.generate decodes here as: {res['generate_uses']}")
        if a.json:
            with open(a.json, "w") as f:
                json.dump(results, f, indent=1, default=float)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
