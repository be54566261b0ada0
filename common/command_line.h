#pragma once

// The command line of the project's binaries (absl flags), one way for all of them.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace rollout {

// Parses argv with absl flags, after which: --help lists `usage` and the flags defined in the
// binary's own source file `main_file` (its name, e.g. "server_main.cc"; absl's default lists
// only files named after the binary, which none of ours is) and --v; --helpfull lists every
// flag; --version prints BuildInfoLine(); --v=N sets glog's verbosity. Returns the positional
// arguments, argv[0] first. Call once, first thing in main.
std::vector<char*> ParseCommandLine(int argc, char** argv, absl::string_view usage,
                                    absl::string_view main_file);

// The bearer token in `path`: its first line without the line end ("\n" or "\r\n") and without
// surrounding whitespace. Read as ReadSmallFile reads (a regular file, at most 64 KiB).
// INVALID_ARGUMENT when there is no token; NOT_FOUND when the file does not exist.
absl::StatusOr<std::string> ReadTokenFile(const std::string& path);

// --v (common/log_flags.cc).
int32_t LogVerbosityFlag();

}  // namespace rollout
