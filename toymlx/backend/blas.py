"""The BLAS that MLX's CPU matmuls call on Linux: which library, which kernels, and how MLX is
pointed at it.

Why: MLX's Linux wheel links the netlib reference BLAS (~5 GFLOPS on a float32 matmul, against
~150-380 GFLOPS for OpenBLAS on these 2-core hosts). And an OpenBLAS that does not know the CPU
runs its generic SSE3 kernels in silence: Debian 12's 0.3.21 on an Intel Xeon of family 6
model 207 chose `Prescott` and reached 20-66 GFLOPS where the same machine does 306-315.

Which library, the first found of:
1. `TOYMLX_BLAS=/path/to/libopenblas.so` (or another LP64 BLAS with plain `cblas_sgemm`, such
   as MKL's `libmkl_rt.so`); `TOYMLX_BLAS=reference` keeps MLX's own; `TOYMLX_BLAS=openblas`
   skips MKL (3. and 4. below).
2. On an Intel CPU, MKL from pip (`mkl`, the `toymlx[mkl]` extra, which the installer adds on
   Intel hosts): its single-thread sgemm at ViT-Tiny's and SmolLM2's shapes takes 0.77-0.91x
   OpenBLAS's time, so toymlx's CPU steps take 0.86-0.95x (paired rounds on an Emerald
   Rapids Xeon, docs/RESULTS.md#r-intel-gap). Its threads come from GNU OpenMP, the process's
   one OpenMP runtime (`mkl_threading`), soon asleep when idle (`load_libgomp`), and take the
   caller's floating-point mode at each call (so a flushing step's matmuls flush). Not on AMD
   CPUs: on a Zen 3, MKL's AVX2 branch made ViT-Tiny's step 1.07x and a LoRA step ~1.14x
   OpenBLAS's time (docs/RESULTS.md#r-mkl).
3. OpenBLAS from pip, `scipy-openblas32` (toymlx[cpu] depends on it on Linux): current
   (0.3.34 when written), built for every x86-64 and arm64 core (DYNAMIC_ARCH), with LP64
   integers as MLX calls them and every symbol prefixed `scipy_`, so it clashes with no other
   BLAS in the process (numpy's own is ILP64). No root, no system package.
4. A system OpenBLAS (Debian's `libopenblas0-pthread`, Fedora's, ...), unprefixed.

Which kernels: OpenBLAS picks its kernel set ("core") from cpuid when it loads, and an older
release does not know newer CPUs. Unless `OPENBLAS_CORETYPE` is set already, `load` sets it for
the load (and only for it: child processes see the environment as it was) to the set this
CPU's flags call for: SkylakeX with AVX-512, Haswell (Intel) or Zen (AMD) with AVX2 and FMA,
the sets current OpenBLAS releases choose themselves on those CPUs. The core in use is read back
(`openblas_get_corename`) and recorded in run_start's `backend.blas_core`; if it is still a
generic one on a CPU with AVX2, importing toymlx warns in one line with the measured GFLOPS and
the fix.

Subnormal floats: OpenBLAS's worker threads are started (as the library loads) in flush-to-zero
mode, as XLA and TensorFlow run their own compute threads, so a matmul's share on them never
meets the 100x-slower subnormal arithmetic of Intel cores; the threads of the caller are left
as they are (`toymlx.backend.fpenv` says when a training step flushes its own). OpenBLAS does
not hand the caller's mode to its workers, so a step that keeps subnormals runs each matmul on
its own thread (`toymlx.backend.device.evaluating`).

How MLX is pointed at it: `libmlx.so` calls every BLAS and LAPACK function through its
procedure linkage table, and `toymlx.backend.blas_rebind` writes the chosen library's
addresses (`scipy_cblas_sgemm` for `cblas_sgemm`, ...) into those slots, with
`toymlx.backend.gemv_forward` in front of `cblas_sgemm` for one-row products. That works
whether mlx.core was imported before toymlx or after, and for a prefixed library as for a plain
one.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib.util
import os
import platform
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from toymlx.backend import fpenv
from toymlx.backend.blas_rebind import loaded_library

PIP_PACKAGE = "scipy-openblas32"
PIP_PREFIX = "scipy_"
MKL_PACKAGE = "mkl"
SYSTEM_PATHS = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
    "/usr/local/lib/libopenblas.so.0",
)
FIX = (f"pip install {PIP_PACKAGE} (toymlx[cpu] brings it), or set TOYMLX_BLAS=/path/to/"
       "libopenblas.so.0")

AVX512_CORES = frozenset({"SkylakeX", "Cooperlake", "SapphireRapids"})
"""OpenBLAS kernel sets with AVX-512 sgemm kernels."""
AVX2_CORES = AVX512_CORES | {"Haswell", "Zen"}
"""OpenBLAS kernel sets with AVX2/FMA sgemm kernels (or better)."""


@dataclass
class Library:
    """A BLAS loaded into this process (local symbol scope)."""

    path: str
    prefix: str
    """What its symbols are prefixed with: "" or "scipy_"."""
    source: str
    """How it was found: TOYMLX_BLAS, pip scipy-openblas32 VERSION, system."""
    handle: ctypes.CDLL
    core_from: str | None = None
    """Who chose the kernel set: "cpuid (FLAGS)" where `load` set OPENBLAS_CORETYPE,
    "OPENBLAS_CORETYPE=X" where the user had set it, "OpenBLAS (OPENBLAS_CORETYPE=X unknown to
    it)" where the user's X names no kernel set OpenBLAS has, else None (the library itself)."""
    unknown_core: str | None = None
    """The user's OPENBLAS_CORETYPE where OpenBLAS knows no kernel set of that name (it then
    runs its own cpuid choice, and says so only at OPENBLAS_VERBOSE 1)."""
    threading: str | None = None
    """MKL's threading layer (`mkl_threading`): gnu (with ", GOMP_SPINCOUNT=1000" where toymlx
    loaded libgomp, `load_libgomp`), sequential, or MKL_THREADING_LAYER=X where the user
    chose; None for another BLAS."""

    def function(self, name: str):
        """The library's `name` (its prefix added), or None where it has none."""
        return getattr(self.handle, self.prefix + name, None)

    def address(self, name: str) -> int | None:
        fn = self.function(name)
        return None if fn is None else ctypes.cast(fn, ctypes.c_void_p).value

    def _text(self, name: str) -> str | None:
        fn = self.function(name)
        if fn is None:
            return None
        fn.restype = ctypes.c_char_p
        value = fn()
        return value.decode(errors="replace").strip() if value else None

    @functools.cached_property
    def kind(self) -> str:
        """openblas, mkl, or other (a BLAS whose threads toymlx does not set)."""
        if self.function("openblas_get_num_threads") is not None:
            return "openblas"
        return "mkl" if self.function("MKL_Get_Max_Threads") is not None else "other"

    @property
    def core(self) -> str | None:
        """The kernel set it runs: OpenBLAS's `openblas_get_corename`, MKL's code branch
        (`mkl_cbwr_get_auto_branch`: AVX2, AVX512, AVX512_E1 ...); None for another BLAS."""
        if self.kind == "mkl":
            branch = int(self.function("mkl_cbwr_get_auto_branch")())
            return MKL_BRANCHES.get(branch, f"branch {branch}")
        return self._text("openblas_get_corename")

    @property
    def config(self) -> str | None:
        """Its version line: OpenBLAS's build (`openblas_get_config`: version, DYNAMIC_ARCH...),
        MKL's `mkl_get_version_string`."""
        if self.kind == "mkl":
            text = ctypes.create_string_buffer(256)
            self.function("mkl_get_version_string")(text, len(text))
            return " ".join(text.value.decode(errors="replace").split()) or None
        return self._text("openblas_get_config")

    def threads(self) -> int | None:
        """Threads a call runs on now (OpenBLAS, MKL); None where toymlx does not set them."""
        get = {"openblas": "openblas_get_num_threads",
               "mkl": "MKL_Get_Max_Threads"}.get(self.kind)
        return None if get is None else int(self.function(get)())

    def set_threads(self, n: int) -> None:
        """Run each later call on `n` threads (OpenBLAS, MKL)."""
        name = {"openblas": "openblas_set_num_threads", "mkl": "MKL_Set_Num_Threads"}[self.kind]
        self.function(name)(int(n))


