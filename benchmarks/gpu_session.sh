#!/usr/bin/env bash
# One lent GPU's checks in one device call, each inside what is left of BUDGET seconds, the
# log ($OUT/session.log) and each step's JSON under $OUT as they are written (so a call cut
# short still brings back what finished; the device tool brings back at most 8 files):
#
#   bash benchmarks/gpu_session.sh .gpu/partN BUDGET      (carry: [".gpu/partN"])
#
# after `bash benchmarks/gpu_machine.sh install .gpu/partK` stored the other parts in earlier
# calls, back to back. It installs (the last part completes the set), then runs:
#   1. benchmarks/bench.py --device gpu in bfloat16: every GPU workload against mlx-lm and
#      PyTorch eager in the same rounds (issue 50's table);
#   2. the `gpu`-marked tests (tests/test_gpu.py), then benchmarks/gpu_decode.py: decoding
#      token by token, toymlx eager (what a GPU runs) and CompiledDecode against mlx-lm's;
#   3. benchmarks/ops_ab.py on ViT-Tiny 224 with PyTorch in the same rounds and each row's
#      kernels profiled: attention padded to 128 rows (MLX's fused CUDA backward) against the
#      default; then the 360M LoRA step's logits sizes and attention, with mlx-lm;
#   4. with time left: benchmarks/decode.py, then the bench in float32;
#   5. MLX's and the driver's kernel caches packed into $OUT for the next machine.
# The last part is the one that completes the set: the wheels' last, or the kernel cache's
# where prepare gave it parts of its own.
# Session 26 (an H200) ran ops_ab first: 5 s of install, 180 s for the LoRA comparison (a first
# step of 109 s: MLX's CUDA kernels), 115 s for ViT's (75 s), 68 s of tests, 60 s for two bench
# workloads whose kernels were built, 74 s of decode.py. The kernel caches carried since may
# shorten those first steps.
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

in_time 200 python3 benchmarks/bench.py --device gpu --dtype bfloat16 \
  --impl toymlx mlx-lm torch --rounds 6 --json "$out/gpu_bf16.json"
in_time 110 python3 -m pytest -m gpu tests/test_gpu.py -p no:cacheprovider -q -rA
in_time 90 python3 benchmarks/gpu_decode.py --device gpu \
  --only lora-q-135m-8x512 lora-q-360m-8x512 --tokens 256 --rounds 3 --json "$out/decode.json"
in_time 60 python3 benchmarks/ops_ab.py --device gpu --dtype bfloat16 \
  --only vit-tiny-224 --variants default padded-attention --peers torch --profile --rounds 6 \
  --json "$out/ab_vit.json"
in_time 20 python3 benchmarks/ops_ab.py --device gpu --dtype bfloat16 \
  --only lora-q-360m-8x512 --variants default logits-2^22 logits-2^24 recompute-attention \
  --peers mlx-lm --profile --rounds 6 --json "$out/ab_lora.json"
in_time 10 python3 benchmarks/decode.py
in_time 5 python3 benchmarks/bench.py --device gpu --dtype float32 \
  --impl toymlx mlx-lm torch --rounds 4  # its table in the log: $OUT holds 8 files at most
echo "session done after $((SECONDS - t0)) s" | tee -a "$log"
# MLX's and the driver's kernel caches for the next lent machine (gpu_machine.sh's header says
# how to keep them here): up to 3 files, which with the 5 above is the device tool's 8
bash benchmarks/gpu_machine.sh kernel-cache "$out/gpu_kernels.tgz" 2>&1 | tee -a "$log" || true
