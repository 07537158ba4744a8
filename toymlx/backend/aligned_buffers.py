"""MLX's CPU arrays on 64-byte boundaries (Linux).

Why: MLX's CPU allocator asks malloc for 8 bytes more than each buffer, keeps the buffer's size
in them and hands out the rest, so every array's data starts 8 bytes past glibc's 16-byte
alignment (24 past a 64-byte boundary for a large one). Every 64-byte vector load of the BLAS
(MKL's and OpenBLAS's AVX-512 packing and small-matrix kernels) then spans two cache lines, as
do half the 32-byte loads of MLX's compiled elementwise kernels. With the data on 64-byte
boundaries a training step is 3-4% faster, every loss the same bits (Intel Xeon, 2 cores:
docs/RESULTS.md, session 62).

How: `aligned_buffers.c` defines a malloc that places a large block (4 KB or more) so that
MLX's pointer + 8 is 64-byte aligned, and a free that tells its blocks from glibc's by the
address (`toymlx.backend.native` builds it once). `install` points libmlx.so's own calls of
malloc and free at them (`toymlx.backend.blas_rebind.rebind_calls`): free first, so a buffer
allocated before is freed by glibc's free as before. Nothing else in the process changes.
It must run before MLX's allocator is first used: `toymlx/__init__` runs it before importing
`mlx.core`, and where a script used MLX before importing toymlx it stays off (said in
`backend_info`). Off with `TOYMLX_MALLOC=default` (glibc's own heap, as MLX asks for it) and
with `TOYMLX_ALIGNED_BUFFERS=off` (for comparisons). On a
GPU MLX's arrays come from the device's allocator, and the shim sees only libmlx.so's own
small host allocations.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from toymlx.backend import blas_rebind, native

SOURCE = Path(__file__).with_name("aligned_buffers.c")
_lib: list[ctypes.CDLL] = []
_result: str | None = None
ALLOCATOR_GUARD = "_ZGVZN3mlx4core9allocator16common_allocatorEvE10allocator_"
"""The guard of MLX's CPU allocator (a function-local static): nonzero once it is built."""


def install() -> str:
    """Align the buffers MLX allocates; call it before `mlx.core` is imported (`toymlx/__init__`
    does). Returns what `backend_info` records: "on", or "off (<reason>)", decided at the first
    call (a later one returns it)."""
    global _result
    if _result is None:
        _result = _install()
    return _result


def _install() -> str:
    if sys.platform != "linux":
        return "off (Linux only)"
    if os.environ.get("TOYMLX_MALLOC") == "default":
        return "off (TOYMLX_MALLOC=default)"
    if os.environ.get("TOYMLX_ALIGNED_BUFFERS") == "off":
        return "off (TOYMLX_ALIGNED_BUFFERS=off)"
    try:
        mlx = _libmlx()
        if mlx is None:
            return "off (no libmlx.so in the mlx package)"
        # loaded as mlx.core's module will find it, in its own scope: global, its reference
        # BLAS would answer the BLAS calls of libraries loaded later (PyTorch's: 40x slower)
        ctypes.CDLL(str(mlx), mode=ctypes.RTLD_LOCAL)
        # MLX's allocator, built at its first use, keeps the free that libmlx.so's GOT held
        # then (its buffer cache frees through it): only one built after the rebinding frees
        # these buffers with the free that knows them
        guard = blas_rebind.symbol_offset(mlx, ALLOCATOR_GUARD)
        if guard is None:
            return "off (libmlx.so has no symbol table to find its allocator in)"
        if blas_rebind.loaded_byte("libmlx.so", guard):
            return "off (MLX's allocator was in use before toymlx was imported)"
        lib = ctypes.CDLL(str(native.build(SOURCE)), mode=ctypes.RTLD_LOCAL)
        address = {name: ctypes.cast(getattr(lib, f"toymlx_{name}"), ctypes.c_void_p).value
                   for name in ("free", "malloc")}
        # free first (written in this order): a buffer malloc gave before is glibc's, which
        # the new free hands to glibc's
        blas_rebind.rebind_calls("libmlx.so", {"free": address["free"],
                                               "malloc": address["malloc"]})
    except (OSError, subprocess.SubprocessError) as e:
        return f"off ({' '.join(str(e).split())[:200]})"
    _lib.append(lib)  # kept loaded: libmlx.so calls into it from now on
    return "on"


def _libmlx() -> Path | None:
    """The mlx package's libmlx.so, found without importing mlx.core."""
    spec = importlib.util.find_spec("mlx")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / "lib" / "libmlx.so"
        if path.exists():
            return path
    return None
