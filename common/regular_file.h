#pragma once

// Reading files named by callers (checkpoints, TLS files, token files) so that no path can hang
// or exhaust a process: only regular files are opened (a FIFO is never waited on, a device never
// read without end), reads are bounded, and a file that shrinks under the reader is an error.

#include <sys/stat.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include "absl/strings/string_view.h"

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace rollout {

// Opens `path` read-only if it is a regular file and returns the descriptor (the caller closes
// it), filling `st`. A path that leads nowhere (ENOENT, ENOTDIR) is NOT_FOUND; a directory, a
// FIFO, device or socket, a symlink loop or a name too long is INVALID_ARGUMENT naming it; EACCES
// is PERMISSION_DENIED. Never blocks on a FIFO.
absl::StatusOr<int> OpenRegularFile(const std::string& path, struct stat* st);

// Reads exactly `size` bytes at `offset` of `fd` (opened from `path`) into `out`. A file that
// ends early was truncated (or rewritten) after it was opened: ABORTED naming `path`.
absl::Status ReadFileAt(int fd, const std::string& path, uint64_t offset, size_t size,
                        uint8_t* out);

// The whole content of the regular file `path`, which may have at most `max_bytes`
// (INVALID_ARGUMENT beyond, naming `what`, e.g. "TLS certificate"), as OpenRegularFile opens it.
absl::StatusOr<std::string> ReadSmallFile(const std::string& path, uint64_t max_bytes,
                                          absl::string_view what);

}  // namespace rollout
