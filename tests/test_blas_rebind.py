"""toymlx.backend.blas_rebind: libmlx.so's BLAS and LAPACK slots rewritten to the chosen BLAS, also
in a process that imported (and used) mlx.core before toymlx; the results match float64 numpy,
and a failure to rewrite warns instead of staying silent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest

from toymlx.backend import blas_rebind, device
from toymlx.backend.device import backend_info

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or backend_info().get("blas") != "openblas",
    reason="MLX's wheel links a reference BLAS on Linux only; this host has no OpenBLAS")

_LATE = """
import json, os, sys, warnings
import numpy as np
import mlx.core as mx
# MLX used first: its cblas_sgemm and sgetrf_ slots bind to the wheel's reference BLAS
a = mx.array(np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32))
mx.eval(a @ a, mx.linalg.inv(a + 8 * mx.eye(64), stream=mx.cpu))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import toymlx
from toymlx.backend import blas_rebind, gemv_forward
from toymlx.backend.device import backend_info

rng = np.random.default_rng(1)
x, w = (rng.standard_normal(s).astype(np.float32) for s in ((96, 80), (80, 72)))
row = rng.standard_normal((1, 80)).astype(np.float32)
spd = rng.standard_normal((48, 48)) ; spd = (spd @ spd.T + 48 * np.eye(48)).astype(np.float32)
before = gemv_forward.forwarded_count()
got = {"gemm": np.array(mx.array(x) @ mx.array(w)), "gemv": np.array(mx.array(row) @ mx.array(w)),
       "inv": np.array(mx.linalg.inv(mx.array(spd), stream=mx.cpu))}
want = {"gemm": x.astype(np.float64) @ w, "gemv": row.astype(np.float64) @ w,
        "inv": np.linalg.inv(spd.astype(np.float64))}
print(json.dumps({
    "backend": backend_info(), "warned": [str(w.message) for w in caught],
    "sgemm": blas_rebind.slot_target("libmlx.so", "cblas_sgemm"),
    "sgetrf": blas_rebind.slot_target("libmlx.so", "sgetrf_"),
    "forwarded": None if before is None else gemv_forward.forwarded_count() - before,
    "error": {k: float(np.abs(got[k] - want[k]).max() / np.abs(want[k]).max()) for k in got}}))
"""


def _late(**env) -> dict:
    e = {**os.environ, **env}
    p = subprocess.run([sys.executable, "-c", _LATE], capture_output=True, text=True, env=e,
                       timeout=300, check=False)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_mlx_imported_and_used_first_is_switched_to_openblas():
    r = _late()
    assert r["warned"] == []
    b = r["backend"]
    assert b["blas"] == "openblas" and b["gemv_forward"] == "on"
    assert b["blas_bound"].endswith("BLAS/LAPACK functions of libmlx.so")
    assert "libtoymlx_gemv_forward" in r["sgemm"]  # the one-row forwarder, then OpenBLAS
    assert r["sgetrf"] == b["blas_path"]  # LAPACK too
    assert r["forwarded"] == 1  # the one-row product went to sgemv, the 96-row one did not
    assert r["error"]["gemm"] < 1e-5 and r["error"]["gemv"] < 1e-5 and r["error"]["inv"] < 1e-4


def test_without_the_forwarder_sgemm_goes_to_openblas_itself():
    r = _late(TOYMLX_GEMV_FORWARD="off")
    assert r["backend"]["gemv_forward"].startswith("off")
    assert r["sgemm"] == r["backend"]["blas_path"] and r["forwarded"] is None
    assert r["error"]["gemm"] < 1e-5


def test_the_slots_are_read_from_libmlx():
    path = blas_rebind.loaded_library("libmlx.so")
    assert path is not None and os.path.exists(path)
    slots = blas_rebind.plt_slots(path)
    assert {"cblas_sgemm", "sgetrf_", "ssyevd_"} <= slots.keys()
    assert len(set(slots.values())) == len(slots)  # one slot each


def test_a_file_that_is_not_a_library_is_refused_by_name(tmp_path):
    bad = tmp_path / "libfake.so"
    bad.write_bytes(b"not an ELF file at all")
    with pytest.raises(OSError, match="libfake.so: expected a 64-bit little-endian ELF"):
        blas_rebind.plt_slots(bad)
    with pytest.raises(OSError, match="libnothere.so is not loaded"):
        blas_rebind.rebind("libnothere.so", lambda name: None)


def test_a_rebind_that_fails_warns_and_records_the_reference_blas(monkeypatch):
    def refuse(library, target):
        raise OSError(f"{library}: the PLT slot of cblas_sgemm is read-only (linked with -z now)")

    monkeypatch.setattr(blas_rebind, "rebind", refuse)
    state = device._ProcessState()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        device._bind_openblas(state)
    assert state.blas == "reference" and state.library is None
    assert state.blas_bound.startswith("failed: ")
    [w] = caught
    assert "read-only" in str(w.message) and "could not be pointed at" in str(w.message)
