#include "server/stream_shaper.h"

#include <utility>

#include "glog/logging.h"
#include "server/proto_convert.h"

namespace rollout {

absl::Status ValidateStreamOptions(const v1::StreamOptions& options) {
  if (options.completions_only() &&
      (options.chunk_tokens() > 0 || options.chunk_interval_ms() > 0)) {
    return absl::InvalidArgumentError(
        "stream.completions_only is set together with stream.chunk_tokens or "
        "stream.chunk_interval_ms; a completions-only stream has no chunks to coalesce");
  }
  return absl::OkStatus();
}

StreamShaper::StreamShaper(const v1::StreamOptions& options,
                           const std::vector<uint32_t>& samples_per_rollout,
                           Clock::time_point start)
    : chunk_tokens_(options.chunk_tokens()) {
  if (options.chunk_interval_ms() > 0) {
    interval_ = std::chrono::milliseconds(options.chunk_interval_ms());
  }
  if (options.completions_only()) {
    mode_ = Mode::kCompletionsOnly;
  } else if (chunk_tokens_ > 1 || interval_.has_value()) {
    mode_ = Mode::kCoalesced;
  } else {
    mode_ = Mode::kPerEvent;  // chunk_tokens 1 is what every event gives anyway
  }
  if (mode_ != Mode::kCoalesced) return;
  size_t total = 0;
  for (uint32_t n : samples_per_rollout) {
    first_sample_.push_back(total);
    total += n;
  }
  held_.resize(total);
  for (Held& h : held_) h.last_sent = start;
}

void StreamShaper::Flush(Held* held, Clock::time_point now,
                         std::vector<v1::GenerateResponse>* out) {
  held->last_sent = now;
  if (held->chunk.token_ids().empty()) return;
  out->emplace_back().mutable_chunk()->Swap(&held->chunk);
}

void StreamShaper::Append(SampleEvent event, Clock::time_point now,
                          std::vector<v1::GenerateResponse>* out) {
  switch (mode_) {
    case Mode::kPerEvent:
      AppendResponses(std::move(event), out);
      return;
    case Mode::kCompletionsOnly:
      AppendCompletion(event, out);
      return;
    case Mode::kCoalesced:
      break;
  }
  const size_t rollout = static_cast<size_t>(event.rollout_index);
  DCHECK_LT(rollout, first_sample_.size());
  Held& held = held_[first_sample_[rollout] + static_cast<size_t>(event.sample_index)];
  if (!event.new_token_ids.empty()) AppendNewTokens(event, &held.chunk);
  const bool enough =
      chunk_tokens_ > 0 && static_cast<uint32_t>(held.chunk.token_ids_size()) >= chunk_tokens_;
  const bool due = interval_.has_value() && now - held.last_sent >= *interval_;
  if (enough || due || event.completion.has_value()) Flush(&held, now, out);
  AppendCompletion(event, out);
}

}  // namespace rollout
