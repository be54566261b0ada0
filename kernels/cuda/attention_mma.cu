// Paged causal attention on tensor cores: one per-row algorithm for prefill and decode
// (docs/determinism.md), the contract in kernels/cuda/ops.h (PagedAttentionMma).
//
// Version 2 (this file): mma.sync m16n8k16 (bf16 in, fp32 accumulate). A warp owns 16 query rows;
// a block owns one split of one work item for one kv head: kOneToken blocks are one warp (a
// decode token's GQA group, padded to 16 rows), kManyTokens blocks four warps (64 rows of up to
// 64 / group consecutive tokens). Tiles of 32 keys are staged with cp.async (zero-filled past
// the item's last position); S = Q K^T and O += P V run on tensor cores; the online softmax of a
// row lives in the four lanes of its MMA quad. Each split's partial goes to memory and
// MergeAttentionSplits folds them in split order: which rows share a block, or how many splits
// run at once, changes nothing but speed. Why it replaced version 1 for speed: version 1 spends
// ~256 scalar FMAs per (row, key); here the same work is 1/128 of an MMA instruction.
//
// Staging, reworked for issue #4 (same bits: bench/attention_bench.cu compares every output and
// split partial with a copy of the kernel before, over random caches). Decode attention is a
// stream of K/V reads, and the copies in flight per SM are bounded by how many blocks fit there,
// not by how one block overlaps its copies with its math: q no longer sits in shared memory (it
// goes from global memory straight into the MMA fragments: 17.4 instead of 21.8 KB per decode
// block), registers are capped to admit as many warps as shared memory does (12 per SM), each
// lane looks up one key's page per tile and shuffles it to the copying lanes (before: a table
// read, a division and a modulo per 16-byte chunk), and K fragments come by ldmatrix.x4. H200,
// Qwen3-8B shapes, one layer: decode of 256 sequences at context ~1536 0.52 -> 0.42-0.43 ms
// (73% -> 88-91% of the device copy rate), prefill of 8 x 1024 tokens 1.03 -> 0.77-0.78 ms.
// Measured and not kept, as no faster: rings of 2..6 tiles for decode (each stage costs a block
// per SM: 2%..115% slower; a second stage does gain prefill 3%, so kManyTokens keeps it), K and
// V in separate cp.async groups refilled right after their MMAs, blocks of 2 or 4 kv heads
// (longer contiguous copies), 8-warp prefill blocks (half the K/V re-reads, fewer blocks per SM).
// Session 4: staged tiles unpadded, their 16-byte chunks XOR-swizzled by key (MmaShape::Chunk;
// 16 instead of 17.4 KB per decode block, still 12 per SM by registers): one layer of the
// 256 x ~1536 decode step 0.420 -> 0.402 ms (3.84 -> 4.01 TB/s), 32 x ~4K 0.148 -> 0.138 ms,
// the 8 x 1024 prefill 0.547 -> 0.568 ms; same bits. Measured and not kept: 13 decode blocks per
// SM (registers capped at 128, spilling: 0.429 ms); with head-major pages (ops.h), an L2 bulk
// prefetch of the next decode tile, at issue or after the tile lands (0.420 -> 0.452 ms), and
// copying a tile as one contiguous run from lane 0's row instead of the per-lane rows
// (0.420 -> 0.431 ms).
//
// Split fold in the block (prefill, same bits: the bench compares the outputs with the old kernel
// + merge's). Launched without partials, a kManyTokens block walks every split of its item and
// folds each split's (m, l, o) into the row's (M, L, O) at the split's end with the merge's own
// FoldRow / FoldElement in increasing split order, then writes FoldedOutput: no partial round
// trip (8 x 1024 tokens: 340 MB written and read back), q read once instead of once per split,
// no merge launch. The running (M, L, O) sits in shared memory, thread-private (34 KB per block:
// 3 blocks per SM still fit; registers are full), touched only at split ends; the fold runs
// between the tile loops of two splits (inside the tile loop ptxas spilled). Items go in reverse
// order so that a prefill's longest walks start first. H200, one layer of the 8 x 1024 prefill:
// kernel + merge 0.754 + 0.154 -> 0.547 ms. Decode keeps split-parallel blocks (a token's splits
// are its only parallelism) and the merge. Measured and not kept (session 11): the merge in the
// last split block of each (item, kv head) (a counter per pair, the partials read back through
// L2 by MergeStoredSplits: the same bits, 369 of 369 bench checks) -- one warp folding its rows'
// splits serially at the kernel's end was slower than the merge launch at every decode shape
// (95 x 4K..8K: 0.597 ms/layer against 0.568 + 0.018).
//
// Prefill on warpgroup MMAs (session 18, same bits: bench/attention_bench.cu's 341 checks against
// the old kernel + merge, and tests/gpu/kernels_test.cc). With head dim 128 and pages of 32 keys,
// the folding kManyTokens block's four warps run as one warpgroup: S = Q K^T as one
// wgmma.mma_async m64n32k16 per k-step (q still from registers, K from the staged tile) and
// O += P V as one m64n128k16 per 16-key chunk (P from registers, V an MN-major operand), each
// element's chain the mma.sync one's (16-wide k-steps in order into the same accumulator, whose
// register layout per warp is mma.sync's) and the online softmax between them unchanged. The
// tiles are staged in the 128-byte swizzle the descriptors name (two [32 keys][64 dims] halves)
// and, a tile being one head-major page, copied as one contiguous run with no per-key lookup.
// No ldmatrix, 10 MMA instructions a tile instead of 64 a warp: H200, one layer of the 8 x 1024
// prefill 0.500 -> 0.421 ms (two leases, the bench's old kernel + merge 1.267 / 1.283 ms in
// them); the 16,384-token prefill step of 4096-token prompts (rollout-bench
// profile, the previous binary in the same lease) attention 152.1 -> 120.4 ms, the step 555.8 ->
// 520.1 ms. ncu: issue slots 60% busy, 1.6 G instructions a layer (the softmax's expf chains and
// the staging), not the tensor cores, bound the kernel now. The staging's copies then came from
// PageTileCopies (attention_tiles.h: each thread's fixed chunk, keys 8 apart, no per-copy
// division; the same copies, attention_tiles_test.cc): ~140 -> ~50 instructions a tile per
// thread in the PTX, 167 registers, no spills -- not yet timed on a GPU.
//
// Shared-prefix decode (session 26, same bits: tests/gpu/kernels_test.cc compares shared with
// unshared tokens bitwise). A split-parallel item may carry a share (ops.h,
// AttentionShareTokens): for the splits below it the block computes the rows of several tokens
// whose tables hold the same whole-split pages (token_of maps a row to its token), and the
// listed tokens' own blocks exit for those splits. H100, the RL workload of 32 x 8 samples:
// 167.76 s against 169.96 s end to end -- the repeated prompt reads it removes were mostly L2
// hits already, the sharers' blocks running one after another.
#include <climits>
#include <cmath>
#include <cstdint>

