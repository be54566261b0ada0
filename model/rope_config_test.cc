// config.json's RoPE fields through ParseModelConfig and back through ModelConfigToJson.
#include "model/rope_config.h"

#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/model_config.h"
#include "model/random_model.h"
#include "nlohmann/json.hpp"

namespace rollout {
namespace {

using ::testing::HasSubstr;
using json = nlohmann::json;

// meta-llama/Llama-3.1-8B-Instruct's config.json, abridged.
constexpr char kLlama31Config[] = R"({
  "architectures": ["LlamaForCausalLM"],
  "attention_bias": false,
  "bos_token_id": 128000,
  "eos_token_id": [128001, 128008, 128009],
  "head_dim": 128,
  "hidden_act": "silu",
  "hidden_size": 4096,
  "intermediate_size": 14336,
  "max_position_embeddings": 131072,
  "mlp_bias": false,
  "model_type": "llama",
  "num_attention_heads": 32,
  "num_hidden_layers": 32,
  "num_key_value_heads": 8,
  "rms_norm_eps": 1e-05,
  "rope_scaling": {
    "factor": 8.0,
    "high_freq_factor": 4.0,
    "low_freq_factor": 1.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3"
  },
  "rope_theta": 500000.0,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "vocab_size": 128256
})";

json Minimal() {
  return json::parse(R"({
    "architectures": ["LlamaForCausalLM"],
    "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
    "num_attention_heads": 4, "vocab_size": 256, "max_position_embeddings": 4096
  })");
}

absl::StatusOr<ModelConfig> Parse(const json& j) { return ParseModelConfig(j.dump()); }

// The config with `block` as its rope_scaling.
json WithScaling(const json& block) {
  json j = Minimal();
  j["rope_scaling"] = block;
  return j;
}

TEST(RopeConfigTest, ParsesLlama31) {
  absl::StatusOr<ModelConfig> c = ParseModelConfig(kLlama31Config);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->rope_theta, 500000.0f);
  const RopeScaling& s = c->rope_scaling;
  EXPECT_EQ(s.type, RopeType::kLlama3);
  EXPECT_EQ(s.factor, 8.0);
  EXPECT_EQ(s.low_freq_factor, 1.0);
  EXPECT_EQ(s.high_freq_factor, 4.0);
  EXPECT_EQ(s.original_max_position_embeddings, 8192);
  EXPECT_EQ(c->max_position_embeddings, 131072);
}

// transformers 5 writes "rope_parameters" with rope_theta inside, and no top-level rope_theta.
TEST(RopeConfigTest, ReadsTransformers5RopeParameters) {
  json j = json::parse(kLlama31Config);
  j["rope_parameters"] = j["rope_scaling"];
  j["rope_parameters"]["rope_theta"] = 500000.0;
  j.erase("rope_scaling");
  j.erase("rope_theta");
  absl::StatusOr<ModelConfig> c = Parse(j);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->rope_theta, 500000.0f);
  EXPECT_EQ(c->rope_scaling, ParseModelConfig(kLlama31Config)->rope_scaling);

  // Both blocks, describing the same RoPE: accepted.
  j["rope_scaling"] = json::parse(kLlama31Config)["rope_scaling"];
  c = Parse(j);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->rope_scaling.type, RopeType::kLlama3);
  // Describing different RoPEs: refused, naming both.
  j["rope_scaling"]["factor"] = 4.0;
  const absl::Status s = Parse(j).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("rope_parameters"));
  EXPECT_THAT(s.message(), HasSubstr("rope_scaling"));
}

TEST(RopeConfigTest, LegacyTypeKeyIsRead) {
  absl::StatusOr<ModelConfig> c = Parse(WithScaling({{"type", "linear"}, {"factor", 2.0}}));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->rope_scaling.type, RopeType::kLinear);
  EXPECT_EQ(c->rope_scaling.factor, 2.0);
  // Qwen2.5's long-context recipe.
  c = Parse(WithScaling(
      {{"type", "yarn"}, {"factor", 4.0}, {"original_max_position_embeddings", 32768}}));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->rope_scaling.type, RopeType::kYarn);
  EXPECT_EQ(c->rope_scaling.original_max_position_embeddings, 32768);
  // Both keys, agreeing.
  c = Parse(WithScaling({{"type", "dynamic"}, {"rope_type", "dynamic"}, {"factor", 2.0}}));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->rope_scaling.type, RopeType::kDynamic);
  // No type at all: default, which has no parameters.
  c = Parse(WithScaling({{"rope_theta", 10000.0}}));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->rope_scaling.type, RopeType::kDefault);
}

