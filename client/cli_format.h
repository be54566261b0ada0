#pragma once

#include <google/protobuf/message.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "client/rollout_client.h"
#include "rollout/v1/rollout.pb.h"

// Pure parsing and formatting for rollout-cli, kept apart from main so it is testable without a
// server.
namespace rollout {

// Parses token ids separated by commas and/or whitespace: "1,2,3", "1 2 3", "1, 2, 3".
// INVALID_ARGUMENT for an empty list, an empty entry ("1,,2", "1,"), a negative number, a
// non-number, or a value above UINT32_MAX; the message names the offending entry.
absl::StatusOr<std::vector<uint32_t>> ParseTokenIds(std::string_view text);

// Parses request ids separated by commas: "a,b", "a, b". Surrounding whitespace is dropped and
// repeated ids are kept once, in first-seen order. INVALID_ARGUMENT for an empty list or an empty
// entry ("a,,b", "a,").
absl::StatusOr<std::vector<std::string>> ParseRequestIds(std::string_view text);

// A human-readable table of every completion: per rollout/sample a header with finish reason,
// sample seed, weight version and cached prompt tokens, then one "pos | token | logprob" row per
// generated token, with the top-N logprobs in a fourth column when the server sent them.
std::string FormatCompletionTable(const GenerateResult& result);

// One line of JSON with the proto field names and every primitive field, zero or not, so that
// lines of a stream have a stable shape for jq and friends.
std::string FormatJson(const google::protobuf::Message& message);

// A key/value table of everything in ServerInfo, grouped by section, plus derived values (the
// prefix cache hit rate) in the counters section.
std::string FormatServerInfoTable(const rollout::v1::ServerInfo& info);

// Per sequence a header (start, temperature, weight version, cached tokens), then one
// "pos | token | logprob" row per scored token, where pos indexes the request's token_ids, with
// the top-N logprobs in a fourth column when the server sent them. The request supplies the
// tokens the response's logprobs belong to.
std::string FormatScoreTable(const rollout::v1::ScoreRequest& request,
                             const rollout::v1::ScoreResponse& response);

// How many rollouts were aborted (out of how many distinct ids were named, or of all in flight)
// and which named ids were not in flight.
std::string FormatAbortResult(const rollout::v1::AbortRequest& request,
                              const rollout::v1::AbortResponse& response);

// Blocks freed now and blocks detached (freed when the samples using them end).
std::string FormatFlushCacheResult(const rollout::v1::FlushCacheResponse& response);

}  // namespace rollout
