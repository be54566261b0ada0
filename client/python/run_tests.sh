#!/usr/bin/env bash
# Installs the Python client into a fresh venv and runs its tests there against a built
# rollout-server, from outside the repository: what is tested is the installed package.
#   client/python/run_tests.sh [BIN_DIR] [WORK_DIR]
# BIN_DIR: folder with rollout-server (default: <repo>/build/bin). WORK_DIR: where the venv and
# the package's build go (emptied first; default: a temporary folder, removed afterwards).
# Needs Debian's python3 with python3-grpcio python3-protobuf python3-numpy python3-venv, and
# protobuf-compiler protobuf-compiler-grpc to build the package (all in deploy/install-deps.sh).
# The venv sees the system's packages (--system-site-packages): nothing is downloaded.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
bin=$(cd "${1:-$repo/build/bin}" && pwd)
if [ -n "${2:-}" ]; then
  work=$2
else
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
fi
py=${ROLLOUT_PYTHON:-/usr/bin/python3}  # not the pyenv python3 on PATH: it lacks grpcio
if ! "$py" -c "import grpc, google.protobuf, numpy, venv" 2>/dev/null; then
  echo "run_tests.sh: $py lacks grpc/protobuf/numpy/venv; apt-get install python3-grpcio" \
       "python3-protobuf python3-numpy python3-venv" >&2
  exit 1
fi
rm -rf "$work" && mkdir -p "$work/src"
"$py" -m venv --system-site-packages "$work/venv"
# Built from a copy (setuptools leaves build/ and *.egg-info beside setup.py), the .proto
# found through ROLLOUT_PROTO_ROOT.
cp -r "$here/pyproject.toml" "$here/setup.py" "$here/README.md" "$here/rollout_client" \
      "$work/src/"
ROLLOUT_PROTO_ROOT="$repo/proto" "$work/venv/bin/python" -m pip install --quiet --no-index \
  --no-build-isolation "$work/src"
cd "$work"
ROLLOUT_BIN_DIR=$bin exec "$work/venv/bin/python" -m unittest discover -s "$here/tests" -v
