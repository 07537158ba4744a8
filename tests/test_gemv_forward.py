"""toymlx.backend.gemv_forward: MLX's one-row float32 matmuls through OpenBLAS's sgemv.

Every layout MLX can hand cblas_sgemm for such a product (either operand transposed, a
strided row, beta 0 and 1) is checked against float64 numpy, and the forwarder's own count
says which products went to sgemv and which to sgemm."""

from __future__ import annotations

import os
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from toymlx.backend import gemv_forward
from toymlx.backend.device import backend_info

LINUX_OPENBLAS = sys.platform.startswith("linux") and backend_info().get("blas") in ("openblas", "mkl")
pytestmark = pytest.mark.skipif(not LINUX_OPENBLAS,
                                reason="the forwarder sits in front of OpenBLAS or MKL on Linux only")


def _rng_arrays(*shapes, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(np.float32) for s in shapes]


def _check(fn, inputs, expected, forwarded: int):
    """`fn(*inputs)` evaluated by MLX equals `expected` (float64), with `forwarded` products
    sent to sgemv."""
    before = gemv_forward.forwarded_count()
    out = fn(*[mx.array(a) for a in inputs])
    mx.eval(out)
    got = np.array(out, dtype=np.float64)
    assert gemv_forward.forwarded_count() - before == forwarded
    scale = np.abs(expected).max()
    np.testing.assert_allclose(got, expected, rtol=0, atol=2e-6 * scale * np.sqrt(
        max(inputs[0].shape)))


def test_the_forwarder_is_in_front_of_openblas():
    assert backend_info()["gemv_forward"] == "on"
    assert gemv_forward.forwarded_count() is not None


@pytest.mark.parametrize("K,N", [(576, 1536), (1536, 576), (64, 49152), (7, 3)])
def test_one_row_times_a_matrix_in_every_layout(K, N):
    x, w_nk, w_kn = _rng_arrays((1, K), (N, K), (K, N))
    x64 = x.astype(np.float64)
    _check(lambda a, w: a @ w.T, [x, w_nk], x64 @ w_nk.T.astype(np.float64), 1)  # a Linear
    _check(lambda a, w: a @ w, [x, w_kn], x64 @ w_kn.astype(np.float64), 1)
    # the row as a column of a transposed (K, 1) array, and a row of a wider matrix
    _check(lambda a, w: a.T.T @ w.T, [x, w_nk], x64 @ w_nk.T.astype(np.float64), 1)
    wide = np.concatenate([x, x * 2], axis=0)  # (2, K): its row 1 as a (1, K) slice
    _check(lambda a, w: a[1:2] @ w.T, [wide, w_nk], 2 * x64 @ w_nk.T.astype(np.float64), 1)


@pytest.mark.parametrize("M,K", [(1536, 576), (9, 4)])
def test_a_matrix_times_one_column_stays_with_sgemm(M, K):
    a_mk, a_km, v = _rng_arrays((M, K), (K, M), (K, 1))
    v64 = v.astype(np.float64)
    _check(lambda a, b: a @ b, [a_mk, v], a_mk.astype(np.float64) @ v64, 0)
    _check(lambda a, b: a.T @ b, [a_km, v], a_km.T.astype(np.float64) @ v64, 0)
    _check(lambda a, b: a @ b.T, [a_mk, v.T.copy()],  # the column as a transposed row
           a_mk.astype(np.float64) @ v64, 0)


def test_addmm_keeps_its_bias_and_scales():
    """beta != 0: C's old values are read (mx.addmm's bias), alpha scales the product."""
    c, x, w = _rng_arrays((1, 300), (1, 200), (300, 200))
    expected = 0.5 * c.astype(np.float64) + 2.0 * (x.astype(np.float64) @ w.T)
    before = gemv_forward.forwarded_count()
    out = mx.addmm(mx.array(c), mx.array(x), mx.array(w).T, alpha=2.0, beta=0.5)
    got = np.array(out, dtype=np.float64)
    assert gemv_forward.forwarded_count() - before == 1
    np.testing.assert_allclose(got, expected, atol=1e-4)


def test_an_output_buffer_full_of_nan_is_overwritten():
    """gemm with beta 0 never reads C; sgemv scales y by beta, and whether 0 * NaN stays NaN
    there has varied between OpenBLAS releases (the forwarder zeroes C first). MLX hands back
    freed buffers, so the one-row product can land in memory that held NaN."""
    x, w = _rng_arrays((1, 256), (512, 256))
    for _ in range(5):
        junk = mx.full((1, 512), float("nan"))
        mx.eval(junk)
        del junk  # its buffer goes back to MLX's cache, the product's output can reuse it
        out = mx.array(x) @ mx.array(w).T
        assert np.isfinite(np.array(out)).all()


def test_many_rows_stay_with_sgemm():
    x, w = _rng_arrays((2, 64), (32, 64))
    _check(lambda a, b: a @ b.T, [x, w], x.astype(np.float64) @ w.T, 0)
    one, = _rng_arrays((1, 1))  # 1 x 1: a dot product, also sgemm's
    _check(lambda a, b: a @ b, [one, one], one.astype(np.float64) @ one, 0)


def test_off_means_off():
    probe = ("import toymlx, toymlx.backend.device as d, toymlx.backend.gemv_forward as g\n"
             "print(d.backend_info()['gemv_forward'], g.forwarded_count())")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         env={**os.environ, "TOYMLX_GEMV_FORWARD": "off"},
                         check=True, timeout=120)
    assert out.stdout.split() == ["off", "(TOYMLX_GEMV_FORWARD=off)", "None"]
