"""The process toymlx runs in: the CPU BLAS, process set-up, device choice, what runs the math.

Two steps, in this order:
1. `bind_blas()`, at import (`toymlx/__init__.py`): on Linux the `mlx[cpu]` wheel links the
   netlib reference BLAS (~5 GFLOPS); this loads an optimised one (`toymlx.backend.blas`
   chooses which, and its kernels) and points libmlx.so's BLAS and LAPACK calls at it
   (`toymlx.backend.blas_rebind`), with `toymlx.backend.gemv_forward` in front of it for
   one-row products (a decoded token's). It works the same whether mlx.core was imported
   before toymlx (an mlx-lm user's script) or after; where it cannot be done, importing toymlx
   warns in one line.
2. `setup_process()`, a named call each command-line entry point makes first thing, and
   `toymlx.training.trainer.train` makes again (a no-op the second time): MLX's graph-evaluation width
   (read by MLX's first evaluation), glibc malloc's thresholds, the folder that keeps MLX's
   compiled CPU kernels across reboots (`persist_kernels`) and the precompiled header that
   makes each new kernel build ~5x faster (`toymlx.backend.kernel_pch`). `backend_info()` records what is
   in effect in run_start.

A process that evaluated anything before `setup_process` is too late for the evaluation width,
which is why `toymlx.train` (the Python entry point, `toymlx.runner.api`) trains in a fresh
child process.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import platform
import re
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from toymlx.backend import (
    aligned_buffers,
    atomic,
    blas,
    blas_rebind,
    fpenv,
    gemv_forward,
    kernel_loops,
    kernel_pch,
    notice,
)

_NO_BLAS = ("no optimised BLAS found, so MLX's CPU matmuls use its reference BLAS "
            "(about 30x slower). Fix: " + blas.FIX)
_BAD_CHOICE = ("TOYMLX_BLAS: expected 'openblas', 'reference' or the path of an LP64 "
               "BLAS library, found {path!r}, which could not be loaded ({why}); MLX's CPU "
               "matmuls use its reference BLAS (about 30x slower)")
_NOT_BOUND = ("MLX's CPU matmuls could not be pointed at {path} ({why}), so they use "
              "MLX's reference BLAS in this process (a training step 10-40x slower)")
_CACHE_NOT_USED = ("TOYMLX_KERNEL_CACHE={chosen}: MLX builds its CPU kernels in "
                   "{mlx_dir}, which is not a link toymlx made, so they are only copied to "
                   "{kept} at each start; remove {mlx_dir} to have them built there")
_CACHE_NO_FOLDER = ("TOYMLX_KERNEL_CACHE={chosen}: expected a folder toymlx can keep MLX's "
                    "kernels in, found {why} at {where}; MLX builds them in its own folder "
                    "{mlx_dir}, not kept")
_CACHE_IN_USE = ("TOYMLX_KERNEL_CACHE={chosen}: MLX builds its CPU kernels in {mlx_dir}, a "
                 "link to {folder} that another running toymlx process builds through, so "
                 "they are not kept in {kept}; give this process a TMPDIR of its own to keep "
                 "them there")
_ANOTHER_BUILD_IN_USE = ("MLX builds its CPU kernels in {mlx_dir}, a link to {folder}: another "
                         "toymlx build's kernels (another vector set or header), which a running "
                         "process builds through, so this process builds its kernels there, "
                         "without its own precompiled header, loops and exp and erf forms; give "
                         "it a TMPDIR of its own to use its kernel folder, {kept}")
_GENERIC = ("{why}: MLX's float32 matmuls run at {gflops:.0f} GFLOPS here. Fix: "
            "set OPENBLAS_CORETYPE={best} before starting, or " + blas.FIX)
_UNKNOWN_CORE = ("OPENBLAS_CORETYPE: expected the name of one of OpenBLAS's kernel sets{best}, "
                 "found {core!r}, which it does not know, so it runs its {used} kernels, chosen "
                 "from this CPU; correct the name or unset it")
# the user's OPENBLAS_CORETYPE chose the kernels: another library would obey it too
_USERS_CORE = ("{why}: MLX's float32 matmuls run at {gflops:.0f} GFLOPS here. Fix: the "
               "environment sets {core_from}, which OpenBLAS obeys: unset it (toymlx then "
               "chooses {best} from this CPU's flags) or set OPENBLAS_CORETYPE={best}")

BFS_MAX_WIDTH = "1000000"
"""MLX orders each evaluation breadth-first up to MLX_BFS_MAX_WIDTH nodes, then depth-first.
The CPU step runs slices of the batch on parallel streams (`toymlx.training.cpu_streams`); a narrow
breadth-first order queues one slice's ops long before the other's, and with at most 10 tasks
in flight the other stream then waits (2 streams: 1.08x slower than 1 at MLX's default width,
0.90x at full width). Linux only: on macOS the step runs on the GPU or on one stream."""

_MALLOC_LIMITS = {"mmap_threshold": 1 << 30, "trim_threshold": 1 << 31}
"""glibc malloc settings while toymlx runs: blocks up to 1 GiB come from the heap, and up to
2 GiB of freed heap stays with the process."""


@dataclass
class _ProcessState:
    """What this process set up: one instance, `_PROCESS`."""

    blas: str = "unknown"
    """What MLX's CPU matmuls call: openblas, accelerate (macOS), reference (MLX's own)."""
    library: blas.Library | None = None
    """The BLAS loaded for MLX (Linux), to read its kernels and set its threads."""
    malloc: str = "default"
    aligned_buffers: str | None = None
    """Whether MLX's CPU arrays start on 64-byte boundaries (`toymlx.backend.aligned_buffers`):
    on, off (why)."""
    bfs_max_width: str | None = None
    kernel_cache: str | None = None
    kernel_folder_users: dict[Path, int] = field(default_factory=dict)
    """MLX's kernel folders this process builds through (one per TMPDIR it had), each with the
    open `KERNEL_FOLDER_USERS` file it holds a shared lock on (`_kernel_folder_decision`)."""
    kernel_pch: str | None = None
    """The precompiled header MLX's kernel builds read (`toymlx.backend.kernel_pch`), or off (why)."""
    kernel_loops: str | None = None
    """The `g++` that vectorises MLX's strided kernels (`toymlx.backend.kernel_loops`), or off (why)."""
    kernel_forms: str | None = None
    """Whether MLX's compiled kernels compute float32 exp and erf as toymlx's forms: "checked",
    or off (why); None before setup (`kernel_forms()`)."""
    gemv_forward: str | None = None
    """Whether one-row matmuls go to OpenBLAS's sgemv (`toymlx.backend.gemv_forward`): on, off (why)."""
    blas_bound: str | None = None
    """What `blas_rebind` rewrote in libmlx.so, or why it could not."""
    trim_threshold: int | None = None
    """glibc's trim threshold once `bound_kept_buffers` set it to a step's memory."""
    mlx_cache_limit: int | None = None
    """MLX's buffer-cache limit once `bound_kept_buffers` set it."""
    blas_warned: bool = False
    """Whether the process this one replaced (`RESTARTED`) printed the BLAS warning already."""
    set_up: bool = False


