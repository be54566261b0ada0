#pragma once

// rollout-digest-bench's own kernels (digest_bench_kernels.cu): variants of the leaf launch
// around the library's SHA-256 (kernels/cuda/sha256.cuh), and read probes without the hashing,
// to tell whether the leaves are bound by arithmetic or by loads. Each hashes (or reads) the
// leaves of one contiguous range of `size` bytes: leaf i = bytes [64 KiB i, 64 KiB (i + 1)).
#include <cuda_runtime.h>

#include <cstdint>

namespace rollout::digest_bench {

// One thread per leaf of one range (no batch search), the library's Sha256.
enum class LeafVariant {
  kThreads128,        // 128 threads per block, registers as the compiler likes
  kThreads128Regs64,  // the same capped at 64 registers (8 blocks = 1024 threads per SM)
  kThreads256,        // 256 threads per block
};
const char* LeafVariantName(LeafVariant v);
// Registers per thread of the variant's kernel (cudaFuncGetAttributes), -1 on error.
int LeafVariantRegisters(LeafVariant v);

// leaf_digests (32 bytes per leaf) = the SHA-256s of the leaves of data[0, size).
cudaError_t LeafDigestsVariant(LeafVariant v, const uint8_t* data, uint64_t size,
                               uint8_t* leaf_digests, cudaStream_t stream);

// One thread per leaf reads its leaf with the 16-byte loads of the hashing path (same order,
// same addresses), xor-folding it into sink[thread]: the loads without the arithmetic.
cudaError_t LeafReadProbe(const uint8_t* data, uint64_t size, uint32_t* sink, cudaStream_t stream);

}  // namespace rollout::digest_bench
