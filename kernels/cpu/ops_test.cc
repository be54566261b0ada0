#include "kernels/cpu/ops.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "kernels/cpu/reference_test_util.h"

namespace rollout::cpu {
namespace {

double DoubleDot(const float* a, const float* b, int64_t n) {
  double s = 0.0;
  for (int64_t i = 0; i < n; ++i) s += static_cast<double>(a[i]) * b[i];
  return s;
}

double AbsDot(const float* a, const float* b, int64_t n) {
  double s = 0.0;
  for (int64_t i = 0; i < n; ++i) s += std::fabs(static_cast<double>(a[i]) * b[i]);
  return s;
}

TEST(DotTest, MatchesDocumentedLaneOrderBitwise) {
  for (int64_t n : {0, 1, 7, 15, 16, 17, 31, 99, 256, 257, 1000}) {
    const std::vector<float> a = RandomVector(n, 1 + n);
    const std::vector<float> b = RandomVector(n, 1000 + n);
    const float got = Dot(a.data(), b.data(), n);
    const float want = ScalarDot(a.data(), b.data(), n);
    EXPECT_TRUE(BitwiseEqual(got, want)) << "n=" << n << " got " << got << " want " << want;
  }
}

TEST(DotTest, CloseToDoublePrecisionReference) {
  for (int64_t n : {1, 7, 99, 257, 4097}) {
    const std::vector<float> a = RandomVector(n, 7 + n);
    const std::vector<float> b = RandomVector(n, 70 + n);
    const double want = DoubleDot(a.data(), b.data(), n);
    // Forward error of a 16-lane sum: about (n / 16 + 4) roundings of the absolute sum.
    const double bound = (n / 16.0 + 5.0) * 6e-8 * AbsDot(a.data(), b.data(), n) + 1e-30;
    EXPECT_NEAR(Dot(a.data(), b.data(), n), want, bound) << "n=" << n;
  }
}

TEST(DotTest, IndependentOfAlignment) {
  const int64_t n = 99;
  const std::vector<float> a = RandomVector(n + 8, 3);
  const std::vector<float> b = RandomVector(n + 8, 4);
  const float want = Dot(a.data(), b.data(), n);
  for (int shift = 1; shift < 8; ++shift) {
    std::vector<float> a2(n + 8, 0.0f), b2(n + 8, 0.0f);
    std::memcpy(a2.data() + shift, a.data(), n * sizeof(float));
    std::memcpy(b2.data() + 8 - shift, b.data(), n * sizeof(float));
    EXPECT_TRUE(BitwiseEqual(Dot(a2.data() + shift, b2.data() + 8 - shift, n), want))
        << "shift=" << shift;
  }
}

void NaiveMatMul(const std::vector<float>& x, int64_t m, int64_t k, const std::vector<float>& w,
                 int64_t n, const float* bias, std::vector<double>* y) {
  y->assign(m * n, 0.0);
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t c = 0; c < n; ++c) {
      (*y)[r * n + c] = DoubleDot(&x[r * k], &w[c * k], k) + (bias ? bias[c] : 0.0);
    }
  }
}

TEST(MatMulTest, EveryElementBitwiseEqualsDot) {
  ThreadPool pool(3);
  for (int64_t k : {7, 256, 257}) {
    const int64_t n = 131;
    const std::vector<float> w = RandomVector(n * k, 11 + k);
    const std::vector<float> bias = RandomVector(n, 12 + k);
    for (int64_t m : {1, 3, 64, 257}) {
      const std::vector<float> x = RandomVector(m * k, 13 + m + k);
      std::vector<float> y(m * n), y_bias(m * n);
      MatMul(&pool, x.data(), m, k, w.data(), n, nullptr, y.data());
      MatMul(&pool, x.data(), m, k, w.data(), n, bias.data(), y_bias.data());
      int64_t mismatches = 0;
      for (int64_t r = 0; r < m; ++r) {
        for (int64_t c = 0; c < n; ++c) {
          const float d = Dot(&x[r * k], &w[c * k], k);
          if (!BitwiseEqual(y[r * n + c], d)) ++mismatches;
          if (!BitwiseEqual(y_bias[r * n + c], d + bias[c])) ++mismatches;
        }
      }
      EXPECT_EQ(mismatches, 0) << "m=" << m << " k=" << k;
    }
  }
}

