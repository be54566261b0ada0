#include "client/cli_format.h"

#include <google/protobuf/descriptor.h>
#include <google/protobuf/reflection.h>
#include <google/protobuf/util/json_util.h>

#include <algorithm>
#include <iterator>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace rollout {
namespace {

using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using google::protobuf::Reflection;

bool AllDigits(absl::string_view s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) {
    return absl::ascii_isdigit(static_cast<unsigned char>(c));
  });
}

absl::StatusOr<uint32_t> ParseOneTokenId(absl::string_view entry) {
  if (absl::StartsWith(entry, "-") && AllDigits(entry.substr(1))) {
    return absl::InvalidArgumentError(
        absl::StrCat("token id '", entry, "' is negative; token ids are unsigned"));
  }
  // Checked by hand because SimpleAtoi also accepts a leading '+' and surrounding spaces, which
  // would make "1+2" style typos parse as something.
  if (!AllDigits(entry)) {
    return absl::InvalidArgumentError(absl::StrCat("token id '", entry, "' is not a number"));
  }
  uint32_t id = 0;
  if (!absl::SimpleAtoi(entry, &id)) {
    return absl::InvalidArgumentError(
        absl::StrCat("token id '", entry, "' is out of range (max 4294967295)"));
  }
  return id;
}

// "STOP" from FINISH_REASON_STOP; the enum's prefix is noise in a table.
std::string FinishReasonName(rollout::v1::FinishReason reason) {
  const std::string& name = rollout::v1::FinishReason_Name(reason);
  if (name.empty()) return absl::StrCat("UNKNOWN(", static_cast<int>(reason), ")");
  return std::string(absl::StripPrefix(name, "FINISH_REASON_"));
}

std::string FormatLogprob(float logprob) { return absl::StrFormat("%.6f", logprob); }

std::string FormatTopLogprobs(const rollout::v1::TopLogprobs& top) {
  return absl::StrJoin(
      top.entries(), " ", [](std::string* out, const rollout::v1::TopLogprob& entry) {
        absl::StrAppend(out, entry.token_id(), ":", FormatLogprob(entry.logprob()));
      });
}

// One row of a per-token table. Cells are formatted before any is printed so the columns can
// be sized to their widest entry.
struct TokenRow {
  std::string pos, token, logprob, top, routing;
};

// Row i's cell of a routing laid out [token][MoE layer][experts per token] over `tokens` rows:
// its ids, comma-separated, in layout order; "?" where the routing is short or uneven.
std::string RoutingCell(const google::protobuf::RepeatedField<uint32_t>& routing, int tokens,
                        int i) {
  if (tokens <= 0 || routing.size() % tokens != 0) return "?";
  const int per_token = routing.size() / tokens;
  return absl::StrJoin(routing.begin() + i * per_token, routing.begin() + (i + 1) * per_token, ",");
}

// The rows under a header row, right-aligned, with the top column only when has_top, and the
// routing column (the experts of every MoE layer, layers ascending) only when has_routing.
void AppendTokenRows(const std::vector<TokenRow>& rows, bool has_top, bool has_routing,
                     std::string* out) {
  const TokenRow header{"pos", "token", "logprob", "top", "experts (MoE layers ascending)"};
  size_t pos_w = header.pos.size(), token_w = header.token.size(),
         logprob_w = header.logprob.size(), top_w = header.top.size();
  for (const TokenRow& row : rows) {
    pos_w = std::max(pos_w, row.pos.size());
    token_w = std::max(token_w, row.token.size());
    logprob_w = std::max(logprob_w, row.logprob.size());
    top_w = std::max(top_w, row.top.size());
  }
  auto append_row = [&](const TokenRow& row) {
    absl::StrAppendFormat(out, "  %*s | %*s | %*s", pos_w, row.pos, token_w, row.token, logprob_w,
                          row.logprob);
    if (has_top) {
      absl::StrAppend(out, " | ", row.top);
      if (has_routing) absl::StrAppend(out, std::string(top_w - row.top.size(), ' '));
    }
    if (has_routing) absl::StrAppend(out, " | ", row.routing);
    absl::StrAppend(out, "\n");
  };
  append_row(header);
  for (const TokenRow& row : rows) append_row(row);
}

