#pragma once

// Device memory that gives its physical memory back to the GPU and takes it again at the same
// device addresses: what the CUDA runner's KV pool and weights live in, so that ReleaseMemory
// frees them for a colocated trainer while the decode graphs captured over them stay valid.
// Internal to runner/cuda/.
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"

namespace rollout {
namespace cuda_runner_internal {

// One allocation through CUDA's virtual memory management: a range of device addresses is
// reserved once (cuMemAddressReserve, rounded up to the allocation granularity); physical
// memory is created and mapped into it (cuMemCreate, cuMemMap, cuMemSetAccess) at Allocate and
// at every Reacquire, and unmapped and freed (cuMemUnmap, cuMemRelease) at every Release. The
// addresses never change, so pointers into it -- and CUDA graphs that captured them -- stay
// valid; only touching it while released is an error (an illegal address on the device).
//
// The driver's entry points come from cudaGetDriverEntryPointByVersion: the module links the
// runtime only, never libcuda (CI builds it on machines without a driver). Where the device or
// driver has no virtual memory management (or its entry points are missing) Allocate falls back
// to cudaMalloc and Release answers FAILED_PRECONDITION. The interface of cuda::DeviceBuffer
// (Allocate, Reset, get, bytes), so the runner's allocations take either.
//
// Move-only. Not thread-safe: its owner's thread (the engine thread), with the device it was
// allocated on current.
class ReleasableDeviceBuffer {
 public:
  ReleasableDeviceBuffer() = default;
  ~ReleasableDeviceBuffer() { Reset(); }
  ReleasableDeviceBuffer(ReleasableDeviceBuffer&& other) noexcept;
  ReleasableDeviceBuffer& operator=(ReleasableDeviceBuffer&& other) noexcept;
  ReleasableDeviceBuffer(const ReleasableDeviceBuffer&) = delete;
  ReleasableDeviceBuffer& operator=(const ReleasableDeviceBuffer&) = delete;

  // Frees what it held, then allocates `bytes` on the current device (nothing for 0).
  // cudaErrorMemoryAllocation when the device lacks the memory.
  cudaError_t Allocate(size_t bytes);
  void Reset();

  template <typename T = void>
  T* get() const {
    return reinterpret_cast<T*>(ptr_);
  }
  size_t bytes() const { return bytes_; }
  // The physical memory it holds now: the reserved length (a multiple of the granularity)
  // while mapped, 0 while released.
  size_t physical_bytes() const { return released_ ? 0 : reserved_; }
  bool released() const { return released_; }
  // Backed by virtual memory management (Release works).
  bool releasable() const { return vmm_; }

  // Unmaps and frees the physical memory; the addresses stay reserved, the contents are lost.
  // A no-op when released already. REQUIRES: nothing on the device uses it any more (the
  // caller synchronizes first). FAILED_PRECONDITION on a cudaMalloc fallback.
  absl::Status Release();
  // Creates and maps physical memory at the same addresses again (its contents undefined: the
  // caller zeroes or restores them); a no-op when not released. RESOURCE_EXHAUSTED when the
  // device lacks the memory (then it is released as before).
  absl::Status Reacquire();

 private:
  // Creates, maps and grants the device access to reserved_ bytes of physical memory at ptr_.
  absl::Status Map();
  // Unmaps and frees it.
  void Unmap();

  uintptr_t ptr_ = 0;  // a CUdeviceptr (VMM) or a cudaMalloc pointer
  size_t bytes_ = 0;
  size_t reserved_ = 0;  // VMM: the reserved range's length
  int device_ = 0;
  bool vmm_ = false;              // ptr_ is a reserved range
  unsigned long long handle_ = 0;  // VMM while mapped: the CUmemGenericAllocationHandle
  bool released_ = false;
};

}  // namespace cuda_runner_internal
}  // namespace rollout