TEST(MatMulTest, RowOfBatchBitwiseEqualsRowAlone) {
  ThreadPool pool(2);
  const int64_t k = 257, n = 99, m = 64;
  const std::vector<float> w = RandomVector(n * k, 21);
  const std::vector<float> x = RandomVector(m * k, 22);
  std::vector<float> y(m * n);
  MatMul(&pool, x.data(), m, k, w.data(), n, nullptr, y.data());
  for (int64_t r : {0, 1, 5, 62, 63}) {
    std::vector<float> row(n);
    MatMul(&pool, &x[r * k], 1, k, w.data(), n, nullptr, row.data());
    const std::vector<float> batched(y.begin() + r * n, y.begin() + (r + 1) * n);
    EXPECT_EQ(FirstBitwiseMismatch(row, batched), -1) << "row " << r;
  }
}

TEST(MatMulTest, BitwiseIndependentOfThreadCount) {
  const int64_t k = 256, n = 1031;
  const std::vector<float> w = RandomVector(n * k, 31);
  for (int64_t m : {1, 7}) {
    const std::vector<float> x = RandomVector(m * k, 32 + m);
    std::vector<float> y0(m * n);
    MatMul(nullptr, x.data(), m, k, w.data(), n, nullptr, y0.data());
    for (int threads : {1, 2, 3}) {
      ThreadPool pool(threads);
      std::vector<float> y(m * n);
      MatMul(&pool, x.data(), m, k, w.data(), n, nullptr, y.data());
      EXPECT_EQ(FirstBitwiseMismatch(y, y0), -1) << "threads=" << threads << " m=" << m;
    }
  }
}

TEST(MatMulTest, CloseToDoublePrecisionReference) {
  ThreadPool pool(2);
  const int64_t m = 7, k = 99, n = 257;
  const std::vector<float> x = RandomVector(m * k, 41);
  const std::vector<float> w = RandomVector(n * k, 42);
  const std::vector<float> bias = RandomVector(n, 43);
  std::vector<float> y(m * n);
  MatMul(&pool, x.data(), m, k, w.data(), n, bias.data(), y.data());
  std::vector<double> want;
  NaiveMatMul(x, m, k, w, n, bias.data(), &want);
  for (int64_t i = 0; i < m * n; ++i) {
    ASSERT_NEAR(y[i], want[i], 1e-5 + 1e-5 * std::fabs(want[i])) << "element " << i;
  }
}

TEST(RmsNormTest, CloseToDoublePrecisionReference) {
  for (int64_t dim : {1, 7, 99, 257}) {
    const int64_t rows = 3;
    const std::vector<float> x = RandomVector(rows * dim, 51 + dim, -3.0f, 3.0f);
    const std::vector<float> weight = RandomVector(dim, 52 + dim, 0.5f, 1.5f);
    const float eps = 1e-6f;
    std::vector<float> y(rows * dim);
    RmsNorm(x.data(), weight.data(), rows, dim, eps, y.data());
    for (int64_t r = 0; r < rows; ++r) {
      double ss = 0.0;
      for (int64_t i = 0; i < dim; ++i) ss += static_cast<double>(x[r * dim + i]) * x[r * dim + i];
      const double inv = 1.0 / std::sqrt(ss / dim + eps);
      for (int64_t i = 0; i < dim; ++i) {
        const double want = x[r * dim + i] * inv * weight[i];
        ASSERT_NEAR(y[r * dim + i], want, 1e-6 + 1e-5 * std::fabs(want)) << dim << " " << i;
      }
    }
  }
}

TEST(RmsNormTest, InPlaceBitwiseEqualsOutOfPlaceAndZeroRowStaysFinite) {
  const int64_t rows = 2, dim = 99;
  std::vector<float> x = RandomVector(rows * dim, 61);
  std::fill(x.begin() + dim, x.end(), 0.0f);  // row 1 is all zeros: only eps keeps it finite
  const std::vector<float> weight = RandomVector(dim, 62);
  std::vector<float> y(rows * dim);
  RmsNorm(x.data(), weight.data(), rows, dim, 1e-5f, y.data());
  RmsNorm(x.data(), weight.data(), rows, dim, 1e-5f, x.data());
  EXPECT_EQ(FirstBitwiseMismatch(x, y), -1);
  for (int64_t i = dim; i < rows * dim; ++i) ASSERT_EQ(y[i], 0.0f);
}

