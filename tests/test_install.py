"""Set-up: scripts/install.sh sourced from bash and zsh or run, the README's commands in
.ci/run, and (marker `install`, minutes of pip) a fresh install from a copy of the checkout
on the system Python, and a built wheel in a fresh venv that trains with its packaged data.

The fast tests here stop the installer before it installs anything (a Python it must
refuse), so they check what a sourced script may leave in the user's shell on any machine.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import toymlx
from toymlx.backend import blas
from toymlx.bundle.events import check_toy_v1, read_events

REPO = Path(__file__).resolve().parents[1]
SYSTEM_PATH = "/usr/bin:/bin"
SHELLS = ["bash", pytest.param("zsh", marks=pytest.mark.skipif(
    shutil.which("zsh") is None, reason="zsh (macOS's default shell) is not installed here"))]
# what a shell knows about itself: variables, functions and options
STATE = {"bash": 'declare -p | grep -v "^declare -[a-zA-Z-]* \\(BASH_[A-Z_]*\\|_\\|PIPESTATUS\\)="'
                 "; declare -F; set -o",
         "zsh": "typeset +; functions +; setopt"}


def _env(**extra: str) -> dict[str, str]:
    """A user's environment on the system Python: no active venv or conda env."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("VIRTUAL_ENV", "CONDA_PREFIX", "PYTHONPATH", "TOYMLX_PYTHON")}
    return {**env, "PATH": SYSTEM_PATH, **extra}


def _pip_cache() -> dict[str, str]:
    """PIP_CACHE_DIR=the pip cache this test's own pip uses, where it has one (else nothing)."""
    r = subprocess.run([sys.executable, "-m", "pip", "cache", "dir"], capture_output=True,
                       text=True, check=False)
    where = r.stdout.strip()
    return {"PIP_CACHE_DIR": where} if r.returncode == 0 and Path(where).is_dir() else {}


def _shell(shell: str, script: str, cwd: Path, env: dict[str, str], timeout: float = 60):
    return subprocess.run([shell, "-c", script], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout, check=False)


def _sourced(shell: str, then: str) -> str:
    """Source the installer between two snapshots of the shell's state; print the diff."""
    return (f"before=$({STATE[shell]}); source scripts/install.sh; echo rc=$?; {then}; "
            f"after=$({STATE[shell]}); diff <(echo \"$before\") <(echo \"$after\") "
            "| grep '^[<>]' | grep -v before; echo alive")


# which of MLX's Linux backend packages an environment holds
BACKENDS = """from importlib import metadata
for name in ("mlx-cpu", "mlx-cuda-13", "mlx-cuda-12"):
    try:
        metadata.version(name)
        print(name)
    except metadata.PackageNotFoundError:
        pass
"""


@pytest.fixture()
def old_python(tmp_path) -> Path:
    """A `python` that answers like macOS's /usr/bin/python3 (3.9)."""
    p = tmp_path / "python3.9"
    p.write_text('#!/bin/sh\necho "3.9.6 arm64"\n')
    p.chmod(0o755)
    return p


# ---- fast: failures leave the user's shell as it was -------------------------------------------

@pytest.mark.parametrize("shell", SHELLS)
def test_sourced_failure_returns_one_line_and_leaves_the_shell_alone(shell, old_python):
    venv_before = (REPO / ".venv" / "bin" / "python").exists()
    r = _shell(shell, _sourced(shell, "echo still here"), REPO,
               _env(TOYMLX_PYTHON=str(old_python)))
    assert r.stdout.splitlines() == ["rc=1", "still here", "alive"], r.stdout + r.stderr
    want = f"toymlx: error: TOYMLX_PYTHON={old_python} is Python 3.9.6; toymlx needs 3.10 or newer"
    assert r.stderr.splitlines() == [want]
    assert (REPO / ".venv" / "bin" / "python").exists() == venv_before  # checked, then touched


@pytest.mark.parametrize("shell", SHELLS)
def test_an_active_environment_with_an_old_python_is_named(shell, tmp_path, old_python):
    venv = tmp_path / "oldenv"
    (venv / "bin").mkdir(parents=True)
    shutil.copy(old_python, venv / "bin" / "python")
    r = _shell(shell, "source scripts/install.sh && echo installed; echo rc=$?", REPO,
               _env(VIRTUAL_ENV=str(venv)))
    assert r.stdout.splitlines() == ["rc=1"], r.stdout + r.stderr
    want = (f"toymlx: error: the active virtual environment {venv} is Python 3.9.6; toymlx "
            "needs 3.10 or newer; deactivate it (toymlx then makes .venv) or use one with "
            "Python 3.10+")
    assert r.stderr.splitlines() == [want]


