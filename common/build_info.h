#pragma once

#include <string>

namespace rollout {

// What this binary was built from (cmake/build_info.cmake writes it at build time). Any thread.
struct BuildInfo {
  const char* version;     // the project version, e.g. "0.1.0"
  const char* commit;      // git commit, "-dirty" with uncommitted changes, or "unknown"
  const char* build_type;  // CMAKE_BUILD_TYPE: Release, Debug, ...
};
BuildInfo GetBuildInfo();

// One line for --version and the start-up log: "rollout 0.1.0 (commit 1a2b3c4d5e6f, Release
// build)".
std::string BuildInfoLine();

}  // namespace rollout
