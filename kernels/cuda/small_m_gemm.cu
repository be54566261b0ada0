#include "kernels/cuda/small_m_gemm.h"

#include <algorithm>
#include <climits>
#include <cstdio>

#include <cuda.h>

#include "kernels/cuda/mma_ptx.cuh"
#include "kernels/cuda/small_m_gemm_ring.cuh"
#include "kernels/cuda/tensor_map.h"

namespace rollout::cuda {
namespace small_m {
namespace {

// One CTA: output columns [n0, n0 + kNTile) of product blockIdx.y, every row of m, the whole K.
// Stage s of the ring (dynamic shared memory): x tile [16 * kMTiles rows][kBk], then w tile
// [kNTile rows][kBk], both swizzled. Warp (wm, wn) owns m16 tiles wm * kMw .. + kMw - 1 and n8
// tiles wn * kNw .. + kNw - 1; one fp32 accumulator per output element, k16 chunks in order.
template <int kNTile, int kMTiles, int kWarpsM, int kWarpsN, int kStages>
__global__ void __launch_bounds__(32 * kWarpsM * kWarpsN)
    SmallMGemmKernel(const bf16* __restrict__ x, int64_t ldx, int64_t x_step, int m,
                     const bf16* __restrict__ w, int64_t w_step, int n, int k, void* y,
                     int64_t y_step, GemmOutput output) {
  constexpr int kThreads = 32 * kWarpsM * kWarpsN;
  constexpr int kMw = kMTiles / kWarpsM;
  constexpr int kNw = kNTile / 8 / kWarpsN;
  static_assert(kMTiles % kWarpsM == 0 && (kNTile / 8) % kWarpsN == 0, "warp grid");
  static_assert(kStages >= 2, "a ring needs two stages");
  constexpr int kXRows = 16 * kMTiles;
  constexpr int kStageElems = (kXRows + kNTile) * kBk;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  bf16* const smem = reinterpret_cast<bf16*>(smem_raw);

  const int64_t b = blockIdx.y;
  x += b * x_step;
  w += b * w_step;
  const int n0 = blockIdx.x * kNTile;
  const int m_tiles = (m + 15) / 16;  // m16 tiles holding a live row
  const int x_rows = 16 * m_tiles;    // rows staged; those >= m are zero-filled, not read
  const int k_tiles = (k + kBk - 1) / kBk;

  // Tile kt of K into ring stage `stage`. A 16-byte chunk lies wholly inside or outside K (k is a
  // multiple of 16); outside ones, and rows past m or n, are zero-filled.
  auto load_stage = [&](int stage, int kt) {
    bf16* const xs = smem + stage * kStageElems;
    bf16* const ws = xs + kXRows * kBk;
    const int k0 = kt * kBk;
    for (int i = threadIdx.x; i < x_rows * kChunks; i += kThreads) {
      const int row = i / kChunks, chunk = i % kChunks, col = k0 + chunk * 8;
      const bool valid = row < m && col < k;
      ptx::CpAsync16(xs + Swizzled(row, chunk), valid ? x + row * ldx + col : x, valid);
    }
    for (int i = threadIdx.x; i < kNTile * kChunks; i += kThreads) {
      const int row = i / kChunks, chunk = i % kChunks, col = k0 + chunk * 8;
      const bool valid = n0 + row < n && col < k;
      ptx::CpAsync16(ws + Swizzled(row, chunk),
                     valid ? w + static_cast<int64_t>(n0 + row) * k + col : w, valid);
    }
  };

  // One commit group per K tile (empty past the end), so that "tile kt has landed" is
  // "at most kStages - 2 groups pending" at iteration kt.
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < k_tiles) load_stage(s, s);
    ptx::CpAsyncCommit();
  }

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int wm = warp / kWarpsN, wn = warp % kWarpsN;
  const bool warp_live = wm * kMw < m_tiles;
  float acc[kMw][kNw][4];
#pragma unroll
  for (int i = 0; i < kMw; ++i) {
#pragma unroll
    for (int j = 0; j < kNw; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;
    }
  }

