"""toymlx.backend.kernel_pch: MLX's own kernel builds read the precompiled preamble (g++ -H marks a
PCH it uses with "!"), the compiled function's values are unchanged, and the header is built once
per compiler and MLX."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from toymlx.backend import kernel_pch


def mx_version() -> str:
    import mlx.core as mx

    return re.escape(mx.__version__)

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or shutil.which("g++") is None,
    reason="MLX builds its CPU kernels with g++ on Linux")

_KERNEL = """
import json, sys
import mlx.core as mx
from toymlx.backend import device
device.setup_process()
fn = lambda x: (x * 1.618 + 0.25) * (x - 3.0)
f = mx.compile(fn)
x = mx.arange(8, dtype=mx.float32)
r = mx.random.normal((4099,), key=mx.random.key(0)) * 100.0  # a tail past any vector width
info = device.backend_info()
print(json.dumps({"values": f(x).tolist(), "pch": info.get("kernel_pch"),
                  "vectors": info.get("kernel_vectors"), "folder": info.get("kernel_cache"),
                  "same_bits": bool(mx.array_equal(f(r), fn(r)).item())}))
"""


def _build_with_logged_gxx(tmp_path: Path, **env: str) -> tuple[dict, str]:
    """Run `_KERNEL` in a fresh process with empty kernel folders and a g++ on PATH that passes
    -H (print each header used, "!" before a valid PCH) and logs it; return its output and the
    log of the builds MLX made."""
    wrap = tmp_path / "bin"
    wrap.mkdir()
    log = tmp_path / "gxx.log"
    (wrap / "g++").write_text(f'#!/bin/sh\nexec {kernel_pch.compiler()} "$@" -H 2>>{log}\n')
    (wrap / "g++").chmod(stat.S_IRWXU)
    (tmp_path / "tmp").mkdir()
    e = {**os.environ, "PATH": f"{wrap}:{os.environ['PATH']}", "TMPDIR": str(tmp_path / "tmp"),
         "XDG_CACHE_HOME": str(tmp_path / "cache"), **env}
    p = subprocess.run([sys.executable, "-c", _KERNEL], env=e, capture_output=True, text=True,
                       timeout=600, check=False)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1]), log.read_text() if log.exists() else ""


def test_mlx_kernel_builds_read_the_precompiled_header(tmp_path):
    out, log = _build_with_logged_gxx(tmp_path)
    assert out["pch"].endswith("mlx/backend/cpu/compiled_preamble.h.gch")
    # the kernel's build used it ("!": a valid PCH), from MLX's kernel folder
    assert re.search(rf"^! .*/mlx/{mx_version()}/cpu/{kernel_pch.HEADER}\.gch$", log, re.MULTILINE), log
    want = [(x * 1.618 + 0.25) * (x - 3.0) for x in range(8)]
    assert out["values"] == pytest.approx(want, rel=1e-6)


def test_kernels_are_built_for_this_cpus_vectors_with_the_same_values(tmp_path):
    """On a CPU with AVX2 the PCH builds MLX's kernels for it (ymm registers, 8 floats a
    vector), in a kernel folder named after it, with no fused multiply-add: the compiled
    kernel's values are MLX's unfused ops' bit for bit."""
    from toymlx.backend.blas import cpu_flags

    out, _ = _build_with_logged_gxx(tmp_path)
    assert out["same_bits"] is True
    name, target = kernel_pch.vector_isa()
    tag = kernel_pch.header_tag()  # the header's: a folder of its own for its kernels
    assert out["vectors"] == name and Path(out["folder"]).parent.name == f"{name}-{tag}"
    avx2 = {"avx2", "f16c"} <= cpu_flags()[1]
    assert (name, target) == (("avx2", "avx2,f16c") if avx2 else (name, None))
    if target is None or shutil.which("objdump") is None:
        return
    kernels = [k for k in Path(out["folder"]).glob("lib*contiguous.so")]
    assert kernels, list(Path(out["folder"]).iterdir())
    code = subprocess.run(["objdump", "-d", str(kernels[0])], capture_output=True, text=True,
                          check=True).stdout
    assert "%ymm" in code and "vfmadd" not in code


