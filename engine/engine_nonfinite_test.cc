// Non-finite logits (weights that diverged) end the sample that met them: FinishReason::kAbort,
// the tokens before kept bitwise, nothing of the bad row emitted, a cause naming the position and
// the weight version, and the row counted (EngineCounters::nonfinite_logit_rows). CPU runner,
// its logits poisoned from a chosen forward on.
#include <cmath>
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

// Forwards to the CPU runner; from forward `poison_from` on, one logit of every row is NaN.
class PoisoningRunner final : public WrappingRunner {
 public:
  PoisoningRunner(std::unique_ptr<ModelRunner> inner, int poison_from)
      : WrappingRunner(std::move(inner)), poison_from_(poison_from) {}
  absl::Status Forward(const ForwardBatch& batch, std::vector<float>* logits) override {
    absl::Status s = WrappingRunner::Forward(batch, logits);
    if (!s.ok() || forwards_++ < poison_from_) return s;
    const size_t vocab = static_cast<size_t>(config().vocab_size);
    for (size_t row = 0; row < logits->size() / vocab; ++row) (*logits)[row * vocab + 3] = NAN;
    return s;
  }

 private:
  const int poison_from_;
  int forwards_ = 0;
};

class EngineNonFiniteTest : public ::testing::TestWithParam<bool> {
 protected:
  // An engine on the tiny model whose logits turn NaN at forward `poison_from` (never if < 0),
  // with decode lookahead as the test's parameter.
  std::unique_ptr<Engine> MakeEngine(int poison_from) {
    const std::string dir = ::testing::TempDir() + "engine-nonfinite-test-tiny";
    RandomModelOptions model;
    model.preset = "tiny";
    EXPECT_TRUE(WriteRandomModel(model, dir).ok());
    auto ck = Checkpoint::Open(dir);
    EXPECT_TRUE(ck.ok()) << ck.status();
    CpuRunnerOptions ro;
    ro.kv_cache_bytes = 8 << 20;
    auto cpu = CpuModelRunner::Create(**ck, ro);
    EXPECT_TRUE(cpu.ok()) << cpu.status();
    EngineOptions options;
    options.weight_version = "diverged";
    options.decode_lookahead = GetParam();
    options.lookahead_on_synchronous_runners = GetParam();
    std::unique_ptr<ModelRunner> runner = *std::move(cpu);
    if (poison_from >= 0)
      runner = std::make_unique<PoisoningRunner>(std::move(runner), poison_from);
    auto engine = Engine::Create(std::move(runner), options);
    EXPECT_TRUE(engine.ok()) << engine.status();
    return engine.ok() ? *std::move(engine) : nullptr;
  }

  static SampleCompletion Run(Engine* engine, const SampleSpec& spec) {
    Collector collector(1);
    EXPECT_TRUE(engine->Submit({spec}, collector.Sink()).ok());
    return collector.Wait()[0];
  }
};

SampleSpec GenerateSpec() {
  SampleSpec spec;
  spec.prompt = {5, 17, 99, 3, 200, 41, 7};
  spec.params.temperature = 0.8f;
  spec.params.max_new_tokens = 16;
  spec.params.ignore_eos = true;
  spec.sample_seed = 11;
  return spec;
}

TEST_P(EngineNonFiniteTest, AGeneratedSampleEndsAtTheFirstNonFiniteRowKeepingTheTokensBefore) {
  // Forward 0 is the prefill (generated token 0); forward 4 gives generated token 4, at
  // position 7 + 4 = 11.
  std::unique_ptr<Engine> healthy = MakeEngine(-1);
  std::unique_ptr<Engine> poisoned = MakeEngine(4);
  ASSERT_NE(healthy, nullptr);
  ASSERT_NE(poisoned, nullptr);
  const SampleCompletion want = Run(healthy.get(), GenerateSpec());
  const SampleCompletion got = Run(poisoned.get(), GenerateSpec());
  ASSERT_EQ(want.finish_reason, FinishReason::kLength);
  EXPECT_EQ(got.finish_reason, FinishReason::kAbort);
  EXPECT_TRUE(got.nonfinite_logits);
  ASSERT_EQ(got.token_ids.size(), 4u) << "the row's token is not emitted";
  ASSERT_EQ(got.logprobs.size(), 4u);
  SampleCompletion first_four = want;
  first_four.token_ids.resize(4);
  first_four.logprobs.resize(4);
  first_four.finish_reason = FinishReason::kAbort;
  EXPECT_EQ(Bits(got), Bits(first_four));
  EXPECT_EQ(got.abort_cause,
            "the model's logits for position 11 (generated token 4) are not finite (NaN or Inf) "
            "under weight version 'diverged': the weights may have diverged");
  EXPECT_FALSE(want.nonfinite_logits);
  EXPECT_EQ(healthy->counters().nonfinite_logit_rows, 0u);
  // A row computed ahead for the ended sample (lookahead) is dropped, not counted.
  EXPECT_EQ(poisoned->counters().nonfinite_logit_rows, 1u);
  if (GetParam()) EXPECT_GT(poisoned->counters().lookahead_steps, 0u) << "never ran ahead";
}

TEST_P(EngineNonFiniteTest, AScoredSequenceEndsNamingItsFirstNonFiniteToken) {
  std::unique_ptr<Engine> poisoned = MakeEngine(0);
  ASSERT_NE(poisoned, nullptr);
  SampleSpec spec;
  spec.prompt = {5, 17, 99, 3, 200, 41, 7};
  spec.score_start = 2;  // scores tokens 2..6: 5 rows, one chunk
  const SampleCompletion got = Run(poisoned.get(), spec);
  EXPECT_EQ(got.finish_reason, FinishReason::kAbort);
  EXPECT_TRUE(got.nonfinite_logits);
  EXPECT_TRUE(got.logprobs.empty());
  EXPECT_EQ(got.abort_cause,
            "the model's logits for token_ids[2] are not finite (NaN or Inf) under weight version "
            "'diverged': the weights may have diverged");
  EXPECT_EQ(poisoned->counters().nonfinite_logit_rows, 5u) << "every row of the chunk was seen";
  EXPECT_EQ(poisoned->counters().scored_tokens, 0u);
}

INSTANTIATE_TEST_SUITE_P(Lookahead, EngineNonFiniteTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "Lookahead" : "OneStepAtATime";
                         });

}  // namespace
}  // namespace rollout
