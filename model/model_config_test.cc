#include "model/model_config.h"

#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace rollout {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using json = nlohmann::json;

// Qwen/Qwen3-8B's config.json (abridged to the fields that matter, plus some it ignores).
constexpr char kQwen3Config[] = R"({
  "architectures": ["Qwen3ForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 151643,
  "eos_token_id": 151645,
  "head_dim": 128,
  "hidden_act": "silu",
  "hidden_size": 4096,
  "initializer_range": 0.02,
  "intermediate_size": 12288,
  "max_position_embeddings": 40960,
  "max_window_layers": 36,
  "model_type": "qwen3",
  "num_attention_heads": 32,
  "num_hidden_layers": 36,
  "num_key_value_heads": 8,
  "rms_norm_eps": 1e-06,
  "rope_scaling": null,
  "rope_theta": 1000000,
  "sliding_window": null,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "use_cache": true,
  "use_sliding_window": false,
  "vocab_size": 151936
})";

// Qwen/Qwen2.5-0.5B-Instruct: tied embeddings, no head_dim field.
constexpr char kQwen2Config[] = R"({
  "architectures": ["Qwen2ForCausalLM"],
  "eos_token_id": 151645,
  "hidden_act": "silu",
  "hidden_size": 896,
  "intermediate_size": 4864,
  "max_position_embeddings": 32768,
  "model_type": "qwen2",
  "num_attention_heads": 14,
  "num_hidden_layers": 24,
  "num_key_value_heads": 2,
  "rms_norm_eps": 1e-06,
  "rope_theta": 1000000.0,
  "sliding_window": 32768,
  "tie_word_embeddings": true,
  "torch_dtype": "bfloat16",
  "use_sliding_window": false,
  "vocab_size": 151936
})";

// TinyLlama-1.1B-Chat: no rope_theta (default 10000), eos as a list here.
constexpr char kLlamaConfig[] = R"({
  "architectures": ["LlamaForCausalLM"],
  "eos_token_id": [2, 32000],
  "hidden_act": "silu",
  "hidden_size": 2048,
  "intermediate_size": 5632,
  "max_position_embeddings": 2048,
  "model_type": "llama",
  "num_attention_heads": 32,
  "num_hidden_layers": 22,
  "num_key_value_heads": 4,
  "rms_norm_eps": 1e-05,
  "rope_scaling": null,
  "tie_word_embeddings": false,
  "torch_dtype": "float32",
  "vocab_size": 32000
})";

// A minimal config with every required field and nothing else.
json MinimalConfig() {
  return json::parse(R"({
    "architectures": ["Qwen3ForCausalLM"],
    "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
    "num_attention_heads": 4, "vocab_size": 256, "max_position_embeddings": 512
  })");
}

absl::Status ParseStatus(const json& j) { return ParseModelConfig(j.dump()).status(); }

TEST(ModelConfigTest, ParsesQwen3ConfigWithQkNormAndNoBias) {
  absl::StatusOr<ModelConfig> c = ParseModelConfig(kQwen3Config);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->architecture, "Qwen3ForCausalLM");
  EXPECT_EQ(c->family, ModelFamily::kQwen3);
  EXPECT_TRUE(c->qk_norm);
  EXPECT_FALSE(c->qkv_bias);
  EXPECT_EQ(c->num_layers, 36);
  EXPECT_EQ(c->hidden_size, 4096);
  EXPECT_EQ(c->intermediate_size, 12288);
  EXPECT_EQ(c->num_attention_heads, 32);
  EXPECT_EQ(c->num_key_value_heads, 8);
  EXPECT_EQ(c->head_dim, 128);
  EXPECT_EQ(c->vocab_size, 151936);
  EXPECT_EQ(c->max_position_embeddings, 40960);
  EXPECT_FLOAT_EQ(c->rms_norm_eps, 1e-6f);
  EXPECT_FLOAT_EQ(c->rope_theta, 1e6f);
  EXPECT_FALSE(c->tie_word_embeddings);
  EXPECT_EQ(c->eos_token_ids, std::vector<int32_t>({151645}));
  EXPECT_EQ(c->torch_dtype, "bfloat16");
}

