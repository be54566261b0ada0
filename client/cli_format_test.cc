#include "client/cli_format.h"

#include <gmock/gmock.h>
#include <google/protobuf/util/json_util.h>
#include <google/protobuf/util/message_differencer.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace rollout {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;

// ---- ParseTokenIds --------------------------------------------------------------------------

TEST(ParseTokenIdsTest, AcceptsCommaSeparatedIds) {
  absl::StatusOr<std::vector<uint32_t>> ids = ParseTokenIds("1,2,3");
  ASSERT_TRUE(ids.ok()) << ids.status();
  EXPECT_THAT(*ids, ElementsAre(1, 2, 3));
}

TEST(ParseTokenIdsTest, AcceptsWhitespaceSeparatedIds) {
  absl::StatusOr<std::vector<uint32_t>> ids = ParseTokenIds("10 20\t30\n40");
  ASSERT_TRUE(ids.ok()) << ids.status();
  EXPECT_THAT(*ids, ElementsAre(10, 20, 30, 40));
}

TEST(ParseTokenIdsTest, AcceptsSpacesAroundCommasAndAtTheEnds) {
  absl::StatusOr<std::vector<uint32_t>> ids = ParseTokenIds("  7, 8 ,9  ");
  ASSERT_TRUE(ids.ok()) << ids.status();
  EXPECT_THAT(*ids, ElementsAre(7, 8, 9));
}

TEST(ParseTokenIdsTest, KeepsOrderAndDuplicates) {
  absl::StatusOr<std::vector<uint32_t>> ids = ParseTokenIds("5,5,0,5");
  ASSERT_TRUE(ids.ok()) << ids.status();
  EXPECT_THAT(*ids, ElementsAre(5, 5, 0, 5));
}

TEST(ParseTokenIdsTest, AcceptsTheLargestUint32) {
  absl::StatusOr<std::vector<uint32_t>> ids = ParseTokenIds("4294967295");
  ASSERT_TRUE(ids.ok()) << ids.status();
  EXPECT_THAT(*ids, ElementsAre(4294967295u));
}

TEST(ParseTokenIdsTest, RejectsEmptyAndBlankInput) {
  for (const char* text : {"", "   ", "\t\n"}) {
    absl::StatusOr<std::vector<uint32_t>> ids = ParseTokenIds(text);
    EXPECT_EQ(ids.status().code(), absl::StatusCode::kInvalidArgument) << "'" << text << "'";
    EXPECT_THAT(ids.status().message(), HasSubstr("empty")) << "'" << text << "'";
  }
}

TEST(ParseTokenIdsTest, RejectsEmptyEntriesBetweenOrAfterCommas) {
  for (const char* text : {"1,,2", "1,", ",1", "1, ,2"}) {
    absl::StatusOr<std::vector<uint32_t>> ids = ParseTokenIds(text);
    EXPECT_EQ(ids.status().code(), absl::StatusCode::kInvalidArgument) << text;
    EXPECT_THAT(ids.status().message(), HasSubstr("empty entry")) << text;
  }
}

