"""An unpacked LoRA run over an mlx-lm data folder, as a user runs it: each step's time against
the steps of its own batch width, and the CPU kernels MLX built during each step.

    python benchmarks/unpacked_run.py --data WIKISQL [--steps 100] [--cold] [--json out.json]

WIKISQL is mlx-lm's example folder (mlx-examples' `lora/data`: train/valid/test.jsonl of
{"text"} rows, 96-224 tokens wide in batches of 4). The command is
`toymlx-train --recipe lora --base SmolLM2-135M-Instruct.Q4_1.gguf --data.path WIKISQL
--data.no-pack --steps N --eval-every 0`, in its own process, with the user's kernel cache, or
with `--cold` a fresh one holding only what the installer builds (`build_kernels` of
scripts/install_env.sh, into a fresh `TOYMLX_KERNEL_CACHE` and `TMPDIR`).

Unpacked rows make batches of different widths (each step's `batch_width` event), and a step's
time grows with its width. So each step is read against the median step of its own width: a
step far above it is a cost of its own (a kernel built, a trace), where a wide batch above the
run's median is only its size. Printed: the host, step 1, the run's median step, per width the
steps and their median, the step furthest above its width's median, the steps over 1.5x the
run's median (with their width), and each kernel built after the run started with the step it
was built in (this script polls the run's kernel folder, named in `run_start`, and its events).
"""

from __future__ import annotations

import toymlx  # noqa: F401  (first: it loads the BLAS, which must precede mlx.core)

# isort: split
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from scratch import scratch_folder
from user_paths import REPO, host_info, host_line, smollm_gguf

POLL_S = 0.05


def installer_kernels(env: dict[str, str]) -> None:
    """Build what the installer builds (`build_kernels`) into `env`'s kernel cache."""
    venv = Path(sys.executable).parent.parent
    script = (f"source {REPO / 'scripts' / 'install_env.sh'} && ENV={venv} BACKEND=cpu "
              f"OS=$(uname -s) ROOT={REPO} build_kernels")
    subprocess.run(["bash", "-c", script], env=env, check=True)


class Watch:
    """Follows a run's events.jsonl and its kernel folder while the run goes."""

    def __init__(self, events: Path):
        self.events, self.offset, self.step = events, 0, 0
        self.folder: Path | None = None
        self.known: set[str] = set()
        self.built: list[dict[str, Any]] = []  # {"kernel", "during_step"}

    def poll(self) -> None:
        # the folder first: a kernel that was not there at the last poll and is now was built
        # after the last step event read then, so in the step after it (to within a poll)
        if self.folder is not None:
            new = self._names() - self.known
            self.known |= new
            self.built += [{"kernel": n, "during_step": self.step + 1} for n in sorted(new)]
        if not self.events.exists():
            return
        with self.events.open("rb") as f:
            f.seek(self.offset)
            chunk = f.read()
        lines = chunk.split(b"\n")
        self.offset += len(chunk) - len(lines[-1])  # a half-written last line waits
        for line in lines[:-1]:
            e = json.loads(line)
            if e["kind"] == "run_start" and e.get("backend", {}).get("kernel_cache"):
                self.folder = Path(e["backend"]["kernel_cache"])
                self.known = self._names()
            elif e["kind"] == "step":
                self.step = e["step"]

    def _names(self) -> set[str]:
        try:
            return {p.name for p in self.folder.glob("*.so")}
        except OSError:
            return set()


def run(data: Path, steps: int, cold: bool, log=print) -> dict[str, Any]:
    """The command in a throw-away folder (its run, and with `cold` its kernel cache)."""
    with scratch_folder("toymlx-unpacked-") as tmp:
        return _run(tmp, data, steps, cold, log)


