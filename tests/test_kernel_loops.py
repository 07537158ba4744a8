"""toymlx.backend.kernel_loops: MLX's strided kernels are rewritten so that their inner loop reads
every operand contiguously, they compute MLX's own loops' values bit for bit on every kind of
stride (broadcast, transposed, reversed, short and long rows, several outputs, other dtypes),
and anything else is compiled as it was written."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import end_child

from toymlx.backend import kernel_loops

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or shutil.which("g++") is None,
    reason="MLX builds its CPU kernels with g++ on Linux")

# What MLX 0.32 writes for `(x - mu) * rstd * w + b` with mu, rstd (M, 1) and w, b (D,)
LAYER_NORM_KERNEL = """\
#include "mlx/backend/cpu/compiled_preamble.h"
using namespace mlx::core;
using namespace mlx::core::detail;
extern "C"  {
void Ff4_strided_2(int* shape, int64_t** strides, void** args) {
  float* A = (float*)args[0];
  const int64_t* A_strides = strides[1];
  float* B = (float*)args[1];
  const int64_t* B_strides = strides[2];
  float* C = (float*)args[2];
  float* F = (float*)args[3];
  for (int i0 = 0; i0 < shape[0]; ++i0) {
  for (int i1 = 0; i1 < shape[1]; ++i1) {
  float tmp_A = *A;
  float tmp_B = *B;
  float tmp_C = C[0];
  float tmp_D = 0x1p+0f;
  float tmp_E = Subtract()(tmp_A, tmp_B);
  float tmp_F = Multiply()(tmp_E, tmp_C);
  *F++ = tmp_F;
  A += A_strides[1];
  B += B_strides[1];
  }
  A += A_strides[0];
  A -= A_strides[1] * shape[1];
  B += B_strides[0];
  B -= B_strides[1] * shape[1];
  }
}
}
"""


def test_the_inner_loop_reads_each_operand_from_a_row():
    new = kernel_loops.rewrite(LAYER_NORM_KERNEL)
    assert new is not None
    # MLX's loop is kept for short rows, as written but for a barrier to vectorising it
    assert ("for (int i1 = 0; i1 < shape[1]; ++i1) {\n  __asm__ volatile(\"\" ::: \"memory\");\n"
            "  float tmp_A = *A;") in new
    assert f"if (n_ < {kernel_loops.MIN_WIDTH})" in new
    # the chunked loop: every strided operand read by index, the scalar and constant as MLX wrote
    loop = new[new.index("#pragma GCC ivdep"):]
    for line in ("float tmp_A = A_p_[i_];", "float tmp_B = B_p_[i_];", "float tmp_C = C[0];",
                 "float tmp_D = 0x1p+0f;", "float tmp_F = Multiply()(tmp_E, tmp_C);",
                 "F_p_[i_] = tmp_F;"):
        assert line in loop, line
    # each pointer ends the row where MLX's loop left it
    assert "A += A_s_ * n_;" in new and "B += B_s_ * n_;" in new and "F += n_;" in new
    assert new.count("A += A_strides[0];") == 1  # the outer loop is MLX's


@pytest.mark.parametrize("change", [
    lambda s: s.replace("_strided_2(", "_contiguous("),  # a flat loop: nothing to do
    lambda s: s.replace("  A += A_strides[1];\n", ""),  # a step missing
    lambda s: s.replace("  *F++ = tmp_F;\n", "  *F = tmp_F;\n"),  # an unknown statement
    lambda s: s.replace("int64_t** strides", "int** strides"),  # another signature
])
def test_a_kernel_in_another_form_is_left_as_written(change):
    assert kernel_loops.rewrite(change(LAYER_NORM_KERNEL)) is None


_CASES = """
import json, sys
import numpy as np
import mlx.core as mx
from toymlx.backend import device
device.setup_process()
rng = np.random.default_rng(0)
def a(*shape, dtype=np.float32):
    return mx.array(rng.standard_normal(shape).astype(dtype))
