#include "model/random_model.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace rollout {
namespace {

using ::testing::HasSubstr;
namespace fs = std::filesystem;

// A fresh, empty directory per test; `suffix` separates several in one test.
std::string TestDir(const std::string& suffix = "") {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const std::string dir = absl::StrCat(::testing::TempDir(), "/rollout_", info->test_suite_name(),
                                       "_", info->name(), "_", ::getpid(), suffix);
  fs::remove_all(dir);
  return dir;
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

std::unique_ptr<Checkpoint> OpenOrDie(const std::string& dir) {
  absl::StatusOr<std::unique_ptr<Checkpoint>> checkpoint = Checkpoint::Open(dir);
  EXPECT_TRUE(checkpoint.ok()) << checkpoint.status();
  return checkpoint.ok() ? std::move(*checkpoint) : nullptr;
}

RandomModelOptions Tiny(uint64_t seed = 0) {
  RandomModelOptions options;
  options.preset = "tiny";
  options.seed = seed;
  return options;
}

double Mean(const std::vector<float>& v) {
  double sum = 0;
  for (float x : v) sum += x;
  return sum / v.size();
}

double Std(const std::vector<float>& v) {
  const double mean = Mean(v);
  double sum = 0;
  for (float x : v) sum += (x - mean) * (x - mean);
  return std::sqrt(sum / v.size());
}

TEST(RandomModelTest, SameSeedWritesIdenticalBytes) {
  const std::string a = TestDir("a"), b = TestDir("b");
  ASSERT_TRUE(WriteRandomModel(Tiny(7), a).ok());
  ASSERT_TRUE(WriteRandomModel(Tiny(7), b).ok());
  for (const char* file : {"/model.safetensors", "/config.json"}) {
    const std::string bytes = ReadAll(a + file);
    EXPECT_FALSE(bytes.empty());
    EXPECT_TRUE(bytes == ReadAll(b + file)) << file;
  }
}

TEST(RandomModelTest, DifferentSeedsWriteDifferentWeightsInEveryTensor) {
  const std::string a = TestDir("a"), b = TestDir("b");
  ASSERT_TRUE(WriteRandomModel(Tiny(0), a).ok());
  ASSERT_TRUE(WriteRandomModel(Tiny(1), b).ok());
  std::unique_ptr<Checkpoint> ca = OpenOrDie(a), cb = OpenOrDie(b);
  ASSERT_TRUE(ca && cb);
  ASSERT_EQ(ca->TensorNames(), cb->TensorNames());
  for (const std::string& name : ca->TensorNames()) {
    const TensorView* va = ca->Find(name);
    const TensorView* vb = cb->Find(name);
    ASSERT_EQ(va->nbytes, vb->nbytes);
    EXPECT_NE(std::memcmp(va->data, vb->data, va->nbytes), 0) << name;
  }
}

TEST(RandomModelTest, TensorsWithinOneModelAreNotCopiesOfEachOther) {
  const std::string dir = TestDir();
  ASSERT_TRUE(WriteRandomModel(Tiny(), dir).ok());
  std::unique_ptr<Checkpoint> c = OpenOrDie(dir);
  ASSERT_TRUE(c);
  const TensorView* up = c->Find("model.layers.0.mlp.up_proj.weight");
  const TensorView* gate = c->Find("model.layers.0.mlp.gate_proj.weight");
  const TensorView* up1 = c->Find("model.layers.1.mlp.up_proj.weight");
  ASSERT_TRUE(up && gate && up1);
  EXPECT_NE(std::memcmp(up->data, gate->data, up->nbytes), 0);
  EXPECT_NE(std::memcmp(up->data, up1->data, up->nbytes), 0);
}

class RandomModelTieTest : public ::testing::TestWithParam<bool> {};

TEST_P(RandomModelTieTest, TinyHasExactlyTheExpectedTensorsWithTheirShapes) {
  const std::string dir = TestDir();
  RandomModelOptions options = Tiny();
  options.tie_word_embeddings = GetParam();
  ASSERT_TRUE(WriteRandomModel(options, dir).ok());
  std::unique_ptr<Checkpoint> c = OpenOrDie(dir);
  ASSERT_TRUE(c);
  absl::StatusOr<ModelConfig> config = ParseModelConfig(c->config_json());
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->tie_word_embeddings, GetParam());
  std::vector<std::string> expected_names;
  for (const TensorSpec& spec : ExpectedTensors(*config)) {
    expected_names.push_back(spec.name);
    const TensorView* view = c->Find(spec.name);
    ASSERT_NE(view, nullptr) << spec.name;
    EXPECT_EQ(view->shape, spec.shape) << spec.name;
    EXPECT_EQ(view->dtype, DType::kBF16);
    EXPECT_TRUE(c->ReadF32(spec.name, spec.shape).ok());
  }
  std::sort(expected_names.begin(), expected_names.end());
  EXPECT_EQ(c->TensorNames(), expected_names);  // nothing extra
  EXPECT_EQ(c->Find("lm_head.weight") != nullptr, !GetParam());
}

INSTANTIATE_TEST_SUITE_P(TiedAndUntied, RandomModelTieTest, ::testing::Bool());

TEST(RandomModelTest, ConfigJsonDescribesThePreset) {
  const std::string dir = TestDir();
  RandomModelOptions options = Tiny();
  options.dtype = DType::kF16;
  ASSERT_TRUE(WriteRandomModel(options, dir).ok());
  std::unique_ptr<Checkpoint> c = OpenOrDie(dir);
  ASSERT_TRUE(c);
  ModelConfig written = *ParseModelConfig(c->config_json());
  ModelConfig preset = *PresetConfig("tiny");
  EXPECT_EQ(written.num_layers, preset.num_layers);
  EXPECT_EQ(written.hidden_size, preset.hidden_size);
  EXPECT_EQ(written.num_key_value_heads, preset.num_key_value_heads);
  EXPECT_EQ(written.head_dim, preset.head_dim);
  EXPECT_EQ(written.eos_token_ids, preset.eos_token_ids);
  EXPECT_EQ(written.torch_dtype, "float16");
  EXPECT_EQ(c->Find("model.norm.weight")->dtype, DType::kF16);
}

TEST(RandomModelTest, ShardedWriteOpensToTheSameTensorsAsSingleFile) {
  const std::string single = TestDir("single"), sharded = TestDir("sharded");
  ASSERT_TRUE(WriteRandomModel(Tiny(3), single).ok());
  RandomModelOptions options = Tiny(3);
  options.num_shards = 3;
  ASSERT_TRUE(WriteRandomModel(options, sharded).ok());
  EXPECT_FALSE(fs::exists(sharded + "/model.safetensors"));
  for (const char* shard :
       {"/model-00001-of-00003.safetensors", "/model-00002-of-00003.safetensors",
        "/model-00003-of-00003.safetensors"}) {
    EXPECT_TRUE(fs::exists(sharded + shard)) << shard;
  }
  const nlohmann::json index =
      nlohmann::json::parse(ReadAll(sharded + "/model.safetensors.index.json"));
  std::set<std::string> shards_used;
  for (const auto& [name, file] : index["weight_map"].items()) shards_used.insert(file);
  EXPECT_EQ(shards_used.size(), 3u);

  std::unique_ptr<Checkpoint> a = OpenOrDie(single), b = OpenOrDie(sharded);
  ASSERT_TRUE(a && b);
  ASSERT_EQ(a->TensorNames(), b->TensorNames());
  uint64_t total = 0;
  for (const std::string& name : a->TensorNames()) {
    const TensorView* va = a->Find(name);
    const TensorView* vb = b->Find(name);
    ASSERT_EQ(va->nbytes, vb->nbytes) << name;
    EXPECT_EQ(std::memcmp(va->data, vb->data, va->nbytes), 0) << name;
    total += va->nbytes;
  }
  EXPECT_EQ(index["metadata"]["total_size"].get<uint64_t>(), total);
}

TEST(RandomModelTest, RewritingADirectoryInTheOtherLayoutReplacesTheOldOne) {
  const std::string dir = TestDir();
  RandomModelOptions options = Tiny(1);
  options.num_shards = 2;
  ASSERT_TRUE(WriteRandomModel(options, dir).ok());
  ASSERT_TRUE(WriteRandomModel(Tiny(2), dir).ok());
  EXPECT_FALSE(fs::exists(dir + "/model.safetensors.index.json"));
  options.seed = 4;
  ASSERT_TRUE(WriteRandomModel(options, dir).ok());
  EXPECT_FALSE(fs::exists(dir + "/model.safetensors"));

  const std::string reference = TestDir("reference");
  ASSERT_TRUE(WriteRandomModel(Tiny(4), reference).ok());
  std::unique_ptr<Checkpoint> a = OpenOrDie(dir), b = OpenOrDie(reference);
  ASSERT_TRUE(a && b);
  const TensorView* va = a->Find("model.embed_tokens.weight");
  const TensorView* vb = b->Find("model.embed_tokens.weight");
  EXPECT_EQ(std::memcmp(va->data, vb->data, va->nbytes), 0);  // seed 4 was what got read
}

TEST(RandomModelTest, WeightsHaveTheIntendedScales) {
  const std::string dir = TestDir();
  RandomModelOptions options;
  options.preset = "small";
  options.dtype = DType::kF32;
  ASSERT_TRUE(WriteRandomModel(options, dir).ok());
  std::unique_ptr<Checkpoint> c = OpenOrDie(dir);
  ASSERT_TRUE(c);
  const ModelConfig config = *ParseModelConfig(c->config_json());
  for (const TensorSpec& spec : ExpectedTensors(config)) {
    const std::vector<float> v = *c->ReadF32(spec.name, spec.shape);
    if (spec.shape.size() == 1) {  // RMSNorm weights
      for (float x : v) ASSERT_TRUE(x >= 0.95f && x <= 1.05f) << spec.name << " " << x;
      EXPECT_GT(Std(v), 0.01) << spec.name;
      continue;
    }
    double expected_std = 1.0 / std::sqrt(static_cast<double>(spec.shape[1]));
    if (spec.name == "model.embed_tokens.weight") expected_std = 1.0;
    if (spec.name == "lm_head.weight") expected_std = 3.0 / std::sqrt(256.0);
    EXPECT_NEAR(Std(v), expected_std, 0.05 * expected_std) << spec.name;
    EXPECT_NEAR(Mean(v), 0.0, 0.05 * expected_std) << spec.name;
  }
}

// Softmax of lm_head times unit-RMS hidden states (what the final RMSNorm produces): the top
// token should typically get a few percent to about half of the probability mass.
TEST(RandomModelTest, SmallPresetNextTokenDistributionIsPeakedButNotOneHot) {
  const std::string dir = TestDir();
  RandomModelOptions options;
  options.preset = "small";
  ASSERT_TRUE(WriteRandomModel(options, dir).ok());
  std::unique_ptr<Checkpoint> c = OpenOrDie(dir);
  ASSERT_TRUE(c);
  const int64_t vocab = 4096, hidden = 256;
  const std::vector<float> lm_head = *c->ReadF32("lm_head.weight", {vocab, hidden});
  const std::vector<float> embed = *c->ReadF32("model.embed_tokens.weight", {vocab, hidden});
  std::vector<double> top_probs;
  for (int64_t token = 0; token < 64; ++token) {
    // A hidden state: an embedding row, RMS-normalised.
    std::vector<double> h(embed.begin() + token * hidden, embed.begin() + (token + 1) * hidden);
    double ms = 0;
    for (double x : h) ms += x * x / hidden;
    for (double& x : h) x /= std::sqrt(ms);
    std::vector<double> logits(vocab);
    for (int64_t v = 0; v < vocab; ++v) {
      double dot = 0;
      for (int64_t i = 0; i < hidden; ++i) dot += lm_head[v * hidden + i] * h[i];
      logits[v] = dot;
    }
    const double max = *std::max_element(logits.begin(), logits.end());
    double sum = 0;
    for (double l : logits) sum += std::exp(l - max);
    top_probs.push_back(1.0 / sum);
  }
  std::sort(top_probs.begin(), top_probs.end());
  const double median = top_probs[top_probs.size() / 2];
  EXPECT_GT(median, 0.05);
  EXPECT_LT(median, 0.6);
  EXPECT_LT(top_probs.back(), 0.99);
}

TEST(RandomModelTest, Qwen2ConfigGetsBiasesThatLoad) {
  const std::string dir = TestDir();
  ModelConfig config = *PresetConfig("tiny");
  config.architecture = "Qwen2ForCausalLM";
  config.family = ModelFamily::kQwen2;
  config.qk_norm = false;
  config.qkv_bias = true;
  ASSERT_TRUE(WriteRandomModelForConfig(config, RandomModelOptions(), dir).ok());
  std::unique_ptr<Checkpoint> c = OpenOrDie(dir);
  ASSERT_TRUE(c);
  EXPECT_EQ(ParseModelConfig(c->config_json())->family, ModelFamily::kQwen2);
  absl::StatusOr<std::vector<float>> bias =
      c->ReadF32("model.layers.1.self_attn.k_proj.bias", {32});
  ASSERT_TRUE(bias.ok()) << bias.status();
  EXPECT_LT(Std(*bias), 0.05);
  EXPECT_GT(Std(*bias), 0.005);
  EXPECT_EQ(c->Find("model.layers.0.self_attn.q_norm.weight"), nullptr);
}

TEST(RandomModelTest, MoeSmallWritesRouterAndExpertsThatLoad) {
  const std::string dir = TestDir();
  RandomModelOptions options;
  options.preset = "moe-small";
  ASSERT_TRUE(WriteRandomModel(options, dir).ok());
  std::unique_ptr<Checkpoint> c = OpenOrDie(dir);
  absl::StatusOr<ModelConfig> config = ReadModelConfig(*c);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->mlp_only_layers, std::vector<int32_t>({1}));
  EXPECT_EQ(c->TensorNames().size(), ExpectedTensors(*config).size());
  absl::StatusOr<std::vector<float>> router = c->ReadF32("model.layers.0.mlp.gate.weight", {8, 256});
  ASSERT_TRUE(router.ok()) << router.status();
  EXPECT_GT(Std(*router), 0.03);  // 1 / sqrt(256) = 0.0625
  EXPECT_LT(Std(*router), 0.1);
  EXPECT_NE(c->Find("model.layers.1.mlp.gate_proj.weight"), nullptr);
  EXPECT_NE(c->Find("model.layers.3.mlp.experts.7.down_proj.weight"), nullptr);
}