def test_run_not_sourced_exits_non_zero(old_python):
    for cmd in (["bash", "scripts/install.sh"], ["sh", "scripts/install.sh"]):
        r = subprocess.run(cmd, cwd=REPO, env=_env(TOYMLX_PYTHON=str(old_python)),
                           capture_output=True, text=True, timeout=60, check=False)
        assert r.returncode == 1 and r.stdout == "", cmd
        assert r.stderr.startswith("toymlx: error: TOYMLX_PYTHON="), (cmd, r.stderr)


def _fake_nvidia_smi(folder: Path, gpus: str, driver: str) -> Path:
    """An `nvidia-smi` answering -L with `gpus` and the driver query with `driver`."""
    folder.mkdir(exist_ok=True)
    tool = folder / "nvidia-smi"
    tool.write_text(f"#!/bin/sh\ncase $1 in -L) printf '{gpus}' ;; *) printf '{driver}' ;; esac\n"
                    "[ -n '" + gpus + "' ] || exit 9\n")
    tool.chmod(0o755)
    return folder


@pytest.mark.parametrize("os_name, gpus, driver, backend, want, message", [
    ("Linux", "", "", None, "cpu", "MLX backend: cpu (no NVIDIA GPU listed by nvidia-smi"),
    ("Linux", "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-1)\n", "580.65.06\n", None, "cuda",
     "MLX backend: cuda (GPU 0: NVIDIA H100 80GB HBM3, driver 580.65.06"),
    ("Linux", "GPU 0: NVIDIA A10G (UUID: GPU-2)\nGPU 1: NVIDIA A10G (UUID: GPU-3)\n",
     "550.54.15\n550.54.15\n", None, "cuda12",
     "MLX backend: cuda12 (GPU 0: NVIDIA A10G; driver 550.54.15 is older than CUDA 13's 580"),
    ("Linux", "GPU 0: NVIDIA L4 (UUID: GPU-4)\n", "N/A\n", None, "cuda", "driver unknown"),
    ("Linux", "GPU 0: NVIDIA L4 (UUID: GPU-4)\n", "580.1\n", "cpu", "cpu",
     "MLX backend: cpu (TOYMLX_BACKEND)"),
    # chosen without a GPU listed: installed (a cluster's login node), and said
    ("Linux", "", "", "cuda12", "cuda12", ("MLX backend: cuda12 (TOYMLX_BACKEND), though "
     "nvidia-smi lists no NVIDIA GPU on this machine: its commands will find no GPU here "
     "(TOYMLX_BACKEND=cpu, or unset, for the CPU)\n")),
    ("Linux", "GPU 0: NVIDIA L4 (UUID: GPU-4)\n", "580.1\n", "cuda12", "cuda12",
     "toymlx: MLX backend: cuda12 (TOYMLX_BACKEND)\n"),
    ("Linux", "", "", "rocm", None,
     "toymlx: error: TOYMLX_BACKEND=rocm: expected cpu, cuda (CUDA 13) or cuda12"),
    ("Darwin", "", "", None, "", None),
    ("Darwin", "", "", "cpu", None, "toymlx: error: TOYMLX_BACKEND=cpu: a Mac has one MLX backend"),
])
def test_backend_follows_the_gpu_and_its_driver(tmp_path, os_name, gpus, driver, backend, want,
                                                message):
    tools = _fake_nvidia_smi(tmp_path / "bin", gpus, driver)
    env = _env(PATH=f"{tools}:{SYSTEM_PATH}")
    if backend is not None:
        env["TOYMLX_BACKEND"] = backend
    r = _shell("bash", f"source scripts/install_env.sh; OS={os_name}; backend_extra", REPO, env)
    if want is None:
        assert r.returncode == 1 and r.stdout == "", r.stdout + r.stderr
    else:
        assert r.returncode == 0 and r.stdout == (want + "\n" if want else ""), r.stdout + r.stderr
    assert (message or "") in r.stderr and (message is not None or r.stderr == ""), r.stderr


