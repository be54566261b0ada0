#!/usr/bin/env bash
# The Python client's weight sync on the GPU host (torch there; CI has none): the torch paths of
# the client's tests, and bench/python_weights_bench.py from GPU tensors into one cuda server,
# then a Fleet of two cuda servers on the same GPU. From the repository root:
#   OUT=/tmp/out tests/gpu/python_weights.sh
# Needs .gpu/ (docs/cuda.md, "Running on a GPU host") and the installed package copied into
# .gpu/py/ (rollout_client with its generated _gen modules).
set -uo pipefail
OUT=${OUT:-/tmp/rollout-gpu}
mkdir -p "$OUT"
source .gpu/env.sh "$PWD/.gpu/lib"
export PYTHONPATH=$PWD/.gpu/py${PYTHONPATH:+:$PYTHONPATH}
MODEL=${MODEL:-/tmp/py-weights-model}
[ -f "$MODEL/config.json" ] || .gpu/bin/rollout-make-model --out "$MODEL" --preset qwen3-8b --seed 1 \
  > "$OUT/py_make_model.log" 2>&1
(cd client/python/tests && ROLLOUT_BIN_DIR=$OLDPWD/.gpu/bin timeout 600 python3 -m unittest -v \
   test_client.TorchConversionTest test_weights_stream test_client.FakeServerTest > "$OUT/py_torch_tests.log" 2>&1)
echo "python torch tests: rc $?"; tail -3 "$OUT/py_torch_tests.log"
pids=()
for port in 50081 50082; do
  .gpu/bin/rollout-server --backend cuda --model "$MODEL" --port $port --metrics_port 0 \
    --kv_cache_mb 8192 > "$OUT/py_server_$port.log" 2>&1 &
  pids+=($!)
done
for port in 50081 50082; do
  for _ in $(seq 1 600); do grep -q "listening on port" "$OUT/py_server_$port.log" && break; sleep 0.2; done
done
timeout 400 python3 bench/python_weights_bench.py --model "$MODEL" \
  --targets 127.0.0.1:50081,127.0.0.1:50082 ${PY_BENCH_ARGS:-} 2>&1 | tee "$OUT/py_weights_bench.log"
echo "python_weights_bench: rc ${PIPESTATUS[0]}"
kill "${pids[@]}" 2>/dev/null; wait
