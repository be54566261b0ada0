#pragma once

#include <cstdint>
#include <vector>

namespace rollout {

// How one sample picks its next token. Validated by the server before it reaches the engine;
// see docs/api.md for the exact definitions.
struct SamplingParams {
  float temperature = 1.0f;  // 0 = greedy
  int32_t top_k = 0;         // 0 = off
  float top_p = 1.0f;        // in (0, 1]
  float min_p = 0.0f;        // in [0, 1]
  int32_t max_new_tokens = 16;
  std::vector<int32_t> stop_token_ids;
  bool ignore_eos = false;
  int32_t top_logprobs = 0;  // top-N logprobs per generated position
};

}  // namespace rollout