@pytest.mark.parametrize("extras, message", [
    (None, None), ("interop,bench", None), ("report", None),
    ("benchmark", ("toymlx: error: TOYMLX_EXTRAS=benchmark: expected toymlx's extras, "
     "comma-separated: some of mkl, test, interop, report, tensorboard, wandb, bench; found "
     "'benchmark'\n")),
    ("bench,cuda", ("toymlx: error: TOYMLX_EXTRAS=bench,cuda: cuda is MLX's backend, one only: "
     "choose it with TOYMLX_BACKEND=cuda\n")),
])
def test_an_extra_toymlx_lacks_is_refused_before_anything_is_installed(extras, message):
    """TOYMLX_EXTRAS=benchmark went to pip, which installed the rest and warned of the extra in
    one line among its hundreds: no PyTorch, found at the benchmark's import; a backend there
    (cuda) was a second backend beside the one chosen, which share a library file."""
    env = {k: v for k, v in _env().items() if k != "TOYMLX_EXTRAS"}
    if extras is not None:
        env["TOYMLX_EXTRAS"] = extras
    r = _shell("bash", f"source scripts/install_env.sh; ROOT={shlex.quote(str(REPO))}; "
               "check_extras", REPO, env)
    assert (r.returncode, r.stdout, r.stderr) == ((0, "", "") if message is None
                                                   else (1, "", message))


_BLAS_EXPECTED = ("expected openblas, reference or the absolute path of an LP64 BLAS library "
                  "(libopenblas.so, MKL's libmkl_rt.so), found ")


@pytest.mark.parametrize("os_name, value, message", [
    ("Linux", None, None), ("Linux", "openblas", None), ("Linux", "reference", None),
    ("Linux", "LIBRARY", None),
    ("Linux", "/no/such/libopenblas.so", (
        "toymlx: error: TOYMLX_BLAS=/no/such/libopenblas.so: " + _BLAS_EXPECTED
        + "no file there; unset, toymlx chooses one itself\n")),
    ("Linux", "mkl", ("toymlx: error: TOYMLX_BLAS=mkl: " + _BLAS_EXPECTED
                      + "a name, not an absolute path; unset, toymlx chooses one itself\n")),
    ("Darwin", "/no/such/libopenblas.so", None),  # a Mac's MLX uses Accelerate whatever it says
])
def test_a_blas_library_that_is_not_there_is_refused_before_anything_is_installed(
        tmp_path, os_name, value, message):
    """TOYMLX_BLAS=/no/such/libopenblas.so installed, and each command then warned that it
    could not load it and ran MLX's reference BLAS, about 30x slower."""
    library = tmp_path / "libopenblas.so.0"
    library.write_bytes(b"")
    env = {k: v for k, v in _env().items() if k != "TOYMLX_BLAS"}
    if value is not None:
        env["TOYMLX_BLAS"] = str(library) if value == "LIBRARY" else value
    r = _shell("bash", f"source scripts/install_env.sh; OS={os_name}; check_blas", REPO, env)
    assert (r.returncode, r.stdout, r.stderr) == ((0, "", "") if message is None
                                                   else (1, "", message))


@pytest.mark.parametrize("arch, vendor, backend, blas, want, message", [
    ("x86_64", "GenuineIntel", "cpu", None, "mkl", "BLAS: Intel's MKL from pip for this Intel CPU"),
    ("x86_64", "GenuineIntel", "cpu", "openblas", "",
     "BLAS: OpenBLAS from pip, not MKL (TOYMLX_BLAS=openblas)"),
    ("x86_64", "GenuineIntel", "cuda", None, "", None),
    ("x86_64", "AuthenticAMD", "cpu", None, "", None),
    ("aarch64", "", "cpu", None, "", None),
])
def test_the_blas_extra_is_mkl_on_intel_cpus_alone(tmp_path, arch, vendor, backend, blas, want,
                                                   message):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nvendor_id\t: {vendor}\nflags\t\t: fpu avx2\n")
    env = {k: v for k, v in _env().items() if k != "TOYMLX_BLAS"}
    if blas:
        env["TOYMLX_BLAS"] = blas
    r = _shell("bash", f"source scripts/install_env.sh; OS=Linux; ARCH={arch}; "
               f"CPUINFO={cpuinfo}; BACKEND={backend}; blas_extra", REPO, env)
    assert r.returncode == 0 and r.stdout == (want + "\n" if want else ""), r.stdout + r.stderr
    assert (message or "") in r.stderr and (message is not None or r.stderr == ""), r.stderr


def _fake_mac_tools(folder: Path, pythons: dict[str, str], arm64: str = "1",
                    translated: str = "0", macos: str = "14.5") -> Path:
    """Pythons answering py_info with "VERSION ARCH", and a Mac's `sysctl` and `sw_vers`."""
    folder.mkdir(exist_ok=True)
    tools = {name: f'echo "{info}"' for name, info in pythons.items()}
    tools["sysctl"] = (f'case $2 in hw.optional.arm64) echo {arm64} ;; '
                       f'sysctl.proc_translated) echo {translated} ;; *) exit 1 ;; esac')
    tools["sw_vers"] = f"echo {macos}"
    for name, body in tools.items():
        (folder / name).write_text(f"#!/bin/sh\n{body}\n")
        (folder / name).chmod(0o755)
    return folder


