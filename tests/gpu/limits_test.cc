// The engine at the largest context and batch its limits allow, on the GPU: the server's default
// max_running_samples (256) samples, each to the model's whole context (Qwen3-8B's
// max_position_embeddings, 40960 tokens), in one step budget of the server's default
// max_batch_tokens (16384), all of them decoding together at the end, in a KV pool sized to hold
// exactly all of them at once (two layers of Qwen3-8B's shapes, 8 KiB a token: 80 GiB on an H200;
// one layer, 40 GiB, on a card that cannot hold that, an 80 GB H100). Every sample ends with all
// its tokens -- none aborted, none preempted, no token recomputed -- the decode steps at 256 x
// 40960 run (the attention partials at the largest split count were planned at load: before the
// memory plan, such steps failed with "allocating attention partials: out of memory"), device
// memory taken during the run stays within what the start-up plan left free, and the first, middle
// and last samples are bitwise those of the same sample run alone (D1 at the limits).
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "engine/engine_test_util.h"
#include "gtest/gtest.h"
#include "model/random_model.h"
#include "runner/cuda/cuda_model_runner.h"
#include "tests/gpu/gpu_test_util.h"

namespace rollout {
namespace {

constexpr int32_t kSamples = 256;       // the server's default --max_running_samples (cuda)
constexpr int32_t kBatchTokens = 16384;  // the server's default --max_batch_tokens (cuda)
// More than the steps the 256 prefills take (256 x 40960 / 16384 = 640), so that every sample is
// still decoding when the last one starts: the steps then decode 256 rows at the whole context.
constexpr int32_t kNewTokens = 768;

double GiB(double bytes) { return bytes / (1 << 30); }

int64_t FreeDeviceMemory() {
  size_t free_bytes = 0, total = 0;
  EXPECT_EQ(cudaMemGetInfo(&free_bytes, &total), cudaSuccess);
  return static_cast<int64_t>(free_bytes);
}

double Seconds(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count();
}

// Sample i: its own random prompt (no prefix shared, so every sample holds its whole context),
// max_context - kNewTokens tokens, then kNewTokens generated; even samples greedy, odd sampled.
SampleSpec Spec(int i, int64_t max_context, int32_t vocab) {
  SampleSpec spec;
  spec.sample_index = i;
  std::mt19937 rng(1000 + i);
  spec.prompt.resize(max_context - kNewTokens);
  for (int32_t& t : spec.prompt) t = static_cast<int32_t>(rng() % vocab);
  spec.params.temperature = i % 2 == 0 ? 0.0f : 0.8f;
  spec.params.max_new_tokens = kNewTokens;
  spec.params.ignore_eos = true;
  spec.sample_seed = 7000 + i;
  return spec;
}

TEST(LimitsTest, EverySampleOfAFullBatchAtTheWholeContextCompletesWithTheBitsOfItsRunAlone) {
  if (!gpu_test::HaveGpu()) GTEST_SKIP() << "no CUDA device";
  ModelConfig config = *PresetConfig("qwen3-8b");
  const int64_t max_context = config.max_position_embeddings;
  CudaRunnerOptions o;
  o.max_batch_tokens = kBatchTokens;
  const int64_t blocks_per_sample = (max_context + o.kv_block_size - 1) / o.kv_block_size;
  // Every sample's blocks, and a few for the pool's own (the graphs' pad block).
  auto pool_bytes = [&](int layers) {
    return (kSamples * blocks_per_sample + 8) * int64_t{2} * layers *
           config.num_key_value_heads * config.head_dim * 2 * o.kv_block_size;
  };
  // Two layers where they fit beside the weights and the step's workspaces (a few GiB).
  config.num_layers = pool_bytes(2) + (int64_t{6} << 30) <= FreeDeviceMemory() ? 2 : 1;
  o.kv_cache_bytes = pool_bytes(config.num_layers);
  const auto t_load = std::chrono::steady_clock::now();
  auto runner = CudaModelRunner::CreateSynthetic(config, 3, o);
  ASSERT_TRUE(runner.ok()) << runner.status();
  CudaModelRunner* const cuda = runner->get();
  EngineOptions options;
  options.max_running_samples = kSamples;
  options.max_batch_tokens = kBatchTokens;
  options.prefix_cache = false;  // the runs alone below compute everything again
  auto created = Engine::Create(*std::move(runner), options);
  ASSERT_TRUE(created.ok()) << created.status();
  std::unique_ptr<Engine> engine = *std::move(created);
  ASSERT_EQ(engine->max_context(), max_context) << "the pool holds a whole context";
  const int64_t free_at_start = FreeDeviceMemory();
  std::printf("%d layer(s); loaded in %.1f s: KV pool %.2f GiB (%d blocks), weights %.2f GiB, "
              "%.2f GiB left free on the device\n",
              config.num_layers, Seconds(t_load), GiB(cuda->kv_cache_bytes()),
              cuda->num_kv_blocks(), GiB(cuda->weight_bytes()), GiB(free_at_start));
  ASSERT_GE(cuda->num_kv_blocks(), kSamples * blocks_per_sample);

  std::vector<SampleSpec> specs;
  for (int i = 0; i < kSamples; ++i) specs.push_back(Spec(i, max_context, config.vocab_size));
  const auto t_run = std::chrono::steady_clock::now();
  Collector collector(kSamples);
  // The most samples decoding at once: started (a token streamed) and not yet complete.
  int started = 0, done = 0, peak = 0;  // the delivery thread's, read after Wait()
  std::vector<bool> streaming(kSamples, false);
  EventSink sink = [&, inner = collector.Sink()](std::vector<SampleEvent> events) {
    for (const SampleEvent& e : events) {
      if (!e.new_token_ids.empty() && !streaming[e.sample_index]) {
        streaming[e.sample_index] = true;
        ++started;
      }
      if (e.completion.has_value()) ++done;
      peak = std::max(peak, started - done);
    }
    inner(std::move(events));
  };
  ASSERT_TRUE(engine->Submit(specs, sink).ok());
  const std::vector<SampleCompletion> all = collector.Wait();
  const double run_s = Seconds(t_run);
  const int64_t free_after = FreeDeviceMemory();
  const EngineCounters counters = engine->counters();
  std::printf("%d samples x %lld tokens (%lld prompt + %d generated) in %.1f s: %llu steps "
              "(%llu prefill, %llu decode at %.2f ms), at most %d samples decoding at once, %llu "
              "preemptions, %llu recomputed tokens; device memory taken during the run %.3f "
              "GiB\n",
              kSamples, static_cast<long long>(max_context),
              static_cast<long long>(max_context - kNewTokens), kNewTokens, run_s,
              static_cast<unsigned long long>(counters.steps),
              static_cast<unsigned long long>(counters.prefill_steps.count),
              static_cast<unsigned long long>(counters.decode_steps.count),
              counters.decode_steps.count > 0
                  ? 1e3 * counters.decode_steps.sum_seconds / counters.decode_steps.count
                  : 0.0,
              peak, static_cast<unsigned long long>(counters.preemptions),
              static_cast<unsigned long long>(counters.recomputed_tokens),
              GiB(free_at_start - free_after));
  for (int i = 0; i < kSamples; ++i) {
    ASSERT_EQ(all[i].finish_reason, FinishReason::kLength) << "sample " << i << " ended early";
    ASSERT_EQ(all[i].token_ids.size(), static_cast<size_t>(kNewTokens)) << "sample " << i;
    ASSERT_EQ(all[i].logprobs.size(), static_cast<size_t>(kNewTokens)) << "sample " << i;
  }
  EXPECT_EQ(counters.preemptions, 0u);
  EXPECT_EQ(counters.recomputed_tokens, 0u);
  EXPECT_EQ(counters.prefilled_tokens,
            static_cast<uint64_t>(kSamples) * static_cast<uint64_t>(max_context - kNewTokens));
  EXPECT_GT(counters.decode_steps.count, 0u);
  EXPECT_EQ(peak, kSamples) << "the steps decoded every sample together at the whole context";
  // The metadata buffers and the graphs captured on first use are all the step path may take;
  // it must stay well inside what the plan left free.
  EXPECT_LE(free_at_start - free_after, int64_t{1} << 30);
  EXPECT_GE(free_after, 0);

  for (int i : {0, kSamples / 2 + 1, kSamples - 1}) {
    SCOPED_TRACE("sample " + std::to_string(i) + " alone");
    SampleSpec spec = Spec(i, max_context, config.vocab_size);
    spec.sample_index = 0;  // the job's only sample (the index is not an input of the bits)
    Collector alone(1);
    ASSERT_TRUE(engine->Submit({spec}, alone.Sink()).ok());
    EXPECT_EQ(Bits(alone.Wait()[0]), Bits(all[i]));
  }
}

}  // namespace
}  // namespace rollout
