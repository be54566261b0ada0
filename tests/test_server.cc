#include "tests/test_server.h"

#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "grpcpp/create_channel.h"
#include "gtest/gtest.h"
#include "model/random_model.h"

namespace rollout::testing {

absl::StatusOr<std::string> TestPresetDir(const std::string& preset) {
  static std::mutex mu;
  static std::map<std::string, std::string>* written = new std::map<std::string, std::string>();
  std::lock_guard<std::mutex> lock(mu);
  if (auto it = written->find(preset); it != written->end()) return it->second;
  const std::string dir = ::testing::TempDir() + "rollout-test-preset-" + preset;
  RandomModelOptions options;
  options.preset = preset;
  if (absl::Status s = WriteRandomModel(options, dir); !s.ok()) return s;
  (*written)[preset] = dir;
  return dir;
}

std::unique_ptr<TestServer> StartTestServer(ServerOptions options) {
  // One model cache per test binary, so tests never depend on the user's cache.
  static const bool cache_set = [] {
    setenv("ROLLOUT_CACHE_DIR", (::testing::TempDir() + "rollout-test-cache").c_str(), 1);
    return true;
  }();
  (void)cache_set;
  if (options.address == ServerOptions().address) options.address = "127.0.0.1:0";
  // ROLLOUT_TEST_PRESET=<preset> serves that preset (seed 0) instead of the embedded default
  // model wherever a test leaves model_dir empty: the determinism suite runs on moe-small so.
  if (const char* preset = std::getenv("ROLLOUT_TEST_PRESET");
      preset != nullptr && *preset && options.model_dir.empty()) {
    absl::StatusOr<std::string> dir = TestPresetDir(preset);
    EXPECT_TRUE(dir.ok()) << dir.status();
    if (!dir.ok()) return nullptr;
    options.model_dir = *dir;
  }
  // ROLLOUT_TEST_BACKEND=cuda runs the suites against the CUDA backend (on a GPU host), with the
  // limits a test did not set at the CPU backend's small defaults on either backend: the suites
  // start several servers at once, and their expectations are sized for those limits.
  if (const char* backend = std::getenv("ROLLOUT_TEST_BACKEND"); backend != nullptr && *backend) {
    options = WithBackendDefaults(options);
    options.backend = backend;
    // ROLLOUT_TEST_CUDA_SPREAD=1 (a host with several GPUs): a server of TP degree d > 1 puts
    // rank r on GPU r (--cuda_devices 0..d-1, through NCCL) instead of d streams of GPU 0.
    if (const char* spread = std::getenv("ROLLOUT_TEST_CUDA_SPREAD");
        spread != nullptr && std::string(spread) == "1" && options.tensor_parallel > 1 &&
        options.cuda_devices.empty()) {
      for (int r = 0; r < options.tensor_parallel; ++r) options.cuda_devices.push_back(r);
    }
  }
  auto t = std::make_unique<TestServer>();
  absl::StatusOr<std::unique_ptr<RolloutServer>> server = RolloutServer::Start(options);
  EXPECT_TRUE(server.ok()) << server.status();
  if (!server.ok()) return nullptr;
  t->server = *std::move(server);
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(256 << 20);
  t->channel = grpc::CreateCustomChannel(t->address(), grpc::InsecureChannelCredentials(), args);
  t->stub = v1::RolloutService::NewStub(t->channel);
  return t;
}

GenerateOutcome RunGenerate(v1::RolloutService::Stub* stub, const v1::GenerateRequest& request) {
  GenerateOutcome out;
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(300));
  auto reader = stub->Generate(&context, request);
  v1::GenerateResponse response;
  out.completions.resize(request.rollouts_size());
  for (int i = 0; i < request.rollouts_size(); ++i) {
    out.completions[i].resize(std::max<uint32_t>(1, request.rollouts(i).num_samples()));
  }
  while (reader->Read(&response)) {
    if (response.has_completion()) {
      const v1::Completion& c = response.completion();
      EXPECT_LT(c.rollout_index(), out.completions.size());
      if (c.rollout_index() < out.completions.size() &&
          c.sample_index() < out.completions[c.rollout_index()].size()) {
        out.completions[c.rollout_index()][c.sample_index()] = c;
      }
    }
    out.responses.push_back(response);
  }
  out.status = reader->Finish();
  return out;
}

v1::RolloutRequest MakeRollout(const std::vector<uint32_t>& prompt, uint64_t seed,
                               uint32_t max_new_tokens, float temperature, std::string id) {
  v1::RolloutRequest r;
  r.set_request_id(std::move(id));
  for (uint32_t t : prompt) r.add_prompt_token_ids(t);
  r.set_seed(seed);
  r.mutable_sampling()->set_max_new_tokens(max_new_tokens);
  r.mutable_sampling()->set_temperature(temperature);
  return r;
}

std::string Fingerprint(const v1::Completion& completion) {
  std::string out;
  for (uint32_t t : completion.token_ids()) absl::StrAppend(&out, t, ",");
  absl::StrAppend(&out, "|");
  for (float lp : completion.logprobs()) {
    uint32_t bits;
    std::memcpy(&bits, &lp, sizeof(bits));
    absl::StrAppend(&out, absl::Hex(bits), ",");
  }
  absl::StrAppend(&out, "|", completion.finish_reason());
  return out;
}

}  // namespace rollout::testing