  for (int kt = 0; kt < k_tiles; ++kt) {
    ptx::CpAsyncWait<kStages - 2>();
    // Tile kt is visible to every thread, and every thread is done with stage (kt - 1) % kStages,
    // which the prefetch below overwrites.
    __syncthreads();
    const int next = kt + kStages - 1;
    if (next < k_tiles) load_stage(next % kStages, next);
    ptx::CpAsyncCommit();

    if (!warp_live) continue;
    const bf16* const xs = smem + (kt % kStages) * kStageElems;
    const bf16* const ws = xs + kXRows * kBk;
    const int k0 = kt * kBk;
#pragma unroll
    for (int kk = 0; kk < kBk / 16; ++kk) {
      if (k0 + 16 * kk >= k) break;  // past K: no instruction at all, not an add of zeros
      uint32_t a[kMw][4];
#pragma unroll
      for (int i = 0; i < kMw; ++i) {
        // Matrices 0..3 of ldmatrix.x4: rows +0 / +8, k chunk 2 kk / 2 kk + 1 (a0 a1 a2 a3).
        const int row = 16 * (wm * kMw + i) + (lane & 7) + ((lane >> 3) & 1) * 8;
        if (wm * kMw + i < m_tiles) ptx::LdMatrixX4(a[i], xs + Swizzled(row, 2 * kk + (lane >> 4)));
      }
      uint32_t bfrag[kNw][2];
#pragma unroll
      for (int j = 0; j < kNw; ++j) {
        const int row = 8 * (wn * kNw + j) + (lane & 7);
        ptx::LdMatrixX2(&bfrag[j][0], &bfrag[j][1], ws + Swizzled(row, 2 * kk + ((lane >> 3) & 1)));
      }
#pragma unroll
      for (int i = 0; i < kMw; ++i) {
        if (wm * kMw + i >= m_tiles) continue;
#pragma unroll
        for (int j = 0; j < kNw; ++j) ptx::Mma16816(acc[i][j], a[i], bfrag[j][0], bfrag[j][1]);
      }
    }
  }
  ptx::CpAsyncWait<0>();  // no copy may outlive the CTA's shared memory

  if (!warp_live) return;
  // Accumulator e of an m16n8 tile: row g + 8 (e / 2), column 2 t + e % 2 (g = lane / 4,
  // t = lane % 4).
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int i = 0; i < kMw; ++i) {
#pragma unroll
    for (int j = 0; j < kNw; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = 16 * (wm * kMw + i) + g + 8 * (e / 2);
        const int col = n0 + 8 * (wn * kNw + j) + 2 * t + e % 2;
        if (row >= m || col >= n) continue;
        const int64_t at = b * y_step + static_cast<int64_t>(row) * n + col;
        const float v = acc[i][j][e];
        StoreElement(output, y, at, v);
      }
    }
  }
}

// The multicast kernel: the same per-element order (one fp32 accumulator, k16 chunks of K in
// increasing order through the same mma.sync), fed by the TMA instead of cp.async, for the cost
// the cp.async kernel could not get under: every CTA reads all of x (m rows x K) from L2 beside
// its own n_tile weight rows, m / n_tile bytes of x per byte of weights, so at decode's m the L2
// reads, not the DRAM, bound it. Here a cluster of kCluster CTAs (consecutive n tiles) shares
// each stage of x: CTA r of the cluster loads rows [r R, r R + R) of the stage (R = 16 ceil(m
// tiles / kCluster)) and the TMA multicasts them into every CTA of the cluster, so L2 serves x
// once per cluster. Weights: one TMA tile a stage per CTA (rows past n zero-filled).
//
// Pipeline: warp kConsumers (one lane) produces, the kWarpsM x kWarpsN consumer warps compute.
// full[s] (one arrival: the producer's, with the stage's byte count) completes when the stage's
// x slices from every cluster CTA and this CTA's weight tile have landed; empty[s] (one arrival
// per consumer warp of every cluster CTA) completes when every CTA that stage s's multicast
// writes into has finished reading it, and only then does this CTA's producer overwrite it.
// Tiles are 64 K elements = 128 bytes a row, swizzled by the TMA's 128-byte pattern (16-byte
// chunk c of row r at c ^ (r % 8): the pattern Swizzled() reads, from 1024-byte aligned tiles).
template <int kNTile, int kMTiles, int kWarpsM, int kWarpsN, int kStages, int kCluster>
struct TmaShape {
  static constexpr int kConsumers = kWarpsM * kWarpsN;
  static constexpr int kThreads = 32 * (kConsumers + 1);
  static constexpr int kSliceTiles = (kMTiles + kCluster - 1) / kCluster;  // most m16 tiles a slice
  static constexpr int kXRows = 16 * kSliceTiles * kCluster;               // x rows staged
  static constexpr int kStageBytes = (kXRows + kNTile) * kBk * 2;
  static constexpr size_t kSmem = size_t{kStages} * kStageBytes + 2 * kStages * 8 + 1024;
  static_assert(kNTile <= 256 && 16 * kSliceTiles <= 256, "a TMA box holds at most 256 rows");
  static_assert((kNTile * kBk * 2) % 1024 == 0, "weight tiles keep the 1024-byte alignment");
};

