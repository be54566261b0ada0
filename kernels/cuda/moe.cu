// Mixture of experts: routing, grouping, the grouped expert GEMMs and the combine. The contract
// is kernels/cuda/moe.h.
//
// Version 1 (this file). The expert GEMM is a tiled tensor-core kernel in two block shapes of one
// per-element arithmetic (MoeTileRowsFor picks by the step's mean rows per expert). Decode: a
// block owns 32 grouped rows of one expert (a tile) x 64 output columns, four warps of 32 x 16,
// K staged 64 at a time through a 3-deep cp.async ring -- decode (a few rows per expert) is bound
// by reading each touched expert's weights once, and a 64-column block streams 64 x K of them
// with three stages in flight. Prefill: 64-row tiles x 128 columns, 2 x 2 warps of 32 x 64, K 32
// at a time: half the shared-memory reads per MMA, and half the weight re-reads (one per tile).
// Rows past the expert's end are zero-filled and never stored. Not timed on a GPU yet
// (rollout-moe-bench times it); no ldmatrix, no wgmma.
#include <algorithm>
#include <climits>
#include <cmath>

#include "kernels/cuda/mma_ptx.cuh"
#include "kernels/cuda/moe.h"
#include "kernels/cuda/ops.h"

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
// Grouping: one block per expert scans the assignments in increasing order.

constexpr int kGroupThreads = 256;

__global__ void MoeCountKernel(const int32_t* ids, int64_t assignments, int32_t* counts) {
  __shared__ int32_t warp_counts[kGroupThreads / 32];
  const int32_t e = blockIdx.x;
  int32_t c = 0;
  for (int64_t a = threadIdx.x; a < assignments; a += kGroupThreads) c += ids[a] == e ? 1 : 0;
#pragma unroll
  for (int off = 16; off > 0; off /= 2) c += __shfl_xor_sync(kFull, c, off);
  if (threadIdx.x % 32 == 0) warp_counts[threadIdx.x / 32] = c;
  __syncthreads();
  if (threadIdx.x == 0) {
    int32_t total = 0;
    for (int w = 0; w < kGroupThreads / 32; ++w) total += warp_counts[w];
    counts[e] = total;
  }
}

__global__ void MoeScatterKernel(const int32_t* ids, int64_t assignments, int32_t top_k,
                                 int32_t num_experts, int32_t tile_rows, const int32_t* counts,
                                 int32_t* expert_offsets, int32_t* tile_offsets, int32_t* rows,
                                 int32_t* slots) {
  __shared__ int32_t warp_totals[kGroupThreads / 32];
  __shared__ int32_t base_shared;
  const int32_t e = blockIdx.x;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (threadIdx.x == 0) {
    // The offsets of e: integer sums, exact in any order.
    int32_t offset = 0, tiles = 0;
    for (int32_t f = 0; f < e; ++f) {
      offset += counts[f];
      tiles += (counts[f] + tile_rows - 1) / tile_rows;
    }
    expert_offsets[e] = offset;
    tile_offsets[e] = tiles;
    if (e == num_experts - 1) {
      expert_offsets[e + 1] = offset + counts[e];
      tile_offsets[e + 1] = tiles + (counts[e] + tile_rows - 1) / tile_rows;
    }
    base_shared = offset;
  }
  __syncthreads();
  int32_t base = base_shared;
  for (int64_t start = 0; start < assignments; start += kGroupThreads) {
    const int64_t a = start + threadIdx.x;
    const bool mine = a < assignments && ids[a] == e;
    const unsigned ballot = __ballot_sync(kFull, mine);
    if (lane == 0) warp_totals[warp] = __popc(ballot);
    __syncthreads();
    int32_t before = 0, total = 0;
    for (int w = 0; w < kGroupThreads / 32; ++w) {
      before += w < warp ? warp_totals[w] : 0;
      total += warp_totals[w];
    }
    if (mine) {
      const int32_t r = base + before + __popc(ballot & ((1u << lane) - 1u));
      rows[r] = static_cast<int32_t>(a / top_k);
      slots[a] = r;
    }
    base += total;
    __syncthreads();  // warp_totals is rewritten by the next chunk
  }
}

// ---------------------------------------------------------------------------------------------
// The grouped expert GEMM. Two block shapes, one per-element arithmetic (every output element is
// acc = mma(acc, ...) over K's 16-wide steps in increasing order from zero, whatever the block,
// warp or fragment position its row and column land in): which one runs changes speed only.

using ptx::CpAsync16;
using ptx::CpAsyncCommit;
using ptx::CpAsyncWait;
using ptx::Mma16816;

