"""toymlx.backend.blas: MLX's CPU matmuls go to pip's OpenBLAS (scipy-openblas32) with the kernel
set this CPU calls for, chosen from cpuid before the library loads and read back after; a
generic kernel set is never silent; the user's OPENBLAS_CORETYPE and TOYMLX_BLAS win."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from toymlx.backend import blas
from toymlx.backend.device import backend_info

LINUX = sys.platform.startswith("linux")
pytestmark = pytest.mark.skipif(not LINUX, reason="toymlx chooses MLX's BLAS on Linux only")

AVX512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "avx2", "fma"}


@pytest.mark.parametrize("vendor,flags,want", [
    ("GenuineIntel", AVX512 | {"avx512_bf16"}, "SkylakeX"),  # Emerald Rapids
    ("AuthenticAMD", AVX512, "SkylakeX"),  # Zen 4 and 5
    ("GenuineIntel", {"avx2", "fma", "avx"}, "Haswell"),
    ("AuthenticAMD", {"avx2", "fma", "avx"}, "Zen"),  # Zen 3
    ("GenuineIntel", {"avx512f", "avx2"}, None),  # AVX-512 without BW/VL (Knights Landing)
    ("GenuineIntel", {"sse3", "avx"}, None),  # no AVX2: left to the library
])
def test_the_kernel_set_follows_the_cpuid_flags(vendor, flags, want):
    got = blas.core_for_cpu(vendor, flags)
    assert (got and got[0]) == want


class _Fake(blas.Library):
    """A Library whose OpenBLAS reports `core_name` (None: not OpenBLAS, MKL)."""

    def __init__(self, core_name: str | None):
        super().__init__("/x/libopenblas.so", "", "test", None)
        self._core = core_name

    @property
    def core(self):
        return self._core

    @property
    def kind(self):
        return "mkl" if self._core is None else "openblas"


@pytest.mark.parametrize("core,flags,slow", [
    ("Prescott", {"avx2", "fma"}, True), ("Sandybridge", {"avx2", "fma"}, True),
    ("Haswell", {"avx2", "fma"}, False), ("Zen", {"avx2", "fma"}, False),
    ("Haswell", AVX512, True), ("Cooperlake", AVX512, False), ("SapphireRapids", AVX512, False),
    ("Prescott", {"sse3"}, False),  # no AVX2 here: nothing better to ask for
    (None, AVX512, False),  # not OpenBLAS (MKL): it chooses its own kernels
])
def test_a_generic_kernel_set_is_named(monkeypatch, core, flags, slow):
    monkeypatch.setattr(blas, "cpu_flags", lambda: ("GenuineIntel", flags))
    why = blas.generic_core(_Fake(core))
    assert (why is not None) == slow
    if slow:
        assert core in why and "best:" in why


_REPORT = """
import json, os, warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import toymlx
from toymlx.backend.device import backend_info
print(json.dumps({"backend": backend_info(), "warned": [str(w.message) for w in caught],
                  "coretype": os.environ.get("OPENBLAS_CORETYPE")}))
"""


def _fresh(**env: str) -> dict:
    """backend_info, the import's warnings and OPENBLAS_CORETYPE after it, in a new process."""
    e = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_CORETYPE", "TOYMLX_BLAS")}
    p = subprocess.run([sys.executable, "-c", _REPORT], env={**e, **env}, capture_output=True,
                       text=True, timeout=120, check=False)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def _avx2() -> tuple[str, str] | None:
    return blas.core_for_cpu(*blas.cpu_flags())


def test_pips_openblas_is_bound_with_the_kernels_of_this_cpu():
    r = _fresh(TOYMLX_BLAS="openblas")  # not MKL, where the mkl extra is installed
    b = r["backend"]
    assert r["warned"] == [] and r["coretype"] is None  # the children's environment as it was
    assert b["blas"] == "openblas" and b["blas_source"].startswith("pip scipy-openblas32 ")
    assert Path(b["blas_path"]) == blas.pip_library()
    assert b["blas_version"].startswith("OpenBLAS 0.3.")
    want = _avx2()
    if want is not None:
        assert b["blas_core_from"] == f"cpuid ({want[1]})"
        # a build without a Zen set (pip's scipy-openblas32) runs its Haswell kernels for it:
        # OpenBLAS's Zen set is the Haswell kernels with Zen's block sizes
        assert b["blas_core"] == want[0] or (want[0], b["blas_core"]) == ("Zen", "Haswell")


