#pragma once

#include <cstdint>

namespace rollout::cuda {

// out = SHA-256 of data[0, size), by sha256.cuh's code compiled for the host (tests only).
void HostBuildSha256(const uint8_t* data, uint64_t size, uint8_t out[32]);

}  // namespace rollout::cuda
