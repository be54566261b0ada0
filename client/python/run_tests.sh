#!/usr/bin/env bash
# Runs the Python client's tests with Debian's system Python against a built rollout-server.
#   client/python/run_tests.sh [BIN_DIR] [GEN_DIR]
# BIN_DIR: folder with rollout-server (default: <repo>/build/bin). GEN_DIR: where the gRPC
# modules are generated from the .proto (default: client/python/rollout_client/_gen).
# Needs: apt-get install python3-grpcio python3-protobuf python3-numpy protobuf-compiler
#        protobuf-compiler-grpc   (all in deploy/install-deps.sh)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
bin=${1:-$here/../../build/bin}
export ROLLOUT_BIN_DIR=$(cd "$bin" && pwd)
if [ -n "${2:-}" ]; then export ROLLOUT_CLIENT_GEN_DIR=$2; fi
py=${ROLLOUT_PYTHON:-/usr/bin/python3}  # not the pyenv python3 on PATH: it lacks grpcio
if ! "$py" -c "import grpc, google.protobuf, numpy" 2>/dev/null; then
  echo "run_tests.sh: $py lacks grpc/protobuf/numpy;" \
       "apt-get install python3-grpcio python3-protobuf python3-numpy" >&2
  exit 1
fi
cd "$here"
exec "$py" -m unittest discover -s tests -v
