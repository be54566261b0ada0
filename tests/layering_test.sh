#!/usr/bin/env bash
# The layering test: every #include "..." of production code points down or sideways, never up.
#   common  -> common
#   model   -> model, common
#   kernels -> kernels, common
#   engine  -> engine, model, common                     (no backend, no gRPC, no proto)
#   runner  -> runner, engine, model, kernels, common
#   server  -> server, runner, engine, model, common, proto/gRPC
#   client  -> client, model, common, proto/gRPC         (clients know the proto, the CLI model/)
#   trainer -> trainer, engine, model, kernels, common   (the kernels behind a C ABI; no runner)
#   proto   -> proto
# bench/ and tests/ may use everything. Unit tests (*_test.cc, *_test_util.h) may use the layers
# above their own to drive them (the engine's tests run it on the CPU runner).
# Usage: layering_test.sh [ROOT]   (default: the repository). Exit 1 and one line per wrong-way
# include; `layering_test.sh --self-test` proves the check fails on a tree that breaks a rule.
set -euo pipefail

if [ "${1:-}" = "--self-test" ]; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  mkdir -p "$tmp/engine" "$tmp/model" "$tmp/runner" "$tmp/kernels/cpu" "$tmp/client"
  printf '#include "model/a.h"\n' > "$tmp/engine/ok.cc"
  printf '#include "runner/backend.h"\n' > "$tmp/engine/bad.cc"
  printf '#include "engine/engine.h"\n' > "$tmp/model/bad.h"
  printf '#include "grpcpp/grpcpp.h"\n' > "$tmp/engine/bad_grpc.h"
  printf '#include "engine/engine.h"\n' > "$tmp/kernels/cpu/bad.cc"
  printf '#include "server/server.h"\n' > "$tmp/client/bad.cc"
  printf '#include "runner/cpu/cpu_model_runner.h"\n' > "$tmp/engine/engine_test.cc"
  out=$(bash "$0" "$tmp" 2>&1) && { echo "self-test: a broken tree passed"; exit 1; }
  for f in engine/bad.cc model/bad.h engine/bad_grpc.h kernels/cpu/bad.cc client/bad.cc; do
    grep -q "^$f:" <<<"$out" || { echo "self-test: $f not reported"; echo "$out"; exit 1; }
  done
  for f in engine/ok.cc engine/engine_test.cc; do
    grep -q "^$f:" <<<"$out" && { echo "self-test: $f reported"; echo "$out"; exit 1; }
  done
  echo "layering self-test: 5 of 5 wrong-way includes found, 2 allowed ones passed"
  exit 0
fi

root=${1:-$(cd "$(dirname "$0")/.." && pwd)}
cd "$root"
declare -A allowed=(
  [common]="common"
  [model]="model common"
  [kernels]="kernels common"
  [engine]="engine model common"
  [runner]="runner engine model kernels common"
  [server]="server runner engine model common proto rpc"
  [client]="client model common proto rpc"
  [trainer]="trainer engine model kernels common"
  [proto]="proto rpc"
)
# What an include names: one of our folders, or "proto"/"rpc" for generated and gRPC headers.
layer_of_include() {
  case "$1" in
    rollout/v1/*|grpc/health/*|google/protobuf/*) echo proto ;;
    grpcpp/*|grpc/*) echo rpc ;;
    common/*|model/*|kernels/*|engine/*|runner/*|server/*|client/*|trainer/*|bench/*|tests/*)
      echo "${1%%/*}" ;;
    *) echo "" ;;  # the standard library and third-party headers
  esac
}
violations=0
checked=0
while IFS= read -r file; do
  layer=${file%%/*}
  [ -n "${allowed[$layer]+x}" ] || continue
  case "$file" in *_test.cc|*_test.cu|*_test_util.h|*/testdata/*) continue ;; esac
  checked=$((checked + 1))
  while IFS= read -r line; do
    inc=$(sed -E 's/^[[:space:]]*#[[:space:]]*include[[:space:]]*"([^"]+)".*/\1/' <<<"$line")
    target=$(layer_of_include "$inc")
    [ -z "$target" ] && continue
    if ! grep -qw -- "$target" <<<"${allowed[$layer]}"; then
      echo "$file: includes \"$inc\" ($layer may use: ${allowed[$layer]})"
      violations=$((violations + 1))
    fi
  done < <(grep -E '^[[:space:]]*#[[:space:]]*include[[:space:]]*"' "$file" || true)
done < <(find common model kernels engine runner server client trainer proto -type f \
           \( -name '*.h' -o -name '*.cc' -o -name '*.cu' -o -name '*.cuh' \) 2>/dev/null | sort)
if [ "$checked" -eq 0 ]; then echo "layering: no source files under $root"; exit 1; fi
if [ "$violations" -gt 0 ]; then
  echo "layering: $violations wrong-way includes in $checked files"
  exit 1
fi
echo "layering: $checked files, every include points down or sideways"