#include "kernels/cuda/attention_fold.cuh"
#include "kernels/cuda/attention_tiles.h"
#include "kernels/cuda/mma_ptx.cuh"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/wgmma_ptx.cuh"

namespace rollout::cuda {
namespace {

constexpr int kTile = kAttentionTile;  // keys per tile

using ptx::CpAsync16;
using ptx::CpAsyncCommit;
using ptx::CpAsyncWait;
using ptx::LdMatrixX2Trans;
using ptx::LdMatrixX4;
using ptx::Mma16816;

__device__ __forceinline__ uint32_t PackBf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// The quad (4 lanes of one MMA row) reductions, in one fixed order.
__device__ __forceinline__ float QuadMax(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float QuadSum(float v) {
  v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

// The online-softmax update of one row for one tile: s[8] are the thread's scores of the row
// (keys 8j + 2t + {0, 1}, j = 0..3), already masked; p[8] receives the probabilities.
// kSelect: p = 0 for a masked key by a select (decode blocks measured faster so); else by
// expf(-inf - m_new) = +0 itself -- the same bits.
template <bool kSelect>
__device__ __forceinline__ float RowUpdate(const float (&s)[8], float* m, float* l, float (&p)[8]) {
  float tile_max = s[0];
#pragma unroll
  for (int i = 1; i < 8; ++i) tile_max = fmaxf(tile_max, s[i]);
  tile_max = QuadMax(tile_max);
  const float m_new = fmaxf(*m, tile_max);
  // A row with no key so far (only padding rows) stays at m = -inf with p = 0, o untouched.
  const bool none = m_new == -INFINITY;
  const float alpha = none ? 1.0f : expf(*m - m_new);
  float sum = 0.0f;
  if (none) {
    // Uniform over the row's quad, and over the warp for a decode block's padding rows g + 8:
    // no exponentials for a row without keys (p = 0, sum = 0: the bits of the loop below).
#pragma unroll
    for (int i = 0; i < 8; ++i) p[i] = 0.0f;
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      p[i] = kSelect && s[i] == -INFINITY ? 0.0f : expf(s[i] - m_new);
      sum = sum + p[i];
    }
  }
  *l = *l * alpha + QuadSum(sum);
  *m = m_new;
  return alpha;
}

// A block's shape: kWarps warps of 16 query rows of one kv head, and a ring of kStages K/V tiles
// in shared memory that all of them fill. kWgmma: the four warps are one warpgroup whose S and
// P V run as wgmma.mma_async (kHeadDim 128; see the kernel).
template <int kHeadDim, int kWarps, int kStages, bool kFold, bool kWgmma = false>
struct MmaShape {
  static_assert(!kWgmma || (kWarps == 4 && kHeadDim == 128), "one warpgroup, 2 x 64 dims");
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kStride = kHeadDim;  // bf16 per staged key: no padding ...
  // ... the chunks of key j are stored XOR-swizzled (attention_tiles.h: SwizzledChunk, or, for
  // kWgmma, two [kTile keys][64 dims] halves in the 128-byte swizzle wgmma's descriptors name,
  // from a 1024-byte aligned ring).
  __device__ static int Chunk(int key, int c) { return SwizzledChunk<kHeadDim>(key, c); }
  __device__ static int Offset(int j, int c) { return StagedChunkOffset<kHeadDim, kWgmma>(j, c); }
  // One stage: K then V, each [kTile, kStride] bf16.
  static constexpr int kTileElems = kTile * kStride;
  static constexpr size_t kRingBytes = sizeof(bf16) * kStages * 2 * kTileElems;
  static constexpr size_t kAlignBytes = kWgmma ? 1024 : 0;  // the ring's base rounded up to it
  // Folding blocks: each thread's running (M, L, O) of its 2 rows (O: kHeadDim / 4 dims each, of
  // the MMA layout), thread-private, [4 + kHeadDim / 2][kThreads] fp32 after the ring (registers
  // are full).
  static constexpr int kFoldElems = 4 + kHeadDim / 2;
  static constexpr size_t kSmemBytes =
      kAlignBytes + kRingBytes + (kFold ? sizeof(float) * kFoldElems * kThreads : 0);
  // Registers capped so that they admit as many warps per SM as shared memory does for one-stage
  // decode blocks (16 KB + 1 KB reserved each, 228 KB per SM: 13 blocks, 152 registers per
  // thread); four-warp blocks keep 168 (3 per SM).
  static constexpr int kMinBlocks = 12 / kWarps;
};

// Issues the cp.async copies of one K/V tile (keys tile_start .. tile_start + 31) into
// k_s / v_s, zero-filling keys past max_pos. lane_row: the cache offset (elements) of lane l's
// key tile_start + l at the block's kv head (any value past max_pos). Every lane of a warp runs
// the same iterations (the chunk count is a multiple of 32): the shuffle is warp-uniform.
template <class Shape>
__device__ __forceinline__ void IssueTile(const KvCacheView& cache, int tile_start, int max_pos,
                                          int64_t lane_row, bf16* k_s, bf16* v_s) {
  constexpr int kChunks = Shape::kStride / 8;  // 16-byte chunks per key
  for (int i = threadIdx.x; i < kTile * kChunks; i += Shape::kThreads) {
    const int j = i / kChunks;  // key of the tile
    const int c = i % kChunks;
    const int64_t src = __shfl_sync(0xffffffffu, lane_row, j) + c * 8;
    const int dst = Shape::Offset(j, c);
    const bool valid = tile_start + j <= max_pos;
    CpAsync16(k_s + dst, cache.k + src, valid);
    CpAsync16(v_s + dst, cache.v + src, valid);
  }
}

// The same for a tile that is one whole page (block_size == kTile) at the block's kv head: its
// 32 keys' rows are contiguous in the head-major page from the cache offset `page_row`, so a
// thread's copies (PageTileCopies: the same chunk of keys kThreads / chunks apart) need no
// per-key lookup. (As a loop over i = thread, thread + kThreads, ... with signed index arithmetic
// it compiled to ~140 instructions a tile per thread for these 8 copies.)
template <int kHeadDim, int kThreads, bool kWgmma>
__device__ __forceinline__ void IssuePageTile(const KvCacheView& cache, int tile_start, int max_pos,
                                              int64_t page_row, bf16* k_s, bf16* v_s) {
  using Copies = PageTileCopies<kHeadDim, kThreads, kWgmma>;
  const bf16* k = cache.k + page_row;
  const bf16* v = cache.v + page_row;
#pragma unroll
  for (int r = 0; r < Copies::kCopies; ++r) {
    const TileCopy copy = Copies::Copy(threadIdx.x, r);
    const bool valid = tile_start + copy.key <= max_pos;
    CpAsync16(k_s + copy.dst, k + copy.src, valid);
    CpAsync16(v_s + copy.dst, v + copy.src, valid);
  }
}

// Tile t of the block's walk is staged in ring stage t % kStages while tiles t + 1 ..
// t + kStages - 1 are in flight (kOneToken: one stage, kManyTokens: two; the file comment says
// why). !kFold: the block walks one split (grid: item, split, kv head) and stores each row's
// partial. kFold: the block walks every split of its item (grid: kv head, item -- items in
// reverse order, so that the longest walks of a prefill start first), folds each split's
// partial into the row's (M, L, O) at the split's end with FoldRow / FoldElement in increasing
// split order -- what MergeAttentionSplits does with the stored partials -- and writes
// bf16(O / L) itself.
template <int kHeadDim, int kWarps, int kStages, bool kFold, bool kWgmma>
__global__ void __launch_bounds__(MmaShape<kHeadDim, kWarps, kStages, kFold, kWgmma>::kThreads,
                                  MmaShape<kHeadDim, kWarps, kStages, kFold, kWgmma>::kMinBlocks)
    MmaAttentionKernel(AttentionParams p, KvCacheView cache) {
  using Shape = MmaShape<kHeadDim, kWarps, kStages, kFold, kWgmma>;
  constexpr int kStride = Shape::kStride;
  constexpr int kSteps = kHeadDim / 16;    // k-steps of Q K^T
  constexpr int kDimTiles = kHeadDim / 8;  // n-tiles of P V
  extern __shared__ uint4 smem[];
  bf16* ring = reinterpret_cast<bf16*>(smem);  // [kStages][K, V][kTile, kStride]
  if constexpr (kWgmma) {
    ring = reinterpret_cast<bf16*>((reinterpret_cast<uintptr_t>(smem) + Shape::kAlignBytes - 1) &
                                   ~uintptr_t{Shape::kAlignBytes - 1});
  }

  const int num_kv_heads = cache.num_kv_heads;
  // Split-parallel grid: x = (item, split, kv head), kv heads fastest, so that the blocks that
  // run together read the same pages' rows of every kv head (the cache interleaves heads per
  // key) and one sequence's splits in order: 1% faster decode than (item, kv head, split) as x,
  // y, z, which read 256-byte rows 2 KB apart.
  int item_index, kv_head, split;
  if (kFold) {
    item_index = p.num_items - 1 - static_cast<int>(blockIdx.y);
    kv_head = blockIdx.x;
    split = 0;
  } else {
    const int flat = static_cast<int>(blockIdx.x / num_kv_heads);
    kv_head = static_cast<int>(blockIdx.x % num_kv_heads);
    item_index = flat / p.max_splits;
    split = flat % p.max_splits;
  }
  const int2 item = p.items[item_index];  // (first token, count)
  // The block's tokens: the item's consecutive ones, or, for a split below a lead's share, the
  // share's list (ops.h, AttentionShareTokens). Block-uniform exits come before any load or
  // barrier.
  int num_tokens = item.y;
  const int32_t* listed = nullptr;
  if (!kFold && p.shares != nullptr) {
    const int4 share = p.shares[item_index];
    if (split < share.x) return;  // computed by this token's lead
    if (split < share.y) {
      num_tokens = share.z;
      listed = p.share_tokens + share.w;
    }
  }
  auto token_of = [&](int i) { return listed != nullptr ? listed[i] : item.x + i; };
  const int group = p.num_heads / num_kv_heads;
  const int num_rows = num_tokens * group;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t4 = lane % 4;

  int max_pos = 0;
  for (int i = 0; i < num_tokens; ++i) max_pos = max(max_pos, p.positions[token_of(i)]);
  const int walk_begin = split * p.split_size;
  const int walk_end = kFold ? max_pos + 1 : min(max_pos + 1, walk_begin + p.split_size);
  if (walk_begin >= walk_end) return;  // idle split
  const int num_tiles = (walk_end - walk_begin + kTile - 1) / kTile;
  const int32_t* table = p.tables + p.table_offsets[token_of(0)];
  // The cache offset of lane l's key l of tile t (0 past max_pos, where no copy reads it).
  // kWgmma (launched for pages of kTile keys only): of the tile's page.
  auto lane_row = [&](int t) -> int64_t {
    if (kWgmma) {
      if (t >= num_tiles) return 0;
      return KvPageOffset(table[walk_begin / kTile + t], kv_head, 0, kTile, num_kv_heads, kHeadDim);
    }
    const int key = walk_begin + t * kTile + lane;
    if (t >= num_tiles || key > max_pos) return 0;
    return KvPageOffset(table[key / cache.block_size], kv_head, key % cache.block_size,
                        cache.block_size, num_kv_heads, kHeadDim);
  };
  auto k_stage = [&](int t) { return ring + (t % kStages) * 2 * Shape::kTileElems; };
  // Tile t as one commit group (empty past the last tile): tile t has landed once at most
  // kStages - 1 groups are pending after tile t + kStages - 1 was issued.
  auto issue = [&](int t, int64_t row) {
    if (t < num_tiles) {
      if constexpr (kWgmma) {
        IssuePageTile<kHeadDim, Shape::kThreads, kWgmma>(cache, walk_begin + t * kTile, max_pos,
                                                         row, k_stage(t),
                                                         k_stage(t) + Shape::kTileElems);
      } else {
        IssueTile<Shape>(cache, walk_begin + t * kTile, max_pos, row, k_stage(t),
                         k_stage(t) + Shape::kTileElems);
      }
    }
    CpAsyncCommit();
  };
  // The first kStages - 1 tiles go in flight before anything else.
#pragma unroll
  for (int t = 0; t < kStages - 1; ++t) issue(t, lane_row(t));
  int64_t next_row = lane_row(kStages - 1);  // of the next tile to issue: read a tile early

  // This thread's two rows: g and g + 8 of the warp's 16. Row r is (token token_of(r / group),
  // head kv_head * group + r % group), row head_row(r) of q, out and the partials.
  const int r0 = warp * 16 + g, r1 = r0 + 8;
  auto head_row = [&](int r) -> int64_t {
    return token_of(r / group) * static_cast<int64_t>(p.num_heads) + kv_head * group + r % group;
  };
  const int pos0 = r0 < num_rows ? p.positions[token_of(r0 / group)] : -1;
  const int pos1 = r1 < num_rows ? p.positions[token_of(r1 / group)] : -1;
  // The warp's rows' last and first positions (-1 for a padding row): tiles past the last are
  // skipped; tiles before the first need no causal mask.
  int warp_max_pos = max(pos0, pos1), warp_min_pos = min(pos0, pos1);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    warp_max_pos = max(warp_max_pos, __shfl_xor_sync(0xffffffffu, warp_max_pos, o));
    warp_min_pos = min(warp_min_pos, __shfl_xor_sync(0xffffffffu, warp_min_pos, o));
  }

  // A fragments of the warp's 16 query rows, q rounded to bf16 (padding rows 0): of rows r0 and
  // r1, the dim pairs 16 kk + 2 t4 + {0, 1} and 16 kk + 8 + 2 t4 + {0, 1}.
  uint32_t qa[kSteps][4];
  {
    auto q_row = [&](int r) -> const float* {
      if (r >= num_rows) return nullptr;
      return p.q + head_row(r) * kHeadDim + 2 * t4;
    };
    auto pair = [](const float* q, int d) {
      if (q == nullptr) return 0u;
      const float2 v = *reinterpret_cast<const float2*>(q + d);
      return PackBf16(v.x, v.y);
    };
    const float* q0 = q_row(r0);
    const float* q1 = q_row(r1);
#pragma unroll
    for (int kk = 0; kk < kSteps; ++kk) {
      qa[kk][0] = pair(q0, 16 * kk);
      qa[kk][1] = pair(q1, 16 * kk);
      qa[kk][2] = pair(q0, 16 * kk + 8);
      qa[kk][3] = pair(q1, 16 * kk + 8);
    }
  }

  float o[kDimTiles][4];
#pragma unroll
  for (int n = 0; n < kDimTiles; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;

  // kFold: the rows' running (M, L, O) over the splits folded so far: element 0 / 1 M of row r0
  // / r1, 2 / 3 their L, then O (4 + 4 n + {0, 1}: row r0, 4 + 4 n + {2, 3}: row r1, dims
  // 8 n + 2 t4 + {0, 1}, as o).
  // (Computed where used, not kept live through the loop: registers are full.)
  auto fold_area = [&] {
    return reinterpret_cast<float*>(ring + kStages * 2 * Shape::kTileElems) + threadIdx.x;
  };
  if (kFold) {
    float* fold = fold_area();
    fold[0] = fold[Shape::kThreads] = -INFINITY;
#pragma unroll
    for (int e = 2; e < Shape::kFoldElems; ++e) fold[e * Shape::kThreads] = 0.0f;
  }
  for (int t = 0; t < num_tiles;) {
    // kFold: the tiles of one split, then its fold; else every tile of the block's split.
    const int tiles_end = kFold ? min(num_tiles, t + p.split_size / kTile) : num_tiles;
    for (; t < tiles_end; ++t) {
      // Every warp is done with tile t - 1, whose stage tile t + kStages - 1 takes.
      __syncthreads();
      issue(t + kStages - 1, next_row);
      next_row = lane_row(t + kStages);
      CpAsyncWait<kStages - 1>();  // this thread's copies of tile t have landed ...
      // ... (visible to the async proxy the wgmma reads through) ...
      if (kWgmma) ptx::FenceProxyAsyncShared();
      __syncthreads();  // ... and every thread's
      const int tile_start = walk_begin + t * kTile;
      // Warp-uniform: no row of this warp reaches the tile. (A warpgroup's MMAs need all four
      // warps: a warp past its rows runs the tile, every key masked -- p = 0, alpha = 1, o + 0,
      // the bits of skipping it.)
      if (!kWgmma && tile_start > warp_max_pos) continue;
      const bf16* k_s = k_stage(t);
      const bf16* v_s = k_s + Shape::kTileElems;

      // S = Q K^T: key tile j (keys 8j..8j+7), dims in increasing k-steps. ldmatrix.x4 gives each
      // lane the B fragments (key 8j + g, dims 16 kk + 2 t4 + {0, 1} and + 8) of two k-steps.
      // kWgmma: the warpgroup's 64 rows x 32 keys as one m64n32k16 per k-step, in the same order
      // into the same accumulator layout (wgmma's k16 step accumulates as mma.sync's).
      float acc[4][4];
      if constexpr (kWgmma) {
        float(&flat)[16] = reinterpret_cast<float(&)[16]>(acc);
#pragma unroll
        for (int i = 0; i < 16; ++i) flat[i] = 0.0f;
        ptx::FenceOperands(flat);
        ptx::WgmmaFence();
#pragma unroll
        for (int kk = 0; kk < kSteps; ++kk) {
          const uint64_t desc =
              ptx::SwizzledKMajorDescriptor(k_s + (kk / 4) * kWgmmaHalfElems) + 2 * (kk % 4);
          ptx::WgmmaRs<32, 0>::Mma(flat, qa[kk], desc);
        }
        ptx::WgmmaCommit();
        ptx::WgmmaWait<0>();
        ptx::FenceOperands(flat);
      } else {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
          const bf16* k_row = k_s + (8 * j + lane % 8) * kStride;
#pragma unroll
          for (int kk = 0; kk < kSteps; kk += 2) {
            uint32_t b[4];
            LdMatrixX4(b, k_row + Shape::Chunk(lane % 8, 2 * kk + lane / 8) * 8);
            Mma16816(acc[j], qa[kk], b[0], b[1]);
            Mma16816(acc[j], qa[kk + 1], b[2], b[3]);
          }
        }
      }
      float s0[8], s1[8];  // rows g and g + 8: keys 8j + 2 t4 + {0, 1}
      // Warp-uniform: every key visible to every row (prefill blocks only: decode blocks measured
      // slower with the branch).
      if (kWarps > 1 && tile_start + kTile - 1 <= warp_min_pos) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            s0[2 * j + c] = acc[j][c] * p.scale;
            s1[2 * j + c] = acc[j][2 + c] * p.scale;
          }
        }
      } else {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const int key = tile_start + 8 * j + 2 * t4 + c;
            s0[2 * j + c] = key <= pos0 ? acc[j][c] * p.scale : -INFINITY;
            s1[2 * j + c] = key <= pos1 ? acc[j][2 + c] * p.scale : -INFINITY;
          }
        }
      }
      float p0[8], p1[8];
      const float alpha0 = RowUpdate<kWarps == 1>(s0, &m0, &l0, p0);
      const float alpha1 = RowUpdate<kWarps == 1>(s1, &m1, &l1, p1);
      // o * 1 is o exactly (no flush-to-zero here): the rescale is skipped while no row of the
      // warp has a new maximum -- most tiles, once the rows' maxima settle (and every tile of the
      // padding rows) -- the same bits for kDimTiles * 4 fewer multiplies per lane.
      if (__any_sync(0xffffffffu, alpha0 != 1.0f || alpha1 != 1.0f)) {
#pragma unroll
        for (int n = 0; n < kDimTiles; ++n) {
          o[n][0] = o[n][0] * alpha0;
          o[n][1] = o[n][1] * alpha0;
          o[n][2] = o[n][2] * alpha1;
          o[n][3] = o[n][3] * alpha1;
        }
      }
      // P as A fragments of the two 16-key chunks (the S accumulator layout is the A layout).
      uint32_t pa[2][4];
