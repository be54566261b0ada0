#pragma once

#include <memory>
#include <mutex>
#include <vector>

#include "rollout/v1/rollout.grpc.pb.h"
#include "server/rollout_service.h"

namespace rollout {

// One Score call: validates, submits every sequence as a scoring job, and finishes once the
// engine has reported all of them (or with CANCELLED if the client goes away, aborting the
// job). Finishes exactly once; deletes itself in OnDone.
class ScoreReactor final : public grpc::ServerUnaryReactor {
 public:
  ScoreReactor(RolloutServiceImpl* service, const v1::ScoreRequest* request,
               v1::ScoreResponse* response);

  void OnCancel() override;
  void OnDone() override;

 private:
  struct State {
    std::mutex mu;
    ScoreReactor* reactor = nullptr;  // null once OnDone ran
    v1::ScoreResponse* response = nullptr;
    size_t left = 0;
    bool finished = false;
  };
  void OnEvents(std::vector<SampleEvent> events);  // with state_->mu held
  void FinishLocked(const grpc::Status& status);

  RolloutServiceImpl* const service_;
  std::shared_ptr<State> state_;
  uint64_t job_id_ = 0;
  bool submitted_ = false;
};

}  // namespace rollout
