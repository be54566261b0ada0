#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/serial_executor.h"
#include "engine/kv_block_manager.h"
#include "engine/model_runner.h"
#include "engine/scheduler.h"
#include "engine/sequence.h"

namespace rollout {

struct EngineOptions {
  int32_t max_running_samples = 64;
  int32_t max_batch_tokens = 512;
  std::string weight_version = "0";
  bool prefix_cache = true;
  // When a waiting sample may start (engine/scheduler.h): kReserve, the default, only when the
  // KV pool can hold everything it may still need, so nothing is ever preempted.
  AdmissionPolicy admission = AdmissionPolicy::kReserve;
  // Launch decode step N + 1 before step N's results are applied, its tokens fed from step N's
  // rows on the runner (Engine::LookaheadReady says when), on a runner whose launched steps run
  // on a device (ModelRunner::LaunchesAsync: the CUDA backend): the device then never waits for
  // this thread between decode steps. false: one step at a time. The same bits either way.
  bool decode_lookahead = true;
  // Tests: the lookahead on a runner that computes steps at launch too (the CPU backend, where it
  // only delays each step's results by one step), to exercise its bookkeeping without a GPU.
  bool lookahead_on_synchronous_runners = false;
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
};

// The end of a sample: everything it generated.
struct SampleCompletion {
  FinishReason finish_reason = FinishReason::kAbort;
  std::vector<int32_t> token_ids;
  std::vector<float> logprobs;
  std::vector<std::vector<TokenLogprob>> top_logprobs;  // empty unless asked
  uint64_t sample_seed = 0;
  int32_t cached_prompt_tokens = 0;
  std::string weight_version;  // the version when the sample ended
  std::vector<VersionSpan> version_spans;
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

// Receives a job's events, once per engine step in which any of its samples changed, on the
// engine thread. Must not block. Every sample gets exactly one event with a completion, the
// job's last call carrying the last one.
using EventSink = std::function<void(std::vector<SampleEvent> events)>;

// Durations of engine steps, in fixed buckets (Prometheus-style cumulative on export).
struct StepHistogram {
  static constexpr int kNumBuckets = 13;
  // Upper bounds in seconds; the last bucket is +Inf.
  static constexpr double kBounds[kNumBuckets - 1] = {0.001, 0.002, 0.005, 0.01, 0.02, 0.05,
                                                      0.1,   0.2,   0.5,   1.0,  2.0,  5.0};
  uint64_t counts[kNumBuckets] = {};  // per bucket, not cumulative
  double sum_seconds = 0;
  uint64_t count = 0;

  void Record(double seconds);
};

struct EngineCounters {
  int32_t running = 0;
  int32_t waiting = 0;
  int32_t kv_blocks_free = 0;
  int32_t kv_blocks_total = 0;
  uint64_t generated_tokens = 0;
  uint64_t prefilled_tokens = 0;
  uint64_t steps = 0;
  uint64_t lookahead_steps = 0;  // of those, decode steps launched before the previous finished
  uint64_t preemptions = 0;
  uint64_t recomputed_tokens = 0;  // prefilled again after a preemption
  int32_t kv_blocks_cached = 0;
  uint64_t prompt_tokens = 0;
  uint64_t cache_hit_tokens = 0;
  uint64_t scored_tokens = 0;
  int64_t unfinished_samples = 0;  // submitted and not yet completed, any state
  StepHistogram prefill_steps;     // steps that computed prompt (or recomputed) tokens
  StepHistogram decode_steps;      // steps of decode tokens only
  uint64_t weight_updates = 0;
  double last_update_seconds = 0;  // engine-side time of the last successful swap
};

// What a weight update does to samples in flight.
enum class UpdatePolicy {
  kAbort,     // end them with FinishReason::kAbort, then swap
  kDrain,     // finish them (and everything already submitted) on the old weights, then swap;
              // submissions that arrive meanwhile wait
  kContinue,  // swap between two steps; they go on with the new weights
};

struct WeightUpdate {
  std::string version;
  UpdatePolicy policy = UpdatePolicy::kDrain;
  std::vector<HostTensor> tensors;  // complete; checked again by the runner
};

struct UpdateResult {
  absl::Status status;
  std::string previous_version;
  int32_t aborted_samples = 0;
};

// The inference engine: one thread owns the scheduler, the KV blocks and the model runner and
// loops schedule -> forward -> sample -> report. Every public method is thread-safe; callers
// talk to the engine thread through a queue and never wait for a step. Event sinks run on a
// delivery thread, in order; replies to updates and flushes wait until the events of earlier
// steps were delivered.
class Engine {
 public:
  static absl::StatusOr<std::unique_ptr<Engine>> Create(std::unique_ptr<ModelRunner> runner,
                                                        const EngineOptions& options);
  // Aborts whatever is in flight (each sample still gets its completion) and joins the thread.
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

