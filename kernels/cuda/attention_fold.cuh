#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

namespace rollout::cuda {

// The scales of one fold: a for the running result, b for the split's partial.
struct FoldScales {
  float a, b;
};

// Folds a split's (m, l) into the row's running (M, L) and returns the scales its o and the
// running O take: FoldPartial's row part.
__device__ __forceinline__ FoldScales FoldRow(float m, float l, float* big_m, float* big_l) {
  const float m_new = fmaxf(*big_m, m);
  const float a = expf(*big_m - m_new);
  const float b = expf(m - m_new);
  *big_l = *big_l * a + l * b;
  *big_m = m_new;
  return {a, b};
}

// FoldPartial's element part: the new O of one dim.
__device__ __forceinline__ float FoldElement(float big_o, float o, FoldScales s) {
  return big_o * s.a + o * s.b;
}

// A row's output element once every split is folded: bf16(O / L).
__device__ __forceinline__ __nv_bfloat16 FoldedOutput(float big_o, float big_l) {
  return __float2bfloat16_rn(big_o / big_l);
}

// Folds a split's partial (m, l, o) into the row's running result (M, L, O). The one formula of
// the split merge, whichever kernel runs it (in-block after each split, or a merge kernel over
// stored partials): same operations, same order, so the same bits. Compiled with --fmad=false:
// no product is fused into a sum here. (FoldRow + FoldElement per dim; a kernel that keeps O
// elsewhere than one array calls those two directly.)
template <int E>
__device__ __forceinline__ void FoldPartial(float m, float l, const float (&o)[E], float* big_m,
                                            float* big_l, float (&big_o)[E]) {
  const FoldScales s = FoldRow(m, l, big_m, big_l);
#pragma unroll
  for (int e = 0; e < E; ++e) big_o[e] = FoldElement(big_o[e], o[e], s);
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
    // Unrolled so that the loads of several splits are in flight before their folds (the fold
    // order, and so the bits, do not change); o in pairs where a lane has an even count (a
    // partial is an even number of floats, so pairs are 8-byte aligned).
#pragma unroll 4
  for (int s = 0; s < splits; ++s) {
    const float* src = partials + (row * max_splits + s) * (kHeadDim + 2);
    float o[E];
    if constexpr (E % 2 == 0) {
#pragma unroll
      for (int e = 0; e < E; e += 2) {
        const float2 pair = *reinterpret_cast<const float2*>(src + 2 + lane * E + e);
        o[e] = pair.x;
        o[e + 1] = pair.y;
      }
    } else {
#pragma unroll
      for (int e = 0; e < E; ++e) o[e] = src[2 + lane * E + e];
    }
    FoldPartial<E>(src[0], src[1], o, &big_m, &big_l, big_o);
  }
  __nv_bfloat16* dst = out + row * kHeadDim + lane * E;
#pragma unroll
  for (int e = 0; e < E; ++e) dst[e] = FoldedOutput(big_o[e], big_l);
}

}  // namespace rollout::cuda
