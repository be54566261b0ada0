#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <iterator>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/admission_policy.h"
#include "engine/model_runner.h"
#include "engine/prefix_cache.h"
#include "engine/sampling_params.h"
#include "engine/sequence.h"
#include "engine/weight_sync.h"
#include "model/weight_digest.h"

namespace rollout {
namespace engine_internal {
class EngineCore;
class WeightSyncAgent;
}  // namespace engine_internal

struct EngineOptions {
  int32_t max_running_samples = 64;
  int32_t max_batch_tokens = 512;
  std::string weight_version = "0";
  // The served tensors' digests (model/weight_digest.h), as the server hashed them at load;
  // empty: the weights' digest is unknown ("") until an update brings every tensor's.
  TensorDigests weight_digests;
  bool prefix_cache = true;
  // When a waiting sample may start (engine/admission_policy.h). kEstimate, the default: when
  // the KV pool can hold what it may still need, a sample that may stop early charged an
  // estimate of its tokens to come; kReserve charges every sample all of max_new_tokens.
  AdmissionPolicy admission = AdmissionPolicy::kEstimate;
  // Launch decode step N + 1 before step N's results are applied, its tokens fed from step N's
  // rows on the runner (EngineCore::LookaheadReady in engine/engine_internal.h says when), on a
  // runner whose launched steps run on a device (ModelRunner::LaunchesAsync: the CUDA backend):
  // the device then never waits for the engine thread between decode steps. false: one step at
  // a time. The same bits either way.
  bool decode_lookahead = true;
  // Tests: the lookahead on a runner that computes steps at launch too (the CPU backend, where it
  // only delays each step's results by one step), to exercise its bookkeeping without a GPU.
  bool lookahead_on_synchronous_runners = false;
  // Called once, on the engine thread, when a step failed and the runner says it cannot run
  // any more (ModelRunner::Usable): every sample then ends (aborted) and every later Submit is
  // UNAVAILABLE with that status's message. The server turns its health NOT_SERVING.
  std::function<void(const absl::Status&)> on_runner_unusable;
};

// One sample to generate.
struct SampleSpec {
  int32_t rollout_index = 0;  // echoed back in events
  int32_t sample_index = 0;
  std::vector<int32_t> prompt;
  SamplingParams params;
  uint64_t sample_seed = 0;
  // > 0 makes this a scoring job: `prompt` is the whole sequence, and the completion carries
  // the logprobs of prompt[score_start..] at params.temperature (0 means 1) with
  // params.top_logprobs; nothing is generated and max_new_tokens is ignored.
  int32_t score_start = 0;
  // MoE routing replay (ModelConfig::RoutingSize() = R ids per token, engine/model_runner.h).
  // return_routing: the completion carries the routing of every generated (or scored) token --
  // the experts chosen at every MoE layer by the row whose logits gave it.
  bool return_routing = false;
  // Scoring jobs only: empty (the rows choose), or the routing each scored token's row uses
  // instead, [(prompt.size() - score_start) * R], in token order.
  std::vector<int32_t> forced_routing;
};

// The end of a sample: everything it generated.
struct SampleCompletion {
  FinishReason finish_reason = FinishReason::kAbort;
  std::vector<int32_t> token_ids;
  std::vector<float> logprobs;
  std::vector<std::vector<TokenLogprob>> top_logprobs;  // empty unless asked
  // SampleSpec::return_routing: [token_ids.size() (scored tokens for a scoring job) * R].
  std::vector<int32_t> routing;
  uint64_t sample_seed = 0;
  int32_t cached_prompt_tokens = 0;
  std::string weight_version;  // the version when the sample ended
  std::string weight_digest;   // that version's digest ("" when unknown)
  std::vector<VersionSpan> version_spans;
  // FinishReason::kAbort: what ended it, for a message ("a weight update 'v2' with policy
  // ABORT"); empty otherwise.
  std::string abort_cause;
  // FinishReason::kAbort because a row of the sample's logits had a NaN or an infinity
  // (abort_cause names its position and the weight version): the served weights' doing, not a
  // caller's or an operator's, and the same again on the same weights (docs/api.md, "Non-finite
  // logits").
  bool nonfinite_logits = false;
};

// What happened to one sample in one engine step: tokens generated since its last event, and
// on its last event the completion.
struct SampleEvent {
  int32_t rollout_index = 0;
  int32_t sample_index = 0;
  std::vector<int32_t> new_token_ids;
  std::vector<float> new_logprobs;
  std::vector<std::vector<TokenLogprob>> new_top_logprobs;
  std::optional<SampleCompletion> completion;
};

// Receives a job's events, once per iteration of the engine's loop in which any of its samples
// changed, on the engine's delivery thread, in order. Must not block: every job's events wait
// behind it, and so does the engine thread before it answers an update or a flush. Every sample
// gets exactly one event with a completion, the job's last call carrying the last one.
using EventSink = std::function<void(std::vector<SampleEvent> events)>;

// Durations in fixed buckets (Prometheus-style cumulative on export). `Bounds::kSeconds` are
// the buckets' upper bounds in seconds, ascending; the last bucket is +Inf.
template <typename Bounds>
struct DurationHistogram {
  static constexpr const double* kBounds = Bounds::kSeconds;
  static constexpr int kNumBuckets = static_cast<int>(std::size(Bounds::kSeconds)) + 1;
  uint64_t counts[kNumBuckets] = {};  // per bucket, not cumulative
  double sum_seconds = 0;
  uint64_t count = 0;