void AppendCompletion(const rollout::v1::Completion& c, std::string* out) {
  absl::StrAppendFormat(
      out,
      "rollout %d sample %d: finish=%s seed=%d weight_version=%s cached_prompt_tokens=%d "
      "tokens=%d\n",
      c.rollout_index(), c.sample_index(), FinishReasonName(c.finish_reason()), c.sample_seed(),
      c.weight_version().empty() ? "(none)" : c.weight_version(), c.cached_prompt_tokens(),
      c.token_ids_size());
  if (!c.abort_cause().empty()) absl::StrAppend(out, "  aborted by: ", c.abort_cause(), "\n");
  // One span is the common case and the header's weight_version already says it all.
  if (c.version_spans_size() > 1) {
    absl::StrAppend(out, "  version spans: ",
                    absl::StrJoin(c.version_spans(), ", ",
                                  [](std::string* s, const rollout::v1::VersionSpan& span) {
                                    absl::StrAppendFormat(
                                        s, "tokens %d-%d %s", span.first_token(), span.last_token(),
                                        span.version().empty() ? "(none)" : span.version());
                                  }),
                    "\n");
  }
  if (c.token_ids_size() == 0) {
    absl::StrAppend(out, "  (no tokens)\n");
    return;
  }
  std::vector<TokenRow> rows;
  rows.reserve(c.token_ids_size());
  const bool has_top = c.top_logprobs_size() > 0;
  for (int i = 0; i < c.token_ids_size(); ++i) {
    TokenRow row;
    row.pos = absl::StrCat(i);
    row.token = absl::StrCat(c.token_ids(i));
    // A server that sends fewer logprobs than tokens is buggy; show the gap, don't hide it.
    row.logprob = i < c.logprobs_size() ? FormatLogprob(c.logprobs(i)) : "?";
    if (has_top) row.top = i < c.top_logprobs_size() ? FormatTopLogprobs(c.top_logprobs(i)) : "?";
    row.routing = RoutingCell(c.routing(), c.token_ids_size(), i);
    rows.push_back(std::move(row));
  }
  AppendTokenRows(rows, has_top, c.routing_size() > 0, out);
}

// One sequence of a Score call; either side may be missing when the server answered with a
// different number of results than sequences were sent, which is shown rather than hidden.
void AppendScoredSequence(int index, const rollout::v1::ScoreSequence* sequence,
                          const rollout::v1::ScoredSequence* result, std::string* out) {
  absl::StrAppend(out, "sequence ", index, ":");
  if (sequence == nullptr) {
    absl::StrAppend(out, " (not in the request)");
  } else {
    absl::StrAppend(out, " start=", sequence->start(), " temperature=",
                    sequence->has_temperature() ? absl::StrCat(sequence->temperature())
                                                : std::string("default"));
  }
  if (result == nullptr) {
    absl::StrAppend(out, "\n  (no result from the server)\n");
    return;
  }
  absl::StrAppend(
      out,
      " weight_version=", result->weight_version().empty() ? "(none)" : result->weight_version(),
      " cached_tokens=", result->cached_tokens(), " scored=", result->logprobs_size(), "\n");

  // Tokens the request asked to score; the response should have exactly one logprob for each.
  const int start = sequence == nullptr ? 0 : static_cast<int>(sequence->start());
  const int expected = sequence == nullptr ? 0 : std::max(0, sequence->token_ids_size() - start);
  const int n = std::max({expected, result->logprobs_size(), result->top_logprobs_size()});
  if (n == 0) {
    absl::StrAppend(out, "  (no tokens scored)\n");
    return;
  }
  const bool has_top = result->top_logprobs_size() > 0;
  std::vector<TokenRow> rows;
  rows.reserve(n);
  for (int j = 0; j < n; ++j) {
    TokenRow row;
    // Positions index the request's token_ids, so a row reads "token_ids[pos] had this logprob".
    row.pos = sequence == nullptr ? "?" : absl::StrCat(start + j);
    row.token = j < expected ? absl::StrCat(sequence->token_ids(start + j)) : "?";
    row.logprob = j < result->logprobs_size() ? FormatLogprob(result->logprobs(j)) : "?";
    if (has_top) {
      row.top = j < result->top_logprobs_size() ? FormatTopLogprobs(result->top_logprobs(j)) : "?";
    }
    row.routing = RoutingCell(result->routing(), n, j);
    rows.push_back(std::move(row));
  }
  AppendTokenRows(rows, has_top, result->routing_size() > 0, out);
}

