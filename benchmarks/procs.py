"""Process plumbing: each implementation's step in its own child process, fresh processes for
peak RSS and GGUF I/O, and data-parallel ranks against one process.

Children import the benchmark's modules from this folder (`child_code` puts it on their path).
"""

from __future__ import annotations

import toymlx  # noqa: F401  (first: it loads OpenBLAS, which must precede mlx.core)

# isort: split
import contextlib
import gc
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from rounds import Variant
from scratch import scratch_folder
from toymlx_step import ToymlxVariant, build_task, cpu_ops, recipe_inputs, reference_ops, weights_np
from workloads import Workload, find, make_batch

from toymlx.backend.device import (
    HUGE_PAGES_TUNABLE,
    backend_info,
    huge_pages,
    restart_tunables,
    setup_process,
)
from toymlx.runner.launch import launch

HERE = Path(__file__).resolve().parent
MB = 2**20


def child_code(body: str) -> str:
    """Python source for a fresh process set up as toymlx-train sets itself up (toymlx first:
    it loads OpenBLAS, which must precede mlx.core), able to import this folder's modules,
    then `body`."""
    return (f"import sys\nsys.path.insert(0, {str(HERE)!r})\nimport toymlx.backend.device\n"
            f"toymlx.backend.device.setup_process()\n{body}")