TEST(ModelConfigTest, ParsesQwen2ConfigWithQkvBiasAndDerivedHeadDim) {
  absl::StatusOr<ModelConfig> c = ParseModelConfig(kQwen2Config);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->family, ModelFamily::kQwen2);
  EXPECT_TRUE(c->qkv_bias);
  EXPECT_FALSE(c->qk_norm);
  EXPECT_EQ(c->head_dim, 64);  // 896 / 14
  EXPECT_TRUE(c->tie_word_embeddings);
}

TEST(ModelConfigTest, ParsesLlamaConfigWithEosListAndDefaultRopeTheta) {
  absl::StatusOr<ModelConfig> c = ParseModelConfig(kLlamaConfig);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->family, ModelFamily::kLlama);
  EXPECT_FALSE(c->qkv_bias);
  EXPECT_FALSE(c->qk_norm);
  EXPECT_EQ(c->eos_token_ids, std::vector<int32_t>({2, 32000}));
  EXPECT_FLOAT_EQ(c->rope_theta, 10000.0f);
  EXPECT_FLOAT_EQ(c->rms_norm_eps, 1e-5f);
  EXPECT_EQ(c->torch_dtype, "float32");
}

TEST(ModelConfigTest, MistralArchitectureWithoutSlidingWindowIsLlamaFamily) {
  json j = MinimalConfig();
  j["architectures"] = {"MistralForCausalLM"};
  j["sliding_window"] = nullptr;
  absl::StatusOr<ModelConfig> c = ParseModelConfig(j.dump());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->family, ModelFamily::kLlama);
  EXPECT_EQ(c->architecture, "MistralForCausalLM");
}

TEST(ModelConfigTest, EosTokenIdMayBeIntListNullOrAbsent) {
  json j = MinimalConfig();
  j["eos_token_id"] = 7;
  EXPECT_EQ(ParseModelConfig(j.dump())->eos_token_ids, std::vector<int32_t>({7}));
  j["eos_token_id"] = {3, 4};
  EXPECT_EQ(ParseModelConfig(j.dump())->eos_token_ids, std::vector<int32_t>({3, 4}));
  j["eos_token_id"] = nullptr;
  EXPECT_TRUE(ParseModelConfig(j.dump())->eos_token_ids.empty());
  j.erase("eos_token_id");
  EXPECT_TRUE(ParseModelConfig(j.dump())->eos_token_ids.empty());
  j["eos_token_id"] = "2";
  absl::Status bad = ParseStatus(j);
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.message(), HasSubstr("eos_token_id"));
}

TEST(ModelConfigTest, OptionalFieldsTakeHuggingFaceDefaults) {
  absl::StatusOr<ModelConfig> c = ParseModelConfig(MinimalConfig().dump());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->num_key_value_heads, 4);  // = heads
  EXPECT_EQ(c->head_dim, 16);            // = 64 / 4
  EXPECT_FLOAT_EQ(c->rope_theta, 10000.0f);
  EXPECT_FLOAT_EQ(c->rms_norm_eps, 1e-6f);
  EXPECT_FALSE(c->tie_word_embeddings);
  EXPECT_EQ(c->torch_dtype, "bfloat16");
}

TEST(ModelConfigTest, FallsBackToModelTypeWhenArchitecturesIsMissing) {
  json j = MinimalConfig();
  j.erase("architectures");
  j["model_type"] = "qwen2";
  absl::StatusOr<ModelConfig> c = ParseModelConfig(j.dump());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->family, ModelFamily::kQwen2);
  EXPECT_EQ(c->architecture, "Qwen2ForCausalLM");
  j["model_type"] = "gpt2";
  absl::Status bad = ParseStatus(j);
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.message(), HasSubstr("'gpt2'"));
}

TEST(ModelConfigTest, UnknownArchitectureIsInvalidArgumentListingSupportedOnes) {
  json j = MinimalConfig();
  j["architectures"] = {"GPT2LMHeadModel"};
  absl::Status s = ParseStatus(j);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("unsupported architecture 'GPT2LMHeadModel'"));
  EXPECT_THAT(s.message(), HasSubstr("Qwen3ForCausalLM"));
  EXPECT_THAT(s.message(), HasSubstr("LlamaForCausalLM"));
}

