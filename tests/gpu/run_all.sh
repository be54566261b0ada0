#!/usr/bin/env bash
# Runs the CUDA backend's proofs and benchmarks on a GPU machine, from the repository root, with
# binaries built elsewhere and bundled in .gpu/ (docs/cuda.md: "Running on a GPU host").
# Logs go to $OUT (default /tmp/rollout-gpu). Each step is time-boxed; a failing step does not
# stop the later ones. Steps: STEPS="hf test attn digest bits sweep bench e2e grpc weights moe
# trainer limits" (default: hf test sweep bench).
#   attn: rollout-attention-bench (bit checks: prefill = decode; decode timings to ~16K).
#   digest: rollout-digest-bench (the device weight digest of Qwen3-8B's 16.4 GB, validated
#         against the host digest, beside the copy rate and the host digest rate).
#   bits: tests/gpu/same_bits.sh .gpu/base .gpu (a previous build, bundled in .gpu/base, against
#         this one: every token id and logprob of the same rollouts compared).
#   e2e:  the end-to-end suites (e2e_test) against servers on the CUDA backend (E2E_FILTER).
#   grpc: writes a Qwen3-8B-shaped checkpoint (rollout-make-model), serves it with rollout-server
#         --backend cuda (its default limits; more flags in GRPC_SERVER_ARGS) and runs
#         rollout-grpc-bench against it (GRPC_ARGS).
#   weights: rollout-weight-bench --backend cuda on the same checkpoint (written if missing):
#         updates of every Qwen3-8B tensor over loopback gRPC, the split and the copy floors
#         (WEIGHTS_ARGS).
#   moe:  rollout-moe-bench (one Qwen3-30B-A3B MoE layer, kernel by kernel, beside the floor of
#         the experts it touches read once; MOE_ARGS), then rollout-bench --preset qwen3-30b-a3b
#         (the MoE floor, the step shares of routing / grouping / expert GEMMs; MOE_BENCH_ARGS).
#   trainer: tests/gpu/trainer_parity.sh for TRAINER_PRESETS (default "small moe-small"): the
#         trainer's logprobs (CudaQwen3Model, CudaQwen3MoeModel) against Generate and Score,
#         bitwise, routing replay, gradients, trainer TP 2/4 (CudaTpQwen3Model, ranks on this
#         GPU over gloo) against Generate (needs rollout-server, rollout-cli,
#         rollout-make-model, the module and librollout_trainer_cuda_ops.so in .gpu/).
#   limits: rollout_gpu_test's LimitsTest.* (256 samples to the whole 40,960-token context).
# The whole rollout_gpu_test outlasts one 10-minute command: shard it with GoogleTest's
# GTEST_TOTAL_SHARDS / GTEST_SHARD_INDEX (passed through to it), one shard a command.
set -uo pipefail
OUT=${OUT:-/tmp/rollout-gpu}
STEPS=${STEPS:-"hf test sweep bench"}
BENCH_ARGS=${BENCH_ARGS:-}
mkdir -p "$OUT"
source .gpu/env.sh .gpu/lib
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
date -u +%Y-%m-%dT%H:%MZ >> "$OUT/gpu.txt"

# transformers references: plain Qwen3, Llama 3.1-style (llama3 RoPE scaling), Qwen3 + YaRN,
# Qwen3-MoE (/tmp/hf-ref-moe).
HF_REFERENCES=/tmp/hf-ref:/tmp/hf-ref-llama3:/tmp/hf-ref-yarn:/tmp/hf-ref-moe
if [[ " $STEPS " == *" hf "* ]]; then
  for arch in qwen3 llama3 yarn qwen3moe; do
    dir=/tmp/hf-ref; [[ $arch == qwen3 ]] || dir=/tmp/hf-ref-$arch
    [[ $arch == qwen3moe ]] && dir=/tmp/hf-ref-moe
    timeout 300 python3 tests/gpu/make_hf_reference.py $dir $arch > "$OUT/hf_reference_$arch.log" 2>&1
    echo "make_hf_reference $arch: rc $?"; tail -1 "$OUT/hf_reference_$arch.log"
  done
fi
if [[ " $STEPS " == *" test "* ]]; then
  ROLLOUT_HF_REFERENCE=$HF_REFERENCES timeout ${TEST_TIMEOUT:-300} .gpu/bin/rollout_gpu_test \
    ${TEST_FILTER:+--gtest_filter=$TEST_FILTER} > "$OUT/gpu_test.log" 2>&1
  echo "rollout_gpu_test: rc $?"; grep -E "^\[  (PASSED|FAILED) |^\[  FAILED|tests? ran" "$OUT/gpu_test.log"
fi
if [[ " $STEPS " == *" attn "* ]]; then
  timeout ${ATTN_TIMEOUT:-300} .gpu/bin/rollout-attention-bench > "$OUT/attention_bench.log" 2>&1
  echo "rollout-attention-bench: rc $?"; grep -E "bitwise equal|== decode|new .*of copy" "$OUT/attention_bench.log" | tail -16
fi
if [[ " $STEPS " == *" digest "* ]]; then
  timeout ${DIGEST_TIMEOUT:-300} .gpu/bin/rollout-digest-bench ${DIGEST_ARGS:-} \
    > "$OUT/digest_bench.log" 2>&1
  echo "rollout-digest-bench: rc $?"; grep -E "^RESULT|validation|MISMATCH" "$OUT/digest_bench.log"
