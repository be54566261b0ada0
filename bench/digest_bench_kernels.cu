// rollout-digest-bench's kernels: digest_bench_kernels.h says what each is for.
#include "bench/digest_bench_kernels.h"
#include "kernels/cuda/device_digest.h"
#include "kernels/cuda/sha256.cuh"

namespace rollout::digest_bench {
namespace {

using cuda::kDigestBytes;
using cuda::kDigestLeafSize;

template <int kThreads, int kMinBlocks>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
    LeafVariantKernel(const uint8_t* data, uint64_t size, uint8_t* leaf_digests) {
  const uint64_t leaf = uint64_t{blockIdx.x} * kThreads + threadIdx.x;
  const uint64_t begin = leaf * kDigestLeafSize;
  if (begin >= size) return;
  const uint64_t left = size - begin;
  cuda::sha256::Sha256(data + begin, left < kDigestLeafSize ? left : kDigestLeafSize,
                       leaf_digests + kDigestBytes * leaf);
}

template <int kThreads, int kMinBlocks>
cudaError_t Launch(const uint8_t* data, uint64_t size, uint8_t* leaf_digests, cudaStream_t stream) {
  const uint64_t leaves = cuda::DigestLeafCount(size);
  if (leaves == 0) return cudaSuccess;
  const unsigned blocks = static_cast<unsigned>((leaves + kThreads - 1) / kThreads);
  LeafVariantKernel<kThreads, kMinBlocks>
      <<<blocks, kThreads, 0, stream>>>(data, size, leaf_digests);
  return cudaGetLastError();
}

__global__ void __launch_bounds__(128)
    LeafReadProbeKernel(const uint8_t* data, uint64_t size, uint32_t* sink) {
  const uint64_t leaf = uint64_t{blockIdx.x} * 128 + threadIdx.x;
  const uint64_t begin = leaf * kDigestLeafSize;
  if (begin >= size) return;
  const uint64_t left = size - begin;
  const uint64_t blocks = (left < kDigestLeafSize ? left : kDigestLeafSize) / 64;
  const uint4* q = reinterpret_cast<const uint4*>(data + begin);
  uint32_t acc = 0;
  for (uint64_t b = 0; b < blocks; ++b) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const uint4 v = cuda::sha256::Load16(q + 4 * b + k);
      acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
  }
  sink[leaf] = acc;
}

}  // namespace

const char* LeafVariantName(LeafVariant v) {
  switch (v) {
    case LeafVariant::kThreads128:
      return "128 threads/block";
    case LeafVariant::kThreads128Regs64:
      return "128 threads/block, <= 64 registers";
    case LeafVariant::kThreads256:
      return "256 threads/block";
  }
  return "?";
}

int LeafVariantRegisters(LeafVariant v) {
  cudaFuncAttributes a;
  cudaError_t err = cudaErrorInvalidValue;
  switch (v) {
    case LeafVariant::kThreads128:
      err = cudaFuncGetAttributes(&a, LeafVariantKernel<128, 1>);
      break;
    case LeafVariant::kThreads128Regs64:
      err = cudaFuncGetAttributes(&a, LeafVariantKernel<128, 8>);
      break;
    case LeafVariant::kThreads256:
      err = cudaFuncGetAttributes(&a, LeafVariantKernel<256, 1>);
      break;
  }
  return err == cudaSuccess ? a.numRegs : -1;
}

cudaError_t LeafDigestsVariant(LeafVariant v, const uint8_t* data, uint64_t size,
                               uint8_t* leaf_digests, cudaStream_t stream) {
  switch (v) {
    case LeafVariant::kThreads128:
      return Launch<128, 1>(data, size, leaf_digests, stream);
    case LeafVariant::kThreads128Regs64:
      return Launch<128, 8>(data, size, leaf_digests, stream);
    case LeafVariant::kThreads256:
      return Launch<256, 1>(data, size, leaf_digests, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t LeafReadProbe(const uint8_t* data, uint64_t size, uint32_t* sink, cudaStream_t stream) {
  const uint64_t leaves = cuda::DigestLeafCount(size);
  if (leaves == 0) return cudaSuccess;
  LeafReadProbeKernel<<<static_cast<unsigned>((leaves + 127) / 128), 128, 0, stream>>>(data, size,
                                                                                       sink);
  return cudaGetLastError();
}

}  // namespace rollout::digest_bench
