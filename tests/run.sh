#!/usr/bin/env bash
# Runs every test: installs what is missing, builds everything, runs ctest (unit tests of each
# module and the end-to-end suites against a real server on loopback).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bash "$root/deploy/build.sh"
cd "$root/build"
ctest --output-on-failure -j "$(nproc 2>/dev/null || echo 2)" --timeout 900
