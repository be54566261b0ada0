#pragma once

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace rollout {

// Host memory whose physical pages can be given back to the OS and taken again at the same
// addresses: the CPU backend's KV cache under ReleaseMemory, the host analogue of the CUDA
// backend's virtual-memory buffers (runner/cuda/releasable_device_buffer.h). An anonymous
// private mapping, reserved once; Release drops its pages (madvise MADV_DONTNEED) and makes the
// range inaccessible (PROT_NONE: a stray read faults instead of reading zeros), Reacquire makes
// it accessible again and faults every page in (MADV_POPULATE_WRITE where the kernel has it),
// so that memory the host does not have is reported now, not by the OOM killer later.
// Move-only; not thread-safe (its owner's thread, the engine thread for the runner).
class ReleasableHostMemory {
 public:
  ReleasableHostMemory() = default;
  // Maps `bytes` (zeroed, every page resident). RESOURCE_EXHAUSTED when the host cannot.
  static absl::StatusOr<ReleasableHostMemory> Allocate(size_t bytes);
  ~ReleasableHostMemory();
  ReleasableHostMemory(ReleasableHostMemory&& other) noexcept;
  ReleasableHostMemory& operator=(ReleasableHostMemory&& other) noexcept;
  ReleasableHostMemory(const ReleasableHostMemory&) = delete;
  ReleasableHostMemory& operator=(const ReleasableHostMemory&) = delete;

  template <typename T = void>
  T* get() const {
    return static_cast<T*>(data_);
  }
  size_t bytes() const { return bytes_; }
  bool released() const { return released_; }

  // Gives every page back to the OS; the addresses stay reserved and the contents are lost.
  // A no-op when released already.
  absl::Status Release();
  // Makes the memory usable again, zeroed, at the same addresses, every page resident; a no-op
  // when not released. RESOURCE_EXHAUSTED when the pages cannot be had (then it is released
  // as before).
  absl::Status Reacquire();

  // Pages of the range resident in physical memory now (mincore), for tests.
  absl::StatusOr<int64_t> ResidentBytes() const;

 private:
  void Unmap();

  void* data_ = nullptr;
  size_t bytes_ = 0;  // the mapping's length: a whole number of pages
  bool released_ = false;
};

}  // namespace rollout
