// How a Generate stream is delivered: the stream options (per-token chunks, coalesced chunks,
// completions only) carry the same tokens and logprob bits, and a stream that ends early is
// still counted in the metrics. Against a real server on loopback.
#include <chrono>
#include <cstdlib>
#include <map>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/reliability_util.h"
#include "tests/test_server.h"

namespace rollout::testing {
namespace {

namespace rel = ::rollout::testing::reliability;

using std::chrono::milliseconds;
using std::chrono::seconds;
using Clock = std::chrono::steady_clock;

const std::vector<uint32_t> kPrompt = {17, 4, 901, 33, 2048, 7, 250, 3999, 12};

// The value of `key` (a full series name with labels) on a /metrics page; 0 if absent.
uint64_t MetricValue(const std::string& page, const std::string& key) {
  const size_t at = page.find(key + " ");
  if (at == std::string::npos) return 0;
  return std::strtoull(page.c_str() + at + key.size() + 1, nullptr, 10);
}

TEST(StreamMetricsTest, ACancelledGenerateStreamCountsItsSamplesAsAborted) {
  ServerOptions options;
  options.metrics_port = rel::PickFreePort();
  ASSERT_GT(options.metrics_port, 0);
  std::unique_ptr<TestServer> server = StartTestServer(options);
  ASSERT_NE(server, nullptr);
  const std::string aborted = "rollout_samples_total{finish_reason=\"abort\"}";
  ASSERT_EQ(MetricValue(rel::HttpGet(options.metrics_port, "/metrics"), aborted), 0u);

  v1::GenerateRequest request;
  *request.add_rollouts() = MakeRollout(kPrompt, 3, 3000, 1.0f);
  request.mutable_rollouts(0)->set_num_samples(4);
  request.mutable_rollouts(0)->mutable_sampling()->set_ignore_eos(true);
  grpc::ClientContext context;
  auto reader = server->stub->Generate(&context, request);
  v1::GenerateResponse response;
  ASSERT_TRUE(reader->Read(&response));  // the samples run
  context.TryCancel();
  while (reader->Read(&response)) {
  }
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);

  // The samples end on the engine after the call did; their completions reach no client.
  uint64_t count = 0;
  const auto deadline = Clock::now() + seconds(30);
  while (count < 4 && Clock::now() < deadline) {
    count = MetricValue(rel::HttpGet(options.metrics_port, "/metrics"), aborted);
    if (count < 4) std::this_thread::sleep_for(milliseconds(20));
  }
  EXPECT_EQ(count, 4u);
}

}  // namespace
}  // namespace rollout::testing
