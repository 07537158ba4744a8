"""Shared test fixtures: where the reference data lives, and small helpers."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

# The host's own OPENBLAS_CORETYPE (a cloud image may set one: Haswell on an AVX-512 AMD EPYC,
# where SkylakeX's sgemm runs ~2x faster) would choose the kernels of every test process and
# warn on each one's stderr: the tests run with the kernels toymlx chooses from cpuid, and
# test_blas sets the variable itself where it tests a user's own choice.
os.environ.pop("OPENBLAS_CORETYPE", None)

import toymlx  # OpenBLAS before mlx; after the line above

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("TOYMLX_SHARED", REPO.parent / "shared")) / "data"
"""The reference files (real files made by others, not part of the checkout): `../shared/data`
beside the checkout, or `$TOYMLX_SHARED/data`. Every test reaches them through `shared_file`."""

SHARED_HOW = "put the project's shared/ folder beside the checkout, or set TOYMLX_SHARED to one"
ORIGINS = {
    "models/stories260K.gguf": "https://huggingface.co/ggml-org/models/resolve/main/tinyllamas/"
                               "stories260K.gguf",
    "text/tinyshakespeare.txt": "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/"
                                "tinyshakespeare/input.txt",
    "images/t10k-images-idx3-ubyte.gz": "https://storage.googleapis.com/cvdf-datasets/mnist/"
                                        "t10k-images-idx3-ubyte.gz",
    "images/t10k-labels-idx1-ubyte.gz": "https://storage.googleapis.com/cvdf-datasets/mnist/"
                                        "t10k-labels-idx1-ubyte.gz",
}
"""Where a reference file comes from, where it can be fetched on its own (the others are made
for the project: shared/data/README.md says from what)."""
for _vocab in ("gpt-2", "llama-spm"):
    for _ext in ("", ".inp", ".out"):
        ORIGINS[f"tokenizers/ggml-vocab-{_vocab}.gguf{_ext}"] = (
            "https://github.com/ggml-org/llama.cpp/raw/master/models/"
            f"ggml-vocab-{_vocab}.gguf{_ext}, as of the llama.cpp the tests were written with")


def shared_path(name: str) -> Path:
    """The reference file `name` (relative to the shared data folder); where it is missing, the
    test asking for it skips, naming the file and how to get it."""
    path = SHARED / name
    if not path.exists():
        origin = f" (or fetch it: {ORIGINS[name]})" if name in ORIGINS else ""
        pytest.skip(f"needs the reference file {path}, which is not part of the checkout: "
                    f"{SHARED_HOW}{origin}")
    return path


@pytest.fixture(scope="session")
def shared_file():
    """`shared_path`: `shared_file("text/tinyshakespeare.txt")` is that file's path, or a skip
    naming it."""
    return shared_path


@pytest.fixture(scope="session")
def stories_path(shared_file) -> Path:
    return shared_file("models/stories260K.gguf")


def pytest_sessionstart(session):
    """Compile toymlx's sources to bytecode once, before the tests start their ~500 commands and
    child processes: where the environment sets PYTHONDONTWRITEBYTECODE (this project's CI
    machine does), each of them compiled every module it imported again, ~0.15 s of a 0.5 s
    start; measured on the subprocess-heavy test files, 10-20% of their time. Python checks
    each file's bytecode against its source, so an edited file is compiled again; where the
    package's folder is not writable (a system install) nothing is written and nothing fails."""
    import compileall

    import toymlx_cli

    for package in (toymlx, toymlx_cli):
        compileall.compile_dir(Path(package.__file__).parent, quiet=2)


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` need MLX's GPU (Metal or CUDA): skipped, and said so, without one."""
    import mlx.core as mx

    if mx.is_available(mx.gpu):
        return
    skip = pytest.mark.skip(reason="needs MLX's GPU (Metal or CUDA); this MLX has none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def on_cpu():
    """MLX's default device is the CPU within the test (the vectorised forms and the CPU's
    floating-point modes are what is tested)."""
    import mlx.core as mx

    old = mx.default_device()
    mx.set_default_device(mx.cpu)
    yield
    mx.set_default_device(old)


@pytest.fixture
def big_files() -> Iterator[list[Path]]:
    """Paths a test adds its large files to (a SmolLM2 F32 export is 513 MiB), removed when it
    ends, passed or failed: pytest keeps the `tmp_path` folders of the last 3 sessions, so the
    slow tiers' exports stayed on disk (GBs) after every run."""
    made: list[Path] = []
    yield made
    for p in made:
        p.unlink(missing_ok=True)


def home_elsewhere(monkeypatch: pytest.MonkeyPatch, home: Path) -> None:
    """HOME set to `home` for a test and the commands it starts (no W&B login, no netrc), with
    toymlx's kernel cache this machine's: `home`'s `.cache/toymlx/mlx-kernels` is a link to it.
    A command under a HOME of its own would otherwise keep MLX's kernels in `home`, which a
    later pytest session deletes: where MLX's kernel folder (`$TMPDIR/mlx/<version>/cpu`,
    `toymlx.backend.device.persist_kernels`) did not exist yet, the command made it a link into
    `home`, and once `home` was gone every process compiling a kernel failed ("cannot create
    directories: File exists") until another made the link again."""
    from toymlx.backend import device

    cache = home / ".cache" / "toymlx" / "mlx-kernels"
    if not cache.is_symlink():
        root = device._kernel_cache_root()
        root.mkdir(parents=True, exist_ok=True)
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.symlink_to(root, target_is_directory=True)
    monkeypatch.setenv("HOME", str(home))


def end_child(p: subprocess.Popen) -> None:
    """A test's `finally` for a child it started (a long training run, a lock holder): kill it
    if it is still running, then reap it, reading what its open pipes still hold, and close
    them, so no child outlives a test that failed before it ended and no pipe is left to the
    garbage collector (a ResourceWarning "unclosed file" in whichever later test collected it:
    test_api's check of its own pipes failed after test_sweep)."""
    if p.poll() is None:
        p.kill()
        for pipe in (p.stdout, p.stderr):
            if pipe is not None and not pipe.closed:
                pipe.read()
        p.wait()
    for pipe in (p.stdin, p.stdout, p.stderr):
        if pipe is not None:
            pipe.close()
