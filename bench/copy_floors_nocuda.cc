// MeasureHostToDevice for builds without the CUDA backend (copy_floors_cuda.cc otherwise).
#include "bench/copy_floors.h"

namespace rollout::bench {

absl::StatusOr<HostToDeviceFloors> MeasureHostToDevice(size_t, int) {
  return absl::UnimplementedError("this build has no CUDA backend");
}

}  // namespace rollout::bench
