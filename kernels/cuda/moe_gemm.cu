// The grouped expert GEMMs of the mixture-of-experts block (MoeExpertGemm, MoeExpertGemmV1; the
// contract is kernels/cuda/moe.h). Every version and block shape computes each output element as
// acc = mma(acc, ...) over K's 16-wide steps in increasing order from a zero accumulator,
// whatever the block, warp or fragment position its row and column land in (rows and columns of
// an MMA are independent): which one runs changes speed only.
//
// Version 1 (MoeExpertGemmV1, kept as the bitwise reference): padded shared-memory rows, 32-bit
// fragment loads. Decode 32 rows x 64 columns (four warps of 32 x 16, K 64 a stage, 3 stages);
// prefill 64 x 128 (2 x 2 warps of 32 x 64, K 32 a stage). H200, Qwen3-30B-A3B's layer: the
// expert GEMMs read the touched weights at 1.15 TB/s (1 token) to 2.9 TB/s (64-512 tokens), 152
// TFLOP/s at 2048 tokens and 183 at 8192.
//
// Version 2 (MoeExpertGemm): staged rows unpadded, 128 bytes (K 64) each, their 16-byte chunks
// XOR-swizzled by row (chunk c of row r at c ^ (r % 8)), so the 8 rows one ldmatrix reads hit 8
// distinct bank groups, and the fragments come by ldmatrix.x4 (A: rows x K; B: w's [n, k] rows,
// already the col-major B operand, so no .trans). Deeper rings in dynamic shared memory: decode
// 32 x 64 with 6 stages (more weight bytes in flight per SM at a few rows per expert); prefill 64
// x 128 (warps of 32 x 64) and 128 x 128 (warps of 64 x 64), 3 stages each, and 128 x 256 (8
// warps of 64 x 64, 4 stages), the one MoeTileColumnsFor gives 128-row tiles on Qwen3's shapes. The
// grid is one dimension, column blocks of a tile adjacent, so a tile's rows are read from memory
// once and from L2 by its other column blocks; the owning expert is found by all threads at once,
// not a serial search; m16 row groups wholly past the expert's rows skip their ldmatrix and MMAs (a
// 1-row decode tile does a quarter of the 32-row work; a prefill tile's tail less). H200
// (docs/benchmarks.md, session 11): only the 128-row tiles gained on version 1.
//
// Version 3 (session 16): the widest shape, 128 x 256, on warpgroup MMAs (MoeExpertGemmWgmmaKernel
// below), the same bits.
#include <climits>
#include <cstdint>

#include "kernels/cuda/mma_ptx.cuh"
#include "kernels/cuda/wgmma_ptx.cuh"
#include "kernels/cuda/moe.h"

