#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace rollout::cuda {

// *count = number of 32-bit words at which a and b differ (bytes % 4 == 0). count is device
// memory; the result is ready when the stream reaches this point.
cudaError_t CountDifferentWords(const void* a, const void* b, int64_t bytes,
                                unsigned long long* count, cudaStream_t stream);

// The same, finished before it returns: *host_count on the host (tools and benchmarks; it
// allocates its 8-byte device counter and synchronizes the device).
cudaError_t CountDifferentWordsOnHost(const void* a, const void* b, int64_t bytes,
                                      unsigned long long* host_count);

}  // namespace rollout::cuda
