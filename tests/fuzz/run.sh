#!/usr/bin/env bash
# Builds the libFuzzer targets with clang, ASan and UBSan in their own build folder, replays every
# regression input under the sanitizers, then fuzzes each target for a bounded time from its seed
# corpus. Exits non-zero if any target crashed or violated a property (the input is kept under
# <build>/artifacts/<target>/; add it to tests/fuzz/regressions/<target>/).
#
#   tests/fuzz/run.sh [SECONDS_PER_TARGET] [TARGET...]
#
# Environment: ROLLOUT_FUZZ_BUILD_DIR (default <repo>/build-fuzz), ROLLOUT_FUZZ_SECONDS (default
# 20), ROLLOUT_FUZZ_CXX (default clang++), ROLLOUT_FUZZ_JOBS (build parallelism, default 2),
# ROLLOUT_FUZZ_STRICT (set to 1 when replaying regressions/*/open/): the convention for an open
# finding is that its fuzz target skips such inputs unless ROLLOUT_FUZZ_STRICT=1, so that a known
# problem does not fail every fuzzing run (no target needs that now).
# The ctest fuzz_smoke runs this script (registered only when clang with libFuzzer exists).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
build=${ROLLOUT_FUZZ_BUILD_DIR:-$root/build-fuzz}
seconds=${1:-${ROLLOUT_FUZZ_SECONDS:-20}}
shift || true
cxx=${ROLLOUT_FUZZ_CXX:-clang++}
jobs=${ROLLOUT_FUZZ_JOBS:-2}
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  targets=(checkpoint checkpoint_index model_config generate_request score_request weights_stream)
fi

sanitize="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
echo "== configuring $build with $cxx"
mkdir -p "$build"
cmake -S "$root" -B "$build" -G Ninja \
  -DCMAKE_CXX_COMPILER="$cxx" \
  -DCMAKE_BUILD_TYPE=Fuzz \
  -DCMAKE_CXX_FLAGS_FUZZ="-O1 -g" \
  -DCMAKE_CXX_FLAGS="$sanitize -fsanitize=fuzzer-no-link" \
  -DCMAKE_EXE_LINKER_FLAGS="$sanitize" \
  -DROLLOUT_CUDA=OFF -DROLLOUT_TESTS=ON -DROLLOUT_FUZZ=ON >"$build/configure.log" 2>&1 || {
  cat "$build/configure.log"
  exit 1
}
echo "== building ${targets[*]}"
cmake --build "$build" -j "$jobs" --target $(printf 'fuzz_%s ' "${targets[@]}")

export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1:allocator_may_return_null=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
failed=()
summary=()
for t in "${targets[@]}"; do
  bin="$build/bin/fuzz_$t"
  artifacts="$build/artifacts/$t"
  work="$build/corpus/$t"
  mkdir -p "$artifacts" "$work"
  # Fixed findings must stay fixed; open ones (regressions/<t>/open/) are only reported.
  for kind in fixed open; do
    dir="$here/regressions/$t"
    [ "$kind" = open ] && dir="$dir/open"
    inputs=()
    if [ -d "$dir" ]; then
      while IFS= read -r -d '' f; do inputs+=("$f"); done \
        < <(find "$dir" -maxdepth 1 -type f ! -name '*.md' ! -name '.*' -print0 | sort -z)
    fi
    [ ${#inputs[@]} -eq 0 ] && continue
    for f in "${inputs[@]}"; do
      if ROLLOUT_FUZZ_STRICT=1 "$bin" -runs=1 "$f" >"$build/$t.replay.log" 2>&1; then
        [ "$kind" = open ] && echo "   $t: open finding $(basename "$f") passes now: move it up"
      elif [ "$kind" = fixed ]; then
        echo "!! $t: regression $(basename "$f") fails again:"
        tail -40 "$build/$t.replay.log"
        failed+=("$t (regression $(basename "$f"))")
      else
        echo "   $t: open finding $(basename "$f") still fails: $(grep -m1 -o 'fuzz property violated.*\|ERROR: [A-Za-z]*Sanitizer: [a-z-]*' "$build/$t.replay.log" || true)"
      fi
    done
  done
  dict=()
  [ -f "$here/$t.dict" ] && dict=(-dict="$here/$t.dict")
  echo "== $t: fuzzing for $seconds s"
  log="$build/$t.fuzz.log"
  status=0
  "$bin" "${dict[@]}" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
    -max_len=8192 -print_final_stats=1 -artifact_prefix="$artifacts/" \
    "$work" "$here/corpus/$t" >"$log" 2>&1 || status=$?
  execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo "?")
  rate=$(grep -o 'stat::average_exec_per_sec: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo "?")
  cov=$(grep -o 'cov: [0-9]*' "$log" | tail -1 | grep -o '[0-9]*' || echo "?")
  corpus=$(find "$work" -type f | wc -l)
  if [ "$status" -ne 0 ]; then
    echo "!! $t FAILED (exit $status); last lines of $log:"
    tail -60 "$log"
    ls -l "$artifacts" || true
    failed+=("$t")
    summary+=("$t: CRASH after $execs execs (see $artifacts)")
  else
    summary+=("$t: $execs execs in ${seconds}s ($rate/s), cov $cov, corpus $corpus")
  fi
done

echo "== fuzz summary"
printf '   %s\n' "${summary[@]}"
if [ ${#failed[@]} -gt 0 ]; then
  echo "FAILED: ${failed[*]}"
  exit 1
fi