  // Validates every sample, then queues them all (in order) as one job. Returns the job id.
  absl::StatusOr<uint64_t> Submit(std::vector<SampleSpec> samples, EventSink sink);

  // Ends every unfinished sample of the job (or only those of `rollout_index`) with
  // FinishReason::kAbort. Unknown or finished jobs are ignored.
  void Abort(uint64_t job_id, std::optional<int32_t> rollout_index = std::nullopt);
  // Aborts every job.
  void AbortAll();

  // Empties the prefix cache between two steps, then calls `done` on the engine thread (it
  // must not block). Running samples keep the KV they hold.
  void FlushCache(std::function<void(FlushResult)> done);

  // Queues a weight update; `done` runs on the engine thread (must not block) once the swap
  // happened or failed. On failure the old weights keep serving, unchanged (every check runs
  // before a byte is copied; only a device failing mid-copy, which leaves the GPU unusable
  // anyway, could interrupt a swap halfway). `cancelled`
  // (optional; thread-safe, must not block) is asked on the engine thread before the update
  // acts (an ABORT update aborts nothing first), while a DRAIN update waits, and right before
  // the swap: once it answers true, nothing is applied and `done` gets CANCELLED.
  void UpdateWeights(WeightUpdate update, std::function<void(UpdateResult)> done,
                     std::function<bool()> cancelled = nullptr);

  // Stops running steps (and so admissions); submissions are queued, not failed. With
  // `abort_in_flight`, every job is aborted too. Returns whether it was paused already.
  bool Pause(bool abort_in_flight);
  // Returns whether it was paused.
  bool Resume();
  bool paused() const;

  // The tensors an update may replace (constant; any thread).
  const std::vector<WeightSpec>& weight_specs() const { return weight_specs_; }
  std::string weight_version() const;

  EngineCounters counters() const;
  // Samples submitted and not yet completed (exact, unlike the per-step counters).
  int64_t unfinished_samples() const;

 private:
  struct Job {
    EventSink sink;
    std::vector<std::unique_ptr<Sequence>> sequences;
    size_t num_unfinished = 0;
  };
  struct Submission {
    uint64_t job_id;
    std::vector<SampleSpec> samples;
    EventSink sink;
  };
  struct PendingUpdate {
    WeightUpdate update;
    std::function<void(UpdateResult)> done;
    std::function<bool()> cancelled;  // may be empty
  };
  struct AbortOrder {
    std::optional<uint64_t> job_id;        // none: every job
    std::optional<int32_t> rollout_index;  // none: every rollout of the job
  };

  // One loop iteration's events, by job id (so that delivery is in job order), in report order
  // within a job. A sample's streamed tokens (no completion, no top logprobs) are copied to
  // flat arrays here and become SampleEvents on the delivery thread: the allocations of the
  // step's ~one event per running sample happen there, off the engine thread (and are freed by
  // the thread that made them). Other events are built by Report.
  struct StepEvents {
    struct Entry {
      int32_t rollout_index = 0;
      int32_t sample_index = 0;
      uint32_t begin = 0, count = 0;  // streamed: [begin, begin + count) of tokens / logprobs
      int32_t built = -1;             // >= 0: the event is the job's built[built] instead
    };
    struct JobEvents {
      std::vector<Entry> entries;
      std::vector<SampleEvent> built;
    };
    std::map<uint64_t, JobEvents> jobs;
    std::vector<int32_t> tokens;
    std::vector<float> logprobs;
    bool empty() const { return jobs.empty(); }
  };

  // A step launched on the runner (ModelRunner::LaunchStep) and not collected yet.
  struct LaunchedStep {
    struct Chunk {
      Sequence* seq;       // nullptr: the sequence finished while the step ran; its row is dropped
      int64_t begin, end;  // tokens [begin, end) of seq
      // Its logits rows [first_row, first_row + num_rows) of the step, for positions from
      // first_position.
      int64_t first_row, num_rows, first_position;
      // Set: the token at `begin` is not known yet; it is the one sampled for this row of the
      // step launched before (a fed token, ModelRunner::LaunchStep).
      std::optional<int64_t> fed_row;
    };
    std::vector<Chunk> chunks;
    std::vector<LogitsRowTask> tasks;  // a dead chunk's (seq nullptr) point at freed params
    bool has_prefill = false;
    std::chrono::steady_clock::time_point start;
  };

