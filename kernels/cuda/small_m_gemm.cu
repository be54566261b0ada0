#include "kernels/cuda/small_m_gemm.h"

#include <climits>
#include <cstdio>

#include "kernels/cuda/mma_ptx.cuh"

namespace rollout::cuda {
namespace {

using bf16 = __nv_bfloat16;

// K elements per ring stage: one 128-byte row of eight 16-byte chunks per x row and w row.
// Chunk c of row r sits at chunk position c ^ (r % 8): the eight rows an ldmatrix phase reads
// (same c, consecutive r) land in eight different bank groups.
constexpr int kBk = 64;
constexpr int kChunks = kBk / 8;

__device__ __forceinline__ int Swizzled(int row, int chunk) {
  return row * kBk + ((chunk ^ (row & 7)) * 8);
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
        if (output == GemmOutput::kBf16) {
          static_cast<bf16*>(y)[at] = __float2bfloat16_rn(v);
        } else if (output == GemmOutput::kF32) {
          static_cast<float*>(y)[at] = v;
        } else {
          float* const p = static_cast<float*>(y) + at;
          *p = __fadd_rn(v, *p);
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

struct Entry {
  SmallMGemmConfig config;
  cudaError_t (*launch)(const Launch&);
  cudaError_t (*prepare)();
};

#define ROLLOUT_SMALL_M_CONFIG(nt, mt, wm, wn, st)                                \
  Entry {                                                                         \
    SmallMGemmConfig{nt, 16 * mt, wm, wn, st}, &LaunchConfig<nt, mt, wm, wn, st>, \
        &PrepareConfig<nt, mt, wm, wn, st>                                        \
  }

// The tilings the ladder may choose from, by the m they serve. Small n tiles give many CTAs
// (qkv's 6144 columns make 384 CTAs of 16); large ones read each x tile for more columns (every
// CTA reads all of x from L2: m / n_tile bytes of x per byte of weights).
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
  };
  return entries;
}

#undef ROLLOUT_SMALL_M_CONFIG

bool Aligned(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

}  // namespace

std::string SmallMGemmConfig::Name() const {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "hand n%d m%d w%dx%d s%d", n_tile, max_m, warps_m, warps_n,
                stages);
  return buf;
}

size_t SmallMGemmConfig::SharedBytes() const {
  return static_cast<size_t>(stages) * (max_m + n_tile) * kBk * sizeof(bf16);
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
