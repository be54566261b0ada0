#pragma once

#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "rollout/v1/rollout.grpc.pb.h"
#include "server/rollout_service.h"
#include "server/stream_shaper.h"

namespace rollout {

// One Generate call. Validates and submits in its constructor; the engine's delivery thread
// then hands it events, which it turns into messages as the request's StreamOptions ask
// (StreamShaper), queues and writes one at a time (a message lives in the queue
// until its OnWriteDone). Finishes exactly once: OK after the last completion is written, the
// validation error, or CANCELLED. A cancelled or broken call aborts its samples, freeing their
// KV blocks. Deletes itself in OnDone.
class GenerateReactor final : public grpc::ServerWriteReactor<v1::GenerateResponse> {
 public:
  // `access`: the caller's access check; a failure finishes the call at once.
  GenerateReactor(RolloutServiceImpl* service, const v1::GenerateRequest* request,
                  const absl::Status& access);

  void OnWriteDone(bool ok) override;
  void OnCancel() override;
  void OnDone() override;

 private:
  // What the engine's delivery thread and gRPC's threads share, owned jointly by the reactor
  // and the engine's event sink so that a late event after OnDone finds it alive.
  struct Stream {
    std::mutex mu;
    GenerateReactor* reactor = nullptr;      // null once OnDone ran
    std::deque<v1::GenerateResponse> queue;  // front() is being written while `writing`
    bool writing = false;
    bool finished = false;  // Finish has been called
    bool cancelled = false;
    size_t completions_left = 0;
    std::optional<StreamShaper> shaper;  // set once the request is valid
  };

  void OnEvents(std::vector<SampleEvent> events);
  // REQUIRES: stream_->mu held, no write in flight.
  void FinishLocked(const grpc::Status& status);

  RolloutServiceImpl* const service_;
  std::shared_ptr<Stream> stream_;
  std::vector<std::string> request_ids_;  // per rollout; released in OnDone
  uint64_t job_id_ = 0;
  bool submitted_ = false;
};

}  // namespace rollout
