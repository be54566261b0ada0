#include "engine/model_runner.h"

#include <algorithm>
#include <new>
#include <utility>

#include "absl/strings/str_format.h"
#include "common/status.h"

namespace rollout {
namespace {

// Plain heap memory: untouched pages cost nothing until the first update writes them.
class PlainHostStaging final : public HostStagingBuffer {
 public:
  PlainHostStaging(std::unique_ptr<uint8_t[]> data, size_t size)
      : data_(std::move(data)), size_(size) {}
  uint8_t* data() const override { return data_.get(); }
  size_t size() const override { return size_; }
  bool pinned() const override { return false; }

 private:
  std::unique_ptr<uint8_t[]> data_;
  size_t size_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<HostStagingBuffer>> ModelRunner::AllocateHostStaging(
    size_t bytes) const {
  return AllocatePlainHostStaging(bytes);
}

absl::StatusOr<std::unique_ptr<HostStagingBuffer>> AllocatePlainHostStaging(size_t bytes) {
  // Not value-initialised: no zero-fill.
  std::unique_ptr<uint8_t[]> data(new (std::nothrow) uint8_t[bytes]);
  if (data == nullptr) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "cannot allocate %.2f GiB of host memory to stage weight updates", bytes / 1073741824.0));
  }
  return std::unique_ptr<HostStagingBuffer>(new PlainHostStaging(std::move(data), bytes));
}

namespace {

absl::Status NoIpc(const char* backend) {
  return absl::FailedPreconditionError(absl::StrFormat(
      "the %s backend cannot read CUDA IPC handles; use UpdateWeights or UpdateWeightsFromPath",
      backend));
}

absl::Status NoBroadcasts(const char* backend) {
  return absl::FailedPreconditionError(absl::StrFormat(
      "the %s backend cannot receive NCCL weight broadcasts (they land in device memory): serve "
      "with --backend cuda --device_weight_staging, or update with UpdateWeights or "
      "UpdateWeightsFromPath",
      backend));
}

}  // namespace

absl::StatusOr<std::unique_ptr<WeightSyncPort>> ModelRunner::CreateWeightSyncPort() {
  return NoBroadcasts(backend_name());
}

absl::Status ModelRunner::UpdateWeightsFromStaging(const StagedWeights& staged) {
  return NoBroadcasts(backend_name());
}

absl::StatusOr<std::unique_ptr<OpenedIpcTensors>> ModelRunner::OpenIpcTensors(
    const std::vector<IpcTensorSource>& tensors) {
  return NoIpc(backend_name());
}

absl::Status ModelRunner::UpdateWeightsFromIpc(const OpenedIpcTensors& opened) {
  return NoIpc(backend_name());
}

absl::Status ModelRunner::ResolveFedTokens(const std::vector<SampleResult>& fed_from,
                                           ForwardBatch* batch) {
  for (const FedToken& fed : batch->fed_tokens) {
    if (fed.from_row < 0 || fed.from_row >= static_cast<int64_t>(fed_from.size())) {
      return absl::InvalidArgumentError(
          absl::StrFormat("fed token of row %d: the previous launched step has %d rows",
                          fed.from_row, fed_from.size()));
    }
    if (fed.token_index < 0 || fed.token_index >= batch->num_tokens()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "fed token at index %d of a batch of %d tokens", fed.token_index, batch->num_tokens()));
    }
    batch->token_ids[fed.token_index] = fed_from[fed.from_row].token;
  }
  batch->fed_tokens.clear();
  return absl::OkStatus();
}

absl::Status ModelRunner::RefuseRouting(const ForwardBatch& batch, const char* backend) {
  if (!batch.asks_routing()) return absl::OkStatus();
  return absl::UnimplementedError(absl::StrFormat(
      "the %s backend does not implement MoE routing replay (return_routing, routing)", backend));
}

absl::Status ModelRunner::ForwardWithRouting(const ForwardBatch& batch, std::vector<float>* logits,
                                             std::vector<std::vector<int32_t>>* routing) {
  ROLLOUT_RETURN_IF_ERROR(RefuseRouting(batch, backend_name()));
  routing->clear();
  return Forward(batch, logits);
}

absl::Status ModelRunner::LaunchStep(const ForwardBatch& batch,
                                     const std::vector<LogitsRowTask>& tasks) {
  if (launched_results_.size() >= 2) {
    return absl::FailedPreconditionError("two launched steps are not collected yet");
  }
  std::vector<float> logits;
  std::vector<std::vector<int32_t>> routing;
  std::vector<SampleResult> results;
  if (HasFedTokens(batch)) {
    if (launched_results_.empty()) {
      return absl::InvalidArgumentError("fed tokens without a launched step to feed them");
    }
    ForwardBatch resolved = batch;
    if (absl::Status s = ResolveFedTokens(launched_results_.back(), &resolved); !s.ok()) return s;
    if (absl::Status s = ForwardWithRouting(resolved, &logits, &routing); !s.ok()) return s;
  } else {
    if (absl::Status s = ForwardWithRouting(batch, &logits, &routing); !s.ok()) return s;
  }
  if (absl::Status s = ProcessLogits(tasks, logits, &results); !s.ok()) return s;
  for (size_t i = 0; i < routing.size() && i < results.size(); ++i) {
    results[i].routing = std::move(routing[i]);
  }
  launched_results_.push_back(std::move(results));
  return absl::OkStatus();
}

absl::Status ModelRunner::CollectStep(std::vector<SampleResult>* results) {
  if (launched_results_.empty()) return absl::FailedPreconditionError("no launched step");
  *results = std::move(launched_results_.front());
  launched_results_.pop_front();
  return absl::OkStatus();
}

absl::StatusOr<ReleasedMemory> ModelRunner::ReleaseMemory(bool weights) {
  return absl::UnimplementedError(absl::StrFormat(
      "the %s backend cannot release its memory (ReleaseMemory)", backend_name()));
}

absl::StatusOr<ReleasedMemory> ModelRunner::ResumeMemory() {
  // Nothing can have been released.
  return ReleasedMemory{};
}

}  // namespace rollout