template <int kNTile, int kMTiles, int kWarpsM, int kWarpsN, int kStages, int kCluster>
__global__ void __launch_bounds__(TmaShape<kNTile, kMTiles, kWarpsM, kWarpsN, kStages,
                                           kCluster>::kThreads)
    SmallMGemmTmaKernel(const __grid_constant__ CUtensorMap x_map,
                        const __grid_constant__ CUtensorMap w_map, int x_col_step, int x_z, int m,
                        int n, int k, void* y, int64_t y_step, GemmOutput output) {
  using Shape = TmaShape<kNTile, kMTiles, kWarpsM, kWarpsN, kStages, kCluster>;
  constexpr int kConsumers = Shape::kConsumers;
  constexpr int kMw = kMTiles / kWarpsM;
  constexpr int kNw = kNTile / 8 / kWarpsN;
  static_assert(kMTiles % kWarpsM == 0 && (kNTile / 8) % kWarpsN == 0, "warp grid");
  extern __shared__ unsigned char smem_raw[];
  unsigned char* const smem = reinterpret_cast<unsigned char*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  uint64_t* const full = reinterpret_cast<uint64_t*>(smem + kStages * Shape::kStageBytes);
  uint64_t* const empty = full + kStages;

  const int b = blockIdx.y;
  const int n0 = blockIdx.x * kNTile;
  const int m_tiles = (m + 15) / 16;
  const int slice_rows = 16 * ((m_tiles + kCluster - 1) / kCluster);
  const uint32_t rank = kCluster > 1 ? ptx::ClusterCtaRank() : 0;
  // Cluster CTAs whose slice holds a row load one; the others' share is past m.
  const int slices = (16 * m_tiles + slice_rows - 1) / slice_rows;
  const uint32_t stage_tx = static_cast<uint32_t>((slices * slice_rows + kNTile) * kBk * 2);
  const int k_tiles = (k + kBk - 1) / kBk;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  if (threadIdx.x == 0) InitRing(full, empty, kStages, kCluster * kConsumers);
  if (kCluster > 1) {
    ptx::ClusterSync();  // every CTA's barriers exist before any multicast or remote arrival
  } else {
    __syncthreads();
  }

  if (warp == kConsumers) {
    if (lane == 0) {
      ptx::PrefetchTensorMap(&x_map);
      ptx::PrefetchTensorMap(&w_map);
      for (int kt = 0; kt < k_tiles; ++kt) {
        const int s = ProduceStage(full, empty, kt, kStages, stage_tx);
        unsigned char* const xs = smem + s * Shape::kStageBytes;
        unsigned char* const ws = xs + Shape::kXRows * kBk * 2;
        const int row0 = static_cast<int>(rank) * slice_rows;
        if (row0 < 16 * m_tiles) {
          const int col = b * x_col_step + kt * kBk;
          unsigned char* const dst = xs + row0 * kBk * 2;
          if (kCluster > 1) {
            ptx::TmaLoad3dMulticast(dst, &x_map, col, row0, b * x_z, &full[s],
                                    static_cast<uint16_t>((1u << kCluster) - 1));
          } else {
            ptx::TmaLoad3d(dst, &x_map, col, row0, b * x_z, &full[s]);
          }
        }
        ptx::TmaLoad3d(ws, &w_map, kt * kBk, n0, b, &full[s]);
      }
    }
  } else {
    const int wm = warp / kWarpsN, wn = warp % kWarpsN;
    const bool warp_live = wm * kMw < m_tiles;
    float acc[kMw][kNw][4];
#pragma unroll
    for (int i = 0; i < kMw; ++i) {
#pragma unroll
      for (int j = 0; j < kNw; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;
      }
    }
    for (int kt = 0; kt < k_tiles; ++kt) {
      const int s = kt % kStages;
      ptx::MbarrierWait(&full[s], (kt / kStages) & 1);
      if (warp_live) {
        const bf16* const xs = reinterpret_cast<const bf16*>(smem + s * Shape::kStageBytes);
        const bf16* const ws = xs + Shape::kXRows * kBk;
        const int k0 = kt * kBk;
#pragma unroll
        for (int kk = 0; kk < kBk / 16; ++kk) {
          if (k0 + 16 * kk >= k) break;  // past K: no instruction at all, not an add of zeros
          uint32_t a[kMw][4];
#pragma unroll
          for (int i = 0; i < kMw; ++i) {
            const int row = 16 * (wm * kMw + i) + (lane & 7) + ((lane >> 3) & 1) * 8;
            if (wm * kMw + i < m_tiles) {
              ptx::LdMatrixX4(a[i], xs + Swizzled(row, 2 * kk + (lane >> 4)));
            }
          }
          uint32_t bfrag[kNw][2];
#pragma unroll
          for (int j = 0; j < kNw; ++j) {
            const int row = 8 * (wn * kNw + j) + (lane & 7);
            ptx::LdMatrixX2(&bfrag[j][0], &bfrag[j][1],
                            ws + Swizzled(row, 2 * kk + ((lane >> 3) & 1)));
          }
#pragma unroll
          for (int i = 0; i < kMw; ++i) {
            if (wm * kMw + i >= m_tiles) continue;
#pragma unroll
            for (int j = 0; j < kNw; ++j) ptx::Mma16816(acc[i][j], a[i], bfrag[j][0], bfrag[j][1]);
          }
        }
      }
      __syncwarp();
      // This warp is done reading stage s: tell every CTA whose multicast writes into it.
      if (lane < kCluster) {
        if (kCluster > 1) {
          ptx::MbarrierArriveCluster(&empty[s], lane);
        } else {
          ptx::MbarrierArrive(&empty[s]);
        }
      }
    }
    if (warp_live) {
      const int g = lane / 4, t = lane % 4;
#pragma unroll
      for (int i = 0; i < kMw; ++i) {
#pragma unroll
        for (int j = 0; j < kNw; ++j) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int row = 16 * (wm * kMw + i) + g + 8 * (e / 2);
            const int col = n0 + 8 * (wn * kNw + j) + 2 * t + e % 2;
            if (row >= m || col >= n) continue;
            const int64_t at = b * y_step + static_cast<int64_t>(row) * n + col;
            const float v = acc[i][j][e];
            StoreElement(output, y, at, v);
          }
        }
      }
    }
  }
  // No CTA leaves while a peer may still arrive on its barriers.
  __syncwarp();
  if (kCluster > 1) ptx::ClusterSync();
}


