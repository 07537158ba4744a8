"""Running cases safely: a worker subprocess runs them, a supervisor watches it.

The worker runs under an address-space limit and reports each case before and after it runs
(one JSON line each). When the worker dies (a crash) or goes quiet past the case timeout (a
hang), the supervisor saves the running case's input, records it, and starts a new worker at
the next case.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from argparse import Namespace
from pathlib import Path

from .mutations import make_case
from .readers import reader_paths, run_case
from .seeds import build_seeds


class SelfTest:
    """A reader that segfaults on case 1 and hangs on case 2: proves the supervisor's guard."""

    case: int | None = None

    def __call__(self, p: str, seed: str) -> None:
        if self.case == 1:
            ctypes.string_at(0)
        if self.case == 2:
            time.sleep(3600)


def worker(args: Namespace) -> int:
    """Run cases args.start..args.end on the seeds in args.work, one JSON line per event."""
    resource.setrlimit(resource.RLIMIT_AS, (args.mem_gb << 30, args.mem_gb << 30))
    work = Path(args.work)
    info = json.loads((work / "seeds" / "seeds.json").read_text())
    seeds = {n: Path(p).read_bytes() for n, p in info["seeds"].items()}
    paths = reader_paths(info["seeds"])
    selftest = SelfTest()
    if args.selftest:
        paths["selftest"] = selftest
    print(json.dumps({"paths": list(paths)}), flush=True)
    if args.start == 0:  # the unmutated seeds: which paths each one exercises to success
        base = {n: run_case(paths, p, n) for n, p in info["seeds"].items()}
        print(json.dumps({"baseline": base}), flush=True)
    case_file = str(work / "case.gguf")
    for i in range(args.start, args.end):
        seed_name, buf, log = make_case(seeds, args.seed, i)
        with open(case_file, "wb") as f:
            f.write(buf)
        print(json.dumps({"start": i, "log": log}), flush=True)
        selftest.case = i
        res = run_case(paths, case_file, seed_name)
        print(json.dumps({"done": i, "seed": seed_name, "log": log, "res": res}), flush=True)
    return 0