TEST(ModelConfigTest, EachMissingRequiredFieldIsNamed) {
  for (const char* field : {"num_hidden_layers", "hidden_size", "intermediate_size",
                            "num_attention_heads", "vocab_size", "max_position_embeddings"}) {
    json j = MinimalConfig();
    j.erase(field);
    absl::Status s = ParseStatus(j);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << field;
    EXPECT_THAT(s.message(), HasSubstr(field));
    EXPECT_THAT(s.message(), HasSubstr("missing"));
  }
}

TEST(ModelConfigTest, NonPositiveOrMistypedSizesAreNamed) {
  for (const char* field :
       {"num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
        "num_key_value_heads", "vocab_size", "max_position_embeddings", "head_dim"}) {
    json j = MinimalConfig();
    j[field] = 0;
    absl::Status s = ParseStatus(j);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << field;
    EXPECT_THAT(s.message(), HasSubstr(field));
  }
  json j = MinimalConfig();
  j["hidden_size"] = "big";
  EXPECT_THAT(ParseStatus(j).message(), HasSubstr("hidden_size"));
  j = MinimalConfig();
  j["vocab_size"] = 1ll << 40;
  EXPECT_THAT(ParseStatus(j).message(), HasSubstr("vocab_size"));
  j = MinimalConfig();
  j["rms_norm_eps"] = "small";
  EXPECT_THAT(ParseStatus(j).message(), HasSubstr("rms_norm_eps"));
}

TEST(ModelConfigTest, HeadsNotDivisibleByKvHeadsNamesTheField) {
  json j = MinimalConfig();
  j["num_key_value_heads"] = 3;
  absl::Status s = ParseStatus(j);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("num_key_value_heads"));
  EXPECT_THAT(s.message(), HasSubstr("num_attention_heads"));
}

TEST(ModelConfigTest, HiddenNotDivisibleByHeadsNeedsExplicitHeadDim) {
  json j = MinimalConfig();
  j["num_attention_heads"] = 6;
  j["num_key_value_heads"] = 2;
  EXPECT_THAT(ParseStatus(j).message(), HasSubstr("head_dim"));
  j["head_dim"] = 16;
  EXPECT_TRUE(ParseStatus(j).ok());
}

TEST(ModelConfigTest, UnsupportedFeaturesAreRefusedByName) {
  struct Case {
    const char* field;
    json value;
    const char* architecture;
  };
  for (const Case& c : {Case{"rope_scaling", json{{"rope_type", "llama3"}}, "LlamaForCausalLM"},
                        Case{"use_sliding_window", true, "Qwen2ForCausalLM"},
                        Case{"hidden_act", "gelu", "Qwen3ForCausalLM"},
                        Case{"attention_bias", true, "LlamaForCausalLM"},
                        Case{"mlp_bias", true, "LlamaForCausalLM"},
                        Case{"sliding_window", 128, "MistralForCausalLM"}}) {
    json j = MinimalConfig();
    j["architectures"] = {c.architecture};
    j[c.field] = c.value;
    absl::Status s = ParseStatus(j);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.field;
    EXPECT_THAT(s.message(), HasSubstr(c.field));
  }
}

// transformers 5 moved rope_theta into "rope_parameters".
TEST(ModelConfigTest, RopeParametersOfTransformers5AreRead) {
  json j = MinimalConfig();
  j.erase("rope_theta");
  j["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 1000000.0}};
  absl::StatusOr<ModelConfig> c = ParseModelConfig(j.dump());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->rope_theta, 1e6f);

  j["rope_theta"] = 1000000;  // both, agreeing
  c = ParseModelConfig(j.dump());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->rope_theta, 1e6f);
}

TEST(ModelConfigTest, RopeParametersOfUnsupportedOrMalformedRopeAreRefused) {
  for (const json& rp :
       {json{{"rope_type", "longrope"}, {"rope_theta", 1e6}, {"factor", 4.0}},
        json{{"rope_type", "default"}, {"rope_theta", -1}},
        json{{"rope_theta", 1e6}, {"factor", 2.0}}, json("default"), json{{"rope_theta", 5e5}}}) {
    json j = MinimalConfig();
    j["rope_theta"] = 1000000;  // disagrees with the last case
    j["rope_parameters"] = rp;
    const absl::Status s = ParseStatus(j);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << rp.dump();
    EXPECT_THAT(s.message(), HasSubstr("rope_parameters")) << rp.dump();
  }
}

