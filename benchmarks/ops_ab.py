"""toymlx's step under variants of its math (`Ops`), side by side in one process: which choice
costs the time. Each variant is the workload's recipe-built Task (`toymlx_step.build_task`, as
the bench's toymlx row) with its Ops changed one way; interleaved rounds, the median step and
MLX's peak memory of each.

    python benchmarks/ops_ab.py --device gpu --dtype bfloat16 --only lora-q-360m-8x512 \\
        --variants default keep-attention [--peers mlx-lm torch] [--profile] [--rounds 6] \\
        [--json out.json]

--peers adds the GPU suite's peer rows (`gpu_suite.peer_variant`, from the default variant's
weights) to the same interleaved rounds; --profile then records one more step of every row
under PyTorch's CUDA profiler (`gpu_suite.kernel_profile`: the kernels it launched, their
count and time against the step's).

Variants (`VARIANTS`):
- default: what toymlx trains with on the device (`training_ops`);
- keep-attention: attention's activations kept for the backward pass, never recomputed
  (`attention_keep_limit` unbounded); recompute-attention: always recomputed (0);
- composed-attention: attention as softmax(q k^T scale) v in plain MLX ops (their own
  autodiff) instead of `mx.fast.scaled_dot_product_attention` (MLX's fused kernel and its vjp);
- padded-attention: a non-causal attention's rows padded to a multiple of 128 (zero queries,
  keys and values, the padded keys masked out, the padded rows' outputs dropped). MLX 0.32's
  CUDA attention has a fused backward pass (cuDNN's) only where the query length is a multiple
  of 128 (`ScaledDotProductAttentionVJP::use_fallback`); other lengths, such as ViT-Tiny 224's
  197 tokens, differentiate the composed form, scores and all. Metal has no fused backward;
- cpu-logits, logits-2^K (K 22, 23, 24, 26, 28): the loss's logits computed
  at the CPU's sizes (`Ops.logits_values` None) or 2^K logits at a time (a frozen head's
  slices, a trained head's chunks); a GPU's default is `CUDA_LOGITS_VALUES`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Callable

import mlx.core as mx
from gpu_suite import (
    format_kernel_profile,
    kernel_profile,
    memory_meters,
    metered_step,
    peer_variant,
    torch_side,
)
from rounds import Variant, first_steps, run_rounds
from toymlx_step import ToymlxVariant, build_task, recipe_inputs, weights_np
from workloads import find, make_batch

from toymlx.backend.device import select_device, setup_process
from toymlx.models.ops import Ops, training_ops


@dataclasses.dataclass(frozen=True)
class ComposedAttention(Ops):
    """Ops whose attention is composed of MLX's plain ops (differentiated op by op)."""

    def attention(self, q: mx.array, k: mx.array, v: mx.array, scale: float,
                  causal: bool, window: int | None = None,
                  softcap: float | None = None) -> mx.array:
        if window is not None:
            raise ValueError("composed-attention: sliding windows are not composed here")
        groups = q.shape[1] // k.shape[1]
        if groups > 1:
            k, v = (mx.repeat(t, groups, axis=1) for t in (k, v))
        scores = (q * scale) @ k.swapaxes(-1, -2)
        if softcap:  # before the mask, as Ops.attention caps
            scores = softcap * mx.tanh(scores / softcap)
        T, S = q.shape[2], k.shape[2]
        if causal and T > 1:
            future = mx.arange(S)[None] > mx.arange(S - T, S)[:, None]
            scores = mx.where(future, mx.array(-mx.inf, scores.dtype), scores)
        return mx.softmax(scores, axis=-1, precise=True) @ v


