// RolloutClient against a scripted in-process RolloutService on loopback, so that the client's
// own behaviour (status mapping, metadata, deadlines, GenerateAll's protocol checks) is tested
// without the real engine.
#include "client/rollout_client.h"

#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace rollout {
namespace {

using rollout::v1::Completion;
using rollout::v1::GenerateRequest;
using rollout::v1::GenerateResponse;
using ::testing::HasSubstr;

class ScriptedService final : public rollout::v1::RolloutService::Service {
 public:
  // What the next Generate call streams and ends with.
  void Script(std::vector<GenerateResponse> responses, grpc::Status status) {
    std::lock_guard<std::mutex> lock(mu_);
    responses_ = std::move(responses);
    status_ = std::move(status);
  }
  void HangUntilCancelled() {
    std::lock_guard<std::mutex> lock(mu_);
    hang_ = true;
  }
  // The authorization metadata of the last call; "<none>" when it had none.
  std::string last_authorization() {
    std::lock_guard<std::mutex> lock(mu_);
    return last_authorization_;
  }

  grpc::Status Generate(grpc::ServerContext* context, const GenerateRequest* request,
                        grpc::ServerWriter<GenerateResponse>* writer) override {
    Record(context);
    std::vector<GenerateResponse> responses;
    grpc::Status status;
    bool hang;
    {
      std::lock_guard<std::mutex> lock(mu_);
      responses = responses_;
      status = status_;
      hang = hang_;
    }
    for (const GenerateResponse& response : responses) writer->Write(response);
    while (hang && !context->IsCancelled()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return status;
  }

  grpc::Status GetServerInfo(grpc::ServerContext* context,
                             const rollout::v1::GetServerInfoRequest* request,
                             rollout::v1::ServerInfo* info) override {
    Record(context);
    info->set_backend("cpu");
    info->set_weight_version("w-7");
    info->mutable_model()->set_vocab_size(1000);
    return grpc::Status::OK;
  }

 private:
  void Record(grpc::ServerContext* context) {
    const auto& metadata = context->client_metadata();
    auto it = metadata.find("authorization");
    std::lock_guard<std::mutex> lock(mu_);
    last_authorization_ =
        it == metadata.end() ? "<none>" : std::string(it->second.data(), it->second.size());
  }

  std::mutex mu_;
  std::vector<GenerateResponse> responses_;
  grpc::Status status_;
  bool hang_ = false;
  std::string last_authorization_;
};

class RolloutClientTest : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(&service_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    ASSERT_GT(port, 0);
    target_ = "127.0.0.1:" + std::to_string(port);
  }
  void TearDown() override {
    if (server_) server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  }

  std::unique_ptr<RolloutClient> Connect(ClientOptions options = {}) {
    absl::StatusOr<std::unique_ptr<RolloutClient>> client =
        RolloutClient::Connect(target_, options);
    EXPECT_TRUE(client.ok()) << client.status();
    return client.ok() ? *std::move(client) : nullptr;
  }