  void Record(double seconds) {
    int b = 0;
    while (b < kNumBuckets - 1 && seconds > kBounds[b]) ++b;
    ++counts[b];
    sum_seconds += seconds;
    ++count;
  }
};

// Engine steps: 1 ms to 5 s.
struct StepBounds {
  static constexpr double kSeconds[] = {0.001, 0.002, 0.005, 0.01, 0.02, 0.05,
                                        0.1,   0.2,   0.5,   1.0,  2.0,  5.0};
};
using StepHistogram = DurationHistogram<StepBounds>;

// A sample's waits, from its submission: 10 ms to 30 min (long rollouts behind a full pool).
struct SampleBounds {
  static constexpr double kSeconds[] = {0.01, 0.025, 0.05, 0.1,  0.25, 0.5,  1.0,   2.5,  5.0,
                                        10.0, 25.0,  50.0, 100., 250., 500., 1000., 1800.};
};
using SampleHistogram = DurationHistogram<SampleBounds>;

// What the engine thread last published: after every loop iteration, and before it answers a
// flush or an ABORT update.
struct EngineCounters {
  int32_t running = 0;
  int32_t paused = 0;  // of `running`, paused for a reader that fell behind (no place in steps)
  int32_t waiting = 0;
  int32_t kv_blocks_free = 0;
  int32_t kv_blocks_total = 0;
  uint64_t generated_tokens = 0;
  uint64_t prefilled_tokens = 0;
  uint64_t steps = 0;
  uint64_t lookahead_steps = 0;  // of those, decode steps launched before the last one's results
  uint64_t preemptions = 0;
  uint64_t recomputed_tokens = 0;  // prefilled again after a preemption
  int32_t kv_blocks_cached = 0;
  uint64_t prompt_tokens = 0;
  uint64_t cache_hit_tokens = 0;
  uint64_t scored_tokens = 0;
  int64_t unfinished_samples = 0;  // submitted and not yet completed, any state
  StepHistogram prefill_steps;     // steps that computed prompt (or recomputed) tokens
  StepHistogram decode_steps;      // steps of decode tokens only
  // Generated samples (not Score sequences), from their submission: to their first step
  // (queue time, behind a full pool, a pause or a DRAIN update included), to their first
  // token, and to their end by stop or length (aborted samples are not counted).
  SampleHistogram queue_time;
  SampleHistogram time_to_first_token;
  SampleHistogram sample_time;
  uint64_t weight_updates = 0;
  double last_update_seconds = 0;  // how long the last successful swap took the runner
  // Logits rows of running samples and Score sequences with a NaN or an infinity. The first of a
  // sample ends it (SampleCompletion::nonfinite_logits); a Score chunk may bring several.
  uint64_t nonfinite_logit_rows = 0;
};

// What a weight update does to samples in flight.
enum class UpdatePolicy {
  kAbort,     // end them with FinishReason::kAbort, then swap
  kDrain,     // finish them (and everything already submitted) on the old weights, then swap;
              // submissions that arrive meanwhile wait
  kContinue,  // swap between two steps; they go on with the new weights
};

// The longest weight version the server accepts (flags and updates): versions are copied into
// every completion.
inline constexpr size_t kMaxWeightVersionBytes = 256;

struct WeightUpdate {
  std::string version;
  UpdatePolicy policy = UpdatePolicy::kDrain;
  std::vector<HostTensorView> tensors;  // complete; checked again by the runner
  // TensorDigest of each of `tensors`, by name, hashed by whoever received the bytes (off the
  // engine thread). A tensor without one is hashed on the engine thread.
  TensorDigests digests;
  // Or, instead of `tensors`, tensors in another process's device memory (engine/ipc_tensor.h),
  // opened and hashed by the runner on the engine thread when the update starts (before its
  // policy acts, so a refused digest aborts nothing), copied at the swap, and unmapped before
  // `done` is called, whatever the outcome.
  std::vector<IpcTensorSource> ipc_tensors;
  // Owns the bytes `tensors` view (the server's staging lease, or tensors of its own). The
  // engine drops it, the last reference it holds, before the update's `done` runs, so that the
  // staging is free again when the caller hears back.
  std::shared_ptr<const void> bytes;
  // When set ("sha256:..."), the update is refused with DATA_LOSS unless the served weights'
  // digest after it would be exactly this (a broadcast's bytes checked against what the trainer
  // meant to send).
  std::string expected_digest;
};

// An UpdateWeightsFromBroadcast call (engine/weight_sync.h): the tensors, in broadcast order,
// and how they travel. Checked against the served specs by CheckBroadcastTensors.
struct BroadcastUpdate {
  std::string version;
  UpdatePolicy policy = UpdatePolicy::kDrain;
  std::vector<BroadcastTensor> tensors;
  uint64_t bucket_bytes = 0;
  int32_t source_rank = 0;  // the trainer's rank in the group
  // Each wait of the receive (the handshake, every bucket) ends after this without progress.
  std::chrono::milliseconds timeout{60'000};
  std::string expected_digest;  // WeightUpdate::expected_digest
};

// The weight-sync group this server is a member of.
struct WeightSyncGroupInfo {
  int32_t rank = 0;
  int32_t world_size = 0;
};

struct JoinResult {
  absl::Status status;
  WeightSyncGroupInfo group;  // when OK
  double seconds = 0;         // waiting for the group's ranks
  int nccl_version = 0;
};

// An update whose bytes are `tensors`, owned by it.
WeightUpdate OwnedWeightUpdate(std::string version, UpdatePolicy policy,
                               std::vector<HostTensor> tensors);

struct UpdateResult {
  absl::Status status;
  std::string previous_version;
  std::string digest;  // the served weights' digest after a successful update
  int32_t aborted_samples = 0;
  // An IPC update: seconds the engine thread spent opening the exports and hashing their bytes.
  double ipc_open_seconds = 0;
  // From Engine::UpdateWeights to the runner's copy: the engine thread taking it (after the
  // step in flight), aborting (ABORT) or draining (DRAIN), hashing tensors without a digest.
  double wait_seconds = 0;
  // The runner's copy of the bytes into the served weights (ModelRunner::UpdateWeights).
  double copy_seconds = 0;
  // A broadcast update: seconds from the handshake to the last bucket hashed (the weight-sync
  // thread), and the bytes received (padding included).
  double receive_seconds = 0;
  uint64_t received_bytes = 0;
};

// What Engine::ReleaseMemory does with samples in flight, and what it releases.
struct MemoryReleaseOptions {
  // End them with FinishReason::kAbort. Otherwise they are requeued: their KV is dropped and
  // recomputed once the memory is back, with the same bits (D5), so nothing is lost.
  bool abort_in_flight = false;
  // The weights' memory too (ModelRunner::ReleaseMemory).
  bool weights = false;
};

// The answer to a ReleaseMemory or ResumeMemory.
struct MemoryResult {
  absl::Status status;
  bool was_released = false;  // something was released before this call
  ReleasedMemory changed;     // released (ReleaseMemory) or taken back (ResumeMemory) by it
  int32_t requeued_samples = 0;
  int32_t aborted_samples = 0;
};

// Validate's bound on top logprobs, for a value as wide as a request's (a caller checks before
// narrowing it to SamplingParams' int32): INVALID_ARGUMENT naming `field` as the caller spells
// it (e.g. "sampling.top_logprobs") and the bound.
absl::Status CheckTopLogprobs(const char* field, int64_t top_logprobs);

// The inference engine. One thread, the engine thread, owns the scheduler, the KV blocks and the
// model runner, and loops: take what callers posted, apply it between two steps (updates,
// admissions, aborts, cache flushes, pause), run one step (schedule -> launch -> collect ->
// report), hand the step's events to the delivery thread. Every public method is thread-safe;
// callers talk to the engine thread through one queue and never wait for a step. Event sinks
// run on the delivery thread, in order; the `done` of an update or a flush runs on the engine
// thread, after the events of earlier steps were delivered.
class Engine {
 public:
  static absl::StatusOr<std::unique_ptr<Engine>> Create(std::unique_ptr<ModelRunner> runner,
                                                        const EngineOptions& options);
  // Aborts whatever is in flight (each sample still gets its completion; a waiting DRAIN update
  // fails UNAVAILABLE), joins the engine thread, and returns once the last events were delivered.
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  const ModelConfig& model_config() const { return config_; }
  const EngineOptions& options() const { return options_; }
  const char* backend_name() const { return backend_name_; }
  int32_t kv_block_size() const { return kv_block_size_; }
  int32_t attention_split_size() const { return split_size_; }
  // Longest prompt + generation of one sample: the model's context, bounded by the KV cache.
  int64_t max_context() const;

