"""toymlx.backend.aligned_buffers: MLX's CPU arrays start on 64-byte boundaries once toymlx is
imported first (MLX's own allocator puts them 8 bytes past glibc's 16-byte alignment), their
buffers are freed without a fault (through MLX's buffer cache too, and at exit), and a process
that used MLX before toymlx keeps MLX's allocator, saying so."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys

import pytest

from toymlx.backend import aligned_buffers, native

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="the shim rebinds libmlx.so's calls on Linux only")

_PROBE = """
import json, sys
import numpy as np
{first}
import toymlx
import mlx.core as mx
from toymlx.backend.device import backend_info

def offset(a):
    mx.eval(a)
    return np.asarray(memoryview(a)).ctypes.data % 64

sizes = [1024, 4096, 100_000, 1_000_000]
offsets = {{n: offset(mx.ones((n,))) for n in sizes}}
# many buffers through MLX's cache, then the cache emptied: each freed by the free that knows it
kept = [mx.ones((50_000,)) * i for i in range(40)]
mx.eval(kept)
total = float(sum(k.sum() for k in kept).item())
del kept
mx.clear_cache()
mx.set_cache_limit(0)
x = mx.random.normal((256, 256), key=mx.random.key(0))
y = np.array(x @ x)
ref = np.array(x).astype(np.float64) @ np.array(x).astype(np.float64)
print(json.dumps({{"state": backend_info().get("aligned_buffers"), "offsets": offsets,
                  "total": total, "matmul_err": float(np.abs(y - ref).max())}}))
"""


def _probe(first: str = "", **env: str) -> dict:
    r = subprocess.run([sys.executable, "-c", _PROBE.format(first=first)],
                       check=False, capture_output=True, text=True, timeout=300,
                       env={**os.environ, **env})
    assert r.returncode == 0, r.stderr[-2000:]  # a free of the wrong kind aborts the process
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_arrays_start_on_64_byte_boundaries_and_free_cleanly():
    r = _probe()
    assert r["state"] == "on"
    # 1024 floats are 4 KB, the shim's smallest; MLX's size header sits in the 8 bytes before
    assert all(r["offsets"][str(n)] == 0 for n in (1024, 100_000, 1_000_000)), r["offsets"]
    assert r["total"] == pytest.approx(50_000 * sum(range(40)))
    assert r["matmul_err"] < 1e-3


def test_mlx_used_before_toymlx_keeps_its_allocator():
    first = "import mlx.core as mx0; mx0.eval(mx0.ones((100_000,)))"
    r = _probe(first)
    assert r["state"] == "off (MLX's allocator was in use before toymlx was imported)"
    assert r["offsets"]["100000"] % 16 == 8  # MLX's own placement, unchanged


def test_glibcs_own_heap_leaves_mlx_as_it_is():
    r = _probe(TOYMLX_MALLOC="default")
    assert r["state"] == "off (TOYMLX_MALLOC=default)"
    assert r["offsets"]["100000"] % 16 == 8


def test_the_shim_tells_its_blocks_from_glibcs():
    lib = ctypes.CDLL(str(native.build(aligned_buffers.SOURCE)))
    lib.toymlx_malloc.restype = ctypes.c_void_p
    lib.toymlx_malloc.argtypes = [ctypes.c_size_t]
    lib.toymlx_free.argtypes = [ctypes.c_void_p]
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    big, small = lib.toymlx_malloc(1 << 20), lib.toymlx_malloc(100)
    assert (big + 8) % 64 == 0 and big % 64 == 56
    assert small % 16 == 0  # below 4 KB: glibc's own block
    ctypes.memset(big, 7, 1 << 20)  # the whole block is the caller's
    theirs = libc.malloc(1 << 20)
    for p in (big, small, theirs, None):  # each freed by the free that owns it (or nothing)
        lib.toymlx_free(p)


def test_libraries_loaded_later_do_not_get_mlxs_reference_blas():
    """The shim loads libmlx.so before mlx.core does, in a scope of its own: loaded globally,
    its reference BLAS answered the BLAS calls of every library loaded after (PyTorch's CPU
    steps ran 40x slower in the benchmark's child)."""
    code = """
import ctypes, json
import toymlx
from toymlx.backend.blas_rebind import library_of
libc = ctypes.CDLL(None)
found = {}
for name in ("cblas_sgemm", "sgemm_", "sgetrf_"):
    f = getattr(libc, name, None)
    found[name] = None if f is None else library_of(ctypes.cast(f, ctypes.c_void_p).value)
print(json.dumps(found))
"""
    r = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    found = json.loads(r.stdout.strip().splitlines()[-1])
    assert not any(path and "mlx_cpu.libs" in path for path in found.values()), found
