// Limits that Score once skipped or that let arithmetic overflow: Score counts against
// --max_queued_samples as Generate does (it once ignored it), and temperatures between 0 and the
// stated minimum are INVALID_ARGUMENT for Generate and Score (1e-45 once ran: tokens 0 with wrong
// logprobs, and Score returned -inf).
#include <chrono>
#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/reliability_util.h"
#include "tests/test_server.h"

namespace rollout::testing {
namespace {

namespace rel = ::rollout::testing::reliability;

using std::chrono::seconds;

const std::vector<uint32_t> kPrompt = {17, 4, 901, 33, 2048, 7, 250, 3999, 12};

v1::ScoreRequest ScoreRequest(int sequences, std::optional<float> temperature = std::nullopt) {
  v1::ScoreRequest request;
  for (int i = 0; i < sequences; ++i) {
    v1::ScoreSequence* seq = request.add_sequences();
    for (uint32_t t : kPrompt) seq->add_token_ids(t + i);
    seq->set_start(3);
    if (temperature.has_value()) seq->set_temperature(*temperature);
  }
  return request;
}

TEST(ReliabilityLimitsTest, ScoreCountsAgainstMaxQueuedSamples) {
  ServerOptions options;
  options.max_queued_samples = 4;
  std::unique_ptr<TestServer> server = StartTestServer(options);
  ASSERT_NE(server, nullptr);
  v1::RolloutService::Stub* stub = server->stub.get();
  {
    v1::ScoreResponse response;
    grpc::ClientContext context;
    const grpc::Status five = stub->Score(&context, ScoreRequest(5), &response);
    EXPECT_EQ(five.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << five.error_message();
    EXPECT_NE(five.error_message().find("limit of 4"), std::string::npos) << five.error_message();
  }
  // Three long samples in flight leave room for one sequence, not two.
  grpc::ClientContext generate_context;
  generate_context.set_deadline(std::chrono::system_clock::now() + seconds(120));
  v1::GenerateRequest request;
  *request.add_rollouts() = MakeRollout(kPrompt, 1, 3000, 1.0f);
  request.mutable_rollouts(0)->set_num_samples(3);
  request.mutable_rollouts(0)->mutable_sampling()->set_ignore_eos(true);
  auto reader = stub->Generate(&generate_context, request);
  v1::GenerateResponse first;
  ASSERT_TRUE(reader->Read(&first));
  {
    v1::ScoreResponse response;
    grpc::ClientContext context;
    const grpc::Status two = stub->Score(&context, ScoreRequest(2), &response);
    EXPECT_EQ(two.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << two.error_message();
    EXPECT_NE(two.error_message().find("holds 3 unfinished samples"), std::string::npos)
        << two.error_message();
  }
  {
    v1::ScoreResponse response;
    grpc::ClientContext context;
    EXPECT_TRUE(stub->Score(&context, ScoreRequest(1), &response).ok());
  }
  generate_context.TryCancel();
  while (reader->Read(&first)) {
  }
  reader->Finish();
  std::string last;
  EXPECT_TRUE(rel::WaitForQuiescence(stub, seconds(30), &last)) << last;
}

TEST(ReliabilityLimitsTest, TemperaturesBelowTheMinimumAreInvalidArgumentForGenerateAndScore) {
  std::unique_ptr<TestServer> server = StartTestServer();
  ASSERT_NE(server, nullptr);
  v1::RolloutService::Stub* stub = server->stub.get();
  for (float t : {1e-45f, 1e-20f, 0.0009f}) {
    v1::GenerateRequest request;
    *request.add_rollouts() = MakeRollout(kPrompt, 1, 4, t);
    const GenerateOutcome out = RunGenerate(stub, request);
    EXPECT_EQ(out.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << t;
    EXPECT_NE(out.status.error_message().find("rollouts[0].sampling.temperature"),
              std::string::npos)
        << out.status.error_message();
    EXPECT_NE(out.status.error_message().find("at least 0.001"), std::string::npos)
        << out.status.error_message();

    v1::ScoreResponse response;
    grpc::ClientContext context;
    const grpc::Status score = stub->Score(&context, ScoreRequest(1, t), &response);
    EXPECT_EQ(score.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << t;
    EXPECT_NE(score.error_message().find("sequences[0].temperature"), std::string::npos)
        << score.error_message();
  }
  // The minimum itself runs, with finite logprobs; so does 0.
  for (float t : {0.001f, 0.0f}) {
    v1::GenerateRequest request;
    *request.add_rollouts() = MakeRollout(kPrompt, 1, 4, t);
    const GenerateOutcome out = RunGenerate(stub, request);
    ASSERT_TRUE(out.status.ok()) << t << ": " << out.status.error_message();
    for (float lp : out.completions[0][0].logprobs()) EXPECT_TRUE(std::isfinite(lp)) << t;
    v1::ScoreResponse response;
    grpc::ClientContext context;
    ASSERT_TRUE(stub->Score(&context, ScoreRequest(1, t), &response).ok()) << t;
    for (float lp : response.results(0).logprobs()) EXPECT_TRUE(std::isfinite(lp)) << t;
  }
}

}  // namespace
}  // namespace rollout::testing
