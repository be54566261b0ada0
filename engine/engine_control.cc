#include <chrono>
#include <utility>

#include "absl/strings/str_format.h"
#include "common/status.h"
#include "engine/engine_internal.h"
#include "glog/logging.h"

namespace rollout {
namespace engine_internal {
namespace {

// An update that was not applied, and why.
UpdateResult FailedUpdate(absl::Status status) {
  UpdateResult result;
  result.status = std::move(status);
  return result;
}

}  // namespace

void EngineCore::ApplyControl(Control control, StepEvents* events) {
  Inbox& inbox = control.inbox;
  // Whatever changes the engine's state waits for the launched step (its sequences' results);
  // so does a pause, which delivers them.
  if (!inbox.empty() || control.paused || control.stop) CollectLaunched(events);
  // Updates first: a submission that raced an update into this iteration runs after it.
  for (PendingUpdate& pending : inbox.updates) StartUpdate(std::move(pending), events);
  AdvanceDrain();
  for (Submission& submission : inbox.submissions) {
    // While a DRAIN update waits, new work waits behind it, so it runs on the new weights. A
    // held job is a job all the same, so aborts and cancellations find it.
    const uint64_t job_id = submission.job_id;
    Accept(std::move(submission));
    if (draining_.has_value()) {
      held_.push_back(job_id);
    } else {
      Schedule(job_id);
    }
  }
  for (const JobPause& pause : inbox.job_pauses) ApplyJobPause(pause);
  for (const AbortOrder& order : inbox.aborts) {
    if (order.job_id.has_value()) {
      AbortJob(*order.job_id, order.rollout_index, order.cause, events);
    } else {
      AbortAllJobs(order.cause, events);
    }
  }
  if (!inbox.flushes.empty()) Flush(std::move(inbox.flushes));
  for (MemoryOrder& order : inbox.memory_orders) ApplyMemoryOrder(std::move(order), events);
}

void EngineCore::Shutdown(StepEvents* events) {
  // Held jobs are aborted below with the rest; none of them ever runs.
  held_.clear();
  if (draining_.has_value()) {
    Reply(&*draining_, FailedUpdate(absl::UnavailableError("the server is shutting down")));
    EndDrain();
  }
  AbortAllJobs("the server shutting down", events);
  PublishCounters();
  Deliver(events);
}

absl::Status EngineCore::CheckDigest(PendingUpdate* pending, TensorDigests* after) {
  WeightUpdate& update = pending->update;
  *after = tensor_digests_;
  for (const HostTensorView& t : update.tensors) {
    auto it = update.digests.find(t.name);
    (*after)[t.name] = it != update.digests.end() ? it->second : TensorDigest(t.data, t.nbytes);
  }
  if (pending->opened_ipc != nullptr) {
    for (const auto& [name, digest] : pending->opened_ipc->digests()) (*after)[name] = digest;
  }
  if (pending->staged != nullptr) {
    for (const auto& [name, digest] : pending->staged->digests()) (*after)[name] = digest;
  }
  const std::string digest = WeightsDigest(runner_->weight_specs(), *after);
  if (!update.expected_digest.empty() && digest != update.expected_digest) {
    return absl::DataLossError(absl::StrFormat(
        "these bytes give weights %s, not the expected %s: what arrived is not what the sender "
        "meant to send (nothing was applied)",
        digest.empty() ? "of an unknown digest (a served tensor is converted or missing)" : digest,
        update.expected_digest));
  }
  const auto served = served_digests_.find(update.version);
  if (served != served_digests_.end() && !served->second.empty() && !digest.empty() &&
      digest != served->second) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "version '%s' %s weights %s; these bytes give %s: the same name for other weights would "
        "break the determinism contract, so give them a new version name (nothing was applied)",
        update.version, update.version == version_ ? "is served with" : "was served with",
        served->second, digest));
  }
  return absl::OkStatus();
}

void EngineCore::RememberServed() {
  auto [it, added] = served_digests_.insert_or_assign(version_, digest_);
  if (!added) return;
  served_order_.push_back(version_);
  if (served_order_.size() > kRememberedVersions) {
    served_digests_.erase(served_order_.front());
    served_order_.pop_front();
  }
}