namespace rollout::cuda {
namespace {

using ptx::CpAsync16;
using ptx::CpAsyncCommit;
using ptx::CpAsyncWait;
using ptx::LdMatrixX4;
using ptx::Mma16816;

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// The expert owning `tile` (a tile index below tile_offsets[num_experts]): the e whose tiles
// [tile_offsets[e], tile_offsets[e + 1]) hold it -- one e, since an empty expert's range is
// empty. Block-wide; every thread returns it.
__device__ int32_t TileExpert(const int32_t* tile_offsets, int32_t num_experts, int32_t tile,
                              int32_t* shared_slot) {
  for (int32_t e = threadIdx.x; e < num_experts; e += blockDim.x) {
    if (tile_offsets[e] <= tile && tile < tile_offsets[e + 1]) *shared_slot = e;
  }
  __syncthreads();
  return *shared_slot;
}

// ---------------------------------------------------------------------------------------------
// Version 1.

// A block of kWarpsM x kWarpsN warps, each 32 rows x 8 kNi columns (2 x kNi m16n8 tiles); K
// staged kBk at a time through a 3-deep cp.async ring, rows padded by 8 bf16 (bank spread).
template <int kWarpsM, int kWarpsN, int kNi, int kBk>
struct GemmShape {
  static constexpr int kBm = 32 * kWarpsM;  // rows of a tile (MoeGroup's tile_rows)
  static constexpr int kBn = 8 * kNi * kWarpsN;
  static constexpr int kThreads = 32 * kWarpsM * kWarpsN;
  static constexpr int kStages = 3;
  static constexpr int kRowStride = kBk + 8;
  static constexpr int kChunks = kBk / 8;  // 16-byte chunks per staged row
  static constexpr int kWarpsColumns = kWarpsN;
  static constexpr int kColumnTiles = kNi;  // n8 tiles per warp
  static_assert((kBm * kChunks) % kThreads == 0 && (kBn * kChunks) % kThreads == 0,
                "every thread copies the same number of chunks");
  struct Smem {
    bf16 a[kStages][kBm][kRowStride];
    bf16 b[kStages][kBn][kRowStride];
  };
};
// Decode (few rows per expert): 32-row tiles, 64 columns, 4 warps side by side.
using SmallGemm = GemmShape<1, 4, 2, 64>;
// Prefill (many rows per expert): 64-row tiles, 128 columns, 2 x 2 warps of 32 x 64 -- half the
// shared-memory reads per MMA.
using LargeGemm = GemmShape<2, 2, 8, 32>;
static_assert(SmallGemm::kBm == kMoeTileRows && LargeGemm::kBm == kMoeTileRowsLarge,
              "moe.h states the tile rows");
static_assert(SmallGemm::kBn == kMoeGemmAlign && SmallGemm::kChunks * 8 == kMoeGemmAlign,
              "moe.h states the alignment");
static_assert(sizeof(SmallGemm::Smem) <= 46 * 1024 && sizeof(LargeGemm::Smem) <= 46 * 1024,
              "static shared memory");

template <class G>
__global__ void __launch_bounds__(G::kThreads) MoeExpertGemmV1Kernel(MoeGemmParams params) {
  constexpr int kBm = G::kBm, kBn = G::kBn, kStages = G::kStages, kChunks = G::kChunks;
  constexpr int kBk = kChunks * 8;
  __shared__ __align__(16) typename G::Smem smem;
  __shared__ int32_t tile_rows[kBm];  // x row of each tile row (valid rows only)
  const int32_t tile = blockIdx.x;
  const int32_t num_experts = params.num_experts;
  if (tile >= params.tile_offsets[num_experts]) return;
  // The expert owning this tile: the last e with tile_offsets[e] <= tile (an empty expert has
  // tile_offsets[e] == tile_offsets[e + 1], so taking the last skips it).
  int32_t lo = 0, hi = num_experts - 1;
  while (lo < hi) {
    const int32_t mid = (lo + hi + 1) / 2;
    if (params.tile_offsets[mid] <= tile) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  const int32_t e = lo;
  const int32_t row0 = params.expert_offsets[e] + (tile - params.tile_offsets[e]) * kBm;
  const int32_t valid_rows = min(kBm, params.expert_offsets[e + 1] - row0);
  const int64_t n0 = static_cast<int64_t>(blockIdx.y) * kBn;
  const int64_t k = params.k;
  for (int r = threadIdx.x; r < kBm; r += G::kThreads) {
    tile_rows[r] = r < valid_rows ? (params.rows != nullptr ? params.rows[row0 + r] : row0 + r) : 0;
  }
  __syncthreads();
  const bf16* w = params.w + static_cast<int64_t>(e) * params.expert_stride + n0 * k;

  // Issues stage `s`'s copies of K columns [kt * kBk, kt * kBk + kBk).
  auto load = [&](int s, int64_t kt) {
    const int64_t k0 = kt * kBk;
#pragma unroll
    for (int i = 0; i < kBm * kChunks / G::kThreads; ++i) {
      const int c = threadIdx.x + i * G::kThreads;
      const int r = c / kChunks, chunk = c % kChunks;
      const bf16* src = params.x + static_cast<int64_t>(tile_rows[r]) * k + k0 + chunk * 8;
      CpAsync16(&smem.a[s][r][chunk * 8], src, r < valid_rows);
    }
#pragma unroll
    for (int i = 0; i < kBn * kChunks / G::kThreads; ++i) {
      const int c = threadIdx.x + i * G::kThreads;
      const int r = c / kChunks, chunk = c % kChunks;
      CpAsync16(&smem.b[s][r][chunk * 8], w + r * k + k0 + chunk * 8, true);
    }
  };

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, q = lane % 4;
  const int warp_row = (warp / G::kWarpsColumns) * 32;
  const int warp_col = (warp % G::kWarpsColumns) * 8 * G::kColumnTiles;
  float acc[2][G::kColumnTiles][4] = {};  // [m16 tile][n8 tile][fragment]
  const int64_t k_tiles = params.k / kBk;
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < k_tiles) load(s, s);
    CpAsyncCommit();
  }
  for (int64_t kt = 0; kt < k_tiles; ++kt) {
    CpAsyncWait<kStages - 2>();
    __syncthreads();  // stage kt landed for all threads; stage kt - 1 is no longer read
    const int64_t next = kt + kStages - 1;
    if (next < k_tiles) load(static_cast<int>(next % kStages), next);
    CpAsyncCommit();
    const int s = static_cast<int>(kt % kStages);
#pragma unroll
    for (int kk = 0; kk < kBk / 16; ++kk) {
      const int col = kk * 16 + q * 2;
      uint32_t a[2][4];
#pragma unroll
      for (int mi = 0; mi < 2; ++mi) {
        const int r = warp_row + mi * 16 + g;
        a[mi][0] = *reinterpret_cast<const uint32_t*>(&smem.a[s][r][col]);
        a[mi][1] = *reinterpret_cast<const uint32_t*>(&smem.a[s][r + 8][col]);
        a[mi][2] = *reinterpret_cast<const uint32_t*>(&smem.a[s][r][col + 8]);
        a[mi][3] = *reinterpret_cast<const uint32_t*>(&smem.a[s][r + 8][col + 8]);
      }
#pragma unroll
      for (int ni = 0; ni < G::kColumnTiles; ++ni) {
        const int nr = warp_col + ni * 8 + g;
        const uint32_t b0 = *reinterpret_cast<const uint32_t*>(&smem.b[s][nr][col]);
        const uint32_t b1 = *reinterpret_cast<const uint32_t*>(&smem.b[s][nr][col + 8]);
#pragma unroll
        for (int mi = 0; mi < 2; ++mi) Mma16816(acc[mi][ni], a[mi], b0, b1);
      }
    }
  }
  CpAsyncWait<0>();

