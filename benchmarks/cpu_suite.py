"""The CPU suite: toymlx's step against PyTorch CPU and mlx-lm, float32, each in its own process.

Per workload: every variant built from the same weights (those of the Task the workload's recipe
builds, `toymlx_step.build_task`), its first step (with the compile),
a warm-up, then interleaved rounds with MLX's and numpy's 2048^3 sgemm timed before each;
medians, per-round time ratios (wall and CPU), MFU against MLX's sgemm. Optionally each
variant's peak RSS in a fresh process, GGUF I/O at the 360M size, data-parallel ranks.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from procs import (
    MB,
    ChildVariant,
    build_step,
    child_env,
    gguf_io,
    proc_status,
    run_child,
    run_dp,
    start_variants,
    write_step_inputs,
)
from rounds import Variant, first_steps, median_ratios, run_rounds
from scratch import scratch_folder
from toymlx_step import cpu_ops, recipe_inputs, reference_ops
from user_paths import format_user_paths, host_info, host_line, run_user_paths
from workloads import Workload, cpu_workloads, find, train_flops

from toymlx.backend import kernel_pch
from toymlx.backend.device import backend_info, kernel_cache_dir

DEFAULT_IMPLS = ("toymlx", "torch", "mlx-lm")


def build_variants(w: Workload, which: tuple[str, ...], inputs: Path
                   ) -> tuple[list[Variant], dict]:
    """Variants for `w` in the order they will be timed, each in its own process
    (`procs.ChildVariant`) and from the same weights: those of the Task that `w`'s recipe
    builds (`toymlx_step.build_task`) from `inputs` (`toymlx_step.recipe_inputs`), where the
    peers' weights and the batch are written too. Returns them and each one's build seconds."""
    write_step_inputs(w, inputs, weights=any(not x.startswith("toymlx") for x in which))
    # mlx-lm trains LoRA on decoders only
    return start_variants(w, inputs, [(impl, impl, None) for impl in which
                                      if impl != "mlx-lm" or (w.lora and w.kind == "llama")])


def mlx_sgemm(n: int = 2048) -> float:
    """GFLOPS of one n^3 float32 matmul in MLX."""
    a, b = mx.random.normal((n, n)), mx.random.normal((n, n))
    mx.eval(a, b)
    t = time.perf_counter()
    mx.eval(a @ b)
    return 2 * n ** 3 / (time.perf_counter() - t) / 1e9


def numpy_sgemm(n: int = 2048) -> float:
    """GFLOPS of one n^3 float32 matmul in numpy."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    t = time.perf_counter()
    a @ b
    return 2 * n ** 3 / (time.perf_counter() - t) / 1e9


def run_workload(w: Workload, rounds: int, warmup: int, which: tuple[str, ...],
                 log: Callable[[str], None] = print) -> dict[str, Any]:
    """Build, take the first step of each variant, warm up, then time interleaved rounds."""
    with recipe_inputs(w) as inputs:  # written once; the built variants no longer read them
        variants, builds = build_variants(w, which, inputs)
    try:
        return _time_variants(w, variants, builds, rounds, warmup, log)
    finally:
        for v in variants:
            v.close()


PROBE_SETTLE_S = 0.3
"""The pause between a round's sgemm probes and its first step: numpy's OpenBLAS threads spin
for ~0.1 s after a call before they sleep, and the step that followed at once shared its 2
cores with them (each round's first step, whichever side, took 50-80 ms longer)."""


