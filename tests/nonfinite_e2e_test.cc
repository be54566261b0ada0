// Diverged weights through the real gRPC stack (review26 finding 4): a trainer pushes a final
// norm of NaN (or +inf) in F32, so every logits row is non-finite. Generate's samples end
// FINISH_REASON_ABORT with a cause naming the position and the version, Score fails
// FAILED_PRECONDITION saying the same, ServerInfo and /metrics count the rows, and finite
// weights serve as before. They returned tokens [0, 0, ...] with logprobs -log(vocab), finish
// reason LENGTH, and nothing in a log or a metric.
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "model/safetensors.h"
#include "tests/reliability_util.h"
#include "tests/test_server.h"

namespace rollout::testing {
namespace {

namespace rel = ::rollout::testing::reliability;

constexpr char kNorm[] = "model.norm.weight";
const std::vector<uint32_t> kPrompt = {1, 2, 3};

// `like`'s name and shape in F32, every value `value`.
HostTensor FilledF32(const HostTensor& like, float value) {
  int64_t n = 1;
  for (int64_t d : like.shape) n *= d;
  HostTensor t{like.name, DType::kF32, like.shape, std::vector<uint8_t>(n * 4)};
  for (int64_t i = 0; i < n; ++i) std::memcpy(&t.bytes[i * 4], &value, 4);
  return t;
}

class NonFiniteE2eTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ServerOptions options;
    options.metrics_port = rel::PickFreePort();
    ASSERT_GT(options.metrics_port, 0);
    metrics_port_ = options.metrics_port;
    server_ = StartTestServer(options);
    ASSERT_NE(server_, nullptr);
    original_ = rel::ReadCheckpointTensor(server_->server->model_dir(), kNorm);
  }
  v1::RolloutService::Stub* stub() { return server_->stub.get(); }

  void Push(const std::string& version, const HostTensor& tensor) {
    v1::UpdateWeightsResponse response;
    std::vector<v1::WeightsChunk> chunks;
    v1::WeightsChunk& header = chunks.emplace_back();
    *header.mutable_header() =
        rel::MakeWeightsHeader(version, v1::IN_FLIGHT_POLICY_DRAIN, {tensor});
    for (v1::WeightsChunk& c : rel::MakeDataChunks({tensor}, 1 << 20)) chunks.push_back(c);
    const grpc::Status s = rel::PushChunks(stub(), chunks, &response);
    ASSERT_TRUE(s.ok()) << version << ": " << s.error_message();
  }

  // Two samples of kPrompt with top logprobs, as a trainer asks.
  GenerateOutcome Generate() {
    v1::GenerateRequest request;
    v1::RolloutRequest* rollout = request.add_rollouts();
    *rollout = MakeRollout(kPrompt, 1, 4, 0.7f);
    rollout->set_num_samples(2);
    rollout->mutable_sampling()->set_top_logprobs(2);
    return RunGenerate(stub(), request);
  }

  grpc::Status Score(v1::ScoreResponse* response) {
    v1::ScoreRequest request;
    v1::ScoreSequence* seq = request.add_sequences();
    for (uint32_t t : {1, 2, 3, 4}) seq->add_token_ids(t);
    seq->set_start(1);  // 3 scored tokens: 3 rows
    grpc::ClientContext context;
    return stub()->Score(&context, request, response);
  }

  uint64_t Scraped(const std::string& series) const {
    return rel::MetricValue(rel::HttpGet(metrics_port_, "/metrics"), series);
  }

  std::unique_ptr<TestServer> server_;
  HostTensor original_;
  int metrics_port_ = 0;
};

TEST_F(NonFiniteE2eTest, DivergedWeightsAbortGenerateAndFailScoreNamingTheVersionAndAreCounted) {
  const GenerateOutcome healthy = Generate();
  ASSERT_TRUE(healthy.status.ok()) << healthy.status.error_message();
  EXPECT_EQ(healthy.completions[0][0].finish_reason(), v1::FINISH_REASON_LENGTH);
  EXPECT_EQ(healthy.completions[0][0].abort_cause(), "");
  EXPECT_EQ(rel::FetchServerInfo(stub()).counters().nonfinite_logit_rows(), 0u);
  EXPECT_EQ(Scraped("rollout_nonfinite_logits_total"), 0u);

  uint64_t rows = 0;
  for (const float bad :
       {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    const std::string version = std::isnan(bad) ? "diverged-nan" : "diverged-inf";
    SCOPED_TRACE(version);
    ASSERT_NO_FATAL_FAILURE(Push(version, FilledF32(original_, bad)));

    // The stream itself ends OK: each sample says how it ended.
    const GenerateOutcome out = Generate();
    ASSERT_TRUE(out.status.ok()) << out.status.error_message();
    ASSERT_EQ(out.completions.size(), 1u);
    ASSERT_EQ(out.completions[0].size(), 2u);
    for (const v1::Completion& c : out.completions[0]) {
      EXPECT_EQ(c.finish_reason(), v1::FINISH_REASON_ABORT);
      EXPECT_EQ(c.token_ids_size(), 0) << "the first row's token is not emitted";
      EXPECT_EQ(c.logprobs_size(), 0);
      EXPECT_EQ(c.weight_version(), version);
      EXPECT_EQ(c.abort_cause(),
                "the model's logits for position 3 (generated token 0) are not finite (NaN or "
                "Inf) under weight version '" +
                    version + "': the weights may have diverged");
    }
    rows += 2;

    v1::ScoreResponse response;
    const grpc::Status scored = Score(&response);
    EXPECT_EQ(scored.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << scored.error_message();
    EXPECT_EQ(scored.error_message(),
              "sequences[0]: the model's logits for token_ids[1] are not finite (NaN or Inf) "
              "under weight version '" +
                  version + "': the weights may have diverged; nothing was scored");
    rows += 3;  // every row of the one chunk

    EXPECT_EQ(rel::FetchServerInfo(stub()).counters().nonfinite_logit_rows(), rows);
    EXPECT_EQ(Scraped("rollout_nonfinite_logits_total"), rows);
  }
  EXPECT_EQ(Scraped("rollout_samples_total{finish_reason=\"abort\"}"), 4u);

  // Finite weights again: the healthy bits, and nothing more counted.
  ASSERT_NO_FATAL_FAILURE(Push("restored", original_));
  const GenerateOutcome restored = Generate();
  ASSERT_TRUE(restored.status.ok()) << restored.status.error_message();
  for (int s = 0; s < 2; ++s) {
    EXPECT_EQ(Fingerprint(restored.completions[0][s]), Fingerprint(healthy.completions[0][s]));
  }
  v1::ScoreResponse response;
  const grpc::Status scored = Score(&response);
  ASSERT_TRUE(scored.ok()) << scored.error_message();
  EXPECT_EQ(response.results(0).logprobs_size(), 3);
  EXPECT_EQ(Scraped("rollout_nonfinite_logits_total"), rows);
}

}  // namespace
}  // namespace rollout::testing
