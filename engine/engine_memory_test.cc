// Colocated memory (Engine::ReleaseMemory / ResumeMemory), driven offline on the CPU runner:
// what is held and what is requeued, the bits after the memory is back, idempotence, the
// refusals, and a resume the host cannot satisfy.
#include <atomic>
#include <chrono>
#include <future>
#include <memory>
#include <thread>

#include "engine/engine.h"
#include "engine/engine_test_util.h"
#include "gtest/gtest.h"
#include "model/random_model.h"
#include "runner/cpu/cpu_model_runner.h"

namespace rollout {
namespace {

constexpr char kTensor[] = "model.layers.0.mlp.down_proj.weight";

const std::string& ModelDir() {  // small: slow enough that a long sample is still in flight
  static const std::string dir = [] {
    std::string d = ::testing::TempDir() + "engine-memory-test-small";
    RandomModelOptions options;
    options.preset = "small";
    options.seed = 5;
    EXPECT_TRUE(WriteRandomModel(options, d).ok());
    return d;
  }();
  return dir;
}

// A CpuModelRunner whose ReleaseMemory(weights = true) also reports the weights released (the
// CPU backend keeps them, as a GPU backend does not), so that the engine's rules for released
// weights can be tested; and optionally a runner that cannot release at all (the default).
class WeightsReleasingRunner final : public WrappingRunner {
 public:
  WeightsReleasingRunner(std::unique_ptr<CpuModelRunner> inner, bool can_release)
      : WrappingRunner(std::move(inner)), can_release_(can_release) {}
  const char* backend_name() const override { return "test"; }
  absl::Status UpdateWeights(const std::vector<HostTensorView>& tensors) override {
    ++updates_seen_;
    if (weights_released_) return absl::InternalError("an update reached released weights");
    return inner().UpdateWeights(tensors);
  }
  absl::StatusOr<ReleasedMemory> ReleaseMemory(bool weights) override {
    if (!can_release_) return ModelRunner::ReleaseMemory(weights);
    absl::StatusOr<ReleasedMemory> r = inner().ReleaseMemory(weights);
    if (r.ok() && weights && !weights_released_) {
      weights_released_ = true;
      r->weights = true;
      r->weight_bytes = 1000;
    }
    return r;
  }
  absl::StatusOr<ReleasedMemory> ResumeMemory() override {
    absl::StatusOr<ReleasedMemory> r = inner().ResumeMemory();
    if (r.ok() && weights_released_) {
      weights_released_ = false;
      r->weights = true;
      r->weight_bytes = 1000;
    }
    return r;
  }
  int updates_seen() const { return updates_seen_; }

