#include "model/model_config.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <optional>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "common/status.h"
#include "model/rope_config.h"
#include "model/safetensors.h"
#include "nlohmann/json.hpp"

namespace rollout {
namespace {

using json = nlohmann::json;

constexpr char kSupported[] =
    "Qwen3ForCausalLM, Qwen3MoeForCausalLM, Qwen2ForCausalLM, LlamaForCausalLM, "
    "MistralForCausalLM";

struct ArchitectureInfo {
  const char* architecture;
  const char* model_type;
  ModelFamily family;
  bool moe = false;
};

constexpr ArchitectureInfo kArchitectures[] = {
    {"Qwen3ForCausalLM", "qwen3", ModelFamily::kQwen3},
    {"Qwen3MoeForCausalLM", "qwen3_moe", ModelFamily::kQwen3, /*moe=*/true},
    {"Qwen2ForCausalLM", "qwen2", ModelFamily::kQwen2},
    {"LlamaForCausalLM", "llama", ModelFamily::kLlama},
    {"MistralForCausalLM", "mistral", ModelFamily::kLlama},
};

bool IsNull(const json& j, const char* field) { return !j.contains(field) || j[field].is_null(); }

absl::Status FieldError(const char* field, std::string_view problem) {
  return absl::InvalidArgumentError(
      absl::StrCat("config.json: field '", field, "' ", std::string(problem)));
}

// Reads an int32 field: a missing (or null) field takes `fallback` when given, else is an error.
absl::Status GetInt(const json& j, const char* field, std::optional<int32_t> fallback,
                    int32_t* out) {
  if (IsNull(j, field)) {
    if (!fallback.has_value()) return FieldError(field, "is missing");
    *out = *fallback;
    return absl::OkStatus();
  }
  const json& v = j[field];
  constexpr int64_t kMin = std::numeric_limits<int32_t>::min();
  constexpr int64_t kMax = std::numeric_limits<int32_t>::max();
  const bool in_range =
      v.is_number_unsigned()
          ? v.get<uint64_t>() <= static_cast<uint64_t>(kMax)
          : v.is_number_integer() && v.get<int64_t>() >= kMin && v.get<int64_t>() <= kMax;
  if (!in_range) return FieldError(field, absl::StrCat("must be a 32-bit integer, got ", v.dump()));
  *out = static_cast<int32_t>(v.get<int64_t>());
  return absl::OkStatus();
}

absl::Status GetFloat(const json& j, const char* field, float fallback, float* out) {
  if (IsNull(j, field)) {
    *out = fallback;
    return absl::OkStatus();
  }
  if (!j[field].is_number())
    return FieldError(field, absl::StrCat("must be a number, got ", j[field].dump()));
  const double value = j[field].get<double>();
  *out = static_cast<float>(value);
  // A value beyond float's range would load as inf and serve garbage.
  if (!std::isfinite(*out)) {
    return FieldError(field, absl::StrCat("must be a finite float, got ", j[field].dump()));
  }
  return absl::OkStatus();
}

absl::Status GetBool(const json& j, const char* field, bool fallback, bool* out) {
  if (IsNull(j, field)) {
    *out = fallback;
    return absl::OkStatus();
  }
  if (!j[field].is_boolean())
    return FieldError(field, absl::StrCat("must be true or false, got ", j[field].dump()));
  *out = j[field].get<bool>();
  return absl::OkStatus();
}

absl::Status ParseEos(const json& j, std::vector<int32_t>* out) {
  out->clear();
  if (IsNull(j, "eos_token_id")) return absl::OkStatus();
  const json& v = j["eos_token_id"];
  auto add = [&](const json& id) {
    if (!id.is_number_integer() || id.get<int64_t>() < 0 ||
        id.get<int64_t>() > std::numeric_limits<int32_t>::max()) {
      return FieldError("eos_token_id",
                        absl::StrCat("must hold non-negative token ids, got ", v.dump()));
    }
    out->push_back(static_cast<int32_t>(id.get<int64_t>()));
    return absl::OkStatus();
  };
  if (!v.is_array()) return add(v);
  for (const json& id : v) {
    absl::Status status = add(id);
    if (!status.ok()) return status;
  }
  return absl::OkStatus();
}

// The double whose shortest decimal form is the shortest one that reads back as `x`, so that
// 1e-6f is written "1e-06" rather than "9.999999974752427e-07" and still round-trips exactly.
double ShortestDouble(float x) {
  char buf[32];
  for (int precision = 1; precision <= 9; ++precision) {
    std::snprintf(buf, sizeof(buf), "%.*g", precision, static_cast<double>(x));
    if (std::strtof(buf, nullptr) == x) break;
  }
  return std::strtod(buf, nullptr);
}

// The supported architecture `j` names: "architectures"[0], or "model_type" for configs that
// omit the list.
absl::StatusOr<const ArchitectureInfo*> FindArchitecture(const json& j) {
  std::string name;
  bool by_model_type = false;
  if (j.contains("architectures") && j["architectures"].is_array() && !j["architectures"].empty()) {
    if (!j["architectures"][0].is_string()) {
      return FieldError("architectures", "must be a list of strings");
    }
    name = j["architectures"][0].get<std::string>();
  } else if (j.contains("model_type") && j["model_type"].is_string()) {
    name = j["model_type"].get<std::string>();
    by_model_type = true;
  } else {
    return FieldError("architectures", "is missing (and there is no \"model_type\" either)");
  }
  for (const ArchitectureInfo& a : kArchitectures) {
    if (name == (by_model_type ? a.model_type : a.architecture)) return &a;
  }
  return absl::InvalidArgumentError(absl::StrCat("config.json: unsupported architecture '", name,
                                                 "' (supported: ", kSupported, ")"));
}

// The sizes every config must give and the fields that have Hugging Face defaults. All are
// read before any is reported, so the error names the first bad field in this order.
absl::Status ReadFields(const json& j, ModelConfig* c) {
  absl::Status s;
  auto check = [&](absl::Status status) {
    if (s.ok()) s = std::move(status);
  };
  check(GetInt(j, "num_hidden_layers", std::nullopt, &c->num_layers));
  check(GetInt(j, "hidden_size", std::nullopt, &c->hidden_size));
  check(GetInt(j, "intermediate_size", std::nullopt, &c->intermediate_size));
  check(GetInt(j, "num_attention_heads", std::nullopt, &c->num_attention_heads));
  check(GetInt(j, "num_key_value_heads", c->num_attention_heads, &c->num_key_value_heads));
  check(GetInt(j, "vocab_size", std::nullopt, &c->vocab_size));
  check(GetInt(j, "max_position_embeddings", std::nullopt, &c->max_position_embeddings));
  check(GetFloat(j, "rms_norm_eps", 1e-6f, &c->rms_norm_eps));
  check(GetFloat(j, "rope_theta", 10000.0f, &c->rope_theta));
  check(GetBool(j, "tie_word_embeddings", false, &c->tie_word_embeddings));
  check(ParseEos(j, &c->eos_token_ids));
  return s;
}

// Every size is positive and the query heads split evenly over the KV heads (grouped-query
// attention), so the divisions below and in the runners are exact.
absl::Status CheckSizes(const ModelConfig& c) {
  struct Positive {
    const char* field;
    int32_t value;
  };
  for (const Positive& p :
       {Positive{"num_hidden_layers", c.num_layers}, Positive{"hidden_size", c.hidden_size},
        Positive{"intermediate_size", c.intermediate_size},
        Positive{"num_attention_heads", c.num_attention_heads},
        Positive{"num_key_value_heads", c.num_key_value_heads},
        Positive{"vocab_size", c.vocab_size},
        Positive{"max_position_embeddings", c.max_position_embeddings}}) {
    if (p.value <= 0) return FieldError(p.field, absl::StrCat("must be positive, got ", p.value));
  }
  if (c.num_attention_heads % c.num_key_value_heads != 0) {
    return FieldError("num_key_value_heads", absl::StrCat("(", c.num_key_value_heads,
                                                          ") must divide num_attention_heads (",
                                                          c.num_attention_heads, ")"));
  }
  return absl::OkStatus();
}

// head_dim defaults to hidden_size / num_attention_heads, but only where that is exact: a
// truncated default would load a model whose projections do not match its checkpoint.
// REQUIRES: CheckSizes(*c) is OK.
absl::Status ReadHeadDim(const json& j, ModelConfig* c) {
  if (IsNull(j, "head_dim") && c->hidden_size % c->num_attention_heads != 0) {
    return FieldError("head_dim", absl::StrCat("is missing and hidden_size (", c->hidden_size,
                                               ") is not a multiple of num_attention_heads (",
                                               c->num_attention_heads, ")"));
  }
  ROLLOUT_RETURN_IF_ERROR(
      GetInt(j, "head_dim", c->hidden_size / c->num_attention_heads, &c->head_dim));
  if (c->head_dim <= 0 || c->head_dim % 2 != 0) {
    return FieldError("head_dim", absl::StrCat("must be positive and even (RoPE rotates pairs), "
                                               "got ",
                                               c->head_dim));
  }
  return absl::OkStatus();
}

// The norm epsilon and RoPE (model/rope_config.h). Features the engine does not implement,
// here and in RefuseUnsupportedFeatures, are refused rather than silently ignored: the model
// would load and produce wrong tokens.
absl::Status ReadNormAndRope(const json& j, ModelConfig* c) {
  if (!(c->rms_norm_eps > 0.0f)) return FieldError("rms_norm_eps", "must be positive");
  if (!(c->rope_theta > 0.0f)) return FieldError("rope_theta", "must be positive");
  return ReadRopeConfig(j, c->max_position_embeddings, &c->rope_theta, &c->rope_scaling);
}

// Sliding-window attention, activations other than SiLU and MLP biases are not implemented.
absl::Status RefuseUnsupportedFeatures(const json& j) {
  bool flag = false;
  ROLLOUT_RETURN_IF_ERROR(GetBool(j, "use_sliding_window", false, &flag));
  if (flag) return FieldError("use_sliding_window", "is not supported");
  if (!IsNull(j, "hidden_act") &&
      (!j["hidden_act"].is_string() || j["hidden_act"].get<std::string>() != "silu")) {
    return FieldError("hidden_act", absl::StrCat("must be \"silu\", got ", j["hidden_act"].dump()));
  }
  ROLLOUT_RETURN_IF_ERROR(GetBool(j, "mlp_bias", false, &flag));
  if (flag) return FieldError("mlp_bias", "is not supported");
  return absl::OkStatus();
}

// The family's attention flags (qk_norm, qkv_bias), and the family-specific variants of
// attention_bias and sliding_window that the forward pass does not model.
absl::Status SetFamilyFlags(const json& j, ModelConfig* c) {
  bool attention_bias = false;
  ROLLOUT_RETURN_IF_ERROR(GetBool(j, "attention_bias", false, &attention_bias));
  switch (c->family) {
    case ModelFamily::kQwen3:
      c->qk_norm = true;
      c->qkv_bias = false;
      // In transformers, Qwen3's attention_bias adds biases to q/k/v *and* o_proj.
      if (attention_bias) {
        return FieldError("attention_bias", "true is not supported for Qwen3 (o_proj bias)");
      }
      break;
    case ModelFamily::kQwen2:
      c->qk_norm = false;
      c->qkv_bias = true;
      break;
    case ModelFamily::kLlama:
      c->qk_norm = false;
      // Llama's attention_bias also puts a bias on o_proj, which ExpectedTensors and the forward
      // pass do not model, so only the bias-free variant is accepted.
      if (attention_bias) {
        return FieldError("attention_bias", "true is not supported (it adds an o_proj bias)");
      }
      c->qkv_bias = false;
      // A window shorter than the context would make attention differ from full attention.
      if (j.contains("sliding_window") && j["sliding_window"].is_number_integer() &&
          j["sliding_window"].get<int64_t>() < c->max_position_embeddings) {
        return FieldError("sliding_window",
                          absl::StrCat("(", j["sliding_window"].dump(), ") is not supported"));
      }
      break;
  }
  return absl::OkStatus();
}

// The MoE fields of a Qwen3MoeForCausalLM config (num_experts or transformers 5's
// num_local_experts), with transformers' Qwen3MoeConfig defaults
// for absent ones (128 experts, 8 per token, width 768, no renormalisation, every layer sparse).
// What the forward pass does not model is refused by name: shared experts (Qwen2-MoE's
// shared_expert_intermediate_size), sizes that are not positive, more experts per token than
// there are, layers outside the model in mlp_only_layers.
absl::Status ReadMoe(const json& j, ModelConfig* c) {
  absl::Status s;
  auto check = [&](absl::Status status) {
    if (s.ok()) s = std::move(status);
  };
  // transformers 5 writes the expert count as num_local_experts (its Qwen3MoeConfig maps
  // num_experts onto it); the Hub's configs say num_experts. Either, not two different counts.
  int32_t local_experts = 0;
  check(GetInt(j, "num_local_experts", 0, &local_experts));
  check(GetInt(j, "num_experts", local_experts > 0 ? local_experts : 128, &c->num_experts));
  if (s.ok() && local_experts > 0 && local_experts != c->num_experts) {
    return FieldError("num_local_experts",
                      absl::StrCat("(", local_experts, ") differs from num_experts (",
                                   c->num_experts, "); they name the same count"));
  }
  check(GetInt(j, "num_experts_per_tok", 8, &c->num_experts_per_tok));
  check(GetInt(j, "moe_intermediate_size", 768, &c->moe_intermediate_size));
  check(GetBool(j, "norm_topk_prob", false, &c->norm_topk_prob));
  check(GetInt(j, "decoder_sparse_step", 1, &c->decoder_sparse_step));
  ROLLOUT_RETURN_IF_ERROR(s);
  struct Positive {
    const char* field;
    int32_t value;
  };
  for (const Positive& p : {Positive{"num_experts", c->num_experts},
                            Positive{"num_experts_per_tok", c->num_experts_per_tok},
                            Positive{"moe_intermediate_size", c->moe_intermediate_size},
                            Positive{"decoder_sparse_step", c->decoder_sparse_step}}) {
    if (p.value <= 0) return FieldError(p.field, absl::StrCat("must be positive, got ", p.value));
  }
  if (c->num_experts_per_tok > c->num_experts) {
    return FieldError("num_experts_per_tok",
                      absl::StrCat("(", c->num_experts_per_tok, ") must not exceed num_experts (",
                                   c->num_experts, ")"));
  }
  c->mlp_only_layers.clear();
  if (!IsNull(j, "mlp_only_layers")) {
    const json& v = j["mlp_only_layers"];
    if (!v.is_array()) return FieldError("mlp_only_layers", "must be a list of layer indices");
    for (const json& layer : v) {
      if (!layer.is_number_integer() || layer.get<int64_t>() < 0 ||
          layer.get<int64_t>() >= c->num_layers) {
        return FieldError("mlp_only_layers", absl::StrCat("must hold layer indices in [0, ",
                                                          c->num_layers, "), got ", v.dump()));
      }
      c->mlp_only_layers.push_back(static_cast<int32_t>(layer.get<int64_t>()));
    }
  }
  int32_t shared = 0;
  ROLLOUT_RETURN_IF_ERROR(GetInt(j, "shared_expert_intermediate_size", 0, &shared));
  if (shared != 0) {
    return FieldError("shared_expert_intermediate_size",
                      "(shared experts, as in Qwen2-MoE) is not supported");
  }
  return absl::OkStatus();
}

// "torch_dtype", or "dtype", its newer name in transformers: the dtype the weights are served
// in (tensors of another float dtype are cast to it on load).
absl::Status ReadDtype(const json& j, ModelConfig* c) {
  if (IsNull(j, "torch_dtype") && IsNull(j, "dtype")) return absl::OkStatus();
  const char* field = IsNull(j, "torch_dtype") ? "dtype" : "torch_dtype";
  const json& d = j[field];
  if (!d.is_string()) return FieldError(field, "must be a string");
  const std::string name = d.get<std::string>();
  if (name != "bfloat16" && name != "float16" && name != "float32") {
    return FieldError(field, absl::StrCat("\"", name,
                                          "\" is not a dtype the engine serves (bfloat16, "
                                          "float16 or float32)"));
  }
  c->torch_dtype = name;
  return absl::OkStatus();
}

// The steps run in this order and stop at the first error, so which problem a config with
// several is reported for stays fixed (model_config_test.cc relies on it).
absl::StatusOr<ModelConfig> Parse(const json& j) {
  if (!j.is_object()) return absl::InvalidArgumentError("config.json: not a JSON object");
  absl::StatusOr<const ArchitectureInfo*> info = FindArchitecture(j);
  if (!info.ok()) return info.status();
  ModelConfig c;
  c.architecture = (*info)->architecture;
  c.family = (*info)->family;
  ROLLOUT_RETURN_IF_ERROR(ReadFields(j, &c));
  ROLLOUT_RETURN_IF_ERROR(CheckSizes(c));
  ROLLOUT_RETURN_IF_ERROR(ReadHeadDim(j, &c));
  ROLLOUT_RETURN_IF_ERROR(ReadNormAndRope(j, &c));
  ROLLOUT_RETURN_IF_ERROR(RefuseUnsupportedFeatures(j));
  ROLLOUT_RETURN_IF_ERROR(SetFamilyFlags(j, &c));
  ROLLOUT_RETURN_IF_ERROR(ReadDtype(j, &c));
  if ((*info)->moe) ROLLOUT_RETURN_IF_ERROR(ReadMoe(j, &c));
  return c;
}

}  // namespace

bool ModelConfig::IsMoeLayer(int32_t layer) const {
  if (num_experts <= 0 || decoder_sparse_step <= 0) return false;
  if (std::find(mlp_only_layers.begin(), mlp_only_layers.end(), layer) != mlp_only_layers.end()) {
    return false;
  }
  return (layer + 1) % decoder_sparse_step == 0;
}

ModelIdentity IdentityOf(const ModelConfig& c) {
  ModelIdentity id;
  id.architecture = c.architecture;
  id.num_layers = c.num_layers;
  id.hidden_size = c.hidden_size;
  id.intermediate_size = c.intermediate_size;
  id.num_attention_heads = c.num_attention_heads;
  id.num_key_value_heads = c.num_key_value_heads;
  id.head_dim = c.head_dim;
  id.vocab_size = c.vocab_size;
  id.num_experts = c.num_experts;
  id.num_experts_per_tok = c.num_experts_per_tok;
  id.moe_intermediate_size = c.moe_intermediate_size;
  id.tie_word_embeddings = c.tie_word_embeddings;
  id.moe_layers = c.MoeLayers();
  return id;
}

absl::Status CheckSameModel(const std::string& dir, const ModelIdentity& checkpoint,
                            const ModelIdentity& served) {
  auto differs = [&](const std::string& field, const std::string& ours, const std::string& theirs) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "%s/config.json has %s %s; the served model has %s: a checkpoint of another model "
        "cannot update it",
        dir, field, ours, theirs));
  };
  if (checkpoint.architecture != served.architecture) {
    return differs("architecture", checkpoint.architecture, served.architecture);
  }
  const struct {
    const char* field;
    int64_t ours, theirs;
  } sizes[] = {
      {"num_hidden_layers", checkpoint.num_layers, served.num_layers},
      {"hidden_size", checkpoint.hidden_size, served.hidden_size},
      {"intermediate_size", checkpoint.intermediate_size, served.intermediate_size},
      {"num_attention_heads", checkpoint.num_attention_heads, served.num_attention_heads},
      {"num_key_value_heads", checkpoint.num_key_value_heads, served.num_key_value_heads},
      {"head_dim", checkpoint.head_dim, served.head_dim},
      {"vocab_size", checkpoint.vocab_size, served.vocab_size},
      {"num_experts", checkpoint.num_experts, served.num_experts},
      {"num_experts_per_tok", checkpoint.num_experts_per_tok, served.num_experts_per_tok},
      {"moe_intermediate_size", checkpoint.moe_intermediate_size, served.moe_intermediate_size},
      {"tie_word_embeddings", checkpoint.tie_word_embeddings, served.tie_word_embeddings},
  };
  for (const auto& s : sizes) {
    if (s.ours != s.theirs) return differs(s.field, absl::StrCat(s.ours), absl::StrCat(s.theirs));
  }
  if (checkpoint.moe_layers != served.moe_layers) {
    return differs("MoE layers", absl::StrCat("[", absl::StrJoin(checkpoint.moe_layers, ","), "]"),
                   absl::StrCat("[", absl::StrJoin(served.moe_layers, ","), "]"));
  }
  return absl::OkStatus();
}