TEST(ModelConfigTest, TorchDtypeMustBeOneTheEngineServes) {
  json j = MinimalConfig();
  j["dtype"] = "float16";  // transformers 5's name for it
  EXPECT_EQ(ParseModelConfig(j.dump())->torch_dtype, "float16");
  for (const char* dtype : {"float8_e4m3fn", "int8", "auto"}) {
    j["torch_dtype"] = dtype;
    const absl::Status s = ParseStatus(j);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << dtype;
    EXPECT_THAT(s.message(), HasSubstr("torch_dtype")) << dtype;
    EXPECT_THAT(s.message(), HasSubstr("bfloat16, float16 or float32")) << dtype;
  }
}

// generation_config.json's EOS ids join config.json's, as vLLM and SGLang merge them: Qwen3's
// Instruct configs name <|im_end|> in config.json and also <|endoftext|> in the generation
// config.
TEST(ModelConfigTest, GenerationConfigEosIdsAreMergedAfterConfigsInOrder) {
  ModelConfig c = *ParseModelConfig(kQwen3Config);
  ASSERT_TRUE(MergeGenerationConfig(R"({"bos_token_id": 151643, "do_sample": true,
      "eos_token_id": [151645, 151643], "temperature": 0.6})", &c).ok());
  EXPECT_EQ(c.eos_token_ids, std::vector<int32_t>({151645, 151643}));
  ASSERT_TRUE(MergeGenerationConfig(R"({"eos_token_id": 7})", &c).ok());
  EXPECT_EQ(c.eos_token_ids, std::vector<int32_t>({151645, 151643, 7}));
  ASSERT_TRUE(MergeGenerationConfig("", &c).ok());  // no file
  ASSERT_TRUE(MergeGenerationConfig(R"({"eos_token_id": null})", &c).ok());
  EXPECT_EQ(c.eos_token_ids.size(), 3u);

  ModelConfig none = *ParseModelConfig(MinimalConfig().dump());  // config.json has none
  ASSERT_TRUE(MergeGenerationConfig(R"({"eos_token_id": [3, 3, 4]})", &none).ok());
  EXPECT_EQ(none.eos_token_ids, std::vector<int32_t>({3, 4}));

  for (const char* bad : {R"({"eos_token_id": "2"})", R"({"eos_token_id": [-1]})", "[1]", "{"}) {
    ModelConfig before = c;
    const absl::Status s = MergeGenerationConfig(bad, &c);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(s.message(), HasSubstr("generation_config.json")) << bad;
    EXPECT_EQ(c.eos_token_ids, before.eos_token_ids) << bad;
  }
  EXPECT_THAT(MergeGenerationConfig(R"({"eos_token_id": "2"})", &c).message(),
              HasSubstr("eos_token_id"));
}