template <int kNTile, int kMTiles, int kWarpsM, int kWarpsN, int kStages>
constexpr size_t kSmemBytes = size_t{kStages} * (16 * kMTiles + kNTile) * kBk * sizeof(bf16);

// The kernel's opt-in to more than 48 KB of dynamic shared memory. Once per device, at load:
// cudaFuncSetAttribute waits for the runtime's pending copies, so it stays out of the step.
template <int kNTile, int kMTiles, int kWarpsM, int kWarpsN, int kStages>
cudaError_t PrepareConfig() {
  constexpr size_t kSmem = kSmemBytes<kNTile, kMTiles, kWarpsM, kWarpsN, kStages>;
  if (kSmem <= 48 * 1024) return cudaSuccess;
  return cudaFuncSetAttribute(&SmallMGemmKernel<kNTile, kMTiles, kWarpsM, kWarpsN, kStages>,
                              cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
}

template <int kNTile, int kMTiles, int kWarpsM, int kWarpsN, int kStages>
cudaError_t LaunchConfig(const Launch& l) {
  constexpr size_t kSmem = kSmemBytes<kNTile, kMTiles, kWarpsM, kWarpsN, kStages>;
  auto* kernel = &SmallMGemmKernel<kNTile, kMTiles, kWarpsM, kWarpsN, kStages>;
  const dim3 grid((l.n + kNTile - 1) / kNTile, l.batch);
  kernel<<<grid, 32 * kWarpsM * kWarpsN, kSmem, l.stream>>>(
      l.x, l.ldx, l.x_step, l.m, l.w, l.w_step, l.n, l.k, l.y, l.y_step, l.output);
  return cudaGetLastError();
}


template <int kNTile, int kMTiles, int kWarpsM, int kWarpsN, int kStages, int kCluster>
cudaError_t PrepareTma() {
  using Shape = TmaShape<kNTile, kMTiles, kWarpsM, kWarpsN, kStages, kCluster>;
  if (!TensorMapsAvailable()) return cudaErrorNotSupported;
  return cudaFuncSetAttribute(
      &SmallMGemmTmaKernel<kNTile, kMTiles, kWarpsM, kWarpsN, kStages, kCluster>,
      cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(Shape::kSmem));
}


// The TMA kernel's launch: `grid` CTAs of `threads` threads and `smem` bytes of dynamic shared
// memory, in clusters of `cluster` along x (the attribute, which *attribute holds, is left out
// for clusters of 1).
inline cudaLaunchConfig_t TmaLaunchConfig(dim3 grid, int threads, size_t smem, int cluster,
                                          cudaStream_t stream, cudaLaunchAttribute* attribute) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  attribute->id = cudaLaunchAttributeClusterDimension;
  attribute->val.clusterDim.x = cluster;
  attribute->val.clusterDim.y = 1;
  attribute->val.clusterDim.z = 1;
  config.attrs = attribute;
  config.numAttrs = cluster > 1 ? 1 : 0;
  return config;
}

