#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/sampler.h"
#include "engine/sampling_params.h"

namespace rollout {

enum class FinishReason { kStop, kLength, kAbort };

// One sample being generated: the unit of scheduling. Owned by the engine; engine thread only.
struct Sequence {
  uint64_t arrival = 0;  // FCFS order: the order the engine received it
  uint64_t job_id = 0;
  int32_t rollout_index = 0;
  int32_t sample_index = 0;
  SamplingParams params;
  uint64_t sample_seed = 0;
  int64_t prompt_len = 0;
  std::vector<int32_t> tokens;  // prompt, then generated tokens
  std::vector<float> logprobs;  // one per generated token
  std::vector<std::vector<TokenLogprob>> top_logprobs;  // one per generated token if asked
  int64_t num_computed = 0;     // tokens [0, num_computed) have their KV in the cache
  std::vector<int32_t> block_table;
  int64_t num_reported = 0;     // generated tokens already sent to the caller
  bool finished = false;        // its completion has been reported

  int64_t num_generated() const { return static_cast<int64_t>(tokens.size()) - prompt_len; }
  int64_t num_tokens() const { return static_cast<int64_t>(tokens.size()); }
};

}  // namespace rollout
