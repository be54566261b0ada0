#include "runner/cuda/forward_profile.h"

#include <algorithm>
#include <iterator>

#include "common/cuda_status.h"
#include "common/status.h"

namespace rollout {
namespace cuda_runner_internal {

absl::Status ForwardProfiler::Mark(int family, cudaStream_t stream) {
  if (!on_) return absl::OkStatus();
  if (num_events_ == events_.size()) {
    cudaEvent_t e;
    ROLLOUT_RETURN_IF_ERROR(CudaError(cudaEventCreate(&e), "cudaEventCreate"));
    events_.emplace_back(e);
    event_family_.push_back(0);
  }
  event_family_[num_events_] = family;
  ROLLOUT_RETURN_IF_ERROR(
      CudaError(cudaEventRecord(events_[num_events_].get(), stream), "cudaEventRecord"));
  ++num_events_;
  return absl::OkStatus();
}

absl::Status ForwardProfiler::EndForward() {
  if (!on_ || num_events_ <= 1) return absl::OkStatus();
  for (size_t i = 1; i < num_events_; ++i) {
    float ms = 0.0f;
    ROLLOUT_RETURN_IF_ERROR(CudaError(
        cudaEventElapsedTime(&ms, events_[i - 1].get(), events_[i].get()), "cudaEventElapsedTime"));
    family_ms_[event_family_[i]] += ms;
  }
  ++forwards_;
  return absl::OkStatus();
}

void ForwardProfiler::Reset() {
  std::fill(std::begin(family_ms_), std::end(family_ms_), 0.0);
  forwards_ = 0;
}

}  // namespace cuda_runner_internal
}  // namespace rollout
