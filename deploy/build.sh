#!/usr/bin/env bash
# Installs what is missing, then configures and builds into build/ (binaries in build/bin).
# Usage: deploy/build.sh [target...]   (default: everything)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bash "$root/deploy/install-deps.sh"
jobs=$(nproc 2>/dev/null || echo 2)
if [ ! -f "$root/build/build.ninja" ]; then
  cmake -S "$root" -B "$root/build" -G Ninja -DCMAKE_BUILD_TYPE=Release
fi
if [ $# -gt 0 ]; then
  cmake --build "$root/build" -j "$jobs" --target "$@"
else
  cmake --build "$root/build" -j "$jobs"
fi
