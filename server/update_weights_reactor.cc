#include "server/update_weights_reactor.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "glog/logging.h"
#include "server/status_util.h"
#include "server/weights_chunk_reader.h"

namespace rollout {
namespace {

double SecondsSince(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

}  // namespace

UpdateWeightsReactor::UpdateWeightsReactor(RolloutServiceImpl* service,
                                           grpc::CallbackServerContext* context,
                                           grpc::ByteBuffer* response, absl::Status admission)
    : service_(service),
      context_(context),
      response_bytes_(response),
      staging_(&service->engine()->weight_specs(), service->weights_arena()),
      holds_slot_(admission.ok()) {
  if (!admission.ok()) {
    FinishOnce(ToGrpcStatus(admission));
    return;
  }
  StartRead(&message_);
}

void UpdateWeightsReactor::OnReadDone(bool ok) {
  if (!ok) {
    // The stream ended: by the client's half-close, or because the call failed (cancel,
    // deadline, disconnect). OnCancel or IsCancelled() tells the two apart when the failure is
    // known by now; one that is reported later is caught by the engine's check before the swap
    // (the predicate below).
    if (Cancelled()) {
      FinishOnce(grpc::Status(grpc::StatusCode::CANCELLED,
                              "the update stream was cancelled before the client half-closed "
                              "it; nothing was applied"));
      return;
    }
    Submit();
    return;
  }
  ++messages_read_;
  absl::Status status;
  TensorDataChunk chunk;
  slices_.clear();
  if (message_.Dump(&slices_).ok() && ReadTensorDataChunk(slices_, &chunk) &&
      staging_.declared(chunk.name)) {
    status = staging_.AddData(
        chunk.name, chunk.offset, chunk.data_size, [this, &chunk](uint8_t* destination) {
          CopyMessageBytes(slices_, chunk.data_begin, chunk.data_size, destination);
        });
  } else {
    // Anything else (a header, an undeclared name, an unusual encoding) as protobuf parses it.
    status = ParseAndStage();
  }
  slices_.clear();
  message_.Clear();  // gRPC's receive buffers go back before the next read
  if (!status.ok()) {
    FinishOnce(ToGrpcStatus(
        absl::Status(status.code(), absl::StrCat(status.message(), "; nothing was applied"))));
    return;
  }
  StartRead(&message_);
}

absl::Status UpdateWeightsReactor::ParseAndStage() {
  if (!grpc::SerializationTraits<v1::WeightsChunk>::Deserialize(&message_, &chunk_).ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("message ", messages_read_,
                     " of the stream is not a valid WeightsChunk (a client bug or "
                     "a corrupted stream)"));
  }
  if (chunk_.has_header()) return staging_.SetHeader(chunk_.header());
  if (chunk_.has_data()) return staging_.AddData(chunk_.data());
  return absl::InvalidArgumentError("an empty WeightsChunk: set header or data");
}

void UpdateWeightsReactor::Submit() {
  response_.set_receive_seconds(SecondsSince(start_));
  response_.set_staging_setup_seconds(staging_.setup_seconds());
  double digest_wait_seconds = 0;
  absl::StatusOr<WeightUpdate> update = staging_.Finish(&digest_wait_seconds);
  if (!update.ok()) {
    FinishOnce(ToGrpcStatus(update.status()));
    return;
  }
  response_.set_digest_wait_seconds(digest_wait_seconds);
  response_.set_version(update->version);
  response_.set_tensors_updated(static_cast<uint32_t>(update->tensors.size()));
  response_.set_bytes_received(staging_.bytes_received());
  const auto swap_start = std::chrono::steady_clock::now();
  // The reactor (and so the context) lives until Finish, which only the engine's answer calls
  // from here on; both callbacks run on the engine thread.
  service_->engine()->UpdateWeights(
      *std::move(update),
      [this, swap_start](UpdateResult r) {
        response_.set_previous_version(r.previous_version);
        response_.set_weight_digest(r.digest);
        response_.set_aborted_samples(static_cast<uint32_t>(r.aborted_samples));
        response_.set_swap_seconds(SecondsSince(swap_start));
        response_.set_engine_wait_seconds(r.wait_seconds);
        response_.set_device_copy_seconds(r.copy_seconds);
        if (service_->metrics() != nullptr) {
          service_->metrics()->RecordUpdate(SecondsSince(start_), r.status.ok());
        }
        if (r.status.ok()) {
          grpc::Slice bytes(response_.SerializeAsString());
          *response_bytes_ = grpc::ByteBuffer(&bytes, 1);
        }
        FinishOnce(ToGrpcStatus(r.status));
      },
      [this] { return Cancelled(); });
}

void UpdateWeightsReactor::FinishOnce(const grpc::Status& status) {
  std::lock_guard<std::mutex> lock(mu_);
  if (finished_) return;
  finished_ = true;
  // The staging arena goes back with the slot (once its hashing stopped): a caller retrying at
  // once finds both free. After a hand-over to the engine it holds nothing any more.
  staging_.Abandon();
  if (!status.ok()) {
    LOG(WARNING) << "weight update stream failed: "
                 << absl::StatusCodeToString(static_cast<absl::StatusCode>(status.error_code()))
                 << ": " << status.error_message();
  }
  ReleaseSlotLocked();
  Finish(status);
}

void UpdateWeightsReactor::ReleaseSlotLocked() {
  if (holds_slot_) service_->ReleaseUpdateSlot();
  holds_slot_ = false;
}

void UpdateWeightsReactor::OnDone() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    ReleaseSlotLocked();
  }
  delete this;
}

}  // namespace rollout