MKL_BRANCHES = {4: "SSE2", 6: "SSSE3", 7: "SSE4_1", 8: "SSE4_2", 9: "AVX", 10: "AVX2",
                11: "AVX512_MIC", 12: "AVX512", 13: "AVX512_MIC_E1", 14: "AVX512_E1"}
"""MKL's code branches (`MKL_CBWR_*` in mkl_cbwr.h), as `mkl_cbwr_get_auto_branch` names them."""


def pip_library() -> Path | None:
    """scipy-openblas32's shared library where that package is installed (found without
    importing it: its import loads the library into the global scope)."""
    spec = importlib.util.find_spec("scipy_openblas32")
    if spec is None or not spec.submodule_search_locations:
        return None
    lib = Path(next(iter(spec.submodule_search_locations))) / "lib" / "libscipy_openblas.so"
    return lib if lib.exists() else None


def _pip_version(package: str = PIP_PACKAGE) -> str:
    try:
        from importlib import metadata
        return metadata.version(package)
    except Exception:  # noqa: BLE001 - a label only
        return "?"


def mkl_library() -> Path | None:
    """MKL's single dynamic library (`libmkl_rt.so.N`) where the `mkl` package is installed
    (found from the package's file list: pip puts it in the environment's lib folder)."""
    from importlib import metadata
    try:
        files = metadata.files(MKL_PACKAGE) or []
    except metadata.PackageNotFoundError:
        return None
    for f in files:
        if f.name.startswith("libmkl_rt.so"):
            path = Path(str(f.locate()))
            if path.exists():
                return path.resolve()
    return None