TEST(RandomModelTest, UnknownPresetListsTheKnownNames) {
  RandomModelOptions options;
  options.preset = "huge";
  absl::Status s = WriteRandomModel(options, TestDir());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("'huge'"));
  for (const std::string& name : PresetNames()) EXPECT_THAT(s.message(), HasSubstr(name));
}

TEST(RandomModelTest, ShardCountOutOfRangeIsInvalidArgument) {
  RandomModelOptions options = Tiny();
  for (int shards : {0, 1000}) {
    options.num_shards = shards;
    EXPECT_EQ(WriteRandomModel(options, TestDir()).code(), absl::StatusCode::kInvalidArgument);
  }
}

TEST(RandomModelTest, PresetsHaveTheDocumentedShapes) {
  const ModelConfig tiny = *PresetConfig("tiny");
  EXPECT_TRUE(tiny.tie_word_embeddings);
  EXPECT_EQ(tiny.vocab_size, 256);
  const ModelConfig small = *PresetConfig("small");
  EXPECT_EQ(small.num_layers, 4);
  EXPECT_EQ(small.hidden_size, 256);
  EXPECT_EQ(small.eos_token_ids, std::vector<int32_t>({2}));
  EXPECT_FALSE(small.tie_word_embeddings);
  const ModelConfig big = *PresetConfig("qwen3-8b");
  EXPECT_EQ(ParameterCount(big), 8190735360);  // Qwen3-8B's published safetensors total
  // Qwen3-32B's safetensors total: 65524246528 bytes of bf16.
  EXPECT_EQ(ParameterCount(*PresetConfig("qwen3-32b")), 32762123264);
  const ModelConfig moe = *PresetConfig("qwen3-30b-a3b");
  // Qwen3-30B-A3B's safetensors total: 61064245248 bytes of bf16.
  EXPECT_EQ(ParameterCount(moe), 30532122624);
  EXPECT_EQ(moe.NumMoeLayers(), 48);
  EXPECT_EQ(moe.num_experts, 128);
  EXPECT_EQ(moe.num_experts_per_tok, 8);
  EXPECT_EQ(moe.moe_intermediate_size, 768);
  EXPECT_TRUE(moe.norm_topk_prob);
  const ModelConfig moe_small = *PresetConfig("moe-small");
  EXPECT_EQ(moe_small.NumMoeLayers(), 3);
  EXPECT_FALSE(moe_small.IsMoeLayer(1));
  for (const std::string& name : PresetNames()) {
    absl::StatusOr<ModelConfig> preset = PresetConfig(name);
    ASSERT_TRUE(preset.ok()) << name;
    EXPECT_TRUE(ParseModelConfig(ModelConfigToJson(*preset)).ok()) << name;
  }
}

