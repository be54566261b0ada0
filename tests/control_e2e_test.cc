// End-to-end checks of Score, Abort and FlushCache through the real gRPC stack.
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/test_server.h"
#include "tests/testdata/test_pki.h"

namespace rollout::testing {
namespace {

class ControlE2eTest : public SharedServerTest {};

const std::vector<uint32_t> kPrompt = {3, 14, 15, 92, 65, 35, 89, 79, 323, 846};

grpc::Status Score(v1::RolloutService::Stub* stub, const v1::ScoreRequest& request,
                   v1::ScoreResponse* response) {
  grpc::ClientContext context;
  return stub->Score(&context, request, response);
}

TEST_F(ControlE2eTest, ScoreOverGrpcEqualsGenerateLogprobsBitwise) {
  v1::GenerateRequest request;
  *request.add_rollouts() = MakeRollout(kPrompt, 8, 16, 0.7f);
  request.mutable_rollouts(0)->mutable_sampling()->set_top_p(0.9f);
  GenerateOutcome out = RunGenerate(stub(), request);
  ASSERT_TRUE(out.status.ok());
  const v1::Completion& c = out.completions[0][0];
  v1::ScoreRequest score;
  v1::ScoreSequence* seq = score.add_sequences();
  for (uint32_t t : kPrompt) seq->add_token_ids(t);
  for (uint32_t t : c.token_ids()) seq->add_token_ids(t);
  seq->set_start(kPrompt.size());
  seq->set_temperature(0.7f);
  v1::ScoreResponse response;
  ASSERT_TRUE(Score(stub(), score, &response).ok());
  ASSERT_EQ(response.results_size(), 1);
  ASSERT_EQ(response.results(0).logprobs_size(), c.logprobs_size());
  for (int i = 0; i < c.logprobs_size(); ++i) {
    const float a = response.results(0).logprobs(i), b = c.logprobs(i);
    EXPECT_EQ(std::memcmp(&a, &b, sizeof(float)), 0) << "token " << i;
  }
  EXPECT_EQ(response.results(0).weight_version(), c.weight_version());
}

TEST_F(ControlE2eTest, ScoreBadInputsGetInvalidArgumentNamingTheField) {
  struct Case {
    std::function<void(v1::ScoreRequest*)> mutate;
    std::string expect;
  };
  const std::vector<Case> cases = {
      {[](v1::ScoreRequest* r) { r->clear_sequences(); }, "sequences is empty"},
      {[](v1::ScoreRequest* r) { r->mutable_sequences(0)->set_start(0); }, "sequences[0].start"},
      {[](v1::ScoreRequest* r) { r->mutable_sequences(0)->set_start(10); }, "sequences[0].start"},
      {[](v1::ScoreRequest* r) { r->mutable_sequences(0)->set_token_ids(1, 5000); },
       "sequences[0].token_ids[1] = 5000"},
      {[](v1::ScoreRequest* r) { r->mutable_sequences(0)->set_temperature(-1); },
       "sequences[0].temperature"},
      {[](v1::ScoreRequest* r) { r->mutable_sequences(0)->set_top_logprobs(99); }, "top_logprobs"},
  };
  for (const Case& c : cases) {
    v1::ScoreRequest request;
    v1::ScoreSequence* seq = request.add_sequences();
    for (uint32_t t : kPrompt) seq->add_token_ids(t);
    seq->set_start(4);
    c.mutate(&request);
    v1::ScoreResponse response;
    grpc::Status status = Score(stub(), request, &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << c.expect;
    EXPECT_NE(status.error_message().find(c.expect), std::string::npos) << status.error_message();
  }
}

TEST_F(ControlE2eTest, AbortByRequestIdEndsThatRolloutWithItsTokensSoFar) {
  v1::GenerateRequest request;
  *request.add_rollouts() = MakeRollout(kPrompt, 1, 3000, 1.0f, "keep");
  request.mutable_rollouts(0)->mutable_sampling()->set_max_new_tokens(20);
  *request.add_rollouts() = MakeRollout(kPrompt, 2, 3000, 1.0f, "stop-me");
  request.mutable_rollouts(1)->mutable_sampling()->set_ignore_eos(true);
  request.mutable_rollouts(0)->mutable_sampling()->set_ignore_eos(true);
  grpc::ClientContext context;
  auto reader = stub()->Generate(&context, request);
  v1::GenerateResponse response;
  std::vector<uint32_t> streamed;
  v1::Completion aborted, kept;
  bool abort_sent = false;
  while (reader->Read(&response)) {
    if (response.has_chunk() && response.chunk().rollout_index() == 1) {
      for (uint32_t t : response.chunk().token_ids()) streamed.push_back(t);
      if (!abort_sent && streamed.size() >= 5) {
        grpc::ClientContext abort_context;
        v1::AbortRequest abort;
        abort.add_request_ids("stop-me");
        abort.add_request_ids("never-seen");
        v1::AbortResponse abort_response;
        ASSERT_TRUE(stub()->Abort(&abort_context, abort, &abort_response).ok());
        EXPECT_EQ(abort_response.aborted_rollouts(), 1u);
        ASSERT_EQ(abort_response.unknown_request_ids_size(), 1);
        EXPECT_EQ(abort_response.unknown_request_ids(0), "never-seen");
        abort_sent = true;
      }
    }
    if (response.has_completion()) {
      (response.completion().rollout_index() == 1 ? aborted : kept) = response.completion();
    }
  }
  ASSERT_TRUE(reader->Finish().ok());
  EXPECT_EQ(aborted.finish_reason(), v1::FINISH_REASON_ABORT);
  EXPECT_EQ(std::vector<uint32_t>(aborted.token_ids().begin(), aborted.token_ids().end()),
            streamed);
  EXPECT_LT(aborted.token_ids_size(), 3000);
  EXPECT_EQ(kept.finish_reason(), v1::FINISH_REASON_LENGTH);
  EXPECT_EQ(kept.token_ids_size(), 20);
}

TEST_F(ControlE2eTest, AbortNeedsIdsOrAllButNotBoth) {
  for (bool all : {false, true}) {
    grpc::ClientContext context;
    v1::AbortRequest request;
    request.set_all(all);
    if (all) request.add_request_ids("x");
    v1::AbortResponse response;
    grpc::Status status = stub()->Abort(&context, request, &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_NE(status.error_message().find("request_ids"), std::string::npos);
  }
}

TEST_F(ControlE2eTest, AbortAllEndsEveryInFlightRollout) {
  v1::GenerateRequest request;
  for (int i = 0; i < 3; ++i) {
    *request.add_rollouts() = MakeRollout(kPrompt, i, 3000, 1.0f);
    request.mutable_rollouts(i)->mutable_sampling()->set_ignore_eos(true);
  }
  grpc::ClientContext context;
  auto reader = stub()->Generate(&context, request);
  v1::GenerateResponse response;
  ASSERT_TRUE(reader->Read(&response));
  grpc::ClientContext abort_context;
  v1::AbortRequest abort;
  abort.set_all(true);
  v1::AbortResponse abort_response;
  ASSERT_TRUE(stub()->Abort(&abort_context, abort, &abort_response).ok());
  EXPECT_GE(abort_response.aborted_rollouts(), 3u);
  int aborted = 0;
  while (reader->Read(&response)) {
    if (response.has_completion()) {
      aborted += response.completion().finish_reason() == v1::FINISH_REASON_ABORT;
    }
  }
  EXPECT_TRUE(reader->Finish().ok());
  EXPECT_EQ(aborted, 3);
}

TEST_F(ControlE2eTest, FlushCacheEmptiesTheCacheAndServerInfoShowsHits) {
  v1::GenerateRequest request;
  std::vector<uint32_t> prompt;
  for (int i = 0; i < 100; ++i) prompt.push_back((i * 7 + 1) % 4000);
  *request.add_rollouts() = MakeRollout(prompt, 4, 4, 0.0f);
  ASSERT_TRUE(RunGenerate(stub(), request).status.ok());
  GenerateOutcome hit = RunGenerate(stub(), request);
  EXPECT_EQ(hit.completions[0][0].cached_prompt_tokens(), 96u);
  grpc::ClientContext info_context;
  v1::ServerInfo info;
  ASSERT_TRUE(stub()->GetServerInfo(&info_context, {}, &info).ok());
  EXPECT_GE(info.counters().cache_hit_tokens(), 96u);
  EXPECT_GT(info.counters().kv_blocks_cached(), 0u);

  grpc::ClientContext flush_context;
  v1::FlushCacheResponse flushed;
  ASSERT_TRUE(stub()->FlushCache(&flush_context, {}, &flushed).ok());
  EXPECT_GT(flushed.freed_blocks(), 0u);
  GenerateOutcome miss = RunGenerate(stub(), request);
  EXPECT_EQ(miss.completions[0][0].cached_prompt_tokens(), 0u);
  EXPECT_EQ(Fingerprint(miss.completions[0][0]), Fingerprint(hit.completions[0][0]));
}

}  // namespace
}  // namespace rollout::testing

namespace rollout::testing {
namespace {

void WriteText(const std::string& path, const char* text) {
  std::ofstream out(path);
  out << text;
  ASSERT_TRUE(out.good()) << path;
}

TEST(TlsE2eTest, MutualTlsServesClientsWithACertificateAndRefusesOthers) {
  const std::string dir = ::testing::TempDir() + "tls-e2e";
  std::filesystem::create_directories(dir);
  WriteText(dir + "/ca.pem", test_pki::kTestCaPem);
  WriteText(dir + "/server.pem", test_pki::kTestServerPem);
  WriteText(dir + "/server.key", test_pki::kTestServerKey);
  ServerOptions options;
  options.address = "127.0.0.1:0";
  options.tls_cert_file = dir + "/server.pem";
  options.tls_key_file = dir + "/server.key";
  options.tls_client_ca_file = dir + "/ca.pem";
  std::unique_ptr<TestServer> server = StartTestServer(options);
  ASSERT_NE(server, nullptr);

  grpc::SslCredentialsOptions with_cert;
  with_cert.pem_root_certs = test_pki::kTestCaPem;
  with_cert.pem_cert_chain = test_pki::kTestClientPem;
  with_cert.pem_private_key = test_pki::kTestClientKey;
  auto stub = v1::RolloutService::NewStub(
      grpc::CreateChannel(server->address(), grpc::SslCredentials(with_cert)));
  v1::GenerateRequest request;
  *request.add_rollouts() = MakeRollout(kPrompt, 1, 4, 0.0f);
  GenerateOutcome out = RunGenerate(stub.get(), request);
  ASSERT_TRUE(out.status.ok()) << out.status.error_message();
  EXPECT_EQ(out.completions[0][0].token_ids_size(), 4);

  grpc::SslCredentialsOptions without_cert;
  without_cert.pem_root_certs = test_pki::kTestCaPem;
  auto refused = v1::RolloutService::NewStub(
      grpc::CreateChannel(server->address(), grpc::SslCredentials(without_cert)));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  v1::ServerInfo info;
  EXPECT_FALSE(refused->GetServerInfo(&context, {}, &info).ok());
  // Plaintext clients are refused too.
  EXPECT_FALSE(RunGenerate(server->stub.get(), request).status.ok());
}

TEST(TlsE2eTest, HalfATlsConfigurationIsAStartupError) {
  ServerOptions options;
  options.address = "127.0.0.1:0";
  options.tls_cert_file = "/nonexistent/cert.pem";
  absl::StatusOr<std::unique_ptr<RolloutServer>> server = RolloutServer::Start(options);
  ASSERT_FALSE(server.ok());
  EXPECT_NE(server.status().message().find("both a certificate and a key"), std::string::npos)
      << server.status();
}

// Memory is planned at load: limits that cannot fit are refused at start, naming the one to
// lower, instead of failing a step (or the process) later.
TEST(StartupE2eTest, LimitsThatCannotFitAreRefusedAtStartNamingTheLimit) {
  ServerOptions options;
  options.address = "127.0.0.1:0";
  options.kv_cache_bytes = int64_t{1} << 50;  // a PiB of KV
  absl::StatusOr<std::unique_ptr<RolloutServer>> server = RolloutServer::Start(options);
  ASSERT_FALSE(server.ok());
  EXPECT_EQ(server.status().code(), absl::StatusCode::kResourceExhausted) << server.status();
  EXPECT_NE(server.status().message().find("lower --kv_cache_mb"), std::string::npos)
      << server.status();
  // The same with the step budget as the limit that does not fit.
  options.kv_cache_bytes = 0;
  options.max_batch_tokens = 1 << 30;
  server = RolloutServer::Start(options);
  ASSERT_FALSE(server.ok());
  EXPECT_EQ(server.status().code(), absl::StatusCode::kResourceExhausted) << server.status();
  EXPECT_NE(server.status().message().find("lower --max_batch_tokens"), std::string::npos)
      << server.status();
}

}  // namespace
}  // namespace rollout::testing