// "key  value" lines with every value in one column; a row with an empty value is a heading.
std::string FormatKeyValueRows(const std::vector<std::pair<std::string, std::string>>& rows) {
  size_t key_w = 0;
  for (const auto& [key, value] : rows) {
    if (!value.empty()) key_w = std::max(key_w, key.size());
  }
  std::string out;
  for (const auto& [key, value] : rows) {
    if (value.empty()) {
      absl::StrAppend(&out, key, "\n");
    } else {
      absl::StrAppendFormat(&out, "%-*s  %s\n", key_w, key, value);
    }
  }
  return out;
}

// Share of admitted prompt tokens served from the prefix cache; "n/a" before any prompt, where
// 0% would wrongly suggest the cache is missing.
std::string CacheHitRate(const rollout::v1::EngineCounters& counters) {
  if (counters.prompt_tokens() == 0) return "n/a";
  return absl::StrFormat("%.1f%%", 100.0 * static_cast<double>(counters.cache_hit_tokens()) /
                                       static_cast<double>(counters.prompt_tokens()));
}

// One value of a scalar field, or of one element of a repeated scalar field when index >= 0.
std::string ScalarToString(const Message& message, const FieldDescriptor* field, int index) {
  const Reflection* r = message.GetReflection();
  const bool rep = index >= 0;
  switch (field->cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT32:
      return absl::StrCat(rep ? r->GetRepeatedInt32(message, field, index)
                              : r->GetInt32(message, field));
    case FieldDescriptor::CPPTYPE_INT64:
      return absl::StrCat(rep ? r->GetRepeatedInt64(message, field, index)
                              : r->GetInt64(message, field));
    case FieldDescriptor::CPPTYPE_UINT32:
      return absl::StrCat(rep ? r->GetRepeatedUInt32(message, field, index)
                              : r->GetUInt32(message, field));
    case FieldDescriptor::CPPTYPE_UINT64:
      return absl::StrCat(rep ? r->GetRepeatedUInt64(message, field, index)
                              : r->GetUInt64(message, field));
    case FieldDescriptor::CPPTYPE_FLOAT:
      return absl::StrCat(rep ? r->GetRepeatedFloat(message, field, index)
                              : r->GetFloat(message, field));
    case FieldDescriptor::CPPTYPE_DOUBLE:
      return absl::StrCat(rep ? r->GetRepeatedDouble(message, field, index)
                              : r->GetDouble(message, field));
    case FieldDescriptor::CPPTYPE_BOOL:
      return (rep ? r->GetRepeatedBool(message, field, index) : r->GetBool(message, field))
                 ? "true"
                 : "false";
    case FieldDescriptor::CPPTYPE_ENUM:
      return (rep ? r->GetRepeatedEnum(message, field, index) : r->GetEnum(message, field))->name();
    case FieldDescriptor::CPPTYPE_STRING:
      return rep ? r->GetRepeatedString(message, field, index) : r->GetString(message, field);
    case FieldDescriptor::CPPTYPE_MESSAGE:
      return (rep ? r->GetRepeatedMessage(message, field, index) : r->GetMessage(message, field))
          .ShortDebugString();
  }
  return "?";
}

