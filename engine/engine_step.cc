#include <algorithm>
#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"
#include "engine/engine_internal.h"
#include "glog/logging.h"

namespace rollout {
namespace engine_internal {
namespace {

// SampleCompletion::abort_cause of a step's samples when its launch or collection fails.
constexpr char kFailedStepCause[] = "a failed step (the server's log says why)";

bool IsStop(const Sequence& seq, int32_t token, const ModelConfig& config) {
  const SamplingParams& p = seq.params;
  if (std::find(p.stop_token_ids.begin(), p.stop_token_ids.end(), token) !=
      p.stop_token_ids.end()) {
    return true;
  }
  return !p.ignore_eos && std::find(config.eos_token_ids.begin(), config.eos_token_ids.end(),
                                    token) != config.eos_token_ids.end();
}

// One task per logits row of `chunk`, in row order: the next token of a chunk that reaches its
// sequence's end, or the scored tokens of a scoring sequence.
void AppendRowTasks(const LaunchedStep::Chunk& chunk, std::vector<LogitsRowTask>* tasks) {
  const Sequence* seq = chunk.seq;
  for (int64_t r = 0; r < chunk.num_rows; ++r) {
    LogitsRowTask task;
    task.params = &seq->params;
    task.sample_seed = seq->sample_seed;
    // The absolute position of the new token (a scoring sequence: its end, as ever).
    task.position = seq->is_score() ? seq->num_tokens() : chunk.end;
    if (seq->is_score()) task.score_token = seq->tokens[chunk.first_position + r + 1];
    tasks->push_back(task);
  }
}

double SecondsBetween(std::chrono::steady_clock::time_point from,
                      std::chrono::steady_clock::time_point to) {
  return std::chrono::duration<double>(to - from).count();
}

}  // namespace

void EngineCore::Step(StepEvents* events) {
  if (!launched_.has_value()) {
    std::vector<LaunchedStep::Chunk> chunks = ScheduleChunks();
    if (chunks.empty()) return;
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

std::vector<LaunchedStep::Chunk> EngineCore::ScheduleChunks() {
  std::vector<ScheduledChunk> scheduled = scheduler_.Schedule();
  std::vector<LaunchedStep::Chunk> chunks;
  chunks.reserve(scheduled.size());
  std::optional<std::chrono::steady_clock::time_point> now;  // read once, if a sequence starts
  for (const ScheduledChunk& c : scheduled) {
    Sequence* seq = c.seq;
    if (!seq->scheduled) {
      seq->scheduled = true;
      if (!now.has_value()) now = std::chrono::steady_clock::now();
      if (!seq->is_score()) queue_time_.Record(SecondsBetween(seq->submitted, *now));
    }
    // A scoring sequence wants the rows that predict each scored token; a generating one the
    // row of its last token, once its prefill is complete.
    int64_t from = c.end - 1, to = c.wants_logits() ? c.end : from;
    if (seq->is_score()) {
      from = std::max(c.begin, seq->score_start - 1);
      to = std::min(c.end, seq->num_tokens() - 1);
    }
    chunks.push_back(
        {seq, c.begin, c.end, 0, std::max<int64_t>(0, to - from), from, /*fed_row=*/std::nullopt});
  }
  return chunks;
}

std::optional<LaunchedStep> EngineCore::Launch(std::vector<LaunchedStep::Chunk> chunks,
                                               StepEvents* events) {
  LaunchedStep step;
  step.chunks = std::move(chunks);
  BuildBatch(&step);
  ++steps_;
  step.start = std::chrono::steady_clock::now();
  if (absl::Status s = runner_->LaunchStep(batch_, step.tasks); !s.ok()) {
    // Not reachable with validated input; fail the step's samples rather than the process.
    LOG(ERROR) << "launching a step failed, aborting its samples: " << s;
    if (events != nullptr) {
      for (const LaunchedStep::Chunk& chunk : step.chunks) {
        if (!chunk.seq->finished) {
          chunk.seq->abort_cause = kFailedStepCause;
          Report(chunk.seq, FinishReason::kAbort, events);
        }
      }
    }
    NoteFailedStep();
    return std::nullopt;
  }
  return step;
}

void EngineCore::NoteFailedStep() {
  const absl::Status usable = runner_->Usable();
  if (usable.ok()) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!unusable_.empty()) return;
    unusable_ = absl::StrCat("the model runner cannot run steps any more (", usable.message(),
                             "): restart the server");
    // Every queued and running sample ends (aborted).
    inbox_.aborts.push_back(AbortOrder{{}, {}, unusable_});
  }
  cv_.notify_all();
  LOG(ERROR) << "the model runner is unusable, ending every sample: " << usable;
  if (options_.on_runner_unusable) options_.on_runner_unusable(usable);
}

void EngineCore::BuildBatch(LaunchedStep* step) {
  ForwardBatch& batch = batch_;
  batch.token_ids.clear();
  batch.positions.clear();
  batch.token_seq.clear();
  batch.logit_rows.clear();
  batch.fed_tokens.clear();
  batch.forced_routing.clear();
  batch.return_routing = false;
  bool any_forced = false;
  for (const LaunchedStep::Chunk& chunk : step->chunks) {
    any_forced = any_forced || !chunk.seq->forced_routing.empty();
    batch.return_routing = batch.return_routing || chunk.seq->return_routing;
  }
  const int64_t routing_size = config_.RoutingSize();
  // One block table per chunk (each chunk is a distinct sequence), assigned in place.
  batch.block_tables.resize(step->chunks.size());
  int64_t num_rows = 0;
  for (size_t c = 0; c < step->chunks.size(); ++c) {
    LaunchedStep::Chunk& chunk = step->chunks[c];
    Sequence* seq = chunk.seq;
    const bool decode = chunk.end - chunk.begin == 1 && seq->num_generated() > 0;
    if (!decode) {
      prefilled_tokens_ += chunk.end - chunk.begin;
      step->has_prefill = true;
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
      if (!any_forced) continue;
      // The row at `pos` predicts token pos + 1: scored token pos + 1 - score_start.
      std::vector<int32_t>& forced = batch.forced_routing.emplace_back();
      if (!seq->forced_routing.empty()) {
        const int64_t scored = pos + 1 - seq->score_start;
        forced.assign(seq->forced_routing.begin() + scored * routing_size,
                      seq->forced_routing.begin() + (scored + 1) * routing_size);
      }
    }
    AppendRowTasks(chunk, &step->tasks);
  }
}

bool EngineCore::LookaheadReady(const LaunchedStep& step) {
  if (!options_.decode_lookahead || draining_.has_value() || !held_.empty() ||
      (!runner_->LaunchesAsync() && !options_.lookahead_on_synchronous_runners)) {
    return false;
  }
  size_t alive = 0;
  bool ends_by_length = false;  // a sequence of the step ends with its token (frees its KV)
  std::vector<LogitsRowTask> tasks;  // of the live chunks (a dead chunk's params are gone)
  tasks.reserve(step.tasks.size());
  for (const LaunchedStep::Chunk& chunk : step.chunks) {
    if (chunk.seq == nullptr) continue;
    ++alive;
    ends_by_length = ends_by_length || EndsByLengthAfter(*chunk.seq);
    tasks.insert(tasks.end(), step.tasks.begin() + chunk.first_row,
                 step.tasks.begin() + chunk.first_row + chunk.num_rows);
    const Sequence& seq = *chunk.seq;
    // Decode chunks of generating sequences only, each the sequence's next token.
    if (seq.is_score() || chunk.num_rows != 1 || chunk.end - chunk.begin != 1 ||
        seq.num_generated() == 0 || chunk.end != seq.num_tokens()) {
      return false;
    }
  }
  // Every running sequence is in the step, and none waits that the next schedule would admit:
  // nothing waits, or the head of the queue does not fit (KV-bound long generations: a full
  // pool with samples queued) and no sequence of the step ends by length, freeing its KV for
  // the next schedule. (One that stops on a sampled token frees it too; the admission it allows
  // then comes a step later, as for a sample that arrives while a step is launched ahead.)
  // (Paused sequences are in no step: they do not keep the others from running ahead.)
  if (alive != static_cast<size_t>(scheduler_.num_unpaused_running())) return false;
  if (scheduler_.num_waiting() > 0 &&
      scheduler_.num_unpaused_running() < options_.max_running_samples) {
    if (ends_by_length || scheduler_.NextScheduleCouldAdmit()) return false;
  }
  if (!runner_->CanFeed(tasks)) return false;
  std::lock_guard<std::mutex> lock(mu_);
  return inbox_.empty() && !paused_ && !stop_;
}

std::optional<LaunchedStep> EngineCore::LaunchLookahead(const LaunchedStep& step) {
  std::vector<LaunchedStep::Chunk> chunks;
  chunks.reserve(step.chunks.size());
  for (const LaunchedStep::Chunk& chunk : step.chunks) {
    Sequence* seq = chunk.seq;
    if (seq == nullptr) continue;
    // After `step`, seq has one more token (at position chunk.end); it finishes there by
    // length, or it decodes that token next.
    if (EndsByLengthAfter(*seq)) continue;
    const int64_t pos = chunk.end;
    if (!scheduler_.Reserve(pos + 1, seq)) return std::nullopt;
    chunks.push_back({seq, pos, pos + 1, 0, 1, pos, /*fed_row=*/chunk.first_row});
  }
  if (chunks.empty()) return std::nullopt;
  std::optional<LaunchedStep> next = Launch(std::move(chunks), /*events=*/nullptr);
  if (next.has_value()) {
    ++lookahead_steps_;
    scheduler_.AdvanceNewTokenRatio();
  }
  return next;
}

bool EngineCore::EndsByLengthAfter(const Sequence& seq) const {
  return seq.num_generated() + 1 >= seq.params.max_new_tokens ||
         seq.num_tokens() + 1 >= max_context_;
}

void EngineCore::Complete(LaunchedStep step, StepEvents* events) {
  std::vector<SampleResult> results;
  if (absl::Status s = runner_->CollectStep(&results); !s.ok()) {
    LOG(ERROR) << "a step failed, aborting its samples: " << s;
    for (const LaunchedStep::Chunk& chunk : step.chunks) {
      if (chunk.seq != nullptr && !chunk.seq->finished) {
        chunk.seq->abort_cause = kFailedStepCause;
        Report(chunk.seq, FinishReason::kAbort, events);
      }
    }
    NoteFailedStep();
  } else {
    for (const LaunchedStep::Chunk& chunk : step.chunks) {
      Sequence* seq = chunk.seq;
      if (seq == nullptr || seq->finished) continue;
      seq->num_computed = chunk.end;
      scheduler_.CachePages(seq);
      SampleResult* rows = results.data() + chunk.first_row;
      // Every row seen, also those after the first of a scoring chunk (which ends it).
      for (int64_t r = 0; r < chunk.num_rows; ++r) nonfinite_logit_rows_ += rows[r].nonfinite;
      if (seq->is_score()) {
        ApplyScores(seq, rows, chunk.num_rows, events);
      } else if (chunk.num_rows > 0) {
        ApplyToken(seq, rows, events);
      }
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

void EngineCore::ApplyScores(Sequence* seq, SampleResult* rows, int64_t num_rows,
                             StepEvents* events) {
  for (int64_t r = 0; r < num_rows; ++r) {
    if (rows[r].nonfinite) {
      // One logprob per scored token so far, in order: this row's token follows them.
      EndOnNonFiniteLogits(seq, seq->score_start + static_cast<int64_t>(seq->logprobs.size()),
                           events);
      return;
    }
    seq->logprobs.push_back(rows[r].logprob);
    if (seq->params.top_logprobs > 0) seq->top_logprobs.push_back(std::move(rows[r].top));
    if (seq->return_routing) {
      seq->routing.insert(seq->routing.end(), rows[r].routing.begin(), rows[r].routing.end());
    }
    ++scored_tokens_;
  }
  if (seq->num_computed == seq->num_tokens()) Report(seq, FinishReason::kLength, events);
}

void EngineCore::ApplyToken(Sequence* seq, SampleResult* result, StepEvents* events) {
  if (result->nonfinite) {
    EndOnNonFiniteLogits(seq, seq->num_tokens(), events);
    return;
  }
  seq->tokens.push_back(result->token);
  seq->logprobs.push_back(result->logprob);
  if (seq->params.top_logprobs > 0) seq->top_logprobs.push_back(std::move(result->top));
  if (seq->return_routing) {
    seq->routing.insert(seq->routing.end(), result->routing.begin(), result->routing.end());
  }
  const int32_t index = static_cast<int32_t>(seq->num_generated() - 1);
  if (seq->version_spans.empty() || seq->version_spans.back().version != version_) {
    seq->version_spans.push_back(VersionSpan{version_, index, index});
  } else {
    seq->version_spans.back().last_token = index;
  }
  ++generated_tokens_;
  if (index == 0) {
    time_to_first_token_.Record(SecondsBetween(seq->submitted, std::chrono::steady_clock::now()));
  }
  std::optional<FinishReason> reason;
  if (IsStop(*seq, result->token, config_)) {
    reason = FinishReason::kStop;
  } else if (seq->num_generated() >= seq->params.max_new_tokens ||
             seq->num_tokens() >= max_context_) {
    reason = FinishReason::kLength;
  }
  Report(seq, reason, events);
}

void EngineCore::EndOnNonFiniteLogits(Sequence* seq, int64_t position, StepEvents* events) {
  // The row's token and logprobs are finite (NaN counts as -inf, sampler.h) but mean nothing;
  // a trainer must not see them as a distribution.
  const int64_t generated = position - seq->prompt_len;
  const std::string where =
      seq->is_score() ? absl::StrCat("token_ids[", position, "]")
                      : absl::StrCat("position ", position, " (generated token ", generated, ")");
  seq->abort_cause =
      absl::StrCat("the model's logits for ", where, " are not finite (NaN or Inf) under weight ",
                   "version '", version_, "': the weights may have diverged");
  seq->nonfinite_logits = true;
  const std::string sample =
      seq->is_score()
          ? absl::StrCat("Score job ", seq->job_id, ", sequences[", seq->rollout_index, "]")
          : absl::StrCat("Generate job ", seq->job_id, ", rollout ", seq->rollout_index, " sample ",
                         seq->sample_index);
  LOG(WARNING) << sample << " ends: " << seq->abort_cause;
  Report(seq, FinishReason::kAbort, events);
}

void EngineCore::CollectLaunched(StepEvents* events) {
  if (!launched_.has_value()) return;
  LaunchedStep step = std::move(*launched_);
  launched_.reset();
  Complete(std::move(step), events);
}

void EngineCore::Report(Sequence* seq, std::optional<FinishReason> reason, StepEvents* events) {
  const int64_t from = seq->num_reported;
  const int64_t to = seq->num_generated();
  seq->num_reported = to;
  if (!reason.has_value() && seq->params.top_logprobs == 0) {
    if (to > from) ReportStreamed(*seq, from, events);
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
  if (reason.has_value()) event.completion = Finish(seq, *reason);
  if (event.new_token_ids.empty() && !event.completion.has_value()) return;
  StepEvents::JobEvents& job_events = events->jobs[seq->job_id];
  StepEvents::Entry entry;
  entry.rollout_index = event.rollout_index;
  entry.sample_index = event.sample_index;
  entry.built = static_cast<uint32_t>(job_events.built.size());
  job_events.built.push_back(std::move(event));
  job_events.entries.push_back(entry);
}

void EngineCore::ReportStreamed(const Sequence& seq, int64_t from, StepEvents* events) {
  if (events->tokens.empty()) {
    events->tokens.reserve(scheduler_.num_running() + 1);
    events->logprobs.reserve(scheduler_.num_running() + 1);
  }
  StepEvents::Entry entry;
  entry.rollout_index = seq.rollout_index;
  entry.sample_index = seq.sample_index;
  entry.begin = static_cast<uint32_t>(events->tokens.size());
  entry.count = static_cast<uint32_t>(seq.num_generated() - from);
  events->tokens.insert(events->tokens.end(), seq.tokens.begin() + seq.prompt_len + from,
                        seq.tokens.end());
  events->logprobs.insert(events->logprobs.end(), seq.logprobs.begin() + from, seq.logprobs.end());
  std::vector<StepEvents::Entry>& entries = events->jobs[seq.job_id].entries;
  // A step reports each running sequence at most once: room for all of them at the first.
  if (entries.empty()) entries.reserve(scheduler_.num_running() + 1);
  entries.push_back(entry);
}

SampleCompletion EngineCore::Finish(Sequence* seq, FinishReason reason) {
  seq->finished = true;
  if (!seq->is_score() && reason != FinishReason::kAbort) {
    sample_time_.Record(SecondsBetween(seq->submitted, std::chrono::steady_clock::now()));
  }
  scheduler_.Remove(seq);
  SampleCompletion c;
  c.finish_reason = reason;
  c.token_ids.assign(seq->tokens.begin() + seq->prompt_len, seq->tokens.end());
  c.logprobs = std::move(seq->logprobs);
  c.top_logprobs = std::move(seq->top_logprobs);
  c.routing = std::move(seq->routing);
  c.sample_seed = seq->sample_seed;
  c.cached_prompt_tokens = static_cast<int32_t>(seq->cached_prompt_tokens.value_or(0));
  c.weight_version = version_;
  c.weight_digest = digest_;
  c.version_spans = std::move(seq->version_spans);
  if (reason == FinishReason::kAbort) {
    c.abort_cause = seq->abort_cause;
    c.nonfinite_logits = seq->nonfinite_logits;
  }
  Job& job = jobs_.at(seq->job_id);
  --job.num_unfinished;
  std::lock_guard<std::mutex> lock(mu_);
  --unfinished_samples_;
  return c;
}

}  // namespace engine_internal
}  // namespace rollout
