"""toymlx.backend.kernel_loops: MLX's strided kernels built with vectorised inner loops compute
every value bit for bit as MLX's own builds of them, for the broadcasts, transposes, reversed
rows, masks and lengths a training step makes; sources it does not know build as MLX wrote them,
and a vectorised source that fails to build falls back to MLX's."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from toymlx.backend import kernel_loops

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or shutil.which("g++") is None,
    reason="MLX builds its CPU kernels with g++ on Linux")

_GRAPHS = """
import json, os, sys
import numpy as np
from toymlx.backend import device, kernel_loops
device.setup_process()
import mlx.core as mx
rng = np.random.default_rng(0)
out = {}
for n in (1, 7, 255, 256, 257, 700):  # one element, a vector's tail, around a block (256)
    x = mx.array(rng.standard_normal((33, n)).astype(np.float32))
    row = mx.array(rng.standard_normal((33, 1)).astype(np.float32))  # a row statistic
    w = mx.array(rng.standard_normal((n,)).astype(np.float32))  # a weight, along the rows
    mask = mx.array(rng.standard_normal((33, n)) > 0)
    t = mx.array(rng.standard_normal((n, 33)).astype(np.float32))  # read transposed
    out[f"norm{n}"] = mx.compile(lambda x, r, w: (x - r) * mx.exp(r) * w + 1.5)(x, row, w)
    out[f"mask{n}"] = mx.compile(
        lambda x, m, r: mx.where(m, x * r, -mx.inf) - mx.maximum(x, r))(x, mask, row)
    out[f"transposed{n}"] = mx.compile(
        lambda x, t, w: (x + t.T) * w / (1.0 + mx.abs(t.T)))(x, t, w)
    x3 = mx.array(rng.standard_normal((4, 5, n)).astype(np.float32))
    out[f"reversed{n}"] = mx.compile(lambda a, b: a * b + a)(x3, x3[:, :, ::-1])
    out[f"half{n}"] = mx.compile(  # float16 inside, float32 strided inputs
        lambda x, r: ((x * 2.0).astype(mx.float16) + r.astype(mx.float16)).astype(mx.float32)
    )(x, row)
mx.eval(out)
np.savez(sys.argv[1], **{k: np.array(v) for k, v in out.items()})
folder = device.backend_info()["kernel_cache"]
libs = [os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".so")] if folder else []
print(json.dumps({"loops": device.backend_info().get("kernel_loops"), "folder": folder,
                  "unmarked": [p for p in libs if "strided" in os.path.basename(p)
                               and not kernel_loops.built_with_loops(p)],
                  "marked": sum(kernel_loops.built_with_loops(p) for p in libs),
                  "strided": sum("strided" in os.path.basename(p) for p in libs)}))
