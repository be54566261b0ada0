#include "kernels/cuda/numerics.h"

#include <cublasLt.h>

#include <cstdio>

namespace rollout::cuda {

cudaError_t DescribeDevice(int device, DeviceFacts* facts) {
  cudaDeviceProp prop{};
  const cudaError_t e = cudaGetDeviceProperties(&prop, device);
  if (e != cudaSuccess) return e;
  facts->gpu_model = prop.name;
  facts->compute_capability = std::to_string(prop.major) + "." + std::to_string(prop.minor);
  facts->cuda_runtime =
      std::to_string(CUDART_VERSION / 1000) + "." + std::to_string(CUDART_VERSION % 1000 / 10);
  facts->cublaslt_version = std::to_string(cublasLtGetVersion());
  return cudaSuccess;
}

std::string DescribePin(const char* name, const PinnedGemm& gemm) {
  const char* out = gemm.output() == GemmOutput::kBf16  ? "bf16"
                    : gemm.output() == GemmOutput::kF32 ? "f32"
                                                        : "f32+=";
  char head[128];
  std::snprintf(head, sizeof(head), "%s n=%lld k=%lld out=%s ", name,
                static_cast<long long>(gemm.n()), static_cast<long long>(gemm.k()), out);
  if (gemm.mode() != PinnedGemm::Mode::kPinned) return std::string(head) + "heuristic per m";
  return std::string(head) + DescribeAlgo(gemm.algo()).ToString();
}

}  // namespace rollout::cuda