def _time_variants(w: Workload, variants: list[ChildVariant], builds: dict[str, float],
                   rounds: int, warmup: int, log: Callable[[str], None]) -> dict[str, Any]:
    """`run_workload`'s timing and figures, once its variants are built."""
    results = first_steps(variants, builds, w.name, log)
    sgemm: dict[str, list[float]] = {"mlx": [], "numpy": []}
    cpu_rounds: list[dict[str, float]] = []

    def before_round(r: int) -> str:
        sgemm["mlx"].append(mlx_sgemm())
        sgemm["numpy"].append(numpy_sgemm())
        time.sleep(PROBE_SETTLE_S)
        cpu_rounds.append({})
        return f"  (sgemm mlx {sgemm['mlx'][-1]:.0f} GFLOPS)"

    def timed_step(v: ChildVariant, s: int) -> float:
        t = time.perf_counter()
        v.step(s)
        dt = time.perf_counter() - t
        res = results[v.name]
        res.times_s.append(dt)
        res.cpu_s.append(v.last_cpu)
        cpu_rounds[-1][v.name] = v.last_cpu
        if v.last_mlx_peak_mb is not None:
            res.mlx_peak_mb = max(res.mlx_peak_mb or 0.0, v.last_mlx_peak_mb)
        return dt

    per_round = run_rounds(variants, rounds, warmup, w.name, timed_step, before_round, log)
    heaps = {v.name: v.info["huge_pages"] for v in variants}
    flops = train_flops(w)
    load = os.getloadavg()[0]
    sg_mlx = statistics.median(sgemm["mlx"])
    sg_np = statistics.median(sgemm["numpy"])
    out = {"workload": w.name, "flops_per_step": flops, "items_per_step": w.tokens,
           "unit": w.unit, "rounds": rounds, "loadavg_1min_at_end": load,
           "sgemm_gflops": {"mlx": sg_mlx, "numpy": sg_np}, "variants": {},
           "ratio_toymlx_over": median_ratios(per_round),
           "cpu_ratio_toymlx_over": median_ratios(cpu_rounds)}
    for name, res in results.items():
        med = res.median_s
        gflops = flops / med / 1e9
        out["variants"][name] = {
            **{k: v for k, v in asdict(res).items() if k != "name"},
            "median_s": med, "min_s": min(res.times_s), "max_s": max(res.times_s),
            "median_cpu_s": statistics.median(res.cpu_s), "huge_pages": heaps[name],
            "items_per_s": w.tokens / med, "gflops": gflops,
            "mfu_vs_mlx_sgemm": gflops / sg_mlx, "mfu_vs_numpy_sgemm": gflops / sg_np,
        }
    return out


def probe_memory(workload: str, variant: str, steps: int = 3) -> dict[str, float]:
    """Peak RSS while one variant runs `steps` steps, in a process holding only that variant
    (run it in a child): Linux's VmHWM, reset after the build (/proc/self/clear_refs 5)."""
    w = find(workload)
    with recipe_inputs(w) as inputs:
        write_step_inputs(w, inputs, weights=not variant.startswith("toymlx"))
        v = build_step(variant, w, inputs)  # in this (probe) process
    v.step(0)
    gc.collect()
    mx.clear_cache()
    before = proc_status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    mx.reset_peak_memory()
    for s in range(1, steps + 1):
        v.step(s)
    return {"rss_peak_mb": proc_status("VmHWM"), "rss_before_steps_mb": before,
            "mlx_peak_mb": mx.get_peak_memory() / MB}


@contextmanager
def cold_kernels(tmp: Path, cold: bool) -> Iterator[float | None]:
    """With `cold`, MLX's kernels built afresh in `tmp` while the block runs (TMPDIR and
    TOYMLX_KERNEL_CACHE there, put back after); yields the seconds its precompiled header took
    to build (None without `cold`)."""
    if not cold:
        yield None
        return
    # mx.compile caches its g++-built kernels under $TMPDIR/mlx, which toymlx's set-up links
    # to its kernel folder; a fresh one of each makes the first step pay for the build, as a
    # first run on a new machine does, with the precompiled header toymlx's set-up puts in
    # that folder (timed apart: once a machine)
    before = {k: os.environ.get(k) for k in ("TMPDIR", "TOYMLX_KERNEL_CACHE")}
    os.environ["TMPDIR"] = str(tmp)
    os.environ["TOYMLX_KERNEL_CACHE"] = str(tmp / "kernels")
    tempfile.tempdir = None
    try:
        t = time.perf_counter()
        kernel_pch.install(kernel_cache_dir() / "cpu")
        yield time.perf_counter() - t
    finally:  # not left pointing at a folder that is about to go
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        tempfile.tempdir = None


