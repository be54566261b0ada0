// MoE routing replay through the real gRPC stack (docs/api.md, "Routing replay"): Generate
// returns each token's experts, Score given that routing reproduces Generate's logprobs bitwise,
// another routing gives other logprobs (and leaves the prefix cache as it was), bad routings
// are INVALID_ARGUMENT, and a dense model refuses routing requests.
#include <cstring>
#include <random>
#include <set>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/determinism_util.h"
#include "tests/test_server.h"

namespace rollout::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

// moe-small: 3 MoE layers (0, 2, 3) of 8 experts, 2 per token.
constexpr int kMoeLayers = 3, kTopK = 2, kExperts = 8, kRouting = kMoeLayers * kTopK;

class RoutingReplayTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    ServerOptions options;
    absl::StatusOr<std::string> dir = TestPresetDir("moe-small");
    ASSERT_TRUE(dir.ok()) << dir.status();
    options.model_dir = *dir;
    server_ = StartTestServer(options).release();
  }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
  }
  static v1::RolloutService::Stub* stub() { return server_->stub.get(); }
  static inline TestServer* server_ = nullptr;
};

std::vector<uint32_t> Prompt(uint64_t seed, int n) {
  std::mt19937_64 rng(seed);
  return RandomPrompt(rng, n);
}

v1::Completion Generate(v1::RolloutService::Stub* stub, const std::vector<uint32_t>& prompt,
                        float temperature, bool return_routing, uint32_t max_new = 12) {
  v1::GenerateRequest request;
  *request.add_rollouts() = MakeRollout(prompt, 77, max_new, temperature);
  request.mutable_rollouts(0)->mutable_sampling()->set_ignore_eos(true);
  request.set_return_routing(return_routing);
  GenerateOutcome out = RunGenerate(stub, request);
  EXPECT_TRUE(out.status.ok()) << out.status.error_message();
  return out.status.ok() ? out.completions[0][0] : v1::Completion();
}

struct ScoreCall {
  grpc::Status status;
  v1::ScoreResponse response;
};
ScoreCall Score(v1::RolloutService::Stub* stub, const std::vector<v1::ScoreSequence>& seqs) {
  v1::ScoreRequest request;
  for (const v1::ScoreSequence& s : seqs) *request.add_sequences() = s;
  ScoreCall call;
  grpc::ClientContext context;
  call.status = stub->Score(&context, request, &call.response);
  return call;
}

// prompt + completion, scoring the completion at `temperature` (0 scores as 1; Generate's
// logprobs at T = 0 are T = 1 ones too).
v1::ScoreSequence ScoreOf(const std::vector<uint32_t>& prompt, const v1::Completion& c,
                          float temperature) {
  v1::ScoreSequence s;
  s.mutable_token_ids()->Add(prompt.begin(), prompt.end());
  s.mutable_token_ids()->Add(c.token_ids().begin(), c.token_ids().end());
  s.set_start(static_cast<uint32_t>(prompt.size()));
  s.set_temperature(temperature);
  return s;
}

std::string Bits(const google::protobuf::RepeatedField<float>& v) {
  std::string out(v.size() * sizeof(float), '\0');
  if (!v.empty()) std::memcpy(out.data(), v.data(), out.size());
  return out;
}

TEST_F(RoutingReplayTest, ServerInfoDescribesTheRouting) {
  grpc::ClientContext context;
  v1::ServerInfo info;
  ASSERT_TRUE(stub()->GetServerInfo(&context, v1::GetServerInfoRequest(), &info).ok());
  EXPECT_EQ(info.model().architecture(), "Qwen3MoeForCausalLM");
  EXPECT_EQ(info.model().num_experts(), 8u);
  EXPECT_EQ(info.model().num_experts_per_tok(), 2u);
  EXPECT_EQ(info.model().moe_intermediate_size(), 128u);
  EXPECT_EQ(std::vector<uint32_t>(info.model().moe_layers().begin(),
                                  info.model().moe_layers().end()),
            std::vector<uint32_t>({0, 2, 3}));
  EXPECT_TRUE(info.model().routing_replay());
}

TEST_F(RoutingReplayTest, GenerateReturnsEveryTokensExpertsOnlyWhenAsked) {
  const std::vector<uint32_t> prompt = Prompt(1, 21);
  const v1::Completion plain = Generate(stub(), prompt, 0.7f, false);
  EXPECT_EQ(plain.routing_size(), 0);
  const v1::Completion routed = Generate(stub(), prompt, 0.7f, true);
  // Asking changes no token or logprob bit.
  EXPECT_EQ(Fingerprint(routed), Fingerprint(plain));
  ASSERT_EQ(routed.routing_size(), routed.token_ids_size() * kRouting);
  std::set<uint32_t> used;
  for (int i = 0; i < routed.routing_size(); i += kTopK) {
    EXPECT_LT(routed.routing(i), kExperts);
    EXPECT_LT(routed.routing(i + 1), kExperts);
    EXPECT_NE(routed.routing(i), routed.routing(i + 1)) << i;
    used.insert(routed.routing(i));
  }
  EXPECT_GE(used.size(), 4u);
}

