"""Shared test fixtures: where the reference data lives, and small helpers."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import toymlx  # noqa: F401  (OpenBLAS before mlx)

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("TOYMLX_SHARED", REPO.parent / "shared")) / "data"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """../shared/data beside the checkout (real files made by others; never copied in)."""
    if not SHARED.is_dir():
        pytest.fail(f"reference data not found at {SHARED}: put shared/ beside the checkout "
                    "or set TOYMLX_SHARED")
    return SHARED


@pytest.fixture(scope="session")
def stories_path(shared_data: Path) -> Path:
    return shared_data / "models" / "stories260K.gguf"


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` need MLX's GPU (Metal or CUDA): skipped, and said so, without one."""
    import mlx.core as mx

    if mx.is_available(mx.gpu):
        return
    skip = pytest.mark.skip(reason="needs MLX's GPU (Metal or CUDA); this MLX has none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