  // Checks one sample against the model and limits; the message names the field and the
  // bound, for the caller to prefix with where the sample came from.
  absl::Status Validate(const SampleSpec& spec) const;
  // Validate's parts that a caller also checks on its own wider values, before narrowing them:
  // a generation's length within max_context() (naming `prompt` and `sampling.max_new_tokens`,
  // as Validate does), and whether routing replay can serve (the message names no field; the
  // caller prefixes the one that asked).
  absl::Status CheckGenerationLength(int64_t prompt_tokens, int64_t max_new_tokens) const;
  absl::Status CheckRoutingReplay() const;
  // Whether this engine's runner implements MoE routing replay (ModelRunner).
  bool routing_replay() const { return routing_replay_; }

  // Validates every sample, then queues them all (in order) as one job. Returns the job id;
  // INVALID_ARGUMENT for no samples or an invalid one (Validate's message), UNAVAILABLE once the
  // engine is shutting down.
  absl::StatusOr<uint64_t> Submit(std::vector<SampleSpec> samples, EventSink sink);
  // Submit for samples the caller has passed through Validate already, where its own caller
  // learns of an error (the server does, to name the rollout and field in its message): a
  // request is validated once. INVALID_ARGUMENT for no samples, UNAVAILABLE as Submit.
  // REQUIRES: Validate(s).ok() for every sample s (checked in debug builds only).
  absl::StatusOr<uint64_t> SubmitValidated(std::vector<SampleSpec> samples, EventSink sink);

