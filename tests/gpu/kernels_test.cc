// Every CUDA kernel against the CPU reference (kernels/cpu/ops.h) within tolerance, and the
// attention kernel's prefill and decode block shapes against each other, bitwise.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/ops.h"
#include "kernels/cuda/compare.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/moe.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/tensor_parallel.h"
#include "model/rope.h"
#include "runner/cuda/batch_plan.h"
#include "tests/gpu/gpu_test_util.h"

namespace rollout {
namespace {

using cuda::bf16;
using gpu_test::AllClose;
using gpu_test::Download;
using gpu_test::Upload;

class KernelsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!gpu_test::HaveGpu()) GTEST_SKIP() << "no CUDA device";
  }
};

// A refused allocation is reported once, by its return value: it must not stay behind as the
// thread's last error, where the next launch check (cudaGetLastError) would report it as that
// kernel's failure (found on the H200: a runner refused for memory made the next runner's
// first weight-generation kernel "fail" with cudaErrorMemoryAllocation).
TEST_F(KernelsTest, ARefusedAllocationLeavesNoErrorForTheNextLaunch) {
  size_t free_bytes = 0, total = 0;
  ASSERT_EQ(cudaMemGetInfo(&free_bytes, &total), cudaSuccess);
  cuda::DeviceBuffer device;
  EXPECT_EQ(device.Allocate(total * 4), cudaErrorMemoryAllocation);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  cuda::PinnedHostBuffer host;
  EXPECT_NE(host.Allocate(size_t{1} << 52), cudaSuccess);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  cuda::DeviceBuffer small;
  ASSERT_EQ(small.Allocate(1024), cudaSuccess);
  ASSERT_EQ(cudaMemset(small.get(), 0, 1024), cudaSuccess);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

TEST_F(KernelsTest, EmbeddingGatherCopiesRowsExactly) {
  const int64_t vocab = 1000, hidden = 264;
  std::vector<bf16> embed;
  std::vector<float> embed_f;
  gpu_test::RandomBf16(vocab * hidden, 1, 1.0f, &embed, &embed_f);
  const std::vector<int32_t> tokens = {5, 999, 0, 5, 123};
  auto d_embed = Upload(embed);
  auto d_tokens = Upload(tokens);
  cuda::DeviceBuffer d_x;
  ASSERT_CUDA_OK(d_x.Allocate(tokens.size() * hidden * 4));
  ASSERT_CUDA_OK(cuda::EmbeddingGather(d_tokens.get<int32_t>(), tokens.size(), d_embed.get<bf16>(),
                                       hidden, d_x.get<float>(), nullptr));
  const std::vector<float> x = Download<float>(d_x, tokens.size() * hidden);
  for (size_t t = 0; t < tokens.size(); ++t) {
    ASSERT_EQ(0, std::memcmp(&x[t * hidden], &embed_f[tokens[t] * hidden], hidden * 4)) << t;
  }
}

TEST_F(KernelsTest, RmsNormMatchesCpuAndIgnoresOtherRows) {
  for (int64_t dim : {256, 4096}) {
    for (int64_t rows : {1, 3, 99}) {
      const std::vector<float> x = gpu_test::RandomFloats(rows * dim, 2 + rows, 3.0f);
      std::vector<float> weight = gpu_test::RandomFloats(dim, 7, 0.1f);
      for (float& w : weight) w += 1.0f;
      auto d_x = Upload(x);
      auto d_w = Upload(weight);
      cuda::DeviceBuffer d_y;
      ASSERT_CUDA_OK(d_y.Allocate(rows * dim * 2));
      ASSERT_CUDA_OK(cuda::RmsNorm(d_x.get<float>(), nullptr, rows, dim, d_w.get<float>(), 1e-6f,
                                   d_y.get<bf16>(), nullptr));
      std::vector<float> ref(rows * dim);
      cpu::RmsNorm(x.data(), weight.data(), rows, dim, 1e-6f, ref.data());
      const std::vector<float> got = gpu_test::Widen(Download<bf16>(d_y, rows * dim));
      EXPECT_TRUE(AllClose(got, ref, 1e-5f, 1.0f / 128)) << "dim " << dim << " rows " << rows;

      // The last row through a gather list alone: bitwise the row computed among all the rows.
      const std::vector<int32_t> one_row = {static_cast<int32_t>(rows - 1)};
      auto d_rows = Upload(one_row);
      cuda::DeviceBuffer d_y1;
      ASSERT_CUDA_OK(d_y1.Allocate(dim * 2));
      ASSERT_CUDA_OK(cuda::RmsNorm(d_x.get<float>(), d_rows.get<int32_t>(), 1, dim,
                                   d_w.get<float>(), 1e-6f, d_y1.get<bf16>(), nullptr));
      const std::vector<bf16> alone = Download<bf16>(d_y1, dim);
      const std::vector<bf16> all = Download<bf16>(d_y, rows * dim);
      EXPECT_EQ(0, std::memcmp(alone.data(), &all[(rows - 1) * dim], dim * 2));
    }
  }
}

// The norm kernels move vectors of elements per lane: a pointer off their alignment is refused
// with cudaErrorInvalidValue, before any launch, instead of faulting on the device.
TEST_F(KernelsTest, NormKernelsRefuseMisalignedPointers) {
  const int64_t dim = 256;
  cuda::DeviceBuffer d_x, d_w, d_y;
  ASSERT_CUDA_OK(d_x.Allocate(2 * dim * 4));
  ASSERT_CUDA_OK(d_w.Allocate(dim * 4));
  ASSERT_CUDA_OK(d_y.Allocate(2 * dim * 2));
  EXPECT_EQ(cudaErrorInvalidValue,
            cuda::RmsNorm(d_x.get<float>() + 1, nullptr, 1, dim, d_w.get<float>(), 1e-6f,
                          d_y.get<bf16>(), nullptr));
  EXPECT_EQ(cudaErrorInvalidValue,
            cuda::RmsNorm(d_x.get<float>(), nullptr, 1, dim, d_w.get<float>(), 1e-6f,
                          d_y.get<bf16>() + 2, nullptr));
  EXPECT_EQ(cudaSuccess, cuda::RmsNorm(d_x.get<float>() + dim, nullptr, 1, dim, d_w.get<float>(),
                                       1e-6f, d_y.get<bf16>() + dim, nullptr));

  const int32_t hd = 128, nh = 2, nkv = 1;
  cuda::DeviceBuffer d_qkv, d_q, d_k, d_v, d_pos, d_rope;
  ASSERT_CUDA_OK(d_qkv.Allocate((nh + 2 * nkv) * hd * 4 + 16));
  ASSERT_CUDA_OK(d_q.Allocate(nh * hd * 4));
  ASSERT_CUDA_OK(d_k.Allocate(16 * nkv * hd * 2));
  ASSERT_CUDA_OK(d_v.Allocate(16 * nkv * hd * 2));
  ASSERT_CUDA_OK(d_pos.Allocate(8));
  ASSERT_CUDA_OK(d_rope.Allocate(hd / 2 * 4));
  cuda::QkvParams p;
  p.qkv = d_qkv.get<float>() + 1;  // 4 bytes off the 16 a lane's 4 floats need
  p.num_tokens = 1;
  p.positions = d_pos.get<int32_t>();
  p.kv_slots = d_pos.get<int32_t>();
  p.rope_cos = p.rope_sin = d_rope.get<float>();
  p.num_heads = nh;
  p.q_out = d_q.get<float>();
  const cuda::KvCacheView cache{d_k.get<bf16>(), d_v.get<bf16>(), 16, nkv, hd};
  EXPECT_EQ(cudaErrorInvalidValue, cuda::QkvNormRopeWriteKv(p, cache, nullptr));
}

TEST_F(KernelsTest, SiluMulMatchesCpu) {
  // The last case: more rows than one grid holds (65535), launched in row ranges.
  for (auto [dim, rows] : {std::pair<int64_t, int64_t>{768, 3}, {12288, 3}, {64, 70000}}) {
    std::vector<bf16> gu;
    std::vector<float> gu_f;
    gpu_test::RandomBf16(rows * 2 * dim, 11, 2.0f, &gu, &gu_f);
    auto d_gu = Upload(gu);
    cuda::DeviceBuffer d_out;
    ASSERT_CUDA_OK(d_out.Allocate(rows * dim * 2));
    ASSERT_CUDA_OK(cuda::SiluMul(d_gu.get<bf16>(), rows, dim, d_out.get<bf16>(), nullptr));
    std::vector<float> ref(rows * dim);
    cpu::SiluMul(gu_f.data(), rows, dim, ref.data());
    EXPECT_TRUE(
        AllClose(gpu_test::Widen(Download<bf16>(d_out, rows * dim)), ref, 1e-6f, 1.0f / 128));
  }
}

// cos/sin tables [max_pos, head_dim / 2] as CudaModelRunner builds them (model/rope.h).
void RopeTables(int64_t max_pos, int64_t head_dim, float theta, const RopeScaling& scaling,
                std::vector<float>* cos_t, std::vector<float>* sin_t) {
  const int64_t half = head_dim / 2;
  cos_t->resize(max_pos * half);
  sin_t->resize(max_pos * half);
  const RopeFrequencies f = ComputeRopeFrequencies(scaling, theta, head_dim);
  for (int64_t p = 0; p < max_pos; ++p) RopeCosSin(f, p, &(*cos_t)[p * half], &(*sin_t)[p * half]);
}

// The rows of `positions` in a table, as the CPU runner gathers them for ApplyRope.
std::vector<float> RopeRows(const std::vector<float>& table, const std::vector<int32_t>& positions,
                            int64_t half) {
  std::vector<float> rows(positions.size() * half);
  for (size_t t = 0; t < positions.size(); ++t) {
    std::memcpy(&rows[t * half], &table[positions[t] * half], half * sizeof(float));
  }
  return rows;
}

RopeScaling YarnForTest() {
  RopeScaling s;
  s.type = RopeType::kYarn;
  s.factor = 4.0;
  s.original_max_position_embeddings = 1024;  // cos and sin scaled by 1 + 0.1 ln 4
  return s;
}

TEST_F(KernelsTest, QkvNormRopeMatchesCpuAndWritesCacheSlots) {
  const int32_t nh = 8, nkv = 2, block_size = 16;
  const std::vector<int32_t> positions = {0, 1, 17, 1000, 4095};
  const std::vector<int32_t> slots = {3, 40, 7, 100, 64};
  const int64_t t = positions.size(), num_blocks = 8;
  for (int32_t hd : {32, 64, 128}) {
    for (bool with_bias : {false, true}) {
      // Plain RoPE, and YaRN (scaled frequencies, cos and sin times its attention factor).
      const RopeScaling scaling = with_bias ? YarnForTest() : RopeScaling();
      const int64_t cols = (nh + 2 * nkv) * hd;
      const std::vector<float> qkv = gpu_test::RandomFloats(t * cols, hd, 1.0f);
      const std::vector<float> bias = gpu_test::RandomFloats(cols, 5, 0.1f);
      std::vector<float> qn = gpu_test::RandomFloats(hd, 6, 0.1f),
                         kn = gpu_test::RandomFloats(hd, 8, 0.1f);
      for (float& w : qn) w += 1.0f;
      for (float& w : kn) w += 1.0f;
      std::vector<float> cos_t, sin_t;
      RopeTables(4096, hd, 1e6f, scaling, &cos_t, &sin_t);
      auto d_qkv = Upload(qkv), d_bias = Upload(bias), d_qn = Upload(qn), d_kn = Upload(kn);
      auto d_pos = Upload(positions), d_slots = Upload(slots);
      auto d_cos = Upload(cos_t), d_sin = Upload(sin_t);
      cuda::DeviceBuffer d_q, d_k, d_v;
      const int64_t cache_elems = num_blocks * block_size * nkv * hd;
      ASSERT_CUDA_OK(d_q.Allocate(t * nh * hd * 4));
      ASSERT_CUDA_OK(d_k.Allocate(cache_elems * 2));
      ASSERT_CUDA_OK(d_v.Allocate(cache_elems * 2));
      cuda::QkvParams p;
      p.qkv = d_qkv.get<float>();
      p.num_tokens = t;
      p.positions = d_pos.get<int32_t>();
      p.kv_slots = d_slots.get<int32_t>();
      if (with_bias) {
        p.q_bias = d_bias.get<float>();
        p.k_bias = p.q_bias + nh * hd;
        p.v_bias = p.q_bias + (nh + nkv) * hd;
      } else {
        p.q_norm = d_qn.get<float>();
        p.k_norm = d_kn.get<float>();
      }
      p.rope_cos = d_cos.get<float>();
      p.rope_sin = d_sin.get<float>();
      p.num_heads = nh;
      p.q_out = d_q.get<float>();
      const cuda::KvCacheView cache{d_k.get<bf16>(), d_v.get<bf16>(), block_size, nkv, hd};
      ASSERT_CUDA_OK(cuda::QkvNormRopeWriteKv(p, cache, nullptr));

      // CPU: split, bias or norm, RoPE.
      std::vector<float> q(t * nh * hd), k(t * nkv * hd), v(t * nkv * hd);
      for (int64_t i = 0; i < t; ++i) {
        for (int64_t c = 0; c < cols; ++c) {
          const float x = qkv[i * cols + c] + (with_bias ? bias[c] : 0.0f);
          if (c < nh * hd) {
            q[i * nh * hd + c] = x;
          } else if (c < (nh + nkv) * hd) {
            k[i * nkv * hd + c - nh * hd] = x;
          } else {
            v[i * nkv * hd + c - (nh + nkv) * hd] = x;
          }
        }
      }
      if (!with_bias) {
        cpu::RmsNorm(q.data(), qn.data(), t * nh, hd, 1e-6f, q.data());
        cpu::RmsNorm(k.data(), kn.data(), t * nkv, hd, 1e-6f, k.data());
      }
      const std::vector<float> cos_rows = RopeRows(cos_t, positions, hd / 2);
      const std::vector<float> sin_rows = RopeRows(sin_t, positions, hd / 2);
      cpu::ApplyRope(q.data(), cos_rows.data(), sin_rows.data(), t, nh, hd);
      cpu::ApplyRope(k.data(), cos_rows.data(), sin_rows.data(), t, nkv, hd);
      EXPECT_TRUE(AllClose(Download<float>(d_q, t * nh * hd), q, 1e-5f, 1e-5f)) << "hd " << hd;
      const std::vector<float> k_cache = gpu_test::Widen(Download<bf16>(d_k, cache_elems));
      const std::vector<float> v_cache = gpu_test::Widen(Download<bf16>(d_v, cache_elems));
      std::vector<float> k_got(t * nkv * hd), v_got(t * nkv * hd);
      for (int64_t i = 0; i < t; ++i) {
        for (int32_t h = 0; h < nkv; ++h) {
          const int64_t at = cuda::KvOffset(slots[i], h, block_size, nkv, hd);
          std::memcpy(&k_got[(i * nkv + h) * hd], &k_cache[at], hd * 4);
          std::memcpy(&v_got[(i * nkv + h) * hd], &v_cache[at], hd * 4);
        }
      }
      EXPECT_TRUE(AllClose(k_got, k, 1e-5f, 1.0f / 128)) << "hd " << hd;
      EXPECT_TRUE(AllClose(v_got, v, 1e-5f, 1.0f / 256)) << "hd " << hd;
    }
  }
}

// A paged cache holding random K/V for a few sequences, with shuffled block tables.
struct AttentionFixture {
  int32_t nh, nkv, hd, block_size, split;
  std::vector<int32_t> lengths;
  std::vector<std::vector<int32_t>> tables;  // per sequence
  std::vector<bf16> k, v;                    // [num_blocks, block_size, nkv, hd] (the CPU's)
  std::vector<float> k_f, v_f;
  int64_t num_blocks = 0;
  cuda::DeviceBuffer d_k, d_v;

  AttentionFixture(int32_t nh_, int32_t nkv_, int32_t hd_, int32_t bs, int32_t split_,
                   std::vector<int32_t> lengths_)
      : nh(nh_), nkv(nkv_), hd(hd_), block_size(bs), split(split_), lengths(std::move(lengths_)) {
    for (int32_t len : lengths) num_blocks += (len + bs - 1) / bs;
    std::vector<int32_t> order(num_blocks);
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), std::mt19937(42));
    int64_t next = 0;
    for (int32_t len : lengths) {
      tables.emplace_back();
      for (int32_t b = 0; b < (len + bs - 1) / bs; ++b) tables.back().push_back(order[next++]);
    }
    const int64_t elems = num_blocks * bs * nkv * hd;
    gpu_test::RandomBf16(elems, 100 + hd, 1.0f, &k, &k_f);
    gpu_test::RandomBf16(elems, 200 + hd, 1.0f, &v, &v_f);
    d_k = Upload(DeviceLayout(k));
    d_v = Upload(DeviceLayout(v));
  }
  // The CPU layout's values where the GPU cache keeps them (cuda::KvOffset).
  std::vector<bf16> DeviceLayout(const std::vector<bf16>& cpu) const {
    std::vector<bf16> out(cpu.size());
    for (int64_t slot = 0; slot < num_blocks * block_size; ++slot) {
      for (int32_t h = 0; h < nkv; ++h) {
        std::memcpy(&out[cuda::KvOffset(slot, h, block_size, nkv, hd)], &cpu[(slot * nkv + h) * hd],
                    hd * sizeof(bf16));
      }
    }
    return out;
  }
  cuda::KvCacheView view() const { return {d_k.get<bf16>(), d_v.get<bf16>(), block_size, nkv, hd}; }
};

