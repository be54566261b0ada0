// RolloutClient against a scripted in-process RolloutService on loopback, so that the client's
// own behaviour (status mapping, metadata, deadlines, GenerateAll's protocol checks) is tested
// without the real engine.
#include "client/rollout_client.h"

#include <gmock/gmock.h>
#include <google/protobuf/util/message_differencer.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/checkpoint_upload.h"
#include "model/model_config.h"
#include "model/random_model.h"
#include "model/safetensors.h"
#include "tests/testdata/test_pki.h"

namespace rollout {
namespace {

using google::protobuf::Message;
using google::protobuf::util::MessageDifferencer;
using rollout::v1::Completion;
using rollout::v1::GenerateRequest;
using rollout::v1::GenerateResponse;
using test_pki::kTestCaPem;
using test_pki::kTestClientKey;
using test_pki::kTestClientPem;
using test_pki::kTestServerKey;
using test_pki::kTestServerPem;
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
  // What the next UpdateWeights call does: with fail_after_messages < 0 it reads the whole
  // stream and then answers like a unary call (ScriptUnary); otherwise it stops reading after
  // that many messages (header included) and answers at once, leaving the rest unread.
  void ScriptUpdateStream(int fail_after_messages) {
    std::lock_guard<std::mutex> lock(mu_);
    update_fail_after_ = fail_after_messages;
  }
  // Every message the last UpdateWeights call read, in order.
  std::vector<rollout::v1::WeightsChunk> update_messages() {
    std::lock_guard<std::mutex> lock(mu_);
    return update_messages_;
  }
  // How many calls of any kind arrived.
  int calls() {
    std::lock_guard<std::mutex> lock(mu_);
    return calls_;
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
    std::lock_guard<std::mutex> lock(mu_);
    if (info_.has_value()) {
      *info = *info_;
      return grpc::Status::OK;
    }
    info->set_backend("cpu");
    info->set_weight_version("w-7");
    info->mutable_model()->set_vocab_size(1000);
    return grpc::Status::OK;
  }
  // What GetServerInfo answers from now on.
  void ScriptServerInfo(const rollout::v1::ServerInfo& info) {
    std::lock_guard<std::mutex> lock(mu_);
    info_ = info;
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
  grpc::Status UpdateWeightsFromPath(grpc::ServerContext* context,
                                     const rollout::v1::UpdateWeightsFromPathRequest* request,
                                     rollout::v1::UpdateWeightsResponse* response) override {
    return Unary(context, *request, response);
  }
  grpc::Status Pause(grpc::ServerContext* context, const rollout::v1::PauseRequest* request,
                     rollout::v1::PauseResponse* response) override {
    return Unary(context, *request, response);
  }
  grpc::Status Resume(grpc::ServerContext* context, const rollout::v1::ResumeRequest* request,
                      rollout::v1::ResumeResponse* response) override {
    return Unary(context, *request, response);
  }

  // Records the first message (the header, when the client sends one first) as the request.
  grpc::Status UpdateWeights(grpc::ServerContext* context,
                             grpc::ServerReader<rollout::v1::WeightsChunk>* reader,
                             rollout::v1::UpdateWeightsResponse* response) override {
    int fail_after;
    {
      std::lock_guard<std::mutex> lock(mu_);
      fail_after = update_fail_after_;
    }
    std::vector<rollout::v1::WeightsChunk> messages;
    rollout::v1::WeightsChunk chunk;
    while ((fail_after < 0 || static_cast<int>(messages.size()) < fail_after) &&
           reader->Read(&chunk)) {
      if (messages.empty()) {
        if (chunk.has_header()) {
          Record(context, chunk.header());
        } else {
          Record(context, chunk);
        }
      }
      messages.push_back(chunk);
    }
    if (messages.empty()) Record(context, chunk);
    {
      std::lock_guard<std::mutex> lock(mu_);
      update_calls_.push_back({context->peer(), messages});
      update_messages_ = std::move(messages);
    }
    return Respond(context, response);
  }

  // Every UpdateWeights call so far: the client's address and port, and what it sent.
  struct UpdateCall {
    std::string peer;
    std::vector<rollout::v1::WeightsChunk> messages;
  };
  std::vector<UpdateCall> update_calls() {
    std::lock_guard<std::mutex> lock(mu_);
    return update_calls_;
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
    ++calls_;
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
    return Respond(context, response);
  }

  // The scripted unary answer.
  grpc::Status Respond(grpc::ServerContext* context, Message* response) {
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
  std::optional<rollout::v1::ServerInfo> info_;
  std::vector<GenerateResponse> responses_;
  grpc::Status status_;
  bool hang_ = false;
  std::string unary_type_;
  std::string unary_response_;
  grpc::Status unary_status_;
  std::string last_authorization_;
  std::optional<std::chrono::milliseconds> last_deadline_left_;
  std::unique_ptr<Message> last_request_;
  int update_fail_after_ = -1;
  std::vector<rollout::v1::WeightsChunk> update_messages_;
  std::vector<UpdateCall> update_calls_;
  int calls_ = 0;
};

// A server for `service` on a free loopback port; `target` receives its address ("" when it
// could not start).
std::unique_ptr<grpc::Server> StartLoopbackServer(
    grpc::Service* service, std::string* target,
    std::shared_ptr<grpc::ServerCredentials> credentials = grpc::InsecureServerCredentials()) {
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", std::move(credentials), &port);
  builder.RegisterService(service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  *target = server != nullptr && port > 0 ? "127.0.0.1:" + std::to_string(port) : "";
  return server;
}

class RolloutClientTest : public ::testing::Test {
 protected:
  void SetUp() override {
    server_ = StartLoopbackServer(&service_, &target_);
    ASSERT_NE(server_, nullptr);
    ASSERT_NE(target_, "");
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
  EXPECT_EQ(client.status().message(),
            "could not connect to 127.0.0.1:1 within 0.3 s: is a server listening there? (a "
            "server with TLS needs a TLS client: its CA's certificate, rollout-cli "
            "--tls_root_cert)");
}

// A TLS mismatch fails as nothing listening does; the message names what to check.
TEST(ConnectTest, AFailedTlsConnectionNamesWhatToCheck) {
  const std::string pem = ::testing::TempDir() + "connect-test.pem";
  std::ofstream(pem) << "not a certificate\n";
  ClientOptions options;
  options.connect_timeout = std::chrono::milliseconds(300);
  options.tls_root_cert_path = pem;
  absl::StatusOr<std::unique_ptr<RolloutClient>> client =
      RolloutClient::Connect("127.0.0.1:1", options);
  EXPECT_EQ(client.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(client.status().message().find("a server that verifies clients needs a client "
                                           "certificate and key: --tls_client_cert"),
            std::string::npos)
      << client.status().message();
  options.tls_client_cert_path = pem;
  options.tls_client_key_path = pem;
  client = RolloutClient::Connect("127.0.0.1:1", options);
  EXPECT_NE(client.status().message().find("that trusts this client certificate's CA"),
            std::string::npos)
      << client.status().message();
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

  // An empty token is none (rollout-cli without a token flag): a bare "Bearer " would make the
  // server say the token is wrong instead of that the call needs one.
  ClientOptions empty;
  empty.bearer_token = "";
  std::unique_ptr<RolloutClient> empty_token = Connect(empty);
  ASSERT_NE(empty_token, nullptr);
  ASSERT_TRUE(empty_token->GetServerInfo().ok());
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

// Streams that break the protocol (each scripted reply, then OK) fail GenerateAll with INTERNAL
// and a message naming what was wrong.
TEST_F(RolloutClientTest, GenerateAllFailsOnStreamsThatBreakTheProtocol) {
  struct Case {
    std::vector<GenerateResponse> replies;
    std::vector<uint32_t> samples;  // the request's samples per rollout
    const char* message;
  };
  const Case cases[] = {
      {{CompletionOf(0, 0, 1)}, {2}, "rollout 0 sample 1"},  // a sample without a completion
      {{CompletionOf(0, 0, 1), CompletionOf(0, 0, 1)}, {1}, "second completion"},
      {{CompletionOf(1, 0, 1), CompletionOf(0, 0, 1)}, {1}, "outside the request"},
      {{CompletionOf(0, 1, 1), CompletionOf(0, 0, 1)}, {1}, "outside the request"},
      {{ChunkOf(0, 5, 1), CompletionOf(0, 0, 1)}, {1}, "outside the request"},
      {{CompletionOf(0, 0, 1), ChunkOf(0, 0, 2)}, {1}, "after its completion"},
  };
  for (const Case& c : cases) {
    service_.Script(c.replies, grpc::Status::OK);
    std::unique_ptr<RolloutClient> client = Connect();
    ASSERT_NE(client, nullptr);
    absl::StatusOr<GenerateResult> result = client->GenerateAll(RequestWithSamples(c.samples));
    EXPECT_EQ(result.status().code(), absl::StatusCode::kInternal) << c.message;
    EXPECT_THAT(result.status().message(), HasSubstr(c.message));
  }
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

  auto update = std::make_shared<rollout::v1::UpdateWeightsResponse>();
  update->set_version("v2");
  update->set_previous_version("v1");
  update->set_tensors_updated(3);
  update->set_bytes_received(123456789);
  update->set_aborted_samples(4);
  update->set_receive_seconds(1.25);
  update->set_swap_seconds(0.5);

  auto pause = std::make_shared<rollout::v1::PauseResponse>();
  pause->set_was_paused(true);
  auto resume = std::make_shared<rollout::v1::ResumeResponse>();
  resume->set_was_paused(true);

  return {
      {"Score", score, [](RolloutClient& c) { return Serialized(c.Score(MakeScoreRequest())); }},
      {"Abort", abort,
       [](RolloutClient& c) {
         rollout::v1::AbortRequest request;
         request.add_request_ids("a");
         return Serialized(c.Abort(request));
       }},
      {"FlushCache", flush, [](RolloutClient& c) { return Serialized(c.FlushCache()); }},
      {"UpdateWeightsFromPath", update,
       [](RolloutClient& c) {
         rollout::v1::UpdateWeightsFromPathRequest request;
         request.set_path("/ckpt");
         request.set_version("v2");
         return Serialized(c.UpdateWeightsFromPath(request));
       }},
      {"Pause", pause, [](RolloutClient& c) { return Serialized(c.Pause(true)); }},
      {"Resume", resume, [](RolloutClient& c) { return Serialized(c.Resume()); }},
      // Client-streaming, but answered like a unary call: it belongs with these for status,
      // token, deadline and UNIMPLEMENTED handling.
      {"UpdateWeights", update,
       [](RolloutClient& c) {
         static const uint8_t kBytes[6] = {1, 2, 3, 4, 5, 6};
         return Serialized(c.UpdateWeightsFromTensors("v2", rollout::v1::IN_FLIGHT_POLICY_CONTINUE,
                                                      {{"w", "BF16", {3}, kBytes, 6}},
                                                      /*chunk_bytes=*/4));
       }},
  };
}

// The UnaryCase of that name; a test failure when there is none.
UnaryCase UnaryCaseNamed(const std::string& name) {
  for (UnaryCase& c : UnaryCases()) {
    if (c.name == name) return c;
  }
  ADD_FAILURE() << "no UnaryCase " << name;
  return {};
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

TEST_F(RolloutClientTest, UnaryCallsReturnTheResponseUnchanged) {
  std::unique_ptr<RolloutClient> client = Connect();
  ASSERT_NE(client, nullptr);
  for (const UnaryCase& c : UnaryCases()) {
    service_.ScriptUnary(*c.response, grpc::Status::OK);
    absl::StatusOr<std::string> response = c.call(*client);
    ASSERT_TRUE(response.ok()) << c.name << ": " << response.status();
    EXPECT_EQ(*response, c.response->SerializeAsString()) << c.name;
  }
}

TEST_F(RolloutClientTest, UpdateWeightsFromPathPauseAndResumeSendTheirRequests) {
  std::unique_ptr<RolloutClient> client = Connect();
  ASSERT_NE(client, nullptr);
  service_.ScriptUnary(*UnaryCaseNamed("UpdateWeightsFromPath").response, grpc::Status::OK);
  rollout::v1::UpdateWeightsFromPathRequest request;
  request.set_path("/srv/ckpt/step-9");
  request.set_version("step-9");
  request.set_policy(rollout::v1::IN_FLIGHT_POLICY_ABORT);
  ASSERT_TRUE(client->UpdateWeightsFromPath(request).ok());
  const auto seen = service_.last_request_as<rollout::v1::UpdateWeightsFromPathRequest>();
  EXPECT_TRUE(MessageDifferencer::Equals(seen, request)) << seen.DebugString();

  service_.ScriptUnary(rollout::v1::PauseResponse(), grpc::Status::OK);
  for (bool abort_in_flight : {true, false}) {
    ASSERT_TRUE(client->Pause(abort_in_flight).ok());
    EXPECT_EQ(service_.last_request_as<rollout::v1::PauseRequest>().abort_in_flight(),
              abort_in_flight);
  }
  service_.ScriptUnary(rollout::v1::ResumeResponse(), grpc::Status::OK);
  ASSERT_TRUE(client->Resume().ok());
  service_.last_request_as<rollout::v1::ResumeRequest>();  // fails the test on another type
}

// ---- UpdateWeights --------------------------------------------------------------------------

rollout::v1::TensorData DataOf(const std::string& name, uint64_t offset, const std::string& bytes) {
  rollout::v1::TensorData data;
  data.set_name(name);
  data.set_offset(offset);
  data.set_data(bytes);
  return data;
}

rollout::v1::WeightsHeader HeaderOf(const std::string& version) {
  rollout::v1::WeightsHeader header;
  header.set_version(version);
  header.set_policy(rollout::v1::IN_FLIGHT_POLICY_DRAIN);
  rollout::v1::TensorDecl* decl = header.add_tensors();
  decl->set_name("model.norm.weight");
  decl->set_dtype("F32");
  decl->add_shape(2);
  return header;
}

TEST_F(RolloutClientTest, UpdateWeightsSendsTheHeaderFirstThenEveryChunkInOrder) {
  service_.ScriptUnary(*UnaryCaseNamed("UpdateWeights").response, grpc::Status::OK);
  std::unique_ptr<RolloutClient> client = Connect();
  ASSERT_NE(client, nullptr);
  const std::vector<rollout::v1::TensorData> chunks = {DataOf("model.norm.weight", 0, "abcd"),
                                                       DataOf("model.norm.weight", 4, "efgh")};
  size_t next = 0;
  absl::StatusOr<rollout::v1::UpdateWeightsResponse> response =
      client->UpdateWeights(HeaderOf("v2"), [&](rollout::v1::TensorData* data) {
        // Every call gets an empty message, whatever the previous one held.
        EXPECT_EQ(data->ByteSizeLong(), 0u) << next;
        if (next == chunks.size()) return false;
        *data = chunks[next++];
        return true;
      });
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_EQ(response->version(), "v2");
  EXPECT_EQ(next, chunks.size());

  const std::vector<rollout::v1::WeightsChunk> seen = service_.update_messages();
  ASSERT_EQ(seen.size(), 1 + chunks.size());
  ASSERT_TRUE(seen[0].has_header());
  EXPECT_TRUE(MessageDifferencer::Equals(seen[0].header(), HeaderOf("v2")))
      << seen[0].DebugString();
  for (size_t i = 0; i < chunks.size(); ++i) {
    ASSERT_TRUE(seen[1 + i].has_data()) << i;
    EXPECT_TRUE(MessageDifferencer::Equals(seen[1 + i].data(), chunks[i]))
        << i << ": " << seen[1 + i].DebugString();
  }
}

TEST(SplitByBytesTest, IsBalancedLargestFirstAndNeverEmpty) {
  using Split = std::vector<std::vector<size_t>>;
  // Largest first into the lightest part: 5 | 4 | 4, then 2 into the 4 of part 1, 1 into part 2.
  EXPECT_EQ(SplitByBytes({5, 1, 4, 4, 2}, 3), (Split{{0}, {2, 4}, {1, 3}}));
  EXPECT_EQ(SplitByBytes({7, 7}, 5), (Split{{0}, {1}}));  // fewer tensors than parts
  EXPECT_EQ(SplitByBytes({3, 0, 9}, 1), (Split{{0, 1, 2}}));
  EXPECT_EQ(SplitByBytes({}, 4), (Split{{}}));
}

TEST_F(RolloutClientTest, UpdateWeightsFromTensorsSpreadsTheTensorsOverStreamsOfTheirOwn) {
  service_.ScriptUnary(*UnaryCaseNamed("UpdateWeights").response, grpc::Status::OK);
  std::unique_ptr<RolloutClient> client = Connect();
  ASSERT_NE(client, nullptr);
  const std::vector<size_t> sizes = {3000, 100, 2000, 2000, 700};
  std::vector<std::string> bytes;
  std::vector<TensorSource> tensors;
  for (size_t i = 0; i < sizes.size(); ++i)
    bytes.emplace_back(sizes[i], static_cast<char>('a' + i));
  for (size_t i = 0; i < sizes.size(); ++i) {
    tensors.push_back({"t" + std::to_string(i),
                       "BF16",
                       {sizes[i] / 2},
                       reinterpret_cast<const uint8_t*>(bytes[i].data()),
                       sizes[i]});
  }
  absl::StatusOr<rollout::v1::UpdateWeightsResponse> response = client->UpdateWeightsFromTensors(
      "v7", rollout::v1::IN_FLIGHT_POLICY_ABORT, tensors, 512, nullptr, /*streams=*/3);
  ASSERT_TRUE(response.ok()) << response.status();

  const auto calls = service_.update_calls();
  ASSERT_EQ(calls.size(), 3u);
  std::set<std::string> peers, declared;
  std::set<uint32_t> indices;
  std::string update_id;
  for (const auto& call : calls) {
    peers.insert(call.peer);  // the client's port: one per connection
    ASSERT_FALSE(call.messages.empty());
    ASSERT_TRUE(call.messages[0].has_header());
    const rollout::v1::WeightsHeader& header = call.messages[0].header();
    EXPECT_EQ(header.version(), "v7");
    EXPECT_EQ(header.policy(), rollout::v1::IN_FLIGHT_POLICY_ABORT);
    EXPECT_EQ(header.part_count(), 3u);
    EXPECT_FALSE(header.update_id().empty());
    if (update_id.empty()) update_id = header.update_id();
    EXPECT_EQ(header.update_id(), update_id);
    indices.insert(header.part_index());
    // The part's tensors as SplitByBytes puts them, each byte sent once.
    const std::vector<size_t> expected =
        SplitByBytes(std::vector<uint64_t>(sizes.begin(), sizes.end()), 3)[header.part_index()];
    ASSERT_EQ(header.tensors_size(), static_cast<int>(expected.size()));
    std::map<std::string, std::string> received;
    for (size_t m = 1; m < call.messages.size(); ++m) {
      const rollout::v1::TensorData& data = call.messages[m].data();
      EXPECT_EQ(data.offset(), received[data.name()].size());
      received[data.name()] += data.data();
    }
    for (size_t k = 0; k < expected.size(); ++k) {
      const std::string name = "t" + std::to_string(expected[k]);
      EXPECT_EQ(header.tensors(k).name(), name);
      EXPECT_TRUE(declared.insert(name).second) << name << " in two parts";
      EXPECT_EQ(received[name], bytes[expected[k]]) << name;
    }
  }
  EXPECT_EQ(peers.size(), 3u) << "the streams shared a connection";
  EXPECT_EQ(indices, (std::set<uint32_t>{0, 1, 2}));
  EXPECT_EQ(declared.size(), sizes.size());
  // A single stream declares no parts.
  ASSERT_TRUE(
      client->UpdateWeightsFromTensors("v8", rollout::v1::IN_FLIGHT_POLICY_ABORT, tensors).ok());
  const rollout::v1::WeightsHeader single = service_.update_calls().back().messages[0].header();
  EXPECT_EQ(single.part_count(), 0u);
  EXPECT_EQ(single.update_id(), "");
  EXPECT_EQ(single.tensors_size(), 5);
  EXPECT_EQ(client
                ->UpdateWeightsFromTensors("v9", rollout::v1::IN_FLIGHT_POLICY_ABORT, tensors, 512,
                                           nullptr, 0)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(RolloutClientTest, UpdateWeightsWithNoChunksSendsOnlyTheHeader) {
  service_.ScriptUnary(*UnaryCaseNamed("UpdateWeights").response, grpc::Status::OK);
  std::unique_ptr<RolloutClient> client = Connect();
  ASSERT_NE(client, nullptr);
  ASSERT_TRUE(
      client->UpdateWeights(HeaderOf("v3"), [](rollout::v1::TensorData*) { return false; }).ok());
  const std::vector<rollout::v1::WeightsChunk> seen = service_.update_messages();
  ASSERT_EQ(seen.size(), 1u);
  EXPECT_EQ(seen[0].header().version(), "v3");
}

TEST_F(RolloutClientTest, UpdateWeightsStopsAskingForChunksWhenTheServerFailsMidStream) {
  // The server rejects the stream after the header and two chunks, without reading the rest.
  service_.ScriptUpdateStream(/*fail_after_messages=*/3);
  service_.ScriptUnary(
      rollout::v1::UpdateWeightsResponse(),
      grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                   "data for 'x' overlaps bytes sent earlier; nothing was applied"));
  std::unique_ptr<RolloutClient> client = Connect();
  ASSERT_NE(client, nullptr);
  // Would go on for ~2 GB; a client that ignores failed writes asks for all of them.
  constexpr int kMaxChunks = 200'000;
  int asked = 0;
  const std::string bytes(10'000, 'x');
  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<rollout::v1::UpdateWeightsResponse> response =
      client->UpdateWeights(HeaderOf("v2"), [&](rollout::v1::TensorData* data) {
        if (asked == kMaxChunks) return false;
        *data = DataOf("model.norm.weight", uint64_t{10'000} * asked++, bytes);
        return true;
      });
  EXPECT_EQ(
      response.status(),
      absl::InvalidArgumentError("data for 'x' overlaps bytes sent earlier; nothing was applied"));
  EXPECT_LT(asked, kMaxChunks);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
  EXPECT_EQ(service_.update_messages().size(), 3u);
}

TEST_F(RolloutClientTest, UpdateWeightsIsAnErrorWhenTheServerSaysOkBeforeTheEnd) {
  // A broken server: it answers OK without reading the whole stream.
  service_.ScriptUpdateStream(/*fail_after_messages=*/1);
  service_.ScriptUnary(*UnaryCaseNamed("UpdateWeights").response, grpc::Status::OK);
  std::unique_ptr<RolloutClient> client = Connect();
  ASSERT_NE(client, nullptr);
  int asked = 0;
  const std::string bytes(10'000, 'x');
  absl::StatusOr<rollout::v1::UpdateWeightsResponse> response =
      client->UpdateWeights(HeaderOf("v2"), [&](rollout::v1::TensorData* data) {
        if (asked == 200'000) return false;
        *data = DataOf("model.norm.weight", uint64_t{10'000} * asked++, bytes);
        return true;
      });
  EXPECT_EQ(response.status().code(), absl::StatusCode::kInternal) << response.status();
  EXPECT_THAT(response.status().message(), HasSubstr("before the whole update stream was sent"));
}

// The tensors each message of an upload carried, reassembled, checking on the way that no
// byte arrived twice; a test failure for a message after the first that is not data.
std::map<std::string, std::string> Reassemble(const std::vector<rollout::v1::WeightsChunk>& seen) {
  std::map<std::string, std::string> bytes;
  std::map<std::string, std::vector<bool>> got;
  for (size_t i = 1; i < seen.size(); ++i) {
    if (!seen[i].has_data()) {
      ADD_FAILURE() << "message " << i << " is not data: " << seen[i].ShortDebugString();
      continue;
    }
    const rollout::v1::TensorData& d = seen[i].data();
    std::string& b = bytes[d.name()];
    std::vector<bool>& g = got[d.name()];
    if (b.size() < d.offset() + d.data().size()) {
      b.resize(d.offset() + d.data().size());
      g.resize(b.size());
    }
    for (size_t j = 0; j < d.data().size(); ++j) {
      EXPECT_FALSE(g[d.offset() + j]) << d.name() << " byte " << d.offset() + j << " twice";
      g[d.offset() + j] = true;
      b[d.offset() + j] = d.data()[j];
    }
  }
  for (const auto& [name, g] : got) {
    for (size_t j = 0; j < g.size(); ++j) EXPECT_TRUE(g[j]) << name << " byte " << j << " missing";
  }
  return bytes;
}

TEST_F(RolloutClientTest, UpdateWeightsFromTensorsCoversEveryByteOnceInBoundedChunks) {
  service_.ScriptUnary(*UnaryCaseNamed("UpdateWeights").response, grpc::Status::OK);
  std::unique_ptr<RolloutClient> client = Connect();
  ASSERT_NE(client, nullptr);
  const std::string a = "0123456789", c = "abcdefg", d = "XYZ";
  auto p = [](const std::string& s) { return reinterpret_cast<const uint8_t*>(s.data()); };
  const std::vector<TensorSource> tensors = {
      {"a", "F16", {5}, p(a), a.size()},
      {"empty", "F32", {0, 4}, nullptr, 0},   // declared, but no (empty) chunk is sent
      {"c", "BF16", {7, 1}, p(c), c.size()},  // odd sizes don't matter to the client
      {"d", "BF16", {3}, p(d), d.size()},
  };
  std::vector<std::pair<uint64_t, uint64_t>> progress;
  absl::StatusOr<rollout::v1::UpdateWeightsResponse> response = client->UpdateWeightsFromTensors(
      "v9", rollout::v1::IN_FLIGHT_POLICY_ABORT, tensors, /*chunk_bytes=*/4,
      [&](uint64_t sent, uint64_t total) { progress.emplace_back(sent, total); });
  ASSERT_TRUE(response.ok()) << response.status();

  const std::vector<rollout::v1::WeightsChunk> seen = service_.update_messages();
  ASSERT_FALSE(seen.empty());
  ASSERT_TRUE(seen[0].has_header());
  const rollout::v1::WeightsHeader& header = seen[0].header();
  EXPECT_EQ(header.version(), "v9");
  EXPECT_EQ(header.policy(), rollout::v1::IN_FLIGHT_POLICY_ABORT);
  ASSERT_EQ(header.tensors_size(), 4);
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(header.tensors(i).name(), tensors[i].name);
    EXPECT_EQ(header.tensors(i).dtype(), tensors[i].dtype);
    EXPECT_THAT(header.tensors(i).shape(), ::testing::ElementsAreArray(tensors[i].shape));
  }
  // Tensor by tensor, at most 4 bytes each, never spanning two tensors.
  std::vector<std::string> layout;
  for (size_t i = 1; i < seen.size(); ++i) {
    layout.push_back(absl::StrCat(seen[i].data().name(), "@", seen[i].data().offset(), "+",
                                  seen[i].data().data().size()));
  }
  EXPECT_THAT(layout, ::testing::ElementsAre("a@0+4", "a@4+4", "a@8+2", "c@0+4", "c@4+3", "d@0+3"));
  EXPECT_THAT(Reassemble(seen),
              ::testing::ElementsAre(::testing::Pair("a", a), ::testing::Pair("c", c),
                                     ::testing::Pair("d", d)));
  using P = std::pair<uint64_t, uint64_t>;
  EXPECT_THAT(progress, ::testing::ElementsAre(P{0, 20}, P{4, 20}, P{8, 20}, P{10, 20}, P{14, 20},
                                               P{17, 20}, P{20, 20}));
}

TEST_F(RolloutClientTest, UpdateWeightsFromTensorsReturnsAnEarlyRefusalWhileChunksAreQueued) {
  // The server refuses the header without reading on, as it does a checkpoint of other shapes.
  // The client's chunk slices that gRPC still holds must not keep it from returning the answer.
  service_.ScriptUpdateStream(/*fail_after_messages=*/1);
  service_.ScriptUnary(rollout::v1::UpdateWeightsResponse(),
                       grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                                    "tensor 'w': shape [8, 8] given; nothing was applied"));
  std::unique_ptr<RolloutClient> client = Connect();
  ASSERT_NE(client, nullptr);
  const std::string bytes(64 << 20, 'w');
  const auto* base = reinterpret_cast<const uint8_t*>(bytes.data());
  const std::vector<TensorSource> tensors = {
      {"w", "BF16", {bytes.size() / 4}, base, bytes.size() / 2},
      {"v", "BF16", {bytes.size() / 4}, base + bytes.size() / 2, bytes.size() / 2}};
  for (int streams : {1, 2}) {
    std::promise<absl::Status> done;
    std::future<absl::Status> result = done.get_future();
    std::thread([&client, &tensors, &done, streams] {
      done.set_value(client
                         ->UpdateWeightsFromTensors("v2", rollout::v1::IN_FLIGHT_POLICY_DRAIN,
                                                    tensors, /*chunk_bytes=*/1 << 20, nullptr,
                                                    streams)
                         .status());
    }).detach();
    if (result.wait_for(std::chrono::seconds(30)) != std::future_status::ready) {
      // Nothing to join or clean: the call is stuck.
      std::cerr << "UpdateWeightsFromTensors over " << streams
                << " stream(s) did not return within 30 s of the server's refusal\n";
      std::_Exit(1);
    }
    EXPECT_EQ(result.get(),
              absl::InvalidArgumentError("tensor 'w': shape [8, 8] given; nothing was applied"))
        << streams << " stream(s)";
  }
}

TEST_F(RolloutClientTest, UpdateWeightsFromTensorsRejectsBadInputWithoutCallingTheServer) {
  std::unique_ptr<RolloutClient> client = Connect();
  ASSERT_NE(client, nullptr);
  const uint8_t byte = 1;
  EXPECT_EQ(client
                ->UpdateWeightsFromTensors("v", rollout::v1::IN_FLIGHT_POLICY_DRAIN,
                                           {{"w", "F32", {1}, &byte, 1}}, /*chunk_bytes=*/0)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  // 64 MiB of data and the chunk's fields are more than the server takes in one message.
  const absl::Status too_big =
      client
          ->UpdateWeightsFromTensors("v", rollout::v1::IN_FLIGHT_POLICY_DRAIN,
                                     {{"w", "F32", {1}, &byte, 1}}, /*chunk_bytes=*/64 << 20)
          .status();
  EXPECT_EQ(too_big.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(too_big.message(), HasSubstr("give 1 to 66060288"));
  absl::Status no_data = client
                             ->UpdateWeightsFromTensors("v", rollout::v1::IN_FLIGHT_POLICY_DRAIN,
                                                        {{"w", "F32", {1}, nullptr, 4}})
                             .status();
  EXPECT_EQ(no_data.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(no_data.message(), HasSubstr("'w'"));
  EXPECT_EQ(service_.calls(), 0);
}

// ---- UpdateWeightsFromCheckpoint ------------------------------------------------------------

// A fresh, empty directory under the test's temp dir.
std::string MakeTempDir(const std::string& name) {
  std::string dir = ::testing::TempDir() + "/client_test_" + name + "_" + std::to_string(getpid());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

// GetServerInfo's model as a server of `config` reports it.
rollout::v1::ServerInfo InfoServing(const ModelConfig& config) {
  rollout::v1::ServerInfo info;
  rollout::v1::ModelInfo* m = info.mutable_model();
  m->set_architecture(config.architecture);
  m->set_num_layers(config.num_layers);
  m->set_hidden_size(config.hidden_size);
  m->set_intermediate_size(config.intermediate_size);
  m->set_num_attention_heads(config.num_attention_heads);
  m->set_num_key_value_heads(config.num_key_value_heads);
  m->set_head_dim(config.head_dim);
  m->set_vocab_size(config.vocab_size);
  m->set_tie_word_embeddings(config.tie_word_embeddings);
  m->set_num_experts(config.num_experts);
  m->set_num_experts_per_tok(config.num_experts_per_tok);
  m->set_moe_intermediate_size(config.moe_intermediate_size);
  for (int32_t layer : config.MoeLayers()) m->add_moe_layers(layer);
  return info;
}

TEST_F(RolloutClientTest, UpdateWeightsFromCheckpointStreamsEveryTensorOfTheServedModel) {
  const std::string dir = MakeTempDir("ckpt");
  RandomModelOptions options;
  options.preset = "tiny";
  options.tie_word_embeddings = true;
  ASSERT_TRUE(WriteRandomModel(options, dir).ok());
  absl::StatusOr<std::unique_ptr<Checkpoint>> checkpoint = Checkpoint::Open(dir);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
  absl::StatusOr<ModelConfig> config = ReadModelConfig(**checkpoint);
  ASSERT_TRUE(config.ok()) << config.status();
  // A tensor the served model does not have (a tied model's lm_head, as the Hub often ships
  // one) stays home.
  std::vector<HostTensor> written;
  for (const std::string& name : (*checkpoint)->TensorNames()) {
    const TensorView* v = (*checkpoint)->Find(name);
    written.push_back(
        {name, v->dtype, v->shape, std::vector<uint8_t>(v->data, v->data + v->nbytes)});
  }
  checkpoint->reset();
  HostTensor extra = written.front();
  extra.name = "lm_head.weight";
  written.push_back(extra);
  ASSERT_TRUE(WriteSafetensors(dir + "/model.safetensors", written).ok());

  service_.ScriptServerInfo(InfoServing(*config));
  service_.ScriptUnary(*UnaryCaseNamed("UpdateWeights").response, grpc::Status::OK);
  std::unique_ptr<RolloutClient> client = Connect();
  ASSERT_NE(client, nullptr);
  uint64_t last_sent = 0, last_total = 0;
  absl::StatusOr<rollout::v1::UpdateWeightsResponse> response =
      UpdateWeightsFromCheckpoint(*client, dir, "step-7", rollout::v1::IN_FLIGHT_POLICY_CONTINUE,
                                  /*chunk_bytes=*/4096, [&](uint64_t sent, uint64_t total) {
                                    EXPECT_GE(sent, last_sent);
                                    last_sent = sent;
                                    last_total = total;
                                  });
  ASSERT_TRUE(response.ok()) << response.status();
  uint64_t model_bytes = 0;
  std::map<std::string, std::string> expected;
  for (const HostTensor& t : written) {
    if (t.name == "lm_head.weight") continue;
    model_bytes += t.bytes.size();
    expected[t.name].assign(t.bytes.begin(), t.bytes.end());
  }
  EXPECT_EQ(last_sent, model_bytes);
  EXPECT_EQ(last_total, model_bytes);

  const std::vector<rollout::v1::WeightsChunk> seen = service_.update_messages();
  ASSERT_FALSE(seen.empty());
  ASSERT_TRUE(seen[0].has_header());
  EXPECT_EQ(seen[0].header().version(), "step-7");
  EXPECT_EQ(seen[0].header().policy(), rollout::v1::IN_FLIGHT_POLICY_CONTINUE);
  // Every tensor of the model, in name order, with the safetensors dtype names the server
  // expects.
  std::vector<std::string> decls, want;
  for (const rollout::v1::TensorDecl& decl : seen[0].header().tensors()) {
    decls.push_back(
        absl::StrCat(decl.name(), " ", decl.dtype(), " ", absl::StrJoin(decl.shape(), "x")));
  }
  for (const TensorSpec& spec : ExpectedTensors(*config)) {
    want.push_back(absl::StrCat(spec.name, " BF16 ", absl::StrJoin(spec.shape, "x")));
  }
  std::sort(want.begin(), want.end());
  EXPECT_EQ(decls, want);
  for (size_t i = 1; i < seen.size(); ++i) EXPECT_LE(seen[i].data().data().size(), 4096u) << i;
  EXPECT_EQ(Reassemble(seen), expected);
  std::filesystem::remove_all(dir);
}

TEST_F(RolloutClientTest, UpdateWeightsFromCheckpointRefusesAnotherModelBeforeSending) {
  const std::string dir = MakeTempDir("other_ckpt");
  RandomModelOptions options;
  options.preset = "tiny";
  ASSERT_TRUE(WriteRandomModel(options, dir).ok());
  absl::StatusOr<ModelConfig> tiny = PresetConfig("tiny");
  ASSERT_TRUE(tiny.ok());
  struct Case {
    std::string name;
    std::function<void(rollout::v1::ModelInfo*)> serve;
    std::string expect;
  };
  const std::vector<Case> cases = {
      {"architecture", [](rollout::v1::ModelInfo* m) { m->set_architecture("LlamaForCausalLM"); },
       "has architecture Qwen3ForCausalLM; the served model has LlamaForCausalLM"},
      {"hidden size", [](rollout::v1::ModelInfo* m) { m->set_hidden_size(2048); }, "hidden_size"},
      {"layers", [](rollout::v1::ModelInfo* m) { m->set_num_layers(48); }, "num_hidden_layers"},
      {"experts", [](rollout::v1::ModelInfo* m) { m->set_num_experts(8); }, "num_experts"},
      {"tied embeddings",
       [](rollout::v1::ModelInfo* m) { m->set_tie_word_embeddings(!m->tie_word_embeddings()); },
       "tie_word_embeddings"},
  };
  std::unique_ptr<RolloutClient> client = Connect();
  ASSERT_NE(client, nullptr);
  for (const Case& c : cases) {
    rollout::v1::ServerInfo info = InfoServing(*tiny);
    c.serve(info.mutable_model());
    service_.ScriptServerInfo(info);
    const int calls = service_.calls();
    absl::StatusOr<rollout::v1::UpdateWeightsResponse> response =
        UpdateWeightsFromCheckpoint(*client, dir, "v", rollout::v1::IN_FLIGHT_POLICY_DRAIN);
    EXPECT_EQ(response.status().code(), absl::StatusCode::kFailedPrecondition) << c.name;
    EXPECT_THAT(response.status().message(), HasSubstr(c.expect)) << c.name;
    EXPECT_THAT(response.status().message(), HasSubstr(dir + "/config.json")) << c.name;
    EXPECT_EQ(service_.calls(), calls + 1) << c.name << ": more than GetServerInfo was called";
  }
  // The model's config, but a tensor of it missing.
  {
    absl::StatusOr<std::unique_ptr<Checkpoint>> checkpoint = Checkpoint::Open(dir);
    ASSERT_TRUE(checkpoint.ok());
    std::vector<HostTensor> kept;
    for (const std::string& name : (*checkpoint)->TensorNames()) {
      if (name == "model.layers.0.self_attn.k_norm.weight") continue;
      const TensorView* v = (*checkpoint)->Find(name);
      kept.push_back(
          {name, v->dtype, v->shape, std::vector<uint8_t>(v->data, v->data + v->nbytes)});
    }
    checkpoint->reset();
    ASSERT_TRUE(WriteSafetensors(dir + "/model.safetensors", kept).ok());
  }
  service_.ScriptServerInfo(InfoServing(*tiny));
  const int calls = service_.calls();
  absl::StatusOr<rollout::v1::UpdateWeightsResponse> response =
      UpdateWeightsFromCheckpoint(*client, dir, "v", rollout::v1::IN_FLIGHT_POLICY_DRAIN);
  EXPECT_EQ(response.status().code(), absl::StatusCode::kFailedPrecondition) << response.status();
  EXPECT_THAT(response.status().message(),
              HasSubstr("lacks tensor 'model.layers.0.self_attn.k_norm.weight'"));
  EXPECT_EQ(service_.calls(), calls + 1);
  std::filesystem::remove_all(dir);
}

TEST_F(RolloutClientTest, UpdateWeightsFromCheckpointFailsBeforeSendingWhenItCannotOpenTheDir) {
  std::unique_ptr<RolloutClient> client = Connect();
  ASSERT_NE(client, nullptr);
  const std::string dir = MakeTempDir("no_ckpt");  // exists, but holds no checkpoint
  absl::StatusOr<rollout::v1::UpdateWeightsResponse> response =
      UpdateWeightsFromCheckpoint(*client, dir, "v", rollout::v1::IN_FLIGHT_POLICY_DRAIN);
  EXPECT_EQ(response.status().code(), absl::StatusCode::kNotFound) << response.status();
  EXPECT_THAT(response.status().message(), HasSubstr(dir));
  EXPECT_EQ(service_.calls(), 0);
  std::filesystem::remove_all(dir);
}

// ---- mutual TLS options ---------------------------------------------------------------------

TEST(ConnectTest, RejectsAClientCertWithoutItsKeyAndViceVersa) {
  ClientOptions cert_only;
  cert_only.tls_client_cert_path = "/some/client.pem";
  absl::Status status = RolloutClient::Connect("127.0.0.1:1", cert_only).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("private key"));

  ClientOptions key_only;
  key_only.tls_client_key_path = "/some/client.key";
  status = RolloutClient::Connect("127.0.0.1:1", key_only).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("certificate"));
}

TEST(ConnectTest, FailsNamingTheClientCertOrKeyFileThatIsMissingOrEmpty) {
  const std::string dir = MakeTempDir("tls");
  const std::string empty = dir + "/empty.pem", present = dir + "/present.pem";
  { std::ofstream(empty).flush(); }
  { std::ofstream(present) << "-----BEGIN CERTIFICATE-----\n"; }
  ClientOptions options;
  options.connect_timeout = std::chrono::milliseconds(100);
  options.tls_client_cert_path = dir + "/missing.pem";
  options.tls_client_key_path = present;
  absl::Status status = RolloutClient::Connect("127.0.0.1:1", options).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(status.message(), HasSubstr("TLS client cert file " + dir + "/missing.pem"));

  options.tls_client_cert_path = present;
  options.tls_client_key_path = empty;
  status = RolloutClient::Connect("127.0.0.1:1", options).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("TLS client key file " + empty + " is empty"));
  std::filesystem::remove_all(dir);
}

TEST(ConnectTest, AClientCertAloneTurnsTlsOn) {
  // A plaintext server: a TLS client cannot complete the handshake, so Connect times out,
  // where a plaintext client would connect.
  rollout::v1::RolloutService::Service bare_service;
  std::string target;
  std::unique_ptr<grpc::Server> server = StartLoopbackServer(&bare_service, &target);
  ASSERT_NE(server, nullptr);
  ClientOptions plain;
  plain.connect_timeout = std::chrono::milliseconds(2000);
  EXPECT_TRUE(RolloutClient::Connect(target, plain).ok());

  const std::string dir = MakeTempDir("tls_on");
  { std::ofstream(dir + "/c.pem") << "-----BEGIN CERTIFICATE-----\n"; }
  { std::ofstream(dir + "/k.pem") << "-----BEGIN PRIVATE KEY-----\n"; }
  ClientOptions tls = plain;
  tls.connect_timeout = std::chrono::milliseconds(500);
  tls.tls_client_cert_path = dir + "/c.pem";
  tls.tls_client_key_path = dir + "/k.pem";
  EXPECT_EQ(RolloutClient::Connect(target, tls).status().code(), absl::StatusCode::kUnavailable);
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  std::filesystem::remove_all(dir);
}

void WriteTextFile(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
  ASSERT_TRUE(out.good()) << path;
}

TEST(MutualTlsTest, TheClientCertificateIsPresentedToAServerThatRequiresOne) {
  grpc::SslServerCredentialsOptions ssl(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  ssl.pem_root_certs = kTestCaPem;
  ssl.pem_key_cert_pairs.push_back({kTestServerKey, kTestServerPem});
  ScriptedService service;
  std::string target;
  std::unique_ptr<grpc::Server> server =
      StartLoopbackServer(&service, &target, grpc::SslServerCredentials(ssl));
  ASSERT_NE(server, nullptr);

  const std::string dir = MakeTempDir("mtls");
  WriteTextFile(dir + "/ca.pem", kTestCaPem);
  WriteTextFile(dir + "/client.pem", kTestClientPem);
  WriteTextFile(dir + "/client.key", kTestClientKey);
  ClientOptions options;
  options.connect_timeout = std::chrono::milliseconds(5000);
  options.tls_root_cert_path = dir + "/ca.pem";
  options.tls_client_cert_path = dir + "/client.pem";
  options.tls_client_key_path = dir + "/client.key";
  absl::StatusOr<std::unique_ptr<RolloutClient>> client = RolloutClient::Connect(target, options);
  ASSERT_TRUE(client.ok()) << client.status();
  absl::StatusOr<rollout::v1::ServerInfo> info = (*client)->GetServerInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->weight_version(), "w-7");

  // The same server turns away a client that trusts it but has no certificate of its own.
  ClientOptions no_client_cert;
  no_client_cert.connect_timeout = std::chrono::milliseconds(1000);
  no_client_cert.tls_root_cert_path = dir + "/ca.pem";
  EXPECT_EQ(RolloutClient::Connect(target, no_client_cert).status().code(),
            absl::StatusCode::kUnavailable);
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  std::filesystem::remove_all(dir);
}

TEST(UnaryCallsAgainstAnOlderServerTest, AnswerUnimplemented) {
  // The generated base service answers UNIMPLEMENTED for every method, like a server built
  // before these RPCs existed.
  rollout::v1::RolloutService::Service bare_service;
  std::string target;
  std::unique_ptr<grpc::Server> server = StartLoopbackServer(&bare_service, &target);
  ASSERT_NE(server, nullptr);
  absl::StatusOr<std::unique_ptr<RolloutClient>> client =
      RolloutClient::Connect(target, ClientOptions());
  ASSERT_TRUE(client.ok()) << client.status();
  for (const UnaryCase& c : UnaryCases()) {
    EXPECT_EQ(c.call(**client).status().code(), absl::StatusCode::kUnimplemented) << c.name;
  }
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
}

}  // namespace
}  // namespace rollout