  // Ends every unfinished sample of the job (or only those of `rollout_index`) with
  // FinishReason::kAbort. Unknown or finished jobs are ignored.
  void Abort(uint64_t job_id, std::optional<int32_t> rollout_index = std::nullopt);
  // Aborts every job.
  void AbortAll();

  // Backpressure: holds the job's unfinished samples out of the schedule, from the next step
  // on, until ResumeJob (the server does so while a Generate stream's client is not reading
  // what it was sent). They keep their KV blocks and their place in the arrival order, and the
  // bits of every sample stay the same (rows are batch invariant, noise is per position); other
  // jobs run on. A DRAIN update still waits for them. Unknown or finished jobs are ignored.
  void PauseJob(uint64_t job_id);
  void ResumeJob(uint64_t job_id);

  // Empties the prefix cache between two steps, then calls `done` on the engine thread (it
  // must not block). Running samples keep the KV they hold.
  void FlushCache(std::function<void(FlushResult)> done);

  // Queues a weight update; `done` runs on the engine thread (must not block) once the swap
  // happened or failed. On failure the old weights keep serving, unchanged (every check runs
  // before a byte is copied; only a device failing mid-copy, which leaves the GPU unusable
  // anyway, could interrupt a swap halfway). One update at a time: another one that arrives
  // while a DRAIN update waits fails ABORTED, and DRAIN fails FAILED_PRECONDITION while the
  // engine is paused with samples in flight. `cancelled` (optional; thread-safe, must not block)
  // is asked on the engine thread before the update acts (an ABORT update aborts nothing first),
  // while a DRAIN update waits (after every step, and every 50 ms while there is no step to
  // run), and right before the swap: once it answers true, nothing is applied and `done` gets
  // CANCELLED. Whatever the outcome, the engine has dropped `update` (its bytes) when `done`
  // runs.
  void UpdateWeights(WeightUpdate update, std::function<void(UpdateResult)> done,
                     std::function<bool()> cancelled = nullptr);

