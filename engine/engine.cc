#include "engine/engine.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <utility>

#include "absl/strings/str_format.h"
#include "glog/logging.h"

namespace rollout {

namespace {

// An update that was not applied, and why.
UpdateResult FailedUpdate(absl::Status status) {
  UpdateResult result;
  result.status = std::move(status);
  return result;
}

}  // namespace
namespace {

constexpr int32_t kMaxTopLogprobs = 20;

bool IsStop(const Sequence& seq, int32_t token, const ModelConfig& config) {
  const SamplingParams& p = seq.params;
  if (std::find(p.stop_token_ids.begin(), p.stop_token_ids.end(), token) !=
      p.stop_token_ids.end()) {
    return true;
  }
  return !p.ignore_eos && std::find(config.eos_token_ids.begin(), config.eos_token_ids.end(),
                                    token) != config.eos_token_ids.end();
}

}  // namespace

void StepHistogram::Record(double seconds) {
  int b = 0;
  while (b < kNumBuckets - 1 && seconds > kBounds[b]) ++b;
  ++counts[b];
  sum_seconds += seconds;
  ++count;
}

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(std::unique_ptr<ModelRunner> runner,
                                                       const EngineOptions& options) {
  if (options.max_running_samples < 1) {
    return absl::InvalidArgumentError("max running samples must be >= 1");
  }
  if (options.max_batch_tokens < runner->attention_split_size()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "max batch tokens (%d) must be at least the attention split size (%d), so that every "
        "prefill chunk can end on a split boundary",
        options.max_batch_tokens, runner->attention_split_size()));
  }
  if (options.max_batch_tokens < options.max_running_samples) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "max batch tokens (%d) must be at least max running samples (%d): every running "
        "sample decodes one token per step",
        options.max_batch_tokens, options.max_running_samples));
  }
  return std::unique_ptr<Engine>(new Engine(std::move(runner), options));
}

Engine::Engine(std::unique_ptr<ModelRunner> runner, const EngineOptions& options)
    : options_(options),
      config_(runner->config()),
      backend_name_(runner->backend_name()),
      kv_block_size_(runner->kv_block_size()),
      split_size_(runner->attention_split_size()),
      num_kv_blocks_(runner->num_kv_blocks()),
      weight_specs_(runner->weight_specs()),
      runner_(std::move(runner)),
      blocks_(num_kv_blocks_, kv_block_size_),
      cache_(&blocks_, options.prefix_cache),
      scheduler_(
          SchedulerOptions{options.max_running_samples, options.max_batch_tokens, split_size_,
                           options.admission,
                           std::min<int64_t>(config_.max_position_embeddings,
                                             int64_t{num_kv_blocks_} * kv_block_size_)},
          &blocks_, &cache_, options.weight_version),
      version_(options.weight_version),
      published_version_(options.weight_version) {
  PublishCounters();
  thread_ = std::thread([this] { Loop(); });
}

Engine::~Engine() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
  delivery_.WaitIdle();  // the final completions reach their sinks while the engine still exists
}

int64_t Engine::max_context() const {
  return std::min<int64_t>(config_.max_position_embeddings,
                           static_cast<int64_t>(num_kv_blocks_) * kv_block_size_);
}

