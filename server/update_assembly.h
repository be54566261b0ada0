#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/engine.h"
#include "grpcpp/alarm.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/status.h"
#include "rollout/v1/rollout.pb.h"
#include "server/weights_arena.h"

namespace rollout {

class RolloutServiceImpl;

// What an UpdateAssembly asks of one part's call (UpdateWeightsReactor), from any thread.
// AbandonStaging and FinishPart are called at most once each, never under the assembly's lock.
class UpdatePart {
 public:
  virtual ~UpdatePart() = default;
  // Stops writing into the staging and hashing it, at once (waits only for the chunk being
  // copied and the runs being hashed): the arena may be reused when this returns.
  virtual void AbandonStaging() = 0;
  // Finishes the call with `status`; `response` (on OK) is the serialized UpdateWeightsResponse.
  virtual void FinishPart(const grpc::Status& status, const grpc::ByteBuffer* response) = 0;
  // The call was cancelled (or disconnected, or past its deadline). Thread-safe.
  virtual bool Cancelled() const = 0;
};

// The fields of `header` that place its stream in an update (part_count, part_index,
// update_id), on their own: INVALID_ARGUMENT naming the field. The assembly checks them against
// its other parts.
absl::Status CheckPartFields(const v1::WeightsHeader& header);

// One weight update staged by one or more concurrent UpdateWeights calls (its parts; docs/api.md,
// "One update over several streams"): it holds the service's update slot and the staging
// arena's lease for all of them, checks each part's header against the others (the same
// version, policy and part_count, each index once, disjoint tensors), and once every part has
// received its bytes hands one WeightUpdate (every part's tensors and digests) to the engine,
// whose answer finishes every call with the same response. If a part fails, is cancelled, or the
// parts do not all arrive within the part timeout of the first, the whole update fails: every
// part stops staging, the arena and the slot are given back, then every call finishes with the
// same status, and nothing is applied. A single-stream update is an assembly of one part.
// Created by RolloutServiceImpl::JoinUpdate; thread-safe (the parts' reactions, the alarm and
// the engine thread call it). The parts it knows outlive it or finish through it: a part that
// joined is finished by the assembly only.
class UpdateAssembly : public std::enable_shared_from_this<UpdateAssembly> {
 public:
  // `update_id` is "" for a single stream; `part_count` >= 1. Holds the service's update slot,
  // claimed by the caller, until it ends.
  UpdateAssembly(RolloutServiceImpl* service, std::string update_id, uint32_t part_count);
  ~UpdateAssembly();
  UpdateAssembly(const UpdateAssembly&) = delete;
  UpdateAssembly& operator=(const UpdateAssembly&) = delete;

  // Fails the update unless every part has joined within `timeout` from now.
  void ArmPartTimeout(std::chrono::milliseconds timeout);

  // Adds `part`, whose header passed WeightsStaging::CheckHeader, started at `start`. Checks it
  // against the parts so far; the first part's call takes the arena (allocated by the first
  // update: *setup_seconds). The lease returned is borrowed: valid until the part is told to
  // AbandonStaging, or the update is handed to the engine. On error the whole update has failed
  // (every part joined so far, `part` included, is finished with the returned status).
  // *joined says whether the part was taken in (then only the assembly finishes it); it is not
  // once the update has ended.
  absl::StatusOr<const WeightsArena::Lease*> Join(const v1::WeightsHeader& header, UpdatePart* part,
                                                  std::chrono::steady_clock::time_point start,
                                                  bool* joined);
  // A part's stream ended cleanly and its tensors are staged and hashed (`update`: its tensors
  // and digests; digest_wait_seconds: the hashing it waited for). Once every part arrived the
  // update goes to the engine.
  void PartReceived(WeightUpdate update, uint64_t bytes_received, double digest_wait_seconds);
  // Fails the whole update with `status` (a message naming the failing part is added for the
  // siblings), and counts it once as a failed update in the service's metrics. A no-op once the
  // update has failed or been handed to the engine (the engine then asks Cancelled() right
  // before the swap; its answer is counted).
  void Fail(UpdatePart* part, const absl::Status& status);

  const std::string& update_id() const { return update_id_; }
  uint32_t part_count() const { return part_count_; }
  // For a refusal message: how many parts joined so far.
  uint32_t parts_joined() const;

 private:
  enum class State { kAssembling, kSubmitted, kEnded };
  // Stage 2 of Fail and of the engine's answer: REQUIRES mu_ not held; `parts` taken from
  // parts_ when the state left kAssembling.
  void End(const std::vector<std::pair<UpdatePart*, uint32_t>>& parts, const grpc::Status& status,
           const grpc::ByteBuffer* response, bool abandon);
  void Submit();  // REQUIRES: mu_ not held; every part received
  bool AnyPartCancelled() const;

  // Constant after construction.
  RolloutServiceImpl* const service_;
  const std::string update_id_;
  const uint32_t part_count_;
  std::unique_ptr<grpc::Alarm> part_timeout_;  // set once, before another thread sees it

  mutable std::mutex mu_;
  State state_ = State::kAssembling;  // guarded by mu_
  absl::Status failure_;              // guarded by mu_: why it failed, once it did
  // Guarded by mu_.
  std::vector<std::pair<UpdatePart*, uint32_t>> parts_;  // joined, with their index
  std::set<uint32_t> indices_;
  std::set<std::string, std::less<>> tensor_names_;  // declared by the parts so far
  bool has_first_ = false;
  std::string version_;
  v1::InFlightPolicy policy_ = v1::IN_FLIGHT_POLICY_UNSPECIFIED;
  std::shared_ptr<WeightsArena::Lease> lease_;  // from the first Join to Submit or the end
  bool lease_failed_ = false;
  double setup_seconds_ = 0;
  std::chrono::steady_clock::time_point start_;  // the earliest part's
  uint32_t received_ = 0;
  uint64_t bytes_received_ = 0;
  double digest_wait_seconds_ = 0;  // the longest part's
  WeightUpdate update_;             // every received part's tensors and digests
};

}  // namespace rollout
