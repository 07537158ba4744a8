#!/usr/bin/env bash
# A lent GPU's checks for issue 50 in one device call, in priority order, each step capped in
# time and none past BUDGET seconds; the log ($OUT/session.log) and each step's JSON are written
# under $OUT as they go (bench.py rewrites its JSON after every workload), so a call cut short
# still brings back what finished. The device tool brings back at most 8 files: the 6 below and
# up to 2 kernel-cache pieces (session 53's: one, 11 MB).
#
# The plan for 15 minutes of device time (all calls together; a machine idle ~30 s goes back):
#   status                                    free: is a machine lent to this task at all?
#   call 1: bash benchmarks/gpu_machine.sh install .gpu/part1      carry [".gpu/part1"]
#           timeout_s 60; ~60-120 s of machine start + ~5 s (stores the piece)
#   call 2, AT ONCE (have it typed before call 1 returns):
#           bash benchmarks/gpu_session.sh .gpu/part2 540           carry [".gpu/part2"]
#           timeout_s 600; ~20 s of transfer + 540 s + ~20 s for the kernel caches
#   give_back at once (the idle wait counts).      Total ~12.5 of the 15 minutes.
#   (Session 53: the machine started in 31 s, so ~4.5 minutes were left after call 2 on the
#   still-warm machine: two more calls, each `gpu_machine.sh run ...` with no install, ran
#   what call 2 had not reached. Have them typed too.)
#   Where call 2 says "nothing installed" (the machine went back between the calls and a fresh
#   one lacks part1), it ends at once: calls 1 and 2 again, with a smaller BUDGET to fit.
# The working tree travels with each part: part1 55.0 MB, part2 56.6 MB (session 42's prepare)
# + the tree (~5 MB), under the tool's 64 MiB; keep untracked files out of the checkout.
# (Where prepare made more parts, every part but the last goes through `install`, back to back,
# and the last through this script.) Here, afterwards: the log and JSON into docs/, and the
# kernel caches joined for the next machine (gpu_machine.sh's header).
#
# The steps (cap / expected seconds; expected from sessions 19, 26 and 53 on an H200, whose first
# compiled LoRA step took 96-146 s of MLX's CUDA kernel builds, ViT-Tiny's 40-104 s and
# from-scratch 360M's 32 s, none of them with a kernel cache carried):
#   0. install (the last part completes the set), nvidia-smi                         - / 10
#   1. from-scratch 360M at 8 x 1024, toymlx against PyTorch eager (bench.py): the
#      gradient norm's reduction (session 53: 158 ms with the product it replaced, 90 ms
#      in session 26)                                        -> scratch_bf16.json  100 / 60
#   2. LoRA in bfloat16, toymlx against mlx-lm, 135M and 360M at 8 x 512 (bench.py;
#      time and peak memory)                                     -> lora_bf16.json  230 / 200
#   3. ViT-Tiny 224 against PyTorch eager (bench.py)              -> vit_bf16.json   150 / 130
#   4. the `gpu`-marked tests (tests/test_gpu.py: every architecture kind and attention
#      width, 69 tests; session 53 ran 29 in ~250 s, most of it kernel builds), each
#      test's line into the log                                                     200 / ?
#   5. memory with a Q4_K_M base: the Llama-3.2-1B-shaped file written (shapes.py, by the
#      llama.cpp and SmolLM2 tokenizer prepare carried; skipped without them), then
#      toymlx-train's LoRA at 1 x 512 on it (memory.py's 1b-1x512 row: MLX's peak, step
#      time, the adapter loaded by llama.cpp)                    -> memory.json  90+120 / 40+80
#   6. decoding token by token, toymlx eager and CompiledDecode against mlx-lm
#      (gpu_decode.py, 135M)                                     -> decode.json      60 / 50
#   7. with time left: float32 LoRA 135M against mlx-lm, then ViT-Tiny 224 against
#      torch.compile (bench.py), their tables into the log                          rest
#   8. MLX's and the driver's kernel caches packed into $OUT for the next machine   (20)
# Not here: memory.py has no mlx-lm row on the 1B/3B/8B shapes, and the 3B and 8B files take
# minutes to write; they need a session of their own.
#
#   bash benchmarks/gpu_session.sh .gpu/partN BUDGET      (carry: [".gpu/partN"])
set -uo pipefail