absl::Status Engine::Validate(const SampleSpec& spec) const {
  const SamplingParams& p = spec.params;
  const int32_t vocab = config_.vocab_size;
  if (spec.prompt.empty()) {
    return absl::InvalidArgumentError("prompt_token_ids is empty; give at least one token");
  }
  for (size_t i = 0; i < spec.prompt.size(); ++i) {
    if (spec.prompt[i] < 0 || spec.prompt[i] >= vocab) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "prompt_token_ids[%d] = %d is outside the vocabulary [0, %d)", i, spec.prompt[i], vocab));
    }
  }
  if (spec.score_start != 0) {
    const int64_t n = static_cast<int64_t>(spec.prompt.size());
    if (spec.score_start < 1 || spec.score_start >= n) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "start = %d; it must be in [1, %d): at least one token precedes and one is scored",
          spec.score_start, n));
    }
    if (n > max_context()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "token_ids has %d tokens, beyond the maximum context of %d", n, max_context()));
    }
  } else if (p.max_new_tokens < 1) {
    return absl::InvalidArgumentError("sampling.max_new_tokens must be >= 1");
  }
  const int64_t total =
      static_cast<int64_t>(spec.prompt.size()) + (spec.score_start != 0 ? 0 : p.max_new_tokens);
  if (total > max_context()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "prompt (%d tokens) + sampling.max_new_tokens (%d) = %d exceeds the maximum context "
        "of %d tokens",
        spec.prompt.size(), p.max_new_tokens, total, max_context()));
  }
  if (!std::isfinite(p.temperature) || p.temperature < 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "sampling.temperature = %g; it must be finite and >= 0 (0 = greedy)", p.temperature));
  }
  if (p.top_k < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("sampling.top_k = %d; it must be >= 0 (0 = off)", p.top_k));
  }
  if (!(p.top_p > 0.0f && p.top_p <= 1.0f)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("sampling.top_p = %g; it must be in (0, 1]", p.top_p));
  }
  if (!(p.min_p >= 0.0f && p.min_p <= 1.0f)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("sampling.min_p = %g; it must be in [0, 1]", p.min_p));
  }
  for (size_t i = 0; i < p.stop_token_ids.size(); ++i) {
    if (p.stop_token_ids[i] < 0 || p.stop_token_ids[i] >= vocab) {
      return absl::InvalidArgumentError(
          absl::StrFormat("sampling.stop_token_ids[%d] = %d is outside the vocabulary [0, %d)", i,
                          p.stop_token_ids[i], vocab));
    }
  }
  if (p.top_logprobs < 0 || p.top_logprobs > kMaxTopLogprobs) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "sampling.top_logprobs = %d; at most %d are returned", p.top_logprobs, kMaxTopLogprobs));
  }
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> Engine::Submit(std::vector<SampleSpec> samples, EventSink sink) {
  if (samples.empty()) return absl::InvalidArgumentError("no samples to generate");
  for (const SampleSpec& spec : samples) {
    if (absl::Status s = Validate(spec); !s.ok()) return s;
  }
  uint64_t job_id;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_) return absl::UnavailableError("the engine is shutting down");
    job_id = next_job_id_++;
    unfinished_samples_ += static_cast<int64_t>(samples.size());
    inbox_.push_back(Submission{job_id, std::move(samples), std::move(sink)});
  }
  cv_.notify_all();
  return job_id;
}

void Engine::Abort(uint64_t job_id, std::optional<int32_t> rollout_index) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    aborts_.push_back(AbortOrder{job_id, rollout_index});
  }
  cv_.notify_all();
}

void Engine::AbortAll() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    aborts_.push_back(AbortOrder{});
  }
  cv_.notify_all();
}

void Engine::FlushCache(std::function<void(FlushResult)> done) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    flushes_.push_back(std::move(done));
  }
  cv_.notify_all();
}

void Engine::UpdateWeights(WeightUpdate update, std::function<void(UpdateResult)> done,
                           std::function<bool()> cancelled) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    updates_.push_back(PendingUpdate{std::move(update), std::move(done), std::move(cancelled)});
  }
  cv_.notify_all();
}

bool Engine::Pause(bool abort_in_flight) {
  bool was;
  {
    std::lock_guard<std::mutex> lock(mu_);
    was = paused_;
    paused_ = true;
    if (abort_in_flight) aborts_.push_back(AbortOrder{});
  }
  cv_.notify_all();
  return was;
}

bool Engine::Resume() {
  bool was;
  {
    std::lock_guard<std::mutex> lock(mu_);
    was = paused_;
    paused_ = false;
  }
  cv_.notify_all();
  return was;
}

bool Engine::paused() const {
  std::lock_guard<std::mutex> lock(mu_);
  return paused_;
}

std::string Engine::weight_version() const {
  std::lock_guard<std::mutex> lock(mu_);
  return published_version_;
}

