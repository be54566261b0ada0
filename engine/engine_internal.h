#pragma once

// The engine's insides, behind engine/engine.h: EngineCore (the engine thread and everything it
// owns) and the records it keeps. Only the engine's own sources include this header.

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
#include <deque>
#include <vector>

#include "absl/status/statusor.h"
#include "common/serial_executor.h"
#include "engine/engine.h"
#include "engine/kv_block_manager.h"
#include "engine/model_runner.h"
#include "engine/prefix_cache.h"
#include "engine/scheduler.h"
#include "engine/sequence.h"

namespace rollout {
namespace engine_internal {

// The samples of one Submit and where their events go. Engine thread only.
struct Job {
  EventSink sink;
  std::vector<std::unique_ptr<Sequence>> sequences;
  size_t num_unfinished = 0;
};

// A Submit on its way to the engine thread (the inbox), where it becomes a Job. Its samples
// passed Engine::Validate.
struct Submission {
  uint64_t job_id;
  std::vector<SampleSpec> samples;
  EventSink sink;
  std::chrono::steady_clock::time_point submitted;
};

// An UpdateWeights call on its way to the engine thread, or a DRAIN update waiting there.
struct PendingUpdate {
  WeightUpdate update;
  std::function<void(UpdateResult)> done;
  std::function<bool()> cancelled;  // may be empty
  // An IPC update's exports, once opened (StartUpdate); closed before its reply.
  std::unique_ptr<OpenedIpcTensors> opened_ipc;
  double ipc_open_seconds = 0;
  std::chrono::steady_clock::time_point submitted = std::chrono::steady_clock::now();
  // A broadcast update's bytes, received and hashed in the runner's staging by the weight-sync
  // thread (engine/weight_sync_agent.h); released before its reply.
  std::unique_ptr<StagedWeights> staged;
  double receive_seconds = 0;
  uint64_t received_bytes = 0;
};

// An Abort, AbortAll or Pause(abort_in_flight) call on its way to the engine thread.
struct AbortOrder {
  std::optional<uint64_t> job_id;        // none: every job
  std::optional<int32_t> rollout_index;  // none: every rollout of the job
  std::string cause;                     // SampleCompletion::abort_cause
};

// A PauseJob or ResumeJob call on its way to the engine thread.
struct JobPause {
  uint64_t job_id;
  bool paused;
};

// A ReleaseMemory (`release` set) or ResumeMemory call on its way to the engine thread.
struct MemoryOrder {
  std::optional<MemoryReleaseOptions> release;
  std::function<void(MemoryResult)> done;
};

// What other threads posted for the engine thread since the loop last took it. Guarded by
// EngineCore::mu_ until taken, then the engine thread's.
struct Inbox {
  std::vector<Submission> submissions;
  std::vector<AbortOrder> aborts;
  std::vector<std::function<void(FlushResult)>> flushes;
  std::vector<PendingUpdate> updates;
  std::vector<JobPause> job_pauses;  // in call order: the last one for a job wins
  std::vector<MemoryOrder> memory_orders;  // in call order
  bool empty() const {
    return submissions.empty() && aborts.empty() && flushes.empty() && updates.empty() &&
           job_pauses.empty() && memory_orders.empty();
  }
};

// One loop iteration's control input: the inbox it took, and the engine's flags at that moment
// (they stay set; they are not taken).
struct Control {
  Inbox inbox;
  bool paused = false;
  bool stop = false;
};

// One loop iteration's events, by job id (so that delivery is in job order), in report order
// within a job. A sample's streamed tokens (no completion, no top logprobs) are copied to
// flat arrays here and become SampleEvents on the delivery thread: the allocations of the
// step's ~one event per running sample happen there, off the engine thread (and are freed by
// the thread that made them). Other events are built by Report. Built on the engine thread,
// then moved to the delivery thread by Deliver.
struct StepEvents {
  struct Entry {
    int32_t rollout_index = 0;
    int32_t sample_index = 0;
    uint32_t begin = 0, count = 0;  // streamed: [begin, begin + count) of tokens / logprobs
    std::optional<uint32_t> built;  // set: the event is the job's built[*built] instead
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

// A step launched on the runner (ModelRunner::LaunchStep) and not collected yet. Engine thread
// only.
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

// The engine thread and everything it owns: the model runner, the scheduler with its KV blocks
// and prefix cache, the jobs and their sequences. Engine's methods post to it and read what it
// publishes (counters, the weight version) from any thread; every other member function runs on
// the engine thread only.
class EngineCore {
 public:
  // Starts the engine thread. `max_context`: Engine::max_context().
  EngineCore(std::unique_ptr<ModelRunner> runner, const EngineOptions& options,
             int64_t max_context);
  // Aborts whatever is in flight (each sample still gets its completion; a waiting DRAIN update
  // fails UNAVAILABLE), joins the thread, then waits until the last events reached their sinks.
  ~EngineCore();
  EngineCore(const EngineCore&) = delete;
  EngineCore& operator=(const EngineCore&) = delete;