// A checkpoint directory's served config: config.json's EOS ids, then generation_config.json's.
TEST(RandomModelTest, ReadModelConfigMergesTheGenerationConfigBesideConfigJson) {
  const std::string dir = TestDir();
  ASSERT_TRUE(WriteRandomModel(Tiny(), dir).ok());
  EXPECT_EQ(ReadModelConfig(*OpenOrDie(dir))->eos_token_ids, std::vector<int32_t>({1}));
  std::ofstream(dir + "/generation_config.json") << R"({"eos_token_id": [1, 9]})";
  absl::StatusOr<ModelConfig> c = ReadModelConfig(*OpenOrDie(dir));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->eos_token_ids, std::vector<int32_t>({1, 9}));

  std::ofstream(dir + "/generation_config.json") << R"({"eos_token_id": "nine"})";
  const absl::Status bad = ReadModelConfig(*OpenOrDie(dir)).status();
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.message(), HasSubstr(dir + "/generation_config.json"));
  EXPECT_THAT(bad.message(), HasSubstr("eos_token_id"));

  // Not a regular file: refused at open, never read.
  fs::remove(dir + "/generation_config.json");
  fs::create_directory(dir + "/generation_config.json");
  EXPECT_FALSE(Checkpoint::Open(dir).ok());
}

TEST(RandomModelTest, ProgressReportsEveryTensorUpToTheTotal) {
  RandomModelOptions options = Tiny();
  options.num_shards = 2;
  int calls = 0;
  uint64_t last_done = 0, last_total = 0;
  options.progress = [&](const std::string&, uint64_t done, uint64_t total) {
    ++calls;
    EXPECT_GT(done, last_done);
    last_done = done;
    last_total = total;
  };
  ASSERT_TRUE(WriteRandomModel(options, TestDir()).ok());
  EXPECT_EQ(calls, static_cast<int>(ExpectedTensors(*PresetConfig("tiny")).size()));
  EXPECT_EQ(last_done, last_total);
  EXPECT_EQ(last_total, static_cast<uint64_t>(ParameterCount(*PresetConfig("tiny"))) * 2);
}

}  // namespace
}  // namespace rollout
