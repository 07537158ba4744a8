"""MLX's one-row matmuls through the BLAS's matrix-vector kernel (Linux, OpenBLAS).

Why: decoding a token multiplies one row of activations by every weight matrix. MLX's CPU
backend sends every float32 matmul to `cblas_sgemm`, and OpenBLAS 0.3.21 (Debian 12's) runs a
1 x K by K x N product as a full gemm: it repacks the whole weight matrix on every call
(`sgemm_incopy`, 60% of such a call's time). Its `cblas_sgemv` streams the matrix once. Measured
on an AMD EPYC Zen 4 (2 cores): SmolLM2-135M's 49152 x 576 output product 23.6 -> 5.6 ms,
1536 x 576 273 -> 180 us; `toymlx-generate` on SmolLM2-135M 17.0 -> 24.3 tokens/s. Some newer
OpenBLAS builds forward such calls themselves (GEMM_GEMV_FORWARD, on some arm64 cores); this
does the same for any, one-row products only.

How: `gemv_forward.c` defines `toymlx_sgemm`, a `cblas_sgemm` that hands one-row products
(M = 1) to the BLAS's `cblas_sgemv` and everything else to its `cblas_sgemm`. `install`
compiles it once with the system C compiler (MLX's CPU backend needs one for its own kernels)
into the toymlx cache and points it at the BLAS; `toymlx.backend.device.bind_blas` then writes
its address into libmlx.so's `cblas_sgemm` slot (`toymlx.backend.blas_rebind`). Training's
matmuls (thousands of rows) go through unchanged. Without a compiler, or with
`TOYMLX_GEMV_FORWARD=off`, MLX calls the BLAS directly. OpenBLAS 0.3.34 (pip's) still runs a
one-row sgemm as a full gemm on x86-64: 9.5 ms against sgemv's 2.6 ms for SmolLM2's output
product (Intel Xeon, 2 cores).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

SOURCE = Path(__file__).with_name("gemv_forward.c")
_lib: ctypes.CDLL | None = None


def cache_dir() -> Path:
    """`$XDG_CACHE_HOME/toymlx/native` (default `~/.cache/toymlx/native`)."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "toymlx" / "native"


def _compiler() -> str | None:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return cc
    return None


def build() -> Path:
    """The compiled forwarder, built on first use (named after its source, so an edit rebuilds
    it); raises OSError with the reason where it cannot be built."""
    code = SOURCE.read_bytes()
    lib = cache_dir() / f"libtoymlx_gemv_forward-{hashlib.sha256(code).hexdigest()[:12]}.so"
    if lib.exists():
        return lib
    cc = _compiler()
    if cc is None:
        raise OSError("no C compiler (cc, gcc or clang) on PATH")
    lib.parent.mkdir(parents=True, exist_ok=True)
    tmp = lib.with_name(f".{lib.name}.{os.getpid()}")  # concurrent builders each rename theirs
    try:
        done = subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(tmp), str(SOURCE),
                               "-ldl"], check=False, capture_output=True, text=True,
                              timeout=120)
        if done.returncode != 0:
            raise OSError(f"{cc} failed: {' '.join(done.stderr.split())[:300]}")
        os.replace(tmp, lib)
    finally:
        tmp.unlink(missing_ok=True)
    return lib


def install(blas_path: str, prefix: str = "") -> str:
    """Point the forwarder at the BLAS at `blas_path`, whose symbols carry `prefix` (its init
    dlopens it). Returns what `backend_info` records: "on", or "off (<reason>)"."""
    global _lib
    if _lib is not None:
        return "on"
    if sys.platform != "linux":
        return "off (Linux only)"
    if os.environ.get("TOYMLX_GEMV_FORWARD") == "off":
        return "off (TOYMLX_GEMV_FORWARD=off)"
    try:
        path = build()
        lib = ctypes.CDLL(str(path), mode=ctypes.RTLD_LOCAL)
        names = [f"{prefix}cblas_sgemm", f"{prefix}cblas_sgemv"]
        if lib.toymlx_gemv_forward_init(blas_path.encode(), *(n.encode() for n in names)) != 0:
            return f"off ({blas_path} lacks {' or '.join(names)})"
    except (OSError, subprocess.SubprocessError) as e:
        return f"off ({' '.join(str(e).split())[:200]})"
    lib.toymlx_gemv_forward_count.restype = ctypes.c_ulong
    _lib = lib
    return "on"


def sgemm_address() -> int | None:
    """The address of the forwarder's sgemm (None: not in use), for libmlx.so's slot."""
    return None if _lib is None else ctypes.cast(_lib.toymlx_sgemm, ctypes.c_void_p).value


def forwarded_count() -> int | None:
    """How many one-row products went to sgemv in this process (None: the forwarder is not in use)."""
    return None if _lib is None else int(_lib.toymlx_gemv_forward_count())
