// MeasureHostToDevice for builds with the CUDA backend (copy_floors_nocuda.cc otherwise).
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>

#include "absl/strings/str_cat.h"
#include "bench/copy_floors.h"

namespace rollout::bench {
namespace {

absl::Status Check(cudaError_t error, const char* what) {
  if (error == cudaSuccess) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(what, ": ", cudaGetErrorString(error)));
}

// One host-to-device copy of `bytes` from `from`, waited for, in GB/s; the best of three.
absl::StatusOr<double> CopyRate(void* device, const void* from, size_t bytes) {
  double best = 0;
  for (int r = 0; r < 3; ++r) {
    const auto start = std::chrono::steady_clock::now();
    if (absl::Status s = Check(cudaMemcpyAsync(device, from, bytes, cudaMemcpyHostToDevice, 0),
                               "cudaMemcpyAsync");
        !s.ok()) {
      return s;
    }
    if (absl::Status s = Check(cudaStreamSynchronize(0), "cudaStreamSynchronize"); !s.ok()) {
      return s;
    }
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    best = std::max(best, bytes / seconds / 1e9);
  }
  return best;
}

}  // namespace

absl::StatusOr<HostToDeviceFloors> MeasureHostToDevice(size_t bytes, int device) {
  if (absl::Status s = Check(cudaSetDevice(device), "cudaSetDevice"); !s.ok()) return s;
  void* on_device = nullptr;
  void* pinned = nullptr;
  if (absl::Status s = Check(cudaMalloc(&on_device, bytes), "cudaMalloc"); !s.ok()) return s;
  absl::Status status =
      Check(cudaHostAlloc(&pinned, bytes, cudaHostAllocPortable), "cudaHostAlloc");
  HostToDeviceFloors floors;
  if (status.ok()) {
    std::memset(pinned, 5, bytes);
    absl::StatusOr<double> rate = CopyRate(on_device, pinned, bytes);
    status = rate.status();
    if (rate.ok()) floors.pinned_gbps = *rate;
  }
  if (status.ok()) {
    std::unique_ptr<uint8_t[]> pageable(new uint8_t[bytes]);
    std::memset(pageable.get(), 6, bytes);
    absl::StatusOr<double> rate = CopyRate(on_device, pageable.get(), bytes);
    status = rate.status();
    if (rate.ok()) floors.pageable_gbps = *rate;
  }
  if (pinned != nullptr) cudaFreeHost(pinned);
  cudaFree(on_device);
  if (!status.ok()) return status;
  return floors;
}

}  // namespace rollout::bench
