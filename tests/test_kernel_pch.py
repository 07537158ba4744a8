"""toymlx.backend.kernel_pch: MLX's own kernel builds read the precompiled preamble (g++ -H marks a
PCH it uses with "!"), the compiled function's values are unchanged, and the header is built once
per compiler and MLX."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import warnings
from collections.abc import Iterator
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
    the default cache and no other process builds through it (while one does, the link stays,
    said in one line); once unset, the link to the chosen folder, of this build's kernels, is
    used as it is; where MLX's folder is its own, one line says the kernels are only copied to
    the chosen folder."""
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
    with _built_through(link), pytest.warns(UserWarning) as caught:
        assert device.persist_kernels() == str(default)
    [message] = [str(w.message) for w in caught]
    assert message == (
        f"TOYMLX_KERNEL_CACHE={tmp_path / 'mine'}: MLX builds its CPU kernels in {link}, a link "
        f"to {default} that another running toymlx process builds through, so they are not "
        f"kept in {chosen}; give this process a TMPDIR of its own to keep them there")
    assert link.resolve() == default.resolve()
    assert device.persist_kernels() == str(chosen)  # that process has ended
    assert link.resolve() == chosen.resolve()
    monkeypatch.delenv("TOYMLX_KERNEL_CACHE")
    assert device.persist_kernels() == str(chosen)
    assert link.resolve() == chosen.resolve()
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


@contextlib.contextmanager
def _built_through(mlx_dir: Path) -> Iterator[None]:
    """What another running toymlx process that builds MLX's kernels through `mlx_dir` holds: a
    shared flock on the users' file beside it, through an open file of its own."""
    from toymlx.backend import device

    fd = os.open(mlx_dir.with_name(device.KERNEL_FOLDER_USERS), os.O_RDONLY | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)


def _in_cache(home: Path, leaf: str) -> Path:
    """A kernel folder of `home`'s toymlx cache, `<mlx version>/<leaf>/cpu`, made."""
    import mlx.core as mx

    folder = home / ".cache" / "toymlx" / "mlx-kernels" / mx.__version__ / leaf / "cpu"
    folder.mkdir(parents=True)
    return folder


