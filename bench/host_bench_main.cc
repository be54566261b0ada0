// rollout-engine-host-bench: the engine's own host work per step, with nothing else in it.
//
// The Engine drives a runner whose Forward does nothing and whose ProcessLogits returns a fixed
// token per row, over the rollout benchmark's shape (Qwen3-8B config, 256 requests of 1024 prompt
// tokens, 1024 generated, ignore_eos, max_running 256, max_batch_tokens 8192, pages of 32): what
// is left is scheduling, batch building, result bookkeeping and event delivery -- the "engine
// host work" term of `rollout-bench` (docs/cuda.md, "What would close the gap"), which the GPU
// waits out on every step. Prints seconds and milliseconds per step.
//
// Usage: rollout-engine-host-bench [--requests=N] [--input_len=N] [--output_len=N] [--repeats=N]
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <memory>
#include <mutex>
#include <random>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "bench/rollout_workload.h"
#include "common/command_line.h"
#include "engine/engine.h"
#include "engine/model_runner.h"
#include "model/random_model.h"

ABSL_FLAG(int32_t, requests, 256, "requests (all submitted at once)");
ABSL_FLAG(int32_t, input_len, 1024, "prompt tokens per request");
ABSL_FLAG(int32_t, output_len, 1024, "generated tokens per request (ignore_eos)");
ABSL_FLAG(int32_t, repeats, 3, "runs; each prints its own figure");

namespace rollout {
namespace {

using Clock = std::chrono::steady_clock;

// A runner that computes nothing.
class NoOpRunner final : public ModelRunner {
 public:
  explicit NoOpRunner(ModelConfig config) : config_(std::move(config)) {}
  const ModelConfig& config() const override { return config_; }
  const char* backend_name() const override { return "no-op"; }
  int32_t num_kv_blocks() const override { return 1 << 16; }
  int32_t kv_block_size() const override { return 32; }
  int32_t attention_split_size() const override { return 256; }
  const std::vector<WeightSpec>& weight_specs() const override { return specs_; }
  absl::Status UpdateWeights(const std::vector<HostTensorView>&) override {
    return absl::OkStatus();
  }
  absl::Status Forward(const ForwardBatch&, std::vector<float>*) override {
    steps_.fetch_add(1);
    return absl::OkStatus();
  }
  absl::Status ProcessLogits(const std::vector<LogitsRowTask>& tasks, const std::vector<float>&,
                             std::vector<SampleResult>* results) override {
    results->resize(tasks.size());
    for (size_t i = 0; i < tasks.size(); ++i) {
      (*results)[i].token = static_cast<int32_t>(7 + tasks[i].position % 1000);
      (*results)[i].logprob = -1.0f;
      (*results)[i].top.clear();
    }
    return absl::OkStatus();
  }
  int64_t steps() const { return steps_.load(); }

 private:
  ModelConfig config_;
  std::vector<WeightSpec> specs_;
  std::atomic<int64_t> steps_{0};
};

int Run() {
  const int requests = absl::GetFlag(FLAGS_requests);
  const int in = absl::GetFlag(FLAGS_input_len), out = absl::GetFlag(FLAGS_output_len);
  std::printf("engine host work: %d requests, %d prompt + %d generated tokens, no-op runner\n",
              requests, in, out);
  for (int rep = 0; rep < absl::GetFlag(FLAGS_repeats); ++rep) {
    auto runner = std::make_unique<NoOpRunner>(*PresetConfig("qwen3-8b"));
    const NoOpRunner* counter = runner.get();
    EngineOptions options;
    options.max_running_samples = 256;
    options.max_batch_tokens = 8192;
    auto engine = Engine::Create(std::move(runner), options);
    if (!engine.ok()) {
      std::fprintf(stderr, "engine: %s\n", engine.status().ToString().c_str());
      return 1;
    }
    std::mt19937_64 rng(1);
    std::vector<SampleSpec> samples = RolloutWorkload(requests, in, out, /*temperature=*/1.0f,
                                                      counter->config().vocab_size, &rng);
    std::mutex mu;
    std::condition_variable cv;
    int finished = 0;
    const auto start = Clock::now();
    auto job = (*engine)->Submit(std::move(samples), [&](std::vector<SampleEvent> events) {
      std::lock_guard<std::mutex> lock(mu);
      for (const SampleEvent& e : events) finished += e.completion.has_value() ? 1 : 0;
      cv.notify_all();
    });
    if (!job.ok()) {
      std::fprintf(stderr, "submit: %s\n", job.status().ToString().c_str());
      return 1;
    }
    {
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] { return finished == requests; });
    }
    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    // Every sample has finished: no step is left to run (the engine is destroyed after this).
    std::printf("  run %d: %ld steps in %.3f s = %.3f ms per step\n", rep,
                static_cast<long>(counter->steps()), seconds,
                seconds / static_cast<double>(counter->steps()) * 1e3);
  }
  return 0;
}

}  // namespace
}  // namespace rollout

int main(int argc, char** argv) {
  rollout::ParseCommandLine(argc, argv,
                            "the engine's own host work per step (docs/cuda.md).\nUsage: "
                            "rollout-engine-host-bench [--requests=N] [--input_len=N] "
                            "[--output_len=N] [--repeats=N]",
                            "host_bench_main.cc");
  return rollout::Run();
}
