#!/usr/bin/env bash
# Installs the Debian 12 packages the build needs, skipping those already present (idempotent).
# CUDA is optional and not installed here; the CPU backend needs none of it.
set -euo pipefail
packages=(
  build-essential cmake ninja-build ccache pkg-config git
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev libgoogle-glog-dev libgtest-dev libgmock-dev libbenchmark-dev
  nlohmann-json3-dev libcivetweb-dev openssl libssl-dev clang libclang-rt-14-dev
  python3-grpcio python3-protobuf python3-numpy python3-venv python3-pip python3-setuptools
  python3-torch  # rollout_trainer's tests (ctest -L torch): measured 98 s to install with its deps
)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#packages[@]} packages present"
  exit 0
fi
echo "install-deps: installing ${missing[*]}"
sudo=""
if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
