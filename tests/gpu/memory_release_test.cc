// Colocated memory on the GPU (ReleaseMemory / ResumeMemory): a ReleasableDeviceBuffer keeps
// its addresses across a release, so a CUDA graph over it replays; through the engine, a
// release gives the KV pool's (and the weights') memory back to the device -- cudaMemGetInfo's
// free memory rises by about their size -- new work waits, and after ResumeMemory the same
// probe gives bitwise the same tokens and logprobs with the decode graphs replayed, not
// captured again; a resume the device cannot satisfy (a "trainer" holding the memory) is
// RESOURCE_EXHAUSTED and a retry after it freed the memory restores the bits.
#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <future>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "engine/engine_test_util.h"
#include "gtest/gtest.h"
#include "model/random_model.h"
#include "runner/cuda/cuda_model_runner.h"
#include "runner/cuda/releasable_device_buffer.h"
#include "tests/gpu/gpu_test_util.h"

namespace rollout {
namespace {

using cuda_runner_internal::ReleasableDeviceBuffer;

double GiB(double bytes) { return bytes / (1 << 30); }

int64_t FreeDeviceMemory() {
  size_t free_bytes = 0, total = 0;
  EXPECT_EQ(cudaMemGetInfo(&free_bytes, &total), cudaSuccess);
  return static_cast<int64_t>(free_bytes);
}

class MemoryReleaseTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!gpu_test::HaveGpu()) GTEST_SKIP() << "no CUDA device";
  }
};

