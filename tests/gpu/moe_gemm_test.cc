// The grouped expert GEMM (kernels/cuda/moe_gemm.cu) in every block shape against version 1,
// bitwise, on Qwen3-30B-A3B's expert shapes (128 experts, top-8, hidden 2048, expert width 768)
// for token counts 1..8192 (sampled): gate/up with the row gather and bf16 output, down without
// and fp32. Routings uniform and concentrated (a third of the tokens on experts 0..7), so experts
// get many row counts and their last tiles every kind of tail. Faster block shapes may only
// change speed, never a bit (docs/determinism.md).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda/compare.h"
#include "kernels/cuda/moe.h"
#include "kernels/cuda/ops.h"
#include "tests/gpu/gpu_test_util.h"

namespace rollout {
namespace {

using cuda::bf16;

class MoeGemmVersionsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!gpu_test::HaveGpu()) GTEST_SKIP() << "no CUDA device";
  }
};

// Every block shape of MoeExpertGemm: (tile rows, tile columns).
struct BlockShape {
  int32_t tile_rows, tile_columns;
};
constexpr BlockShape kBlockShapes[] = {{cuda::kMoeTileRows, 0},
                                       {cuda::kMoeTileRowsLarge, 0},
                                       {cuda::kMoeTileRowsXLarge, 0},
                                       {cuda::kMoeTileRowsXLarge, cuda::kMoeTileColumnsWide}};

// ids [t_count, k]: distinct experts per token, uniform; when concentrated, tokens t % 3 == 0
// take experts 0..k-1 (in a shuffled order) instead.
std::vector<int32_t> Routing(int64_t t_count, int e_count, int k, bool concentrated,
                             uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> ids(t_count * k), all(e_count);
  for (int64_t t = 0; t < t_count; ++t) {
    std::iota(all.begin(), all.end(), 0);
    if (concentrated && t % 3 == 0) {
      std::shuffle(all.begin(), all.begin() + k, rng);
    } else {
      std::shuffle(all.begin(), all.end(), rng);
    }
    std::copy(all.begin(), all.begin() + k, ids.begin() + t * k);
  }
  return ids;
}

