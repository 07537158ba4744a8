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
before. `TOYMLX_KERNEL_PCH=off` leaves it out.

What it adds to MLX's preamble: toymlx's float32 exp and erf for MLX's Exp and Erf ops
(`toymlx.backend.fastmath.kernel_source`), the same values as fastmath's composed forms in one
vectorised loop. A kernel built without the PCH (a mismatched one) computes MLX's own exp
instead, so `toymlx.backend.device.setup_process` checks the kernels' values before training
asks for those ops (`Ops.kernel_forms`), and kernels built with one header live in a folder of
their own (`header_tag`).

The vector width: MLX 0.32's Linux wheel builds its kernels for baseline x86-64 (SSE2, 4 floats
a vector); newer MLX adds `-mavx2 -mfma` itself where it was built with AVX2. On a CPU with AVX2
the PCH starts with `#pragma GCC target("avx2,f16c")`, which g++ applies to every function after
it, the kernel's own included: 8 floats a vector. FMA is left out, so that g++ cannot fuse a
multiply and an add into one rounding: each kernel computes the same float32 values as before,
bit for bit. Kernels built for one CPU must not run on another, so the kernel folder is named
after the vector set and the header's tag (`toymlx.backend.device.kernel_cache_dir`).
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import subprocess
from pathlib import Path

from toymlx.backend import kernel_loops

HEADER = "mlx/backend/cpu/compiled_preamble.h"
FLAGS = ("-std=c++17", "-O3", "-Wall", "-fPIC")
"""The flags of MLX's own kernel builds that a PCH must share (mlx/backend/cpu/jit_compiler.cpp;
-shared only links)."""


_AVX2 = ("avx2", "f16c")
"""The cpuid flags (and g++ target options) of the vector set MLX's kernels are built for on an
x86-64 CPU that has them: 256-bit vectors. Not FMA: without fused multiply-adds in the target,
g++ cannot fuse a multiply and an add into one rounding, so each kernel keeps MLX's values bit
for bit. (AVX-512 measured no faster on these memory-bound loops, and its kernels took 30% longer
to build: docs/RESULTS.md, session 18.)"""


@functools.cache
def vector_isa() -> tuple[str, str | None]:
    """(name, g++ target) of the vector set MLX's kernels are built for on this CPU: ("avx2",
    "avx2,f16c") on an x86-64 CPU with AVX2 and F16C, else (the machine's baseline, None)."""
    machine = platform.machine().lower()
    if machine not in ("x86_64", "amd64"):
        return machine or "unknown", None
    from toymlx.backend.blas import cpu_flags

    if all(f in cpu_flags()[1] for f in _AVX2):
        return "avx2", ",".join(_AVX2)
    return "x86-64", None


def _source(header: Path) -> str:
    """What the PCH is compiled from: the vector set's pragma, MLX's preamble, then toymlx's
    float32 exp and erf for MLX's kernels (`toymlx.backend.fastmath.kernel_source`)."""
    from toymlx.backend import fastmath  # here: it imports mlx.core

    _, target = vector_isa()
    lines = [] if target is None else [f'#pragma GCC target("{target}")']
    return "\n".join([*lines, f'#include "{header}"', fastmath.kernel_source()]) + "\n"


@functools.cache
def _compiler_version(gxx: str) -> str:
    return "".join(subprocess.run([gxx, "--version"], capture_output=True, text=True, timeout=30,
                                  check=False).stdout.splitlines()[:1])


def _identity(gxx: str) -> str:
    """What MLX's kernels are built with: the compiler's version line, the flags, the PCH's
    source with MLX's header by name, not by path (the kernel folder's path names MLX's
    version, so environments with the same MLX, sharing a folder, agree on it and never
    rebuild each other's PCH), and the loops the kernels are rewritten to
    (`toymlx.backend.kernel_loops`)."""
    return "\n".join([_compiler_version(gxx), " ".join(FLAGS), _source(Path(HEADER)),
                      kernel_loops.identity()]) + "\n"


def compiler() -> str | None:
    """The g++ MLX's kernel builds would run, past toymlx's own shim
    (`toymlx.backend.kernel_loops`), which a process started from a toymlx process finds first
    on its PATH; None where there is none."""
    for folder in filter(None, os.environ.get("PATH", "").split(os.pathsep)):
        found = shutil.which("g++", path=folder)
        if found and not kernel_loops.is_shim(found):
            return found
    return None


def _header() -> Path:
    import mlx.core as mx  # here, not at the top: this module loads before mlx.core

    return Path(mx.__file__).parent / "include" / HEADER


@functools.cache
def header_tag() -> str | None:
    """What MLX's kernels are built with, as 10 hex digits: the compiler's version, the flags and
    the PCH's source (so toymlx's forms of exp and erf); None where no PCH is used
    (`TOYMLX_KERNEL_PCH=off`, no g++, no header). A kernel's file is named after its graph only,
    so kernels built with one header must never be found by a build with another:
    `toymlx.backend.device.kernel_cache_dir` keeps them apart by this tag."""
    header, gxx = _header(), compiler()
    if os.environ.get("TOYMLX_KERNEL_PCH") == "off" or gxx is None or not header.is_file():
        return None
    return hashlib.sha256(_identity(gxx).encode()).hexdigest()[:10]


def install(kernel_dir: str | os.PathLike) -> str:
    """Build the PCH into `kernel_dir` (MLX's kernel folder) unless one built from the same
    compiler and header is there; return what `backend_info` records: the file, or "off (why)"."""
    if os.environ.get("TOYMLX_KERNEL_PCH") == "off":
        return "off (TOYMLX_KERNEL_PCH=off)"
    header = _header()
    gxx = compiler()
    if not header.is_file():
        return f"off (this MLX ships no {HEADER})"
    if gxx is None:
        return "off (no g++ on PATH; MLX needs it to build its kernels too)"
    gch = Path(kernel_dir) / (HEADER + ".gch")
    stamp = gch.with_name(gch.name + ".built-from")
    want = _identity(gxx)
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