  // acc[mi][ni][0, 1]: row mi * 16 + g, columns 2q, 2q + 1 of the n8 tile; [2, 3]: row + 8.
  const int64_t n = params.n;
#pragma unroll
  for (int mi = 0; mi < 2; ++mi) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = warp_row + mi * 16 + g + half * 8;
      if (r >= valid_rows) continue;
      const int64_t out_row = row0 + r;
#pragma unroll
      for (int ni = 0; ni < G::kColumnTiles; ++ni) {
        const int64_t col = n0 + warp_col + ni * 8 + q * 2;
        const float v0 = acc[mi][ni][half * 2], v1 = acc[mi][ni][half * 2 + 1];
        if (params.output == MoeGemmOutput::kBf16) {
          *reinterpret_cast<__nv_bfloat162*>(static_cast<bf16*>(params.y) + out_row * n + col) =
              __floats2bfloat162_rn(v0, v1);
        } else {
          *reinterpret_cast<float2*>(static_cast<float*>(params.y) + out_row * n + col) =
              make_float2(v0, v1);
        }
      }
    }
  }
}

template <class G>
cudaError_t LaunchExpertGemmV1(const MoeGemmParams& params, cudaStream_t stream) {
  if (params.n % G::kBn != 0 || params.k % (G::kChunks * 8) != 0 || params.n / G::kBn > 65535) {
    return cudaErrorInvalidValue;
  }
  const int64_t tiles = MoeMaxTiles(params.assignments, params.num_experts, G::kBm);
  const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(params.n / G::kBn));
  MoeExpertGemmV1Kernel<G><<<grid, G::kThreads, 0, stream>>>(params);
  return cudaGetLastError();
}

// ---------------------------------------------------------------------------------------------
// Version 2.

