#!/usr/bin/env bash
# The work behind scripts/install.sh, in its own strict bash (install.sh is what users source
# or run): choose the Python environment, install toymlx into it, and print the
# environment's folder as the only line on stdout (everything else goes to stderr).
#
# The environment: the active virtual environment ($VIRTUAL_ENV) or conda env
# ($CONDA_PREFIX) if there is one; otherwise .venv in the checkout, created (or reused) from
# a Python >= 3.10: $TOYMLX_PYTHON if set, else python3, python3.14 ... python3.10 on PATH,
# then Homebrew's and python.org's. System Pythons (Debian's, Homebrew's) are externally
# managed (PEP 668): toymlx is never pip-installed into them.
#
# Linux with apt: only where the chosen Python lacks venv/ensurepip (Debian and Ubuntu ship
# them apart), python3.X-venv, as root or through sudo. MLX's BLAS comes from pip
# (scipy-openblas32, in toymlx[cpu]; on an Intel CPU MKL too, toymlx[mkl]): no root is asked
# for it.
# macOS: MLX needs Apple Silicon, macOS >= 13.5 and a native (arm64) Python.
#
# MLX's backend: Metal on a Mac (it comes with mlx); on Linux an extra, toymlx[cpu],
# toymlx[cuda] (CUDA 13) or toymlx[cuda12]: cuda where nvidia-smi lists a GPU (cuda12 with an
# NVIDIA driver older than 580), else cpu; TOYMLX_BACKEND=cpu|cuda|cuda12 chooses.
#
# Re-runs are quick: pip runs again only when pyproject.toml, the extras or the checkout
# changed since the last install into that environment (or toymlx no longer imports there).

# stderr explicitly: these also run inside $(...)
say() { echo "toymlx: $*" >&2; }
die() { echo "toymlx: error: $*" >&2; exit 1; }

# "X.Y.Z ARCH" of a Python, or nothing if it does not run.
py_info() {
  "$1" -c 'import platform, sys; print("%d.%d.%d" % sys.version_info[:3], platform.machine())' \
    2>/dev/null || true
}

