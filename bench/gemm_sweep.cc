// rollout-gemm-sweep: how fast the pinned (split-K-free, one algorithm for every m) cuBLASLt
// GEMMs are on the Qwen3-8B weight shapes, per pinning choice, against cuBLASLt's unconstrained
// best for each m (its heuristic's first pick with a 64 MiB workspace, split-K allowed).
// Informs CudaRunnerOptions::gemm_pin_m.
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/ops.h"

namespace rollout {
namespace {

using cuda::GemmOutput;

struct Shape {
  const char* name;
  int64_t n, k;
  GemmOutput output;
};

constexpr int64_t kMs[] = {1, 8, 64, 256, 512, 1024, 4096, 8192};
constexpr int64_t kPins[] = {64, 256, 1024, 2048, 8192};

template <typename F>
double TimeMs(F run) {
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  run();
  run();
  const int reps = 5;
  cudaEventRecord(a);
  for (int i = 0; i < reps; ++i) run();
  cudaEventRecord(b);
  cudaEventSynchronize(b);
  float ms = 0;
  cudaEventElapsedTime(&ms, a, b);
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return ms / reps;
}

// cuBLASLt's first heuristic pick for this m with a workspace: the unconstrained reference.
double BestMs(cublasLtHandle_t lt, const Shape& s, int64_t m, const void* x, const void* w, void* y,
              void* ws, size_t ws_bytes) {
  cublasLtMatmulDesc_t desc;
  cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F);
  const cublasOperation_t t = CUBLAS_OP_T, n = CUBLAS_OP_N;
  cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof(t));
  cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &n, sizeof(n));
  const cudaDataType_t out = s.output == GemmOutput::kBf16 ? CUDA_R_16BF : CUDA_R_32F;
  cublasLtMatrixLayout_t la, lb, lc;
  cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, s.k, s.n, s.k);
  cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, s.k, m, s.k);
  cublasLtMatrixLayoutCreate(&lc, out, s.n, m, s.n);
  cublasLtMatmulPreference_t pref;
  cublasLtMatmulPreferenceCreate(&pref);
  const uint64_t wsb = ws_bytes;
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb,
                                       sizeof(wsb));
  cublasLtMatmulHeuristicResult_t r;
  int found = 0;
  cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, lc, lc, pref, 1, &r, &found);
  const float alpha = 1.0f;
  const float beta = s.output == GemmOutput::kF32Accumulate ? 1.0f : 0.0f;
  const double ms = found == 0 ? -1.0 : TimeMs([&] {
    cublasLtMatmul(lt, desc, &alpha, w, la, x, lb, &beta, y, lc, y, lc, &r.algo, ws, ws_bytes,
                   nullptr);
  });
  cublasLtMatmulPreferenceDestroy(pref);
  cublasLtMatrixLayoutDestroy(la);
  cublasLtMatrixLayoutDestroy(lb);
  cublasLtMatrixLayoutDestroy(lc);
  cublasLtMatmulDescDestroy(desc);
  return ms;
}

int Main() {
  const Shape shapes[] = {
      {"qkv", 6144, 4096, GemmOutput::kF32},
      {"o", 4096, 4096, GemmOutput::kF32Accumulate},
      {"gate_up", 24576, 4096, GemmOutput::kBf16},
      {"down", 4096, 12288, GemmOutput::kF32Accumulate},
      {"lm_head", 151936, 4096, GemmOutput::kF32},
  };
  cublasLtHandle_t lt;
  cublasLtCreate(&lt);
  cuda::DeviceBuffer x, w, y, ws;
  const size_t ws_bytes = 64 << 20;
  x.Allocate(8192ll * 12288 * 2);
  w.Allocate(151936ll * 4096 * 2);
  y.Allocate(8192ll * 151936 * 4);
  ws.Allocate(ws_bytes);
  cuda::FillRandomWeights(1, 1.0 / 37837.0, 0, 8192ll * 12288, x.get<cuda::bf16>(), nullptr, 0);
  cuda::FillRandomWeights(2, 1.0 / (37837.0 * 64), 0, 151936ll * 4096, w.get<cuda::bf16>(), nullptr,
                          0);
  cudaMemset(y.get(), 0, 8192ll * 151936 * 4);
  cudaDeviceSynchronize();

  for (const Shape& s : shapes) {
    std::printf("\n%s [n %ld, k %ld]: microseconds per GEMM (TFLOP/s)\n", s.name,
                static_cast<long>(s.n), static_cast<long>(s.k));
    std::printf("  %-22s", "m =");
    for (int64_t m : kMs) std::printf(" %14ld", static_cast<long>(m));
    std::printf("\n  %-22s", "cuBLASLt best (any)");
    for (int64_t m : kMs) {
      const double ms = BestMs(lt, s, m, x.get(), w.get(), y.get(), ws.get(), ws_bytes);
      std::printf(" %7.1f (%4.0f)", ms * 1e3, 2.0 * m * s.n * s.k / (ms * 1e-3) / 1e12);
    }
    std::printf("\n  %-22s", "no-workspace per m");
    {
      std::unique_ptr<cuda::PinnedGemm> g;
      cuda::PinnedGemm::CreateHeuristic(lt, s.n, s.k, s.output, &g);
      for (int64_t m : kMs) {
        const double ms =
            TimeMs([&] { g->Run(x.get<cuda::bf16>(), m, w.get<cuda::bf16>(), y.get(), nullptr); });
        std::printf(" %7.1f (%4.0f)", ms * 1e3, 2.0 * m * s.n * s.k / (ms * 1e-3) / 1e12);
      }
    }
    std::printf("\n");
    for (int64_t pin : kPins) {
      std::unique_ptr<cuda::PinnedGemm> g;
      std::string why;
      if (cuda::PinnedGemm::Create(lt, s.n, s.k, s.output, pin, &g, &why) !=
          CUBLAS_STATUS_SUCCESS) {
        std::printf("  pinned at m=%-10ld none:\n%s", static_cast<long>(pin), why.c_str());
        continue;
      }
      std::printf("  pinned at m=%-10ld", static_cast<long>(pin));
      for (int64_t m : kMs) {
        const double ms =
            TimeMs([&] { g->Run(x.get<cuda::bf16>(), m, w.get<cuda::bf16>(), y.get(), nullptr); });
        std::printf(" %7.1f (%4.0f)", ms * 1e3, 2.0 * m * s.n * s.k / (ms * 1e-3) / 1e12);
      }
      std::printf("   %s\n", g->Describe().c_str());
    }
    std::fflush(stdout);
  }
  cublasLtDestroy(lt);
  return 0;
}

}  // namespace
}  // namespace rollout

int main() { return rollout::Main(); }
