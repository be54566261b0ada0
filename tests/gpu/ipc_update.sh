#!/usr/bin/env bash
# The CUDA IPC weight update on a GPU host, end to end (issue 17 item 2; docs/cuda.md, "Weight
# updates from a colocated trainer"). From the repository root, with .gpu/ bundled as docs/cuda.md
# says (bin: rollout-server rollout-cli rollout-make-model e2e_test rollout_gpu_test
# rollout-ipc-exporter; lib: their libraries and librollout_cuda_backend.so):
#   OUT=/tmp/out bash tests/gpu/ipc_update.sh
# Steps (each time-boxed; a failing one does not stop the later ones):
#   1. two Qwen3-8B-shaped checkpoints (PRESET), A (seed 1) and B (seed 2), by rollout-make-model;
#   2. rollout-server --backend cuda on A; a fixed Generate probe;
#   3. tests/gpu/ipc_trainer.py (torch) loads B onto the GPU and sends it by CUDA IPC through
#      rollout-cli, twice (a tensor per allocation, then one packed buffer), printing seconds,
#      GB/s and the copy floor measured in the same run; the probe again;
#   4. a fresh rollout-server started on B: its ServerInfo digest and the probe;
#   5. checks: both IPC updates report B's digest, the probe after the IPC update equals the fresh
#      server's bitwise (tokens and logprobs) and differs from A's;
#   6. the GPU unit tests (rollout_gpu_test --gtest_filter='IpcTest.*') and the end-to-end IPC
#      suite against a cuda server (e2e_test --gtest_filter='WeightsIpc*').
# STEPS picks parts: "update" (1-5) and "tests" (6); default both. A Qwen3-8B run writes 33 GB
# of checkpoints under WORK (kept for the next run) and needs ~45 GB of GPU memory.
# Prints IPC_UPDATE / COPY_FLOOR lines and "ipc_update: PASS" or "ipc_update: FAIL (...)".
set -uo pipefail
STEPS=${STEPS:-"update tests"}
OUT=${OUT:-/tmp/rollout-ipc}
PRESET=${PRESET:-qwen3-8b}   # PRESET=small: a quick run of the same steps
WORK=${WORK:-/tmp/rollout-ipc-work-$PRESET}
KV_MB=${KV_MB:-8192}   # leave the trainer room on the GPU
PORT=${PORT:-50171}
mkdir -p "$OUT" "$WORK"
trainer_ld=${LD_LIBRARY_PATH:-}  # torch runs with the host's libraries, not the bundle's
source .gpu/env.sh .gpu/lib
bin=.gpu/bin
failures=()
fail() { failures+=("$1"); echo "FAIL: $1"; }

nvidia-smi --query-gpu=name,uuid,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
gpu_uuid=$(nvidia-smi --query-gpu=uuid --format=csv,noheader -i 0 | tr -d ' ')

if [[ " $STEPS " == *" update "* ]]; then
for seed in 1 2; do
  dir=$WORK/ckpt-$seed
  if [[ ! -f $dir/config.json ]]; then
    /usr/bin/time -f "make-model seed $seed: %e s" timeout 600 $bin/rollout-make-model \
      --preset "$PRESET" --seed $seed --out "$dir" > "$OUT/make_model_$seed.log" 2>&1 ||
      fail "rollout-make-model seed $seed"
    tail -1 "$OUT/make_model_$seed.log"
  fi
done

server_pid=
start_server() {  # model dir, log name
  $bin/rollout-server --backend cuda --model "$1" --port $PORT --metrics_port 0 \
    --kv_cache_mb $KV_MB --weight_version boot > "$OUT/$2.log" 2>&1 &
  server_pid=$!
  for _ in $(seq 1 600); do
    grep -q "listening on port" "$OUT/$2.log" && return 0
    kill -0 $server_pid 2>/dev/null || break
    sleep 0.5
  done
  tail -5 "$OUT/$2.log"
  return 1
}
stop_server() {
  [[ -n $server_pid ]] && kill -TERM $server_pid && wait $server_pid
  server_pid=
}
cli() { $bin/rollout-cli --server=127.0.0.1:$PORT "$@"; }
# The probe's completions as "rollout sample: token ids | logprobs" lines (the JSON floats are
# float32's round-trip digits: equal lines mean equal bits).
probe() {
  cli --prompt 11,22,33,44,55,66,77 --samples 3 --seed 7 --temperature 0.8 \
    --max_new_tokens 32 --ignore_eos --json generate |
    python3 -c '
import json, sys
for line in sys.stdin:
    c = json.loads(line).get("completion")
    if c:
        print(c["rollout_index"], c["sample_index"], c["token_ids"], "|", c["logprobs"])' |
    sort > "$OUT/$1.txt"
  [[ -s $OUT/$1.txt ]] || fail "probe $1 returned nothing"
}
digest() { cli --json info | python3 -c 'import json,sys; print(json.load(sys.stdin)["weight_digest"])'; }

