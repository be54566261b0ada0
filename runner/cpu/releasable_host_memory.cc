#include "runner/cpu/releasable_host_memory.h"

#include <errno.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14; older kernels answer EINVAL (then pages are touched)
#endif

namespace rollout {
namespace {

size_t PageSize() { return static_cast<size_t>(sysconf(_SC_PAGESIZE)); }

std::string Errno(int err) { return std::strerror(err); }

// Faults every page of [data, data + bytes) in, writable. ENOMEM when the host has no pages.
int Populate(void* data, size_t bytes) {
  if (madvise(data, bytes, MADV_POPULATE_WRITE) == 0) return 0;
  if (errno != EINVAL) return errno;
  // A kernel without MADV_POPULATE_WRITE: write one byte per page (the pages are zero, so a
  // zero write changes nothing). A host out of memory then answers with the OOM killer.
  const size_t page = PageSize();
  volatile char* p = static_cast<volatile char*>(data);
  for (size_t off = 0; off < bytes; off += page) p[off] = 0;
  return 0;
}

}  // namespace

absl::StatusOr<ReleasableHostMemory> ReleasableHostMemory::Allocate(size_t bytes) {
  ReleasableHostMemory m;
  if (bytes == 0) return m;
  const size_t page = PageSize();
  const size_t length = (bytes + page - 1) / page * page;
  void* data = mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (data == MAP_FAILED) {
    return absl::ResourceExhaustedError(
        absl::StrFormat("mapping %d bytes of host memory: %s", length, Errno(errno)));
  }
  m.data_ = data;
  m.bytes_ = length;
  if (const int err = Populate(data, length); err != 0) {
    return absl::ResourceExhaustedError(
        absl::StrFormat("faulting in %d bytes of host memory: %s", length, Errno(err)));
  }
  return m;
}

ReleasableHostMemory::~ReleasableHostMemory() { Unmap(); }

ReleasableHostMemory::ReleasableHostMemory(ReleasableHostMemory&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      bytes_(std::exchange(other.bytes_, 0)),
      released_(std::exchange(other.released_, false)) {}

ReleasableHostMemory& ReleasableHostMemory::operator=(ReleasableHostMemory&& other) noexcept {
  if (this != &other) {
    Unmap();
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
    released_ = std::exchange(other.released_, false);
  }
  return *this;
}

void ReleasableHostMemory::Unmap() {
  if (data_ != nullptr) munmap(data_, bytes_);
  data_ = nullptr;
  bytes_ = 0;
  released_ = false;
}

absl::Status ReleasableHostMemory::Release() {
  if (released_ || data_ == nullptr) return absl::OkStatus();
  // MADV_DONTNEED on a private anonymous mapping frees the pages now; the next touch would
  // see zero pages, but PROT_NONE makes any touch before Reacquire a fault.
  if (madvise(data_, bytes_, MADV_DONTNEED) != 0) {
    return absl::InternalError(absl::StrCat("madvise(MADV_DONTNEED): ", Errno(errno)));
  }
  if (mprotect(data_, bytes_, PROT_NONE) != 0) {
    return absl::InternalError(absl::StrCat("mprotect(PROT_NONE): ", Errno(errno)));
  }
  released_ = true;
  return absl::OkStatus();
}

absl::Status ReleasableHostMemory::Reacquire() {
  if (!released_) return absl::OkStatus();
  if (mprotect(data_, bytes_, PROT_READ | PROT_WRITE) != 0) {
    return absl::ResourceExhaustedError(absl::StrCat("mprotect(PROT_READ | PROT_WRITE): ",
                                                     Errno(errno)));
  }
  if (const int err = Populate(data_, bytes_); err != 0) {
    // Back to released: drop what was faulted in.
    madvise(data_, bytes_, MADV_DONTNEED);
    mprotect(data_, bytes_, PROT_NONE);
    return absl::ResourceExhaustedError(
        absl::StrFormat("faulting in %d bytes of host memory: %s", bytes_, Errno(err)));
  }
  released_ = false;
  return absl::OkStatus();
}

absl::StatusOr<int64_t> ReleasableHostMemory::ResidentBytes() const {
  if (data_ == nullptr) return 0;
  const size_t page = PageSize();
  std::vector<unsigned char> pages(bytes_ / page);
  if (mincore(data_, bytes_, pages.data()) != 0) {
    return absl::InternalError(absl::StrCat("mincore: ", Errno(errno)));
  }
  int64_t resident = 0;
  for (unsigned char p : pages) resident += (p & 1) ? static_cast<int64_t>(page) : 0;
  return resident;
}

}  // namespace rollout