  // Fleets: NCCL weight-sync groups (engine/weight_sync.h, docs/api.md "Weights by NCCL
  // broadcast"). The runner's port does the work on the engine's weight-sync thread, one call at
  // a time in call order, so the engine thread keeps stepping meanwhile; each `done` runs on that
  // thread (it must not block).
  //
  // Joins the group of `spec` (returns once every rank joined, the timeout passed, or
  // `give_up`). FAILED_PRECONDITION when the runner cannot receive broadcasts (its port's
  // reason: the cpu backend, no device staging), while another join runs, or when already a
  // member.
  void JoinWeightSyncGroup(WeightSyncGroupSpec spec, std::function<void(JoinResult)> done,
                           GiveUp give_up = nullptr);
  // Leaves the group, if any (after the calls queued before); `done` gets what was left.
  void LeaveWeightSyncGroup(std::function<void(std::optional<WeightSyncGroupInfo>)> done);
  // Receives a broadcast into the runner's staging (ReceiveBroadcast), then updates as
  // UpdateWeights does, with its digests and policy; `done` once applied or failed (on the engine
  // thread, or on the weight-sync thread when the receive failed). A refused update (`update` an
  // error: the server's validation, its update slot) still takes part in the group's handshake,
  // so that the trainer and the other servers stop too, and answers its error. Without a group:
  // FAILED_PRECONDITION (the runner's reason first, then "join first"), or the refusal.
  // A receive that times out, is cancelled or fails in NCCL leaves the group (join again).
  // `cancelled` is asked during the receive too.
  void UpdateWeightsFromBroadcast(absl::StatusOr<BroadcastUpdate> update,
                                  std::function<void(UpdateResult)> done,
                                  std::function<bool()> cancelled = nullptr);
  // The group this server is a member of (any thread).
  std::optional<WeightSyncGroupInfo> weight_sync_group() const;

