// Paged causal attention with one per-row algorithm for prefill and decode (docs/determinism.md).
//
// Version 1 (this file): SIMT fp32. A block owns one work item (up to a few consecutive tokens of
// one sequence) for one kv head, so the GQA group's query heads share every K/V tile read. Tiles
// of 32 keys are staged in shared memory; lane j of a warp scores key j of the tile (a sequential
// fmaf chain over head_dim), the warp then updates the online softmax of the row and folds each
// split's partial into the row's result in split order. A row's arithmetic is one device
// function of (q row, its cached keys and values, its position, split size): which rows share a
// block (kOneToken vs kManyTokens) changes nothing but speed.
#include <algorithm>
#include <cmath>

#include "kernels/cuda/attention_fold.cuh"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/warp_reduce.cuh"

namespace rollout::cuda {
namespace {

constexpr int kTile = kAttentionTile;

// Rows (token, head) per block of the kManyTokens shape: kWarps * kRows.
constexpr int kManyWarps = 8;
constexpr int kManyRows = 8;
constexpr int kOneWarps = 4;
constexpr int kOneRows = 1;

template <int kHeadDim, int kWarps, int kRows>
struct AttentionSmem {
  static constexpr int kKStride = kHeadDim + 8;  // bf16 per staged key: 16 B pad, no conflicts
  static constexpr size_t kQBytes = sizeof(float) * kWarps * kRows * kHeadDim;
  static constexpr size_t kKBytes = sizeof(bf16) * kTile * kKStride;
  static constexpr size_t kVBytes = sizeof(bf16) * kTile * kHeadDim;
  static constexpr size_t kPBytes = sizeof(float) * kWarps * kRows * kTile;
  static constexpr size_t kBytes = kQBytes + kKBytes + kVBytes + kPBytes;
};

template <int kHeadDim, int kWarps, int kRows>
__global__ void __launch_bounds__(kWarps * 32)
    PagedAttentionKernel(AttentionParams p, KvCacheView cache) {
  constexpr int E = kHeadDim / 32;       // output dims per lane
  constexpr int kChunks = kHeadDim / 8;  // 16-byte chunks per key
  using Smem = AttentionSmem<kHeadDim, kWarps, kRows>;
  extern __shared__ float4 smem[];
  float* q_s = reinterpret_cast<float*>(smem);  // [kWarps * kRows, kHeadDim]
  bf16* k_s = reinterpret_cast<bf16*>(reinterpret_cast<char*>(smem) + Smem::kQBytes);
  bf16* v_s = reinterpret_cast<bf16*>(reinterpret_cast<char*>(k_s) + Smem::kKBytes);
  float* p_s = reinterpret_cast<float*>(reinterpret_cast<char*>(v_s) + Smem::kVBytes);
  // k_s: [kTile, kKStride]; v_s: [kTile, kHeadDim]; p_s: [kWarps * kRows, kTile]

  const int2 item = p.items[blockIdx.x];  // (first token, count)
  const int kv_head = blockIdx.y;
  const int num_kv_heads = cache.num_kv_heads;
  const int group = p.num_heads / num_kv_heads;
  const int num_rows = item.y * group;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int32_t* table = p.tables + p.table_offsets[item.x];

  // Stage the block's query rows: row r = (token item.x + r / group, head kv_head*group + r%group).
  for (int i = threadIdx.x; i < num_rows * (kHeadDim / 4); i += kWarps * 32) {
    const int r = i / (kHeadDim / 4);
    const int c = i % (kHeadDim / 4);
    const int64_t t = item.x + r / group;
    const int h = kv_head * group + r % group;
    reinterpret_cast<float4*>(q_s)[i] =
        reinterpret_cast<const float4*>(p.q + (t * p.num_heads + h) * kHeadDim)[c];
  }
  int max_pos = 0;
  for (int i = 0; i < item.y; ++i) max_pos = max(max_pos, p.positions[item.x + i]);

  int pos[kRows];
  float m[kRows], l[kRows], big_m[kRows], big_l[kRows];
  float o[kRows][E], big_o[kRows][E];
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    const int r = warp * kRows + i;
    pos[i] = r < num_rows ? p.positions[item.x + r / group] : -1;  // -1: no row, never active
    m[i] = -INFINITY;
    l[i] = 0.0f;
    big_m[i] = -INFINITY;
    big_l[i] = 0.0f;
#pragma unroll
    for (int e = 0; e < E; ++e) {
      o[i][e] = 0.0f;
      big_o[i][e] = 0.0f;
    }
  }
  // Split-parallel mode: this block walks split blockIdx.z alone (idle splits exit).
  const int split = p.partials != nullptr ? static_cast<int>(blockIdx.z) : 0;
  const int walk_begin = p.partials != nullptr ? split * p.split_size : 0;
  const int walk_end =
      p.partials != nullptr ? min(max_pos + 1, walk_begin + p.split_size) : max_pos + 1;
  if (walk_begin >= walk_end) return;  // block-uniform, before any barrier
  __syncthreads();

