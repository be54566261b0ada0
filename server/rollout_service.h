#pragma once

#include <atomic>
#include <chrono>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "common/serial_executor.h"
#include "engine/engine.h"
#include "rollout/v1/rollout.grpc.pb.h"
#include "runner/backend.h"
#include "server/metrics.h"
#include "server/update_assembly.h"
#include "server/weights_arena.h"

namespace rollout {

// Facts about the served model that the engine does not know.
struct ServedModel {
  std::string source;           // checkpoint directory
  int32_t tensor_parallel = 1;  // ranks the runner splits the model over (ServerInfo reports it)
  BackendNumerics numerics;     // the backend's part of ServerInfo.numerics
};

// Who may call what. With a token, control RPCs (UpdateWeights*, Pause, Resume, Abort,
// FlushCache, ReleaseMemory, ResumeMemory, Join/LeaveWeightSyncGroup) need "authorization:
// Bearer <token>" metadata; with `all_rpcs`, every RPC does.
struct AccessPolicy {
  std::string bearer_token;  // empty: no authentication
  bool all_rpcs = false;
};

// What one Generate stream may hold for a client that reads slower than the samples come.
struct StreamLimits {
  // In-memory bytes of the messages queued for the client (protobuf's SpaceUsedLong) at which
  // the stream's samples pause (Engine::PauseJob); they resume once it is down to half.
  int64_t max_buffered_bytes = int64_t{16} << 20;
  // A paused stream whose client reads nothing this long ends: its samples are aborted and the
  // call finishes RESOURCE_EXHAUSTED naming the bound, after what was queued.
  std::chrono::milliseconds max_paused{60'000};
};

// How long the parts of a multi-part UpdateWeights may take to arrive.
struct UpdateLimits {
  // From the first part's header to the last part's: the update fails (DEADLINE_EXCEEDED on
  // every part's call) unless every part has joined by then.
  std::chrono::milliseconds part_timeout{60'000};
};

// Whose request ids a call claims and Abort reaches. With a token and `all_rpcs` off, Generate
// calls that do not carry the token are kAnonymous: their ids are a namespace apart from those
// of callers that do (kTrusted), so they can neither probe (ALREADY_EXISTS), take nor have a
// trainer's Abort end ids of the other kind. Without a token every caller is kTrusted.
enum class CallerScope { kTrusted, kAnonymous };

// The RolloutService over one engine, on gRPC's callback API: every handler returns at once;
// work happens on the engine thread and results are written by reactors. Thread-safe.
// UpdateWeights is served on raw bytes (see UpdateWeightsReactor for why); the wire format is
// the proto's.
class RolloutServiceImpl final : public v1::RolloutService::WithRawCallbackMethod_UpdateWeights<
                                     v1::RolloutService::CallbackService> {
 public:
  // `engine` is borrowed and must outlive the service and every call it started.
  // `metrics` (optional) is borrowed. `max_unfinished_samples` bounds the queue: Generate and
  // Score answer RESOURCE_EXHAUSTED beyond it. `stream_limits` bound each Generate stream's buffer.
  RolloutServiceImpl(Engine* engine, ServedModel model, AccessPolicy access = {},
                     ServiceMetrics* metrics = nullptr, int64_t max_unfinished_samples = 1 << 20,
                     StreamLimits stream_limits = {}, UpdateLimits update_limits = {});
  ~RolloutServiceImpl() override;

  grpc::ServerWriteReactor<v1::GenerateResponse>* Generate(
      grpc::CallbackServerContext* context, const v1::GenerateRequest* request) override;
  grpc::ServerUnaryReactor* GetServerInfo(grpc::CallbackServerContext* context,
                                          const v1::GetServerInfoRequest* request,
                                          v1::ServerInfo* response) override;
  grpc::ServerUnaryReactor* Score(grpc::CallbackServerContext* context,
                                  const v1::ScoreRequest* request,
                                  v1::ScoreResponse* response) override;
  grpc::ServerUnaryReactor* Abort(grpc::CallbackServerContext* context,
                                  const v1::AbortRequest* request,
                                  v1::AbortResponse* response) override;
  grpc::ServerUnaryReactor* FlushCache(grpc::CallbackServerContext* context,
                                       const v1::FlushCacheRequest* request,
                                       v1::FlushCacheResponse* response) override;
  // Reads WeightsChunk messages, answers an UpdateWeightsResponse.
  grpc::ServerReadReactor<grpc::ByteBuffer>* UpdateWeights(grpc::CallbackServerContext* context,
                                                           grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* UpdateWeightsFromPath(grpc::CallbackServerContext* context,
                                                  const v1::UpdateWeightsFromPathRequest* request,
                                                  v1::UpdateWeightsResponse* response) override;
  // Defined in server/ipc_update.cc.
  grpc::ServerUnaryReactor* UpdateWeightsFromIpc(grpc::CallbackServerContext* context,
                                                 const v1::UpdateWeightsFromIpcRequest* request,
                                                 v1::UpdateWeightsResponse* response) override;
  // Fleets (NCCL weight-sync groups); defined in server/broadcast_update.cc.
  grpc::ServerUnaryReactor* JoinWeightSyncGroup(grpc::CallbackServerContext* context,
                                                const v1::JoinWeightSyncGroupRequest* request,
                                                v1::JoinWeightSyncGroupResponse* response) override;
  grpc::ServerUnaryReactor* LeaveWeightSyncGroup(
      grpc::CallbackServerContext* context, const v1::LeaveWeightSyncGroupRequest* request,
      v1::LeaveWeightSyncGroupResponse* response) override;
  grpc::ServerUnaryReactor* UpdateWeightsFromBroadcast(
      grpc::CallbackServerContext* context, const v1::UpdateWeightsFromBroadcastRequest* request,
      v1::UpdateWeightsResponse* response) override;
  grpc::ServerUnaryReactor* Pause(grpc::CallbackServerContext* context,
                                  const v1::PauseRequest* request,
                                  v1::PauseResponse* response) override;
  grpc::ServerUnaryReactor* Resume(grpc::CallbackServerContext* context,
                                   const v1::ResumeRequest* request,
                                   v1::ResumeResponse* response) override;
  // Colocated memory (Engine::ReleaseMemory / ResumeMemory); answered between two engine steps.
  grpc::ServerUnaryReactor* ReleaseMemory(grpc::CallbackServerContext* context,
                                          const v1::ReleaseMemoryRequest* request,
                                          v1::ReleaseMemoryResponse* response) override;
  grpc::ServerUnaryReactor* ResumeMemory(grpc::CallbackServerContext* context,
                                         const v1::ResumeMemoryRequest* request,
                                         v1::ResumeMemoryResponse* response) override;

  // UNAUTHENTICATED unless the call carries the bearer token the policy asks for (for control
  // RPCs, and for every RPC with all_rpcs); else whose ids the call may use.
  absl::StatusOr<CallerScope> Authenticate(const grpc::CallbackServerContext* context,
                                           bool control) const;
  absl::Status CheckAccess(const grpc::CallbackServerContext* context, bool control) const;
  // Takes the single weight-update slot; ABORTED if another update holds it.
  absl::Status ClaimUpdateSlot();
  void ReleaseUpdateSlot();
  // The UpdateWeights update that `header` starts (claiming the update slot), or the multi-part
  // one it is a part of (the same update_id as the one assembling). This call alone is refused,
  // always on another update's account: ABORTED while another update holds the slot; for the
  // update_id of one that ended recently, that update's outcome.
  // REQUIRES: CheckPartFields(header).ok().
  absl::StatusOr<std::shared_ptr<UpdateAssembly>> JoinUpdate(const v1::WeightsHeader& header);
  // A part whose header was refused before it joined (`status`): fails the multi-part update it
  // names, now, or when its siblings come. Returns whether the header named one (part fields
  // valid, part_count > 1); that update then counts the failure in the metrics, once.
  bool FailUpdatePart(const v1::WeightsHeader& header, const absl::Status& status);
  // `assembly` ended with `code` and `message`: the slot is free; its update_id is remembered.
  void EndUpdate(const UpdateAssembly* assembly, absl::StatusCode code,
                 const std::string& message);

  // Submits a Generate call's samples as one engine job and records its rollouts' request ids
  // in the caller's scope (request_ids[i] belongs to rollout i; empty ids are not tracked).
  // ALREADY_EXISTS, with nothing submitted, if an id is in flight already in that scope;
  // UNAVAILABLE once admission stopped; RESOURCE_EXHAUSTED beyond max_unfinished_samples.
  // REQUIRES: `samples` passed Engine::Validate (ToSampleSpecs does it).
  absl::StatusOr<uint64_t> StartGenerate(CallerScope caller,
                                         const std::vector<std::string>& request_ids,
                                         std::vector<SampleSpec> samples, EventSink sink);
  // Forgets a finished call's job and request ids.
  void EndGenerate(CallerScope caller, uint64_t job_id,
                   const std::vector<std::string>& request_ids);
  // Of a Generate call's job, the samples that ended (its events with a completion): a rollout
  // whose samples all ended leaves Abort's reach, and its request id is free again, while the
  // call's other rollouts run on.
  void EndSamples(uint64_t job_id, const std::vector<SampleEvent>& events);
  // Submits a Score call's sequences as one engine job, within the same limits as Generate.
  // REQUIRES: `samples` passed Engine::Validate (ToScoreSpecs does it).
  absl::StatusOr<uint64_t> StartScore(std::vector<SampleSpec> samples, EventSink sink);
  // A Score call's job (StartScore's) ended, whatever its outcome: an Abort of all no longer
  // counts it.
  void EndScore(uint64_t job_id);

  // From now on Generate and Score answer UNAVAILABLE (shutdown); running calls go on.
  void StopAdmission();
  // UNAVAILABLE once admission stopped.
  absl::Status CheckAdmission() const;

  Engine* engine() const { return engine_; }
  // Where every update is staged (UpdateWeights, UpdateWeightsFromPath): one at a time, as the
  // update slot admits.
  WeightsArena* weights_arena() { return &weights_arena_; }
  ServiceMetrics* metrics() const { return metrics_; }
  const StreamLimits& stream_limits() const { return stream_limits_; }

 private:
  struct InFlight {
    uint64_t job_id;
    int32_t rollout_index;
  };
  // A Generate call's job: per rollout, its request id and how many of its samples run (0: the
  // rollout ended, or Abort named it).
  struct InFlightJob {
    CallerScope caller;
    std::vector<std::string> request_ids;
    std::vector<uint32_t> samples_left;
  };
  // Rollout `rollout` of `job` (job id `job_id`) ended: it no longer counts, and its id is
  // forgotten. REQUIRES: mu_ held.
  void EndRolloutLocked(uint64_t job_id, InFlightJob* job, int32_t rollout);

  // UNAVAILABLE once admission stopped, RESOURCE_EXHAUSTED when `num_samples` more would pass
  // max_unfinished_samples_. REQUIRES: mu_ held (so that checks and submissions are ordered).
  absl::Status CheckQueueLocked(size_t num_samples) const;

  Engine* const engine_;
  const ServedModel model_;
  const AccessPolicy access_;
  ServiceMetrics* const metrics_;
  const int64_t max_unfinished_samples_;
  const StreamLimits stream_limits_;
  std::atomic<bool> admitting_{true};
  WeightsArena weights_arena_;
  // Reads UpdateWeightsFromPath checkpoints off gRPC's threads; the destructor joins it first.
  std::unique_ptr<SerialExecutor> loader_;
  const UpdateLimits update_limits_;
  std::mutex mu_;
  bool update_in_progress_ = false;  // guarded by mu_
  // Guarded by mu_: the UpdateWeights update holding the slot (if it is one), and the outcome of
  // the multi-part updates that ended last (by update_id, oldest first), so that a late part of
  // one is refused instead of starting a new update that waits for siblings in vain.
  std::shared_ptr<UpdateAssembly> assembly_;
  std::deque<std::pair<std::string, absl::Status>> ended_updates_;
  // Guarded by mu_.
  std::map<std::pair<CallerScope, std::string>, InFlight> in_flight_ids_;
  std::map<uint64_t, InFlightJob> in_flight_jobs_;
  std::set<uint64_t> in_flight_scores_;  // Score calls' jobs (AbortResponse.aborted_score_calls)
};

}  // namespace rollout
