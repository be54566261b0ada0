#include <utility>

#include "engine/engine_internal.h"
#include "glog/logging.h"

namespace rollout {
namespace engine_internal {

EngineCore::EngineCore(std::unique_ptr<ModelRunner> runner, const EngineOptions& options,
                       int64_t max_context)
    : options_(options),
      config_(runner->config()),
      max_context_(max_context),
      runner_(std::move(runner)),
      blocks_(runner_->num_kv_blocks(), runner_->kv_block_size()),
      cache_(&blocks_, options.prefix_cache),
      scheduler_(SchedulerOptions{options.max_running_samples, options.max_batch_tokens,
                                  runner_->attention_split_size()},
                 &blocks_, &cache_, options.weight_version),
      version_(options.weight_version),
      published_version_(options.weight_version) {
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
    job_id = next_job_id_++;
    unfinished_samples_ += static_cast<int64_t>(samples.size());
    inbox_.push_back(Submission{job_id, std::move(samples), std::move(sink)});
  }
  cv_.notify_all();
  return job_id;
}

void EngineCore::Abort(AbortOrder order) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    aborts_.push_back(order);
  }
  cv_.notify_all();
}

void EngineCore::FlushCache(std::function<void(FlushResult)> done) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    flushes_.push_back(std::move(done));
  }
  cv_.notify_all();
}

void EngineCore::UpdateWeights(PendingUpdate update) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    updates_.push_back(std::move(update));
  }
  cv_.notify_all();
}

bool EngineCore::SetPaused(bool paused, bool abort_in_flight) {
  bool was;
  {
    std::lock_guard<std::mutex> lock(mu_);
    was = paused_;
    paused_ = paused;
    if (abort_in_flight) aborts_.push_back(AbortOrder{});
  }
  cv_.notify_all();
  return was;
}

bool EngineCore::paused() const {
  std::lock_guard<std::mutex> lock(mu_);
  return paused_;
}

std::string EngineCore::weight_version() const {
  std::lock_guard<std::mutex> lock(mu_);
  return published_version_;
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
  c.waiting = static_cast<int32_t>(scheduler_.num_waiting());
  c.kv_blocks_free = blocks_.num_free();
  c.kv_blocks_total = blocks_.num_total();
  c.generated_tokens = generated_tokens_;
  c.prefilled_tokens = prefilled_tokens_;
  c.steps = steps_;
  c.lookahead_steps = lookahead_steps_;
  c.preemptions = scheduler_.num_preemptions();
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

void EngineCore::Loop() {
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
        UpdateResult result;
        result.status = absl::UnavailableError("the server is shutting down");
        Reply(draining_->done, std::move(result));
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

}  // namespace engine_internal
}  // namespace rollout