  for (int tile_start = walk_begin; tile_start < walk_end; tile_start += kTile) {
    // Stage the tile's keys and values (positions past max_pos are never read by any row).
    for (int i = threadIdx.x; i < kTile * kChunks; i += kWarps * 32) {
      const int j = i / kChunks;
      const int c = i % kChunks;
      const int key = tile_start + j;
      if (key <= max_pos) {
        const int64_t offset =
            KvPageOffset(table[key / cache.block_size], kv_head, key % cache.block_size,
                         cache.block_size, num_kv_heads, kHeadDim) +
            c * 8;
        *reinterpret_cast<uint4*>(k_s + j * Smem::kKStride + c * 8) =
            *reinterpret_cast<const uint4*>(cache.k + offset);
        *reinterpret_cast<uint4*>(v_s + j * kHeadDim + c * 8) =
            *reinterpret_cast<const uint4*>(cache.v + offset);
      }
    }
    __syncthreads();

    // Scores: lane j dots key tile_start + j with each of the warp's rows.
    float acc[kRows];
#pragma unroll
    for (int i = 0; i < kRows; ++i) acc[i] = 0.0f;
    const bf16* k_row = k_s + lane * Smem::kKStride;
#pragma unroll 4
    for (int c = 0; c < kChunks; ++c) {
      const uint4 raw = *reinterpret_cast<const uint4*>(k_row + c * 8);
      const __nv_bfloat162* k2 = reinterpret_cast<const __nv_bfloat162*>(&raw);
      float kf[8];
#pragma unroll
      for (int h = 0; h < 4; ++h) {
        const float2 f = __bfloat1622float2(k2[h]);
        kf[2 * h] = f.x;
        kf[2 * h + 1] = f.y;
      }
#pragma unroll
      for (int i = 0; i < kRows; ++i) {
        const float4* q4 = reinterpret_cast<const float4*>(q_s + (warp * kRows + i) * kHeadDim);
        const float4 qa = q4[2 * c];
        const float4 qb = q4[2 * c + 1];
        acc[i] = fmaf(qa.x, kf[0], acc[i]);
        acc[i] = fmaf(qa.y, kf[1], acc[i]);
        acc[i] = fmaf(qa.z, kf[2], acc[i]);
        acc[i] = fmaf(qa.w, kf[3], acc[i]);
        acc[i] = fmaf(qb.x, kf[4], acc[i]);
        acc[i] = fmaf(qb.y, kf[5], acc[i]);
        acc[i] = fmaf(qb.z, kf[6], acc[i]);
        acc[i] = fmaf(qb.w, kf[7], acc[i]);
      }
    }

    // Online softmax update of each active row (warp-uniform branches).
    int last_j[kRows];  // last key of the tile the row sees; -1 when the row is past its end
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      last_j[i] = min(kTile - 1, pos[i] - tile_start);
      if (last_j[i] < 0) continue;
      const bool valid = lane <= last_j[i];
      const float s = valid ? acc[i] * p.scale : -INFINITY;
      const float m_new = fmaxf(m[i], WarpMax(s));
      const float alpha = expf(m[i] - m_new);
      const float pj = valid ? expf(s - m_new) : 0.0f;
      l[i] = l[i] * alpha + WarpSum(pj);
#pragma unroll
      for (int e = 0; e < E; ++e) o[i][e] = o[i][e] * alpha;
      m[i] = m_new;
      p_s[(warp * kRows + i) * kTile + lane] = pj;
    }
    __syncwarp();

    // o += p_j * v_j in increasing j, each V element read once for all the warp's rows.
#pragma unroll 2
    for (int j = 0; j < kTile; ++j) {
      float vf[E];
      const bf16* v_row = v_s + j * kHeadDim + lane * E;
#pragma unroll
      for (int e = 0; e < E; ++e) vf[e] = __bfloat162float(v_row[e]);
#pragma unroll
      for (int i = 0; i < kRows; ++i) {
        if (j > last_j[i]) continue;
        const float pj = p_s[(warp * kRows + i) * kTile + j];
#pragma unroll
        for (int e = 0; e < E; ++e) o[i][e] = fmaf(pj, vf[e], o[i][e]);
      }
    }