#pragma unroll
      for (int kc = 0; kc < 2; ++kc) {
        pa[kc][0] = PackBf16(p0[4 * kc + 0], p0[4 * kc + 1]);
        pa[kc][1] = PackBf16(p1[4 * kc + 0], p1[4 * kc + 1]);
        pa[kc][2] = PackBf16(p0[4 * kc + 2], p0[4 * kc + 3]);
        pa[kc][3] = PackBf16(p1[4 * kc + 2], p1[4 * kc + 3]);
      }
      // O += P V: dim tile n, key chunks in increasing order. kWgmma: all 128 dims of the
      // warpgroup's rows as one m64n128k16 per key chunk, V an MN-major B (dims contiguous).
      if constexpr (kWgmma) {
        float(&flat)[4 * kDimTiles] = reinterpret_cast<float(&)[4 * kDimTiles]>(o);
        ptx::FenceOperands(flat);
        ptx::WgmmaFence();
#pragma unroll
        for (int kc = 0; kc < 2; ++kc) {
          const uint64_t desc =
              ptx::SwizzledMnMajorDescriptor(v_s, sizeof(bf16) * kWgmmaHalfElems) + 128 * kc;
          ptx::WgmmaRs<128, 1>::Mma(flat, pa[kc], desc);
        }
        ptx::WgmmaCommit();
        ptx::WgmmaWait<0>();
        ptx::FenceOperands(flat);
      } else {
#pragma unroll
        for (int n = 0; n < kDimTiles; ++n) {
#pragma unroll
          for (int kc = 0; kc < 2; ++kc) {
            uint32_t b0, b1;
            LdMatrixX2Trans(&b0, &b1,
                            v_s + (16 * kc + lane % 16) * kStride + Shape::Chunk(lane % 16, n) * 8);
            Mma16816(o[n], pa[kc], b0, b1);
          }
        }
      }
    }
    if (kFold) {
      const int t_end = t;
      float* fold = fold_area();
      float* fold_o = fold + 4 * Shape::kThreads;
      // Split (t_end - 1) / (split_size / 32) has ended: its partial of each row with keys in it
      // (the rows the merge folds: position >= the split's first key) goes into (M, L, O), then
      // the next split's (m, l, o) start as a split block starts them.
      const int split_begin = (t_end - 1) / (p.split_size / kTile) * p.split_size;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        if ((half == 0 ? pos0 : pos1) >= split_begin) {
          const FoldScales sc =
              FoldRow(half == 0 ? m0 : m1, half == 0 ? l0 : l1, fold + half * Shape::kThreads,
                      fold + (2 + half) * Shape::kThreads);
#pragma unroll
          for (int n = 0; n < kDimTiles; ++n) {
#pragma unroll
            for (int c = 0; c < 2; ++c) {
              float* big_o = fold_o + (4 * n + 2 * half + c) * Shape::kThreads;
              *big_o = FoldElement(*big_o, o[n][2 * half + c], sc);
            }
          }
        }
      }