def candidates() -> list[tuple[str, str, str]]:
    """(path, symbol prefix, source) of the libraries to try, in order."""
    chosen = os.environ.get("TOYMLX_BLAS")
    if chosen and chosen != "openblas":
        path = chosen
        prefix = PIP_PREFIX if os.path.basename(path).startswith("libscipy_openblas") else ""
        return [(path, prefix, "TOYMLX_BLAS")]
    found = []
    intel = cpu_flags()[0] == "GenuineIntel" and chosen != "openblas"
    mkl = mkl_library() if intel else None
    if mkl is not None:
        found.append((str(mkl), "", f"pip {MKL_PACKAGE} {_pip_version(MKL_PACKAGE)}"))
    pip = pip_library()
    if pip is not None:
        found.append((str(pip), PIP_PREFIX, f"pip {PIP_PACKAGE} {_pip_version()}"))
    found += [(p, "", "system") for p in SYSTEM_PATHS if os.path.exists(p)]
    return found


def cpu_flags() -> tuple[str, set[str]]:
    """(vendor, cpuid flags) of this CPU from /proc/cpuinfo (empty where it cannot be read)."""
    vendor, flags = "", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "vendor_id":
                    vendor = value.strip()
                elif key == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass
    return vendor, flags


def core_for_cpu(vendor: str, flags: set[str]) -> tuple[str, str] | None:
    """(OpenBLAS kernel set, why) that current OpenBLAS releases choose for a CPU with these
    cpuid flags; None where this CPU is not x86-64 with AVX2 (leave it to the library)."""
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"} <= flags:
        return "SkylakeX", "avx512f/bw/vl/dq/cd"
    if {"avx2", "fma"} <= flags:
        amd = vendor in ("AuthenticAMD", "HygonGenuine")
        return ("Zen" if amd else "Haswell"), "avx2/fma"
    return None


def load(path: str, prefix: str, source: str) -> Library:
    """Load the library at `path` with its kernel set chosen from cpuid (see the module's
    docstring); raises OSError where it does not load or lacks `cblas_sgemm`."""
    user = os.environ.get("OPENBLAS_CORETYPE")
    core_from = None if user is None else f"OPENBLAS_CORETYPE={user}"
    forced = None
    if user is None and platform.machine() in ("x86_64", "AMD64"):
        forced = core_for_cpu(*cpu_flags())
    if forced is not None:
        core_from = f"cpuid ({forced[1]})"
    # OpenBLAS starts its worker threads as it loads, and they keep the floating-point mode of
    # this thread for life: flushing subnormals (toymlx.backend.fpenv)
    with environ_for_load("OPENBLAS_CORETYPE", forced and forced[0]), fpenv.subnormals("flush"):
        if user is None:
            handle, unknown = ctypes.CDLL(path, mode=ctypes.RTLD_LOCAL), False
        else:
            handle, unknown = _load_told_of_core(path, user)
    lib = Library(path, prefix, source, handle, core_from)
    if unknown:
        lib.core_from = f"OpenBLAS (OPENBLAS_CORETYPE={user} unknown to it)"
        lib.unknown_core = user
    if lib.function("cblas_sgemm") is None:
        raise OSError(f"{path}: no {prefix}cblas_sgemm in it; expected a BLAS")
    if lib.kind == "mkl":
        lib.core_from = None  # MKL chooses its code branch itself
        lib.threading = mkl_threading(lib)
    return lib


