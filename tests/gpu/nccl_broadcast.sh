#!/usr/bin/env bash
# Weights by NCCL broadcast into a fleet, end to end on one host with >= 2 GPUs (issue 17 item 3;
# docs/cuda.md, "Weights by NCCL broadcast"). NCCL cannot put two ranks on one GPU, so this needs
# several: the trainer on GPU 0, one rollout-server on each of GPUs 1..N. From the repository root,
# with .gpu/ bundled as docs/cuda.md says (bin: rollout-server rollout-cli rollout-make-model
# rollout_gpu_test rollout-ipc-exporter; lib: their libraries and librollout_cuda_backend.so) and
# the installed Python package copied into .gpu/py/ (rollout_client with its _gen modules; the
# host's Python has torch, grpcio and protobuf):
#   OUT=/tmp/out bash tests/gpu/nccl_broadcast.sh
# Knobs: SERVERS (default: every GPU but GPU 0, at most 7), PRESET (qwen3-8b), KV_MB (8192),
# BUCKET_MB (256), REPEATS (3).
# Steps (each time-boxed; a failing one does not stop the later ones):
#   1. checkpoints A (seed 1) and B (seed 2) of the PRESET's shapes, by rollout-make-model;
#   2. rollout-server --backend cuda --cuda_devices G --device_weight_staging on A, for each
#      server GPU G; a fixed Generate probe on each;
#   3. tests/gpu/nccl_trainer.py (torch, GPU 0): the peer copy floors, a broadcast that stops
#      half way (every server DEADLINE_EXCEEDED, weights unchanged, group left), then the whole
#      of B REPEATS times into every server at once (BROADCAST lines: GB/s per receiving GPU);
#      the probe on each server again;
#   4. a fresh rollout-server on B: its ServerInfo digest and the probe;
#   5. checks: every server reports B's digest (ServerInfo and every broadcast's answer), every
#      server's probe equals the fresh server's bitwise and differs from A's;
#   6. the GPU unit tests of the path (rollout_gpu_test --gtest_filter='WeightSyncTest.*:
#      NcclWeightSyncTest.*').
# Prints BROADCAST / P2P_FLOOR / HALF_WAY lines, a "GB/s per receiving GPU" summary and
# "nccl_broadcast: PASS" or "nccl_broadcast: FAIL (...)".
set -uo pipefail
OUT=${OUT:-/tmp/rollout-nccl}
WORK=${WORK:-/tmp/rollout-nccl-work}
PRESET=${PRESET:-qwen3-8b}
KV_MB=${KV_MB:-8192}
BUCKET_MB=${BUCKET_MB:-256}
REPEATS=${REPEATS:-3}
BASE_PORT=${BASE_PORT:-50270}
mkdir -p "$OUT" "$WORK"
source .gpu/env.sh "$PWD/.gpu/lib"
export PYTHONPATH=$PWD/.gpu/py${PYTHONPATH:+:$PYTHONPATH}
bin=.gpu/bin
failures=()
fail() { failures+=("$1"); echo "FAIL: $1"; }

nvidia-smi --query-gpu=index,name,memory.total --format=csv | tee "$OUT/gpus.txt"
nvidia-smi topo -m > "$OUT/topo.txt" 2>&1 || true
gpus=$(nvidia-smi --query-gpu=index --format=csv,noheader | wc -l)
if (( gpus < 2 )); then
  echo "nccl_broadcast: needs >= 2 GPUs (the trainer's and a server's); this host has $gpus"
  echo "nccl_broadcast: FAIL (too few GPUs)"
  exit 1
fi
servers=${SERVERS:-$(( gpus - 1 < 7 ? gpus - 1 : 7 ))}
server_gpus=$(seq -s, 1 "$servers")
echo "trainer on GPU 0, $servers server(s) on GPUs $server_gpus"

for seed in 1 2; do
  dir=$WORK/ckpt-$seed
  if [[ ! -f $dir/config.json ]]; then
    /usr/bin/time -f "make-model seed $seed: %e s" timeout 900 $bin/rollout-make-model \
      --preset "$PRESET" --seed $seed --out "$dir" > "$OUT/make_model_$seed.log" 2>&1 ||
      fail "rollout-make-model seed $seed"
    tail -1 "$OUT/make_model_$seed.log"
  fi
done

pids=()
start_server() {  # gpu, model dir, log name
  local port=$((BASE_PORT + $1))
  $bin/rollout-server --backend cuda --cuda_devices "$1" --device_weight_staging \
    --model "$2" --port $port --metrics_port 0 --kv_cache_mb $KV_MB --weight_version boot \
    > "$OUT/$3.log" 2>&1 &
  pids+=($!)
}
wait_servers() {  # log names...
  local log
  for log in "$@"; do
    for _ in $(seq 1 900); do
      grep -q "listening on port" "$OUT/$log.log" && break
      grep -qE "^rollout-server: |Check failed" "$OUT/$log.log" && break
      sleep 0.5
    done
    grep -q "listening on port" "$OUT/$log.log" || { tail -5 "$OUT/$log.log"; return 1; }
  done
}
stop_servers() {
  local p
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null; done
  pids=()
}
cli() { $bin/rollout-cli --server=127.0.0.1:$1 "${@:2}"; }
# The probe's completions as "rollout sample: token ids | logprobs" lines (equal lines mean equal
# bits: the JSON floats are float32's round-trip digits).
probe() {  # port, name
  cli "$1" --prompt 11,22,33,44,55,66,77 --samples 3 --seed 7 --temperature 0.8 \
    --max_new_tokens 32 --ignore_eos --json generate |
    python3 -c '
import json, sys
for line in sys.stdin:
    c = json.loads(line).get("completion")
    if c:
        print(c["rollout_index"], c["sample_index"], c["token_ids"], "|", c["logprobs"])' |
    sort > "$OUT/$2.txt"
  [[ -s $OUT/$2.txt ]] || fail "probe $2 returned nothing"
}
digest() { cli "$1" --json info | python3 -c 'import json,sys; print(json.load(sys.stdin)["weight_digest"])'; }