void Engine::ProcessUpdates(std::vector<PendingUpdate> updates, StepEvents* events) {
  for (PendingUpdate& pending : updates) {
    if (DropIfCancelled(&pending)) continue;
    if (draining_.has_value()) {
      Reply(pending.done, FailedUpdate(absl::AbortedError(absl::StrFormat(
                              "weight update to '%s' is still draining; one update at a time",
                              draining_->update.version))));
      continue;
    }
    switch (pending.update.policy) {
      case UpdatePolicy::kAbort: {
        int32_t aborted = 0;
        for (const auto& [job_id, job] : jobs_) {
          for (const auto& seq : job.sequences) aborted += !seq->finished;
          AbortJob(job_id, std::nullopt, events);
        }
        // The aborted samples' completions reach their streams before the update's reply.
        PublishCounters();
        Deliver(events);
        ApplyUpdate(std::move(pending), aborted);
        break;
      }
      case UpdatePolicy::kContinue:
        ApplyUpdate(std::move(pending), 0);
        break;
      case UpdatePolicy::kDrain: {
        bool paused;
        {
          std::lock_guard<std::mutex> lock(mu_);
          paused = paused_;
        }
        if (paused && !scheduler_.idle()) {
          Reply(pending.done,
                FailedUpdate(absl::FailedPreconditionError(absl::StrFormat(
                    "the server is paused with %d samples in flight, which DRAIN cannot finish; "
                    "resume first, or update with policy ABORT or CONTINUE",
                    scheduler_.num_running() + scheduler_.num_waiting()))));
          break;
        }
        draining_ = std::move(pending);
        break;
      }
    }
  }
  if (!draining_.has_value()) return;
  // A cancelled DRAIN update stops holding new work at once, not when the old work ends.
  const bool cancelled = DropIfCancelled(&*draining_);
  if (cancelled || scheduler_.idle()) {
    PendingUpdate pending = *std::move(draining_);
    draining_.reset();
    if (!cancelled) ApplyUpdate(std::move(pending), 0);
    std::vector<Submission> held;
    held.swap(held_);
    for (Submission& s : held) Admit(std::move(s));
  }
}

bool Engine::DropIfCancelled(PendingUpdate* pending) {
  if (!pending->cancelled || !pending->cancelled()) return false;
  UpdateResult result;
  result.status = absl::CancelledError(absl::StrFormat(
      "the update to '%s' was cancelled by its caller before the swap; nothing was applied",
      pending->update.version));
  result.previous_version = version_;
  Reply(pending->done, std::move(result));
  return true;
}

void Engine::Reply(const std::function<void(UpdateResult)>& done, UpdateResult result) {
  delivery_.WaitIdle();  // replies come after the events of earlier steps
  done(std::move(result));
}

void Engine::ApplyUpdate(PendingUpdate pending, int32_t aborted_samples) {
  UpdateResult result;
  result.previous_version = version_;
  result.aborted_samples = aborted_samples;
  const auto start = std::chrono::steady_clock::now();
  result.status = runner_->UpdateWeights(pending.update.tensors);
  if (result.status.ok()) {
    ++weight_updates_;
    last_update_seconds_ =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    version_ = pending.update.version;
    scheduler_.set_cache_version(version_);
    // KV of the old weights must never serve the new ones; pages still used by running
    // samples (CONTINUE) are detached and freed when those end.
    cache_.Flush();
    std::lock_guard<std::mutex> lock(mu_);
    published_version_ = version_;
    LOG(INFO) << "weights updated: " << result.previous_version << " -> " << version_ << " ("
              << pending.update.tensors.size() << " tensors)";
  }
  Reply(pending.done, std::move(result));
}

int64_t Engine::unfinished_samples() const {
  std::lock_guard<std::mutex> lock(mu_);
  return unfinished_samples_;
}

EngineCounters Engine::counters() const {
  std::lock_guard<std::mutex> lock(mu_);
  return counters_;
}

