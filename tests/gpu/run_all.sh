#!/usr/bin/env bash
# Runs the CUDA backend's proofs and benchmarks on a GPU machine, from the repository root, with
# binaries built elsewhere and bundled in .gpu/ (docs/cuda.md: "Running on a GPU host").
# Logs go to $OUT (default /tmp/rollout-gpu). Each step is time-boxed; a failing step does not
# stop the later ones. Steps: STEPS="hf test sweep bench" (default: all).
set -uo pipefail
OUT=${OUT:-/tmp/rollout-gpu}
STEPS=${STEPS:-"hf test sweep bench"}
BENCH_ARGS=${BENCH_ARGS:-}
mkdir -p "$OUT"
source .gpu/env.sh .gpu/lib
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
date -u +%Y-%m-%dT%H:%MZ >> "$OUT/gpu.txt"

if [[ " $STEPS " == *" hf "* ]]; then
  timeout 300 python3 tests/gpu/make_hf_reference.py /tmp/hf-ref > "$OUT/hf_reference.log" 2>&1
  echo "make_hf_reference: rc $?"; tail -3 "$OUT/hf_reference.log"
fi
if [[ " $STEPS " == *" test "* ]]; then
  ROLLOUT_HF_REFERENCE=/tmp/hf-ref timeout ${TEST_TIMEOUT:-300} .gpu/bin/rollout_gpu_test \
    ${TEST_FILTER:+--gtest_filter=$TEST_FILTER} > "$OUT/gpu_test.log" 2>&1
  echo "rollout_gpu_test: rc $?"; grep -E "^\[  (PASSED|FAILED) |^\[  FAILED|tests? ran" "$OUT/gpu_test.log"
fi
if [[ " $STEPS " == *" sweep "* ]]; then
  timeout ${SWEEP_TIMEOUT:-120} .gpu/bin/rollout-gemm-sweep > "$OUT/gemm_sweep.log" 2>&1
  echo "rollout-gemm-sweep: rc $?"
fi
if [[ " $STEPS " == *" bench "* ]]; then
  timeout ${BENCH_TIMEOUT:-420} .gpu/bin/rollout-bench $BENCH_ARGS > "$OUT/bench.log" 2>&1
  echo "rollout-bench: rc $?"; grep -E "RESULT|REPLAY|floor|batch-1|TIMEOUT" "$OUT/bench.log"
fi
