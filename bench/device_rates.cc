#include "bench/device_rates.h"

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "bench/check_cuda.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/event_timer.h"

namespace rollout::bench {

double MeasureCopyBandwidth() {
  const size_t bytes = size_t{4} << 30;
  cuda::DeviceBuffer a, b;
  CHECK_CUDA(a.Allocate(bytes));
  CHECK_CUDA(b.Allocate(bytes));
  CHECK_CUDA(cudaMemset(a.get(), 1, bytes));
  const double ms = cuda::MeanMilliseconds(
      [&] { cudaMemcpyAsync(b.get(), a.get(), bytes, cudaMemcpyDeviceToDevice); }, /*reps=*/10,
      /*warmups=*/2);
  return 2.0 * bytes / (ms * 1e-3);
}

double MeasurePeerBandwidth(int dst, int src) {
  const size_t bytes = size_t{1} << 30;
  int can = 0;
  CHECK_CUDA(cudaDeviceCanAccessPeer(&can, dst, src));
  cuda::DeviceBuffer a, b;
  CHECK_CUDA(cudaSetDevice(src));
  CHECK_CUDA(a.Allocate(bytes));
  CHECK_CUDA(cudaMemset(a.get(), 1, bytes));
  CHECK_CUDA(cudaSetDevice(dst));
  if (can) cudaDeviceEnablePeerAccess(src, 0);  // already enabled is fine
  cudaGetLastError();
  CHECK_CUDA(b.Allocate(bytes));
  const double ms = cuda::MeanMilliseconds(
      [&] { cudaMemcpyPeerAsync(b.get(), dst, a.get(), src, bytes); }, /*reps=*/10,
      /*warmups=*/2);
  CHECK_CUDA(cudaSetDevice(0));
  return bytes / (ms * 1e-3);
}

double MeasureGemmFlops() {
  const int64_t n = 8192;
  cuda::DeviceBuffer a, b, c, ws;
  CHECK_CUDA(a.Allocate(n * n * 2));
  CHECK_CUDA(b.Allocate(n * n * 2));
  CHECK_CUDA(c.Allocate(n * n * 2));
  CHECK_CUDA(ws.Allocate(64 << 20));
  // Random bits in [-1, 1)-ish bf16: fill bytes with a pattern that gives finite values.
  std::vector<uint16_t> host(n * n);
  std::mt19937 rng(1);
  for (auto& v : host) v = static_cast<uint16_t>(0x3c00 + (rng() % 0x300)) | ((rng() & 1) << 15);
  CHECK_CUDA(cudaMemcpy(a.get(), host.data(), n * n * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(b.get(), host.data(), n * n * 2, cudaMemcpyHostToDevice));
  cublasLtHandle_t lt;
  cublasLtCreate(&lt);
  cublasLtMatmulDesc_t desc;
  cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F);
  const cublasOperation_t t = CUBLAS_OP_T, nt = CUBLAS_OP_N;
  cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof(t));
  cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &nt, sizeof(nt));
  cublasLtMatrixLayout_t la, lb, lc;
  cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, n, n, n);
  cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, n, n, n);
  cublasLtMatrixLayoutCreate(&lc, CUDA_R_16BF, n, n, n);
  cublasLtMatmulPreference_t pref;
  cublasLtMatmulPreferenceCreate(&pref);
  const uint64_t wsb = 64 << 20;
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb,
                                       sizeof(wsb));
  cublasLtMatmulHeuristicResult_t result;
  int found = 0;
  cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, lc, lc, pref, 1, &result, &found);
  const float alpha = 1.0f, beta = 0.0f;
  auto run = [&] {
    cublasLtMatmul(lt, desc, &alpha, a.get(), la, b.get(), lb, &beta, c.get(), lc, c.get(), lc,
                   found > 0 ? &result.algo : nullptr, ws.get(), wsb, nullptr);
  };
  const double ms = cuda::MeanMilliseconds(run, /*reps=*/10, /*warmups=*/3);
  cublasLtMatmulPreferenceDestroy(pref);
  cublasLtMatrixLayoutDestroy(la);
  cublasLtMatrixLayoutDestroy(lb);
  cublasLtMatrixLayoutDestroy(lc);
  cublasLtMatmulDescDestroy(desc);
  cublasLtDestroy(lt);
  return 2.0 * n * n * n / (ms * 1e-3);
}


}  // namespace rollout::bench