void EngineCore::StartUpdate(PendingUpdate pending, StepEvents* events) {
  if (DropIfCancelled(&pending)) return;
  if (draining_.has_value()) {
    Reply(&pending, FailedUpdate(absl::AbortedError(absl::StrFormat(
                        "weight update to '%s' is still draining; one update at a time",
                        draining_->update.version))));
    return;
  }
  if (released_.has_value() && released_->weights) {
    UpdateResult result = FailedUpdate(absl::FailedPreconditionError(absl::StrFormat(
        "the weights' memory is released (ReleaseMemory with weights); call ResumeMemory "
        "before updating them (nothing was applied; '%s' still serves)",
        version_)));
    result.previous_version = version_;
    Reply(&pending, std::move(result));
    return;
  }
  if (absl::Status opened = OpenIpcTensors(&pending); !opened.ok()) {
    UpdateResult result = FailedUpdate(std::move(opened));
    result.previous_version = version_;
    result.ipc_open_seconds = pending.ipc_open_seconds;
    Reply(&pending, std::move(result));
    return;
  }
  // Opening and hashing take a while: a caller that gave up meanwhile gets nothing applied.
  if (pending.opened_ipc != nullptr && DropIfCancelled(&pending)) return;
  TensorDigests after;
  if (absl::Status digest = CheckDigest(&pending, &after); !digest.ok()) {
    UpdateResult result = FailedUpdate(std::move(digest));
    result.previous_version = version_;
    result.ipc_open_seconds = pending.ipc_open_seconds;
    Reply(&pending, std::move(result));
    return;
  }
  pending.update.digests = std::move(after);  // from here on: every served tensor's
  switch (pending.update.policy) {
    case UpdatePolicy::kAbort: {
      const int32_t aborted = AbortAllJobs(
          absl::StrCat("a weight update to '", pending.update.version, "' with policy ABORT"),
          events);
      // The aborted samples' completions reach their streams before the update's reply.
      PublishCounters();
      Deliver(events);
      ApplyUpdate(std::move(pending), aborted);
      return;
    }
    case UpdatePolicy::kContinue:
      ApplyUpdate(std::move(pending), 0);
      return;
    case UpdatePolicy::kDrain: {
      bool paused, refused;
      {
        std::lock_guard<std::mutex> lock(mu_);
        paused = paused_;
        refused = (paused || released_.has_value()) && !scheduler_.idle();
        // Under the lock that Pause takes: a Pause after this sees the update waiting.
        drain_waiting_ = !refused;
      }
      if (refused) {
        Reply(&pending,
              FailedUpdate(absl::FailedPreconditionError(absl::StrFormat(
                  "the server is %s with %d samples in flight, which DRAIN cannot finish; "
                  "%s first, or update with policy ABORT or CONTINUE",
                  paused ? "paused" : "holding its memory released",
                  scheduler_.num_running() + scheduler_.num_waiting(),
                  paused ? "resume" : "ResumeMemory"))));
        return;
      }
      draining_ = std::move(pending);  // AdvanceDrain applies it once the work in flight ends
      return;
    }
  }
}

void EngineCore::EndDrain() {
  draining_.reset();
  std::lock_guard<std::mutex> lock(mu_);
  drain_waiting_ = false;
}

void EngineCore::AdvanceDrain() {
  if (!draining_.has_value()) return;
  // A cancelled DRAIN update stops holding new work at once, not when the old work ends.
  const bool cancelled = DropIfCancelled(&*draining_);
  if (!cancelled && !scheduler_.idle()) return;
  PendingUpdate pending = *std::move(draining_);
  EndDrain();
  if (!cancelled) ApplyUpdate(std::move(pending), 0);
  std::vector<uint64_t> held;
  held.swap(held_);
  for (uint64_t job_id : held) Schedule(job_id);
}

bool EngineCore::DropIfCancelled(PendingUpdate* pending) {
  if (!pending->cancelled || !pending->cancelled()) return false;
  UpdateResult result;
  result.status = absl::CancelledError(absl::StrFormat(
      "the update to '%s' was cancelled by its caller before the swap; nothing was applied",
      pending->update.version));
  result.previous_version = version_;
  Reply(pending, std::move(result));
  return true;
}

absl::Status EngineCore::OpenIpcTensors(PendingUpdate* pending) {
  const std::vector<IpcTensorSource>& tensors = pending->update.ipc_tensors;
  if (tensors.empty()) return absl::OkStatus();
  if (!pending->update.tensors.empty()) {
    return absl::InvalidArgumentError("an update gives host tensors or IPC tensors, not both");
  }
  ROLLOUT_RETURN_IF_ERROR(CheckIpcTensors(runner_->weight_specs(), tensors));
  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<std::unique_ptr<OpenedIpcTensors>> opened = runner_->OpenIpcTensors(tensors);
  pending->ipc_open_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (!opened.ok()) return opened.status();
  pending->opened_ipc = *std::move(opened);
  return absl::OkStatus();
}

void EngineCore::Reply(PendingUpdate* pending, UpdateResult result) {
  // The caller may free its exported tensors once answered: they are unmapped first. And it
  // may stage its next update: the bytes (the server's staging lease, or a broadcast's
  // device staging) go too.
  pending->opened_ipc.reset();
  pending->update.tensors.clear();
  pending->update.bytes.reset();
  pending->staged.reset();
  result.receive_seconds = pending->receive_seconds;
  result.received_bytes = pending->received_bytes;
  delivery_.WaitIdle();  // replies come after the events of earlier steps
  pending->done(std::move(result));
}

