// Colocated memory: Engine::ReleaseMemory and ResumeMemory on the engine thread. The engine's
// side is the bookkeeping that makes the runner's release safe -- no step in flight, no KV
// block that anything will read -- and the hold on scheduling until the memory is back.
#include <utility>

#include "absl/strings/str_format.h"
#include "engine/engine_internal.h"
#include "glog/logging.h"

namespace rollout {
namespace engine_internal {
namespace {

double GiB(int64_t bytes) { return static_cast<double>(bytes) / (1 << 30); }

}  // namespace

void EngineCore::ApplyMemoryOrder(MemoryOrder order, StepEvents* events) {
  MemoryResult result = order.release.has_value() ? ReleaseMemory(*order.release, events)
                                                  : ResumeMemory();
  // Counters and the aborted samples' completions reach their streams before the reply.
  PublishCounters();
  Deliver(events);
  delivery_.WaitIdle();
  order.done(std::move(result));
}

MemoryResult EngineCore::ReleaseMemory(const MemoryReleaseOptions& options, StepEvents* events) {
  MemoryResult result;
  result.was_released = released_.has_value();
  if (options.abort_in_flight) {
    result.aborted_samples = AbortAllJobs("ReleaseMemory with abort_in_flight", events);
    // A DRAIN update waiting for them applies now, before the memory goes; its reply comes
    // after their completions.
    PublishCounters();
    Deliver(events);
    AdvanceDrain();
  }
  if (draining_.has_value()) {
    // Its samples could never finish, and the update would hold new work forever.
    result.status = absl::FailedPreconditionError(absl::StrFormat(
        "a DRAIN weight update to '%s' waits for %d samples in flight; release the memory once "
        "it applied, or with abort_in_flight (nothing was released)",
        draining_->update.version, scheduler_.num_running() + scheduler_.num_waiting()));
    return result;
  }
  const bool weights = options.weights && !(released_.has_value() && released_->weights);
  if (released_.has_value() && !weights) return result;  // released already: nothing more to do
  // Every block must be free: the runner's memory behind them is about to go. Requeued samples
  // are recomputed after ResumeMemory, bit for bit (D5); a flush frees the pages they left in
  // the cache.
  result.requeued_samples = scheduler_.RequeueRunning();
  cache_.Flush();
  if (blocks_.num_free() != blocks_.num_total()) {
    result.status = absl::InternalError(absl::StrFormat(
        "%d KV blocks are still held after every sample was requeued; nothing was released",
        blocks_.num_total() - blocks_.num_free()));
    return result;
  }
  absl::StatusOr<ReleasedMemory> freed = runner_->ReleaseMemory(weights);
  if (!freed.ok()) {
    // The runner releases all it was asked for or nothing: the memory is as it was (the
    // requeued samples run again on the next step if it was not released before).
    result.status = freed.status();
    return result;
  }
  result.changed = *freed;
  ReleasedMemory now = released_.value_or(ReleasedMemory{});
  now.kv_cache_bytes += freed->kv_cache_bytes;
  now.weight_bytes += freed->weight_bytes;
  now.weights = now.weights || freed->weights;
  released_ = now;
  PublishReleased();
  LOG(INFO) << absl::StrFormat(
      "memory released: KV cache %.2f GiB, weights %.2f GiB (%d samples requeued, %d aborted); "
      "no step runs until ResumeMemory",
      GiB(now.kv_cache_bytes), GiB(now.weight_bytes), result.requeued_samples,
      result.aborted_samples);
  return result;
}

MemoryResult EngineCore::ResumeMemory() {
  MemoryResult result;
  result.was_released = released_.has_value();
  if (!released_.has_value()) return result;
  absl::StatusOr<ReleasedMemory> taken = runner_->ResumeMemory();
  if (!taken.ok()) {
    // Still released, as it was: the caller may retry once the memory is free.
    result.status = taken.status();
    LOG(WARNING) << "ResumeMemory failed; the memory stays released: " << taken.status();
    return result;
  }
  result.changed = *taken;
  released_.reset();
  PublishReleased();
  LOG(INFO) << absl::StrFormat("memory resumed: KV cache %.2f GiB, weights %.2f GiB",
                               GiB(taken->kv_cache_bytes), GiB(taken->weight_bytes));
  return result;
}

void EngineCore::PublishReleased() {
  std::lock_guard<std::mutex> lock(mu_);
  published_released_ = released_;
}

}  // namespace engine_internal
}  // namespace rollout