TEST(ModelConfigTest, InvalidJsonIsInvalidArgument) {
  EXPECT_EQ(ParseModelConfig("{\"hidden_size\": ").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseModelConfig("[1, 2]").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ModelConfigTest, ToJsonRoundTripsEveryField) {
  for (const char* text : {kQwen3Config, kQwen2Config, kLlamaConfig}) {
    absl::StatusOr<ModelConfig> a = ParseModelConfig(text);
    ASSERT_TRUE(a.ok()) << a.status();
    a->rms_norm_eps = 1.2345678e-5f;  // not a short decimal: must still round-trip exactly
    absl::StatusOr<ModelConfig> b = ParseModelConfig(ModelConfigToJson(*a));
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_EQ(b->architecture, a->architecture);
    EXPECT_EQ(b->family, a->family);
    EXPECT_EQ(b->num_layers, a->num_layers);
    EXPECT_EQ(b->hidden_size, a->hidden_size);
    EXPECT_EQ(b->intermediate_size, a->intermediate_size);
    EXPECT_EQ(b->num_attention_heads, a->num_attention_heads);
    EXPECT_EQ(b->num_key_value_heads, a->num_key_value_heads);
    EXPECT_EQ(b->head_dim, a->head_dim);
    EXPECT_EQ(b->vocab_size, a->vocab_size);
    EXPECT_EQ(b->max_position_embeddings, a->max_position_embeddings);
    EXPECT_EQ(b->rms_norm_eps, a->rms_norm_eps);
    EXPECT_EQ(b->rope_theta, a->rope_theta);
    EXPECT_EQ(b->tie_word_embeddings, a->tie_word_embeddings);
    EXPECT_EQ(b->qk_norm, a->qk_norm);
    EXPECT_EQ(b->qkv_bias, a->qkv_bias);
    EXPECT_EQ(b->eos_token_ids, a->eos_token_ids);
    EXPECT_EQ(b->torch_dtype, a->torch_dtype);
    EXPECT_EQ(b->rope_scaling, a->rope_scaling);
  }
}

TEST(ModelConfigTest, ToJsonWritesHuggingFaceKeys) {
  json j = json::parse(ModelConfigToJson(*ParseModelConfig(kQwen3Config)));
  EXPECT_EQ(j["architectures"], json({"Qwen3ForCausalLM"}));
  EXPECT_EQ(j["model_type"], "qwen3");
  EXPECT_EQ(j["num_hidden_layers"], 36);
  EXPECT_EQ(j["eos_token_id"], 151645);
  EXPECT_EQ(j["rms_norm_eps"].dump(), "1e-06");
}

TEST(ModelConfigTest, ExpectedTensorsListsQwen3NamesAndShapes) {
  ModelConfig c = *ParseModelConfig(MinimalConfig().dump());
  c.num_key_value_heads = 2;
  c.qk_norm = true;
  std::vector<TensorSpec> specs = ExpectedTensors(c);
  ASSERT_EQ(specs.size(), 1 + 2 * 11 + 2u);  // embed, 11 per layer, norm, lm_head
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const TensorSpec& s : specs) shapes[s.name] = s.shape;
  ASSERT_EQ(shapes.size(), specs.size()) << "duplicate names";
  using Shape = std::vector<int64_t>;
  EXPECT_EQ(shapes["model.embed_tokens.weight"], Shape({256, 64}));
  EXPECT_EQ(shapes["model.layers.1.input_layernorm.weight"], Shape({64}));
  EXPECT_EQ(shapes["model.layers.1.self_attn.q_proj.weight"], Shape({64, 64}));
  EXPECT_EQ(shapes["model.layers.1.self_attn.k_proj.weight"], Shape({32, 64}));
  EXPECT_EQ(shapes["model.layers.1.self_attn.v_proj.weight"], Shape({32, 64}));
  EXPECT_EQ(shapes["model.layers.1.self_attn.o_proj.weight"], Shape({64, 64}));
  EXPECT_EQ(shapes["model.layers.1.self_attn.q_norm.weight"], Shape({16}));
  EXPECT_EQ(shapes["model.layers.1.self_attn.k_norm.weight"], Shape({16}));
  EXPECT_EQ(shapes["model.layers.1.post_attention_layernorm.weight"], Shape({64}));
  EXPECT_EQ(shapes["model.layers.1.mlp.gate_proj.weight"], Shape({128, 64}));
  EXPECT_EQ(shapes["model.layers.1.mlp.up_proj.weight"], Shape({128, 64}));
  EXPECT_EQ(shapes["model.layers.1.mlp.down_proj.weight"], Shape({64, 128}));
  EXPECT_EQ(shapes["model.norm.weight"], Shape({64}));
  EXPECT_EQ(shapes["lm_head.weight"], Shape({256, 64}));
  EXPECT_EQ(shapes.count("model.layers.0.self_attn.q_proj.bias"), 0u);
}

TEST(ModelConfigTest, ExpectedTensorsAddsBiasesAndDropsTiedLmHead) {
  ModelConfig c = *ParseModelConfig(kQwen2Config);
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const TensorSpec& s : ExpectedTensors(c)) shapes[s.name] = s.shape;
  EXPECT_EQ(shapes["model.layers.23.self_attn.q_proj.bias"], std::vector<int64_t>({896}));
  EXPECT_EQ(shapes["model.layers.23.self_attn.k_proj.bias"], std::vector<int64_t>({128}));
  EXPECT_EQ(shapes["model.layers.23.self_attn.v_proj.bias"], std::vector<int64_t>({128}));
  EXPECT_EQ(shapes.count("model.layers.0.self_attn.q_norm.weight"), 0u);
  EXPECT_EQ(shapes.count("lm_head.weight"), 0u);
  EXPECT_EQ(shapes.size(), 1 + 24 * 12 + 1u);
}

}  // namespace
}  // namespace rollout