// Key/value rows of a message by reflection, so fields added to ServerInfo later show up
// without touching this file. An empty value marks a section heading.
void CollectRows(const Message& message, int depth,
                 std::vector<std::pair<std::string, std::string>>* rows) {
  const google::protobuf::Descriptor* descriptor = message.GetDescriptor();
  const Reflection* reflection = message.GetReflection();
  const std::string indent(2 * depth, ' ');
  // Plain values first, then sub-messages, so a section's rows are not split by its parent's.
  std::vector<const FieldDescriptor*> fields;
  for (int i = 0; i < descriptor->field_count(); ++i) fields.push_back(descriptor->field(i));
  std::stable_partition(fields.begin(), fields.end(), [](const FieldDescriptor* field) {
    return field->is_repeated() || field->cpp_type() != FieldDescriptor::CPPTYPE_MESSAGE;
  });
  for (const FieldDescriptor* field : fields) {
    const std::string key = indent + field->name();
    if (field->is_repeated()) {
      std::vector<std::string> values;
      const int n = reflection->FieldSize(message, field);
      values.reserve(n);
      for (int j = 0; j < n; ++j) values.push_back(ScalarToString(message, field, j));
      rows->emplace_back(key, values.empty() ? "(none)" : absl::StrJoin(values, ","));
    } else if (field->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE) {
      rows->emplace_back(key, "");
      if (!reflection->HasField(message, field)) {
        rows->emplace_back(indent + "  (not reported)", "");
      } else {
        CollectRows(reflection->GetMessage(message, field), depth + 1, rows);
      }
    } else {
      std::string value = ScalarToString(message, field, -1);
      rows->emplace_back(key, value.empty() ? "(none)" : std::move(value));
    }
  }
  // Derived values go at the end of the section they derive from. Matched by type, not by
  // position, so they follow EngineCounters wherever it sits in ServerInfo.
  if (const auto* counters =
          google::protobuf::DynamicCastToGenerated<rollout::v1::EngineCounters>(&message)) {
    rows->emplace_back(indent + "cache_hit_rate", CacheHitRate(*counters));
  }
}

}  // namespace

absl::StatusOr<std::vector<uint32_t>> ParseTokenIds(std::string_view std_text) {
  // Debian builds Abseil with its own string_view type rather than an alias of std's.
  const absl::string_view text(std_text.data(), std_text.size());
  if (absl::StripAsciiWhitespace(text).empty()) {
    return absl::InvalidArgumentError("empty token id list");
  }
  std::vector<uint32_t> ids;
  int entry_number = 0;
  for (absl::string_view piece : absl::StrSplit(text, ',')) {
    ++entry_number;
    // A doubled or trailing comma is more likely a lost id than intended, so it is an error.
    if (absl::StripAsciiWhitespace(piece).empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("empty entry ", entry_number, " in token id list '", text, "'"));
    }
    for (absl::string_view entry :
         absl::StrSplit(piece, absl::ByAnyChar(" \t\r\n"), absl::SkipEmpty())) {
      absl::StatusOr<uint32_t> id = ParseOneTokenId(entry);
      if (!id.ok()) return id.status();
      ids.push_back(*id);
    }
  }
  return ids;
}

absl::StatusOr<std::vector<std::string>> ParseRequestIds(std::string_view std_text) {
  const absl::string_view text(std_text.data(), std_text.size());
  if (absl::StripAsciiWhitespace(text).empty()) {
    return absl::InvalidArgumentError("empty request id list");
  }
  std::vector<std::string> ids;
  absl::flat_hash_set<std::string> seen;
  int entry_number = 0;
  for (absl::string_view piece : absl::StrSplit(text, ',')) {
    ++entry_number;
    // As for token ids: a doubled or trailing comma more likely lost an id than meant nothing.
    const absl::string_view id = absl::StripAsciiWhitespace(piece);
    if (id.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("empty entry ", entry_number, " in request id list '", text, "'"));
    }
    // A repeat would make "aborted N of M named" count one rollout twice.
    if (seen.insert(std::string(id)).second) ids.emplace_back(id);
  }
  return ids;
}

std::string FormatCompletionTable(const GenerateResult& result) {
  std::string out;
  bool first = true;
  for (const std::vector<rollout::v1::Completion>& samples : result.completions) {
    for (const rollout::v1::Completion& completion : samples) {
      if (!first) absl::StrAppend(&out, "\n");
      first = false;
      AppendCompletion(completion, &out);
    }
  }
  if (first) return "(no completions)\n";
  return out;
}