void Engine::PublishCounters() {
  EngineCounters c;
  c.running = static_cast<int32_t>(scheduler_.num_running());
  c.waiting = static_cast<int32_t>(scheduler_.num_waiting());
  c.kv_blocks_free = blocks_.num_free();
  c.kv_blocks_total = blocks_.num_total();
  c.generated_tokens = generated_tokens_;
  c.prefilled_tokens = prefilled_tokens_;
  c.steps = steps_;
  c.lookahead_steps = lookahead_steps_;
  c.preemptions = scheduler_.num_preemptions();
  c.recomputed_tokens = scheduler_.num_recomputed_tokens();
  c.kv_blocks_cached = cache_.num_cached_blocks();
  c.prompt_tokens = scheduler_.num_prompt_tokens();
  c.cache_hit_tokens = scheduler_.num_cache_hit_tokens();
  c.scored_tokens = scored_tokens_;
  c.prefill_steps = prefill_steps_;
  c.decode_steps = decode_steps_;
  c.weight_updates = weight_updates_;
  c.last_update_seconds = last_update_seconds_;
  std::lock_guard<std::mutex> lock(mu_);
  c.unfinished_samples = unfinished_samples_;
  counters_ = c;
}

void Engine::Loop() {
  for (;;) {
    std::vector<Submission> submissions;
    std::vector<AbortOrder> aborts;
    std::vector<std::function<void(FlushResult)>> flushes;
    std::vector<PendingUpdate> updates;
    bool stop, paused;
    {
      std::unique_lock<std::mutex> lock(mu_);
      const bool busy = !scheduler_.idle() || launched_.has_value();
      // Paused with a launched step: wake to collect it (its results are delivered).
      auto ready = [&] {
        return stop_ || (busy && !paused_) || (paused_ && launched_.has_value()) ||
               !inbox_.empty() || !aborts_.empty() || !flushes_.empty() || !updates_.empty();
      };
      if (draining_.has_value()) {
        // A waiting DRAIN update's caller may cancel while the engine has nothing else to do
        // (paused, say): its predicate is looked at again at least every 50 ms.
        cv_.wait_for(lock, std::chrono::milliseconds(50), ready);
      } else {
        cv_.wait(lock, ready);
      }
      submissions.swap(inbox_);
      aborts.swap(aborts_);
      flushes.swap(flushes_);
      updates.swap(updates_);
      stop = stop_;
      paused = paused_;
    }
    StepEvents events;
    // Whatever changes the engine's state waits for the launched step (its sequences' results).
    if (!submissions.empty() || !aborts.empty() || !flushes.empty() || !updates.empty() || stop ||
        paused) {
      DrainLaunched(&events);
    }
    // Updates first: a submission that raced an update into this iteration runs after it.
    ProcessUpdates(std::move(updates), &events);
    for (Submission& s : submissions) {
      // While a DRAIN update waits, new work waits behind it, so it runs on the new weights.
      if (draining_.has_value()) {
        held_.push_back(std::move(s));
      } else {
        Admit(std::move(s));
      }
    }
    for (const AbortOrder& order : aborts) {
      if (order.job_id.has_value()) {
        AbortJob(*order.job_id, order.rollout_index, &events);
      } else {
        for (const auto& [job_id, job] : jobs_) AbortJob(job_id, std::nullopt, &events);
      }
    }
    if (!flushes.empty()) {
      const FlushResult r = cache_.Flush();
      // Counters first, so a caller that reads them after the reply sees the flush.
      PublishCounters();
      delivery_.WaitIdle();  // replies come after the events of earlier steps
      for (auto& done : flushes) done(r);
    }
    if (stop) {
      for (Submission& s : held_) Admit(std::move(s));
      held_.clear();
      if (draining_.has_value()) {
        Reply(draining_->done, FailedUpdate(absl::UnavailableError("the server is shutting down")));
        draining_.reset();
      }
      for (const auto& [job_id, job] : jobs_) AbortJob(job_id, std::nullopt, &events);
      PublishCounters();
      Deliver(&events);
      return;
    }
    if (!paused && (!scheduler_.idle() || launched_.has_value())) Step(&events);
    // A DRAIN update may have become ready (or been cancelled) in this step.
    if (draining_.has_value()) ProcessUpdates({}, &events);
    // Counters first: a caller that has seen an event sees the state that produced it.
    PublishCounters();
    Deliver(&events);
  }
}