void EngineCore::ApplyUpdate(PendingUpdate pending, int32_t aborted_samples) {
  UpdateResult result;
  result.previous_version = version_;
  result.aborted_samples = aborted_samples;
  result.ipc_open_seconds = pending.ipc_open_seconds;
  const auto start = std::chrono::steady_clock::now();
  result.wait_seconds = std::chrono::duration<double>(start - pending.submitted).count();
  if (pending.staged != nullptr) {
    result.status = runner_->UpdateWeightsFromStaging(*pending.staged);
  } else if (pending.opened_ipc != nullptr) {
    result.status = runner_->UpdateWeightsFromIpc(*pending.opened_ipc);
  } else {
    result.status = runner_->UpdateWeights(pending.update.tensors);
  }
  result.copy_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (result.status.ok()) {
    ++weight_updates_;
    last_update_seconds_ = result.copy_seconds;
    version_ = pending.update.version;
    tensor_digests_ = std::move(pending.update.digests);
    digest_ = WeightsDigest(runner_->weight_specs(), tensor_digests_);
    RememberServed();
    scheduler_.set_cache_version(version_);
    // CONTINUE: a sample without a generated token yet starts again on the new weights (its
    // prompt's KV would be the old ones', under a span that says new).
    const int32_t restarted = scheduler_.RestartUnstarted();
    if (restarted > 0) {
      LOG(INFO) << restarted << " samples without a generated token restart on the new weights";
    }
    // KV of the old weights must never serve the new ones; pages still used by running
    // samples (CONTINUE) are detached and freed when those end.
    cache_.Flush();
    std::lock_guard<std::mutex> lock(mu_);
    published_version_ = version_;
    published_digest_ = digest_;
    result.digest = digest_;
    LOG(INFO) << "weights updated: " << result.previous_version << " -> " << version_ << " ("
              << pending.update.tensors.size() + pending.update.ipc_tensors.size() +
                     (pending.staged != nullptr ? pending.staged->plan().tensors.size() : 0)
              << (pending.opened_ipc != nullptr ? " IPC" : "")
              << (pending.staged != nullptr ? " broadcast" : "") << " tensors; "
              << (digest_.empty() ? "digest unknown" : digest_) << ")";
  }
  Reply(&pending, std::move(result));
}

void EngineCore::Accept(Submission submission) {
  Job& job = jobs_[submission.job_id];
  job.sink = std::move(submission.sink);
  for (SampleSpec& spec : submission.samples) {
    auto seq = std::make_unique<Sequence>();
    seq->arrival = next_arrival_++;
    seq->submitted = submission.submitted;
    seq->job_id = submission.job_id;
    seq->rollout_index = spec.rollout_index;
    seq->sample_index = spec.sample_index;
    seq->params = std::move(spec.params);
    seq->sample_seed = spec.sample_seed;
    seq->prompt_len = static_cast<int64_t>(spec.prompt.size());
    seq->tokens = std::move(spec.prompt);
    seq->score_start = spec.score_start;
    seq->return_routing = spec.return_routing;
    seq->forced_routing = std::move(spec.forced_routing);
    job.sequences.push_back(std::move(seq));
  }
  job.num_unfinished = job.sequences.size();
}

void EngineCore::Schedule(uint64_t job_id) {
  // Gone when every sample of a held job was aborted (and its last events delivered).
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return;
  for (auto& seq : it->second.sequences) {
    if (!seq->finished) scheduler_.Add(seq.get());
  }
}

int32_t EngineCore::AbortJob(uint64_t job_id, std::optional<int32_t> rollout_index,
                             const std::string& cause, StepEvents* events) {
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return 0;
  int32_t aborted = 0;
  for (auto& seq : it->second.sequences) {
    if (seq->finished) continue;
    if (rollout_index.has_value() && seq->rollout_index != *rollout_index) continue;
    seq->abort_cause = cause;
    Report(seq.get(), FinishReason::kAbort, events);
    ++aborted;
  }
  return aborted;
}

void EngineCore::ApplyJobPause(const JobPause& pause) {
  auto it = jobs_.find(pause.job_id);
  if (it == jobs_.end()) return;
  for (auto& seq : it->second.sequences) seq->paused = pause.paused;
}

int32_t EngineCore::AbortAllJobs(const std::string& cause, StepEvents* events) {
  int32_t aborted = 0;
  for (const auto& [job_id, job] : jobs_) aborted += AbortJob(job_id, std::nullopt, cause, events);
  return aborted;
}

void EngineCore::Flush(std::vector<std::function<void(FlushResult)>> dones) {
  const FlushResult r = cache_.Flush();
  // Counters first, so a caller that reads them after the reply sees the flush.
  PublishCounters();
  delivery_.WaitIdle();  // replies come after the events of earlier steps
  for (auto& done : dones) done(r);
}

}  // namespace engine_internal
}  // namespace rollout