// A block of kWarpsM x kWarpsN warps, each 16 kMi rows x 8 kNi columns (kMi x kNi m16n8 tiles);
// K staged 64 at a time through a kStages-deep cp.async ring of swizzled 128-byte rows.
template <int kWarpsM, int kWarpsN, int kMi, int kNi, int kStages, int kMinBlocks>
struct SwizzledShape {
  static constexpr int kBm = 16 * kMi * kWarpsM;  // rows of a tile (MoeGroup's tile_rows)
  static constexpr int kBn = 8 * kNi * kWarpsN;
  static constexpr int kBk = 64;  // one staged row: 8 chunks of 16 bytes
  static constexpr int kWarpsColumns = kWarpsN;
  static constexpr int kRowTiles = kMi;     // m16 tiles per warp
  static constexpr int kColumnTiles = kNi;  // n8 tiles per warp
  static constexpr int kStageCount = kStages;
  static constexpr int kBlocksPerSm = kMinBlocks;
  static constexpr int kThreads = 32 * kWarpsM * kWarpsN;
  static constexpr int kStageElements = (kBm + kBn) * kBk;  // A rows, then B rows
  static constexpr int kSmemBytes = kStages * kStageElements * 2;
  static_assert(kNi % 2 == 0, "one ldmatrix.x4 gives the B fragments of two n8 tiles");
  static_assert((kBm * 8) % kThreads == 0 && (kBn * 8) % kThreads == 0,
                "every thread copies the same number of chunks");
  static_assert(kSmemBytes * kMinBlocks <= 227 * 1024, "kMinBlocks blocks fit an SM (H100/H200)");
};
// Decode: 32-row tiles x 64 columns, 4 warps side by side, 6 stages (72 KiB, 3 blocks an SM).
using DecodeGemm = SwizzledShape<1, 4, 2, 2, 6, 3>;
// Prefill: 64-row tiles x 128 columns, 2 x 2 warps of 32 x 64, 3 stages (72 KiB, 3 an SM).
using PrefillGemm = SwizzledShape<2, 2, 2, 8, 3, 3>;
// Prefill, many rows per expert: 128 x 128, 2 x 2 warps of 64 x 64 (CUTLASS's usual Ampere
// tile: 8 ldmatrix.x4 per 32 MMAs, a third fewer shared-memory reads per MMA than 32 x 64), 3
// stages (96 KiB, 2 an SM).
using PrefillLargeGemm = SwizzledShape<2, 2, 4, 8, 3, 2>;
// The widest, 128 x 256, runs on warpgroup MMAs (WgmmaWideGemm, below).
static_assert(DecodeGemm::kBm == kMoeTileRows && PrefillGemm::kBm == kMoeTileRowsLarge &&
                  PrefillLargeGemm::kBm == kMoeTileRowsXLarge,
              "moe.h states the tile rows");
static_assert(DecodeGemm::kBn == kMoeGemmAlign && DecodeGemm::kBk == kMoeGemmAlign,
              "moe.h states the alignment");

// Element offset of chunk `chunk` (8 bf16) of staged row `row`.
__device__ __forceinline__ int Swizzled(int row, int chunk) {
  return row * 64 + ((chunk ^ (row & 7)) << 3);
}

// A block's tile of one expert's rows (the grid: tiles x column blocks, column blocks adjacent).
struct ExpertTile {
  int32_t row0;        // first grouped row of the tile
  int32_t valid_rows;  // rows of the tile that hold an assignment
  int64_t n0;          // first output column of the block
  const bf16* w;       // the expert's weight rows from n0
};

// Finds this block's tile and fills tile_rows[r] (the x row of tile row r, 0 past valid_rows);
// false (every thread) when the block lies past the step's tiles. Block-wide.
template <int kBm, int kBn, int kThreads>
__device__ bool SetUpExpertTile(const MoeGemmParams& params, int32_t column_blocks,
                                int32_t* tile_rows, int32_t* expert_slot, ExpertTile* t) {
  const int32_t tile = static_cast<int32_t>(blockIdx.x / column_blocks);
  const int32_t column_block = static_cast<int32_t>(blockIdx.x % column_blocks);
  const int32_t num_experts = params.num_experts;
  if (tile >= params.tile_offsets[num_experts]) return false;
  const int32_t e = TileExpert(params.tile_offsets, num_experts, tile, expert_slot);
  t->row0 = params.expert_offsets[e] + (tile - params.tile_offsets[e]) * kBm;
  t->valid_rows = min(kBm, params.expert_offsets[e + 1] - t->row0);
  t->n0 = static_cast<int64_t>(column_block) * kBn;
  for (int r = threadIdx.x; r < kBm; r += kThreads) {
    const int32_t row = t->row0 + r;
    tile_rows[r] = r < t->valid_rows ? (params.rows != nullptr ? params.rows[row] : row) : 0;
  }
  __syncthreads();
  t->w = params.w + static_cast<int64_t>(e) * params.expert_stride + t->n0 * params.k;
  return true;
}

