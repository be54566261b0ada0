// RolloutClient against a scripted in-process RolloutService on loopback, so that the client's
// own behaviour (status mapping, metadata, deadlines, GenerateAll's protocol checks) is tested
// without the real engine.
#include "client/rollout_client.h"

#include <gmock/gmock.h>
#include <google/protobuf/util/message_differencer.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace rollout {
namespace {

using google::protobuf::Message;
using google::protobuf::util::MessageDifferencer;
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
  // What the next Score, Abort or FlushCache call answers: the response, which must be of that
  // call's type, when the status is OK.
  void ScriptUnary(const Message& response, grpc::Status status) {
    std::lock_guard<std::mutex> lock(mu_);
    unary_type_ = response.GetTypeName();
    unary_response_ = response.SerializeAsString();
    unary_status_ = std::move(status);
  }
  // The authorization metadata of the last call; "<none>" when it had none.
  std::string last_authorization() {
    std::lock_guard<std::mutex> lock(mu_);
    return last_authorization_;
  }
  // How long the last call had left until its deadline when it arrived; nullopt for none.
  std::optional<std::chrono::milliseconds> last_deadline_left() {
    std::lock_guard<std::mutex> lock(mu_);
    return last_deadline_left_;
  }
  // The request of the last call, as the server parsed it; a test failure if it was of another
  // type.
  template <typename Request>
  Request last_request_as() {
    std::lock_guard<std::mutex> lock(mu_);
    Request request;
    if (last_request_ != nullptr && last_request_->GetTypeName() == request.GetTypeName()) {
      request.CopyFrom(*last_request_);
    } else {
      ADD_FAILURE() << "last request was "
                    << (last_request_ == nullptr ? "none" : last_request_->GetTypeName());
    }
    return request;
  }

  grpc::Status Generate(grpc::ServerContext* context, const GenerateRequest* request,
                        grpc::ServerWriter<GenerateResponse>* writer) override {
    Record(context, *request);
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
    if (hang) WaitForCancel(context);
    return status;
  }

  grpc::Status GetServerInfo(grpc::ServerContext* context,
                             const rollout::v1::GetServerInfoRequest* request,
                             rollout::v1::ServerInfo* info) override {
    Record(context, *request);
    info->set_backend("cpu");
    info->set_weight_version("w-7");
    info->mutable_model()->set_vocab_size(1000);
    return grpc::Status::OK;
  }

  grpc::Status Score(grpc::ServerContext* context, const rollout::v1::ScoreRequest* request,
                     rollout::v1::ScoreResponse* response) override {
    return Unary(context, *request, response);
  }
  grpc::Status Abort(grpc::ServerContext* context, const rollout::v1::AbortRequest* request,
                     rollout::v1::AbortResponse* response) override {
    return Unary(context, *request, response);
  }
  grpc::Status FlushCache(grpc::ServerContext* context,
                          const rollout::v1::FlushCacheRequest* request,
                          rollout::v1::FlushCacheResponse* response) override {
    return Unary(context, *request, response);
  }

 private:
  // Bounded, so that a client that never cancels fails its test instead of hanging the suite.
  static void WaitForCancel(grpc::ServerContext* context) {
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (!context->IsCancelled() && std::chrono::steady_clock::now() < give_up) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }

  void Record(grpc::ServerContext* context, const Message& request) {
    const auto& metadata = context->client_metadata();
    auto it = metadata.find("authorization");
    // gRPC reports "no deadline" as the largest time_point.
    const auto left = context->deadline() - std::chrono::system_clock::now();
    std::lock_guard<std::mutex> lock(mu_);
    last_authorization_ =
        it == metadata.end() ? "<none>" : std::string(it->second.data(), it->second.size());
    last_deadline_left_ = std::nullopt;
    if (left < std::chrono::hours(24 * 365)) {
      last_deadline_left_ = std::chrono::duration_cast<std::chrono::milliseconds>(left);
    }
    last_request_.reset(request.New());
    last_request_->CopyFrom(request);
  }

  grpc::Status Unary(grpc::ServerContext* context, const Message& request, Message* response) {
    Record(context, request);
    std::string type, bytes;
    grpc::Status status;
    bool hang;
    {
      std::lock_guard<std::mutex> lock(mu_);
      type = unary_type_;
      bytes = unary_response_;
      status = unary_status_;
      hang = hang_;
    }
    if (hang) WaitForCancel(context);
    if (!status.ok()) return status;
    // A test scripting the wrong type would otherwise pass garbage through unnoticed.
    if (type != response->GetTypeName() || !response->ParseFromString(bytes)) {
      return grpc::Status(grpc::StatusCode::INTERNAL,
                          "scripted " + type + " for a call answering " + response->GetTypeName());
    }
    return grpc::Status::OK;
  }

