// The canonical 8-segment K reduction of row-parallel layers (ops.h): equal to a naive
// transcription of the fixed tree, and equal whichever "ranks" compute which segments.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <thread>
#include <tuple>
#include <vector>

#include "kernels/cpu/ops.h"
#include "kernels/cpu/reference_test_util.h"

namespace rollout::cpu {
namespace {

// The documented tree, written out: segment s = [s * k / 8, (s + 1) * k / 8).
float NaiveSegmented(const float* x, const float* w, int64_t k) {
  float p[8];
  for (int s = 0; s < 8; ++s) {
    const int64_t b0 = k * s / 8, b1 = k * (s + 1) / 8;
    p[s] = ScalarDot(x + b0, w + b0, b1 - b0);
  }
  return ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]));
}

std::vector<float> NaiveSegmentedMatMul(const std::vector<float>& x, int64_t m, int64_t k,
                                        const std::vector<float>& w, int64_t n, const float* bias) {
  std::vector<float> y(m * n);
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t c = 0; c < n; ++c) {
      float d = NaiveSegmented(&x[r * k], &w[c * k], k);
      if (bias != nullptr) d += bias[c];
      y[r * n + c] = d;
    }
  }
  return y;
}

// (m, k, n): k multiple of 8 * 16, multiple of 8 only, not a multiple of 8, shorter than 8.
const std::vector<std::tuple<int64_t, int64_t, int64_t>> kShapes = {
    {1, 256, 5}, {3, 768, 7}, {5, 64, 13}, {4, 100, 4}, {2, 1000, 9}, {6, 5, 3}, {1, 0, 2}};

TEST(SegmentedMatMulTest, EveryElementBitwiseEqualsTheNaiveFixedTree) {
  for (const auto& [m, k, n] : kShapes) {
    const std::vector<float> x = RandomVector(m * k, 11 + k);
    const std::vector<float> w = RandomVector(n * k, 22 + k);
    const std::vector<float> bias = RandomVector(n, 33);
    for (const float* b : {static_cast<const float*>(nullptr), bias.data()}) {
      std::vector<float> y(m * n);
      SegmentedMatMul(nullptr, x.data(), m, k, w.data(), n, b, y.data());
      EXPECT_EQ(FirstBitwiseMismatch(y, NaiveSegmentedMatMul(x, m, k, w, n, b)), -1)
          << "m=" << m << " k=" << k << " n=" << n << " bias=" << (b != nullptr);
    }
  }
}

// The point of the tree: a rank of degree tp owns segments [r * 8 / tp, (r + 1) * 8 / tp) and
// sees only its K slice; computed on separate threads with their own pools, its node values
// gathered in rank order and combined give the bits of one rank doing it all.
TEST(SegmentedMatMulTest, NodesComputedOnSeparateRanksCombineToTheSameBitsAtEveryDegree) {
  for (const auto& [m, k, n] : kShapes) {
    const std::vector<float> x = RandomVector(m * k, 44 + k);
    const std::vector<float> w = RandomVector(n * k, 55 + k);
    std::vector<float> want(m * n);
    SegmentedMatMul(nullptr, x.data(), m, k, w.data(), n, nullptr, want.data());
    for (int tp : {1, 2, 4, 8}) {
      std::vector<float> gathered(tp * m * n);
      std::vector<std::thread> ranks;
      for (int r = 0; r < tp; ++r) {
        ranks.emplace_back([&, r] {
          const int s0 = r * kNumKSegments / tp, s1 = (r + 1) * kNumKSegments / tp;
          ASSERT_TRUE(IsCanonicalSegmentBlock(s0, s1));
          const int64_t c0 = KSegmentBegin(k, s0), c1 = KSegmentBegin(k, s1);
          const std::vector<float> xs = Columns(x, m, k, c0, c1);
          const std::vector<float> ws = Columns(w, n, k, c0, c1);
          ThreadPool pool(1 + r % 3);
          SegmentedPartialMatMul(&pool, xs.data(), m, ws.data(), n, k, s0, s1,
                                 &gathered[r * m * n]);
        });
      }
      for (std::thread& t : ranks) t.join();
      std::vector<float> got(m * n);
      CombinePartials(gathered.data(), tp, m * n, got.data());
      EXPECT_EQ(FirstBitwiseMismatch(got, want), -1)
          << "tp=" << tp << " m=" << m << " k=" << k << " n=" << n;
      // In place (y aliasing the first part) too.
      CombinePartials(gathered.data(), tp, m * n, gathered.data());
      gathered.resize(m * n);
      EXPECT_EQ(FirstBitwiseMismatch(gathered, want), -1) << "in place, tp=" << tp;
    }
  }
}

