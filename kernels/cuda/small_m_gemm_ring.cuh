// The small-m GEMM kernels' shared pieces (small_m_gemm.cu: the cp.async and TMA kernels;
// small_m_gemm_wgmma.cu: the warpgroup kernel): the ring-stage layout, the output store, the
// TMA ring's barriers, a launch's arguments and tensor maps, and a configuration table entry.
// Internal to those two files.
#pragma once

#include <cstdint>
#include <vector>

#include <cuda.h>

#include "kernels/cuda/mma_ptx.cuh"
#include "kernels/cuda/small_m_gemm.h"
#include "kernels/cuda/tensor_map.h"

namespace rollout::cuda::small_m {

using bf16 = __nv_bfloat16;

// K elements per ring stage: one 128-byte row of eight 16-byte chunks per x row and w row.
// Chunk c of row r sits at chunk position c ^ (r % 8): the eight rows an ldmatrix phase reads
// (same c, consecutive r) land in eight different bank groups.
constexpr int kBk = 64;
static_assert(kBk == kTileMapBoxColumns, "a TMA box row is one ring-stage row");
constexpr int kChunks = kBk / 8;

__device__ __forceinline__ int Swizzled(int row, int chunk) {
  return row * kBk + ((chunk ^ (row & 7)) * 8);
}

// One output element: kBf16 y = bf16(acc) (round to nearest even), kF32 y = acc, kF32Accumulate
// y = acc + y (one rounding).
__device__ __forceinline__ void StoreElement(GemmOutput output, void* y, int64_t at, float v) {
  if (output == GemmOutput::kBf16) {
    static_cast<bf16*>(y)[at] = __float2bfloat16_rn(v);
  } else if (output == GemmOutput::kF32) {
    static_cast<float*>(y)[at] = v;
  } else {
    float* const p = static_cast<float*>(y) + at;
    *p = __fadd_rn(v, *p);
  }
}

// The ring of a TMA-fed kernel: full[s] completes when stage s has landed (one arrival, the
// producer's, with the stage's bytes), empty[s] when `consumers` arrivals say it was read.
__device__ __forceinline__ void InitRing(uint64_t* full, uint64_t* empty, int stages,
                                         uint32_t consumers) {
  for (int s = 0; s < stages; ++s) {
    ptx::MbarrierInit(&full[s], 1);
    ptx::MbarrierInit(&empty[s], consumers);
  }
  ptx::FenceMbarrierInit();
}

// The producer's turn at K tile kt: waits until stage kt % stages was released by every
// consumer of the tile before (from the second lap on), arms full[] for `tx` bytes and returns
// the stage.
__device__ __forceinline__ int ProduceStage(uint64_t* full, uint64_t* empty, int kt, int stages,
                                            uint32_t tx) {
  const int s = kt % stages;
  if (kt >= stages) ptx::MbarrierWait(&empty[s], ((kt / stages) - 1) & 1);
  ptx::MbarrierArriveExpectTx(&full[s], tx);
  return s;
}

struct Launch {
  const bf16* x;
  int64_t ldx, x_step;
  int m;
  const bf16* w;
  int64_t w_step;
  int n, k;
  void* y;
  int64_t y_step;
  int batch;
  GemmOutput output;
  cudaStream_t stream;
};

// The tensor maps of a launch's x (boxes of x_rows rows) and w (boxes of w_rows rows), and how
// a product b finds its x: x_b = x + b x_step is either the columns [b x_step, b x_step + k) of
// rows ldx apart (the canonical K tree's leaves: x_col_step) or a matrix x_step further (x_z).
struct TmaMaps {
  CUtensorMap x, w;
  int x_col_step = 0, x_z = 0;
};

inline cudaError_t EncodeLaunchMaps(const Launch& l, uint32_t x_rows, uint32_t w_rows,
                                     TmaMaps* maps) {
  uint64_t x_d0 = l.k, x_d2 = l.batch, x_stride2 = uint64_t(l.x_step) * 2;
  if (l.batch == 1 || (l.batch - 1) * l.x_step + l.k <= l.ldx) {
    maps->x_col_step = static_cast<int>(l.x_step);
    x_d0 = l.ldx, x_d2 = 1, x_stride2 = uint64_t(l.ldx) * l.m * 2;
  } else if (l.x_step >= l.ldx * l.m) {
    maps->x_z = 1;
  } else {
    return cudaErrorInvalidValue;
  }
  if (l.batch > 1 && l.w_step < int64_t{l.n} * l.k) return cudaErrorInvalidValue;
  if (!EncodeBf16TileMap(&maps->x, l.x, x_d0, l.m, x_d2, uint64_t(l.ldx) * 2, x_stride2, x_rows) ||
      !EncodeBf16TileMap(&maps->w, l.w, l.k, l.n, l.batch, uint64_t(l.k) * 2,
                         l.batch > 1 ? uint64_t(l.w_step) * 2 : uint64_t(l.n) * l.k * 2, w_rows)) {
    return cudaErrorInvalidValue;
  }
  return cudaSuccess;
}

struct Entry {
  SmallMGemmConfig config;
  cudaError_t (*launch)(const Launch&);
  cudaError_t (*prepare)();
  // The TMA kernel's: how many of its clusters can be resident at once (cudaOccupancyMax-
  // ActiveClusters at its shared memory), after prepare. nullptr for the others.
  cudaError_t (*resident_clusters)(int* clusters) = nullptr;
};

// The warpgroup kernel's configurations, in table order (small_m_gemm_wgmma.cu).
std::vector<Entry> WgmmaEntries();

}  // namespace rollout::cuda::small_m
