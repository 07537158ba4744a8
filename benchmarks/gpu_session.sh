#!/usr/bin/env bash
# One lent GPU's checks in one device call, each inside what is left of BUDGET seconds, the
# log ($OUT/session.log) and each step's JSON under $OUT as they are written (so a call cut
# short still brings back what finished; the device tool brings back at most 8 files):
#
#   bash benchmarks/gpu_session.sh .gpu/partN BUDGET      (carry: [".gpu/partN"])
#
# after `bash benchmarks/gpu_machine.sh install .gpu/partK` stored the other parts in earlier
# calls, back to back. It installs (the last part completes the set), then runs:
#   1. benchmarks/ops_ab.py on the 360M LoRA step, with mlx-lm's step in the same rounds: the
#      loss's logits at a GPU's sizes (the default) against the CPU's and 2^26 at a time, and
#      attention kept against recomputed; then one step of each under the CUDA profiler (the
#      kernels each launches);
#   2. the same for ViT-Tiny 224 against PyTorch eager: attention padded to 128 rows (MLX's
#      fused CUDA backward) against the default;
#   3. the `gpu`-marked tests (tests/test_gpu.py);
#   4. benchmarks/bench.py --device gpu in bfloat16 on the workloads 1-2 left out: the 135M
#      LoRA step against mlx-lm and PyTorch, from-scratch 360M against PyTorch;
#   5. with time left: benchmarks/decode.py, then the whole bench in float32.
# Session 19 (an H200) ran an older plan in 575 s: 30 s of install, 148 s of tests (most of it
# MLX's kernel JIT), 268 s of the bfloat16 suite (a first LoRA step of 96 s), 55 s of decode.py.
set -uo pipefail

part=${1:?usage: gpu_session.sh .gpu/partN BUDGET_SECONDS}
budget=${2:?usage: gpu_session.sh .gpu/partN BUDGET_SECONDS}
out=${OUT:-/tmp/toymlx-gpu-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
t0=$SECONDS
left() { echo $((budget - (SECONDS - t0))); }
log=$out/session.log
in_time() {  # in_time RESERVE COMMAND...: run COMMAND under gpu_machine.sh, killed so that
  local reserve=$1  # RESERVE seconds of the budget stay for what follows
  shift
  local limit=$(($(left) - reserve))
  if ((limit < 30)); then echo "== skipped ($limit s left): $*" | tee -a "$log"; return 1; fi
  echo "== $* (at most $limit s)" | tee -a "$log"
  timeout "$limit" bash benchmarks/gpu_machine.sh run "$@" 2>&1 | tee -a "$log"
  echo "== exit ${PIPESTATUS[0]} after $((SECONDS - t0)) s" | tee -a "$log"
}

bash benchmarks/gpu_machine.sh install "$part" 2>&1 | tee -a "$log"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv \
  | tee -a "$log"
echo "installed after $((SECONDS - t0)) s" | tee -a "$log"

in_time 260 python3 benchmarks/ops_ab.py --device gpu --dtype bfloat16 \
  --only lora-q-360m-8x512 --variants default cpu-logits logits-2^26 keep-attention \
  --peers mlx-lm --profile --rounds 5 --json "$out/ab_lora.json"
in_time 170 python3 benchmarks/ops_ab.py --device gpu --dtype bfloat16 \
  --only vit-tiny-224 --variants default padded-attention --peers torch --profile --rounds 5 \
  --json "$out/ab_vit.json"
in_time 60 python3 -m pytest -m gpu tests/test_gpu.py -p no:cacheprovider -q -rA
in_time 10 python3 benchmarks/bench.py --device gpu --dtype bfloat16 \
  --only lora-q-135m-8x512 scratch-360m-8x1024 --impl toymlx mlx-lm torch --rounds 4 \
  --json "$out/gpu_bf16.json"
in_time 10 python3 benchmarks/decode.py
in_time 5 python3 benchmarks/bench.py --device gpu --dtype float32 \
  --impl toymlx mlx-lm torch --rounds 4 --json "$out/gpu_f32.json"
echo "session done after $((SECONDS - t0)) s" | tee -a "$log"
# MLX's PTX cache for the next lent machine: save it here as gpu_machine.sh's PTX_CACHE
tar czf "$out/mlx_ptx.tgz" -C "${TMPDIR:-/tmp}" mlx 2>/dev/null || true