TEST_F(MoeGemmVersionsTest, EveryBlockShapeEqualsVersion1BitwiseOnQwen3MoeShapes) {
  constexpr int kExperts = 128, kTopK = 8;
  constexpr int64_t kHidden = 2048, kInter = 768;
  const std::vector<int64_t> counts = {1,   2,   3,    5,    8,    13,   31,   64,   100, 257,
                                       512, 777, 1024, 1500, 2048, 3001, 4096, 6007, 8192};
  const int64_t max_t = 8192, max_a = max_t * kTopK;
  cuda::DeviceBuffer xn, act, w_gate_up, w_down, ids, reference_ints, grouping_ints, y_reference, y;
  ASSERT_CUDA_OK(xn.Allocate(max_t * kHidden * 2));
  ASSERT_CUDA_OK(act.Allocate(max_a * kInter * 2));
  ASSERT_CUDA_OK(w_gate_up.Allocate(int64_t{kExperts} * 2 * kInter * kHidden * 2));
  ASSERT_CUDA_OK(w_down.Allocate(int64_t{kExperts} * kHidden * kInter * 2));
  ASSERT_CUDA_OK(ids.Allocate(max_a * 4));
  ASSERT_CUDA_OK(reference_ints.Allocate(cuda::MoeGroupingInts(kExperts, max_a) * 4));
  ASSERT_CUDA_OK(grouping_ints.Allocate(cuda::MoeGroupingInts(kExperts, max_a) * 4));
  const int64_t y_bytes = max_a * std::max(2 * kInter * 2, kHidden * 4);
  ASSERT_CUDA_OK(y_reference.Allocate(y_bytes));
  ASSERT_CUDA_OK(y.Allocate(y_bytes));
  ASSERT_CUDA_OK(
      cuda::FillRandomWeights(1, 1.0, 0, max_t * kHidden, xn.get<bf16>(), nullptr, nullptr));
  ASSERT_CUDA_OK(
      cuda::FillRandomWeights(2, 1.0, 0, max_a * kInter, act.get<bf16>(), nullptr, nullptr));
  ASSERT_CUDA_OK(cuda::FillRandomWeights(3, 1.0 / std::sqrt(double(kHidden)), 0,
                                         int64_t{kExperts} * 2 * kInter * kHidden,
                                         w_gate_up.get<bf16>(), nullptr, nullptr));
  ASSERT_CUDA_OK(cuda::FillRandomWeights(4, 1.0 / std::sqrt(double(kInter)), 0,
                                         int64_t{kExperts} * kHidden * kInter, w_down.get<bf16>(),
                                         nullptr, nullptr));
  int compared = 0;
  for (int64_t t_count : counts) {
    for (bool concentrated : {false, true}) {
      const int64_t a = t_count * kTopK;
      const std::vector<int32_t> host_ids =
          Routing(t_count, kExperts, kTopK, concentrated, static_cast<uint32_t>(t_count));
      ASSERT_EQ(cudaSuccess, cudaMemcpy(ids.get(), host_ids.data(), a * 4, cudaMemcpyHostToDevice));
      const cuda::MoeGrouping reference =
          cuda::MoeGroupingIn(reference_ints.get<int32_t>(), kExperts, a);
      const cuda::MoeGrouping grouping =
          cuda::MoeGroupingIn(grouping_ints.get<int32_t>(), kExperts, a);
      ASSERT_CUDA_OK(cuda::MoeGroup(ids.get<int32_t>(), t_count, kExperts, kTopK,
                                    cuda::kMoeTileRows, reference, nullptr));
      for (bool gate_up : {true, false}) {
        cuda::MoeGemmParams p;
        p.x = gate_up ? xn.get<bf16>() : act.get<bf16>();
        p.rows = gate_up ? reference.rows : nullptr;
        p.assignments = a;
        p.w = gate_up ? w_gate_up.get<bf16>() : w_down.get<bf16>();
        p.expert_stride = gate_up ? 2 * kInter * kHidden : kHidden * kInter;
        p.n = gate_up ? 2 * kInter : kHidden;
        p.k = gate_up ? kHidden : kInter;
        p.expert_offsets = reference.expert_offsets;
        p.tile_offsets = reference.tile_offsets;
        p.num_experts = kExperts;
        p.output = gate_up ? cuda::MoeGemmOutput::kBf16 : cuda::MoeGemmOutput::kF32;
        p.tile_rows = cuda::kMoeTileRows;
        const int64_t bytes = a * p.n * (gate_up ? 2 : 4);
        ASSERT_CUDA_OK(cudaMemset(y_reference.get(), 0xff, bytes));
        p.y = y_reference.get();
        ASSERT_CUDA_OK(cuda::MoeExpertGemmV1(p, nullptr));
        for (const BlockShape shape : kBlockShapes) {
          const int32_t tile_rows = shape.tile_rows;
          ASSERT_CUDA_OK(cuda::MoeGroup(ids.get<int32_t>(), t_count, kExperts, kTopK, tile_rows,
                                        grouping, nullptr));
          cuda::MoeGemmParams q = p;
          q.rows = gate_up ? grouping.rows : nullptr;
          q.expert_offsets = grouping.expert_offsets;
          q.tile_offsets = grouping.tile_offsets;
          q.tile_rows = tile_rows;
          q.tile_columns = shape.tile_columns;
          q.y = y.get();
          ASSERT_CUDA_OK(cudaMemset(y.get(), 0xff, bytes));
          ASSERT_CUDA_OK(cuda::MoeExpertGemm(q, nullptr));
          unsigned long long differing = 0;
          ASSERT_CUDA_OK(
              cuda::CountDifferentWordsOnHost(y_reference.get(), y.get(), bytes, &differing));
          EXPECT_EQ(0u, differing)
              << (gate_up ? "gate_up" : "down") << " T " << t_count
              << (concentrated ? " concentrated" : " uniform") << " tile rows " << tile_rows
              << " columns " << shape.tile_columns << ": words differing from version 1";
          ++compared;
        }
      }
    }
  }
  std::printf("[ moe gemm ] %d (token count, routing, projection, block shape) runs compared\n",
              compared);
}

