#pragma once

// The tensor digest (model/weight_digest.h) of bytes in device memory: the one seam through
// which the CUDA backend hashes weights where they are (IPC updates today). For now it copies
// the bytes to the host in pinned chunks (the next copied while the last is hashed) and hashes
// their 64 KiB leaves with the host code on every core; a GPU SHA-256 of the leaves
// (kernels/cuda/device_digest.h) is meant to replace the body, not the callers.

#include <cuda_runtime.h>

#include <cstddef>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace rollout {

// `size` bytes at `data`, device memory readable from the current device (its own, or an IPC
// mapping of another process's).
struct DeviceBytes {
  const void* data = nullptr;
  size_t size = 0;
};

// TensorDigest of each of `tensors`, in order: bitwise what TensorDigest gives for the same
// bytes on the host. Synchronous; uses `stream` (of the current device) and returns once it is
// idle. INTERNAL naming the CUDA call on a device error.
absl::StatusOr<std::vector<std::string>> DigestDeviceTensors(
    const std::vector<DeviceBytes>& tensors, cudaStream_t stream);

}  // namespace rollout
