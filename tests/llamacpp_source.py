"""llama.cpp's own source tree, as the `llama-cpp-python` source distribution on PyPI carries it.

Its `vendor/llama.cpp/` holds what the interop tests need from llama.cpp besides the library:
`convert_hf_to_gguf.py` (the converter people's GGUFs come from), `gguf-py/`, and
`models/ggml-vocab-*.gguf` with their `.inp`/`.out` tokenizer vectors. The version fetched is
the installed `llama-cpp-python`'s (so the converter matches the llama.cpp that runs the
files), else 0.3.36. It is fetched once with `pip download --no-deps --no-binary :all:` into
the cache folder ($TOYMLX_CACHE or ~/.cache/toymlx) and unpacked there; test modules import
the fixture: `from llamacpp_source import llamacpp_source  # noqa: F401`.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import tarfile
from pathlib import Path

import pytest
from pip_cache import cache_dir, pip_download

DEFAULT_VERSION = "0.3.36"


def source_version() -> str:
    """The installed llama-cpp-python's version (its llama.cpp runs the files), else the default."""
    try:
        return importlib.metadata.version("llama_cpp_python")
    except importlib.metadata.PackageNotFoundError:
        return DEFAULT_VERSION


def fetch_source(version: str | None = None, cache: Path | None = None) -> Path:
    """`vendor/llama.cpp` of llama-cpp-python `version`, downloaded and unpacked once."""
    version = version or source_version()
    cache = cache or cache_dir()
    root = cache / f"llama_cpp_python-{version}"
    tree = root / "vendor" / "llama.cpp"
    if (tree / "convert_hf_to_gguf.py").is_file():
        return tree
    sdist = pip_download(f"llama-cpp-python=={version}", cache / "sdists",
                         cache / "sdists" / f"llama_cpp_python-{version}.tar.gz", source=True)
    tmp = cache / f".llama_cpp_python-{version}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with tarfile.open(sdist) as t:
        extract_inside(t, tmp)
    unpacked = tmp / f"llama_cpp_python-{version}"
    try:
        os.replace(unpacked, root)  # concurrent test processes never see a half-unpacked tree
    except OSError:
        if not (tree / "convert_hf_to_gguf.py").is_file():
            raise
    shutil.rmtree(tmp, ignore_errors=True)
    return tree


def check_member(tar: tarfile.TarFile, m: tarfile.TarInfo, target: Path) -> None:
    """TarError naming the archive and the member unless `m` lands inside `target`, as tarfile's
    `filter="data"` (Python 3.11.4+; Debian 12 ships 3.11.2) would have it: no absolute or `..`
    path out of `target`, no link to a path outside it, only files, folders and links (no
    devices or fifos). Paths are resolved through what is on disk already, so a link unpacked
    before cannot lead a later member out. It clears set-id and other-writable mode bits."""
    root = os.path.realpath(target)

    def inside(path: str) -> bool:
        return os.path.commonpath([root, os.path.realpath(path)]) == root

    where = os.path.join(root, m.name)
    why = None
    if os.path.isabs(m.name) or not inside(where):
        why = "its path leaves the folder"
    elif m.issym() and (os.path.isabs(m.linkname)
                        or not inside(os.path.join(os.path.dirname(where), m.linkname))):
        why = f"a symbolic link to {m.linkname!r}, outside the folder"
    elif m.islnk() and not inside(os.path.join(root, m.linkname)):
        why = f"a hard link to {m.linkname!r}, outside the folder"
    elif not (m.isfile() or m.isdir() or m.issym() or m.islnk()):
        why = "not a file, folder or link"
    if why:
        raise tarfile.TarError(f"{tar.name}: member {m.name!r}: expected a path inside "
                               f"{target}, found {why}; unpacking stopped")
    m.mode &= 0o755


def extract_inside(tar: tarfile.TarFile, target: Path) -> None:
    """Unpack `tar` into `target`, one member at a time, each checked by `check_member` first
    (and, on Pythons that have it, by tarfile's data filter too)."""
    data = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
    for m in tar.getmembers():
        check_member(tar, m, target)
        tar.extract(m, target, **data)


@pytest.fixture(scope="session")
def llamacpp_source() -> Path:
    """Path of llama.cpp's source tree (`vendor/llama.cpp` of the llama-cpp-python sdist)."""
    try:
        return fetch_source()
    except (RuntimeError, OSError, tarfile.TarError) as e:
        pytest.fail(f"llama.cpp source (llama-cpp-python sdist) unavailable: {e}")
