// Bitwise comparison of device buffers, for the GPU tests' invariance checks (a row-invariance
// sweep compares gigabytes; copying them to the host would dominate the test).
#include <algorithm>

#include "kernels/cuda/compare.h"

namespace rollout::cuda {
namespace {

__global__ void CountDifferentWordsKernel(const uint32_t* a, const uint32_t* b, int64_t words,
                                          unsigned long long* count) {
  unsigned long long local = 0;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < words;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    local += a[i] != b[i] ? 1 : 0;
  }
  if (local != 0) atomicAdd(count, local);  // integer: order-independent
}

}  // namespace

cudaError_t CountDifferentWords(const void* a, const void* b, int64_t bytes,
                                unsigned long long* count, cudaStream_t stream) {
  if (bytes % 4 != 0) return cudaErrorInvalidValue;
  const cudaError_t err = cudaMemsetAsync(count, 0, sizeof(*count), stream);
  if (err != cudaSuccess) return err;
  if (bytes == 0) return cudaSuccess;
  const int64_t words = bytes / 4;
  const int64_t blocks = std::min<int64_t>((words + 255) / 256, 132 * 16);
  CountDifferentWordsKernel<<<static_cast<unsigned>(blocks), 256, 0, stream>>>(
      static_cast<const uint32_t*>(a), static_cast<const uint32_t*>(b), words, count);
  return cudaGetLastError();
}

cudaError_t CountDifferentWordsOnHost(const void* a, const void* b, int64_t bytes,
                                      unsigned long long* host_count) {
  unsigned long long* count = nullptr;
  cudaError_t err = cudaMalloc(&count, sizeof(*count));
  if (err != cudaSuccess) return err;
  err = CountDifferentWords(a, b, bytes, count, nullptr);
  if (err == cudaSuccess) {
    err = cudaMemcpy(host_count, count, sizeof(*count), cudaMemcpyDeviceToHost);
  }
  const cudaError_t freed = cudaFree(count);
  return err != cudaSuccess ? err : freed;
}

}  // namespace rollout::cuda
