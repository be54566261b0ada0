#pragma once

#include <chrono>
#include <mutex>

#include "rollout/v1/rollout.grpc.pb.h"
#include "server/rollout_service.h"
#include "server/weights_staging.h"

namespace rollout {

// One UpdateWeights stream: stages the chunks in host memory as they arrive (validating each),
// and once the client has sent everything hands the complete update to the engine, which swaps
// it in between two steps. Any error finishes the call at once with nothing applied. Holds the
// service's single update slot until it finishes. Deletes itself in OnDone.
class UpdateWeightsReactor final : public grpc::ServerReadReactor<v1::WeightsChunk> {
 public:
  // `admission`: the access check and the update-slot claim; a failure finishes at once.
  UpdateWeightsReactor(RolloutServiceImpl* service, v1::UpdateWeightsResponse* response,
                       absl::Status admission);

  void OnReadDone(bool ok) override;
  void OnCancel() override;
  void OnDone() override;

 private:
  void FinishOnce(const grpc::Status& status);
  void Submit();

  RolloutServiceImpl* const service_;
  v1::UpdateWeightsResponse* const response_;
  void ReleaseSlotLocked();  // before Finish, so the caller's next update is not refused

  bool holds_slot_;  // guarded by mu_ after construction
  const std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
  WeightsStaging staging_;
  v1::WeightsChunk chunk_;
  std::mutex mu_;
  bool finished_ = false;   // guarded by mu_
  bool cancelled_ = false;  // guarded by mu_
};

}  // namespace rollout