def test_the_users_coretype_wins_and_a_generic_one_is_one_line():
    if _avx2() is None:
        pytest.skip("this CPU has no AVX2: OpenBLAS's generic kernels are its best")
    r = _fresh(OPENBLAS_CORETYPE="Nehalem", TOYMLX_BLAS="openblas")  # SSE4.2 kernels
    b = r["backend"]
    core = b["blas_core"]
    assert core not in blas.AVX2_CORES and b["blas_core_from"] == "OPENBLAS_CORETYPE=Nehalem"
    assert r["coretype"] == "Nehalem"  # the user's own variable stays
    [line] = [w for w in r["warned"] if core in w]
    assert "\n" not in line and "GFLOPS" in line and "OPENBLAS_CORETYPE=" in line
    assert f"best: {_avx2()[0]}" in line
    # the variable chose them, so the fix is the variable's, not another library (pip's
    # scipy-openblas32, loaded already, obeys it as well)
    best = _avx2()[0]
    assert line.endswith(
        " GFLOPS here. Fix: the environment sets OPENBLAS_CORETYPE=Nehalem, which OpenBLAS obeys: "
        f"unset it (toymlx then chooses {best} from this CPU's flags) or set "
        f"OPENBLAS_CORETYPE={best}")


def test_a_coretype_openblas_does_not_know_is_one_line():
    """OPENBLAS_CORETYPE=SkylakX (a typo) was silent: OpenBLAS ignores a name it knows no kernel
    set of and runs its cpuid choice (it says so only at OPENBLAS_VERBOSE 1), and run_start said
    the variable chose the kernels. Now one line names the variable, the value and the fix, and
    run_start says who chose; a name it knows in another case (skylakex) is obeyed, no word."""
    r = _fresh(OPENBLAS_CORETYPE="SkylakX", TOYMLX_BLAS="openblas")
    b = r["backend"]
    best = _avx2()
    assert b["blas_core_from"] == "OpenBLAS (OPENBLAS_CORETYPE=SkylakX unknown to it)"
    assert r["coretype"] == "SkylakX"  # the user's own variable stays
    assert r["warned"] == [
        "OPENBLAS_CORETYPE: expected the name of one of OpenBLAS's kernel sets"
        + ("" if best is None else f" (this CPU's best: {best[0]})")
        + f", found 'SkylakX', which it does not know, so it runs its {b['blas_core']} kernels, "
        "chosen from this CPU; correct the name or unset it"]
    known = _fresh(OPENBLAS_CORETYPE="skylakex", TOYMLX_BLAS="openblas")
    assert known["backend"]["blas_core_from"] == "OPENBLAS_CORETYPE=skylakex"
    assert not [w for w in known["warned"] if "expected the name" in w]


@pytest.mark.parametrize("verbose, stderr, told", [
    (None, subprocess.PIPE, False),  # the line the load provoked is toymlx's to say
    ("1", subprocess.PIPE, True),  # the user asked for OpenBLAS's own lines: passed on
    (None, subprocess.DEVNULL, False),  # stderr closed
])
def test_reading_openblas_s_word_on_the_core_keeps_stderr_as_it_was(verbose, stderr, told):
    """The load's stderr is read back to find OpenBLAS's "Core not found": what it writes is
    passed on, less the line toymlx provoked, and a process with stderr closed still imports."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("OPENBLAS_CORETYPE", "OPENBLAS_VERBOSE", "TOYMLX_BLAS")}
    env.update(OPENBLAS_CORETYPE="SkylakX", TOYMLX_BLAS="openblas",
               **({} if verbose is None else {"OPENBLAS_VERBOSE": verbose}))
    code = "import toymlx, sys; sys.stdout.write('imported')"
    closed = stderr == subprocess.DEVNULL  # then closed in the child: `2>&-`
    p = subprocess.run([sys.executable, "-W", "ignore", "-c", code], env=env, timeout=120,
                       stdout=subprocess.PIPE, stderr=stderr, text=True, check=False,
                       preexec_fn=(lambda: os.close(2)) if closed else None)
    assert (p.returncode, p.stdout) == (0, "imported")
    if stderr == subprocess.PIPE:
        assert ("Core not found: SkylakX" in p.stderr) == told, p.stderr


def test_toymlx_blas_chooses_another_library():
    system = next((p for p in blas.SYSTEM_PATHS if os.path.exists(p)), None)
    if system is None:
        pytest.skip(f"no system OpenBLAS at any of {', '.join(blas.SYSTEM_PATHS)}")
    b = _fresh(TOYMLX_BLAS=system)["backend"]
    assert b["blas_path"] == system and b["blas_source"] == "TOYMLX_BLAS"
    assert _fresh(TOYMLX_BLAS="reference")["backend"]["blas"] == "reference"


def test_a_toymlx_blas_that_does_not_load_is_named():
    """TOYMLX_BLAS=junk warned "no optimised BLAS found ... or set TOYMLX_BLAS=..." to a user
    who had set it: the one warning now names the variable, the value and why it failed."""
    r = _fresh(TOYMLX_BLAS="/no/such/libblas.so")
    assert r["backend"]["blas"] == "reference"
    assert r["warned"] == [
        ("TOYMLX_BLAS: expected 'openblas', 'reference' or the path of an LP64 BLAS "
         "library, found '/no/such/libblas.so', which could not be loaded (/no/such/libblas.so: "
         "cannot open shared object file: No such file or directory); MLX's CPU matmuls use "
         "its reference BLAS (about 30x slower)")]


def test_this_process_runs_pips_openblas():
    """The test process itself: what every other CPU test measures against (MKL from pip where
    the mkl extra is installed and the CPU is Intel's)."""
    b = backend_info()
    if _mkl_chosen():
        assert b["blas"] == "mkl" and b["blas_source"].startswith("pip mkl ")
        return
    assert b["blas"] == "openblas" and b["blas_source"].startswith("pip scipy-openblas32")


def _mkl_chosen() -> bool:
    return blas.mkl_library() is not None and blas.cpu_flags()[0] == "GenuineIntel"


def test_mkl_from_pip_runs_mlxs_matmuls_one_thread_a_stream_on_an_intel_cpu():
    """With the mkl extra on an Intel CPU: MKL is bound, its code path recorded, its threads set
    as OpenBLAS's are (the step's CPU streams one each), and MLX's matmul equals float64's."""
    if not _mkl_chosen():
        pytest.skip("the mkl extra is not installed here, or this CPU is not Intel's "
                    "(pip install 'toymlx[mkl]')")
    import mlx.core as mx
    import numpy as np

    from toymlx.backend import device
    b = _fresh()["backend"]
    assert b["blas"] == "mkl" and b["blas_core"] in blas.MKL_BRANCHES.values(), b
    assert b["blas_version"].startswith("Intel(R) oneAPI Math Kernel Library")
    assert device.blas_threads() >= 1
    with device.use_blas_threads(1):
        assert device.blas_threads() == 1
        a = np.random.default_rng(0).standard_normal((300, 200)).astype(np.float32)
        got = np.array(mx.array(a) @ mx.array(a.T), np.float64)
    want = a.astype(np.float64) @ a.T.astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * np.abs(want).max())