// cos and sin [positions.size(), head_dim / 2] of plain RoPE with base theta, double then float.
static void PlainRopeRows(const std::vector<int32_t>& positions, int64_t head_dim, double theta,
                   std::vector<float>* cos_rows, std::vector<float>* sin_rows) {
  const int64_t half = head_dim / 2;
  cos_rows->resize(positions.size() * half);
  sin_rows->resize(positions.size() * half);
  for (size_t t = 0; t < positions.size(); ++t) {
    for (int64_t i = 0; i < half; ++i) {
      const double angle = positions[t] * std::pow(theta, -2.0 * i / head_dim);
      (*cos_rows)[t * half + i] = static_cast<float>(std::cos(angle));
      (*sin_rows)[t * half + i] = static_cast<float>(std::sin(angle));
    }
  }
}

TEST(ApplyRopeTest, CloseToDoublePrecisionRotateHalfReference) {
  const int64_t num_tokens = 5, num_heads = 3, head_dim = 24;
  const float theta = 10000.0f;
  const std::vector<int32_t> positions = {0, 1, 7, 99, 4097};
  const std::vector<float> x0 = RandomVector(num_tokens * num_heads * head_dim, 71);
  std::vector<float> x = x0, cos_rows, sin_rows;
  PlainRopeRows(positions, head_dim, theta, &cos_rows, &sin_rows);
  ApplyRope(x.data(), cos_rows.data(), sin_rows.data(), num_tokens, num_heads, head_dim);
  const int64_t half = head_dim / 2;
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int64_t h = 0; h < num_heads; ++h) {
      const float* in = &x0[(t * num_heads + h) * head_dim];
      const float* out = &x[(t * num_heads + h) * head_dim];
      for (int64_t i = 0; i < half; ++i) {
        const double angle =
            positions[t] * std::pow(static_cast<double>(theta), -2.0 * i / head_dim);
        const double c = static_cast<float>(std::cos(angle));
        const double s = static_cast<float>(std::sin(angle));
        const double want1 = in[i] * c - in[i + half] * s;
        const double want2 = in[i + half] * c + in[i] * s;
        ASSERT_NEAR(out[i], want1, 1e-6) << t << " " << h << " " << i;
        ASSERT_NEAR(out[i + half], want2, 1e-6) << t << " " << h << " " << i;
      }
    }
  }
  // Position 0 is the identity.
  for (int64_t i = 0; i < num_heads * head_dim; ++i) ASSERT_EQ(x[i], x0[i]);
}

TEST(ApplyRopeTest, TokenBitwiseIndependentOfItsBatch) {
  const int64_t num_heads = 2, head_dim = 64, row = num_heads * head_dim;
  const std::vector<int32_t> positions = {3, 250, 17};
  const std::vector<float> x0 = RandomVector(3 * row, 72);
  std::vector<float> batch = x0, cos_rows, sin_rows;
  PlainRopeRows(positions, head_dim, 1e6, &cos_rows, &sin_rows);
  ApplyRope(batch.data(), cos_rows.data(), sin_rows.data(), 3, num_heads, head_dim);
  for (int64_t t = 0; t < 3; ++t) {
    std::vector<float> alone(x0.begin() + t * row, x0.begin() + (t + 1) * row);
    ApplyRope(alone.data(), &cos_rows[t * head_dim / 2], &sin_rows[t * head_dim / 2], 1, num_heads,
              head_dim);
    const std::vector<float> in_batch(batch.begin() + t * row, batch.begin() + (t + 1) * row);
    EXPECT_EQ(FirstBitwiseMismatch(alone, in_batch), -1) << "token " << t;
  }
}

TEST(SiluMulTest, CloseToDoublePrecisionReferenceIncludingLargeGates) {
  const int64_t rows = 3, dim = 99;
  std::vector<float> gate_up = RandomVector(rows * 2 * dim, 81, -8.0f, 8.0f);
  gate_up[0] = -200.0f;  // exp overflows to inf: silu must still be -0, not NaN
  gate_up[1] = 200.0f;
  std::vector<float> out(rows * dim);
  SiluMul(gate_up.data(), rows, dim, out.data());
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < dim; ++i) {
      const double g = gate_up[r * 2 * dim + i];
      const double u = gate_up[r * 2 * dim + dim + i];
      const double want = g / (1.0 + std::exp(-g)) * u;
      ASSERT_TRUE(std::isfinite(out[r * dim + i]));
      ASSERT_NEAR(out[r * dim + i], want, 1e-6 + 1e-5 * std::fabs(want)) << r << " " << i;
    }
  }
}