// Tokens (sequence, position) with q rows; runs the kernel over `items` in `shape`.
struct AttentionRun {
  std::vector<int32_t> token_seq, positions;
  std::vector<float> q;  // [tokens, nh, hd]

  std::vector<bf16> Run(const AttentionFixture& f, const std::vector<int32_t>& items,
                        cuda::AttentionBlockShape shape, bool split_parallel = false) const {
    const int64_t t = positions.size();
    std::vector<int32_t> offsets(t), tables;
    std::vector<int32_t> seq_offset(f.tables.size());
    for (size_t s = 0; s < f.tables.size(); ++s) {
      seq_offset[s] = tables.size();
      tables.insert(tables.end(), f.tables[s].begin(), f.tables[s].end());
    }
    for (int64_t i = 0; i < t; ++i) offsets[i] = seq_offset[token_seq[i]];
    auto d_q = Upload(q), d_pos = Upload(positions), d_off = Upload(offsets);
    auto d_tables = Upload(tables), d_items = Upload(items);
    cuda::DeviceBuffer d_out;
    d_out.Allocate(t * f.nh * f.hd * 2);
    cudaMemset(d_out.get(), 0xff, t * f.nh * f.hd * 2);
    cuda::AttentionParams p;
    p.q = d_q.get<float>();
    p.positions = d_pos.get<int32_t>();
    p.table_offsets = d_off.get<int32_t>();
    p.tables = d_tables.get<int32_t>();
    p.items = d_items.get<int2>();
    p.num_items = items.size() / 2;
    p.num_heads = f.nh;
    p.split_size = f.split;
    p.scale = 1.0f / std::sqrt(static_cast<float>(f.hd));
    p.out = d_out.get<bf16>();
    cuda::DeviceBuffer partials;
    if (split_parallel) {
      int32_t max_pos = 0;
      for (int32_t pos : positions) max_pos = std::max(max_pos, pos);
      p.max_splits = max_pos / f.split + 1;
      partials.Allocate(static_cast<size_t>(p.num_items) * f.nh * p.max_splits * (f.hd + 2) * 4);
      p.partials = partials.get<float>();
    }
    EXPECT_EQ(cudaSuccess, cuda::PagedAttention(p, shape, f.view(), nullptr));
    EXPECT_EQ(cudaSuccess, cudaDeviceSynchronize());
    return Download<bf16>(d_out, t * f.nh * f.hd);
  }

