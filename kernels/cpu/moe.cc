#include "kernels/cpu/moe.h"

#include <cmath>

namespace rollout::cpu {

void RouteToken(const float* logits, int32_t num_experts, int32_t k, bool norm_topk_prob,
                const int32_t* forced, int32_t* ids, float* weights) {
  float m = logits[0];
  for (int32_t e = 1; e < num_experts; ++e) m = std::fmax(m, logits[e]);
  // p_e is recomputed where needed rather than stored: expf(l - m) / s is the same bits each time.
  float s = 0.0f;
  for (int32_t e = 0; e < num_experts; ++e) s += std::exp(logits[e] - m);
  auto p = [&](int32_t e) { return std::exp(logits[e] - m) / s; };
  if (forced != nullptr) {
    for (int32_t j = 0; j < k; ++j) ids[j] = forced[j];
  } else {
    // k passes of a scan in ascending id: a strictly larger p replaces the best, so among equal
    // probabilities the lower id wins, and ranks come out by p descending.
    for (int32_t j = 0; j < k; ++j) {
      int32_t best = -1;
      float best_p = 0.0f;
      for (int32_t e = 0; e < num_experts; ++e) {
        bool taken = false;
        for (int32_t i = 0; i < j; ++i) taken = taken || ids[i] == e;
        if (taken) continue;
        const float pe = p(e);
        if (best < 0 || pe > best_p) {
          best = e;
          best_p = pe;
        }
      }
      ids[j] = best;
    }
  }
  for (int32_t j = 0; j < k; ++j) weights[j] = p(ids[j]);
  if (norm_topk_prob) {
    float sum = 0.0f;
    for (int32_t j = 0; j < k; ++j) sum += weights[j];
    for (int32_t j = 0; j < k; ++j) weights[j] = weights[j] / sum;
  }
}

void CombineExperts(const float* y, const float* weights, int32_t k, int64_t dim, float* out) {
  for (int64_t c = 0; c < dim; ++c) {
    float acc = 0.0f;
    for (int32_t j = 0; j < k; ++j) acc = std::fma(weights[j], y[j * dim + c], acc);
    out[c] = acc;
  }
}

}  // namespace rollout::cpu
