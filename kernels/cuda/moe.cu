// Mixture of experts: routing, grouping and the combine, and MoeExperts, the expert block in
// order. The contract is kernels/cuda/moe.h; the grouped expert GEMMs are kernels/cuda/moe_gemm.cu.
#include <algorithm>
#include <climits>
#include <cmath>

#include "kernels/cuda/moe.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/residual_terms.cuh"

namespace rollout::cuda {
namespace {

constexpr unsigned kFull = 0xffffffffu;

// ---------------------------------------------------------------------------------------------
// Routing

constexpr int kRouteWarps = 4;

__global__ void MoeRouteKernel(const float* logits, int64_t num_tokens, int32_t num_experts,
                               int32_t top_k, bool norm_topk_prob, const int32_t* forced_ids,
                               const int32_t* forced_rows, int32_t* ids, float* weights) {
  extern __shared__ float route_smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kRouteWarps + warp;
  if (t >= num_tokens) return;
  float* p = route_smem + warp * num_experts;
  const float* l = logits + t * num_experts;

  float m = -INFINITY;
  for (int e = lane; e < num_experts; e += 32) m = fmaxf(m, l[e]);
#pragma unroll
  for (int off = 16; off > 0; off /= 2) m = fmaxf(m, __shfl_xor_sync(kFull, m, off));
  float s = 0.0f;
  for (int e = lane; e < num_experts; e += 32) {
    const float q = expf(l[e] - m);
    p[e] = q;
    s += q;
  }
  // Commutative at every level: both lanes of a pair compute the same sum, so every lane ends
  // with the same s.
#pragma unroll
  for (int off = 16; off > 0; off /= 2) s += __shfl_xor_sync(kFull, s, off);
  for (int e = lane; e < num_experts; e += 32) p[e] = p[e] / s;
  __syncwarp();

  const bool forced = forced_rows != nullptr && forced_rows[t] != 0;
  float chosen[kMoeMaxTopK];
  int32_t chosen_id[kMoeMaxTopK];
  for (int j = 0; j < top_k; ++j) {
    int32_t id;
    float pj;
    if (forced) {
      id = min(max(forced_ids[t * top_k + j], 0), num_experts - 1);
      pj = p[id];
    } else {
      // This lane's best (largest p, lower index on ties), then the warp's by the same total
      // order. Taken experts hold -1 (every p >= 0).
      float best = -2.0f;
      int32_t best_id = INT_MAX;
      for (int e = lane; e < num_experts; e += 32) {
        if (p[e] > best) {
          best = p[e];
          best_id = e;
        }
      }
#pragma unroll
      for (int off = 16; off > 0; off /= 2) {
        const float ob = __shfl_xor_sync(kFull, best, off);
        const int32_t oi = __shfl_xor_sync(kFull, best_id, off);
        if (ob > best || (ob == best && oi < best_id)) {
          best = ob;
          best_id = oi;
        }
      }
      id = best_id < num_experts ? best_id : 0;  // only NaN logits leave no candidate
      pj = best;
      __syncwarp();
      if (lane == id % 32) p[id] = -1.0f;
      __syncwarp();
    }
    chosen[j] = pj;
    chosen_id[j] = id;
  }
  if (lane != 0) return;
  float sum = 0.0f;
  for (int j = 0; j < top_k; ++j) sum += chosen[j];
  for (int j = 0; j < top_k; ++j) {
    ids[t * top_k + j] = chosen_id[j];
    weights[t * top_k + j] = norm_topk_prob ? chosen[j] / sum : chosen[j];
  }
}

// ---------------------------------------------------------------------------------------------
// Grouping: one launch, one block per expert e. Each of the block's warps owns a contiguous range
// of the assignments (warp w's before warp w + 1's). The block counts every expert's rows (a
// shared-memory histogram of all the ids: integer adds, exact in any order) and, per warp, e's
// rows in the warp's range; e's row and tile offsets are sums over f < e of those counts; then
// each warp writes e's rows of its range in increasing a after the rows of the warps before it
// -- the stable counting sort, with no serial pass over the experts or the assignments.

constexpr int kGroupThreads = 1024;
constexpr int kGroupWarps = kGroupThreads / 32;

// The block-wide sum of one int32 per thread (exact in any order). Every thread returns it.
__device__ int32_t BlockSum(int32_t v, int32_t* warp_sums) {
#pragma unroll
  for (int off = 16; off > 0; off /= 2) v += __shfl_xor_sync(kFull, v, off);
  __syncthreads();  // warp_sums may still be read by a previous call
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = v;
  __syncthreads();
  int32_t total = 0;
  for (int w = 0; w < kGroupWarps; ++w) total += warp_sums[w];
  return total;
}

__global__ void __launch_bounds__(kGroupThreads)
    MoeGroupKernel(const int32_t* ids, int64_t assignments, int32_t top_k, int32_t num_experts,
                   int32_t tile_rows, int32_t* counts, int32_t* expert_offsets,
                   int32_t* tile_offsets, int32_t* rows, int32_t* slots) {
  extern __shared__ int32_t histogram[];      // [num_experts]
  __shared__ int32_t warp_rows[kGroupWarps];  // e's rows in each warp's range
  __shared__ int32_t warp_sums[kGroupWarps];
  const int32_t e = blockIdx.x;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int f = threadIdx.x; f < num_experts; f += kGroupThreads) histogram[f] = 0;
  __syncthreads();
  // Warp w's range [w * per_warp, (w + 1) * per_warp) (clipped), per_warp a multiple of 32.
  const int64_t per_warp = ((assignments + kGroupWarps - 1) / kGroupWarps + 31) / 32 * 32;
  const int64_t begin = warp * per_warp, end = min(assignments, begin + per_warp);
  int32_t mine = 0;
  for (int64_t a0 = begin; a0 < end; a0 += 32) {
    const int64_t a = a0 + lane;
    const int32_t id = a < end ? ids[a] : -1;
    if (id >= 0 && id < num_experts) atomicAdd(&histogram[id], 1);
    mine += __popc(__ballot_sync(kFull, id == e));
  }
  if (lane == 0) warp_rows[warp] = mine;
  __syncthreads();
  int32_t before = 0, tiles_before = 0;
  for (int32_t f = threadIdx.x; f < e; f += kGroupThreads) {
    before += histogram[f];
    tiles_before += (histogram[f] + tile_rows - 1) / tile_rows;
  }
  const int32_t offset = BlockSum(before, warp_sums);
  const int32_t tiles = BlockSum(tiles_before, warp_sums);
  const int32_t count = histogram[e];
  if (threadIdx.x == 0) {
    counts[e] = count;
    expert_offsets[e] = offset;
    tile_offsets[e] = tiles;
    if (e == num_experts - 1) {
      expert_offsets[e + 1] = offset + count;
      tile_offsets[e + 1] = tiles + (count + tile_rows - 1) / tile_rows;
    }
  }
  int32_t r = offset;
  for (int w = 0; w < warp; ++w) r += warp_rows[w];
  for (int64_t a0 = begin; a0 < end; a0 += 32) {
    const int64_t a = a0 + lane;
    const bool is_e = a < end && ids[a] == e;
    const unsigned ballot = __ballot_sync(kFull, is_e);
    if (is_e) {
      const int32_t row = r + __popc(ballot & ((1u << lane) - 1u));
      rows[row] = static_cast<int32_t>(a / top_k);
      slots[a] = row;
    }
    r += __popc(ballot);
  }
}

// ---------------------------------------------------------------------------------------------
// Combine: one block per token, a thread per 4 columns.

constexpr int kCombineThreads = 256;

__global__ void MoeCombineKernel(const float* y, const int32_t* slots, const float* weights,
                                 int32_t top_k, int64_t hidden, float* x) {
  const int64_t t = blockIdx.y;
  const int64_t c4 = static_cast<int64_t>(blockIdx.x) * kCombineThreads + threadIdx.x;
  if (c4 * 4 >= hidden) return;
  const float4 acc = MoeCombine4(y, slots, weights, top_k, hidden, t, c4);
  float4* out = reinterpret_cast<float4*>(x + t * hidden) + c4;
  *out = Add4(*out, acc);
}

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

cudaError_t MoeRoute(const float* logits, int64_t num_tokens, int32_t num_experts, int32_t top_k,
                     bool norm_topk_prob, const int32_t* forced_ids, const int32_t* forced_rows,
                     int32_t* ids, float* weights, cudaStream_t stream) {
  if (num_experts < 1 || num_experts > kMoeMaxExperts || top_k < 1 || top_k > kMoeMaxTopK ||
      top_k > num_experts || (forced_rows != nullptr && forced_ids == nullptr)) {
    return cudaErrorInvalidValue;
  }
  if (num_tokens == 0) return cudaSuccess;
  const int64_t blocks = (num_tokens + kRouteWarps - 1) / kRouteWarps;
  const size_t smem = sizeof(float) * kRouteWarps * num_experts;
  MoeRouteKernel<<<static_cast<unsigned>(blocks), kRouteWarps * 32, smem, stream>>>(
      logits, num_tokens, num_experts, top_k, norm_topk_prob, forced_ids, forced_rows, ids,
      weights);
  return cudaGetLastError();
}

cudaError_t MoeGroup(const int32_t* ids, int64_t num_tokens, int32_t num_experts, int32_t top_k,
                     int32_t tile_rows, const MoeGrouping& grouping, cudaStream_t stream) {
  if (num_experts < 1 || num_experts > kMoeMaxExperts || top_k < 1 ||
      num_tokens * top_k > INT32_MAX ||
      (tile_rows != kMoeTileRows && tile_rows != kMoeTileRowsLarge &&
       tile_rows != kMoeTileRowsXLarge)) {
    return cudaErrorInvalidValue;
  }
  const int64_t assignments = num_tokens * top_k;
  MoeGroupKernel<<<num_experts, kGroupThreads, sizeof(int32_t) * num_experts, stream>>>(
      ids, assignments, top_k, num_experts, tile_rows, grouping.counts, grouping.expert_offsets,
      grouping.tile_offsets, grouping.rows, grouping.slots);
  return cudaGetLastError();
}

cudaError_t MoeCombine(const float* y, const int32_t* slots, const float* weights,
                       int64_t num_tokens, int32_t top_k, int64_t hidden, float* x,
                       cudaStream_t stream) {
  if (hidden % 4 != 0 || top_k < 1 || num_tokens > 65535 || !Aligned16(x) || !Aligned16(y)) {
    return cudaErrorInvalidValue;
  }
  if (num_tokens == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>((hidden / 4 + kCombineThreads - 1) / kCombineThreads),
                  static_cast<unsigned>(num_tokens));
  MoeCombineKernel<<<grid, kCombineThreads, 0, stream>>>(y, slots, weights, top_k, hidden, x);
  return cudaGetLastError();
}

cudaError_t MoeExpertOutputs(const MoeLayerParams& p, cudaStream_t stream) {
  if (p.num_tokens == 0) return cudaSuccess;
  const int64_t assignments = p.num_tokens * p.top_k;
  const int32_t tile_rows = MoeTileRowsFor(assignments, p.num_experts, p.hidden, p.inter);
  cudaError_t err =
      MoeGroup(p.ids, p.num_tokens, p.num_experts, p.top_k, tile_rows, p.grouping, stream);
  if (err != cudaSuccess) return err;
  if ((err = MoeExpertGemmForTiles(MoeGateUpGemm(p, tile_rows), stream)) != cudaSuccess) {
    return err;
  }
  if ((err = SiluMul(p.gate_up, assignments, p.inter, p.act, stream)) != cudaSuccess) return err;
  return MoeExpertGemmForTiles(MoeDownGemm(p, tile_rows), stream);
}

cudaError_t MoeExperts(const MoeLayerParams& p, cudaStream_t stream) {
  if (p.num_tokens == 0) return cudaSuccess;
  if (const cudaError_t err = MoeExpertOutputs(p, stream); err != cudaSuccess) return err;
  return MoeCombine(p.y, p.grouping.slots, p.weights, p.num_tokens, p.top_k, p.hidden, p.x, stream);
}

MoeGemmParams MoeGateUpGemm(const MoeLayerParams& p, int32_t tile_rows) {
  MoeGemmParams gemm;
  gemm.x = p.xn;
  gemm.rows = p.grouping.rows;
  gemm.assignments = p.num_tokens * p.top_k;
  gemm.w = p.w_gate_up;
  gemm.expert_stride = 2 * p.inter * p.hidden;
  gemm.n = 2 * p.inter;
  gemm.k = p.hidden;
  gemm.expert_offsets = p.grouping.expert_offsets;
  gemm.tile_offsets = p.grouping.tile_offsets;
  gemm.num_experts = p.num_experts;
  gemm.output = MoeGemmOutput::kBf16;
  gemm.y = p.gate_up;
  gemm.tile_rows = tile_rows;
  gemm.tile_columns = MoeTileColumnsFor(tile_rows, p.hidden, p.inter);
  return gemm;
}

MoeGemmParams MoeDownGemm(const MoeLayerParams& p, int32_t tile_rows) {
  MoeGemmParams gemm = MoeGateUpGemm(p, tile_rows);
  gemm.x = p.act;
  gemm.rows = nullptr;
  gemm.w = p.w_down;
  gemm.expert_stride = p.hidden * p.inter;
  gemm.n = p.hidden;
  gemm.k = p.inter;
  gemm.output = MoeGemmOutput::kF32;
  gemm.y = p.y;
  return gemm;
}

cudaError_t MoeExpertGemmForTiles(const MoeGemmParams& params, cudaStream_t stream) {
  return params.tile_rows == kMoeTileRowsXLarge ? MoeExpertGemm(params, stream)
                                                : MoeExpertGemmV1(params, stream);
}

}  // namespace rollout::cuda