x, xl, xs = a(37, 192), a(3, 1000), a(64, 5)  # rows: one chunk, several chunks, MLX's loop
mu, w = a(37, 1), a(192)
cases = {
    "row and column broadcasts": (lambda x, mu, w: (x - mu) * (mu * 0.5) * w + w, (x, mu, w)),
    "long rows": (lambda x, m: (x - m) * m, (xl, a(3, 1))),
    "short rows": (lambda x, m: (x - m) * m, (xs, a(64, 1))),
    "transposed": (lambda x, y: x.T * y + 1.0, (a(192, 37), x)),
    "reversed": (lambda x, w: x[:, ::-1] * w - x, (x, w)),
    "strided rows": (lambda x, w: x[:, ::3] * w[::3] + 2.0, (x, w)),
    "mask": (lambda x, m, k: mx.where(k, x * m, -mx.inf), (x, mu, a(192) > 0)),
    "mask as numbers": (lambda x, m, k: k.astype(mx.float32) * (x - m), (x, mu, a(37, 1) > 0)),
    "two outputs": (lambda x, mu: ((x - mu) * 3.0, (x - mu) * (x - mu)), (x, mu)),
    "exp": (lambda x, mu: mx.exp(x - mu), (x, mu)),
    "int32": (lambda i, j: (i * 3 + j) // 2, (mx.array(rng.integers(-9, 9, (37, 192)), mx.int32),
                                              mx.array(rng.integers(1, 9, (37, 1)), mx.int32))),
    "float16": (lambda x, w: x * w + x, (a(37, 192, dtype=np.float16), a(192, dtype=np.float16))),
    "scalar operand": (lambda x, s: (x + s) * x, (x, mx.array(1.5))),
}
out = {}
for name, (fn, args) in cases.items():
    got = mx.compile(fn)(*args)
    got = got if isinstance(got, tuple) else (got,)
    out[name] = [np.array(g.astype(mx.float32) if g.dtype == mx.float16 else g).tolist() for g in got]
info = device.backend_info()
print(json.dumps({"values": out, "loops": info.get("kernel_loops"),
                  "folder": info.get("kernel_cache")}))
