"""SIGKILL a real `toymlx-train` at random instants and check the run bundle survives each time.

    python scripts/kill_test.py --kills 50            # long run; summary on stdout
    python scripts/kill_test.py --kills 5 --json s.json

A tiny from-scratch run (checkpoint every step, so writes are in flight much of the time) is
killed in one of several ways: the moment a `.tmp-` file shows up in weights/ (mid-write),
the moment a new step_N.gguf appears (before or after the `latest` swap), at a random time
after a new checkpoint, or at a random time after a resume was launched (imports, resume
load, first step). After each kill the bundle must hold:

- `weights/latest` names a complete GGUF that load_llama loads, whose `general.step` is its
  file's step, with a complete resume state beside it;
- every `step_*.gguf` present loads, and has its state file (state is written first);
- `events.jsonl` reads with read_log: at most one torn line (its last), no damage.

The next cycle resumes the run with `--resume`, and its `resume` event must show from_step
equal to the step `latest` named when it was launched; the bundle keeps one run_start and each
step once. A final resume with a few more steps must complete. Before the loop, one run is
killed before its first checkpoint: `--resume` then fails with a one-line error, reusing the
run id fails without `--overwrite`, and with it the run starts over.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("TOYMLX_SHARED", REPO.parent / "shared")) / "data"
TINY = ["--model.d-model", "32", "--model.n-layers", "1", "--model.n-heads", "4",
        "--model.n-kv-heads", "2", "--model.ffn-dim", "64", "--model.context", "64",
        "--seq-len", "32", "--batch-size", "2", "--checkpoint-every", "1", "--eval-every", "0",
        "--eval-batches", "1", "--warmup", "2", "--no-compile", "--no-progress"]
MODES = ["tmp", "new-gguf", "after-ckpt", "startup"]
WAIT_LIMIT = 180.0  # seconds for a kill condition; beyond it the trainer is stuck


def train_cmd() -> list[str]:
    exe = Path(sys.executable).parent / "toymlx-train"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "toymlx_cli.train"]


def launch(args: list[str], log: Path) -> subprocess.Popen:
    with open(log, "ab") as f:  # the child keeps its own descriptor
        return subprocess.Popen(train_cmd() + args, stdout=f, stderr=f, start_new_session=True)


def kill(p: subprocess.Popen) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.wait()


def ggufs(weights: Path) -> set[str]:
    try:
        return {e.name for e in os.scandir(weights) if e.name.endswith(".gguf")}
    except FileNotFoundError:
        return set()


def tmps(weights: Path) -> list[str]:
    try:
        return [e.name for e in os.scandir(weights) if ".tmp-" in e.name]
    except FileNotFoundError:
        return []


def wait_and_kill(p: subprocess.Popen, weights: Path, mode: str, r: random.Random) -> dict:
    """Wait for the mode's moment, SIGKILL the trainer's process group; what was seen."""
    start = time.monotonic()
    before = ggufs(weights)
    delay = r.uniform(0.0, 0.4)
    startup = r.uniform(0.0, 3.0)
    seen_new_at = None
    while True:
        now = time.monotonic() - start
        if p.poll() is not None:
            return {"mode": mode, "exited": p.returncode, "t": round(now, 3)}
        if now > WAIT_LIMIT:
            kill(p)
            return {"mode": mode, "stuck": True, "t": round(now, 3)}
        if mode == "tmp" and tmps(weights):
            break
        if mode in ("new-gguf", "after-ckpt") and seen_new_at is None and ggufs(weights) - before:
            seen_new_at = now
            if mode == "new-gguf":
                break
        if mode == "after-ckpt" and seen_new_at is not None and now - seen_new_at >= delay:
            break
        if mode == "startup" and now >= startup:
            break
        time.sleep(0.0005 if mode in ("tmp", "new-gguf") else 0.005)
    kill(p)
    left = tmps(weights)
    return {"mode": mode, "t": round(time.monotonic() - start, 3), "tmp_left": left}


def check_bundle(run: Path, kills_so_far: int) -> dict:
    """The invariants after a kill; AssertionError naming what broke."""
    import toymlx  # noqa: F401
    from toymlx.bundle.checkpoint import list_checkpoints, load_state, resolve_latest, state_path
    from toymlx.bundle.events import damage_note, read_log
    from toymlx.gguf.llama import load_llama

    weights = run / "weights"
    latest = resolve_latest(run)
    assert latest.parent == weights and latest.exists(), f"latest -> {latest}"
    _, g = load_llama(latest)
    step = int(latest.name[len("step_"):-len(".gguf")])
    assert g.metadata.get("general.step") == step, (latest, g.metadata.get("general.step"))
    _, meta = load_state(state_path(latest))
    assert meta["step"] == step, (state_path(latest), meta)
    found = list_checkpoints(weights)
    for s, path in found:
        load_llama(path)
        assert state_path(path).exists(), f"{path} has no state beside it"
        load_state(state_path(path))
    # killed between the GGUF's rename and the link swap, the newest file is one step ahead
    top = max(s for s, _ in found)
    assert top - step in (0, 1), f"latest is step {step}, newest checkpoint step {top}"
    log = read_log(run)
    events = log.events
    kinds = [e["kind"] for e in events]
    assert kinds.count("run_start") <= 1 and kinds[:1] in ([], ["run_start"]), "run_start"
    steps = [e["step"] for e in events if e["kind"] == "step"]
    assert steps == list(range(1, len(steps) + 1)), f"steps not 1..N once: {steps[-12:]}"
    # a kill leaves at most its torn last line (a resume moves it out): never what
    # toymlx-report would name as damage
    assert not log.damaged, damage_note(log.path, log.damaged)
    assert len(log.torn) <= 1, f"torn lines {log.torn} after {kills_so_far} kills"
    return {"latest": step, "n_ckpt": len(found), "events": len(events), "torn": len(log.torn)}


def resumes(run: Path) -> list[dict]:
    from toymlx.bundle.events import read_events

    return [e for e in read_events(run) if e["kind"] == "resume"]


def kill_test(kills: int, seed: int, root: Path) -> dict:
    r = random.Random(seed)
    run = root / "kill"
    log = root / "train.log"
    data = str(SHARED / "text" / "tinystories_sample.txt")
    fresh = ["--recipe", "from-scratch", *TINY, "--steps", "1000000", "--data.path", data,
             "--runs-root", str(root), "--run-id", "kill"]
    out: dict = {"kills_made": 0, "kills_survived": 0, "mid_write": 0, "resumes_checked": 0,
                 "modes": {}, "failures": [], "cycles": []}
    t0 = time.time()

    # 1. killed before its first checkpoint: nothing to resume, the run id is taken
    p = launch(fresh, log)
    while not (run / "config.json").exists() and p.poll() is None:
        time.sleep(0.001)
    kill(p)
    out["kills_made"] += 1
    early = {"mode": "before-first-checkpoint"}
    if not list(run.glob("weights/step_*.gguf")):
        q = subprocess.run(train_cmd() + ["--resume", str(run)], capture_output=True, check=False, text=True)
        err = q.stderr.strip().splitlines()
        early["resume_rc"], early["resume_err"] = q.returncode, err[-1] if err else ""
        q2 = subprocess.run(train_cmd() + fresh + ["--steps", "1"], capture_output=True, check=False,
                            text=True)
        early["reuse_rc"] = q2.returncode
        ok = (q.returncode == 2 and len(err) == 1 and "checkpoint" in err[0]
              and q2.returncode == 2 and "already exists" in q2.stderr)
    else:  # the first step was fast enough to checkpoint: still a valid bundle
        ok = True
        early["note"] = "a checkpoint was already written"
    out["cycles"].append(early)
    if ok:
        out["kills_survived"] += 1
    else:
        out["failures"].append(early)

    # 2. the loop: start over with --overwrite, then resume after every kill
    cmd = fresh + ["--overwrite"]
    expect_start = 0
    offset = r.randrange(len(MODES))
    for k in range(kills - 1):
        # the first launch must complete a checkpoint before its kill; then every mode in turn
        mode = r.choice(MODES[1:3]) if k == 0 else MODES[(k + offset) % len(MODES)]
        n_resumes = len(resumes(run)) if run.exists() else 0
        p = launch(cmd, log)
        seen = wait_and_kill(p, run / "weights", mode, r)
        out["kills_made"] += 1
        out["modes"][mode] = out["modes"].get(mode, 0) + 1
        cycle = {"k": k + 1, **seen, "expected_start": expect_start}
        try:
            assert not seen.get("stuck"), f"no {mode} moment within {WAIT_LIMIT} s"
            assert "exited" not in seen, f"trainer exited by itself ({seen.get('exited')})"
            if seen.get("tmp_left"):
                out["mid_write"] += 1
            res = resumes(run)
            if k and len(res) > n_resumes:  # the resume got as far as its resume event
                got = res[-1]["from_step"]
                assert got == expect_start, f"resume from_step {got}, latest was {expect_start}"
                out["resumes_checked"] += 1
                cycle["start_step"] = got
            state = check_bundle(run, out["kills_made"])
            cycle.update(state)
            expect_start = state["latest"]
            out["kills_survived"] += 1
        except Exception as e:  # noqa: BLE001 -- every broken invariant is a finding
            cycle["error"] = f"{type(e).__name__}: {e}"
            out["failures"].append(cycle)
            saved = root / f"bundle-after-kill-{k + 1}"
            shutil.copytree(run, saved, symlinks=True, dirs_exist_ok=True)
            cycle["saved"] = str(saved)
            out["cycles"].append(cycle)
            break
        out["cycles"].append(cycle)
        cmd = ["--resume", str(run)]

    # 3. a resume that runs to the end
    if not out["failures"]:
        target = expect_start + 3
        q = subprocess.run(train_cmd() + ["--resume", str(run), "--steps", str(target)],
                           capture_output=True, check=False, text=True)
        res = resumes(run)
        from toymlx.bundle.events import read_events

        end = [e for e in read_events(run) if e["kind"] == "run_end"]
        final = {"rc": q.returncode, "start_step": res[-1]["from_step"] if res else None,
                 "expected_start": expect_start,
                 "end": {k: end[-1].get(k) for k in ("reason", "final_step")} if end else None}
        out["final_resume"] = final
        if not (q.returncode == 0 and final["start_step"] == expect_start and end
                and end[-1]["reason"] == "completed" and end[-1]["final_step"] == target):
            out["failures"].append({"final_resume": final, "stderr": q.stderr[-2000:]})
        else:
            out["final_bundle"] = check_bundle(run, out["kills_made"])
            left = tmps(run / "weights")  # what killed writers left is swept on resume
            if left:
                out["failures"].append({"final_resume": final, "temporaries_left": left})
    out["elapsed_s"] = round(time.time() - t0, 1)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=50, help="SIGKILLs to make (>= 2)")
    ap.add_argument("--seed", type=int, default=0, help="seed for kill modes and delays")
    ap.add_argument("--root", help="runs folder (default: a temporary one, removed if all ok)")
    ap.add_argument("--json", help="write the summary JSON here")
    args = ap.parse_args(argv)
    root = Path(args.root) if args.root else Path(tempfile.mkdtemp(prefix="kill-test-"))
    root.mkdir(parents=True, exist_ok=True)
    s = kill_test(max(args.kills, 2), args.seed, root)
    s["root"] = str(root)
    if args.json:
        Path(args.json).write_text(json.dumps(s, indent=1))
    print(f"kill_test: {s['kills_survived']}/{s['kills_made']} kills survived "
          f"({s['mid_write']} during a write, {s['resumes_checked']} resumes checked), "
          f"modes {s['modes']}, {s['elapsed_s']} s")
    for f in s["failures"]:
        print("FAILURE:", json.dumps(f)[:3000])
    if s["failures"]:
        print(f"bundle and train.log kept in {root}")
        return 1
    if not args.root:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
