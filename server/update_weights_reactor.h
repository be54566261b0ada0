#pragma once

#include <atomic>
#include <chrono>
#include <mutex>
#include <vector>

#include "grpcpp/support/byte_buffer.h"
#include "rollout/v1/rollout.grpc.pb.h"
#include "server/rollout_service.h"
#include "server/weights_staging.h"

namespace rollout {

// One UpdateWeights stream: stages the chunks in host memory as they arrive (validating each),
// and once the client has half-closed the stream hands the complete update to the engine, which
// swaps it in between two steps. Any error, a message that does not parse, or a cancellation
// finishes the call with nothing applied. Holds the service's single update slot until it
// finishes. Deletes itself in OnDone.
//
// Messages arrive as raw bytes and are parsed here: on a typed stream gRPC reports a message it
// cannot parse exactly as it reports the client's half-close (OnReadDone(false)), and only the
// half-close may apply an update. A data chunk's bytes are copied once, from gRPC's buffers to
// their staging place (ReadTensorDataChunk); anything else goes through protobuf.
//
// When an update is applied: after a clean half-close, and only if the call is still not
// cancelled when the engine is about to swap (asked on the engine thread, right before). A
// cancel that reaches the server after the swap cannot undo it: the server answers OK, yet the
// client may see CANCELLED; GetServerInfo's weight_version tells which weights serve.
class UpdateWeightsReactor final : public grpc::ServerReadReactor<grpc::ByteBuffer> {
 public:
  // `context` and `response` are the call's, valid until OnDone. `admission`: the access check
  // and the update-slot claim; a failure finishes at once.
  UpdateWeightsReactor(RolloutServiceImpl* service, grpc::CallbackServerContext* context,
                       grpc::ByteBuffer* response, absl::Status admission);

  void OnReadDone(bool ok) override;
  void OnDone() override;
  // A cancel (or deadline, or disconnect) may be reported here before, after or instead of
  // IsCancelled() turning true; both are checked.
  void OnCancel() override { cancelled_ = true; }

 private:
  void FinishOnce(const grpc::Status& status);
  // Staged update to the engine; from here on only the engine's answer finishes the call.
  void Submit();
  void ReleaseSlotLocked();  // before Finish, so the caller's next update is not refused
  bool Cancelled() const { return cancelled_ || context_->IsCancelled(); }

  // Constant after construction.
  RolloutServiceImpl* const service_;
  grpc::CallbackServerContext* const context_;
  grpc::ByteBuffer* const response_bytes_;
  const std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
  std::atomic<bool> cancelled_{false};  // OnCancel ran

  // A message that ReadTensorDataChunk leaves to protobuf, parsed into chunk_.
  absl::Status ParseAndStage();

  // Touched by one reaction at a time (each read's OnReadDone, then the engine's answer).
  WeightsStaging staging_;
  grpc::ByteBuffer message_;         // the read in flight
  std::vector<grpc::Slice> slices_;  // message_'s, while it is staged
  v1::WeightsChunk chunk_;
  uint64_t messages_read_ = 0;
  v1::UpdateWeightsResponse response_;

  std::mutex mu_;
  bool holds_slot_;        // guarded by mu_ after construction
  bool finished_ = false;  // guarded by mu_
};

}  // namespace rollout