TEST(AddTest, AddsElementwise) {
  std::vector<float> x = RandomVector(257, 91);
  const std::vector<float> y = RandomVector(257, 92);
  const std::vector<float> x0 = x;
  Add(x.data(), y.data(), 257);
  for (int i = 0; i < 257; ++i) ASSERT_EQ(x[i], x0[i] + y[i]);
}

// A small paged-attention world: sequences with contiguous logical K/V, scattered over the
// physical blocks of a cache by their block tables.
struct AttentionWorld {
  static constexpr int64_t kBlockSize = 5;
  static constexpr int64_t kNumKvHeads = 2;
  static constexpr int64_t kNumHeads = 6;  // 3 query heads per kv head
  static constexpr int64_t kHeadDim = 24;  // 16 lanes + a tail of 8
  static constexpr int64_t kNumBlocks = 16;
  static constexpr int64_t kRow = kNumKvHeads * kHeadDim;

  std::vector<int64_t> lengths = {13, 7, 1};
  std::vector<std::vector<float>> k, v;      // per sequence: [length, kv heads, head_dim]
  std::vector<std::vector<int32_t>> tables;  // per sequence
  std::vector<float> k_cache, v_cache;

  // `permute` picks other physical blocks for the same logical content.
  explicit AttentionWorld(bool permute) {
    int32_t next_block = 0;
    for (size_t s = 0; s < lengths.size(); ++s) {
      k.push_back(RandomVector(lengths[s] * kRow, 100 + s, -2.0f, 2.0f));
      v.push_back(RandomVector(lengths[s] * kRow, 200 + s));
      std::vector<int32_t> table;
      for (int64_t b = 0; b * kBlockSize < lengths[s]; ++b) {
        const int32_t id = next_block++;
        table.push_back(permute ? static_cast<int32_t>(kNumBlocks - 1 - 2 * id) : id);
      }
      tables.push_back(table);
    }
    // Unused blocks hold NaN: reading one would poison the output.
    k_cache.assign(kNumBlocks * kBlockSize * kRow, std::numeric_limits<float>::quiet_NaN());
    v_cache = k_cache;
    for (size_t s = 0; s < lengths.size(); ++s) {
      std::vector<int32_t> positions(lengths[s]);
      std::vector<const int32_t*> token_tables(lengths[s], tables[s].data());
      for (int64_t p = 0; p < lengths[s]; ++p) positions[p] = static_cast<int32_t>(p);
      TokenSlots slots{positions.data(), token_tables.data(), lengths[s]};
      WriteKv(k[s].data(), v[s].data(), slots, Cache());
    }
  }

  KvCacheLayer Cache() {
    return KvCacheLayer{k_cache.data(), v_cache.data(), kBlockSize, kNumKvHeads, kHeadDim};
  }

  // Attention of tokens (sequence, position) with queries q: [tokens, kNumHeads, kHeadDim].
  std::vector<float> Run(ThreadPool* pool, const std::vector<std::pair<int, int32_t>>& tokens,
                         const std::vector<float>& q) {
    std::vector<int32_t> positions;
    std::vector<const int32_t*> token_tables;
    for (const auto& [s, p] : tokens) {
      positions.push_back(p);
      token_tables.push_back(tables[s].data());
    }
    TokenSlots slots{positions.data(), token_tables.data(), static_cast<int64_t>(tokens.size())};
    std::vector<float> out(tokens.size() * kNumHeads * kHeadDim);
    const float scale = 1.0f / std::sqrt(static_cast<float>(kHeadDim));
    PagedAttention(pool, q.data(), slots, kNumHeads, Cache(), scale, out.data());
    return out;
  }
};

// Tokens of all three sequences at assorted positions, as one flattened batch.
const std::vector<std::pair<int, int32_t>> kBatchTokens = {{0, 12}, {1, 3}, {1, 4}, {1, 5},
                                                           {1, 6},  {2, 0}, {0, 0}};

TEST(PagedAttentionTest, WriteKvPutsEachTokenInItsBlockSlot) {
  AttentionWorld world(/*permute=*/true);
  const int64_t row = AttentionWorld::kRow;
  for (size_t s = 0; s < world.lengths.size(); ++s) {
    for (int64_t p = 0; p < world.lengths[s]; ++p) {
      const int64_t block = world.tables[s][p / AttentionWorld::kBlockSize];
      const int64_t slot = block * AttentionWorld::kBlockSize + p % AttentionWorld::kBlockSize;
      for (int64_t i = 0; i < row; ++i) {
        ASSERT_EQ(world.k_cache[slot * row + i], world.k[s][p * row + i]);
        ASSERT_EQ(world.v_cache[slot * row + i], world.v[s][p * row + i]);
      }
    }
  }
}