  // The tensor-core kernel, split-parallel and its merge, or (fold: kManyTokens only) without
  // partials, every split folded in the block.
  // shares / share_tokens (split-parallel only): the items' prefix shares (ops.h).
  std::vector<bf16> RunMma(const AttentionFixture& f, const std::vector<int32_t>& items,
                           cuda::AttentionBlockShape shape, bool fold = false,
                           const std::vector<int32_t>& shares = {},
                           const std::vector<int32_t>& share_tokens = {}) const {
    const int64_t t = positions.size();
    std::vector<int32_t> offsets(t), tables;
    std::vector<int32_t> seq_offset(f.tables.size());
    for (size_t s = 0; s < f.tables.size(); ++s) {
      seq_offset[s] = tables.size();
      tables.insert(tables.end(), f.tables[s].begin(), f.tables[s].end());
    }
    for (int64_t i = 0; i < t; ++i) offsets[i] = seq_offset[token_seq[i]];
    auto d_q = Upload(q), d_pos = Upload(positions), d_off = Upload(offsets);
    auto d_tables = Upload(tables), d_items = Upload(items);
    int32_t max_pos = 0;
    for (int32_t pos : positions) max_pos = std::max(max_pos, pos);
    cuda::DeviceBuffer d_out, partials;
    d_out.Allocate(t * f.nh * f.hd * 2);
    cudaMemset(d_out.get(), 0xff, t * f.nh * f.hd * 2);
    cuda::AttentionParams p;
    p.q = d_q.get<float>();
    p.positions = d_pos.get<int32_t>();
    p.table_offsets = d_off.get<int32_t>();
    p.tables = d_tables.get<int32_t>();
    p.items = d_items.get<int2>();
    p.num_items = items.size() / 2;
    p.num_heads = f.nh;
    p.split_size = f.split;
    p.scale = 1.0f / std::sqrt(static_cast<float>(f.hd));
    p.out = d_out.get<bf16>();
    p.max_splits = max_pos / f.split + 1;
    partials.Allocate(static_cast<size_t>(t) * f.nh * p.max_splits * (f.hd + 2) * 4);
    cudaMemset(partials.get(), 0xff, static_cast<size_t>(t) * f.nh * p.max_splits * (f.hd + 2) * 4);
    p.partials = partials.get<float>();
    cuda::DeviceBuffer d_shares, d_share_tokens;
    if (!shares.empty()) {
      d_shares = Upload(shares);
      d_share_tokens = Upload(share_tokens.empty() ? std::vector<int32_t>{0} : share_tokens);
      p.shares = d_shares.get<int4>();
      p.share_tokens = d_share_tokens.get<int32_t>();
    }
    if (fold) {
      p.partials = nullptr;
      EXPECT_EQ(cudaSuccess, cuda::PagedAttentionMma(p, shape, f.view(), nullptr));
    } else {
      EXPECT_EQ(cudaSuccess, cuda::PagedAttentionMma(p, shape, f.view(), nullptr));
      EXPECT_EQ(cudaSuccess, cuda::MergeAttentionSplits(p, t, f.hd, nullptr));
    }
    EXPECT_EQ(cudaSuccess, cudaDeviceSynchronize());
    return Download<bf16>(d_out, t * f.nh * f.hd);
  }
};

