#!/usr/bin/env bash
# Install toymlx and what it needs on a fresh machine (Debian/Ubuntu Linux or macOS).
# Linux: Debian's OpenBLAS makes MLX's CPU matmuls ~33x faster than the reference BLAS
# the mlx[cpu] wheel links (toymlx loads it automatically before mlx).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(uname -s)" = "Linux" ] && command -v apt-get >/dev/null; then
  if ! ls /usr/lib/*-linux-gnu/openblas-pthread/libopenblas.so.0 >/dev/null 2>&1; then
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq libopenblas0-pthread
  fi
fi
python3 -m pip install -q -e ".[test${TOYMLX_EXTRAS:+,$TOYMLX_EXTRAS}]"
