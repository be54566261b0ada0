// CudaModelRunner's waits for launched work, bounded when ranks on several GPUs exchange through
// NCCL: a peer GPU's fault or a hung link then ends the step with a status instead of hanging
// the engine thread forever (docs/cuda.md, "Faults across GPUs").
#include <chrono>
#include <string>
#include <thread>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/cuda_status.h"
#include "common/status.h"
#include "glog/logging.h"
#include "runner/cuda/cuda_runner_state.h"

namespace rollout {

absl::Status CudaModelRunner::State::CheckUsable() const {
  if (broken.empty()) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "this runner's tensor-parallel group was aborted (", broken,
      "); its GPUs' state is unknown: restart the server"));
}

absl::Status CudaModelRunner::State::Wait(cudaStream_t stream, cudaEvent_t event,
                                          const char* what) {
  ROLLOUT_RETURN_IF_ERROR(CheckUsable());
  if (group == nullptr || !group->can_hang()) {
    return CudaError(event != nullptr ? cudaEventSynchronize(event) : cudaStreamSynchronize(stream),
                     what);
  }
  const auto start = std::chrono::steady_clock::now();
  for (int polls = 0;; ++polls) {
    const cudaError_t e = event != nullptr ? cudaEventQuery(event) : cudaStreamQuery(stream);
    if (e == cudaSuccess) return absl::OkStatus();
    std::string why;
    if (e != cudaErrorNotReady) {
      why = absl::StrCat(what, ": ", cudaGetErrorName(e), " (", cudaGetErrorString(e), ")");
    } else if (const cuda::GroupStatus async = group->CheckAsync(); !async.ok()) {
      why = absl::StrCat(what, ": the NCCL group failed: ", async.message());
    } else if (std::chrono::steady_clock::now() - start >= collective_timeout) {
      why = absl::StrFormat(
          "%s: not done within %d s (--collective_timeout_s): a tensor-parallel exchange across "
          "GPUs hung (a peer GPU failed or stalled)",
          what,
          static_cast<int>(std::chrono::duration_cast<std::chrono::seconds>(collective_timeout)
                               .count()));
    }
    if (!why.empty()) {
      LOG(ERROR) << why << "; aborting the tensor-parallel group";
      group->Abort();
      broken = why;
      return absl::UnavailableError(why);
    }
    // A decode step takes milliseconds: spin first, then sleep a little.
    if (polls < 2000) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }
}

absl::Status CudaModelRunner::Usable() const { return state_->CheckUsable(); }

void* CudaModelRunner::WrapRankGroupForTesting(
    const std::function<std::unique_ptr<cuda::RankGroup>(std::unique_ptr<cuda::RankGroup>)>&
        wrap) {
  State& s = *state_;
  if (s.group == nullptr) return nullptr;
  s.group = wrap(std::move(s.group));
  return s.stream;
}

}  // namespace rollout