  Engine(std::unique_ptr<ModelRunner> runner, const EngineOptions& options);
  void Loop();
  void Admit(Submission submission);
  // One step: launches the schedule's chunks (unless a step is launched already), launches the
  // next decode step too when it can be known in advance (LookaheadReady), then collects the
  // first and applies its results. So on a backend that runs launched steps on its device, the
  // device computes step N + 1 while this thread applies step N and prepares step N + 2.
  void Step(StepEvents* events);
  // Launches `chunks` (their batch built in batch_). nullopt when the launch fails, with the
  // chunks' samples aborted into `events` unless it is null.
  std::optional<LaunchedStep> Launch(std::vector<LaunchedStep::Chunk> chunks, StepEvents* events);
  // Whether the step after `step` is known before `step`'s results: every running sequence
  // decodes in `step`, none waits to be admitted, nothing waits in the inbox, the runner can
  // feed `step`'s tokens. (A sequence that stops on a sampled token then has one dropped row.)
  bool LookaheadReady(const LaunchedStep& step);
  // The decode step after `step`, its tokens fed from `step`'s rows; nullopt if KV blocks are
  // short or the launch fails (then nothing was launched).
  std::optional<LaunchedStep> LaunchLookahead(const LaunchedStep& step);
  // Collects `step`'s results and applies them: new tokens, scores, reports, finishes.
  void Complete(LaunchedStep step, StepEvents* events);
  // Collects the launched step, if any (before anything changes the engine's state).
  void DrainLaunched(StepEvents* events);
  // Moves what `seq` generated since its last report into an event, finishing it if `reason`.
  void Report(Sequence* seq, std::optional<FinishReason> reason, StepEvents* events);
  void AbortJob(uint64_t job_id, std::optional<int32_t> rollout_index, StepEvents* events);
  // Posts the events to the delivery thread, in job order.
  void Deliver(StepEvents* events);
  // Calls an update's `done` once the events of earlier steps were delivered.
  void Reply(const std::function<void(UpdateResult)>& done, UpdateResult result);
  void PublishCounters();
  // Takes updates off the inbox, applies those that can be applied now.
  void ProcessUpdates(std::vector<PendingUpdate> updates, StepEvents* events);
  void ApplyUpdate(PendingUpdate pending, int32_t aborted_samples);
  // Whether the update's caller gave up; if so, answers it CANCELLED (nothing applied).
  bool DropIfCancelled(PendingUpdate* pending);

  // Constant after construction.
  const EngineOptions options_;
  const ModelConfig config_;
  const char* const backend_name_;
  const int32_t kv_block_size_;
  const int32_t split_size_;
  const int32_t num_kv_blocks_;
  const std::vector<WeightSpec> weight_specs_;

  // Engine thread only.
  std::unique_ptr<ModelRunner> runner_;
  KvBlockManager blocks_;
  PrefixCache cache_;
  Scheduler scheduler_;
  std::map<uint64_t, Job> jobs_;
  uint64_t next_arrival_ = 0;
  uint64_t generated_tokens_ = 0;
  uint64_t prefilled_tokens_ = 0;
  uint64_t steps_ = 0;
  uint64_t scored_tokens_ = 0;
  StepHistogram prefill_steps_, decode_steps_;
  uint64_t weight_updates_ = 0;
  double last_update_seconds_ = 0;
  std::string version_;                    // the weights now in the runner
  std::optional<PendingUpdate> draining_;  // a DRAIN update waiting for in-flight work
  std::vector<Submission> held_;           // submissions waiting for draining_
  // The step's batch, rebuilt every step in place: its vectors (a block table per sequence)
  // keep their capacity instead of being allocated again each step.
  ForwardBatch batch_;
  // The launched step whose results the next Step (or DrainLaunched) collects.
  std::optional<LaunchedStep> launched_;
  uint64_t lookahead_steps_ = 0;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  // Protected by mu_.
  std::vector<Submission> inbox_;
  std::vector<AbortOrder> aborts_;
  std::vector<std::function<void(FlushResult)>> flushes_;
  std::vector<PendingUpdate> updates_;
  bool paused_ = false;
  std::string published_version_;
  uint64_t next_job_id_ = 1;
  int64_t unfinished_samples_ = 0;
  bool stop_ = false;
  EngineCounters counters_;

  SerialExecutor delivery_;  // event sinks, in step order
  std::thread thread_;       // last: starts after everything above is built
};

}  // namespace rollout
