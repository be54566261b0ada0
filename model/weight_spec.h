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

// What a pushed tensor must meet: `specs` has a tensor `name` of this shape. Its dtype may be
// any float dtype (every DType is one): a tensor in another than the served one is cast to it
// (CastToSpec, model/dtype_cast.h) before it is hashed or applied. INVALID_ARGUMENT as above.
absl::Status CheckPushedTensor(const std::vector<WeightSpec>& specs, const std::string& name,
                               DType dtype, const std::vector<int64_t>& shape);

}  // namespace rollout
