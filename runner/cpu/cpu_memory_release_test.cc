// The CPU runner's side of ReleaseMemory / ResumeMemory: every rank's KV pages go back to the
// OS and come back zeroed, the logits after are bitwise those before, nothing runs meanwhile,
// and a resume the host cannot hold is refused with everything still released.
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "model/random_model.h"
#include "runner/cpu/cpu_model_runner.h"

namespace rollout {
namespace {

const std::string& ModelDir() {
  static const std::string dir = [] {
    std::string d = ::testing::TempDir() + "cpu-memory-release-test";
    RandomModelOptions options;
    options.preset = "tiny";
    options.seed = 8;
    EXPECT_TRUE(WriteRandomModel(options, d).ok());
    return d;
  }();
  return dir;
}

std::unique_ptr<CpuModelRunner> MakeRunner(int tp, std::function<int64_t()> memory = nullptr) {
  absl::StatusOr<std::unique_ptr<Checkpoint>> ck = Checkpoint::Open(ModelDir());
  EXPECT_TRUE(ck.ok()) << ck.status();
  CpuRunnerOptions options;
  options.tensor_parallel = tp;
  options.kv_cache_bytes = 8 << 20;
  options.available_host_memory = std::move(memory);
  absl::StatusOr<std::unique_ptr<CpuModelRunner>> runner = CpuModelRunner::Create(**ck, options);
  EXPECT_TRUE(runner.ok()) << runner.status();
  return runner.ok() ? *std::move(runner) : nullptr;
}

// A prefill of 21 tokens then two decode steps, in blocks 2 and 5; every row's logits.
std::string Logits(CpuModelRunner* runner) {
  std::vector<float> all;
  ForwardBatch b;
  b.block_tables = {{2, 5}};
  auto step = [&](int from, int n) {
    b.token_ids.clear();
    b.positions.clear();
    b.token_seq.clear();
    b.logit_rows.clear();
    for (int i = 0; i < n; ++i) {
      b.token_ids.push_back((from + i) * 37 % runner->config().vocab_size);
      b.positions.push_back(from + i);
      b.token_seq.push_back(0);
      b.logit_rows.push_back(i);
    }
    std::vector<float> logits;
    absl::Status s = runner->Forward(b, &logits);
    EXPECT_TRUE(s.ok()) << s;
    all.insert(all.end(), logits.begin(), logits.end());
  };
  step(0, 21);
  step(21, 1);
  step(22, 1);
  std::string bits(all.size() * sizeof(float), '\0');
  std::memcpy(bits.data(), all.data(), bits.size());
  return bits;
}

TEST(CpuMemoryReleaseTest, EveryRanksKvPagesGoAndComeBackWithTheSameLogits) {
  for (int tp : {1, 2}) {
    SCOPED_TRACE(tp);
    std::unique_ptr<CpuModelRunner> runner = MakeRunner(tp);
    const std::string before = Logits(runner.get());
    const int64_t kv = runner->kv_cache_bytes();
    EXPECT_EQ(*runner->ResidentKvCacheBytes(), kv);
    absl::StatusOr<ReleasedMemory> freed = runner->ReleaseMemory(/*weights=*/true);
    ASSERT_TRUE(freed.ok()) << freed.status();
    EXPECT_EQ(freed->kv_cache_bytes, kv);
    EXPECT_EQ(freed->weight_bytes, 0) << "the CPU backend keeps its weights";
    EXPECT_FALSE(freed->weights);
    EXPECT_EQ(*runner->ResidentKvCacheBytes(), 0);
    absl::StatusOr<ReleasedMemory> again = runner->ReleaseMemory(false);
    ASSERT_TRUE(again.ok());
    EXPECT_EQ(again->kv_cache_bytes, 0) << "released already";

    std::vector<float> logits;
    ForwardBatch b;
    b.token_ids = {1};
    b.positions = {0};
    b.token_seq = {0};
    b.block_tables = {{0}};
    b.logit_rows = {0};
    EXPECT_EQ(runner->Forward(b, &logits).code(), absl::StatusCode::kFailedPrecondition);

    absl::StatusOr<ReleasedMemory> taken = runner->ResumeMemory();
    ASSERT_TRUE(taken.ok()) << taken.status();
    EXPECT_EQ(taken->kv_cache_bytes, kv);
    EXPECT_EQ(*runner->ResidentKvCacheBytes(), kv);
    EXPECT_EQ(Logits(runner.get()), before);
    absl::StatusOr<ReleasedMemory> nothing = runner->ResumeMemory();
    ASSERT_TRUE(nothing.ok());
    EXPECT_EQ(nothing->kv_cache_bytes, 0);
  }
}

TEST(CpuMemoryReleaseTest, AResumeTheHostCannotHoldIsRefusedAndEverythingStaysReleased) {
  int64_t available = 1 << 20;
  std::unique_ptr<CpuModelRunner> runner = MakeRunner(2, [&available] { return available; });
  const std::string before = Logits(runner.get());
  ASSERT_TRUE(runner->ReleaseMemory(false).ok());
  absl::StatusOr<ReleasedMemory> refused = runner->ResumeMemory();
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_NE(refused.status().message().find("the host has 0.00 GiB available"), std::string::npos)
      << refused.status();
  EXPECT_EQ(*runner->ResidentKvCacheBytes(), 0);
  available = int64_t{1} << 40;
  absl::StatusOr<ReleasedMemory> taken = runner->ResumeMemory();
  ASSERT_TRUE(taken.ok()) << taken.status();
  EXPECT_EQ(taken->kv_cache_bytes, runner->kv_cache_bytes());
  EXPECT_EQ(Logits(runner.get()), before);
}

}  // namespace
}  // namespace rollout
