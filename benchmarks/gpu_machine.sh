#!/usr/bin/env bash
# toymlx on a lent NVIDIA machine that has Python and CUDA but no MLX and no network.
#
# Here (with network):      bash benchmarks/gpu_machine.sh prepare
#   downloads MLX's CUDA wheels and toymlx's other missing dependencies for that machine's
#   Python, in the versions installed here, and cuts them into carries that fit beside the
#   working tree under the device tool's 64 MiB a call: .gpu/part1 .. .gpu/partN (ignored by
#   git), plus .gpu/MANIFEST. MLX 0.32.4's CUDA wheel (90 MB) makes two parts.
# There, one call per part, back to back (an idle machine goes back after ~30 s):
#   bash benchmarks/gpu_machine.sh install .gpu/partK     (carry: .gpu/partK)
#   Each call stores its part outside the working tree (laid anew every call); the call that
#   completes the set joins the big wheel, checks its SHA-256 and installs MLX, toymlx (a wheel
#   built by prepare) and the rest under $TOYMLX_GPU_HOME/site (default /tmp/toymlx-gpu).
# Then, in the same call or the next:
#   bash benchmarks/gpu_machine.sh run python3 benchmarks/bench.py --device gpu ...
#   runs a command with that installation on PYTHONPATH (and toymlx's commands on PATH).
#
# The first compiled step on a fresh machine takes 1-2 minutes: MLX compiles its fused CUDA
# kernels (NVRTC; PTX cached under $TMPDIR/mlx) and the driver builds their machine code (cached
# under ~/.nv/ComputeCache), both for the machine's life. gpu_session.sh brings both caches back
# ($OUT/gpu_kernels.tgz.0, .1, ...); joined here into $KERNEL_CACHE
#   cat /work/.device/N/gpu_kernels.tgz.* > ~/.cache/toymlx/gpu/kernels-mlx-VERSION.tgz
# prepare carries it (in the last wheel part where it fits, else in parts of its own after them)
# and install unpacks it where MLX and the driver look. How much of the first step it saves is
# not yet measured.
set -euo pipefail

HOME_DIR=${TOYMLX_GPU_HOME:-/tmp/toymlx-gpu}
WORK=.gpu
PART_BYTES=${TOYMLX_GPU_PART_BYTES:-55000000}  # + the small wheels + the tree < 64 MiB
PY_VERSION=${TOYMLX_GPU_PYTHON:-3.12}
KERNEL_CACHE=${TOYMLX_GPU_KERNEL_CACHE:-$HOME/.cache/toymlx/gpu/kernels-mlx-$(python3 -c \
  "import importlib.metadata as m; print(m.version('mlx'))" 2>/dev/null || echo none).tgz}
LAST_PART_BYTES=${TOYMLX_GPU_LAST_PART_BYTES:-60000000}  # + the tree (~5 MB) < 64 MiB
# The lent machine's image already has numpy, transformers, tokenizers, jinja2, pillow, tqdm,
# pyyaml, safetensors and NVIDIA's CUDA 13 libraries (../.library/device/KINDS.md)
PACKAGES=(mlx mlx-cuda-13 mlx-lm gguf tyro docstring-parser typeguard typing-extensions
          scipy-openblas32)  # MLX's CPU BLAS (toymlx.backend.blas)
# Where llama-cpp-python is installed here, prepare also carries it (its package as built here,
# llama_cpp.tgz, ~10 MB, and diskcache, which it imports) and SmolLM2's tokenizer alone
# (smollm2-vocab.gguf, ~2 MB, for $TOYMLX_SHAPES_VOCAB): benchmarks/shapes.py writes the
# Q4_K_M files of benchmarks/memory.py's 1b/3b/8b rows with llama.cpp's quantizer there.

die() { echo "gpu_machine.sh: $*" >&2; exit 1; }

version_here() {  # the version of a package in this environment (MLX's CUDA wheel: MLX's)
  local name=$1
  [[ $name == mlx-cuda-13 ]] && name=mlx
  python3 -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name" \
    2>/dev/null || die "$name is not installed here: install toymlx first (scripts/install.sh)"
}