namespace rollout {
namespace {

// Found by fuzzing (tests/fuzz/regressions/model_config): 1e39 overflows float to +inf.
TEST(ModelConfigTest, FloatsBeyondFloatRangeAreRejectedNotLoadedAsInfinity) {
  for (const char* field : {"rms_norm_eps", "rope_theta"}) {
    nlohmann::json j = nlohmann::json::parse(R"({
      "architectures": ["Qwen3ForCausalLM"],
      "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
      "num_attention_heads": 4, "vocab_size": 256, "max_position_embeddings": 512
    })");
    j[field] = 1e39;
    absl::Status status = ParseModelConfig(j.dump()).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << field;
    EXPECT_NE(status.message().find(field), std::string::npos) << status;
    EXPECT_NE(status.message().find("finite"), std::string::npos) << status;
  }
}

// Qwen/Qwen3-30B-A3B's config.json (abridged).
constexpr char kQwen3MoeConfig[] = R"({
  "architectures": ["Qwen3MoeForCausalLM"],
  "attention_bias": false,
  "bos_token_id": 151643,
  "decoder_sparse_step": 1,
  "eos_token_id": 151645,
  "head_dim": 128,
  "hidden_act": "silu",
  "hidden_size": 2048,
  "intermediate_size": 6144,
  "max_position_embeddings": 40960,
  "max_window_layers": 48,
  "mlp_only_layers": [],
  "model_type": "qwen3_moe",
  "moe_intermediate_size": 768,
  "norm_topk_prob": true,
  "num_attention_heads": 32,
  "num_experts": 128,
  "num_experts_per_tok": 8,
  "num_hidden_layers": 48,
  "num_key_value_heads": 4,
  "output_router_logits": false,
  "rms_norm_eps": 1e-06,
  "rope_scaling": null,
  "rope_theta": 1000000.0,
  "router_aux_loss_coef": 0.001,
  "sliding_window": null,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "use_cache": true,
  "use_sliding_window": false,
  "vocab_size": 151936
})";

json SmallMoe() {
  return json::parse(R"({
    "architectures": ["Qwen3MoeForCausalLM"],
    "num_hidden_layers": 4, "hidden_size": 64, "intermediate_size": 128,
    "num_attention_heads": 4, "vocab_size": 256, "max_position_embeddings": 512,
    "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32
  })");
}

TEST(ModelConfigTest, ParsesQwen3MoeConfig) {
  absl::StatusOr<ModelConfig> c = ParseModelConfig(kQwen3MoeConfig);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->architecture, "Qwen3MoeForCausalLM");
  EXPECT_EQ(c->family, ModelFamily::kQwen3);
  EXPECT_TRUE(c->qk_norm);
  EXPECT_FALSE(c->qkv_bias);
  EXPECT_TRUE(c->is_moe());
  EXPECT_EQ(c->num_experts, 128);
  EXPECT_EQ(c->num_experts_per_tok, 8);
  EXPECT_EQ(c->moe_intermediate_size, 768);
  EXPECT_TRUE(c->norm_topk_prob);
  EXPECT_EQ(c->decoder_sparse_step, 1);
  EXPECT_TRUE(c->mlp_only_layers.empty());
  EXPECT_EQ(c->NumMoeLayers(), 48);
  EXPECT_EQ(c->RoutingSize(), 48 * 8);
  EXPECT_EQ(c->num_key_value_heads, 4);
}

TEST(ModelConfigTest, DenseConfigsHaveNoExperts) {
  for (const char* text : {kQwen3Config, kQwen2Config, kLlamaConfig}) {
    absl::StatusOr<ModelConfig> c = ParseModelConfig(text);
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_FALSE(c->is_moe());
    EXPECT_EQ(c->NumMoeLayers(), 0);
    EXPECT_EQ(c->RoutingSize(), 0);
  }
  // Experts in a dense architecture's config are not read: Qwen3ForCausalLM has none.
  json j = json::parse(kQwen3Config);
  j["num_experts"] = 8;
  absl::StatusOr<ModelConfig> c = ParseModelConfig(j.dump());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_FALSE(c->is_moe());
}