// A block of kWarpsM x kWarpsN warps, each 32 rows x 8 kNi columns (2 x kNi m16n8 tiles); K
// staged kBk at a time through a 3-deep cp.async ring, rows padded by 8 bf16 (bank spread).
template <int kWarpsM, int kWarpsN, int kNi, int kBk>
struct GemmShape {
  static constexpr int kBm = 32 * kWarpsM;  // rows of a tile (MoeGroup's tile_rows)
  static constexpr int kBn = 8 * kNi * kWarpsN;
  static constexpr int kThreads = 32 * kWarpsM * kWarpsN;
  static constexpr int kStages = 3;
  static constexpr int kRowStride = kBk + 8;
  static constexpr int kChunks = kBk / 8;  // 16-byte chunks per staged row
  static constexpr int kWarpsColumns = kWarpsN;
  static constexpr int kColumnTiles = kNi;  // n8 tiles per warp
  static_assert((kBm * kChunks) % kThreads == 0 && (kBn * kChunks) % kThreads == 0,
                "every thread copies the same number of chunks");
  struct Smem {
    bf16 a[kStages][kBm][kRowStride];
    bf16 b[kStages][kBn][kRowStride];
  };
};
// Decode (few rows per expert): 32-row tiles, 64 columns, 4 warps side by side.
using SmallGemm = GemmShape<1, 4, 2, 64>;
// Prefill (many rows per expert): 64-row tiles, 128 columns, 2 x 2 warps of 32 x 64 -- half the
// shared-memory reads per MMA.
using LargeGemm = GemmShape<2, 2, 8, 32>;
static_assert(SmallGemm::kBm == kMoeTileRows && LargeGemm::kBm == kMoeTileRowsLarge,
              "moe.h states the tile rows");
static_assert(SmallGemm::kBn == kMoeGemmAlign && SmallGemm::kChunks * 8 == kMoeGemmAlign,
              "moe.h states the alignment");
static_assert(sizeof(SmallGemm::Smem) <= 46 * 1024 && sizeof(LargeGemm::Smem) <= 46 * 1024,
              "static shared memory");