def run_child(body: str, timeout: float = 1800) -> dict:
    """Run python `body` in a fresh process; its last stdout line is a JSON object."""
    p = subprocess.run([sys.executable, "-c", child_code(body)], capture_output=True, text=True,
                       check=False, timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(f"child failed ({p.returncode}): {p.stderr.strip()[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def proc_status(key: str) -> float:
    """A /proc/self/status figure in MB (VmRSS, VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(key)


# ---- each side's step in its own process ---------------------------------------------------
IMPLS = ("toymlx", "toymlx-ref", "torch", "torch1t", "mlx-lm")
"""The CPU steps `build_step` builds (toymlx-ref: toymlx with MLX's own elementwise ops;
torch1t: PyTorch on one thread)."""

STEP_INPUTS = ("weights.npz", "batch.npz")
"""What `write_step_inputs` puts beside a workload's recipe inputs for the step processes."""


def write_step_inputs(w: Workload, folder: Path, weights: bool) -> None:
    """What `build_step` reads besides the recipe's own inputs in `folder`: the workload's batch
    and, with `weights` (a peer will be built), the weights the recipe's Task starts from."""
    np.savez(folder / STEP_INPUTS[1], **make_batch(w))
    if weights:
        task, _ = build_task(w, cpu_ops(), folder)
        np.savez(folder / STEP_INPUTS[0], **weights_np(task.model))
        del task
        gc.collect()
        mx.clear_cache()


def plain_tunables(tunables: str | None) -> str | None:
    """GLIBC_TUNABLES without the huge-page heap toymlx's commands add (None: nothing left)."""
    kept = [t for t in (tunables or "").split(":")
            if t and t != HUGE_PAGES_TUNABLE]
    return ":".join(kept) or None


def child_env(impl: str) -> dict[str, str | None]:
    """The environment `impl`'s child starts with, beyond the parent's (None: unset).

    - toymlx, toymlx-ref: the heap toymlx's commands restart with (`restart_with_huge_pages`'s
      `HUGE_PAGES_TUNABLE`, where this machine takes it), so the row is the step users get.
    - mlx-lm: the plain heap, as `mlx_lm.lora` runs (its process loads the same OpenBLAS:
      toymlx is imported first, as in every child).
    - torch, torch1t: the plain heap and TOYMLX_BLAS=reference: the child never loads
      OpenBLAS. Where it did, PyTorch's CPU attention kernels called OpenBLAS's threaded sgemm
      from inside their OpenMP threads (fwd+bwd of a SmolLM2-135M attention: 465 ms against
      20 ms in a clean process). And `TORCH_OMP_WAIT_POLICY` (unless OMP_WAIT_POLICY is set).
    Every other process the benchmark starts (toymlx's commands, mlx-lm, llama.cpp) runs with
    the environment as the user has it.
    """
    here = os.environ.get("GLIBC_TUNABLES")
    if impl.startswith("toymlx"):
        return {"GLIBC_TUNABLES": restart_tunables() or here}
    env: dict[str, str | None] = {"GLIBC_TUNABLES": plain_tunables(here)}
    if impl.startswith("torch"):
        env["TOYMLX_BLAS"] = "reference"
        env["OMP_WAIT_POLICY"] = os.environ.get("OMP_WAIT_POLICY") or TORCH_OMP_WAIT_POLICY
    return env


TORCH_OMP_WAIT_POLICY = "PASSIVE"
"""PyTorch's children's OpenMP wait: its threads otherwise spin while they wait (libgomp's
default), and on a 2-core machine that other work shares the spinning thread holds the core
its partner needs: PyTorch's CPU steps took 3-5x longer than with one thread. PASSIVE waits
sleep. Only there: MKL's threads in toymlx's processes are libgomp's too, and decoding
(2-thread matrix-vector products, a few hundred a token) ran at half speed with PASSIVE."""


class ChildVariant(Variant):
    """One implementation's step in its own process, built there and driven step by step.

    Every side runs alone in a fresh process, as a user runs it, and the parent only times
    the round trip (a pipe message each way). In one process the sides disturbed each other:
    PyTorch's step took 686-709 ms as the child of a process that stepped toymlx between its
    steps, 770-776 ms when that process's heap had huge pages, against 629-645 ms alone
    (vit-tiny-28, Intel Xeon, session 19). `child_env` says what each child starts with.

    Each reply carries the step's loss, the child's CPU seconds for it (all its threads) and,
    for MLX's sides, MLX's peak memory during the step (reset before it)."""

    def __init__(self, impl: str, w: Workload, inputs: Path, timeout_s: float = 1800,
                 env: dict[str, str | None] | None = None, name: str | None = None):
        """`env`: variables set (None: unset) on top of `child_env(impl)`; `name`: the row's
        name (default `impl`)."""
        self.name, self.timeout_s = name or impl, timeout_s
        self.uses_mlx = not impl.startswith("torch")
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        with _environ({**child_env(impl), **(env or {})}):  # a spawned child starts with os.environ
            self.proc = ctx.Process(target=_step_worker, args=(child, impl, w, str(inputs)),
                                    daemon=True)
            self.proc.start()
        child.close()
        self.info: dict[str, Any] = self._reply()
        """What the child reports of itself once built: its heap (`huge_pages`) and, for MLX's
        sides, what runs its math (`backend`: `toymlx.backend.device.backend_info`)."""
        self.gnorm0: float | None = None
        self.last_cpu: float | None = None
        self.last_mlx_peak_mb: float | None = None

    def step(self, s: int) -> float:
        self.conn.send(s)
        loss, gnorm0, self.last_cpu, self.last_mlx_peak_mb = self._reply()
        self.gnorm0 = gnorm0
        return loss

    def first_grad_norm(self) -> float | None:
        return self.gnorm0

    def _reply(self) -> Any:
        """The child's answer; RuntimeError if it failed, ended, or says nothing within
        `timeout_s` (then it is killed: a benchmark never hangs)."""
        if not self.conn.poll(self.timeout_s):
            self.proc.kill()
            raise RuntimeError(f"the {self.name} step's process said nothing in "
                               f"{self.timeout_s:.0f} s; killed")
        try:
            kind, payload = self.conn.recv()
        except EOFError:
            raise RuntimeError(f"the {self.name} step's process ended without a word "
                               f"(exit code {self.proc.exitcode})") from None
        if kind == "error":
            raise RuntimeError(f"the {self.name} step's process failed:\n{payload}")
        return payload

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.send(None)
        self.proc.join(timeout=60)
        if self.proc.is_alive():
            self.proc.kill()


def start_variants(w: Workload, inputs: Path,
                   sides: list[tuple[str, str, dict[str, str | None] | None]]
                   ) -> tuple[list[ChildVariant], dict[str, float]]:
    """A `ChildVariant` for each (impl, name, env) of `sides`, started one after another from
    `inputs`; them and each one's start seconds. Where one fails to start, those already
    started are closed."""
    out: list[ChildVariant] = []
    builds: dict[str, float] = {}
    try:
        for impl, name, env in sides:
            t = time.perf_counter()
            out.append(ChildVariant(impl, w, inputs, env=env, name=name))
            builds[name] = time.perf_counter() - t
    except BaseException:
        for v in out:
            v.close()
        raise
    return out, builds


@contextlib.contextmanager
def _environ(env: dict[str, str | None]) -> Iterator[None]:
    """os.environ with `env`'s entries set (None: unset) inside the block, as it was after."""
    saved = {k: os.environ.get(k) for k in env}
    try:
        _set_environ(env)
        yield
    finally:
        _set_environ(saved)


def _set_environ(env: dict[str, str | None]) -> None:
    for k, v in env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def build_step(impl: str, w: Workload, inputs: Path) -> Variant:
    """`impl`'s step for `w` in this (child) process, from the folder `build_variants` wrote:
    toymlx's from the recipe's own inputs (the Task `toymlx-train` builds), the peers' from
    the weights that Task starts from."""
    if impl not in IMPLS:
        raise ValueError(f"a CPU step's implementation: expected toymlx, toymlx-ref, mlx-lm, "
                         f"torch or torch1t, found {impl!r}")
    batch = dict(np.load(inputs / STEP_INPUTS[1]))
    if impl in ("toymlx", "toymlx-ref"):
        ops = cpu_ops() if impl == "toymlx" else reference_ops()
        return ToymlxVariant(*build_task(w, ops, inputs), batch, name=impl)
    weights = dict(np.load(inputs / STEP_INPUTS[0]))
    if impl == "mlx-lm":
        from mlx_lm_step import MlxLmVariant  # mlx-lm is optional (the bench extra)

        return MlxLmVariant(w, weights, batch)
    from torch_step import TorchStep  # torch only in a torch child: see child_env

    step = TorchStep(w, weights, batch, 1 if impl == "torch1t" else None)
    step.name = impl
    return step


def _step_worker(conn, impl: str, w: Workload, inputs: str) -> None:
    """The child's side of `ChildVariant`: set up as toymlx-train sets itself up (MLX's sides),
    build, then one step per request; each reply (loss, step 0's |g|, CPU s, MLX peak MB)."""
    try:
        if not impl.startswith("torch"):
            setup_process()
        v = build_step(impl, w, Path(inputs))
        backend = {} if impl.startswith("torch") else {"backend": backend_info()}
        conn.send(("ok", {"huge_pages": huge_pages(), **backend}))
        while (s := conn.recv()) is not None:
            if v.uses_mlx:
                mx.reset_peak_memory()
            c = time.process_time()
            loss = v.step(s)
            cpu = time.process_time() - c
            peak = mx.get_peak_memory() / MB if v.uses_mlx else None
            conn.send(("ok", (loss, v.first_grad_norm(), cpu, peak)))
    except Exception:  # noqa: BLE001  (whatever failed, the parent must hear of it)
        conn.send(("error", traceback.format_exc()))


# ---- GGUF I/O at the SmolLM2-360M size ------------------------------------------------------
def gguf_io(folder: Path) -> dict[str, Any]:
    """Seconds and peak RSS to write a random 360M F32 llama GGUF and to load it back
    (each in a fresh process; RSS is the process's whole VmHWM, and its VmRSS just before)."""
    path = folder / "bench-360m.gguf"
    rss = "from pathlib import Path\nfrom procs import proc_status as st\n"
    write = run_child(
        "import json, time\n" + rss +
        "import toymlx, mlx.core as mx\n"
        "from toymlx.models.llama import Llama, smollm2_360m\n"
        "from toymlx.gguf.llama import write_llama\n"
        "mx.random.seed(0); m = Llama(smollm2_360m()); mx.eval(m.parameters())\n"
        "base = st('VmRSS'); Path('/proc/self/clear_refs').write_text('5')\n"
        "t = time.perf_counter()\n"
        f"write_llama({str(path)!r}, m, {{}}, name='bench')\n"
        "dt = time.perf_counter() - t\n"
        "print(json.dumps({'seconds': dt, 'rss_peak_mb': st('VmHWM'), 'rss_before_mb': base}))\n")
    load = run_child(
        "import json, time\n" + rss +
        "import toymlx, mlx.core as mx\n"
        "from toymlx.gguf.llama import load_llama\n"
        "base = st('VmRSS'); Path('/proc/self/clear_refs').write_text('5')\n"
        "t = time.perf_counter()\n"
        f"m, g = load_llama({str(path)!r})\n"
        "dt = time.perf_counter() - t\n"
        "print(json.dumps({'seconds': dt, 'rss_peak_mb': st('VmHWM'), 'rss_before_mb': base}))\n")
    size = path.stat().st_size / MB
    path.unlink()
    return {"file_mb": size, "write": write, "load": load}


# ---- one data-parallel rank per core against one process ------------------------------------
def dp_worker(workload: str, steps: int, out: str, inputs: str) -> None:
    """Time `steps` warm steps of toymlx's step on this rank's share of the batch (a child),
    its Task built from the recipe inputs in folder `inputs`."""
    world = mx.distributed.init()
    world = world if world.size() > 1 else None
    w = find(workload)
    v = ToymlxVariant(*build_task(w, cpu_ops(), Path(inputs)), make_batch(w), world=world)
    loss0 = v.step(0)
    v.step(1)
    wall, cpu = [], []
    for s in range(2, 2 + steps):
        t, c = time.perf_counter(), time.process_time()
        v.step(s)
        wall.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    rank = 0 if world is None else world.rank()
    Path(f"{out}.rank{rank}").write_text(json.dumps({"loss0": loss0, "grad_norm0": v.gnorm0,
                                                      "wall": wall, "cpu": cpu}))


def run_dp(workload: str, ranks: int = 2, rounds: int = 3, steps: int = 3,
           log: Callable[[str], None] = print) -> dict[str, Any]:
    """One process (OpenBLAS on every core) against `ranks` ring ranks over loopback with one
    BLAS thread each, alternating launches; per-step medians and the ratio dp / single."""
    res: dict[str, Any] = {"workload": workload, "ranks": ranks, "single": [], "dp": []}
    # the recipe's inputs written once, read by every launch
    with scratch_folder("toymlx-dp-") as folder, recipe_inputs(find(workload)) as inputs:
        script = folder / "worker.py"  # a file: mlx.launch does not carry `-c` code intact
        script.write_text(child_code(
            "from procs import dp_worker\nfrom toymlx.runner.launch import rank_status\n\n"
            "with rank_status() as status:\n"
            "    dp_worker(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4])\n"
            "    status.code = 0\n"))
        for r in range(rounds):
            for kind in (("single", "dp") if r % 2 == 0 else ("dp", "single")):
                out = folder / f"{kind}{r}"
                cmd = [sys.executable, str(script), workload, str(steps), str(out), str(inputs)]
                if kind == "single":
                    subprocess.run(cmd, check=True)
                    reports = [json.loads(Path(f"{out}.rank0").read_text())]
                else:
                    if launch(ranks, cmd, env=["OPENBLAS_NUM_THREADS=1"]) != 0:
                        raise RuntimeError(f"data-parallel launch of {workload} failed")
                    reports = [json.loads(Path(f"{out}.rank{i}").read_text())
                               for i in range(ranks)]
                walls = [max(x) for x in zip(*(p["wall"] for p in reports))]  # slowest rank
                cpus = [sum(x) for x in zip(*(p["cpu"] for p in reports))]  # all ranks
                res[kind].append({"loss0": reports[0]["loss0"],
                                  "grad_norm0": reports[0]["grad_norm0"], "wall": walls,
                                  "cpu": cpus})
                log(f"  dp {workload} {kind}: step {statistics.median(walls) * 1e3:.0f} ms wall, "
                    f"{statistics.median(cpus) * 1e3:.0f} ms cpu, loss0 "
                    f"{reports[0]['loss0']:.6f}")
    for kind in ("single", "dp"):
        res[kind + "_median_s"] = statistics.median(x for r in res[kind] for x in r["wall"])
        res[kind + "_median_cpu_s"] = statistics.median(x for r in res[kind] for x in r["cpu"])
    pairs = [statistics.median(d["wall"]) / statistics.median(s["wall"])
             for s, d in zip(res["single"], res["dp"])]
    res["ratio_dp_over_single"] = statistics.median(pairs)
    res["loss0_abs_diff"] = abs(res["single"][0]["loss0"] - res["dp"][0]["loss0"])
    return res
