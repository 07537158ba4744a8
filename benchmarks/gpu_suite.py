"""The GPU suite: GPU-sized workloads at float32 and bfloat16 against mlx-lm and PyTorch.

Rows for each workload and dtype, all from the same weights (those of the Task the workload's
recipe builds, `toymlx_step.build_task`; their step-0 losses side by side): toymlx; mlx-lm's
LoRA step on the LoRA workloads, on the same device and dtype (its model cast with
`set_dtype`); PyTorch where the device is a CUDA GPU (or the CPU, with
--device cpu): bf16 autocast, fused AdamW, SDPA, eager and under `torch.compile`.

- TFLOPS = the workload's training FLOPs / the row's median step time.
- MFU = TFLOPS / the fastest n^3 matmul of the row's dtype (MLX's or PyTorch's, whichever is
  faster) timed in the same run, before the workloads. On CUDA both frameworks run float32
  matmuls as TF32 (MLX always does; PyTorch is set to "high" precision to match).
- Peak memory of a row: its own weights and optimizer state plus the most its step allocated
  beyond what was live just before (`mx.get_peak_memory`, `torch.cuda.max_memory_allocated`),
  so rows sharing the process do not count each other's weights.

`--shapes tiny` runs every one of these code paths at shapes a CPU trains in seconds. toymlx's
rows compute with the math toymlx trains with on a GPU (`training_ops(on_gpu=True, dtype)`:
MLX's fused kernels, float32 master weights, `mx.fast.rope`) on either device.
"""

from __future__ import annotations

import gc
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from cpu_suite import num
from procs import MB
from rounds import Variant, first_steps, median_ratios, run_rounds
from scratch import scratch_folder
from toymlx_step import ToymlxVariant, build_task, gpu_ops, recipe_inputs, weights_np
from workloads import Workload, gpu_workloads, make_batch, train_flops

from toymlx.backend.device import backend_info

IMPLS = ("toymlx", "mlx-lm", "torch", "torch-compile")
DTYPES = ("float32", "bfloat16")
MATMUL_N = {"full": 8192, "tiny": 256}


@dataclass(frozen=True)
class Memory:
    """One framework's allocation counters (bytes)."""

    live: Callable[[], int]
    reset_peak: Callable[[], None]
    peak: Callable[[], int]


MLX_MEMORY = Memory(mx.get_active_memory, mx.reset_peak_memory, mx.get_peak_memory)


def time_best(run: Callable[[], None], reps: int) -> float:
    """The fastest of `reps` timed calls of `run`, after one untimed call."""
    run()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t)
    return best


def matmul_peak(dtype: str, n: int, torch_device: str | None, reps: int = 10) -> dict[str, Any]:
    """TFLOPS of an n^3 matmul in `dtype` in MLX (and PyTorch on `torch_device`); the faster
    one is the peak that MFU divides by."""
    a, b = (mx.random.normal((n, n)).astype(getattr(mx, dtype)) for _ in range(2))
    mx.eval(a, b)
    out: dict[str, Any] = {"n": n}
    out["mlx"] = {"seconds": time_best(lambda: mx.eval(a @ b), reps)}
    if torch_device is not None:
        import torch  # optional (the bench extra)

        ta, tb = (torch.randn(n, n, device=torch_device).to(getattr(torch, dtype))
                  for _ in range(2))
        sync = torch.cuda.synchronize if torch_device == "cuda" else (lambda: None)

        def torch_mm() -> None:
            ta @ tb
            sync()

        out["torch"] = {"seconds": time_best(torch_mm, reps)}
    for k in ("mlx", "torch"):
        if k in out:
            out[k]["tflops"] = 2 * n ** 3 / out[k]["seconds"] / 1e12
    out["peak_tflops"] = max(out[k]["tflops"] for k in ("mlx", "torch") if k in out)
    return out


def metered_step(v: Variant, s: int, meter: Memory | None, times_s: list[float],
                 peak_mb: dict[str, float]) -> float:
    """Step `v` once, timed: its seconds appended to `times_s` and returned; with a `meter`,
    the row's peak memory (its weights and optimizer state plus the most the step allocated
    beyond what was live before it) raised in `peak_mb[v.name]`."""
    if meter is not None:
        live = meter.live()
        meter.reset_peak()
    t = time.perf_counter()
    v.step(s)
    dt = time.perf_counter() - t
    times_s.append(dt)
    if meter is not None:
        own = v.resident_bytes() + meter.peak() - live
        peak_mb[v.name] = max(peak_mb.get(v.name, 0.0), own / MB)
    return dt


