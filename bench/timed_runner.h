#pragma once

// rollout-bench's runner decorator: times the engine's steps and emulates the RL workload's stops.
#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <vector>

#include "engine/forwarding_runner.h"
#include "engine/model_runner.h"
#include "runner/cuda/cuda_model_runner.h"

namespace rollout {

// Times the engine's steps, split by whether the step holds prefill tokens: the host time inside
// LaunchStep (metadata, enqueueing; all of a step that runs at launch) and the wait in
// CollectStep (for a step enqueued on the GPU: until its results are back).
class TimedRunner final : public ForwardingRunner {
 public:
  explicit TimedRunner(CudaModelRunner* inner) : ForwardingRunner(inner) {}
  absl::StatusOr<std::unique_ptr<HostStagingBuffer>> AllocateHostStaging(
      size_t bytes) const override {
    return inner().AllocateHostStaging(bytes);
  }
  bool CanFeed(const std::vector<LogitsRowTask>& tasks) const override {
    return inner().CanFeed(tasks);
  }
  bool LaunchesAsync() const override { return inner().LaunchesAsync(); }
  absl::Status LaunchStep(const ForwardBatch& batch,
                          const std::vector<LogitsRowTask>& tasks) override {
    const auto start = std::chrono::steady_clock::now();
    absl::Status s = inner().LaunchStep(batch, tasks);
    const bool decode_only = batch.num_tokens() == static_cast<int64_t>(batch.block_tables.size());
    Kind& kind = decode_only ? decode : prefill;
    kind.launch_ns += Nanoseconds(start);
    if (s.ok()) {
      ++kind.steps;
      kind.tokens += batch.num_tokens();
      Launched launched{&kind, {}};
      if (!stop_after_.empty()) {
        for (const LogitsRowTask& t : tasks) launched.rows.push_back({t.sample_seed, t.position});
      }
      launched_.push_back(std::move(launched));
    }
    return s;
  }
  absl::Status CollectStep(std::vector<SampleResult>* results) override {
    const auto start = std::chrono::steady_clock::now();
    absl::Status s = inner().CollectStep(results);
    if (!launched_.empty()) {
      launched_.front().kind->collect_ns += Nanoseconds(start);
      if (s.ok()) EmulateStops(launched_.front().rows, results);
      launched_.pop_front();
    }
    return s;
  }

  // The RL workload's stand-in for a trained model's EOS: the sample with seed `seed` samples
  // `stop_token` as its generated token number stop_after[seed] (counted from 1, after prompts of
  // `prompt_len` tokens), and never before (a random model would hit it by chance). Only the
  // token the engine sees changes; on the device a launched-ahead step of the sample may have
  // used the original token, as after any stop (the engine drops that row).
  void EmulateStops(int32_t stop_token, int64_t prompt_len, std::map<uint64_t, int> stop_after) {
    stop_token_ = stop_token;
    prompt_len_ = prompt_len;
    stop_after_ = std::move(stop_after);
  }

  struct Kind {
    std::atomic<int64_t> launch_ns{0}, collect_ns{0}, steps{0}, tokens{0};
    double launch_s() const { return launch_ns.load() * 1e-9; }
    double collect_s() const { return collect_ns.load() * 1e-9; }
    double total_s() const { return launch_s() + collect_s(); }
    double ms_per_step() const { return total_s() / std::max<int64_t>(1, steps.load()) * 1e3; }
  };
  Kind prefill, decode;

 private:
  static int64_t Nanoseconds(std::chrono::steady_clock::time_point start) {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() -
                                                                start)
        .count();
  }
  struct Row {
    uint64_t seed;
    int64_t position;  // of the token being sampled
  };
  struct Launched {
    Kind* kind;
    std::vector<Row> rows;  // with EmulateStops only
  };
  void EmulateStops(const std::vector<Row>& rows, std::vector<SampleResult>* results) const {
    for (size_t r = 0; r < rows.size() && r < results->size(); ++r) {
      auto it = stop_after_.find(rows[r].seed);
      if (it == stop_after_.end()) continue;
      int32_t& token = (*results)[r].token;
      const int64_t generated = rows[r].position - prompt_len_ + 1;
      if (generated == it->second) {
        token = stop_token_;
      } else if (token == stop_token_) {
        token = stop_token_ + 1;
      }
    }
  }

  std::deque<Launched> launched_;  // engine thread only
  int32_t stop_token_ = 0;
  int64_t prompt_len_ = 0;
  std::map<uint64_t, int> stop_after_;  // by sample seed
};

}  // namespace rollout