def run_all(quick: bool = False, only: list[str] | None = None, rounds: int | None = None,
            warmup: int = 1, which: tuple[str, ...] = DEFAULT_IMPLS,
            memory: bool | None = None, gguf: bool | None = None, cold_jit: bool = True,
            partial_json: str | None = None, dp: int = 0, user_paths: bool = True,
            log: Callable[[str], None] = print) -> dict[str, Any]:
    """Every selected workload, then (optionally) child-process peak RSS and GGUF I/O, and the
    paths users run (`user_paths`: toymlx-train, toymlx.train after mlx, generation)."""
    # the folder and all made in it (runs, the GGUF, the cold kernels, tempfile's folders with
    # TMPDIR there) go when the suite ends, also by Ctrl-C or SIGTERM
    with scratch_folder("toymlx-bench-") as tmp, cold_kernels(tmp, cold_jit) as pch_s:
        chosen = [w for w in cpu_workloads()
                  if (w.quick or not quick) and (not only or w.name in only)]
        info: dict[str, Any] = {"suite": "cpu", "host": host_info(), "backend": backend_info(),
                                "quick": quick,
                                "toymlx_ops": {"toymlx": cpu_ops().describe(), "toymlx-ref":
                                               reference_ops().describe()},
                                "cold_jit": cold_jit, "kernel_pch_build_s": pch_s,
                                "torch_omp_wait_policy": child_env("torch")["OMP_WAIT_POLICY"],
                                "numpy": np.__version__, "workloads": []}
        try:
            import torch  # optional (the bench extra); its version and threads for the record

            info["torch"] = torch.__version__
            info["torch_threads"] = torch.get_num_threads()
        except ImportError:
            which = tuple(x for x in which if not x.startswith("torch"))
        try:
            import mlx_lm  # optional (the bench extra)

            info["mlx_lm"] = mlx_lm.__version__
        except ImportError:
            which = tuple(x for x in which if x != "mlx-lm")
        t_all = time.perf_counter()
        for w in chosen:
            n = rounds or (4 if quick or (w.llama is not None and w.llama.d_model >= 960) else 6)
            log(f"{w.name}: {', '.join(which)} x {n} rounds")
            try:
                res = run_workload(w, n, warmup, which, log)
            except Exception as e:  # noqa: BLE001 -- one workload that fails (a child out of
                # memory, a compiler error) must not cost the others' figures; the table shows it
                res = {"workload": w.name, "error": f"{type(e).__name__}: {str(e).strip()[-500:]}"}
                log(f"  {w.name} failed: {res['error']}")
            mx.clear_cache()
            info["workloads"].append(res)
            if partial_json:
                Path(partial_json).write_text(json.dumps(info, indent=1, default=float))
        if memory if memory is not None else not quick:
            for res in info["workloads"]:
                for name in res.get("variants", {}):
                    log(f"  peak RSS: {res['workload']} {name}")
                    probe = run_child(f"import json; from cpu_suite import probe_memory; "
                                      f"print(json.dumps(probe_memory({res['workload']!r}, "
                                      f"{name!r})))")
                    res["variants"][name].update(
                        rss_peak_mb=probe["rss_peak_mb"],
                        rss_before_steps_mb=probe["rss_before_steps_mb"])
        for w in chosen if dp > 1 else []:
            log(f"{w.name}: {dp} data-parallel ranks against one process")
            info.setdefault("data_parallel", []).append(run_dp(w.name, dp, log=log))
        if gguf if gguf is not None else not quick:
            log("GGUF write + load at the SmolLM2-360M size")
            info["gguf_360m"] = gguf_io(tmp)
        if user_paths:
            lora = next((r for r in info["workloads"] if r["workload"] == "lora-q-135m"), None)
            bench_s = lora.get("variants", {}).get("toymlx", {}).get("median_s") if lora else None
            info["user_paths"] = run_user_paths(bench_s, log)
        info["total_s"] = time.perf_counter() - t_all
        return info