TEST_F(RoutingReplayTest, ScoreWithGeneratesRoutingGivesGeneratesLogprobsBitwise) {
  for (float temperature : {0.0f, 0.7f}) {
    const std::vector<uint32_t> prompt = Prompt(2, 33);
    const v1::Completion c = Generate(stub(), prompt, temperature, true, 16);
    ASSERT_EQ(c.routing_size(), c.token_ids_size() * kRouting);
    v1::ScoreSequence replay = ScoreOf(prompt, c, temperature);
    replay.mutable_routing()->CopyFrom(c.routing());
    replay.set_return_routing(true);
    // Beside an unforced copy and a stranger in one request.
    const v1::ScoreSequence copy = ScoreOf(prompt, c, temperature);
    v1::ScoreSequence stranger;
    const std::vector<uint32_t> other = Prompt(9, 40);
    stranger.mutable_token_ids()->Add(other.begin(), other.end());
    stranger.set_start(5);
    const ScoreCall call = Score(stub(), {replay, copy, stranger});
    ASSERT_TRUE(call.status.ok()) << call.status.error_message();
    const v1::ScoredSequence& got = call.response.results(0);
    EXPECT_EQ(Bits(got.logprobs()), Bits(c.logprobs())) << "T=" << temperature;
    EXPECT_EQ(Bits(call.response.results(1).logprobs()), Bits(c.logprobs()));
    EXPECT_EQ(std::vector<uint32_t>(got.routing().begin(), got.routing().end()),
              std::vector<uint32_t>(c.routing().begin(), c.routing().end()));
    EXPECT_EQ(call.response.results(1).routing_size(), 0);  // not asked
    // Every row's routing, the prompt's too: Score from start 1; its tail is Generate's.
    v1::ScoreSequence all = ScoreOf(prompt, c, temperature);
    all.set_start(1);
    all.set_return_routing(true);
    const ScoreCall whole = Score(stub(), {all});
    ASSERT_TRUE(whole.status.ok()) << whole.status.error_message();
    const auto& r = whole.response.results(0).routing();
    ASSERT_EQ(r.size(), static_cast<int>(prompt.size() + c.token_ids_size() - 1) * kRouting);
    EXPECT_EQ(std::vector<uint32_t>(r.end() - c.routing_size(), r.end()),
              std::vector<uint32_t>(c.routing().begin(), c.routing().end()));
  }
}

TEST_F(RoutingReplayTest, AnotherRoutingGivesOtherLogprobsAndLeavesThePrefixCacheAlone) {
  const std::vector<uint32_t> prompt = Prompt(3, 40);
  const v1::Completion c = Generate(stub(), prompt, 0.0f, true, 24);
  ASSERT_EQ(c.routing_size(), c.token_ids_size() * kRouting);
  // Every scored token's row at every MoE layer: its second expert replaced by the lowest id
  // that is not its first.
  v1::ScoreSequence forced = ScoreOf(prompt, c, 1.0f);
  for (int i = 0; i < c.routing_size(); i += kTopK) {
    uint32_t e = 0;
    while (e == c.routing(i) || e == c.routing(i + 1)) ++e;
    forced.add_routing(c.routing(i));
    forced.add_routing(e);
  }
  forced.set_return_routing(true);
  {  // The forced Score computes every page itself.
    grpc::ClientContext context;
    v1::FlushCacheResponse flushed;
    ASSERT_TRUE(stub()->FlushCache(&context, v1::FlushCacheRequest(), &flushed).ok());
  }
  const ScoreCall moved = Score(stub(), {forced});
  ASSERT_TRUE(moved.status.ok()) << moved.status.error_message();
  const v1::ScoredSequence& got = moved.response.results(0);
  ASSERT_EQ(got.logprobs_size(), c.logprobs_size());
  EXPECT_EQ(std::vector<uint32_t>(got.routing().begin(), got.routing().end()),
            std::vector<uint32_t>(forced.routing().begin(), forced.routing().end()));
  int differ = 0;
  for (int i = 0; i < got.logprobs_size(); ++i) differ += got.logprobs(i) != c.logprobs(i);
  EXPECT_GT(differ, got.logprobs_size() / 2) << "the forced routing barely changed anything";
  // Its KV was not shared: only the pages before its first forced row (39) entered the prefix
  // cache, so a plain Score of the last tokens -- which could reuse 48 tokens' pages -- reuses
  // 32 and still gives Generate's bits; and so does Generate.
  v1::ScoreSequence tail = ScoreOf(prompt, c, 1.0f);
  tail.set_start(static_cast<uint32_t>(prompt.size()) + 20);
  const ScoreCall again = Score(stub(), {tail});
  ASSERT_TRUE(again.status.ok());
  EXPECT_EQ(again.response.results(0).cached_tokens(), 32u);
  ASSERT_EQ(again.response.results(0).logprobs_size(), 4);
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(again.response.results(0).logprobs(i), c.logprobs(20 + i)) << i;
  }
  EXPECT_EQ(Fingerprint(Generate(stub(), prompt, 0.0f, false, 24)), Fingerprint(c));
}