template <int kNTile, int kMTiles, int kWarpsM, int kWarpsN, int kStages, int kCluster>
cudaError_t ResidentTmaClusters(int* clusters) {
  using Shape = TmaShape<kNTile, kMTiles, kWarpsM, kWarpsN, kStages, kCluster>;
  cudaLaunchAttribute attribute;
  cudaLaunchConfig_t config =
      TmaLaunchConfig(dim3(kCluster), Shape::kThreads, Shape::kSmem, kCluster, nullptr, &attribute);
  config.numAttrs = 1;  // the occupancy API wants the cluster size, also a cluster of 1
  return cudaOccupancyMaxActiveClusters(
      clusters, &SmallMGemmTmaKernel<kNTile, kMTiles, kWarpsM, kWarpsN, kStages, kCluster>,
      &config);
}

template <int kNTile, int kMTiles, int kWarpsM, int kWarpsN, int kStages, int kCluster>
cudaError_t LaunchTma(const Launch& l) {
  using Shape = TmaShape<kNTile, kMTiles, kWarpsM, kWarpsN, kStages, kCluster>;
  const int m_tiles = (l.m + 15) / 16;
  const uint32_t slice_rows = 16 * ((m_tiles + kCluster - 1) / kCluster);
  TmaMaps maps;
  const cudaError_t err = EncodeLaunchMaps(l, slice_rows, kNTile, &maps);
  if (err != cudaSuccess) return err;
  const int n_tiles = (l.n + kNTile - 1) / kNTile;
  cudaLaunchAttribute attribute;
  const cudaLaunchConfig_t config =
      TmaLaunchConfig(dim3((n_tiles + kCluster - 1) / kCluster * kCluster, l.batch),
                      Shape::kThreads, Shape::kSmem, kCluster, l.stream, &attribute);
  return cudaLaunchKernelEx(
      &config, &SmallMGemmTmaKernel<kNTile, kMTiles, kWarpsM, kWarpsN, kStages, kCluster>, maps.x,
      maps.w, maps.x_col_step, maps.x_z, l.m, l.n, l.k, l.y, l.y_step, l.output);
}


#define ROLLOUT_SMALL_M_CONFIG(nt, mt, wm, wn, st)                                   \
  Entry {                                                                            \
    SmallMGemmConfig{nt, 16 * mt, wm, wn, st, 0}, &LaunchConfig<nt, mt, wm, wn, st>, \
        &PrepareConfig<nt, mt, wm, wn, st>                                           \
  }
