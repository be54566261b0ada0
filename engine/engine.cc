#include "engine/engine.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status.h"
#include "engine/engine_internal.h"
#include "engine/weight_sync_agent.h"
#include "glog/logging.h"

namespace rollout {

using engine_internal::AbortOrder;
using engine_internal::EngineCore;
using engine_internal::MemoryOrder;
using engine_internal::PendingUpdate;
using engine_internal::WeightSyncAgent;

absl::Status CheckTopLogprobs(const char* field, int64_t top_logprobs) {
  if (top_logprobs < 0 || top_logprobs > kMaxTopLogprobs) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s = %d; at most %d are returned", field, top_logprobs, kMaxTopLogprobs));
  }
  return absl::OkStatus();
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
  // Before the engine thread takes the runner: the port is the weight-sync thread's from here on.
  absl::StatusOr<std::unique_ptr<WeightSyncPort>> port = runner->CreateWeightSyncPort();
  return std::unique_ptr<Engine>(new Engine(std::move(runner), std::move(port), options));
}

Engine::Engine(std::unique_ptr<ModelRunner> runner,
               absl::StatusOr<std::unique_ptr<WeightSyncPort>> port, const EngineOptions& options)
    : options_(options),
      config_(runner->config()),
      backend_name_(runner->backend_name()),
      routing_replay_(runner->SupportsRoutingReplay()),
      kv_block_size_(runner->kv_block_size()),
      split_size_(runner->attention_split_size()),
      num_kv_blocks_(runner->num_kv_blocks()),
      weight_specs_(runner->weight_specs()),
      staging_allocator_(runner.get()),
      core_(std::make_unique<EngineCore>(std::move(runner), options, max_context())),
      weight_sync_(std::make_unique<WeightSyncAgent>(std::move(port), core_.get())) {}

Engine::~Engine() = default;

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
  if (spec.score_start == 0) {
    ROLLOUT_RETURN_IF_ERROR(
        CheckGenerationLength(static_cast<int64_t>(spec.prompt.size()), p.max_new_tokens));
  }
  if (!std::isfinite(p.temperature) || p.temperature < 0 ||
      (p.temperature > 0 && p.temperature < kMinTemperature)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "sampling.temperature = %g; it must be 0 (greedy) or finite and at least %g (below, "
        "logits / temperature leave fp32's range)",
        p.temperature, kMinTemperature));
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
  // A scoring sample's field is its sequence's own; a generated one's is in its sampling.
  ROLLOUT_RETURN_IF_ERROR(CheckTopLogprobs(
      spec.score_start != 0 ? "top_logprobs" : "sampling.top_logprobs", p.top_logprobs));
  return ValidateRouting(spec);
}

absl::Status Engine::CheckGenerationLength(int64_t prompt_tokens, int64_t max_new_tokens) const {
  const int64_t total = prompt_tokens + max_new_tokens;
  if (total > max_context()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "prompt (%d tokens) + sampling.max_new_tokens (%d) = %d exceeds the maximum context "
        "of %d tokens",
        prompt_tokens, max_new_tokens, total, max_context()));
  }
  return absl::OkStatus();
}

absl::Status Engine::CheckRoutingReplay() const {
  if (!config_.is_moe()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "routing replay needs a mixture-of-experts model; the served %s has no experts",
        config_.architecture));
  }
  if (!routing_replay_) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "the %s backend does not implement MoE routing replay; serve with --backend cpu",
        backend_name_));
  }
  return absl::OkStatus();
}

absl::Status Engine::ValidateRouting(const SampleSpec& spec) const {
  if (!spec.return_routing && spec.forced_routing.empty()) return absl::OkStatus();
  const char* field = spec.forced_routing.empty() ? "return_routing" : "routing";
  if (absl::Status s = CheckRoutingReplay(); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat(field, ": ", s.message()));
  }
  if (spec.forced_routing.empty()) return absl::OkStatus();
  if (spec.score_start == 0) {
    return absl::InvalidArgumentError("routing: only Score replays a routing");
  }
  const int64_t per_token = config_.RoutingSize(), k = config_.num_experts_per_tok;
  const int64_t scored = static_cast<int64_t>(spec.prompt.size()) - spec.score_start;
  if (static_cast<int64_t>(spec.forced_routing.size()) != scored * per_token) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "routing has %d expert ids; expected %d: %d scored tokens x %d MoE layers x %d experts "
        "per token",
        spec.forced_routing.size(), scored * per_token, scored, config_.NumMoeLayers(), k));
  }
  for (size_t i = 0; i < spec.forced_routing.size(); ++i) {
    const int32_t id = spec.forced_routing[i];
    const int64_t token = static_cast<int64_t>(i) / per_token;
    const int64_t layer = static_cast<int64_t>(i) % per_token / k;
    if (id < 0 || id >= config_.num_experts) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "routing[%d] = %d (scored token %d, MoE layer %d) is outside the experts [0, %d)", i,
          id, token, layer, config_.num_experts));
    }
    for (size_t j = i - i % k; j < i; ++j) {
      if (spec.forced_routing[j] == id) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "routing[%d] = %d: expert %d is given twice for scored token %d at MoE layer %d", i,
            id, id, token, layer));
      }
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> Engine::Submit(std::vector<SampleSpec> samples, EventSink sink) {
  for (const SampleSpec& spec : samples) {
    if (absl::Status s = Validate(spec); !s.ok()) return s;
  }
  return SubmitValidated(std::move(samples), std::move(sink));
}

