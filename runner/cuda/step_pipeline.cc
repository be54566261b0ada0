// CudaModelRunner's step pipeline (ModelRunner::LaunchStep / CollectStep): a step the device
// runs alone is only enqueued, its results collected later from its host staging slot; other
// steps run at launch.
#include <cuda_runtime.h>

#include <utility>
#include <vector>

#include "absl/strings/str_format.h"
#include "common/cuda_status.h"
#include "common/status.h"
#include "runner/cuda/cuda_model_runner.h"
#include "runner/cuda/cuda_runner_state.h"

namespace rollout {

absl::Status CudaModelRunner::LaunchStep(const ForwardBatch& batch,
                                         const std::vector<LogitsRowTask>& tasks) {
  State& s = *state_;
  if (s.launched.size() >= 2) {
    return absl::FailedPreconditionError("two launched steps are not collected yet");
  }
  if (tasks.size() != batch.logit_rows.size()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%d tasks for %d logits rows", tasks.size(), batch.logit_rows.size()));
  }
  const bool fed = HasFedTokens(batch);
  if (fed && s.launched.empty()) {
    return absl::InvalidArgumentError("fed tokens without a launched step to feed them");
  }
  ROLLOUT_RETURN_IF_ERROR(CudaError(cudaSetDevice(s.ranks[0].device), "cudaSetDevice"));
  // A staging slot no uncollected step uses, once the step that used it last is done with it.
  s.slot = s.launched.empty() || !s.launched.back().slot.has_value() ? s.slot ^ 1
                                                                     : *s.launched.back().slot ^ 1;
  ROLLOUT_RETURN_IF_ERROR(s.Wait(nullptr, s.staging().done.get(), "waiting for a staging slot"));
  const int64_t rows = static_cast<int64_t>(tasks.size());
  State::Launched launched;
  launched.rows = rows;
  // Enqueued only: one slice, its logits on the device, every row processed there, its fed
  // tokens (if any) in the device's results of the step before.
  absl::Status status;
  // One slice only: the pinned metadata of a slice is rewritten by the next one, which an
  // enqueued step cannot wait for.
  const bool one_slice = SliceEnds(batch).size() <= 1;
  // Routing replay runs synchronously (ForwardWithRouting), its routings into the results.
  const bool routing = batch.asks_routing();
  if (one_slice && CanFeed(tasks) && (!fed || s.feed_ready) && !routing) {
    status = ForwardImpl(batch, nullptr, /*async=*/true);
    if (status.ok() && rows > 0) {
      status = EnqueueDeviceRows(s.logits.get<float>(), tasks, 0, rows);
    }
    if (status.ok()) {
      status = CudaError(cudaEventRecord(s.staging().done.get(), s.stream), "cudaEventRecord");
    }
    launched.slot = s.slot;
  } else {
    ForwardBatch resolved;
    const ForwardBatch* run = &batch;
    if (fed) {
      // The previous launched step's tokens, from its results.
      const State::Launched& previous = s.launched.back();
      std::vector<SampleResult> fed_from = previous.results;  // computed at its launch, or:
      if (previous.slot.has_value()) {
        status = SlotResults(*previous.slot, previous.rows, &fed_from);
      }
      resolved = batch;
      if (status.ok()) status = ResolveFedTokens(fed_from, &resolved);
      run = &resolved;
    }
    std::vector<std::vector<int32_t>> routings;
    if (status.ok()) status = ForwardWithRouting(*run, nullptr, &routings);
    if (status.ok()) status = ProcessLogits(tasks, {}, &launched.results);
    for (size_t i = 0; status.ok() && i < routings.size(); ++i) {
      launched.results[i].routing = std::move(routings[i]);
    }
  }
  // The device's results are this step's tokens when one sampling pass picked them all (a failed
  // launch may have overwritten them: nothing to feed from).
  s.feed_ready = status.ok() && CanFeed(tasks);
  s.feed_rows = rows;
  if (!status.ok()) return status;
  s.launched.push_back(std::move(launched));
  return absl::OkStatus();
}

absl::Status CudaModelRunner::CollectStep(std::vector<SampleResult>* results) {
  State& s = *state_;
  if (s.launched.empty()) return absl::FailedPreconditionError("no launched step to collect");
  State::Launched launched = std::move(s.launched.front());
  s.launched.pop_front();
  // Fed tokens refer to an uncollected step, as in ModelRunner's contract.
  if (s.launched.empty()) s.feed_ready = false;
  if (!launched.slot.has_value()) {
    *results = std::move(launched.results);
    return absl::OkStatus();
  }
  ROLLOUT_RETURN_IF_ERROR(CudaError(cudaSetDevice(s.ranks[0].device), "cudaSetDevice"));
  return SlotResults(*launched.slot, launched.rows, results);
}

absl::Status CudaModelRunner::SlotResults(int slot, int64_t rows,
                                          std::vector<SampleResult>* results) {
  State& s = *state_;
  ROLLOUT_RETURN_IF_ERROR(s.Wait(nullptr, s.slots[slot].done.get(), "a launched step"));
  results->assign(rows, SampleResult());
  ConvertDeviceRows(s.slots[slot].results.get(), 0, rows, results);
  return absl::OkStatus();
}

}  // namespace rollout
