#include <algorithm>
#include <vector>

#include <cuda.h>

#include "kernels/cuda/small_m_gemm_ring.cuh"
#include "kernels/cuda/wgmma_ptx.cuh"

namespace rollout::cuda::small_m {
namespace {

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
    if (err == cudaSuccess) {
      err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    }
    if (err != cudaSuccess) return err;
    grid = dim3(static_cast<unsigned>(std::min<int64_t>(int64_t{col_blocks} * l.batch, sms)), 1);
  }
  SmallMGemmWgmmaKernel<kN, kWgs, kMt, kStages, kPersistent>
      <<<grid, Shape::kThreads, Shape::kSmem, l.stream>>>(maps.x, maps.w, maps.x_col_step,
                                                           maps.x_z, l.m, l.n, l.k, l.batch, l.y,
                                                           l.y_step, l.output);
  return cudaGetLastError();
}

#define ROLLOUT_SMALL_M_WGMMA(nt, wgs, mt, st, p)                                            \
  Entry {                                                                                    \
    SmallMGemmConfig{nt, 64 * wgs * mt, wgs, 1, st, 0, wgs, p}, &LaunchWgmma<nt, wgs, mt, st, p>, \
        &PrepareWgmma<nt, wgs, mt, st, p>                                                    \
  }

}  // namespace

std::vector<Entry> WgmmaEntries() {
  return {
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
}

#undef ROLLOUT_SMALL_M_WGMMA

}  // namespace rollout::cuda::small_m
