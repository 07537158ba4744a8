"""A precompiled header for MLX's JIT-compiled CPU kernels (Linux, g++): each kernel builds in
~0.15 s instead of ~0.7 s.

Why: `mx.compile` on the CPU writes each fused elementwise kernel as a small C++ file that
includes `mlx/backend/cpu/compiled_preamble.h` (69,000 lines once preprocessed) and builds it
with `g++ -std=c++17 -O3 -Wall -fPIC -shared -I <mlx>/include`, one kernel at a time. Parsing
that header is nearly all of a build: a cold LoRA step of SmolLM2-135M spent ~18 s of its
~23 s building ~35 kernels, and each new batch length of an unpacked run builds a few more.

How: g++ looks for `<header>.gch` in each directory it searches for `<header>`, before the
header itself, and a quoted include is searched first in the including file's directory:
MLX's kernel folder (`toymlx.backend.device.persist_kernels`). So `install` compiles MLX's
own preamble once, with MLX's code-generation flags, to
`<kernel folder>/mlx/backend/cpu/compiled_preamble.h.gch`, and every kernel g++ builds there
reads it instead of the header. g++ checks a PCH before using it (same compiler, same
code-generation options; `g++ -H` prints `!` for one it uses) and otherwise reads the header as
before, so a stale or mismatched file can only cost the time it would have saved, never change
a kernel's values. `TOYMLX_KERNEL_PCH=off` leaves it out.

The vector width: MLX 0.32's Linux wheel builds its kernels for baseline x86-64 (SSE2, 4 floats
a vector); newer MLX adds `-mavx2 -mfma` itself where it was built with AVX2. The PCH carries a
`#pragma GCC target` for the widest vector set this CPU's cpuid has (`vector_isa`: x86-64-v4,
AVX-512; x86-64-v3, AVX2), which g++ applies to every function after it, the kernel's own
included, and `#pragma GCC optimize("fp-contract=off")`, so that no multiply and add are fused
into one rounding: each kernel computes the same float32 values as before, bit for bit, in wider
vectors. Kernels built for one CPU must not run on another, so the kernel folder is named after
the vector set (`toymlx.backend.device.kernel_cache_dir`).
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from pathlib import Path

HEADER = "mlx/backend/cpu/compiled_preamble.h"
FLAGS = ("-std=c++17", "-O3", "-Wall", "-fPIC")
"""The flags of MLX's own kernel builds that a PCH must share (mlx/backend/cpu/jit_compiler.cpp;
-shared only links)."""


_X86_LEVELS = (
    ("x86-64-v4", ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512dq", "avx512vl")),
    ("x86-64-v3", ("avx2", "fma", "f16c")),
)
"""x86-64's vector levels above the baseline (the psABI's names), widest first, with the cpuid
flags each needs; the same names are g++'s target options."""


def vector_isa() -> tuple[str, str | None]:
    """(name, g++ target) of the widest vector set this CPU has: ("x86-64-v4", "avx2,...") with
    AVX-512, ("x86-64-v3", ...) with AVX2 and FMA, else (the machine's baseline, None)."""
    machine = platform.machine().lower()
    if machine not in ("x86_64", "amd64"):
        return machine or "unknown", None
    from toymlx.backend.blas import cpu_flags

    _, flags = cpu_flags()
    for name, needs in _X86_LEVELS:
        if all(f in flags for f in needs):
            return name, ",".join(needs)
    return "x86-64", None


def _source(header: Path) -> str:
    """What the PCH is compiled from: the vector set's pragmas, then MLX's preamble."""
    _, target = vector_isa()
    lines = [] if target is None else [f'#pragma GCC target("{target}")',
                                       '#pragma GCC optimize("fp-contract=off")']
    return "\n".join([*lines, f'#include "{header}"']) + "\n"


def _identity(gxx: str, header: Path) -> str:
    """What the PCH was built from: the compiler's version line, the flags, the source (the
    vector set's pragmas and the header's path), the header's time."""
    version = subprocess.run([gxx, "--version"], capture_output=True, text=True, timeout=30,
                             check=False).stdout.splitlines()[:1]
    return "\n".join([*version, " ".join(FLAGS), _source(header),
                      str(header.stat().st_mtime_ns)]) + "\n"


def install(kernel_dir: str | os.PathLike) -> str:
    """Build the PCH into `kernel_dir` (MLX's kernel folder) unless one built from the same
    compiler and header is there; return what `backend_info` records: the file, or "off (why)"."""
    if os.environ.get("TOYMLX_KERNEL_PCH") == "off":
        return "off (TOYMLX_KERNEL_PCH=off)"
    import mlx.core as mx  # here, not at the top: this module loads before mlx.core

    header = Path(mx.__file__).parent / "include" / HEADER
    gxx = shutil.which("g++")
    if not header.is_file():
        return f"off (this MLX ships no {HEADER})"
    if gxx is None:
        return "off (no g++ on PATH; MLX needs it to build its kernels too)"
    gch = Path(kernel_dir) / (HEADER + ".gch")
    stamp = gch.with_name(gch.name + ".built-from")
    want = _identity(gxx, header)
    if gch.is_file() and stamp.is_file() and stamp.read_text() == want:
        return str(gch)
    tmp = gch.with_name(f".{gch.name}.{os.getpid()}")
    source = gch.with_name(f".{gch.name}.{os.getpid()}.h")
    try:
        gch.parent.mkdir(parents=True, exist_ok=True)
        source.write_text(_source(header))
        done = subprocess.run([gxx, *FLAGS, "-I", str(header.parents[3]), "-x", "c++-header",
                               str(source), "-o", str(tmp)], capture_output=True, text=True,
                              timeout=300, check=False)
        if done.returncode != 0:
            return f"off (g++ failed: {' '.join(done.stderr.split())[-200:]})"
        os.replace(tmp, gch)  # readers see the whole file or none
        stamp.write_text(want)
    except (OSError, subprocess.SubprocessError) as e:
        return f"off ({' '.join(str(e).split())[:200]})"
    finally:
        tmp.unlink(missing_ok=True)
        source.unlink(missing_ok=True)
    return str(gch)
