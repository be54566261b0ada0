#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

// The mixture-of-experts block of Qwen3-MoE on the GPU (kernels/cuda/moe.cu): routing, grouping
// of the (token, rank) assignments by expert, the experts' GEMMs in one grouped launch each, and
// the weighted combine into the residual. Every launch is sized from host-known numbers only
// (tokens, top_k, experts): how many rows each expert got lives on the device, so a step needs
// no host sync and is CUDA-graph capturable; blocks past the step's real work exit.
//
// Determinism (docs/determinism.md, "Mixture of experts"): a token's output depends only on its
// own row -- never on how many rows an expert got, which other tokens share the step, or where
// in the batch the token sits. Routing is one warp per token; grouping orders an expert's rows by
// (token, rank) with block scans (no atomics whose order matters); every expert GEMM output
// element is one fixed sequence of m16n8k16 MMAs over K in increasing order from a zero
// accumulator, whatever tile or in-tile position its row lands in (rows of an MMA are
// independent); the combine sums the top-k outputs in rank order. tests/gpu/moe_test.cc proves
// each row's bits equal over every token count 1..512 (and larger) and any batch order.
namespace rollout::cuda {

using bf16 = __nv_bfloat16;

inline constexpr int kMoeMaxExperts = 1024;
inline constexpr int kMoeMaxTopK = 32;
// Rows of one expert GEMM tile (an expert's rows are cut into tiles of this many), one per block
// shape: decode, prefill, and prefill at many rows per expert.
inline constexpr int kMoeTileRows = 32;
inline constexpr int kMoeTileRowsLarge = 64;
inline constexpr int kMoeTileRowsXLarge = 128;
// The expert GEMMs' N and K must be multiples of this (tile width and K step).
inline constexpr int kMoeGemmAlign = 64;
// Columns of the widest block shape (128-row tiles x 256 columns; MoeGemmParams::tile_columns).
inline constexpr int kMoeTileColumnsWide = 256;

// Most tiles a grouping of `assignments` rows over `num_experts` experts can produce: the grid of
// the expert GEMMs. Only touched experts have tiles, at most min(num_experts, assignments) of
// them, and sum over them of ceil(count / tile_rows) <= assignments / tile_rows + touched -- so
// a 1-token step launches top_k tiles' blocks, not num_experts'.
inline int64_t MoeMaxTiles(int64_t assignments, int32_t num_experts,
                           int32_t tile_rows = kMoeTileRows) {
  return assignments / tile_rows + std::min<int64_t>(num_experts, assignments);
}

// The tile rows (block shape) of a step, by host-known numbers (so that a step stays
// graph-capturable). Where both projections' N (2 inter, hidden) are multiples of 256, 128-row
// tiles of 256 columns (the warpgroup-MMA shape, MoeTileColumnsFor) from 64 assignments (8 tokens
// at top-8): H200, Qwen3-30B-A3B's layer (rollout-moe-bench, session 16), it beat every other
// shape at every count from 8 tokens (256 tokens: gate_up + down 0.299 ms against 0.350 for
// 32 x 64; 2048: 0.654 against 1.03) and lost only at 1 token (0.048 against 0.039). Else by the
// experts' mean rows: 128 from 256 rows an expert, 64 from 64, else the decode shape's 32 -- the
// prefill shapes only when hidden is a multiple of 128 (their column blocks). The bits do not
// depend on it (moe_test.cc checks every shape against version 1).
// Whether both projections' N (2 inter for gate/up, hidden for down) tile by the widest shape's
// columns.
inline bool MoeWideColumnsFit(int64_t hidden, int64_t inter) {
  return hidden % kMoeTileColumnsWide == 0 && (2 * inter) % kMoeTileColumnsWide == 0;
}

inline int32_t MoeTileRowsFor(int64_t assignments, int32_t num_experts, int64_t hidden,
                              int64_t inter) {
  if (hidden % 128 != 0) return kMoeTileRows;
  if (MoeWideColumnsFit(hidden, inter) && assignments >= 64) return kMoeTileRowsXLarge;
  if (assignments >= int64_t{256} * num_experts) return kMoeTileRowsXLarge;
  if (assignments >= int64_t{kMoeTileRowsLarge} * num_experts) return kMoeTileRowsLarge;
  return kMoeTileRows;
}

// The block columns of a step's expert GEMMs (MoeGemmParams::tile_columns) for its tile rows:
// 256 with 128-row tiles when both projections' N (2 inter, hidden) are multiples of 256 -- a
// third fewer staged bytes per MMA than 128 x 128 -- else 0 (the tile rows' own shape).
inline int32_t MoeTileColumnsFor(int32_t tile_rows, int64_t hidden, int64_t inter) {
  return tile_rows == kMoeTileRowsXLarge && MoeWideColumnsFit(hidden, inter) ? kMoeTileColumnsWide
                                                                             : 0;
}

// Routing, one warp per token t of [0, num_tokens):
//   m = max_e logits[t, e]; q_e = expf(logits[t, e] - m); s = sum of q_e as 32 lane sums (lane l
//   adds e = l, l + 32, ... in increasing order) combined by the xor butterfly 16, 8, 4, 2, 1;
//   p_e = q_e / s. Unless forced, ids[t, 0..k) are the k largest p (ties: the lower expert index
//   first), in that (rank) order; forced (forced_rows != nullptr && forced_rows[t] != 0): ids[t, j]
//   = forced_ids[t, j] (clamped into [0, num_experts); the runner validates them). weights[t, j]
//   = p_{ids[t, j]}, divided by their sum taken in rank order j = 0..k-1 when norm_topk_prob.
// logits: [num_tokens, num_experts] fp32; forced_ids: [num_tokens, top_k] or nullptr;
// forced_rows: [num_tokens] or nullptr; ids: [num_tokens, top_k] int32; weights: [num_tokens,
// top_k] fp32. REQUIRES: 1 <= top_k <= min(num_experts, kMoeMaxTopK), num_experts <=
// kMoeMaxExperts (cudaErrorInvalidValue otherwise).
cudaError_t MoeRoute(const float* logits, int64_t num_tokens, int32_t num_experts, int32_t top_k,
                     bool norm_topk_prob, const int32_t* forced_ids, const int32_t* forced_rows,
                     int32_t* ids, float* weights, cudaStream_t stream);

// The assignments (t, j) -- assignment a = t * top_k + j, expert ids[a] -- grouped by expert:
// expert e's rows are [expert_offsets[e], expert_offsets[e + 1]) of the grouped order, in
// increasing a (token, then rank). Its tiles are [tile_offsets[e], tile_offsets[e + 1]).
struct MoeGrouping {
  int32_t* counts = nullptr;          // [num_experts]: rows per expert
  int32_t* expert_offsets = nullptr;  // [num_experts + 1]
  int32_t* tile_offsets = nullptr;    // [num_experts + 1]
  int32_t* rows = nullptr;            // [assignments]: grouped row -> token t
  int32_t* slots = nullptr;           // [assignments]: assignment a -> its grouped row
};

// A grouping laid out in one int32 buffer, in the order above: how many int32 it takes, and
// its arrays at their places in `buffer`.
inline int64_t MoeGroupingInts(int64_t num_experts, int64_t assignments) {
  return 3 * num_experts + 2 + 2 * assignments;
}
inline MoeGrouping MoeGroupingIn(int32_t* buffer, int64_t num_experts, int64_t assignments) {
  const int64_t e = num_experts;
  return {buffer, buffer + e, buffer + 2 * e + 1, buffer + 3 * e + 2,
          buffer + 3 * e + 2 + assignments};
}

// Fills `grouping` from ids ([num_tokens, top_k], each in [0, num_experts)), tiles of
// `tile_rows` (kMoeTileRows, kMoeTileRowsLarge or kMoeTileRowsXLarge: the expert GEMMs'
// tile_rows): one launch of one block per expert (every expert's count by a shared-memory
// histogram, the expert's offsets from them, then its stable scatter, each warp a contiguous range
// of the assignments).
// REQUIRES: num_experts <= kMoeMaxExperts; the ids of one token distinct.
cudaError_t MoeGroup(const int32_t* ids, int64_t num_tokens, int32_t num_experts, int32_t top_k,
                     int32_t tile_rows, const MoeGrouping& grouping, cudaStream_t stream);

enum class MoeGemmOutput {
  kBf16,  // y bf16 = bf16(acc) (round to nearest even), as cuBLAS's bf16 epilogue
  kF32,   // y fp32 = acc
};

// One grouped GEMM over every expert: for each grouped row r of expert e,
//   y[r, :] = x[rows ? rows[r] : r, :] . w_e^T,  w_e = w + e * expert_stride ([n, k] bf16),
// acc per element = a fixed sequence of mma.sync m16n8k16 over K in increasing 16-wide steps
// from zero (bf16 in, fp32 accumulate), in every block shape and version (moe_gemm.cu). Block
// shapes by tile_rows: 32 rows x 64 columns (decode), 64 x 128 and 128 x 128 (prefill), 128 x 256
// with tile_columns kMoeTileColumnsWide; the grid covers MoeMaxTiles(assignments, num_experts,
// tile_rows) tiles and blocks past tile_offsets[num_experts] exit. x: [*, k] bf16; rows:
// [assignments] or nullptr; y: [assignments, n]. REQUIRES: n % kMoeGemmAlign == 0, k %
// kMoeGemmAlign == 0 (and n a multiple of the block's columns); tile_rows the grouping's; x, w, y
// 16-byte aligned (cudaErrorInvalidValue otherwise).
struct MoeGemmParams {
  const bf16* x = nullptr;
  const int32_t* rows = nullptr;
  int64_t assignments = 0;
  const bf16* w = nullptr;
  int64_t expert_stride = 0;  // elements
  int64_t n = 0;
  int64_t k = 0;
  const int32_t* expert_offsets = nullptr;
  const int32_t* tile_offsets = nullptr;
  int32_t num_experts = 0;
  MoeGemmOutput output = MoeGemmOutput::kBf16;
  void* y = nullptr;
  int32_t tile_rows = kMoeTileRows;  // MoeGroup's: the block shape
  int32_t tile_columns = 0;  // 0: tile_rows' shape; kMoeTileColumnsWide (tile_rows 128): 128 x 256
};
cudaError_t MoeExpertGemm(const MoeGemmParams& params, cudaStream_t stream);

// Version 1 of the grouped GEMM (padded shared-memory rows, 32-bit fragment loads; block shapes
// 32 x 64 and 64 x 128), the reference the current version must equal bitwise (moe_test.cc,
// rollout-moe-bench). The same contract; REQUIRES: tile_rows kMoeTileRows or kMoeTileRowsLarge,
// tile_columns 0.
cudaError_t MoeExpertGemmV1(const MoeGemmParams& params, cudaStream_t stream);

// x[t, :] += sum_{j = 0..top_k-1} weights[t, j] * y[slots[t * top_k + j], :], per element
// acc = fmaf(w_j, y_j, acc) from acc = 0 in rank order, then x = x + acc (fp32).
// y: [assignments, hidden] fp32; slots, weights: [num_tokens, top_k]; x: [num_tokens, hidden].
// REQUIRES: hidden % 4 == 0, x and y 16-byte aligned.
cudaError_t MoeCombine(const float* y, const int32_t* slots, const float* weights,
                       int64_t num_tokens, int32_t top_k, int64_t hidden, float* x,
                       cudaStream_t stream);

// The whole expert part of one MoE layer after routing: grouping (tiles of MoeTileRowsFor), gate/up
// (w_gate_up: [E, 2 I, H], expert e's gate rows then its up rows), SiLU * up (SiluMul's arithmetic,
// kernels/cuda/ops.h), down (w_down: [E, H, I]) and the combine into x. The buffers are the
// caller's workspace.
struct MoeLayerParams {
  const bf16* xn = nullptr;  // [num_tokens, hidden]: the post-attention norm's output
  int64_t num_tokens = 0;
  int64_t hidden = 0;
  int64_t inter = 0;  // moe_intermediate_size
  int32_t num_experts = 0;
  int32_t top_k = 0;
  const int32_t* ids = nullptr;    // [num_tokens, top_k] (MoeRoute's)
  const float* weights = nullptr;  // [num_tokens, top_k]
  const bf16* w_gate_up = nullptr;
  const bf16* w_down = nullptr;
  MoeGrouping grouping;
  bf16* gate_up = nullptr;  // [num_tokens * top_k, 2 inter]
  bf16* act = nullptr;      // [num_tokens * top_k, inter]
  float* y = nullptr;       // [num_tokens * top_k, hidden]
  float* x = nullptr;       // [num_tokens, hidden]: the residual, += the combine
};
cudaError_t MoeExperts(const MoeLayerParams& params, cudaStream_t stream);
// MoeExperts up to the combine: grouping, gate/up, SiLU * up and down into y (grouped order);
// weights and x are not used. The trainer's rt_cuda_moe_experts (its combine is a separate op).
cudaError_t MoeExpertOutputs(const MoeLayerParams& params, cudaStream_t stream);

// The expert GEMMs of one MoE layer as MoeExperts and the runner's EnqueueMoe (which marks its
// profile between them) launch them, in tiles of `tile_rows` (the grouping's: MoeTileRowsFor) and
// MoeTileColumnsFor's columns. Gate/up: the grouped rows of xn times each expert's w_gate_up
// into gate_up (bf16); down: act (grouped order) times each expert's w_down into y (fp32).
// Reads no pointer; weights, ids, x are not used.
MoeGemmParams MoeGateUpGemm(const MoeLayerParams& params, int32_t tile_rows);
MoeGemmParams MoeDownGemm(const MoeLayerParams& params, int32_t tile_rows);

// The grouped GEMM in the faster version for its tiles (H200, rollout-moe-bench, session 11):
// version 1 at 32- and 64-row tiles (64 tokens 0.177 against 0.196 ms, 256 tokens 0.350 against
// 0.450), version 2 at 128 (8192 tokens 3.09 against 3.38 ms). The same bits either way
// (MoeGemmVersionsTest).
cudaError_t MoeExpertGemmForTiles(const MoeGemmParams& params, cudaStream_t stream);

}  // namespace rollout::cuda
