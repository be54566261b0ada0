#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "grpcpp/alarm.h"
#include "rollout/v1/rollout.grpc.pb.h"
#include "server/rollout_service.h"
#include "server/stream_shaper.h"

namespace rollout {

// One Generate call. Validates and submits in its constructor; the engine's delivery thread
// then hands it events, which it turns into messages as the request's StreamOptions ask
// (StreamShaper), queues and writes one at a time (a message lives in the queue until its
// OnWriteDone). Finishes exactly once: OK after the last completion is written, the validation
// error, CANCELLED, or RESOURCE_EXHAUSTED for a client that stopped reading. A cancelled or
// broken call aborts its samples, freeing their KV blocks. Deletes itself in OnDone.
//
// Backpressure: a write completes only as the client reads, so a client slower than its samples
// makes the queue grow. Past StreamLimits::max_buffered_bytes the job is paused in the engine
// (its samples wait, keeping their KV and their bits) and resumed once the queue is down to
// half; a paused stream whose client reads nothing for StreamLimits::max_paused ends
// RESOURCE_EXHAUSTED: its samples are aborted, and the status follows what was queued (dropped,
// but for the message in flight, if the client reads nothing for another max_paused).
class GenerateReactor final : public grpc::ServerWriteReactor<v1::GenerateResponse> {
 public:
  // `caller`: the caller's access check (a failure finishes the call at once) and whose
  // request ids it uses.
  GenerateReactor(RolloutServiceImpl* service, const v1::GenerateRequest* request,
                  const absl::StatusOr<CallerScope>& caller);

  void OnWriteDone(bool ok) override;
  void OnCancel() override;
  void OnDone() override;

 private:
  // What the engine's delivery thread and gRPC's threads share, owned jointly by the reactor
  // and the engine's event sink so that a late event after OnDone finds it alive.
  struct Queued {
    v1::GenerateResponse message;
    int64_t bytes;  // message.SpaceUsedLong() when queued
  };
  struct Stream {
    std::mutex mu;
    GenerateReactor* reactor = nullptr;  // null once OnDone ran
    std::deque<Queued> queue;            // front() is being written while `writing`
    int64_t queued_bytes = 0;            // sum of queue[i].bytes
    bool writing = false;
    bool finished = false;  // Finish has been called
    bool cancelled = false;
    // Set when the client stalled: the status to finish with once the queue is written.
    std::optional<grpc::Status> stalled;
    bool paused = false;  // the job is paused in the engine
    uint64_t alarms = 0;  // stall alarms armed; names the one that counts (the latest)
    // When the client last read (a write completed), or the pause began.
    std::chrono::steady_clock::time_point last_read;
    size_t completions_left = 0;
    std::optional<StreamShaper> shaper;  // set once the request is valid
  };

  void OnEvents(std::vector<SampleEvent> events);
  // Pauses the job when the queue passed the bound, resumes it once it is down to half.
  // REQUIRES: stream_->mu held.
  void ApplyBackpressure();
  // Arms the stall alarm anew, to ring `after` from now. REQUIRES: stream_->mu held.
  void ArmStallAlarmLocked(std::chrono::steady_clock::duration after);
  // Stall alarm number `alarm` rang (on a gRPC thread): a paused stream whose client read
  // nothing for StreamLimits::max_paused ends stalled, a stalled one drops its queue; one that
  // read since is given the rest of the timeout from its last read.
  static void OnStallAlarm(const std::shared_ptr<Stream>& stream, uint64_t alarm);
  // Ends a stalled stream: aborts its samples and finishes once what is queued is written.
  // REQUIRES: stream_->mu held.
  void EndStalledLocked();
  // REQUIRES: stream_->mu held, no write in flight.
  void FinishLocked(const grpc::Status& status);

  RolloutServiceImpl* const service_;
  std::shared_ptr<Stream> stream_;
  CallerScope caller_ = CallerScope::kTrusted;
  std::vector<std::string> request_ids_;  // per rollout, in caller_'s scope; released in OnDone
  uint64_t job_id_ = 0;
  bool submitted_ = false;
  // The stall alarm of the current pause (a new one per pause, and while the client reads;
  // destroying one cancels it). Guarded by stream_->mu.
  std::unique_ptr<grpc::Alarm> stall_alarm_;
};

}  // namespace rollout
