// The mixture-of-experts kernels (kernels/cuda/moe.h) against host references -- routing (ties
// to the lower index, forced routings), grouping (exact), the grouped expert GEMM and the whole
// expert block -- and the determinism proof issue 19 asks for: a fixed set of rows gives the same
// output bits for every token count 1..512 (and larger), whatever the other rows and their
// routings (so an expert gets every row count), and wherever the rows sit in the batch.
#include "kernels/cuda/moe.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda/ops.h"
#include "tests/gpu/gpu_test_util.h"

namespace rollout {
namespace {

using cuda::bf16;
using gpu_test::AllClose;
using gpu_test::Download;
using gpu_test::Upload;

class MoeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!gpu_test::HaveGpu()) GTEST_SKIP() << "no CUDA device";
  }
};

float RoundBf16(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

// The routing contract of moe.h on the host (sum in the kernel's lane order, so the reference
// differs from the device only by expf's rounding).
void HostRoute(const std::vector<float>& logits, int64_t t_count, int e_count, int k, bool norm,
               const std::vector<int32_t>* forced_ids, const std::vector<int32_t>* forced_rows,
               std::vector<int32_t>* ids, std::vector<float>* weights) {
  ids->assign(t_count * k, 0);
  weights->assign(t_count * k, 0.0f);
  for (int64_t t = 0; t < t_count; ++t) {
    const float* l = &logits[t * e_count];
    float m = -INFINITY;
    for (int e = 0; e < e_count; ++e) m = std::max(m, l[e]);
    std::vector<float> q(e_count), lane(32, 0.0f);
    for (int e = 0; e < e_count; ++e) {
      q[e] = std::exp(l[e] - m);
      lane[e % 32] += q[e];
    }
    for (int off = 16; off > 0; off /= 2) {
      std::vector<float> next(32);
      for (int i = 0; i < 32; ++i) next[i] = lane[i] + lane[i ^ off];
      lane = next;
    }
    std::vector<float> p(e_count);
    for (int e = 0; e < e_count; ++e) p[e] = q[e] / lane[0];
    std::vector<int32_t> chosen;
    if (forced_rows != nullptr && (*forced_rows)[t] != 0) {
      chosen.assign(forced_ids->begin() + t * k, forced_ids->begin() + (t + 1) * k);
    } else {
      std::vector<int32_t> order(e_count);
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return p[a] > p[b]; });
      chosen.assign(order.begin(), order.begin() + k);
    }
    float sum = 0.0f;
    for (int j = 0; j < k; ++j) sum += p[chosen[j]];
    for (int j = 0; j < k; ++j) {
      (*ids)[t * k + j] = chosen[j];
      (*weights)[t * k + j] = norm ? p[chosen[j]] / sum : p[chosen[j]];
    }
  }
}

// Device buffers for a step of up to max_tokens tokens.
struct MoeBuffers {
  cuda::DeviceBuffer logits, forced_ids, forced_rows, ids, weights, counts, expert_offsets,
      tile_offsets, rows, slots, xn, gate_up, act, y, x;
  void Allocate(int64_t max_tokens, int e, int k, int64_t h, int64_t inter) {
    const int64_t a = max_tokens * k;
    ASSERT_CUDA_OK(logits.Allocate(max_tokens * e * 4));
    ASSERT_CUDA_OK(forced_ids.Allocate(a * 4));
    ASSERT_CUDA_OK(forced_rows.Allocate(max_tokens * 4));
    ASSERT_CUDA_OK(ids.Allocate(a * 4));
    ASSERT_CUDA_OK(weights.Allocate(a * 4));
    ASSERT_CUDA_OK(counts.Allocate(e * 4));
    ASSERT_CUDA_OK(expert_offsets.Allocate((e + 1) * 4));
    ASSERT_CUDA_OK(tile_offsets.Allocate((e + 1) * 4));
    ASSERT_CUDA_OK(rows.Allocate(a * 4));
    ASSERT_CUDA_OK(slots.Allocate(a * 4));
    ASSERT_CUDA_OK(xn.Allocate(max_tokens * h * 2));
    ASSERT_CUDA_OK(gate_up.Allocate(a * 2 * inter * 2));
    ASSERT_CUDA_OK(act.Allocate(a * inter * 2));
    ASSERT_CUDA_OK(y.Allocate(a * h * 4));
    ASSERT_CUDA_OK(x.Allocate(max_tokens * h * 4));
  }
  cuda::MoeGrouping Grouping() {
    return {counts.get<int32_t>(), expert_offsets.get<int32_t>(), tile_offsets.get<int32_t>(),
            rows.get<int32_t>(), slots.get<int32_t>()};
  }
};