prepare() {
  rm -rf "$WORK" && mkdir -p "$WORK/wheels"
  local specs=() p llama_cpp
  for p in "${PACKAGES[@]}"; do specs+=("$p==$(version_here "$p")"); done
  llama_cpp=$(python3 -c 'import llama_cpp, os; print(os.path.dirname(llama_cpp.__file__))' \
    2>/dev/null || true)
  [[ -n $llama_cpp ]] && specs+=("diskcache==$(version_here diskcache)")
  echo "downloading for Python $PY_VERSION, manylinux x86_64: ${specs[*]}"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" \
    --implementation cp --platform manylinux_2_35_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$WORK/wheels" "${specs[@]}"
  # toymlx itself as a wheel built here (that machine may lack setuptools)
  python3 -m pip wheel -q --no-deps --no-build-isolation -w "$WORK/wheels" .
  if [[ -n $llama_cpp ]]; then  # see PACKAGES above; no llama-cpp-python: memory.py's rows skip
    tar czf "$WORK/wheels/llama_cpp.tgz" -C "$(dirname "$llama_cpp")" llama_cpp \
      "$(cd "$(dirname "$llama_cpp")" && ls -d llama_cpp_python-*.dist-info)"
    python3 benchmarks/shapes.py --write-vocab "$WORK/wheels/smollm2-vocab.gguf"
  fi
  # the big wheel travels in pieces; every other wheel rides with the last (smallest) piece
  local big
  big=$(ls "$WORK"/wheels/mlx_cuda_13-*.whl) || die "no mlx-cuda-13 wheel was downloaded"
  split -b "$PART_BYTES" -d -a 2 "$big" "$WORK/piece."
  local pieces=("$WORK"/piece.*) n=0
  for p in "${pieces[@]}"; do
    n=$((n + 1)) && mkdir -p "$WORK/part$n" && mv "$p" "$WORK/part$n/"
  done
  find "$WORK/wheels" -type f ! -name 'mlx_cuda_13-*' -exec cp {} "$WORK/part$n/" \;
  local k=0 all=$n
  if [[ -f $KERNEL_CACHE ]]; then  # MLX's and the driver's kernel caches (see above)
    if (( $(du -sb "$WORK/part$n" | cut -f1) + $(stat -c %s "$KERNEL_CACHE") \
          <= LAST_PART_BYTES )); then
      cp "$KERNEL_CACHE" "$WORK/part$n/kernels.tgz.00" && k=1
    else
      split -b "$PART_BYTES" -d -a 2 "$KERNEL_CACHE" "$WORK/kernels.tgz."
      for p in "$WORK"/kernels.tgz.*; do
        k=$((k + 1)) all=$((all + 1)) && mkdir -p "$WORK/part$all" && mv "$p" "$WORK/part$all/"
      done
    fi
  fi
  { echo "wheel $(basename "$big")"; echo "sha256 $(sha256sum "$big" | cut -d' ' -f1)"
    echo "pieces $n"; echo "kernel_pieces $k"; } > "$WORK/MANIFEST"
  for p in $(seq 1 "$all"); do cp "$WORK/MANIFEST" "$WORK/part$p/"; done
  rm -rf "$WORK/wheels"
  du -sh "$WORK"/part* | sed 's/^/  /'
  echo "then one device call per part, back to back, each with carry [\".gpu/partK\"]:"
  echo "  bash benchmarks/gpu_machine.sh install .gpu/partK"
}