@pytest.mark.parametrize("pythons, translated, want, message", [
    # Homebrew's python3 first on PATH, native: taken
    ({"python3": "3.13.1 arm64"}, "0", "python3", ""),
    # an Intel (or Rosetta) python3 is passed over for a native python3.11 further down
    ({"python3": "3.12.4 x86_64", "python3.11": "3.11.9 arm64"}, "0", "python3.11", ""),
    # only old or Intel Pythons, in a Rosetta terminal: named, with the way out
    ({"python3": "3.9.6 arm64", "python3.12": "3.12.4 x86_64"}, "1", None,
     "is Python 3.9.6; toymlx needs 3.10 or newer;"),
])
def test_a_mac_finds_a_native_python(tmp_path, pythons, translated, want, message):
    """On macOS the installer takes the first Python >= 3.10 that runs natively (arm64): MLX
    has no Intel build, and a Rosetta terminal's Pythons answer x86_64."""
    tools = _fake_mac_tools(tmp_path / "bin", pythons, translated=translated)
    r = _shell("bash", "source scripts/install_env.sh; OS=Darwin; find_python", REPO,
               _env(PATH=f"{tools}:{SYSTEM_PATH}"))
    if want is not None:
        assert r.returncode == 0 and r.stdout == f"{tools / want}\n", r.stdout + r.stderr
        return
    assert r.returncode == 1 and r.stdout == "", r.stdout
    err = r.stderr.strip()
    assert err.count("\n") == 0 and err.startswith("toymlx: error: no native Python 3.10+ found")
    assert message in err and "is an x86_64 Python (Rosetta or Intel)" in err, err
    assert "runs under Rosetta" in err and "brew install python@3.12" in err, err


@pytest.mark.parametrize("arm64, macos, message", [
    ("1", "14.5", None),
    ("1", "26.1", None),
    ("0", "14.5", "MLX runs only on Apple Silicon Macs (M1 or later); this Mac has an Intel CPU"),
    ("1", "13.4", "MLX needs macOS 13.5 or later; this Mac runs macOS 13.4"),
])
def test_a_mac_that_mlx_cannot_run_on_is_named(tmp_path, arm64, macos, message):
    tools = _fake_mac_tools(tmp_path / "bin", {}, arm64=arm64, macos=macos)
    r = _shell("bash", "source scripts/install_env.sh; OS=Darwin; check_platform", REPO,
               _env(PATH=f"{tools}:{SYSTEM_PATH}"))
    if message is None:
        assert r.returncode == 0 and r.stderr == "", r.stderr
    else:
        assert r.returncode == 1 and r.stderr.startswith(f"toymlx: error: {message}"), r.stderr


@pytest.mark.parametrize("present, backend, removed", [
    ("mlx-cpu", "cpu", None),
    ("mlx-cuda-13", "cpu", "mlx-cuda-13"),
    ("mlx-cpu mlx-cuda-13", "cuda", "mlx-cpu mlx-cuda-13"),  # the chosen one's file may be gone
    ("", "cuda12", None),
    ("mlx-cpu", "", None),  # a Mac: no backend extra, nothing to remove
])
def test_other_backends_are_removed_first(tmp_path, present, backend, removed):
    """MLX's backend wheels share mlx/lib/libmlx.so: installing one beside another breaks both."""
    env_dir, log = tmp_path / "env", tmp_path / "pip.log"
    (env_dir / "bin").mkdir(parents=True)
    python = env_dir / "bin" / "python"
    python.write_text(f'#!/bin/sh\nif [ "$1" = -c ]; then printf "%s\\n" {present}; '
                      f'else echo "$@" >> {log}; fi\n')
    python.chmod(0o755)
    r = _shell("bash", f"source scripts/install_env.sh; ENV={env_dir}; BACKEND={backend}; "
               "remove_other_backends", REPO, _env())
    assert r.returncode == 0, r.stderr
    calls = log.read_text().splitlines() if log.exists() else []
    assert calls == ([f"-m pip uninstall -y {removed}"] if removed else []), (calls, r.stderr)
    assert ("removing MLX backends" in r.stderr) == bool(removed)


