// A runner that becomes unusable (ModelRunner::Usable: the CUDA runner after a hung exchange
// across GPUs aborted its group): the failed step's samples and every other end (aborted), the
// callback fires once, and every later Submit is UNAVAILABLE naming the cause. CPU runner.
#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "engine/engine_test_util.h"
#include "gtest/gtest.h"
#include "model/random_model.h"
#include "runner/cpu/cpu_model_runner.h"

namespace rollout {
namespace {

// Forwards to the CPU runner until `fail_after` forwards have run; from then on every step
// fails and Usable() says why.
class FaultingRunner final : public WrappingRunner {
 public:
  FaultingRunner(std::unique_ptr<ModelRunner> inner, int fail_after)
      : WrappingRunner(std::move(inner)), fail_after_(fail_after) {}
  const char* backend_name() const override { return "test"; }
  absl::Status Usable() const override {
    return broken_ ? absl::FailedPreconditionError("the test's group was aborted")
                   : absl::OkStatus();
  }
  absl::Status Forward(const ForwardBatch& batch, std::vector<float>* logits) override {
    if (forwards_++ >= fail_after_) broken_ = true;
    if (broken_) return absl::UnavailableError("a hung exchange (test)");
    return WrappingRunner::Forward(batch, logits);
  }

 private:
  const int fail_after_;
  int forwards_ = 0;
  bool broken_ = false;
};

TEST(EngineFaultTest, AnUnusableRunnerEndsEverySampleAndRefusesNewWorkNamingTheCause) {
  const std::string dir = ::testing::TempDir() + "engine-fault-test-tiny";
  RandomModelOptions model;
  model.preset = "tiny";
  ASSERT_TRUE(WriteRandomModel(model, dir).ok());
  auto ck = Checkpoint::Open(dir);
  ASSERT_TRUE(ck.ok());
  CpuRunnerOptions ro;
  ro.kv_cache_bytes = 8 << 20;
  auto cpu = CpuModelRunner::Create(**ck, ro);
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  std::atomic<int> callbacks{0};
  std::string told;
  EngineOptions options;
  options.max_running_samples = 2;  // the third sample waits in the queue when the fault comes
  options.on_runner_unusable = [&](const absl::Status& s) {
    ++callbacks;
    told = std::string(s.message());
  };
  auto engine = Engine::Create(std::make_unique<FaultingRunner>(*std::move(cpu), 5), options);
  ASSERT_TRUE(engine.ok()) << engine.status();
  std::vector<SampleSpec> specs(3);
  for (int i = 0; i < 3; ++i) {
    specs[i].sample_index = i;
    specs[i].prompt = {5, 17, 99, 3, 200, 41, 7};
    specs[i].params.max_new_tokens = 64;
    specs[i].params.ignore_eos = true;
    specs[i].sample_seed = 100 + i;
  }
  Collector collector(3);
  ASSERT_TRUE((*engine)->Submit(specs, collector.Sink()).ok());
  const std::vector<SampleCompletion> done = collector.Wait();
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(done[i].finish_reason, FinishReason::kAbort) << "sample " << i;
    EXPECT_LT(done[i].token_ids.size(), 64u) << "sample " << i;
  }
  EXPECT_EQ(callbacks.load(), 1);
  EXPECT_NE(told.find("the test's group was aborted"), std::string::npos) << told;
  Collector later(1);
  const absl::StatusOr<uint64_t> refused = (*engine)->Submit({specs[0]}, later.Sink());
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(refused.status().message().find("restart the server"), std::string::npos)
      << refused.status();
  EXPECT_NE(refused.status().message().find("the test's group was aborted"), std::string::npos);
}

}  // namespace
}  // namespace rollout