TEST(RopeConfigTest, OriginalContextDefaultsAsTransformersDoes) {
  const json llama3 = {
      {"rope_type", "llama3"}, {"factor", 8.0}, {"low_freq_factor", 1.0}, {"high_freq_factor", 4.0}};
  // Absent: max_position_embeddings.
  EXPECT_EQ(Parse(WithScaling(llama3))->rope_scaling.original_max_position_embeddings, 4096);
  // At the top level (Phi-3 style): taken from there.
  json j = WithScaling(llama3);
  j["original_max_position_embeddings"] = 1024;
  EXPECT_EQ(Parse(j)->rope_scaling.original_max_position_embeddings, 1024);
  // In both, disagreeing: refused.
  j["rope_scaling"]["original_max_position_embeddings"] = 2048;
  EXPECT_THAT(Parse(j).status().message(), HasSubstr("original_max_position_embeddings"));
  // yarn without a factor: max_position_embeddings / original.
  absl::StatusOr<ModelConfig> c =
      Parse(WithScaling({{"rope_type", "yarn"}, {"original_max_position_embeddings", 1024}}));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->rope_scaling.factor, 4.0);
}

TEST(RopeConfigTest, YarnOptionalParametersAreKeptAndZeroBetasTakeTheDefault) {
  absl::StatusOr<ModelConfig> c = Parse(WithScaling({{"rope_type", "yarn"},
                                                     {"factor", 40.0},
                                                     {"original_max_position_embeddings", 4096},
                                                     {"beta_fast", 0},
                                                     {"beta_slow", 2.0},
                                                     {"mscale", 0.707},
                                                     {"mscale_all_dim", 0.707},
                                                     {"truncate", false}}));
  ASSERT_TRUE(c.ok()) << c.status();
  const RopeScaling& s = c->rope_scaling;
  EXPECT_FALSE(s.beta_fast.has_value());
  EXPECT_EQ(s.beta_slow, 2.0);
  EXPECT_EQ(s.mscale, 0.707);
  EXPECT_EQ(s.mscale_all_dim, 0.707);
  EXPECT_FALSE(s.attention_factor.has_value());
  EXPECT_FALSE(s.truncate);
}

TEST(RopeConfigTest, UnsupportedTypesAreRefusedByNameListingTheSupportedOnes) {
  for (const char* type : {"longrope", "su", "mrope", "ntk"}) {
    const absl::Status s =
        Parse(WithScaling({{"rope_type", type}, {"factor", 2.0}, {"short_factor", {1.0}}}))
            .status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << type;
    EXPECT_THAT(s.message(), HasSubstr("rope_scaling")) << type;
    EXPECT_THAT(s.message(), HasSubstr(absl::StrCat("\"", type, "\""))) << type;
    EXPECT_THAT(s.message(), HasSubstr("default, linear, dynamic, yarn, llama3")) << type;
  }
}

