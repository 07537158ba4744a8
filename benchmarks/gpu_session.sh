#!/usr/bin/env bash
# One lent GPU's checks in one device call, in the order issue 50 asks for them, each inside
# what is left of BUDGET seconds, every log and JSON under $OUT as it is written (so a call
# cut short still brings back what finished):
#
#   bash benchmarks/gpu_session.sh .gpu/partN BUDGET      (carry: [".gpu/partN"])
#
# after `bash benchmarks/gpu_machine.sh install .gpu/partK` stored the other parts in earlier
# calls, back to back. It installs (the last part completes the set), then runs:
#   1. the `gpu`-marked tests (tests/test_gpu.py);
#   2. benchmarks/bench.py --device gpu in bfloat16: toymlx, mlx-lm and PyTorch eager;
#   3. with time left: benchmarks/decode.py (block decoding against mx.dequantize and the
#      product it feeds), then the bench in float32.
set -uo pipefail

part=${1:?usage: gpu_session.sh .gpu/partN BUDGET_SECONDS}
budget=${2:?usage: gpu_session.sh .gpu/partN BUDGET_SECONDS}
out=${OUT:-/tmp/toymlx-gpu-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
t0=$SECONDS
left() { echo $((budget - (SECONDS - t0))); }
in_time() {  # in_time RESERVE LOG COMMAND...: run COMMAND under gpu_machine.sh, killed so that
  local reserve=$1 log=$2  # RESERVE seconds of the budget stay for what follows
  shift 2
  local limit=$(($(left) - reserve))
  if ((limit < 30)); then echo "skipped ($limit s left): $*" | tee "$out/$log"; return 1; fi
  echo "== $* (at most $limit s)"
  timeout "$limit" bash benchmarks/gpu_machine.sh run "$@" 2>&1 | tee "$out/$log"
  echo "== exit ${PIPESTATUS[0]} after $((SECONDS - t0)) s"
}

bash benchmarks/gpu_machine.sh install "$part" 2>&1 | tee "$out/install.log"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv \
  | tee "$out/gpu.txt"
echo "installed after $((SECONDS - t0)) s"

in_time 240 tests.log python3 -m pytest -m gpu tests/test_gpu.py -p no:cacheprovider -q -rA
in_time 10 bench_bf16.log python3 benchmarks/bench.py --device gpu --dtype bfloat16 \
  --impl toymlx mlx-lm torch --rounds 5 --json "$out/gpu_bf16.json"
in_time 10 decode.log python3 benchmarks/decode.py
in_time 5 bench_f32.log python3 benchmarks/bench.py --device gpu --dtype float32 \
  --impl toymlx mlx-lm torch --rounds 3 --json "$out/gpu_f32.json"
echo "session done after $((SECONDS - t0)) s"
