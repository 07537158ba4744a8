"""toymlx's CPU step under two process environments, side by side: what a setting costs.

Each side is the benchmark's toymlx step (the Task `toymlx-train` builds) in a process of its own
(`procs.ChildVariant`), started with the environment the benchmark gives toymlx
(`procs.child_env`) plus the side's variables. The two step in interleaved rounds
(`rounds.run_rounds`, the order alternating), so each round's ratio compares steps taken
seconds apart. On the 2-core cloud hosts this project measures on, one configuration's median
step moved 15-25% between runs minutes apart (docs/RESULTS.md, session 25): only paired ratios
tell a few percent. For a form of toymlx's math, which can share one process, see `ops_ab.py`.

    python benchmarks/env_ab.py --only vit-tiny-28 --b GOMP_SPINCOUNT=0 [--a VAR=VALUE ...]
        [--rounds 24] [--json out.json]

Prints the host line, what differs between the two sides' backends (`backend_info`, as each
child reports it), each side's median step and CPU time, the median and quartiles of the
per-round ratios b/a (wall and CPU), and whether the sides' losses agree bit for bit.
"""

from __future__ import annotations

import toymlx  # noqa: F401  (first: it loads the BLAS, which must precede mlx.core)

# isort: split
import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from procs import ChildVariant, start_variants, write_step_inputs
from rounds import first_steps, run_rounds
from toymlx_step import recipe_inputs
from user_paths import host_info, host_line
from workloads import Workload, cpu_workloads


def parse_env(items: list[str], flag: str) -> dict[str, str]:
    """["VAR=VALUE", ...] -> {VAR: VALUE}; ValueError naming the flag and the item otherwise."""
    env = {}
    for item in items:
        var, sep, value = item.partition("=")
        if not sep or not var or not var.replace("_", "").isalnum():
            raise ValueError(f"{flag}: expected VAR=VALUE, found {item!r}")
        env[var] = value
    return env


def quartiles(xs: list[float]) -> dict[str, float]:
    """The median and the quartiles of `xs`."""
    q1, med, q3 = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else xs * 3
    return {"median": med, "q1": q1, "q3": q3}


def run(w: Workload, a: dict[str, str], b: dict[str, str], rounds: int = 24, warmup: int = 1,
        log: Callable[[str], None] = print) -> dict[str, Any]:
    """Side a and side b of `w`'s toymlx step (`a`, `b`: the variables each child starts with),
    their first steps, `warmup` steps, then `rounds` interleaved rounds; the figures."""
    with recipe_inputs(w) as inputs:  # written once; the built sides no longer read them
        write_step_inputs(w, inputs, weights=False)
        sides, builds = start_variants(w, inputs, [("toymlx", "a", a), ("toymlx", "b", b)])
    try:
        results = first_steps(sides, builds, w.name, log)
        losses: dict[str, list[float]] = {"a": [], "b": []}

        def timed_step(v: ChildVariant, s: int) -> float:
            t = time.perf_counter()
            losses[v.name].append(v.step(s))
            dt = time.perf_counter() - t
            results[v.name].times_s.append(dt)
            results[v.name].cpu_s.append(v.last_cpu)
            return dt

        per_round = run_rounds(sides, rounds, warmup, w.name, timed_step, log=log)
        backends = {v.name: v.info.get("backend", {}) for v in sides}
    finally:
        for v in sides:
            v.close()
    ra, rb = results["a"], results["b"]
    return {
        "workload": w.name, "host": host_info(), "a": a, "b": b, "rounds": rounds,
        "backend_differs": {k: [backends["a"].get(k), backends["b"].get(k)]
                            for k in sorted(set(backends["a"]) | set(backends["b"]))
                            if backends["a"].get(k) != backends["b"].get(k)},
        "sides": {n: {"median_ms": r.median_s * 1e3,
                      "cpu_median_ms": statistics.median(r.cpu_s) * 1e3,
                      "first_step_s": r.first_step_s, "loss0": r.loss0}
                  for n, r in (("a", ra), ("b", rb))},
        "ratio_wall": quartiles([r["b"] / r["a"] for r in per_round]),
        "ratio_cpu": quartiles([y / x for x, y in zip(ra.cpu_s, rb.cpu_s)]),
        "losses_equal": losses["a"] == losses["b"] and ra.loss0 == rb.loss0,
    }


def format_report(out: dict[str, Any]) -> str:
    env = {k: " ".join(f"{v}={x}" for v, x in out[k].items()) or "(as the benchmark)"
           for k in ("a", "b")}
    lines = [host_line(out["host"]), f"a: {env['a']}", f"b: {env['b']}"]
    lines += [f"backend differs: {k}: a {x!r}, b {y!r}"
              for k, (x, y) in out["backend_differs"].items()]
    for n, s in out["sides"].items():
        lines.append(f"{out['workload']} {n}: median step {s['median_ms']:.0f} ms, "
                     f"CPU {s['cpu_median_ms']:.0f} ms, first step {s['first_step_s']:.2f} s")
    for k in ("wall", "cpu"):
        r = out[f"ratio_{k}"]
        lines.append(f"b/a {k}, median of {out['rounds']} rounds: {r['median']:.3f} "
                     f"(quartiles {r['q1']:.3f}-{r['q3']:.3f})")
    lines.append(f"losses bit for bit: {'yes' if out['losses_equal'] else 'NO'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    names = [w.name for w in cpu_workloads()]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default="vit-tiny-28", choices=names, help="the workload")
    p.add_argument("--a", nargs="*", default=[], metavar="VAR=VALUE",
                   help="side a's variables (default: none beyond the benchmark's)")
    p.add_argument("--b", nargs="*", default=[], metavar="VAR=VALUE", help="side b's variables")
    p.add_argument("--rounds", type=int, default=24, help="interleaved rounds (even: each side "
                   "goes first equally often)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps after the first")
    p.add_argument("--json", help="write the figures here too")
    args = p.parse_args(argv)
    try:
        a, b = parse_env(args.a, "--a"), parse_env(args.b, "--b")
        if args.rounds < 1:
            raise ValueError(f"--rounds: expected >= 1, found {args.rounds}")
    except ValueError as e:
        print(f"env_ab: {e}", file=sys.stderr)
        return 2
    w = next(w for w in cpu_workloads() if w.name == args.only)
    out = run(w, a, b, args.rounds, args.warmup, log=lambda s: print(s, file=sys.stderr))
    print(format_report(out))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
