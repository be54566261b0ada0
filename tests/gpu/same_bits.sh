#!/usr/bin/env bash
# Same bits across two builds on the GPU: serves the embedded default model with the cuda
# backend from build A and from build B, sends both the same rollouts (concurrently, so batches
# differ between the two runs) and compares every token id and logprob bit. For a change that
# must not move a bit (a restructuring, a faster kernel with the same arithmetic).
# Usage, from the repository root on the GPU host:
#   tests/gpu/same_bits.sh DIR_A DIR_B [OUT]
# DIR_x holds bin/rollout-server, bin/rollout-cli and lib/librollout_cuda_backend.so (and the
# bundled libraries in lib/); env.sh is sourced from .gpu/. Exit 0 when every output is equal.
# BACKEND=cpu runs it on the CPU backend (a check of the script itself, without a GPU).
set -uo pipefail
a=$1 b=$2 out=${3:-/tmp/same-bits}
mkdir -p "$out"
[ -f .gpu/env.sh ] && source .gpu/env.sh .gpu/lib
backend=${BACKEND:-cuda}
export ROLLOUT_CACHE_DIR=$out/cache

serve_and_run() {  # DIR PORT TAG
  local dir=$1 port=$2 tag=$3
  LD_LIBRARY_PATH="$dir/lib:${LD_LIBRARY_PATH:-}" "$dir/bin/rollout-server" --backend "$backend" \
    --port "$port" --metrics_port 0 --max_batch_tokens 512 > "$out/server_$tag.log" 2>&1 &
  local server=$!
  for _ in $(seq 1 240); do
    grep -q "listening on port" "$out/server_$tag.log" && break
    kill -0 $server 2>/dev/null || { echo "server $tag died"; tail -5 "$out/server_$tag.log"; return 1; }
    sleep 0.5
  done
  mkdir -p "$out/$tag"
  local pids=()
  for i in $(seq 0 23); do
    # Prompts of 1..1200 tokens (across pages, splits and several 512-token steps).
    local len=$(( (i * 397 + 1) % 1200 + 1 ))
    local prompt=$(python3 -c "print(','.join(str((t * 31 + $i * 7 + 3) % 4000) for t in range($len)))")
    local temp=$(python3 -c "print([0, 0.7, 1.0][$i % 3])")
    LD_LIBRARY_PATH="$dir/lib:${LD_LIBRARY_PATH:-}" "$dir/bin/rollout-cli" --server "127.0.0.1:$port" \
      --prompt "$prompt" --samples $(( i % 4 + 1 )) --seed $i --temperature "$temp" \
      --max_new_tokens $(( 16 + i * 7 )) --ignore_eos --request_id "r$i" --json generate \
      > "$out/$tag/gen_$i.json" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p"; done
  kill -TERM $server; wait $server
}

serve_and_run "$a" 50171 a || exit 1
serve_and_run "$b" 50172 b || exit 1
python3 - "$out" <<'PY'
import json, sys, glob, os
out = sys.argv[1]
def samples(tag):
    res = {}
    for f in sorted(glob.glob(f"{out}/{tag}/gen_*.json")):
        toks, lps = {}, {}
        for line in open(f):
            line = line.strip()
            if not line.startswith("{"): continue
            m = json.loads(line)
            # Every list of token ids / logprobs in the message, keyed by sample index.
            def walk(o, sample=None):
                if isinstance(o, dict):
                    s = o.get("sampleIndex", o.get("sample_index", sample))
                    for k, v in o.items():
                        if k in ("tokenIds", "token_ids", "newTokenIds"):
                            toks.setdefault((s, k), []).extend(v)
                        elif k in ("logprobs", "newLogprobs"):
                            lps.setdefault((s, k), []).extend(v)
                        else:
                            walk(v, s)
                elif isinstance(o, list):
                    for v in o: walk(v, sample)
            walk(m)
        res[os.path.basename(f)] = (sorted(toks.items(), key=str), sorted(lps.items(), key=str))
    return res
A, B = samples("a"), samples("b")
ntok = sum(len(v) for t, _ in A.values() for _, v in t)
bad = [k for k in A if A[k] != B.get(k)]
print(f"same-bits: {len(A)} requests, {ntok} token ids compared; {len(bad)} differ {bad[:5]}")
sys.exit(1 if bad or not A or ntok == 0 else 0)
PY
