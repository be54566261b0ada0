#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

// CUDA kernels of the forward pass. Storage is bf16 (weights, KV cache, GEMM inputs), arithmetic
// fp32. Batch invariance: every output row is produced by one block (or warp) whose launch shape
// is a constant of the kernel, never derived from the batch, and every reduction runs in one
// fixed order -- so a row's bits depend only on its own inputs. The library is compiled with
// --fmad=false: a multiply feeds an add through one rounding only where the source says fmaf().
//
// Launchers take raw device pointers, sizes and a stream, allocate nothing (CUDA-graph friendly)
// and return the launch's cudaError_t (cudaErrorInvalidValue for unsupported sizes).
namespace rollout::cuda {

using bf16 = __nv_bfloat16;

// Keys per attention tile: one warp's lanes, one key each.
inline constexpr int kAttentionTile = 32;

// One layer's paged KV cache: k, v: [num_blocks, num_kv_heads, block_size, head_dim] bf16 --
// head-major inside a page, so that one kv head's keys of a page are one contiguous run (8 KB for
// pages of 32 keys at head_dim 128) that decode attention streams: in rollout-attention-bench's
// read probes (H200, the 256 x ~1536 decode step), the attention access pattern with no math
// reads 4.20 TB/s this way against 4.14 with [block, token, head, dim], 4.44 against 3.86 with
// 32 warps per SM. Where a slot (block * block_size + position in block) keeps its head's row:
// KvOffset.
struct KvCacheView {
  bf16* k = nullptr;
  bf16* v = nullptr;
  int32_t block_size = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
};

#if defined(__CUDACC__)
#define ROLLOUT_HOST_DEVICE __host__ __device__
#else
#define ROLLOUT_HOST_DEVICE
#endif

// Element offset, in one layer's k (or v), of the head_dim values of KV block `page`'s key
// `in_page` at kv head `kv_head`: the cache layout, stated once.
ROLLOUT_HOST_DEVICE inline int64_t KvPageOffset(int64_t page, int32_t kv_head, int32_t in_page,
                                                int32_t block_size, int32_t num_kv_heads,
                                                int32_t head_dim) {
  return ((page * num_kv_heads + kv_head) * block_size + in_page) * head_dim;
}

// The same for a slot (block * block_size + position in block).
ROLLOUT_HOST_DEVICE inline int64_t KvOffset(int64_t slot, int32_t kv_head, int32_t block_size,
                                            int32_t num_kv_heads, int32_t head_dim) {
  return KvPageOffset(slot / block_size, kv_head, static_cast<int32_t>(slot % block_size),
                      block_size, num_kv_heads, head_dim);
}

// x[t, :] = float(embed[token_ids[t], :]).
// token_ids: [num_tokens]; embed: [vocab, hidden] bf16; x: [num_tokens, hidden] fp32.
// REQUIRES: hidden % 8 == 0.
cudaError_t EmbeddingGather(const int32_t* token_ids, int64_t num_tokens, const bf16* embed,
                            int64_t hidden, float* x, cudaStream_t stream);

// y[r, :] = bf16((x[src, :] * inv_rms) * weight) with src = rows ? rows[r] : r and
// inv_rms = 1 / sqrtf(sum_sq / dim + eps); sum_sq in a fixed order (per thread of a 256-thread
// block: fmaf over its float4s in increasing index; then lanes by xor-butterfly; then warps in
// increasing order). x: [*, dim] fp32; rows: [num_rows] or nullptr; weight: [dim] fp32;
// y: [num_rows, dim] bf16. REQUIRES: dim % 4 == 0; x and weight 16-byte aligned, y 8-byte
// aligned (cudaErrorInvalidValue otherwise).
cudaError_t RmsNorm(const float* x, const int32_t* rows, int64_t num_rows, int64_t dim,
                    const float* weight, float eps, bf16* y, cudaStream_t stream);

// A residual add and the next RMSNorm of the same rows in one launch, bitwise SumTree (or
// MoeCombine) into x followed by RmsNorm(x) into y: each element of x gets the same operations
// in the same order (kernels/cuda/residual_terms.cuh), and the norm's the same sums.
//   SumTreeRmsNorm: x[r, :] = x[r, :] + T, T the canonical tree over parts[p * part_stride +
//   r * dim + :], p < num_parts (SumTree's, tensor_parallel.h); then y = RmsNorm(x).
//   REQUIRES: num_parts in {1, 2, 4, 8}; dim and part_stride multiples of 4, part_stride >=
//   num_rows * dim; parts, x, weight 16-byte and y 8-byte aligned; x does not overlap parts.
//   MoeCombineRmsNorm: x[t, :] += MoeCombine's sum of token t's top_k expert rows of expert_y
//   (moe.h); then y = RmsNorm(x) with norm_weight. REQUIRES: hidden % 4 == 0, top_k >= 1,
//   expert_y, x, norm_weight 16-byte and y 8-byte aligned.
// cudaErrorInvalidValue (nothing launched) when a requirement fails.
cudaError_t SumTreeRmsNorm(const float* parts, int num_parts, int64_t part_stride,
                           int64_t num_rows, int64_t dim, float* x, const float* weight, float eps,
                           bf16* y, cudaStream_t stream);
cudaError_t MoeCombineRmsNorm(const float* expert_y, const int32_t* slots, const float* weights,
                              int64_t num_tokens, int32_t top_k, int64_t hidden, float* x,
                              const float* norm_weight, float eps, bf16* y, cudaStream_t stream);

// The attention input stage of one layer, one warp per (token, head of q|k|v):
//   + bias (if given); q and k: per-head RMSNorm (if norms given); RoPE (rotate_half, cos/sin
//   from the tables); q -> q_out (fp32), k and v -> their cache slot (bf16).
// qkv: [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim] fp32 (q heads, k heads, v heads);
// positions, kv_slots: [num_tokens] (slot = block * block_size + position % block_size);
// q_bias/k_bias/v_bias: [heads * head_dim] fp32 or nullptr; q_norm/k_norm: [head_dim] or nullptr;
// rope_cos/rope_sin: [max_position, head_dim / 2] fp32; q_out: [num_tokens, num_heads, head_dim].
// RoPE is the CPU reference's: out[i] = fmaf(x1, c, -(x2 * s)), out[i + d/2] = fmaf(x2, c, x1*s).
// REQUIRES: head_dim in {32, 64, 128}; every pointer aligned to head_dim / 32 of its elements
// (a lane moves that many at once; cudaErrorInvalidValue otherwise).
struct QkvParams {
  const float* qkv = nullptr;
  int64_t num_tokens = 0;
  const int32_t* positions = nullptr;
  const int32_t* kv_slots = nullptr;
  const float* q_bias = nullptr;
  const float* k_bias = nullptr;
  const float* v_bias = nullptr;
  const float* q_norm = nullptr;
  const float* k_norm = nullptr;
  float eps = 1e-6f;
  const float* rope_cos = nullptr;
  const float* rope_sin = nullptr;
  int32_t num_heads = 0;
  float* q_out = nullptr;
};
cudaError_t QkvNormRopeWriteKv(const QkvParams& params, KvCacheView cache, cudaStream_t stream);

// Which block shape runs a list of attention work items. Both compute every row with the same
// device function and the same per-row arithmetic; they differ only in how many rows share a
// block (and so in speed).
enum class AttentionBlockShape {
  kOneToken,    // items of 1 token (decode): the GQA group of one token per block
  kManyTokens,  // items of up to AttentionItemTokens(group) tokens of one sequence (prefill)
};

// Most tokens one kManyTokens item may hold for `group` query heads per kv head.
int AttentionItemTokens(int group);

// Most tokens whose rows one split-parallel kOneToken block computes together for `group` query
// heads per kv head (AttentionShare): 16 / group (the block's one warp of 16 rows), 64 / group
// where group > 16 (such items run kManyTokens blocks); 1 where group > 64.
int AttentionShareTokens(int group);

// Prefix sharing of split-parallel one-token items (AttentionParams::shares): the decode tokens
// of sequences whose block tables hold the same KV pages for a whole split -- the samples of one
// request over their prompt, cached prefixes -- read those pages once for all of them. Item i's
// share, (x, y, z, w) as an int4:
//   x  first split the item computes: its token's splits below x are computed by the item whose
//      share lists it (its lead), so its blocks of those splits exit at once;
//   y  splits below y compute the rows of the z tokens share_tokens[w, w + z) (the first is the
//      item's own token) from the item's own block table; splits y and above, its token's rows
//      only.
// A lead's splits below y must be whole (position >= (split + 1) * split_size - 1) for every
// listed token and be the same pages in every listed token's table; z <= AttentionShareTokens.
// Every row then goes through exactly the tiles, masks and operations of its own block (rows of
// an MMA are independent), so its partials -- and the merged output -- are bitwise those without
// sharing, and the pages are read once instead of z times. (0, 0, 0, 0): no sharing.

// Paged causal attention over the cache (write the batch's K/V first). A work item is
// (first token, number of tokens): consecutive tokens of one sequence, so one block table.
// q: [num_tokens, num_heads, head_dim] fp32; out: [num_tokens, num_heads, head_dim] bf16;
// positions, table_offsets: [num_tokens]; tables: concatenated block tables, the token's at
// tables + table_offsets[t]; items: [num_items] of (first token, count).
struct AttentionParams {
  const float* q = nullptr;
  const int32_t* positions = nullptr;
  const int32_t* table_offsets = nullptr;
  const int32_t* tables = nullptr;
  const int2* items = nullptr;
  int32_t num_items = 0;
  int32_t num_heads = 0;
  int32_t split_size = 0;
  float scale = 1.0f;
  bf16* out = nullptr;
  // Split partials [num_tokens, num_heads, max_splits, head_dim + 2] fp32: (m, l, o[head_dim])
  // per (token, head, split). REQUIRES: max_splits >= max over the items' tokens of
  // position / split_size + 1.
  float* partials = nullptr;
  int32_t max_splits = 0;
  // Optional prefix sharing (PagedAttentionMma with partials only; ignored otherwise):
  // shares [num_items] as described at AttentionShareTokens, share_tokens the lists they name.
  const int4* shares = nullptr;
  const int32_t* share_tokens = nullptr;
};

// Version 1, SIMT fp32 (kernels/cuda/attention.cu). Per row (token at position p, head h, kv
// head h / group), exactly:
//   keys [0, p] in splits [kS, (k+1)S), S = split_size; inside a split, tiles of 32 keys in
//   increasing order; per tile, s_j = (sum_d fmaf(q_d, k_jd) in increasing d) * scale for j <= p,
//   m' = max(m, max_j s_j), a = expf(m - m'), p_j = expf(s_j - m'), l = l * a + warp_sum(p_j),
//   o = o * a then o = fmaf(p_j, v_j, o) in increasing j <= p; at the split's end (a multiple of
//   S, or p's tile) the partial (m, l, o) is folded into (M, L, O) in increasing split order
//   (FoldPartial, attention_fold.cuh); out = bf16(O / L). warp_sum is the xor-butterfly
//   16, 8, 4, 2, 1 over the tile's lanes.
// Split-parallel mode (items of one token only), when params.partials is set: one block per
// (item, kv head, split) stores each split's partial, then a merge kernel folds them in split
// order with FoldPartial -- the same bits as one block walking every split, with max_splits
// times the parallelism. Otherwise one block walks all splits of its rows.
cudaError_t PagedAttention(const AttentionParams& params, AttentionBlockShape shape,
                           KvCacheView cache, cudaStream_t stream);

// Version 2, tensor cores (kernels/cuda/attention_mma.cu): mma.sync m16n8k16, bf16 inputs, fp32
// accumulation. Two launch modes, the same bits for every row:
// - params.partials set (split-parallel): one block per (item, kv head, split) writes the split
//   partial of each of its rows to params.partials; MergeAttentionSplits (every token) or
//   MergeAttentionSplitsOfItems (the tokens of these items) then folds them.
// - params.partials null (kManyTokens only): one block per (item, kv head) walks every split of
//   its rows, folds each split's partial into the row's (M, L, O) right after the split, in
//   increasing split order with FoldPartial's arithmetic (FoldRow / FoldElement), and writes
//   bf16(O / L) (FoldedOutput) to params.out itself: no partials, no merge for these rows. Less
//   parallel (a row's splits run one after the other), so for many items of short to moderate
//   context: prefill.
// Per row (token at position p), exactly: q rounded to bf16; per tile of 32 keys of its split
// (tiles up to p's), S = q . K^T as 4 key-tiles of 8 x (head_dim / 16) MMAs in increasing dim
// order, s = S * scale (keys > p: -inf), m' = max(m, tile max), a = expf(m - m'), p_j = expf(s_j -
// m'), l = l * a + (the row's 32 p_j summed per thread in key order, then across the quad by xor 1,
// 2), o = o * a, then o += bf16(P) . V as (head_dim / 8) dim-tiles x 2 key chunks of MMAs in
// increasing order. Rows of an MMA are independent, so padding rows and neighbours cannot touch
// a row's bits: kOneToken (one warp: a token's GQA group padded to 16 rows) and kManyTokens
// (four warps of 16 rows) compute the same bits; so does any staging of the K/V tiles (how many
// are in flight, how they reach shared memory: speed only, bench/attention_bench.cu checks it
// against the previous kernel bitwise). REQUIRES: head_dim in {32, 64, 128}; split_size % 32 ==
// 0; group <= 64; params.partials set (with max_splits) unless shape is kManyTokens; at most
// 65535 items without partials. (kOneToken with group > 16 runs kManyTokens blocks.)
cudaError_t PagedAttentionMma(const AttentionParams& params, AttentionBlockShape shape,
                              KvCacheView cache, cudaStream_t stream);

// For tokens [0, num_tokens): folds each (token, head)'s split partials in increasing split order
// (FoldPartial) and writes bf16(O / L) to params.out. One warp per row.
cudaError_t MergeAttentionSplits(const AttentionParams& params, int64_t num_tokens,
                                 int32_t head_dim, cudaStream_t stream);

// The same fold for the tokens of params.items only (the others' outputs are left alone): one
// warp per (item, head), the item's tokens in order. For a step whose kManyTokens items folded
// their splits in-block and whose kOneToken items stored partials.
cudaError_t MergeAttentionSplitsOfItems(const AttentionParams& params, int32_t head_dim,
                                        cudaStream_t stream);

// out[r, i] = bf16(silu(gate) * up), silu(g) = g / (1 + expf(-g)), gate = gate_up[r, i],
// up = gate_up[r, dim + i]. gate_up: [rows, 2 * dim] bf16; out: [rows, dim] bf16. Any number of
// rows (launched 65535 at a time). REQUIRES: dim % 8 == 0.
cudaError_t SiluMul(const bf16* gate_up, int64_t rows, int64_t dim, bf16* out, cudaStream_t stream);

// Seeded weights, bitwise the values WriteRandomModel (model/random_model.cc) writes in bf16:
// element i is RandomValue(key, i) rounded to bf16 (nearest even). kind: 0 = normal with
// `scale` (Irwin-Hall of four 16-bit uniforms), 1 = norm weight (1 + k / 65536). Exactly one of
// out_bf16 / out_f32 is set; out_f32 receives the bf16 value widened.
cudaError_t FillRandomWeights(uint64_t key, double scale, int kind, int64_t count, bf16* out_bf16,
                              float* out_f32, cudaStream_t stream);

}  // namespace rollout::cuda
