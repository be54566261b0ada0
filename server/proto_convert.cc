#include "server/proto_convert.h"

#include <cmath>
#include <limits>
#include <set>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "engine/sampler.h"

namespace rollout {
namespace {

absl::Status RolloutError(size_t index, const absl::Status& status) {
  return absl::Status(status.code(), absl::StrCat("rollouts[", index, "].", status.message()));
}

void ToProto(const std::vector<TokenLogprob>& top, v1::TopLogprobs* out) {
  for (const TokenLogprob& t : top) {
    v1::TopLogprob* e = out->add_entries();
    e->set_token_id(static_cast<uint32_t>(t.token));
    e->set_logprob(t.logprob);
  }
}

}  // namespace

absl::StatusOr<std::vector<SampleSpec>> ToSampleSpecs(const v1::GenerateRequest& request,
                                                      const Engine& engine) {
  if (request.rollouts().empty()) {
    return absl::InvalidArgumentError("rollouts is empty; send at least one RolloutRequest");
  }
  const uint32_t vocab = static_cast<uint32_t>(engine.model_config().vocab_size);
  std::set<std::string> ids;
  size_t total = 0;
  for (int i = 0; i < request.rollouts_size(); ++i) {
    const v1::RolloutRequest& r = request.rollouts(i);
    if (r.request_id().size() > kMaxRequestIdBytes) {
      return absl::InvalidArgumentError(
          absl::StrFormat("rollouts[%d].request_id is %d bytes; at most %d", i,
                          r.request_id().size(), kMaxRequestIdBytes));
    }
    if (!r.request_id().empty() && !ids.insert(r.request_id()).second) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "rollouts[%d].request_id '%s' is used by an earlier rollout of this request", i,
          r.request_id()));
    }
    const uint32_t n = r.num_samples() == 0 ? 1 : r.num_samples();
    if (n > kMaxSamplesPerRollout) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "rollouts[%d].num_samples = %d; at most %d per rollout", i, n, kMaxSamplesPerRollout));
    }
    total += n;
    if (total > kMaxSamplesPerRequest) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "the request asks for more than %d samples in all; split it", kMaxSamplesPerRequest));
    }
  }

  // The request's field, not a rollout's: named as such, once.
  if (request.return_routing()) {
    if (absl::Status st = engine.CheckRoutingReplay(); !st.ok()) {
      return absl::Status(st.code(), absl::StrCat("return_routing: ", st.message()));
    }
  }

  std::vector<SampleSpec> specs;
  specs.reserve(total);
  for (int i = 0; i < request.rollouts_size(); ++i) {
    const v1::RolloutRequest& r = request.rollouts(i);
    if (!r.has_sampling()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "rollouts[%d].sampling is missing; at least sampling.max_new_tokens is required", i));
    }
    const v1::SamplingParams& s = r.sampling();
    SampleSpec spec;
    spec.rollout_index = i;
    // Range checks on the unsigned wire values come first, so no value wraps when narrowed.
    for (int t = 0; t < r.prompt_token_ids_size(); ++t) {
      if (r.prompt_token_ids(t) >= vocab) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "rollouts[%d].prompt_token_ids[%d] = %d is outside the vocabulary [0, %d)", i, t,
            r.prompt_token_ids(t), vocab));
      }
    }
    for (int t = 0; t < s.stop_token_ids_size(); ++t) {
      if (s.stop_token_ids(t) >= vocab) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "rollouts[%d].sampling.stop_token_ids[%d] = %d is outside the vocabulary [0, %d)", i, t,
            s.stop_token_ids(t), vocab));
      }
    }
    if (s.max_new_tokens() == 0) {
      return absl::InvalidArgumentError(
          absl::StrFormat("rollouts[%d].sampling.max_new_tokens is 0; it must be >= 1", i));
    }
    // Validate's bounds on the wire values, each naming its field: within them (max_context()
    // is an int32's) neither wraps when narrowed.
    if (absl::Status st =
            engine.CheckGenerationLength(r.prompt_token_ids_size(), s.max_new_tokens());
        !st.ok()) {
      return RolloutError(i, st);
    }
    if (absl::Status st = CheckTopLogprobs("sampling.top_logprobs", s.top_logprobs()); !st.ok()) {
      return RolloutError(i, st);
    }
    spec.prompt.assign(r.prompt_token_ids().begin(), r.prompt_token_ids().end());
    SamplingParams& p = spec.params;
    p.temperature = s.has_temperature() ? s.temperature() : 1.0f;
    p.top_k = s.has_top_k() ? s.top_k() : 0;
    p.top_p = s.has_top_p() ? s.top_p() : 1.0f;
    p.min_p = s.has_min_p() ? s.min_p() : 0.0f;
    p.max_new_tokens = static_cast<int32_t>(s.max_new_tokens());
    p.stop_token_ids.assign(s.stop_token_ids().begin(), s.stop_token_ids().end());
    p.ignore_eos = s.ignore_eos();
    p.top_logprobs = static_cast<int32_t>(s.top_logprobs());
    spec.return_routing = request.return_routing();
    if (absl::Status st = engine.Validate(spec); !st.ok()) {
      // Engine messages name fields relative to the rollout ("sampling.top_p ...").
      return RolloutError(i, st);
    }
    const uint32_t n = r.num_samples() == 0 ? 1 : r.num_samples();
    for (uint32_t j = 0; j < n; ++j) {
      SampleSpec sample = spec;
      sample.sample_index = static_cast<int32_t>(j);
      sample.sample_seed = DeriveSampleSeed(r.seed(), j);
      specs.push_back(std::move(sample));
    }
  }
  return specs;
}