  ScriptedService service_;
  std::unique_ptr<grpc::Server> server_;
  std::string target_;
};

GenerateRequest RequestWithSamples(std::vector<uint32_t> num_samples) {
  GenerateRequest request;
  for (uint32_t n : num_samples) {
    rollout::v1::RolloutRequest* rollout = request.add_rollouts();
    rollout->add_prompt_token_ids(1);
    rollout->mutable_sampling()->set_max_new_tokens(4);
    rollout->set_num_samples(n);
  }
  return request;
}

GenerateResponse ChunkOf(uint32_t r, uint32_t s, uint32_t token) {
  GenerateResponse response;
  response.mutable_chunk()->set_rollout_index(r);
  response.mutable_chunk()->set_sample_index(s);
  response.mutable_chunk()->add_token_ids(token);
  response.mutable_chunk()->add_logprobs(-1.0f);
  return response;
}

GenerateResponse CompletionOf(uint32_t r, uint32_t s, uint32_t token) {
  GenerateResponse response;
  Completion* c = response.mutable_completion();
  c->set_rollout_index(r);
  c->set_sample_index(s);
  c->add_token_ids(token);
  c->add_logprobs(-1.0f);
  c->set_finish_reason(rollout::v1::FINISH_REASON_LENGTH);
  return response;
}

TEST(FromGrpcStatusTest, KeepsCodeAndMessageIntact) {
  for (grpc::StatusCode code :
       {grpc::StatusCode::CANCELLED, grpc::StatusCode::INVALID_ARGUMENT,
        grpc::StatusCode::DEADLINE_EXCEEDED, grpc::StatusCode::RESOURCE_EXHAUSTED,
        grpc::StatusCode::FAILED_PRECONDITION, grpc::StatusCode::UNAVAILABLE,
        grpc::StatusCode::UNAUTHENTICATED, grpc::StatusCode::INTERNAL}) {
    absl::Status status = FromGrpcStatus(grpc::Status(code, "rollout 3: bad thing"));
    EXPECT_EQ(static_cast<int>(status.code()), static_cast<int>(code));
    EXPECT_EQ(status.message(), "rollout 3: bad thing");
  }
  EXPECT_TRUE(FromGrpcStatus(grpc::Status::OK).ok());
}

TEST(ConnectTest, FailsWithUnavailableNamingTheAddressWhenNothingListens) {
  ClientOptions options;
  options.connect_timeout = std::chrono::milliseconds(300);
  // Port 1 (tcpmux) is privileged and unused on test machines.
  absl::StatusOr<std::unique_ptr<RolloutClient>> client =
      RolloutClient::Connect("127.0.0.1:1", options);
  EXPECT_EQ(client.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(client.status().message(), "could not connect to 127.0.0.1:1 within 0.3 s");
}

TEST(ConnectTest, RejectsEmptyTarget) {
  EXPECT_EQ(RolloutClient::Connect("", ClientOptions()).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ConnectTest, FailsWhenTheTlsRootCertFileIsMissing) {
  ClientOptions options;
  options.tls_root_cert_path = "/nonexistent/roots.pem";
  absl::StatusOr<std::unique_ptr<RolloutClient>> client =
      RolloutClient::Connect("127.0.0.1:1", options);
  EXPECT_EQ(client.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(client.status().message(), HasSubstr("/nonexistent/roots.pem"));
}

TEST_F(RolloutClientTest, GenerateDeliversEveryMessageInOrder) {
  std::vector<GenerateResponse> script = {ChunkOf(0, 0, 5), ChunkOf(0, 0, 6),
                                          CompletionOf(0, 0, 5)};
  service_.Script(script, grpc::Status::OK);
  std::unique_ptr<RolloutClient> client = Connect();
  ASSERT_NE(client, nullptr);
  std::vector<GenerateResponse> seen;
  absl::Status status = client->Generate(RequestWithSamples({1}),
                                         [&](const GenerateResponse& r) { seen.push_back(r); });
  ASSERT_TRUE(status.ok()) << status;
  ASSERT_EQ(seen.size(), script.size());
  for (size_t i = 0; i < seen.size(); ++i) {
    EXPECT_EQ(seen[i].SerializeAsString(), script[i].SerializeAsString()) << i;
  }
}

TEST_F(RolloutClientTest, GenerateReturnsTheServersStatusUnchanged) {
  service_.Script({ChunkOf(0, 0, 5)},
                  grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "rollouts[0]: empty prompt"));
  std::unique_ptr<RolloutClient> client = Connect();
  ASSERT_NE(client, nullptr);
  int messages = 0;
  absl::Status status =
      client->Generate(RequestWithSamples({1}), [&](const GenerateResponse&) { ++messages; });
  EXPECT_EQ(status, absl::InvalidArgumentError("rollouts[0]: empty prompt"));
  EXPECT_EQ(messages, 1);
}

TEST_F(RolloutClientTest, SendsBearerTokenOnEveryCallOnlyWhenSet) {
  ClientOptions options;
  options.bearer_token = "s3cret";
  std::unique_ptr<RolloutClient> with_token = Connect(options);
  ASSERT_NE(with_token, nullptr);
  ASSERT_TRUE(with_token->GetServerInfo().ok());
  EXPECT_EQ(service_.last_authorization(), "Bearer s3cret");
  service_.Script({CompletionOf(0, 0, 1)}, grpc::Status::OK);
  ASSERT_TRUE(with_token->Generate(RequestWithSamples({1}), [](const GenerateResponse&) {}).ok());
  EXPECT_EQ(service_.last_authorization(), "Bearer s3cret");

  std::unique_ptr<RolloutClient> without_token = Connect();
  ASSERT_NE(without_token, nullptr);
  ASSERT_TRUE(without_token->GetServerInfo().ok());
  EXPECT_EQ(service_.last_authorization(), "<none>");
}

TEST_F(RolloutClientTest, CallTimeoutEndsAStuckStreamWithDeadlineExceeded) {
  service_.HangUntilCancelled();
  ClientOptions options;
  options.call_timeout = std::chrono::milliseconds(200);
  std::unique_ptr<RolloutClient> client = Connect(options);
  ASSERT_NE(client, nullptr);
  const auto start = std::chrono::steady_clock::now();
  absl::Status status = client->Generate(RequestWithSamples({1}), [](const GenerateResponse&) {});
  EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded) << status;
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
}

TEST_F(RolloutClientTest, MaxReceiveMessageSizeIsEnforced) {
  GenerateResponse big = CompletionOf(0, 0, 1);
  for (int i = 0; i < 1000; ++i) big.mutable_completion()->add_token_ids(100000 + i);
  service_.Script({big}, grpc::Status::OK);
  ClientOptions options;
  options.max_receive_message_bytes = 1024;
  std::unique_ptr<RolloutClient> client = Connect(options);
  ASSERT_NE(client, nullptr);
  absl::Status status = client->Generate(RequestWithSamples({1}), [](const GenerateResponse&) {});
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted) << status;

  // The 256 MiB default lets the same message through.
  std::unique_ptr<RolloutClient> default_client = Connect();
  ASSERT_NE(default_client, nullptr);
  EXPECT_TRUE(
      default_client->Generate(RequestWithSamples({1}), [](const GenerateResponse&) {}).ok());
}

TEST_F(RolloutClientTest, GenerateAllIndexesCompletionsByRolloutAndSample) {
  // Out of order on purpose; num_samples 0 means one sample.
  service_.Script({ChunkOf(1, 0, 30), CompletionOf(1, 0, 30), ChunkOf(0, 1, 21),
                   CompletionOf(0, 1, 21), CompletionOf(0, 0, 20)},
                  grpc::Status::OK);
  std::unique_ptr<RolloutClient> client = Connect();
  ASSERT_NE(client, nullptr);
  absl::StatusOr<GenerateResult> result = client->GenerateAll(RequestWithSamples({2, 0}));
  ASSERT_TRUE(result.ok()) << result.status();
  ASSERT_EQ(result->completions.size(), 2u);
  ASSERT_EQ(result->completions[0].size(), 2u);
  ASSERT_EQ(result->completions[1].size(), 1u);
  EXPECT_EQ(result->completions[0][0].token_ids(0), 20u);
  EXPECT_EQ(result->completions[0][1].token_ids(0), 21u);
  EXPECT_EQ(result->completions[1][0].token_ids(0), 30u);
  ASSERT_EQ(result->chunks.size(), 2u);
  EXPECT_EQ(result->chunks[0].token_ids(0), 30u);
  EXPECT_EQ(result->chunks[1].token_ids(0), 21u);
}

TEST_F(RolloutClientTest, GenerateAllFailsWhenASampleHasNoCompletion) {
  service_.Script({CompletionOf(0, 0, 1)}, grpc::Status::OK);
  std::unique_ptr<RolloutClient> client = Connect();
  ASSERT_NE(client, nullptr);
  absl::StatusOr<GenerateResult> result = client->GenerateAll(RequestWithSamples({2}));
  EXPECT_EQ(result.status().code(), absl::StatusCode::kInternal);
  EXPECT_THAT(result.status().message(), HasSubstr("rollout 0 sample 1"));
}

TEST_F(RolloutClientTest, GenerateAllFailsOnASecondCompletionForOneSample) {
  service_.Script({CompletionOf(0, 0, 1), CompletionOf(0, 0, 1)}, grpc::Status::OK);
  std::unique_ptr<RolloutClient> client = Connect();
  ASSERT_NE(client, nullptr);
  absl::StatusOr<GenerateResult> result = client->GenerateAll(RequestWithSamples({1}));
  EXPECT_EQ(result.status().code(), absl::StatusCode::kInternal);
  EXPECT_THAT(result.status().message(), HasSubstr("second completion"));
}

TEST_F(RolloutClientTest, GenerateAllFailsOnIndicesOutsideTheRequest) {
  for (const GenerateResponse& stray :
       {CompletionOf(1, 0, 1), CompletionOf(0, 1, 1), ChunkOf(0, 5, 1)}) {
    service_.Script({stray, CompletionOf(0, 0, 1)}, grpc::Status::OK);
    std::unique_ptr<RolloutClient> client = Connect();
    ASSERT_NE(client, nullptr);
    absl::StatusOr<GenerateResult> result = client->GenerateAll(RequestWithSamples({1}));
    EXPECT_EQ(result.status().code(), absl::StatusCode::kInternal) << stray.ShortDebugString();
    EXPECT_THAT(result.status().message(), HasSubstr("outside the request"));
  }
}

TEST_F(RolloutClientTest, GenerateAllFailsOnAChunkAfterItsSamplesCompletion) {
  service_.Script({CompletionOf(0, 0, 1), ChunkOf(0, 0, 2)}, grpc::Status::OK);
  std::unique_ptr<RolloutClient> client = Connect();
  ASSERT_NE(client, nullptr);
  absl::StatusOr<GenerateResult> result = client->GenerateAll(RequestWithSamples({1}));
  EXPECT_EQ(result.status().code(), absl::StatusCode::kInternal);
  EXPECT_THAT(result.status().message(), HasSubstr("after its completion"));
}

TEST_F(RolloutClientTest, GenerateAllReportsTheServerErrorOverAnIncompleteStream) {
  service_.Script({ChunkOf(0, 0, 1)},
                  grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, "prompt too long"));
  std::unique_ptr<RolloutClient> client = Connect();
  ASSERT_NE(client, nullptr);
  absl::StatusOr<GenerateResult> result = client->GenerateAll(RequestWithSamples({1}));
  EXPECT_EQ(result.status(), absl::ResourceExhaustedError("prompt too long"));
}

TEST_F(RolloutClientTest, GetServerInfoReturnsTheServersMessage) {
  std::unique_ptr<RolloutClient> client = Connect();
  ASSERT_NE(client, nullptr);
  absl::StatusOr<rollout::v1::ServerInfo> info = client->GetServerInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->backend(), "cpu");
  EXPECT_EQ(info->weight_version(), "w-7");
  EXPECT_EQ(info->model().vocab_size(), 1000u);
}

}  // namespace
}  // namespace rollout