std::string FormatJson(const google::protobuf::Message& message) {
  google::protobuf::util::JsonPrintOptions options;
  options.add_whitespace = false;
  options.always_print_primitive_fields = true;
  options.preserve_proto_field_names = true;
  std::string json;
  auto status = google::protobuf::util::MessageToJsonString(message, &json, options);
  if (!status.ok()) {
    // Only Any fields with unknown types can fail; keep the output valid JSON regardless.
    return absl::StrCat("{\"json_error\":\"cannot convert ", message.GetTypeName(), "\"}");
  }
  return json;
}

std::string FormatServerInfoTable(const rollout::v1::ServerInfo& info) {
  std::vector<std::pair<std::string, std::string>> rows;
  CollectRows(info, 0, &rows);
  return FormatKeyValueRows(rows);
}

std::string FormatScoreTable(const rollout::v1::ScoreRequest& request,
                             const rollout::v1::ScoreResponse& response) {
  const int n = std::max(request.sequences_size(), response.results_size());
  if (n == 0) return "(no sequences)\n";
  std::string out;
  for (int i = 0; i < n; ++i) {
    if (i > 0) absl::StrAppend(&out, "\n");
    AppendScoredSequence(i, i < request.sequences_size() ? &request.sequences(i) : nullptr,
                         i < response.results_size() ? &response.results(i) : nullptr, &out);
  }
  return out;
}

std::string FormatAbortResult(const rollout::v1::AbortRequest& request,
                              const rollout::v1::AbortResponse& response) {
  std::string aborted = absl::StrCat(response.aborted_rollouts());
  if (request.all()) {
    absl::StrAppend(&aborted, " (all in flight)");
  } else {
    const absl::flat_hash_set<std::string> named(request.request_ids().begin(),
                                                 request.request_ids().end());
    absl::StrAppend(&aborted, " of ", named.size(), " named");
  }
  const std::string unknown = response.unknown_request_ids().empty()
                                  ? "(none)"
                                  : absl::StrJoin(response.unknown_request_ids(), ",");
  if (request.all()) {  // an Abort of all also ends the Score calls in flight
    return FormatKeyValueRows({{"aborted_rollouts", aborted},
                               {"aborted_score_calls", absl::StrCat(response.aborted_score_calls())},
                               {"unknown_request_ids", unknown}});
  }
  return FormatKeyValueRows({{"aborted_rollouts", aborted}, {"unknown_request_ids", unknown}});
}

std::string FormatFlushCacheResult(const rollout::v1::FlushCacheResponse& response) {
  std::string detached = absl::StrCat(response.detached_blocks());
  // Otherwise "detached" reads as leaked; the note is noise when there are none.
  if (response.detached_blocks() > 0) {
    absl::StrAppend(&detached, " (freed when the samples using them end)");
  }
  return FormatKeyValueRows(
      {{"freed_blocks", absl::StrCat(response.freed_blocks())}, {"detached_blocks", detached}});
}

absl::StatusOr<std::vector<std::string>> RewriteVersionFlag(std::vector<std::string> args,
                                                            std::string_view std_to) {
  const std::string to(std_to);
  // "--version" alone: Abseil's, the binary's version (as every other binary of the project).
  if (args.size() == 2 && (args[1] == "--version" || args[1] == "-version")) return args;
  std::vector<std::string> out;
  out.reserve(args.size());
  for (size_t i = 0; i < args.size(); ++i) {
    std::string& arg = args[i];
    if (i == 0 || arg == "--") {
      // Everything from "--" on is positional for Abseil too.
      if (arg == "--" && i > 0) {
        out.insert(out.end(), std::make_move_iterator(args.begin() + i),
                   std::make_move_iterator(args.end()));
        break;
      }
      out.push_back(std::move(arg));
      continue;
    }
    absl::string_view name = arg;
    if (!absl::ConsumePrefix(&name, "--")) absl::ConsumePrefix(&name, "-");
    if (name.size() == arg.size()) {  // no dash: a positional argument
      out.push_back(std::move(arg));
      continue;
    }
    if (absl::ConsumePrefix(&name, "version=")) {
      out.push_back(absl::StrCat("--", to, "=", name));
    } else if (name == "version") {
      if (i + 1 == args.size() || absl::StartsWith(args[i + 1], "-")) {
        return absl::InvalidArgumentError(
            absl::StrCat("--version needs a value: the weight version, as in --version v1",
                         i + 1 == args.size() ? "" : absl::StrCat(" (got '", args[i + 1], "')")));
      }
      out.push_back(absl::StrCat("--", to, "=", args[++i]));
    } else {
      out.push_back(std::move(arg));
    }
  }
  return out;
}