def format_table(info: dict[str, Any]) -> str:
    """A plain-text table of the results."""
    b = info["backend"]
    lines = [host_line(info["host"]), (f"backend: {b.get('kind')} blas={b.get('blas')} mlx={b.get('mlx')} "
              f"torch={info.get('torch')} ({info.get('torch_threads')} threads) "
              f"mlx-lm={info.get('mlx_lm')} cores={b.get('cores')} "
              f"cold_jit={info['cold_jit']} (kernel PCH built in "
              f"{num(info.get('kernel_pch_build_s'), '.1f')} s) "
              f"PyTorch's OMP_WAIT_POLICY={info.get('torch_omp_wait_policy')}")]
    wn = max([13] + [len(r["workload"]) for r in info["workloads"]])  # the name column
    hdr = (f"{'workload':<{wn}} {'impl':<7} {'median ms':>9} {'min ms':>8} {'cpu ms':>8} "
           f"{'items/s':>9} "
           f"{'GFLOPS':>7} {'MFU':>5} {'1st step s':>10} {'mlx MB':>8} {'RSS MB':>8} "
           f"{'loss0':>9} {'|g|0':>8}")
    lines += [hdr, "-" * len(hdr)]
    for res in info["workloads"]:
        if "error" in res:
            lines.append(f"{res['workload']:<{wn}} FAILED: {res['error']}")
            continue
        unit = "img/s" if res["unit"] == "images" else "tok/s"
        for name, v in res["variants"].items():
            rss = v.get("rss_peak_mb")
            lines.append(
                f"{res['workload']:<{wn}} {name:<7} {v['median_s'] * 1e3:>9.0f} "
                f"{v['min_s'] * 1e3:>8.0f} {v['median_cpu_s'] * 1e3:>8.0f} "
                f"{v['items_per_s']:>9.0f} {v['gflops']:>7.1f} "
                f"{v['mfu_vs_mlx_sgemm']:>5.2f} {v['first_step_s']:>10.2f} "
                f"{num(v.get('mlx_peak_mb')):>8} {num(rss):>8} {v['loss0']:>9.5f} "
                f"{num(v.get('grad_norm0'), '.4f'):>8}")
        ratios = ", ".join(f"toymlx/{k} {r:.2f}x (cpu {res['cpu_ratio_toymlx_over'][k]:.2f}x)"
                           for k, r in res["ratio_toymlx_over"].items())
        sg = res["sgemm_gflops"]
        lines.append(f"{'':<{wn}} time ratio (median of per-round ratios): {ratios}; "
                     f"{res['flops_per_step'] / 1e9:.1f} GFLOP/step, {unit}; sgemm 2048: "
                     f"mlx {sg['mlx']:.0f}, numpy {sg['numpy']:.0f} GFLOPS "
                     f"(mlx/numpy {sg['mlx'] / sg['numpy']:.2f}x); "
                     f"load avg {res['loadavg_1min_at_end']:.1f}")
    g = info.get("gguf_360m")
    if g:
        lines.append(f"GGUF 360M F32 ({g['file_mb']:.0f} MB): write {g['write']['seconds']:.1f} s "
                     f"(peak RSS {g['write']['rss_peak_mb']:.0f} MB, "
                     f"{g['write']['rss_before_mb']:.0f} before), "
                     f"load {g['load']['seconds']:.1f} s (peak RSS {g['load']['rss_peak_mb']:.0f} "
                     f"MB, {g['load']['rss_before_mb']:.0f} before)")
    for d in info.get("data_parallel", []):
        lines.append(f"data parallel {d['workload']}: {d['ranks']} ranks x 1 BLAS thread "
                     f"{d['dp_median_s'] * 1e3:.0f} ms/step (cpu {d['dp_median_cpu_s'] * 1e3:.0f}) "
                     f"vs one process {d['single_median_s'] * 1e3:.0f} ms/step (cpu "
                     f"{d['single_median_cpu_s'] * 1e3:.0f}): dp/single {d['ratio_dp_over_single']:.2f}x,"
                     f" |loss0 diff| {d['loss0_abs_diff']:.1e}")
    if "user_paths" in info:
        lines += format_user_paths(info["user_paths"])
    lines.append(f"MFU: achieved GFLOPS / MLX fp32 sgemm 2048^3 in the same rounds. "
                 f"total {info['total_s']:.0f} s")
    return "\n".join(lines)


def num(x: float | None, fmt: str = ".0f") -> str:
    """`x` formatted, or "-" when there is none."""
    return "-" if x is None else format(x, fmt)