    // A split ends at an absolute multiple of split_size or at the row's own last tile. In
    // split-parallel mode the block owns one split: its partial is stored for the merge kernel.
    const int tile_end = tile_start + kTile;
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      if (last_j[i] < 0) continue;
      if (tile_end % p.split_size != 0 && tile_end <= pos[i]) continue;
      if (p.partials != nullptr) {
        // One-token items: row = (token, head).
        const int64_t row = static_cast<int64_t>(item.x) * p.num_heads + kv_head * group +
                            (warp * kRows + i) % group;
        float* dst = p.partials + (row * p.max_splits + split) * (kHeadDim + 2);
        if (lane == 0) {
          dst[0] = m[i];
          dst[1] = l[i];
        }
#pragma unroll
        for (int e = 0; e < E; ++e) dst[2 + lane * E + e] = o[i][e];
      } else {
        FoldPartial<E>(m[i], l[i], o[i], &big_m[i], &big_l[i], big_o[i]);
      }
#pragma unroll
      for (int e = 0; e < E; ++e) o[i][e] = 0.0f;
      m[i] = -INFINITY;
      l[i] = 0.0f;
    }
    __syncthreads();  // the next tile overwrites k_s, v_s and p_s
  }

  if (p.partials != nullptr) return;
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    if (pos[i] < 0) continue;
    const int r = warp * kRows + i;
    const int64_t t = item.x + r / group;
    const int h = kv_head * group + r % group;
    bf16* dst = p.out + (t * p.num_heads + h) * kHeadDim + lane * E;
#pragma unroll
    for (int e = 0; e < E; ++e) dst[e] = __float2bfloat16_rn(big_o[i][e] / big_l[i]);
  }
}

constexpr int kMergeWarps = 8;

// One warp per (token, head) row: folds the row's stored split partials in increasing split
// order (FoldPartial, as the in-block walk does) and writes O / L.
template <int kHeadDim>
__global__ void __launch_bounds__(kMergeWarps * 32) MergeSplitsKernel(AttentionParams p) {
  const int lane = threadIdx.x % 32;
  const int64_t w = static_cast<int64_t>(blockIdx.x) * kMergeWarps + threadIdx.x / 32;
  if (w >= static_cast<int64_t>(p.num_items) * p.num_heads) return;  // w = (item, head)
  const int64_t t = p.items[w / p.num_heads].x;
  const int64_t row = t * p.num_heads + w % p.num_heads;  // partials row = (token, head)
  const int splits = p.positions[t] / p.split_size + 1;
  MergeStoredSplits<kHeadDim>(p.partials, p.max_splits, row, splits, p.out, lane);
}

template <int kHeadDim, int kWarps, int kRows>
cudaError_t Launch(const AttentionParams& p, KvCacheView cache, cudaStream_t stream) {
  constexpr size_t kSmem = AttentionSmem<kHeadDim, kWarps, kRows>::kBytes;
  auto kernel = PagedAttentionKernel<kHeadDim, kWarps, kRows>;
  if (kSmem > 48 * 1024) {
    // Idempotent and cheap; done on every launch so no hidden "initialised" flag is needed.
    const cudaError_t err =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
    if (err != cudaSuccess) return err;
  }
  const unsigned splits = p.partials != nullptr ? static_cast<unsigned>(p.max_splits) : 1u;
  const dim3 grid(static_cast<unsigned>(p.num_items), static_cast<unsigned>(cache.num_kv_heads),
                  splits);
  kernel<<<grid, kWarps * 32, kSmem, stream>>>(p, cache);
  if (p.partials == nullptr) return cudaGetLastError();
  const int64_t rows = static_cast<int64_t>(p.num_items) * p.num_heads;
  MergeSplitsKernel<kHeadDim><<<static_cast<unsigned>((rows + kMergeWarps - 1) / kMergeWarps),
                                kMergeWarps * 32, 0, stream>>>(p);
  return cudaGetLastError();
}

template <int kHeadDim>
cudaError_t LaunchShape(const AttentionParams& p, AttentionBlockShape shape, KvCacheView cache,
                        cudaStream_t stream) {
  if (shape == AttentionBlockShape::kOneToken) {
    return Launch<kHeadDim, kOneWarps, kOneRows>(p, cache, stream);
  }
  return Launch<kHeadDim, kManyWarps, kManyRows>(p, cache, stream);
}

}  // namespace

int AttentionItemTokens(int group) { return std::max(1, kManyWarps * kManyRows / group); }

cudaError_t PagedAttention(const AttentionParams& params, AttentionBlockShape shape,
                           KvCacheView cache, cudaStream_t stream) {
  if (params.split_size <= 0 || params.split_size % kTile != 0 || cache.num_kv_heads <= 0 ||
      params.num_heads % cache.num_kv_heads != 0) {
    return cudaErrorInvalidValue;
  }
  const int group = params.num_heads / cache.num_kv_heads;
  // kOneToken holds one token's group; kManyTokens up to 64 rows.
  if (shape == AttentionBlockShape::kOneToken && group > kOneWarps * kOneRows) {
    shape = AttentionBlockShape::kManyTokens;
  }
  if (group > kManyWarps * kManyRows) return cudaErrorInvalidValue;
  if (params.partials != nullptr && params.max_splits < 1) return cudaErrorInvalidValue;
  if (params.num_items == 0) return cudaSuccess;
  switch (cache.head_dim) {
    case 32:
      return LaunchShape<32>(params, shape, cache, stream);
    case 64:
      return LaunchShape<64>(params, shape, cache, stream);
    case 128:
      return LaunchShape<128>(params, shape, cache, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace rollout::cuda
