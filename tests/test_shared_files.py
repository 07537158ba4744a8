"""Reference files not in the checkout: a test that needs one skips where it is missing, naming
the file and how to get it, and runs where $TOYMLX_SHARED (or ../shared) has it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MNIST = "images/t10k-images-idx3-ubyte.gz"


def _pytest(node: str, shared: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "TOYMLX_SHARED": str(shared)}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                           node], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600, check=False)


def test_a_missing_reference_file_skips_naming_it(tmp_path, shared_file):
    node = "tests/test_images.py::test_idx_mnist_t10k"
    r = _pytest(node, tmp_path / "empty")
    assert r.returncode == 0, r.stdout[-2000:]
    want = (f"{tmp_path / 'empty' / 'data' / MNIST}, which is not part of the checkout: put the "
            "project's shared/ folder beside the checkout, or set TOYMLX_SHARED to one (or fetch "
            "it: https://storage.googleapis.com/cvdf-datasets/mnist/t10k-images-idx3-ubyte.gz)")
    skipped = [ln for ln in r.stdout.splitlines() if ln.startswith("SKIPPED")]
    assert len(skipped) == 1 and skipped[0].endswith(f"needs the reference file {want}"), r.stdout
    assert "1 skipped" in r.stdout.splitlines()[-1]

    # the images alone, in a folder named by TOYMLX_SHARED: the test runs (and passes)
    own = tmp_path / "own" / "data" / "images"
    own.mkdir(parents=True)
    for name in (MNIST, "images/t10k-labels-idx1-ubyte.gz"):
        (own / Path(name).name).symlink_to(shared_file(name))
    r = _pytest(node, tmp_path / "own")
    assert r.returncode == 0 and "1 passed" in r.stdout.splitlines()[-1], r.stdout[-2000:]