# Why a Python cannot host toymlx (empty when it can).
py_unfit() {
  local info
  info=$(py_info "$1")
  [ -n "$info" ] || { echo "does not run"; return; }
  local version=${info% *} arch=${info#* }
  local major=${version%%.*} minor
  minor=${version#*.}; minor=${minor%%.*}
  if [ "$major" -lt 3 ] || { [ "$major" -eq 3 ] && [ "$minor" -lt 10 ]; }; then
    echo "is Python $version; toymlx needs 3.10 or newer"
  elif [ "$OS" = Darwin ] && [ "$arch" != arm64 ]; then
    echo "is an $arch Python (Rosetta or Intel); MLX needs a native arm64 one"
  fi
}

check_platform() {
  if [ "$OS" = Darwin ]; then
    [ "$(sysctl -n hw.optional.arm64 2>/dev/null || echo 0)" = 1 ] ||
      die "MLX runs only on Apple Silicon Macs (M1 or later); this Mac has an Intel CPU"
    local v
    v=$(sw_vers -productVersion)
    local major=${v%%.*} minor
    minor=${v#*.}; minor=${minor%%.*}
    if [ "$major" -lt 13 ] || { [ "$major" -eq 13 ] && [ "$minor" -lt 5 ]; }; then
      die "MLX needs macOS 13.5 or later; this Mac runs macOS $v: update macOS, then re-run"
    fi
  fi
}

# Install Debian packages, as root or through sudo; otherwise fail naming the command.
apt_install() {
  local sudo=()
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null || die "missing Debian packages: $*; run as root: apt-get install -y $*"
    sudo=(sudo)
  fi
  say "installing Debian packages: $* (${sudo[*]:-as root})"
  local apt=("${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get -y -qq)
  # fresh machines have no package lists: update only when the first try fails
  if "${apt[@]}" install "$@" >/dev/null 2>&1; then return; fi
  if ! { "${apt[@]}" update && "${apt[@]}" install "$@"; }; then
    die "could not install Debian packages $*; run: sudo apt-get update && sudo apt-get install -y $*"
  fi
}

# Install what this machine lacks from Debian: the venv module of Python $1 (Debian and Ubuntu
# ship it apart, as python3.X-venv).
debian_packages() {
  if [ "$OS" != Linux ] || ! command -v apt-get >/dev/null; then return 0; fi
  local need=()
  if ! "$1" -c 'import ensurepip, venv' 2>/dev/null; then
    local real
    real=$(readlink -f "$1")
    case $real in
      /usr/bin/python3.*) need+=("${real#/usr/bin/}-venv") ;;  # python3.11 -> python3.11-venv
      *) die "$1 ($real) has no venv module; install one that has, or set TOYMLX_PYTHON" ;;
    esac
  fi
  if [ ${#need[@]} -gt 0 ]; then apt_install "${need[@]}"; fi
}

find_python() {
  if [ -n "${TOYMLX_PYTHON:-}" ]; then
    local path why
    path=$(command -v "$TOYMLX_PYTHON") || die "TOYMLX_PYTHON=$TOYMLX_PYTHON: no such command"
    why=$(py_unfit "$path")
    [ -z "$why" ] || die "TOYMLX_PYTHON=$TOYMLX_PYTHON $why"
    echo "$path"
    return
  fi
  local candidates=(python3 python3.14 python3.13 python3.12 python3.11 python3.10) c rejected=()
  if [ "$OS" = Darwin ]; then
    for c in 14 13 12 11 10; do
      candidates+=("/opt/homebrew/bin/python3.$c"
                   "/Library/Frameworks/Python.framework/Versions/3.$c/bin/python3")
    done
  fi
  for c in "${candidates[@]}"; do
    local path
    path=$(command -v "$c" 2>/dev/null) || continue
    # macOS's /usr/bin/python3 is 3.9, and without the Xcode tools it opens an install dialog
    if [ "$OS" = Darwin ] && [ "$path" = /usr/bin/python3 ]; then continue; fi
    local why
    why=$(py_unfit "$path")
    if [ -z "$why" ]; then echo "$path"; return; fi
    rejected+=("$path $why")
  done
  local found=""
  [ ${#rejected[@]} -eq 0 ] || found=" (found: $(IFS=';'; echo "${rejected[*]}"))"
  if [ "$OS" = Darwin ]; then
    if [ "$(sysctl -n sysctl.proc_translated 2>/dev/null || echo 0)" = 1 ]; then
      found+="; this terminal runs under Rosetta (x86_64): open one without it, or run arch -arm64 zsh"
    fi
    die "no native Python 3.10+ found$found; install one (brew install python@3.12, or python.org's installer) and re-run, or set TOYMLX_PYTHON=/path/to/python3"
  fi
  die "no Python 3.10+ found$found; install one (e.g. apt-get install python3, pyenv) and re-run, or set TOYMLX_PYTHON=/path/to/python3"
}

# The extra that brings MLX's backend: cpu, cuda or cuda12 on Linux, nothing on a Mac.
backend_extra() {
  if [ "$OS" = Darwin ]; then
    [ -z "${TOYMLX_BACKEND:-}" ] ||
      die "TOYMLX_BACKEND=$TOYMLX_BACKEND: a Mac has one MLX backend, Metal, that comes with mlx; unset TOYMLX_BACKEND"
    return 0
  fi
  local gpu driver
  gpu=$(nvidia-smi -L 2>/dev/null | grep -m1 '^GPU ' || true)
  if [ -n "${TOYMLX_BACKEND:-}" ]; then
    case $TOYMLX_BACKEND in
      cpu) say "MLX backend: cpu (TOYMLX_BACKEND)" ;;
      # a CUDA backend without a GPU here may be for a machine that has one (a cluster's login
      # node), so it is installed, and said
      cuda | cuda12)
        if [ -n "$gpu" ]; then
          say "MLX backend: $TOYMLX_BACKEND (TOYMLX_BACKEND)"
        else
          say "MLX backend: $TOYMLX_BACKEND (TOYMLX_BACKEND), though nvidia-smi lists no NVIDIA GPU on this machine: its commands will find no GPU here (TOYMLX_BACKEND=cpu, or unset, for the CPU)"
        fi ;;
      *) die "TOYMLX_BACKEND=$TOYMLX_BACKEND: expected cpu, cuda (CUDA 13) or cuda12" ;;
    esac
    echo "$TOYMLX_BACKEND"
    return 0
  fi
  if [ -z "$gpu" ]; then
    say "MLX backend: cpu (no NVIDIA GPU listed by nvidia-smi; TOYMLX_BACKEND=cuda to choose)"
    echo cpu
    return 0
  fi
  driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n1 || true)
  case ${driver%%.*} in
    '' | *[!0-9]*) driver="unknown" ;;
  esac
  if [ "$driver" != unknown ] && [ "${driver%%.*}" -lt 580 ]; then
    say "MLX backend: cuda12 (${gpu%% (UUID*}; driver $driver is older than CUDA 13's 580; TOYMLX_BACKEND=cpu for the CPU)"
    echo cuda12
  else
    say "MLX backend: cuda (${gpu%% (UUID*}, driver $driver; TOYMLX_BACKEND=cuda12 or cpu to choose another)"
    echo cuda
  fi
}

# The BLAS extra: on an Intel CPU with the CPU backend, Intel's MKL from pip (toymlx[mkl]), the
# BLAS PyTorch's wheels carry, which runs these steps 4-16% faster (ViT-Tiny 4-9%, LoRA 8-16%: docs/RESULTS.md, r-mkl) there than OpenBLAS;
# TOYMLX_BLAS set (openblas, or a library's path) keeps OpenBLAS alone. Nothing elsewhere.
blas_extra() {
  [ "$OS" = Linux ] && [ "${BACKEND:-}" = cpu ] && [ "$ARCH" = x86_64 ] || return 0
  grep -q -m1 '^vendor_id[[:space:]]*: GenuineIntel' "$CPUINFO" 2>/dev/null || return 0
  if [ -n "${TOYMLX_BLAS:-}" ]; then
    say "BLAS: OpenBLAS from pip, not MKL (TOYMLX_BLAS=$TOYMLX_BLAS)"
    return 0
  fi
  say "BLAS: Intel's MKL from pip for this Intel CPU (toymlx[mkl]: 265 MB to download, 830 MB installed; TOYMLX_BLAS=openblas for OpenBLAS alone)"
  echo mkl
}

# The environment to install into: the active one, else .venv (created or reused).
choose_env() {
  if [ -n "${VIRTUAL_ENV:-}" ] || [ -n "${CONDA_PREFIX:-}" ]; then
    local prefix=${VIRTUAL_ENV:-$CONDA_PREFIX} name
    name=$([ -n "${VIRTUAL_ENV:-}" ] && echo "virtual environment" || echo "conda env")
    [ -x "$prefix/bin/python" ] ||
      die "the active $name $prefix has no bin/python; deactivate it, or re-create it"
    local why
    why=$(py_unfit "$prefix/bin/python")
    [ -z "$why" ] || die "the active $name $prefix $why; deactivate it (toymlx then makes .venv) or use one with Python 3.10+"
    say "installing into the active $name $prefix"
    ENV=$prefix
    return
  fi
  ENV=$ROOT/.venv
  local py=""
  [ -z "${TOYMLX_PYTHON:-}" ] || py=$(find_python)  # checked before .venv is touched
  if [ -e "$ENV/bin/python" ] || [ -L "$ENV/bin/python" ]; then
    local why
    why=$(py_unfit "$ENV/bin/python")
    if [ -n "$py" ] && [ -z "$why" ]; then
      local want have
      want=$(py_info "$py"); have=$(py_info "$ENV/bin/python")
      [ "${want%.* *}" = "${have%.* *}" ] || why="is ${have% *}, not TOYMLX_PYTHON's ${want% *}"
    fi
    if [ -z "$why" ]; then
      say "using $ENV (Python $(py_info "$ENV/bin/python" | cut -d' ' -f1))"
      return
    fi
    say "re-creating $ENV: its Python $why"
    rm -rf "$ENV"
  elif [ -e "$ENV" ]; then
    die "$ENV exists but is not a virtual environment (no bin/python); move it away and re-run"
  fi
  [ -n "$py" ] || py=$(find_python)
  debian_packages "$py"
  say "creating $ENV with $py (Python $(py_info "$py" | cut -d' ' -f1))"
  if ! "$py" -m venv "$ENV"; then
    rm -rf "$ENV"  # a venv without pip would be reused and fail later
    die "$py -m venv $ENV failed (see above)"
  fi
}

# MLX's backend packages all ship mlx/lib/libmlx.so: with another one in $ENV, remove them all
# (the chosen one too, its file may be the one overwritten) before pip installs the chosen.
remove_other_backends() {
  local all=(mlx-cpu mlx-cuda-13 mlx-cuda-12) chosen present
  case ${BACKEND:-} in
    cpu) chosen=mlx-cpu ;; cuda) chosen=mlx-cuda-13 ;; cuda12) chosen=mlx-cuda-12 ;; *) return 0 ;;
  esac
  present=$("$ENV/bin/python" -c 'import sys
from importlib import metadata
for name in sys.argv[1:]:
    try:
        metadata.version(name)
        print(name)
    except metadata.PackageNotFoundError:
        pass' "${all[@]}")
  if [ -n "$present" ] && [ "$present" != "$chosen" ]; then
    say "removing MLX backends $(echo "$present" | tr '\n' ' ')before installing $chosen: they share one library file"
    # shellcheck disable=SC2086  # one package name a line
    "$ENV/bin/python" -m pip uninstall -y $present
  fi
}