// Shapes other than Qwen3's (few experts, K a multiple of 64 but not of 128, N an odd multiple
// of 256, one expert taking most rows): every block shape equals version 1 in both outputs, with
// and without the gather.
TEST_F(MoeGemmVersionsTest, EveryBlockShapeEqualsVersion1BitwiseOnOddShapes) {
  constexpr int kExperts = 5;
  constexpr int64_t kN = 768, kK = 448;
  for (int64_t t_count : {1, 7, 16, 17, 129, 700}) {
    std::vector<int32_t> host_ids(t_count);
    for (int64_t t = 0; t < t_count; ++t) {
      host_ids[t] = static_cast<int32_t>(t % 4 == 0 ? (t / 4) % kExperts : 2);
    }
    const cuda::DeviceBuffer ids = gpu_test::Upload(host_ids);
    std::vector<bf16> x, w;
    std::vector<float> unused;
    gpu_test::RandomBf16(t_count * kK, 20 + t_count, 1.0f, &x, &unused);
    gpu_test::RandomBf16(kExperts * kN * kK, 21, 0.05f, &w, &unused);
    const cuda::DeviceBuffer dx = gpu_test::Upload(x), dw = gpu_test::Upload(w);
    cuda::DeviceBuffer reference_ints, grouping_ints, y_reference, y;
    ASSERT_CUDA_OK(reference_ints.Allocate(cuda::MoeGroupingInts(kExperts, t_count) * 4));
    ASSERT_CUDA_OK(grouping_ints.Allocate(cuda::MoeGroupingInts(kExperts, t_count) * 4));
    ASSERT_CUDA_OK(y_reference.Allocate(t_count * kN * 4));
    ASSERT_CUDA_OK(y.Allocate(t_count * kN * 4));
    const cuda::MoeGrouping reference =
        cuda::MoeGroupingIn(reference_ints.get<int32_t>(), kExperts, t_count);
    const cuda::MoeGrouping grouping =
        cuda::MoeGroupingIn(grouping_ints.get<int32_t>(), kExperts, t_count);
    ASSERT_CUDA_OK(cuda::MoeGroup(ids.get<int32_t>(), t_count, kExperts, 1, cuda::kMoeTileRows,
                                  reference, nullptr));
    for (bool gather : {true, false}) {
      for (cuda::MoeGemmOutput out : {cuda::MoeGemmOutput::kBf16, cuda::MoeGemmOutput::kF32}) {
        cuda::MoeGemmParams p;
        p.x = dx.get<bf16>();
        p.rows = gather ? reference.rows : nullptr;
        p.assignments = t_count;
        p.w = dw.get<bf16>();
        p.expert_stride = kN * kK;
        p.n = kN;
        p.k = kK;
        p.expert_offsets = reference.expert_offsets;
        p.tile_offsets = reference.tile_offsets;
        p.num_experts = kExperts;
        p.output = out;
        p.tile_rows = cuda::kMoeTileRows;
        p.y = y_reference.get();
        const int64_t bytes = t_count * kN * (out == cuda::MoeGemmOutput::kBf16 ? 2 : 4);
        ASSERT_CUDA_OK(cudaMemset(y_reference.get(), 0xff, bytes));
        ASSERT_CUDA_OK(cuda::MoeExpertGemmV1(p, nullptr));
        for (const BlockShape shape : kBlockShapes) {
          const int32_t tile_rows = shape.tile_rows;
          ASSERT_CUDA_OK(cuda::MoeGroup(ids.get<int32_t>(), t_count, kExperts, 1, tile_rows,
                                        grouping, nullptr));
          cuda::MoeGemmParams q = p;
          q.rows = gather ? grouping.rows : nullptr;
          q.expert_offsets = grouping.expert_offsets;
          q.tile_offsets = grouping.tile_offsets;
          q.tile_rows = tile_rows;
          q.tile_columns = shape.tile_columns;
          q.y = y.get();
          ASSERT_CUDA_OK(cudaMemset(y.get(), 0xff, bytes));
          ASSERT_CUDA_OK(cuda::MoeExpertGemm(q, nullptr));
          unsigned long long differing = 0;
          ASSERT_CUDA_OK(
              cuda::CountDifferentWordsOnHost(y_reference.get(), y.get(), bytes, &differing));
          EXPECT_EQ(0u, differing)
              << "T " << t_count << " gather " << gather
              << (out == cuda::MoeGemmOutput::kBf16 ? " bf16" : " f32") << " tile rows "
              << tile_rows << " columns " << shape.tile_columns;
        }
      }
    }
  }
}

// The block shapes' launch limits: a prefill shape refuses N not a multiple of its columns, the
// wide shape other tile rows; version 1 refuses the shapes it does not have.
TEST_F(MoeGemmVersionsTest, ShapesRefuseWhatTheyCannotTile) {
  cuda::DeviceBuffer buf;
  ASSERT_CUDA_OK(buf.Allocate(1 << 20));
  cuda::MoeGemmParams gp;
  gp.x = buf.get<bf16>();
  gp.w = buf.get<bf16>();
  gp.y = buf.get();
  gp.assignments = 1;
  gp.num_experts = 1;
  gp.expert_offsets = buf.get<int32_t>();
  gp.tile_offsets = buf.get<int32_t>();
  gp.n = 192;
  gp.k = 128;
  for (int32_t tile_rows : {cuda::kMoeTileRowsLarge, cuda::kMoeTileRowsXLarge, 48}) {
    gp.tile_rows = tile_rows;
    EXPECT_EQ(cudaErrorInvalidValue, cuda::MoeExpertGemm(gp, nullptr)) << tile_rows;
  }
  gp.n = 384;  // a multiple of 128, not of 256
  gp.tile_rows = cuda::kMoeTileRowsXLarge;
  gp.tile_columns = cuda::kMoeTileColumnsWide;
  EXPECT_EQ(cudaErrorInvalidValue, cuda::MoeExpertGemm(gp, nullptr));
  gp.n = 256;
  gp.tile_rows = cuda::kMoeTileRowsLarge;  // the wide shape has 128-row tiles only
  EXPECT_EQ(cudaErrorInvalidValue, cuda::MoeExpertGemm(gp, nullptr));
  gp.tile_columns = 128;
  EXPECT_EQ(cudaErrorInvalidValue, cuda::MoeExpertGemm(gp, nullptr));
  gp.tile_columns = 0;
  gp.tile_rows = cuda::kMoeTileRowsXLarge;
  EXPECT_EQ(cudaErrorInvalidValue, cuda::MoeExpertGemmV1(gp, nullptr));
  gp.tile_rows = cuda::kMoeTileRows;
  gp.tile_columns = cuda::kMoeTileColumnsWide;
  EXPECT_EQ(cudaErrorInvalidValue, cuda::MoeExpertGemmV1(gp, nullptr));
  cudaGetLastError();
}

}  // namespace
}  // namespace rollout
