#include "model/dtype_cast.h"

#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/str_format.h"
#include "common/status.h"

namespace rollout {
namespace {

float Decode(DType dtype, const uint8_t* p) {
  uint16_t half;
  switch (dtype) {
    case DType::kF32: {
      float f;
      std::memcpy(&f, p, 4);
      return f;
    }
    case DType::kF16:
      std::memcpy(&half, p, 2);
      return F16ToF32(half);
    case DType::kBF16:
      break;
  }
  std::memcpy(&half, p, 2);
  return BF16ToF32(half);
}

// The bits of `x` rounded to `dtype`, in its width (f32: the float itself).
void Encode(DType dtype, float x, uint8_t* p) {
  switch (dtype) {
    case DType::kF32:
      std::memcpy(p, &x, 4);
      return;
    case DType::kF16: {
      const uint16_t half = F32ToF16(x);
      std::memcpy(p, &half, 2);
      return;
    }
    case DType::kBF16:
      break;
  }
  const uint16_t half = F32ToBF16(x);
  std::memcpy(p, &half, 2);
}

absl::Status Overflow(const std::string& name, size_t index, float value, DType dtype) {
  return absl::InvalidArgumentError(absl::StrFormat(
      "tensor '%s': element %d (%g) is beyond the range of %s, the dtype the model serves "
      "(cast, it would be infinite)",
      name, index, value, DTypeName(dtype)));
}

}  // namespace

DType ServedDType(const ModelConfig& config) {
  if (config.torch_dtype == "float32") return DType::kF32;
  if (config.torch_dtype == "float16") return DType::kF16;
  return DType::kBF16;
}

absl::Status RoundToDType(const std::string& name, DType dtype, float* values, size_t count) {
  if (dtype == DType::kF32) return absl::OkStatus();
  // Checked first, so that an error leaves `values` as they were.
  uint8_t bits[2];
  for (size_t i = 0; i < count; ++i) {
    Encode(dtype, values[i], bits);
    if (std::isfinite(values[i]) && !std::isfinite(Decode(dtype, bits))) {
      return Overflow(name, i, values[i], dtype);
    }
  }
  for (size_t i = 0; i < count; ++i) {
    Encode(dtype, values[i], bits);
    values[i] = Decode(dtype, bits);
  }
  return absl::OkStatus();
}

absl::Status CastFloats(const std::string& name, DType from, const uint8_t* src, size_t count,
                        DType to, uint8_t* dst, size_t first_element) {
  if (from == to) {
    std::memcpy(dst, src, count * DTypeSize(to));
    return absl::OkStatus();
  }
  const size_t in = DTypeSize(from), out = DTypeSize(to);
  for (size_t i = 0; i < count; ++i) {
    const float x = Decode(from, src + i * in);
    Encode(to, x, dst + i * out);
    if (std::isfinite(x) && !std::isfinite(Decode(to, dst + i * out))) {
      return Overflow(name, first_element + i, x, to);
    }
  }
  return absl::OkStatus();
}

absl::Status CastTensorTo(DType dtype, HostTensor* tensor) {
  if (tensor->dtype == dtype) return absl::OkStatus();
  const size_t count = tensor->bytes.size() / DTypeSize(tensor->dtype);
  std::vector<uint8_t> cast(count * DTypeSize(dtype));
  if (absl::Status s =
          CastFloats(tensor->name, tensor->dtype, tensor->bytes.data(), count, dtype, cast.data());
      !s.ok()) {
    return s;
  }
  tensor->bytes = std::move(cast);
  tensor->dtype = dtype;
  return absl::OkStatus();
}

absl::Status CastToSpec(const std::vector<WeightSpec>& specs, HostTensor* tensor) {
  ROLLOUT_RETURN_IF_ERROR(CheckPushedTensor(specs, tensor->name, tensor->dtype, tensor->shape));
  size_t count = 1;
  for (int64_t d : tensor->shape) count *= static_cast<size_t>(d);
  if (tensor->bytes.size() != count * DTypeSize(tensor->dtype)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("tensor '%s': %d bytes given, its shape in %s needs %d", tensor->name,
                        tensor->bytes.size(), DTypeName(tensor->dtype),
                        count * DTypeSize(tensor->dtype)));
  }
  return CastTensorTo(FindWeightSpec(specs, tensor->name)->dtype, tensor);
}

}  // namespace rollout