#pragma unroll
      for (int n = 0; n < kDimTiles; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
      m0 = m1 = -INFINITY;
      l0 = l1 = 0.0f;
    }
  }

  if constexpr (kFold) {
    // Every split folded (the last at t == num_tiles): bf16(O / L) of each real row.
    const float* fold = fold_area();
    const float* fold_o = fold + 4 * Shape::kThreads;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = half == 0 ? r0 : r1;
      if (r >= num_rows) continue;  // padding row
      const float big_l = fold[(2 + half) * Shape::kThreads];
      bf16* dst = p.out + head_row(r) * kHeadDim + 2 * t4;
#pragma unroll
      for (int n = 0; n < kDimTiles; ++n) {
        const float* big_o = fold_o + (4 * n + 2 * half) * Shape::kThreads;
        *reinterpret_cast<__nv_bfloat162*>(dst + 8 * n) = __halves2bfloat162(
            FoldedOutput(big_o[0], big_l), FoldedOutput(big_o[Shape::kThreads], big_l));
      }
    }
  } else {
    // This split's partial of each real row with keys in it.
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = half == 0 ? r0 : r1;
      const int pos = half == 0 ? pos0 : pos1;
      if (pos < walk_begin) continue;  // padding row, or no key of this split
      float* dst = p.partials + (head_row(r) * p.max_splits + split) * (kHeadDim + 2);
      if (t4 == 0) {
        dst[0] = half == 0 ? m0 : m1;
        dst[1] = half == 0 ? l0 : l1;
      }
#pragma unroll
      for (int n = 0; n < kDimTiles; ++n) {
        dst[2 + 8 * n + 2 * t4] = o[n][2 * half];
        dst[2 + 8 * n + 2 * t4 + 1] = o[n][2 * half + 1];
      }
    }
  }
}

