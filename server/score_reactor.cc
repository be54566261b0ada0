#include "server/score_reactor.h"

#include <utility>

#include "absl/strings/str_cat.h"

#include "server/proto_convert.h"
#include "server/status_util.h"

namespace rollout {

ScoreReactor::ScoreReactor(RolloutServiceImpl* service, const v1::ScoreRequest* request,
                           v1::ScoreResponse* response)
    : service_(service), state_(std::make_shared<State>()) {
  state_->reactor = this;
  state_->response = response;
  absl::StatusOr<std::vector<SampleSpec>> specs = ToScoreSpecs(*request, *service_->engine());
  if (!specs.ok()) {
    state_->finished = true;
    Finish(ToGrpcStatus(specs.status()));
    return;
  }
  for (size_t i = 0; i < specs->size(); ++i) response->add_results();
  state_->left = specs->size();
  std::shared_ptr<State> state = state_;
  std::lock_guard<std::mutex> lock(state_->mu);
  absl::StatusOr<uint64_t> job =
      service_->StartScore(*std::move(specs), [state](std::vector<SampleEvent> events) {
        std::lock_guard<std::mutex> lock(state->mu);
        if (state->reactor != nullptr) state->reactor->OnEvents(std::move(events));
      });
  if (!job.ok()) {
    FinishLocked(ToGrpcStatus(job.status()));
    return;
  }
  job_id_ = *job;
  submitted_ = true;
}

void ScoreReactor::OnEvents(std::vector<SampleEvent> events) {
  State& s = *state_;
  if (s.finished) return;
  for (SampleEvent& event : events) {
    if (!event.completion.has_value()) continue;
    SampleCompletion& c = *event.completion;
    if (c.nonfinite_logits) {
      // Not an interruption: the served weights give no scores, and would give none again.
      FinishLocked(grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                                absl::StrCat("sequences[", event.rollout_index,
                                             "]: ", c.abort_cause, "; nothing was scored")));
      return;
    }
    if (c.finish_reason == FinishReason::kAbort) {
      FinishLocked(grpc::Status(
          grpc::StatusCode::ABORTED,
          absl::StrCat("scoring was aborted by ",
                       c.abort_cause.empty() ? "the server" : c.abort_cause,
                       " before it finished; nothing was scored: resubmit the sequences")));
      return;
    }
    v1::ScoredSequence* out = s.response->mutable_results(event.rollout_index);
    out->mutable_logprobs()->Add(c.logprobs.begin(), c.logprobs.end());
    for (const auto& top : c.top_logprobs) {
      v1::TopLogprobs* entries = out->add_top_logprobs();
      for (const TokenLogprob& t : top) {
        v1::TopLogprob* e = entries->add_entries();
        e->set_token_id(static_cast<uint32_t>(t.token));
        e->set_logprob(t.logprob);
      }
    }
    out->set_weight_version(c.weight_version);
    out->set_weight_digest(c.weight_digest);
    out->set_cached_tokens(static_cast<uint32_t>(c.cached_prompt_tokens));
    out->mutable_routing()->Add(c.routing.begin(), c.routing.end());
    --s.left;
  }
  if (s.left == 0) FinishLocked(grpc::Status::OK);
}

void ScoreReactor::FinishLocked(const grpc::Status& status) {
  if (state_->finished) return;
  state_->finished = true;
  // Lock order: the call's state, then the service's (StartScore is called the same way).
  if (submitted_) service_->EndScore(job_id_);
  Finish(status);
}

void ScoreReactor::OnCancel() {
  std::lock_guard<std::mutex> lock(state_->mu);
  if (submitted_) service_->engine()->Abort(job_id_);
  FinishLocked(grpc::Status(grpc::StatusCode::CANCELLED, "cancelled"));
}

void ScoreReactor::OnDone() {
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->reactor = nullptr;
    if (submitted_ && state_->left > 0) service_->engine()->Abort(job_id_);
  }
  delete this;
}

}  // namespace rollout