def peer_variant(name: str, w: Workload, weights: dict[str, np.ndarray],
                 batch: dict[str, np.ndarray], dtype: str, torch_device: str | None,
                 compile_backend: str = "inductor") -> Variant | None:
    """A peer's row of `w` from toymlx's `weights` (`weights_np`): mlx-lm (its LoRA step, on
    LoRA workloads), torch or torch-compile (where `torch_device` is set); None where the peer
    has no such row."""
    if name == "mlx-lm":
        if not w.lora:  # mlx-lm's trainer is a fine-tuner: its LoRA step only
            return None
        from mlx_lm_step import MlxLmVariant  # mlx-lm is optional (the bench extra)

        return MlxLmVariant(w, weights, batch, dtype=dtype)
    if name not in ("torch", "torch-compile"):
        raise ValueError(f"peer: expected mlx-lm, torch or torch-compile, found {name!r}")
    if torch_device is None:
        return None
    from torch_step import TorchStep  # PyTorch is optional (the bench extra)

    return TorchStep(w, weights, batch, device=torch_device, dtype=dtype,
                     compile_backend=compile_backend if name == "torch-compile" else None)


def build_variants(w: Workload, which: tuple[str, ...], dtype: str, torch_device: str | None,
                   compile_backend: str, inputs: Path) -> tuple[list[Variant], dict[str, float]]:
    """The rows of `w` in `dtype` that apply to it, each built from the same weights: those of
    the Task that `w`'s recipe builds (`toymlx_step.build_task`) from `inputs`."""
    batch = make_batch(w)
    t = time.perf_counter()
    task, cfg = build_task(w, gpu_ops(dtype), inputs)
    # what toymlx's model holds is where every row starts (in bfloat16, a LoRA base rounded)
    weights = weights_np(task.model)
    shared = time.perf_counter() - t
    variants, builds = [], {}
    for name in which:
        t = time.perf_counter()
        v = (ToymlxVariant(task, cfg, batch) if name == "toymlx" else
             peer_variant(name, w, weights, batch, dtype, torch_device, compile_backend))
        if v is not None:
            variants.append(v)
            builds[v.name] = time.perf_counter() - t + shared
    return variants, builds


def memory_meters(variants: list[Variant], torch_device: str | None) -> dict[str, Memory]:
    """Each row's allocation counters: MLX's for rows in MLX, CUDA's for PyTorch's on a GPU."""
    meters: dict[str, Memory] = {v.name: MLX_MEMORY for v in variants if v.uses_mlx}
    if torch_device == "cuda":
        import torch  # optional (the bench extra)

        cuda = Memory(torch.cuda.memory_allocated, torch.cuda.reset_peak_memory_stats,
                      torch.cuda.max_memory_allocated)
        meters.update({v.name: cuda for v in variants if not v.uses_mlx})
    return meters


def torch_side(device: str) -> tuple[str | None, dict[str, Any], list[str]]:
    """PyTorch's device for the peer rows beside MLX's `device` (None: no PyTorch rows), what
    to record of it, and notes on why there are none. On CUDA, float32 matmuls as TF32, as
    MLX runs them."""
    try:
        import torch  # optional (the bench extra)
    except ImportError:
        return None, {}, ["PyTorch is not installed: no PyTorch rows"]
    info: dict[str, Any] = {"torch": torch.__version__}
    if device == "cpu":
        return "cpu", info, []
    if not torch.cuda.is_available():
        return None, info, ["torch.cuda.is_available() is false: no PyTorch rows"]
    info.update(torch_cuda=torch.version.cuda, torch_device_name=torch.cuda.get_device_name(),
                float32_matmuls="tf32")
    torch.set_float32_matmul_precision("high")
    return "cuda", info, []


def kernel_profile(step: Callable[[], None], top: int = 15) -> dict[str, Any]:
    """The GPU kernels one call of `step` launched, as CUPTI records them through PyTorch's
    profiler (every kernel of the process, MLX's too, read from its trace's "kernel" events):
    their count, summed time against the call's wall time (a sum well under the wall time: the
    GPU waited on launches), and the `top` kernels by summed time. {"error": ...} where there is
    no PyTorch, no CUDA, or the profiler fails."""
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile

        if not torch.cuda.is_available():
            return {"error": "torch.cuda.is_available() is false"}
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            t = time.perf_counter()
            step()
            torch.cuda.synchronize()
            wall = time.perf_counter() - t
        with scratch_folder("toymlx-profile-") as tmp:
            trace = tmp / "trace.json"
            prof.export_chrome_trace(str(trace))
            events = json.loads(trace.read_text()).get("traceEvents", [])
    except Exception as e:  # noqa: BLE001 -- a profile that fails must not cost the figures
        return {"error": f"{type(e).__name__}: {str(e).strip()[:300]}"}
    kernels: dict[str, list[float]] = {}
    for e in events:
        if e.get("cat") == "kernel" and "dur" in e:
            kernels.setdefault(e.get("name", "?"), []).append(float(e["dur"]))
    total_us = sum(sum(v) for v in kernels.values())
    ranked = sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:top]
    return {"wall_ms": wall * 1e3, "kernels": sum(len(v) for v in kernels.values()),
            "distinct": len(kernels), "kernel_ms": total_us / 1e3,
            "top": [{"name": k[:120], "count": len(v), "ms": sum(v) / 1e3} for k, v in ranked]}


