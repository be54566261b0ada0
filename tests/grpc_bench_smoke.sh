#!/usr/bin/env bash
# ctest: rollout-grpc-bench against the real rollout-server binary on the embedded default model
# (a small workload): the benchmark must complete every request with the asked number of tokens
# and print its RESULT line. Usage: grpc_bench_smoke.sh BIN_DIR
set -euo pipefail
bin=$1
log=$(mktemp /tmp/rollout-grpc-bench-smoke.XXXXXX.log)
"$bin/rollout-server" --port 0 --metrics_port 0 >"$log" 2>&1 &
pid=$!
trap 'kill -TERM $pid 2>/dev/null || true; wait $pid 2>/dev/null || true; rm -f "$log"' EXIT
port=""
for _ in $(seq 1 240); do
  port=$(sed -n 's/.*listening on port \([0-9]*\).*/\1/p' "$log" | head -1)
  [[ -n $port ]] && break
  if ! kill -0 $pid 2>/dev/null; then cat "$log"; echo "rollout-server exited"; exit 1; fi
  sleep 0.25
done
[[ -n $port ]] || { cat "$log"; echo "rollout-server did not listen"; exit 1; }
out=$("$bin/rollout-grpc-bench" --target "127.0.0.1:$port" --num_requests 24 --input_len 40 \
  --output_len 12 --concurrency 6 --progress_s 0)
echo "$out"
grep -q "^RESULT grpc 24 x 40/12: " <<<"$out"
grep -q "24 of 24 requests completed with 12 tokens" <<<"$out"