// Issues one stage's copies of K columns [kt * 64, kt * 64 + 64) into `a` (kBm swizzled x rows,
// zero past valid_rows) and the kBn weight rows after them: chunk c of a staged row is thread
// (c + 8 i)'s, so 8 neighbouring threads read one row's 128 bytes.
template <int kBm, int kBn, int kThreads>
__device__ __forceinline__ void LoadExpertStage(bf16* a, const MoeGemmParams& params,
                                                const int32_t* tile_rows, const ExpertTile& t,
                                                int64_t kt) {
  const int64_t k = params.k, k0 = kt * 64;
  bf16* b = a + kBm * 64;
#pragma unroll
  for (int i = 0; i < kBm * 8 / kThreads; ++i) {
    const int c = threadIdx.x + i * kThreads;
    const int r = c / 8, chunk = c % 8;
    const bf16* src = params.x + static_cast<int64_t>(tile_rows[r]) * k + k0 + chunk * 8;
    CpAsync16(a + Swizzled(r, chunk), src, r < t.valid_rows);
  }
#pragma unroll
  for (int i = 0; i < kBn * 8 / kThreads; ++i) {
    const int c = threadIdx.x + i * kThreads;
    const int r = c / 8, chunk = c % 8;
    CpAsync16(b + Swizzled(r, chunk), t.w + r * k + k0 + chunk * 8, true);
  }
}

// Output columns col, col + 1 of grouped row `row`.
__device__ __forceinline__ void StoreExpertPair(const MoeGemmParams& params, int64_t row,
                                                int64_t col, float v0, float v1) {
  const int64_t at = row * params.n + col;
  if (params.output == MoeGemmOutput::kBf16) {
    *reinterpret_cast<__nv_bfloat162*>(static_cast<bf16*>(params.y) + at) =
        __floats2bfloat162_rn(v0, v1);
  } else {
    *reinterpret_cast<float2*>(static_cast<float*>(params.y) + at) = make_float2(v0, v1);
  }
}