  std::mutex mu_;
  std::vector<GenerateResponse> responses_;
  grpc::Status status_;
  bool hang_ = false;
  std::string unary_type_;
  std::string unary_response_;
  grpc::Status unary_status_;
  std::string last_authorization_;
  std::optional<std::chrono::milliseconds> last_deadline_left_;
  std::unique_ptr<Message> last_request_;
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

// ---- Score, Abort, FlushCache ---------------------------------------------------------------

rollout::v1::ScoreRequest MakeScoreRequest() {
  rollout::v1::ScoreRequest request;
  rollout::v1::ScoreSequence* sequence = request.add_sequences();
  for (uint32_t token : {11, 12, 13, 14}) sequence->add_token_ids(token);
  sequence->set_start(2);
  sequence->set_temperature(0.5f);
  sequence->set_top_logprobs(3);
  request.add_sequences()->add_token_ids(7);
  return request;
}

// One of the unary calls, with a response to script that has every field set, so a field lost
// on the way shows up.
struct UnaryCase {
  std::string name;
  std::shared_ptr<const Message> response;
  std::function<absl::StatusOr<std::string>(RolloutClient&)> call;  // the response, serialized
};

template <typename Response>
absl::StatusOr<std::string> Serialized(const absl::StatusOr<Response>& response) {
  if (!response.ok()) return response.status();
  return response->SerializeAsString();
}

std::vector<UnaryCase> UnaryCases() {
  auto score = std::make_shared<rollout::v1::ScoreResponse>();
  rollout::v1::ScoredSequence* scored = score->add_results();
  scored->add_logprobs(-0.1f);
  scored->add_logprobs(-1.0f / 3.0f);
  rollout::v1::TopLogprob* top = scored->add_top_logprobs()->add_entries();
  top->set_token_id(5);
  top->set_logprob(-0.25f);
  scored->set_weight_version("w-9");
  scored->set_cached_tokens(2);
  score->add_results()->set_weight_version("w-9");

  auto abort = std::make_shared<rollout::v1::AbortResponse>();
  abort->set_aborted_rollouts(2);
  abort->add_unknown_request_ids("gone");

  auto flush = std::make_shared<rollout::v1::FlushCacheResponse>();
  flush->set_freed_blocks(40);
  flush->set_detached_blocks(3);

  return {
      {"Score", score, [](RolloutClient& c) { return Serialized(c.Score(MakeScoreRequest())); }},
      {"Abort", abort,
       [](RolloutClient& c) {
         rollout::v1::AbortRequest request;
         request.add_request_ids("a");
         return Serialized(c.Abort(request));
       }},
      {"FlushCache", flush, [](RolloutClient& c) { return Serialized(c.FlushCache()); }},
  };
}

TEST_F(RolloutClientTest, ScoreSendsTheRequestAndReturnsTheResponseUnchanged) {
  const UnaryCase score = UnaryCases()[0];
  service_.ScriptUnary(*score.response, grpc::Status::OK);
  std::unique_ptr<RolloutClient> client = Connect();
  ASSERT_NE(client, nullptr);
  absl::StatusOr<rollout::v1::ScoreResponse> response = client->Score(MakeScoreRequest());
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_TRUE(MessageDifferencer::Equals(*response, *score.response)) << response->DebugString();
  const rollout::v1::ScoreRequest seen = service_.last_request_as<rollout::v1::ScoreRequest>();
  EXPECT_TRUE(MessageDifferencer::Equals(seen, MakeScoreRequest())) << seen.DebugString();
  EXPECT_TRUE(seen.sequences(0).has_temperature());
  EXPECT_FALSE(seen.sequences(1).has_temperature());
}

TEST_F(RolloutClientTest, AbortSendsTheRequestAndReturnsTheResponseUnchanged) {
  const UnaryCase abort = UnaryCases()[1];
  service_.ScriptUnary(*abort.response, grpc::Status::OK);
  std::unique_ptr<RolloutClient> client = Connect();
  ASSERT_NE(client, nullptr);

  rollout::v1::AbortRequest named;
  named.add_request_ids("r-1");
  named.add_request_ids("gone");
  absl::StatusOr<rollout::v1::AbortResponse> response = client->Abort(named);
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_TRUE(MessageDifferencer::Equals(*response, *abort.response)) << response->DebugString();
  rollout::v1::AbortRequest seen = service_.last_request_as<rollout::v1::AbortRequest>();
  EXPECT_TRUE(MessageDifferencer::Equals(seen, named)) << seen.DebugString();

  rollout::v1::AbortRequest all;
  all.set_all(true);
  ASSERT_TRUE(client->Abort(all).ok());
  seen = service_.last_request_as<rollout::v1::AbortRequest>();
  EXPECT_TRUE(seen.all());
  EXPECT_EQ(seen.request_ids_size(), 0);
}

TEST_F(RolloutClientTest, FlushCacheReturnsTheResponseUnchanged) {
  const UnaryCase flush = UnaryCases()[2];
  service_.ScriptUnary(*flush.response, grpc::Status::OK);
  std::unique_ptr<RolloutClient> client = Connect();
  ASSERT_NE(client, nullptr);
  absl::StatusOr<rollout::v1::FlushCacheResponse> response = client->FlushCache();
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_EQ(response->freed_blocks(), 40u);
  EXPECT_EQ(response->detached_blocks(), 3u);
  service_.last_request_as<rollout::v1::FlushCacheRequest>();  // fails the test on another type
}

TEST_F(RolloutClientTest, UnaryCallsReturnTheServersStatusUnchanged) {
  std::unique_ptr<RolloutClient> client = Connect();
  ASSERT_NE(client, nullptr);
  for (const UnaryCase& c : UnaryCases()) {
    service_.ScriptUnary(*c.response, grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                                                   c.name + ": weights are being swapped"));
    EXPECT_EQ(c.call(*client).status(),
              absl::FailedPreconditionError(c.name + ": weights are being swapped"));
  }
}

