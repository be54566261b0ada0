#!/usr/bin/env bash
# ctest: rollout-grpc-bench against the real rollout-server binary on the embedded default model
# (a small workload): the benchmark must complete every request with the asked number of tokens
# and print its RESULT line. Usage: grpc_bench_smoke.sh BIN_DIR
# Then: a run where requests fail prints no RESULT and exits 1; bad flags exit 2 before any
# call; and a server with mutual TLS is benched with --tls_* flags.
set -euo pipefail
bin=$(cd "$1" && pwd)
work=$(mktemp -d /tmp/rollout-grpc-bench-smoke.XXXXXX)
pids=()
trap 'for p in "${pids[@]}"; do kill -TERM $p 2>/dev/null || true; wait $p 2>/dev/null || true; done
      rm -rf "$work"' EXIT

# start_server LOG ARGS...: starts rollout-server, sets $port once it listens.
start_server() {
  local log=$1
  shift
  "$bin/rollout-server" --port 0 --metrics_port 0 "$@" >"$log" 2>&1 &
  pids+=($!)
  port=""
  for _ in $(seq 1 240); do
    port=$(sed -n 's/.*listening on port \([0-9]*\).*/\1/p' "$log" | head -1)
    [[ -n $port ]] && return 0
    if ! kill -0 "${pids[-1]}" 2>/dev/null; then cat "$log"; echo "rollout-server exited"; exit 1; fi
    sleep 0.25
  done
  cat "$log"
  echo "rollout-server did not listen"
  exit 1
}

start_server "$work/plain.log"
out=$("$bin/rollout-grpc-bench" --target "127.0.0.1:$port" --num_requests 24 --input_len 40 \
  --output_len 12 --concurrency 6 --progress_s 0)
echo "$out"
grep -q "^RESULT grpc 24 x 40/12: " <<<"$out"
grep -q "24 of 24 requests completed with 12 tokens" <<<"$out"

for bad in "--concurrency -1" "--temperature -1" "--temperature nan"; do
  rc=0
  "$bin/rollout-grpc-bench" --target "127.0.0.1:$port" --num_requests 2 --input_len 8 \
    --output_len 4 $bad >"$work/bad.out" 2>&1 || rc=$?
  cat "$work/bad.out"
  [[ $rc == 2 ]] || { echo "$bad: exit $rc, not 2"; exit 1; }
  ! grep -q "^RESULT" "$work/bad.out" || { echo "$bad printed a RESULT"; exit 1; }
done

# One queued sample at a time: of 8 calls at once, some are refused RESOURCE_EXHAUSTED.
start_server "$work/one.log" --max_queued_samples 1
rc=0
"$bin/rollout-grpc-bench" --target "127.0.0.1:$port" --num_requests 8 --input_len 8 \
  --output_len 200 --concurrency 8 --progress_s 0 >"$work/fail.out" 2>&1 || rc=$?
cat "$work/fail.out"
[[ $rc == 1 ]] || { echo "failed requests: exit $rc, not 1"; exit 1; }
grep -q "RESOURCE_EXHAUSTED" "$work/fail.out"
grep -q "^FAILED: [1-7] of 8 requests failed" "$work/fail.out"
! grep -q "^RESULT" "$work/fail.out" || { echo "a run with failed requests printed a RESULT"; exit 1; }

# Mutual TLS: a CA, the server's certificate for 127.0.0.1, a client's.
cd "$work"
openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.crt -days 1 -subj /CN=ca \
  2>/dev/null
for who in server client; do
  openssl req -newkey rsa:2048 -nodes -keyout $who.key -out $who.csr -subj /CN=$who 2>/dev/null
  printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\n' >$who.ext
  openssl x509 -req -in $who.csr -CA ca.crt -CAkey ca.key -CAcreateserial -out $who.crt -days 1 \
    -extfile $who.ext 2>/dev/null
done
start_server "$work/tls.log" --tls_cert server.crt --tls_key server.key --tls_client_ca ca.crt
out=$("$bin/rollout-grpc-bench" --target "127.0.0.1:$port" --num_requests 4 --input_len 8 \
  --output_len 4 --progress_s 0 --tls_root_cert ca.crt --tls_client_cert client.crt \
  --tls_client_key client.key)
echo "$out"
grep -q "4 of 4 requests completed with 4 tokens" <<<"$out"