"""


def _run(tmp_path: Path, name: str, **env: str) -> tuple[dict, dict]:
    """Evaluate `_GRAPHS` in a fresh process with empty kernel folders; its report and values."""
    home = tmp_path / name
    (home / "tmp").mkdir(parents=True)
    e = {**os.environ, "TMPDIR": str(home / "tmp"), "XDG_CACHE_HOME": str(home / "cache"), **env}
    p = subprocess.run([sys.executable, "-c", _GRAPHS, str(home / "values.npz")], env=e,
                       capture_output=True, text=True, timeout=600, check=False)
    assert p.returncode == 0, p.stderr[-2000:]
    values = np.load(home / "values.npz")
    return json.loads(p.stdout.strip().splitlines()[-1]), {k: values[k] for k in values}


def test_vectorised_strided_kernels_keep_mlx_s_values_bit_for_bit(tmp_path):
    ours, got = _run(tmp_path, "loops")
    mlx, want = _run(tmp_path, "mlx", TOYMLX_KERNEL_LOOPS="off")
    assert ours["loops"] == "on" and mlx["loops"] == "off (TOYMLX_KERNEL_LOOPS=off)"
    # every strided kernel built with the vectorised loops (half's float16 ones included: their
    # strided inputs are float32), none of MLX's own builds
    assert ours["strided"] >= 5 and ours["marked"] == ours["strided"], ours
    assert mlx["marked"] == 0, mlx
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].tobytes() == want[k].tobytes(), k


_STRIDED = """extern "C"  {
void K(int* shape, int64_t** strides, void** args) {
  float* A = (float*)args[0];
  const int64_t* A_strides = strides[1];
  %s* B = (%s*)args[1];
  const int64_t* B_strides = strides[2];
  float* C = (float*)args[2];
  float* D = (float*)args[3];
  for (int i0 = 0; i0 < shape[0]; ++i0) {
  for (int i1 = 0; i1 < shape[1]; ++i1) {
  float tmp_A = *A;
  %s tmp_B = *B;
  float tmp_C = C[0];
  float tmp_E = 2;
  float tmp_F = Multiply()(tmp_A, tmp_E);
  float tmp_D = Add()(tmp_F, tmp_C);
  *D++ = tmp_D;
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


def test_vectorise_rewrites_only_the_strided_loops_it_knows():
    src = _STRIDED % ("float", "float", "float")
    out = kernel_loops.vectorise(src)
    assert out is not None and f"{kernel_loops.MARK}[]" in out
    # the innermost loop reads contiguous views; the scalar input and the outer loop are MLX's
    assert "tmp_A = v_A[i1];" in out and "tmp_C = C[0];" in out and "D[i1] = tmp_D;" in out
    assert "  A -= A_strides[1] * shape[1];" in out
    # rows shorter than SHORT run MLX's loop as it was
    short = out.index(f"  if (shape[1] < {kernel_loops.SHORT}) {{")
    assert out.index("  *D++ = tmp_D;") > short and out.index("  } else {") > out.index("*D++")
    # a buffer type outside TYPES, a contiguous kernel, an unknown statement: left to MLX
    assert kernel_loops.vectorise(_STRIDED % ("float16_t", "float16_t", "float16_t")) is None
    contiguous = "  for (size_t i = 0; i < size; ++i) {\n  float tmp_A = A[i];\n  B[i] = tmp_A;\n  }"
    assert kernel_loops.vectorise(contiguous) is None
    assert kernel_loops.vectorise(src.replace("  float tmp_E = 2;", "  weird(A);")) is None


def test_a_build_command_falls_back_to_mlx_s_source(tmp_path):
    """The vectorised source is built first, then removed; where its build fails the command
    builds MLX's source (here: a vectorised source that does not compile)."""
    src = tmp_path / "tmp_1.cpp"
    src.write_text(_STRIDED % ("float", "float", "float"))
    mlx_cmd = f'g++ -shared "{src}" -o "{tmp_path / "tmp_1.so"}" 2>&1'
    cmd = kernel_loops.build_command(mlx_cmd)
    vec = tmp_path / "tmp_1.vec.cpp"
    assert vec.is_file() and kernel_loops.MARK in vec.read_text()
    assert cmd.startswith(mlx_cmd.replace(str(src), str(vec))) and cmd.endswith(f"{mlx_cmd}; }}")
    vec.write_text("this is not C++")  # its build fails: the command runs MLX's
    fake = tmp_path / "bin"
    fake.mkdir()
    log = tmp_path / "built"
    (fake / "g++").write_text(f'#!/bin/sh\ncase "$*" in *vec.cpp*) exit 1;; esac\n'
                              f'echo "$*" >> {log}\n')
    (fake / "g++").chmod(0o755)
    p = subprocess.run(["sh", "-c", cmd], env={**os.environ, "PATH": f"{fake}:/usr/bin:/bin"},
                       capture_output=True, text=True, check=False)
    assert p.returncode == 0, p.stdout
    assert str(src) in log.read_text() and not vec.exists()
    # a command that is not a kernel build, or a source it does not know, runs unchanged
    assert kernel_loops.build_command("g++ --version") == "g++ --version"
    src.write_text("int x;\n")
    assert kernel_loops.build_command(mlx_cmd) == mlx_cmd