template <class G>
__global__ void __launch_bounds__(G::kThreads) MoeExpertGemmKernel(MoeGemmParams params) {
  constexpr int kBm = G::kBm, kBn = G::kBn, kStages = G::kStages, kChunks = G::kChunks;
  constexpr int kBk = kChunks * 8;
  __shared__ __align__(16) typename G::Smem smem;
  __shared__ int32_t tile_rows[kBm];  // x row of each tile row (valid rows only)
  const int32_t tile = blockIdx.x;
  const int32_t num_experts = params.num_experts;
  if (tile >= params.tile_offsets[num_experts]) return;
  // The expert owning this tile: the last e with tile_offsets[e] <= tile (an empty expert has
  // tile_offsets[e] == tile_offsets[e + 1], so taking the last skips it).
  int32_t lo = 0, hi = num_experts - 1;
  while (lo < hi) {
    const int32_t mid = (lo + hi + 1) / 2;
    if (params.tile_offsets[mid] <= tile) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  const int32_t e = lo;
  const int32_t row0 = params.expert_offsets[e] + (tile - params.tile_offsets[e]) * kBm;
  const int32_t valid_rows = min(kBm, params.expert_offsets[e + 1] - row0);
  const int64_t n0 = static_cast<int64_t>(blockIdx.y) * kBn;
  const int64_t k = params.k;
  for (int r = threadIdx.x; r < kBm; r += G::kThreads) {
    tile_rows[r] = r < valid_rows ? (params.rows != nullptr ? params.rows[row0 + r] : row0 + r) : 0;
  }
  __syncthreads();
  const bf16* w = params.w + static_cast<int64_t>(e) * params.expert_stride + n0 * k;

  // Issues stage `s`'s copies of K columns [kt * kBk, kt * kBk + kBk).
  auto load = [&](int s, int64_t kt) {
    const int64_t k0 = kt * kBk;
#pragma unroll
    for (int i = 0; i < kBm * kChunks / G::kThreads; ++i) {
      const int c = threadIdx.x + i * G::kThreads;
      const int r = c / kChunks, chunk = c % kChunks;
      const bf16* src = params.x + static_cast<int64_t>(tile_rows[r]) * k + k0 + chunk * 8;
      CpAsync16(&smem.a[s][r][chunk * 8], src, r < valid_rows);
    }
#pragma unroll
    for (int i = 0; i < kBn * kChunks / G::kThreads; ++i) {
      const int c = threadIdx.x + i * G::kThreads;
      const int r = c / kChunks, chunk = c % kChunks;
      CpAsync16(&smem.b[s][r][chunk * 8], w + r * k + k0 + chunk * 8, true);
    }
  };

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, q = lane % 4;
  const int warp_row = (warp / G::kWarpsColumns) * 32;
  const int warp_col = (warp % G::kWarpsColumns) * 8 * G::kColumnTiles;
  float acc[2][G::kColumnTiles][4] = {};  // [m16 tile][n8 tile][fragment]
  const int64_t k_tiles = k / kBk;
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < k_tiles) load(s, s);
    CpAsyncCommit();
  }
  for (int64_t kt = 0; kt < k_tiles; ++kt) {
    CpAsyncWait<kStages - 2>();
    __syncthreads();  // stage kt landed for all threads; stage kt - 1 is no longer read
    const int64_t next = kt + kStages - 1;
    if (next < k_tiles) load(static_cast<int>(next % kStages), next);
    CpAsyncCommit();
    const int s = static_cast<int>(kt % kStages);
#pragma unroll
    for (int kk = 0; kk < kBk / 16; ++kk) {
      const int col = kk * 16 + q * 2;
      uint32_t a[2][4];
#pragma unroll
      for (int mi = 0; mi < 2; ++mi) {
        const int r = warp_row + mi * 16 + g;
        a[mi][0] = *reinterpret_cast<const uint32_t*>(&smem.a[s][r][col]);
        a[mi][1] = *reinterpret_cast<const uint32_t*>(&smem.a[s][r + 8][col]);
        a[mi][2] = *reinterpret_cast<const uint32_t*>(&smem.a[s][r][col + 8]);
        a[mi][3] = *reinterpret_cast<const uint32_t*>(&smem.a[s][r + 8][col + 8]);
      }
#pragma unroll
      for (int ni = 0; ni < G::kColumnTiles; ++ni) {
        const int nr = warp_col + ni * 8 + g;
        const uint32_t b0 = *reinterpret_cast<const uint32_t*>(&smem.b[s][nr][col]);
        const uint32_t b1 = *reinterpret_cast<const uint32_t*>(&smem.b[s][nr][col + 8]);
#pragma unroll
        for (int mi = 0; mi < 2; ++mi) Mma16816(acc[mi][ni], a[mi], b0, b1);
      }
    }
  }
  CpAsyncWait<0>();

  // acc[mi][ni][0, 1]: row mi * 16 + g, columns 2q, 2q + 1 of the n8 tile; [2, 3]: row + 8.
  const int64_t n = params.n;
#pragma unroll
  for (int mi = 0; mi < 2; ++mi) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = warp_row + mi * 16 + g + half * 8;
      if (r >= valid_rows) continue;
      const int64_t out_row = row0 + r;
#pragma unroll
      for (int ni = 0; ni < G::kColumnTiles; ++ni) {
        const int64_t col = n0 + warp_col + ni * 8 + q * 2;
        const float v0 = acc[mi][ni][half * 2], v1 = acc[mi][ni][half * 2 + 1];
        if (params.output == MoeGemmOutput::kBf16) {
          *reinterpret_cast<__nv_bfloat162*>(static_cast<bf16*>(params.y) + out_row * n + col) =
              __floats2bfloat162_rn(v0, v1);
        } else {
          *reinterpret_cast<float2*>(static_cast<float*>(params.y) + out_row * n + col) =
              make_float2(v0, v1);
        }
      }
    }
  }
}

template <class G>
cudaError_t LaunchExpertGemm(const MoeGemmParams& params, cudaStream_t stream) {
  if (params.n % G::kBn != 0 || params.k % (G::kChunks * 8) != 0 || params.n / G::kBn > 65535) {
    return cudaErrorInvalidValue;
  }
  const int64_t tiles = MoeMaxTiles(params.assignments, params.num_experts, G::kBm);
  const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(params.n / G::kBn));
  MoeExpertGemmKernel<G><<<grid, G::kThreads, 0, stream>>>(params);
  return cudaGetLastError();
}

// ---------------------------------------------------------------------------------------------
// Combine: one block per token, a thread per 4 columns.

constexpr int kCombineThreads = 256;

