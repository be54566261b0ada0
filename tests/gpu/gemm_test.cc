// Row invariance of the pinned cuBLASLt GEMMs on every Qwen3-8B weight shape: the first m rows
// of y = x . w^T computed with m rows are bitwise the rows computed with 16384 rows (the cuda
// backend's default step budget; 8192 for the per-m heuristic, the fallback), for m = 1..512
// exhaustively and larger m up to 16383. Also the canonical K tree's leaf GEMMs (o_proj and
// down_proj in eight K segments, the server's default), batched as the runner runs them.
#include "kernels/cuda/gemm.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda/compare.h"
#include "kernels/cuda/ops.h"
#include "runner/cuda/cuda_model_runner.h"
#include "tests/gpu/gpu_test_util.h"

namespace rollout {
namespace {

using cuda::bf16;
using cuda::GemmOutput;

struct Shape {
  const char* name;
  int64_t n, k;
  GemmOutput output;
  // > 1: the canonical K tree's leaves, `leaves` products [m, k] x [n, k]^T over the column
  // blocks of one [m, leaves * k] input, run by RunBatched as the runner runs them.
  int leaves = 1;
};

// The shapes and output kinds CudaModelRunner uses for Qwen3-8B, and the MoE router GEMM.
const Shape kQwen3_8bShapes[] = {
    {"qkv", 6144, 4096, GemmOutput::kF32},       {"o", 4096, 4096, GemmOutput::kF32Accumulate},
    {"gate_up", 24576, 4096, GemmOutput::kBf16}, {"down", 4096, 12288, GemmOutput::kF32Accumulate},
    {"lm_head", 151936, 4096, GemmOutput::kF32},
    // Qwen3-30B-A3B's router (128 experts over hidden 2048): routing reads its fp32 rows.
    {"moe_router", 128, 2048, GemmOutput::kF32},
};

// The leaves of o_proj and down_proj under the canonical K tree (the server's default,
// --tp_invariant): eight K / 8 segments each. Pinned only (the tree requires pinned GEMMs).
const Shape kQwen3_8bLeafShapes[] = {
    {"o_leaf", 4096, 512, GemmOutput::kF32, 8},
    {"down_leaf", 4096, 1536, GemmOutput::kF32, 8},
};
constexpr int64_t kLeafPinChoices[] = {256, 2048, -256};

std::vector<int64_t> RowCounts(int64_t max_m) {
  std::vector<int64_t> ms;
  for (int64_t m = 1; m <= 512; ++m) ms.push_back(m);
  for (int64_t m :
       {640, 768, 1000, 1024, 1536, 2048, 3000, 4096, 5000, 6144, 8191, 8192, 12288, 16383}) {
    if (m < max_m) ms.push_back(m);
  }
  return ms;
}

// 0: the no-workspace heuristic per m (the fallback); else the m an algorithm is pinned at;
// negative: pinned at -m with the ladder (PinnedGemm::BuildLadder), the runner's default.
// The runner's default pin (CudaRunnerOptions::gemm_pin_m) must be among these.
constexpr int64_t kPinChoices[] = {0, 256, 2048, -256};

class GemmTest
    : public gpu_test::CublasLtTest<::testing::TestWithParam<std::tuple<Shape, int64_t>>> {};

TEST_P(GemmTest, EveryRowIsBitwiseIndependentOfM) {
  const Shape s = std::get<0>(GetParam());
  const int64_t pin_m = std::get<1>(GetParam());
  const int64_t max_m = pin_m == 0 ? 8192 : 16384;
  std::unique_ptr<cuda::PinnedGemm> gemm;
  std::string why;
  if (pin_m == 0) {
    ASSERT_EQ(CUBLAS_STATUS_SUCCESS,
              cuda::PinnedGemm::CreateHeuristic(lt_, s.n, s.k, s.output, &gemm));
  } else {
    ASSERT_EQ(
        CUBLAS_STATUS_SUCCESS,
        cuda::PinnedGemm::Create(lt_, s.n, s.k, s.output, std::abs(pin_m), &gemm, &why, s.leaves))
        << why;
  }
  if (pin_m < 0) {
    std::string ladder;
    ASSERT_EQ(CUBLAS_STATUS_SUCCESS, gemm->BuildLadder(&ladder));
    std::printf("%s", ladder.c_str());
    // On the H200 every range gets a rung; elsewhere a ladder may be short, never empty here
    // (else this case would only repeat the pinned one).
    EXPECT_GT(gemm->rungs(), 0) << ladder;
  }
  std::printf("[ gemm     ] %-8s n=%-6ld k=%-6ld pin_m=%ld %s\n", s.name, static_cast<long>(s.n),
              static_cast<long>(s.k), static_cast<long>(pin_m), gemm->Describe().c_str());

  const int64_t out_bytes = s.output == GemmOutput::kBf16 ? 2 : 4;
  const int64_t k_in = s.k * s.leaves;  // the input's row: every leaf's segment
  cuda::DeviceBuffer x, w, base, ref, y, count;
  ASSERT_CUDA_OK(x.Allocate(max_m * k_in * 2));
  ASSERT_CUDA_OK(w.Allocate(s.leaves * s.n * s.k * 2));
  ASSERT_CUDA_OK(base.Allocate(max_m * s.n * 4));
  ASSERT_CUDA_OK(ref.Allocate(s.leaves * max_m * s.n * out_bytes));
  ASSERT_CUDA_OK(y.Allocate(s.leaves * max_m * s.n * out_bytes));
  ASSERT_CUDA_OK(count.Allocate(8));
  ASSERT_CUDA_OK(
      cuda::FillRandomWeights(1, 1.0 / 37837.0, 0, max_m * k_in, x.get<bf16>(), nullptr, nullptr));
  ASSERT_CUDA_OK(cuda::FillRandomWeights(2, 1.0 / (37837.0 * std::sqrt(double(s.k))), 0,
                                         s.leaves * s.n * s.k, w.get<bf16>(), nullptr, nullptr));
  // The accumulating GEMMs add into a residual: start every run from the same values.
  ASSERT_CUDA_OK(cuda::FillRandomWeights(3, 1.0 / 37837.0, 0, max_m * s.n, nullptr,
                                         base.get<float>(), nullptr));
  auto reset = [&](void* dst, int64_t m) {
    return s.output == GemmOutput::kF32Accumulate
               ? cudaMemcpy(dst, base.get(), m * s.n * 4, cudaMemcpyDeviceToDevice)
               : cudaMemset(dst, 0, s.leaves * m * s.n * out_bytes);
  };
  // m rows of every leaf; leaf b's output at dst + b * m * n (the runner's packing).
  auto run = [&](int64_t m, void* dst) {
    if (s.leaves == 1) return gemm->Run(x.get<bf16>(), m, w.get<bf16>(), dst, 0);
    return gemm->RunBatched(x.get<bf16>(), k_in, s.k, m, w.get<bf16>(), s.n * s.k, dst, m * s.n,
                            s.leaves, 0);
  };
  ASSERT_CUDA_OK(reset(ref.get(), max_m));
  ASSERT_EQ(CUBLAS_STATUS_SUCCESS, run(max_m, ref.get()));

  std::vector<int64_t> bad;
  for (int64_t m : RowCounts(max_m)) {
    ASSERT_CUDA_OK(reset(y.get(), m));
    ASSERT_EQ(CUBLAS_STATUS_SUCCESS, run(m, y.get()));
    unsigned long long differ = 0;
    for (int b = 0; b < s.leaves; ++b) {
      const int64_t leaf_bytes = m * s.n * out_bytes;
      ASSERT_CUDA_OK(
          cuda::CountDifferentWords(static_cast<char*>(y.get()) + b * leaf_bytes,
                                    static_cast<char*>(ref.get()) + b * max_m * s.n * out_bytes,
                                    leaf_bytes, count.get<unsigned long long>(), 0));
      unsigned long long leaf_differ = 0;
      ASSERT_CUDA_OK(cudaMemcpy(&leaf_differ, count.get(), 8, cudaMemcpyDeviceToHost));
      differ += leaf_differ;
    }
    if (differ != 0) bad.push_back(m);
  }
  std::printf("[ checked  ] %-8s %zu row counts, %zu differ%s\n", s.name, RowCounts(max_m).size(),
              bad.size(), bad.empty() ? "" : " (first listed below)");
  EXPECT_TRUE(bad.empty()) << s.name << ": rows differ from the m = " << max_m
                           << " result at m = " << (bad.empty() ? 0 : bad.front()) << " ("
                           << bad.size() << " row counts in all)";

  // Not vacuous: the reference holds real, finite numbers.
  std::vector<float> head(64);
  if (s.output == GemmOutput::kBf16) {
    std::vector<bf16> h(64);
    ASSERT_CUDA_OK(cudaMemcpy(h.data(), ref.get(), 128, cudaMemcpyDeviceToHost));
    head = gpu_test::Widen(h);
  } else {
    ASSERT_CUDA_OK(cudaMemcpy(head.data(), ref.get(), 256, cudaMemcpyDeviceToHost));
  }
  double sum_sq = 0.0;
  for (float v : head) sum_sq += double(v) * v;
  EXPECT_TRUE(std::isfinite(sum_sq) && sum_sq > 0.0);
}

std::string CaseName(const ::testing::TestParamInfo<std::tuple<Shape, int64_t>>& info) {
  const int64_t pin = std::get<1>(info.param);
  return std::string(std::get<0>(info.param).name) + (pin == 0 ? "_heuristic"
                                                      : pin < 0
                                                          ? "_ladder_at_" + std::to_string(-pin)
                                                          : "_pinned_at_" + std::to_string(pin));
}

INSTANTIATE_TEST_SUITE_P(Qwen3_8b, GemmTest,
                         ::testing::Combine(::testing::ValuesIn(kQwen3_8bShapes),
                                            ::testing::ValuesIn(kPinChoices)),
                         CaseName);
INSTANTIATE_TEST_SUITE_P(Qwen3_8bLeaves, GemmTest,
                         ::testing::Combine(::testing::ValuesIn(kQwen3_8bLeafShapes),
                                            ::testing::ValuesIn(kLeafPinChoices)),
                         CaseName);

}  // namespace
}  // namespace rollout
