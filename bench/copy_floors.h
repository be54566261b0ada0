#pragma once

// The copy rates a weight update cannot beat, measured on the machine that runs it
// (rollout-weight-bench prints them beside its figures). Rates are GB/s (1e9 bytes/s), the best
// of a few repetitions, with buffers touched first so that page faults are not counted.

#include <cstddef>
#include <string>

#include "absl/status/statusor.h"

namespace rollout::bench {

// memcpy of `bytes` between two host buffers on `threads` threads (each its own slice).
double HostMemcpyGBps(size_t bytes, int threads);

// `bytes` through `connections` loopback TCP connections at once, an equal share each (write()
// on one thread, read() on another per connection): one is what one gRPC stream's bytes cross
// before gRPC touches them; more say what spreading an update over several would give.
absl::StatusOr<double> LoopbackTcpGBps(size_t bytes, int connections = 1);

// Host to device copies of `bytes` on GPU `device`, from page-locked and from pageable memory.
struct HostToDeviceFloors {
  double pinned_gbps = 0;
  double pageable_gbps = 0;
};
// UNIMPLEMENTED in a build without CUDA; the CUDA error otherwise (no GPU, no memory).
absl::StatusOr<HostToDeviceFloors> MeasureHostToDevice(size_t bytes, int device);

}  // namespace rollout::bench
