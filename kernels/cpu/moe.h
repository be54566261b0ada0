#pragma once

#include <cstdint>

// The CPU reference's mixture-of-experts arithmetic (docs/determinism.md, "MoE layers"): one
// token's routing from its router logits, and the combine of its experts' outputs. Both are
// per-token functions of their inputs only, so a row's result never depends on the batch or on
// how many tokens each expert got.
namespace rollout::cpu {

// One token's routing. logits: [num_experts], fp32 (the router GEMM's output). Exactly:
// m = max_e logits[e]; x_e = expf(logits[e] - m); s = sum_e x_e in ascending e from +0;
// p_e = x_e / s. Chosen (forced == nullptr): ids[0..k) = the k largest p_e, rank order by p
// descending with ties to the lower expert id. Forced: ids = forced[0..k) as given.
// Then weights[j] = p_{ids[j]}, and with norm_topk_prob divided by their sum (accumulated in
// rank order j = 0..k-1 from +0). REQUIRES: 1 <= k <= num_experts; forced ids (if any) in
// [0, num_experts).
void RouteToken(const float* logits, int32_t num_experts, int32_t k, bool norm_topk_prob,
                const int32_t* forced, int32_t* ids, float* weights);

// out[c] = sum_j weights[j] * y[j * dim + c] over ranks j = 0..k-1 in that order, from +0, each
// step acc = fma(weights[j], y[j][c], acc) (one rounding, spelled out). y: [k, dim], the chosen
// experts' outputs in rank order; out: [dim].
void CombineExperts(const float* y, const float* weights, int32_t k, int64_t dim, float* out);

}  // namespace rollout::cpu
