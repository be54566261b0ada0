#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <vector>

#include "kernels/cuda/gemm.h"

// A hand-written small-m GEMM with the pinned cuBLASLt GEMM's bits: y[m, n] = x[m, k] . w[n, k]^T,
// bf16 in, for decode-sized m (up to 256), where the pin's big split-K-free tiles leave most SMs
// idle (issue 16).
//
// The order that gives the pin's bits (bench/gemm_order_probe.cu, measured on the H200 for every
// Qwen3-8B shape at m = 1 .. 256): every output element is ONE fp32 accumulator, initialised to
// +0, into which mma.sync.m16n8k16 (A = x rows, B = w rows) adds the k16 chunks of K in
// increasing order, k = 0, 16, 32, ... Any tiling of m and n keeps that order; splitting K
// (across warps, CTAs, or two accumulators) does not. So: each CTA owns a slice of n (kn_tile
// columns) and ALL m rows, walks the full K, and streams its weight rows exactly once through a
// multi-stage cp.async ring (64 K elements a stage, XOR-swizzled 16-byte chunks read by
// ldmatrix); its warps split the rows and columns, never K. Epilogue: kBf16 y =
// __float2bfloat16_rn(acc); kF32 y = acc; kF32Accumulate y = acc + y (one rounding).
//
// Three kernels keep that order: the cp.async kernel above ("hand"), the same fed by the TMA
// with x multicast across a cluster ("tma"), and a warpgroup kernel ("wgmma": the k16 chunks as
// wgmma.mma_async m64nNk16 from TMA-filled shared memory, one m64 tile per consumer warpgroup),
// which at m >= 32 is not bound by mma.sync's issue rate.
//
// Whether the bits really are the pin's on a given GPU / cuBLAS is not assumed: PinnedGemm's
// ladder admits a configuration only when its probe finds the pin's bits, and times it against
// the cuBLASLt rungs (gemm.h). tests/gpu/small_m_gemm_test.cc is the proof over m = 1 .. 256.
//
// SmallMGemm allocates nothing and never synchronises: capturable in a CUDA graph.
namespace rollout::cuda {

// One compiled tiling. max_m = 16 * (m tiles); warps_m x warps_n warps per CTA, each owning
// max_m / 16 / warps_m m16 tiles and n_tile / 8 / warps_n n8 tiles of the CTA's output.
struct SmallMGemmConfig {
  int n_tile;
  int max_m;
  int warps_m;
  int warps_n;
  int stages;  // ring depth (64 K elements each)
  // 0: the cp.async kernel. >= 1: the TMA kernel, x multicast across clusters of this many CTAs
  // (one producer warp beside the warps_m x warps_n consumers).
  int cluster;
  // >= 1: the wgmma kernel, this many consumer warpgroups of max_m / 64 / warpgroups m64 tiles
  // each, fed by a TMA producer warp (warps_m = warpgroups, warps_n = 1, cluster = 0).
  int warpgroups = 0;
  // The wgmma kernel only: at most one CTA an SM, each walking its tiles in turn through one
  // ring (the next tile's stages fill while this one's results are stored).
  bool persistent = false;
  // "hand n32 m16 w1x4 s8", "tma n48 m96 w2x3 s8 c2", "wgmma n128 m128 g2 s6", "... s6 p"
  std::string Name() const;
  // Dynamic shared memory per CTA.
  size_t SharedBytes() const;
};

// Every compiled configuration; SmallMGemm's `config` indexes this.
const std::vector<SmallMGemmConfig>& SmallMGemmConfigs();

// Opts configuration `config`'s kernel into its shared memory (SharedBytes()) on the current
// device. REQUIRES: called once per device before that device's first SmallMGemm of the
// configuration, outside graph capture (it waits for the runtime's pending copies); without it a
// configuration over 48 KB fails to launch (cudaErrorInvalidValue).
cudaError_t PrepareSmallMGemm(int config);

// The TMA kernel's configurations (cluster >= 1): how many of its clusters the device can hold
// at once at its shared memory (cudaOccupancyMaxActiveClusters), after PrepareSmallMGemm.
// cudaErrorNotSupported for the other kernels. For rollout-gemm-sweep: clusters of 2 and 4 ran
// about 2 and 4 times longer than one CTA alone (docs/benchmarks.md, session 27).
cudaError_t SmallMGemmResidentClusters(int config, int* clusters);

// `batch` products y_b = x_b . w_b^T, b = 0 .. batch - 1 (PinnedGemm::RunBatched's layout):
// x_b = x + b * x_step: [m, k] bf16, rows ldx elements apart; w_b = w + b * w_step: [n, k] bf16;
// y_b = y + b * y_step: [m, n] (bf16 for kBf16, else fp32), rows n apart. One launch; a product's
// bits do not depend on batch, m or the configuration.
// REQUIRES (else cudaErrorInvalidValue, nothing launched): config indexes SmallMGemmConfigs();
// 1 <= m <= its max_m; n >= 1; k >= 16 and a multiple of 16; ldx >= k and a multiple of 8; x and
// w 16-byte aligned, x_step and w_step multiples of 8; y 4-byte aligned; 1 <= batch <= 65535.
cudaError_t SmallMGemm(int config, const __nv_bfloat16* x, int64_t ldx, int64_t x_step, int64_t m,
                       const __nv_bfloat16* w, int64_t w_step, int64_t n, int64_t k, void* y,
                       int64_t y_step, int batch, GemmOutput output, cudaStream_t stream);

}  // namespace rollout::cuda
