#include "common/regular_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"

namespace rollout {
namespace {

std::string ErrnoText() { return std::strerror(errno); }

// A failed open, from errno. A path that does not lead to a file (ENOENT, or ENOTDIR: a
// component of it is a file) or cannot (a symlink loop, a name too long) is the caller's to
// fix, never INTERNAL.
absl::Status OpenFailure(const std::string& path) {
  const int error = errno;
  std::string message = absl::StrCat(path, ": ", std::strerror(error));
  if (error == ENOENT || error == ENOTDIR) return absl::NotFoundError(std::move(message));
  if (error == EISDIR) {
    return absl::InvalidArgumentError(absl::StrCat(path, " is a directory, not a file"));
  }
  if (error == ELOOP || error == ENAMETOOLONG) {
    return absl::InvalidArgumentError(std::move(message));
  }
  if (error == EACCES || error == EPERM) return absl::PermissionDeniedError(std::move(message));
  return absl::InternalError(std::move(message));
}

}  // namespace

absl::StatusOr<int> OpenRegularFile(const std::string& path, struct stat* st) {
  // O_NONBLOCK: opening a FIFO without a writer would otherwise wait for one, forever. (It does
  // nothing to reads of a regular file.)
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return OpenFailure(path);
  if (::fstat(fd, st) != 0) {
    std::string message = absl::StrCat(path, ": fstat: ", ErrnoText());
    ::close(fd);
    return absl::InternalError(message);
  }
  if (!S_ISREG(st->st_mode)) {
    ::close(fd);
    return absl::InvalidArgumentError(absl::StrCat(
        path, S_ISDIR(st->st_mode)
                  ? " is a directory, not a file"
                  : " is not a regular file (a FIFO, device or socket); give a regular file"));
  }
  return fd;
}

absl::Status ReadFileAt(int fd, const std::string& path, uint64_t offset, size_t size,
                        uint8_t* out) {
  size_t done = 0;
  while (done < size) {
    const ssize_t n = ::pread(fd, out + done, size - done, static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return absl::InternalError(absl::StrCat(path, ": read failed: ", ErrnoText()));
    if (n == 0) {
      return absl::AbortedError(
          absl::StrCat(path, " ends at byte ", offset + done,
                       ", short of bytes it held when it was opened: it was truncated or "
                       "rewritten while it was read"));
    }
    done += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReadSmallFile(const std::string& path, uint64_t max_bytes,
                                          absl::string_view what) {
  struct stat st;
  absl::StatusOr<int> fd = OpenRegularFile(path, &st);
  if (!fd.ok()) return fd.status();
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size > max_bytes) {
    ::close(*fd);
    const std::string limit = max_bytes % (1 << 20) == 0 ? absl::StrCat(max_bytes >> 20, " MiB")
                                                         : absl::StrCat(max_bytes, " bytes");
    return absl::InvalidArgumentError(
        absl::StrCat(path, " is ", size, " bytes, beyond the ", limit, " a ", what, " may have"));
  }
  std::string text(size, '\0');
  absl::Status read = ReadFileAt(*fd, path, 0, size, reinterpret_cast<uint8_t*>(text.data()));
  ::close(*fd);
  if (!read.ok()) return read;
  return text;
}

}  // namespace rollout