def format_kernel_profile(name: str, prof: dict[str, Any]) -> str:
    """`kernel_profile`'s result as lines of text."""
    if "error" in prof:
        return f"{name}: kernel profile: {prof['error']}"
    head = (f"{name}: {prof['kernels']} kernels ({prof['distinct']} distinct), "
            f"{prof['kernel_ms']:.1f} ms of kernels in {prof['wall_ms']:.1f} ms")
    lines = [head]
    lines += [f"  {k['ms']:8.2f} ms {k['count']:5d}x  {k['name']}" for k in prof["top"]]
    return "\n".join(lines)


def run_workload(w: Workload, dtype: str, which: tuple[str, ...], rounds: int, warmup: int,
                 peak: dict[str, Any], torch_device: str | None, compile_backend: str,
                 inputs: Path, log: Callable[[str], None] = print) -> dict[str, Any]:
    """One workload in one dtype (its recipe's inputs in `inputs`): first steps, warm-up,
    interleaved rounds; per row its median, TFLOPS, MFU and peak memory."""
    variants, builds = build_variants(w, which, dtype, torch_device, compile_backend, inputs)
    tag = f"{w.name} {dtype}"
    results = first_steps(variants, builds, tag, log)
    meters = memory_meters(variants, torch_device)
    peak_mb: dict[str, float] = {}

    def timed_step(v: Variant, s: int) -> float:
        return metered_step(v, s, meters.get(v.name), results[v.name].times_s, peak_mb)

    per_round = run_rounds(variants, rounds, warmup, tag, timed_step, log=log)
    flops = train_flops(w)
    rows = {}
    for v in variants:
        res = results[v.name]
        med = res.median_s
        tflops = flops / med / 1e12
        rows[v.name] = {"median_s": med, "min_s": min(res.times_s), "max_s": max(res.times_s),
                        "times_s": res.times_s, "first_step_s": res.first_step_s,
                        "build_s": res.build_s, "loss0": res.loss0, "grad_norm0": res.grad_norm0,
                        "items_per_s": w.tokens / med, "tflops": tflops,
                        "mfu": tflops / peak["peak_tflops"], "peak_mb": peak_mb.get(v.name),
                        "resident_mb": _mb(v.resident_bytes())}
        v.close()
    losses = [r["loss0"] for r in rows.values()]
    return {"workload": w.name, "dtype": dtype, "shape": w.describe(), "flops_per_step": flops,
            "toymlx_ops": gpu_ops(dtype).describe(),
            "items_per_step": w.tokens, "unit": w.unit, "rounds": rounds,
            "peak_tflops": peak["peak_tflops"], "rows": rows,
            "ratio_toymlx_over": median_ratios(per_round),
            "loss0_spread": max(losses) - min(losses)}