void Engine::Admit(Submission submission) {
  Job& job = jobs_[submission.job_id];
  job.sink = std::move(submission.sink);
  for (SampleSpec& spec : submission.samples) {
    auto seq = std::make_unique<Sequence>();
    seq->arrival = next_arrival_++;
    seq->job_id = submission.job_id;
    seq->rollout_index = spec.rollout_index;
    seq->sample_index = spec.sample_index;
    seq->params = std::move(spec.params);
    seq->sample_seed = spec.sample_seed;
    seq->prompt_len = static_cast<int64_t>(spec.prompt.size());
    seq->tokens = std::move(spec.prompt);
    seq->score_start = spec.score_start;
    scheduler_.Add(seq.get());
    job.sequences.push_back(std::move(seq));
  }
  job.num_unfinished = job.sequences.size();
}

void Engine::Step(StepEvents* events) {
  if (!launched_.has_value()) {
    std::vector<ScheduledChunk> scheduled = scheduler_.Schedule();
    if (scheduled.empty()) return;
    std::vector<LaunchedStep::Chunk> chunks;
    chunks.reserve(scheduled.size());
    for (const ScheduledChunk& c : scheduled) {
      Sequence* seq = c.seq;
      // A scoring sequence wants the rows that predict each scored token; a generating one the
      // row of its last token, once its prefill is complete.
      int64_t from = c.end - 1, to = c.wants_logits() ? c.end : from;
      if (seq->is_score()) {
        from = std::max(c.begin, seq->score_start - 1);
        to = std::min(c.end, seq->num_tokens() - 1);
      }
      chunks.push_back({seq, c.begin, c.end, 0, std::max<int64_t>(0, to - from), from});
    }
    launched_ = Launch(std::move(chunks), events);
    if (!launched_.has_value()) return;
  }
  std::optional<LaunchedStep> next;
  if (LookaheadReady(*launched_)) next = LaunchLookahead(*launched_);
  LaunchedStep current = std::move(*launched_);
  launched_ = std::move(next);  // Complete drops the rows of sequences that finish now
  Complete(std::move(current), events);
  // A step launched ahead runs on the device from here on: its duration counts from now.
  if (launched_.has_value()) launched_->start = std::chrono::steady_clock::now();
}

std::optional<Engine::LaunchedStep> Engine::Launch(std::vector<LaunchedStep::Chunk> chunks,
                                                   StepEvents* events) {
  LaunchedStep step;
  step.chunks = std::move(chunks);
  ForwardBatch& batch = batch_;
  batch.token_ids.clear();
  batch.positions.clear();
  batch.token_seq.clear();
  batch.logit_rows.clear();
  batch.fed_tokens.clear();
  // One block table per chunk (each chunk is a distinct sequence), assigned in place.
  batch.block_tables.resize(step.chunks.size());
  int64_t num_rows = 0;
  for (size_t c = 0; c < step.chunks.size(); ++c) {
    LaunchedStep::Chunk& chunk = step.chunks[c];
    Sequence* seq = chunk.seq;
    const bool decode = chunk.end - chunk.begin == 1 && seq->num_generated() > 0;
    if (!decode) {
      prefilled_tokens_ += chunk.end - chunk.begin;
      step.has_prefill = true;
    }
    chunk.first_row = num_rows;
    num_rows += chunk.num_rows;
    batch.block_tables[c].assign(seq->block_table.begin(), seq->block_table.end());
    const int64_t first_token = batch.num_tokens();
    if (chunk.fed_row.has_value()) {
      batch.fed_tokens.push_back(
          {static_cast<int32_t>(first_token), static_cast<int32_t>(*chunk.fed_row)});
    }
    for (int64_t pos = chunk.begin; pos < chunk.end; ++pos) {
      const bool fed = pos == chunk.begin && chunk.fed_row.has_value();
      batch.token_ids.push_back(fed ? 0 : seq->tokens[pos]);
      batch.positions.push_back(static_cast<int32_t>(pos));
      batch.token_seq.push_back(static_cast<int32_t>(c));
    }
    for (int64_t pos = chunk.first_position; pos < chunk.first_position + chunk.num_rows; ++pos) {
      batch.logit_rows.push_back(static_cast<int32_t>(first_token + pos - chunk.begin));
    }
    // One task per logits row, in row order: the next token of each finished chunk, or the
    // scored tokens of a scoring sequence.
    for (int64_t r = 0; r < chunk.num_rows; ++r) {
      LogitsRowTask task;
      task.params = &seq->params;
      task.sample_seed = seq->sample_seed;
      // The absolute position of the new token (a scoring sequence: its end, as ever).
      task.position = seq->is_score() ? seq->num_tokens() : chunk.end;
      if (seq->is_score()) task.score_token = seq->tokens[chunk.first_position + r + 1];
      step.tasks.push_back(task);
    }
  }
  ++steps_;
  step.start = std::chrono::steady_clock::now();
  if (absl::Status s = runner_->LaunchStep(batch, step.tasks); !s.ok()) {
    // Not reachable with validated input; fail the step's samples rather than the process.
    LOG(ERROR) << "launching a step failed, aborting its samples: " << s;
    if (events != nullptr) {
      for (const LaunchedStep::Chunk& chunk : step.chunks) {
        if (!chunk.seq->finished) Report(chunk.seq, FinishReason::kAbort, events);
      }
    }
    return std::nullopt;
  }
  return step;
}

