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

// A human-readable table of every completion: per rollout/sample a header with finish reason,
// sample seed, weight version and cached prompt tokens, then one "pos | token | logprob" row per
// generated token, with the top-N logprobs in a fourth column when the server sent them.
std::string FormatCompletionTable(const GenerateResult& result);

// One line of JSON with the proto field names and every primitive field, zero or not, so that
// lines of a stream have a stable shape for jq and friends.
std::string FormatJson(const google::protobuf::Message& message);

// A key/value table of everything in ServerInfo, grouped by section.
std::string FormatServerInfoTable(const rollout::v1::ServerInfo& info);

}  // namespace rollout