  // Stops running steps (and so admissions) once the step in flight, if any, is collected and
  // its events delivered; submissions are queued, not failed. With `abort_in_flight`, every job
  // is aborted too. Returns whether it was paused already; FAILED_PRECONDITION (not paused)
  // while a DRAIN weight update waits for samples in flight, which a pause would hold for ever
  // (with abort_in_flight they end, and the update applies).
  absl::StatusOr<bool> Pause(bool abort_in_flight);
  // Returns whether it was paused.
  bool Resume();
  bool paused() const;

  // Colocated memory: for a trainer that shares the device between rollout phases. Between two
  // steps, ends (abort_in_flight) or requeues every sample in flight, empties the prefix cache
  // and has the runner give back the KV cache's memory (and, with `weights`, the weights',
  // kept in host memory); then `done` runs on the engine thread (after the events of earlier
  // steps were delivered; it must not block). Until ResumeMemory no step runs: submissions are
  // queued, not failed, as under Pause (which is independent of it: both must be lifted).
  // Weight updates: refused while the weights are released; DRAIN refused while samples wait.
  // Idempotent: releasing again releases nothing more (was_released), except the weights when
  // they are asked for the first time. FAILED_PRECONDITION while a DRAIN update waits for the
  // samples in flight (abort_in_flight ends them, so the update applies first). On failure the
  // memory is as it was.
  void ReleaseMemory(MemoryReleaseOptions options, std::function<void(MemoryResult)> done);
  // Takes everything released back (ModelRunner::ResumeMemory: the KV zeroed, the weights
  // restored bitwise), then steps run again. RESOURCE_EXHAUSTED when the memory is not there:
  // everything stays released, to retry. OK with nothing changed when nothing was released.
  void ResumeMemory(std::function<void(MemoryResult)> done);
  // What is released now; nullopt when nothing is.
  std::optional<ReleasedMemory> memory_released() const;

  // The tensors an update may replace (constant; any thread).
  const std::vector<WeightSpec>& weight_specs() const { return weight_specs_; }
  // Host memory to stage updates in, from the runner (ModelRunner::AllocateHostStaging: pinned
  // on CUDA). Any thread; the buffer may outlive the engine.
  absl::StatusOr<std::unique_ptr<HostStagingBuffer>> AllocateHostStaging(size_t bytes) const;
  std::string weight_version() const;
  // The served weights' digest (model/weight_digest.h; "" when unknown), changed with the
  // version at each swap.
  std::string weight_digest() const;

  EngineCounters counters() const;
  // Samples submitted and not yet completed (exact, unlike the per-step counters).
  int64_t unfinished_samples() const;

 private:
  Engine(std::unique_ptr<ModelRunner> runner, absl::StatusOr<std::unique_ptr<WeightSyncPort>> port,
         const EngineOptions& options);
  // Validate's part for return_routing and forced_routing: a MoE model on a runner that
  // replays, a forced routing only for scoring, of the right length, ids in range, none twice
  // in one layer.
  absl::Status ValidateRouting(const SampleSpec& spec) const;

  // Constant after construction.
  const EngineOptions options_;
  const ModelConfig config_;
  const char* const backend_name_;
  const bool routing_replay_;  // the runner's SupportsRoutingReplay()
  const int32_t kv_block_size_;
  const int32_t split_size_;
  const int32_t num_kv_blocks_;
  const std::vector<WeightSpec> weight_specs_;
  // The runner, borrowed for its one thread-safe method (AllocateHostStaging); core_ owns it.
  const ModelRunner* const staging_allocator_;

  // The engine thread, its state and the queue to it (engine/engine_internal.h). Last: it takes
  // the runner, after the constants above were read from it.
  std::unique_ptr<engine_internal::EngineCore> core_;
  // The weight-sync thread and its group, over the runner's port (made before core_ took the
  // runner). After core_: destroyed first, so no receive outlives the engine or the runner.
  std::unique_ptr<engine_internal::WeightSyncAgent> weight_sync_;
};

}  // namespace rollout
