#include "runner/cpu/releasable_host_memory.h"

#include <cstdint>
#include <cstring>

#include "gtest/gtest.h"

namespace rollout {
namespace {

constexpr size_t kBytes = size_t{24} << 20;

TEST(ReleasableHostMemoryTest, AllocatedMemoryIsZeroedAndResident) {
  absl::StatusOr<ReleasableHostMemory> m = ReleasableHostMemory::Allocate(kBytes);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->bytes(), kBytes);
  EXPECT_EQ(*m->ResidentBytes(), static_cast<int64_t>(kBytes));
  const uint8_t* p = m->get<uint8_t>();
  for (size_t i = 0; i < kBytes; i += 4093) ASSERT_EQ(p[i], 0) << i;
}

TEST(ReleasableHostMemoryTest, ReleaseGivesThePagesBackAndReacquireZeroesThemAtTheSameAddress) {
  absl::StatusOr<ReleasableHostMemory> m = ReleasableHostMemory::Allocate(kBytes);
  ASSERT_TRUE(m.ok()) << m.status();
  void* const address = m->get();
  std::memset(m->get(), 0x5a, kBytes);
  ASSERT_TRUE(m->Release().ok());
  EXPECT_TRUE(m->released());
  EXPECT_EQ(*m->ResidentBytes(), 0);
  EXPECT_EQ(m->get(), address);
  ASSERT_TRUE(m->Release().ok()) << "idempotent";
  ASSERT_TRUE(m->Reacquire().ok());
  EXPECT_FALSE(m->released());
  EXPECT_EQ(m->get(), address);
  EXPECT_EQ(*m->ResidentBytes(), static_cast<int64_t>(kBytes));
  const uint8_t* p = m->get<uint8_t>();
  for (size_t i = 0; i < kBytes; i += 4093) ASSERT_EQ(p[i], 0) << i;
  ASSERT_TRUE(m->Reacquire().ok()) << "idempotent";
}

TEST(ReleasableHostMemoryTest, ATouchWhileReleasedFaultsInsteadOfReadingZeros) {
  absl::StatusOr<ReleasableHostMemory> m = ReleasableHostMemory::Allocate(1 << 20);
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_TRUE(m->Release().ok());
  volatile uint8_t* p = m->get<uint8_t>();
  EXPECT_DEATH({ (void)p[100]; }, "");
}

TEST(ReleasableHostMemoryTest, MovingHandsTheMappingOver) {
  absl::StatusOr<ReleasableHostMemory> m = ReleasableHostMemory::Allocate(1 << 20);
  ASSERT_TRUE(m.ok()) << m.status();
  void* const address = m->get();
  ReleasableHostMemory moved = *std::move(m);
  EXPECT_EQ(moved.get(), address);
  EXPECT_EQ(moved.bytes(), size_t{1} << 20);
  ReleasableHostMemory empty;
  EXPECT_EQ(empty.get(), nullptr);
  EXPECT_EQ(*empty.ResidentBytes(), 0);
  EXPECT_TRUE(empty.Release().ok());
}

}  // namespace
}  // namespace rollout