TEST_F(RoutingReplayTest, BadRoutingsAreInvalidArgumentNamingTheProblem) {
  const std::vector<uint32_t> prompt = Prompt(4, 10);
  const v1::Completion c = Generate(stub(), prompt, 0.0f, true, 4);
  ASSERT_EQ(c.routing_size(), 4 * kRouting);
  struct Case {
    std::function<void(v1::ScoreSequence*)> edit;
    const char* message;
  };
  const std::vector<Case> cases = {
      {[](v1::ScoreSequence* s) { s->mutable_routing()->RemoveLast(); },
       "sequences[0].routing has 23 expert ids; expected 24: 4 scored tokens x 3 MoE layers x 2 "
       "experts per token"},
      {[](v1::ScoreSequence* s) { s->set_routing(7, 8); },
       "sequences[0].routing[7] = 8 (scored token 1, MoE layer 0) is outside the experts [0, 8)"},
      {[](v1::ScoreSequence* s) { s->set_routing(3, 4294967295u); },
       "sequences[0].routing[3] = 4294967295 is outside the experts [0, 8)"},
      {[](v1::ScoreSequence* s) { s->set_routing(9, s->routing(8)); },
       "is given twice for scored token 1 at MoE layer 1"},
  };
  for (const Case& k : cases) {
    v1::ScoreSequence s = ScoreOf(prompt, c, 1.0f);
    s.mutable_routing()->CopyFrom(c.routing());
    k.edit(&s);
    const ScoreCall call = Score(stub(), {s});
    EXPECT_EQ(call.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << k.message;
    EXPECT_THAT(call.status.error_message(), HasSubstr(k.message));
  }
  // The server serves on, with the same bits.
  v1::ScoreSequence ok = ScoreOf(prompt, c, 1.0f);
  ok.mutable_routing()->CopyFrom(c.routing());
  const ScoreCall call = Score(stub(), {ok});
  ASSERT_TRUE(call.status.ok()) << call.status.error_message();
  EXPECT_EQ(Bits(call.response.results(0).logprobs()), Bits(c.logprobs()));
}

TEST(RoutingReplayDenseTest, ADenseModelRefusesRoutingRequests) {
  std::unique_ptr<TestServer> server = StartTestServer();  // the dense default model
  ASSERT_NE(server, nullptr);
  if (const char* preset = std::getenv("ROLLOUT_TEST_PRESET"); preset != nullptr && *preset) {
    GTEST_SKIP() << "ROLLOUT_TEST_PRESET serves " << preset;
  }
  v1::GenerateRequest request;
  *request.add_rollouts() = MakeRollout({1, 2, 3}, 1, 4, 0.0f);
  request.set_return_routing(true);
  GenerateOutcome out = RunGenerate(server->stub.get(), request);
  EXPECT_EQ(out.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  // GenerateRequest's field, not a rollout's.
  EXPECT_THAT(out.status.error_message(),
              StartsWith("return_routing: routing replay needs a mixture-of-experts model; the "
                         "served Qwen3ForCausalLM has no experts"));
  v1::ScoreSequence s;
  for (uint32_t t : {1u, 2u, 3u}) s.add_token_ids(t);
  s.set_start(1);
  s.add_routing(0);
  const ScoreCall call = Score(server->stub.get(), {s});
  EXPECT_EQ(call.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(call.status.error_message(),
              HasSubstr("sequences[0].routing: routing replay needs a mixture-of-experts model"));
  // ScoreSequence.return_routing is the sequence's own.
  s.clear_routing();
  s.set_return_routing(true);
  const ScoreCall asked = Score(server->stub.get(), {s});
  EXPECT_EQ(asked.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(asked.status.error_message(),
              StartsWith("sequences[0].return_routing: routing replay needs a mixture-of-experts "
                         "model"));
}

}  // namespace
}  // namespace rollout::testing
