#include "client/cli_format.h"

#include <google/protobuf/descriptor.h>
#include <google/protobuf/reflection.h>
#include <google/protobuf/util/json_util.h>

#include <algorithm>
#include <utility>

#include "absl/strings/ascii.h"
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

void AppendCompletion(const rollout::v1::Completion& c, std::string* out) {
  absl::StrAppendFormat(
      out,
      "rollout %d sample %d: finish=%s seed=%d weight_version=%s cached_prompt_tokens=%d "
      "tokens=%d\n",
      c.rollout_index(), c.sample_index(), FinishReasonName(c.finish_reason()), c.sample_seed(),
      c.weight_version().empty() ? "(none)" : c.weight_version(), c.cached_prompt_tokens(),
      c.token_ids_size());
  if (c.token_ids_size() == 0) {
    absl::StrAppend(out, "  (no tokens)\n");
    return;
  }
  // Cells are formatted first so the columns can be sized to their widest entry.
  struct Row {
    std::string pos, token, logprob, top;
  };
  std::vector<Row> rows;
  rows.reserve(c.token_ids_size());
  const bool has_top = c.top_logprobs_size() > 0;
  for (int i = 0; i < c.token_ids_size(); ++i) {
    Row row;
    row.pos = absl::StrCat(i);
    row.token = absl::StrCat(c.token_ids(i));
    // A server that sends fewer logprobs than tokens is buggy; show the gap, don't hide it.
    row.logprob = i < c.logprobs_size() ? FormatLogprob(c.logprobs(i)) : "?";
    if (has_top) row.top = i < c.top_logprobs_size() ? FormatTopLogprobs(c.top_logprobs(i)) : "?";
    rows.push_back(std::move(row));
  }
  Row header{"pos", "token", "logprob", "top"};
  size_t pos_w = header.pos.size(), token_w = header.token.size(),
         logprob_w = header.logprob.size();
  for (const Row& row : rows) {
    pos_w = std::max(pos_w, row.pos.size());
    token_w = std::max(token_w, row.token.size());
    logprob_w = std::max(logprob_w, row.logprob.size());
  }
  auto append_row = [&](const Row& row) {
    absl::StrAppendFormat(out, "  %*s | %*s | %*s", pos_w, row.pos, token_w, row.token, logprob_w,
                          row.logprob);
    if (has_top) absl::StrAppend(out, " | ", row.top);
    absl::StrAppend(out, "\n");
  };
  append_row(header);
  for (const Row& row : rows) append_row(row);
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

}  // namespace rollout