"""


def _start_cases(tmp_path: Path, **env: str) -> subprocess.Popen:
    """`_CASES` in a fresh process with empty kernel folders."""
    (tmp_path / "tmp").mkdir(parents=True)
    e = {**os.environ, "TMPDIR": str(tmp_path / "tmp"), "XDG_CACHE_HOME": str(tmp_path / "cache"),
         **env}
    e.pop("TOYMLX_KERNEL_CACHE", None)
    return subprocess.Popen([sys.executable, "-c", _CASES], env=e, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _cases_of(p: subprocess.Popen) -> dict:
    out, err = p.communicate(timeout=900)
    assert p.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def test_rewritten_kernels_compute_mlxs_values_bit_for_bit(tmp_path):
    # both at once: each builds its kernels cold with g++ (one core each), ~10 s one after other
    procs = [_start_cases(tmp_path / "new"),
             _start_cases(tmp_path / "old", TOYMLX_KERNEL_LOOPS="off")]
    try:
        new, old = (_cases_of(p) for p in procs)
    finally:
        for p in procs:
            end_child(p)
    assert new["loops"].endswith("/g++") and kernel_loops.is_shim(new["loops"])
    assert old["loops"] == "off (TOYMLX_KERNEL_LOOPS=off)"
    assert new["folder"] != old["folder"]  # kernels of either kind are never found by the other
    rewritten = [p for p in Path(new["folder"]).glob("*_strided_*.cpp")
                 if "#pragma GCC ivdep" in p.read_text()]
    assert len(rewritten) >= 10, sorted(p.name for p in Path(new["folder"]).glob("*.cpp"))
    assert not any("#pragma GCC ivdep" in p.read_text()
                   for p in Path(old["folder"]).glob("*.cpp"))
    for name, values in old["values"].items():
        for got, want in zip(new["values"][name], values, strict=True):
            got, want = np.array(got, np.float64), np.array(want, np.float64)
            assert got.shape == want.shape, name
            same = (got == want) | (np.isnan(got) & np.isnan(want))
            assert same.all(), f"{name}: {got[~same][:4]} against {want[~same][:4]}"


def test_a_process_that_keeps_mlxs_loops_takes_an_inherited_shim_off_its_path(tmp_path):
    """A process started from one that put the shim on PATH, with TOYMLX_KERNEL_LOOPS=off: its
    PATH loses the shim, and the shim itself rewrites nothing there either."""
    from toymlx.backend.kernel_pch import compiler

    before = os.environ["PATH"]
    try:
        shim = kernel_loops.install(tmp_path, compiler())
        assert kernel_loops.is_shim(shim) and os.environ["PATH"].startswith(str(Path(shim).parent))
        env = {**os.environ, "TOYMLX_KERNEL_LOOPS": "off"}
    finally:
        os.environ["PATH"] = before
    code = ("import os; from toymlx.backend import kernel_loops; kernel_loops.uninstall(); "
            "print(os.environ['PATH'])")
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       check=True)
    assert str(Path(shim).parent) not in p.stdout.split(os.pathsep)
    source = tmp_path / "k.cpp"
    source.write_text(LAYER_NORM_KERNEL.replace('#include "mlx/backend/cpu/compiled_preamble.h"\n'
                                                "using namespace mlx::core;\n"
                                                "using namespace mlx::core::detail;\n",
                                                "#include <cstdint>\n"
                                                "struct Subtract { float operator()(float a, float b) { return a - b; } };\n"
                                                "struct Multiply { float operator()(float a, float b) { return a * b; } };\n"))
    for loops, rewritten in (("off", False), ("on", True)):
        e = {**env, "TOYMLX_KERNEL_LOOPS": loops}
        subprocess.run([shim, "-c", str(source), "-o", str(tmp_path / "k.o")], env=e, check=True)
        assert ("#pragma GCC ivdep" in source.read_text()) is rewritten


def test_the_compiler_the_shim_runs_ignores_the_stop_signals(tmp_path):
    """A terminal's Ctrl-C goes to every process of its job, MLX's kernel build too: the build
    died and the step it built for failed. The shim's compiler, and all it runs, now ignore
    SIGINT, SIGTERM and SIGHUP (the run counts them itself and stops after the step), and
    SIGPIPE (a run that left at once leaves the build in flight to finish its library)."""
    import signal
    import stat

    fake = tmp_path / "cc"
    fake.write_text("#!/bin/sh\ngrep '^SigIgn:' /proc/self/status\n")
    fake.chmod(stat.S_IRWXU)
    before = os.environ["PATH"]
    try:
        shim = kernel_loops.install(tmp_path, str(fake))
    finally:
        os.environ["PATH"] = before
    out = subprocess.run([shim], capture_output=True, text=True, check=True).stdout
    ignored = int(out.split()[-1], 16)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGPIPE):
        assert ignored >> (sig - 1) & 1, sig.name


# ---- a full disk leaves no temporary behind -----------------------------------------------------
def _full_disk(*_a, **_k):
    import errno

    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_shim_that_cannot_be_written_leaves_no_temporary(tmp_path, monkeypatch):
    """The shim's write fails (a full disk): kernel loops are off (why), and its folder holds
    no `.g++.<pid>` (before: left there, on the disk that was full)."""
    monkeypatch.setattr(kernel_loops.os, "replace", _full_disk)
    said = kernel_loops.install(tmp_path, "g++")
    assert said == "off ([Errno 28] No space left on device)", said
    assert [p.name for p in tmp_path.rglob("*") if p.is_file()] == []


def test_a_rewrite_that_cannot_be_written_leaves_the_kernel_as_mlx_wrote_it(tmp_path,
                                                                           monkeypatch):
    """Rewriting a strided kernel fails at its rename (a full disk): the source is MLX's, and
    no `.<name>.<pid>` is left beside it."""
    source, text = tmp_path / "k.cpp", LAYER_NORM_KERNEL
    assert kernel_loops.rewrite(text) is not None  # one it rewrites
    source.write_text(text)
    monkeypatch.setattr(kernel_loops.os, "replace", _full_disk)
    kernel_loops._rewrite_file(source)
    assert source.read_text() == text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k.cpp"]


def test_kernels_that_cannot_be_kept_leave_no_partial_copy(tmp_path, monkeypatch):
    """Copying MLX's kernels into toymlx's cache fails midway (a full disk): the cache holds no
    `.partial-<pid>` (before: a half-copied library left on the disk that was full)."""
    from toymlx.backend import device

    mlx_dir, kept = tmp_path / "mlx", tmp_path / "kept"
    mlx_dir.mkdir()
    (mlx_dir / "a.so").write_bytes(b"\x7fELF" + bytes(4096))

    def half(src, dst):
        Path(dst).write_bytes(Path(src).read_bytes()[:100])
        _full_disk()

    monkeypatch.setattr(device.shutil, "copyfile", half)
    device._keep_new_kernels(mlx_dir, kept)
    assert list(kept.iterdir()) == []