#define ROLLOUT_SMALL_M_TMA(nt, mt, wm, wn, st, c)                                     \
  Entry {                                                                              \
    SmallMGemmConfig{nt, 16 * mt, wm, wn, st, c}, &LaunchTma<nt, mt, wm, wn, st, c>,   \
        &PrepareTma<nt, mt, wm, wn, st, c>, &ResidentTmaClusters<nt, mt, wm, wn, st, c> \
  }

// The tilings the ladder may choose from, by the m they serve. Small n tiles give many CTAs
// (qkv's 6144 columns make 384 CTAs of 16); large ones read each x tile for more columns (every
// CTA reads all of x from L2: m / n_tile bytes of x per byte of weights; the TMA kernels' clusters
// divide that by the cluster size).
std::vector<Entry> HandEntries() {
  return {
      ROLLOUT_SMALL_M_CONFIG(16, 1, 1, 2, 8),   ROLLOUT_SMALL_M_CONFIG(32, 1, 1, 4, 8),
      ROLLOUT_SMALL_M_CONFIG(64, 1, 1, 4, 6),   ROLLOUT_SMALL_M_CONFIG(32, 2, 1, 4, 6),
      ROLLOUT_SMALL_M_CONFIG(64, 2, 2, 4, 6),   ROLLOUT_SMALL_M_CONFIG(32, 3, 1, 4, 6),
      ROLLOUT_SMALL_M_CONFIG(64, 3, 1, 4, 4),   ROLLOUT_SMALL_M_CONFIG(32, 4, 2, 2, 4),
      ROLLOUT_SMALL_M_CONFIG(64, 4, 2, 4, 4),   ROLLOUT_SMALL_M_CONFIG(64, 6, 2, 2, 4),
      ROLLOUT_SMALL_M_CONFIG(128, 6, 2, 4, 3),  ROLLOUT_SMALL_M_CONFIG(64, 8, 4, 2, 4),
      ROLLOUT_SMALL_M_CONFIG(128, 8, 4, 2, 3),  ROLLOUT_SMALL_M_CONFIG(64, 16, 4, 2, 3),
      ROLLOUT_SMALL_M_CONFIG(128, 16, 8, 2, 3),
      // m <= 16
      ROLLOUT_SMALL_M_TMA(64, 1, 1, 4, 12, 1),  ROLLOUT_SMALL_M_TMA(128, 1, 1, 8, 10, 2),
      // m <= 32
      ROLLOUT_SMALL_M_TMA(64, 2, 1, 4, 10, 2),  ROLLOUT_SMALL_M_TMA(128, 2, 2, 4, 8, 2),
      // m <= 48
      ROLLOUT_SMALL_M_TMA(48, 3, 1, 3, 10, 2),  ROLLOUT_SMALL_M_TMA(96, 3, 1, 6, 8, 2),
      ROLLOUT_SMALL_M_TMA(128, 3, 1, 8, 6, 4),  ROLLOUT_SMALL_M_TMA(256, 3, 1, 8, 4, 4),
      // m <= 64
      ROLLOUT_SMALL_M_TMA(64, 4, 2, 2, 8, 2),   ROLLOUT_SMALL_M_TMA(128, 4, 2, 4, 6, 4),
      // m <= 96
      ROLLOUT_SMALL_M_TMA(48, 6, 2, 3, 8, 1),   ROLLOUT_SMALL_M_TMA(48, 6, 2, 3, 8, 2),
      ROLLOUT_SMALL_M_TMA(96, 6, 2, 4, 6, 2),   ROLLOUT_SMALL_M_TMA(128, 6, 2, 4, 6, 1),
      ROLLOUT_SMALL_M_TMA(128, 6, 2, 4, 6, 4),  ROLLOUT_SMALL_M_TMA(256, 6, 2, 8, 4, 4),
      // m <= 128
      ROLLOUT_SMALL_M_TMA(64, 8, 2, 4, 6, 2),   ROLLOUT_SMALL_M_TMA(128, 8, 2, 4, 5, 4),
      // m <= 256
      ROLLOUT_SMALL_M_TMA(64, 16, 4, 2, 4, 2),  ROLLOUT_SMALL_M_TMA(128, 16, 4, 4, 4, 4),
  };
}

#undef ROLLOUT_SMALL_M_TMA
#undef ROLLOUT_SMALL_M_CONFIG

