#pragma once

#include <cstdint>

#include "kernels/cpu/thread_pool.h"

// CPU reference kernels, fp32. Every output element is produced by one fixed sequence of
// floating-point operations that depends only on its own inputs: threads split rows, heads or
// output columns, never a reduction, so results are bitwise independent of batch size, batch
// composition and thread count. Pointers are borrowed; nothing here allocates per call except
// where noted.
namespace rollout::cpu {

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

// y[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight, for `rows` rows of `dim`. y may alias x.
void RmsNorm(const float* x, const float* weight, int64_t rows, int64_t dim, float eps, float* y);

// Rotary embedding in the Hugging Face "rotate_half" layout, in place.
// x: [num_tokens, num_heads, head_dim]; positions: [num_tokens]. The angle of pair i at
// position p is p * theta^(-2i / head_dim), computed in double, with cos and sin in double then
// rounded to float: out[i] = fma(x1, cos, -(x2 * sin)), out[i + d/2] = fma(x2, cos, x1 * sin).
void ApplyRope(float* x, const int32_t* positions, int64_t num_tokens, int64_t num_heads,
               int64_t head_dim, float theta);

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
  const int32_t* positions = nullptr;             // [num_tokens]
  const int32_t* const* block_tables = nullptr;   // [num_tokens] -> table of its sequence
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