_PROCESS = _ProcessState()


RESTARTED = "TOYMLX_RESTARTED"
"""Set (to 1) for the process `restart_with_huge_pages` starts in its place, whose import of
toymlx then takes it out of the environment again (its own children do not inherit it): the
process it replaced already printed the import's BLAS warning, so it is not printed twice."""


def bind_blas() -> dict:
    """Point MLX's CPU BLAS calls at an optimised BLAS (Linux; once); return what is used."""
    p = _PROCESS
    if p.blas == "unknown":
        p.blas_warned = os.environ.pop(RESTARTED, None) is not None
        if sys.platform == "darwin":
            p.blas = "accelerate"
        elif sys.platform != "linux" or os.environ.get("TOYMLX_BLAS") == "reference":
            p.blas = "reference"
        else:
            _bind_openblas(p)
        p.aligned_buffers = aligned_buffers.install()
    return {"name": p.blas, "path": p.library.path if p.library else None}


def blas_summary() -> str:
    """One line on MLX's CPU BLAS, for `--version` and the benchmark's host line: "OpenBLAS
    0.3.34 SkylakeX kernels (pip scipy-openblas32 0.3.34)", "Accelerate", "reference"."""
    p, lib = _PROCESS, _PROCESS.library
    if lib is None:
        return {"accelerate": "Accelerate", "unknown": "not bound yet"}.get(p.blas, p.blas)
    version = (lib.config or "").split()
    if version[:1] == ["OpenBLAS"]:
        name = " ".join(version[:2])
    elif lib.kind == "mkl":
        name = "MKL " + next((v for v in version if v[:1].isdigit()), "").split("-")[0]
    else:
        name = os.path.basename(lib.path)
    kernels = f" {lib.core} kernels" if lib.core else ""
    return f"{name}{kernels} ({lib.source})"


