// The expert GEMMs' block shape by step size (MoeTileRowsFor / MoeTileColumnsFor, moe.h): pure
// host arithmetic, so CI checks the choice the runner and the trainer make; the shapes' bits and
// speed are proved on a GPU (tests/gpu/moe_gemm_test.cc, rollout-moe-bench).
#include "gtest/gtest.h"
#include "kernels/cuda/moe.h"

namespace rollout::cuda {
namespace {

TEST(MoeTilesTest, WideWarpgroupTilesFromSixtyFourAssignmentsWhereBothProjectionsAllowThem) {
  // Qwen3-30B-A3B: 128 experts, hidden 2048, expert width 768 (2 x 768 and 2048: multiples of 256).
  const int32_t e = 128;
  const int64_t h = 2048, inter = 768;
  EXPECT_EQ(MoeTileRowsFor(8, e, h, inter), kMoeTileRows);     // 1 token at top-8
  EXPECT_EQ(MoeTileRowsFor(63, e, h, inter), kMoeTileRows);
  EXPECT_EQ(MoeTileRowsFor(64, e, h, inter), kMoeTileRowsXLarge);  // 8 tokens
  EXPECT_EQ(MoeTileRowsFor(2048, e, h, inter), kMoeTileRowsXLarge);  // a 256-token decode step
  EXPECT_EQ(MoeTileColumnsFor(MoeTileRowsFor(2048, e, h, inter), h, inter), kMoeTileColumnsWide);
}

TEST(MoeTilesTest, OtherShapesKeepTheMeanRowsRule) {
  // 2 x 100 columns are no multiple of 256: no wide tiles, the mean rows an expert decide.
  const int32_t e = 128;
  const int64_t h = 2048, inter = 100;
  EXPECT_EQ(MoeTileRowsFor(2048, e, h, inter), kMoeTileRows);  // 16 rows an expert
  EXPECT_EQ(MoeTileRowsFor(int64_t{64} * e, e, h, inter), kMoeTileRowsLarge);
  EXPECT_EQ(MoeTileRowsFor(int64_t{256} * e, e, h, inter), kMoeTileRowsXLarge);
  EXPECT_EQ(MoeTileColumnsFor(kMoeTileRowsXLarge, h, inter), 0);
  // hidden not a multiple of 128: the decode shape at every size.
  EXPECT_EQ(MoeTileRowsFor(int64_t{1} << 20, e, 200, 768), kMoeTileRows);
}

}  // namespace
}  // namespace rollout::cuda