# --- 2, 3: servers on A, the trainer broadcasting B.
targets=()
logs=()
for g in $(seq 1 "$servers"); do
  start_server "$g" "$WORK/ckpt-1" "server_$g"
  targets+=("127.0.0.1:$((BASE_PORT + g))")
  logs+=("server_$g")
done
if wait_servers "${logs[@]}"; then
  grep -h "memory plan" "$OUT"/server_*.log | head -"$servers"
  for g in $(seq 1 "$servers"); do probe $((BASE_PORT + g)) "probe_a_$g"; done
  timeout 1800 python3 tests/gpu/nccl_trainer.py --checkpoint "$WORK/ckpt-2" \
    --targets "$(IFS=,; echo "${targets[*]}")" --server_gpus "$server_gpus" \
    --bucket_mb "$BUCKET_MB" --repeats "$REPEATS" --results "$OUT/trainer.json" 2>&1 |
    tee "$OUT/trainer.log" |
    grep -E "BROADCAST|P2P_FLOOR|HALF_WAY|JOIN|TRAINER|loaded|torch|Error|error"
  grep -q "TRAINER OK" "$OUT/trainer.log" || fail "the trainer's broadcasts"
  for g in $(seq 1 "$servers"); do
    probe $((BASE_PORT + g)) "probe_bc_$g"
    echo "server on GPU $g: $(digest $((BASE_PORT + g)))" | tee -a "$OUT/digests.txt"
  done
  grep -hE "weights updated|broadcast weight update|weight-sync" "$OUT"/server_*.log | tail -8
  stop_servers
else
  fail "a rollout-server on checkpoint A did not start"
  stop_servers
fi

# --- 4: a fresh server on B.
start_server 1 "$WORK/ckpt-2" fresh_b
if wait_servers fresh_b; then
  probe $((BASE_PORT + 1)) probe_b
  fresh_digest=$(digest $((BASE_PORT + 1)))
else
  fail "rollout-server on checkpoint B did not start"
fi
stop_servers

# --- 5: the checks.
echo "digest of a fresh server on B: ${fresh_digest:-?}"
if [[ -n ${fresh_digest:-} ]]; then
  n=$(grep -c ": ${fresh_digest}\$" "$OUT/digests.txt" 2>/dev/null)
  [[ ${n:-0} -eq $servers ]] || fail "$n of $servers servers report B's digest"
fi
if [[ -f $OUT/trainer.json ]]; then
  python3 - "$OUT/trainer.json" "${fresh_digest:-}" <<'EOF' || fail "a broadcast's digest is not B's"
import json, statistics, sys
r = json.load(open(sys.argv[1]))
rows = [b for b in r["broadcasts"] if b.get("ok")]
bad = [b for b in rows if b.get("digest") != sys.argv[2]]
floors = {int(g): v for g, v in r.get("floors", {}).items()}
print(f"{len(rows)} server answers, {len(bad)} with another digest than B's")
by_server = {}
for b in rows:
    by_server.setdefault(b["server"], []).append(b["gbps_receive"])
for i, (server, rates) in enumerate(sorted(by_server.items())):
    floor = floors.get(i + 1)
    print(f"GB/s per receiving GPU, {server}: best {max(rates):.1f}, median "
          f"{statistics.median(rates):.1f}" +
          (f" (peer copy floor {floor / 1e9:.0f} GB/s: {max(rates) * 1e9 / floor:.0%})" if floor else ""))
sys.exit(1 if bad or not rows else 0)
EOF
fi
for g in $(seq 1 "$servers"); do
  if cmp -s "$OUT/probe_bc_$g.txt" "$OUT/probe_b.txt"; then
    echo "probe on GPU $g after the broadcasts == probe of a fresh server on B (tokens and logprob bits)"
  else
    fail "probe on GPU $g after the broadcasts differs from a fresh server on B"
    diff "$OUT/probe_bc_$g.txt" "$OUT/probe_b.txt" | head -5
  fi
  cmp -s "$OUT/probe_a_$g.txt" "$OUT/probe_bc_$g.txt" && fail "the broadcast changed no output on GPU $g"
done

# --- 6: the unit tests of the path.
timeout 600 $bin/rollout_gpu_test --gtest_filter='WeightSyncTest.*:NcclWeightSyncTest.*' \
  > "$OUT/gpu_test_weight_sync.log" 2>&1 || fail "rollout_gpu_test WeightSyncTest.*"
grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[  FAILED" "$OUT/gpu_test_weight_sync.log"

if [[ ${#failures[@]} -eq 0 ]]; then
  echo "nccl_broadcast: PASS"
else
  echo "nccl_broadcast: FAIL (${failures[*]})"
  exit 1
fi
