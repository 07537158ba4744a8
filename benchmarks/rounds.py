"""Interleaved timing: every implementation of a workload steps once per round, in turn.

A round runs each variant's step once (A B C, then C B A in the next round, so none always
goes first); a busy machine then slows every variant alike, and the per-round time ratios are
robust where the raw times drift. Both suites time through `first_steps` and `run_rounds`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field


class Variant:
    """One implementation of a workload's training step."""

    name = ""
    uses_mlx = True
    """Its arrays live in MLX (so MLX's memory counters see them)."""

    def step(self, s: int) -> float:
        """Train one step (step index `s`, 0-based); return its loss, fully computed."""
        raise NotImplementedError

    def first_grad_norm(self) -> float | None:
        """The gradient norm of step 0 (None where the implementation does not compute it)."""
        return None

    def resident_bytes(self) -> int | None:
        """Bytes its weights and optimizer state hold between steps (None: not known)."""
        return None

    def close(self) -> None:
        """Release what the variant holds outside this process."""


@dataclass
class VariantResult:
    name: str
    first_step_s: float
    build_s: float
    loss0: float
    grad_norm0: float | None
    times_s: list[float] = field(default_factory=list)
    cpu_s: list[float] = field(default_factory=list)
    """Process CPU time of each timed step (all threads): robust to a busy machine's waits,
    but it counts spinning BLAS/OpenMP threads as work."""
    mlx_peak_mb: float | None = None
    rss_peak_mb: float | None = None

    @property
    def median_s(self) -> float:
        return statistics.median(self.times_s)


def first_steps(variants: list[Variant], builds: dict[str, float], tag: str,
                log: Callable[[str], None]) -> dict[str, VariantResult]:
    """Step 0 of each variant, one after another (it includes compilation), with its loss."""
    results: dict[str, VariantResult] = {}
    for v in variants:
        t = time.perf_counter()
        loss0 = v.step(0)
        results[v.name] = VariantResult(v.name, time.perf_counter() - t, builds[v.name],
                                        loss0, v.first_grad_norm())
        log(f"  {tag} {v.name}: first step {results[v.name].first_step_s:.2f} s, "
            f"loss {loss0:.5f}")
    return results


def run_rounds(variants: list[Variant], rounds: int, warmup: int, tag: str,
               timed_step: Callable[[Variant, int], float],
               before_round: Callable[[int], str] = lambda r: "",
               log: Callable[[str], None] = print) -> list[dict[str, float]]:
    """`warmup` untimed steps of each variant, then `rounds` interleaved rounds of
    `timed_step(variant, step)` (which returns the step's seconds and records what else it
    measures); `before_round(r)` runs first in each round and returns a note for its log line.
    Returns each round's {variant: seconds}.

    The order alternates between rounds, so with an even count each variant goes first in half
    of them: on an AMD EPYC Zen 4 the first slot of a round (right after `before_round`'s sgemm
    probes) took 30-60 ms longer for toymlx and PyTorch alike on a 350-850 ms step, and an odd
    count (5) tilted the median ratio by up to 7% against whoever went first more often."""
    if rounds % 2 and len(variants) > 1:
        log(f"  {tag}: {rounds} rounds is odd, so {variants[0].name} goes first once more than "
            "the others (the first slot is slower); an even count balances the order")
    for i in range(warmup):
        for v in variants:
            v.step(1 + i)
    out, s = [], 1 + warmup
    for r in range(rounds):
        note = before_round(r)
        this = {}
        for v in variants if r % 2 == 0 else variants[::-1]:
            this[v.name] = timed_step(v, s)
        s += 1
        out.append(this)
        log(f"  {tag} round {r + 1}/{rounds}: " +
            "  ".join(f"{k} {t * 1e3:.0f} ms" for k, t in this.items()) + note)
    return out


def median_ratios(per_round: list[dict[str, float]], ref: str = "toymlx") -> dict[str, float]:
    """{other: median over rounds of ref's value / other's value} (a time ratio: < 1 means
    `ref` took less)."""
    ratios: dict[str, list[float]] = {}
    for this in per_round:
        for name, x in this.items():
            if name != ref and ref in this:
                ratios.setdefault(name, []).append(this[ref] / x)
    return {k: statistics.median(v) for k, v in ratios.items()}