TEST(ParseTokenIdsTest, RejectsNegativeIdsSayingSo) {
  absl::StatusOr<std::vector<uint32_t>> ids = ParseTokenIds("1,-2,3");
  EXPECT_EQ(ids.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(ids.status().message(), HasSubstr("'-2'"));
  EXPECT_THAT(ids.status().message(), HasSubstr("negative"));
}

TEST(ParseTokenIdsTest, RejectsNonNumbersNamingTheEntry) {
  for (const char* bad : {"abc", "1.5", "+3", "0x10", "1e3", "3-"}) {
    absl::StatusOr<std::vector<uint32_t>> ids = ParseTokenIds(std::string("1,") + bad);
    EXPECT_EQ(ids.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(ids.status().message(), HasSubstr(std::string("'") + bad + "'")) << bad;
    EXPECT_THAT(ids.status().message(), HasSubstr("not a number")) << bad;
  }
}

TEST(ParseTokenIdsTest, RejectsIdsAboveUint32Max) {
  absl::StatusOr<std::vector<uint32_t>> ids = ParseTokenIds("4294967296");
  EXPECT_EQ(ids.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(ids.status().message(), HasSubstr("out of range"));
}

// ---- ParseRequestIds ------------------------------------------------------------------------

TEST(ParseRequestIdsTest, SplitsOnCommasAndTrimsWhitespace) {
  absl::StatusOr<std::vector<std::string>> ids = ParseRequestIds(" cli-1-2 ,b, c\t");
  ASSERT_TRUE(ids.ok()) << ids.status();
  EXPECT_THAT(*ids, ElementsAre("cli-1-2", "b", "c"));
}

TEST(ParseRequestIdsTest, KeepsRepeatedIdsOnceInFirstSeenOrder) {
  absl::StatusOr<std::vector<std::string>> ids = ParseRequestIds("b,a,b,c,a");
  ASSERT_TRUE(ids.ok()) << ids.status();
  EXPECT_THAT(*ids, ElementsAre("b", "a", "c"));
}

TEST(ParseRequestIdsTest, RejectsEmptyListsAndEmptyEntries) {
  for (const char* text : {"", "  "}) {
    absl::StatusOr<std::vector<std::string>> ids = ParseRequestIds(text);
    EXPECT_EQ(ids.status().code(), absl::StatusCode::kInvalidArgument) << "'" << text << "'";
    EXPECT_THAT(ids.status().message(), HasSubstr("empty request id list")) << text;
  }
  for (const char* text : {"a,,b", "a,", ",a", "a, ,b"}) {
    absl::StatusOr<std::vector<std::string>> ids = ParseRequestIds(text);
    EXPECT_EQ(ids.status().code(), absl::StatusCode::kInvalidArgument) << text;
    EXPECT_THAT(ids.status().message(), HasSubstr("empty entry")) << text;
  }
}

// ---- FormatCompletionTable ------------------------------------------------------------------

rollout::v1::Completion MakeCompletion(uint32_t rollout_index, uint32_t sample_index) {
  rollout::v1::Completion c;
  c.set_rollout_index(rollout_index);
  c.set_sample_index(sample_index);
  c.set_finish_reason(rollout::v1::FINISH_REASON_LENGTH);
  c.set_weight_version("w-42");
  c.set_cached_prompt_tokens(16);
  c.set_sample_seed(1234567890123ull);
  return c;
}

TEST(FormatCompletionTableTest, MatchesGoldenLayoutForOneSample) {
  rollout::v1::Completion c = MakeCompletion(0, 0);
  c.set_finish_reason(rollout::v1::FINISH_REASON_STOP);
  c.add_token_ids(17);
  c.add_logprobs(-0.5f);
  c.add_token_ids(151645);
  c.add_logprobs(-12.25f);
  GenerateResult result;
  result.completions = {{c}};

  EXPECT_EQ(FormatCompletionTable(result),
            "rollout 0 sample 0: finish=STOP seed=1234567890123 weight_version=w-42 "
            "cached_prompt_tokens=16 tokens=2\n"
            "  pos |  token |    logprob\n"
            "    0 |     17 |  -0.500000\n"
            "    1 | 151645 | -12.250000\n");
}

TEST(FormatCompletionTableTest, ListsEverySampleOfEveryRolloutInOrder) {
  GenerateResult result;
  result.completions = {{MakeCompletion(0, 0), MakeCompletion(0, 1)}, {MakeCompletion(1, 0)}};
  const std::string table = FormatCompletionTable(result);
  const size_t a = table.find("rollout 0 sample 0:");
  const size_t b = table.find("rollout 0 sample 1:");
  const size_t c = table.find("rollout 1 sample 0:");
  ASSERT_NE(a, std::string::npos) << table;
  ASSERT_NE(b, std::string::npos) << table;
  ASSERT_NE(c, std::string::npos) << table;
  EXPECT_LT(a, b);
  EXPECT_LT(b, c);
  EXPECT_THAT(table, HasSubstr("finish=LENGTH"));
}

TEST(FormatCompletionTableTest, AddsTopLogprobsColumnOnlyWhenPresent) {
  rollout::v1::Completion plain = MakeCompletion(0, 0);
  plain.add_token_ids(3);
  plain.add_logprobs(-1.0f);
  GenerateResult without_top;
  without_top.completions = {{plain}};
  EXPECT_THAT(FormatCompletionTable(without_top), Not(HasSubstr("top")));

  rollout::v1::Completion with = plain;
  rollout::v1::TopLogprobs* top = with.add_top_logprobs();
  rollout::v1::TopLogprob* e = top->add_entries();
  e->set_token_id(3);
  e->set_logprob(-1.0f);
  e = top->add_entries();
  e->set_token_id(9);
  e->set_logprob(-2.5f);
  GenerateResult with_top;
  with_top.completions = {{with}};
  const std::string table = FormatCompletionTable(with_top);
  EXPECT_THAT(table, HasSubstr("| top\n"));
  EXPECT_THAT(table, HasSubstr("| 3:-1.000000 9:-2.500000\n"));
}

// --return_routing printed nothing of the routing in the table (only --json had it).
TEST(FormatCompletionTableTest, AddsAnExpertsColumnOnlyWhenTheRoutingCame) {
  rollout::v1::Completion c = MakeCompletion(0, 0);
  for (uint32_t token : {3u, 4u}) {
    c.add_token_ids(token);
    c.add_logprobs(-1.0f);
  }
  GenerateResult plain;
  plain.completions = {{c}};
  EXPECT_THAT(FormatCompletionTable(plain), Not(HasSubstr("experts")));
  for (uint32_t id : {6u, 7u, 6u, 3u, 1u, 0u, 2u, 5u}) c.add_routing(id);  // 2 tokens x 4 ids
  GenerateResult routed;
  routed.completions = {{c}};
  const std::string table = FormatCompletionTable(routed);
  EXPECT_THAT(table, HasSubstr("| experts (MoE layers ascending)\n"));
  EXPECT_THAT(table, HasSubstr("| 6,7,6,3\n"));
  EXPECT_THAT(table, HasSubstr("| 1,0,2,5\n"));
}

TEST(FormatCompletionTableTest, ShowsMissingLogprobsInsteadOfHidingThem) {
  rollout::v1::Completion c = MakeCompletion(0, 0);
  c.add_token_ids(1);
  c.add_token_ids(2);
  c.add_logprobs(-0.25f);  // one short
  GenerateResult result;
  result.completions = {{c}};
  std::vector<std::string> lines = absl::StrSplit(FormatCompletionTable(result), '\n');
  ASSERT_GE(lines.size(), 4u);
  EXPECT_THAT(lines[2], ::testing::EndsWith("| -0.250000"));
  EXPECT_THAT(lines[3], ::testing::MatchesRegex(" +1 \\| +2 \\| +\\?"));
}

TEST(FormatCompletionTableTest, SaysSoWhenASampleHasNoTokens) {
  GenerateResult result;
  result.completions = {{MakeCompletion(0, 0)}};
  const std::string table = FormatCompletionTable(result);
  EXPECT_THAT(table, HasSubstr("tokens=0"));
  EXPECT_THAT(table, HasSubstr("(no tokens)"));
}

TEST(FormatCompletionTableTest, ListsVersionSpansWhenTheWeightsChangedMidSample) {
  rollout::v1::Completion c = MakeCompletion(0, 0);
  for (uint32_t t : {5, 6, 7}) {
    c.add_token_ids(t);
    c.add_logprobs(-1.0f);
  }
  c.set_weight_version("v2");
  rollout::v1::VersionSpan* span = c.add_version_spans();
  span->set_version("v1");
  span->set_first_token(0);
  span->set_last_token(1);
  span = c.add_version_spans();
  span->set_version("v2");
  span->set_first_token(2);
  span->set_last_token(2);
  GenerateResult result;
  result.completions = {{c}};
  std::vector<std::string> lines = absl::StrSplit(FormatCompletionTable(result), '\n');
  ASSERT_GE(lines.size(), 3u);
  EXPECT_THAT(lines[0], HasSubstr("weight_version=v2"));
  EXPECT_EQ(lines[1], "  version spans: tokens 0-1 v1, tokens 2-2 v2");
  EXPECT_THAT(lines[2], HasSubstr("pos |"));
}

TEST(FormatCompletionTableTest, LeavesOutASingleVersionSpan) {
  rollout::v1::Completion c = MakeCompletion(0, 0);
  c.add_token_ids(5);
  c.add_logprobs(-1.0f);
  rollout::v1::VersionSpan* span = c.add_version_spans();
  span->set_version("w-42");
  span->set_last_token(0);
  GenerateResult result;
  result.completions = {{c}};
  EXPECT_THAT(FormatCompletionTable(result), Not(HasSubstr("version spans")));
}

TEST(FormatCompletionTableTest, SaysSoWhenThereAreNoCompletions) {
  EXPECT_EQ(FormatCompletionTable(GenerateResult()), "(no completions)\n");
}

// ---- FormatJson -----------------------------------------------------------------------------

TEST(FormatJsonTest, IsOneLineWithProtoFieldNamesAndZeroPrimitives) {
  rollout::v1::GenerateResponse response;
  *response.mutable_completion() = MakeCompletion(2, 0);
  response.mutable_completion()->set_cached_prompt_tokens(0);
  const std::string json = FormatJson(response);
  EXPECT_THAT(json, Not(HasSubstr("\n")));
  EXPECT_THAT(json, HasSubstr("\"completion\""));
  EXPECT_THAT(json, HasSubstr("\"rollout_index\":2"));
  EXPECT_THAT(json, HasSubstr("\"sample_index\":0"));
  EXPECT_THAT(json, HasSubstr("\"cached_prompt_tokens\":0"));
  EXPECT_THAT(json, HasSubstr("\"finish_reason\":\"FINISH_REASON_LENGTH\""));
  EXPECT_THAT(json, Not(HasSubstr("\"chunk\"")));
}

TEST(FormatJsonTest, RoundTripsLogprobsExactly) {
  rollout::v1::GenerateResponse response;
  rollout::v1::TokenChunk* chunk = response.mutable_chunk();
  chunk->set_rollout_index(1);
  chunk->add_token_ids(99);
  // Values with no short decimal form: determinism checks compare logprobs bit for bit.
  chunk->add_logprobs(-0.1f);
  chunk->add_logprobs(-1.0f / 3.0f);
  chunk->add_logprobs(-1.17549435e-38f);
  rollout::v1::GenerateResponse parsed;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(FormatJson(response), &parsed).ok());
  EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(parsed, response))
      << parsed.DebugString();
}

// ---- FormatServerInfoTable ------------------------------------------------------------------

rollout::v1::ServerInfo MakeServerInfo() {
  rollout::v1::ServerInfo info;
  info.set_server_version("0.1.0");
  info.set_backend("cpu");
  info.set_weight_version("sha-abc");
  rollout::v1::ModelInfo* model = info.mutable_model();
  model->set_architecture("Qwen3ForCausalLM");
  model->set_num_layers(28);
  model->set_vocab_size(151936);
  model->add_eos_token_ids(151645);
  model->add_eos_token_ids(151643);
  model->set_source("/models/qwen3");
  info.mutable_limits()->set_kv_block_size(16);
  return info;
}

TEST(FormatServerInfoTableTest, ShowsTopLevelAndNestedValues) {
  const std::string table = FormatServerInfoTable(MakeServerInfo());
  for (const char* expected :
       {"server_version", "0.1.0", "backend", "cpu", "sha-abc", "Qwen3ForCausalLM", "151936",
        "/models/qwen3", "kv_block_size", "max_running_samples", "151645,151643"}) {
    EXPECT_THAT(table, HasSubstr(expected)) << table;
  }
}

TEST(FormatServerInfoTableTest, PrintsZeroCountersRatherThanOmittingThem) {
  rollout::v1::ServerInfo info = MakeServerInfo();
  info.mutable_counters()->set_kv_blocks_total(100);
  const std::string table = FormatServerInfoTable(info);
  std::vector<std::string> lines = absl::StrSplit(table, '\n');
  bool found = false;
  for (const std::string& line : lines) {
    if (line.find("running_samples") != std::string::npos &&
        line.find("max_running_samples") == std::string::npos) {
      found = true;
      EXPECT_EQ(line.back(), '0') << line;
    }
  }
  EXPECT_TRUE(found) << table;
}

TEST(FormatServerInfoTableTest, MarksSectionsTheServerDidNotSend) {
  const std::string table = FormatServerInfoTable(MakeServerInfo());  // no counters
  const size_t counters = table.find("counters\n");
  ASSERT_NE(counters, std::string::npos) << table;
  EXPECT_EQ(table.find("(not reported)"), table.find("\n", counters) + 3) << table;
}

TEST(FormatServerInfoTableTest, AlignsAllValuesInOneColumn) {
  std::vector<std::string> lines =
      absl::StrSplit(FormatServerInfoTable(MakeServerInfo()), '\n', absl::SkipEmpty());
  // Rows are "<key><spaces><value>" with at least two spaces before the value; headings have
  // no value. Every value must start in the same column.
  size_t column = std::string::npos;
  int rows = 0;
  for (const std::string& line : lines) {
    const size_t gap = line.find("  ", line.find_first_not_of(' '));
    if (gap == std::string::npos) continue;  // a heading
    const size_t value = line.find_first_not_of(' ', gap);
    if (line.find("(not reported)") != std::string::npos) continue;
    ASSERT_NE(value, std::string::npos) << line;
    if (column == std::string::npos) column = value;
    EXPECT_EQ(value, column) << line;
    ++rows;
  }
  EXPECT_GT(rows, 10);
}

TEST(FormatServerInfoTableTest, ShowsTheCacheAndScoreCountersByName) {
  rollout::v1::ServerInfo info = MakeServerInfo();
  rollout::v1::EngineCounters* counters = info.mutable_counters();
  counters->set_preemptions(11);
  counters->set_kv_blocks_cached(22);
  counters->set_prompt_tokens(33);
  counters->set_cache_hit_tokens(4);
  counters->set_scored_tokens(55);
  const std::string table = FormatServerInfoTable(info);
  for (const char* row : {"preemptions +11\n", "kv_blocks_cached +22\n", "\n +prompt_tokens +33\n",
                          "cache_hit_tokens +4\n", "scored_tokens +55\n"}) {
    EXPECT_THAT(table, ::testing::ContainsRegex(row)) << table;
  }
}

// The rate's row, or "" when there is none.
std::string CacheHitRateRow(const rollout::v1::ServerInfo& info) {
  const std::vector<std::string> lines = absl::StrSplit(FormatServerInfoTable(info), '\n');
  for (const std::string& line : lines) {
    if (line.find("cache_hit_rate") != std::string::npos) return line;
  }
  return "";
}

TEST(FormatServerInfoTableTest, DerivesTheCacheHitRateFromPromptAndHitTokens) {
  rollout::v1::ServerInfo info = MakeServerInfo();
  info.mutable_counters()->set_prompt_tokens(800);
  info.mutable_counters()->set_cache_hit_tokens(300);
  EXPECT_THAT(CacheHitRateRow(info), ::testing::MatchesRegex("  cache_hit_rate +37\\.5%"));
  info.mutable_counters()->set_prompt_tokens(3);
  info.mutable_counters()->set_cache_hit_tokens(1);
  EXPECT_THAT(CacheHitRateRow(info), ::testing::EndsWith(" 33.3%"));
}

TEST(FormatServerInfoTableTest, SaysNotApplicableForTheHitRateBeforeAnyPrompt) {
  rollout::v1::ServerInfo info = MakeServerInfo();
  // Hits without prompts only come from a buggy server, but must not divide by zero either.
  info.mutable_counters()->set_cache_hit_tokens(5);
  EXPECT_THAT(CacheHitRateRow(info), ::testing::EndsWith(" n/a"));
}

TEST(FormatServerInfoTableTest, PutsTheHitRateInTheCountersSection) {
  rollout::v1::ServerInfo info = MakeServerInfo();
  info.mutable_counters()->set_prompt_tokens(10);
  const std::string table = FormatServerInfoTable(info);
  const size_t counters = table.find("\ncounters\n");
  const size_t rate = table.find("\n  cache_hit_rate ");
  ASSERT_NE(counters, std::string::npos) << table;
  ASSERT_NE(rate, std::string::npos) << table;
  ASSERT_GT(rate, counters) << table;
  // Every line from the counters heading to the rate is in that section: indented.
  const std::string between = table.substr(counters + 1, rate - counters);
  std::vector<std::string> lines = absl::StrSplit(between, '\n', absl::SkipEmpty());
  ASSERT_FALSE(lines.empty());
  EXPECT_EQ(lines[0], "counters");
  for (size_t i = 1; i < lines.size(); ++i) {
    EXPECT_THAT(lines[i], ::testing::StartsWith("  ")) << table;
  }
}

TEST(FormatServerInfoTableTest, OmitsTheHitRateWhenCountersAreNotReported) {
  EXPECT_EQ(CacheHitRateRow(MakeServerInfo()), "");
}

// ---- FormatScoreTable -----------------------------------------------------------------------

rollout::v1::ScoreRequest MakeScoreRequest(std::vector<uint32_t> tokens, uint32_t start) {
  rollout::v1::ScoreRequest request;
  rollout::v1::ScoreSequence* sequence = request.add_sequences();
  sequence->mutable_token_ids()->Add(tokens.begin(), tokens.end());
  sequence->set_start(start);
  return request;
}

rollout::v1::ScoredSequence MakeScored(std::vector<float> logprobs) {
  rollout::v1::ScoredSequence scored;
  scored.mutable_logprobs()->Add(logprobs.begin(), logprobs.end());
  scored.set_weight_version("w-42");
  scored.set_cached_tokens(1);
  return scored;
}

TEST(FormatScoreTableTest, MatchesGoldenLayoutWithPositionsIndexingTheRequestTokens) {
  rollout::v1::ScoreResponse response;
  *response.add_results() = MakeScored({-0.5f, -12.25f});
  EXPECT_EQ(FormatScoreTable(MakeScoreRequest({1, 2, 3, 151645}, 2), response),
            "sequence 0: start=2 temperature=default weight_version=w-42 cached_tokens=1 "
            "scored=2\n"
            "  pos |  token |    logprob\n"
            "    2 |      3 |  -0.500000\n"
            "    3 | 151645 | -12.250000\n");
}

TEST(FormatScoreTableTest, AddsAnExpertsColumnWhenTheRoutingCame) {
  rollout::v1::ScoreResponse response;
  rollout::v1::ScoredSequence scored = MakeScored({-0.5f, -1.5f});
  for (uint32_t id : {4u, 1u, 0u, 2u}) scored.add_routing(id);  // 2 scored tokens x 2 ids
  *response.add_results() = scored;
  const std::string table = FormatScoreTable(MakeScoreRequest({1, 2, 3, 9}, 2), response);
  EXPECT_THAT(table, HasSubstr("| -0.500000 | 4,1\n"));
  EXPECT_THAT(table, HasSubstr("| -1.500000 | 0,2\n"));
}

TEST(FormatScoreTableTest, ShowsTheRequestedTemperature) {
  rollout::v1::ScoreRequest request = MakeScoreRequest({1, 2}, 1);
  request.mutable_sequences(0)->set_temperature(0.7f);
  rollout::v1::ScoreResponse response;
  *response.add_results() = MakeScored({-1.0f});
  EXPECT_THAT(FormatScoreTable(request, response), HasSubstr(" temperature=0.7 "));
}

TEST(FormatScoreTableTest, AddsTopLogprobsColumnOnlyWhenPresent) {
  const rollout::v1::ScoreRequest request = MakeScoreRequest({1, 2, 3}, 1);
  rollout::v1::ScoreResponse response;
  *response.add_results() = MakeScored({-1.0f, -2.0f});
  EXPECT_THAT(FormatScoreTable(request, response), Not(HasSubstr("top")));

  for (int pos = 0; pos < 2; ++pos) {
    rollout::v1::TopLogprob* e = response.mutable_results(0)->add_top_logprobs()->add_entries();
    e->set_token_id(7 + pos);
    e->set_logprob(-0.25f);
  }
  const std::string table = FormatScoreTable(request, response);
  EXPECT_THAT(table, HasSubstr("| top\n"));
  EXPECT_THAT(table, HasSubstr("    1 |     2 | -1.000000 | 7:-0.250000\n"));
  EXPECT_THAT(table, HasSubstr("    2 |     3 | -2.000000 | 8:-0.250000\n"));
}

TEST(FormatScoreTableTest, ShowsMissingAndSurplusLogprobsInsteadOfHidingThem) {
  rollout::v1::ScoreResponse short_response;
  *short_response.add_results() = MakeScored({-1.0f});
  std::vector<std::string> lines = absl::StrSplit(
      FormatScoreTable(MakeScoreRequest({1, 2, 3}, 1), short_response), '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 4u);
  EXPECT_THAT(lines[3], ::testing::MatchesRegex(" +2 \\| +3 \\| +\\?"));

  rollout::v1::ScoreResponse long_response;
  *long_response.add_results() = MakeScored({-1.0f, -2.0f});
  lines = absl::StrSplit(FormatScoreTable(MakeScoreRequest({1, 2}, 1), long_response), '\n',
                         absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 4u);
  EXPECT_THAT(lines[3], ::testing::MatchesRegex(" +2 \\| +\\? \\| -2\\.000000"));
}

TEST(FormatScoreTableTest, ShowsSequencesAndResultsWithoutACounterpart) {
  rollout::v1::ScoreRequest request = MakeScoreRequest({1, 2}, 1);
  *request.add_sequences() = request.sequences(0);
  rollout::v1::ScoreResponse one_result;
  *one_result.add_results() = MakeScored({-1.0f});
  EXPECT_THAT(FormatScoreTable(request, one_result),
              HasSubstr("\nsequence 1: start=1 temperature=default\n  (no result from the "
                        "server)\n"));

  rollout::v1::ScoreResponse two_results = one_result;
  *two_results.add_results() = MakeScored({-3.0f});
  const std::string table = FormatScoreTable(MakeScoreRequest({1, 2}, 1), two_results);
  EXPECT_THAT(table, HasSubstr("sequence 1: (not in the request) weight_version=w-42"));
  EXPECT_THAT(table, ::testing::ContainsRegex("\\? \\| +\\? \\| -3\\.000000\n$"));
}

TEST(FormatScoreTableTest, SaysSoWhenThereIsNothingToShow) {
  EXPECT_EQ(FormatScoreTable(rollout::v1::ScoreRequest(), rollout::v1::ScoreResponse()),
            "(no sequences)\n");
  rollout::v1::ScoreResponse empty;
  *empty.add_results() = MakeScored({});
  EXPECT_THAT(FormatScoreTable(MakeScoreRequest({1, 2}, 2), empty),
              HasSubstr("scored=0\n  (no tokens scored)\n"));
}

// ---- FormatAbortResult / FormatFlushCacheResult ---------------------------------------------

TEST(FormatAbortResultTest, CountsDistinctNamedIdsAndListsUnknownOnes) {
  rollout::v1::AbortRequest request;
  for (const char* id : {"a", "b", "c", "a"}) request.add_request_ids(id);
  rollout::v1::AbortResponse response;
  response.set_aborted_rollouts(1);
  response.add_unknown_request_ids("b");
  response.add_unknown_request_ids("c");
  EXPECT_EQ(FormatAbortResult(request, response),
            "aborted_rollouts     1 of 3 named\n"
            "unknown_request_ids  b,c\n");
}

TEST(FormatAbortResultTest, SaysAllAndNoneWhenEverythingWasAborted) {
  rollout::v1::AbortRequest request;
  request.set_all(true);
  rollout::v1::AbortResponse response;
  response.set_aborted_rollouts(5);
  response.set_aborted_score_calls(2);
  EXPECT_EQ(FormatAbortResult(request, response),
            "aborted_rollouts     5 (all in flight)\n"
            "aborted_score_calls  2\n"
            "unknown_request_ids  (none)\n");
}

TEST(FormatFlushCacheResultTest, ShowsFreedAndDetachedBlocks) {
  rollout::v1::FlushCacheResponse response;
  response.set_freed_blocks(12);
  response.set_detached_blocks(3);
  EXPECT_EQ(FormatFlushCacheResult(response),
            "freed_blocks     12\n"
            "detached_blocks  3 (freed when the samples using them end)\n");
  response.set_detached_blocks(0);
  EXPECT_EQ(FormatFlushCacheResult(response),
            "freed_blocks     12\n"
            "detached_blocks  0\n");
}

// ---- Weight updates, pause and resume -------------------------------------------------------

TEST(ParseInFlightPolicyTest, AcceptsTheThreePoliciesInAnyCase) {
  EXPECT_EQ(*ParseInFlightPolicy("drain"), rollout::v1::IN_FLIGHT_POLICY_DRAIN);
  EXPECT_EQ(*ParseInFlightPolicy("abort"), rollout::v1::IN_FLIGHT_POLICY_ABORT);
  EXPECT_EQ(*ParseInFlightPolicy("continue"), rollout::v1::IN_FLIGHT_POLICY_CONTINUE);
  EXPECT_EQ(*ParseInFlightPolicy("CONTINUE"), rollout::v1::IN_FLIGHT_POLICY_CONTINUE);
  EXPECT_EQ(*ParseInFlightPolicy("Abort"), rollout::v1::IN_FLIGHT_POLICY_ABORT);
}

TEST(ParseInFlightPolicyTest, RejectsAnythingElseNamingTheChoices) {
  for (const char* bad : {"", "drian", "unspecified", " drain", "IN_FLIGHT_POLICY_DRAIN"}) {
    absl::StatusOr<rollout::v1::InFlightPolicy> policy = ParseInFlightPolicy(bad);
    EXPECT_EQ(policy.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(policy.status().message(), HasSubstr(std::string("'") + bad + "'")) << bad;
    EXPECT_THAT(policy.status().message(), HasSubstr("drain, abort, continue")) << bad;
  }
}

TEST(FormatUpdateWeightsResultTest, MatchesGoldenLayout) {
  rollout::v1::UpdateWeightsResponse response;
  response.set_version("step-100");
  response.set_previous_version("step-99");
  response.set_tensors_updated(291);
  response.set_bytes_received(16'060'522'496ull);
  response.set_aborted_samples(3);
  response.set_receive_seconds(12.5);
  response.set_swap_seconds(0.0421);
  EXPECT_EQ(FormatUpdateWeightsResult(response),
            "version           step-100\n"
            "previous_version  step-99\n"
            "tensors_updated   291\n"
            "bytes_received    16060522496 (16060.5 MB)\n"
            "aborted_samples   3\n"
            "receive_seconds   12.500\n"
            "swap_seconds      0.042\n"
            "receive_rate      1284.8 MB/s\n");
}

TEST(FormatUpdateWeightsResultTest, SaysNoneAndNotApplicableForMissingValues) {
  rollout::v1::UpdateWeightsResponse response;
  response.set_version("v1");
  const std::string text = FormatUpdateWeightsResult(response);
  EXPECT_THAT(text, HasSubstr("previous_version  (none)\n"));
  EXPECT_THAT(text, HasSubstr("receive_rate      n/a\n"));
  EXPECT_THAT(text, HasSubstr("bytes_received    0 (0.0 MB)\n"));
}

TEST(FormatUploadProgressTest, ShowsMegabytesShareAndRate) {
  EXPECT_EQ(FormatUploadProgress(250'000'000, 1'000'000'000, 2.0),
            "sent 250.0 / 1000.0 MB (25%), 125.0 MB/s");
  EXPECT_EQ(FormatUploadProgress(0, 1'000'000, 0.0), "sent 0.0 / 1.0 MB (0%)");
  EXPECT_EQ(FormatUploadProgress(0, 0, 0.0), "sent 0.0 / 0.0 MB (100%)");
}

TEST(FormatPauseResumeTest, SayWhatTheStateWasAndIs) {
  rollout::v1::PauseResponse pause;
  EXPECT_EQ(FormatPauseResult(pause), "was_paused  false\nnow         paused\n");
  pause.set_was_paused(true);
  EXPECT_EQ(FormatPauseResult(pause), "was_paused  true\nnow         paused\n");
  rollout::v1::ResumeResponse resume;
  resume.set_was_paused(true);
  EXPECT_EQ(FormatResumeResult(resume), "was_paused  true\nnow         running\n");
  resume.set_was_paused(false);
  EXPECT_EQ(FormatResumeResult(resume), "was_paused  false\nnow         running\n");
}

TEST(FormatMemoryTest, ReleaseAndResumeSayWhatChangedInGiB) {
  rollout::v1::ReleaseMemoryResponse released;
  released.set_kv_cache_bytes(uint64_t{3} << 29);
  released.set_weight_bytes(uint64_t{1} << 30);
  released.set_preempted_samples(4);
  released.set_seconds(0.0125);
  EXPECT_EQ(FormatReleaseMemoryResult(released),
            "was_released       false\n"
            "released_kv_cache  1.50 GiB\n"
            "released_weights   1.00 GiB\n"
            "preempted_samples  4\n"
            "aborted_samples    0\n"
            "seconds            0.013\n"
            "now                released (requests are held until resume-memory)\n");
  rollout::v1::ResumeMemoryResponse resumed;
  EXPECT_EQ(FormatResumeMemoryResult(resumed),
            "was_released      false\n"
            "resumed_kv_cache  0.00 GiB\n"
            "resumed_weights   0.00 GiB\n"
            "seconds           0.000\n"
            "now               resumed\n");
}

// ---- RewriteVersionFlag ---------------------------------------------------------------------

std::vector<std::string> Rewritten(std::vector<std::string> args) {
  absl::StatusOr<std::vector<std::string>> out = RewriteVersionFlag(std::move(args), "wv");
  EXPECT_TRUE(out.ok()) << out.status();
  return out.ok() ? *out : std::vector<std::string>{};
}

TEST(RewriteVersionFlagTest, RewritesEverySpellingOfVersion) {
  EXPECT_THAT(Rewritten({"cli", "update-weights", "--version", "v1", "--from", "/m"}),
              ElementsAre("cli", "update-weights", "--wv=v1", "--from", "/m"));
  EXPECT_THAT(Rewritten({"cli", "--version=v2", "x"}), ElementsAre("cli", "--wv=v2", "x"));
  EXPECT_THAT(Rewritten({"cli", "-version", "v3"}), ElementsAre("cli", "--wv=v3"));
  EXPECT_THAT(Rewritten({"cli", "-version=v4"}), ElementsAre("cli", "--wv=v4"));
  EXPECT_THAT(Rewritten({"cli", "--version="}), ElementsAre("cli", "--wv="));
}

TEST(RewriteVersionFlagTest, LeavesEverythingElseAlone) {
  EXPECT_THAT(Rewritten({"--version", "--weight_version=a", "--versions", "version", "-v", "--",
                         "--version", "b"}),
              ElementsAre("--version", "--weight_version=a", "--versions", "version", "-v", "--",
                          "--version", "b"));
}

TEST(RewriteVersionFlagTest, LeavesVersionAloneAsTheOnlyArgumentForTheBinarysVersion) {
  EXPECT_THAT(Rewritten({"cli", "--version"}), ElementsAre("cli", "--version"));
  EXPECT_THAT(Rewritten({"cli", "-version"}), ElementsAre("cli", "-version"));
}

TEST(RewriteVersionFlagTest, RejectsAVersionWithoutAValue) {
  for (std::vector<std::string> args :
       {std::vector<std::string>{"cli", "update-weights", "--version"},
        std::vector<std::string>{"cli", "--version", "--from", "/m"}}) {
    absl::StatusOr<std::vector<std::string>> out = RewriteVersionFlag(args, "wv");
    EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument) << args.back();
    EXPECT_THAT(out.status().message(), HasSubstr("--version needs a value")) << args.back();
  }
}

// ---- ParseIpcTensorsJson --------------------------------------------------------------------

// 64 bytes 0, 1, ..., 63 in base64.
constexpr char kHandle64[] =
    "AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8gISIjJCUmJygpKissLS4vMDEyMzQ1Njc4OTo7PD0+Pw==";

TEST(ParseIpcTensorsJsonTest, ReadsTensorsInEitherKeySpelling) {
  const std::string json = absl::StrCat(
      R"({"tensors": [{"name": "model.norm.weight", "dtype": "BF16", "shape": [64],
          "ipc_handle": ")",
      kHandle64, R"(", "offset_bytes": "512", "device_uuid": "GPU-x"},
          {"name": "lm_head.weight", "dtype": "BF16", "shape": ["8", 64], "ipcHandle": ")",
      kHandle64, R"(", "offsetBytes": 1024, "deviceUuid": "GPU-y"}]})");
  absl::StatusOr<rollout::v1::UpdateWeightsFromIpcRequest> r = ParseIpcTensorsJson(json);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->tensors_size(), 2);
  EXPECT_EQ(r->tensors(0).name(), "model.norm.weight");
  EXPECT_EQ(r->tensors(0).offset_bytes(), 512u);
  EXPECT_EQ(r->tensors(0).ipc_handle().size(), 64u);
  EXPECT_EQ(static_cast<unsigned char>(r->tensors(0).ipc_handle()[63]), 63);
  EXPECT_THAT(r->tensors(1).shape(), ElementsAre(8, 64));
  EXPECT_EQ(r->tensors(1).offset_bytes(), 1024u);
  EXPECT_EQ(r->tensors(1).device_uuid(), "GPU-y");
}

