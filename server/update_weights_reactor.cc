#include "server/update_weights_reactor.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "glog/logging.h"
#include "server/status_util.h"
#include "server/weights_chunk_reader.h"

namespace rollout {

UpdateWeightsReactor::UpdateWeightsReactor(RolloutServiceImpl* service,
                                           grpc::CallbackServerContext* context,
                                           grpc::ByteBuffer* response, absl::Status admission)
    : service_(service),
      context_(context),
      response_bytes_(response),
      staging_(&service->engine()->weight_specs(), service->weights_arena()) {
  if (!admission.ok()) {
    FinishOnce(ToGrpcStatus(admission));
    return;
  }
  StartRead(&message_);
}

void UpdateWeightsReactor::OnReadDone(bool ok) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    // The update failed through another part (or the timeout): this call is finished.
    if (finished_) return;
  }
  if (!ok) {
    // The stream ended: by the client's half-close, or because the call failed (cancel,
    // deadline, disconnect). OnCancel or IsCancelled() tells the two apart when the failure is
    // known by now; one that is reported later is caught by the engine's check before the swap.
    if (Cancelled()) {
      Fail(absl::CancelledError(
          "the update stream was cancelled before the client half-closed it; nothing was "
          "applied"));
      return;
    }
    EndOfStream();
    return;
  }
  ++messages_read_;
  absl::Status status = HandleMessage();
  slices_.clear();
  message_.Clear();  // gRPC's receive buffers go back before the next read
  if (!status.ok()) {
    Fail(status);
    return;
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (!finished_) StartRead(&message_);
}

absl::Status UpdateWeightsReactor::HandleMessage() {
  {
    std::lock_guard<std::mutex> lock(stage_mu_);
    if (abandoned_) return absl::OkStatus();  // the assembly finishes the call
    TensorDataChunk chunk;
    slices_.clear();
    if (message_.Dump(&slices_).ok() && ReadTensorDataChunk(slices_, &chunk) &&
        staging_.declared(chunk.name)) {
      return staging_.AddData(
          chunk.name, chunk.offset, chunk.data_size, [this, &chunk](uint8_t* destination) {
            CopyMessageBytes(slices_, chunk.data_begin, chunk.data_size, destination);
          });
    }
  }
  // Anything else (a header, an undeclared name, an unusual encoding) as protobuf parses it.
  if (!grpc::SerializationTraits<v1::WeightsChunk>::Deserialize(&message_, &chunk_).ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("message ", messages_read_,
                     " of the stream is not a valid WeightsChunk (a client bug or "
                     "a corrupted stream)"));
  }
  if (chunk_.has_header()) return StartPart(chunk_.header());
  std::lock_guard<std::mutex> lock(stage_mu_);
  if (abandoned_) return absl::OkStatus();
  if (chunk_.has_data()) return staging_.AddData(chunk_.data());
  return absl::InvalidArgumentError("an empty WeightsChunk: set header or data");
}

absl::Status UpdateWeightsReactor::StartPart(const v1::WeightsHeader& header) {
  absl::Status checked;
  {
    std::lock_guard<std::mutex> lock(stage_mu_);
    if (abandoned_) return absl::OkStatus();
    checked = staging_.CheckHeader(header);
  }
  if (checked.ok()) checked = CheckPartFields(header);
  if (!checked.ok()) {
    // A second header fails this part's update (Fail); a first one refused on its own also fails
    // the multi-part update it names, so that its siblings hear at once, and that update counts
    // the failure.
    if (assembly() == nullptr && service_->FailUpdatePart(header, checked)) {
      count_failure_ = false;
    }
    return checked;
  }
  absl::StatusOr<std::shared_ptr<UpdateAssembly>> assembly = service_->JoinUpdate(header);
  if (!assembly.ok()) {
    // This call only, refused on another update's account (the slot is taken, or this part's
    // update ended, counted then): no update of its own failed.
    count_failure_ = false;
    return assembly.status();
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    assembly_ = *assembly;
  }
  bool joined = false;
  absl::StatusOr<const WeightsArena::Lease*> lease =
      (*assembly)->Join(header, this, start_, &joined);
  if (!joined) {
    std::lock_guard<std::mutex> lock(mu_);
    assembly_.reset();  // it ended before this part came: refused on its own
    count_failure_ = false;  // as that update's late part, counted when it ended
  }
  if (!lease.ok()) return lease.status();  // once joined, the failure finished every call
  std::lock_guard<std::mutex> lock(stage_mu_);
  if (!abandoned_) staging_.Bind(**lease);
  return absl::OkStatus();
}

void UpdateWeightsReactor::EndOfStream() {
  std::shared_ptr<UpdateAssembly> update = assembly();
  if (update == nullptr) {
    Fail(absl::InvalidArgumentError("the stream ended without a WeightsHeader"));
    return;
  }
  double digest_wait_seconds = 0;
  absl::StatusOr<WeightUpdate> part;
  uint64_t bytes = 0;
  {
    std::lock_guard<std::mutex> lock(stage_mu_);
    if (abandoned_) return;
    part = staging_.Finish(&digest_wait_seconds);
    bytes = staging_.bytes_received();
  }
  if (!part.ok()) {
    Fail(part.status());
    return;
  }
  update->PartReceived(*std::move(part), bytes, digest_wait_seconds);
}

void UpdateWeightsReactor::Fail(const absl::Status& status) {
  if (std::shared_ptr<UpdateAssembly> update = assembly()) {
    update->Fail(this, status);  // finishes every part's call, this one's too, and counts it
    return;
  }
  std::string message(status.message());
  if (message.find("nothing was applied") == std::string::npos) {
    absl::StrAppend(&message, "; nothing was applied");
  }
  LOG(WARNING) << "weight update stream failed: " << absl::StatusCodeToString(status.code()) << ": "
               << message;
  if (count_failure_ && service_->metrics() != nullptr) {
    service_->metrics()->RecordUpdate(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count(), false);
  }
  FinishOnce(ToGrpcStatus(absl::Status(status.code(), message)));
}

void UpdateWeightsReactor::OnCancel() {
  cancelled_ = true;
  // A part waiting for its siblings reads nothing more: only this tells it the client left.
  if (std::shared_ptr<UpdateAssembly> update = assembly()) {
    update->Fail(this, absl::CancelledError(
                           "the update stream was cancelled before the update was applied"));
  }
}

void UpdateWeightsReactor::AbandonStaging() {
  std::lock_guard<std::mutex> lock(stage_mu_);
  abandoned_ = true;
  staging_.Abandon();
}

void UpdateWeightsReactor::FinishPart(const grpc::Status& status,
                                      const grpc::ByteBuffer* response) {
  if (response != nullptr) *response_bytes_ = *response;
  FinishOnce(status);
}

void UpdateWeightsReactor::FinishOnce(const grpc::Status& status) {
  {
    // A part that never joined gives its staging back here (it holds no arena): idempotent.
    std::lock_guard<std::mutex> lock(stage_mu_);
    abandoned_ = true;
    staging_.Abandon();
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (finished_) return;
  finished_ = true;
  Finish(status);
}

void UpdateWeightsReactor::OnDone() {
  {
    // The assembly (if still alive) no longer calls this part: it finished it.
    std::lock_guard<std::mutex> lock(mu_);
    assembly_.reset();
  }
  delete this;
}

}  // namespace rollout
