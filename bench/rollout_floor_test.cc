// The benchmark floor's arithmetic (bench/rollout_floor.h), host only: the one-GPU floor is the
// formula of docs/benchmarks.md, and across GPUs each GPU's share plus the all-gathers.
#include "bench/rollout_floor.h"

#include <vector>

#include "gtest/gtest.h"
#include "model/random_model.h"

namespace rollout {
namespace {

TEST(RolloutFloorTest, KvPerGpuIsTheRanksHeadsSplitOrOneReplicated) {
  const ModelConfig c = *PresetConfig("qwen3-8b");  // 8 KV heads
  EXPECT_DOUBLE_EQ(KvBytesPerTokenPerGpu(c, 1), KvBytesPerToken(c));
  EXPECT_DOUBLE_EQ(KvBytesPerTokenPerGpu(c, 2), KvBytesPerToken(c) / 2.0);
  EXPECT_DOUBLE_EQ(KvBytesPerTokenPerGpu(c, 8), KvBytesPerToken(c) / 8.0);
  const ModelConfig small = *PresetConfig("small");  // 2 KV heads: replicated at 4
  EXPECT_DOUBLE_EQ(KvBytesPerTokenPerGpu(small, 4), KvBytesPerToken(small) / 2.0);
}

TEST(RolloutFloorTest, GatherBytesAreTheOtherRanksNodesEmbeddingsAndLogitsColumns) {
  const ModelConfig c = *PresetConfig("qwen3-8b");
  EXPECT_EQ(TpGatherBytes(c, 1, 256, 256), 0.0);
  // TP 2, 256 tokens and rows: 1 other rank x ((2 x 36 + 1) nodes of 256 x 4096 fp32 + 256 rows
  // of 75,968 logits columns fp32).
  EXPECT_DOUBLE_EQ(TpGatherBytes(c, 2, 256, 256), 73.0 * 256 * 4096 * 4 + 256.0 * 75968 * 4);
  // TP 4: three other ranks, ceil(151936 / 4) columns each.
  EXPECT_DOUBLE_EQ(TpGatherBytes(c, 4, 8, 2), 3 * (73.0 * 8 * 4096 * 4 + 2.0 * 37984 * 4));
}

TEST(RolloutFloorTest, AcrossGpusEachGetsItsShareAndPaysTheGathers) {
  const ModelConfig c = *PresetConfig("qwen3-8b");
  const std::vector<int> lengths(64, 128);
  const double flops = 800e12, bw = 4.3e12;
  const Floor one = ComputeFloor(c, 64 * 1024, 1024, lengths, 1 << 20, flops, bw);
  EXPECT_EQ(one.gather_s, 0.0);
  EXPECT_GT(one.prefill_s, 0.0);
  // Ranks as streams of one GPU: the one GPU's floor.
  const Floor streams = ComputeFloor(c, 64 * 1024, 1024, lengths, 1 << 20, flops, bw, {1, 0.0});
  EXPECT_DOUBLE_EQ(streams.total(), one.total());
  const Floor two = ComputeFloor(c, 64 * 1024, 1024, lengths, 1 << 20, flops, bw, {2, 400e9});
  EXPECT_DOUBLE_EQ(two.prefill_s, one.prefill_s / 2);
  EXPECT_DOUBLE_EQ(two.decode_gemm_s, one.decode_gemm_s / 2);
  EXPECT_DOUBLE_EQ(two.decode_kv_s, one.decode_kv_s / 2);
  // The prefill's gathers (64 logits rows) and 128 decode steps of 64 tokens and rows.
  const double want = (TpGatherBytes(c, 2, 64 * 1024, 64) + 128 * TpGatherBytes(c, 2, 64, 64)) /
                      400e9;
  EXPECT_NEAR(two.gather_s, want, want * 1e-12);
  EXPECT_DOUBLE_EQ(two.total(),
                   two.prefill_s + two.decode_gemm_s + two.decode_kv_s + two.gather_s);
}

TEST(RolloutFloorTest, SamplesSharingAPromptReadItsKvOnceInTheSharedFloor) {
  const ModelConfig c = *PresetConfig("qwen3-8b");
  const double flops = 800e12, bw = 4.3e12;
  // 2 prompts x 4 samples of 10, 10, 10, 10 / 20, 20, 20, 20 tokens after 1000 prompt tokens,
  // all running at once.
  const std::vector<int> lengths = {10, 10, 10, 10, 20, 20, 20, 20};
  const Floor apart = ComputeFloor(c, 2000, 1000, lengths, 1 << 20, flops, bw);
  EXPECT_DOUBLE_EQ(apart.decode_kv_shared_s, apart.decode_kv_s);  // every prompt its own
  const Floor shared = ComputeFloor(c, 2000, 1000, lengths, 1 << 20, flops, bw, {}, 4);
  EXPECT_DOUBLE_EQ(shared.decode_kv_s, apart.decode_kv_s);
  // Steps 0..9: 8 samples, 2 prompts; steps 10..19: 4 samples, 1 prompt. Generated KV is read per
  // sample, the prompt once per prompt running.
  double tokens = 0, shared_tokens = 0;
  for (int step = 0; step < 20; ++step) {
    const int samples = step < 10 ? 8 : 4, prompts = step < 10 ? 2 : 1;
    tokens += samples * (1000.0 + step + 1);
    shared_tokens += samples * (step + 1.0) + prompts * 1000.0;
  }
  const double per_token = KvBytesPerToken(c) / bw;
  EXPECT_NEAR(apart.decode_kv_s, tokens * per_token, 1e-12);
  EXPECT_NEAR(shared.decode_kv_shared_s, shared_tokens * per_token, 1e-12);
  EXPECT_DOUBLE_EQ(shared.total_shared(),
                   shared.total() - shared.decode_kv_s + shared.decode_kv_shared_s);
}

}  // namespace
}  // namespace rollout
