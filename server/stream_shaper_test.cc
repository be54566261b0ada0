#include "server/stream_shaper.h"

#include <chrono>
#include <vector>

#include "gtest/gtest.h"

namespace rollout {
namespace {

using std::chrono::milliseconds;
using Clock = StreamShaper::Clock;

// One decode step's event of sample (rollout, sample): token `token`, logprob -token.
SampleEvent Token(int32_t rollout, int32_t sample, int32_t token, bool last = false) {
  SampleEvent e;
  e.rollout_index = rollout;
  e.sample_index = sample;
  e.new_token_ids = {token};
  e.new_logprobs = {-static_cast<float>(token)};
  if (last) e.completion.emplace().token_ids = {token};
  return e;
}

// The token ids of each message, a completion as {-1}.
std::vector<std::vector<int32_t>> Shape(const std::vector<v1::GenerateResponse>& out) {
  std::vector<std::vector<int32_t>> shape;
  for (const v1::GenerateResponse& r : out) {
    if (r.has_completion()) {
      shape.push_back({-1});
    } else {
      shape.emplace_back(r.chunk().token_ids().begin(), r.chunk().token_ids().end());
    }
  }
  return shape;
}

TEST(StreamShaperTest, ChunkTokensHoldsEachSamplesTokensApartUntilItHasEnough) {
  v1::StreamOptions options;
  options.set_chunk_tokens(3);
  const Clock::time_point t0 = Clock::now();
  StreamShaper shaper(options, {1, 2}, t0);
  std::vector<v1::GenerateResponse> out;
  for (int32_t t = 1; t <= 4; ++t) {
    shaper.Append(Token(0, 0, t), t0, &out);
    shaper.Append(Token(1, 1, 10 + t), t0, &out);
  }
  shaper.Append(Token(1, 1, 15, /*last=*/true), t0, &out);
  EXPECT_EQ(Shape(out),
            (std::vector<std::vector<int32_t>>{{1, 2, 3}, {11, 12, 13}, {14, 15}, {-1}}));
  EXPECT_EQ(out[2].chunk().rollout_index(), 1u);
  EXPECT_EQ(out[2].chunk().sample_index(), 1u);
  EXPECT_EQ(out[2].chunk().logprobs(1), -15.0f);
}

TEST(StreamShaperTest, ChunkIntervalSendsWhatIsHeldAtTheFirstTokenAfterIt) {
  v1::StreamOptions options;
  options.set_chunk_interval_ms(10);
  const Clock::time_point t0 = Clock::now();
  StreamShaper shaper(options, {1}, t0);
  std::vector<v1::GenerateResponse> out;
  shaper.Append(Token(0, 0, 1), t0 + milliseconds(4), &out);
  shaper.Append(Token(0, 0, 2), t0 + milliseconds(9), &out);
  EXPECT_TRUE(out.empty());
  shaper.Append(Token(0, 0, 3), t0 + milliseconds(10), &out);  // 10 ms since the call started
  shaper.Append(Token(0, 0, 4), t0 + milliseconds(19), &out);
  shaper.Append(Token(0, 0, 5), t0 + milliseconds(20), &out);  // 10 ms since that chunk
  EXPECT_EQ(Shape(out), (std::vector<std::vector<int32_t>>{{1, 2, 3}, {4, 5}}));
}

TEST(StreamShaperTest, CompletionsOnlySendsNoChunk) {
  v1::StreamOptions options;
  options.set_completions_only(true);
  StreamShaper shaper(options, {1}, Clock::now());
  std::vector<v1::GenerateResponse> out;
  shaper.Append(Token(0, 0, 1), Clock::now(), &out);
  shaper.Append(Token(0, 0, 2, /*last=*/true), Clock::now(), &out);
  EXPECT_EQ(Shape(out), (std::vector<std::vector<int32_t>>{{-1}}));
}

TEST(StreamShaperTest, DefaultsSendAChunkPerEvent) {
  StreamShaper shaper(v1::StreamOptions(), {1}, Clock::now());
  std::vector<v1::GenerateResponse> out;
  shaper.Append(Token(0, 0, 1), Clock::now(), &out);
  shaper.Append(Token(0, 0, 2, /*last=*/true), Clock::now(), &out);
  EXPECT_EQ(Shape(out), (std::vector<std::vector<int32_t>>{{1}, {2}, {-1}}));
}

TEST(StreamShaperTest, ValidateRefusesCompletionsOnlyWithCoalescing) {
  v1::StreamOptions options;
  options.set_completions_only(true);
  EXPECT_TRUE(ValidateStreamOptions(options).ok());
  options.set_chunk_interval_ms(5);
  EXPECT_EQ(ValidateStreamOptions(options).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace rollout
