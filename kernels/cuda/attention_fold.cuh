#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

namespace rollout::cuda {

// Folds a split's partial (m, l, o) into the row's running result (M, L, O). The one formula of
// the split merge, whichever kernel runs it (in-block after each split, or a merge kernel over
// stored partials): same operations, same order, so the same bits. Compiled with --fmad=false:
// no product is fused into a sum here.
template <int E>
__device__ __forceinline__ void FoldPartial(float m, float l, const float (&o)[E], float* big_m,
                                            float* big_l, float (&big_o)[E]) {
  const float m_new = fmaxf(*big_m, m);
  const float a = expf(*big_m - m_new);
  const float b = expf(m - m_new);
  *big_l = *big_l * a + l * b;
#pragma unroll
  for (int e = 0; e < E; ++e) big_o[e] = big_o[e] * a + o[e] * b;
  *big_m = m_new;
}

// One warp: folds the `splits` stored partials of partials row `row` (= token * heads + head;
// [max_splits, head_dim + 2] floats each: m, l, o) in increasing split order with FoldPartial,
// and writes bf16(O / L) to out[row * kHeadDim ...]. Lane `lane` owns kHeadDim / 32 dims. The
// tail of both attention versions' merge kernels.
template <int kHeadDim>
__device__ __forceinline__ void MergeStoredSplits(const float* partials, int32_t max_splits,
                                                  int64_t row, int splits, __nv_bfloat16* out,
                                                  int lane) {
  constexpr int E = kHeadDim / 32;
  float big_m = -INFINITY, big_l = 0.0f, big_o[E];
#pragma unroll
  for (int e = 0; e < E; ++e) big_o[e] = 0.0f;
  for (int s = 0; s < splits; ++s) {
    const float* src = partials + (row * max_splits + s) * (kHeadDim + 2);
    float o[E];
#pragma unroll
    for (int e = 0; e < E; ++e) o[e] = src[2 + lane * E + e];
    FoldPartial<E>(src[0], src[1], o, &big_m, &big_l, big_o);
  }
  __nv_bfloat16* dst = out + row * kHeadDim + lane * E;
#pragma unroll
  for (int e = 0; e < E; ++e) dst[e] = __float2bfloat16_rn(big_o[e] / big_l);
}

}  // namespace rollout::cuda