TEST(SegmentedMatMulTest, RowOfBatchAndThreadCountDoNotChangeAnyBit) {
  const int64_t m = 9, k = 768, n = 37;
  const std::vector<float> x = RandomVector(m * k, 66);
  const std::vector<float> w = RandomVector(n * k, 77);
  std::vector<float> want(m * n);
  SegmentedMatMul(nullptr, x.data(), m, k, w.data(), n, nullptr, want.data());
  for (int threads : {1, 2, 3}) {
    ThreadPool pool(threads);
    std::vector<float> y(m * n);
    SegmentedMatMul(&pool, x.data(), m, k, w.data(), n, nullptr, y.data());
    EXPECT_EQ(FirstBitwiseMismatch(y, want), -1) << "threads=" << threads;
  }
  for (int64_t r = 0; r < m; ++r) {
    std::vector<float> row(n);
    SegmentedMatMul(nullptr, &x[r * k], 1, k, w.data(), n, nullptr, row.data());
    EXPECT_EQ(FirstBitwiseMismatch(row, std::vector<float>(&want[r * n], &want[r * n + n])), -1)
        << "row " << r;
  }
}

TEST(SegmentedMatMulTest, CloseToDoublePrecisionReference) {
  const int64_t m = 3, k = 2048, n = 8;
  const std::vector<float> x = RandomVector(m * k, 88);
  const std::vector<float> w = RandomVector(n * k, 99);
  std::vector<float> y(m * n);
  SegmentedMatMul(nullptr, x.data(), m, k, w.data(), n, nullptr, y.data());
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t c = 0; c < n; ++c) {
      double want = 0.0, mag = 0.0;
      for (int64_t i = 0; i < k; ++i) {
        want += static_cast<double>(x[r * k + i]) * w[c * k + i];
        mag += std::fabs(static_cast<double>(x[r * k + i]) * w[c * k + i]);
      }
      EXPECT_NEAR(y[r * n + c], want, (k / 128.0 + 8.0) * 6e-8 * mag) << r << "," << c;
    }
  }
}

// Why the canonical tree is needed: the plain ordered reduction (each rank one Dot over its
// contiguous K slice, the partials summed in rank order) is a different sum at each degree.
TEST(SegmentedMatMulTest, PlainPerRankReductionChangesBitsWithTheDegree) {
  const int64_t m = 4, k = 768, n = 64;
  const std::vector<float> x = RandomVector(m * k, 123);
  const std::vector<float> w = RandomVector(n * k, 456);
  auto plain = [&](int tp) {
    std::vector<float> y(m * n, 0.0f);
    for (int64_t r = 0; r < m; ++r) {
      for (int64_t c = 0; c < n; ++c) {
        float sum = 0.0f;
        for (int rank = 0; rank < tp; ++rank) {
          const int64_t b0 = k * rank / tp, b1 = k * (rank + 1) / tp;
          const float part = Dot(&x[r * k + b0], &w[c * k + b0], b1 - b0);
          sum = rank == 0 ? part : sum + part;
        }
        y[r * n + c] = sum;
      }
    }
    return y;
  };
  const std::vector<float> tp1 = plain(1);
  EXPECT_NE(FirstBitwiseMismatch(plain(2), tp1), -1);
  EXPECT_NE(FirstBitwiseMismatch(plain(4), tp1), -1);
}

TEST(SegmentedMatMulTest, CanonicalBlocksAreTheNodesOfTheTree) {
  EXPECT_TRUE(IsCanonicalSegmentBlock(0, 8));
  EXPECT_TRUE(IsCanonicalSegmentBlock(4, 8));
  EXPECT_TRUE(IsCanonicalSegmentBlock(2, 4));
  EXPECT_TRUE(IsCanonicalSegmentBlock(7, 8));
  EXPECT_FALSE(IsCanonicalSegmentBlock(1, 3));  // not aligned
  EXPECT_FALSE(IsCanonicalSegmentBlock(0, 3));  // not a power of two
  EXPECT_FALSE(IsCanonicalSegmentBlock(0, 0));
  EXPECT_FALSE(IsCanonicalSegmentBlock(4, 12));
  EXPECT_EQ(KSegmentBegin(100, 3), 37);
  EXPECT_EQ(KSegmentBegin(100, 8), 100);
}

}  // namespace
}  // namespace rollout::cpu
