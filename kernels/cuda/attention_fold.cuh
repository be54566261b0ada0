#pragma once

#include <cuda_runtime.h>

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

}  // namespace rollout::cuda