def _run(root: Path, data: Path, steps: int, cold: bool, log) -> dict[str, Any]:
    env = dict(os.environ)
    if cold:
        for var, name in (("TOYMLX_KERNEL_CACHE", "kernels"), ("TMPDIR", "tmp")):
            (root / name).mkdir()
            env[var] = str(root / name)
        log("building the installer's kernels into a fresh kernel cache ...")
        installer_kernels(env)
    exe = Path(sys.executable).with_name("toymlx-train")
    cmd = [str(exe) if exe.exists() else "toymlx-train", "--recipe", "lora",
           "--base", str(smollm_gguf()), "--data.path", str(data), "--data.no-pack",
           "--steps", str(steps), "--eval-every", "0", "--checkpoint-every", "0",
           "--no-progress", "--runs-root", str(root / "runs"), "--run-id", "unpacked"]
    log("$ " + " ".join(cmd))
    watch = Watch(root / "runs" / "unpacked" / "events.jsonl")
    t0 = time.perf_counter()
    with subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True) as p:
        while p.poll() is None:
            watch.poll()
            time.sleep(POLL_S)
        err = p.stderr.read()
    watch.poll()
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"toymlx-train failed ({p.returncode}): {err.strip()[-1000:]}")
    events = [json.loads(line) for line in watch.events.read_text().splitlines()]
    return {"command": " ".join(cmd), "cold": cold, "wall_s": round(wall, 2),
            **analyse([e for e in events if e["kind"] == "step"]), "kernels_built": watch.built}


def analyse(step_events: list[dict[str, Any]]) -> dict[str, Any]:
    """Step 1, the run's median, per-width medians and each later step against them."""
    times = {e["step"]: e["step_time_s"] for e in step_events}
    width = {e["step"]: e["batch_width"] for e in step_events}
    later = [s for s in times if s > 1]
    run_median = statistics.median(times[s] for s in later)
    by_width: dict[int, list[int]] = {}
    for s in later:
        by_width.setdefault(width[s], []).append(s)
    width_median = {w: statistics.median(times[s] for s in ss) for w, ss in by_width.items()}
    vs_width = {s: times[s] / width_median[width[s]] for s in later}
    worst = max(later, key=vs_width.get)
    return {
        "steps": len(times), "first_step_s": times[1], "first_width": width[1],
        "median_step_s": run_median,
        "total_steps_s": round(sum(times.values()), 2),
        "widths": {w: {"steps": len(by_width[w]), "median_step_s": round(width_median[w], 4),
                       "s_per_width_unit_ms": round(1e3 * width_median[w] / w, 2)}
                   for w in sorted(by_width)},
        "worst_vs_width": {"step": worst, "width": width[worst],
                           "ratio": round(vs_width[worst], 3)},
        "over_1.5x_run_median": [
            {"step": s, "width": width[s], "ratio": round(times[s] / run_median, 3),
             "vs_width": round(vs_width[s], 3)}
            for s in later if times[s] > 1.5 * run_median],
    }


def report(r: dict[str, Any]) -> list[str]:
    out = [(f"step 1: {r['first_step_s']:.2f} s ({r['first_width']} wide); median step "
            f"{r['median_step_s']:.3f} s; all steps {r['total_steps_s']} s; the command "
            f"{r['wall_s']} s")]
    for w, v in r["widths"].items():
        out.append(f"  width {w}: {v['steps']} steps, median {v['median_step_s']:.3f} s "
                   f"({v['s_per_width_unit_ms']} ms a unit of width)")
    worst = r["worst_vs_width"]
    out.append(f"furthest above its width's median: step {worst['step']} ({worst['width']} "
               f"wide) at {worst['ratio']}x")
    over = r["over_1.5x_run_median"]
    out.append("over 1.5x the run's median: " + (", ".join(
        f"step {o['step']} ({o['width']} wide, {o['ratio']}x; {o['vs_width']}x its width's)"
        for o in over) or "none"))
    built: dict[int, int] = {}
    for k in r["kernels_built"]:
        built[k["during_step"]] = built.get(k["during_step"], 0) + 1
    last = r["steps"]
    where = [f"{n} in step {s}" if s <= last else f"{n} after the last step"
             for s, n in sorted(built.items())]
    out.append(f"kernels built during the run: {len(r['kernels_built'])}"
               + (f" ({', '.join(where)})" if where else ""))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, required=True,
                    help="an mlx-lm data folder (train.jsonl, valid.jsonl)")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--cold", action="store_true",
                    help="a fresh kernel cache holding only what the installer builds")
    ap.add_argument("--json", type=Path, help="write the figures here")
    a = ap.parse_args()
    if not (a.data / "train.jsonl").is_file():
        ap.error(f"--data {a.data}: expected a folder holding train.jsonl (mlx-lm's layout)")
    print(host_line(host_info()), flush=True)
    r = run(a.data, a.steps, a.cold)
    print("\n".join(report(r)))
    if a.json:
        a.json.write_text(json.dumps({"host": host_info(), **r}, indent=1))


if __name__ == "__main__":
    main()
