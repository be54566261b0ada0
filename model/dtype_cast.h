#pragma once

// The served dtype of a model's weights, and casts into it. A checkpoint tensor or a pushed
// tensor in another float dtype is cast on arrival: widening is exact, narrowing rounds to
// nearest even (bf16 and f16 keep their NaNs quiet), and a finite value beyond the target's
// range (an f32 or bf16 above 65504 into f16) is refused rather than served as infinity. What
// is served, and hashed into the weight digest, are the cast bytes.

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "model/model_config.h"
#include "model/safetensors.h"
#include "model/weight_spec.h"

namespace rollout {

// The dtype every weight of `config` is served in: its torch_dtype (bfloat16 when the config
// has none). REQUIRES: config came from ParseModelConfig (torch_dtype is one it accepts).
DType ServedDType(const ModelConfig& config);

// Rounds each of `count` floats at `values` to the nearest value of `dtype` (ties to even), in
// place; a no-op for F32. INVALID_ARGUMENT naming `name` and the element when a finite value
// overflows `dtype`.
absl::Status RoundToDType(const std::string& name, DType dtype, float* values, size_t count);

// Casts `count` elements at `src` in `from` to `to` at `dst` (count * DTypeSize(to) bytes, not
// overlapping `src`): a copy when the dtypes are equal, else as RoundToDType of the exact f32
// value. Errors as RoundToDType's; `first_element` is the index of src[0] in the tensor, for
// the message (a tensor cast in pieces).
absl::Status CastFloats(const std::string& name, DType from, const uint8_t* src, size_t count,
                        DType to, uint8_t* dst, size_t first_element = 0);

// `tensor` in `dtype`: unchanged when it already is, else its bytes cast (and its dtype set).
// Errors as RoundToDType's, with `tensor` unchanged.
absl::Status CastTensorTo(DType dtype, HostTensor* tensor);

// A pushed tensor (UpdateWeights, UpdateWeightsFromPath) in its spec's dtype: CheckPushedTensor
// (model/weight_spec.h), a byte count of prod(shape) x its dtype's size, then CastTensorTo the
// spec's dtype. Call it before the tensor is hashed: the digest is that of the served bytes.
// INVALID_ARGUMENT naming the tensor, with `tensor` unchanged.
absl::Status CastToSpec(const std::vector<WeightSpec>& specs, HostTensor* tensor);

}  // namespace rollout
