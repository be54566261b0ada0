#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "gtest/gtest.h"
#include "rollout/v1/rollout.grpc.pb.h"
#include "server/server.h"

namespace rollout::testing {

// A real rollout server on a free loopback port, serving the embedded default model (written
// once per test binary under a temp cache dir), plus a stub connected to it.
struct TestServer {
  std::unique_ptr<RolloutServer> server;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::RolloutService::Stub> stub;

  std::string address() const { return "127.0.0.1:" + std::to_string(server->port()); }
};

// A directory holding `preset` (model/random_model.h) with seed 0, written once per test binary.
absl::StatusOr<std::string> TestPresetDir(const std::string& preset);

// Starts a server with `options` (address and model default to loopback:0 and the default
// model, or ROLLOUT_TEST_PRESET's preset when that is set). Fails the calling test on error.
std::unique_ptr<TestServer> StartTestServer(ServerOptions options = {});

// A fixture whose tests share one server started with the default options (per test binary
// run; ctest runs each test in its own process).
class SharedServerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { server_ = StartTestServer().release(); }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
  }
  static v1::RolloutService::Stub* stub() { return server_->stub.get(); }

  static inline TestServer* server_ = nullptr;
};

// The result of one Generate call, as a client sees it.
struct GenerateOutcome {
  grpc::Status status;
  std::vector<v1::GenerateResponse> responses;
  // completions[rollout][sample]; filled from the responses.
  std::vector<std::vector<v1::Completion>> completions;
};

GenerateOutcome RunGenerate(v1::RolloutService::Stub* stub, const v1::GenerateRequest& request);

// A rollout with the given prompt, seed and sampling; max_new_tokens set, others unset.
v1::RolloutRequest MakeRollout(const std::vector<uint32_t>& prompt, uint64_t seed,
                               uint32_t max_new_tokens, float temperature, std::string id = "");

// Tokens and logprob bits of a completion, for bitwise comparison.
std::string Fingerprint(const v1::Completion& completion);

}  // namespace rollout::testing
