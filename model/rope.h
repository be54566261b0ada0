#pragma once

// Rotary position embeddings: the per-frequency inverse frequencies and the attention factor
// of every RoPE variant the engine serves, computed as Hugging Face transformers'
// modeling_rope_utils computes them (transformers 5), in double. Both backends rotate with the
// floats RopeCosSin gives (the CPU reference per token, the CUDA backend from tables built with
// it at load), so they agree bit for bit on cos and sin.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace rollout {

// The RoPE variants of config.json's "rope_scaling" / "rope_parameters" ("rope_type", or the
// legacy "type"). Each is a fixed function of the position within max_position_embeddings.
enum class RopeType {
  kDefault,  // theta^(-2i/d)
  kLinear,   // default / factor (position interpolation)
  kDynamic,  // dynamic NTK: equal to default at every position below max_position_embeddings
  kYarn,     // YaRN: a ramp between interpolated and extrapolated frequencies, scaled cos/sin
  kLlama3,   // Llama 3.1: long wavelengths divided by factor, a smooth band between
};

// "default", "linear", "dynamic", "yarn", "llama3".
const char* RopeTypeName(RopeType type);

// The parameters of a RoPE variant, as config.json gives them (model/rope_config.cc reads and
// writes them). Fields a type does not use keep their defaults. Plain value type.
struct RopeScaling {
  RopeType type = RopeType::kDefault;
  double factor = 1.0;  // linear, dynamic, yarn, llama3
  // llama3 and yarn: the pre-training context. Resolved at parse time as transformers does:
  // the block's value, else the top-level field of that name, else max_position_embeddings.
  int32_t original_max_position_embeddings = 0;
  double low_freq_factor = 0.0;   // llama3
  double high_freq_factor = 0.0;  // llama3, > low_freq_factor
  // yarn. Absent values take transformers' defaults in ComputeRopeFrequencies: attention_factor
  // from factor (and mscale / mscale_all_dim when both are non-zero), beta_fast 32, beta_slow 1.
  std::optional<double> attention_factor;
  std::optional<double> beta_fast, beta_slow;
  std::optional<double> mscale, mscale_all_dim;
  bool truncate = true;  // yarn: round the correction range outwards to whole dimensions

  bool operator==(const RopeScaling& other) const;
  bool operator!=(const RopeScaling& other) const { return !(*this == other); }
};

// What rotates a head: the angle of pair i at position p is p * inv_freq[i]; cos and sin are
// multiplied by attention_factor (1 except for yarn).
struct RopeFrequencies {
  std::vector<double> inv_freq;  // [head_dim / 2]
  double attention_factor = 1.0;
};

// The inverse frequencies and attention factor of `scaling` for heads of `head_dim` (even)
// with base `theta`. The one function both backends use.
// REQUIRES: scaling passed rope_config.cc's checks (positive factors, high > low, ...).
RopeFrequencies ComputeRopeFrequencies(const RopeScaling& scaling, double theta,
                                       int64_t head_dim);

// cos and sin [inv_freq.size()] of `position`: for each pair, the angle position * inv_freq[i]
// in double, cos and sin in double times attention_factor, then rounded to float.
void RopeCosSin(const RopeFrequencies& frequencies, int64_t position, float* cos, float* sin);

// One line for the start-up log: the variant and its parameters, and for `dynamic` that it is
// served as plain RoPE and the context capped at max_position_embeddings.
std::string DescribeRope(const RopeScaling& scaling, double theta,
                         int32_t max_position_embeddings);

}  // namespace rollout