def run_gpu(device: str, shapes: str = "full", dtypes: tuple[str, ...] = DTYPES,
            which: tuple[str, ...] = IMPLS, rounds: int = 10, warmup: int = 2,
            only: list[str] | None = None, compile_backend: str = "inductor",
            partial_json: str | None = None,
            log: Callable[[str], None] = print) -> dict[str, Any]:
    """Every selected GPU-suite workload in every dtype, on MLX's current default device
    (`device` says which it is, for PyTorch's side)."""
    chosen = [w for w in gpu_workloads(shapes) if not only or w.name in only]
    info: dict[str, Any] = {"suite": "gpu", "device": device, "shapes": shapes,
                            "dtypes": list(dtypes), "backend": backend_info(), "notes": [],
                            "torch_compile_backend": compile_backend, "matmul": {},
                            "workloads": []}
    torch_device, torch_info, notes = torch_side(device)
    info.update(torch_info)
    info["notes"] += notes
    try:
        import mlx_lm  # optional (the bench extra)

        info["mlx_lm"] = mlx_lm.__version__
    except ImportError:
        which = tuple(x for x in which if x != "mlx-lm")
        info["notes"].append("mlx-lm is not installed: no mlx-lm rows")
    t_all = time.perf_counter()
    for dtype in dtypes:
        info["matmul"][dtype] = matmul_peak(dtype, MATMUL_N[shapes], torch_device)
        log(f"matmul {MATMUL_N[shapes]}^3 {dtype}: " + ", ".join(
            f"{k} {info['matmul'][dtype][k]['tflops']:.3g} TFLOPS" for k in ("mlx", "torch")
            if k in info["matmul"][dtype]))
    for w in chosen:
        with recipe_inputs(w) as inputs:  # written once for every dtype
            for dtype in dtypes:
                log(f"{w.name} {dtype}: {', '.join(which)} x {rounds} rounds")
                try:
                    res = run_workload(w, dtype, which, rounds, warmup, info["matmul"][dtype],
                                       torch_device, compile_backend, inputs, log)
                except Exception as e:  # noqa: BLE001 -- one workload that fails (out of
                    # memory, a compiler error) must not cost the others' figures; the table
                    # shows it
                    res = {"workload": w.name, "dtype": dtype,
                           "error": f"{type(e).__name__}: {str(e).strip()[:500]}"}
                    log(f"  {w.name} {dtype} failed: {res['error']}")
                info["workloads"].append(res)
                _release(torch_device)
                if partial_json:
                    Path(partial_json).write_text(json.dumps(info, indent=1, default=float))
    info["total_s"] = time.perf_counter() - t_all
    return info


def _release(torch_device: str | None) -> None:
    """Give back what the last workload's rows held, and torch.compile's cached graphs."""
    gc.collect()
    mx.clear_cache()
    if torch_device is not None:
        import torch  # optional (the bench extra)

        torch.compiler.reset()
        if torch_device == "cuda":
            torch.cuda.empty_cache()


def _mb(n: int | None) -> float | None:
    return None if n is None else n / MB


def format_gpu_table(info: dict[str, Any]) -> str:
    """A plain-text table of the GPU suite's results."""
    b = info["backend"]
    lines = [(f"backend: {b.get('kind')} {b.get('name') or ''} mlx={b.get('mlx')} "
              f"mlx-lm={info.get('mlx_lm')} torch={info.get('torch')} (cuda "
              f"{info.get('torch_cuda')}, float32 matmuls {info.get('float32_matmuls', '-')}) "
              f"shapes={info['shapes']}")]
    lines += [f"note: {n}" for n in info["notes"]]
    for dtype, m in info["matmul"].items():
        lines.append(f"matmul {m['n']}^3 {dtype}: " + ", ".join(
            f"{k} {m[k]['tflops']:.3g}" for k in ("mlx", "torch") if k in m) +
            f" TFLOPS (peak {m['peak_tflops']:.3g})")
    hdr = (f"{'workload':<20} {'dtype':<8} {'impl':<13} {'median ms':>9} {'min ms':>8} "
           f"{'items/s':>9} {'TFLOPS':>7} {'MFU':>6} {'1st step s':>10} {'peak MB':>8} "
           f"{'loss0':>9} {'|g|0':>8}")
    lines += [hdr, "-" * len(hdr)]
    for res in info["workloads"]:
        if "error" in res:
            lines.append(f"{res['workload']:<20} {res['dtype']:<8} FAILED: {res['error']}")
            continue
        for name, r in res["rows"].items():
            lines.append(
                f"{res['workload']:<20} {res['dtype']:<8} {name:<13} {r['median_s'] * 1e3:>9.1f} "
                f"{r['min_s'] * 1e3:>8.1f} {r['items_per_s']:>9.0f} {r['tflops']:>7.3g} "
                f"{r['mfu']:>6.3f} {r['first_step_s']:>10.2f} {num(r['peak_mb']):>8} "
                f"{r['loss0']:>9.5f} {num(r['grad_norm0'], '.4f'):>8}")
        speed = ", ".join(f"{1 / x:.2f}x {k}" for k, x in res["ratio_toymlx_over"].items())
        unit = "img/s" if res["unit"] == "images" else "tok/s"
        lines.append(f"{'':<20} toymlx speed (median of per-round time ratios): "
                     f"{speed or '-'}; {res['flops_per_step'] / 1e9:.3g} GFLOP/step, {unit}; "
                     f"loss0 spread {res['loss0_spread']:.1e}")
    lines.append("MFU: TFLOPS / the faster n^3 matmul (MLX, PyTorch) of the row's dtype in this "
                 "run; peak MB: the row's weights + optimizer state + the most its step "
                 f"allocated beyond them. total {info['total_s']:.0f} s")
    return "\n".join(lines)
