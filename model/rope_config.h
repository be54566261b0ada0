#pragma once

// config.json's RoPE fields, read into RopeScaling and written back; used by model_config.cc.

#include <cstdint>

#include "absl/status/status.h"
#include "model/rope.h"
#include "nlohmann/json_fwd.hpp"

namespace rollout {

// The RoPE variant of a config: "rope_scaling" (transformers 4) and/or "rope_parameters"
// (transformers 5; both present must describe the same RoPE), each with "rope_type" or the
// legacy "type" (default, linear, dynamic, yarn, llama3); a block's "rope_theta" must agree with
// the top-level one, which `*theta` holds on entry (its default when the config has none), and
// replaces it. Any other type (longrope, ...), a parameter the type does not have, a missing or
// out-of-range parameter and a partial_rotary_factor other than 1 are INVALID_ARGUMENT naming
// the field, the key and what is supported.
absl::Status ReadRopeConfig(const nlohmann::json& config, int32_t max_position_embeddings,
                            float* theta, RopeScaling* scaling);

// The "rope_scaling" value ReadRopeConfig reads back as `scaling`: null for default RoPE.
nlohmann::ordered_json RopeScalingToJson(const RopeScaling& scaling);

}  // namespace rollout