  // Any thread: these post to the engine thread and wake it.
  // REQUIRES: every sample passed Engine::Validate, and there is at least one.
  absl::StatusOr<uint64_t> Submit(std::vector<SampleSpec> samples, EventSink sink);
  void Abort(AbortOrder order);
  void SetJobPaused(uint64_t job_id, bool paused);
  void FlushCache(std::function<void(FlushResult)> done);
  void UpdateWeights(PendingUpdate update);
  // Returns whether it was paused.
  // Engine::Pause and Engine::Resume (which never fails).
  absl::StatusOr<bool> SetPaused(bool paused, bool abort_in_flight);
  void PostMemoryOrder(MemoryOrder order);

  // Any thread: the pause flag, and what the engine thread published.
  bool paused() const;
  std::optional<ReleasedMemory> memory_released() const;
  std::string weight_version() const;
  std::string weight_digest() const;
  EngineCounters counters() const;
  int64_t unfinished_samples() const;

 private:
  // engine_core.cc: the loop, what wakes it, and what it hands to other threads.
  //
  // Each iteration: take the inbox, apply it (ApplyControl), run one Step unless paused, then
  // publish the counters and deliver the iteration's events.
  void Loop();
  // Waits until something is posted, or there is a step to run (or to collect, when paused),
  // or, while a DRAIN update waits, until its `cancelled` is due to be asked again; then takes
  // the inbox.
  Control WaitForControl();
  // Samples paused by PauseJob are no work: a loop with only those sleeps; so are all samples
  // while the memory is released (nothing can run).
  bool has_work() const {
    return (!released_.has_value() && scheduler_.has_unpaused()) || launched_.has_value();
  }
  void PublishCounters();
  // Posts the events to the delivery thread, in job order.
  void Deliver(StepEvents* events);

