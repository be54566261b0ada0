// rollout-gemm-order-probe: which per-element K order does the pinned cuBLASLt algorithm
// compute? Compares, bitwise, the pin's fp32 output with hand-written tensor-core GEMMs of known
// order (mma.sync m16n8k16 walking K in steps of 16 from 0, one accumulator; and variants), on
// the Qwen3-8B shapes at decode-sized m. A hand-written kernel that matches can serve the pin's
// bits where cuBLASLt's small-m kernels leave bandwidth unused.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/mma_ptx.cuh"

namespace rollout {
namespace {

// Variant 0: acc += mma(k16) for k = 0, 16, 32, ... (one accumulator).
// Variant 1: per 64-wide K tile, a fresh accumulator, added to the running sum after the tile.
// Variant 2: two accumulators, even and odd k16 steps, summed at the end.
template <int kVariant>
__global__ void NaiveMma(const __nv_bfloat16* x, const __nv_bfloat16* w, float* y, int m, int n,
                         int k) {
  const int lane = threadIdx.x, g = lane / 4, t = lane % 4;
  const int n0 = blockIdx.x * 8, m0 = blockIdx.y * 16;
  auto xa = [&](int row, int col) -> uint32_t {
    if (m0 + row >= m) return 0u;
    return *reinterpret_cast<const uint32_t*>(x + static_cast<int64_t>(m0 + row) * k + col);
  };
  float acc[4] = {0, 0, 0, 0}, acc2[4] = {0, 0, 0, 0};
  for (int kk = 0; kk < k; kk += 16) {
    uint32_t a[4] = {xa(g, kk + 2 * t), xa(g + 8, kk + 2 * t), xa(g, kk + 2 * t + 8),
                     xa(g + 8, kk + 2 * t + 8)};
    const __nv_bfloat16* wr = w + static_cast<int64_t>(n0 + g) * k + kk;
    const uint32_t b0 = *reinterpret_cast<const uint32_t*>(wr + 2 * t);
    const uint32_t b1 = *reinterpret_cast<const uint32_t*>(wr + 2 * t + 8);
    if (kVariant == 0) {
      cuda::ptx::Mma16816(acc, a, b0, b1);
    } else if (kVariant == 1) {
      cuda::ptx::Mma16816(acc2, a, b0, b1);
      if ((kk + 16) % 64 == 0 || kk + 16 >= k) {
        for (int i = 0; i < 4; ++i) {
          acc[i] = __fadd_rn(acc[i], acc2[i]);
          acc2[i] = 0;
        }
      }
    } else {
      if ((kk / 16) % 2 == 0) {
        cuda::ptx::Mma16816(acc, a, b0, b1);
      } else {
        cuda::ptx::Mma16816(acc2, a, b0, b1);
      }
    }
  }
  if (kVariant == 2) {
    for (int i = 0; i < 4; ++i) acc[i] = __fadd_rn(acc[i], acc2[i]);
  }
  const int r0 = m0 + g, c0 = n0 + 2 * t;
  if (r0 < m) {
    y[static_cast<int64_t>(r0) * n + c0] = acc[0];
    y[static_cast<int64_t>(r0) * n + c0 + 1] = acc[1];
  }
  if (r0 + 8 < m) {
    y[static_cast<int64_t>(r0 + 8) * n + c0] = acc[2];
    y[static_cast<int64_t>(r0 + 8) * n + c0 + 1] = acc[3];
  }
}

void Check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

int Main() {
  cublasLtHandle_t lt;
  cublasLtCreate(&lt);
  struct Shape {
    const char* name;
    int64_t n, k;
  };
  const Shape shapes[] = {{"qkv", 6144, 4096}, {"o leaf", 4096, 512}, {"gate_up", 24576, 4096},
                          {"down leaf", 4096, 1536}, {"lm_head-ish", 8192, 4096}};
  const int ms[] = {1, 16, 47, 95, 256};
  std::mt19937_64 rng(1);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  int failures = 0;
  for (const Shape& s : shapes) {
    std::unique_ptr<cuda::PinnedGemm> pin;
    std::string why;
    if (cuda::PinnedGemm::Create(lt, s.n, s.k, cuda::GemmOutput::kF32, 256, &pin, &why) !=
        CUBLAS_STATUS_SUCCESS) {
      std::printf("%s: no pin: %s\n", s.name, why.c_str());
      return 1;
    }
    const int64_t max_m = 256;
    std::vector<__nv_bfloat16> hx(max_m * s.k), hw(s.n * s.k);
    for (auto& v : hx) v = __float2bfloat16(normal(rng));
    for (auto& v : hw) v = __float2bfloat16(normal(rng) * 0.05f);
    __nv_bfloat16 *dx, *dw;
    float *dref, *dy;
    Check(cudaMalloc(&dx, hx.size() * 2), "malloc");
    Check(cudaMalloc(&dw, hw.size() * 2), "malloc");
    Check(cudaMalloc(&dref, max_m * s.n * 4), "malloc");
    Check(cudaMalloc(&dy, max_m * s.n * 4), "malloc");
    cudaMemcpy(dx, hx.data(), hx.size() * 2, cudaMemcpyHostToDevice);
    cudaMemcpy(dw, hw.data(), hw.size() * 2, cudaMemcpyHostToDevice);
    for (int m : ms) {
      pin->Run(dx, m, dw, dref, nullptr);
      Check(cudaDeviceSynchronize(), "pin");
      std::vector<float> ref(m * s.n), got(m * s.n);
      cudaMemcpy(ref.data(), dref, ref.size() * 4, cudaMemcpyDeviceToHost);
      std::printf("%-12s n=%-6ld k=%-5ld m=%-4d", s.name, s.n, s.k, m);
      for (int v = 0; v < 3; ++v) {
        dim3 grid(s.n / 8, (m + 15) / 16);
        if (v == 0) NaiveMma<0><<<grid, 32>>>(dx, dw, dy, m, s.n, s.k);
        if (v == 1) NaiveMma<1><<<grid, 32>>>(dx, dw, dy, m, s.n, s.k);
        if (v == 2) NaiveMma<2><<<grid, 32>>>(dx, dw, dy, m, s.n, s.k);
        Check(cudaDeviceSynchronize(), "naive");
        cudaMemcpy(got.data(), dy, got.size() * 4, cudaMemcpyDeviceToHost);
        int64_t diff = 0;
        double maxrel = 0;
        for (size_t i = 0; i < ref.size(); ++i) {
          if (std::memcmp(&ref[i], &got[i], 4) != 0) {
            ++diff;
            maxrel = std::max(maxrel, std::abs(double(ref[i]) - got[i]) /
                                          (std::abs(double(ref[i])) + 1e-6));
          }
        }
        std::printf(" | v%d: %ld of %zu differ (max rel %.2e)", v, diff, ref.size(), maxrel);
        if (v == 0 && diff) ++failures;
      }
      std::printf("\n");
    }
    cudaFree(dx);
    cudaFree(dw);
    cudaFree(dref);
    cudaFree(dy);
  }
  std::printf("variant 0 (sequential k16 mma.sync) %s the pin\n",
              failures ? "DIFFERS from" : "EQUALS");
  return 0;
}

}  // namespace
}  // namespace rollout

int main() { return rollout::Main(); }