def test_the_kernel_warm_up_runs_with_its_throw_away_folder_as_its_tmpdir(tmp_path):
    """The installer's kernel builds (`build_kernels_for`) run in a throw-away folder that is
    their TMPDIR too, so MLX's kernel folder there is made a link to this HOME's kernel cache,
    the one the mark is made in (the machine's /tmp/mlx may link to another HOME's cache,
    which toymlx uses as it is); the folder is gone after, the mark made."""
    seen, mark = tmp_path / "seen", tmp_path / "cache" / "main.built"
    commands = f'echo "$TMPDIR $PWD" > {seen}'
    r = _shell("bash", f"source scripts/install_env.sh; ENV={tmp_path / 'env'}; "
               f"build_kernels_for {mark} 'a test' {shlex.quote(commands)}", REPO,
               _env(TMPDIR=str(tmp_path)))
    assert r.returncode == 0 and r.stderr == "toymlx: building MLX's CPU kernels for a test\n", r
    tmpdir, cwd = seen.read_text().split()
    assert tmpdir == cwd and Path(cwd).parent == tmp_path and not Path(cwd).exists()
    assert mark.is_file()


def test_ci_runs_the_readme_commands_as_written():
    readme = (REPO / "README.md").read_text()
    setup = readme[readme.index("## Set-up"):readme.index("\n## ", readme.index("## Set-up"))]
    commands = re.findall(r"```\n(.+?)\n```", setup)
    assert commands == ["source scripts/install.sh && toymlx-train --recipe vit-tiny",
                        "python3 -m pytest"]
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    assert "source scripts/install.sh && toymlx-train --recipe vit-tiny || exit 1" in ci
    assert "python3 -m pytest" in ci
    assert ("export PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1 "
            "TOYMLX_EXTRAS=interop,report,bench,tensorboard,wandb") in ci
    assert ci.index("python3 -m pytest") > next(i for i, x in enumerate(ci) if "source" in x)


# ---- install tier: a fresh machine's first commands --------------------------------------------

