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
compiles it once (`toymlx.backend.native`)
into the toymlx cache and points it at the BLAS; `toymlx.backend.device.bind_blas` then writes
its address into libmlx.so's `cblas_sgemm` slot (`toymlx.backend.blas_rebind`). Training's
matmuls (thousands of rows) go through unchanged. Without a compiler, or with
`TOYMLX_GEMV_FORWARD=off`, MLX calls the BLAS directly. OpenBLAS 0.3.34 (pip's) still runs a
one-row sgemm as a full gemm on x86-64: 9.5 ms against sgemv's 2.6 ms for SmolLM2's output
product (Intel Xeon, 2 cores).
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

from toymlx.backend import native

SOURCE = Path(__file__).with_name("gemv_forward.c")
_lib: ctypes.CDLL | None = None


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
        path = native.build(SOURCE)
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