bool Engine::LookaheadReady(const LaunchedStep& step) {
  if (!options_.decode_lookahead || draining_.has_value() || !held_.empty() ||
      (!runner_->LaunchesAsync() && !options_.lookahead_on_synchronous_runners)) {
    return false;
  }
  size_t alive = 0;
  std::vector<LogitsRowTask> tasks;  // of the live chunks (a dead chunk's params are gone)
  tasks.reserve(step.tasks.size());
  for (const LaunchedStep::Chunk& chunk : step.chunks) {
    if (chunk.seq == nullptr) continue;
    ++alive;
    tasks.insert(tasks.end(), step.tasks.begin() + chunk.first_row,
                 step.tasks.begin() + chunk.first_row + chunk.num_rows);
    const Sequence& seq = *chunk.seq;
    // Decode chunks of generating sequences only, each the sequence's next token.
    if (seq.is_score() || chunk.num_rows != 1 || chunk.end - chunk.begin != 1 ||
        seq.num_generated() == 0 || chunk.end != seq.num_tokens()) {
      return false;
    }
  }
  // Every running sequence is in the step, and none waits that the scheduler would admit.
  if (alive != scheduler_.num_running() ||
      (scheduler_.num_waiting() > 0 &&
       static_cast<int32_t>(scheduler_.num_running()) < options_.max_running_samples)) {
    return false;
  }
  if (!runner_->CanFeed(tasks)) return false;
  std::lock_guard<std::mutex> lock(mu_);
  return inbox_.empty() && aborts_.empty() && flushes_.empty() && updates_.empty() && !paused_ &&
         !stop_;
}

std::optional<Engine::LaunchedStep> Engine::LaunchLookahead(const LaunchedStep& step) {
  std::vector<LaunchedStep::Chunk> chunks;
  chunks.reserve(step.chunks.size());
  for (const LaunchedStep::Chunk& chunk : step.chunks) {
    Sequence* seq = chunk.seq;
    if (seq == nullptr) continue;
    // After `step`, seq has one more token (at position chunk.end); it finishes there by
    // length, or it decodes that token next.
    if (seq->num_generated() + 1 >= seq->params.max_new_tokens ||
        seq->num_tokens() + 1 >= max_context()) {
      continue;
    }
    const int64_t pos = chunk.end;
    if (!scheduler_.Reserve(pos + 1, seq)) return std::nullopt;
    chunks.push_back({seq, pos, pos + 1, 0, 1, pos, /*fed_row=*/chunk.first_row});
  }
  if (chunks.empty()) return std::nullopt;
  std::optional<LaunchedStep> next = Launch(std::move(chunks), /*events=*/nullptr);
  if (next.has_value()) ++lookahead_steps_;
  return next;
}

