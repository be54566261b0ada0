#pragma once

#include <cstdint>

#include "common/thread_pool.h"

// CPU reference kernels, fp32. Every output element is produced by one fixed sequence of
// floating-point operations that depends only on its own inputs: threads split rows, heads or
// output columns, never a reduction, so results are bitwise independent of batch size, batch
// composition and thread count. Pointers are borrowed; nothing here allocates per call except
// where noted.
namespace rollout::cpu {

// The build id and version of these kernels' arithmetic, reported in ServerInfo.numerics.kernels
// and by the trainer library's shared object (trainer/): a forward that reproduces the server's
// bits must run these same definitions. Bump the number whenever any function below changes a
// bit of its output.
inline constexpr char kKernelsVersion[] = "rollout-cpu-ref/1";

// Dot product of two fp32 vectors of length n in a fixed lane order (16 partial sums, combined
// by a fixed tree). Every reduction over a hidden dimension goes through this. Exactly:
// acc[0..16) = +0; for i in increasing order acc[i % 16] = fma(a[i], b[i], acc[i % 16]) (one
// rounding, spelled out so no compiler contraction choice can change it); then
// acc[l] += acc[l + 8] (l < 8), acc[l] += acc[l + 4] (l < 4), acc[l] += acc[l + 2] (l < 2),
// result acc[0] + acc[1]. Independent of alignment and of the build's -march.
float Dot(const float* a, const float* b, int64_t n);

// y[m, n] = sum_k x[m, k] * w[n, k]   (w in the Hugging Face [out_features, in_features] layout)
// x: [m, k], w: [n, k], y: [m, n]. bias (optional, [n]) is added after the dot product.
// Every y[r, c] is bitwise Dot(x[r], w[c], k) (+ bias[c]), whatever m, n or the thread count.
void MatMul(ThreadPool* pool, const float* x, int64_t m, int64_t k, const float* w, int64_t n,
            const float* bias, float* y);

// --- The canonical K reduction of row-parallel layers (tensor-parallel invariance, D10) ---
//
// A row-parallel layer (o_proj, down_proj) reduces over K in one fixed tree, whatever the
// tensor-parallel degree: K is cut into kNumKSegments = 8 canonical segments, segment s being
// [KSegmentBegin(k, s), KSegmentBegin(k, s + 1)) with KSegmentBegin(k, s) = s * k / 8 (integer
// division, so any k works; segments differ by at most one element). Leaf s is Dot over the
// segment (Dot's 16-lane order, restarted at the segment's first element). The leaves are
// combined by the fixed pairwise tree
//     ((p0 + p1) + (p2 + p3)) + ((p4 + p5) + (p6 + p7)).
// A TP rank (degree 1, 2, 4 or 8) owns the aligned block of 8 / tp segments under one node of
// this tree; it computes that node's value from its K slice alone, the ranks' node values are
// gathered in rank order and combined by the tree's top levels (CombinePartials). Every degree
// performs the same floating-point operations in the same order, so TP 1, 2, 4 and 8 give the
// same bits -- and the messages are as large as a plain all-reduce's (one value per output).
constexpr int kNumKSegments = 8;
inline int64_t KSegmentBegin(int64_t k, int s) { return k * s / kNumKSegments; }

// True when [seg_begin, seg_end) is a node of the tree: a power-of-two number of segments
// starting at a multiple of it (what a rank of TP degree 1, 2, 4 or 8 owns).
bool IsCanonicalSegmentBlock(int seg_begin, int seg_end);

// y[r, c] = the tree node over segments [seg_begin, seg_end) of sum_k x[r, k] * w[c, k], for the
// reduction of full length k_full. x: [m, k_slice], w: [n, k_slice] hold only the columns
// [KSegmentBegin(k_full, seg_begin), KSegmentBegin(k_full, seg_end)) = k_slice of the full
// operands (a rank's shard). REQUIRES IsCanonicalSegmentBlock(seg_begin, seg_end).
// Threads split output columns as in MatMul; bits never depend on m, n or the thread count.
void SegmentedPartialMatMul(ThreadPool* pool, const float* x, int64_t m, const float* w, int64_t n,
                            int64_t k_full, int seg_begin, int seg_end, float* y);

// The row-parallel matmul on one rank holding all of K: the root of the tree (segments
// [0, 8)), then + bias[c] (optional). Bitwise equal to CombinePartials of the nodes that any
// TP degree computes with SegmentedPartialMatMul. Note: not bitwise MatMul (a different tree).
void SegmentedMatMul(ThreadPool* pool, const float* x, int64_t m, int64_t k, const float* w,
                     int64_t n, const float* bias, float* y);

// parts: [num_parts][count], part i the node over segments [i * 8 / num_parts,
// (i + 1) * 8 / num_parts) (num_parts = 1, 2, 4 or 8: the ranks' values in rank order).
// y[j] = the tree's root from those nodes, combined as adjacent pairs level by level. y may
// alias parts (the first part).
void CombinePartials(const float* parts, int num_parts, int64_t count, float* y);

// y[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight, for `rows` rows of `dim`. y may alias x.
void RmsNorm(const float* x, const float* weight, int64_t rows, int64_t dim, float eps, float* y);

// Rotary embedding in the Hugging Face "rotate_half" layout, in place.
// x: [num_tokens, num_heads, head_dim]; cos, sin: [num_tokens, head_dim / 2], each token's
// rotation (what model/rope.h's RopeCosSin gives for its position, as the CUDA backend's
// tables hold it): out[i] = fma(x1, cos, -(x2 * sin)), out[i + d/2] = fma(x2, cos, x1 * sin).
void ApplyRope(float* x, const float* cos, const float* sin, int64_t num_tokens,
               int64_t num_heads, int64_t head_dim);

// out[i] = silu(gate[i]) * up[i] for `rows` rows: gate_up: [rows, 2 * dim] holding gate then
// up, out: [rows, dim].
void SiluMul(const float* gate_up, int64_t rows, int64_t dim, float* out);

// x[i] += y[i]
void Add(float* x, const float* y, int64_t n);

// One layer's paged KV cache, fp32:
//   k, v: [num_blocks, block_size, num_kv_heads, head_dim].
struct KvCacheLayer {
  float* k = nullptr;
  float* v = nullptr;
  int64_t block_size = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
};

// Where each token of a flattened batch lives: its absolute position and its sequence's block
// table (block ids of positions [0, block_size), [block_size, 2 * block_size), ...).
struct TokenSlots {
  const int32_t* positions = nullptr;            // [num_tokens]
  const int32_t* const* block_tables = nullptr;  // [num_tokens] -> table of its sequence
  int64_t num_tokens = 0;
};

// Writes k, v ([num_tokens, num_kv_heads, head_dim]) into the cache at each token's slot.
void WriteKv(const float* k, const float* v, const TokenSlots& slots, KvCacheLayer cache);

// Causal attention of each token over positions [0, its position] of its sequence, read from
// the cache (write the batch's own K/V first). q, out: [num_tokens, num_heads, head_dim]; query
// head h reads kv head h / (num_heads / num_kv_heads). Per row: scores s_j = Dot(q, k_j) *
// scale in increasing j, m = max_j s_j, w_j = exp(s_j - m), l = sum_j w_j in increasing j,
// out = (sum_j w_j * v_j in increasing j, as acc = fma(w_j, v_j[d], acc)) / l (expf, float
// throughout). A row's bits depend only on its q and the cached K/V of its positions -- not on
// the batch, the chunk it came in, or where its KV came from. Parallel over (token, head) rows;
// allocates one scratch vector per chunk of rows.
void PagedAttention(ThreadPool* pool, const float* q, const TokenSlots& slots, int64_t num_heads,
                    KvCacheLayer cache, float scale, float* out);

}  // namespace rollout::cpu