TEST(ModelConfigTest, MoeFieldsTakeTransformersDefaults) {
  json j = SmallMoe();
  j.erase("num_experts");
  j.erase("num_experts_per_tok");
  j.erase("moe_intermediate_size");
  absl::StatusOr<ModelConfig> c = ParseModelConfig(j.dump());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->num_experts, 128);
  EXPECT_EQ(c->num_experts_per_tok, 8);
  EXPECT_EQ(c->moe_intermediate_size, 768);
  EXPECT_FALSE(c->norm_topk_prob);
  EXPECT_EQ(c->decoder_sparse_step, 1);
  EXPECT_TRUE(c->mlp_only_layers.empty());
  // By model_type alone.
  j = SmallMoe();
  j.erase("architectures");
  j["model_type"] = "qwen3_moe";
  c = ParseModelConfig(j.dump());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->architecture, "Qwen3MoeForCausalLM");
  EXPECT_TRUE(c->is_moe());
}

// transformers 5.17's save_pretrained writes num_local_experts, not num_experts (found on the
// H200: its reference model of 8 experts was read as the default 128).
TEST(ModelConfigTest, TransformersFivesNumLocalExpertsIsTheExpertCount) {
  json j = SmallMoe();
  j.erase("num_experts");
  j["num_local_experts"] = 8;
  absl::StatusOr<ModelConfig> c = ParseModelConfig(j.dump());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->num_experts, 8);
  j["num_experts"] = 8;  // both, agreeing
  c = ParseModelConfig(j.dump());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->num_experts, 8);
  j["num_experts"] = 16;  // both, disagreeing
  c = ParseModelConfig(j.dump());
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(c.status().message().find("num_local_experts"), std::string::npos) << c.status();
}

TEST(ModelConfigTest, IsMoeLayerFollowsSparseStepAndMlpOnlyLayers) {
  json j = SmallMoe();
  j["num_hidden_layers"] = 6;
  j["decoder_sparse_step"] = 2;
  j["mlp_only_layers"] = {3};
  absl::StatusOr<ModelConfig> c = ParseModelConfig(j.dump());
  ASSERT_TRUE(c.ok()) << c.status();
  // (layer + 1) % 2 == 0: layers 1, 3, 5; layer 3 is dense by mlp_only_layers.
  std::vector<bool> moe;
  for (int i = 0; i < 6; ++i) moe.push_back(c->IsMoeLayer(i));
  EXPECT_EQ(moe, std::vector<bool>({false, true, false, false, false, true}));
  EXPECT_EQ(c->NumMoeLayers(), 2);
  EXPECT_EQ(c->MoeLayers(), std::vector<int32_t>({1, 5}));
  EXPECT_EQ(c->RoutingSize(), 4);
}

TEST(ModelConfigTest, BadOrUnsupportedMoeFieldsAreNamed) {
  struct Case {
    const char* field;
    json value;
    const char* message;
  };
  const std::vector<Case> cases = {
      {"num_experts", 0, "'num_experts' must be positive"},
      {"num_experts_per_tok", -1, "'num_experts_per_tok' must be positive"},
      {"num_experts_per_tok", 9, "'num_experts_per_tok' (9) must not exceed num_experts (8)"},
      {"moe_intermediate_size", 0, "'moe_intermediate_size' must be positive"},
      {"decoder_sparse_step", 0, "'decoder_sparse_step' must be positive"},
      {"norm_topk_prob", 1, "'norm_topk_prob' must be true or false"},
      {"mlp_only_layers", 2, "'mlp_only_layers' must be a list"},
      {"mlp_only_layers", json::array({0, 4}), "'mlp_only_layers' must hold layer indices in [0, 4)"},
      {"mlp_only_layers", json::array({"0"}), "'mlp_only_layers' must hold layer indices"},
      {"shared_expert_intermediate_size", 64,
       "'shared_expert_intermediate_size' (shared experts, as in Qwen2-MoE) is not supported"},
  };
  for (const Case& k : cases) {
    json j = SmallMoe();
    j[k.field] = k.value;
    absl::Status s = ParseStatus(j);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << k.field;
    EXPECT_THAT(s.message(), HasSubstr(k.message)) << k.field << ": " << s.message();
  }
  // Zero shared experts is the no-op a Qwen3-MoE config may carry.
  json j = SmallMoe();
  j["shared_expert_intermediate_size"] = 0;
  EXPECT_TRUE(ParseStatus(j).ok());
  // Qwen2-MoE itself is not a supported architecture.
  j["architectures"] = {"Qwen2MoeForCausalLM"};
  EXPECT_THAT(ParseStatus(j).message(), HasSubstr("unsupported architecture 'Qwen2MoeForCausalLM'"));
}

