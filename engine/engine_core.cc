#include <chrono>
#include <utility>

#include "engine/engine_internal.h"
#include "glog/logging.h"

namespace rollout {
namespace engine_internal {
namespace {

// How often a waiting DRAIN update's `cancelled` is asked while the engine has nothing to step.
constexpr std::chrono::milliseconds kCancelPollInterval{50};

}  // namespace

EngineCore::EngineCore(std::unique_ptr<ModelRunner> runner, const EngineOptions& options,
                       int64_t max_context)
    : options_(options),
      config_(runner->config()),
      max_context_(max_context),
      runner_(std::move(runner)),
      blocks_(runner_->num_kv_blocks(), runner_->kv_block_size()),
      cache_(&blocks_, options.prefix_cache),
      scheduler_(SchedulerOptions{options.max_running_samples, options.max_batch_tokens,
                                  runner_->attention_split_size(), options.admission, max_context,
                                  !runner_->config().eos_token_ids.empty()},
                 &blocks_, &cache_, options.weight_version),
      version_(options.weight_version),
      tensor_digests_(options.weight_digests),
      digest_(WeightsDigest(runner_->weight_specs(), tensor_digests_)),
      published_version_(options.weight_version),
      published_digest_(digest_) {
  RememberServed();
  PublishCounters();
  thread_ = std::thread([this] { Loop(); });
}

EngineCore::~EngineCore() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
  delivery_.WaitIdle();  // the final completions reach their sinks while the engine still exists
}

absl::StatusOr<uint64_t> EngineCore::Submit(std::vector<SampleSpec> samples, EventSink sink) {
  uint64_t job_id;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_) return absl::UnavailableError("the engine is shutting down");
    if (!unusable_.empty()) return absl::UnavailableError(unusable_);
    job_id = next_job_id_++;
    unfinished_samples_ += static_cast<int64_t>(samples.size());
    inbox_.submissions.push_back(
        Submission{job_id, std::move(samples), std::move(sink), std::chrono::steady_clock::now()});
  }
  cv_.notify_all();
  return job_id;
}

void EngineCore::Abort(AbortOrder order) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    inbox_.aborts.push_back(order);
  }
  cv_.notify_all();
}

void EngineCore::SetJobPaused(uint64_t job_id, bool paused) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    inbox_.job_pauses.push_back(JobPause{job_id, paused});
  }
  cv_.notify_all();
}

void EngineCore::FlushCache(std::function<void(FlushResult)> done) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    inbox_.flushes.push_back(std::move(done));
  }
  cv_.notify_all();
}

void EngineCore::UpdateWeights(PendingUpdate update) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    inbox_.updates.push_back(std::move(update));
  }
  cv_.notify_all();
}

absl::StatusOr<bool> EngineCore::SetPaused(bool paused, bool abort_in_flight) {
  bool was;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (paused && !abort_in_flight && drain_waiting_) {
      return absl::FailedPreconditionError(
          "a DRAIN weight update waits for the samples in flight, which a pause would hold for "
          "ever (the update too); pause once it applied, or with abort_in_flight (not paused)");
    }
    was = paused_;
    paused_ = paused;
    if (abort_in_flight) inbox_.aborts.push_back(AbortOrder{{}, {}, "Pause with abort_in_flight"});
  }
  cv_.notify_all();
  return was;
}

void EngineCore::PostMemoryOrder(MemoryOrder order) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    inbox_.memory_orders.push_back(std::move(order));
  }
  cv_.notify_all();
}

std::optional<ReleasedMemory> EngineCore::memory_released() const {
  std::lock_guard<std::mutex> lock(mu_);
  return published_released_;
}

bool EngineCore::paused() const {
  std::lock_guard<std::mutex> lock(mu_);
  return paused_;
}

std::string EngineCore::weight_version() const {
  std::lock_guard<std::mutex> lock(mu_);
  return published_version_;
}

std::string EngineCore::weight_digest() const {
  std::lock_guard<std::mutex> lock(mu_);
  return published_digest_;
}

int64_t EngineCore::unfinished_samples() const {
  std::lock_guard<std::mutex> lock(mu_);
  return unfinished_samples_;
}

EngineCounters EngineCore::counters() const {
  std::lock_guard<std::mutex> lock(mu_);
  return counters_;
}

void EngineCore::PublishCounters() {
  EngineCounters c;
  c.running = static_cast<int32_t>(scheduler_.num_running());
  c.paused = c.running - scheduler_.num_unpaused_running();
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
  c.queue_time = queue_time_;
  c.time_to_first_token = time_to_first_token_;
  c.sample_time = sample_time_;
  c.weight_updates = weight_updates_;
  c.last_update_seconds = last_update_seconds_;
  c.nonfinite_logit_rows = nonfinite_logit_rows_;
  std::lock_guard<std::mutex> lock(mu_);
  c.unfinished_samples = unfinished_samples_;
  counters_ = c;
}

void EngineCore::Loop() {
  for (;;) {
    Control control = WaitForControl();
    const bool paused = control.paused, stop = control.stop;
    StepEvents events;
    ApplyControl(std::move(control), &events);
    if (stop) {
      Shutdown(&events);
      return;
    }
    if (!paused && has_work()) Step(&events);
    // A DRAIN update may have become ready (or been cancelled) in this step.
    AdvanceDrain();
    // Counters first: a caller that has seen an event sees the state that produced it.
    PublishCounters();
    Deliver(&events);
  }
}

Control EngineCore::WaitForControl() {
  std::unique_lock<std::mutex> lock(mu_);
  const bool busy = has_work();  // this thread's own state: constant while it waits
  auto woken = [&] {
    return stop_ || !inbox_.empty() || (busy && !paused_) ||
           // Paused with a launched step: wake to collect it (its results are delivered).
           (paused_ && launched_.has_value());
  };
  if (draining_.has_value()) {
    // The loop's one timed wake. A waiting DRAIN update's `cancelled` is a predicate that no
    // event announces, so while nothing else wakes the engine (it is paused, say: a DRAIN
    // update only waits for work in flight, which otherwise keeps the loop stepping) the
    // predicate is asked again at this deadline.
    cv_.wait_until(lock, std::chrono::steady_clock::now() + kCancelPollInterval, woken);
  } else {
    cv_.wait(lock, woken);
  }
  Control control;
  std::swap(control.inbox, inbox_);
  control.paused = paused_;
  control.stop = stop_;
  return control;
}

void EngineCore::Deliver(StepEvents* events) {
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
        if (entry.built.has_value()) {
          out[i] = std::move(job_events.built[*entry.built]);
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

}  // namespace engine_internal
}  // namespace rollout
