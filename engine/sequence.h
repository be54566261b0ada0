#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "engine/prefix_cache.h"
#include "engine/sampler.h"
#include "engine/sampling_params.h"

namespace rollout {

enum class FinishReason { kStop, kLength, kAbort };

// Generated tokens [first_token, last_token] (inclusive) came from weights `version`.
struct VersionSpan {
  std::string version;
  int32_t first_token = 0;
  int32_t last_token = 0;
};

// One sample being generated: the unit of scheduling. Owned by the engine; engine thread only.
struct Sequence {
  uint64_t arrival = 0;                             // FCFS order: the order the engine received it
  std::chrono::steady_clock::time_point submitted;  // when Engine::Submit took it
  bool scheduled = false;                           // in a step at least once
  uint64_t job_id = 0;
  int32_t rollout_index = 0;
  int32_t sample_index = 0;
  SamplingParams params;
  uint64_t sample_seed = 0;
  int64_t prompt_len = 0;
  // Set by whatever aborts it: SampleCompletion::abort_cause (and nonfinite_logits).
  std::string abort_cause;
  bool nonfinite_logits = false;
  std::vector<int32_t> tokens;                          // prompt, then generated tokens
  std::vector<float> logprobs;                          // one per generated token
  std::vector<std::vector<TokenLogprob>> top_logprobs;  // one per generated token if asked
  int64_t num_computed = 0;  // tokens [0, num_computed) have their KV in the cache
  // Tokens [0, max_computed) were computed at least once (a chunk below it after a preemption
  // is recomputation; a prefix-cache hit is not).
  int64_t max_computed = 0;
  std::vector<int32_t> block_table;
  int64_t num_reported = 0;  // generated tokens already sent to the caller
  bool finished = false;     // its completion has been reported
  // Its job's caller is not taking events (Engine::PauseJob): the scheduler leaves it out of
  // every step, keeping its KV blocks and its place in the arrival order.
  bool paused = false;
  // Leading pages found in or added to the prefix cache, locked while this sequence lives.
  std::vector<PrefixCache::Node*> cache_path;
  std::optional<int64_t> cached_prompt_tokens;  // prefix-cache hit at first admission
  // Score jobs: > 0 means teacher-forced scoring of tokens[score_start..]; nothing is sampled.
  int64_t score_start = 0;
  std::vector<VersionSpan> version_spans;  // one per run of generated tokens of one version
  // MoE routing replay (SampleSpec): return each generated / scored token's routing, appended
  // to `routing` ([tokens so far * R]) as its row is applied; a scoring sequence's forced
  // routing of its scored tokens ([(num_tokens - score_start) * R]), or empty.
  bool return_routing = false;
  std::vector<int32_t> routing;
  std::vector<int32_t> forced_routing;
  // Weight version that computed the KV of tokens [0, num_computed); only pages of the current
  // version may enter the prefix cache.
  std::string kv_version;

  bool is_score() const { return score_start > 0; }

  int64_t num_generated() const { return static_cast<int64_t>(tokens.size()) - prompt_len; }
  int64_t num_tokens() const { return static_cast<int64_t>(tokens.size()); }
  // Leading tokens whose KV may come from the prefix cache: at least the last token is always
  // computed (its logits are needed), and for scoring every scored position's logits too.
  int64_t max_prefix_tokens() const {
    const int64_t last = num_tokens() - 1;
    return is_score() ? std::min(last, score_start - 1) : last;
  }
};

}  // namespace rollout