def test_without_it_the_kernel_builds_as_before(tmp_path):
    out, log = _build_with_logged_gxx(tmp_path, TOYMLX_KERNEL_PCH="off")
    assert out["pch"] == "off (TOYMLX_KERNEL_PCH=off)"
    assert ".gch" not in log and "compiled_preamble.h" in log  # the header itself, parsed
    want = [(x * 1.618 + 0.25) * (x - 3.0) for x in range(8)]
    assert out["values"] == pytest.approx(want, rel=1e-6)


def test_built_once_and_again_when_its_compiler_or_header_changes(tmp_path):
    first = Path(kernel_pch.install(tmp_path))
    built = first.stat().st_mtime_ns
    assert kernel_pch.install(tmp_path) == str(first)
    assert first.stat().st_mtime_ns == built  # the same compiler and header: kept
    stamp = first.with_name(first.name + ".built-from")
    stamp.write_text("g++ (another) 9.0\n")
    assert kernel_pch.install(tmp_path) == str(first)
    assert first.stat().st_mtime_ns > built and stamp.read_text() != "g++ (another) 9.0\n"


def test_a_link_of_the_older_layout_is_pointed_at_this_cpus_folder(tmp_path, monkeypatch):
    """MLX's kernel folder, a link toymlx made to the kernel cache's older folder (one for every
    CPU), is made again to the folder of this CPU's vector set; a folder MLX made is kept."""
    import mlx.core as mx

    from toymlx.backend import device

    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("TOYMLX_KERNEL_CACHE", raising=False)
    old = tmp_path / "cache" / "toymlx" / "mlx-kernels" / mx.__version__ / "cpu"
    old.mkdir(parents=True)
    link = tmp_path / "tmp" / "mlx" / mx.__version__ / "cpu"
    link.parent.mkdir(parents=True)
    link.symlink_to(old, target_is_directory=True)
    kept = device.kernel_cache_dir() / "cpu"
    assert kept.parent.name == f"{kernel_pch.vector_isa()[0]}-{kernel_pch.header_tag()}"
    assert device.persist_kernels() == str(kept)
    assert link.resolve() == kept.resolve()
    link.unlink()
    link.mkdir()  # MLX's own folder: used as it is
    assert device.persist_kernels() == str(link.resolve())


def test_a_chosen_kernel_cache_replaces_toymlx_link_to_another(tmp_path, monkeypatch):
    """TOYMLX_KERNEL_CACHE=<folder> is used where MLX's kernel folder is already toymlx's link to
    the default cache (and back again once unset); where MLX's folder is its own, one line says
    the kernels are only copied to the chosen folder."""
    import mlx.core as mx

    from toymlx.backend import device

    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("TOYMLX_KERNEL_CACHE", raising=False)
    link = tmp_path / "tmp" / "mlx" / mx.__version__ / "cpu"
    default = device.kernel_cache_dir() / "cpu"
    assert device.persist_kernels() == str(default)
    assert link.resolve() == default.resolve()
    monkeypatch.setenv("TOYMLX_KERNEL_CACHE", str(tmp_path / "mine"))
    chosen = device.kernel_cache_dir() / "cpu"
    assert (tmp_path / "mine") in chosen.parents
    assert device.persist_kernels() == str(chosen)
    assert link.resolve() == chosen.resolve()
    monkeypatch.delenv("TOYMLX_KERNEL_CACHE")
    assert device.persist_kernels() == str(default)
    assert link.resolve() == default.resolve()
    link.unlink()
    link.mkdir()  # MLX's own folder: used as it is, and said so
    (link / "libk.so").write_bytes(b"k")
    monkeypatch.setenv("TOYMLX_KERNEL_CACHE", str(tmp_path / "mine"))
    with pytest.warns(UserWarning) as caught:
        assert device.persist_kernels() == str(link.resolve())
    [message] = [str(w.message) for w in caught]
    assert "\n" not in message and f"TOYMLX_KERNEL_CACHE={tmp_path / 'mine'}" in message
    assert f"remove {link}" in message
    assert (chosen / "libk.so").read_bytes() == b"k"