_OPENMP = """
import json
import toymlx
import mlx.core as mx
from toymlx.backend import device
from toymlx.backend.device import backend_info
with device.use_blas_threads(2):  # a product big enough for MKL to start its threads
    mx.eval(mx.ones((1024, 1024)) @ mx.ones((1024, 1024)))
maps = open("/proc/self/maps").read()
import os
print(json.dumps({"threading": backend_info().get("blas_threading"),
                  "iomp": "libiomp5" in maps, "gomp": "libgomp" in maps,
                  "env": os.environ.get("OMP_WAIT_POLICY", os.environ.get("GOMP_SPINCOUNT"))}))
"""


def test_mkl_computes_on_the_process_s_one_openmp_runtime():
    """With MKL: its threads are GNU OpenMP's, the runtime llama.cpp and g++'s code use, and
    Intel's OpenMP, a second pool of threads on the same cores, is never loaded;
    MKL_THREADING_LAYER set by the user is left to MKL. GNU OpenMP loads with its idle threads
    spinning 1000 times before they sleep (libgomp's own report of its settings,
    OMP_DISPLAY_ENV), in this process alone: the environment children get is unchanged; a
    user's OMP_WAIT_POLICY is kept."""
    if not _mkl_chosen():
        pytest.skip("the mkl extra is not installed here, or this CPU is not Intel's "
                    "(pip install 'toymlx[mkl]')")
    e = {k: v for k, v in os.environ.items()
         if k not in ("TOYMLX_BLAS", "MKL_THREADING_LAYER", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    e["OMP_DISPLAY_ENV"] = "VERBOSE"  # libgomp prints its settings to stderr as it loads
    for extra, want, spins in [
            ({}, {"threading": "gnu, GOMP_SPINCOUNT=1000", "iomp": False, "gomp": True,
                  "env": None}, "1000"),  # libgomp's default: 300000
            ({"OMP_WAIT_POLICY": "ACTIVE"}, {"threading": "gnu", "env": "ACTIVE"},
             "30000000000"),
            ({"MKL_THREADING_LAYER": "INTEL"},
             {"threading": "MKL_THREADING_LAYER=INTEL", "iomp": True}, None)]:
        p = subprocess.run([sys.executable, "-c", _OPENMP], env={**e, **extra},
                           capture_output=True, text=True, timeout=120, check=False)
        assert p.returncode == 0, p.stderr[-2000:]
        got = json.loads(p.stdout.strip().splitlines()[-1])
        assert {k: got[k] for k in want} == want, (extra, got)
        if spins is not None:
            assert f"GOMP_SPINCOUNT = '{spins}'" in p.stderr, (extra, p.stderr[-2000:])