  // engine_control.cc: the control plane, applied between two steps.
  //
  // Collects the launched step if anything changes (or the engine is paused), then applies the
  // inbox: updates, admissions (held behind a DRAIN update), job pauses, aborts, cache flushes.
  void ApplyControl(Control control, StepEvents* events);
  // The loop's last iteration: every job is aborted, a waiting DRAIN update fails.
  void Shutdown(StepEvents* events);
  // Acts on an update taken off the inbox: applies it now (CONTINUE; ABORT, after aborting
  // every job), or holds it in draining_ (DRAIN), or answers why not.
  void StartUpdate(PendingUpdate pending, StepEvents* events);
  // Applies the DRAIN update in draining_ once no work is in flight (or drops it once its caller
  // cancelled), then schedules the jobs it held.
  void AdvanceDrain();
  // Empties draining_ (and drain_waiting_ with it).
  void EndDrain();
  void ApplyUpdate(PendingUpdate pending, int32_t aborted_samples);
  // Whether the update's caller gave up; if so, answers it CANCELLED (nothing applied).
  bool DropIfCancelled(PendingUpdate* pending);
  // Hashes the update's tensors that came without a digest; then FAILED_PRECONDITION when it
  // reuses the served version name for other bytes (both digests known), DATA_LOSS when it
  // expects another digest than its bytes give, else OK with the served digests after it in
  // `after`.
  absl::Status CheckDigest(PendingUpdate* pending, TensorDigests* after);
  // An IPC update: its tensors checked against the served specs, then opened and hashed by the
  // runner (the time it took in pending->ipc_open_seconds); nothing for other updates.
  absl::Status OpenIpcTensors(PendingUpdate* pending);
  // Calls an update's `done` once the events of earlier steps were delivered, its IPC exports
  // (if any) closed and its bytes (WeightUpdate::bytes) and staging (if any) dropped first.
  void Reply(PendingUpdate* pending, UpdateResult result);
  // Makes the submission a job in jobs_ (arrival numbers taken in submission order); its samples
  // wait for Schedule, which hands the unfinished ones to the scheduler.
  void Accept(Submission submission);
  void Schedule(uint64_t job_id);
  // Ends the job's unfinished samples (of `rollout_index` only, if set); returns how many.
  int32_t AbortJob(uint64_t job_id, std::optional<int32_t> rollout_index, const std::string& cause,
                   StepEvents* events);
  int32_t AbortAllJobs(const std::string& cause, StepEvents* events);
  // Marks the job's sequences paused or not (the scheduler skips paused ones).
  void ApplyJobPause(const JobPause& pause);
  // Empties the prefix cache, then answers every flush.
  void Flush(std::vector<std::function<void(FlushResult)>> dones);

  // engine_memory.cc: colocated memory (Engine::ReleaseMemory, ResumeMemory).
  //
  // Applies the order (the launched step was collected) and answers it.
  void ApplyMemoryOrder(MemoryOrder order, StepEvents* events);
  MemoryResult ReleaseMemory(const MemoryReleaseOptions& options, StepEvents* events);
  MemoryResult ResumeMemory();
  // Publishes released_ for memory_released().
  void PublishReleased();

  // engine_step.cc: the step pipeline.
  //
  // One step: launches the schedule's chunks (unless a step is launched already), launches the
  // next decode step too when it can be known in advance (LookaheadReady), then collects the
  // first and applies its results. So on a backend that runs launched steps on its device, the
  // device computes step N + 1 while this thread applies step N and prepares step N + 2.
  void Step(StepEvents* events);
  // The scheduler's chunks for the next step, with the logits rows each one wants.
  std::vector<LaunchedStep::Chunk> ScheduleChunks();
  // Launches `chunks` (their batch built in batch_). nullopt when the launch fails, with the
  // chunks' samples aborted into `events` unless it is null.
  std::optional<LaunchedStep> Launch(std::vector<LaunchedStep::Chunk> chunks, StepEvents* events);
  // Fills batch_ and step->tasks from step->chunks, and their rows' places in the step.
  void BuildBatch(LaunchedStep* step);
  // Whether the step after `step` is known before `step`'s results: the lookahead is on for this
  // runner, every running sequence decodes in `step`, none waits that the next schedule would
  // admit (Scheduler::NextScheduleCouldAdmit, with no sequence of `step` ending by length),
  // nothing waits in the inbox or behind a DRAIN update, the engine is neither paused nor
  // stopping, and the runner can feed `step`'s tokens. (A sequence that stops on a sampled token
  // then has one dropped row.)
  bool LookaheadReady(const LaunchedStep& step);
  // The decode step after `step`, its tokens fed from `step`'s rows; nullopt if every sequence
  // ends by length after `step`, KV blocks are short or the launch fails (then nothing was
  // launched).
  std::optional<LaunchedStep> LaunchLookahead(const LaunchedStep& step);
  // Whether `seq`, decoding in a step, finishes by length with that step's token (its
  // max_new_tokens or the context).
  bool EndsByLengthAfter(const Sequence& seq) const;
  // Collects `step`'s results and applies them: new tokens, scores, reports, finishes.
  void Complete(LaunchedStep step, StepEvents* events);
  // A scoring chunk's results: the logprobs of its scored tokens; finishes it at its end.
  void ApplyScores(Sequence* seq, SampleResult* rows, int64_t num_rows, StepEvents* events);
  // A generating sequence's new token: appended, reported, finishing it on a stop or length.
  void ApplyToken(Sequence* seq, SampleResult* result, StepEvents* events);
  // Ends `seq` (FinishReason::kAbort) because the logits row for its token at `position` (of
  // prompt + generated tokens; a scoring sequence's index into its tokens) had a NaN or an
  // infinity; nothing of that row is applied. One warning in the log per sequence.
  void EndOnNonFiniteLogits(Sequence* seq, int64_t position, StepEvents* events);
  // Collects the launched step, if any (before anything changes the engine's state).
  void CollectLaunched(StepEvents* events);
  // Moves what `seq` generated since its last report into an event, finishing it if `reason`.
  void Report(Sequence* seq, std::optional<FinishReason> reason, StepEvents* events);
  // After a failed step: when the runner is no longer usable, refuse new work and end all.
  void NoteFailedStep();
  // Streamed tokens only (no completion, no top logprobs), generated tokens [from, end):
  // copied flat, made into an event on the delivery thread.
  void ReportStreamed(const Sequence& seq, int64_t from, StepEvents* events);
  // Marks `seq` finished, releases its KV, and returns its completion.
  SampleCompletion Finish(Sequence* seq, FinishReason reason);

