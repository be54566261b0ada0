#pragma once

#include <cstdint>
#include <vector>

namespace rollout {

// The smallest temperature above 0 (greedy). Samplers divide fp32 logits by T; below this the
// quotients of ordinary logits approach fp32's range (at T = 1e-45, 1 / T is inf: every
// positive logit became the same largest float, and logprobs -inf) while the sampling it asks
// for is already greedy in effect (the Gumbel noise, at most ~17, is dwarfed by logit gaps
// times 1000). Smaller positive temperatures are refused; 0 asks for greedy.
inline constexpr float kMinTemperature = 1e-3f;

// The most top logprobs one position returns (SamplingParams::top_logprobs).
inline constexpr int32_t kMaxTopLogprobs = 20;

// How one sample picks its next token. Validated by the server before it reaches the engine;
// see docs/api.md for the exact definitions.
struct SamplingParams {
  float temperature = 1.0f;  // 0 = greedy, else at least kMinTemperature
  int32_t top_k = 0;         // 0 = off
  float top_p = 1.0f;        // in (0, 1]
  float min_p = 0.0f;        // in [0, 1]
  int32_t max_new_tokens = 16;
  std::vector<int32_t> stop_token_ids;
  bool ignore_eos = false;
  int32_t top_logprobs = 0;  // top-N logprobs per generated position, at most kMaxTopLogprobs
};

}  // namespace rollout
