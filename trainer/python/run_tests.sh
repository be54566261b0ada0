#!/usr/bin/env bash
# Runs rollout_trainer's tests (trainer/python/tests) against a built rollout-server and
# librollout_trainer_ops.so, with Debian's /usr/bin/python3 (python3-torch, python3-grpcio,
# python3-protobuf, python3-numpy from the system; deploy/install-deps.sh installs them) in a
# fresh venv that sees the system's packages and has the Python client installed.
#   trainer/python/run_tests.sh [BIN_DIR] [OPS_LIB]
# BIN_DIR: folder with rollout-server (default <repo>/build/bin); OPS_LIB: the shared library
# (default <repo>/build/lib/librollout_trainer_ops.so). torch missing is a failure, not a skip:
# `ctest -LE torch` leaves this test out on a machine without it.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
bin=$(cd "${1:-$repo/build/bin}" && pwd)
ops=${2:-$repo/build/lib/librollout_trainer_ops.so}
py=${ROLLOUT_PYTHON:-/usr/bin/python3}
if ! "$py" -c "import torch" 2>/dev/null; then
  echo "trainer/python/run_tests.sh: $py cannot import torch; apt-get install python3-torch" \
       "(deploy/install-deps.sh does), or leave this test out with ctest -LE torch" >&2
  exit 1
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$py" -m venv --system-site-packages "$work/venv"
mkdir -p "$work/src"
cp -r "$repo/client/python/pyproject.toml" "$repo/client/python/setup.py" \
      "$repo/client/python/README.md" "$repo/client/python/rollout_client" "$work/src/"
ROLLOUT_PROTO_ROOT="$repo/proto" "$work/venv/bin/python" -m pip install --quiet --no-index \
  --no-build-isolation "$work/src"
cd "$work"
ROLLOUT_BIN_DIR=$bin ROLLOUT_TRAINER_OPS=$ops PYTHONPATH="$here" \
  exec "$work/venv/bin/python" -m unittest discover -s "$here/tests" -v