part=${1:?usage: gpu_session.sh .gpu/partN BUDGET_SECONDS}
budget=${2:?usage: gpu_session.sh .gpu/partN BUDGET_SECONDS}
out=${OUT:-/tmp/toymlx-gpu-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
t0=$SECONDS
left() { echo $((budget - (SECONDS - t0))); }
log=$out/session.log
step() {  # step CAP COMMAND...: COMMAND under gpu_machine.sh, killed after CAP seconds or at
  local cap=$1  # the end of the budget, whichever comes first; skipped with under 30 s left
  # (status 1); else COMMAND's status
  shift
  local limit
  limit=$(left)
  ((limit > cap)) && limit=$cap
  if ((limit < 30)); then echo "== skipped ($limit s left): $*" | tee -a "$log"; return 1; fi
  echo "== $* (at most $limit s)" | tee -a "$log"
  timeout "$limit" bash benchmarks/gpu_machine.sh run "$@" 2>&1 | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  echo "== exit $rc after $((SECONDS - t0)) s" | tee -a "$log"
  return "$rc"
}

# a failed install, or a set still incomplete (a fresh machine: the one that stored the
# earlier parts went back), leaves nothing to run: stop at once, said in the log
if ! bash benchmarks/gpu_machine.sh install "$part" 2>&1 | tee -a "$log" \
    || ! bash benchmarks/gpu_machine.sh run true 2>&1 | tee -a "$log"; then
  echo "== nothing installed after $((SECONDS - t0)) s (above): no step can run" | tee -a "$log"
  exit 1
fi
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv \
  | tee -a "$log"
echo "installed after $((SECONDS - t0)) s" | tee -a "$log"

step 100 python3 benchmarks/bench.py --device gpu --dtype bfloat16 --impl toymlx torch \
  --only scratch-360m-8x1024 --rounds 6 --json "$out/scratch_bf16.json"
step 230 python3 benchmarks/bench.py --device gpu --dtype bfloat16 --impl toymlx mlx-lm \
  --only lora-q-135m-8x512 lora-q-360m-8x512 --rounds 6 --json "$out/lora_bf16.json"
step 150 python3 benchmarks/bench.py --device gpu --dtype bfloat16 --impl toymlx torch \
  --only vit-tiny-224 --rounds 6 --json "$out/vit_bf16.json"
step 200 python3 -m pytest -m gpu tests/test_gpu.py -p no:cacheprovider -v -rfE
if bash benchmarks/gpu_machine.sh run python3 -c "import llama_cpp" 2>/dev/null; then
  step 90 python3 benchmarks/shapes.py llama-3.2-1b \
    && step 120 python3 benchmarks/memory.py --only 1b-1x512 --json "$out/memory.json"
else
  echo "== skipped: memory with a Q4_K_M base (prepare carried no llama-cpp-python)" \
    | tee -a "$log"
fi
step 60 python3 benchmarks/gpu_decode.py --device gpu --only lora-q-135m-8x512 --tokens 128 \
  --rounds 3 --json "$out/decode.json"
step 90 python3 benchmarks/bench.py --device gpu --dtype float32 --impl toymlx mlx-lm \
  --only lora-q-135m-8x512 --rounds 4  # its table in the log: $OUT holds 8 files
step 600 python3 benchmarks/bench.py --device gpu --dtype bfloat16 --impl toymlx torch \
  torch-compile --only vit-tiny-224 --rounds 4  # its table in the log: $OUT holds 8 files
echo "session done after $((SECONDS - t0)) s" | tee -a "$log"
# MLX's and the driver's kernel caches for the next lent machine (gpu_machine.sh's header says
# how to keep them here): up to 3 files (2 fit beside the 6 above in the device tool's 8)
bash benchmarks/gpu_machine.sh kernel-cache "$out/gpu_kernels.tgz" 2>&1 | tee -a "$log" || true
