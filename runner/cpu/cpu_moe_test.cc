// The CPU backend's MoE layers (Qwen3-MoE): a row's logits and routing do not depend on the
// rest of the batch (nor on how many tokens each expert got), routing replay, and loading the
// fused expert layout.
#include <cstring>
#include <filesystem>
#include <random>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/random_model.h"
#include "runner/cpu/cpu_model_runner.h"

namespace rollout {
namespace {

using ::testing::HasSubstr;

const std::string& MoeDir() {
  static const std::string dir = [] {
    const std::string d = ::testing::TempDir() + "cpu-moe-test-moe-small";
    RandomModelOptions options;
    options.preset = "moe-small";
    options.seed = 21;
    absl::Status s = WriteRandomModel(options, d);
    EXPECT_TRUE(s.ok()) << s;
    return d;
  }();
  return dir;
}

std::unique_ptr<CpuModelRunner> MakeRunner(const std::string& dir) {
  absl::StatusOr<std::unique_ptr<Checkpoint>> ck = Checkpoint::Open(dir);
  EXPECT_TRUE(ck.ok()) << ck.status();
  if (!ck.ok()) return nullptr;
  CpuRunnerOptions options;
  options.kv_cache_bytes = 16 << 20;
  absl::StatusOr<std::unique_ptr<CpuModelRunner>> runner = CpuModelRunner::Create(**ck, options);
  EXPECT_TRUE(runner.ok()) << runner.status();
  return runner.ok() ? *std::move(runner) : nullptr;
}

std::vector<int32_t> Tokens(int n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> t(n);
  for (int32_t& id : t) id = static_cast<int32_t>(rng() % 4096);
  return t;
}

// Prefill of each sequence's tokens in one batch (sequence s in blocks [8 s, 8 s + 8)), every
// token a logits row; returns per sequence its rows' logits and routing.
struct SeqOut {
  std::vector<std::vector<float>> logits;  // per token
  std::vector<std::vector<int32_t>> routing;
};
std::vector<SeqOut> Prefill(CpuModelRunner* runner, const std::vector<std::vector<int32_t>>& seqs,
                            const std::vector<std::vector<std::vector<int32_t>>>& forced = {}) {
  ForwardBatch b;
  b.return_routing = true;
  for (size_t s = 0; s < seqs.size(); ++s) {
    std::vector<int32_t> table;
    for (int i = 0; i < 8; ++i) table.push_back(static_cast<int32_t>(8 * s + i));
    b.block_tables.push_back(table);
    for (size_t i = 0; i < seqs[s].size(); ++i) {
      b.logit_rows.push_back(static_cast<int32_t>(b.token_ids.size()));
      b.token_ids.push_back(seqs[s][i]);
      b.positions.push_back(static_cast<int32_t>(i));
      b.token_seq.push_back(static_cast<int32_t>(s));
      if (!forced.empty()) b.forced_routing.push_back(forced[s][i]);
    }
  }
  std::vector<float> logits;
  std::vector<std::vector<int32_t>> routing;
  absl::Status status = runner->ForwardWithRouting(b, &logits, &routing);
  EXPECT_TRUE(status.ok()) << status;
  std::vector<SeqOut> out(seqs.size());
  if (!status.ok()) return out;
  EXPECT_EQ(routing.size(), b.logit_rows.size());
  const int64_t vocab = runner->config().vocab_size;
  size_t row = 0;
  for (size_t s = 0; s < seqs.size(); ++s) {
    for (size_t i = 0; i < seqs[s].size(); ++i, ++row) {
      out[s].logits.emplace_back(logits.begin() + row * vocab, logits.begin() + (row + 1) * vocab);
      out[s].routing.push_back(routing[row]);
    }
  }
  return out;
}

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

TEST(CpuMoeTest, RoutingHasEveryMoeLayersExpertsDistinctAndInRange) {
  std::unique_ptr<CpuModelRunner> runner = MakeRunner(MoeDir());
  ASSERT_NE(runner, nullptr);
  EXPECT_TRUE(runner->SupportsRoutingReplay());
  const ModelConfig& c = runner->config();
  ASSERT_EQ(c.RoutingSize(), 3 * 2);
  const std::vector<SeqOut> out = Prefill(runner.get(), {Tokens(40, 1)});
  std::set<int32_t> used;
  for (const std::vector<int32_t>& r : out[0].routing) {
    ASSERT_EQ(r.size(), 6u);
    for (int layer = 0; layer < 3; ++layer) {
      EXPECT_NE(r[2 * layer], r[2 * layer + 1]);
      for (int j = 0; j < 2; ++j) {
        EXPECT_GE(r[2 * layer + j], 0);
        EXPECT_LT(r[2 * layer + j], 8);
        used.insert(r[2 * layer + j]);
      }
    }
  }
  // Random weights spread 40 tokens over more than a couple of experts.
  EXPECT_GE(used.size(), 5u);
}

// A row's logits and routing are the same bits alone and beside other sequences, which change
// how many tokens each expert runs this step (D1 for MoE).
TEST(CpuMoeTest, ARowsResultIsIndependentOfTheBatchAndOfExpertTokenCounts) {
  std::unique_ptr<CpuModelRunner> runner = MakeRunner(MoeDir());
  ASSERT_NE(runner, nullptr);
  const std::vector<int32_t> seq = Tokens(23, 2);
  const std::vector<SeqOut> alone = Prefill(runner.get(), {seq});
  for (int others : {1, 3}) {
    std::vector<std::vector<int32_t>> seqs;
    for (int o = 0; o < others; ++o) seqs.push_back(Tokens(17 + 9 * o, 10 + o));
    seqs.insert(seqs.begin() + others / 2, seq);
    const std::vector<SeqOut> batched = Prefill(runner.get(), seqs);
    const SeqOut& got = batched[others / 2];
    for (size_t i = 0; i < seq.size(); ++i) {
      EXPECT_TRUE(SameBits(got.logits[i], alone[0].logits[i])) << others << " others, row " << i;
      EXPECT_EQ(got.routing[i], alone[0].routing[i]) << others << " others, row " << i;
    }
  }
}

TEST(CpuMoeTest, ForcingTheChosenRoutingChangesNothingAndAnotherChangesTheLogits) {
  std::unique_ptr<CpuModelRunner> runner = MakeRunner(MoeDir());
  ASSERT_NE(runner, nullptr);
  const std::vector<int32_t> seq = Tokens(12, 3);
  const std::vector<SeqOut> chosen = Prefill(runner.get(), {seq});
  const std::vector<SeqOut> replayed = Prefill(runner.get(), {seq}, {{chosen[0].routing}});
  for (size_t i = 0; i < seq.size(); ++i) {
    EXPECT_TRUE(SameBits(replayed[0].logits[i], chosen[0].logits[i])) << i;
    EXPECT_EQ(replayed[0].routing[i], chosen[0].routing[i]);
  }
  // Row 5 forced elsewhere at every MoE layer: its logits change (and it reports what it used);
  // rows before it do not (causal), rows after it do not route it differently themselves.
  std::vector<std::vector<int32_t>> forced(seq.size());
  std::vector<int32_t> other = chosen[0].routing[5];
  for (size_t i = 0; i < other.size(); i += 2) {
    for (int32_t e = 0; e < 8; ++e) {
      if (e != chosen[0].routing[5][i] && e != chosen[0].routing[5][i + 1]) {
        other[i] = e;
        break;
      }
    }
  }
  forced[5] = other;
  const std::vector<SeqOut> moved = Prefill(runner.get(), {seq}, {forced});
  EXPECT_EQ(moved[0].routing[5], other);
  EXPECT_FALSE(SameBits(moved[0].logits[5], chosen[0].logits[5]));
  for (size_t i = 0; i < 5; ++i) EXPECT_TRUE(SameBits(moved[0].logits[i], chosen[0].logits[i]));
}

TEST(CpuMoeTest, MalformedForcedRoutingIsInvalidArgument) {
  std::unique_ptr<CpuModelRunner> runner = MakeRunner(MoeDir());
  ASSERT_NE(runner, nullptr);
  ForwardBatch b;
  b.token_ids = {5, 6};
  b.positions = {0, 1};
  b.token_seq = {0, 0};
  b.block_tables = {{0}};
  b.logit_rows = {0, 1};
  std::vector<float> logits;
  std::vector<std::vector<int32_t>> routing;
  struct Case {
    std::vector<std::vector<int32_t>> forced;
    const char* message;
  };
  const std::vector<Case> cases = {
      {{{0, 1, 2, 3, 4, 5}}, "forced routing for 1 logits rows, the batch has 2"},
      {{{}, {0, 1, 2}}, "forced routing of logits row 1: 3 expert ids, expected 6 (3 MoE layers x 2)"},
      {{{0, 1, 2, 3, 4, 8}, {}}, "forced routing of logits row 0: expert id 8 outside [0, 8)"},
      {{{0, 1, 2, 3, -1, 5}, {}}, "expert id -1 outside [0, 8)"},
      {{{}, {0, 1, 3, 3, 4, 5}}, "forced routing of logits row 1: expert 3 twice in MoE layer 1"},
  };
  for (const Case& k : cases) {
    b.forced_routing = k.forced;
    absl::Status s = runner->ForwardWithRouting(b, &logits, &routing);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << k.message;
    EXPECT_THAT(s.message(), HasSubstr(k.message));
  }
  // Nothing was written: the next valid forward is as on a fresh runner.
  b.forced_routing.clear();
  ASSERT_TRUE(runner->ForwardWithRouting(b, &logits, &routing).ok());
  std::vector<float> fresh;
  ASSERT_TRUE(MakeRunner(MoeDir())->Forward(b, &fresh).ok());
  EXPECT_TRUE(SameBits(logits, fresh));
}

TEST(CpuMoeTest, ADenseModelRefusesRoutingRequests) {
  const std::string dir = ::testing::TempDir() + "cpu-moe-test-tiny";
  RandomModelOptions options;
  options.preset = "tiny";
  ASSERT_TRUE(WriteRandomModel(options, dir).ok());
  std::unique_ptr<CpuModelRunner> runner = MakeRunner(dir);
  ASSERT_NE(runner, nullptr);
  EXPECT_FALSE(runner->SupportsRoutingReplay());
  ForwardBatch b;
  b.token_ids = {5};
  b.positions = {0};
  b.token_seq = {0};
  b.block_tables = {{0}};
  b.logit_rows = {0};
  b.return_routing = true;
  std::vector<float> logits;
  std::vector<std::vector<int32_t>> routing;
  absl::Status s = runner->ForwardWithRouting(b, &logits, &routing);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("routing replay needs a mixture-of-experts model"));
}

// The same weights saved with transformers 5's fused experts serve the same bits.
TEST(CpuMoeTest, FusedExpertCheckpointServesTheSameLogits) {
  absl::StatusOr<std::unique_ptr<Checkpoint>> per_expert = Checkpoint::Open(MoeDir());
  ASSERT_TRUE(per_expert.ok());
  const ModelConfig config = *ReadModelConfig(**per_expert);
  std::vector<HostTensor> tensors;
  auto read = [&](const std::string& name) {
    const TensorView* v = (*per_expert)->Find(name);
    std::vector<uint8_t> bytes(v->nbytes);
    EXPECT_TRUE((*per_expert)->Read(name, bytes.data()).ok());
    return std::make_pair(*v, bytes);
  };
  for (const std::string& name : (*per_expert)->TensorNames()) {
    if (name.find(".mlp.experts.") != std::string::npos) continue;
    auto [view, bytes] = read(name);
    tensors.push_back(HostTensor{name, view.dtype, view.shape, bytes});
  }
  const int64_t e = config.num_experts, mi = config.moe_intermediate_size, h = config.hidden_size;
  for (int32_t layer = 0; layer < config.num_layers; ++layer) {
    if (!config.IsMoeLayer(layer)) continue;
    const std::string p = absl::StrCat("model.layers.", layer, ".mlp.experts.");
    HostTensor gate_up{p + "gate_up_proj", DType::kBF16, {e, 2 * mi, h}, {}};
    HostTensor down{p + "down_proj", DType::kBF16, {e, h, mi}, {}};
    for (int64_t x = 0; x < e; ++x) {
      for (const char* part : {"gate_proj", "up_proj"}) {
        auto [view, bytes] = read(absl::StrCat(p, x, ".", part, ".weight"));
        gate_up.bytes.insert(gate_up.bytes.end(), bytes.begin(), bytes.end());
      }
      auto [view, bytes] = read(absl::StrCat(p, x, ".down_proj.weight"));
      down.bytes.insert(down.bytes.end(), bytes.begin(), bytes.end());
    }
    tensors.push_back(std::move(gate_up));
    tensors.push_back(std::move(down));
  }
  const std::string fused_dir = ::testing::TempDir() + "cpu-moe-test-fused";
  std::filesystem::create_directories(fused_dir);
  ASSERT_TRUE(WriteSafetensors(fused_dir + "/model.safetensors", tensors).ok());
  std::filesystem::copy_file(MoeDir() + "/config.json", fused_dir + "/config.json",
                             std::filesystem::copy_options::overwrite_existing);
  std::unique_ptr<CpuModelRunner> fused = MakeRunner(fused_dir);
  std::unique_ptr<CpuModelRunner> plain = MakeRunner(MoeDir());
  ASSERT_NE(fused, nullptr);
  ASSERT_NE(plain, nullptr);
  EXPECT_EQ(fused->weight_specs().size(), plain->weight_specs().size());
  const std::vector<int32_t> seq = Tokens(9, 4);
  const std::vector<SeqOut> a = Prefill(fused.get(), {seq});
  const std::vector<SeqOut> b = Prefill(plain.get(), {seq});
  for (size_t i = 0; i < seq.size(); ++i) EXPECT_TRUE(SameBits(a[0].logits[i], b[0].logits[i]));
}

}  // namespace
}  // namespace rollout