TEST_F(RolloutClientTest, UnaryCallsSendTheBearerTokenOnlyWhenSet) {
  ClientOptions options;
  options.bearer_token = "s3cret";
  std::unique_ptr<RolloutClient> with_token = Connect(options);
  std::unique_ptr<RolloutClient> without_token = Connect();
  ASSERT_NE(with_token, nullptr);
  ASSERT_NE(without_token, nullptr);
  for (const UnaryCase& c : UnaryCases()) {
    service_.ScriptUnary(*c.response, grpc::Status::OK);
    ASSERT_TRUE(c.call(*with_token).ok()) << c.name;
    EXPECT_EQ(service_.last_authorization(), "Bearer s3cret") << c.name;
    ASSERT_TRUE(c.call(*without_token).ok()) << c.name;
    EXPECT_EQ(service_.last_authorization(), "<none>") << c.name;
  }
}

TEST_F(RolloutClientTest, UnaryCallsCarryTheCallTimeoutAsTheirDeadline) {
  ClientOptions options;
  options.call_timeout = std::chrono::seconds(30);
  std::unique_ptr<RolloutClient> with_timeout = Connect(options);
  std::unique_ptr<RolloutClient> without_timeout = Connect();
  ASSERT_NE(with_timeout, nullptr);
  ASSERT_NE(without_timeout, nullptr);
  std::vector<UnaryCase> cases = UnaryCases();
  // GetServerInfo goes through the same path; its answer is fixed, so nothing is scripted.
  cases.push_back(
      {"GetServerInfo", nullptr, [](RolloutClient& c) { return Serialized(c.GetServerInfo()); }});
  for (const UnaryCase& c : cases) {
    if (c.response != nullptr) service_.ScriptUnary(*c.response, grpc::Status::OK);
    ASSERT_TRUE(c.call(*with_timeout).ok()) << c.name;
    std::optional<std::chrono::milliseconds> left = service_.last_deadline_left();
    ASSERT_TRUE(left.has_value()) << c.name;
    // gRPC rounds the timeout it puts on the wire up (30 s arrives as about 30.1 s).
    EXPECT_GT(left->count(), 20'000) << c.name;
    EXPECT_LE(left->count(), 31'000) << c.name;

    ASSERT_TRUE(c.call(*without_timeout).ok()) << c.name;
    EXPECT_EQ(service_.last_deadline_left(), std::nullopt) << c.name;
  }
}

TEST_F(RolloutClientTest, CallTimeoutEndsAStuckUnaryCallWithDeadlineExceeded) {
  service_.HangUntilCancelled();
  ClientOptions options;
  options.call_timeout = std::chrono::milliseconds(200);
  std::unique_ptr<RolloutClient> client = Connect(options);
  ASSERT_NE(client, nullptr);
  for (const UnaryCase& c : UnaryCases()) {
    service_.ScriptUnary(*c.response, grpc::Status::OK);
    const auto start = std::chrono::steady_clock::now();
    EXPECT_EQ(c.call(*client).status().code(), absl::StatusCode::kDeadlineExceeded) << c.name;
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5)) << c.name;
  }
}

TEST(UnaryCallsAgainstAnOlderServerTest, AnswerUnimplemented) {
  // The generated base service answers UNIMPLEMENTED for every method, like a server built
  // before these RPCs existed.
  rollout::v1::RolloutService::Service bare_service;
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&bare_service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  absl::StatusOr<std::unique_ptr<RolloutClient>> client =
      RolloutClient::Connect("127.0.0.1:" + std::to_string(port), ClientOptions());
  ASSERT_TRUE(client.ok()) << client.status();
  for (const UnaryCase& c : UnaryCases()) {
    EXPECT_EQ(c.call(**client).status().code(), absl::StatusCode::kUnimplemented) << c.name;
  }
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
}

}  // namespace
}  // namespace rollout
