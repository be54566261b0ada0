#!/usr/bin/env bash
# Trainer-side parity on CUDA (docs/trainer.md, "CUDA"), on the GPU host (torch there, no
# grpcio): for each preset, a rollout-make-model checkpoint served by rollout-server --backend
# cuda, rollouts with logprobs and Score through rollout-cli --json, the same logprobs
# recomputed by rollout_trainer.CudaQwen3Model, bitwise; gradients against float32 plain torch
# (small presets); one GRPO step's forward + backward timed against plain torch bf16 + SDPA.
# moe-small (Qwen3-MoE, rollout-make-model --preset moe-small) runs CudaQwen3MoeModel with the
# routing replay checks (tests/gpu/trainer_parity.py's docstring). One "CHECK name: PASS|FAIL"
# line per check and a SUMMARY line per preset. From the repository root:
#   OUT=/tmp/out tests/gpu/trainer_parity.sh
#   PRESETS=moe-small OUT=/tmp/out tests/gpu/trainer_parity.sh     (the MoE case alone)
# Needs .gpu/ (docs/cuda.md, "Running on a GPU host") with rollout-server, rollout-cli,
# rollout-make-model in .gpu/bin and librollout_cuda_backend.so, librollout_trainer_cuda_ops.so
# in .gpu/lib. Sizes: PRESETS (default "small moe-small qwen3-8b"), SMALL_ARGS, MOE_ARGS and
# BIG_ARGS (flags of tests/gpu/trainer_parity.py; the defaults of BIG_ARGS are the target, 256
# samples x 1024 tokens), SERVER_ARGS (more rollout-server flags). Exits non-zero when any
# preset fails.
set -uo pipefail
OUT=${OUT:-/tmp/rollout-gpu}
mkdir -p "$OUT"
source .gpu/env.sh "$PWD/.gpu/lib"
export ROLLOUT_TRAINER_CUDA_OPS=${ROLLOUT_TRAINER_CUDA_OPS:-$PWD/.gpu/lib/librollout_trainer_cuda_ops.so}
PRESETS=${PRESETS:-"small moe-small qwen3-8b"}
SMALL_ARGS=${SMALL_ARGS:-"--prompts 8 --samples 4 --prompt_len 96 --new_tokens 160 --microbatch 8 --grad_check --trainer_tp 2,4"}
MOE_ARGS=${MOE_ARGS:-"--prompts 8 --samples 4 --prompt_len 96 --new_tokens 160 --microbatch 8 --grad_check --time_steps 2"}
BIG_ARGS=${BIG_ARGS:-"--prompts 32 --samples 8 --prompt_len 512 --new_tokens 512 --microbatch 8 --trainer_tp 2 --trainer_tp_samples 16"}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/trainer_parity_gpu.txt"
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
rc=0
for preset in $PRESETS; do
  model=/tmp/trainer-parity-$preset
  [ -f "$model/config.json" ] || .gpu/bin/rollout-make-model --out "$model" --preset "$preset" \
    --seed 1 > "$OUT/trainer_parity_make_$preset.log" 2>&1 || { echo "make-model $preset failed"; rc=1; continue; }
  case $preset in
    qwen3-8b) args=$BIG_ARGS ;;
    moe-*) args=$MOE_ARGS ;;
    *) args=$SMALL_ARGS ;;
  esac
  timeout ${PARITY_TIMEOUT:-3000} python3 tests/gpu/trainer_parity.py --model "$model" \
    --bin .gpu/bin --out "$OUT" --server_args "${SERVER_ARGS:-}" $args 2>&1 \
    | tee "$OUT/trainer_parity_$preset.log"
  r=${PIPESTATUS[0]}
  echo "trainer_parity $preset: rc $r"
  [ "$r" -eq 0 ] || rc=1
done
exit $rc