def supervise(args: Namespace, entry: Path) -> dict:
    """Build the seeds, run args.cases cases through workers started as `entry --worker`, and
    return the summary."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="fuzz-gguf-"))
    t_start = time.time()
    build_seeds(work / "seeds", full=args.profile == "full")
    seed_info = json.loads((work / "seeds" / "seeds.json").read_text())
    summary: dict = {"seed": args.seed, "profile": args.profile, "cases": 0, "seeds": seed_info,
                     "paths": [], "per_path": {}, "defects": [], "crashes": [], "hangs": [],
                     "per_seed": {}, "ops": {}, "path_seconds": {}}
    nxt = 0
    while nxt < args.cases:
        if args.time_budget and time.time() - t_start > args.time_budget:
            summary["stopped_early"] = f"time budget {args.time_budget}s reached"
            break
        cmd = [sys.executable, str(entry), "--worker", "--work", str(work), "--seed",
               str(args.seed), "--start", str(nxt), "--end", str(args.cases),
               "--mem-gb", str(args.mem_gb)] + (["--selftest"] if args.selftest else [])
        err_path = work / "worker.stderr"
        with open(err_path, "wb") as err_file:  # a file: a full stderr pipe would stall it
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err_file,
                                    start_new_session=True)
        current, current_log, buf, hung = None, None, b"", False
        last = time.time()
        while True:
            ready, _, _ = select.select([proc.stdout], [], [], 1.0)
            if ready:
                chunk = os.read(proc.stdout.fileno(), 1 << 16)
                if not chunk:
                    break
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    msg = json.loads(line)
                    last = time.time()
                    if "paths" in msg:
                        summary["paths"] = msg["paths"]
                    elif "baseline" in msg:
                        _record_baseline(summary, msg["baseline"])
                    elif "start" in msg:
                        current, current_log = msg["start"], msg["log"]
                    elif "done" in msg:
                        _record(summary, msg, out, work)
                        current = None
                        nxt = msg["done"] + 1
            # the first case also pays for imports and seed parsing
            limit = args.case_timeout if current is not None else args.case_timeout + 120
            if time.time() - last > limit:
                os.killpg(proc.pid, signal.SIGKILL)
                hung = True
                break
        rc = proc.wait()
        proc.stdout.close()
        err = err_path.read_text(errors="replace")
        if current is not None and (hung or rc != 0):
            kind = "hang" if hung else "crash"
            summary["hangs" if hung else "crashes"].append(
                {"case": current, "log": current_log, "returncode": rc, "stderr": err[-2000:],
                 "input": _save_input(out, work, current, kind)})
            summary["cases"] += 1
            nxt = current + 1
        elif rc != 0 or hung:
            summary["worker_failed"] = {"returncode": rc, "stderr": err[-4000:]}
            break
    summary["elapsed_s"] = round(time.time() - t_start, 1)
    shutil.rmtree(work, ignore_errors=True)
    return summary


def _record_baseline(summary: dict, baseline: dict) -> None:
    """What each unmutated seed does in each reader; a defect there is a defect too."""
    summary["baseline"] = {n: {p: r["outcome"] for p, r in res.items()}
                           for n, res in baseline.items()}
    for n, res in baseline.items():
        for p, r in res.items():
            if r["outcome"] == "defect":
                summary["defects"].append({"case": f"seed {n}", "path": p, "log": [n],
                                           "why": r.get("why"), "error": r.get("error"),
                                           "trace": r.get("trace"), "input": None})


def _save_input(out: Path, work: Path, case: int, kind: str) -> str | None:
    src = work / "case.gguf"
    if not src.exists():
        return None
    dst = out / f"{kind}-case{case}.gguf"
    shutil.copyfile(src, dst)
    return str(dst)


def _record(summary: dict, msg: dict, out: Path, work: Path) -> None:
    summary["cases"] += 1
    seed_name = msg["seed"]
    summary["per_seed"][seed_name] = summary["per_seed"].get(seed_name, 0) + 1
    for entry in msg["log"][1:]:
        op = entry.split(":", 1)[0]
        summary["ops"][op] = summary["ops"].get(op, 0) + 1
    saved = None
    for path, rec in msg["res"].items():
        counts = summary["per_path"].setdefault(path, {})
        counts[rec["outcome"]] = counts.get(rec["outcome"], 0) + 1
        summary["path_seconds"][path] = round(summary["path_seconds"].get(path, 0) + rec["s"], 3)
        if rec["outcome"] == "defect":
            if saved is None:
                saved = _save_input(out, work, msg["done"], "defect")
            summary["defects"].append({"case": msg["done"], "path": path, "log": msg["log"],
                                       "why": rec.get("why"), "error": rec.get("error"),
                                       "trace": rec.get("trace"), "input": saved})


def replay(file: str) -> int:
    """Every reader on one saved input, in this process; 1 if any found a defect."""
    work = Path(tempfile.mkdtemp(prefix="fuzz-gguf-replay-"))
    res = run_case(reader_paths(build_seeds(work)), file, "toy-checkpoint")
    for name, rec in res.items():
        print(f"{name}: {rec['outcome']} {rec.get('error', '')}")
        if rec.get("trace"):
            print(rec["trace"])
    shutil.rmtree(work, ignore_errors=True)
    return int(any(r["outcome"] == "defect" for r in res.values()))


def show_case(seed: int, index: int, out: Path) -> Path:
    """Write case `index`'s bytes to `out`/case<index>.gguf; print its mutation log."""
    work = Path(tempfile.mkdtemp(prefix="fuzz-gguf-show-"))
    seeds = {n: Path(p).read_bytes() for n, p in build_seeds(work).items()}
    _, buf, log = make_case(seeds, seed, index)
    out.mkdir(parents=True, exist_ok=True)
    dst = out / f"case{index}.gguf"
    dst.write_bytes(buf)
    print(f"{dst}: {' | '.join(log)}")
    shutil.rmtree(work, ignore_errors=True)
    return dst


def report(s: dict) -> str:
    """The summary as text: counts per reader and seed, then every defect, crash and hang."""
    lines = [f"fuzz_gguf: {s['cases']} cases, seed {s['seed']}, {s['elapsed_s']} s"]
    lines.append("seeds: " + ", ".join(f"{k} x{v}" for k, v in sorted(s["per_seed"].items())))
    for k, v in s["seeds"].get("notes", {}).items():
        lines.append(f"  note {k}: {v}")
    for p, c in s["per_path"].items():
        lines.append(f"  {p}: " + ", ".join(f"{k} {v}" for k, v in sorted(c.items()))
                     + f" ({s['path_seconds'].get(p, 0):.1f} s)")
    for n, res in s.get("baseline", {}).items():
        ok = [p.split("(")[0] for p, o in res.items() if o == "ok"]
        lines.append(f"  seed {n} loads through: {', '.join(ok) or 'nothing'}")
    lines.append(f"defects {len(s['defects'])}, crashes {len(s['crashes'])}, "
                 f"hangs {len(s['hangs'])}")
    for d in s["defects"][:20]:
        lines.append(f"  defect case {d['case']} {d['path']}: {d['why']}: {d['error']} "
                     f"[{' | '.join(d['log'])}] -> {d['input']}")
    for d in s["crashes"] + s["hangs"]:
        lines.append(f"  crash/hang case {d['case']}: {' | '.join(d['log'] or [])} -> "
                     f"{d['input']} rc={d.get('returncode')}")
    if s.get("worker_failed"):
        lines.append("worker failed: " + s["worker_failed"]["stderr"][-1500:])
    return "\n".join(lines)
