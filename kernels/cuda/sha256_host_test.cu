// The host build of kernels/cuda/sha256.cuh, for sha256_test.cc: the device digest's SHA-256,
// compiled from the same source for the CPU, so that CI (nvcc, no GPU) checks its padding,
// byte order and both load paths.
#include <cstring>

#include "kernels/cuda/sha256.cuh"
#include "kernels/cuda/sha256_host_test.h"

namespace rollout::cuda {

void HostBuildSha256(const uint8_t* data, uint64_t size, uint8_t out[32]) {
  alignas(16) uint8_t digest[32];
  sha256::Sha256(data, size, digest);
  std::memcpy(out, digest, sizeof(digest));
}

}  // namespace rollout::cuda