absl::Status CheckFlagsApply(const std::vector<std::string>& args, std::string_view command,
                             const CommandFlagTable& table) {
  auto contains = [](const std::vector<std::string>& names, absl::string_view name) {
    return std::find(names.begin(), names.end(), name) != names.end();
  };
  // The commands that read `name` (empty: no command does).
  auto readers = [&](absl::string_view name) {
    std::vector<std::string> commands;
    for (const auto& [c, flags] : table.by_command) {
      if (contains(flags, name)) commands.push_back(c);
    }
    return commands;
  };
  const std::vector<std::string>* mine = nullptr;
  for (const auto& [c, flags] : table.by_command) {
    if (c == command) mine = &flags;
  }
  auto applies = [&](absl::string_view name) {
    return contains(table.common, name) || (mine != nullptr && contains(*mine, name));
  };
  for (size_t i = 1; i < args.size() && args[i] != "--"; ++i) {
    absl::string_view name = args[i];
    if (!absl::ConsumePrefix(&name, "--") && !absl::ConsumePrefix(&name, "-")) continue;
    name = name.substr(0, name.find('='));
    if (applies(name)) continue;
    std::vector<std::string> read_by = readers(name);
    if (read_by.empty() && absl::ConsumePrefix(&name, "no")) {  // --noflag of a boolean
      if (applies(name)) continue;
      read_by = readers(name);
    }
    if (read_by.empty()) continue;  // not one of the commands' flags
    return absl::InvalidArgumentError(
        absl::StrCat("--", name, " does not apply to ", std::string(command), " (it is read by ",
                     absl::StrJoin(read_by, ", "), "); it is ignored"));
  }
  return absl::OkStatus();
}

absl::StatusOr<rollout::v1::InFlightPolicy> ParseInFlightPolicy(std::string_view std_text) {
  const std::string text =
      absl::AsciiStrToLower(absl::string_view(std_text.data(), std_text.size()));
  if (text == "drain") return rollout::v1::IN_FLIGHT_POLICY_DRAIN;
  if (text == "abort") return rollout::v1::IN_FLIGHT_POLICY_ABORT;
  if (text == "continue") return rollout::v1::IN_FLIGHT_POLICY_CONTINUE;
  return absl::InvalidArgumentError(
      absl::StrCat("in-flight policy '", absl::string_view(std_text.data(), std_text.size()),
                   "' is not one of drain, abort, continue"));
}

absl::StatusOr<rollout::v1::UpdateWeightsFromIpcRequest> ParseIpcTensorsJson(
    std::string_view json) {
  rollout::v1::UpdateWeightsFromIpcRequest request;
  google::protobuf::util::JsonParseOptions options;
  options.ignore_unknown_fields = false;
  const auto parsed = google::protobuf::util::JsonStringToMessage(
      google::protobuf::StringPiece(json.data(), json.size()), &request, options);
  if (!parsed.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "not an UpdateWeightsFromIpcRequest in proto3 JSON ({\"tensors\": [{\"name\", "
        "\"dtype\", \"shape\", \"ipc_handle\" (base64), \"offset_bytes\", \"device_uuid\"}]}): ",
        std::string(parsed.message())));
  }
  if (!request.version().empty() || request.policy() != rollout::v1::IN_FLIGHT_POLICY_UNSPECIFIED) {
    return absl::InvalidArgumentError(
        "give the version and policy with --version and --policy, not in the file");
  }
  if (request.tensors().empty()) {
    return absl::InvalidArgumentError("no tensors: the file's \"tensors\" list is empty");
  }
  for (int i = 0; i < request.tensors_size(); ++i) {
    const rollout::v1::IpcTensor& t = request.tensors(i);
    if (t.ipc_handle().size() != 64) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "tensors[%d] ('%s'): ipc_handle decodes to %d bytes; a cudaIpcMemHandle_t has 64", i,
          t.name(), t.ipc_handle().size()));
    }
  }
  return request;
}

