#include "model/weight_spec.h"

#include <algorithm>

#include "absl/strings/str_format.h"

namespace rollout {

size_t WeightSpec::nbytes() const {
  size_t n = DTypeSize(dtype);
  for (int64_t d : shape) n *= static_cast<size_t>(d);
  return n;
}

const WeightSpec* FindWeightSpec(const std::vector<WeightSpec>& specs, const std::string& name) {
  auto it = std::lower_bound(specs.begin(), specs.end(), name,
                             [](const WeightSpec& s, const std::string& n) { return s.name < n; });
  return it != specs.end() && it->name == name ? &*it : nullptr;
}

absl::Status CheckPushedTensor(const std::vector<WeightSpec>& specs, const std::string& name,
                               DType dtype, const std::vector<int64_t>& shape) {
  const WeightSpec* spec = FindWeightSpec(specs, name);
  if (spec == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrFormat("tensor '%s' is not a weight of the served model", name));
  }
  return CheckTensorAgainstSpec(specs, name, spec->dtype, shape);
}

absl::Status CheckTensorAgainstSpec(const std::vector<WeightSpec>& specs, const std::string& name,
                                    DType dtype, const std::vector<int64_t>& shape) {
  const WeightSpec* spec = FindWeightSpec(specs, name);
  if (spec == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrFormat("tensor '%s' is not a weight of the served model", name));
  }
  if (dtype != spec->dtype) {
    return absl::InvalidArgumentError(
        absl::StrFormat("tensor '%s': dtype %s given, the served tensor is %s", name,
                        DTypeName(dtype), DTypeName(spec->dtype)));
  }
  if (shape != spec->shape) {
    return absl::InvalidArgumentError(absl::StrFormat("tensor '%s': shape %s given, expected %s",
                                                      name, ShapeToString(shape),
                                                      ShapeToString(spec->shape)));
  }
  return absl::OkStatus();
}

}  // namespace rollout