template <class G>
__global__ void __launch_bounds__(G::kThreads, G::kBlocksPerSm)
    MoeExpertGemmKernel(MoeGemmParams params, int32_t column_blocks) {
  constexpr int kBm = G::kBm, kBn = G::kBn, kBk = G::kBk, kStages = G::kStageCount;
  constexpr int kMi = G::kRowTiles, kNi = G::kColumnTiles;
  extern __shared__ uint4 moe_gemm_smem[];
  bf16* staged = reinterpret_cast<bf16*>(moe_gemm_smem);  // [kStages][kBm + kBn rows][kBk]
  __shared__ int32_t tile_rows[kBm];  // x row of each tile row (valid rows only)
  __shared__ int32_t expert_slot;
  ExpertTile t;
  if (!SetUpExpertTile<kBm, kBn, G::kThreads>(params, column_blocks, tile_rows, &expert_slot, &t)) {
    return;
  }
  const int32_t row0 = t.row0, valid_rows = t.valid_rows;
  auto load = [&](int s, int64_t kt) {
    LoadExpertStage<kBm, kBn, G::kThreads>(staged + s * G::kStageElements, params, tile_rows, t,
                                           kt);
  };

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, q = lane % 4;
  const int warp_row = (warp / G::kWarpsColumns) * 16 * kMi;
  const int warp_col = (warp % G::kWarpsColumns) * 8 * kNi;
  // ldmatrix.x4 row addresses. A (m16 x k16 at rows warp_row + 16 mi): lane l gives row l % 16,
  // chunk l / 16 -- matrices (rows 0-7, k 0-7), (8-15, k 0-7), (0-7, k 8-15), (8-15, k 8-15) are
  // a0..a3. B (two n8 tiles x k16 at columns warp_col + 16 nj): lane l gives n row
  // 8 (l / 16) + l % 8, chunk (l / 8) % 2 -- matrices (tile 2nj, k 0-7), (2nj, k 8-15),
  // (2nj + 1, k 0-7), (2nj + 1, k 8-15) are b0, b1 of n8 tile 2nj, then of 2nj + 1. Lane l then
  // holds row l / 4, elements 2 (l % 4) + {0, 1} of each: the m16n8k16 fragments, the same
  // values version 1 reads with 32-bit loads.
  const int a_row = lane % 16, a_chunk = lane / 16;
  const int b_row = 8 * (lane / 16) + lane % 8, b_chunk = (lane / 8) % 2;
  // m16 row groups holding a valid row (warp-uniform: ldmatrix and mma.sync are warp-wide);
  // the rest keep a zero accumulator and are never stored.
  int active_row_tiles = 0;
#pragma unroll
  for (int mi = 0; mi < kMi; ++mi) active_row_tiles += warp_row + 16 * mi < valid_rows ? 1 : 0;
  float acc[kMi][kNi][4] = {};  // [m16 tile][n8 tile][fragment]
  const int64_t k_tiles = params.k / kBk;
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < k_tiles) load(s, s);
    CpAsyncCommit();
  }
  for (int64_t kt = 0; kt < k_tiles; ++kt) {
    CpAsyncWait<kStages - 2>();
    __syncthreads();  // stage kt landed for all threads; stage kt - 1 is no longer read
    const int64_t next = kt + kStages - 1;
    if (next < k_tiles) load(static_cast<int>(next % kStages), next);
    CpAsyncCommit();
    const bf16* a = staged + static_cast<int>(kt % kStages) * G::kStageElements;
    const bf16* b = a + kBm * kBk;
#pragma unroll
    for (int kk = 0; kk < kBk / 16; ++kk) {
      uint32_t bfrag[kNi][2];
#pragma unroll
      for (int nj = 0; nj < kNi / 2; ++nj) {
        uint32_t r[4];
        LdMatrixX4(r, b + Swizzled(warp_col + 16 * nj + b_row, 2 * kk + b_chunk));
        bfrag[2 * nj][0] = r[0];
        bfrag[2 * nj][1] = r[1];
        bfrag[2 * nj + 1][0] = r[2];
        bfrag[2 * nj + 1][1] = r[3];
      }
#pragma unroll
      for (int mi = 0; mi < kMi; ++mi) {
        if (mi >= active_row_tiles) continue;
        uint32_t afrag[4];
        LdMatrixX4(afrag, a + Swizzled(warp_row + 16 * mi + a_row, 2 * kk + a_chunk));
#pragma unroll
        for (int ni = 0; ni < kNi; ++ni) Mma16816(acc[mi][ni], afrag, bfrag[ni][0], bfrag[ni][1]);
      }
    }
  }
  CpAsyncWait<0>();

  // acc[mi][ni][0, 1]: row 16 mi + g, columns 2q, 2q + 1 of the n8 tile; [2, 3]: row + 8.
#pragma unroll
  for (int mi = 0; mi < kMi; ++mi) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = warp_row + mi * 16 + g + half * 8;
      if (r >= valid_rows) continue;
#pragma unroll
      for (int ni = 0; ni < kNi; ++ni) {
        StoreExpertPair(params, row0 + r, t.n0 + warp_col + ni * 8 + q * 2, acc[mi][ni][half * 2],
                        acc[mi][ni][half * 2 + 1]);
      }
    }
  }
}