// The table: the mma.sync kernels (cp.async, then TMA), then the warpgroup kernel's.
const std::vector<Entry>& Entries() {
  static const std::vector<Entry> entries = [] {
    std::vector<Entry> e = HandEntries();
    const std::vector<Entry> wgmma = WgmmaEntries();
    e.insert(e.end(), wgmma.begin(), wgmma.end());
    return e;
  }();
  return entries;
}

bool Aligned(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

}  // namespace
}  // namespace small_m

using small_m::Aligned;
using small_m::bf16;
using small_m::Entries;
using small_m::Entry;
using small_m::kBk;
using small_m::Launch;

std::string SmallMGemmConfig::Name() const {
  char buf[64];
  if (warpgroups > 0) {
    std::snprintf(buf, sizeof(buf), "wgmma n%d m%d g%d s%d%s", n_tile, max_m, warpgroups, stages,
                  persistent ? " p" : "");
  } else if (cluster == 0) {
    std::snprintf(buf, sizeof(buf), "hand n%d m%d w%dx%d s%d", n_tile, max_m, warps_m, warps_n,
                  stages);
  } else {
    std::snprintf(buf, sizeof(buf), "tma n%d m%d w%dx%d s%d c%d", n_tile, max_m, warps_m, warps_n,
                  stages, cluster);
  }
  return buf;
}

size_t SmallMGemmConfig::SharedBytes() const {
  if (warpgroups > 0) {
    return static_cast<size_t>(stages) * (max_m + n_tile) * kBk * sizeof(bf16) +
           16 * static_cast<size_t>(stages) + 1024;
  }
  if (cluster == 0) return static_cast<size_t>(stages) * (max_m + n_tile) * kBk * sizeof(bf16);
  const int slice_tiles = (max_m / 16 + cluster - 1) / cluster;
  return static_cast<size_t>(stages) * (16 * slice_tiles * cluster + n_tile) * kBk * sizeof(bf16) +
         16 * static_cast<size_t>(stages) + 1024;
}

const std::vector<SmallMGemmConfig>& SmallMGemmConfigs() {
  static const std::vector<SmallMGemmConfig> configs = [] {
    std::vector<SmallMGemmConfig> c;
    for (const Entry& e : Entries()) c.push_back(e.config);
    return c;
  }();
  return configs;
}

cudaError_t PrepareSmallMGemm(int config) {
  const std::vector<Entry>& entries = Entries();
  if (config < 0 || config >= static_cast<int>(entries.size())) return cudaErrorInvalidValue;
  return entries[config].prepare();
}

cudaError_t SmallMGemmResidentClusters(int config, int* clusters) {
  const std::vector<Entry>& entries = Entries();
  if (config < 0 || config >= static_cast<int>(entries.size()) || clusters == nullptr) {
    return cudaErrorInvalidValue;
  }
  if (entries[config].resident_clusters == nullptr) return cudaErrorNotSupported;
  return entries[config].resident_clusters(clusters);
}

cudaError_t SmallMGemm(int config, const bf16* x, int64_t ldx, int64_t x_step, int64_t m,
                       const bf16* w, int64_t w_step, int64_t n, int64_t k, void* y, int64_t y_step,
                       int batch, GemmOutput output, cudaStream_t stream) {
  const std::vector<Entry>& entries = Entries();
  if (config < 0 || config >= static_cast<int>(entries.size())) return cudaErrorInvalidValue;
  const SmallMGemmConfig& c = entries[config].config;
  if (m < 1 || m > c.max_m || n < 1 || n > INT_MAX || k < 16 || k % 16 != 0 || k > INT_MAX ||
      ldx < k || ldx % 8 != 0 || x_step % 8 != 0 || w_step % 8 != 0 || batch < 1 || batch > 65535 ||
      !Aligned(x, 16) || !Aligned(w, 16) || !Aligned(y, 4) || x == nullptr || w == nullptr ||
      y == nullptr) {
    return cudaErrorInvalidValue;
  }
  return entries[config].launch(Launch{x, ldx, x_step, static_cast<int>(m), w, w_step,
                                       static_cast<int>(n), static_cast<int>(k), y, y_step, batch,
                                       output, stream});
}

}  // namespace rollout::cuda
