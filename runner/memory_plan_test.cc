#include "runner/memory_plan.h"

#include "gtest/gtest.h"

namespace rollout {
namespace {

TEST(MemoryPlanTest, FitsOrNamesTheSettingsThatLowerTheLargestItemsFirst) {
  MemoryPlan plan;
  plan.where = "GPU 0";
  plan.items = {{"weights", 10ll << 30, ""},
                {"step workspace", 2ll << 30, "--max_batch_tokens"},
                {"KV cache", 6ll << 30, "--kv_cache_mb"}};
  plan.available = 20ll << 30;
  EXPECT_TRUE(plan.Check().ok());
  EXPECT_NE(plan.ToString().find("2.00 GiB left free"), std::string::npos) << plan.ToString();

  plan.available = 16ll << 30;
  const absl::Status s = plan.Check();
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  const std::string m(s.message());
  EXPECT_NE(m.find("2.00 GiB more than the 16.00 GiB available"), std::string::npos) << m;
  const size_t kv = m.find("--kv_cache_mb (KV cache 6.00 GiB)");
  const size_t budget = m.find("--max_batch_tokens (step workspace 2.00 GiB)");
  ASSERT_NE(kv, std::string::npos) << m;
  ASSERT_NE(budget, std::string::npos) << m;
  EXPECT_LT(kv, budget) << "the largest item's setting comes first: " << m;
}

TEST(MemoryPlanTest, UnknownAvailableMemoryRefusesNothing) {
  MemoryPlan plan;
  plan.items = {{"weights", 1ll << 40, ""}};
  EXPECT_TRUE(plan.Check().ok());
}

TEST(MemoryPlanTest, TheHostReportsItsAvailableMemory) { EXPECT_GT(AvailableHostMemory(), 0); }

}  // namespace
}  // namespace rollout