TEST_F(KernelsTest, PagedAttentionMatchesCpu) {
  for (int32_t hd : {32, 128}) {
    for (int32_t bs : {16, 32}) {
      AttentionFixture f(8, 2, hd, bs, 64, {1, 31, 32, 33, 300, 1000});
      AttentionRun run;
      for (size_t s = 0; s < f.lengths.size(); ++s) {
        for (int32_t pos : {0, f.lengths[s] / 2, f.lengths[s] - 1}) {
          run.token_seq.push_back(s);
          run.positions.push_back(pos);
        }
      }
      const int64_t t = run.positions.size();
      run.q = gpu_test::RandomFloats(t * f.nh * hd, 9, 1.0f);
      std::vector<int32_t> items;
      for (int64_t i = 0; i < t; ++i) items.insert(items.end(), {static_cast<int32_t>(i), 1});
      const std::vector<bf16> got = run.Run(f, items, cuda::AttentionBlockShape::kOneToken);

      std::vector<const int32_t*> tables(t);
      for (int64_t i = 0; i < t; ++i) tables[i] = f.tables[run.token_seq[i]].data();
      cpu::TokenSlots slots{run.positions.data(), tables.data(), t};
      cpu::KvCacheLayer cache{f.k_f.data(), f.v_f.data(), bs, f.nkv, hd};
      std::vector<float> ref(t * f.nh * hd);
      cpu::PagedAttention(nullptr, run.q.data(), slots, f.nh, cache,
                          1.0f / std::sqrt(static_cast<float>(hd)), ref.data());
      EXPECT_TRUE(AllClose(gpu_test::Widen(got), ref, 2e-3f, 1.0f / 64))
          << "simt, hd " << hd << " block " << bs;
      // Tensor cores round q and P to bf16: a looser bound.
      const std::vector<bf16> mma = run.RunMma(f, items, cuda::AttentionBlockShape::kOneToken);
      EXPECT_TRUE(AllClose(gpu_test::Widen(mma), ref, 1e-2f, 1.0f / 32))
          << "tensor cores, hd " << hd << " block " << bs;
      std::vector<int32_t> many;
      for (int64_t i = 0; i < t; ++i) many.insert(many.end(), {static_cast<int32_t>(i), 1});
      const std::vector<bf16> mma_many =
          run.RunMma(f, many, cuda::AttentionBlockShape::kManyTokens);
      EXPECT_EQ(0, std::memcmp(mma.data(), mma_many.data(), mma.size() * 2))
          << "tensor cores, one warp vs four warps";
      const std::vector<bf16> mma_fold =
          run.RunMma(f, many, cuda::AttentionBlockShape::kManyTokens, /*fold=*/true);
      EXPECT_EQ(0, std::memcmp(mma.data(), mma_fold.data(), mma.size() * 2))
          << "tensor cores, split-parallel + merge vs splits folded in-block";
    }
  }
}

