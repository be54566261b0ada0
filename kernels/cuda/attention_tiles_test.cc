// The tensor-core attention's tile staging arithmetic (attention_tiles.h): pure host arithmetic,
// so CI checks the copies a thread issues and the shared-memory layout they fill; the kernels
// that use it are proved on a GPU (rollout-attention-bench, tests/gpu/kernels_test.cc).
#include "kernels/cuda/attention_tiles.h"

#include <set>

#include "gtest/gtest.h"

namespace rollout::cuda {
namespace {

// Every copy equals the plain loop's (chunk i = thread + r kThreads of the tile), and together
// the threads' copies fill each of the tile's chunks exactly once.
template <int kHeadDim, int kThreads, bool kWgmma>
void ExpectTheCopiesOfThePlainLoop() {
  using Copies = PageTileCopies<kHeadDim, kThreads, kWgmma>;
  constexpr int kChunks = kHeadDim / 8;
  std::set<int> dsts;
  for (unsigned thread = 0; thread < kThreads; ++thread) {
    for (int r = 0; r < Copies::kCopies; ++r) {
      const int i = static_cast<int>(thread) + r * kThreads;
      const TileCopy copy = Copies::Copy(thread, r);
      EXPECT_EQ(copy.key, i / kChunks) << "thread " << thread << " copy " << r;
      EXPECT_EQ(copy.src, 8 * i) << "thread " << thread << " copy " << r;
      EXPECT_EQ(copy.dst, (StagedChunkOffset<kHeadDim, kWgmma>(i / kChunks, i % kChunks)));
      dsts.insert(copy.dst);
    }
  }
  ASSERT_EQ(dsts.size(), static_cast<size_t>(kAttentionTile * kChunks));
  for (int dst : dsts) {
    EXPECT_EQ(dst % 8, 0);
    EXPECT_LT(dst / 8, kAttentionTile * kChunks);
  }
}

TEST(AttentionTilesTest, APageTilesCopiesAreThePlainLoopsAndFillEveryChunkOnce) {
  ExpectTheCopiesOfThePlainLoop<128, 128, true>();  // the wgmma prefill block
  ExpectTheCopiesOfThePlainLoop<128, 128, false>();
  ExpectTheCopiesOfThePlainLoop<64, 128, false>();
  ExpectTheCopiesOfThePlainLoop<32, 128, false>();
  ExpectTheCopiesOfThePlainLoop<128, 32, false>();  // one warp
  ExpectTheCopiesOfThePlainLoop<32, 32, false>();
}

// The wgmma layout is the 128-byte swizzle its descriptors name, from a 1024-byte aligned base:
// dims 64 h.. in half h (4096 bytes each), key j's 128-byte row at j * 128, and the 16-byte
// chunk position within the row the logical chunk XOR the row's bits 7..9 of the address.
TEST(AttentionTilesTest, TheWgmmaTileIsTheHundredTwentyEightByteSwizzle) {
  for (int j = 0; j < kAttentionTile; ++j) {
    for (int c = 0; c < 16; ++c) {
      const int byte = 2 * StagedChunkOffset<128, true>(j, c);
      EXPECT_EQ(byte / 4096, c / 8) << j << " " << c;
      EXPECT_EQ(byte % 4096 / 128, j) << j << " " << c;
      EXPECT_EQ(((byte >> 4) & 7) ^ ((byte >> 7) & 7), c % 8) << j << " " << c;
    }
  }
}

// The ldmatrix layout: key j's row of kHeadDim elements, chunk c at c ^ (j & (min(chunks, 8) -
// 1)), so that 8 consecutive keys' same chunk land in 8 distinct 16-byte bank groups.
TEST(AttentionTilesTest, TheMmaSyncTileSpreadsEightKeysOverEightBankGroups) {
  for (int c = 0; c < 16; ++c) {
    std::set<int> groups;
    for (int j = 0; j < 8; ++j) groups.insert(StagedChunkOffset<128, false>(j, c) / 8 % 8);
    EXPECT_EQ(groups.size(), 8u) << "chunk " << c;
  }
  EXPECT_EQ((StagedChunkOffset<32, false>(5, 2)), 5 * 32 + (2 ^ (5 & 3)) * 8);
}

}  // namespace
}  // namespace rollout::cuda
