#include "engine/kv_block_manager.h"

#include <set>

#include "gtest/gtest.h"

namespace rollout {
namespace {

TEST(KvBlockManagerTest, GrowAllocatesExactlyTheBlocksNeeded) {
  KvBlockManager blocks(10, 16);
  std::vector<int32_t> table;
  ASSERT_TRUE(blocks.Grow(1, &table));
  EXPECT_EQ(table.size(), 1u);
  ASSERT_TRUE(blocks.Grow(16, &table));
  EXPECT_EQ(table.size(), 1u);
  ASSERT_TRUE(blocks.Grow(17, &table));
  EXPECT_EQ(table.size(), 2u);
  EXPECT_EQ(blocks.num_free(), 8);
  EXPECT_EQ(std::set<int32_t>(table.begin(), table.end()).size(), 2u) << "distinct blocks";
}

TEST(KvBlockManagerTest, GrowBeyondFreeChangesNothing) {
  KvBlockManager blocks(3, 4);
  std::vector<int32_t> table;
  ASSERT_TRUE(blocks.Grow(8, &table));
  const std::vector<int32_t> before = table;
  EXPECT_FALSE(blocks.Grow(13, &table));  // needs 4 blocks, 3 exist
  EXPECT_EQ(table, before);
  EXPECT_EQ(blocks.num_free(), 1);
}

TEST(KvBlockManagerTest, ReleaseReturnsEveryBlockAndAllocationIsDeterministic) {
  KvBlockManager a(8, 2), b(8, 2);
  std::vector<int32_t> ta, tb, ua, ub;
  ASSERT_TRUE(a.Grow(5, &ta) && b.Grow(5, &tb));
  ASSERT_TRUE(a.Grow(3, &ua) && b.Grow(3, &ub));
  EXPECT_EQ(ta, tb);
  EXPECT_EQ(ua, ub);
  a.Release(&ta);
  EXPECT_TRUE(ta.empty());
  a.Release(&ua);
  EXPECT_EQ(a.num_free(), 8);
  std::vector<int32_t> again;
  ASSERT_TRUE(a.Grow(16, &again));
  EXPECT_EQ(std::set<int32_t>(again.begin(), again.end()).size(), 8u);
  EXPECT_EQ(a.num_free(), 0);
}

}  // namespace
}  // namespace rollout
