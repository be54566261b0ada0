#!/usr/bin/env bash
# The runs of the several-GPU issue in one command, for a host with 2, 4 or 8 H200s (docs/cuda.md,
# "Several GPUs"), most important first, each time-boxed (a failing step does not stop the later
# ones), logs in $OUT. From the repository root with .gpu/ bundled (docs/cuda.md, "Running on a GPU
# host": rollout_gpu_test, e2e_test, rollout-bench, rollout-server, rollout-cli,
# rollout-make-model, the module and librollout_trainer_cuda_ops.so; for the broadcast step what
# tests/gpu/nccl_broadcast.sh needs):
#   OUT=/tmp/out bash tests/gpu/multi_gpu.sh
#   STEPS="probe determinism bench8b bench32b trainer broadcast" (the default: all of them)
# Steps:
#   probe:       rollout_gpu_test TpMultiGpuTest.* -- the fixed probe sets (small, Qwen2-style,
#                Qwen3-8B shapes) with rank r on GPU r through NCCL at TP 2, 4, 8 (as many as
#                there are GPUs), logits and sampled rows bitwise TP 1's on one GPU.
#   determinism: the determinism suite's TP test against cuda servers at every degree the host
#                allows, ranks on separate GPUs (ROLLOUT_TEST_CUDA_SPREAD=1).
#   bench8b:     rollout-bench, Qwen3-8B, 256 x 1024/1024: TP 1 on GPU 0, then TP 2 on GPUs 0,1,
#                each beside its floor (across GPUs: each GPU's share + the all-gathers at the
#                measured peer copy rate).
#   bench32b:    rollout-bench --preset qwen3-32b at TP 2 and TP 4 (when there are 4 GPUs).
#   trainer:     tests/gpu/trainer_parity.sh, small preset, trainer TP 2 and 4 with one GPU per
#                rank over NCCL against Generate, bitwise.
#   broadcast:   tests/gpu/nccl_broadcast.sh (the trainer on GPU 0, servers on the others).
# BENCH_ARGS: more rollout-bench flags for both bench steps.
set -uo pipefail
OUT=${OUT:-/tmp/rollout-multi}
STEPS=${STEPS:-"probe determinism bench8b bench32b trainer broadcast"}
BENCH_ARGS=${BENCH_ARGS:-"--replay=false --batch1_tokens=0"}
mkdir -p "$OUT"
source .gpu/env.sh .gpu/lib
export NCCL_NVLS_ENABLE=0  # the GPU host requires NVLink multicast off
gpus=$(nvidia-smi -L | wc -l)
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv | tee "$OUT/gpus.txt"
nvidia-smi topo -m > "$OUT/topology.txt" 2>&1
date -u +%Y-%m-%dT%H:%MZ >> "$OUT/gpus.txt"
echo "multi_gpu: $gpus GPUs"
if [ "$gpus" -lt 2 ]; then
  echo "multi_gpu: needs at least 2 GPUs"
  exit 1
fi
degrees=1
for d in 2 4 8; do [ "$d" -le "$gpus" ] && degrees="$degrees,$d"; done
devices() { seq -s, 0 $(($1 - 1)); }

if [[ " $STEPS " == *" probe "* ]]; then
  timeout ${PROBE_TIMEOUT:-600} .gpu/bin/rollout_gpu_test --gtest_filter='TpMultiGpuTest.*' \
    > "$OUT/probe.log" 2>&1
  echo "probe (TpMultiGpuTest): rc $?"
  grep -E "^\[ multi|^\[  (PASSED|FAILED) |^\[  FAILED|SKIPPED" "$OUT/probe.log"
fi
if [[ " $STEPS " == *" determinism "* ]]; then
  ROLLOUT_TEST_BACKEND=cuda ROLLOUT_TEST_CUDA_SPREAD=1 ROLLOUT_TEST_TP_DEGREES=$degrees \
    ROLLOUT_CLI_BIN=$(pwd)/.gpu/bin/rollout-cli timeout ${DETERMINISM_TIMEOUT:-900} \
    .gpu/bin/e2e_test --gtest_filter='DeterminismTest.TensorParallel*' \
    > "$OUT/determinism.log" 2>&1
  echo "determinism at TP $degrees across GPUs: rc $?"
  grep -E "over TP|^\[  (PASSED|FAILED) |^\[  FAILED" "$OUT/determinism.log"
fi
bench() {  # name, then rollout-bench flags
  local name=$1
  shift
  timeout ${BENCH_TIMEOUT:-600} .gpu/bin/rollout-bench $BENCH_ARGS "$@" > "$OUT/bench_$name.log" 2>&1
  echo "rollout-bench $name ($*): rc $?"
  grep -E "peer copy|as streams|^floor|RESULT|x the floor|TIMEOUT|FAILED|lost" "$OUT/bench_$name.log"
}
if [[ " $STEPS " == *" bench8b "* ]]; then
  bench qwen3-8b-tp1 --preset qwen3-8b
  bench qwen3-8b-tp2 --preset qwen3-8b --tp 2 --cuda_devices "$(devices 2)"
fi
if [[ " $STEPS " == *" bench32b "* ]]; then
  bench qwen3-32b-tp2 --preset qwen3-32b --tp 2 --cuda_devices "$(devices 2)"
  [ "$gpus" -ge 4 ] && bench qwen3-32b-tp4 --preset qwen3-32b --tp 4 --cuda_devices "$(devices 4)"
fi
if [[ " $STEPS " == *" trainer "* ]]; then
  tps=2
  [ "$gpus" -ge 4 ] && tps=2,4
  PRESETS=small OUT=$OUT/trainer \
    SMALL_ARGS="--prompts 8 --samples 4 --prompt_len 96 --new_tokens 160 --microbatch 8 --grad_check --trainer_tp $tps" \
    timeout ${TRAINER_TIMEOUT:-600} bash tests/gpu/trainer_parity.sh > "$OUT/trainer.log" 2>&1
  echo "trainer TP $tps over NCCL: rc $?"
  grep -E "^CHECK trainer TP|trainer TP [0-9] \(|^SUMMARY" "$OUT/trainer.log"
fi
if [[ " $STEPS " == *" broadcast "* ]]; then
  OUT=$OUT/broadcast timeout ${BROADCAST_TIMEOUT:-900} bash tests/gpu/nccl_broadcast.sh \
    > "$OUT/broadcast.log" 2>&1
  echo "nccl_broadcast: rc $?"
  grep -E "P2P_FLOOR|GB/s per receiving|nccl_broadcast: (PASS|FAIL)" "$OUT/broadcast.log"
fi
