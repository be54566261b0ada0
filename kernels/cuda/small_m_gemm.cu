#include "kernels/cuda/small_m_gemm.h"

#include <algorithm>
#include <climits>
#include <cstdio>

#include <cuda.h>

#include "kernels/cuda/mma_ptx.cuh"
#include "kernels/cuda/tensor_map.h"
#include "kernels/cuda/wgmma_ptx.cuh"

namespace rollout::cuda {
namespace {

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

// The warpgroup kernel: the same per-element order (one fp32 accumulator, the k16 chunks of K in
// increasing order), issued as wgmma.mma_async m64nNk16 from shared memory, for the m where
// mma.sync's issue rate, not the weights' bytes, bounds the kernels above (at m = 95 a CTA of
// n 48 holds 96 x 48 x 4096 MACs against 393 KB of weights: as long at mma.sync's rate as the
// weights take at the copy rate). kWgs consumer warpgroups each own kMt m64 tiles of every row
// of the CTA's kN columns; one producer warp's lane 0 feeds a ring of kStages stages by the TMA
// (x: one 64-row box per m64 tile that holds a live row; w: one kN-row box), 64 K elements a
// stage, both in the 128-byte swizzle wgmma's descriptors read. full[s] completes when stage s
// has landed; empty[s] takes one arrival per consumer warp once its MMAs reading stage s are
// done (wgmma.wait_group 1 after the next stage's group). Per element the chain is the
// cp.async kernel's: 16-wide K steps in order into one accumulator, starting from +0.
template <int kN, int kWgs, int kMt, int kStages>
struct WgmmaShape {
  static constexpr int kThreads = 128 * kWgs + 32;
  static constexpr int kXRows = 64 * kWgs * kMt;
  static constexpr int kStageBytes = (kXRows + kN) * kBk * 2;
  static constexpr size_t kSmem = size_t{kStages} * kStageBytes + 2 * kStages * 8 + 1024;
  static_assert(kN % 8 == 0 && kN <= 256, "wgmma N: a multiple of 8 up to 256");
  static_assert(kMt * kN / 2 <= 128, "at most 128 accumulator registers a thread");
  static_assert((kN * kBk * 2) % 1024 == 0, "weight tiles keep the 1024-byte alignment");
};

// kPersistent: a grid of at most one CTA an SM walks the (product, column block) tiles in turn,
// tile blockIdx.x, then + gridDim.x, ...; the ring and its phases run on across the CTA's tiles,
// so the producer fills the next tile's stages while the consumers finish this one (its last
// MMAs and its stores) -- where a launch of many short tiles (the K-tree leaves, K = 512) was
// otherwise a wave of fill, compute and drain per tile. Otherwise one tile per CTA, (blockIdx.x,
// blockIdx.y). A tile's arithmetic is the same either way: which CTA computes it never matters.
template <int kN, int kWgs, int kMt, int kStages, bool kPersistent>
__global__ void __launch_bounds__(WgmmaShape<kN, kWgs, kMt, kStages>::kThreads, 1)
    SmallMGemmWgmmaKernel(const __grid_constant__ CUtensorMap x_map,
                          const __grid_constant__ CUtensorMap w_map, int x_col_step, int x_z, int m,
                          int n, int k, int batch, void* y, int64_t y_step, GemmOutput output) {
  using Shape = WgmmaShape<kN, kWgs, kMt, kStages>;
  extern __shared__ unsigned char smem_raw[];
  unsigned char* const smem = reinterpret_cast<unsigned char*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  uint64_t* const full = reinterpret_cast<uint64_t*>(smem + kStages * Shape::kStageBytes);
  uint64_t* const empty = full + kStages;

  const int col_blocks = (n + kN - 1) / kN;
  const int num_tiles = kPersistent ? col_blocks * batch : 1;
  const int first_tile = kPersistent ? static_cast<int>(blockIdx.x) : 0;
  const int tile_step = kPersistent ? static_cast<int>(gridDim.x) : 1;
  // The product and first column of a tile.
  auto tile_b = [&](int tile) { return kPersistent ? tile / col_blocks : int(blockIdx.y); };
  auto tile_n0 = [&](int tile) { return (kPersistent ? tile % col_blocks : int(blockIdx.x)) * kN; };
  const int live_tiles = (m + 63) / 64;  // m64 tiles holding a live row
  const uint32_t stage_tx = static_cast<uint32_t>((64 * live_tiles + kN) * kBk * 2);
  const int k_tiles = (k + kBk - 1) / kBk;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  if (threadIdx.x == 0) InitRing(full, empty, kStages, 4 * kWgs);
  __syncthreads();

  if (warp == 4 * kWgs) {
    if (lane == 0) {
      ptx::PrefetchTensorMap(&x_map);
      ptx::PrefetchTensorMap(&w_map);
      int g = 0;  // the ring's K tile count over this CTA's tiles
      for (int tile = first_tile; tile < num_tiles; tile += tile_step) {
        const int b = tile_b(tile), n0 = tile_n0(tile);
        for (int kt = 0; kt < k_tiles; ++kt, ++g) {
          const int s = ProduceStage(full, empty, g, kStages, stage_tx);
          unsigned char* const xs = smem + s * Shape::kStageBytes;
          unsigned char* const ws = xs + Shape::kXRows * kBk * 2;
          const int col = b * x_col_step + kt * kBk;
          for (int i = 0; i < live_tiles; ++i) {
            ptx::TmaLoad3d(xs + i * 64 * kBk * 2, &x_map, col, 64 * i, b * x_z, &full[s]);
          }
          ptx::TmaLoad3d(ws, &w_map, kt * kBk, n0, b, &full[s]);
        }
      }
    }
    return;
  }

  // Broadcast from lane 0, so that the compiler sees both as warp-uniform: a wgmma on a path it
  // takes for divergent would be serialized (ptxas C7520).
  const int wg = __shfl_sync(0xffffffffu, warp / 4, 0);
  // This warpgroup's m64 tiles that hold a live row (uniform over the warpgroup).
  const int my_tiles = __shfl_sync(0xffffffffu, min(kMt, max(0, live_tiles - wg * kMt)), 0);
  const int g_lane = lane / 4, t = lane % 4, w_in = warp % 4;
  float acc[kMt][kN / 2];
  int g = 0;
  for (int tile = first_tile; tile < num_tiles; tile += tile_step) {
#pragma unroll
    for (int i = 0; i < kMt; ++i) {
#pragma unroll
      for (int j = 0; j < kN / 2; ++j) acc[i][j] = 0.0f;
    }
    for (int kt = 0; kt < k_tiles; ++kt, ++g) {
      const int s = g % kStages;
      ptx::MbarrierWait(&full[s], (g / kStages) & 1);
      if (my_tiles > 0) {
        const unsigned char* const xs = smem + s * Shape::kStageBytes;
        const uint64_t w_desc = ptx::SwizzledKMajorDescriptor(xs + Shape::kXRows * kBk * 2);
        const uint64_t x_desc = ptx::SwizzledKMajorDescriptor(xs + wg * kMt * 64 * kBk * 2);
#pragma unroll
        for (int i = 0; i < kMt; ++i) {
          ptx::FenceOperands(acc[i]);
        }
        ptx::WgmmaFence();
        // Past K no instruction at all, not an add of zeros; a whole tile without a test.
        const int k16s = min(kBk / 16, (k - kt * kBk) / 16);
        if (k16s == kBk / 16 && my_tiles == kMt) {
#pragma unroll
          for (int kk = 0; kk < kBk / 16; ++kk) {
#pragma unroll
            for (int i = 0; i < kMt; ++i) {
              // m64 tile i of this warpgroup: 64 rows of 128 bytes further (in 16-byte units).
              ptx::Wgmma<kN>::Mma(acc[i], x_desc + uint64_t(i * 64 * kBk * 2 / 16) + 2 * kk,
                                  w_desc + 2 * kk);
            }
          }
        } else {
          for (int kk = 0; kk < k16s; ++kk) {
#pragma unroll
            for (int i = 0; i < kMt; ++i) {
              if (i < my_tiles) {
                ptx::Wgmma<kN>::Mma(acc[i], x_desc + uint64_t(i * 64 * kBk * 2 / 16) + 2 * kk,
                                    w_desc + 2 * kk);
              }
            }
          }
        }
        ptx::WgmmaCommit();
#pragma unroll
        for (int i = 0; i < kMt; ++i) {
          ptx::FenceOperands(acc[i]);
        }
        // The group of stage g - 1 is done: its stage may be refilled.
        ptx::WgmmaWait<1>();
      }
      if (kt > 0 && lane == 0) ptx::MbarrierArrive(&empty[(g - 1) % kStages]);
    }
    ptx::WgmmaWait<0>();
#pragma unroll
    for (int i = 0; i < kMt; ++i) {
      ptx::FenceOperands(acc[i]);
    }
    // The tile's last stage is read: the producer may refill it (with the next tile's K) while
    // this tile's results are stored.
    if (kPersistent && lane == 0) ptx::MbarrierArrive(&empty[(g - 1) % kStages]);
    if (my_tiles == 0) continue;
    const int b = tile_b(tile), n0 = tile_n0(tile);
#pragma unroll
    for (int i = 0; i < kMt; ++i) {
      if (i >= my_tiles) continue;
      const int row_base = 64 * (wg * kMt + i) + 16 * w_in + g_lane;
#pragma unroll
      for (int j = 0; j < kN / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int row = row_base + 8 * (e / 2);
          const int col = n0 + 8 * j + 2 * t + e % 2;
          if (row >= m || col >= n) continue;
          const int64_t at = b * y_step + static_cast<int64_t>(row) * n + col;
          const float v = acc[i][4 * j + e];
          StoreElement(output, y, at, v);
        }
      }
    }
  }
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

// The tensor maps of a launch's x (boxes of x_rows rows) and w (boxes of w_rows rows), and how
// a product b finds its x: x_b = x + b x_step is either the columns [b x_step, b x_step + k) of
// rows ldx apart (the canonical K tree's leaves: x_col_step) or a matrix x_step further (x_z).
struct TmaMaps {
  CUtensorMap x, w;
  int x_col_step = 0, x_z = 0;
};

cudaError_t EncodeLaunchMaps(const Launch& l, uint32_t x_rows, uint32_t w_rows, TmaMaps* maps) {
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

template <int kNTile, int kMTiles, int kWarpsM, int kWarpsN, int kStages, int kCluster>
cudaError_t LaunchTma(const Launch& l) {
  using Shape = TmaShape<kNTile, kMTiles, kWarpsM, kWarpsN, kStages, kCluster>;
  const int m_tiles = (l.m + 15) / 16;
  const uint32_t slice_rows = 16 * ((m_tiles + kCluster - 1) / kCluster);
  TmaMaps maps;
  const cudaError_t err = EncodeLaunchMaps(l, slice_rows, kNTile, &maps);
  if (err != cudaSuccess) return err;
  const int n_tiles = (l.n + kNTile - 1) / kNTile;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3((n_tiles + kCluster - 1) / kCluster * kCluster, l.batch);
  config.blockDim = dim3(Shape::kThreads);
  config.dynamicSmemBytes = Shape::kSmem;
  config.stream = l.stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeClusterDimension;
  attribute[0].val.clusterDim.x = kCluster;
  attribute[0].val.clusterDim.y = 1;
  attribute[0].val.clusterDim.z = 1;
  config.attrs = attribute;
  config.numAttrs = kCluster > 1 ? 1 : 0;
  return cudaLaunchKernelEx(
      &config, &SmallMGemmTmaKernel<kNTile, kMTiles, kWarpsM, kWarpsN, kStages, kCluster>, maps.x,
      maps.w, maps.x_col_step, maps.x_z, l.m, l.n, l.k, l.y, l.y_step, l.output);
}

template <int kN, int kWgs, int kMt, int kStages, bool kPersistent>
cudaError_t PrepareWgmma() {
  if (!TensorMapsAvailable()) return cudaErrorNotSupported;
  return cudaFuncSetAttribute(&SmallMGemmWgmmaKernel<kN, kWgs, kMt, kStages, kPersistent>,
                              cudaFuncAttributeMaxDynamicSharedMemorySize,
                              static_cast<int>(WgmmaShape<kN, kWgs, kMt, kStages>::kSmem));
}

template <int kN, int kWgs, int kMt, int kStages, bool kPersistent>
cudaError_t LaunchWgmma(const Launch& l) {
  using Shape = WgmmaShape<kN, kWgs, kMt, kStages>;
  TmaMaps maps;
  cudaError_t err = EncodeLaunchMaps(l, 64, kN, &maps);
  if (err != cudaSuccess) return err;
  const int col_blocks = (l.n + kN - 1) / kN;
  dim3 grid(col_blocks, l.batch);
  if (kPersistent) {
    // One CTA an SM (the ring fills its shared memory), never more CTAs than tiles.
    int device = 0, sms = 0;
    err = cudaGetDevice(&device);
    if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    if (err != cudaSuccess) return err;
    grid = dim3(static_cast<unsigned>(std::min<int64_t>(int64_t{col_blocks} * l.batch, sms)), 1);
  }
  SmallMGemmWgmmaKernel<kN, kWgs, kMt, kStages, kPersistent>
      <<<grid, Shape::kThreads, Shape::kSmem, l.stream>>>(maps.x, maps.w, maps.x_col_step,
                                                           maps.x_z, l.m, l.n, l.k, l.batch, l.y,
                                                           l.y_step, l.output);
  return cudaGetLastError();
}

struct Entry {
  SmallMGemmConfig config;
  cudaError_t (*launch)(const Launch&);
  cudaError_t (*prepare)();
};

#define ROLLOUT_SMALL_M_CONFIG(nt, mt, wm, wn, st)                                   \
  Entry {                                                                            \
    SmallMGemmConfig{nt, 16 * mt, wm, wn, st, 0}, &LaunchConfig<nt, mt, wm, wn, st>, \
        &PrepareConfig<nt, mt, wm, wn, st>                                           \
  }
#define ROLLOUT_SMALL_M_TMA(nt, mt, wm, wn, st, c)                                     \
  Entry {                                                                              \
    SmallMGemmConfig{nt, 16 * mt, wm, wn, st, c}, &LaunchTma<nt, mt, wm, wn, st, c>,   \
        &PrepareTma<nt, mt, wm, wn, st, c>                                             \
  }
#define ROLLOUT_SMALL_M_WGMMA(nt, wgs, mt, st, p)                                            \
  Entry {                                                                                    \
    SmallMGemmConfig{nt, 64 * wgs * mt, wgs, 1, st, 0, wgs, p}, &LaunchWgmma<nt, wgs, mt, st, p>, \
        &PrepareWgmma<nt, wgs, mt, st, p>                                                    \
  }

// The tilings the ladder may choose from, by the m they serve. Small n tiles give many CTAs
// (qkv's 6144 columns make 384 CTAs of 16); large ones read each x tile for more columns (every
// CTA reads all of x from L2: m / n_tile bytes of x per byte of weights; the TMA kernels' clusters
// divide that by the cluster size).
const std::vector<Entry>& Entries() {
  static const std::vector<Entry> entries = {
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
      // wgmma, m <= 64 and m <= 128: those that were the fastest configuration for some runner
      // shape at some m of 1..128 (rollout-gemm-sweep --small-m, H200, session 16). Two m64
      // tiles a warpgroup (m <= 256) lost to the pin at every m above 128 and were dropped, as was
      // n 128 for m <= 64.
      ROLLOUT_SMALL_M_WGMMA(48, 1, 1, 12, false),
      ROLLOUT_SMALL_M_WGMMA(64, 1, 1, 12, false),
      ROLLOUT_SMALL_M_WGMMA(256, 1, 1, 5, false),
      ROLLOUT_SMALL_M_WGMMA(48, 2, 1, 9, false),
      ROLLOUT_SMALL_M_WGMMA(64, 2, 1, 8, false),
      ROLLOUT_SMALL_M_WGMMA(128, 2, 1, 6, false),
      ROLLOUT_SMALL_M_WGMMA(192, 2, 1, 5, false),
      ROLLOUT_SMALL_M_WGMMA(256, 2, 1, 4, false),
      // Persistent (session 19): the tilings with more tiles than SMs on some runner shape (the
      // K-tree leaves: 8 x 4096 / n; gate_up: 24576 / n), where a CTA per tile ran a wave of
      // ring fill and drain per tile.
      ROLLOUT_SMALL_M_WGMMA(48, 1, 1, 12, true),
      ROLLOUT_SMALL_M_WGMMA(64, 1, 1, 12, true),
      ROLLOUT_SMALL_M_WGMMA(96, 1, 1, 10, true),
      ROLLOUT_SMALL_M_WGMMA(48, 2, 1, 9, true),
      ROLLOUT_SMALL_M_WGMMA(64, 2, 1, 8, true),
      ROLLOUT_SMALL_M_WGMMA(96, 2, 1, 7, true),
      ROLLOUT_SMALL_M_WGMMA(128, 2, 1, 6, true),
  };
  return entries;
}

#undef ROLLOUT_SMALL_M_WGMMA
#undef ROLLOUT_SMALL_M_TMA
#undef ROLLOUT_SMALL_M_CONFIG

bool Aligned(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

}  // namespace

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
