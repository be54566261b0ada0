#pragma once

// Copies a tensor that is already in device memory (an IPC export, a broadcast's staging) into
// where the runner serves it, through the same bindings a host update writes (weight_binding.h).
// Internal to runner/cuda/.
#include <cuda_runtime.h>

#include "model/safetensors.h"
#include "runner/cuda/weight_binding.h"

namespace rollout {

// Enqueues on `stream` the copy of the tensor `src` (`dtype`, row-major [b.rows, b.cols],
// readable from the current device) into its pieces on the current device: straight when the
// dtype is the device's (bf16 matrices, fp32 vectors), else converted on the device bitwise as
// the host path converts.
cudaError_t CopyWeightFromDevice(const cuda_runner_internal::Binding& b, DType dtype,
                                 const void* src, cudaStream_t stream);

}  // namespace rollout