# TOYMLX_EXTRAS against pyproject.toml's extras, before anything is installed: pip installs
# the rest and warns of an extra it lacks in one line among hundreds (TOYMLX_EXTRAS=benchmark:
# no PyTorch, found at the benchmark's first import), and a backend there is a second one.
check_extras() {
  local known extra
  known=$(sed -n '/^\[project.optional-dependencies\]/,/^\[/s/^\([a-z0-9_-]*\) *=.*/\1/p' \
          "$ROOT/pyproject.toml" | grep -vxE 'cpu|cuda|cuda12' | tr '\n' ' ')
  for extra in $(echo "${TOYMLX_EXTRAS:-}" | tr ',' ' '); do
    case " $known" in
      *" $extra "*) ;;
      *) case $extra in
           cpu | cuda | cuda12) die "TOYMLX_EXTRAS=$TOYMLX_EXTRAS: $extra is MLX's backend, one only: choose it with TOYMLX_BACKEND=$extra" ;;
           # shellcheck disable=SC2086  # $known split into its words, one space apart
           *) die "TOYMLX_EXTRAS=$TOYMLX_EXTRAS: expected toymlx's extras, comma-separated: some of $(echo $known | sed 's/ /, /g'); found '$extra'" ;;
         esac ;;
    esac
  done
}