TEST(PagedAttentionTest, CloseToDoublePrecisionCausalReference) {
  AttentionWorld world(/*permute=*/false);
  ThreadPool pool(2);
  const int64_t nh = AttentionWorld::kNumHeads, hd = AttentionWorld::kHeadDim;
  const std::vector<float> q = RandomVector(kBatchTokens.size() * nh * hd, 300, -2.0f, 2.0f);
  const std::vector<float> out = world.Run(&pool, kBatchTokens, q);
  const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
  for (size_t t = 0; t < kBatchTokens.size(); ++t) {
    const auto [s, pos] = kBatchTokens[t];
    for (int64_t h = 0; h < nh; ++h) {
      const int64_t kvh = h / (nh / AttentionWorld::kNumKvHeads);
      const float* qr = &q[(t * nh + h) * hd];
      std::vector<double> scores(pos + 1);
      double m = -INFINITY;
      for (int32_t j = 0; j <= pos; ++j) {
        scores[j] =
            DoubleDot(qr, &world.k[s][(j * AttentionWorld::kNumKvHeads + kvh) * hd], hd) * scale;
        m = std::max(m, scores[j]);
      }
      double l = 0.0;
      for (double& sc : scores) l += (sc = std::exp(sc - m));
      for (int64_t d = 0; d < hd; ++d) {
        double want = 0.0;
        for (int32_t j = 0; j <= pos; ++j) {
          want += scores[j] * world.v[s][(j * AttentionWorld::kNumKvHeads + kvh) * hd + d];
        }
        want /= l;
        ASSERT_NEAR(out[(t * nh + h) * hd + d], want, 1e-5 + 1e-5 * std::fabs(want))
            << "token " << t << " head " << h << " dim " << d;
      }
    }
  }
}

TEST(PagedAttentionTest, RowBitwiseEqualAloneAndInsideBatch) {
  AttentionWorld world(/*permute=*/false);
  ThreadPool pool(3);
  const int64_t row = AttentionWorld::kNumHeads * AttentionWorld::kHeadDim;
  const std::vector<float> q = RandomVector(kBatchTokens.size() * row, 301);
  const std::vector<float> batch = world.Run(&pool, kBatchTokens, q);
  for (size_t t = 0; t < kBatchTokens.size(); ++t) {
    const std::vector<float> q_alone(q.begin() + t * row, q.begin() + (t + 1) * row);
    const std::vector<float> alone = world.Run(&pool, {kBatchTokens[t]}, q_alone);
    const std::vector<float> in_batch(batch.begin() + t * row, batch.begin() + (t + 1) * row);
    EXPECT_EQ(FirstBitwiseMismatch(alone, in_batch), -1) << "token " << t;
  }
}

TEST(PagedAttentionTest, BitwiseIndependentOfPhysicalBlocks) {
  AttentionWorld world(/*permute=*/false);
  AttentionWorld permuted(/*permute=*/true);
  ASSERT_NE(world.tables[0], permuted.tables[0]);
  const int64_t row = AttentionWorld::kNumHeads * AttentionWorld::kHeadDim;
  const std::vector<float> q = RandomVector(kBatchTokens.size() * row, 302);
  const std::vector<float> a = world.Run(nullptr, kBatchTokens, q);
  const std::vector<float> b = permuted.Run(nullptr, kBatchTokens, q);
  EXPECT_EQ(FirstBitwiseMismatch(a, b), -1);
  for (float x : a) ASSERT_TRUE(std::isfinite(x));
}

TEST(PagedAttentionTest, BitwiseIndependentOfThreadCount) {
  AttentionWorld world(/*permute=*/true);
  const int64_t row = AttentionWorld::kNumHeads * AttentionWorld::kHeadDim;
  // Enough rows of enough length that the pool really splits the work.
  std::vector<std::pair<int, int32_t>> tokens;
  for (int rep = 0; rep < 40; ++rep) tokens.push_back({rep % 2, static_cast<int32_t>(rep % 7)});
  const std::vector<float> q = RandomVector(tokens.size() * row, 303);
  const std::vector<float> want = world.Run(nullptr, tokens, q);
  for (int threads : {1, 2, 3}) {
    ThreadPool pool(threads);
    EXPECT_EQ(FirstBitwiseMismatch(world.Run(&pool, tokens, q), want), -1) << "threads=" << threads;
  }
}

}  // namespace
}  // namespace rollout::cpu