MKL_THREADING = {"sequential": 1, "gnu": 3}
"""`MKL_Set_Threading_Layer`'s values (mkl_service.h: MKL_THREADING_SEQUENTIAL, _GNU)."""


def mkl_threading(lib: Library) -> str:
    """Choose MKL's threading layer, before its first call: GNU OpenMP (libgomp) where it
    loads, else sequential; MKL_THREADING_LAYER, if set, is the user's choice and MKL's own.

    Not MKL's default, Intel OpenMP: a second OpenMP runtime in the process beside the
    libgomp that llama.cpp's threads (`--engine llama.cpp`) and g++'s code use, and the two
    pools fought over 2 cores (SmolLM2 decoding through llama.cpp 16 against 87 tokens/s;
    through MLX 18.6 against 34.7 with libgomp). A training step's MKL calls run on one
    thread each and take the layer's speed either way."""
    user = os.environ.get("MKL_THREADING_LAYER")
    if user:
        if user.upper() == "INTEL":
            # Intel OpenMP's idle threads spin for 200 ms after a call by default, while the
            # step's other CPU stream needs the core; read when MKL first starts them
            os.environ.setdefault("KMP_BLOCKTIME", "0")
        return f"MKL_THREADING_LAYER={user}"
    try:
        wait = load_libgomp()
        layer = "gnu"
    except OSError:
        wait, layer = None, "sequential"
    lib.function("MKL_Set_Threading_Layer")(MKL_THREADING[layer])
    return layer if wait is None else f"{layer}, {wait}"


GOMP_WAIT = ("GOMP_SPINCOUNT", "1000")
"""How long GNU OpenMP's idle threads spin before they sleep when toymlx loads it: 1000 checks
(libgomp's default: 300,000)."""


def load_libgomp() -> str | None:
    """Load GNU OpenMP for MKL's threads; OSError where it is absent. It reads its settings from
    the environment as it loads, and here that is with GOMP_SPINCOUNT=1000 (for the load only:
    child processes see the environment as it was), unless the user set GOMP_SPINCOUNT or
    OMP_WAIT_POLICY, or libgomp is loaded already (by llama.cpp or a library imported before
    toymlx). Returns the setting it loaded with (None: not toymlx's).

    Why: libgomp's idle threads spin 300,000 times (milliseconds) after each parallel region
    before they sleep. Generating a token makes ~200 small matmuls, each a parallel region on
    the 2 cores; while another process needs a core, the spinning thread holds it from the
    thread the region waits for. SmolLM2-135M decoding, 64 tokens, with one core busy elsewhere:
    15-16 tokens/s through MLX against 9-10 (0.7-6 beside a test run), 22-26 through
    `--engine llama.cpp` (the same libgomp) against 14-17; on idle cores 22-24 against 23-27
    and 62-71 against 48-59. Not 0 (PASSIVE): llama.cpp's idle cores then took 40-47
    (docs/RESULTS.md#r-omp-wait). A training step's matmuls run on one thread a CPU stream and
    start no parallel region."""
    name, value = GOMP_WAIT
    if (loaded_library("libgomp.so.1") or os.environ.get(name)
            or os.environ.get("OMP_WAIT_POLICY")):
        value = None
    with environ_for_load(name, value):
        ctypes.CDLL("libgomp.so.1")
    return None if value is None else f"{name}={value}"


CORE_NOT_FOUND = "Core not found: "
"""How OpenBLAS (x86-64 and arm64 DYNAMIC_ARCH builds, 0.2 to 0.3.34) says at load, at
OPENBLAS_VERBOSE 1 or more, that no kernel set is named as OPENBLAS_CORETYPE says."""