__global__ void MoeCombineKernel(const float* y, const int32_t* slots, const float* weights,
                                 int32_t top_k, int64_t hidden, float* x) {
  const int64_t t = blockIdx.y;
  const int64_t c4 = static_cast<int64_t>(blockIdx.x) * kCombineThreads + threadIdx.x;
  if (c4 * 4 >= hidden) return;
  float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  for (int j = 0; j < top_k; ++j) {
    const float w = weights[t * top_k + j];
    const float4 v = reinterpret_cast<const float4*>(
        y + static_cast<int64_t>(slots[t * top_k + j]) * hidden)[c4];
    acc.x = fmaf(w, v.x, acc.x);
    acc.y = fmaf(w, v.y, acc.y);
    acc.z = fmaf(w, v.z, acc.z);
    acc.w = fmaf(w, v.w, acc.w);
  }
  float4* out = reinterpret_cast<float4*>(x + t * hidden) + c4;
  float4 r = *out;
  r.x = r.x + acc.x;
  r.y = r.y + acc.y;
  r.z = r.z + acc.z;
  r.w = r.w + acc.w;
  *out = r;
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
      (tile_rows != kMoeTileRows && tile_rows != kMoeTileRowsLarge)) {
    return cudaErrorInvalidValue;
  }
  const int64_t assignments = num_tokens * top_k;
  MoeCountKernel<<<num_experts, kGroupThreads, 0, stream>>>(ids, assignments, grouping.counts);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  MoeScatterKernel<<<num_experts, kGroupThreads, 0, stream>>>(
      ids, assignments, top_k, num_experts, tile_rows, grouping.counts, grouping.expert_offsets,
      grouping.tile_offsets, grouping.rows, grouping.slots);
  return cudaGetLastError();
}

cudaError_t MoeExpertGemm(const MoeGemmParams& params, cudaStream_t stream) {
  if (params.n % kMoeGemmAlign != 0 || params.k % kMoeGemmAlign != 0 || params.n <= 0 ||
      params.k <= 0 || params.num_experts < 1 || params.num_experts > kMoeMaxExperts ||
      !Aligned16(params.x) || !Aligned16(params.w) || !Aligned16(params.y) ||
      params.expert_stride % 8 != 0) {
    return cudaErrorInvalidValue;
  }
  if (params.assignments == 0) return cudaSuccess;
  if (params.tile_rows == SmallGemm::kBm) return LaunchExpertGemm<SmallGemm>(params, stream);
  if (params.tile_rows == LargeGemm::kBm) return LaunchExpertGemm<LargeGemm>(params, stream);
  return cudaErrorInvalidValue;
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

cudaError_t MoeExperts(const MoeLayerParams& p, cudaStream_t stream) {
  if (p.num_tokens == 0) return cudaSuccess;
  const int64_t assignments = p.num_tokens * p.top_k;
  const int32_t tile_rows = MoeTileRowsFor(assignments, p.num_experts, p.hidden);
  cudaError_t err =
      MoeGroup(p.ids, p.num_tokens, p.num_experts, p.top_k, tile_rows, p.grouping, stream);
  if (err != cudaSuccess) return err;
  MoeGemmParams gemm;
  gemm.tile_rows = tile_rows;
  gemm.x = p.xn;
  gemm.rows = p.grouping.rows;
  gemm.assignments = assignments;
  gemm.w = p.w_gate_up;
  gemm.expert_stride = 2 * p.inter * p.hidden;
  gemm.n = 2 * p.inter;
  gemm.k = p.hidden;
  gemm.expert_offsets = p.grouping.expert_offsets;
  gemm.tile_offsets = p.grouping.tile_offsets;
  gemm.num_experts = p.num_experts;
  gemm.output = MoeGemmOutput::kBf16;
  gemm.y = p.gate_up;
  if ((err = MoeExpertGemm(gemm, stream)) != cudaSuccess) return err;
  // SiluMul's grid holds 65535 rows: the same kernel over consecutive row ranges.
  for (int64_t r0 = 0; r0 < assignments; r0 += 65535) {
    const int64_t rn = std::min<int64_t>(65535, assignments - r0);
    err = SiluMul(p.gate_up + r0 * 2 * p.inter, rn, p.inter, p.act + r0 * p.inter, stream);
    if (err != cudaSuccess) return err;
  }
  gemm.x = p.act;
  gemm.rows = nullptr;
  gemm.w = p.w_down;
  gemm.expert_stride = p.hidden * p.inter;
  gemm.n = p.hidden;
  gemm.k = p.inter;
  gemm.output = MoeGemmOutput::kF32;
  gemm.y = p.y;
  if ((err = MoeExpertGemm(gemm, stream)) != cudaSuccess) return err;
  return MoeCombine(p.y, p.grouping.slots, p.weights, p.num_tokens, p.top_k, p.hidden, p.x, stream);
}

}  // namespace rollout::cuda