TEST(ModelConfigTest, MoeToJsonRoundTrips) {
  json j = SmallMoe();
  j["norm_topk_prob"] = true;
  j["decoder_sparse_step"] = 2;
  j["mlp_only_layers"] = {1};
  absl::StatusOr<ModelConfig> a = ParseModelConfig(j.dump());
  ASSERT_TRUE(a.ok()) << a.status();
  absl::StatusOr<ModelConfig> b = ParseModelConfig(ModelConfigToJson(*a));
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->architecture, "Qwen3MoeForCausalLM");
  EXPECT_EQ(b->num_experts, a->num_experts);
  EXPECT_EQ(b->num_experts_per_tok, a->num_experts_per_tok);
  EXPECT_EQ(b->moe_intermediate_size, a->moe_intermediate_size);
  EXPECT_EQ(b->norm_topk_prob, a->norm_topk_prob);
  EXPECT_EQ(b->decoder_sparse_step, a->decoder_sparse_step);
  EXPECT_EQ(b->mlp_only_layers, a->mlp_only_layers);
  // A hand-built MoE config without an architecture is written as Qwen3-MoE.
  ModelConfig hand = *a;
  hand.architecture.clear();
  EXPECT_THAT(ModelConfigToJson(hand), HasSubstr("Qwen3MoeForCausalLM"));
  hand.num_experts = 0;
  EXPECT_THAT(ModelConfigToJson(hand), Not(HasSubstr("Moe")));
}

TEST(ModelConfigTest, ExpectedTensorsOfMoeLayersAreThePerExpertHubLayout) {
  json j = SmallMoe();
  j["mlp_only_layers"] = {0};
  absl::StatusOr<ModelConfig> c = ParseModelConfig(j.dump());
  ASSERT_TRUE(c.ok()) << c.status();
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const TensorSpec& t : ExpectedTensors(*c)) shapes[t.name] = t.shape;
  // Layer 0 is dense.
  EXPECT_EQ(shapes["model.layers.0.mlp.gate_proj.weight"], std::vector<int64_t>({128, 64}));
  EXPECT_EQ(shapes.count("model.layers.0.mlp.gate.weight"), 0u);
  // Layer 1 is MoE: router and 8 experts, no dense MLP.
  EXPECT_EQ(shapes.count("model.layers.1.mlp.gate_proj.weight"), 0u);
  EXPECT_EQ(shapes["model.layers.1.mlp.gate.weight"], std::vector<int64_t>({8, 64}));
  for (int e = 0; e < 8; ++e) {
    const std::string p = "model.layers.1.mlp.experts." + std::to_string(e) + ".";
    EXPECT_EQ(shapes[p + "gate_proj.weight"], std::vector<int64_t>({32, 64})) << e;
    EXPECT_EQ(shapes[p + "up_proj.weight"], std::vector<int64_t>({32, 64})) << e;
    EXPECT_EQ(shapes[p + "down_proj.weight"], std::vector<int64_t>({64, 32})) << e;
  }
  EXPECT_EQ(shapes.count("model.layers.1.mlp.experts.8.gate_proj.weight"), 0u);
  // 3 MoE layers x (1 + 3 * 8) + 1 dense x 3, 4 x 8 attention and norms, embed, norm, lm_head.
  EXPECT_EQ(shapes.size(), 3u * 25 + 3 + 4 * 8 + 3);
}

}  // namespace
}  // namespace rollout