TEST_F(MemoryReleaseTest, ABufferKeepsItsAddressAcrossAReleaseAndAGraphOverItReplays) {
  constexpr size_t kBytes = size_t{1} << 30;
  ReleasableDeviceBuffer buffer;
  ASSERT_CUDA_OK(buffer.Allocate(kBytes));
  ASSERT_TRUE(buffer.releasable()) << "no CUDA virtual memory management on this GPU";
  void* const address = buffer.get();
  cudaStream_t stream = nullptr;
  ASSERT_CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  ASSERT_CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  ASSERT_CUDA_OK(cudaMemsetAsync(buffer.get(), 0x3c, kBytes, stream));
  ASSERT_CUDA_OK(cudaStreamEndCapture(stream, &graph));
  ASSERT_CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));

  const int64_t before = FreeDeviceMemory();
  ASSERT_TRUE(buffer.Release().ok());
  EXPECT_TRUE(buffer.released());
  EXPECT_EQ(buffer.physical_bytes(), 0u);
  const int64_t released = FreeDeviceMemory();
  EXPECT_GE(released - before, static_cast<int64_t>(kBytes) - (int64_t{16} << 20))
      << "the memory went back";
  ASSERT_TRUE(buffer.Release().ok()) << "idempotent";
  ASSERT_TRUE(buffer.Reacquire().ok());
  EXPECT_EQ(buffer.get(), address);
  EXPECT_LE(FreeDeviceMemory(), before + (int64_t{64} << 20));

  ASSERT_CUDA_OK(cudaGraphLaunch(exec, stream));
  ASSERT_CUDA_OK(cudaStreamSynchronize(stream));
  std::vector<unsigned char> probe(4096);
  for (size_t at : {size_t{0}, kBytes / 2, kBytes - probe.size()}) {
    ASSERT_CUDA_OK(cudaMemcpy(probe.data(), buffer.get<unsigned char>() + at, probe.size(),
                              cudaMemcpyDeviceToHost));
    for (unsigned char b : probe) ASSERT_EQ(b, 0x3c) << "at " << at;
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

// Two layers of Qwen3-8B's shapes (the production GEMMs and attention, ~3.3 GB of weights) with
// a 4 GiB KV pool, served by an engine as the server does.
struct Served {
  CudaModelRunner* runner = nullptr;  // owned by the engine
  std::unique_ptr<Engine> engine;
};

Served Serve() {
  ModelConfig config = *PresetConfig("qwen3-8b");
  config.num_layers = 2;
  CudaRunnerOptions o;
  o.kv_cache_bytes = int64_t{4} << 30;
  o.max_batch_tokens = 2048;
  auto runner = CudaModelRunner::CreateSynthetic(config, 3, o);
  EXPECT_TRUE(runner.ok()) << runner.status();
  Served served;
  if (!runner.ok()) return served;
  served.runner = runner->get();
  EngineOptions options;
  options.max_running_samples = 64;
  options.max_batch_tokens = 2048;
  auto engine = Engine::Create(*std::move(runner), options);
  EXPECT_TRUE(engine.ok()) << engine.status();
  if (engine.ok()) served.engine = *std::move(engine);
  return served;
}

// Eight samples of one 77-token prompt (four greedy, four sampled), 48 tokens each: the prompt
// prefills, then the decode steps replay the graphs.
std::vector<SampleSpec> Probe() {
  std::vector<SampleSpec> specs(8);
  std::mt19937 rng(7);
  std::vector<int32_t> prompt(77);
  for (int32_t& t : prompt) t = static_cast<int32_t>(rng() % 151936);
  for (int i = 0; i < 8; ++i) {
    specs[i].sample_index = i;
    specs[i].prompt = prompt;
    specs[i].params.temperature = i < 4 ? 0.0f : 0.8f;
    specs[i].params.max_new_tokens = 48;
    specs[i].params.ignore_eos = true;
    specs[i].sample_seed = 100 + i;
  }
  return specs;
}

std::future<std::string> Start(Engine* engine) {
  return std::async(std::launch::async, [engine] {
    Collector collector(8);
    EXPECT_TRUE(engine->Submit(Probe(), collector.Sink()).ok());
    std::string bits;
    for (const SampleCompletion& c : collector.Wait()) bits += Bits(c) + "\n";
    return bits;
  });
}

MemoryResult Release(Engine* engine, bool weights) {
  std::promise<MemoryResult> promise;
  engine->ReleaseMemory(MemoryReleaseOptions{false, weights},
                        [&promise](MemoryResult r) { promise.set_value(std::move(r)); });
  return promise.get_future().get();
}

MemoryResult Resume(Engine* engine) {
  std::promise<MemoryResult> promise;
  engine->ResumeMemory([&promise](MemoryResult r) { promise.set_value(std::move(r)); });
  return promise.get_future().get();
}

TEST_F(MemoryReleaseTest, ReleasedMemoryReturnsToTheDeviceAndTheProbeKeepsItsBitsThroughGraphs) {
  Served s = Serve();
  ASSERT_NE(s.engine, nullptr);
  const std::string expected = Start(s.engine.get()).get();
  const int64_t captured = s.runner->graphs_captured();
  ASSERT_GT(s.runner->graph_launches(), 0) << "the probe's decode steps replay graphs";
  const int64_t kv = s.runner->kv_cache_bytes(), weights = s.runner->weight_bytes();

  for (bool with_weights : {false, true}) {
    SCOPED_TRACE(with_weights ? "KV cache and weights" : "KV cache");
    const int64_t before = FreeDeviceMemory();
    const auto t0 = std::chrono::steady_clock::now();
    const MemoryResult released = Release(s.engine.get(), with_weights);
    const double release_s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    ASSERT_TRUE(released.status.ok()) << released.status;
    const int64_t after = FreeDeviceMemory();
    const int64_t expect = kv + (with_weights ? weights : 0);
    std::printf("released %s: free %.2f -> %.2f GiB (+%.3f GiB; KV pool %.3f GiB, weights "
                "%.3f GiB; reported %.3f + %.3f GiB) in %.3f s\n",
                with_weights ? "KV + weights" : "KV", GiB(before), GiB(after),
                GiB(after - before), GiB(kv), GiB(weights), GiB(released.changed.kv_cache_bytes),
                GiB(released.changed.weight_bytes), release_s);
    EXPECT_GE(after - before, expect - (int64_t{64} << 20)) << "free memory rose by the pool";
    EXPECT_GE(released.changed.kv_cache_bytes, kv);
    EXPECT_EQ(released.changed.weights, with_weights);
    EXPECT_EQ(s.runner->kv_cache_released(), true);

    auto held = Start(s.engine.get());
    EXPECT_EQ(held.wait_for(std::chrono::milliseconds(300)), std::future_status::timeout);
    const int64_t launches = s.runner->graph_launches();

    const auto t1 = std::chrono::steady_clock::now();
    const MemoryResult resumed = Resume(s.engine.get());
    const double resume_s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
    ASSERT_TRUE(resumed.status.ok()) << resumed.status;
    std::printf("resumed in %.3f s, free %.2f GiB\n", resume_s, GiB(FreeDeviceMemory()));
    EXPECT_LE(FreeDeviceMemory(), before + (int64_t{64} << 20));
    EXPECT_EQ(held.get(), expected) << "the same bits after ResumeMemory";
    EXPECT_GT(s.runner->graph_launches(), launches) << "decode replayed graphs";
    EXPECT_EQ(s.runner->graphs_captured(), captured) << "the graphs survived: none captured again";
  }
}

TEST_F(MemoryReleaseTest, AResumeTheDeviceCannotHoldIsRefusedAndARetryRestoresTheBits) {
  Served s = Serve();
  ASSERT_NE(s.engine, nullptr);
  const std::string expected = Start(s.engine.get()).get();
  ASSERT_TRUE(Release(s.engine.get(), /*weights=*/true).status.ok());
  // A trainer takes what was freed, and then some.
  void* trainer = nullptr;
  ASSERT_CUDA_OK(cudaMalloc(&trainer, FreeDeviceMemory() - (int64_t{256} << 20)));
  const MemoryResult refused = Resume(s.engine.get());
  EXPECT_EQ(refused.status.code(), absl::StatusCode::kResourceExhausted) << refused.status;
  EXPECT_NE(refused.status.message().find("call ResumeMemory again"), std::string::npos)
      << refused.status;
  std::printf("refused: %s\n", refused.status.ToString().c_str());
  EXPECT_TRUE(s.engine->memory_released().has_value());
  EXPECT_TRUE(s.runner->kv_cache_released());
  ASSERT_CUDA_OK(cudaFree(trainer));
  const MemoryResult resumed = Resume(s.engine.get());
  ASSERT_TRUE(resumed.status.ok()) << resumed.status;
  EXPECT_TRUE(resumed.changed.weights);
  EXPECT_EQ(Start(s.engine.get()).get(), expected);
}

}  // namespace
}  // namespace rollout