template <typename T>
void Put(cuda::DeviceBuffer& d, const std::vector<T>& h) {
  ASSERT_EQ(cudaSuccess,
            cudaMemcpy(d.get(), h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
}

std::vector<float> RandomLogits(int64_t t_count, int e_count, uint64_t seed) {
  return gpu_test::RandomFloats(t_count * e_count, seed, 2.0f);
}

TEST_F(MoeTest, RouteMatchesHostReference) {
  struct Case {
    int e, k;
  };
  for (const Case c : {Case{8, 2}, Case{60, 4}, Case{128, 8}, Case{256, 32}}) {
    for (int64_t t_count : {1, 7, 300}) {
      for (bool norm : {true, false}) {
        const std::vector<float> logits = RandomLogits(t_count, c.e, 11 + t_count + c.e);
        MoeBuffers b;
        b.Allocate(t_count, c.e, c.k, 64, 64);
        Put(b.logits, logits);
        ASSERT_CUDA_OK(cuda::MoeRoute(b.logits.get<float>(), t_count, c.e, c.k, norm, nullptr,
                                      nullptr, b.ids.get<int32_t>(), b.weights.get<float>(),
                                      nullptr));
        std::vector<int32_t> want_ids;
        std::vector<float> want_w;
        HostRoute(logits, t_count, c.e, c.k, norm, nullptr, nullptr, &want_ids, &want_w);
        const std::string where = "E " + std::to_string(c.e) + " k " + std::to_string(c.k) + " T " +
                                  std::to_string(t_count) + " norm " + std::to_string(norm);
        EXPECT_EQ(want_ids, Download<int32_t>(b.ids, t_count * c.k)) << where;
        EXPECT_TRUE(AllClose(Download<float>(b.weights, t_count * c.k), want_w, 1e-7f, 1e-5f))
            << where;
      }
    }
  }
}

// Equal probabilities go to the lower expert index: all equal; equal pairs in one lane (e and
// e + 32) and across lanes; a tie at the k-th place.
TEST_F(MoeTest, RouteTiesGoToTheLowerExpertIndex) {
  const int e_count = 128, k = 4;
  std::vector<std::vector<float>> rows;
  std::vector<std::vector<int32_t>> want;
  rows.push_back(std::vector<float>(e_count, 0.5f));
  want.push_back({0, 1, 2, 3});
  std::vector<float> r(e_count, 0.0f);
  r[40] = 3.0f;
  r[8] = 3.0f;  // the same lane as 40
  r[97] = 2.0f;
  r[33] = 2.0f;  // lane 1, as 97
  rows.push_back(r);
  want.push_back({8, 40, 33, 97});
  r.assign(e_count, 0.0f);
  r[127] = 5.0f;
  r[5] = 4.0f;
  r[6] = 4.0f;
  r[100] = 1.0f;
  r[70] = 1.0f;
  r[71] = 1.0f;  // three tie for the 4th place: 70 wins
  rows.push_back(r);
  want.push_back({127, 5, 6, 70});
  std::vector<float> logits;
  for (const auto& row : rows) logits.insert(logits.end(), row.begin(), row.end());
  const int64_t t_count = static_cast<int64_t>(rows.size());
  MoeBuffers b;
  b.Allocate(t_count, e_count, k, 64, 64);
  Put(b.logits, logits);
  ASSERT_CUDA_OK(cuda::MoeRoute(b.logits.get<float>(), t_count, e_count, k, true, nullptr, nullptr,
                                b.ids.get<int32_t>(), b.weights.get<float>(), nullptr));
  const std::vector<int32_t> ids = Download<int32_t>(b.ids, t_count * k);
  const std::vector<float> w = Download<float>(b.weights, t_count * k);
  for (int64_t t = 0; t < t_count; ++t) {
    EXPECT_EQ(want[t], std::vector<int32_t>(ids.begin() + t * k, ids.begin() + (t + 1) * k))
        << "row " << t;
  }
  for (int j = 0; j < k; ++j) EXPECT_EQ(0.25f, w[j]) << "all-equal row, rank " << j;
  EXPECT_EQ(w[k + 0], w[k + 1]);
  EXPECT_EQ(w[k + 2], w[k + 3]);
}

// Forced rows take the given ids in the given order, their weights from p at those ids; the
// other rows choose as usual.
TEST_F(MoeTest, RouteTakesForcedIdsAndWeighsThemByTheirProbabilities) {
  const int e_count = 64, k = 4;
  const int64_t t_count = 37;
  const std::vector<float> logits = RandomLogits(t_count, e_count, 5);
  std::mt19937 rng(3);
  std::vector<int32_t> forced_ids(t_count * k), forced_rows(t_count);
  for (int64_t t = 0; t < t_count; ++t) {
    forced_rows[t] = t % 3 == 0 ? 0 : 1;
    std::vector<int32_t> all(e_count);
    std::iota(all.begin(), all.end(), 0);
    std::shuffle(all.begin(), all.end(), rng);
    std::copy(all.begin(), all.begin() + k, forced_ids.begin() + t * k);
  }
  for (bool norm : {true, false}) {
    MoeBuffers b;
    b.Allocate(t_count, e_count, k, 64, 64);
    Put(b.logits, logits);
    Put(b.forced_ids, forced_ids);
    Put(b.forced_rows, forced_rows);
    ASSERT_CUDA_OK(cuda::MoeRoute(b.logits.get<float>(), t_count, e_count, k, norm,
                                  b.forced_ids.get<int32_t>(), b.forced_rows.get<int32_t>(),
                                  b.ids.get<int32_t>(), b.weights.get<float>(), nullptr));
    std::vector<int32_t> want_ids;
    std::vector<float> want_w;
    HostRoute(logits, t_count, e_count, k, norm, &forced_ids, &forced_rows, &want_ids, &want_w);
    EXPECT_EQ(want_ids, Download<int32_t>(b.ids, t_count * k)) << "norm " << norm;
    EXPECT_TRUE(AllClose(Download<float>(b.weights, t_count * k), want_w, 1e-7f, 1e-5f));
  }
}

// Counts, offsets, tile offsets, the grouped order (token, then rank, per expert) and the slots:
// exactly the host's counting sort. Skewed routings (every token on the same experts) too.
TEST_F(MoeTest, GroupIsTheStableCountingSortByExpert) {
  for (int e_count : {1, 16, 128}) {
    for (int64_t t_count : {1, 5, 333, 4000, 17000}) {
      for (bool skewed : {false, true}) {
        const int k = std::min(e_count, 8);
        std::mt19937 rng(static_cast<uint32_t>(e_count * 7 + t_count));
        std::vector<int32_t> ids(t_count * k);
        for (int64_t t = 0; t < t_count; ++t) {
          std::vector<int32_t> all(e_count);
          std::iota(all.begin(), all.end(), 0);
          if (!skewed) std::shuffle(all.begin(), all.end(), rng);
          std::copy(all.begin(), all.begin() + k, ids.begin() + t * k);
        }
        const int32_t tile_rows = !skewed            ? cuda::kMoeTileRows
                                  : e_count % 2 == 0 ? cuda::kMoeTileRowsXLarge
                                                     : cuda::kMoeTileRowsLarge;
        MoeBuffers b;
        b.Allocate(t_count, e_count, k, 64, 64);
        Put(b.ids, ids);
        ASSERT_CUDA_OK(cuda::MoeGroup(b.ids.get<int32_t>(), t_count, e_count, k, tile_rows,
                                      b.Grouping(), nullptr));
        std::vector<int32_t> counts(e_count, 0), offsets(e_count + 1, 0), tiles(e_count + 1, 0);
        for (int32_t id : ids) ++counts[id];
        for (int e = 0; e < e_count; ++e) {
          offsets[e + 1] = offsets[e] + counts[e];
          tiles[e + 1] = tiles[e] + (counts[e] + tile_rows - 1) / tile_rows;
        }
        std::vector<int32_t> rows(ids.size()), slots(ids.size());
        std::vector<int32_t> fill(offsets.begin(), offsets.end() - 1);
        for (size_t a = 0; a < ids.size(); ++a) {
          slots[a] = fill[ids[a]]++;
          rows[slots[a]] = static_cast<int32_t>(a / k);
        }
        const std::string where = "E " + std::to_string(e_count) + " T " + std::to_string(t_count) +
                                  (skewed ? " skewed" : "");
        EXPECT_EQ(counts, Download<int32_t>(b.counts, e_count)) << where;
        EXPECT_EQ(offsets, Download<int32_t>(b.expert_offsets, e_count + 1)) << where;
        EXPECT_EQ(tiles, Download<int32_t>(b.tile_offsets, e_count + 1)) << where;
        EXPECT_EQ(rows, Download<int32_t>(b.rows, ids.size())) << where;
        EXPECT_EQ(slots, Download<int32_t>(b.slots, ids.size())) << where;
        EXPECT_LE(tiles[e_count], cuda::MoeMaxTiles(t_count * k, e_count, tile_rows)) << where;
      }
    }
  }
}

// A whole random MoE problem: routing's ids and weights given, the host computes each token's
// expert outputs the way the device rounds (gate/up to bf16, SiLU * up to bf16, down in fp32)
// and the weighted sum into the residual.
struct Problem {
  int e, k;
  int64_t h, inter, t;
  std::vector<bf16> xn, w_gate_up, w_down;
  std::vector<float> xn_f, w_gate_up_f, w_down_f, x;
  std::vector<int32_t> ids;
  std::vector<float> weights;
};

Problem MakeProblem(int e, int k, int64_t h, int64_t inter, int64_t t, uint64_t seed) {
  Problem p;
  p.e = e;
  p.k = k;
  p.h = h;
  p.inter = inter;
  p.t = t;
  gpu_test::RandomBf16(t * h, seed, 1.0f, &p.xn, &p.xn_f);
  gpu_test::RandomBf16(e * 2 * inter * h, seed + 1, 1.0f / std::sqrt(float(h)), &p.w_gate_up,
                       &p.w_gate_up_f);
  gpu_test::RandomBf16(e * h * inter, seed + 2, 1.0f / std::sqrt(float(inter)), &p.w_down,
                       &p.w_down_f);
  p.x = gpu_test::RandomFloats(t * h, seed + 3, 1.0f);
  std::mt19937 rng(static_cast<uint32_t>(seed));
  std::uniform_real_distribution<float> unit(0.05f, 1.0f);
  for (int64_t i = 0; i < t; ++i) {
    std::vector<int32_t> all(e);
    std::iota(all.begin(), all.end(), 0);
    std::shuffle(all.begin(), all.end(), rng);
    for (int j = 0; j < k; ++j) {
      p.ids.push_back(all[j]);
      p.weights.push_back(unit(rng));
    }
  }
  return p;
}

std::vector<float> HostExperts(const Problem& p) {
  std::vector<float> out = p.x;
  std::vector<float> gu(2 * p.inter), act(p.inter), y(p.h);
  for (int64_t t = 0; t < p.t; ++t) {
    std::vector<float> acc(p.h, 0.0f);
    for (int j = 0; j < p.k; ++j) {
      const int e = p.ids[t * p.k + j];
      const float* wg = &p.w_gate_up_f[static_cast<int64_t>(e) * 2 * p.inter * p.h];
      const float* wd = &p.w_down_f[static_cast<int64_t>(e) * p.h * p.inter];
      for (int64_t n = 0; n < 2 * p.inter; ++n) {
        double s = 0.0;
        for (int64_t c = 0; c < p.h; ++c) s += double(p.xn_f[t * p.h + c]) * wg[n * p.h + c];
        gu[n] = RoundBf16(static_cast<float>(s));
      }
      for (int64_t i = 0; i < p.inter; ++i) {
        const float g = gu[i];
        act[i] = RoundBf16(g / (1.0f + std::exp(-g)) * gu[p.inter + i]);
      }
      for (int64_t n = 0; n < p.h; ++n) {
        double s = 0.0;
        for (int64_t i = 0; i < p.inter; ++i) s += double(act[i]) * wd[n * p.inter + i];
        acc[n] = std::fma(p.weights[t * p.k + j], static_cast<float>(s), acc[n]);
      }
    }
    for (int64_t n = 0; n < p.h; ++n) out[t * p.h + n] += acc[n];
  }
  return out;
}

// Runs MoeExperts on the problem's rows; returns x.
std::vector<float> DeviceExperts(const Problem& p, MoeBuffers& b, const cuda::DeviceBuffer& wgu,
                                 const cuda::DeviceBuffer& wd) {
  Put(b.xn, p.xn);
  Put(b.x, p.x);
  Put(b.ids, p.ids);
  Put(b.weights, p.weights);
  cuda::MoeLayerParams mp;
  mp.xn = b.xn.get<bf16>();
  mp.num_tokens = p.t;
  mp.hidden = p.h;
  mp.inter = p.inter;
  mp.num_experts = p.e;
  mp.top_k = p.k;
  mp.ids = b.ids.get<int32_t>();
  mp.weights = b.weights.get<float>();
  mp.w_gate_up = wgu.get<bf16>();
  mp.w_down = wd.get<bf16>();
  mp.grouping = b.Grouping();
  mp.gate_up = b.gate_up.get<bf16>();
  mp.act = b.act.get<bf16>();
  mp.y = b.y.get<float>();
  mp.x = b.x.get<float>();
  const cudaError_t err = cuda::MoeExperts(mp, nullptr);
  EXPECT_EQ(cudaSuccess, err) << cudaGetErrorString(err);
  EXPECT_EQ(cudaSuccess, cudaDeviceSynchronize());
  return Download<float>(b.x, p.t * p.h);
}

TEST_F(MoeTest, ExpertsMatchHostReference) {
  struct Case {
    int e, k;
    int64_t h, inter, t;
  };
  for (const Case c : {Case{4, 2, 64, 64, 1}, Case{8, 2, 128, 192, 45}, Case{16, 4, 256, 128, 130},
                       Case{128, 8, 2048, 768, 3}}) {
    const Problem p = MakeProblem(c.e, c.k, c.h, c.inter, c.t, 100 + c.t);
    MoeBuffers b;
    b.Allocate(c.t, c.e, c.k, c.h, c.inter);
    const cuda::DeviceBuffer wgu = Upload(p.w_gate_up), wd = Upload(p.w_down);
    const std::vector<float> got = DeviceExperts(p, b, wgu, wd);
    // bf16 roundings of gate/up and of the activation may fall on the other side of a tie from
    // the host's double sums; the tolerance covers a few such flips per row.
    EXPECT_TRUE(AllClose(got, HostExperts(p), 2e-3f, 2e-2f))
        << "E " << c.e << " k " << c.k << " h " << c.h << " inter " << c.inter << " T " << c.t;
  }
}

// The grouped GEMM alone, every block shape and output, with and without the row gather, against
// fp64 sums; and the block shapes give the same bits.
TEST_F(MoeTest, ExpertGemmMatchesHostReferenceInEveryBlockShape) {
  const int e_count = 6;
  const int64_t n = 256, k = 320, t_count = 301;
  std::vector<bf16> x, w;
  std::vector<float> x_f, w_f;
  gpu_test::RandomBf16(t_count * k, 1, 1.0f, &x, &x_f);
  gpu_test::RandomBf16(e_count * n * k, 2, 0.05f, &w, &w_f);
  std::vector<int32_t> ids(t_count);
  for (int64_t t = 0; t < t_count; ++t) ids[t] = static_cast<int32_t>((t * 7 + t / 5) % e_count);
  ids[0] = e_count - 1;
  const cuda::DeviceBuffer dx = Upload(x), dw = Upload(w);
  cuda::DeviceBuffer dy;
  ASSERT_CUDA_OK(dy.Allocate(t_count * n * 4));
  std::vector<std::vector<uint8_t>> first_shape_bits;  // [gather x output]
  for (int32_t tile_rows :
       {cuda::kMoeTileRows, cuda::kMoeTileRowsLarge, cuda::kMoeTileRowsXLarge}) {
    MoeBuffers b;
    b.Allocate(t_count, e_count, 1, k, n);
    Put(b.ids, ids);
    ASSERT_CUDA_OK(cuda::MoeGroup(b.ids.get<int32_t>(), t_count, e_count, 1, tile_rows,
                                  b.Grouping(), nullptr));
    const std::vector<int32_t> rows = Download<int32_t>(b.rows, t_count);
    const std::vector<int32_t> offsets = Download<int32_t>(b.expert_offsets, e_count + 1);
    int variant = 0;
    for (bool gather : {true, false}) {
      for (cuda::MoeGemmOutput out : {cuda::MoeGemmOutput::kF32, cuda::MoeGemmOutput::kBf16}) {
        const std::string where = "tile rows " + std::to_string(tile_rows) + " gather " +
                                  std::to_string(gather) +
                                  (out == cuda::MoeGemmOutput::kBf16 ? " bf16" : " f32");
        ASSERT_CUDA_OK(cudaMemset(dy.get(), 0xff, t_count * n * 4));
        cuda::MoeGemmParams gp;
        gp.x = dx.get<bf16>();
        gp.rows = gather ? b.rows.get<int32_t>() : nullptr;
        gp.assignments = t_count;
        gp.w = dw.get<bf16>();
        gp.expert_stride = n * k;
        gp.n = n;
        gp.k = k;
        gp.expert_offsets = b.expert_offsets.get<int32_t>();
        gp.tile_offsets = b.tile_offsets.get<int32_t>();
        gp.num_experts = e_count;
        gp.output = out;
        gp.y = dy.get();
        gp.tile_rows = tile_rows;
        ASSERT_CUDA_OK(cuda::MoeExpertGemm(gp, nullptr));
        const size_t bytes = t_count * n * (out == cuda::MoeGemmOutput::kF32 ? 4 : 2);
        const std::vector<uint8_t> bits = Download<uint8_t>(dy, bytes);
        if (tile_rows == cuda::kMoeTileRows) {
          first_shape_bits.push_back(bits);
        } else {
          EXPECT_EQ(0, std::memcmp(bits.data(), first_shape_bits[variant].data(), bytes))
              << where << ": the block shapes give other bits";
        }
        ++variant;
        std::vector<float> got(t_count * n);
        for (size_t i = 0; i < got.size(); ++i) {
          if (out == cuda::MoeGemmOutput::kF32) {
            std::memcpy(&got[i], &bits[4 * i], 4);
          } else {
            bf16 v;
            std::memcpy(&v, &bits[2 * i], 2);
            got[i] = __bfloat162float(v);
          }
        }
        std::vector<float> want(t_count * n);
        for (int e = 0; e < e_count; ++e) {
          for (int32_t r = offsets[e]; r < offsets[e + 1]; ++r) {
            const int64_t src = gather ? rows[r] : r;
            for (int64_t c = 0; c < n; ++c) {
              double sum = 0.0;
              for (int64_t i = 0; i < k; ++i) {
                sum += double(x_f[src * k + i]) * w_f[(e * n + c) * k + i];
              }
              want[r * n + c] =
                  out == cuda::MoeGemmOutput::kF32 ? float(sum) : RoundBf16(float(sum));
            }
          }
        }
        EXPECT_TRUE(
            AllClose(got, want, 1e-4f, out == cuda::MoeGemmOutput::kF32 ? 1e-4f : 1.0f / 128))
            << where;
      }
    }
  }
}

TEST_F(MoeTest, ExpertGemmRefusesUnalignedShapes) {
  cuda::MoeGemmParams gp;
  cuda::DeviceBuffer buf;
  ASSERT_CUDA_OK(buf.Allocate(1 << 20));
  gp.x = buf.get<bf16>();
  gp.w = buf.get<bf16>();
  gp.y = buf.get();
  gp.assignments = 1;
  gp.num_experts = 1;
  gp.expert_offsets = buf.get<int32_t>();
  gp.tile_offsets = buf.get<int32_t>();
  gp.n = 96;
  gp.k = 128;
  EXPECT_EQ(cudaErrorInvalidValue, cuda::MoeExpertGemm(gp, nullptr));
  gp.n = 128;
  gp.k = 100;
  EXPECT_EQ(cudaErrorInvalidValue, cuda::MoeExpertGemm(gp, nullptr));
  cudaGetLastError();
}

// The whole chain (routing from logits, grouping, experts, combine) for one batch; returns x.
struct Chain {
  Chain(int e_count, int top_k, int64_t hidden, int64_t width)
      : e(e_count), k(top_k), h(hidden), inter(width) {}
  int e, k;
  int64_t h, inter;
  cuda::DeviceBuffer wgu, wd;
  MoeBuffers b;
  std::vector<float> Run(const std::vector<float>& logits, const std::vector<bf16>& xn,
                         const std::vector<float>& x, int64_t t_count) {
    Put(b.logits, logits);
    Put(b.xn, xn);
    Put(b.x, x);
    EXPECT_EQ(cudaSuccess,
              cuda::MoeRoute(b.logits.get<float>(), t_count, e, k, true, nullptr, nullptr,
                             b.ids.get<int32_t>(), b.weights.get<float>(), nullptr));
    cuda::MoeLayerParams mp;
    mp.xn = b.xn.get<bf16>();
    mp.num_tokens = t_count;
    mp.hidden = h;
    mp.inter = inter;
    mp.num_experts = e;
    mp.top_k = k;
    mp.ids = b.ids.get<int32_t>();
    mp.weights = b.weights.get<float>();
    mp.w_gate_up = wgu.get<bf16>();
    mp.w_down = wd.get<bf16>();
    mp.grouping = b.Grouping();
    mp.gate_up = b.gate_up.get<bf16>();
    mp.act = b.act.get<bf16>();
    mp.y = b.y.get<float>();
    mp.x = b.x.get<float>();
    const cudaError_t err = cuda::MoeExperts(mp, nullptr);
    EXPECT_EQ(cudaSuccess, err) << cudaGetErrorString(err);
    EXPECT_EQ(cudaSuccess, cudaDeviceSynchronize());
    return Download<float>(b.x, t_count * h);
  }
};

struct InvarianceShape {
  const char* name;
  int e, k;
  int64_t h, inter;
  std::vector<int64_t> counts;  // token counts to check
};

std::vector<int64_t> OneTo512AndLarger() {
  std::vector<int64_t> v(512);
  std::iota(v.begin(), v.end(), 1);
  for (int64_t t : {640, 1000, 1024, 2048, 4099, 8192}) v.push_back(t);
  return v;
}

class MoeInvarianceTest : public ::testing::TestWithParam<InvarianceShape> {
 protected:
  void SetUp() override {
    if (!gpu_test::HaveGpu()) GTEST_SKIP() << "no CUDA device";
  }
};

// The proof: three probe rows (their logits, norm output and residual fixed) computed alone give
// reference bits; then for every token count T they sit at random positions among T - 3 other
// rows. Even T: the others' routings are random; odd T: the others copy probe 0's logits, so
// probe 0's experts get every row count from 1 to T (and probe 0 lands anywhere among them).
// Every probe row's output must equal its reference bitwise.
TEST_P(MoeInvarianceTest, EveryRowIsBitwiseIndependentOfTheBatch) {
  const InvarianceShape& s = GetParam();
  const int64_t max_t = *std::max_element(s.counts.begin(), s.counts.end());
  Chain chain(s.e, s.k, s.h, s.inter);
  {
    std::vector<bf16> w;
    std::vector<float> wf;
    gpu_test::RandomBf16(int64_t{s.e} * 2 * s.inter * s.h, 1, 1.0f / std::sqrt(float(s.h)), &w,
                         &wf);
    chain.wgu = Upload(w);
    gpu_test::RandomBf16(int64_t{s.e} * s.h * s.inter, 2, 1.0f / std::sqrt(float(s.inter)), &w,
                         &wf);
    chain.wd = Upload(w);
  }
  chain.b.Allocate(max_t, s.e, s.k, s.h, s.inter);
  constexpr int kProbes = 3;
  const std::vector<float> probe_logits = RandomLogits(kProbes, s.e, 7);
  std::vector<bf16> probe_xn;
  std::vector<float> probe_xn_f;
  gpu_test::RandomBf16(kProbes * s.h, 8, 1.0f, &probe_xn, &probe_xn_f);
  const std::vector<float> probe_x = gpu_test::RandomFloats(kProbes * s.h, 9, 1.0f);
  std::vector<std::vector<float>> reference(kProbes);
  for (int p = 0; p < kProbes; ++p) {
    reference[p] = chain.Run(
        std::vector<float>(probe_logits.begin() + p * s.e, probe_logits.begin() + (p + 1) * s.e),
        std::vector<bf16>(probe_xn.begin() + p * s.h, probe_xn.begin() + (p + 1) * s.h),
        std::vector<float>(probe_x.begin() + p * s.h, probe_x.begin() + (p + 1) * s.h), 1);
  }
  // Others' data for the largest step, reused as a prefix (positions differ per T anyway).
  std::vector<float> other_logits = RandomLogits(max_t, s.e, 10);
  std::vector<bf16> other_xn;
  std::vector<float> other_xn_f;
  gpu_test::RandomBf16(max_t * s.h, 11, 1.0f, &other_xn, &other_xn_f);
  const std::vector<float> other_x = gpu_test::RandomFloats(max_t * s.h, 12, 1.0f);
  std::mt19937 rng(13);
  int failures = 0;
  for (int64_t t_count : s.counts) {
    const bool concentrated = t_count % 2 == 1;
    const int probes = static_cast<int>(std::min<int64_t>(kProbes, t_count));
    std::vector<int64_t> positions(t_count);
    std::iota(positions.begin(), positions.end(), 0);
    std::shuffle(positions.begin(), positions.end(), rng);
    positions.resize(probes);
    std::vector<float> logits(other_logits.begin(), other_logits.begin() + t_count * s.e);
    std::vector<bf16> xn(other_xn.begin(), other_xn.begin() + t_count * s.h);
    std::vector<float> x(other_x.begin(), other_x.begin() + t_count * s.h);
    if (concentrated) {
      for (int64_t t = 0; t < t_count; ++t) {
        std::copy(probe_logits.begin(), probe_logits.begin() + s.e, logits.begin() + t * s.e);
      }
    }
    for (int p = 0; p < probes; ++p) {
      const int64_t at = positions[p];
      std::copy(probe_logits.begin() + p * s.e, probe_logits.begin() + (p + 1) * s.e,
                logits.begin() + at * s.e);
      std::copy(probe_xn.begin() + p * s.h, probe_xn.begin() + (p + 1) * s.h,
                xn.begin() + at * s.h);
      std::copy(probe_x.begin() + p * s.h, probe_x.begin() + (p + 1) * s.h, x.begin() + at * s.h);
    }
    const std::vector<float> got = chain.Run(logits, xn, x, t_count);
    for (int p = 0; p < probes; ++p) {
      const float* row = &got[positions[p] * s.h];
      if (std::memcmp(row, reference[p].data(), s.h * 4) == 0) continue;
      if (++failures > 10) continue;
      int64_t first = 0;
      while (first < s.h && std::memcmp(&row[first], &reference[p][first], 4) == 0) ++first;
      const std::vector<int32_t> counts = Download<int32_t>(chain.b.counts, s.e);
      const std::vector<int32_t> ids = Download<int32_t>(chain.b.ids, t_count * s.k);
      std::ostringstream experts;
      for (int j = 0; j < s.k; ++j) {
        const int32_t e = ids[positions[p] * s.k + j];
        experts << " " << e << "(" << counts[e] << " rows)";
      }
      ADD_FAILURE() << s.name << ": T " << t_count << (concentrated ? " concentrated" : " random")
                    << ", probe " << p << " at position " << positions[p]
                    << " differs from alone; first element " << first << ": " << row[first]
                    << " vs " << reference[p][first] << "; experts" << experts.str();
    }
  }
  EXPECT_EQ(0, failures) << s.name;
  std::printf("[ moe ] %s: %zu token counts up to %lld, %d probe rows differing\n", s.name,
              s.counts.size(), static_cast<long long>(max_t), failures);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, MoeInvarianceTest,
    ::testing::Values(
        // Few experts: every expert gets large, varied counts.
        InvarianceShape{"e16_k4_h256_i128", 16, 4, 256, 128, OneTo512AndLarger()},
        // Qwen3-30B-A3B's expert shapes.
        InvarianceShape{
            "qwen3_30b_a3b", 128, 8, 2048, 768, {1,   2,   3,   4,   5,   7,   8,    15,   16,
                                                 17,  31,  32,  33,  63,  64,  65,   127,  128,
                                                 129, 255, 256, 257, 511, 512, 1023, 2048, 4097}}),
    [](const ::testing::TestParamInfo<InvarianceShape>& info) { return info.param.name; });

// Batch order: a step of 300 rows and the same rows permuted give each row the same bits.
TEST_F(MoeTest, RowsAreBitwiseIndependentOfBatchOrder) {
  const int e = 32, k = 4;
  const int64_t h = 512, inter = 256, t_count = 300;
  Chain chain(e, k, h, inter);
  std::vector<bf16> w;
  std::vector<float> wf;
  gpu_test::RandomBf16(int64_t{e} * 2 * inter * h, 1, 1.0f / std::sqrt(float(h)), &w, &wf);
  chain.wgu = Upload(w);
  gpu_test::RandomBf16(int64_t{e} * h * inter, 2, 1.0f / std::sqrt(float(inter)), &w, &wf);
  chain.wd = Upload(w);
  chain.b.Allocate(t_count, e, k, h, inter);
  const std::vector<float> logits = RandomLogits(t_count, e, 3);
  std::vector<bf16> xn;
  std::vector<float> xn_f;
  gpu_test::RandomBf16(t_count * h, 4, 1.0f, &xn, &xn_f);
  const std::vector<float> x = gpu_test::RandomFloats(t_count * h, 5, 1.0f);
  const std::vector<float> base = chain.Run(logits, xn, x, t_count);
  std::vector<int64_t> perm(t_count);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), std::mt19937(6));
  std::vector<float> pl(logits.size()), px(x.size());
  std::vector<bf16> pxn(xn.size());
  for (int64_t i = 0; i < t_count; ++i) {
    std::copy(logits.begin() + perm[i] * e, logits.begin() + (perm[i] + 1) * e, pl.begin() + i * e);
    std::copy(xn.begin() + perm[i] * h, xn.begin() + (perm[i] + 1) * h, pxn.begin() + i * h);
    std::copy(x.begin() + perm[i] * h, x.begin() + (perm[i] + 1) * h, px.begin() + i * h);
  }
  const std::vector<float> permuted = chain.Run(pl, pxn, px, t_count);
  int differing = 0;
  for (int64_t i = 0; i < t_count; ++i) {
    if (std::memcmp(&permuted[i * h], &base[perm[i] * h], h * 4) != 0 && ++differing <= 5) {
      ADD_FAILURE() << "row " << perm[i] << " (at " << i << " when permuted) differs";
    }
  }
  EXPECT_EQ(0, differing);
}

}  // namespace
}  // namespace rollout
