#pragma once

// The engine's weight-sync thread (engine/weight_sync.h): joins and leaves the NCCL group and
// receives broadcasts into the runner's staging, so that the engine thread keeps stepping while
// the bytes arrive; a received broadcast becomes an update for the engine thread to swap in.
// Only the engine's own sources include this header.

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/serial_executor.h"
#include "engine/engine.h"
#include "engine/engine_internal.h"
#include "engine/weight_sync.h"

namespace rollout {
namespace engine_internal {

// Owned by Engine, after its EngineCore (destroyed first). Its public methods are thread-safe and
// return at once; the work runs on its thread, one call at a time, in call order.
class WeightSyncAgent {
 public:
  // `port`: the runner's (or why it has none, for every answer); `core` outlives the agent.
  WeightSyncAgent(absl::StatusOr<std::unique_ptr<WeightSyncPort>> port, EngineCore* core);
  // Makes every wait in progress give up (the group is left), runs what is queued (each gives up
  // at once), and joins the thread; then leaves the group.
  ~WeightSyncAgent();
  WeightSyncAgent(const WeightSyncAgent&) = delete;
  WeightSyncAgent& operator=(const WeightSyncAgent&) = delete;

  void Join(WeightSyncGroupSpec spec, std::function<void(JoinResult)> done, GiveUp give_up);
  void Leave(std::function<void(std::optional<WeightSyncGroupInfo>)> done);
  void Broadcast(absl::StatusOr<BroadcastUpdate> update, std::function<void(UpdateResult)> done,
                 std::function<bool()> cancelled);
  std::optional<WeightSyncGroupInfo> group() const;

 private:
  // Weight-sync thread: the broadcast's work (Broadcast posts it).
  void Receive(const absl::StatusOr<BroadcastUpdate>& update,
               std::function<void(UpdateResult)> done, std::function<bool()> cancelled);
  // Weight-sync thread: forgets a member whose communicator was aborted.
  void DropIfBroken();

  // Constant after construction.
  const absl::Status port_status_;  // OK when port_ is set
  const std::unique_ptr<WeightSyncPort> port_;
  EngineCore* const core_;

  std::atomic<bool> stopping_{false};  // set by the destructor: every wait gives up
  mutable std::mutex mu_;
  bool joining_ = false;                          // guarded by mu_
  std::optional<WeightSyncGroupInfo> published_;  // guarded by mu_: member_'s, for any thread
  std::unique_ptr<WeightSyncMember> member_;      // the weight-sync thread's
  std::unique_ptr<SerialExecutor> thread_;        // last: starts once the members above exist
};

}  // namespace engine_internal
}  // namespace rollout