absl::StatusOr<std::vector<SampleSpec>> ToScoreSpecs(const v1::ScoreRequest& request,
                                                     const Engine& engine) {
  if (request.sequences().empty()) {
    return absl::InvalidArgumentError("sequences is empty; send at least one ScoreSequence");
  }
  if (static_cast<size_t>(request.sequences_size()) > kMaxSamplesPerRequest) {
    return absl::InvalidArgumentError(
        absl::StrFormat("the request has more than %d sequences; split it", kMaxSamplesPerRequest));
  }
  const uint32_t vocab = static_cast<uint32_t>(engine.model_config().vocab_size);
  std::vector<SampleSpec> specs;
  for (int i = 0; i < request.sequences_size(); ++i) {
    const v1::ScoreSequence& seq = request.sequences(i);
    for (int t = 0; t < seq.token_ids_size(); ++t) {
      if (seq.token_ids(t) >= vocab) {
        return absl::InvalidArgumentError(
            absl::StrFormat("sequences[%d].token_ids[%d] = %d is outside the vocabulary [0, %d)", i,
                            t, seq.token_ids(t), vocab));
      }
    }
    if (seq.token_ids_size() < 2) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "sequences[%d] has %d token%s; a scored sequence needs at least 2 (a token of context, "
          "then the tokens scored from start)",
          i, seq.token_ids_size(), seq.token_ids_size() == 1 ? "" : "s"));
    }
    if (seq.start() == 0 || seq.start() >= static_cast<uint32_t>(seq.token_ids_size())) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "sequences[%d].start = %d; it must be in [1, %d) (token_ids has %d tokens)", i,
          seq.start(), seq.token_ids_size(), seq.token_ids_size()));
    }
    if (seq.has_temperature() &&
        !(std::isfinite(seq.temperature()) &&
          (seq.temperature() == 0.0f || seq.temperature() >= kMinTemperature))) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "sequences[%d].temperature = %g; it must be 0 (scores as 1) or finite and at least %g "
          "(below, logits / temperature leave fp32's range)",
          i, seq.temperature(), kMinTemperature));
    }
    // On the wire value, so that none wraps when narrowed.
    if (absl::Status st = CheckTopLogprobs("top_logprobs", seq.top_logprobs()); !st.ok()) {
      return absl::Status(st.code(), absl::StrCat("sequences[", i, "].", st.message()));
    }
    SampleSpec spec;
    spec.rollout_index = i;
    spec.prompt.assign(seq.token_ids().begin(), seq.token_ids().end());
    spec.score_start = static_cast<int32_t>(seq.start());
    spec.params.temperature = seq.has_temperature() ? seq.temperature() : 1.0f;
    spec.params.top_logprobs = static_cast<int32_t>(seq.top_logprobs());
    spec.return_routing = seq.return_routing();
    // Range-checked on the wire values, so none wraps when narrowed; Validate does the rest.
    for (int t = 0; t < seq.routing_size(); ++t) {
      if (seq.routing(t) > static_cast<uint32_t>(std::numeric_limits<int32_t>::max())) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "sequences[%d].routing[%d] = %d is outside the experts [0, %d)", i, t, seq.routing(t),
            engine.model_config().num_experts));
      }
    }
    spec.forced_routing.assign(seq.routing().begin(), seq.routing().end());
    if (absl::Status st = engine.Validate(spec); !st.ok()) {
      return absl::Status(st.code(), absl::StrCat("sequences[", i, "].", st.message()));
    }
    specs.push_back(std::move(spec));
  }
  return specs;
}