def _mlx_kernel_link(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """MLX's kernel folder under `tmp_path/tmp` (not made), for a process whose HOME is
    `tmp_path/home-b`."""
    import mlx.core as mx

    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home-b" / ".cache"))
    monkeypatch.delenv("TOYMLX_KERNEL_CACHE", raising=False)
    link = tmp_path / "tmp" / "mlx" / mx.__version__ / "cpu"
    link.parent.mkdir(parents=True)
    return link


def test_a_link_into_another_homes_cache_of_this_builds_kernels_is_kept(tmp_path, monkeypatch):
    """MLX's kernel folder, toymlx's link into another HOME's cache, to this build's kernels (the
    same MLX, vector set and header: the same code), is used as it is, whether or not a process
    builds through it: pointed at this HOME's folder, it would be pulled from under a process of
    that HOME, between writing a kernel's source and g++ reading it."""
    from toymlx.backend import device

    link = _mlx_kernel_link(tmp_path, monkeypatch)
    theirs = _in_cache(tmp_path / "home-a", device.kernel_cache_dir().name)
    link.symlink_to(theirs, target_is_directory=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # and nothing said
        assert device.persist_kernels() == str(theirs)
        with _built_through(link):
            assert device.persist_kernels() == str(theirs)
    assert os.readlink(link) == str(theirs)
    assert not (tmp_path / "home-b" / ".cache" / "toymlx" / "mlx-kernels").exists()  # nor copied


def test_a_dangling_link_is_made_again_even_while_a_process_uses_it(tmp_path, monkeypatch):
    """MLX's kernel folder, a link to a folder since deleted (a test's HOME): MLX fails every
    build through it, a running process's too (it does not make the folder again), so it is
    made again to this build's folder whoever builds through it."""
    from toymlx.backend import device

    link = _mlx_kernel_link(tmp_path, monkeypatch)
    gone = _in_cache(tmp_path / "home-a", device.kernel_cache_dir().name)
    link.symlink_to(gone, target_is_directory=True)
    shutil.rmtree(tmp_path / "home-a")
    kept = device.kernel_cache_dir() / "cpu"
    with _built_through(link):
        assert device.persist_kernels() == str(kept)
    assert Path(os.readlink(link)) == kept.resolve()


def test_a_link_to_another_builds_kernels_is_made_again_unless_a_process_uses_it(tmp_path,
                                                                                monkeypatch):
    """MLX's kernel folder, toymlx's link to another build's kernels (another header's tag: a
    kernel built with another header must never be found by this build): made again to this
    build's folder where no other process builds through it; while one does, it stays, and one
    line says where this process builds its kernels and how to have its own folder."""
    from toymlx.backend import device

    link = _mlx_kernel_link(tmp_path, monkeypatch)
    theirs = _in_cache(tmp_path / "home-a", f"{kernel_pch.vector_isa()[0]}-0123456789")
    link.symlink_to(theirs, target_is_directory=True)
    kept = device.kernel_cache_dir() / "cpu"
    with _built_through(link), pytest.warns(UserWarning) as caught:
        assert device.persist_kernels() == str(theirs)
    [message] = [str(w.message) for w in caught]
    assert message == (
        f"MLX builds its CPU kernels in {link}, a link to {theirs}: another toymlx build's "
        f"kernels (another vector set or header), which a running process builds through, so "
        f"this process builds its kernels there, without its own precompiled header, loops and "
        f"exp and erf forms; give it a TMPDIR of its own to use its kernel folder, {kept}")
    assert os.readlink(link) == str(theirs)
    assert device.persist_kernels() == str(kept)  # that process has ended
    assert Path(os.readlink(link)) == kept.resolve()


def test_the_link_leads_to_the_caches_real_folder(tmp_path, monkeypatch):
    """A HOME whose kernel cache is a link to this machine's (a test's, `home_elsewhere`): MLX's
    kernel folder is made a link to the machine's folder itself, so it still leads somewhere
    once that HOME is deleted."""
    from conftest import home_elsewhere

    from toymlx.backend import device

    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    monkeypatch.setenv("HOME", str(tmp_path / "machine"))
    for var in ("XDG_CACHE_HOME", "TOYMLX_KERNEL_CACHE"):
        monkeypatch.delenv(var, raising=False)
    home_elsewhere(monkeypatch, tmp_path / "test-home")
    kept = device.kernel_cache_dir() / "cpu"
    assert (tmp_path / "test-home") in kept.parents
    assert device.persist_kernels() == str(kept)
    link = tmp_path / "tmp" / "mlx" / kept.parent.parent.name / "cpu"
    machine = tmp_path / "machine" / ".cache" / "toymlx" / "mlx-kernels"
    assert Path(os.readlink(link)) == (machine / kept.parent.parent.name / kept.parent.name
                                       / "cpu").resolve()
    shutil.rmtree(tmp_path / "test-home")
    assert link.is_dir()


_BUILDER = r"""
import json, sys
import toymlx  # noqa: F401  (the BLAS first)
from toymlx.backend import device, kernel_pch
kernel_pch.header_tag = lambda: sys.argv[1]  # another build's header
import mlx.core as mx
mx.set_default_device(mx.cpu)
print(json.dumps({"folder": device.persist_kernels()}), flush=True)
for line in iter(sys.stdin.readline, ""):  # a constant: a kernel of its own, built now
    k = float(line)
    try:
        print(json.dumps({"values": mx.compile(lambda x: x * k + 0.5)(mx.arange(3.0)).tolist()}),
              flush=True)
    except RuntimeError as e:
        print(json.dumps({"error": str(e)}), flush=True)
"""

_STARTS = """
import json
from toymlx.backend import device
device.setup_process()
print(json.dumps(device.backend_info()))
"""


def test_a_process_building_through_the_link_keeps_it_from_another_build(tmp_path, monkeypatch):
    """Two real processes with one TMPDIR, two HOMEs and two builds (two header tags). A links
    MLX's kernel folder to its own and builds a kernel; B starts while A runs: the link stays
    A's (it was pointed at B's folder: A's next kernel, built with A's header, landed in B's
    folder, or was lost where the link turned between MLX writing its source and g++ reading
    it), B says so in one line, records why it builds no precompiled header and puts none in
    A's folder; A's next kernel is built in its own folder. A's HOME deleted, A's next build
    fails (MLX does not make a dangling link's folder again), until B, starting again, makes
    the link to its own folder although A runs; A then builds again."""
    from conftest import end_child

    from toymlx.backend import device

    link = _mlx_kernel_link(tmp_path, monkeypatch)
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "home-a" / ".cache")}
    a = subprocess.Popen([sys.executable, "-c", _BUILDER, "a0a0a0a0a0"], env=env, text=True,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def a_builds(k: float) -> dict:
        a.stdin.write(f"{k}\n")
        a.stdin.flush()
        return json.loads(a.stdout.readline())

    try:
        theirs = Path(json.loads(a.stdout.readline())["folder"])
        assert theirs.parent.name == f"{kernel_pch.vector_isa()[0]}-a0a0a0a0a0"
        assert Path(os.readlink(link)) == theirs.resolve()
        assert a_builds(1.5) == {"values": [0.5, 2.0, 3.5]}
        b = subprocess.run([sys.executable, "-c", _STARTS], env=os.environ, capture_output=True,
                           text=True, timeout=300, check=False)  # HOME B's cache, the real tag
        assert b.returncode == 0, b.stderr[-2000:]
        info = json.loads(b.stdout.strip().splitlines()[-1])
        assert info["kernel_cache"] == str(theirs.resolve())
        assert info["kernel_pch"] == ("off (MLX's kernel folder holds another toymlx build's "
                                      "kernels, in use)")
        assert info["kernel_forms"].startswith("off (no precompiled header: off (MLX's kernel")
        assert (f"toymlx: warning: MLX builds its CPU kernels in {link}, a link to "
                f"{theirs.resolve()}: another toymlx build's kernels") in b.stderr
        assert Path(os.readlink(link)) == theirs.resolve()
        assert a_builds(2.5) == {"values": [0.5, 3.0, 5.5]}
        assert len(list(theirs.glob("lib*.so"))) == 2 and not list(theirs.rglob("*.gch"))
        assert not (tmp_path / "home-b" / ".cache" / "toymlx" / "mlx-kernels").exists()
        shutil.rmtree(tmp_path / "home-a")
        failed = a_builds(3.5)
        assert "cannot create directories: File exists" in failed["error"], failed
        kept = device.kernel_cache_dir() / "cpu"  # B again, in this process
        assert device.persist_kernels() == str(kept)
        assert Path(os.readlink(link)) == kept.resolve()
        assert a_builds(4.5) == {"values": [0.5, 5.0, 9.5]}
        a.stdin.close()
        assert a.wait(timeout=60) == 0
    finally:
        end_child(a)


def test_a_kernel_cache_that_is_no_folder_is_named(tmp_path, monkeypatch):
    """TOYMLX_KERNEL_CACHE naming a file (or a place it cannot write) was passed over with no
    word: MLX built its kernels in its own folder, not where they were asked to be kept."""
    import mlx.core as mx

    from toymlx.backend import device

    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "notes.txt").write_text("mine")
    monkeypatch.setenv("TOYMLX_KERNEL_CACHE", str(tmp_path / "notes.txt"))
    kept = device.kernel_cache_dir() / "cpu"
    mlx_dir = tmp_path / "tmp" / "mlx" / mx.__version__ / "cpu"
    with pytest.warns(UserWarning) as caught:
        assert device.persist_kernels() is None  # MLX makes its own folder
    assert [str(w.message) for w in caught] == [(
        f"TOYMLX_KERNEL_CACHE={tmp_path / 'notes.txt'}: expected a folder toymlx can keep MLX's "
        f"kernels in, found Not a directory at {kept}; MLX builds them in its own folder "
        f"{mlx_dir}, not kept")]
    assert (tmp_path / "notes.txt").read_text() == "mine"
    # the next start, MLX's own folder made by the first: the same line (it said the kernels
    # "are only copied to" a folder under the file, which cannot be made)
    mlx_dir.mkdir(parents=True)
    (mlx_dir / "libk.so").write_bytes(b"k")
    with pytest.warns(UserWarning) as again:
        assert device.persist_kernels() == str(mlx_dir)
    assert [str(w.message) for w in again] == [str(w.message) for w in caught]
    assert (tmp_path / "notes.txt").read_text() == "mine"