fi
if [[ " $STEPS " == *" bits "* ]]; then
  timeout ${BITS_TIMEOUT:-300} bash tests/gpu/same_bits.sh .gpu/base .gpu "$OUT/same-bits" \
    > "$OUT/same_bits.log" 2>&1
  echo "same_bits: rc $?"; tail -2 "$OUT/same_bits.log"
fi
if [[ " $STEPS " == *" sweep "* ]]; then
  timeout ${SWEEP_TIMEOUT:-120} .gpu/bin/rollout-gemm-sweep > "$OUT/gemm_sweep.log" 2>&1
  echo "rollout-gemm-sweep: rc $?"
fi
if [[ " $STEPS " == *" e2e "* ]]; then
  ROLLOUT_TEST_BACKEND=cuda ROLLOUT_CLI_BIN=$(pwd)/.gpu/bin/rollout-cli \
    timeout ${E2E_TIMEOUT:-300} .gpu/bin/e2e_test \
    --gtest_filter="${E2E_FILTER:-Determinism*:TensorParallelServer*:ReliabilityMetrics*:GenerateE2e*}" \
    > "$OUT/e2e_cuda.log" 2>&1
  echo "e2e_test (cuda backend): rc $?"; grep -E "^\[  (PASSED|FAILED) |^\[  FAILED" "$OUT/e2e_cuda.log"
fi
if [[ " $STEPS " == *" grpc "* ]]; then
  model=${GRPC_MODEL_DIR:-/tmp/rollout-qwen3-8b}
  if [[ ! -f $model/config.json ]]; then
    /usr/bin/time -f "make-model %e s" timeout 300 .gpu/bin/rollout-make-model --preset qwen3-8b \
      --out "$model" > "$OUT/make_model.log" 2>&1
    tail -1 "$OUT/make_model.log"
  fi
  # The cuda backend's default limits (256 running, 16384 tokens per step, pages of 32, split
  # 256, KV from free memory) are the benchmark's configuration.
  .gpu/bin/rollout-server --backend cuda --model "$model" --port 50151 --metrics_port 9491 \
    ${GRPC_SERVER_ARGS:-} > "$OUT/grpc_server.log" 2>&1 &
  server=$!
  for _ in $(seq 1 600); do
    grep -q "listening on port" "$OUT/grpc_server.log" && break
    kill -0 $server 2>/dev/null || break
    sleep 0.5
  done
  grep -E "loaded|listening|metrics" "$OUT/grpc_server.log" | tail -3
  timeout ${GRPC_TIMEOUT:-300} .gpu/bin/rollout-grpc-bench --target 127.0.0.1:50151 ${GRPC_ARGS:-} \
    > "$OUT/grpc_bench.log" 2>&1
  echo "rollout-grpc-bench: rc $?"; grep -A3 RESULT "$OUT/grpc_bench.log"
  curl -s localhost:9491/metrics > "$OUT/grpc_metrics.txt" 2>/dev/null || true
  kill -TERM $server; wait $server; echo "rollout-server exit: $?"
fi
if [[ " $STEPS " == *" weights "* ]]; then
  timeout ${WEIGHTS_TIMEOUT:-420} .gpu/bin/rollout-weight-bench --backend cuda --preset qwen3-8b \
    --model_dir "${GRPC_MODEL_DIR:-/tmp/rollout-qwen3-8b}" ${WEIGHTS_ARGS:-} \
    > "$OUT/weight_bench.log" 2>&1
  echo "rollout-weight-bench: rc $?"; grep -E "^floors|^wrote|^update|RESULT|split:|served digest" \
    "$OUT/weight_bench.log"
fi
if [[ " $STEPS " == *" bench "* ]]; then
  timeout ${BENCH_TIMEOUT:-420} .gpu/bin/rollout-bench $BENCH_ARGS > "$OUT/bench.log" 2>&1
  echo "rollout-bench: rc $?"; grep -E "RESULT|REPLAY|floor|batch-1|TIMEOUT" "$OUT/bench.log"
fi
if [[ " $STEPS " == *" trainer "* ]]; then
  PRESETS=${TRAINER_PRESETS:-"small moe-small"} OUT=$OUT/trainer \
    timeout ${TRAINER_TIMEOUT:-600} bash tests/gpu/trainer_parity.sh > "$OUT/trainer_parity.log" 2>&1
  echo "trainer_parity: rc $?"; grep -E "^SUMMARY|^FAILED|rc [0-9]" "$OUT/trainer_parity.log"
fi
if [[ " $STEPS " == *" limits "* ]]; then
  timeout ${LIMITS_TIMEOUT:-300} .gpu/bin/rollout_gpu_test --gtest_filter='LimitsTest.*' \
    > "$OUT/limits_test.log" 2>&1
  echo "LimitsTest: rc $?"; grep -E "^loaded|samples x|^\[  (PASSED|FAILED) " "$OUT/limits_test.log"
fi
if [[ " $STEPS " == *" moe "* ]]; then
  timeout ${MOE_TIMEOUT:-300} .gpu/bin/rollout-moe-bench ${MOE_ARGS:-} > "$OUT/moe_bench.log" 2>&1
  echo "rollout-moe-bench: rc $?"; tail -20 "$OUT/moe_bench.log"
  timeout ${MOE_BENCH_TIMEOUT:-600} .gpu/bin/rollout-bench --preset qwen3-30b-a3b ${MOE_BENCH_ARGS:-} \
    > "$OUT/bench_moe.log" 2>&1
  echo "rollout-bench qwen3-30b-a3b: rc $?"
  grep -E "RESULT|REPLAY|floor|batch-1|TIMEOUT|MoE|moe " "$OUT/bench_moe.log"
fi
