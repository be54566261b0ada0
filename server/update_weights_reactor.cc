#include "server/update_weights_reactor.h"

#include <utility>

#include "server/status_util.h"

namespace rollout {
namespace {

double SecondsSince(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

}  // namespace

UpdateWeightsReactor::UpdateWeightsReactor(RolloutServiceImpl* service,
                                           v1::UpdateWeightsResponse* response,
                                           absl::Status admission)
    : service_(service),
      response_(response),
      holds_slot_(admission.ok()),
      staging_(&service->engine()->weight_specs()) {
  if (!admission.ok()) {
    FinishOnce(ToGrpcStatus(admission));
    return;
  }
  StartRead(&chunk_);
}

void UpdateWeightsReactor::OnReadDone(bool ok) {
  if (!ok) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (cancelled_) {
        if (!finished_) {
          finished_ = true;
          ReleaseSlotLocked();
          Finish(grpc::Status(grpc::StatusCode::CANCELLED,
                              "the update stream was cancelled; nothing was applied"));
        }
        return;
      }
    }
    Submit();
    return;
  }
  absl::Status status;
  if (chunk_.has_header()) {
    status = staging_.SetHeader(chunk_.header());
  } else if (chunk_.has_data()) {
    status = staging_.AddData(chunk_.data());
  } else {
    status = absl::InvalidArgumentError("an empty WeightsChunk: set header or data");
  }
  if (!status.ok()) {
    FinishOnce(ToGrpcStatus(absl::Status(
        status.code(), absl::StrCat(status.message(), "; nothing was applied"))));
    return;
  }
  StartRead(&chunk_);
}

void UpdateWeightsReactor::Submit() {
  absl::StatusOr<WeightUpdate> update = staging_.Finish();
  if (!update.ok()) {
    FinishOnce(ToGrpcStatus(update.status()));
    return;
  }
  response_->set_version(update->version);
  response_->set_tensors_updated(static_cast<uint32_t>(update->tensors.size()));
  response_->set_bytes_received(staging_.bytes_received());
  response_->set_receive_seconds(SecondsSince(start_));
  const auto swap_start = std::chrono::steady_clock::now();
  // The reactor lives until Finish, which only this callback calls from here on.
  service_->engine()->UpdateWeights(*std::move(update), [this, swap_start](UpdateResult r) {
    response_->set_previous_version(r.previous_version);
    response_->set_aborted_samples(static_cast<uint32_t>(r.aborted_samples));
    response_->set_swap_seconds(SecondsSince(swap_start));
    if (service_->metrics() != nullptr) {
      service_->metrics()->RecordUpdate(SecondsSince(start_), r.status.ok());
    }
    FinishOnce(ToGrpcStatus(r.status));
  });
}

void UpdateWeightsReactor::FinishOnce(const grpc::Status& status) {
  std::lock_guard<std::mutex> lock(mu_);
  if (finished_) return;
  finished_ = true;
  ReleaseSlotLocked();
  Finish(status);
}

void UpdateWeightsReactor::ReleaseSlotLocked() {
  if (holds_slot_) service_->ReleaseUpdateSlot();
  holds_slot_ = false;
}

void UpdateWeightsReactor::OnCancel() {
  // A read is always outstanding until the stream ends; OnReadDone(false) finishes the call.
  std::lock_guard<std::mutex> lock(mu_);
  cancelled_ = true;
}

void UpdateWeightsReactor::OnDone() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    ReleaseSlotLocked();
  }
  delete this;
}

}  // namespace rollout
