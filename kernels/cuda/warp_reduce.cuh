#pragma once

#include <cuda_runtime.h>

// Warp reductions with one fixed order. The xor-butterfly (16, 8, 4, 2, 1) leaves every lane with
// bitwise the same result: at each step lanes i and i ^ offset add the same two values, and
// floating-point addition is commutative.
namespace rollout::cuda {

inline constexpr unsigned kFullMask = 0xffffffffu;

__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    v = __fadd_rn(v, __shfl_xor_sync(kFullMask, v, offset));
  }
  return v;
}

__device__ __forceinline__ float WarpMax(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    v = fmaxf(v, __shfl_xor_sync(kFullMask, v, offset));
  }
  return v;
}

}  // namespace rollout::cuda
