#include "model/rope_config.h"

#include <cmath>
#include <limits>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status.h"
#include "nlohmann/json.hpp"

namespace rollout {
namespace {

using json = nlohmann::json;

constexpr char kSupportedTypes[] = "default, linear, dynamic, yarn, llama3";

struct TypeInfo {
  const char* name;
  RopeType type;
  std::vector<std::string> keys;  // its parameters, besides rope_type/type/rope_theta
};

const std::vector<TypeInfo>& Types() {
  static const std::vector<TypeInfo>* types = new std::vector<TypeInfo>{
      {"default", RopeType::kDefault, {}},
      {"linear", RopeType::kLinear, {"factor"}},
      // transformers ignores original_max_position_embeddings for dynamic NTK; so do we.
      {"dynamic", RopeType::kDynamic, {"factor", "original_max_position_embeddings"}},
      {"yarn",
       RopeType::kYarn,
       {"factor", "original_max_position_embeddings", "attention_factor", "beta_fast",
        "beta_slow", "mscale", "mscale_all_dim", "truncate"}},
      {"llama3",
       RopeType::kLlama3,
       {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}},
  };
  return *types;
}

bool IsNull(const json& j, const char* key) { return !j.contains(key) || j[key].is_null(); }

// Errors about one block, e.g. "config.json: field 'rope_scaling': factor must be positive".
class Block {
 public:
  Block(const json& value, const char* field) : value_(value), field_(field) {}

  absl::Status Error(const std::string& problem) const {
    return absl::InvalidArgumentError(
        absl::StrCat("config.json: field '", field_, "': ", problem));
  }

  // A finite number, or nullopt when absent or null.
  absl::StatusOr<std::optional<double>> Number(const char* key) const {
    if (IsNull(value_, key)) return std::optional<double>();
    const json& v = value_[key];
    if (!v.is_number() || !std::isfinite(v.get<double>())) {
      return Error(absl::StrCat(key, " must be a finite number, got ", v.dump()));
    }
    return std::optional<double>(v.get<double>());
  }

  // A number > 0 that must be present.
  absl::StatusOr<double> Positive(const char* key, const char* type) const {
    absl::StatusOr<std::optional<double>> v = Number(key);
    if (!v.ok()) return v.status();
    if (!v->has_value()) {
      return Error(absl::StrCat("rope_type \"", type, "\" needs ", key, ", which is missing"));
    }
    if (!(**v > 0.0)) return Error(absl::StrCat(key, " must be positive, got ", **v));
    return **v;
  }

  const json& value() const { return value_; }
  const char* field() const { return field_; }