void Engine::Complete(LaunchedStep step, StepEvents* events) {
  std::vector<SampleResult> results;
  if (absl::Status s = runner_->CollectStep(&results); !s.ok()) {
    LOG(ERROR) << "a step failed, aborting its samples: " << s;
    for (const LaunchedStep::Chunk& chunk : step.chunks) {
      if (chunk.seq != nullptr && !chunk.seq->finished) {
        Report(chunk.seq, FinishReason::kAbort, events);
      }
    }
    results.clear();
  } else {
    for (const LaunchedStep::Chunk& chunk : step.chunks) {
      Sequence* seq = chunk.seq;
      if (seq == nullptr || seq->finished) continue;
      seq->num_computed = chunk.end;
      scheduler_.CachePages(seq);
      SampleResult* first = results.data() + chunk.first_row;
      if (seq->is_score()) {
        for (int64_t r = 0; r < chunk.num_rows; ++r) {
          seq->logprobs.push_back(first[r].logprob);
          if (seq->params.top_logprobs > 0) seq->top_logprobs.push_back(std::move(first[r].top));
          ++scored_tokens_;
        }
        if (seq->num_computed == seq->num_tokens()) Report(seq, FinishReason::kLength, events);
        continue;
      }
      if (chunk.num_rows == 0) continue;
      SampleResult& result = *first;
      seq->tokens.push_back(result.token);
      seq->logprobs.push_back(result.logprob);
      if (seq->params.top_logprobs > 0) seq->top_logprobs.push_back(std::move(result.top));
      const int32_t index = static_cast<int32_t>(seq->num_generated() - 1);
      if (seq->version_spans.empty() || seq->version_spans.back().version != version_) {
        seq->version_spans.push_back(VersionSpan{version_, index, index});
      } else {
        seq->version_spans.back().last_token = index;
      }
      ++generated_tokens_;
      std::optional<FinishReason> reason;
      if (IsStop(*seq, result.token, config_)) {
        reason = FinishReason::kStop;
      } else if (seq->num_generated() >= seq->params.max_new_tokens ||
                 seq->num_tokens() >= max_context()) {
        reason = FinishReason::kLength;
      }
      Report(seq, reason, events);
    }
  }
  // The launched step after this one computed a row for every sequence of this one: drop the
  // rows of those that finished (their Sequence goes with its job).
  if (launched_.has_value()) {
    for (LaunchedStep::Chunk& chunk : launched_->chunks) {
      if (chunk.seq != nullptr && chunk.seq->finished) chunk.seq = nullptr;
    }
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - step.start).count();
  (step.has_prefill ? prefill_steps_ : decode_steps_).Record(seconds);
}

void Engine::DrainLaunched(StepEvents* events) {
  if (!launched_.has_value()) return;
  LaunchedStep step = std::move(*launched_);
  launched_.reset();
  Complete(std::move(step), events);
}

