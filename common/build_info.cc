#include "common/build_info.h"

#include "rollout_build_info.h"  // generated: ROLLOUT_VERSION, ROLLOUT_GIT_COMMIT, ...

namespace rollout {

BuildInfo GetBuildInfo() { return {ROLLOUT_VERSION, ROLLOUT_GIT_COMMIT, ROLLOUT_BUILD_TYPE}; }

std::string BuildInfoLine() {
  const BuildInfo b = GetBuildInfo();
  return std::string("rollout ") + b.version + " (commit " + b.commit + ", " + b.build_type +
         " build)";
}

}  // namespace rollout
