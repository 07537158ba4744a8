"""toymlx's small C shims (Linux): each compiled once per machine with the system C compiler
(MLX's CPU backend needs one for its own kernels) into `~/.cache/toymlx/native`, named after
its source, so an edit rebuilds it. `toymlx.backend.gemv_forward` and
`toymlx.backend.aligned_buffers` build theirs here."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path


def cache_dir() -> Path:
    """`$XDG_CACHE_HOME/toymlx/native` (default `~/.cache/toymlx/native`)."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "toymlx" / "native"


def _compiler() -> str | None:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return cc
    return None


def build(source: Path) -> Path:
    """The shared library compiled from `source` (a C file), built on first use; raises
    OSError with the reason where it cannot be built."""
    code = source.read_bytes()
    lib = cache_dir() / f"libtoymlx_{source.stem}-{hashlib.sha256(code).hexdigest()[:12]}.so"
    if lib.exists():
        return lib
    cc = _compiler()
    if cc is None:
        raise OSError("no C compiler (cc, gcc or clang) on PATH")
    lib.parent.mkdir(parents=True, exist_ok=True)
    tmp = lib.with_name(f".{lib.name}.{os.getpid()}")  # concurrent builders each rename theirs
    try:
        done = subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(tmp), str(source),
                               "-ldl"], check=False, capture_output=True, text=True,
                              timeout=120)
        if done.returncode != 0:
            raise OSError(f"{cc} failed: {' '.join(done.stderr.split())[:300]}")
        os.replace(tmp, lib)
    finally:
        tmp.unlink(missing_ok=True)
    return lib