absl::StatusOr<uint64_t> Engine::SubmitValidated(std::vector<SampleSpec> samples, EventSink sink) {
  // A job without samples would never complete, and so never leave the engine.
  if (samples.empty()) return absl::InvalidArgumentError("no samples to generate");
  for (const SampleSpec& spec : samples) DCHECK(Validate(spec).ok()) << Validate(spec);
  return core_->Submit(std::move(samples), std::move(sink));
}

void Engine::Abort(uint64_t job_id, std::optional<int32_t> rollout_index) {
  core_->Abort(AbortOrder{job_id, rollout_index, "an Abort call (or its client's cancel)"});
}

void Engine::AbortAll() { core_->Abort(AbortOrder{{}, {}, "an Abort of all rollouts"}); }

void Engine::PauseJob(uint64_t job_id) { core_->SetJobPaused(job_id, true); }

void Engine::ResumeJob(uint64_t job_id) { core_->SetJobPaused(job_id, false); }

void Engine::FlushCache(std::function<void(FlushResult)> done) {
  core_->FlushCache(std::move(done));
}

void Engine::UpdateWeights(WeightUpdate update, std::function<void(UpdateResult)> done,
                           std::function<bool()> cancelled) {
  PendingUpdate pending;
  pending.update = std::move(update);
  pending.done = std::move(done);
  pending.cancelled = std::move(cancelled);
  core_->UpdateWeights(std::move(pending));
}

absl::StatusOr<std::unique_ptr<HostStagingBuffer>> Engine::AllocateHostStaging(size_t bytes) const {
  return staging_allocator_->AllocateHostStaging(bytes);
}

WeightUpdate OwnedWeightUpdate(std::string version, UpdatePolicy policy,
                               std::vector<HostTensor> tensors) {
  auto owned = std::make_shared<const std::vector<HostTensor>>(std::move(tensors));
  WeightUpdate update;
  update.version = std::move(version);
  update.policy = policy;
  update.tensors = ViewsOf(*owned);
  update.bytes = std::move(owned);
  return update;
}

void Engine::JoinWeightSyncGroup(WeightSyncGroupSpec spec, std::function<void(JoinResult)> done,
                                 GiveUp give_up) {
  weight_sync_->Join(std::move(spec), std::move(done), std::move(give_up));
}

void Engine::LeaveWeightSyncGroup(std::function<void(std::optional<WeightSyncGroupInfo>)> done) {
  weight_sync_->Leave(std::move(done));
}

void Engine::UpdateWeightsFromBroadcast(absl::StatusOr<BroadcastUpdate> update,
                                        std::function<void(UpdateResult)> done,
                                        std::function<bool()> cancelled) {
  weight_sync_->Broadcast(std::move(update), std::move(done), std::move(cancelled));
}

std::optional<WeightSyncGroupInfo> Engine::weight_sync_group() const {
  return weight_sync_->group();
}

absl::StatusOr<bool> Engine::Pause(bool abort_in_flight) {
  return core_->SetPaused(true, abort_in_flight);
}

bool Engine::Resume() { return *core_->SetPaused(false, false); }

bool Engine::paused() const { return core_->paused(); }

void Engine::ReleaseMemory(MemoryReleaseOptions options, std::function<void(MemoryResult)> done) {
  core_->PostMemoryOrder(MemoryOrder{options, std::move(done)});
}

void Engine::ResumeMemory(std::function<void(MemoryResult)> done) {
  core_->PostMemoryOrder(MemoryOrder{std::nullopt, std::move(done)});
}

std::optional<ReleasedMemory> Engine::memory_released() const { return core_->memory_released(); }

std::string Engine::weight_version() const { return core_->weight_version(); }

std::string Engine::weight_digest() const { return core_->weight_digest(); }

EngineCounters Engine::counters() const { return core_->counters(); }

int64_t Engine::unfinished_samples() const { return core_->unfinished_samples(); }

}  // namespace rollout