 private:
  const json& value_;
  const char* field_;
};

// "rope_type", or the legacy "type"; both present must agree. Absent: "default".
absl::StatusOr<const TypeInfo*> ReadType(const Block& b) {
  std::string name = "default";
  bool named = false;
  for (const char* key : {"rope_type", "type"}) {
    if (IsNull(b.value(), key)) continue;
    const json& v = b.value()[key];
    if (!v.is_string()) return b.Error(absl::StrCat(key, " must be a string, got ", v.dump()));
    if (named && v.get<std::string>() != name) {
      return b.Error(absl::StrCat("rope_type \"", name, "\" and type ", v.dump(), " disagree"));
    }
    name = v.get<std::string>();
    named = true;
  }
  for (const TypeInfo& t : Types()) {
    if (name == t.name) return &t;
  }
  return b.Error(absl::StrCat("rope_type \"", name, "\" is not supported (supported: ",
                              kSupportedTypes, ")"));
}

absl::Status CheckKeys(const Block& b, const TypeInfo& type) {
  std::set<std::string> known(type.keys.begin(), type.keys.end());
  known.insert({"rope_type", "type", "rope_theta", "partial_rotary_factor"});
  for (const auto& [key, value] : b.value().items()) {
    if (known.count(key) != 0) continue;
    return b.Error(absl::StrCat(
        "key \"", key, "\" is not a parameter of rope_type \"", type.name, "\" (its parameters: ",
        type.keys.empty() ? std::string("none") : absl::StrJoin(type.keys, ", "), ")"));
  }
  return absl::OkStatus();
}

// Only RoPE over the whole head is implemented.
absl::Status CheckPartialRotary(const json& j, const Block& b) {
  if (IsNull(j, "partial_rotary_factor")) return absl::OkStatus();
  const json& v = j["partial_rotary_factor"];
  if (v.is_number() && v.get<double>() == 1.0) return absl::OkStatus();
  return b.Error(
      absl::StrCat("partial_rotary_factor ", v.dump(), " is not supported (only 1: RoPE over the "
                   "whole head)"));
}

// llama3 and yarn: the block's value, else the config's top-level field (which transformers
// prefers; both must agree), else max_position_embeddings.
absl::StatusOr<int32_t> OriginalContext(const json& config, const Block& b, int32_t max_pos) {
  constexpr char kKey[] = "original_max_position_embeddings";
  std::optional<int64_t> value;
  for (const json* j : {&b.value(), &config}) {
    if (IsNull(*j, kKey)) continue;
    const json& v = (*j)[kKey];
    if (!v.is_number_integer() || v.get<int64_t>() <= 0 ||
        v.get<int64_t>() > std::numeric_limits<int32_t>::max()) {
      return b.Error(absl::StrCat(kKey, " must be a positive 32-bit integer, got ", v.dump()));
    }
    if (value.has_value() && *value != v.get<int64_t>()) {
      return b.Error(absl::StrCat(kKey, " ", *value, " disagrees with the top-level ", kKey, " ",
                                  v.dump()));
    }
    value = v.get<int64_t>();
  }
  return static_cast<int32_t>(value.value_or(max_pos));
}

absl::Status ReadLlama3(const json& config, const Block& b, int32_t max_pos, RopeScaling* s) {
  absl::StatusOr<double> factor = b.Positive("factor", "llama3");
  if (!factor.ok()) return factor.status();
  absl::StatusOr<double> low = b.Positive("low_freq_factor", "llama3");
  if (!low.ok()) return low.status();
  absl::StatusOr<double> high = b.Positive("high_freq_factor", "llama3");
  if (!high.ok()) return high.status();
  if (!(*high > *low)) {
    return b.Error(absl::StrCat("high_freq_factor (", *high, ") must be greater than "
                                "low_freq_factor (",
                                *low, ")"));
  }
  absl::StatusOr<int32_t> original = OriginalContext(config, b, max_pos);
  if (!original.ok()) return original.status();
  s->factor = *factor;
  s->low_freq_factor = *low;
  s->high_freq_factor = *high;
  s->original_max_position_embeddings = *original;
  return absl::OkStatus();
}

absl::Status ReadYarn(const json& config, const Block& b, int32_t max_pos, RopeScaling* s) {
  absl::StatusOr<int32_t> original = OriginalContext(config, b, max_pos);
  if (!original.ok()) return original.status();
  s->original_max_position_embeddings = *original;
  absl::StatusOr<std::optional<double>> factor = b.Number("factor");
  if (!factor.ok()) return factor.status();
  // transformers 5: an absent factor is the ratio of the two contexts.
  s->factor = factor->value_or(static_cast<double>(max_pos) / *original);
  if (!(s->factor > 0.0)) return b.Error(absl::StrCat("factor must be positive, got ", s->factor));
  for (auto [key, out] : {std::pair{"attention_factor", &s->attention_factor},
                          std::pair{"beta_fast", &s->beta_fast},
                          std::pair{"beta_slow", &s->beta_slow}, std::pair{"mscale", &s->mscale},
                          std::pair{"mscale_all_dim", &s->mscale_all_dim}}) {
    absl::StatusOr<std::optional<double>> v = b.Number(key);
    if (!v.ok()) return v.status();
    *out = *v;
  }
  if (s->attention_factor.has_value() && !(*s->attention_factor > 0.0)) {
    return b.Error(absl::StrCat("attention_factor must be positive, got ", *s->attention_factor));
  }
  // transformers reads `beta_fast or 32`: a zero takes the default, as absence does.
  for (auto [key, beta] : {std::pair{"beta_fast", &s->beta_fast},
                           std::pair{"beta_slow", &s->beta_slow}}) {
    if (beta->has_value() && **beta == 0.0) beta->reset();
    if (beta->has_value() && !(**beta > 0.0)) {
      return b.Error(absl::StrCat(key, " must be positive, got ", **beta));
    }
  }
  if (!IsNull(b.value(), "truncate")) {
    if (!b.value()["truncate"].is_boolean()) {
      return b.Error(
          absl::StrCat("truncate must be true or false, got ", b.value()["truncate"].dump()));
    }
    s->truncate = b.value()["truncate"].get<bool>();
  }
  return absl::OkStatus();
}

// One block: its RoPE, and its rope_theta if it has one.
absl::StatusOr<RopeScaling> ReadBlock(const json& config, const char* field, int32_t max_pos,
                                      std::optional<double>* block_theta) {
  const Block b(config[field], field);
  if (!b.value().is_object()) return b.Error(absl::StrCat("must be an object, got ", b.value().dump()));
  absl::StatusOr<const TypeInfo*> type = ReadType(b);
  if (!type.ok()) return type.status();
  ROLLOUT_RETURN_IF_ERROR(CheckKeys(b, **type));
  ROLLOUT_RETURN_IF_ERROR(CheckPartialRotary(b.value(), b));
  absl::StatusOr<std::optional<double>> theta = b.Number("rope_theta");
  if (!theta.ok()) return theta.status();
  if (theta->has_value() && !(**theta > 0.0)) {
    return b.Error(absl::StrCat("rope_theta must be a positive number, got ", **theta));
  }
  *block_theta = *theta;
  RopeScaling s;
  s.type = (*type)->type;
  switch (s.type) {
    case RopeType::kDefault:
      break;
    case RopeType::kLinear:
    case RopeType::kDynamic: {
      absl::StatusOr<double> factor = b.Positive("factor", (*type)->name);
      if (!factor.ok()) return factor.status();
      s.factor = *factor;
      break;
    }
    case RopeType::kLlama3:
      ROLLOUT_RETURN_IF_ERROR(ReadLlama3(config, b, max_pos, &s));
      break;
    case RopeType::kYarn:
      ROLLOUT_RETURN_IF_ERROR(ReadYarn(config, b, max_pos, &s));
      break;
  }
  return s;
}

}  // namespace

absl::Status ReadRopeConfig(const json& config, int32_t max_position_embeddings, float* theta,
                            RopeScaling* scaling) {
  *scaling = RopeScaling();
  ROLLOUT_RETURN_IF_ERROR(CheckPartialRotary(config, Block(config, "partial_rotary_factor")));
  // Where *theta came from, when the config gave it: "at the top level", "of rope_scaling".
  std::string theta_from = IsNull(config, "rope_theta") ? "" : "at the top level";
  std::optional<RopeScaling> found;
  const char* found_in = nullptr;
  for (const char* field : {"rope_scaling", "rope_parameters"}) {
    if (IsNull(config, field)) continue;
    std::optional<double> block_theta;
    absl::StatusOr<RopeScaling> s =
        ReadBlock(config, field, max_position_embeddings, &block_theta);
    if (!s.ok()) return s.status();
    if (block_theta.has_value()) {
      const float value = static_cast<float>(*block_theta);
      if (!std::isfinite(value)) {
        return Block(config, field).Error("rope_theta must be a finite float");
      }
      if (!theta_from.empty() && value != *theta) {
        return Block(config, field).Error(absl::StrCat(
            "rope_theta ", *block_theta, " disagrees with the rope_theta ", *theta, " ",
            theta_from));
      }
      *theta = value;
      theta_from = absl::StrCat("of ", field);
    }
    if (found.has_value() && *found != *s) {
      return Block(config, field).Error(absl::StrCat(
          "describes another RoPE than ", found_in, " (", config[found_in].dump(), " vs ",
          config[field].dump(), "); give one of them"));
    }
    found = *s;
    found_in = field;
  }
  if (found.has_value()) *scaling = *found;
  return absl::OkStatus();
}

nlohmann::ordered_json RopeScalingToJson(const RopeScaling& s) {
  if (s.type == RopeType::kDefault) return nullptr;
  nlohmann::ordered_json j;
  j["rope_type"] = RopeTypeName(s.type);
  j["factor"] = s.factor;
  switch (s.type) {
    case RopeType::kDefault:
    case RopeType::kLinear:
    case RopeType::kDynamic:
      break;
    case RopeType::kLlama3:
      j["low_freq_factor"] = s.low_freq_factor;
      j["high_freq_factor"] = s.high_freq_factor;
      j["original_max_position_embeddings"] = s.original_max_position_embeddings;
      break;
    case RopeType::kYarn:
      j["original_max_position_embeddings"] = s.original_max_position_embeddings;
      if (s.attention_factor.has_value()) j["attention_factor"] = *s.attention_factor;
      if (s.beta_fast.has_value()) j["beta_fast"] = *s.beta_fast;
      if (s.beta_slow.has_value()) j["beta_slow"] = *s.beta_slow;
      if (s.mscale.has_value()) j["mscale"] = *s.mscale;
      if (s.mscale_all_dim.has_value()) j["mscale_all_dim"] = *s.mscale_all_dim;
      if (!s.truncate) j["truncate"] = false;
      break;
  }
  return j;
}

}  // namespace rollout
