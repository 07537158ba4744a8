"""Device selection and the CPU BLAS fix-up.

On Linux the `mlx[cpu]` wheel links the netlib reference BLAS (~5 GFLOPS). Loading an
optimised BLAS with global symbol visibility *before* `mlx.core` is imported makes MLX's
matmuls use it instead (~33x faster). `toymlx/__init__.py` calls `preload_blas()` first
thing, so importing anything from toymlx is enough.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import platform
import sys
import warnings

_BLAS_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
    "/usr/local/lib/libopenblas.so.0",
)
_BLAS_FIX = (
    "toymlx: no optimised BLAS found, MLX's CPU matmuls will use the reference BLAS "
    "(about 30x slower). Fix: `sudo apt-get install libopenblas0-pthread` "
    "(Debian/Ubuntu) or set TOYMLX_BLAS=/path/to/libopenblas.so.0"
)

_blas: dict = {"name": "unknown", "path": None}
_loaded: dict = {}  # the CDLL handle, to ask OpenBLAS its thread count
_warned = False
_malloc_mode = "default"  # what tune_malloc() set: "glibc-retain" or "default"


def preload_blas() -> dict:
    """Load OpenBLAS globally before mlx.core is imported (Linux only); return what was used."""
    global _warned
    if _blas["path"] is not None or _blas["name"] != "unknown":
        return dict(_blas)
    if sys.platform == "darwin":
        _blas.update(name="accelerate")
        return dict(_blas)
    if sys.platform != "linux" or os.environ.get("TOYMLX_BLAS") == "reference":
        _blas.update(name="reference")
        return dict(_blas)
    if "mlx.core" in sys.modules:
        # Too late to change which BLAS MLX binds to; report honestly.
        _blas.update(name="reference (mlx imported before toymlx)")
        return dict(_blas)
    candidates = [os.environ["TOYMLX_BLAS"]] if os.environ.get("TOYMLX_BLAS") else []
    candidates += list(_BLAS_CANDIDATES)
    local = _ranks_on_this_host()
    if local > 1 and "OPENBLAS_NUM_THREADS" not in os.environ:
        # data-parallel ranks on one host would each start a BLAS thread per core; OpenBLAS
        # reads this once, when it is loaded just below
        os.environ["OPENBLAS_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // local))
    for path in candidates:
        if os.path.exists(path):
            try:
                _loaded["lib"] = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            except OSError:
                continue
            _blas.update(name="openblas", path=path)
            return dict(_blas)
    _blas.update(name="reference")
    if not _warned:
        warnings.warn(_BLAS_FIX, stacklevel=2)
        _warned = True
    return dict(_blas)


_MALLOC_LIMITS = {"mmap_threshold": 1 << 30, "trim_threshold": 1 << 31}
"""glibc malloc settings while toymlx runs: blocks up to 1 GiB come from the heap, and up to
2 GiB of freed heap stays with the process."""


def tune_malloc() -> str:
    """Keep freed buffers inside the process (glibc only; `TOYMLX_MALLOC=default` skips it).

    MLX's CPU allocator hands every buffer straight to malloc and back. glibc serves large
    blocks with fresh mmap pages and trims freed heap, so each training step page-faults its
    activations in again: ~48,000 faults a step on ViT-Tiny 28x28 (a 10th of the step in the
    kernel). With these two thresholds raised the same buffers are reused (~400 faults a step)
    and the step is 10-15% faster; the cost is that the process keeps its peak heap."""
    global _malloc_mode
    if sys.platform != "linux" or os.environ.get("TOYMLX_MALLOC") == "default":
        return _malloc_mode
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return _malloc_mode  # not glibc (musl has no mallopt)
    m_trim_threshold, m_mmap_threshold = -1, -3
    ok = mallopt(m_mmap_threshold, _MALLOC_LIMITS["mmap_threshold"])
    ok &= mallopt(m_trim_threshold, _MALLOC_LIMITS["trim_threshold"])
    _malloc_mode = "glibc-retain" if ok else "default"
    return _malloc_mode


def blas_threads() -> int | None:
    """OpenBLAS's thread count now, or None where toymlx does not control the BLAS (macOS's
    Accelerate, the reference BLAS)."""
    get = getattr(_loaded.get("lib"), "openblas_get_num_threads", None)
    return int(get()) if get is not None else None


@contextlib.contextmanager
def use_blas_threads(n: int | None):
    """Within: OpenBLAS runs each call on `n` threads (no-op for None or where toymlx does not
    control the BLAS). MLX reads it when a matmul runs, so wrap the evaluation, not the trace."""
    lib = _loaded.get("lib")
    before = blas_threads()
    if n is None or before is None or n == before:
        yield
        return
    lib.openblas_set_num_threads(int(n))
    try:
        yield
    finally:
        lib.openblas_set_num_threads(before)


def _ranks_on_this_host() -> int:
    """Data-parallel ranks the launcher started on this host (mlx.launch ring hostfile or
    Open MPI), read from the environment before mlx is imported; 1 when not launched."""
    env = os.environ
    if env.get("OMPI_COMM_WORLD_LOCAL_SIZE", "").isdigit():
        return int(env["OMPI_COMM_WORLD_LOCAL_SIZE"])
    path, rank = env.get("MLX_HOSTFILE"), env.get("MLX_RANK", "")
    if not path or not rank.isdigit():
        return 1
    try:
        import json

        with open(path) as f:
            hosts = json.load(f)  # ring: one list of "ip:port" per rank
        mine = hosts[int(rank)][0].rsplit(":", 1)[0]
        return sum(1 for h in hosts if h and h[0].rsplit(":", 1)[0] == mine)
    except (OSError, ValueError, IndexError, TypeError, AttributeError):
        return 1


def select_device(name: str = "auto"):
    """Make `name` (auto|gpu|cpu) MLX's default device and return it."""
    import mlx.core as mx

    if name not in ("auto", "gpu", "cpu"):
        raise ValueError(f"--device: expected one of auto, gpu, cpu; found {name!r}")
    has_gpu = mx.is_available(mx.gpu)
    if name == "gpu" and not has_gpu:
        raise ValueError("--device gpu: MLX has no GPU backend on this machine; use --device cpu")
    dev = mx.gpu if (name == "gpu" or (name == "auto" and has_gpu)) else mx.cpu
    mx.set_default_device(dev)
    return dev


def backend_info() -> dict:
    """What actually runs the math: for run_start events and benchmarks."""
    import mlx.core as mx

    dev = mx.default_device()
    from toymlx import fastmath

    info: dict = {"device": "gpu" if dev == mx.gpu else "cpu", "mlx": mx.__version__,
                  "elementwise_math": fastmath.describe()}
    if dev == mx.gpu:
        info["kind"] = "metal" if sys.platform == "darwin" else "cuda"
        try:
            info["name"] = mx.device_info().get("device_name")
        except Exception:  # noqa: BLE001, S110 -- device_info is backend-specific, optional
            pass
    else:
        info["kind"] = "cpu"
        info["blas"] = _blas["name"]
        if _blas["path"]:
            info["blas_path"] = _blas["path"]
        get_threads = getattr(_loaded.get("lib"), "openblas_get_num_threads", None)
        if get_threads is not None:
            info["blas_threads"] = int(get_threads())
        info["malloc"] = _malloc_mode
        info["cpu"] = platform.processor() or platform.machine()
        info["cores"] = os.cpu_count()
    return info