// Launches `kernel` (block shape G: kBm x kBn tiles of kThreads threads, kSmemBytes of dynamic
// shared memory) over the step's tiles, column blocks adjacent.
template <class G>
cudaError_t LaunchExpertGemm(void (*kernel)(MoeGemmParams, int32_t), const MoeGemmParams& params,
                             cudaStream_t stream) {
  if (params.n % G::kBn != 0 || params.k % G::kBk != 0) return cudaErrorInvalidValue;
  const int64_t column_blocks = params.n / G::kBn;
  const int64_t blocks =
      MoeMaxTiles(params.assignments, params.num_experts, G::kBm) * column_blocks;
  if (blocks > INT32_MAX) return cudaErrorInvalidValue;
  // The blocks' rings need the most shared memory an SM can carve out.
  cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, G::kSmemBytes);
  if (err == cudaSuccess) {
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                               cudaSharedmemCarveoutMaxShared);
  }
  if (err != cudaSuccess) return err;
  kernel<<<static_cast<unsigned>(blocks), G::kThreads, G::kSmemBytes, stream>>>(
      params, static_cast<int32_t>(column_blocks));
  return cudaGetLastError();
}

// The widest shape on warpgroup MMAs (version 3, session 16): 128-row tiles x 256 columns, the
// ring, the copies and the epilogue of MoeExpertGemmKernel (version 2 ran this shape as 2 x 4
// warps of 64 x 64 on mma.sync), but each of the two warpgroups issues its 64 rows' K steps as
// wgmma.mma_async m64n256k16 reading the staged tiles in place (the staging's XOR swizzle is the
// 128-byte swizzle wgmma's descriptors name, from a 1024-byte aligned ring) instead of ldmatrix +
// mma.sync. Per element the same chain: 16-wide K
// steps in order into one fp32 accumulator from +0 (wgmma's k16 step accumulates as mma.sync's:
// the small-m GEMM's wgmma configurations give the pinned GEMM's bits, tests/gpu/
// small_m_gemm_test.cc), so the bits are version 1's (moe_gemm_test.cc).
struct WgmmaWideGemm {
  static constexpr int kBm = kMoeTileRowsXLarge, kBn = kMoeTileColumnsWide, kBk = 64;
  static constexpr int kStages = 4;
  static constexpr int kThreads = 256;  // two warpgroups of 64 rows
  static constexpr int kStageElements = (kBm + kBn) * kBk;
  static constexpr int kSmemBytes = kStages * kStageElements * 2 + 1024;  // + alignment
  static_assert(kBm == 128 && kBn == 256, "two m64 warpgroups, one wgmma N of 256");
};

__global__ void __launch_bounds__(WgmmaWideGemm::kThreads, 1)
    MoeExpertGemmWgmmaKernel(MoeGemmParams params, int32_t column_blocks) {
  using G = WgmmaWideGemm;
  constexpr int kBm = G::kBm, kBn = G::kBn, kBk = G::kBk, kStages = G::kStages;
  extern __shared__ uint4 moe_gemm_smem[];
  bf16* const staged = reinterpret_cast<bf16*>(
      (reinterpret_cast<uintptr_t>(moe_gemm_smem) + 1023) & ~uintptr_t{1023});
  __shared__ int32_t tile_rows[kBm];
  __shared__ int32_t expert_slot;
  ExpertTile t;
  if (!SetUpExpertTile<kBm, kBn, G::kThreads>(params, column_blocks, tile_rows, &expert_slot, &t)) {
    return;
  }
  const int32_t valid_rows = t.valid_rows;
  auto load = [&](int s, int64_t kt) {
    LoadExpertStage<kBm, kBn, G::kThreads>(staged + s * G::kStageElements, params, tile_rows, t,
                                           kt);
  };
  // Broadcast, so that the compiler sees them warp-uniform (a wgmma on a path it takes for
  // divergent is serialized: ptxas C7520).
  const int wg = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x / 128), 0);
  const bool live = __shfl_sync(0xffffffffu, 64 * wg < valid_rows ? 1 : 0, 0) != 0;
  float acc[kBn / 2];