TEST(RopeConfigTest, MalformedParametersAreRefusedNamingTheKey) {
  const json llama3 = {{"rope_type", "llama3"},
                       {"factor", 8.0},
                       {"low_freq_factor", 1.0},
                       {"high_freq_factor", 4.0},
                       {"original_max_position_embeddings", 1024}};
  struct Case {
    const char* key;
    json value;  // null: erase the key
    const char* message;
  };
  for (const Case& c : {Case{"low_freq_factor", nullptr, "low_freq_factor, which is missing"},
                        Case{"factor", 0.0, "factor must be positive"},
                        Case{"factor", "8", "factor must be a finite number"},
                        Case{"high_freq_factor", 1.0, "must be greater than low_freq_factor"},
                        Case{"original_max_position_embeddings", -5, "positive 32-bit integer"},
                        Case{"attention_factor", 1.0, "key \"attention_factor\" is not a parameter"},
                        Case{"type", "yarn", "disagree"},
                        Case{"partial_rotary_factor", 0.5, "partial_rotary_factor 0.5"}}) {
    json block = llama3;
    if (c.value.is_null()) {
      block.erase(c.key);
    } else {
      block[c.key] = c.value;
    }
    const absl::Status s = Parse(WithScaling(block)).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.key;
    EXPECT_THAT(s.message(), HasSubstr("rope_scaling")) << c.key;
    EXPECT_THAT(s.message(), HasSubstr(c.message)) << c.key;
  }
  // The parameters of the named type are listed.
  EXPECT_THAT(Parse(WithScaling({{"rope_type", "linear"}, {"factor", 2.0}, {"beta_fast", 1}}))
                  .status()
                  .message(),
              HasSubstr("its parameters: factor"));
  // yarn's own checks.
  const json yarn = {{"rope_type", "yarn"}, {"factor", 4.0}};
  for (const auto& [key, value] : {std::pair<const char*, json>{"truncate", "yes"},
                                   {"attention_factor", -1.0},
                                   {"beta_slow", -1.0}}) {
    json block = yarn;
    block[key] = value;
    EXPECT_THAT(Parse(WithScaling(block)).status().message(), HasSubstr(key)) << key;
  }
  // Not an object.
  EXPECT_THAT(Parse(WithScaling("llama3")).status().message(), HasSubstr("must be an object"));
  // Partial rotary at the top level.
  json j = Minimal();
  j["partial_rotary_factor"] = 0.25;
  EXPECT_THAT(Parse(j).status().message(), HasSubstr("partial_rotary_factor"));
  j["partial_rotary_factor"] = 1.0;
  EXPECT_TRUE(Parse(j).ok());
}

TEST(RopeConfigTest, RoundTripsThroughModelConfigToJson) {
  std::vector<json> blocks = {
      json::parse(kLlama31Config)["rope_scaling"],
      {{"rope_type", "linear"}, {"factor", 2.5}},
      {{"rope_type", "dynamic"}, {"factor", 2.0}},
      {{"rope_type", "yarn"}, {"factor", 4.0}, {"original_max_position_embeddings", 1024}},
      {{"rope_type", "yarn"},
       {"factor", 40.0},
       {"original_max_position_embeddings", 1024},
       {"attention_factor", 1.25},
       {"beta_fast", 16.0},
       {"beta_slow", 2.0},
       {"mscale", 1.0},
       {"mscale_all_dim", 0.707},
       {"truncate", false}},
  };
  for (const json& block : blocks) {
    absl::StatusOr<ModelConfig> a = Parse(WithScaling(block));
    ASSERT_TRUE(a.ok()) << a.status();
    absl::StatusOr<ModelConfig> b = ParseModelConfig(ModelConfigToJson(*a));
    ASSERT_TRUE(b.ok()) << b.status() << "\n" << ModelConfigToJson(*a);
    EXPECT_EQ(b->rope_scaling, a->rope_scaling) << block.dump();
    EXPECT_EQ(b->rope_theta, a->rope_theta);
  }
  // Default RoPE is written as "rope_scaling": null, as before.
  EXPECT_TRUE(json::parse(ModelConfigToJson(*Parse(Minimal())))["rope_scaling"].is_null());
  // The presets with scaled RoPE.
  for (const char* preset : {"llama3-small", "yarn-small"}) {
    const ModelConfig c = *PresetConfig(preset);
    absl::StatusOr<ModelConfig> back = ParseModelConfig(ModelConfigToJson(c));
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(back->rope_scaling, c.rope_scaling) << preset;
    EXPECT_NE(back->rope_scaling.type, RopeType::kDefault) << preset;
  }
  EXPECT_EQ(PresetConfig("llama3-small")->architecture, "LlamaForCausalLM");
}

}  // namespace
}  // namespace rollout
