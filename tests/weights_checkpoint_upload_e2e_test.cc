// The C++ client's weight uploads against the real server, where a user found them wrong: a
// checkpoint of another model streamed as if it were the served one (a Llama directory onto a
// Qwen3 server once updated the 39 tensors whose names the two share and kept the rest), and a
// refused stream whose unsent chunks kept rollout-cli update-weights waiting for ever.
#include <chrono>
#include <filesystem>
#include <fstream>
#include <future>
#include <iostream>
#include <iterator>
#include <string>
#include <thread>
#include <vector>

#include "client/checkpoint_upload.h"
#include "client/rollout_client.h"
#include "gtest/gtest.h"
#include "model/random_model.h"
#include "tests/reliability_util.h"
#include "tests/test_server.h"

namespace rollout::testing {
namespace {

namespace rel = ::rollout::testing::reliability;

std::unique_ptr<RolloutClient> ConnectTo(const TestServer& server) {
  absl::StatusOr<std::unique_ptr<RolloutClient>> client =
      RolloutClient::Connect(server.address(), ClientOptions());
  EXPECT_TRUE(client.ok()) << client.status();
  return client.ok() ? *std::move(client) : nullptr;
}

TEST(WeightsCheckpointUploadE2eTest, ACheckpointOfAnotherModelIsRefusedBeforeAnythingIsSent) {
  std::unique_ptr<TestServer> server = StartTestServer();
  ASSERT_NE(server, nullptr);
  std::unique_ptr<RolloutClient> client = ConnectTo(*server);
  ASSERT_NE(client, nullptr);
  const v1::ServerInfo before = rel::FetchServerInfo(server->stub.get());
  ASSERT_EQ(before.model().architecture(), "Qwen3ForCausalLM");
  const struct {
    std::string preset, expect;
  } cases[] = {
      // Its tensor names are a subset of Qwen3's (no q/k norms); the shapes match.
      {"llama3-small", "has architecture LlamaForCausalLM; the served model has Qwen3ForCausalLM"},
      {"tiny", "has num_hidden_layers 2; the served model has 4"},
  };
  for (const auto& c : cases) {
    absl::StatusOr<std::string> dir = TestPresetDir(c.preset);
    ASSERT_TRUE(dir.ok()) << dir.status();
    absl::StatusOr<v1::UpdateWeightsResponse> pushed =
        UpdateWeightsFromCheckpoint(*client, *dir, "other", v1::IN_FLIGHT_POLICY_DRAIN);
    EXPECT_EQ(pushed.status().code(), absl::StatusCode::kFailedPrecondition) << pushed.status();
    EXPECT_NE(pushed.status().message().find(c.expect), std::string::npos) << pushed.status();
    const v1::ServerInfo after = rel::FetchServerInfo(server->stub.get());
    EXPECT_EQ(after.weight_version(), before.weight_version()) << c.preset;
    EXPECT_EQ(after.weight_digest(), before.weight_digest()) << c.preset;
    EXPECT_EQ(after.counters().weight_updates(), 0u) << c.preset;
  }
  // The served model's own checkpoint goes through.
  absl::StatusOr<v1::UpdateWeightsResponse> same = UpdateWeightsFromCheckpoint(
      *client, server->server->model_dir(), "same", v1::IN_FLIGHT_POLICY_DRAIN);
  ASSERT_TRUE(same.ok()) << same.status();
  EXPECT_EQ(same->tensors_updated(), 47u);
  EXPECT_EQ(rel::FetchServerInfo(server->stub.get()).weight_digest(), before.weight_digest());
}

// The same verdict when the server reads the directory itself (UpdateWeightsFromPath): it read
// only the tensors, so a config.json of another model -- or one that was not JSON -- over
// tensors of the served names and shapes was applied (review26 finding 3).
TEST(WeightsCheckpointUploadE2eTest, UpdateWeightsFromPathRefusesACheckpointOfAnotherModel) {
  std::unique_ptr<TestServer> server = StartTestServer();
  ASSERT_NE(server, nullptr);
  const v1::ServerInfo before = rel::FetchServerInfo(server->stub.get());
  auto from_path = [&](const std::string& dir) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    v1::UpdateWeightsFromPathRequest request;
    request.set_path(dir);
    request.set_version("other");
    v1::UpdateWeightsResponse response;
    return server->stub->UpdateWeightsFromPath(&context, request, &response);
  };
  // The served model's own tensors under a config.json that says something else.
  const std::string served_dir = server->server->model_dir();
  std::ifstream config_in(served_dir + "/config.json");
  const std::string config((std::istreambuf_iterator<char>(config_in)),
                           std::istreambuf_iterator<char>());
  auto with_config = [&](const std::string& name, const std::string& text) {
    const std::string dir = ::testing::TempDir() + "path-config-" + name;
    std::filesystem::create_directories(dir);
    std::filesystem::copy_file(served_dir + "/model.safetensors", dir + "/model.safetensors",
                               std::filesystem::copy_options::overwrite_existing);
    std::ofstream(dir + "/config.json") << text;
    return dir;
  };
  auto replaced = [&](const std::string& from, const std::string& to) {
    std::string text = config;
    const size_t at = text.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    return at == std::string::npos ? text : text.replace(at, from.size(), to);
  };
  absl::StatusOr<std::string> llama = TestPresetDir("llama3-small");
  ASSERT_TRUE(llama.ok()) << llama.status();
  const struct {
    std::string dir;
    grpc::StatusCode code;
    std::string expect;
  } cases[] = {
      {*llama, grpc::StatusCode::FAILED_PRECONDITION,
       "has architecture LlamaForCausalLM; the served model has Qwen3ForCausalLM"},
      {with_config("arch", replaced("Qwen3ForCausalLM", "LlamaForCausalLM")),
       grpc::StatusCode::FAILED_PRECONDITION, "has architecture LlamaForCausalLM"},
      {with_config("layers", replaced("\"num_hidden_layers\": 4", "\"num_hidden_layers\": 3")),
       grpc::StatusCode::FAILED_PRECONDITION, "has num_hidden_layers 3; the served model has 4"},
      {with_config("text", "this is not json"), grpc::StatusCode::INVALID_ARGUMENT, "config.json"},
  };
  for (const auto& c : cases) {
    const grpc::Status s = from_path(c.dir);
    EXPECT_EQ(s.error_code(), c.code) << c.dir << ": " << s.error_message();
    EXPECT_NE(s.error_message().find(c.expect), std::string::npos) << s.error_message();
    EXPECT_NE(s.error_message().find("nothing was applied"), std::string::npos)
        << s.error_message();
    const v1::ServerInfo after = rel::FetchServerInfo(server->stub.get());
    EXPECT_EQ(after.weight_version(), before.weight_version()) << c.dir;
    EXPECT_EQ(after.counters().weight_updates(), 0u) << c.dir;
  }
  // The served model's own directory goes through.
  EXPECT_TRUE(from_path(served_dir).ok());
}

// A policy number that is not an InFlightPolicy is refused on the path update too (it ran as
// DRAIN: review26 finding 5), before the update slot is taken.
TEST(WeightsCheckpointUploadE2eTest, UpdateWeightsFromPathRefusesAPolicyThatIsNotOne) {
  std::unique_ptr<TestServer> server = StartTestServer();
  ASSERT_NE(server, nullptr);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  v1::UpdateWeightsFromPathRequest request;
  request.set_path(server->server->model_dir());
  request.set_version("p42");
  request.set_policy(static_cast<v1::InFlightPolicy>(42));
  v1::UpdateWeightsResponse response;
  const grpc::Status s = server->stub->UpdateWeightsFromPath(&context, request, &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_NE(s.error_message().find("policy is 42, not an InFlightPolicy"), std::string::npos)
      << s.error_message();
  EXPECT_EQ(rel::FetchServerInfo(server->stub.get()).counters().weight_updates(), 0u);
}

TEST(WeightsCheckpointUploadE2eTest, AStreamRefusedAtItsHeaderReturnsTheRefusalAtOnce) {
  std::unique_ptr<TestServer> server = StartTestServer();
  ASSERT_NE(server, nullptr);
  std::unique_ptr<RolloutClient> client = ConnectTo(*server);
  ASSERT_NE(client, nullptr);
  // 64 MiB declared in another shape than the served embedding's: the server answers after the
  // header, while most chunks are still queued in the client.
  const std::vector<uint8_t> bytes(size_t{64} << 20, 0);
  const std::vector<TensorSource> tensors = {
      {"model.embed_tokens.weight", "BF16", {16384, 2048}, bytes.data(), bytes.size()}};
  std::promise<absl::Status> done;
  std::future<absl::Status> result = done.get_future();
  std::thread([&] {
    done.set_value(client
                       ->UpdateWeightsFromTensors("wrong", v1::IN_FLIGHT_POLICY_DRAIN, tensors,
                                                  /*chunk_bytes=*/1 << 20)
                       .status());
  }).detach();
  if (result.wait_for(std::chrono::seconds(60)) != std::future_status::ready) {
    std::cerr << "UpdateWeightsFromTensors did not return within 60 s of the refusal\n";
    std::_Exit(1);  // nothing to join: the call is stuck
  }
  const absl::Status status = result.get();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_NE(status.message().find("shape [16384, 2048] given"), std::string::npos) << status;
  EXPECT_EQ(rel::FetchServerInfo(server->stub.get()).weight_version(), "0");
}

}  // namespace
}  // namespace rollout::testing