constexpr int kMergeWarps = 8;

template <int kHeadDim>
__global__ void __launch_bounds__(kMergeWarps * 32)
    MergeKernel(AttentionParams p, int64_t num_tokens) {
  const int lane = threadIdx.x % 32;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kMergeWarps + threadIdx.x / 32;
  if (row >= num_tokens * p.num_heads) return;  // row = (token, head)
  const int splits = p.positions[row / p.num_heads] / p.split_size + 1;
  MergeStoredSplits<kHeadDim>(p.partials, p.max_splits, row, splits, p.out, lane);
}

// One warp per (item, head): the rows of the item's tokens, in token order.
template <int kHeadDim>
__global__ void __launch_bounds__(kMergeWarps * 32) MergeItemsKernel(AttentionParams p) {
  const int lane = threadIdx.x % 32;
  const int64_t w = static_cast<int64_t>(blockIdx.x) * kMergeWarps + threadIdx.x / 32;
  if (w >= static_cast<int64_t>(p.num_items) * p.num_heads) return;
  const int2 item = p.items[w / p.num_heads];
  const int head = static_cast<int>(w % p.num_heads);
  for (int i = 0; i < item.y; ++i) {
    const int64_t token = item.x + i;
    const int64_t row = token * p.num_heads + head;
    const int splits = p.positions[token] / p.split_size + 1;
    MergeStoredSplits<kHeadDim>(p.partials, p.max_splits, row, splits, p.out, lane);
  }
}

