#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <utility>

namespace rollout::cuda {

// Owns one cudaMalloc allocation (256-byte aligned). Move-only. Not thread-safe.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  ~DeviceBuffer() { Reset(); }
  DeviceBuffer(DeviceBuffer&& other) noexcept
      : ptr_(std::exchange(other.ptr_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept {
    if (this != &other) {
      Reset();
      ptr_ = std::exchange(other.ptr_, nullptr);
      bytes_ = std::exchange(other.bytes_, 0);
    }
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  // Frees what it held, then allocates `bytes` (nothing for 0).
  cudaError_t Allocate(size_t bytes) {
    Reset();
    if (bytes == 0) return cudaSuccess;
    const cudaError_t err = cudaMalloc(&ptr_, bytes);
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
    if (ptr_ != nullptr) cudaFree(ptr_);
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

// Owns one cudaMallocHost allocation (pinned host memory). Move-only. Not thread-safe.
class PinnedHostBuffer {
 public:
  PinnedHostBuffer() = default;
  ~PinnedHostBuffer() { Reset(); }
  PinnedHostBuffer(PinnedHostBuffer&& other) noexcept
      : ptr_(std::exchange(other.ptr_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}
  PinnedHostBuffer(const PinnedHostBuffer&) = delete;
  PinnedHostBuffer& operator=(const PinnedHostBuffer&) = delete;

  cudaError_t Allocate(size_t bytes) {
    Reset();
    if (bytes == 0) return cudaSuccess;
    const cudaError_t err = cudaMallocHost(&ptr_, bytes);
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
    if (ptr_ != nullptr) cudaFreeHost(ptr_);
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

}  // namespace rollout::cuda