  // Constant after construction.
  const EngineOptions options_;
  const ModelConfig config_;
  const int64_t max_context_;

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
  uint64_t nonfinite_logit_rows_ = 0;
  StepHistogram prefill_steps_, decode_steps_;
  SampleHistogram queue_time_, time_to_first_token_, sample_time_;  // EngineCounters says what
  uint64_t weight_updates_ = 0;
  double last_update_seconds_ = 0;
  std::string version_;                    // the weights now in the runner
  TensorDigests tensor_digests_;           // theirs, by tensor
  std::string digest_;                     // WeightsDigest of them ("" when unknown)
  // Every version served since start (the last kRememberedVersions), with its digest: a name is
  // bound to its bytes for as long as it is remembered, not only while it serves (CheckDigest).
  static constexpr size_t kRememberedVersions = 4096;
  std::map<std::string, std::string> served_digests_;
  std::deque<std::string> served_order_;  // oldest first
  void RememberServed();                  // version_ and digest_, now serving
  std::optional<PendingUpdate> draining_;  // a DRAIN update waiting for in-flight work
  // Jobs submitted while draining_ waits: in jobs_ (so Abort finds them), not yet scheduled.
  std::vector<uint64_t> held_;
  // What the runner holds released (ReleaseMemory); while set, no step runs.
  std::optional<ReleasedMemory> released_;
  // The step's batch, rebuilt every step in place: its vectors (a block table per sequence)
  // keep their capacity instead of being allocated again each step.
  ForwardBatch batch_;
  // The launched step whose results the next Step (or CollectLaunched) collects.
  std::optional<LaunchedStep> launched_;
  uint64_t lookahead_steps_ = 0;

  mutable std::mutex mu_;
  std::condition_variable cv_;  // notified whenever inbox_ or a flag below changes
  // Protected by mu_.
  Inbox inbox_;
  bool paused_ = false;
  bool drain_waiting_ = false;  // draining_ holds a DRAIN update: Pause is refused (SetPaused)
  std::optional<ReleasedMemory> published_released_;
  std::string published_version_;
  std::string published_digest_;
  uint64_t next_job_id_ = 1;
  int64_t unfinished_samples_ = 0;
  bool stop_ = false;
  std::string unusable_;  // non-empty: the runner cannot run steps (NoteFailedStep); why
  EngineCounters counters_;

  SerialExecutor delivery_;  // event sinks, in step order
  std::thread thread_;       // last: starts after everything above is built
};

}  // namespace engine_internal
}  // namespace rollout