@dataclasses.dataclass(frozen=True)
class PaddedAttention(Ops):
    """Ops whose non-causal attention runs on rows padded to a multiple of `PAD`."""

    PAD = 128

    def attention(self, q: mx.array, k: mx.array, v: mx.array, scale: float,
                  causal: bool, window: int | None = None,
                  softcap: float | None = None) -> mx.array:
        T, S = q.shape[2], k.shape[2]
        if (causal or window is not None or softcap
                or (T % self.PAD == 0 and S % self.PAD == 0)):
            return super().attention(q, k, v, scale, causal, window, softcap)
        Tp, Sp = -(-T // self.PAD) * self.PAD, -(-S // self.PAD) * self.PAD

        def pad(x: mx.array, n: int) -> mx.array:
            return mx.pad(x, [(0, 0), (0, 0), (0, n - x.shape[2]), (0, 0)])

        mask = mx.where(mx.arange(Sp) < S, 0.0, -mx.inf).astype(q.dtype)  # (Sp,)
        o = mx.fast.scaled_dot_product_attention(pad(q, Tp), pad(k, Sp), pad(v, Sp),
                                                 scale=scale, mask=mask[None, None, None])
        return o[:, :, :T]


def _as(cls: type[Ops]) -> Callable[[Ops], Ops]:
    """The same Ops, computing attention as `cls` does."""
    return lambda ops: cls(**{f.name: getattr(ops, f.name) for f in dataclasses.fields(ops)})


VARIANTS: dict[str, Callable[[Ops], Ops]] = {
    "default": lambda ops: ops,
    "keep-attention": lambda ops: dataclasses.replace(ops, attention_keep_limit=2**62),
    "recompute-attention": lambda ops: dataclasses.replace(ops, attention_keep_limit=0),
    "composed-attention": _as(ComposedAttention),
    "padded-attention": _as(PaddedAttention),
    "cpu-logits": lambda ops: dataclasses.replace(ops, logits_values=None),
    **{f"logits-2^{k}": (lambda ops, k=k: dataclasses.replace(ops, logits_values=1 << k))
       for k in (22, 23, 24, 26, 28)},
}


def run(workload: str, dtype: str, on_gpu: bool, names: list[str], rounds: int, warmup: int,
        log: Callable[[str], None], peers: tuple[str, ...] = (), profile: bool = False) -> dict:
    """One workload's variants (and `peers`' rows): first step, interleaved rounds, median and
    peak memory of each; with `profile`, one more step of each under the CUDA profiler."""
    w = find(workload)
    batch = make_batch(w)
    base = training_ops(on_gpu=on_gpu, dtype=dtype)
    variants: list[Variant] = []
    builds: dict[str, float] = {}
    with recipe_inputs(w) as inputs:
        for name in names:
            t = time.perf_counter()
            task, cfg = build_task(w, VARIANTS[name](base), inputs)
            variants.append(ToymlxVariant(task, cfg, batch, name=name))
            builds[name] = time.perf_counter() - t
    torch_device, _, notes = (torch_side("gpu" if on_gpu else "cpu") if "torch" in peers
                              else (None, {}, []))
    for note in notes:
        log(note)
    weights = weights_np(variants[0].task.model)
    for name in peers:
        t = time.perf_counter()
        v = peer_variant(name, w, weights, batch, base.dtype, torch_device)
        if v is not None:
            variants.append(v)
            builds[v.name] = time.perf_counter() - t
    results = first_steps(variants, builds, workload, log)
    peaks: dict[str, float] = {}
    meters = memory_meters(variants, torch_device)
    per_round = run_rounds(
        variants, rounds, warmup, workload,
        lambda v, s: metered_step(v, s, meters.get(v.name), results[v.name].times_s, peaks),
        log=log)
    rows = {v.name: {"median_ms": results[v.name].median_s * 1e3,
                     "first_step_s": results[v.name].first_step_s,
                     "loss0": results[v.name].loss0, "peak_mb": peaks.get(v.name),
                     "over_default": statistics.median(r[v.name] / r[names[0]]
                                                       for r in per_round)}
            for v in variants}
    if profile:
        step = warmup + rounds + 1
        for v in variants:
            rows[v.name]["profile"] = kernel_profile(lambda v=v: v.step(step))
            log(format_kernel_profile(f"{workload} {v.name}", rows[v.name]["profile"]))
    for v in variants:
        v.close()
    return {"workload": workload, "dtype": dtype, "ops": base.describe(), "rows": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cpu", "gpu"], default="gpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--only", nargs="+", required=True, help="workload names (workloads.py)")
    p.add_argument("--variants", nargs="+", default=["default", "keep-attention"],
                   choices=list(VARIANTS))
    p.add_argument("--peers", nargs="*", default=[], choices=["mlx-lm", "torch"],
                   help="peer rows in the same rounds (gpu_suite.peer_variant)")
    p.add_argument("--profile", action="store_true",
                   help="then one step of each row under PyTorch's CUDA profiler")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--json", help="write the results here (after each workload)")
    a = p.parse_args(argv)
    select_device(a.device)
    setup_process()
    log = lambda s: print(s, file=sys.stderr, flush=True)
    out = []
    for name in a.only:
        res = run(name, a.dtype, a.device == "gpu", a.variants, a.rounds, a.warmup, log,
                  tuple(a.peers), a.profile)
        out.append(res)
        for k, r in res["rows"].items():
            peak = "-" if r["peak_mb"] is None else f"{r['peak_mb']:.0f}"
            print(f"{name:<22} {res['dtype'] if a.dtype == 'auto' else a.dtype:<9} {k:<20} "
                  f"{r['median_ms']:8.1f} ms  x{r['over_default']:.3f} of {a.variants[0]}  "
                  f"peak {peak:>8} MB  first {r['first_step_s']:6.1f} s  "
                  f"loss0 {r['loss0']:.5f}", flush=True)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(out, f, indent=1, default=float)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
