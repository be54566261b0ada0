// The Prometheus exposition obeys the rules `promtool check metrics` applies (it once broke
// three: rollout_kv_blocks_total was a gauge, rollout_weight_update_seconds_sum a counter with
// no histogram), and carries what dashboards expect: a build_info gauge and histograms of queue
// time, time to first token and end-to-end time of samples.
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/reliability_util.h"
#include "tests/test_server.h"

namespace rollout::testing {
namespace {

namespace rel = ::rollout::testing::reliability;

// What promtool's linter reports on a text exposition (the rules of
// prometheus/client_golang's testutil/promlint that apply to it), one line each.
std::vector<std::string> LintExposition(const std::string& text) {
  std::vector<std::string> problems;
  std::map<std::string, std::string> types;  // family -> type
  std::set<std::string> helped;
  std::map<std::string, std::set<std::string>> samples;  // family -> suffixes seen
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    if (line.empty()) continue;
    std::istringstream words(line);
    std::string first, second, name, type;
    words >> first;
    if (first == "#") {
      words >> second >> name;
      if (second == "HELP") helped.insert(name);
      if (second == "TYPE") {
        words >> type;
        types[name] = type;
      }
      continue;
    }
    const std::string metric = first.substr(0, first.find('{'));
    std::string family = metric, suffix;
    for (const char* s : {"_bucket", "_sum", "_count"}) {
      const std::string base = metric.substr(0, metric.size() - std::string(s).size());
      if (absl::EndsWith(metric, s) && types.count(base) != 0 && types[base] == "histogram") {
        family = base;
        suffix = s;
      }
    }
    if (types.count(family) == 0) {
      problems.push_back(absl::StrCat(metric, ": no TYPE"));
      continue;
    }
    samples[family].insert(suffix);
    if (suffix == "_bucket" && absl::StrContains(first, "le=\"+Inf\"")) {
      samples[family].insert("+Inf");
    }
  }
  for (const auto& [family, type] : types) {
    if (helped.count(family) == 0) problems.push_back(absl::StrCat(family, ": no HELP"));
    const bool total = absl::EndsWith(family, "_total");
    if (type == "counter" && !total) {
      problems.push_back(absl::StrCat(family, ": counter metrics should have \"_total\" suffix"));
    }
    if (type != "counter" && total) {
      problems.push_back(
          absl::StrCat(family, ": non-counter metrics should not have \"_total\" suffix"));
    }
    for (const char* s : {"_sum", "_count", "_bucket"}) {
      if (type != "histogram" && type != "summary" && absl::EndsWith(family, s)) {
        problems.push_back(absl::StrCat(family,
                                        ": non-histogram and non-summary metrics should "
                                        "not have \"",
                                        s, "\" suffix"));
      }
    }
    if (type == "histogram") {
      for (const char* s : {"_bucket", "_sum", "_count", "+Inf"}) {
        if (samples[family].count(s) == 0) {
          problems.push_back(absl::StrCat(family, ": histogram without ", s));
        }
      }
    }
  }
  return problems;
}

// The linter finds what it should: the three names the exposition once had.
TEST(ReliabilityMetricsLintTest, TheLinterFlagsMisnamedCountersGaugesAndSums) {
  const std::string bad =
      "# HELP a_total x\n# TYPE a_total gauge\na_total 1\n"
      "# HELP b_seconds_sum x\n# TYPE b_seconds_sum counter\nb_seconds_sum 2\n"
      "# TYPE c counter\nc 3\n";
  const std::vector<std::string> problems = LintExposition(bad);
  EXPECT_EQ(problems.size(), 5u);
  for (const std::string& p : problems) std::printf("  lint: %s\n", p.c_str());
}

TEST(ReliabilityMetricsLintTest, TheExpositionPassesPromtoolsRulesAndHasLatencyHistograms) {
  ServerOptions options;
  options.metrics_port = rel::PickFreePort();
  ASSERT_GT(options.metrics_port, 0);
  std::unique_ptr<TestServer> server = StartTestServer(options);
  ASSERT_NE(server, nullptr);
  v1::GenerateRequest request;
  *request.add_rollouts() = MakeRollout({5, 6, 7, 8}, 3, 4, 0.7f);
  request.mutable_rollouts(0)->set_num_samples(3);
  ASSERT_TRUE(RunGenerate(server->stub.get(), request).status.ok());
  {
    grpc::ClientContext context;
    v1::UpdateWeightsFromPathRequest update;
    update.set_path(server->server->model_dir());
    update.set_version("lint");
    v1::UpdateWeightsResponse response;
    ASSERT_TRUE(server->stub->UpdateWeightsFromPath(&context, update, &response).ok());
  }
  std::string page = rel::HttpGet(options.metrics_port, "/metrics");
  const size_t body = page.find("\r\n\r\n");
  ASSERT_NE(body, std::string::npos) << page;
  page = page.substr(body + 4);
  for (const std::string& problem : LintExposition(page)) ADD_FAILURE() << problem;
  for (const std::string& needle : {
           std::string("rollout_build_info{version=\"0.1.0\",commit=\""),
           std::string("# TYPE rollout_kv_blocks_capacity gauge"),
           std::string("# TYPE rollout_weight_update_seconds histogram"),
           std::string("rollout_weight_update_seconds_count 1"),
           std::string("rollout_sample_queue_seconds_count 3"),
           std::string("rollout_time_to_first_token_seconds_count 3"),
           std::string("rollout_sample_seconds_count 3"),
       }) {
    EXPECT_NE(page.find(needle), std::string::npos) << "missing: " << needle << "\n" << page;
  }
}

}  // namespace
}  // namespace rollout::testing
