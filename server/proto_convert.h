#pragma once

#include <vector>

#include "absl/status/statusor.h"
#include "engine/engine.h"
#include "rollout/v1/rollout.pb.h"

namespace rollout {

// Upper bounds on one Generate call, so that a single request cannot hold the server.
inline constexpr uint32_t kMaxSamplesPerRollout = 1024;
inline constexpr size_t kMaxSamplesPerRequest = 16384;
// A request id is a key the server holds while its rollout runs (as a weight version is).
inline constexpr size_t kMaxRequestIdBytes = 256;

// Expands a GenerateRequest into the engine's samples (rollout i, sample j, in that order),
// applying the API defaults and validating everything up front. Errors are INVALID_ARGUMENT
// naming the rollout and field, e.g. "rollouts[2].sampling.top_p = 1.5; it must be in (0, 1]".
absl::StatusOr<std::vector<SampleSpec>> ToSampleSpecs(const v1::GenerateRequest& request,
                                                      const Engine& engine);

// Turns a ScoreRequest into scoring jobs (sequence i is "rollout" i), validating up front.
// Errors are INVALID_ARGUMENT naming the sequence and field, e.g. "sequences[1].start = 0; ...".
absl::StatusOr<std::vector<SampleSpec>> ToScoreSpecs(const v1::ScoreRequest& request,
                                                     const Engine& engine);

v1::FinishReason ToProto(FinishReason reason);

// Appends the responses for one engine event: a TokenChunk if it carries new tokens, then the
// Completion if it is the sample's last.
void AppendResponses(SampleEvent event, std::vector<v1::GenerateResponse>* out);
// The parts of that: the event's new tokens, logprobs and top logprobs appended to `chunk`
// (which takes the event's indices), and the Completion if the event has one.
void AppendNewTokens(const SampleEvent& event, v1::TokenChunk* chunk);
void AppendCompletion(const SampleEvent& event, std::vector<v1::GenerateResponse>* out);

}  // namespace rollout
