#pragma once

// The rollout benchmark's workloads (docs/benchmarks.md, "The workload and its floor"), shared by
// the tools that drive the Engine with them: rollout-bench (GPU) and rollout-engine-host-bench
// (no runner work).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "engine/engine.h"
#include "engine/sampler.h"

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

// The RL-shaped workload: `prompts` prompts of input_len tokens, each one request (one Submit)
// of `samples` samples with seeds DeriveSampleSeed(2000 + prompt, j), so the prompt is shared
// through the prefix cache. Every sample may generate max_new_tokens; how many it does is
// lengths[prompt * samples + j] (RlOutputLengths), ending on `stop_token` -- which the benchmark's
// runner decorator makes the sampled token at that length, as a trained model's EOS would be.
inline std::vector<std::vector<SampleSpec>> RlWorkload(int prompts, int samples, int input_len,
                                                       int max_new_tokens, int32_t stop_token,
                                                       float temperature, int vocab,
                                                       std::mt19937_64* rng) {
  std::vector<std::vector<SampleSpec>> jobs(prompts);
  for (int p = 0; p < prompts; ++p) {
    const std::vector<int32_t> prompt = RandomPrompt(input_len, vocab, rng);
    for (int j = 0; j < samples; ++j) {
      SampleSpec s;
      s.rollout_index = p;
      s.sample_index = j;
      s.prompt = prompt;
      s.params.temperature = temperature;
      s.params.max_new_tokens = max_new_tokens;
      s.params.ignore_eos = true;  // the synthetic model's EOS would stop samples at random
      s.params.stop_token_ids = {stop_token};
      s.sample_seed = DeriveSampleSeed(2000 + static_cast<uint64_t>(p), static_cast<uint32_t>(j));
      jobs[p].push_back(std::move(s));
    }
  }
  return jobs;
}

// n output lengths from a fixed seed, long-tailed like reasoning rollouts: log-normal with median
// `median` and sigma 0.8, clamped to [16, max_len].
inline std::vector<int> RlOutputLengths(int n, int median, int max_len) {
  std::mt19937_64 rng(11);
  std::lognormal_distribution<double> dist(std::log(static_cast<double>(median)), 0.8);
  std::vector<int> lengths(n);
  for (int& l : lengths) {
    l = std::clamp(static_cast<int>(std::lround(dist(rng))), 16, max_len);
  }
  return lengths;
}

// The decode steps of samples of `lengths` generated tokens after input_len prompt tokens, as an
// oracle that knows every length would schedule them: continuous batching in arrival order, a
// sample admitted when its whole KV (prompt + length) fits in kv_capacity_tokens beside the
// running ones. Calls step(batch, kv_tokens) for each step: the samples running and the KV tokens
// they read. Equal lengths give waves. With samples_per_prompt > 1 (lengths[i] a sample of prompt
// i / samples_per_prompt), step gets a third argument: the KV tokens with each running prompt's
// input_len tokens read once, as decode attention that shares a prompt's pages among its samples
// reads them.
template <typename Step>
void ForEachOracleDecodeStep(const std::vector<int>& lengths, int input_len,
                             int64_t kv_capacity_tokens, Step step, int samples_per_prompt = 1) {
  struct Running {
    int64_t generated, length, prompt;
  };
  std::vector<Running> running;
  size_t next = 0;
  int64_t held = 0;  // KV tokens reserved by the running samples
  while (next < lengths.size() || !running.empty()) {
    while (next < lengths.size() &&
           (running.empty() || held + input_len + lengths[next] <= kv_capacity_tokens)) {
      running.push_back({0, lengths[next], static_cast<int64_t>(next) / samples_per_prompt});
      held += input_len + lengths[next];
      ++next;
    }
    int64_t kv_tokens = 0, generated_kv = 0;
    std::vector<int64_t> prompts;
    for (const Running& r : running) {
      kv_tokens += input_len + r.generated + 1;
      generated_kv += r.generated + 1;
      prompts.push_back(r.prompt);
    }
    std::sort(prompts.begin(), prompts.end());
    const int64_t distinct = std::unique(prompts.begin(), prompts.end()) - prompts.begin();
    step(static_cast<int64_t>(running.size()), kv_tokens, generated_kv + distinct * input_len);
    for (Running& r : running) ++r.generated;
    for (size_t i = 0; i < running.size();) {
      if (running[i].generated >= running[i].length) {
        held -= input_len + running[i].length;
        running[i] = running.back();
        running.pop_back();
      } else {
        ++i;
      }
    }
  }
}

}  // namespace rollout