TEST(ParseIpcTensorsJsonTest, RefusesWhatIsNotATensorListSayingWhat) {
  struct Case {
    std::string json, expected;
  };
  const std::vector<Case> cases = {
      {"[1, 2]", "not an UpdateWeightsFromIpcRequest"},
      {R"({"tensors": [{"name": "a", "colour": "red"}]})", "not an UpdateWeightsFromIpcRequest"},
      {R"({"tensors": []})", "no tensors"},
      {R"({"version": "v1", "tensors": [{"name": "a"}]})", "--version and --policy"},
      {R"({"tensors": [{"name": "a", "ipc_handle": "AAEC"}]})",
       "tensors[0] ('a'): ipc_handle decodes to 3 bytes"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<rollout::v1::UpdateWeightsFromIpcRequest> r = ParseIpcTensorsJson(c.json);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << c.json;
    EXPECT_THAT(std::string(r.status().message()), HasSubstr(c.expected)) << c.json;
  }
}

CommandFlagTable TestFlagTable() {
  return {{"server", "json"},
          {{"generate", {"prompt", "samples", "ignore_eos", "temperature"}},
           {"score", {"tokens", "temperature"}},
           {"pause", {"abort_in_flight"}}}};
}

TEST(CheckFlagsApplyTest, AcceptsTheCommandsOwnCommonAndAbseilsFlagsInEverySpelling) {
  const std::vector<std::string> args = {
      "rollout-cli",    "--server=h:1", "-json", "--samples",    "4",  "--prompt=1,2",
      "--noignore_eos", "generate",     "--v=2", "--flagfile=f", "--", "--tokens=1"};
  EXPECT_TRUE(CheckFlagsApply(args, "generate", TestFlagTable()).ok());
  EXPECT_TRUE(CheckFlagsApply({"rollout-cli", "--temperature", "0", "score", "--json"}, "score",
                              TestFlagTable())
                  .ok());
  EXPECT_TRUE(
      CheckFlagsApply({"rollout-cli", "pause", "--abort_in_flight"}, "pause", TestFlagTable())
          .ok());
  EXPECT_TRUE(CheckFlagsApply({"rollout-cli", "info"}, "info", TestFlagTable()).ok());
}

TEST(CheckFlagsApplyTest, RefusesAFlagTheCommandWouldIgnoreNamingWhoReadsIt) {
  struct Case {
    std::vector<std::string> args;
    std::string command, expected;
  };
  const std::vector<Case> cases = {
      {{"rollout-cli", "--samples", "4", "score"},
       "score",
       "--samples does not apply to score (it is read by generate)"},
      {{"rollout-cli", "-samples=4", "score"}, "score", "--samples does not apply to score"},
      {{"rollout-cli", "info", "--temperature=0"},
       "info",
       "--temperature does not apply to info (it is read by generate, score)"},
      {{"rollout-cli", "--noabort_in_flight", "score"}, "score", "--abort_in_flight"},
  };
  for (const Case& c : cases) {
    const absl::Status status = CheckFlagsApply(c.args, c.command, TestFlagTable());
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << c.expected;
    EXPECT_THAT(std::string(status.message()), HasSubstr(c.expected));
  }
}

}  // namespace
}  // namespace rollout