std::string FormatUpdateWeightsResult(const rollout::v1::UpdateWeightsResponse& response) {
  const double mb = static_cast<double>(response.bytes_received()) / 1e6;
  const std::string rate = response.receive_seconds() > 0
                               ? absl::StrFormat("%.1f MB/s", mb / response.receive_seconds())
                               : std::string("n/a");
  auto or_none = [](const std::string& s) { return s.empty() ? std::string("(none)") : s; };
  return FormatKeyValueRows({
      {"version", or_none(response.version())},
      {"previous_version", or_none(response.previous_version())},
      {"tensors_updated", absl::StrCat(response.tensors_updated())},
      {"bytes_received", absl::StrFormat("%d (%.1f MB)", response.bytes_received(), mb)},
      {"aborted_samples", absl::StrCat(response.aborted_samples())},
      {"receive_seconds", absl::StrFormat("%.3f", response.receive_seconds())},
      {"swap_seconds", absl::StrFormat("%.3f", response.swap_seconds())},
      {"receive_rate", rate},
  });
}

std::string FormatUploadProgress(uint64_t sent_bytes, uint64_t total_bytes,
                                 double elapsed_seconds) {
  const double sent_mb = static_cast<double>(sent_bytes) / 1e6;
  // An empty upload is done from the start.
  const double percent =
      total_bytes == 0 ? 100.0 : 100.0 * static_cast<double>(sent_bytes) / total_bytes;
  std::string line = absl::StrFormat("sent %.1f / %.1f MB (%.0f%%)", sent_mb,
                                     static_cast<double>(total_bytes) / 1e6, percent);
  if (elapsed_seconds > 0) absl::StrAppendFormat(&line, ", %.1f MB/s", sent_mb / elapsed_seconds);
  return line;
}

std::string FormatPauseResult(const rollout::v1::PauseResponse& response) {
  return FormatKeyValueRows(
      {{"was_paused", response.was_paused() ? "true" : "false"}, {"now", "paused"}});
}

std::string FormatResumeResult(const rollout::v1::ResumeResponse& response) {
  return FormatKeyValueRows(
      {{"was_paused", response.was_paused() ? "true" : "false"}, {"now", "running"}});
}

namespace {

std::string GiBString(uint64_t bytes) {
  return absl::StrFormat("%.2f GiB", static_cast<double>(bytes) / (1 << 30));
}

}  // namespace

std::string FormatReleaseMemoryResult(const rollout::v1::ReleaseMemoryResponse& response) {
  return FormatKeyValueRows({
      {"was_released", response.was_released() ? "true" : "false"},
      {"released_kv_cache", GiBString(response.kv_cache_bytes())},
      {"released_weights", GiBString(response.weight_bytes())},
      {"preempted_samples", absl::StrCat(response.preempted_samples())},
      {"aborted_samples", absl::StrCat(response.aborted_samples())},
      {"seconds", absl::StrFormat("%.3f", response.seconds())},
      {"now", "released (requests are held until resume-memory)"},
  });
}

std::string FormatResumeMemoryResult(const rollout::v1::ResumeMemoryResponse& response) {
  return FormatKeyValueRows({
      {"was_released", response.was_released() ? "true" : "false"},
      {"resumed_kv_cache", GiBString(response.kv_cache_bytes())},
      {"resumed_weights", GiBString(response.weight_bytes())},
      {"seconds", absl::StrFormat("%.3f", response.seconds())},
      {"now", "resumed"},
  });
}

}  // namespace rollout
