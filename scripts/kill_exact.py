"""Kill a run at random moments, resume it each time, and compare it bit for bit with one that never stopped.

    python scripts/kill_exact.py from-scratch --kills 8 --seed 0
    python scripts/kill_exact.py lora --signal INT --json s.json

Where `scripts/kill_test.py` checks the bundle a kill leaves, this checks what a user gets in the
end: a run of one of CONFIGS is started, stopped with `--signal` (KILL, TERM or INT, sent to
its process group as a terminal's Ctrl-C is) at a moment of each of MODES in turn (during start
before the first step, during a step, during a validation, while a checkpoint file is being
written), and resumed with `toymlx-train --resume RUN` (started over where no checkpoint was
made yet) until the kills are spent; a last `--resume` runs it to its end. Its events.jsonl
(every step's loss, grad norm and lr; every validation), its final checkpoint's tensors and
its resume state's arrays must then equal those of an uninterrupted run of the same config.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from kill_test import SHARED, WAIT_LIMIT, tmps, train_cmd

CONFIGS = {
    "from-scratch": ["--recipe", "from-scratch", "--steps", "40", "--batch-size", "4",
                     "--seq-len", "64", "--checkpoint-every", "5", "--eval-every", "10",
                     "--data.path", str(SHARED / "text" / "tinystories_sample.txt")],
    "vit-tiny": ["--recipe", "vit-tiny", "--steps", "60", "--checkpoint-every", "6",
                 "--eval-every", "20"],
    "lora": ["--recipe", "lora", "--base", str(SHARED / "models" / "stories260K.gguf"),
             "--steps", "40", "--checkpoint-every", "5", "--eval-every", "10"],
}
MODES = ["startup", "step", "eval", "checkpoint"]
NICE = 5
"""How much lower the stopped runs' priority is than the watcher's."""


def steps_logged(run: Path) -> list[int]:
    from toymlx.bundle.events import read_events  # a torn last line (mid-write) is skipped

    return [e["step"] for e in read_events(run) if e.get("kind") == "step"]


def wait_and_stop(p: subprocess.Popen, run: Path, mode: str, sig: int, eval_every: int,
                  r: random.Random) -> dict:
    """Wait for the mode's moment, send `sig` to the trainer's process group; what was seen."""
    start, n0, d, seen = time.monotonic(), len(steps_logged(run)), r.uniform(0.0, 1.0), None
    while p.poll() is None and time.monotonic() - start < WAIT_LIMIT:
        now = time.monotonic() - start
        if mode == "startup" and now >= 2.5 * d:  # imports, resume load, first step
            break
        if mode == "checkpoint" and tmps(run / "weights"):
            break
        if mode in ("step", "eval") and seen is None:
            st = steps_logged(run)
            if len(st) > n0 and (mode == "step" or st[-1] % eval_every == 0):
                seen = now
        if seen is not None and now - seen >= 0.3 * d:
            break
        time.sleep(0.0005 if mode == "checkpoint" else 0.01)
    if p.poll() is not None:
        return {"mode": mode, "exited": p.returncode}
    steps = len(steps_logged(run))
    try:
        os.killpg(p.pid, sig)
    except ProcessLookupError:
        pass
    try:
        p.wait(timeout=WAIT_LIMIT)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    if completed(run):  # it came as the run ended, its run_end written: a stop no longer
        # (the process then says "interrupted" and exits 130, the run complete)
        return {"mode": mode, "exited": 0, "completed_before_the_stop": p.returncode}
    return {"mode": mode, "t": round(time.monotonic() - start, 2), "steps_logged": steps,
            "rc": p.returncode}


def completed(run: Path) -> bool:
    """Whether the run's last event is a run_end of a completed run."""
    from toymlx.bundle.events import read_events

    ev = read_events(run) if run.exists() else []
    return bool(ev) and ev[-1].get("kind") == "run_end" and ev[-1].get("reason") == "completed"