#pragma unroll
  for (int j = 0; j < kBn / 2; ++j) acc[j] = 0.0f;
  const int64_t k_tiles = params.k / kBk;
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < k_tiles) load(s, s);
    CpAsyncCommit();
  }
  for (int64_t kt = 0; kt < k_tiles; ++kt) {
    CpAsyncWait<kStages - 2>();
    // This thread's copies of stage kt are visible to the async proxy wgmma reads through.
    ptx::FenceProxyAsyncShared();
    __syncthreads();
    const bf16* a = staged + static_cast<int>(kt % kStages) * G::kStageElements;
    if (live) {
      const uint64_t a_desc = ptx::SwizzledKMajorDescriptor(a + 64 * wg * kBk);
      const uint64_t b_desc = ptx::SwizzledKMajorDescriptor(a + kBm * kBk);
      ptx::FenceOperands(acc);
      ptx::WgmmaFence();
#pragma unroll
      for (int kk = 0; kk < kBk / 16; ++kk) {
        ptx::Wgmma<kBn>::Mma(acc, a_desc + 2 * kk, b_desc + 2 * kk);
      }
      ptx::WgmmaCommit();
      // Stage kt - 1's MMAs are done; the refill below overwrites it.
      ptx::WgmmaWait<1>();
      ptx::FenceOperands(acc);
    }
    __syncthreads();  // neither warpgroup still reads stage kt - 1
    const int64_t next = kt + kStages - 1;
    if (next < k_tiles) load(static_cast<int>(next % kStages), next);
    CpAsyncCommit();
  }
  ptx::WgmmaWait<0>();
  ptx::FenceOperands(acc);
  CpAsyncWait<0>();
  if (!live) return;
  // acc[4 j + 2 h + {0, 1}]: row 16 (warp % 4) + lane / 4 + 8 h of the warpgroup's 64, columns
  // 8 j + 2 (lane % 4) + {0, 1}.
  const int lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
  const int warp_row = 64 * wg + 16 * ((threadIdx.x / 32) % 4);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = warp_row + g + half * 8;
    if (r >= valid_rows) continue;
#pragma unroll
    for (int j = 0; j < kBn / 8; ++j) {
      StoreExpertPair(params, t.row0 + r, t.n0 + 8 * j + q * 2, acc[4 * j + 2 * half],
                      acc[4 * j + 2 * half + 1]);
    }
  }
}

bool ValidGemmParams(const MoeGemmParams& params) {
  return params.n % kMoeGemmAlign == 0 && params.k % kMoeGemmAlign == 0 && params.n > 0 &&
         params.k > 0 && params.num_experts >= 1 && params.num_experts <= kMoeMaxExperts &&
         params.assignments >= 0 && params.assignments <= INT32_MAX && Aligned16(params.x) &&
         Aligned16(params.w) && Aligned16(params.y) && params.expert_stride % 8 == 0;
}

}  // namespace

cudaError_t MoeExpertGemm(const MoeGemmParams& params, cudaStream_t stream) {
  if (!ValidGemmParams(params)) return cudaErrorInvalidValue;
  if (params.tile_columns != 0) {
    if (params.tile_rows != kMoeTileRowsXLarge || params.tile_columns != kMoeTileColumnsWide) {
      return cudaErrorInvalidValue;
    }
    return params.assignments == 0
               ? cudaSuccess
               : LaunchExpertGemm<WgmmaWideGemm>(MoeExpertGemmWgmmaKernel, params, stream);
  }
  if (params.assignments == 0) return cudaSuccess;
  switch (params.tile_rows) {
    case kMoeTileRows:
      return LaunchExpertGemm<DecodeGemm>(MoeExpertGemmKernel<DecodeGemm>, params, stream);
    case kMoeTileRowsLarge:
      return LaunchExpertGemm<PrefillGemm>(MoeExpertGemmKernel<PrefillGemm>, params, stream);
    case kMoeTileRowsXLarge:
      return LaunchExpertGemm<PrefillLargeGemm>(MoeExpertGemmKernel<PrefillLargeGemm>, params,
                                                stream);
    default:
      return cudaErrorInvalidValue;
  }
}

cudaError_t MoeExpertGemmV1(const MoeGemmParams& params, cudaStream_t stream) {
  if (!ValidGemmParams(params) || params.tile_columns != 0) return cudaErrorInvalidValue;
  if (params.assignments == 0) return cudaSuccess;
  if (params.tile_rows == SmallGemm::kBm) return LaunchExpertGemmV1<SmallGemm>(params, stream);
  if (params.tile_rows == LargeGemm::kBm) return LaunchExpertGemmV1<LargeGemm>(params, stream);
  return cudaErrorInvalidValue;
}

}  // namespace rollout::cuda
