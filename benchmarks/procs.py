"""Process plumbing: PyTorch's CPU step in a child process, fresh processes for peak RSS and
GGUF I/O, and data-parallel ranks against one process.

Children import the benchmark's modules from this folder (`child_code` puts it on their path).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from rounds import Variant
from toymlx_step import CPU_OPS, ToymlxVariant, build_task, recipe_inputs
from workloads import Workload, find, make_batch

from toymlx.backend.device import HUGE_PAGES_TUNABLE
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


# ---- PyTorch's CPU step in its own process ---------------------------------------------------
def plain_tunables(tunables: str | None) -> str | None:
    """GLIBC_TUNABLES without the huge-page heap toymlx's commands add (None: nothing left)."""
    kept = [t for t in (tunables or "").split(":")
            if t and t != HUGE_PAGES_TUNABLE]
    return ":".join(kept) or None


class TorchVariant(Variant):
    """The PyTorch step (`torch_step.TorchStep`) in its own process, driven step by step.

    Not in this process: toymlx loads OpenBLAS with global symbols before MLX, and PyTorch's
    CPU attention kernels then call OpenBLAS's threaded sgemm from inside their OpenMP threads
    (fwd+bwd of a SmolLM2-135M attention: 465 ms against 20 ms in a clean process). The child
    runs with TOYMLX_BLAS=reference so it never loads OpenBLAS, and never calls
    `toymlx.backend.device.setup_process`: it keeps glibc's malloc settings, as a plain PyTorch process
    has them, and without the huge-page heap toymlx's commands restart with
    (`toymlx.backend.device.HUGE_PAGES_TUNABLE`).
    """

    name = "torch"
    uses_mlx = False

    def __init__(self, w: Workload, weights: dict[str, np.ndarray], batch: dict[str, np.ndarray],
                 threads: int | None = None):
        if threads is not None:
            self.name = f"torch{threads}t"
        self.folder = Path(tempfile.mkdtemp(prefix="toymlx-torch-"))
        np.savez(self.folder / "weights.npz", **weights)
        np.savez(self.folder / "batch.npz", **batch)
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        child_env = {"TOYMLX_BLAS": "reference",  # the child inherits these at spawn (None: unset)
                     "GLIBC_TUNABLES": plain_tunables(os.environ.get("GLIBC_TUNABLES"))}
        saved = {k: os.environ.get(k) for k in child_env}
        for k, v in child_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        try:
            self.proc = ctx.Process(target=_torch_worker, args=(child, w, str(self.folder),
                                                                threads), daemon=True)
            self.proc.start()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        self._reply()
        self.gnorm0: float | None = None
        self.last_cpu: float | None = None

    def step(self, s: int) -> float:
        self.conn.send(s)
        loss, gnorm, self.last_cpu = self._reply()
        if self.gnorm0 is None:
            self.gnorm0 = gnorm
        return loss

    def first_grad_norm(self) -> float | None:
        return self.gnorm0

    def _reply(self) -> Any:
        kind, payload = self.conn.recv()
        if kind == "error":
            raise RuntimeError(f"PyTorch worker failed:\n{payload}")
        return payload

    def close(self) -> None:
        self.conn.send(None)
        self.proc.join(timeout=60)
        for f in self.folder.iterdir():
            f.unlink()
        self.folder.rmdir()


def _torch_worker(conn, w: Workload, folder: str, threads: int | None) -> None:
    """Child side of TorchVariant: build, then one step per request; reply (loss, |g|, cpu s)."""
    try:
        from torch_step import TorchStep  # torch only in this child: see TorchVariant

        weights = dict(np.load(Path(folder) / "weights.npz"))
        batch = dict(np.load(Path(folder) / "batch.npz"))
        step = TorchStep(w, weights, batch, threads)
        del weights
        conn.send(("ok", None))
        while (s := conn.recv()) is not None:
            c = time.process_time()
            loss = step.step(s)
            conn.send(("ok", (loss, step.last_norm, time.process_time() - c)))
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
    v = ToymlxVariant(*build_task(w, CPU_OPS, Path(inputs)), make_batch(w), world=world)
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
    folder = Path(tempfile.mkdtemp(prefix="toymlx-dp-"))
    script = folder / "worker.py"  # a file: mlx.launch does not carry `-c` code intact
    script.write_text(child_code(
        "from procs import dp_worker\nfrom toymlx.runner.launch import rank_status\n\nwith rank_status() as status:\n"
        "    dp_worker(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4])\n"
        "    status.code = 0\n"))
    res: dict[str, Any] = {"workload": workload, "ranks": ranks, "single": [], "dp": []}
    with recipe_inputs(find(workload)) as inputs:  # written once, read by every launch
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