template <int kHeadDim, int kWarps, int kStages, bool kFold, bool kWgmma = false>
cudaError_t LaunchMma(const AttentionParams& p, KvCacheView cache, cudaStream_t stream) {
  using Shape = MmaShape<kHeadDim, kWarps, kStages, kFold, kWgmma>;
  auto kernel = MmaAttentionKernel<kHeadDim, kWarps, kStages, kFold, kWgmma>;
  if (Shape::kSmemBytes > 48 * 1024) {
    const cudaError_t err = cudaFuncSetAttribute(
        kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(Shape::kSmemBytes));
    if (err != cudaSuccess) return err;
  }
  const int64_t nkv = cache.num_kv_heads;
  const int64_t blocks = kFold ? nkv : static_cast<int64_t>(p.num_items) * p.max_splits * nkv;
  if (blocks > INT32_MAX || (kFold && p.num_items > 65535)) return cudaErrorInvalidConfiguration;
  const dim3 grid = kFold ? dim3(static_cast<unsigned>(nkv), static_cast<unsigned>(p.num_items))
                          : dim3(static_cast<unsigned>(blocks));
  kernel<<<grid, Shape::kThreads, Shape::kSmemBytes, stream>>>(p, cache);
  return cudaGetLastError();
}

template <int kHeadDim>
cudaError_t LaunchMmaShape(const AttentionParams& p, AttentionBlockShape shape, KvCacheView cache,
                           cudaStream_t stream) {
  if (p.partials == nullptr) {
    if constexpr (kHeadDim == 128) {
      if (cache.block_size == kTile) return LaunchMma<kHeadDim, 4, 2, true, true>(p, cache, stream);
    }
    return LaunchMma<kHeadDim, 4, 2, true>(p, cache, stream);
  }
  if (shape == AttentionBlockShape::kOneToken) {
    return LaunchMma<kHeadDim, 1, 1, false>(p, cache, stream);
  }
  return LaunchMma<kHeadDim, 4, 2, false>(p, cache, stream);
}

}  // namespace

