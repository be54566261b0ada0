#pragma once

// The tensor digest (model/weight_digest.h) of bytes in device memory: the one place the CUDA
// runner hashes weights where they are (IPC updates). A thin owner of the workspace around
// kernels/cuda/device_digest.h's DeviceTensorDigests (one thread per 64 KiB leaf, then one per
// tensor), which computes exactly what TensorDigest computes on the host.

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
// bytes on the host. Synchronous: enqueues on `stream` (of the current device), allocates the
// kernels' workspace (32 bytes per leaf: 8 MB for 16.4 GB) for the call, and returns once the
// stream passed it. INTERNAL naming the CUDA call on a device error.
absl::StatusOr<std::vector<std::string>> DigestDeviceTensors(
    const std::vector<DeviceBytes>& tensors, cudaStream_t stream);

}  // namespace rollout
