#include "kernels/cpu/moe.h"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "kernels/cpu/reference_test_util.h"

namespace rollout::cpu {
namespace {

struct Routed {
  std::vector<int32_t> ids;
  std::vector<float> weights;
};

Routed Route(const std::vector<float>& logits, int32_t k, bool norm,
             const std::vector<int32_t>& forced = {}) {
  Routed r{std::vector<int32_t>(k), std::vector<float>(k)};
  RouteToken(logits.data(), static_cast<int32_t>(logits.size()), k, norm,
             forced.empty() ? nullptr : forced.data(), r.ids.data(), r.weights.data());
  return r;
}

// The documented softmax, written out.
std::vector<float> Softmax(const std::vector<float>& l) {
  float m = l[0];
  for (float v : l) m = std::fmax(m, v);
  float s = 0.0f;
  for (float v : l) s += std::exp(v - m);
  std::vector<float> p;
  for (float v : l) p.push_back(std::exp(v - m) / s);
  return p;
}

TEST(MoeRoutingTest, PicksTheLargestInRankOrder) {
  const std::vector<float> logits = {0.1f, 2.0f, -1.0f, 1.5f, 3.0f, 0.0f};
  const Routed r = Route(logits, 3, /*norm=*/false);
  EXPECT_EQ(r.ids, std::vector<int32_t>({4, 1, 3}));
  const std::vector<float> p = Softmax(logits);
  for (int j = 0; j < 3; ++j) EXPECT_TRUE(BitwiseEqual(r.weights[j], p[r.ids[j]])) << j;
}

TEST(MoeRoutingTest, TiesGoToTheLowerExpertId) {
  // Experts 1, 3 and 5 tie for first; 0 and 4 tie below them.
  const std::vector<float> logits = {0.5f, 2.0f, -3.0f, 2.0f, 0.5f, 2.0f};
  EXPECT_EQ(Route(logits, 2, false).ids, std::vector<int32_t>({1, 3}));
  EXPECT_EQ(Route(logits, 3, false).ids, std::vector<int32_t>({1, 3, 5}));
  EXPECT_EQ(Route(logits, 5, false).ids, std::vector<int32_t>({1, 3, 5, 0, 4}));
  // All equal: ids in ascending order.
  EXPECT_EQ(Route(std::vector<float>(8, 0.25f), 4, true).ids,
            std::vector<int32_t>({0, 1, 2, 3}));
}

TEST(MoeRoutingTest, NormTopkProbRenormalisesInRankOrder) {
  const std::vector<float> logits = RandomVector(16, 3, -2.0f, 2.0f);
  const Routed raw = Route(logits, 4, false);
  const Routed norm = Route(logits, 4, true);
  EXPECT_EQ(raw.ids, norm.ids);
  float sum = 0.0f;
  for (float w : raw.weights) sum += w;  // rank order
  EXPECT_LT(sum, 1.0f);
  for (int j = 0; j < 4; ++j) {
    EXPECT_TRUE(BitwiseEqual(norm.weights[j], raw.weights[j] / sum)) << j;
  }
  float total = 0.0f;
  for (float w : norm.weights) total += w;
  EXPECT_NEAR(total, 1.0f, 1e-6f);
}

TEST(MoeRoutingTest, ForcedIdsTakeTheRouterProbabilitiesAtThoseIds) {
  const std::vector<float> logits = RandomVector(8, 4, -2.0f, 2.0f);
  const std::vector<float> p = Softmax(logits);
  const Routed chosen = Route(logits, 2, true);
  // Forcing the chosen routing gives the same bits.
  const Routed same = Route(logits, 2, true, chosen.ids);
  EXPECT_EQ(same.ids, chosen.ids);
  EXPECT_TRUE(BitwiseEqual(same.weights[0], chosen.weights[0]));
  EXPECT_TRUE(BitwiseEqual(same.weights[1], chosen.weights[1]));
  // Another routing, in the order given (not re-sorted).
  const Routed forced = Route(logits, 2, false, {6, 2});
  EXPECT_EQ(forced.ids, std::vector<int32_t>({6, 2}));
  EXPECT_TRUE(BitwiseEqual(forced.weights[0], p[6]));
  EXPECT_TRUE(BitwiseEqual(forced.weights[1], p[2]));
  const Routed forced_norm = Route(logits, 2, true, {6, 2});
  EXPECT_TRUE(BitwiseEqual(forced_norm.weights[0], p[6] / (p[6] + p[2])));
}

TEST(MoeCombineTest, AccumulatesInRankOrderWithFma) {
  const int64_t dim = 37;
  const int32_t k = 4;
  const std::vector<float> y = RandomVector(k * dim, 5, -10.0f, 10.0f);
  const std::vector<float> w = {0.4f, 0.3f, 0.2f, 0.1f};
  std::vector<float> out(dim);
  CombineExperts(y.data(), w.data(), k, dim, out.data());
  for (int64_t c = 0; c < dim; ++c) {
    float acc = 0.0f;
    for (int j = 0; j < k; ++j) acc = std::fma(w[j], y[j * dim + c], acc);
    EXPECT_TRUE(BitwiseEqual(out[c], acc)) << c;
  }
  // The order is part of the result: reversed ranks differ somewhere (fp addition does not
  // commute across roundings), which is why the rank order is fixed.
  std::vector<float> y_rev(k * dim), w_rev(k), out_rev(dim);
  for (int j = 0; j < k; ++j) {
    w_rev[j] = w[k - 1 - j];
    for (int64_t c = 0; c < dim; ++c) y_rev[j * dim + c] = y[(k - 1 - j) * dim + c];
  }
  CombineExperts(y_rev.data(), w_rev.data(), k, dim, out_rev.data());
  EXPECT_GE(FirstBitwiseMismatch(out, out_rev), 0);
}

}  // namespace
}  // namespace rollout::cpu
