#pragma once

#include <google/protobuf/message.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
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
// sample seed, weight version and cached prompt tokens, then, when the sample's tokens came from
// more than one weight version (a CONTINUE update mid-sample), a line with the version of each
// span of tokens, then one "pos | token | logprob" row per generated token, with the top-N
// logprobs in a fourth column when the server sent them, and the token's routing (its experts
// at every MoE layer) in the last when the server sent one.
std::string FormatCompletionTable(const GenerateResult& result);

// One line of JSON with the proto field names and every primitive field, zero or not, so that
// lines of a stream have a stable shape for jq and friends.
std::string FormatJson(const google::protobuf::Message& message);

// A key/value table of everything in ServerInfo, grouped by section, plus derived values (the
// prefix cache hit rate) in the counters section.
std::string FormatServerInfoTable(const rollout::v1::ServerInfo& info);

// Per sequence a header (start, temperature, weight version, cached tokens), then one
// "pos | token | logprob" row per scored token, where pos indexes the request's token_ids, with
// the top-N logprobs in a fourth column when the server sent them (and the routing, as for
// FormatCompletionTable). The request supplies the
// tokens the response's logprobs belong to.
std::string FormatScoreTable(const rollout::v1::ScoreRequest& request,
                             const rollout::v1::ScoreResponse& response);

// How many rollouts were aborted (out of how many distinct ids were named, or of all in flight)
// and which named ids were not in flight.
std::string FormatAbortResult(const rollout::v1::AbortRequest& request,
                              const rollout::v1::AbortResponse& response);

// Blocks freed now and blocks detached (freed when the samples using them end).
std::string FormatFlushCacheResult(const rollout::v1::FlushCacheResponse& response);

// The tensors of an UpdateWeightsFromIpc call from a file (rollout-cli update-weights-from-ipc
// --ipc_tensors): an UpdateWeightsFromIpcRequest in proto3's JSON mapping, with `tensors` only
// (the version and policy come from the command line): {"tensors": [{"name": ..., "dtype":
// "BF16", "shape": [..], "ipc_handle": "<base64 of the 64 bytes>", "offset_bytes": N,
// "device_uuid": "GPU-..."}, ...]} (lowerCamelCase keys work too). INVALID_ARGUMENT saying
// what is wrong otherwise, naming the tensor where one is at fault.
absl::StatusOr<rollout::v1::UpdateWeightsFromIpcRequest> ParseIpcTensorsJson(std::string_view json);

// Abseil reserves --version for "print the binary's version and exit"; this rewrites
// "--version V", "--version=V" and the single-dash forms in a command line into "--<to>=V" so
// the CLI can take a weight version under that name. args[0] (the program) and everything
// after a "--" are left alone, and so is "--version" as the only argument (Abseil's: print the
// binary's version). INVALID_ARGUMENT when --version has no value or the next argument is
// another flag.
absl::StatusOr<std::vector<std::string>> RewriteVersionFlag(std::vector<std::string> args,
                                                            std::string_view to);

// Which flags each command reads, for CheckFlagsApply: `common` apply to every command
// (connection, auth, output), `by_command` maps each command to the rest it reads.
struct CommandFlagTable {
  std::vector<std::string> common;
  std::vector<std::pair<std::string, std::vector<std::string>>> by_command;
};

// OK when every flag that `args` (a command line, args[0] the program) names applies to
// `command`; otherwise INVALID_ARGUMENT naming the first flag that does not and the commands
// that read it (rollout-cli prints it as a warning), so that a flag the command ignores
// ("--samples 4 score") is not taken for one that worked. A flag is named by "--name",
// "--name=value", "-name" or, for a boolean,
// "--noname"; values, positional arguments and everything after "--" are skipped, and so are
// names that no command of `table` reads (Abseil's own: --v, --flagfile, --help...). Flags read
// from a --flagfile are not seen.
absl::Status CheckFlagsApply(const std::vector<std::string>& args, std::string_view command,
                             const CommandFlagTable& table);

// "drain", "abort" or "continue", in any case, as the InFlightPolicy value; INVALID_ARGUMENT
// naming the text and the choices otherwise.
absl::StatusOr<rollout::v1::InFlightPolicy> ParseInFlightPolicy(std::string_view text);

// The new and previous version, tensors and bytes replaced, samples aborted, the receive and
// swap times, and the receive rate in MB/s (10^6 bytes; "n/a" when no time was measured).
std::string FormatUpdateWeightsResult(const rollout::v1::UpdateWeightsResponse& response);

// One progress line of an upload, without a line break: bytes sent of the total in MB, the
// share done and the rate so far over elapsed_seconds.
std::string FormatUploadProgress(uint64_t sent_bytes, uint64_t total_bytes, double elapsed_seconds);

// Whether the server was paused before the call, and what it is now.
std::string FormatPauseResult(const rollout::v1::PauseResponse& response);
std::string FormatResumeResult(const rollout::v1::ResumeResponse& response);

// What a ReleaseMemory or ResumeMemory call changed (GiB of KV cache and weights, samples
// requeued or aborted, seconds) and what the memory is now.
std::string FormatReleaseMemoryResult(const rollout::v1::ReleaseMemoryResponse& response);
std::string FormatResumeMemoryResult(const rollout::v1::ResumeMemoryResponse& response);

}  // namespace rollout