def _copy_checkout(dest: Path) -> Path:
    """The checkout's files as git would clone them (tracked and new, not ignored)."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO,
                           capture_output=True, check=True).stdout.decode().split("\0")
    for f in filter(None, files):
        if (REPO / f).is_file():
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / f, dest / f)
    return dest


@pytest.mark.install
def test_fresh_install_on_the_system_python(tmp_path):
    """The README's first command in a copy of the checkout, PATH=/usr/bin:/bin: .venv from
    the system python3, toymlx installed editable from the copy, a few real steps; then a
    re-run from zsh reuses it, activates it, and leaves nothing else behind. No root is asked
    for the BLAS: apt-get and sudo on PATH only record their calls, and the run's MLX uses
    a BLAS from pip with the kernels this CPU calls for (MKL on an Intel CPU, else OpenBLAS)."""
    system = subprocess.run(["/usr/bin/python3", "-c", "import sys; print(sys.version.split()[0])"],
                            capture_output=True, text=True, check=True).stdout.strip()
    copy = _copy_checkout(tmp_path / "toymlx")
    # a fresh machine: no kernel cache yet, and a /tmp that the first run then finds empty, as
    # after a reboot (the installer built MLX's kernels for the main job into the cache); pip's
    # own cache stays where it was (XDG_CACHE_HOME would move it too), so that the test times
    # the installer, not the network (the Debian fresh-clone test below downloads everything)
    cache, tmp = tmp_path / "cache", tmp_path / "tmp"
    tmp.mkdir()
    asked, stubs = tmp_path / "asked-for-root", tmp_path / "stubs"
    stubs.mkdir()
    for name in ("apt-get", "sudo"):  # what the installer asks root for, recorded
        real = shutil.which(name, path=SYSTEM_PATH) or "false"
        (stubs / name).write_text(f'#!/bin/sh\necho "{name} $*" >> {asked}\nexec {real} "$@"\n')
        (stubs / name).chmod(0o755)
    r = _shell("bash", f"source scripts/install.sh && rm -rf {tmp}/mlx && "
               "toymlx-train --recipe vit-tiny --steps 5 "
               "--no-progress && command -v python3 toymlx-train && "
               "python3 -c 'import toymlx; print(toymlx.__file__)'", copy,
               _env(XDG_CACHE_HOME=str(cache), TMPDIR=str(tmp), **_pip_cache(),
                    PATH=f"{stubs}:{SYSTEM_PATH}"), timeout=1800)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    # root only ever for Python's venv module (where the system Python lacks it), never a BLAS
    assert "blas" not in (asked.read_text().lower() if asked.exists() else ""), asked.read_text()
    if sys.platform.startswith("linux"):  # Linux's CPU backend: the kernels built at install
        assert "building MLX's CPU kernels for the main job" in r.stderr
        assert "building MLX's CPU kernels for LoRA fine-tunes" in r.stderr
        kernels = list((cache / "toymlx" / "mlx-kernels").glob("*/*/cpu/*.so"))
        built = {p.name: p for p in (cache / "toymlx" / "mlx-kernels").glob("*/*/*.built")}
        assert kernels and sorted(built) == ["lora.built", "vit-tiny.built"], sorted(built)
        # the main job then compiled nothing: every .so is older than the last marker
        assert max(k.stat().st_mtime for k in kernels) <= max(p.stat().st_mtime
                                                              for p in built.values())
    venv = copy / ".venv"
    assert r.stdout.splitlines()[-3:] == [str(venv / "bin" / "python3"),
                                          str(venv / "bin" / "toymlx-train"),
                                          str(copy / "toymlx" / "__init__.py")]
    py = subprocess.run([venv / "bin" / "python", "-c", "import sys; print(sys.version.split()[0])"],
                        capture_output=True, text=True, check=True).stdout.strip()
    assert py == system
    version = subprocess.run([venv / "bin" / "toymlx-train", "--version"], capture_output=True,
                             text=True, check=True).stdout
    assert re.fullmatch(rf"toymlx {re.escape(toymlx.__version__)} \(mlx [0-9.]+; BLAS .+\)\n",
                        version)
    backends = subprocess.run([venv / "bin" / "python", "-c", BACKENDS], capture_output=True,
                              text=True, check=True).stdout.split()
    if sys.platform.startswith("linux") and shutil.which("nvidia-smi") is None:
        assert backends == ["mlx-cpu"], backends  # toymlx[cpu], and no other backend
    runs = list((copy / "runs").iterdir())
    evs = read_events(runs[0])
    assert len(runs) == 1 and check_toy_v1(evs) == []
    backend = evs[0]["backend"]
    if sys.platform.startswith("linux"):  # MLX's BLAS from pip, never a generic core
        vendor, flags = blas.cpu_flags()
        if vendor == "GenuineIntel" and "TOYMLX_BLAS" not in os.environ:  # MKL, its AVX code
            assert backend["blas_source"].startswith("pip mkl "), backend
            assert backend["blas_core"].startswith("AVX2" if "avx512f" not in flags
                                                   else "AVX512"), backend
        else:
            assert backend["blas_source"].startswith("pip scipy-openblas32"), backend
            want = blas.core_for_cpu(vendor, flags)
            # pip's scipy-openblas32 has no Zen set: it runs its Haswell kernels for Zen (OpenBLAS's
            # Zen set is the Haswell kernels with Zen's block sizes), as test_blas accepts
            assert want is None or backend["blas_core"] == want[0] or (
                (want[0], backend["blas_core"]) == ("Zen", "Haswell")), backend
    assert [e["step"] for e in evs if e["kind"] == "step"] == [1, 2, 3, 4, 5]
    assert evs[-1]["reason"] == "completed" and evs[0]["config"]["data_source"] == "uci-digits"

    if shutil.which("zsh"):  # macOS's shell; the re-run reuses .venv and skips pip
        r = _shell("zsh", _sourced("zsh", "command -v python3"), copy, _env(), timeout=120)
        assert "nothing to do" in r.stderr and "rc=0" in r.stdout, r.stdout + r.stderr
        out = r.stdout.splitlines()
        assert out[1] == str(venv / "bin" / "python3")
        changed = {ln.split()[1].split("=")[0] for ln in out[2:-1]}
        assert changed <= {"VIRTUAL_ENV", "VIRTUAL_ENV_PROMPT", "_OLD_VIRTUAL_PATH",
                           "_OLD_VIRTUAL_PS1", "deactivate"}, out


@pytest.mark.install
def test_wheel_trains_from_any_folder_with_its_packaged_data(tmp_path, stories_path):
    """`pip install <wheel>` into a fresh venv, then vit-tiny and lora on their default data
    from a folder outside the checkout."""
    copy = _copy_checkout(tmp_path / "src")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w",
                    tmp_path / "dist", copy], check=True, timeout=600)
    wheel = next((tmp_path / "dist").glob("toymlx-*.whl"))
    assert wheel.name.startswith(f"toymlx-{toymlx.__version__}-")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", venv], check=True, timeout=300)
    backend = "[cpu]" if sys.platform.startswith("linux") else ""  # Metal comes with mlx
    subprocess.run([venv / "bin" / "python", "-m", "pip", "install", "-q", f"{wheel}{backend}"],
                   check=True, timeout=1800)
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}

    def run(*cmd: str) -> str:
        r = subprocess.run([venv / "bin" / cmd[0], *cmd[1:]], cwd=work, env=env,
                           capture_output=True, text=True, timeout=900, check=False)
        assert r.returncode == 0, (cmd, r.stdout[-2000:], r.stderr[-3000:])
        return r.stdout

    for name in ("train", "generate", "export", "eval", "sweep", "report", "launch"):
        assert run(f"toymlx-{name}", "--version").startswith(f"toymlx {toymlx.__version__} (mlx")
    where = json.loads(run("python", "-c", "import json, toymlx, toymlx.data.images as i, "
                           "toymlx.recipes.lora as l; print(json.dumps([toymlx.__file__, "
                           "str(i.DIGITS_NPZ), str(l.DEFAULT_DATA)]))"))
    site = venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / \
        "site-packages"
    assert [Path(p) for p in where] == [site / "toymlx" / "__init__.py",
                                        site / "toymlx" / "fixtures" / "digits" / "digits.npz",
                                        site / "toymlx" / "fixtures" / "python_qa" /
                                        "python_qa.jsonl"]

    run("toymlx-train", "--recipe", "vit-tiny", "--steps", "5", "--no-progress", "--run-id", "v")
    run("toymlx-train", "--recipe", "lora", "--base", str(stories_path), "--steps", "2",
        "--batch-size", "2", "--seq-len", "64", "--eval-batches", "1", "--no-progress",
        "--run-id", "l")
    for rid, source, steps in (("v", "uci-digits", 5), ("l", str(where[2]), 2)):
        evs = read_events(work / "runs" / rid)
        assert check_toy_v1(evs) == [], rid
        assert evs[0]["config"]["data_source"] == source
        assert evs[0]["toymlx_version"] == toymlx.__version__
        assert [e["step"] for e in evs if e["kind"] == "step"] == list(range(1, steps + 1))
        assert evs[-1]["reason"] == "completed"
        if sys.platform.startswith("linux"):  # the packaged C source compiled and in front
            assert evs[0]["backend"]["gemv_forward"] == "on", evs[0]["backend"]


FRESH_CLONE_MODULES = ("test_install", "test_device", "test_blas", "test_blas_rebind",
                       "test_fpenv", "test_kernel_pch", "test_kernel_loops", "test_gemv_forward",
                       "test_version", "test_shared_files", "test_tokenizer", "test_api",
                       "test_vit_recipe")
"""The default tier's modules the fresh-clone test runs on Debian's python: those that meet the
machine (the installer, the BLAS and the FP environment, MLX's kernel builds with g++, the C
source compiled at first use, tokenizers' wheel, the reference files, the public API and the
main job). Every module is collected there, and CI's own default tier runs them all from its
own fresh clone: the whole tier again would add ~11 minutes to CI's 90."""
FRESH_CLONE_TESTS = "TOYMLX_FRESH_CLONE_TESTS"
"""A `-k` expression: the fresh-clone test runs the default tier's tests it selects instead of
FRESH_CLONE_MODULES ("not nothing" selects the whole tier)."""
NEEDS_FILE = re.compile(r"^SKIPPED \[\d+\] \S+: needs the reference file (\S+), which is not "
                        r"part of the checkout: put the project's shared/ folder beside the "
                        r"checkout, or set TOYMLX_SHARED to one", re.MULTILINE)


