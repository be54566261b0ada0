#include "runner/cpu/communicator.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <thread>
#include <vector>

namespace rollout {
namespace {

// Runs fn(rank, comm) for every rank of an in-process group of `n`, each on its own thread.
template <typename Fn>
void RunRanks(int n, Fn fn) {
  std::vector<std::unique_ptr<Communicator>> group = CreateInProcessGroup(n);
  ASSERT_EQ(group.size(), static_cast<size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] { fn(r, group[r].get()); });
  }
  for (std::thread& t : threads) t.join();
}

TEST(InProcessCommunicatorTest, AllGatherPutsEveryRanksBufferInRankOrder) {
  for (int n : {1, 2, 4, 8}) {
    for (int64_t count : {0, 1, 5, 1000}) {
      std::vector<std::vector<float>> recv(n);
      RunRanks(n, [&](int rank, Communicator* comm) {
        EXPECT_EQ(comm->rank(), rank);
        EXPECT_EQ(comm->world_size(), n);
        EXPECT_STREQ(comm->kind(), "in-process");
        std::vector<float> send(count);
        for (int64_t i = 0; i < count; ++i) send[i] = rank * 10000.0f + i;
        recv[rank].assign(n * count, -1.0f);
        EXPECT_TRUE(comm->AllGather(send.data(), count, recv[rank].data()).ok());
        // The send buffer may be reused at once.
        std::fill(send.begin(), send.end(), -2.0f);
      });
      for (int r = 0; r < n; ++r) {
        for (int src = 0; src < n; ++src) {
          for (int64_t i = 0; i < count; ++i) {
            ASSERT_EQ(recv[r][src * count + i], src * 10000.0f + i)
                << "n=" << n << " rank " << r << " from " << src << " [" << i << "]";
          }
        }
      }
    }
  }
}

TEST(InProcessCommunicatorTest, AllGatherInPlaceAndManyRoundsInLockstep) {
  const int n = 4;
  const int64_t count = 64;
  std::atomic<int> bad{0};
  RunRanks(n, [&](int rank, Communicator* comm) {
    std::vector<float> buf(n * count);
    for (int round = 0; round < 200; ++round) {
      for (int64_t i = 0; i < count; ++i) buf[rank * count + i] = round * 100.0f + rank;
      if (!comm->AllGather(&buf[rank * count], count, buf.data()).ok()) ++bad;
      for (int src = 0; src < n; ++src) {
        for (int64_t i = 0; i < count; ++i) {
          if (buf[src * count + i] != round * 100.0f + src) ++bad;
        }
      }
    }
  });
  EXPECT_EQ(bad.load(), 0);
}

TEST(InProcessCommunicatorTest, MismatchedCountsAreAnErrorOnEveryRank) {
  const int n = 2;
  std::vector<bool> ok(n, true);
  RunRanks(n, [&](int rank, Communicator* comm) {
    std::vector<float> send(4 + rank), recv(2 * 8);
    ok[rank] = comm->AllGather(send.data(), 4 + rank, recv.data()).ok();
  });
  EXPECT_FALSE(ok[0]);
  EXPECT_FALSE(ok[1]);
}

TEST(InProcessCommunicatorTest, BarrierWaitsForEveryRank) {
  const int n = 4;
  std::atomic<int> arrived{0};
  std::atomic<int> early{0};
  RunRanks(n, [&](int rank, Communicator* comm) {
    for (int round = 1; round <= 50; ++round) {
      if (rank == round % n) std::this_thread::yield();
      ++arrived;
      EXPECT_TRUE(comm->Barrier().ok());
      if (arrived.load() < round * n) ++early;
      EXPECT_TRUE(comm->Barrier().ok());  // nobody starts the next round before all checked
    }
  });
  EXPECT_EQ(early.load(), 0);
}

}  // namespace
}  // namespace rollout