v1::FinishReason ToProto(FinishReason reason) {
  switch (reason) {
    case FinishReason::kStop:
      return v1::FINISH_REASON_STOP;
    case FinishReason::kLength:
      return v1::FINISH_REASON_LENGTH;
    case FinishReason::kAbort:
      return v1::FINISH_REASON_ABORT;
  }
  return v1::FINISH_REASON_UNSPECIFIED;
}

void AppendNewTokens(const SampleEvent& event, v1::TokenChunk* chunk) {
  chunk->set_rollout_index(static_cast<uint32_t>(event.rollout_index));
  chunk->set_sample_index(static_cast<uint32_t>(event.sample_index));
  chunk->mutable_token_ids()->Add(event.new_token_ids.begin(), event.new_token_ids.end());
  chunk->mutable_logprobs()->Add(event.new_logprobs.begin(), event.new_logprobs.end());
  for (const auto& top : event.new_top_logprobs) ToProto(top, chunk->add_top_logprobs());
}

void AppendResponses(SampleEvent event, std::vector<v1::GenerateResponse>* out) {
  if (!event.new_token_ids.empty()) AppendNewTokens(event, out->emplace_back().mutable_chunk());
  AppendCompletion(event, out);
}

void AppendCompletion(const SampleEvent& event, std::vector<v1::GenerateResponse>* out) {
  if (event.completion.has_value()) {
    const SampleCompletion& c = *event.completion;
    v1::Completion* done = out->emplace_back().mutable_completion();
    done->set_rollout_index(static_cast<uint32_t>(event.rollout_index));
    done->set_sample_index(static_cast<uint32_t>(event.sample_index));
    done->mutable_token_ids()->Add(c.token_ids.begin(), c.token_ids.end());
    done->mutable_logprobs()->Add(c.logprobs.begin(), c.logprobs.end());
    done->set_finish_reason(ToProto(c.finish_reason));
    done->set_abort_cause(c.abort_cause);
    done->set_weight_version(c.weight_version);
    done->set_weight_digest(c.weight_digest);
    done->set_cached_prompt_tokens(static_cast<uint32_t>(c.cached_prompt_tokens));
    done->set_sample_seed(c.sample_seed);
    for (const auto& top : c.top_logprobs) ToProto(top, done->add_top_logprobs());
    done->mutable_routing()->Add(c.routing.begin(), c.routing.end());
    for (const VersionSpan& span : c.version_spans) {
      v1::VersionSpan* out = done->add_version_spans();
      out->set_version(span.version);
      out->set_first_token(static_cast<uint32_t>(span.first_token));
      out->set_last_token(static_cast<uint32_t>(span.last_token));
    }
  }
}

}  // namespace rollout
