#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

// Kernels of tensor parallelism on the CUDA backend (docs/determinism.md, D10):
// the combining step of the canonical K tree, and the vocab-parallel
// embedding's shard gather and owner select. Elementwise: an output element's
// arithmetic is the formula stated here, whatever the launch shape. Launchers
// take raw device pointers, sizes and a stream, allocate nothing and return the
// launch's cudaError_t.
namespace rollout::cuda {

// Row-parallel projections (o_proj, down_proj) reduce K as one fixed tree at
// every degree: K is cut into kNumKSegments segments [s * K / 8, (s + 1) * K /
// 8); leaf s is a GEMM over its segment (fp32 out, one pinned algorithm per
// segment shape), and the leaves combine as
// ((p0 + p1) + (p2 + p3)) + ((p4 + p5) + (p6 + p7)). A rank of degree tp owns
// the 8 / tp adjacent leaves under one node of that tree (SumTree of them), the
// nodes are all-gathered in rank order and the tree's top levels are SumTree of
// the tp nodes -- the same additions in the same order at tp = 1, 2, 4 and 8.
// The same tree as the CPU backend's cpu::SegmentedMatMul.
inline constexpr int kNumKSegments = 8;

// out[i] = accumulate ? out[i] + T : T, where T is the pairwise tree over
// num_parts values v_p = parts[p * part_stride + i]:
//   1: v0;  2: v0 + v1;  4: (v0 + v1) + (v2 + v3);  8: ((v0 + v1) + (v2 + v3))
//   + ((v4 + v5) + (v6 + v7))
// -- so the residual is added after the whole tree (x + T), as the CPU
// reference does. REQUIRES: num_parts in {1, 2, 4, 8}; count and part_stride
// multiples of 4; parts and out 16-byte aligned; out does not overlap parts.
cudaError_t SumTree(const float* parts, int num_parts, int64_t part_stride, int64_t count,
                    float* out, bool accumulate, cudaStream_t stream);
// The same tree onto another array: out[i] = residual ? residual[i] + T : T (residual may be
// out: SumTree's accumulate). residual 16-byte aligned.
cudaError_t SumTreeOnto(const float* parts, int num_parts, int64_t part_stride, int64_t count,
                        const float* residual, float* out, cudaStream_t stream);

// The vocab-parallel embedding, one rank's part: x[t, :] =
// float(shard[token_ids[t] - vocab_begin, :]) when vocab_begin <= token_ids[t]
// < vocab_end, else zeros. shard: [>= vocab_end - vocab_begin, hidden] bf16; x:
// [num_tokens, hidden] fp32. REQUIRES: hidden % 8 == 0.
cudaError_t EmbeddingGatherShard(const int32_t* token_ids, int64_t num_tokens,
                                 const __nv_bfloat16* shard, int64_t vocab_begin, int64_t vocab_end,
                                 int64_t hidden, float* x, cudaStream_t stream);

// After the ranks' EmbeddingGatherShard outputs are all-gathered into
// `gathered`
// ([ranks, num_tokens, hidden], rank i at i * rank_stride): x[t, :] = the row
// of rank token_ids[t] / rows_per_rank, the one that owns the token. Selected,
// never summed (a sum with the other ranks' zeros would turn -0 into +0): x is
// the exact embedding row at every degree. REQUIRES: hidden % 4 == 0.
cudaError_t SelectOwnerRows(const int32_t* token_ids, int64_t num_tokens, const float* gathered,
                            int64_t rank_stride, int64_t rows_per_rank, int64_t hidden, float* x,
                            cudaStream_t stream);

}  // namespace rollout::cuda
