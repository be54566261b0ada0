#pragma once

// Header only, for CUDA code (common/ links no CUDA library).

#include <cuda_runtime.h>

namespace rollout {

// Restores the calling thread's current CUDA device on scope exit (when it had one). Not
// copyable; lives on one thread's stack.
class CudaDeviceScope {
 public:
  CudaDeviceScope() { had_device_ = cudaGetDevice(&device_) == cudaSuccess; }
  ~CudaDeviceScope() {
    if (had_device_) cudaSetDevice(device_);
  }
  CudaDeviceScope(const CudaDeviceScope&) = delete;
  CudaDeviceScope& operator=(const CudaDeviceScope&) = delete;

 private:
  int device_ = 0;
  bool had_device_ = false;
};

}  // namespace rollout