// Items covering tokens [0, n) in pieces of sizes cycling through `sizes`.
std::vector<int32_t> Items(int32_t n, const std::vector<int32_t>& sizes, int32_t max_size) {
  std::vector<int32_t> items;
  size_t k = 0;
  for (int32_t i = 0; i < n;) {
    const int32_t len = std::min({sizes[k++ % sizes.size()], max_size, n - i});
    items.insert(items.end(), {i, len});
    i += len;
  }
  return items;
}

// D8 at the kernel level: a row's output does not depend on which rows share its block --
// decode (one token per block), one-shot prefill, or prefill cut at odd places.
TEST_F(KernelsTest, AttentionPrefillAndDecodeAreBitwiseEqual) {
  struct Case {
    int32_t nh, nkv, hd, bs, split, len;
  };
  for (const Case& c : std::vector<Case>{{32, 8, 128, 32, 256, 777},
                                         {32, 8, 128, 16, 64, 300},
                                         {8, 2, 32, 16, 64, 1000},
                                         {16, 2, 64, 32, 32, 200}}) {
    AttentionFixture f(c.nh, c.nkv, c.hd, c.bs, c.split, {c.len});
    AttentionRun run;
    for (int32_t pos = 0; pos < c.len; ++pos) {
      run.token_seq.push_back(0);
      run.positions.push_back(pos);
    }
    run.q = gpu_test::RandomFloats(c.len * c.nh * c.hd, 3, 1.0f);
    const int32_t max_item = cuda::AttentionItemTokens(c.nh / c.nkv);
    const std::vector<bf16> decode =
        run.Run(f, Items(c.len, {1}, 1), cuda::AttentionBlockShape::kOneToken);
    const std::vector<bf16> prefill =
        run.Run(f, Items(c.len, {max_item}, max_item), cuda::AttentionBlockShape::kManyTokens);
    const std::vector<bf16> chunked = run.Run(f, Items(c.len, {3, 1, max_item, 7, 2}, max_item),
                                              cuda::AttentionBlockShape::kManyTokens);
    const std::vector<bf16> split_parallel =
        run.Run(f, Items(c.len, {1}, 1), cuda::AttentionBlockShape::kOneToken, true);
    const size_t bytes = decode.size() * 2;
    EXPECT_EQ(0, std::memcmp(decode.data(), split_parallel.data(), bytes))
        << "hd " << c.hd << " split " << c.split << ": split-parallel decode";
    EXPECT_EQ(0, std::memcmp(decode.data(), prefill.data(), bytes))
        << "hd " << c.hd << " split " << c.split;
    EXPECT_EQ(0, std::memcmp(decode.data(), chunked.data(), bytes))
        << "hd " << c.hd << " split " << c.split;
    // Not vacuous: every output was written.
    for (size_t i = 0; i < decode.size(); ++i) {
      ASSERT_TRUE(std::isfinite(__bfloat162float(decode[i]))) << i;
    }

    // The tensor-core kernel: its own bits, the same on every path.
    const std::vector<bf16> mma_decode =
        run.RunMma(f, Items(c.len, {1}, 1), cuda::AttentionBlockShape::kOneToken);
    const std::vector<bf16> mma_prefill =
        run.RunMma(f, Items(c.len, {max_item}, max_item), cuda::AttentionBlockShape::kManyTokens);
    const std::vector<bf16> mma_chunked = run.RunMma(
        f, Items(c.len, {3, 1, max_item, 7, 2}, max_item), cuda::AttentionBlockShape::kManyTokens);
    EXPECT_EQ(0, std::memcmp(mma_decode.data(), mma_prefill.data(), bytes))
        << "tensor cores, hd " << c.hd << " split " << c.split;
    EXPECT_EQ(0, std::memcmp(mma_decode.data(), mma_chunked.data(), bytes))
        << "tensor cores, hd " << c.hd << " split " << c.split;
    // Prefill blocks folding their splits in-block (no partials, no merge): the same bits.
    const std::vector<bf16> mma_fold = run.RunMma(f, Items(c.len, {max_item}, max_item),
                                                  cuda::AttentionBlockShape::kManyTokens, true);
    const std::vector<bf16> mma_fold_chunked =
        run.RunMma(f, Items(c.len, {3, 1, max_item, 7, 2}, max_item),
                   cuda::AttentionBlockShape::kManyTokens, true);
    EXPECT_EQ(0, std::memcmp(mma_decode.data(), mma_fold.data(), bytes))
        << "tensor cores, folded, hd " << c.hd << " split " << c.split;
    EXPECT_EQ(0, std::memcmp(mma_decode.data(), mma_fold_chunked.data(), bytes))
        << "tensor cores, folded and chunked, hd " << c.hd << " split " << c.split;
    for (size_t i = 0; i < mma_decode.size(); ++i) {
      ASSERT_TRUE(std::isfinite(__bfloat162float(mma_decode[i]))) << i;
    }
    // Close to the SIMT kernel (different roundings, same math).
    EXPECT_TRUE(AllClose(gpu_test::Widen(mma_decode), gpu_test::Widen(decode), 1e-2f, 1.0f / 32));
  }
}

