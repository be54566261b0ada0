// How a Generate stream is delivered: the stream options (per-token chunks, coalesced chunks,
// completions only) carry the same tokens and logprob bits, and a stream that ends early is
// still counted in the metrics. Against a real server on loopback.
#include <chrono>
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

// A sample's tokens, logprobs and top logprobs as one TokenChunk; serialized, so that equal
// strings mean equal bits.
using SampleKey = std::pair<uint32_t, uint32_t>;

std::string Bits(const v1::TokenChunk& chunk) {
  v1::TokenChunk c = chunk;
  c.clear_rollout_index();
  c.clear_sample_index();
  return c.SerializeAsString();
}

v1::TokenChunk AsChunk(const v1::Completion& completion) {
  v1::TokenChunk c;
  *c.mutable_token_ids() = completion.token_ids();
  *c.mutable_logprobs() = completion.logprobs();
  *c.mutable_top_logprobs() = completion.top_logprobs();
  return c;
}

// What one stream delivered, by sample.
struct Delivered {
  std::map<SampleKey, std::string> completions;  // Bits(AsChunk(completion)) + finish reason
  std::map<SampleKey, v1::TokenChunk> streamed;  // the chunks concatenated
  std::map<SampleKey, std::vector<int>> chunk_sizes;
  size_t messages = 0;
};

Delivered Deliver(v1::RolloutService::Stub* stub, const v1::GenerateRequest& request) {
  const GenerateOutcome out = RunGenerate(stub, request);
  EXPECT_TRUE(out.status.ok()) << out.status.error_message();
  Delivered d;
  d.messages = out.responses.size();
  std::map<SampleKey, bool> done;
  for (const v1::GenerateResponse& r : out.responses) {
    if (r.has_chunk()) {
      const SampleKey key{r.chunk().rollout_index(), r.chunk().sample_index()};
      EXPECT_FALSE(done[key]) << "a chunk after the completion of " << key.first << "/"
                              << key.second;
      d.streamed[key].MergeFrom(r.chunk());  // repeated fields concatenate
      d.chunk_sizes[key].push_back(r.chunk().token_ids_size());
    } else {
      const v1::Completion& c = r.completion();
      const SampleKey key{c.rollout_index(), c.sample_index()};
      done[key] = true;
      d.completions[key] = absl::StrCat(Bits(AsChunk(c)), "|", c.finish_reason());
    }
  }
  return d;
}

// Greedy and sampled rollouts with top logprobs, several samples, some stopping early.
v1::GenerateRequest MixedRequest() {
  v1::GenerateRequest request;
  *request.add_rollouts() = MakeRollout(kPrompt, 11, 40, 0.0f);
  *request.add_rollouts() = MakeRollout({5, 6, 7}, 12, 57, 1.0f);
  *request.add_rollouts() = MakeRollout({900, 901}, 13, 23, 0.7f);
  request.mutable_rollouts(1)->set_num_samples(3);
  request.mutable_rollouts(2)->set_num_samples(2);
  for (auto& r : *request.mutable_rollouts()) r.mutable_sampling()->set_top_logprobs(2);
  // Stops some samples early, so held tokens meet a completion mid-chunk.
  request.mutable_rollouts(1)->mutable_sampling()->add_stop_token_ids(7);
  return request;
}

class StreamOptionsTest : public SharedServerTest {};

TEST_F(StreamOptionsTest, CoalescedAndCompletionsOnlyStreamsCarryThePerTokenStreamsBits) {
  const v1::GenerateRequest per_token = MixedRequest();
  const Delivered reference = Deliver(stub(), per_token);
  ASSERT_EQ(reference.completions.size(), 6u);
  for (const auto& [key, chunk] : reference.streamed) {
    for (int n : reference.chunk_sizes.at(key)) EXPECT_EQ(n, 1);
  }

  v1::GenerateRequest by_count = per_token;
  by_count.mutable_stream()->set_chunk_tokens(5);
  v1::GenerateRequest by_time = per_token;
  by_time.mutable_stream()->set_chunk_interval_ms(50);
  v1::GenerateRequest by_both = per_token;
  by_both.mutable_stream()->set_chunk_tokens(8);
  by_both.mutable_stream()->set_chunk_interval_ms(20);
  v1::GenerateRequest completions_only = per_token;
  completions_only.mutable_stream()->set_completions_only(true);

  for (const v1::GenerateRequest* request : {&by_count, &by_time, &by_both, &completions_only}) {
    SCOPED_TRACE(request->stream().ShortDebugString());
    const Delivered d = Deliver(stub(), *request);
    EXPECT_EQ(d.completions, reference.completions);
    if (request->stream().completions_only()) {
      EXPECT_TRUE(d.streamed.empty());
      EXPECT_EQ(d.messages, 6u);
      continue;
    }
    ASSERT_EQ(d.streamed.size(), reference.streamed.size());
    for (const auto& [key, chunk] : reference.streamed) {
      EXPECT_EQ(Bits(d.streamed.at(key)), Bits(chunk)) << key.first << "/" << key.second;
    }
    EXPECT_LT(d.messages, reference.messages);
  }

  // By count alone: every chunk but a sample's last has exactly 5 tokens (one a step).
  const Delivered d = Deliver(stub(), by_count);
  for (const auto& [key, sizes] : d.chunk_sizes) {
    for (size_t i = 0; i + 1 < sizes.size(); ++i) EXPECT_EQ(sizes[i], 5) << i;
    EXPECT_LE(sizes.back(), 5);
  }
}

TEST_F(StreamOptionsTest, CompletionsOnlyWithCoalescingIsInvalidArgumentNamingTheFields) {
  v1::GenerateRequest request = MixedRequest();
  request.mutable_stream()->set_completions_only(true);
  request.mutable_stream()->set_chunk_tokens(4);
  const GenerateOutcome out = RunGenerate(stub(), request);
  EXPECT_EQ(out.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(out.status.error_message().find("stream.completions_only"), std::string::npos)
      << out.status.error_message();
  EXPECT_TRUE(out.responses.empty());
}

TEST(StreamMetricsTest, ACancelledGenerateStreamCountsItsSamplesAsAborted) {
  ServerOptions options;
  options.metrics_port = rel::PickFreePort();
  ASSERT_GT(options.metrics_port, 0);
  std::unique_ptr<TestServer> server = StartTestServer(options);
  ASSERT_NE(server, nullptr);
  const std::string aborted = "rollout_samples_total{finish_reason=\"abort\"}";
  ASSERT_EQ(rel::MetricValue(rel::HttpGet(options.metrics_port, "/metrics"), aborted), 0u);

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
    count = rel::MetricValue(rel::HttpGet(options.metrics_port, "/metrics"), aborted);
    if (count < 4) std::this_thread::sleep_for(milliseconds(20));
  }
  EXPECT_EQ(count, 4u);
}

}  // namespace
}  // namespace rollout::testing
