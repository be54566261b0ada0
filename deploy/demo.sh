#!/usr/bin/env bash
# The main job: build, start rollout-server on the embedded default model, run a sample rollout
# against it over gRPC (tokens and logprobs printed), then stop the server.
# Environment: ROLLOUT_PORT (default 50051), ROLLOUT_METRICS_PORT (default 9400; 0 turns the
# metrics endpoint off), for a machine where those are taken.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
port=${ROLLOUT_PORT:-50051}
metrics_port=${ROLLOUT_METRICS_PORT:-9400}
bash "$root/deploy/build.sh" rollout-server rollout-cli rollout-make-model
bin="$root/build/bin"
log=$(mktemp /tmp/rollout-server.XXXXXX.log)
"$bin/rollout-server" --port "$port" --metrics_port "$metrics_port" >"$log" 2>&1 &
server_pid=$!
trap 'kill -TERM $server_pid 2>/dev/null || true; wait $server_pid 2>/dev/null || true' EXIT
echo "rollout-server started (pid $server_pid, log $log); waiting for it to listen on :$port"
for _ in $(seq 1 120); do
  if grep -q "listening on port" "$log"; then break; fi
  if ! kill -0 $server_pid 2>/dev/null; then cat "$log"; echo "rollout-server exited"; exit 1; fi
  sleep 0.5
done
grep -E "loaded|listening" "$log" | sed 's/^[^]]*] /  server: /'
echo
"$bin/rollout-cli" --server "127.0.0.1:$port" info
echo
echo "$ rollout-cli generate --prompt 11,42,7,300,1999 --samples 2 --seed 7 --temperature 0.7 --top_p 0.9 --max_new_tokens 12 --top_logprobs 2"
"$bin/rollout-cli" --server "127.0.0.1:$port" --prompt 11,42,7,300,1999 --samples 2 --seed 7 \
  --temperature 0.7 --top_p 0.9 --max_new_tokens 12 --top_logprobs 2 generate
