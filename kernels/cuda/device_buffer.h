#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <utility>

namespace rollout::cuda {

namespace device_buffer_internal {

inline cudaError_t DeviceAlloc(void** p, size_t bytes) { return cudaMalloc(p, bytes); }
inline cudaError_t DeviceFree(void* p) { return cudaFree(p); }
inline cudaError_t PinnedAlloc(void** p, size_t bytes) { return cudaMallocHost(p, bytes); }
inline cudaError_t PinnedFree(void* p) { return cudaFreeHost(p); }

// Owns one allocation of `kAlloc`, freed by `kFree`. Move-only. Not thread-safe.
template <cudaError_t (*kAlloc)(void**, size_t), cudaError_t (*kFree)(void*)>
class Buffer {
 public:
  Buffer() = default;
  ~Buffer() { Reset(); }
  Buffer(Buffer&& other) noexcept
      : ptr_(std::exchange(other.ptr_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}
  Buffer& operator=(Buffer&& other) noexcept {
    if (this != &other) {
      Reset();
      ptr_ = std::exchange(other.ptr_, nullptr);
      bytes_ = std::exchange(other.bytes_, 0);
    }
    return *this;
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  // Frees what it held, then allocates `bytes` (nothing for 0).
  cudaError_t Allocate(size_t bytes) {
    Reset();
    if (bytes == 0) return cudaSuccess;
    const cudaError_t err = kAlloc(&ptr_, bytes);
    if (err != cudaSuccess) {
      ptr_ = nullptr;
      // The error is returned; clear the thread's last error too, so that the next kernel
      // launch checked with cudaGetLastError() does not report this allocation's failure.
      (void)cudaGetLastError();
      return err;
    }
    bytes_ = bytes;
    return cudaSuccess;
  }
  void Reset() {
    if (ptr_ != nullptr) kFree(ptr_);
    ptr_ = nullptr;
    bytes_ = 0;
  }

  template <typename T = void>
  T* get() const {
    return static_cast<T*>(ptr_);
  }
  size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

}  // namespace device_buffer_internal

// Owns one cudaMalloc allocation (256-byte aligned). Move-only. Not thread-safe.
using DeviceBuffer = device_buffer_internal::Buffer<device_buffer_internal::DeviceAlloc,
                                                    device_buffer_internal::DeviceFree>;

// Owns one cudaMallocHost allocation (pinned host memory). Move-only. Not thread-safe.
using PinnedHostBuffer = device_buffer_internal::Buffer<device_buffer_internal::PinnedAlloc,
                                                        device_buffer_internal::PinnedFree>;

}  // namespace rollout::cuda