install() {
  local part=${1:?install needs the carried part folder}
  [[ -f $part/MANIFEST ]] || die "$part/MANIFEST is missing: carry a folder made by prepare"
  mkdir -p "$HOME_DIR/parts"
  cp "$part"/* "$HOME_DIR/parts/"
  local manifest=$HOME_DIR/parts/MANIFEST wheel sha pieces kernels have
  wheel=$(awk '$1 == "wheel" {print $2}' "$manifest")
  sha=$(awk '$1 == "sha256" {print $2}' "$manifest")
  pieces=$(awk '$1 == "pieces" {print $2}' "$manifest")
  kernels=$(awk '$1 == "kernel_pieces" {print $2}' "$manifest")
  kernels=${kernels:-0}
  have=$(find "$HOME_DIR/parts" -name 'piece.*' | wc -l)
  if [[ $(cat "$HOME_DIR/installed" 2>/dev/null) != "$wheel" ]]; then
    if (( have < pieces )); then
      local k missing=()
      for (( k = 1; k <= pieces; k++ )); do
        [[ -f $HOME_DIR/parts/piece.$(printf %02d $((k - 1))) ]] || missing+=(".gpu/part$k")
      done
      echo "stored $have of $pieces pieces in $HOME_DIR/parts; still to carry, back to back" \
        "(a machine idle for ~30 s goes back with them): ${missing[*]}"
    else
      install_wheels "$wheel" "$sha"
    fi
  fi
  if (( kernels > 0 )) && [[ ! -f $HOME_DIR/kernels-unpacked ]]; then
    have=$(find "$HOME_DIR/parts" -name 'kernels.tgz.*' | wc -l)
    if (( have < kernels )); then
      echo "stored $have of $kernels kernel-cache pieces; carry the parts after the wheels' too"
    else
      unpack_kernels "$HOME_DIR/parts" && touch "$HOME_DIR/kernels-unpacked"
    fi
  fi
}

install_wheels() {  # install_wheels WHEEL SHA256: join the big wheel, check it, install all
  local wheel=$1 sha=$2
  cat "$HOME_DIR"/parts/piece.* > "$HOME_DIR/parts/$wheel"
  echo "$sha  $HOME_DIR/parts/$wheel" | sha256sum -c --quiet - \
    || die "$wheel: SHA-256 does not match $HOME_DIR/parts/MANIFEST (a piece is damaged)"
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade \
    --target "$HOME_DIR/site" "$HOME_DIR"/parts/*.whl
  if [[ -f $HOME_DIR/parts/llama_cpp.tgz ]]; then tar xzf "$HOME_DIR/parts/llama_cpp.tgz" \
    -C "$HOME_DIR/site"; fi
  # MLX's CUDA library finds NVIDIA's (cuBLAS, cuDNN, NCCL, ...) at $ORIGIN/../../nvidia, i.e.
  # beside itself in site-packages: point that at the machine's own NVIDIA wheels
  local nvidia
  nvidia=$(python3 -c 'import nvidia; print(list(nvidia.__path__)[0])' 2>/dev/null || true)
  if [[ -n $nvidia && ! -e $HOME_DIR/site/nvidia ]]; then ln -s "$nvidia" "$HOME_DIR/site/nvidia"; fi
  echo "$wheel" > "$HOME_DIR/installed"
  run python3 -c "import mlx.core as mx, toymlx; gpu = mx.is_available(mx.gpu); print('toymlx',
    toymlx.__version__, 'MLX', mx.__version__, 'GPU:', gpu and mx.device_info())"
}

unpack_kernels() {  # unpack_kernels FOLDER: its kernels.tgz.* joined, each cache where it is read
  local joined=$1/kernels.tgz top
  cat "$1"/kernels.tgz.* > "$joined"
  for top in $(tar tzf "$joined" | cut -d/ -f1 | sort -u); do
    local into
    case $top in
      mlx) into=${TMPDIR:-/tmp}/mlx ;;  # MLX's PTX: $TMPDIR/mlx/VERSION/ptx
      ComputeCache) into=${CUDA_CACHE_PATH:-$HOME/.nv/ComputeCache} ;;  # the driver's
      *) echo "kernel cache: skipping $top (not MLX's or the driver's)"; continue ;;
    esac
    mkdir -p "$into" && tar xzf "$joined" -C "$into" --strip-components=1 "$top" \
      && echo "kernel cache: $top unpacked into $into"
  done
}

make_kernel_cache() {  # make_kernel_cache OUT_PREFIX: MLX's and the driver's caches, packed and
  # cut into pieces OUT_PREFIX.0, .1, ... of <= 15 MB (the device tool brings back files of at
  # most 16 MB, 8 in all); the driver's left out where the two take more than 3 pieces
  local prefix=$1 tmp cc
  tmp=$(mktemp) cc=${CUDA_CACHE_PATH:-$HOME/.nv/ComputeCache}
  [[ -d ${TMPDIR:-/tmp}/mlx ]] || { echo "kernel cache: no ${TMPDIR:-/tmp}/mlx"; return 0; }
  if [[ -d $cc ]]; then
    tar czf "$tmp" -C "${TMPDIR:-/tmp}" mlx -C "$(dirname "$cc")" \
      --transform "s,^$(basename "$cc"),ComputeCache," "$(basename "$cc")"
  fi
  if [[ ! -s $tmp ]] || (( $(stat -c %s "$tmp") > 45000000 )); then
    tar czf "$tmp" -C "${TMPDIR:-/tmp}" mlx
  fi
  split -b 15000000 -d -a 1 "$tmp" "$prefix."
  rm -f "$tmp"
  ls -la "$prefix".*
}

run() {
  [[ -d $HOME_DIR/site/toymlx ]] || die "nothing installed under $HOME_DIR: run install first"
  # the working tree's packages first, so code changed since prepare runs as it is now: toymlx
  # from $PWD, and cli as toymlx_cli through a link (the wheel's toymlx_cli is prepare's copy,
  # and the tree's cli imports itself by that name); the installed wheel gives the commands
  # (toymlx-train ...) and the dependencies
  mkdir -p "$HOME_DIR/tree" && ln -sfn "$PWD/cli" "$HOME_DIR/tree/toymlx_cli"
  if [[ -f $HOME_DIR/parts/smollm2-vocab.gguf ]]; then  # shapes.py's SmolLM2 tokenizer
    export TOYMLX_SHAPES_VOCAB=${TOYMLX_SHAPES_VOCAB:-$HOME_DIR/parts/smollm2-vocab.gguf}
  fi
  PYTHONPATH="$PWD:$HOME_DIR/tree:$HOME_DIR/site${PYTHONPATH:+:$PYTHONPATH}" \
    PATH="$HOME_DIR/site/bin:$PATH" "$@"
}

case ${1:-} in
  prepare) prepare ;;
  install) shift; install "$@" ;;
  kernel-cache) shift; make_kernel_cache "$@" ;;
  run) shift; run "$@" ;;
  *) die "usage: bash benchmarks/gpu_machine.sh prepare | install .gpu/partK | run COMMAND... |" \
       "kernel-cache OUT_PREFIX" ;;
esac
