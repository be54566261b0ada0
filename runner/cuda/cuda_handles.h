#pragma once

// Owners of the CUDA runtime and cuBLASLt handles the CUDA runner creates. Internal to
// runner/cuda/. Not thread-safe; the engine thread owns them, like the runner.
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <utility>

namespace rollout {
namespace cuda_runner_internal {

// Owns one handle (nullptr: none) and destroys it with kDestroy, whose error is ignored as in any
// destructor. Move-only. Destroys with whatever device is current: a handle of another device
// than the current one is destroyed by an owner that makes its device current first (RankList).
template <typename Handle, auto kDestroy>
class CudaHandle {
 public:
  CudaHandle() = default;
  explicit CudaHandle(Handle handle) : handle_(handle) {}
  ~CudaHandle() { Reset(); }
  CudaHandle(CudaHandle&& other) noexcept : handle_(std::exchange(other.handle_, nullptr)) {}
  CudaHandle& operator=(CudaHandle&& other) noexcept {
    if (this != &other) {
      Reset();
      handle_ = std::exchange(other.handle_, nullptr);
    }
    return *this;
  }
  CudaHandle(const CudaHandle&) = delete;
  CudaHandle& operator=(const CudaHandle&) = delete;

  Handle get() const { return handle_; }
  // Destroys the handle held, if any; returns where a create call writes the new one.
  Handle* Receive() {
    Reset();
    return &handle_;
  }
  void Reset() {
    if (handle_ != nullptr) kDestroy(handle_);
    handle_ = nullptr;
  }

 private:
  Handle handle_ = nullptr;
};

using CudaStream = CudaHandle<cudaStream_t, cudaStreamDestroy>;
using CudaEvent = CudaHandle<cudaEvent_t, cudaEventDestroy>;
using CudaGraphExec = CudaHandle<cudaGraphExec_t, cudaGraphExecDestroy>;
using CublasLt = CudaHandle<cublasLtHandle_t, cublasLtDestroy>;

}  // namespace cuda_runner_internal
}  // namespace rollout