// Prefix sharing (ops.h, AttentionShareTokens): decode tokens over the same pages, planned by the
// runner's own PlanShares, give bitwise the outputs of every token computing its own splits --
// with the GQA groups of Qwen3-8B (4: four tokens a block), Qwen3-30B-A3B (8: two) and 32 (two,
// in the four-warp blocks kOneToken runs for groups above 16), and tokens that share all of the
// prompt's whole splits, fewer of them, or none.
TEST_F(KernelsTest, DecodeTokensSharingPagesGiveTheBitsOfTokensAlone) {
  struct Case {
    int32_t nh, nkv, hd, bs, split;
  };
  for (const Case& c : std::vector<Case>{
           {32, 8, 128, 32, 256}, {32, 4, 128, 32, 256}, {8, 2, 32, 16, 64}, {64, 2, 64, 32, 32}}) {
    // Seven sequences: 0-5 over one prompt of 768 keys (sequence 5 only its first 512, then
    // pages of its own), 6 of its own pages. Decode positions past and at the prompt's end.
    const std::vector<int32_t> lengths = {1000, 1001, 769, 1300, 1000, 900, 800};
    AttentionFixture f(c.nh, c.nkv, c.hd, c.bs, c.split, lengths);
    for (int s = 1; s <= 5; ++s) {
      const int32_t shared_keys = s == 5 ? 512 : 768;
      for (int32_t j = 0; j < shared_keys / c.bs; ++j) f.tables[s][j] = f.tables[0][j];
    }
    ForwardBatch batch;
    AttentionRun run;
    for (int s = 0; s < static_cast<int>(lengths.size()); ++s) {
      batch.token_ids.push_back(1);
      batch.positions.push_back(lengths[s] - 1);
      batch.token_seq.push_back(s);
      batch.block_tables.push_back(f.tables[s]);
      batch.logit_rows.push_back(s);
      run.token_seq.push_back(s);
      run.positions.push_back(lengths[s] - 1);
    }
    const int64_t t = run.positions.size();
    run.q = gpu_test::RandomFloats(t * c.nh * c.hd, 5, 1.0f);
    cuda_runner_internal::SlicePlanOptions o;
    o.kv_block_size = c.bs;
    o.attention_split_size = c.split;
    o.share_tokens = cuda::AttentionShareTokens(c.nh / c.nkv);
    const cuda_runner_internal::SlicePlan plan =
        cuda_runner_internal::PlanSlice(batch, 0, t, o, /*may_replay_graph=*/false);
    // Not vacuous: some lead computes several tokens' rows over shared splits.
    int leads = 0;
    for (size_t i = 0; i < plan.shares.size(); i += 4) leads += plan.shares[i + 2] > 1;
    ASSERT_GT(leads, 0) << "group " << c.nh / c.nkv;

    const std::vector<bf16> alone =
        run.RunMma(f, plan.items_one, cuda::AttentionBlockShape::kOneToken);
    const std::vector<bf16> shared =
        run.RunMma(f, plan.items_one, cuda::AttentionBlockShape::kOneToken, /*fold=*/false,
                   plan.shares, plan.share_tokens);
    EXPECT_EQ(0, std::memcmp(alone.data(), shared.data(), alone.size() * 2))
        << "group " << c.nh / c.nkv << " split " << c.split;
    for (size_t i = 0; i < shared.size(); ++i) {
      ASSERT_TRUE(std::isfinite(__bfloat162float(shared[i]))) << i;
    }
  }
}