def _load_told_of_core(path: str, user: str) -> tuple[ctypes.CDLL, bool]:
    """Load `path` under the user's OPENBLAS_CORETYPE `user`, and whether the library said it
    knows no kernel set of that name: at OPENBLAS_VERBOSE 1 for the load (unless the user set
    a level), what it writes to stderr meanwhile read back. It otherwise ignores such a name
    without a word (a typo's SkylakX ran the SkylakeX kernels cpuid chose, the user none the
    wiser). What was written is passed on, less the line this provoked; where stderr cannot be
    read back (no file descriptor 2, no temporary file) the library loads as before, unasked."""
    import sys
    import tempfile

    verbose = None if "OPENBLAS_VERBOSE" in os.environ else "1"
    try:
        saved = os.dup(2)  # first: with no stderr, the temporary file would take its number
    except OSError:
        return ctypes.CDLL(path, mode=ctypes.RTLD_LOCAL), False
    try:
        captured = tempfile.TemporaryFile()  # noqa: SIM115 (closed by the `with` below)
    except OSError:
        os.close(saved)
        return ctypes.CDLL(path, mode=ctypes.RTLD_LOCAL), False
    with captured:
        sys.stderr.flush()
        os.dup2(captured.fileno(), 2)
        try:
            with environ_for_load("OPENBLAS_VERBOSE", verbose):
                handle = ctypes.CDLL(path, mode=ctypes.RTLD_LOCAL)
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        captured.seek(0)
        lines = captured.read().splitlines(keepends=True)
    not_found = (CORE_NOT_FOUND + user).encode(errors="replace")
    unknown = any(line.rstrip(b"\r\n") == not_found for line in lines)
    kept = [line for line in lines
            if verbose is None or line.rstrip(b"\r\n") != not_found]  # ours to say instead
    if kept:
        os.write(2, b"".join(kept))
    return handle, unknown


@contextlib.contextmanager
def environ_for_load(name: str, value: str | None) -> Iterator[None]:
    """`name`=`value` in the environment while a library loads and reads it (nothing where
    `value` is None): child processes started later see the environment as it was."""
    if value is None:
        yield
        return
    os.environ[name] = value
    try:
        yield
    finally:
        del os.environ[name]


def generic_core(lib: Library) -> str | None:
    """The reason `lib` runs slower kernels than this CPU has (None: it does not, or it is not
    OpenBLAS): a kernel set without AVX2 on a CPU with AVX2, or without AVX-512 on one with it."""
    core, want = lib.core, core_for_cpu(*cpu_flags())
    if core is None or want is None or lib.kind != "openblas":
        return None
    best = AVX512_CORES if want[0] == "SkylakeX" else AVX2_CORES
    if core in best:
        return None
    return f"OpenBLAS runs its {core} kernels on a CPU with {want[1]} (best: {want[0]})"


def sgemm_gflops(lib: Library, n: int = 512, repeats: int = 3) -> float:
    """The library's float32 matmul speed, n x n x n, best of `repeats` (GFLOPS)."""
    import numpy as np  # here: this module loads before mlx.core, numpy is not needed before

    a = np.ones((n, n), np.float32)
    c = np.empty((n, n), np.float32)
    sgemm = lib.function("cblas_sgemm")
    p = ctypes.POINTER(ctypes.c_float)
    args = (101, 111, 111, n, n, n, ctypes.c_float(1.0), a.ctypes.data_as(p), n,
            a.ctypes.data_as(p), n, ctypes.c_float(0.0), c.ctypes.data_as(p), n)
    sgemm(*args)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        sgemm(*args)
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best / 1e9


def mlx_targets(lib: Library, sgemm: int | None) -> Callable[[str], int | None]:
    """What `blas_rebind.rebind` writes into libmlx.so's slots: for each BLAS or LAPACK
    symbol, `lib`'s function of that name (`sgemm`, the one-row forwarder, for cblas_sgemm)."""
    def target(name: str) -> int | None:
        if not (name.startswith("cblas_") or (name.endswith("_") and name[0] != "_")):
            return None  # libc, libstdc++: not the BLAS's business
        if name == "cblas_sgemm" and sgemm:
            return sgemm
        return lib.address(name)
    return target
