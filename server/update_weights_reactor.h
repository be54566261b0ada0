#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <vector>

#include "grpcpp/support/byte_buffer.h"
#include "rollout/v1/rollout.grpc.pb.h"
#include "server/rollout_service.h"
#include "server/update_assembly.h"
#include "server/weights_staging.h"

namespace rollout {

// One UpdateWeights stream: the whole update, or one part of a multi-part one (UpdateAssembly).
// Its header joins the update (claiming the service's single update slot for the first part),
// then it stages the chunks in host memory as they arrive (validating each); once the client has
// half-closed the stream its part is complete, and once every part is the assembly hands the
// update to the engine, which swaps it in between two steps. Any error, a message that does not
// parse, or a cancellation of any part finishes every part's call with nothing applied. Deletes
// itself in OnDone.
//
// Messages arrive as raw bytes and are parsed here: on a typed stream gRPC reports a message it
// cannot parse exactly as it reports the client's half-close (OnReadDone(false)), and only the
// half-close may complete a part. A data chunk's bytes are copied once, from gRPC's buffers to
// their staging place (ReadTensorDataChunk); anything else goes through protobuf.
//
// When an update is applied: after a clean half-close of every part, and only if none is
// cancelled when the engine is about to swap (asked on the engine thread, right before). A
// cancel that reaches the server after the swap cannot undo it: the server answers OK, yet the
// client may see CANCELLED; GetServerInfo's weight_version tells which weights serve.
//
// Threads: its own reactions run one at a time; the assembly may call AbandonStaging and
// FinishPart from another part's reaction, the part timeout's alarm or the engine thread.
// stage_mu_ orders AbandonStaging against the reaction writing into the staging.
class UpdateWeightsReactor final : public grpc::ServerReadReactor<grpc::ByteBuffer>,
                                   public UpdatePart {
 public:
  // `context` and `response` are the call's, valid until OnDone. `admission`: the access check;
  // a failure finishes at once.
  UpdateWeightsReactor(RolloutServiceImpl* service, grpc::CallbackServerContext* context,
                       grpc::ByteBuffer* response, absl::Status admission);

  void OnReadDone(bool ok) override;
  void OnDone() override;
  // A cancel (or deadline, or disconnect) may be reported here before, after or instead of
  // IsCancelled() turning true; both are checked. A part that has joined fails its update here.
  void OnCancel() override;

  // UpdatePart.
  void AbandonStaging() override;
  void FinishPart(const grpc::Status& status, const grpc::ByteBuffer* response) override;
  bool Cancelled() const override { return cancelled_ || context_->IsCancelled(); }

 private:
  // The message in message_: staged, or (a header) the part started. Not under stage_mu_.
  absl::Status HandleMessage();
  // A header: checked, then the update joined and the staging bound to its arena.
  absl::Status StartPart(const v1::WeightsHeader& header);
  // The client half-closed: this part is complete (or fails the update).
  void EndOfStream();
  // Fails this call, and the whole update once the part has joined one; counts the failed
  // update in the metrics once (ServiceMetrics::RecordUpdate).
  void Fail(const absl::Status& status);
  void FinishOnce(const grpc::Status& status);
  std::shared_ptr<UpdateAssembly> assembly() {
    std::lock_guard<std::mutex> lock(mu_);
    return assembly_;
  }

  // Constant after construction.
  RolloutServiceImpl* const service_;
  grpc::CallbackServerContext* const context_;
  grpc::ByteBuffer* const response_bytes_;
  const std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
  std::atomic<bool> cancelled_{false};  // OnCancel ran

  // Touched by one reaction at a time.
  grpc::ByteBuffer message_;         // the read in flight
  std::vector<grpc::Slice> slices_;  // message_'s, while it is staged
  v1::WeightsChunk chunk_;
  uint64_t messages_read_ = 0;
  // Whether a failure before this call joined an update counts as a failed update of its own
  // in the metrics: not when it was refused on another update's account, or when the
  // multi-part update its header names counts it.
  bool count_failure_ = true;

  std::mutex stage_mu_;     // held while the staging is written, hashed or given back
  WeightsStaging staging_;  // guarded by stage_mu_
  bool abandoned_ = false;  // guarded by stage_mu_: the update failed; staging_ is given back

  std::mutex mu_;
  std::shared_ptr<UpdateAssembly> assembly_;  // guarded by mu_: set by the header, once
  bool finished_ = false;                     // guarded by mu_
};

}  // namespace rollout
