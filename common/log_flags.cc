// glog's --v as an absl flag. This file must not include glog, whose gflags declaration of
// FLAGS_v would clash with the one ABSL_FLAG defines; common/command_line.cc hands the value to
// glog.
#include <cstdint>

#include "absl/flags/flag.h"
#include "common/command_line.h"

ABSL_FLAG(int32_t, v, 0,
          "verbose logging: VLOG(n) messages with n <= this level are printed (glog's --v)");

namespace rollout {

int32_t LogVerbosityFlag() { return absl::GetFlag(FLAGS_v); }

}  // namespace rollout
