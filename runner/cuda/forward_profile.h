#pragma once

// Per-kernel-family timing of the CUDA runner's Forward calls (CudaModelRunner::EnableProfiling):
// an event recorded on rank 0's stream after each family's work, the time between consecutive
// events added to the later one's family. Internal to runner/cuda/. Engine thread only.
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "runner/cuda/cuda_handles.h"

namespace rollout {
namespace cuda_runner_internal {

enum Family {
  kMeta,
  kEmbed,
  kNorm,
  kGemmQkv,
  kQkvRope,
  kAttention,
  kGemmO,
  kGemmGateUp,
  kSiluMul,
  kGemmDown,
  kLmHead,
  kLogitsCopy,
  kMoeRoute,    // router GEMM + routing
  kMoeGroup,    // grouping by expert
  kMoeGateUp,   // the grouped gate/up GEMM
  kMoeDown,     // the grouped down GEMM
  kMoeCombine,  // the weighted sum into the residual
  kNumFamilies
};
inline constexpr const char* kFamilyNames[kNumFamilies] = {"metadata h2d",
                                                           "embedding",
                                                           "rmsnorm",
                                                           "gemm qkv",
                                                           "qk-norm+rope+kv write",
                                                           "attention",
                                                           "gemm o (+res)",
                                                           "gemm gate_up",
                                                           "silu*up",
                                                           "gemm down (+res)",
                                                           "lm_head (+final norm)",
                                                           "logits d2h",
                                                           "moe router+routing",
                                                           "moe grouping",
                                                           "moe gemm gate_up",
                                                           "moe gemm down",
                                                           "moe combine (+res)"};

class ForwardProfiler {
 public:
  bool on() const { return on_; }
  void set_on(bool on) { on_ = on; }

  // A Forward starts: its events are recorded from the first again.
  void BeginForward() { num_events_ = 0; }
  // Records the end of `family`'s work on `stream` (nothing when off); creates events as needed.
  absl::Status Mark(int family, cudaStream_t stream);
  // REQUIRES: the Forward's work is done. Adds its times to the families (when on).
  absl::Status EndForward();

  double family_ms(int family) const { return family_ms_[family]; }
  int64_t forwards() const { return forwards_; }
  void Reset();

 private:
  bool on_ = false;
  std::vector<CudaEvent> events_;  // recorded in order during one Forward
  std::vector<int> event_family_;  // family of the work that ends at events_[i]
  size_t num_events_ = 0;
  double family_ms_[kNumFamilies] = {};
  int64_t forwards_ = 0;
};

}  // namespace cuda_runner_internal
}  // namespace rollout