int32_t ModelConfig::NumMoeLayers() const {
  int32_t n = 0;
  for (int32_t i = 0; i < num_layers; ++i) n += IsMoeLayer(i) ? 1 : 0;
  return n;
}

std::vector<int32_t> ModelConfig::MoeLayers() const {
  std::vector<int32_t> layers;
  for (int32_t i = 0; i < num_layers; ++i) {
    if (IsMoeLayer(i)) layers.push_back(i);
  }
  return layers;
}

absl::StatusOr<ModelConfig> ParseModelConfig(std::string_view json_text) {
  try {
    json j = json::parse(json_text, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded()) return absl::InvalidArgumentError("config.json: not valid JSON");
    return Parse(j);
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("config.json: ", e.what()));
  }
}

absl::Status MergeGenerationConfig(std::string_view generation_config_json, ModelConfig* config) {
  if (generation_config_json.empty()) return absl::OkStatus();
  json j = json::parse(generation_config_json, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return absl::InvalidArgumentError("generation_config.json: not a JSON object");
  }
  std::vector<int32_t> ids;
  if (absl::Status s = ParseEos(j, &ids); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "generation_config.json: ", absl::StripPrefix(s.message(), "config.json: ")));
  }
  for (int32_t id : ids) {
    if (std::find(config->eos_token_ids.begin(), config->eos_token_ids.end(), id) ==
        config->eos_token_ids.end()) {
      config->eos_token_ids.push_back(id);
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<ModelConfig> ReadModelConfig(const Checkpoint& checkpoint) {
  absl::StatusOr<ModelConfig> config = ParseModelConfig(checkpoint.config_json());
  if (!config.ok()) {
    return absl::Status(config.status().code(),
                        absl::StrCat(checkpoint.dir(), "/", config.status().message()));
  }
  if (absl::Status s = MergeGenerationConfig(checkpoint.generation_config_json(), &*config);
      !s.ok()) {
    return absl::Status(s.code(), absl::StrCat(checkpoint.dir(), "/", s.message()));
  }
  return config;
}

std::string ModelConfigToJson(const ModelConfig& config) {
  // A hand-built config may leave `architecture` empty: fall back to the family's first name
  // (the MoE one when it has experts).
  const ArchitectureInfo* info = nullptr;
  for (const ArchitectureInfo& a : kArchitectures) {
    if (config.architecture == a.architecture) info = &a;
  }
  for (const ArchitectureInfo& a : kArchitectures) {
    if (info == nullptr && a.family == config.family && a.moe == config.is_moe()) info = &a;
  }
  nlohmann::ordered_json j;
  j["architectures"] = nlohmann::ordered_json::array({info->architecture});
  j["model_type"] = info->model_type;
  j["num_hidden_layers"] = config.num_layers;
  j["hidden_size"] = config.hidden_size;
  j["intermediate_size"] = config.intermediate_size;
  j["num_attention_heads"] = config.num_attention_heads;
  j["num_key_value_heads"] = config.num_key_value_heads;
  j["head_dim"] = config.head_dim;
  j["vocab_size"] = config.vocab_size;
  j["max_position_embeddings"] = config.max_position_embeddings;
  j["rms_norm_eps"] = ShortestDouble(config.rms_norm_eps);
  j["rope_theta"] = ShortestDouble(config.rope_theta);
  j["rope_scaling"] = RopeScalingToJson(config.rope_scaling);
  j["tie_word_embeddings"] = config.tie_word_embeddings;
  j["attention_bias"] = config.family == ModelFamily::kLlama && config.qkv_bias;
  j["hidden_act"] = "silu";
  if (config.eos_token_ids.empty()) {
    j["eos_token_id"] = nullptr;
  } else if (config.eos_token_ids.size() == 1) {
    j["eos_token_id"] = config.eos_token_ids[0];
  } else {
    j["eos_token_id"] = config.eos_token_ids;
  }
  j["torch_dtype"] = config.torch_dtype;
  if (info->moe) {
    j["num_experts"] = config.num_experts;
    j["num_experts_per_tok"] = config.num_experts_per_tok;
    j["moe_intermediate_size"] = config.moe_intermediate_size;
    j["norm_topk_prob"] = config.norm_topk_prob;
    j["decoder_sparse_step"] = config.decoder_sparse_step;
    j["mlp_only_layers"] = config.mlp_only_layers;
  }
  return j.dump(2) + "\n";
}

std::vector<TensorSpec> ExpectedTensors(const ModelConfig& c) {
  const int64_t h = c.hidden_size;
  const int64_t q_dim = static_cast<int64_t>(c.num_attention_heads) * c.head_dim;
  const int64_t kv_dim = static_cast<int64_t>(c.num_key_value_heads) * c.head_dim;
  const int64_t inter = c.intermediate_size;
  std::vector<TensorSpec> specs;
  specs.push_back({"model.embed_tokens.weight", {c.vocab_size, h}});
  for (int32_t i = 0; i < c.num_layers; ++i) {
    const std::string p = absl::StrCat("model.layers.", i, ".");
    specs.push_back({p + "input_layernorm.weight", {h}});
    specs.push_back({p + "self_attn.q_proj.weight", {q_dim, h}});
    specs.push_back({p + "self_attn.k_proj.weight", {kv_dim, h}});
    specs.push_back({p + "self_attn.v_proj.weight", {kv_dim, h}});
    specs.push_back({p + "self_attn.o_proj.weight", {h, q_dim}});
    if (c.qkv_bias) {
      specs.push_back({p + "self_attn.q_proj.bias", {q_dim}});
      specs.push_back({p + "self_attn.k_proj.bias", {kv_dim}});
      specs.push_back({p + "self_attn.v_proj.bias", {kv_dim}});
    }
    if (c.qk_norm) {
      specs.push_back({p + "self_attn.q_norm.weight", {c.head_dim}});
      specs.push_back({p + "self_attn.k_norm.weight", {c.head_dim}});
    }
    specs.push_back({p + "post_attention_layernorm.weight", {h}});
    if (c.IsMoeLayer(i)) {
      const int64_t moe_inter = c.moe_intermediate_size;
      specs.push_back({p + "mlp.gate.weight", {c.num_experts, h}});
      for (int32_t e = 0; e < c.num_experts; ++e) {
        const std::string x = absl::StrCat(p, "mlp.experts.", e, ".");
        specs.push_back({x + "gate_proj.weight", {moe_inter, h}});
        specs.push_back({x + "up_proj.weight", {moe_inter, h}});
        specs.push_back({x + "down_proj.weight", {h, moe_inter}});
      }
    } else {
      specs.push_back({p + "mlp.gate_proj.weight", {inter, h}});
      specs.push_back({p + "mlp.up_proj.weight", {inter, h}});
      specs.push_back({p + "mlp.down_proj.weight", {h, inter}});
    }
  }
  specs.push_back({"model.norm.weight", {h}});
  if (!c.tie_word_embeddings) specs.push_back({"lm_head.weight", {c.vocab_size, h}});
  return specs;
}

}  // namespace rollout