def outcome(run: Path) -> dict:
    """What must not change: step and eval records, final tensors and resume state arrays."""
    from safetensors.numpy import load_file

    from toymlx.bundle.checkpoint import resolve_latest, state_path
    from toymlx.bundle.events import read_events
    from toymlx.gguf.reader import GGUFFile

    ev = read_events(run)
    latest = resolve_latest(run)
    with GGUFFile(latest) as g:
        tensors = {n: g.raw(n).tobytes() for n in g.tensors}
    state = {k: (v.dtype.str, v.shape, v.tobytes()) for k, v in load_file(state_path(latest)).items()}
    return {"steps": [(e["step"], e["loss"], e.get("grad_norm"), e.get("lr"))
                      for e in ev if e.get("kind") == "step"],
            "evals": [(e["step"], e.get("val_loss"), e.get("val_row_loss"), e.get("val_row_n"))
                      for e in ev if e.get("kind") == "eval"],
            "ends": [(e.get("reason"), e.get("final_step"), e.get("final_loss"))
                     for e in ev if e.get("kind") == "run_end"],
            "file": latest.name, "tensors": tensors, "state": state}


def differences(ref: dict, got: dict) -> list[str]:
    bad = [f"{k}: {str(got[k])[:300]} vs uninterrupted {str(ref[k])[:300]}"
           for k in ("steps", "evals", "ends", "file") if got[k] != ref[k]]
    for k in ("tensors", "state"):
        diff = sorted(n for n in ref[k].keys() | got[k].keys() if ref[k].get(n) != got[k].get(n))
        if diff:
            bad.append(f"{k} differ: {diff[:4]} ({len(diff)})")
    return bad


def kill_exact(config: str, kills: int, seed: int, sig: int, root: Path) -> dict:
    args = CONFIGS[config] + ["--runs-root", str(root), "--no-progress"]
    eval_every = int(args[args.index("--eval-every") + 1])
    log = root / "train.log"
    with open(log, "ab") as f:
        subprocess.run(train_cmd() + args + ["--run-id", "uninterrupted"], stdout=f, stderr=f,
                       check=True)
    run = root / "killed"
    fresh = args + ["--run-id", run.name]
    r = random.Random(seed)
    out: dict = {"config": config, "signal": signal.Signals(sig).name, "kills": []}
    cmd = fresh
    for k in range(kills):
        with open(log, "ab") as f:
            # niced, so that the watcher's 0.5 ms polls run at once on a busy machine and see
            # a checkpoint's short-lived temporary file (a LoRA adapter's is written in ~1 ms)
            p = subprocess.Popen(["nice", "-n", str(NICE), *train_cmd(), *cmd], stdout=f,
                                 stderr=f, start_new_session=True)
        out["kills"].append(wait_and_stop(p, run, MODES[k % len(MODES)], sig, eval_every, r))
        if out["kills"][-1].get("exited") == 0:  # it ran to its end before this stop came
            break
        if list(run.glob("weights/*step_*.gguf")):
            cmd = ["--resume", str(run)]
        else:  # stopped before its first checkpoint: nothing to resume, start it over
            cmd = fresh + ["--overwrite"]
    q = None if out["kills"][-1].get("exited") == 0 else subprocess.run(
        train_cmd() + cmd, capture_output=True, check=False, text=True)
    out["final_rc"] = q.returncode if q else 0
    # a run that failed by itself before a stop came is a finding, even where a resume mended it
    crashed = [f"stop {i} ({k['mode']}): the run exited by itself with status {k['exited']} "
               f"before the stop (see {log})" for i, k in enumerate(out["kills"])
               if k.get("exited", 0) != 0]
    out["differences"] = crashed + (differences(outcome(root / "uninterrupted"), outcome(run))
                                    if not q or q.returncode == 0 else [q.stderr.strip()[-2000:]])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config", choices=sorted(CONFIGS))
    ap.add_argument("--kills", type=int, default=8, help="stops to make")
    ap.add_argument("--seed", type=int, default=0, help="seed for the moments")
    ap.add_argument("--signal", choices=["KILL", "TERM", "INT"], default="KILL")
    ap.add_argument("--root", required=True, help="runs folder (kept: train.log is there)")
    ap.add_argument("--json", help="write the summary JSON here")
    a = ap.parse_args(argv)
    root = Path(a.root)
    root.mkdir(parents=True, exist_ok=True)
    s = kill_exact(a.config, a.kills, a.seed, getattr(signal, "SIG" + a.signal), root)
    if a.json:
        Path(a.json).write_text(json.dumps(s, indent=1))
    n = sum("exited" not in k for k in s["kills"])
    print(f"kill_exact {a.config}: {n}/{a.kills} SIG{a.signal} made, resumed to the end: "
          f"{'bit-exact' if not s['differences'] else 'DIFFERENT'}")
    for d in s["differences"]:
        print("DIFFERENCE:", d)
    return 1 if s["differences"] else 0


if __name__ == "__main__":
    sys.exit(main())
