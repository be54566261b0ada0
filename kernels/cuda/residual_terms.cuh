#pragma once
// What a layer adds to the residual stream x, four floats at a time, shared by the kernels that
// add it alone (SumTree, MoeCombine) and by those that add it and then take the next RMSNorm of
// the same rows (SumTreeRmsNorm, MoeCombineRmsNorm: kernels/cuda/ops.h), so that both compute
// each element by the same operations in the same order.
#include <cuda_runtime.h>

#include <cstdint>

namespace rollout::cuda {

__device__ __forceinline__ float4 Add4(float4 a, float4 b) {
  return make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w);
}

// The canonical K tree over kParts float4s parts[p * part_stride4 + i], level by level,
// neighbours first: ((v0 + v1) + (v2 + v3)) + ((v4 + v5) + (v6 + v7)) for 8
// (kernels/cuda/tensor_parallel.h).
template <int kParts>
__device__ __forceinline__ float4 TreeSum4(const float4* parts, int64_t part_stride4, int64_t i) {
  float4 v[kParts];
#pragma unroll
  for (int p = 0; p < kParts; ++p) v[p] = parts[p * part_stride4 + i];
#pragma unroll
  for (int width = kParts; width > 1; width /= 2) {
#pragma unroll
    for (int p = 0; p < width / 2; ++p) v[p] = Add4(v[2 * p], v[2 * p + 1]);
  }
  return v[0];
}

// Token t's MoE combine at float4 c4 of its hidden row: acc = fmaf(w_j, y_j, acc) from 0 over
// its top_k slots in rank order (kernels/cuda/moe.h).
__device__ __forceinline__ float4 MoeCombine4(const float* y, const int32_t* slots,
                                              const float* weights, int32_t top_k, int64_t hidden,
                                              int64_t t, int64_t c4) {
  float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  for (int j = 0; j < top_k; ++j) {
    const float w = weights[t * top_k + j];
    const float4 v =
        reinterpret_cast<const float4*>(y + static_cast<int64_t>(slots[t * top_k + j]) * hidden)[c4];
    acc.x = fmaf(w, v.x, acc.x);
    acc.y = fmaf(w, v.y, acc.y);
    acc.z = fmaf(w, v.z, acc.z);
    acc.w = fmaf(w, v.w, acc.w);
  }
  return acc;
}

}  // namespace rollout::cuda