# --- 2, 3: the IPC updates into a server on A.
if start_server "$WORK/ckpt-1" server_a; then
  grep -E "memory plan|listening" "$OUT/server_a.log" | tail -2
  probe probe_a
  printf '#!/bin/sh\nexport LD_LIBRARY_PATH=%q\nexec %q "$@"\n' "$LD_LIBRARY_PATH" \
    "$(pwd)/$bin/rollout-cli" > "$WORK/cli.sh"
  chmod +x "$WORK/cli.sh"
  LD_LIBRARY_PATH=$trainer_ld timeout 900 python3 tests/gpu/ipc_trainer.py \
    --checkpoint "$WORK/ckpt-2" --server 127.0.0.1:$PORT --cli "$WORK/cli.sh" --version ipc \
    --work "$WORK" --results "$OUT/trainer.json" 2>&1 | tee "$OUT/trainer.log" |
    grep -E "IPC_UPDATE|COPY_FLOOR|PAUSE_UPDATE_RESUME|packed|loaded|TRAINER|torch|Error|error"
  grep -q "TRAINER OK" "$OUT/trainer.log" || fail "the trainer's updates"
  probe probe_ipc
  ipc_digest=$(digest)
  grep -E "weights updated|IPC weight update" "$OUT/server_a.log" | tail -3
  stop_server
else
  fail "rollout-server on checkpoint A did not start"
fi

# --- 4: a fresh server on B.
if start_server "$WORK/ckpt-2" server_b; then
  probe probe_b
  fresh_digest=$(digest)
  stop_server
else
  fail "rollout-server on checkpoint B did not start"
fi

# --- 5: the checks.
echo "digest after the IPC updates: ${ipc_digest:-?}"
echo "digest of a fresh server on B: ${fresh_digest:-?}"
[[ -n ${ipc_digest:-} && ${ipc_digest:-} == "${fresh_digest:-}" ]] || fail "digests differ"
if [[ -f $OUT/trainer.json ]]; then
  python3 - "$OUT/trainer.json" "${fresh_digest:-}" <<'EOF' || fail "a reported digest is not B's"
import json, sys
r = json.load(open(sys.argv[1]))
for u in r["updates"]:
    print(f"  {u['layout']}: {u.get('digest')} {'==' if u.get('digest') == sys.argv[2] else '!='} fresh")
sys.exit(0 if all(u.get("digest") == sys.argv[2] for u in r["updates"]) else 1)
EOF
fi
if cmp -s "$OUT/probe_ipc.txt" "$OUT/probe_b.txt"; then
  echo "probe after the IPC update == probe of a fresh server on B (tokens and logprob bits)"
else
  fail "probe after the IPC update differs from a fresh server on B"
  diff "$OUT/probe_ipc.txt" "$OUT/probe_b.txt" | head -5
fi
cmp -s "$OUT/probe_a.txt" "$OUT/probe_ipc.txt" && fail "the IPC update changed no output"
fi

# --- 6: the unit and end-to-end suites.
if [[ " $STEPS " == *" tests "* ]]; then
timeout 600 $bin/rollout_gpu_test --gtest_filter='IpcTest.*' > "$OUT/gpu_test_ipc.log" 2>&1 ||
  fail "rollout_gpu_test IpcTest.*"
grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[  FAILED" "$OUT/gpu_test_ipc.log"
ROLLOUT_TEST_BACKEND=cuda ROLLOUT_TEST_GPU_UUID=$gpu_uuid ROLLOUT_CLI_BIN=$(pwd)/$bin/rollout-cli \
  timeout 600 $bin/e2e_test \
  --gtest_filter='WeightsIpc*' > "$OUT/e2e_ipc.log" 2>&1 || fail "e2e_test WeightsIpc*"
grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[  FAILED" "$OUT/e2e_ipc.log"
fi

if [[ ${#failures[@]} -eq 0 ]]; then
  echo "ipc_update: PASS"
else
  echo "ipc_update: FAIL (${failures[*]})"
  exit 1
fi
