#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "model/safetensors.h"

namespace rollout {

// A replaceable tensor of the served model, as its checkpoint had it.
struct WeightSpec {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  size_t nbytes() const;
};

// The spec named `name` in `specs` (sorted by name), or nullptr.
const WeightSpec* FindWeightSpec(const std::vector<WeightSpec>& specs, const std::string& name);

// OK when `specs` has a tensor `name` with exactly this dtype and shape; otherwise
// INVALID_ARGUMENT saying what was given and what is served.
absl::Status CheckTensorAgainstSpec(const std::vector<WeightSpec>& specs, const std::string& name,
                                    DType dtype, const std::vector<int64_t>& shape);

}  // namespace rollout
