// The hand-written small-m GEMM (kernels/cuda/small_m_gemm.h) against the pinned cuBLASLt GEMM,
// bitwise: every configuration at every m it serves (1 .. 256), on every weight shape the CUDA
// runner pins for Qwen3-8B and Qwen3-30B-A3B (and the canonical K tree's batched leaves), for
// every output kind. The ladder admits a configuration on a probe at three m; this is the proof
// over all of them. Plus the launcher's refusals of what it does not support.
#include "kernels/cuda/small_m_gemm.h"

#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda/compare.h"
#include "kernels/cuda/ops.h"
#include "tests/gpu/gpu_test_util.h"

namespace rollout {
namespace {

using cuda::bf16;
using cuda::GemmOutput;

struct Shape {
  const char* name;
  int64_t n, k;
  int leaves;  // > 1: RunBatched over `leaves` column blocks of one [m, leaves * k] input
};

const Shape kShapes[] = {
    {"qkv", 6144, 4096, 1},
    {"o", 4096, 4096, 1},
    {"gate_up", 24576, 4096, 1},
    {"down", 4096, 12288, 1},
    {"lm_head", 151936, 4096, 1},
    // lm_head's rows at TP 8 (151936 / 8 = 18992: not a multiple of any n tile).
    {"lm_head_tp8", 18992, 4096, 1},
    // Qwen3-30B-A3B: the router (128 experts over hidden 2048) and the attention input.
    {"moe_router", 128, 2048, 1},
    {"moe_qkv", 5120, 2048, 1},
    // n not a multiple of 16, k not of 64 (the last K stage holds one k16 chunk).
    {"odd", 1000, 1040, 1},
    // The canonical K tree's leaves of o_proj and down_proj: eight K / 8 segments.
    {"o_leaf", 4096, 512, 8},
    {"down_leaf", 4096, 1536, 8},
};
const GemmOutput kOutputs[] = {GemmOutput::kBf16, GemmOutput::kF32, GemmOutput::kF32Accumulate};
constexpr int64_t kMaxM = 256;

const char* OutputName(GemmOutput o) {
  return o == GemmOutput::kBf16 ? "bf16" : o == GemmOutput::kF32 ? "f32" : "f32_accumulate";
}

class SmallMGemmTest
    : public gpu_test::CublasLtTest<::testing::TestWithParam<std::tuple<Shape, GemmOutput>>> {};

TEST_P(SmallMGemmTest, EveryConfigurationGivesThePinsBitsForEveryM) {
  const Shape s = std::get<0>(GetParam());
  const GemmOutput output = std::get<1>(GetParam());
  std::unique_ptr<cuda::PinnedGemm> pin;
  std::string why;
  ASSERT_EQ(CUBLAS_STATUS_SUCCESS,
            cuda::PinnedGemm::Create(lt_, s.n, s.k, output, 256, &pin, &why, s.leaves))
      << why;
  const int64_t out_bytes = output == GemmOutput::kBf16 ? 2 : 4;
  const int64_t k_in = s.k * s.leaves;
  const int64_t out_size = s.leaves * kMaxM * s.n * out_bytes;
  cuda::DeviceBuffer x, w, base, ref, got, count;
  ASSERT_CUDA_OK(x.Allocate(kMaxM * k_in * 2));
  ASSERT_CUDA_OK(w.Allocate(s.leaves * s.n * s.k * 2));
  ASSERT_CUDA_OK(base.Allocate(s.leaves * kMaxM * s.n * 4));
  ASSERT_CUDA_OK(ref.Allocate(out_size));
  ASSERT_CUDA_OK(got.Allocate(out_size));
  ASSERT_CUDA_OK(count.Allocate(8));
  ASSERT_CUDA_OK(cuda::FillRandomWeights(11, 1.0, 0, kMaxM * k_in, x.get<bf16>(), nullptr, 0));
  ASSERT_CUDA_OK(cuda::FillRandomWeights(12, 1.0 / std::sqrt(double(s.k)), 0, s.leaves * s.n * s.k,
                                         w.get<bf16>(), nullptr, 0));
  // The accumulating output adds into a residual: every run starts from the same values.
  ASSERT_CUDA_OK(
      cuda::FillRandomWeights(13, 1.0, 0, s.leaves * kMaxM * s.n, nullptr, base.get<float>(), 0));
  auto reset = [&](void* dst, int64_t m) {
    return output == GemmOutput::kF32Accumulate
               ? cudaMemcpy(dst, base.get(), s.leaves * m * s.n * 4, cudaMemcpyDeviceToDevice)
               : cudaMemset(dst, 0, s.leaves * m * s.n * out_bytes);
  };
  const std::vector<cuda::SmallMGemmConfig>& configs = cuda::SmallMGemmConfigs();
  for (int c = 0; c < static_cast<int>(configs.size()); ++c) {
    ASSERT_EQ(cudaSuccess, cuda::PrepareSmallMGemm(c)) << configs[c].Name();
  }
  std::vector<std::string> bad;
  int64_t checked = 0;
  for (int64_t m = 1; m <= kMaxM; ++m) {
    ASSERT_CUDA_OK(reset(ref.get(), m));
    ASSERT_EQ(CUBLAS_STATUS_SUCCESS, pin->RunBatched(x.get<bf16>(), k_in, s.k, m, w.get<bf16>(),
                                                     s.n * s.k, ref.get(), m * s.n, s.leaves, 0));
    for (int c = 0; c < static_cast<int>(configs.size()); ++c) {
      if (configs[c].max_m < m) continue;
      ASSERT_CUDA_OK(reset(got.get(), m));
      ASSERT_CUDA_OK(cuda::SmallMGemm(c, x.get<bf16>(), k_in, s.k, m, w.get<bf16>(), s.n * s.k, s.n,
                                      s.k, got.get(), m * s.n, s.leaves, output, 0));
      ASSERT_CUDA_OK(cuda::CountDifferentWords(got.get(), ref.get(), s.leaves * m * s.n * out_bytes,
                                               count.get<unsigned long long>(), 0));
      unsigned long long differ = 0;
      ASSERT_CUDA_OK(cudaMemcpy(&differ, count.get(), 8, cudaMemcpyDeviceToHost));
      ++checked;
      if (differ != 0) {
        bad.push_back(configs[c].Name() + " m=" + std::to_string(m) + " (" +
                      std::to_string(differ) + " words)");
      }
    }
  }
  std::printf("[ checked  ] %-11s %-14s %ld (configuration, m) pairs, %zu differ\n", s.name,
              OutputName(output), static_cast<long>(checked), bad.size());
  for (size_t i = 0; i < bad.size() && i < 8; ++i) std::printf("  differs: %s\n", bad[i].c_str());
  EXPECT_TRUE(bad.empty()) << s.name << " " << OutputName(output) << ": " << bad.size()
                           << " (configuration, m) pairs differ from the pin, first "
                           << (bad.empty() ? "" : bad.front());

  // Not vacuous: the reference (m = 256, every leaf) holds real, finite, nonzero numbers.
  std::vector<float> head(64);
  if (output == GemmOutput::kBf16) {
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

std::string CaseName(const ::testing::TestParamInfo<std::tuple<Shape, GemmOutput>>& info) {
  return std::string(std::get<0>(info.param).name) + "_" + OutputName(std::get<1>(info.param));
}

INSTANTIATE_TEST_SUITE_P(Shapes, SmallMGemmTest,
                         ::testing::Combine(::testing::ValuesIn(kShapes),
                                            ::testing::ValuesIn(kOutputs)),
                         CaseName);

// What the launcher does not support is refused before anything runs: cudaErrorInvalidValue,
// the output untouched (the ladder then never offers the rung).
TEST(SmallMGemmRefusalTest, UnsupportedShapesAndLayoutsLaunchNothing) {
  if (!gpu_test::HaveGpu()) GTEST_SKIP() << "no CUDA device";
  const int64_t n = 64, k = 64, m = 4;
  cuda::DeviceBuffer x, w, y;
  ASSERT_CUDA_OK(x.Allocate(2 * m * 2 * k * 2));
  ASSERT_CUDA_OK(w.Allocate(2 * n * k * 2));
  ASSERT_CUDA_OK(y.Allocate(2 * m * n * 4));
  ASSERT_CUDA_OK(cudaMemset(x.get(), 0x3f, 2 * m * 2 * k * 2));
  ASSERT_CUDA_OK(cudaMemset(w.get(), 0x3f, 2 * n * k * 2));
  ASSERT_CUDA_OK(cudaMemset(y.get(), 0x5a, 2 * m * n * 4));
  const bf16* xp = x.get<bf16>();
  const bf16* wp = w.get<bf16>();
  const int configs = static_cast<int>(cuda::SmallMGemmConfigs().size());
  ASSERT_CUDA_OK(cuda::PrepareSmallMGemm(0));
  EXPECT_EQ(cudaErrorInvalidValue, cuda::PrepareSmallMGemm(configs));
  struct Case {
    const char* what;
    int config;
    const bf16* x;
    int64_t ldx, m, n, k;
    int batch;
  };
  const Case cases[] = {
      {"config out of range", configs, xp, k, m, n, k, 1},
      {"negative config", -1, xp, k, m, n, k, 1},
      {"m = 0", 0, xp, k, 0, n, k, 1},
      {"m above the configuration's max_m", 0, xp, k, 17, n, k, 1},
      {"k not a multiple of 16", 0, xp, k, m, n, 56, 1},
      {"ldx < k", 0, xp, k - 8, m, n, k, 1},
      {"ldx not a multiple of 8", 0, xp, k + 4, m, n, k, 1},
      {"x not 16-byte aligned", 0, xp + 4, k, m, n, k, 1},
      {"n = 0", 0, xp, k, m, 0, k, 1},
      {"batch = 0", 0, xp, k, m, n, k, 0},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(cudaErrorInvalidValue, cuda::SmallMGemm(c.config, c.x, c.ldx, 0, c.m, wp, 0, c.n, c.k,
                                                      y.get(), 0, c.batch, GemmOutput::kF32, 0))
        << c.what;
  }
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  std::vector<uint32_t> host(2 * m * n);
  ASSERT_CUDA_OK(cudaMemcpy(host.data(), y.get(), host.size() * 4, cudaMemcpyDeviceToHost));
  for (uint32_t v : host) ASSERT_EQ(v, 0x5a5a5a5au) << "a refused call wrote the output";
  // Control: the same buffers with a supported call do write it.
  ASSERT_CUDA_OK(cuda::SmallMGemm(0, xp, k, 0, m, wp, 0, n, k, y.get(), 0, 1, GemmOutput::kF32, 0));
  ASSERT_CUDA_OK(cudaMemcpy(host.data(), y.get(), host.size() * 4, cudaMemcpyDeviceToHost));
  EXPECT_NE(host[0], 0x5a5a5a5au);
}

}  // namespace
}  // namespace rollout
