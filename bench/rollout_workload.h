#pragma once

// The rollout benchmark's workload (docs/benchmarks.md, "The workload and its floor"), shared by the tools that drive the
// Engine with it: rollout-bench (GPU) and rollout-engine-host-bench (no runner work).
#include <cstdint>
#include <random>
#include <vector>

#include "engine/engine.h"

namespace rollout {

// n token ids drawn uniformly below vocab.
inline std::vector<int32_t> RandomPrompt(int n, int vocab, std::mt19937_64* rng) {
  std::vector<int32_t> t(n);
  for (int32_t& x : t) x = static_cast<int32_t>((*rng)() % vocab);
  return t;
}

// `requests` samples (rollout i, sample seed 1000 + i) of random prompts of input_len tokens,
// each generating exactly output_len tokens (ignore_eos) at `temperature`.
inline std::vector<SampleSpec> RolloutWorkload(int requests, int input_len, int output_len,
                                               float temperature, int vocab, std::mt19937_64* rng) {
  std::vector<SampleSpec> samples;
  samples.reserve(requests);
  for (int i = 0; i < requests; ++i) {
    SampleSpec s;
    s.rollout_index = i;
    s.prompt = RandomPrompt(input_len, vocab, rng);
    s.params.temperature = temperature;
    s.params.max_new_tokens = output_len;
    s.params.ignore_eos = true;
    s.sample_seed = 1000 + static_cast<uint64_t>(i);
    samples.push_back(std::move(s));
  }
  return samples;
}

}  // namespace rollout