# TOYMLX_BLAS on Linux, before anything is installed: a library's file that is not there was
# only warned of at each run, which then used MLX's reference BLAS (about 30x slower). An
# absolute path: a relative one would be looked for from each command's own folder. A Mac uses
# Accelerate, whatever it says.
check_blas() {
  [ "$OS" = Linux ] && [ -n "${TOYMLX_BLAS:-}" ] || return 0
  local found
  case $TOYMLX_BLAS in
    openblas | reference) return 0 ;;
    /*) if [ -f "$TOYMLX_BLAS" ]; then return 0; fi
        found="no file there" ;;
    *) found="a name, not an absolute path" ;;
  esac
  die "TOYMLX_BLAS=$TOYMLX_BLAS: expected openblas, reference or the absolute path of an LP64 BLAS library (libopenblas.so, MKL's libmkl_rt.so), found $found; unset, toymlx chooses one itself"
}

# pip install -e the checkout, unless the last install into $ENV was of this same state.
install_toymlx() {
  local spec=".[${BACKEND:+$BACKEND,}${BLAS:+$BLAS,}test${TOYMLX_EXTRAS:+,$TOYMLX_EXTRAS}]"
  local stamp="$ENV/.toymlx-install" want
  want=$(printf 'checkout %s\nspec %s\npython %s\n' "$ROOT" "$spec" "$(py_info "$ENV/bin/python")"
         cat pyproject.toml)
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$ENV/bin/toymlx-train" ] &&
     [ "$("$ENV/bin/python" -I -c 'import toymlx; print(toymlx.__file__)' 2>/dev/null)" = \
       "$ROOT/toymlx/__init__.py" ]; then
    say "toymlx is installed in $ENV and pyproject.toml is unchanged: nothing to do"
    return
  fi
  rm -f "$stamp"
  remove_other_backends
  say "pip install -e '$spec' into $ENV"
  # llama.cpp (built by the interop extra's llama-cpp-python) without its AMX kernels where the
  # CPU lists AMX: a VM may list it yet not give a process the tile state, and llama.cpp's first
  # product on AMX tiles then kills the process with SIGILL (Intel Xeon model 207, session 62)
  local no_amx=""
  if grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then
    no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
  fi
  CFLAGS="${CFLAGS-$no_amx}" CXXFLAGS="${CXXFLAGS-$no_amx}" \
    "$ENV/bin/python" -m pip install -e "$spec" || die "pip install -e '$spec' failed (see above)"
  printf '%s\n' "$want" >"$stamp"
}

# MLX compiles a compiled step's fused CPU kernels with g++ the first time it meets them (ViT-Tiny:
# ~50 kernels, 40 s on 2 cores); toymlx keeps them in ~/.cache/toymlx/mlx-kernels across reboots
# (toymlx.device.persist_kernels). Build them once here for two jobs, each in a throw-away folder
# and marked done in the kernel folder: the main job (vit-tiny, two steps), and LoRA fine-tunes (a
# two-step LoRA on the small base scripts/kernel_warmup_base.py writes: a kernel is named after
# its fused operations and the constants in them, not the model's widths, so a SmolLM2-135M LoRA
# run then builds 1 of its 47 kernels, the schedule's). Linux CPU backend only (a Mac's Metal
# kernels and CUDA's are MLX's own); a failure here is only a warning.
build_kernels() {
  [ "$OS" = Linux ] && [ "${BACKEND:-}" = cpu ] && [ "${TOYMLX_KERNEL_CACHE:-}" != off ] || return 0
  local cache warmup_base
  cache=$("$ENV/bin/python" -c 'from toymlx.backend.device import kernel_cache_dir
print(kernel_cache_dir())') || return 0
  warmup_base="${ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}/scripts/kernel_warmup_base.py"
  build_kernels_for "$cache/vit-tiny.built" "the main job, once (about 45 s on 2 cores)" \
    "toymlx-train --recipe vit-tiny --steps 2 --run-id kernels --no-progress"
  build_kernels_for "$cache/lora.built" "LoRA fine-tunes, once (about 15 s on 2 cores)" \
    "python \"\$warmup_base\" base.gguf && toymlx-train --recipe lora \
       --steps 2 --run-id kernels --base base.gguf --no-progress"
}

# build_kernels_for MARK WHAT COMMANDS: run COMMANDS (toymlx's own, from $ENV) in a throw-away
# folder unless MARK exists, then make MARK. The folder is their TMPDIR too, so MLX's kernel
# folder there is made a link to this HOME's kernel cache, the one MARK is in: the machine's
# (/tmp/mlx/<version>/cpu) may link to another HOME's, which toymlx uses as it is.
build_kernels_for() {
  local mark=$1 what=$2 commands=$3 tmp
  [ ! -f "$mark" ] || return 0
  tmp=$(mktemp -d)
  say "building MLX's CPU kernels for $what"
  if (cd "$tmp" && export PATH="$ENV/bin:$PATH" TMPDIR="$tmp" && eval "$commands" >"$tmp/log" 2>&1); then
    mkdir -p "$(dirname "$mark")" && touch "$mark" || true
  else
    say "warning: building the kernels failed (the first training step will build them): $(tail -n 1 "$tmp/log")"
  fi
  rm -rf "$tmp"
}

# Sourced (the tests do, to call one function), this file only defines the functions above.
if [ "${BASH_SOURCE[0]}" != "$0" ]; then return 0; fi
set -euo pipefail
exec 3>&1 1>&2
cd "$(dirname "$0")/.."
ROOT=$PWD
OS=$(uname -s)
ARCH=$(uname -m)
CPUINFO=/proc/cpuinfo
export PIP_DISABLE_PIP_VERSION_CHECK=1
check_platform
check_extras
check_blas
choose_env
BACKEND=$(backend_extra)
BLAS=$(blas_extra)
install_toymlx
build_kernels
echo "$ENV" >&3