def _debian_python() -> Path:
    """Debian's own /usr/bin/python3 with its venv module (apt-get installs python3 and
    python3-venv where they are missing, as root)."""
    python = Path("/usr/bin/python3")
    has_venv = [str(python), "-c", "import ensurepip, venv"]
    if python.exists() and subprocess.run(has_venv, capture_output=True,
                                          check=False).returncode == 0:
        return python
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        pytest.fail("Debian's python3 and python3-venv are needed: run as root: apt-get update "
                    "&& apt-get install -y python3 python3-venv")
    for cmd in (["apt-get", "update", "-qq"],
                ["apt-get", "install", "-y", "-qq", "python3", "python3-venv"]):
        subprocess.run(cmd, check=True, timeout=900, capture_output=True,
                       env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
    subprocess.run(has_venv, check=True, capture_output=True)
    return python


@pytest.mark.install
def test_default_tier_from_a_fresh_clone_on_debians_python(tmp_path, shared_file):
    """The README's commands in a fresh `git clone` of this checkout (its committed HEAD), on
    Debian's own python3 with an empty HOME (no pip cache; toymlx's kernel cache is this
    machine's) and PATH=/usr/bin:/bin:
    `source scripts/install.sh && python3 -m pytest` passes without ../shared beside the clone
    (each test needing a reference file skips, naming it); with ../shared there, the first such
    test of each module runs again and passes (CI's own default tier runs them all with it).
    The tier's tests are all collected there, and those of FRESH_CLONE_MODULES run
    ($TOYMLX_FRESH_CLONE_TESTS, a -k expression, chooses others)."""
    if not Path("/etc/debian_version").exists():
        pytest.skip("Debian's own python3: this machine is not Debian or Ubuntu")
    python = _debian_python()
    shared = shared_file("README.md").parent.parent  # what ../shared holds: data/
    clone = tmp_path / "work" / "toymlx"
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True, timeout=300)
    home = tmp_path / "home"
    # toymlx's kernel cache alone is this machine's (CI's own default tier has just built the
    # tier's ~540 kernels there): building them cold again takes 7 minutes of CI, and a fresh
    # machine's cold build is the fresh-install test's (the installer's, then the main job's)
    (home / ".cache" / "toymlx").mkdir(parents=True)
    (home / ".cache" / "toymlx" / "mlx-kernels").symlink_to(_kernel_root())
    keep = {k: v for k, v in os.environ.items()  # the network's settings, nothing of a user's
            if k.lower() in ("http_proxy", "https_proxy", "no_proxy", "pip_index_url",
                             "pip_extra_index_url")}
    env = {**keep, "PATH": SYSTEM_PATH, "HOME": str(home), "LANG": "C.UTF-8"}
    select = os.environ.get(FRESH_CLONE_TESTS)
    # -rsfE: the skips' reasons, then failures and errors last, so the tail asserted on names them
    pytest_cmd = "python3 -m pytest -q -p no:cacheprovider -rsfE"
    chosen = (f"-k {shlex.quote(select)}" if select else
              " ".join(f"tests/{m}.py" for m in FRESH_CLONE_MODULES))

    def tier(args: str) -> tuple[str, dict[str, int]]:
        r = _shell("bash", f"source scripts/install.sh && {pytest_cmd} {args}", clone, env,
                   timeout=3600)
        assert r.returncode == 0, r.stdout[-5000:] + r.stderr[-3000:]
        counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|skipped|failed|errors?)\b",
                                                      r.stdout.splitlines()[-1])}
        return r.stdout, counts

    report = tmp_path / "without-shared.xml"
    without, bare = tier(f"--junitxml={shlex.quote(str(report))} {chosen}")
    collected, _ = tier("--collect-only")  # every module of the tier imports on this python
    assert re.search(r"^\d+/\d+ tests collected \(\d+ deselected\)|^\d+ tests collected",
                     collected.splitlines()[-1]), collected[-2000:]
    assert subprocess.run([clone / ".venv" / "bin" / "python", "-c",
                           "import sys; print(sys.version.split()[0])"], capture_output=True,
                          text=True, check=True).stdout.strip() == subprocess.run(
        [python, "-c", "import sys; print(sys.version.split()[0])"], capture_output=True,
        text=True, check=True).stdout.strip()
    missing = NEEDS_FILE.findall(without)
    assert missing and bare.get("skipped", 0) >= len(missing), without[-3000:]
    assert all(p.startswith(f"{clone.parent / 'shared' / 'data'}/") for p in missing), missing
    # with ../shared beside the clone, the first test of each module that skipped for a file
    # runs again and finds it: CI's own default tier runs every test with ../shared beside its
    # clone
    needed = _skipped_for_a_file(report, clone)
    assert len(needed) >= len(missing), (len(needed), len(missing))  # -rs joins equal lines
    first = list({n.split("::")[0]: n for n in reversed(needed)}.values())
    (clone.parent / "shared").symlink_to(shared)
    beside, full = tier(" ".join(shlex.quote(n) for n in first))
    assert NEEDS_FILE.findall(beside) == [], beside[-3000:]
    assert full["passed"] + full.get("skipped", 0) == len(first), (full, first)
    assert full["passed"] > 0
    print(f"fresh clone on {python}: {chosen}: without ../shared {bare}, {len(needed)} of "
          f"them for a file; with it, the first of each of their {len(first)} modules: {full}")


def _kernel_root() -> Path:
    """This machine's kernel cache root (`toymlx.backend.device`'s, made if missing)."""
    from toymlx.backend.device import _kernel_cache_root

    root = _kernel_cache_root()
    root.mkdir(parents=True, exist_ok=True)
    return root


def _skipped_for_a_file(junit: Path, root: Path) -> list[str]:
    """The node ids (tests/test_x.py::name[param]) of the tests that pytest's JUnit report at
    `junit` records as skipped for a missing reference file."""
    import xml.etree.ElementTree as ET

    ids = []
    for case in ET.parse(junit).iter("testcase"):
        skipped = case.find("skipped")
        if skipped is None or "needs the reference file" not in skipped.get("message", ""):
            continue
        module = case.get("classname").replace(".", "/") + ".py"
        assert (root / module).is_file(), (case.get("classname"), case.get("name"))
        ids.append(f"{module}::{case.get('name')}")
    return ids