def _bind_openblas(p: _ProcessState) -> None:
    local = _ranks_on_this_host()
    for var in ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        if local > 1 and var not in os.environ:
            # data-parallel ranks on one host would each start a BLAS thread per core; the
            # BLAS reads this once, when it is loaded just below
            os.environ[var] = str(max(1, (os.cpu_count() or 1) // local))
    p.blas = "reference"
    chosen = None  # the user's TOYMLX_BLAS, where it failed to load: named, not "none found"
    for path, prefix, source in blas.candidates():
        try:
            lib = blas.load(path, prefix, source)
        except OSError as e:
            if source == "TOYMLX_BLAS":
                chosen = _BAD_CHOICE.format(path=path, why=" ".join(str(e).split()))
            continue
        p.gemv_forward = gemv_forward.install(path, prefix)
        try:
            names = blas_rebind.rebind("libmlx.so",
                                       blas.mlx_targets(lib, gemv_forward.sgemm_address()))
        except OSError as e:
            p.blas_bound = f"failed: {e}"
            _warn_blas(p, _NOT_BOUND.format(path=path, why=e))
            return
        p.blas, p.library = "mkl" if lib.kind == "mkl" else "openblas", lib
        p.blas_bound = f"{len(names)} BLAS/LAPACK functions of libmlx.so"
        os.register_at_fork(after_in_parent=_restart_blas_workers)
        if lib.unknown_core is not None:
            best = blas.core_for_cpu(*blas.cpu_flags())
            _warn_blas(p, _UNKNOWN_CORE.format(
                core=lib.unknown_core, used=lib.core,
                best="" if best is None else f" (this CPU's best: {best[0]})"))
        why = blas.generic_core(lib)
        if why is not None:
            users = (lib.core_from or "").startswith("OPENBLAS_CORETYPE=")
            _warn_blas(p, (_USERS_CORE if users else _GENERIC).format(
                why=why, gflops=blas.sgemm_gflops(lib), core_from=lib.core_from,
                best=blas.core_for_cpu(*blas.cpu_flags())[0]))
        return
    _warn_blas(p, chosen or _NO_BLAS)


def _warn_blas(p: _ProcessState, message: str) -> None:
    """The import's BLAS warning, unless the process this one replaced printed it."""
    if not p.blas_warned:
        notice.warn(message, stacklevel=5)  # the line that imported toymlx


def check_bfs_width(text: str | None) -> None:
    """ValueError (one line) unless `text`, MLX_BFS_MAX_WIDTH as set, is unset or a whole number
    other than 0: MLX reads text or 0 as a width of 0, and then never finishes evaluating
    anything (the command waits forever); a negative width is MLX's "no limit"."""
    if text is None:
        return
    try:
        width = int(text)
    except ValueError:
        width = 0
    if width == 0:
        raise ValueError(f"MLX_BFS_MAX_WIDTH: expected a whole number other than 0, found "
                         f"{text!r} (MLX reads it as 0, and with 0 never finishes an "
                         f"evaluation: the command would hang); unset it, or set it to "
                         f"{BFS_MAX_WIDTH} as toymlx does")


SWITCHES = {"TOYMLX_KERNEL_PCH": ("off", "on"), "TOYMLX_KERNEL_LOOPS": ("off", "on"),
            "TOYMLX_GEMV_FORWARD": ("off", "on"), "TOYMLX_ALIGNED_BUFFERS": ("off", "on"),
            "TOYMLX_MALLOC": ("default", "glibc-retain")}
"""The environment's switches of toymlx's own CPU code: (the value each reads, what it is
unset: backend_info's word)."""


def check_switches(env: Mapping[str, str] = os.environ) -> None:
    """ValueError (one line) for a `SWITCHES` variable set to neither of its values (empty is
    unset): each compares with its one value, so TOYMLX_KERNEL_PCH=0 or =OFF left the
    precompiled header on, with no word."""
    for name, (value, unset) in SWITCHES.items():
        found = env.get(name)
        if found not in (None, "", value, unset):
            raise ValueError(f"{name}: expected {value} (or {unset}, as unset), found {found!r}, "
                             f"which toymlx reads as {unset}; set {name}={value} or unset it")


def check_kernel_cache(env: Mapping[str, str] = os.environ) -> None:
    """ValueError (one line) for a TOYMLX_KERNEL_CACHE that is neither off nor an absolute
    folder (~ is the home folder; empty is unset): a relative one is a folder of that name in
    whichever folder a command starts in, so TOYMLX_KERNEL_CACHE=OFF, =0 or =false made a kernel
    cache there, built again from nothing, with no word."""
    found = env.get("TOYMLX_KERNEL_CACHE")
    if not found or found == "off" or os.path.isabs(os.path.expanduser(found)):
        return
    raise ValueError(f"TOYMLX_KERNEL_CACHE: expected off or an absolute folder path, found "
                     f"{found!r}, which would be a folder of that name in each folder a command "
                     f"starts in; set TOYMLX_KERNEL_CACHE=off, or an absolute path, or unset it")


def setup_process(wide_evaluation: bool = True) -> None:
    """Tune this process for training: MLX's evaluation width (Linux) and glibc malloc.

    Call it before MLX evaluates anything (MLX reads the width at its first evaluation; the
    console scripts call this first thing); later calls do nothing. ValueError (one line) for
    an MLX_BFS_MAX_WIDTH that would hang MLX (`check_bfs_width`). `wide_evaluation=False`
    keeps MLX's default width: the wide breadth-first order that the CPU stream split needs
    also keeps more activations alive at once (tiny Llama, 2 x 1024 tokens: 249 against
    192 MiB peak), and it undoes most of what --grad-checkpoint saves (231 against 125 MiB)."""
    p = _PROCESS
    if p.set_up:
        return
    check_bfs_width(os.environ.get("MLX_BFS_MAX_WIDTH"))
    check_switches()
    check_kernel_cache()
    p.set_up = True
    if sys.platform.startswith("linux") and wide_evaluation:
        os.environ.setdefault("MLX_BFS_MAX_WIDTH", BFS_MAX_WIDTH)
    p.bfs_max_width = os.environ.get("MLX_BFS_MAX_WIDTH")
    p.malloc = tune_malloc()
    p.kernel_cache = persist_kernels()
    if p.kernel_cache:
        # not this build's header where another build's builds, in use, would find it
        theirs = _relink_reason(_mlx_kernel_dir(), kernel_cache_dir() / "cpu") == "another build's"
        p.kernel_pch = ("off (MLX's kernel folder holds another toymlx build's kernels, in use)"
                        if theirs else kernel_pch.install(p.kernel_cache))
    p.kernel_loops = _install_kernel_loops(p)
    p.kernel_forms = _check_kernel_forms(p)


def _not_toymlx_kernel_folder(p: _ProcessState) -> str | None:
    """Why MLX's kernels are not built with toymlx's header in a folder toymlx made for it
    (named `<vector set>-<header tag>`, in this cache or another that MLX's temporary folder
    links to), or None where they are: a kernel is found by its graph's name, so one built in
    another folder may hold MLX's own exp and MLX's own loops."""
    if not p.kernel_pch or p.kernel_pch.startswith("off"):
        return f"no precompiled header: {p.kernel_pch or 'no kernel folder'}"
    folder = Path(p.kernel_cache or "")
    if (folder.name, folder.parent.name) != ("cpu", kernel_cache_dir().name):
        return f"MLX builds its kernels in {folder}, not a folder toymlx made for this header"
    return None


def _install_kernel_loops(p: _ProcessState) -> str:
    """`kernel_loops.install` where MLX builds its kernels in toymlx's folder (the folder's tag
    names the loops, so rewritten kernels live apart from MLX's own), else off (why), with any
    shim inherited from the process that started this one taken off PATH."""
    why = _not_toymlx_kernel_folder(p)
    compiler = kernel_pch.compiler()
    if why is None and compiler is None:
        why = "no g++ on PATH"
    done = (f"off ({why})" if why is not None
            else kernel_loops.install(Path(p.kernel_cache or "").parent, compiler))
    if done.startswith("off"):
        kernel_loops.uninstall()
    return done


def _check_kernel_forms(p: _ProcessState) -> str:
    """ "checked" where MLX's compiled CPU kernels compute float32 exp and erf bit for bit as
    `toymlx.backend.fastmath`'s composed forms (its `kernel_source`, in the PCH), else off (why).
    Only in toymlx's kernel folder (`_not_toymlx_kernel_folder`)."""
    why = _not_toymlx_kernel_folder(p)
    if why is not None:
        return f"off ({why})"
    from toymlx.backend import fastmath  # here: it imports mlx.core

    try:
        why = fastmath.check_kernel_forms()
    except (RuntimeError, OSError) as e:  # a kernel that cannot be built: MLX's ops stay
        why = f"the check failed: {' '.join(str(e).split())[:200]}"
    return "checked" if why is None else f"off ({why})"


def kernel_forms() -> bool:
    """Whether this process's compiled CPU kernels compute float32 exp and erf as toymlx's forms
    (`setup_process` checked them), so `Ops.kernel_forms` may ask for MLX's exp and erf ops."""
    return _PROCESS.kernel_forms == "checked"


def _keep_new_kernels(mlx_dir: Path, kept: Path) -> OSError | None:
    """Copy the kernels MLX built in its own temporary folder that `kept` lacks (each through
    a temporary name, so a reader never sees half a library, removed where the copy fails: a
    full disk is left no fuller); the error where `kept` cannot be made (a file on its path, a
    read-only place), else None."""
    try:
        kept.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return e
    tmp = kept / f".partial-{os.getpid()}"  # MLX's names fill NAME_MAX already
    try:
        have = {p.name for p in kept.iterdir()}
        for lib in mlx_dir.glob("*.so"):
            if lib.name not in have:
                shutil.copyfile(lib, tmp)
                os.replace(tmp, kept / lib.name)
    except OSError:
        atomic.discard(tmp)  # a cache: MLX compiles what it lacks
    return None


def _kernel_cache_root() -> Path:
    """`TOYMLX_KERNEL_CACHE` where it names a folder (a benchmark's cold start), else
    `$XDG_CACHE_HOME/toymlx/mlx-kernels` (default `~/.cache/...`)."""
    chosen = os.environ.get("TOYMLX_KERNEL_CACHE")
    if chosen and chosen != "off":
        return Path(chosen).expanduser()
    return _default_kernel_cache_root()


def _default_kernel_cache_root() -> Path:
    """`$XDG_CACHE_HOME/toymlx/mlx-kernels` (default `~/.cache/...`)."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "toymlx" / "mlx-kernels"


def kernel_cache_dir() -> Path:
    """Where toymlx keeps MLX's compiled CPU kernels: `$XDG_CACHE_HOME/toymlx/mlx-kernels/<mlx
    version>/<vector set>[-<header tag>]` (default `~/.cache/...`; the vector set they are built
    for, `kernel_pch.vector_isa`: a home folder shared by machines with other CPUs never hands
    one of them a kernel it cannot run; the tag of the header they are built with,
    `kernel_pch.header_tag`: a kernel built with MLX's own exp is never found by a build whose
    header carries toymlx's, nor one of an older toymlx's forms)."""
    import mlx.core as mx  # here, not at the top: this module loads before mlx.core

    isa, tag = kernel_pch.vector_isa()[0], kernel_pch.header_tag()
    return _kernel_cache_root() / mx.__version__ / (isa if tag is None else f"{isa}-{tag}")


def _cxx_temp_dir() -> Path:
    """The folder C++'s `std::filesystem::temp_directory_path()` gives MLX on POSIX."""
    for var in ("TMPDIR", "TMP", "TEMP", "TEMPDIR"):
        if os.environ.get(var):
            return Path(os.environ[var])
    return Path("/tmp")


KERNEL_FOLDER_USERS = ".cpu.users"
"""The file beside MLX's kernel folder that each toymlx process building through the folder
holds a shared `flock` on (`_kernel_folder_decision`)."""


def _mlx_kernel_dir() -> Path:
    """MLX's kernel folder, `$TMPDIR/mlx/<version>/cpu`: one for every process with this TMPDIR."""
    import mlx.core as mx  # here, not at the top: this module loads before mlx.core

    return _cxx_temp_dir() / "mlx" / mx.__version__ / "cpu"


def persist_kernels() -> str | None:
    """Keep MLX's JIT-compiled CPU kernels across reboots; return the folder in use.

    MLX compiles each fused elementwise kernel of a compiled step with the system C++ compiler
    (about 0.8 s each; ViT-Tiny's first step builds ~50, 40 s on 2 cores) into
    `$TMPDIR/mlx/<version>/cpu`, and looks there before compiling. Most Linux systems empty
    /tmp at every reboot. Where that folder does not exist yet, this makes it a link to
    `kernel_cache_dir()/cpu` (by its real path), so MLX writes and finds its kernels there;
    where it already exists (a real folder, or a link toymlx did not make), MLX keeps using it
    and the kernels it holds are copied into the kept folder for after the next reboot. The
    kernels are named after their code, so a stale one is never used for another.

    MLX's folder is shared by every process with this TMPDIR, and each build goes through it
    (MLX 0.32's `compile` in mlx/backend/cpu/compiled.cpp writes the source there, g++ reads
    it and writes the library there, MLX then dlopens it): a link pointed elsewhere meanwhile
    loses that build (g++ finds no source, or MLX no library), and a link whose folder was
    deleted fails every later one (MLX does not make the folder again: "cannot create
    directories: File exists"). So a link toymlx made stays as it is where it leads to this
    build's kernels (`<mlx version>/<vector set>[-<header tag>]/cpu`, as `kernel_cache_dir`),
    in this cache or another (another HOME's: the same code). It is made again
    (`_relink_reason`) where it leads nowhere, and, only while no other toymlx process uses it
    (`_kernel_folder_decision`), where it leads to another build's kernels (the older layout,
    another vector set or header: never to be found by this build) or where
    `TOYMLX_KERNEL_CACHE=<folder>` names another folder (a benchmark's cold start). While one
    does, it stays, and one line says so (`setup_process` then builds no precompiled header
    into another build's folder). Not on macOS (Metal kernels are MLX's own);
    `TOYMLX_KERNEL_CACHE=off` leaves MLX's folder alone; where MLX's folder is not a link toymlx
    made, `TOYMLX_KERNEL_CACHE=<folder>` says in one line that the kernels are only copied
    there (or, where it names no folder toymlx can make, that they are not kept)."""
    if sys.platform != "linux" or os.environ.get("TOYMLX_KERNEL_CACHE") == "off":
        return None
    mlx_dir = _mlx_kernel_dir()
    kept = kernel_cache_dir() / "cpu"
    with _kernel_folder_decision(mlx_dir) as alone:
        why = (_relink_reason(mlx_dir, kept) if mlx_dir.is_symlink()
               else None if mlx_dir.exists() else "missing")
        in_use = why if why in ("another build's", "chosen") and not alone() else None
        if why is not None and in_use is None:
            return _link_kernel_folder(mlx_dir, kept)
    unkept = None
    if not _made_by_toymlx(mlx_dir, kept) and mlx_dir.is_dir():
        unkept = _keep_new_kernels(mlx_dir, kept)
    folder = mlx_dir.resolve()
    chosen = os.environ.get("TOYMLX_KERNEL_CACHE")
    if in_use == "chosen":
        notice.warn(_CACHE_IN_USE.format(chosen=chosen, mlx_dir=mlx_dir, folder=folder, kept=kept),
                    stacklevel=2)
    elif in_use is not None:
        notice.warn(_ANOTHER_BUILD_IN_USE.format(mlx_dir=mlx_dir, folder=folder, kept=kept),
                    stacklevel=2)
    elif chosen and unkept is not None:  # a file: "only copied to" it could not be
        notice.warn(_CACHE_NO_FOLDER.format(chosen=chosen, why=unkept.strerror or unkept,
                                            where=unkept.filename or kept, mlx_dir=mlx_dir),
                    stacklevel=2)
    elif chosen and folder != kept.resolve():
        notice.warn(_CACHE_NOT_USED.format(chosen=chosen, mlx_dir=mlx_dir, kept=kept),
                    stacklevel=2)
    return str(folder) if mlx_dir.exists() else None


def _link_kernel_folder(mlx_dir: Path, kept: Path) -> str | None:
    """Make MLX's kernel folder `mlx_dir` a link to `kept`'s real path (a cache reached through
    a link, e.g. a test's HOME whose cache links to this machine's, is never left behind in
    it); return the folder MLX builds in."""
    try:
        kept.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        if chosen := os.environ.get("TOYMLX_KERNEL_CACHE"):  # a file, a read-only place: it
            # was passed over with no word, the kernels built where the benchmark did not look
            notice.warn(_CACHE_NO_FOLDER.format(chosen=chosen, why=e.strerror or e,
                                                where=e.filename or kept, mlx_dir=mlx_dir),
                        stacklevel=3)
        return str(mlx_dir) if mlx_dir.is_dir() else None  # MLX makes its own folder
    try:
        mlx_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = mlx_dir.with_name(f".cpu.{os.getpid()}")
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(kept.resolve(), target_is_directory=True)
        os.replace(tmp, mlx_dir)  # atomic: a build sees the old link or the new one
    except OSError:
        return str(mlx_dir) if mlx_dir.is_dir() else None  # MLX makes its own folder
    return str(kept)


def kernel_stamp() -> int | None:
    """When MLX's CPU kernel folder last changed (ns; None: none yet, or not Linux), for
    `building_kernels`: MLX writes each kernel's source there before it builds it."""
    if sys.platform != "linux":
        return None
    try:
        return _mlx_kernel_dir().stat().st_mtime_ns
    except OSError:
        return None


def building_kernels(since: int | None) -> bool:
    """Whether MLX is building CPU kernels in an evaluation that began at `since` (its
    `kernel_stamp` then): its kernel folder changed since, or a child of this process runs the
    C++ compiler now (MLX has the shell run `g++` for each kernel a compiled step needs, one at
    a time, inside the step's evaluation). Linux's /proc; False where it cannot tell."""
    if kernel_stamp() != since:
        return True
    me = os.getpid()
    try:
        threads = os.listdir(f"/proc/{me}/task")
    except OSError:
        return False
    for tid in threads:
        try:
            with open(f"/proc/{me}/task/{tid}/children", "rb") as f:
                children = f.read().split()
        except OSError:
            continue
        for child in children:
            try:
                with open(b"/proc/" + child + b"/cmdline", "rb") as f:
                    if b"g++" in f.read():
                        return True
            except OSError:
                continue
    return False


_UNLOADABLE = re.compile(r"Could not load C\+\+ shared library (/\S+?\.so): ")
"""MLX's error for a kernel library it built and cannot load."""


def drop_unloadable_kernel(error: BaseException) -> str | None:
    """Where `error` is MLX's failure to load a kernel library in its kernel folder, remove that
    library and return its path (else None). For a build a stop cut short: a terminal's Ctrl-C
    reaches MLX's compiler too where toymlx's g++ shim is off (`TOYMLX_KERNEL_LOOPS=off`, no
    kernel folder of toymlx's), and the linker stopped halfway left a truncated library ("file
    too short") that MLX, finding it there, failed to load in every later run."""
    found = _UNLOADABLE.search(str(error))
    if found is None or sys.platform != "linux":
        return None
    lib = Path(found.group(1))
    try:
        if lib.resolve().parent != _mlx_kernel_dir().resolve():
            return None
        lib.unlink()
    except OSError:
        return None
    return str(lib)


_UNBUILT = re.compile(r"\[Compile::eval_cpu\] Failed to compile function .*?the output is: ?(.*)",
                     re.DOTALL)
"""MLX's error for a kernel its compiler failed to build (the compiler's output at the end)."""


def kernel_build_failure(error: BaseException, also: str = "") -> str | None:
    """Where `error` is MLX's failure to build a CPU kernel (its compiler failed: a full disk,
    "final link failed: No space left on device"), one line saying so: the kernel folder, the
    compiler's first line, what is free there where the disk is full, and what to do (`also`:
    the command's own way round it, toymlx-train's --no-compile); else None. MLX's own error
    is a screenful (the compiler's command and output)."""
    found = _UNBUILT.search(str(error))
    if found is None:
        return None
    said = next((ln.strip() for ln in found.group(1).splitlines() if ln.strip()),
                "no output")[:300]
    folder = _mlx_kernel_dir()
    with contextlib.suppress(OSError):
        folder = folder.resolve()
    line = f"MLX could not build a CPU kernel in {folder} (its compiler: {said})"
    if "No space left on device" in said or "Disk quota exceeded" in said:
        if (free := atomic.free_bytes(folder)) is not None:
            line += f"; {free / 2**20:.1f} MiB are free there"
        line += (": free space there, or set TOYMLX_KERNEL_CACHE to a folder on a larger disk"
                 + (f", or {also}" if also else ""))
    return line


def _made_by_toymlx(link: Path, kept: Path) -> bool:
    """Whether `link` (MLX's kernel folder) is a link toymlx made to a kernel cache, recognised
    by the layout, `<root>/<mlx version>/<vector set>[-<header tag>]/cpu` (the older one:
    `<root>/<mlx version>/cpu`), in any cache root, or as a folder of this process's roots."""
    try:
        target = link.parent / os.readlink(link)
    except OSError:
        return False
    version = kept.parent.parent.name
    roots = (_kernel_cache_root(), _default_kernel_cache_root())
    return (target.name == "cpu" and version in (target.parent.name, target.parent.parent.name)
            or any(target == root or root in target.parents for root in roots))


def _relink_reason(link: Path, kept: Path) -> str | None:
    """Why the link `link` (MLX's kernel folder) is to lead to `kept` instead: "dangling" (its
    folder is gone: MLX would fail every build), "another build's" (toymlx made it to another
    build's kernels: another vector set or header, or the older layout), "chosen"
    (`TOYMLX_KERNEL_CACHE` names a folder, and it leads to another); None where it is used as
    it is: it leads to `kept`, to this build's kernels in another cache (another HOME's), or to
    a folder toymlx did not make."""
    if not link.exists():
        return "dangling"
    if link.resolve() == kept.resolve() or not _made_by_toymlx(link, kept):
        return None
    target = link.parent / os.readlink(link)
    if (target.parent.parent.name, target.parent.name) != (kept.parent.parent.name,
                                                           kept.parent.name):
        return "another build's"
    return "chosen" if os.environ.get("TOYMLX_KERNEL_CACHE") else None


@contextlib.contextmanager
def _kernel_folder_decision(mlx_dir: Path) -> Iterator[Callable[[], bool]]:
    """Decide what MLX's kernel folder `mlx_dir` is one toymlx process at a time, then be one of
    the processes that build through it.

    The block runs under an exclusive `flock` of the folder above `mlx_dir` (another process
    deciding waits; the block waits on nothing) and gets `alone()`: whether no other running
    toymlx process builds through `mlx_dir` (none holds a shared `flock` on
    `KERNEL_FOLDER_USERS` beside it), so that it may be pointed elsewhere. After the block this
    process holds that shared lock until it ends or decides on that folder again (a forked
    child shares it); the kernel drops it however the process ends, so a crashed process never
    keeps the link. Where the lock files cannot be opened (a folder that is not this user's),
    nothing is locked and `alone()` is True."""
    p = _PROCESS
    if mlx_dir in p.kernel_folder_users:  # this process's earlier decision: decided again
        os.close(p.kernel_folder_users.pop(mlx_dir))
    import fcntl  # here: Linux only (persist_kernels)

    deciding = users = None
    try:
        try:
            mlx_dir.parent.mkdir(parents=True, exist_ok=True)
            deciding = os.open(mlx_dir.parent, os.O_RDONLY | os.O_DIRECTORY)
            fcntl.flock(deciding, fcntl.LOCK_EX)
            users = os.open(mlx_dir.with_name(KERNEL_FOLDER_USERS), os.O_RDONLY | os.O_CREAT,
                            0o644)
        except OSError:
            pass

        def alone() -> bool:
            if users is None:
                return True
            try:
                fcntl.flock(users, fcntl.LOCK_EX | fcntl.LOCK_NB)  # turned shared below
            except OSError:
                return False
            return True

        yield alone
        if users is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(users, fcntl.LOCK_SH | fcntl.LOCK_NB)  # no one holds it exclusively
                p.kernel_folder_users[mlx_dir], users = users, None
    finally:
        for fd in (users, deciding):
            if fd is not None:
                os.close(fd)


HUGE_PAGES_TUNABLE = "glibc.malloc.hugetlb=1"
"""glibc's tunable (2.35+) that has malloc ask the kernel for transparent huge pages
(`madvise(MADV_HUGEPAGE)`) for the heap it grows: 2 MB pages for MLX's activations instead of
4 KB ones, fewer TLB misses and page faults. On a 2-core Intel Xeon the step was 4-10% faster
(vit-tiny-28 788-799 against 869-892 ms, llama-4x256 331-333 against 348-364 ms, lora-q-135m
3.19-3.50 against 3.47-3.62 s; docs/RESULTS.md, session 19). glibc reads it only as a process
starts, hence `restart_with_huge_pages`."""

THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str | None:
    """The kernel's transparent-huge-page mode (always, madvise, never), None where unknown."""
    try:
        text = THP_MODE.read_text()
    except OSError:
        return None
    chosen = [w[1:-1] for w in text.split() if w.startswith("[")]
    return chosen[0] if chosen else None


def glibc_version() -> tuple[int, int] | None:
    """The running glibc's (major, minor), None elsewhere (musl, macOS)."""
    try:
        name, version = os.confstr("CS_GNU_LIBC_VERSION").split()  # "glibc 2.36"
        major, minor = version.split(".")[:2]
        return (int(major), int(minor)) if name == "glibc" else None
    except (AttributeError, OSError, TypeError, ValueError):  # no such name, or not glibc
        return None


def huge_pages_tunables(environ: dict[str, str], mode: str | None,
                        glibc: tuple[int, int] | None) -> str | None:
    """The GLIBC_TUNABLES a process should restart with to get huge pages for its heap, or
    None to run as it is: not asked for (`TOYMLX_MALLOC=default`), not glibc 2.35+, a kernel
    whose mode is not madvise (always: its heap has them already; never: there are none), or
    a GLIBC_TUNABLES that already says glibc.malloc.hugetlb (the user's choice, or a restart's)."""
    if environ.get("TOYMLX_MALLOC") == "default" or mode != "madvise":
        return None
    if glibc is None or glibc < (2, 35):
        return None
    current = environ.get("GLIBC_TUNABLES", "")
    if "glibc.malloc.hugetlb" in current:
        return None
    return f"{current}:{HUGE_PAGES_TUNABLE}" if current else HUGE_PAGES_TUNABLE


def restart_tunables() -> str | None:
    """The GLIBC_TUNABLES this process's command would restart with for a huge-page heap
    (`huge_pages_tunables` of this environment, kernel and glibc), None where it runs as it
    is (and on every system but Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    return huge_pages_tunables(dict(os.environ), thp_mode(), glibc_version())


def restart_with_huge_pages() -> None:
    """Run this command again, at once, in a process whose heap gets huge pages
    (`HUGE_PAGES_TUNABLE`), where `huge_pages_tunables` says so; else return. The console
    scripts call it first thing, before reading any input, so the restart (~0.2 s: Python and
    the imports again) repeats nothing; the same command line, environment and open files.
    `TOYMLX_MALLOC=default` skips it; run_start's backend says what the process runs with
    (`huge_pages`)."""
    tunables = restart_tunables()
    if tunables is None:
        return
    before = os.environ.get("GLIBC_TUNABLES")
    os.environ["GLIBC_TUNABLES"] = tunables
    os.environ[RESTARTED] = "1"
    sys.stdout.flush()
    sys.stderr.flush()
    with contextlib.suppress(OSError, ValueError):  # cannot restart: run on as it is
        os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])
    del os.environ[RESTARTED]
    if before is None:
        del os.environ["GLIBC_TUNABLES"]
    else:
        os.environ["GLIBC_TUNABLES"] = before


def huge_pages() -> str:
    """Whether this process's heap gets transparent huge pages, and why (run_start's backend)."""
    mode = thp_mode()
    if mode is None:
        return "unknown (no THP setting readable)"
    if mode == "always":
        return "on (THP always)"
    if mode == "never":
        return "off (THP never)"
    if HUGE_PAGES_TUNABLE in os.environ.get("GLIBC_TUNABLES", "").split(":"):
        return f"on ({HUGE_PAGES_TUNABLE}, THP madvise)"
    return "off (THP madvise; glibc.malloc.hugetlb not set)"


def tune_malloc() -> str:
    """Keep freed buffers inside the process (glibc only; `TOYMLX_MALLOC=default` skips it).

    MLX's CPU allocator hands every buffer straight to malloc and back. glibc serves large
    blocks with fresh mmap pages and trims freed heap, so each training step page-faults its
    activations in again: ~48,000 faults a step on ViT-Tiny 28x28 (a 10th of the step in the
    kernel). With these two thresholds raised the same buffers are reused (~400 faults a step)
    and the step is 10-15% faster; the cost is that the process keeps its peak heap."""
    if sys.platform != "linux" or os.environ.get("TOYMLX_MALLOC") == "default":
        return "default"
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return "default"  # not glibc (musl has no mallopt)
    m_trim_threshold, m_mmap_threshold = -1, -3
    ok = mallopt(m_mmap_threshold, _MALLOC_LIMITS["mmap_threshold"])
    ok &= mallopt(m_trim_threshold, _MALLOC_LIMITS["trim_threshold"])
    return "glibc-retain" if ok else "default"


def bound_kept_buffers(step_bytes: int | None) -> None:
    """Keep only what a step reuses: glibc's freed heap (its trim threshold) and MLX's buffer
    cache bounded to `step_bytes` (a step's transient memory, `toymlx.training.memory.Estimate`), and
    what loading left freed handed back now (`malloc_trim`). None: the process's settings as
    they are. `kept_buffers` says what is kept.
    MLX's cache is bounded only where MLX computes on the CPU (the estimate is of the CPU step's
    sizes): on a GPU a freed buffer beyond the bound goes back to the driver (cudaFree waits for
    the device) and is allocated again next step, while the peak MLX reports counts no cached
    buffer; there MLX's own limit stays, as mlx-lm trains with it."""
    p = _PROCESS
    if step_bytes is None:
        return
    import mlx.core as mx  # here, not at the top: this module loads before mlx.core

    step_bytes = int(step_bytes)
    if not on_gpu():
        before = mx.set_cache_limit(step_bytes)
        if before < step_bytes:  # a bound, never a raise (MLX's CPU allocator keeps little)
            mx.set_cache_limit(before)
        p.mlx_cache_limit = min(before, step_bytes)
    if p.malloc == "glibc-retain":
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold = -1
        if libc.mallopt(m_trim_threshold, min(step_bytes, _MALLOC_LIMITS["trim_threshold"])):
            p.trim_threshold = min(step_bytes, _MALLOC_LIMITS["trim_threshold"])
        libc.malloc_trim(0)


def kept_buffers() -> dict[str, Any]:
    """What this process keeps for speed, and its cost (run_start's memory.kept): glibc's
    thresholds (freed heap up to trim_threshold stays with the process: steps fault no pages
    back in) and MLX's buffer-cache limit, in MB."""
    import mlx.core as mx  # here, not at the top: this module loads before mlx.core

    p = _PROCESS
    out: dict[str, Any] = {"malloc": p.malloc}
    if p.malloc == "glibc-retain":
        out.update(mmap_threshold_mb=_MALLOC_LIMITS["mmap_threshold"] >> 20,
                   trim_threshold_mb=(p.trim_threshold or _MALLOC_LIMITS["trim_threshold"])
                   >> 20)
    out["mlx_cache_limit_mb"] = None if p.mlx_cache_limit is None else p.mlx_cache_limit >> 20
    out["mlx_cache_mb"] = round(mx.get_cache_memory() / 2**20, 1)
    # the cost: freed memory the process may hold on to beyond what its arrays use
    out["most_kept_mb"] = out.get("trim_threshold_mb", 0) + (out["mlx_cache_limit_mb"] or 0)
    return out


def peak_rss_mb() -> float | None:
    """This process's peak resident set so far, in MB (None where the OS does not say)."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(peak / (2**20 if sys.platform == "darwin" else 2**10), 1)  # bytes on macOS


def _restart_blas_workers() -> None:
    """After a fork: OpenBLAS ends its worker threads before every fork and starts them again
    at the next call that wants them, in the floating-point mode of whichever thread makes it.
    Start them now, flushing subnormals as they always do (`toymlx.backend.blas`)."""
    lib = _PROCESS.library
    if lib is not None and lib.kind == "openblas":
        with fpenv.subnormals("flush"):
            lib.set_threads(lib.threads())


def blas_threads() -> int | None:
    """The BLAS's thread count now (OpenBLAS, MKL), or None where toymlx does not control the
    BLAS (macOS's Accelerate, the reference BLAS)."""
    lib = _PROCESS.library
    return None if lib is None else lib.threads()


@contextlib.contextmanager
def use_blas_threads(n: int | None):
    """Within: OpenBLAS runs each call on `n` threads (no-op for None or where toymlx does not
    control the BLAS). MLX reads it when a matmul runs, so wrap the evaluation, not the trace."""
    before = blas_threads()
    if n is None or before is None or n == before:
        yield
        return
    set_threads = _PROCESS.library.set_threads

    def set_to(count: int) -> None:
        # OpenBLAS may end and start worker threads here, and a thread starts in the mode of
        # the one that starts it: its workers always flush subnormals (toymlx.backend.blas)
        with fpenv.subnormals("flush"):
            set_threads(count)

    set_to(int(n))
    try:
        yield
    finally:
        set_to(before)


@contextlib.contextmanager
def evaluating(blas_threads: int | None, subnormals: fpenv.Subnormals):
    """Within: a training step's or a held-out pass's evaluation: OpenBLAS on `blas_threads`
    threads a call (`use_blas_threads`), subnormal floats as `subnormals` says on this thread
    (`toymlx.backend.fpenv`; the streams' own threads were made in that mode,
    `toymlx.training.cpu_streams.new_streams`). OpenBLAS's worker threads always flush them, so
    with `keep` each matmul runs on the thread that calls it."""
    if subnormals == "keep" and _PROCESS.library is not None:
        blas_threads = 1  # its worker threads flush subnormals (toymlx.backend.blas)
    with use_blas_threads(blas_threads), fpenv.subnormals(subnormals):
        yield


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
        with open(path) as f:
            hosts = json.load(f)  # ring: one list of "ip:port" per rank
        mine = hosts[int(rank)][0].rsplit(":", 1)[0]
        return sum(1 for h in hosts if h and h[0].rsplit(":", 1)[0] == mine)
    except (OSError, ValueError, IndexError, TypeError, AttributeError):
        return 1


def torch_device_hint(value: object) -> str:
    """After a --device value refused: PyTorch's GPU names (nanoGPT's device='cuda', a Mac's
    'mps') as toymlx's gpu ("; PyTorch's cuda ... is gpu here"); "" for any other value."""
    if not (isinstance(value, str) and re.fullmatch(r"cuda(:\d+)?|mps", value)):
        return ""
    return (f"; PyTorch's {value} (nanoGPT's device) is gpu here: MLX's GPU, Metal on a Mac, "
            "CUDA elsewhere")


def backend_variable_note(has_gpu: bool, env: Mapping[str, str] = os.environ) -> str | None:
    """A line where TOYMLX_BACKEND, the MLX backend scripts/install.sh installs (no command reads
    it), names another device than --device auto takes: cuda or cuda12 where this MLX has no
    GPU, cpu where it has one. Taken for a device switch (PyTorch users set one), it let a run
    compute on the other device without a word; None where it agrees or is not set."""
    value = env.get("TOYMLX_BACKEND")
    if value in ("cuda", "cuda12") and not has_gpu:
        found, where = "no GPU", "CPU"
        fix = "unset it, or for a GPU, source the installer with it where nvidia-smi lists one"
    elif value == "cpu" and has_gpu:
        found, where, fix = "a GPU", "GPU", "pass --device cpu for the CPU"
    else:
        return None
    return (f"TOYMLX_BACKEND={value}: this MLX has {found}, so this computes on the {where}; the "
            f"variable chooses the MLX backend scripts/install.sh installs, not where a command "
            f"computes (--device): {fix}")


def select_device(name: str = "auto"):
    """Make `name` (auto|gpu|cpu) MLX's default device and return it; with auto, warn where
    TOYMLX_BACKEND says otherwise (`backend_variable_note`)."""
    import mlx.core as mx  # here, not at the top: this module loads before mlx.core

    if name not in ("auto", "gpu", "cpu"):
        raise ValueError(f"--device: expected one of auto, gpu, cpu; found {name!r}"
                         f"{torch_device_hint(name)}")
    has_gpu = mx.is_available(mx.gpu)
    note = backend_variable_note(has_gpu) if name == "auto" else None
    if note is not None:
        notice.warn(note, stacklevel=2)
    if name == "gpu" and not has_gpu:
        raise ValueError("--device gpu: MLX has no GPU backend on this machine; use --device cpu")
    dev = mx.gpu if (name == "gpu" or (name == "auto" and has_gpu)) else mx.cpu
    mx.set_default_device(dev)
    return dev


def on_gpu() -> bool:
    """Whether MLX's default device is a GPU (Metal or CUDA)."""
    import mlx.core as mx  # here, not at the top: this module loads before mlx.core

    return mx.default_device().type == mx.DeviceType.gpu


def gpu_kind() -> str | None:
    """Which GPU MLX's default device is: metal on a Mac, cuda elsewhere (MLX's two GPU
    backends); None on the CPU."""
    if not on_gpu():
        return None
    return "metal" if sys.platform == "darwin" else "cuda"


def cuda_kernel_cache() -> Path | None:
    """Where MLX's CUDA backend keeps the PTX of the kernels it builds on first use
    (MLX_PTX_CACHE_DIR, else <temp>/mlx/<version>/ptx, as MLX 0.32 names it); None where MLX's
    default device is not a CUDA GPU. Empty on a fresh machine: the first steps then take 1-2
    minutes (docs/RESULTS.md, session 26)."""
    if gpu_kind() != "cuda":
        return None
    import mlx.core as mx  # here, not at the top: this module loads before mlx.core

    env = os.environ.get("MLX_PTX_CACHE_DIR")
    return Path(env) if env else Path(tempfile.gettempdir()) / "mlx" / mx.__version__ / "ptx"


def backend_info() -> dict:
    """What actually runs the math: for run_start events and benchmarks."""
    import mlx.core as mx  # here, not at the top: this module loads before mlx.core

    kind = gpu_kind()
    info: dict = {"device": "gpu" if kind else "cpu", "mlx": mx.__version__}
    if kind:
        info["kind"] = kind
        with contextlib.suppress(Exception):  # device_info is backend-specific, optional
            info["name"] = mx.device_info().get("device_name")
        return info
    p = _PROCESS
    info.update(kind="cpu", blas=p.blas, malloc=p.malloc, huge_pages=huge_pages(),
                bfs_max_width=p.bfs_max_width,
                cpu=platform.processor() or platform.machine(), cores=os.cpu_count())
    if p.library is not None:
        info.update(blas_path=p.library.path, blas_source=p.library.source,
                    blas_core=p.library.core, blas_version=p.library.config)
        if p.library.core_from:
            info["blas_core_from"] = p.library.core_from
        if p.library.threading:
            info["blas_threading"] = p.library.threading
    if p.kernel_cache:
        info["kernel_cache"] = p.kernel_cache
    if p.kernel_pch:
        info["kernel_pch"] = p.kernel_pch
        # the vector set the PCH compiles MLX's kernels for (without one: MLX's own flags)
        info["kernel_vectors"] = ("mlx's own" if p.kernel_pch.startswith("off")
                                  else kernel_pch.vector_isa()[0])
    if p.kernel_loops:
        info["kernel_loops"] = p.kernel_loops
    if p.kernel_forms:
        info["kernel_forms"] = p.kernel_forms
    if p.gemv_forward:
        info["gemv_forward"] = p.gemv_forward
    if p.aligned_buffers:
        info["aligned_buffers"] = p.aligned_buffers
    if p.blas_bound:
        info["blas_bound"] = p.blas_bound
    if blas_threads() is not None:
        info["blas_threads"] = blas_threads()
    return info


def peak_memory() -> dict[str, float | None]:
    """The process's memory peaks so far, in MB rounded to 0.1: MLX's own count of the buffers
    it held at once (`peak_memory_mb`) and the resident set the system saw (`peak_rss_mb`)."""
    import mlx.core as mx  # here, not at the top: this module loads before mlx.core

    return {"peak_memory_mb": round(mx.get_peak_memory() / 2**20, 1),
            "peak_rss_mb": peak_rss_mb()}
