#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "model/model_config.h"

namespace rollout::testing {

// An independent, deliberately plain forward pass in double precision: whole-sequence causal
// attention with no KV cache, no paging, no batching, no threads. It shares only the checkpoint
// reader with the engine, so it checks the engine's arithmetic, not its own reflection.
class NaiveModel {
 public:
  static absl::StatusOr<NaiveModel> Load(const std::string& dir);

  const ModelConfig& config() const { return config_; }

  // Logits after every position of `tokens`: [tokens.size()][vocab].
  std::vector<std::vector<double>> Logits(const std::vector<int32_t>& tokens) const;

 private:
  using Matrix = std::vector<float>;  // row-major [out, in]
  struct Layer {
    Matrix in_norm, q, k, v, q_bias, k_bias, v_bias, q_norm, k_norm, o, post_norm, gate, up, down;
    // A MoE layer (Qwen3-MoE): the router and each expert's gate, up and down.
    bool moe = false;
    Matrix router;
    std::vector<Matrix> expert_gate, expert_up, expert_down;
  };
  // The SwiGLU MLP of (gate, up, down) of width `inter` on xn.
  static std::vector<double> Mlp(const Matrix& gate, const Matrix& up, const Matrix& down,
                                 size_t inter, const std::vector<double>& xn);
  // A MoE layer on xn: softmax of the router logits, the top num_experts_per_tok (ties to the
  // lower id), their probabilities (renormalised with norm_topk_prob) weighting their experts.
  std::vector<double> Moe(const Layer& l, const std::vector<double>& xn) const;
  ModelConfig config_;
  Matrix embed_, lm_head_, final_norm_;
  std::vector<Layer> layers_;
};

// log_softmax(logits / T)[token] in double; T <= 0 means T = 1.
double NaiveLogprob(const std::vector<double>& logits, double temperature, int32_t token);

}  // namespace rollout::testing