// The fused residual add + RMSNorm kernels give bitwise what the two launches they replace give:
// x after the add and the normed rows, for every tree width, rows past the norm's register cache
// (dim 8192 = 2 x 4096), a row that ends inside a thread's float4s (2052) and a row count that is
// not a power of two.
TEST_F(KernelsTest, FusedResidualAddAndRmsNormEqualTheTwoLaunches) {
  auto bits_equal = [](const cuda::DeviceBuffer& a, const cuda::DeviceBuffer& b, size_t bytes) {
    return Download<uint8_t>(a, bytes) == Download<uint8_t>(b, bytes);
  };
  int checked = 0;
  for (int64_t dim : {2048, 2052, 4096, 8192}) {
    std::vector<float> weight = gpu_test::RandomFloats(dim, 7, 0.1f);
    for (float& w : weight) w += 1.0f;
    auto d_w = Upload(weight);
    for (int64_t rows : {1, 37}) {
      const std::vector<float> x0 = gpu_test::RandomFloats(rows * dim, 3 + rows, 2.0f);
      for (int parts : {1, 2, 4, 8}) {
        // The leaves sit a stride apart that is larger than the rows (the runner's workspace).
        const int64_t stride = rows * dim + 64;
        auto d_parts = Upload(gpu_test::RandomFloats(parts * stride, 11 + parts, 1.0f));
        auto x_ref = Upload(x0), x_got = Upload(x0);
        cuda::DeviceBuffer y_ref, y_got;
        ASSERT_CUDA_OK(y_ref.Allocate(rows * dim * 2));
        ASSERT_CUDA_OK(y_got.Allocate(rows * dim * 2));
        ASSERT_CUDA_OK(cuda::SumTree(d_parts.get<float>(), parts, stride, rows * dim,
                                     x_ref.get<float>(), /*accumulate=*/true, nullptr));
        ASSERT_CUDA_OK(cuda::RmsNorm(x_ref.get<float>(), nullptr, rows, dim, d_w.get<float>(),
                                     1e-6f, y_ref.get<bf16>(), nullptr));
        ASSERT_CUDA_OK(cuda::SumTreeRmsNorm(d_parts.get<float>(), parts, stride, rows, dim,
                                            x_got.get<float>(), d_w.get<float>(), 1e-6f,
                                            y_got.get<bf16>(), nullptr));
        ASSERT_CUDA_OK(cudaDeviceSynchronize());
        EXPECT_TRUE(bits_equal(x_ref, x_got, rows * dim * 4)) << dim << " " << rows << " " << parts;
        EXPECT_TRUE(bits_equal(y_ref, y_got, rows * dim * 2)) << dim << " " << rows << " " << parts;
        // Not vacuous: the add moved x.
        EXPECT_NE(Download<float>(x_got, 1)[0], x0[0]);
        ++checked;
      }
      // The MoE combine: 4 expert rows a token, each token's at scrambled slots.
      const int32_t top_k = 4;
      const int64_t assignments = rows * top_k;
      std::vector<int32_t> slots(assignments);
      std::iota(slots.begin(), slots.end(), 0);
      std::mt19937 rng(5);
      std::shuffle(slots.begin(), slots.end(), rng);
      auto d_slots = Upload(slots);
      auto d_gates = Upload(gpu_test::RandomFloats(assignments, 17, 0.5f));
      auto d_y = Upload(gpu_test::RandomFloats(assignments * dim, 19, 1.0f));
      auto x_ref = Upload(x0), x_got = Upload(x0);
      cuda::DeviceBuffer y_ref, y_got;
      ASSERT_CUDA_OK(y_ref.Allocate(rows * dim * 2));
      ASSERT_CUDA_OK(y_got.Allocate(rows * dim * 2));
      ASSERT_CUDA_OK(cuda::MoeCombine(d_y.get<float>(), d_slots.get<int32_t>(),
                                      d_gates.get<float>(), rows, top_k, dim, x_ref.get<float>(),
                                      nullptr));
      ASSERT_CUDA_OK(cuda::RmsNorm(x_ref.get<float>(), nullptr, rows, dim, d_w.get<float>(), 1e-6f,
                                   y_ref.get<bf16>(), nullptr));
      ASSERT_CUDA_OK(cuda::MoeCombineRmsNorm(d_y.get<float>(), d_slots.get<int32_t>(),
                                             d_gates.get<float>(), rows, top_k, dim,
                                             x_got.get<float>(), d_w.get<float>(), 1e-6f,
                                             y_got.get<bf16>(), nullptr));
      ASSERT_CUDA_OK(cudaDeviceSynchronize());
      EXPECT_TRUE(bits_equal(x_ref, x_got, rows * dim * 4)) << "moe " << dim << " " << rows;
      EXPECT_TRUE(bits_equal(y_ref, y_got, rows * dim * 2)) << "moe " << dim << " " << rows;
      EXPECT_NE(Download<float>(x_got, 1)[0], x0[0]);
      ++checked;
    }
  }
  EXPECT_EQ(checked, 4 * 2 * 5);
  // Refused before launch: a tree width the tree does not have, a stride shorter than the rows.
  cuda::DeviceBuffer buf;
  ASSERT_CUDA_OK(buf.Allocate(8 * 4096 * 4));
  EXPECT_EQ(cudaErrorInvalidValue,
            cuda::SumTreeRmsNorm(buf.get<float>(), 3, 4096, 1, 4096, buf.get<float>(),
                                 buf.get<float>(), 1e-6f, buf.get<bf16>(), nullptr));
  EXPECT_EQ(cudaErrorInvalidValue,
            cuda::SumTreeRmsNorm(buf.get<float>(), 2, 1024, 1, 4096, buf.get<float>(),
                                 buf.get<float>(), 1e-6f, buf.get<bf16>(), nullptr));
}

TEST_F(KernelsTest, CountDifferentWordsCounts) {
  std::vector<uint32_t> a(1000, 7), b = a;
  b[3] = 8;
  b[999] = 9;
  auto d_a = Upload(a), d_b = Upload(b);
  cuda::DeviceBuffer d_count;
  ASSERT_CUDA_OK(d_count.Allocate(8));
  ASSERT_CUDA_OK(cuda::CountDifferentWords(d_a.get(), d_b.get(), 4000,
                                           d_count.get<unsigned long long>(), nullptr));
  EXPECT_EQ(2u, Download<unsigned long long>(d_count, 1)[0]);
}

}  // namespace
}  // namespace rollout
