#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "engine/engine.h"
#include "rollout/v1/rollout.pb.h"

namespace rollout {

// INVALID_ARGUMENT naming the field when `options` asks for two modes at once.
absl::Status ValidateStreamOptions(const v1::StreamOptions& options);

// Turns one Generate call's engine events into its response messages as the call's
// StreamOptions ask: a TokenChunk per event (the default), none (completions only), or each
// sample's tokens held until enough have come or enough time has passed (coalesced). Only the
// grouping changes: tokens, logprobs and top logprobs are moved, never recomputed, and a
// sample's held tokens are sent before its Completion. Not thread-safe: the reactor calls it
// on the engine's delivery thread with its stream mutex held.
class StreamShaper {
 public:
  using Clock = std::chrono::steady_clock;

  // `samples_per_rollout[i]`: how many samples rollout i has. `start`: when the call started
  // (a sample's first interval runs from it).
  // REQUIRES: ValidateStreamOptions(options).ok().
  StreamShaper(const v1::StreamOptions& options, const std::vector<uint32_t>& samples_per_rollout,
               Clock::time_point start);

  // Appends the messages `event` makes due at `now`.
  // REQUIRES: the event's rollout and sample index are within samples_per_rollout.
  void Append(SampleEvent event, Clock::time_point now, std::vector<v1::GenerateResponse>* out);

 private:
  enum class Mode { kPerEvent, kCompletionsOnly, kCoalesced };

  // A sample's tokens not yet sent (kCoalesced).
  struct Held {
    v1::TokenChunk chunk;
    Clock::time_point last_sent;
  };

  // Moves `held`'s tokens into a TokenChunk message, if it has any.
  static void Flush(Held* held, Clock::time_point now, std::vector<v1::GenerateResponse>* out);

  // Constant after construction.
  Mode mode_;
  uint32_t chunk_tokens_;                    // 0: no count bound
  std::optional<Clock::duration> interval_;  // none: no time bound
  std::vector<size_t> first_sample_;         // rollout i's samples start at held_[first_sample_[i]]

  std::vector<Held> held_;  // kCoalesced: one per sample of the call
};

}  // namespace rollout