int AttentionShareTokens(int group) {
  if (group < 1 || group > 64) return 1;
  return group <= 16 ? 16 / group : 64 / group;
}

cudaError_t PagedAttentionMma(const AttentionParams& params, AttentionBlockShape shape,
                              KvCacheView cache, cudaStream_t stream) {
  if (params.split_size <= 0 || params.split_size % kTile != 0 || cache.num_kv_heads <= 0 ||
      params.num_heads % cache.num_kv_heads != 0) {
    return cudaErrorInvalidValue;
  }
  // Without partials only kManyTokens blocks, which fold their splits themselves.
  if (params.partials == nullptr ? shape != AttentionBlockShape::kManyTokens
                                 : params.max_splits < 1) {
    return cudaErrorInvalidValue;
  }
  if (params.partials == nullptr && params.num_items > 65535) return cudaErrorInvalidValue;
  const int group = params.num_heads / cache.num_kv_heads;
  if (shape == AttentionBlockShape::kOneToken && group > 16) {
    shape = AttentionBlockShape::kManyTokens;
  }
  if (group > 64) return cudaErrorInvalidValue;
  if (params.num_items == 0) return cudaSuccess;
  switch (cache.head_dim) {
    case 32:
      return LaunchMmaShape<32>(params, shape, cache, stream);
    case 64:
      return LaunchMmaShape<64>(params, shape, cache, stream);
    case 128:
      return LaunchMmaShape<128>(params, shape, cache, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

cudaError_t MergeAttentionSplits(const AttentionParams& params, int64_t num_tokens,
                                 int32_t head_dim, cudaStream_t stream) {
  if (num_tokens == 0) return cudaSuccess;
  const int64_t rows = num_tokens * params.num_heads;
  const unsigned blocks = static_cast<unsigned>((rows + kMergeWarps - 1) / kMergeWarps);
  switch (head_dim) {
    case 32:
      MergeKernel<32><<<blocks, kMergeWarps * 32, 0, stream>>>(params, num_tokens);
      break;
    case 64:
      MergeKernel<64><<<blocks, kMergeWarps * 32, 0, stream>>>(params, num_tokens);
      break;
    case 128:
      MergeKernel<128><<<blocks, kMergeWarps * 32, 0, stream>>>(params, num_tokens);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

cudaError_t MergeAttentionSplitsOfItems(const AttentionParams& params, int32_t head_dim,
                                        cudaStream_t stream) {
  if (params.num_items == 0) return cudaSuccess;
  const int64_t warps = static_cast<int64_t>(params.num_items) * params.num_heads;
  const unsigned blocks = static_cast<unsigned>((warps + kMergeWarps - 1) / kMergeWarps);
  switch (head_dim) {
    case 32:
      MergeItemsKernel<32><<<blocks, kMergeWarps * 32, 0, stream>>>(params);
      break;
    case 64:
      MergeItemsKernel<64><<<blocks, kMergeWarps * 32, 0, stream>>>(params);
      break;
    case 128:
      MergeItemsKernel<128><<<blocks, kMergeWarps * 32, 0, stream>>>(params);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace rollout::cuda
