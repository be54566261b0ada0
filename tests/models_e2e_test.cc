// End-to-end on the models RL users train beyond the default Qwen3: Llama 3.1-style and YaRN
// RoPE scaling, generation_config.json's EOS ids, F32 checkpoints served as BF16. Real servers
// on loopback, driven through the real gRPC stack.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "model/random_model.h"
#include "nlohmann/json.hpp"
#include "tests/naive_model.h"
#include "tests/test_server.h"

namespace rollout::testing {
namespace {

const std::vector<uint32_t> kPrompt = {11, 42, 7, 300, 1999, 5, 64, 812};

// A fresh directory holding `preset` written with `seed` (and `dtype`).
std::string WriteModel(const std::string& name, const std::string& preset, uint64_t seed,
                       DType dtype = DType::kBF16) {
  const std::string dir = ::testing::TempDir() + "models-e2e/" + name;
  std::filesystem::remove_all(dir);
  RandomModelOptions options;
  options.preset = preset;
  options.seed = seed;
  options.dtype = dtype;
  EXPECT_TRUE(WriteRandomModel(options, dir).ok());
  return dir;
}

// Rewrites one top-level field of dir/config.json.
void EditConfig(const std::string& dir, const std::function<void(nlohmann::json*)>& edit) {
  nlohmann::json j;
  {
    std::ifstream in(dir + "/config.json");
    in >> j;
  }
  edit(&j);
  std::ofstream(dir + "/config.json") << j.dump(2);
}

std::unique_ptr<TestServer> Serve(const std::string& dir) {
  ServerOptions options;
  options.model_dir = dir;
  return StartTestServer(options);
}

v1::ServerInfo Info(v1::RolloutService::Stub* stub) {
  grpc::ClientContext context;
  v1::ServerInfo info;
  EXPECT_TRUE(stub->GetServerInfo(&context, v1::GetServerInfoRequest(), &info).ok());
  return info;
}

// Greedy and sampled rollouts of `prompt` (ignoring EOS) with their logprobs.
std::vector<v1::Completion> Rollouts(v1::RolloutService::Stub* stub, uint32_t max_new_tokens) {
  std::vector<v1::Completion> out;
  for (float temperature : {0.0f, 1.0f}) {
    v1::GenerateRequest request;
    *request.add_rollouts() = MakeRollout(kPrompt, 5, max_new_tokens, temperature);
    request.mutable_rollouts(0)->mutable_sampling()->set_ignore_eos(true);
    GenerateOutcome run = RunGenerate(stub, request);
    EXPECT_TRUE(run.status.ok()) << run.status.error_message();
    if (!run.status.ok()) return {};
    out.push_back(run.completions[0][0]);
  }
  return out;
}

// The CPU backend's logprobs equal a double-precision forward (tests/naive_model.cc) within
// fp32 error, on a model whose RoPE is scaled (or that has MoE layers); and what is tested
// matters: the same weights with `other` applied to config.json (plain RoPE; no renormalised
// expert weights) give other logprobs.
void CheckAgainstNaive(const std::string& preset,
                       const std::function<void(nlohmann::json*)>& other =
                           [](nlohmann::json* j) { (*j)["rope_scaling"] = nullptr; }) {
  const std::string dir = WriteModel(preset, preset, 3);
  std::unique_ptr<TestServer> server = Serve(dir);
  ASSERT_NE(server, nullptr);
  EXPECT_EQ(Info(server->stub.get()).model().architecture(),
            PresetConfig(preset)->architecture);
  const std::vector<v1::Completion> rollouts = Rollouts(server->stub.get(), 16);
  ASSERT_EQ(rollouts.size(), 2u);
  absl::StatusOr<NaiveModel> naive = NaiveModel::Load(dir);
  ASSERT_TRUE(naive.ok()) << naive.status();
  // The CUDA backend (ROLLOUT_TEST_BACKEND=cuda) rounds activations and KV to bf16.
  const char* backend = std::getenv("ROLLOUT_TEST_BACKEND");
  const double tolerance = backend != nullptr && std::string(backend) == "cuda" ? 5e-2 : 2e-3;
  for (size_t r = 0; r < rollouts.size(); ++r) {
    const v1::Completion& c = rollouts[r];
    ASSERT_EQ(c.token_ids_size(), 16);
    std::vector<int32_t> seq(kPrompt.begin(), kPrompt.end());
    seq.insert(seq.end(), c.token_ids().begin(), c.token_ids().end());
    const std::vector<std::vector<double>> logits = naive->Logits(seq);
    const float temperature = r == 0 ? 0.0f : 1.0f;
    for (int i = 0; i < c.token_ids_size(); ++i) {
      EXPECT_NEAR(c.logprobs(i),
                  NaiveLogprob(logits[kPrompt.size() - 1 + i], temperature, c.token_ids(i)),
                  tolerance)
          << preset << " T=" << temperature << " position " << i;
    }
  }

  // Plain RoPE (or the other change) on the same weights: another model.
  EditConfig(dir, other);
  std::unique_ptr<TestServer> plain = Serve(dir);
  ASSERT_NE(plain, nullptr);
  const std::vector<v1::Completion> unscaled = Rollouts(plain->stub.get(), 16);
  ASSERT_EQ(unscaled.size(), 2u);
  EXPECT_NE(Fingerprint(unscaled[1]), Fingerprint(rollouts[1])) << preset;
}

TEST(ModelsE2eTest, Llama31StyleRopeScalingMatchesTheNaiveForward) {
  CheckAgainstNaive("llama3-small");
}

TEST(ModelsE2eTest, YarnRopeScalingMatchesTheNaiveForward) { CheckAgainstNaive("yarn-small"); }

// Qwen3-MoE: router, top-2 of 8 experts renormalised, a dense layer among the MoE ones.
TEST(ModelsE2eTest, Qwen3MoeMatchesTheNaiveForward) {
  CheckAgainstNaive("moe-small", [](nlohmann::json* j) { (*j)["norm_topk_prob"] = false; });
}

// Qwen3-Instruct names a second EOS only in generation_config.json: a rollout must stop on it,
// and ServerInfo lists it.
TEST(ModelsE2eTest, AnEosOfTheGenerationConfigStopsTheRollout) {
  const std::string dir = WriteModel("generation-config", "small", 4);
  std::vector<uint32_t> greedy;
  {
    std::unique_ptr<TestServer> server = Serve(dir);
    ASSERT_NE(server, nullptr);
    const v1::Completion c = Rollouts(server->stub.get(), 12)[0];
    greedy.assign(c.token_ids().begin(), c.token_ids().end());
  }
  // The first token after the first that occurred neither before nor is config.json's EOS (2).
  size_t at = 1;
  while (at < greedy.size() &&
         (greedy[at] == 2 || std::count(greedy.begin(), greedy.begin() + at, greedy[at]) > 0)) {
    ++at;
  }
  ASSERT_LT(at, greedy.size()) << "no fresh token in the greedy continuation";
  const uint32_t eos = greedy[at];
  std::ofstream(dir + "/generation_config.json")
      << absl::StrCat(R"({"bos_token_id": 1, "eos_token_id": [2, )", eos, "]}");

  std::unique_ptr<TestServer> server = Serve(dir);
  ASSERT_NE(server, nullptr);
  const v1::ServerInfo info = Info(server->stub.get());
  EXPECT_EQ(std::vector<uint32_t>(info.model().eos_token_ids().begin(),
                                  info.model().eos_token_ids().end()),
            std::vector<uint32_t>({2, eos}));
  v1::GenerateRequest request;
  *request.add_rollouts() = MakeRollout(kPrompt, 5, 12, 0.0f);
  GenerateOutcome run = RunGenerate(server->stub.get(), request);
  ASSERT_TRUE(run.status.ok()) << run.status.error_message();
  const v1::Completion& c = run.completions[0][0];
  EXPECT_EQ(c.finish_reason(), v1::FINISH_REASON_STOP);
  ASSERT_EQ(c.token_ids_size(), static_cast<int>(at) + 1);
  EXPECT_EQ(c.token_ids(at), eos);
  // ignore_eos still runs to the length.
  request.mutable_rollouts(0)->mutable_sampling()->set_ignore_eos(true);
  run = RunGenerate(server->stub.get(), request);
  ASSERT_TRUE(run.status.ok());
  EXPECT_EQ(run.completions[0][0].token_ids_size(), 12);
}

// An F32 checkpoint of a bfloat16 model is cast on load, round to nearest even: it serves the
// bits and the weight digest of the BF16 checkpoint of the same weights, at start and when a
// server updates from it.
TEST(ModelsE2eTest, AnF32CheckpointServesTheBitsAndDigestOfItsBf16Cast) {
  const std::string bf16 = WriteModel("bf16", "small", 6);
  const std::string f32 = WriteModel("f32", "small", 6, DType::kF32);
  EditConfig(f32, [](nlohmann::json* j) { (*j)["torch_dtype"] = "bfloat16"; });
  std::unique_ptr<TestServer> a = Serve(bf16);
  std::unique_ptr<TestServer> b = Serve(f32);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  const std::string digest = Info(a->stub.get()).weight_digest();
  EXPECT_FALSE(digest.empty());
  EXPECT_EQ(Info(b->stub.get()).weight_digest(), digest);
  const std::vector<v1::Completion> want = Rollouts(a->stub.get(), 12);
  const std::vector<v1::Completion> got = Rollouts(b->stub.get(), 12);
  ASSERT_EQ(want.size(), 2u);
  ASSERT_EQ(got.size(), 2u);
  for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(Fingerprint(got[i]), Fingerprint(want[i]));

  // The same through UpdateWeightsFromPath: the F32 files cast into the BF16 server.
  {
    grpc::ClientContext context;
    v1::UpdateWeightsFromPathRequest request;
    request.set_path(f32);
    request.set_version("from-f32");
    v1::UpdateWeightsResponse response;
    const grpc::Status s = a->stub->UpdateWeightsFromPath(&context, request, &response);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(response.weight_digest(), digest);
    const std::vector<v1::Completion> after = Rollouts(a->stub.get(), 12);
    ASSERT_EQ(after.size(), 2u);
    EXPECT_EQ(Fingerprint(after[1]), Fingerprint(want[1]));
  }

  // Served as float32 (its config says so), the same file is another model, and its digest is
  // that of the F32 bytes.
  EditConfig(f32, [](nlohmann::json* j) { (*j)["torch_dtype"] = "float32"; });
  std::unique_ptr<TestServer> c = Serve(f32);
  ASSERT_NE(c, nullptr);
  EXPECT_NE(Info(c->stub.get()).weight_digest(), digest);
  EXPECT_NE(Fingerprint(Rollouts(c->stub.get(), 12)[1]), Fingerprint(want[1]));
}

}  // namespace
}  // namespace rollout::testing
