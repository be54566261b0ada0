#include "common/thread_pool.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <set>
#include <thread>
#include <utility>
#include <vector>

namespace rollout::cpu {
namespace {

struct Range {
  int64_t begin;
  int64_t end;
};

std::vector<Range> RecordRanges(ThreadPool* pool, int64_t n, int64_t grain) {
  std::mutex mu;
  std::vector<Range> ranges;
  pool->ParallelFor(n, grain, [&](int64_t begin, int64_t end) {
    std::lock_guard<std::mutex> lock(mu);
    ranges.push_back({begin, end});
  });
  return ranges;
}

TEST(ThreadPoolTest, CoversEveryIndexExactlyOnceInChunksOfAtLeastGrain) {
  for (int threads : {1, 2, 3, 7}) {
    ThreadPool pool(threads);
    EXPECT_EQ(pool.num_threads(), threads);
    for (int64_t n : {1, 2, 7, 99, 257, 10007}) {
      for (int64_t grain : {1, 3, 16, 100, 100000}) {
        std::vector<int> hits(n, 0);
        const std::vector<Range> ranges = RecordRanges(&pool, n, grain);
        for (const Range& r : ranges) {
          ASSERT_LT(r.begin, r.end);
          // Every chunk has >= grain indices unless the whole loop is smaller than that.
          ASSERT_GE(r.end - r.begin, std::min(grain, n)) << n << " " << grain;
          for (int64_t i = r.begin; i < r.end; ++i) ++hits[i];
        }
        for (int64_t i = 0; i < n; ++i) {
          ASSERT_EQ(hits[i], 1) << "threads=" << threads << " n=" << n << " grain=" << grain;
        }
      }
    }
  }
}

TEST(ThreadPoolTest, EmptyLoopNeverCallsFn) {
  ThreadPool pool(3);
  int calls = 0;
  pool.ParallelFor(0, 1, [&](int64_t, int64_t) { ++calls; });
  EXPECT_EQ(calls, 0);
}

TEST(ThreadPoolTest, LoopNoLargerThanGrainRunsInlineAsOneChunk) {
  ThreadPool pool(4);
  std::vector<std::pair<std::thread::id, Range>> seen;
  pool.ParallelFor(64, 64, [&](int64_t begin, int64_t end) {
    seen.push_back({std::this_thread::get_id(), {begin, end}});
  });
  ASSERT_EQ(seen.size(), 1u);
  EXPECT_EQ(seen[0].first, std::this_thread::get_id());
  EXPECT_EQ(seen[0].second.begin, 0);
  EXPECT_EQ(seen[0].second.end, 64);
}

// The first chunk waits until some other chunk has started. Only a pool that really runs chunks
// concurrently gets past that before the deadline.
TEST(ThreadPoolTest, ChunksRunConcurrentlyOnWorkers) {
  ThreadPool pool(2);
  std::atomic<int> started{0};
  std::atomic<bool> overlapped{false};
  std::mutex mu;
  std::set<std::thread::id> threads;
  pool.ParallelFor(2, 1, [&](int64_t, int64_t) {
    {
      std::lock_guard<std::mutex> lock(mu);
      threads.insert(std::this_thread::get_id());
    }
    started.fetch_add(1);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (started.load() < 2 && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::yield();
    }
    if (started.load() == 2) overlapped = true;
  });
  EXPECT_TRUE(overlapped.load());
  EXPECT_EQ(threads.size(), 2u);
}

TEST(ThreadPoolTest, TenThousandTinyCallsAllComplete) {
  ThreadPool pool(3);
  int64_t total = 0;
  for (int call = 0; call < 10000; ++call) {
    std::atomic<int64_t> sum{0};
    const int64_t n = 1 + call % 13;
    pool.ParallelFor(n, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) sum.fetch_add(i + 1);
    });
    ASSERT_EQ(sum.load(), n * (n + 1) / 2) << "call " << call;
    total += sum.load();
  }
  EXPECT_GT(total, 0);
}

TEST(ThreadPoolTest, NestedParallelForRunsInlineInsteadOfDeadlocking) {
  ThreadPool pool(3);
  std::atomic<int64_t> inner{0};
  pool.ParallelFor(6, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      pool.ParallelFor(10, 1, [&](int64_t b, int64_t e) { inner.fetch_add(e - b); });
    }
  });
  EXPECT_EQ(inner.load(), 60);
}

TEST(ThreadPoolTest, DestructorJoinsIdleAndJustUsedWorkers) {
  for (int i = 0; i < 200; ++i) {
    ThreadPool pool(1 + i % 4);
    if (i % 2 == 0) {
      std::atomic<int> count{0};
      pool.ParallelFor(8, 1, [&](int64_t b, int64_t e) { count.fetch_add(e - b); });
      ASSERT_EQ(count.load(), 8);
    }
  }
}

TEST(ThreadPoolTest, ZeroThreadsMeansHardwareConcurrency) {
  ThreadPool pool(0);
  const int want = std::max(1u, std::thread::hardware_concurrency());
  EXPECT_EQ(pool.num_threads(), want);
}

}  // namespace
}  // namespace rollout::cpu