 private:
  const bool can_release_;
  bool weights_released_ = false;
  int updates_seen_ = 0;
};

struct TestEngine {
  std::unique_ptr<Engine> engine;
  CpuModelRunner* cpu = nullptr;               // owned by the engine
  WeightsReleasingRunner* wrapper = nullptr;   // owned by the engine, when wrapped
  std::shared_ptr<std::atomic<int64_t>> host_memory;  // what ResumeMemory is told is available
};

enum class Wrap { kNone, kWeights, kCannotRelease };

TestEngine MakeEngine(Wrap wrap = Wrap::kNone) {
  TestEngine t;
  t.host_memory = std::make_shared<std::atomic<int64_t>>(int64_t{1} << 40);
  auto ck = Checkpoint::Open(ModelDir());
  EXPECT_TRUE(ck.ok());
  CpuRunnerOptions ro;
  ro.kv_cache_bytes = 16 << 20;
  ro.available_host_memory = [memory = t.host_memory] { return memory->load(); };
  auto runner = CpuModelRunner::Create(**ck, ro);
  EXPECT_TRUE(runner.ok()) << runner.status();
  t.cpu = runner->get();
  std::unique_ptr<ModelRunner> served = *std::move(runner);
  if (wrap != Wrap::kNone) {
    auto w = std::make_unique<WeightsReleasingRunner>(
        std::unique_ptr<CpuModelRunner>(static_cast<CpuModelRunner*>(served.release())),
        wrap == Wrap::kWeights);
    t.wrapper = w.get();
    served = std::move(w);
  }
  EngineOptions options;
  options.weight_version = "v0";
  auto engine = Engine::Create(std::move(served), options);
  EXPECT_TRUE(engine.ok());
  t.engine = *std::move(engine);
  return t;
}

SampleSpec Spec(int32_t max_new_tokens = 12, uint64_t seed = 11) {
  SampleSpec s;
  s.prompt = {5, 17, 99, 3, 200, 41, 7, 12, 150, 8, 33, 91, 60, 2, 18, 77, 240, 9};
  s.params.temperature = 0.8f;
  s.params.max_new_tokens = max_new_tokens;
  s.params.ignore_eos = true;
  s.sample_seed = seed;
  return s;
}

std::future<std::vector<SampleCompletion>> Start(Engine* engine, SampleSpec spec) {
  return std::async(std::launch::async, [engine, spec] {
    Collector collector(1);
    EXPECT_TRUE(engine->Submit({spec}, collector.Sink()).ok());
    return collector.Wait();
  });
}

std::vector<SampleCompletion> RunOne(Engine* engine, SampleSpec spec) {
  return Start(engine, std::move(spec)).get();
}

MemoryResult Release(Engine* engine, bool abort_in_flight = false, bool weights = false) {
  std::promise<MemoryResult> promise;
  engine->ReleaseMemory(MemoryReleaseOptions{abort_in_flight, weights},
                        [&promise](MemoryResult r) { promise.set_value(std::move(r)); });
  return promise.get_future().get();
}

MemoryResult Resume(Engine* engine) {
  std::promise<MemoryResult> promise;
  engine->ResumeMemory([&promise](MemoryResult r) { promise.set_value(std::move(r)); });
  return promise.get_future().get();
}

UpdateResult Update(Engine* engine, std::string version, UpdatePolicy policy) {
  auto ck = Checkpoint::Open(ModelDir());
  const TensorView* view = (*ck)->Find(kTensor);
  HostTensor t{kTensor, view->dtype, view->shape,
               std::vector<uint8_t>(view->data, view->data + view->nbytes)};
  for (size_t i = 0; i < t.bytes.size(); i += 2) t.bytes[i] ^= 1;  // other bytes
  std::promise<UpdateResult> promise;
  engine->UpdateWeights(OwnedWeightUpdate(std::move(version), policy, {std::move(t)}),
                        [&promise](UpdateResult r) { promise.set_value(std::move(r)); });
  return promise.get_future().get();
}

// Waits until `engine` has generated `tokens` more tokens than it had.
void WaitForTokens(Engine* engine, uint64_t tokens) {
  const uint64_t from = engine->counters().generated_tokens;
  while (engine->counters().generated_tokens < from + tokens) std::this_thread::yield();
}

bool StillWaiting(std::future<std::vector<SampleCompletion>>& f) {
  return f.wait_for(std::chrono::milliseconds(300)) == std::future_status::timeout;
}

TEST(EngineMemoryTest, ReleaseFreesTheKvPagesHoldsNewWorkAndResumeGivesTheSameBits) {
  TestEngine t = MakeEngine();
  const std::string expected = Bits(RunOne(t.engine.get(), Spec())[0]);
  ASSERT_EQ(*t.cpu->ResidentKvCacheBytes(), t.cpu->kv_cache_bytes());
  EXPECT_FALSE(t.engine->memory_released().has_value());

  const MemoryResult released = Release(t.engine.get());
  ASSERT_TRUE(released.status.ok()) << released.status;
  EXPECT_FALSE(released.was_released);
  EXPECT_EQ(released.changed.kv_cache_bytes, t.cpu->kv_cache_bytes());
  EXPECT_FALSE(released.changed.weights);
  EXPECT_EQ(*t.cpu->ResidentKvCacheBytes(), 0) << "the KV pages went back to the OS";
  ASSERT_TRUE(t.engine->memory_released().has_value());
  EXPECT_EQ(t.engine->memory_released()->kv_cache_bytes, t.cpu->kv_cache_bytes());
  EXPECT_EQ(t.engine->counters().kv_blocks_cached, 0) << "the prefix cache was flushed";

  auto held = Start(t.engine.get(), Spec());
  EXPECT_TRUE(StillWaiting(held)) << "a request ran while the memory was released";
  EXPECT_EQ(t.engine->counters().waiting, 1);

  const MemoryResult resumed = Resume(t.engine.get());
  ASSERT_TRUE(resumed.status.ok()) << resumed.status;
  EXPECT_TRUE(resumed.was_released);
  EXPECT_EQ(resumed.changed.kv_cache_bytes, t.cpu->kv_cache_bytes());
  EXPECT_FALSE(t.engine->memory_released().has_value());
  EXPECT_EQ(*t.cpu->ResidentKvCacheBytes(), t.cpu->kv_cache_bytes());
  EXPECT_EQ(Bits(held.get()[0]), expected);
  EXPECT_EQ(Bits(RunOne(t.engine.get(), Spec())[0]), expected);
}

TEST(EngineMemoryTest, SamplesInFlightAreRequeuedAndFinishWithTheBitsOfAnUndisturbedRun) {
  TestEngine t = MakeEngine();
  const std::string expected = Bits(RunOne(t.engine.get(), Spec(160, 3))[0]);
  auto running = Start(t.engine.get(), Spec(160, 3));
  WaitForTokens(t.engine.get(), 5);
  const MemoryResult released = Release(t.engine.get());
  ASSERT_TRUE(released.status.ok()) << released.status;
  EXPECT_EQ(released.requeued_samples, 1);
  EXPECT_EQ(released.aborted_samples, 0);
  const uint64_t generated = t.engine->counters().generated_tokens;
  EXPECT_TRUE(StillWaiting(running));
  EXPECT_EQ(t.engine->counters().generated_tokens, generated) << "a step ran while released";
  ASSERT_TRUE(Resume(t.engine.get()).status.ok());
  const SampleCompletion c = running.get()[0];
  EXPECT_EQ(c.finish_reason, FinishReason::kLength);
  EXPECT_EQ(Bits(c), expected);
}

TEST(EngineMemoryTest, AbortInFlightEndsWhatRunsWithItsTokensSoFar) {
  TestEngine t = MakeEngine();
  auto running = Start(t.engine.get(), Spec(2000, 4));
  WaitForTokens(t.engine.get(), 3);
  const MemoryResult released = Release(t.engine.get(), /*abort_in_flight=*/true);
  ASSERT_TRUE(released.status.ok()) << released.status;
  EXPECT_EQ(released.aborted_samples, 1);
  EXPECT_EQ(released.requeued_samples, 0);
  const SampleCompletion c = running.get()[0];
  EXPECT_EQ(c.finish_reason, FinishReason::kAbort);
  EXPECT_GE(c.token_ids.size(), 3u);
  ASSERT_TRUE(Resume(t.engine.get()).status.ok());
}

TEST(EngineMemoryTest, ReleaseAndResumeAreIdempotent) {
  TestEngine t = MakeEngine();
  ASSERT_TRUE(Release(t.engine.get()).status.ok());
  const MemoryResult again = Release(t.engine.get());
  ASSERT_TRUE(again.status.ok()) << again.status;
  EXPECT_TRUE(again.was_released);
  EXPECT_EQ(again.changed.kv_cache_bytes, 0) << "nothing more to release";
  EXPECT_EQ(t.engine->memory_released()->kv_cache_bytes, t.cpu->kv_cache_bytes());
  ASSERT_TRUE(Resume(t.engine.get()).status.ok());
  const MemoryResult resumed_again = Resume(t.engine.get());
  ASSERT_TRUE(resumed_again.status.ok()) << resumed_again.status;
  EXPECT_FALSE(resumed_again.was_released);
  EXPECT_EQ(resumed_again.changed.kv_cache_bytes, 0);
  EXPECT_EQ(RunOne(t.engine.get(), Spec())[0].token_ids.size(), 12u);
}

TEST(EngineMemoryTest, AResumeWithoutTheMemoryIsRefusedAndStaysReleasedForARetry) {
  TestEngine t = MakeEngine();
  const std::string expected = Bits(RunOne(t.engine.get(), Spec())[0]);
  ASSERT_TRUE(Release(t.engine.get()).status.ok());
  auto held = Start(t.engine.get(), Spec());
  t.host_memory->store(t.cpu->kv_cache_bytes() / 2);  // the trainer still holds the rest
  const MemoryResult refused = Resume(t.engine.get());
  EXPECT_EQ(refused.status.code(), absl::StatusCode::kResourceExhausted) << refused.status;
  EXPECT_NE(refused.status.message().find("call ResumeMemory again"), std::string::npos)
      << refused.status;
  EXPECT_TRUE(t.engine->memory_released().has_value());
  EXPECT_EQ(*t.cpu->ResidentKvCacheBytes(), 0);
  EXPECT_TRUE(StillWaiting(held));
  t.host_memory->store(int64_t{1} << 40);
  const MemoryResult retried = Resume(t.engine.get());
  ASSERT_TRUE(retried.status.ok()) << retried.status;
  EXPECT_EQ(retried.changed.kv_cache_bytes, t.cpu->kv_cache_bytes());
  EXPECT_EQ(Bits(held.get()[0]), expected);
}

TEST(EngineMemoryTest, PauseAndReleaseAreLiftedSeparately) {
  TestEngine t = MakeEngine();
  ASSERT_TRUE(t.engine->Pause(false).ok());
  ASSERT_TRUE(Release(t.engine.get()).status.ok());
  auto held = Start(t.engine.get(), Spec());
  ASSERT_TRUE(Resume(t.engine.get()).status.ok());
  EXPECT_TRUE(StillWaiting(held)) << "still paused";
  t.engine->Resume();
  EXPECT_EQ(held.get()[0].token_ids.size(), 12u);
}

TEST(EngineMemoryTest, UpdatesWhileOnlyTheKvIsReleasedFollowTheirPolicy) {
  TestEngine t = MakeEngine();
  ASSERT_TRUE(Release(t.engine.get()).status.ok());
  // Nothing in flight: DRAIN applies at once, the memory still released.
  UpdateResult drained = Update(t.engine.get(), "v1", UpdatePolicy::kDrain);
  ASSERT_TRUE(drained.status.ok()) << drained.status;
  EXPECT_EQ(t.engine->weight_version(), "v1");
  EXPECT_TRUE(t.engine->memory_released().has_value());
  // Held work that cannot run: DRAIN is refused with what to do, CONTINUE applies.
  auto held = Start(t.engine.get(), Spec());
  while (t.engine->counters().waiting == 0) std::this_thread::yield();
  UpdateResult refused = Update(t.engine.get(), "v2", UpdatePolicy::kDrain);
  EXPECT_EQ(refused.status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(refused.status.message().find("ResumeMemory first"), std::string::npos)
      << refused.status;
  EXPECT_EQ(t.engine->weight_version(), "v1");
  ASSERT_TRUE(Update(t.engine.get(), "v3", UpdatePolicy::kContinue).status.ok());
  ASSERT_TRUE(Resume(t.engine.get()).status.ok());
  EXPECT_EQ(held.get()[0].weight_version, "v3");
}

TEST(EngineMemoryTest, UpdatesAreRefusedWhileTheWeightsAreReleasedAndChangeNothing) {
  TestEngine t = MakeEngine(Wrap::kWeights);
  const std::string expected = Bits(RunOne(t.engine.get(), Spec())[0]);
  const MemoryResult kv_only = Release(t.engine.get());
  ASSERT_TRUE(kv_only.status.ok());
  EXPECT_FALSE(kv_only.changed.weights);
  // Asking again with the weights releases them, and only them.
  const MemoryResult weights = Release(t.engine.get(), false, /*weights=*/true);
  ASSERT_TRUE(weights.status.ok()) << weights.status;
  EXPECT_TRUE(weights.was_released);
  EXPECT_TRUE(weights.changed.weights);
  EXPECT_EQ(weights.changed.kv_cache_bytes, 0);
  EXPECT_TRUE(t.engine->memory_released()->weights);
  for (UpdatePolicy policy : {UpdatePolicy::kAbort, UpdatePolicy::kDrain, UpdatePolicy::kContinue}) {
    UpdateResult r = Update(t.engine.get(), "v1", policy);
    EXPECT_EQ(r.status.code(), absl::StatusCode::kFailedPrecondition) << r.status;
    EXPECT_NE(r.status.message().find("call ResumeMemory before updating"), std::string::npos)
        << r.status;
    EXPECT_EQ(r.previous_version, "v0");
  }
  EXPECT_EQ(t.wrapper->updates_seen(), 0) << "an update reached the runner";
  EXPECT_EQ(t.engine->weight_version(), "v0");
  const MemoryResult resumed = Resume(t.engine.get());
  ASSERT_TRUE(resumed.status.ok());
  EXPECT_TRUE(resumed.changed.weights);
  EXPECT_EQ(Bits(RunOne(t.engine.get(), Spec())[0]), expected);
  EXPECT_TRUE(Update(t.engine.get(), "v1", UpdatePolicy::kDrain).status.ok());
}

TEST(EngineMemoryTest, ReleaseWhileADrainUpdateWaitsIsRefusedUnlessItAbortsTheSamples) {
  TestEngine t = MakeEngine();
  auto running = Start(t.engine.get(), Spec(2000, 4));
  WaitForTokens(t.engine.get(), 2);
  std::promise<UpdateResult> update_done;
  {
    auto ck = Checkpoint::Open(ModelDir());
    const TensorView* view = (*ck)->Find(kTensor);
    t.engine->UpdateWeights(
        OwnedWeightUpdate("v1", UpdatePolicy::kDrain,
                          {HostTensor{kTensor, view->dtype, view->shape,
                                      std::vector<uint8_t>(view->data, view->data + view->nbytes)}}),
                            [&update_done](UpdateResult r) { update_done.set_value(std::move(r)); });
  }
  const MemoryResult refused = Release(t.engine.get());
  EXPECT_EQ(refused.status.code(), absl::StatusCode::kFailedPrecondition) << refused.status;
  EXPECT_NE(refused.status.message().find("abort_in_flight"), std::string::npos) << refused.status;
  EXPECT_FALSE(t.engine->memory_released().has_value());
  const MemoryResult released = Release(t.engine.get(), /*abort_in_flight=*/true);
  ASSERT_TRUE(released.status.ok()) << released.status;
  EXPECT_EQ(running.get()[0].finish_reason, FinishReason::kAbort);
  EXPECT_TRUE(update_done.get_future().get().status.ok()) << "the update applied first";
  EXPECT_EQ(t.engine->weight_version(), "v1");
  EXPECT_TRUE(t.engine->memory_released().has_value());
  ASSERT_TRUE(Resume(t.engine.get()).status.ok());
}

TEST(EngineMemoryTest, ARunnerThatCannotReleaseSaysSoAndKeepsServing) {
  TestEngine t = MakeEngine(Wrap::kCannotRelease);
  const std::string expected = Bits(RunOne(t.engine.get(), Spec(60, 5))[0]);
  auto running = Start(t.engine.get(), Spec(60, 5));
  WaitForTokens(t.engine.get(), 2);
  const MemoryResult r = Release(t.engine.get());
  EXPECT_EQ(r.status.code(), absl::StatusCode::kUnimplemented) << r.status;
  EXPECT_NE(r.status.message().find("the test backend cannot release"), std::string::npos)
      << r.status;
  EXPECT_FALSE(t.engine->memory_released().has_value());
  EXPECT_EQ(Bits(running.get()[0]), expected) << "the requeued sample ran on, same bits";
  const MemoryResult resumed = Resume(t.engine.get());
  EXPECT_TRUE(resumed.status.ok());
  EXPECT_FALSE(resumed.was_released);
}

}  // namespace
}  // namespace rollout