void Engine::Report(Sequence* seq, std::optional<FinishReason> reason, StepEvents* events) {
  const int64_t from = seq->num_reported;
  const int64_t to = seq->num_generated();
  seq->num_reported = to;
  if (!reason.has_value() && seq->params.top_logprobs == 0) {
    // Streamed tokens only: copied flat, made into an event on the delivery thread.
    if (to == from) return;
    if (events->tokens.empty()) {
      events->tokens.reserve(scheduler_.num_running() + 1);
      events->logprobs.reserve(scheduler_.num_running() + 1);
    }
    StepEvents::Entry entry;
    entry.rollout_index = seq->rollout_index;
    entry.sample_index = seq->sample_index;
    entry.begin = static_cast<uint32_t>(events->tokens.size());
    entry.count = static_cast<uint32_t>(to - from);
    events->tokens.insert(events->tokens.end(), seq->tokens.begin() + seq->prompt_len + from,
                          seq->tokens.end());
    events->logprobs.insert(events->logprobs.end(), seq->logprobs.begin() + from,
                            seq->logprobs.end());
    std::vector<StepEvents::Entry>& entries = events->jobs[seq->job_id].entries;
    // A step reports each running sequence at most once: room for all of them at the first.
    if (entries.empty()) entries.reserve(scheduler_.num_running() + 1);
    entries.push_back(entry);
    return;
  }
  SampleEvent event;
  event.rollout_index = seq->rollout_index;
  event.sample_index = seq->sample_index;
  event.new_token_ids.assign(seq->tokens.begin() + seq->prompt_len + from, seq->tokens.end());
  event.new_logprobs.assign(seq->logprobs.begin() + from, seq->logprobs.end());
  if (seq->params.top_logprobs > 0) {
    event.new_top_logprobs.assign(seq->top_logprobs.begin() + from, seq->top_logprobs.end());
  }
  if (reason.has_value()) {
    seq->finished = true;
    scheduler_.Remove(seq);
    SampleCompletion c;
    c.finish_reason = *reason;
    c.token_ids.assign(seq->tokens.begin() + seq->prompt_len, seq->tokens.end());
    c.logprobs = std::move(seq->logprobs);
    c.top_logprobs = std::move(seq->top_logprobs);
    c.sample_seed = seq->sample_seed;
    c.cached_prompt_tokens = static_cast<int32_t>(seq->cached_prompt_tokens.value_or(0));
    c.weight_version = version_;
    c.version_spans = std::move(seq->version_spans);
    event.completion = std::move(c);
    Job& job = jobs_.at(seq->job_id);
    --job.num_unfinished;
    std::lock_guard<std::mutex> lock(mu_);
    --unfinished_samples_;
  }
  if (event.new_token_ids.empty() && !event.completion.has_value()) return;
  StepEvents::JobEvents& job_events = events->jobs[seq->job_id];
  StepEvents::Entry entry;
  entry.rollout_index = event.rollout_index;
  entry.sample_index = event.sample_index;
  entry.built = static_cast<int32_t>(job_events.built.size());
  job_events.built.push_back(std::move(event));
  job_events.entries.push_back(entry);
}

void Engine::AbortJob(uint64_t job_id, std::optional<int32_t> rollout_index, StepEvents* events) {
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return;
  for (auto& seq : it->second.sequences) {
    if (seq->finished) continue;
    if (rollout_index.has_value() && seq->rollout_index != *rollout_index) continue;
    Report(seq.get(), FinishReason::kAbort, events);
  }
}

void Engine::Deliver(StepEvents* events) {
  if (events->empty()) return;
  // One closure per step: the sinks of its jobs in job order (a job's events stay in order
  // because the delivery thread runs closures in the order they were posted).
  std::vector<std::pair<EventSink, StepEvents::JobEvents>> deliveries;
  for (auto& [job_id, job_events] : events->jobs) {
    auto it = jobs_.find(job_id);
    CHECK(it != jobs_.end());
    if (it->second.num_unfinished == 0) {
      deliveries.emplace_back(std::move(it->second.sink), std::move(job_events));
      jobs_.erase(it);
    } else {
      deliveries.emplace_back(it->second.sink, std::move(job_events));
    }
  }
  delivery_.Post([deliveries = std::move(deliveries), tokens = std::move(events->tokens),
                  logprobs = std::move(events->logprobs)]() mutable {
    for (auto& [sink, job_events] : deliveries) {
      std::vector<SampleEvent> out(job_events.entries.size());
      for (size_t i = 0; i < out.size(); ++i) {
        const StepEvents::Entry& entry = job_events.entries[i];
        if (entry.built >= 0) {
          out[i] = std::move(job_events.built[entry.built]);
          continue;
        }
        out[i].rollout_index = entry.rollout_index;
        out[i].sample_index = entry.sample_index;
        out[i].new_token_ids.assign(tokens.begin() + entry.begin,
                                    tokens.begin() + entry.begin + entry.count);
        out[i].new_logprobs.assign(logprobs.begin() + entry.begin,
                                   logprobs.begin() + entry.begin + entry.count);
      }
      sink(std::move(out));
    }
  });
  *events = StepEvents();
}

}  // namespace rollout
