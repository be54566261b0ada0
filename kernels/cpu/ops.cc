#include "kernels/cpu/ops.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#if defined(__FMA__)
#include <immintrin.h>
#endif

// Bitwise contract of this file: wherever a product feeds a sum, the code says so explicitly with
// a fused multiply-add (one rounding). GCC contracts a * b + c into an FMA at its own discretion
// in C++ (-ffp-contract=fast is its default even with -std=c++17), so spelling the FMA out is what
// pins the arithmetic: the vectorised MatMul tile performs, per lane, exactly Dot's FMAs in Dot's
// order, and a build without FMA hardware (ROLLOUT_CPU_ARCH=x86-64) computes the same bits, only
// slower. ops_test checks Dot bitwise against a scalar transcription of this order.
namespace rollout::cpu {
namespace {

constexpr int kLanes = 16;

// Float8 never crosses a translation unit, so GCC's note that its ABI differs without AVX is moot.
#pragma GCC diagnostic ignored "-Wpsabi"

// Eight fp32 lanes: one AVX register on x86-64-v3, two SSE registers elsewhere.
typedef float Float8 __attribute__((vector_size(32)));
typedef float Float4 __attribute__((vector_size(16)));

inline __attribute__((always_inline)) Float8 Load8(const float* p) {
  Float8 v;
  std::memcpy(&v, p, sizeof(v));  // unaligned load; results never depend on alignment
  return v;
}

// a * b + c per lane, rounded once.
inline __attribute__((always_inline)) Float8 Fma8(const Float8& a, const Float8& b,
                                                  const Float8& c) {
#if defined(__FMA__)
  return reinterpret_cast<Float8>(_mm256_fmadd_ps(
      reinterpret_cast<__m256>(a), reinterpret_cast<__m256>(b), reinterpret_cast<__m256>(c)));
#else
  Float8 r;
  for (int l = 0; l < 8; ++l) r[l] = std::fma(a[l], b[l], c[l]);
  return r;
#endif
}

// The end of every dot product, given its lanes 0-7 and 8-15: elements [begin, n) (fewer than
// 16) go into lane i % 16 in increasing i, then the 16 lanes are combined by the fixed tree
// acc[l] += acc[l + 8] (l < 8), acc[l] += acc[l + 4] (l < 4), acc[l] += acc[l + 2] (l < 2),
// acc[0] + acc[1] -- written with vector halves, which are exactly those lane-wise adds.
inline __attribute__((always_inline)) float FinishDot(const Float8& lanes_lo,
                                                      const Float8& lanes_hi, const float* a,
                                                      const float* b, int64_t begin, int64_t n) {
  Float8 lo = lanes_lo, hi = lanes_hi;
  if (begin < n) {
    float acc[kLanes];
    std::memcpy(acc, &lo, sizeof(lo));
    std::memcpy(acc + 8, &hi, sizeof(hi));
    for (int64_t i = begin; i < n; ++i) {
      acc[i % kLanes] = std::fma(a[i], b[i], acc[i % kLanes]);
    }
    std::memcpy(&lo, acc, sizeof(lo));
    std::memcpy(&hi, acc + 8, sizeof(hi));
  }
  const Float8 s8 = lo + hi;
  Float4 s8_lo, s8_hi;
  std::memcpy(&s8_lo, &s8, sizeof(Float4));
  std::memcpy(&s8_hi, reinterpret_cast<const char*>(&s8) + sizeof(Float4), sizeof(Float4));
  const Float4 s4 = s8_lo + s8_hi;
  const float s2_0 = s4[0] + s4[2];
  const float s2_1 = s4[1] + s4[3];
  return s2_0 + s2_1;
}

// The 16-lane accumulators of MR x NR dot products over the first k_full (a multiple of 16)
// elements of MR rows of x and NR rows of w: lanes 0-7 of every dot in one pass over k (`lo`),
// lanes 8-15 in a second pass (`hi`). Lanes 0-7 and 8-15 never interact before the final tree,
// so each pass keeps the whole tile in registers and shares each load among the MR * NR dots.
// Per lane, exactly Dot's FMAs in Dot's order. x rows are ldx floats apart and w rows ldw apart
// (both k for a plain MatMul; longer when the tile reads one K segment of wider rows).
template <int MR, int NR>
inline __attribute__((always_inline)) void AccumulateTile(const float* x, int64_t ldx,
                                                          const float* w, int64_t ldw,
                                                          int64_t k_full, Float8 (&lo)[MR][NR],
                                                          Float8 (&hi)[MR][NR]) {
  for (int half = 0; half < 2; ++half) {
    Float8(&sum)[MR][NR] = half == 0 ? lo : hi;
    for (int r = 0; r < MR; ++r) {
      for (int c = 0; c < NR; ++c) sum[r][c] = Float8{};
    }
    for (int64_t i = half * 8; i < k_full; i += kLanes) {
      Float8 wv[NR];
      for (int c = 0; c < NR; ++c) wv[c] = Load8(w + c * ldw + i);
      for (int r = 0; r < MR; ++r) {
        const Float8 xv = Load8(x + r * ldx + i);
        for (int c = 0; c < NR; ++c) sum[r][c] = Fma8(xv, wv[c], sum[r][c]);
      }
    }
  }
}

// y[r, c] = Dot(x[r], w[c], k) (+ bias[c]) for MR rows of x and NR rows of w: AccumulateTile,
// then each dot's tail and 16-lane tree (FinishDot).
template <int MR, int NR>
void DotTile(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t k, const float* bias,
             float* y, int64_t ldy) {
  const int64_t k_full = k / kLanes * kLanes;
  Float8 lo[MR][NR], hi[MR][NR];
  AccumulateTile<MR, NR>(x, ldx, w, ldw, k_full, lo, hi);
  for (int r = 0; r < MR; ++r) {
    for (int c = 0; c < NR; ++c) {
      float d = FinishDot(lo[r][c], hi[r][c], x + r * ldx, w + c * ldw, k_full, k);
      if (bias != nullptr) d += bias[c];
      y[r * ldy + c] = d;
    }
  }
}

// The register tile: 12 accumulators plus the loaded x and w vectors fill the 16 AVX registers.
// Measured on Zen 5 (k = 256, n = 4096, one thread): 4x3 and 3x3 ~70 GFLOP/s, 3x4, 5x2 and 6x2
// ~62, 4x2 and 2x4 slower; 4x3 shares each load most.
constexpr int kTileRows = 4;
constexpr int kTileCols = 3;

using DotTileFn = void (*)(const float*, int64_t, const float*, int64_t, int64_t, const float*,
                           float*, int64_t);

// kTileFns[mr - 1][nr - 1] handles the edge tiles of a matrix whose sides are not multiples of
// the tile.
constexpr DotTileFn kTileFns[kTileRows][kTileCols] = {
    {DotTile<1, 1>, DotTile<1, 2>, DotTile<1, 3>},
    {DotTile<2, 1>, DotTile<2, 2>, DotTile<2, 3>},
    {DotTile<3, 1>, DotTile<3, 2>, DotTile<3, 3>},
    {DotTile<4, 1>, DotTile<4, 2>, DotTile<4, 3>},
};

// Columns of one cache panel: its weight rows (about 128 KiB) stay in L2 while every row block
// of x walks across them, and each row block stays in L1 while it does.
constexpr int64_t kPanelBytes = 128 * 1024;
// Smallest work (multiply-adds) worth handing to another thread.
constexpr int64_t kMinChunkMacs = 32 * 1024;

// Columns [col_begin, col_end) of y for all m rows.
// Calls tile(r0, mr, c0, nr) for the register tiles of columns [col_begin, col_end) of an
// [m, *] output, panel by panel, for operand rows of `k` floats.
template <typename TileFn>
void ForEachTile(int64_t m, int64_t k, int64_t col_begin, int64_t col_end, TileFn tile) {
  const int64_t row_bytes = std::max<int64_t>(k, 1) * static_cast<int64_t>(sizeof(float));
  const int64_t panel =
      std::max<int64_t>(kTileCols, kPanelBytes / row_bytes / kTileCols * kTileCols);
  for (int64_t p0 = col_begin; p0 < col_end; p0 += panel) {
    const int64_t p1 = std::min(col_end, p0 + panel);
    for (int64_t r0 = 0; r0 < m; r0 += kTileRows) {
      const int64_t mr = std::min<int64_t>(kTileRows, m - r0);
      for (int64_t c0 = p0; c0 < p1; c0 += kTileCols) {
        tile(r0, mr, c0, std::min<int64_t>(kTileCols, p1 - c0));
      }
    }
  }
}

void MatMulColumns(const float* x, int64_t m, int64_t k, const float* w, int64_t n,
                   const float* bias, float* y, int64_t col_begin, int64_t col_end) {
  ForEachTile(m, k, col_begin, col_end, [&](int64_t r0, int64_t mr, int64_t c0, int64_t nr) {
    kTileFns[mr - 1][nr - 1](x + r0 * k, k, w + c0 * k, k, k, bias == nullptr ? nullptr : bias + c0,
                             y + r0 * n + c0, n);
  });
}

// In place: vals[0] becomes the canonical tree's value of `count` (a power of two) adjacent
// node values of `stride`-spaced runs of `width` floats, combined as adjacent pairs level by level:
// (v0 + v1), (v2 + v3), ... then ((v0 + v1) + (v2 + v3)), ...
inline void TreeCombine(float* vals, int count, int64_t stride, int64_t width) {
  for (int span = 1; span < count; span *= 2) {
    for (int i = 0; i + span < count; i += 2 * span) {
      float* a = vals + i * stride;
      const float* b = vals + (i + span) * stride;
      for (int64_t j = 0; j < width; ++j) a[j] = a[j] + b[j];
    }
  }
}

#if defined(__clang__)
#define ROLLOUT_SHUFFLE8(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
typedef int Int8 __attribute__((vector_size(32)));
#define ROLLOUT_SHUFFLE8(a, b, ...) __builtin_shuffle(a, b, Int8{__VA_ARGS__})
#endif

// FinishDot without a tail for 8 dot products at once: s8[j] = lanes 0-7 + lanes 8-15 of dot j.
// Per dot exactly FinishDot's additions, with the same operands in the same order (s4[l] =
// s8[l] + s8[l + 4]; s2_0 = s4[0] + s4[2], s2_1 = s4[1] + s4[3]; s2_0 + s2_1) -- only
// transposed so each add serves 2, 4 or 8 dots. Dot j ends in lane kFinishLane[j].
constexpr int kFinishLane[8] = {0, 4, 1, 5, 2, 6, 3, 7};
inline __attribute__((always_inline)) Float8 FinishDots8(const Float8* s8) {
  auto s4 = [](const Float8& a, const Float8& b) {  // [s4 of a, s4 of b]
    return ROLLOUT_SHUFFLE8(a, b, 0, 1, 2, 3, 8, 9, 10, 11) +
           ROLLOUT_SHUFFLE8(a, b, 4, 5, 6, 7, 12, 13, 14, 15);
  };
  auto s2 = [](const Float8& a, const Float8& b) {  // from [a0, a1], [b0, b1]: s2 of a0, b0, a1, b1
    return ROLLOUT_SHUFFLE8(a, b, 0, 1, 8, 9, 4, 5, 12, 13) +
           ROLLOUT_SHUFFLE8(a, b, 2, 3, 10, 11, 6, 7, 14, 15);
  };
  const Float8 s2_0123 = s2(s4(s8[0], s8[1]), s4(s8[2], s8[3]));  // dots 0, 2, 1, 3
  const Float8 s2_4567 = s2(s4(s8[4], s8[5]), s4(s8[6], s8[7]));  // dots 4, 6, 5, 7
  return ROLLOUT_SHUFFLE8(s2_0123, s2_4567, 0, 2, 8, 10, 4, 6, 12, 14) +
         ROLLOUT_SHUFFLE8(s2_0123, s2_4567, 1, 3, 9, 11, 5, 7, 13, 15);  // 0, 2, 4, 6, 1, 3, 5, 7
}
#undef ROLLOUT_SHUFFLE8

// The tree node over `num_segments` canonical K segments for MR rows of x and NR rows of w:
// x and w point at the first segment's first column (rows ldx and ldw floats apart), seg[i] and
// seg[i + 1] bound segment i relative to that. Per segment, exactly DotTile's arithmetic (so
// each leaf is Dot of the segment: lanes 0-7 in one pass, 8-15 in another, then the tail and
// the 16-lane tree of FinishDot -- for the tile's dots at once when there is no tail); then the
// leaves meet in the fixed pairwise tree. One call per tile, not one DotTile per segment, and
// the batched finish keep short segments (K / 8 = 32 on small models) affordable.
template <int MR, int NR>
void SegmentedTile(const float* x, int64_t ldx, const float* w, int64_t ldw, const int64_t* seg,
                   int num_segments, const float* bias, float* y, int64_t ldy) {
  constexpr int kDots = MR * NR;            // dot j = (r, c) with j = r * NR + c
  constexpr int kGroups = (kDots + 7) / 8;  // of 8 dots
  // leaves[s][g * 8 + kFinishLane[i]]: the leaf of dot g * 8 + i in segment s.
  alignas(32) float leaves[kNumKSegments][kGroups * 8];
  for (int s = 0; s < num_segments; ++s) {
    const float* xs = x + seg[s];
    const float* ws = w + seg[s];
    const int64_t k = seg[s + 1] - seg[s];
    const int64_t k_full = k / kLanes * kLanes;
    Float8 lanes_lo[MR][NR], sum[MR][NR];  // lanes 0-7 and 8-15 of each dot
    AccumulateTile<MR, NR>(xs, ldx, ws, ldw, k_full, lanes_lo, sum);
    if (k_full == k) {
      Float8 s8[kGroups * 8];
      for (int j = 0; j < kGroups * 8; ++j) {
        s8[j] = j < kDots ? lanes_lo[j / NR][j % NR] + sum[j / NR][j % NR] : Float8{};
      }
      for (int g = 0; g < kGroups; ++g) {
        const Float8 finished = FinishDots8(s8 + g * 8);
        std::memcpy(&leaves[s][g * 8], &finished, sizeof(finished));
      }
    } else {
      for (int j = 0; j < kDots; ++j) {
        const int r = j / NR, c = j % NR;
        leaves[s][j / 8 * 8 + kFinishLane[j % 8]] =
            FinishDot(lanes_lo[r][c], sum[r][c], xs + r * ldx, ws + c * ldw, k_full, k);
      }
    }
  }
  // Adjacent pairs, level by level: node [i, i + 2 * span) = node [i, i + span) + its neighbour.
  for (int span = 1; span < num_segments; span *= 2) {
    for (int i = 0; i + span < num_segments; i += 2 * span) {
      for (int l = 0; l < kGroups * 8; ++l) leaves[i][l] = leaves[i][l] + leaves[i + span][l];
    }
  }
  for (int j = 0; j < kDots; ++j) {
    const int r = j / NR, c = j % NR;
    float d = leaves[0][j / 8 * 8 + kFinishLane[j % 8]];
    if (bias != nullptr) d += bias[c];
    y[r * ldy + c] = d;
  }
}

using SegmentedTileFn = void (*)(const float*, int64_t, const float*, int64_t, const int64_t*, int,
                                 const float*, float*, int64_t);
constexpr SegmentedTileFn kSegmentedTileFns[kTileRows][kTileCols] = {
    {SegmentedTile<1, 1>, SegmentedTile<1, 2>, SegmentedTile<1, 3>},
    {SegmentedTile<2, 1>, SegmentedTile<2, 2>, SegmentedTile<2, 3>},
    {SegmentedTile<3, 1>, SegmentedTile<3, 2>, SegmentedTile<3, 3>},
    {SegmentedTile<4, 1>, SegmentedTile<4, 2>, SegmentedTile<4, 3>},
};

// Columns [col_begin, col_end) of the tree node over canonical K segments [seg_begin, seg_end):
// x: [m, k_slice], w: [n, k_slice] hold the columns [KSegmentBegin(k_full, seg_begin),
// KSegmentBegin(k_full, seg_end)) of the full operands.
void SegmentedColumns(const float* x, int64_t m, const float* w, int64_t n, int64_t k_full,
                      int seg_begin, int seg_end, const float* bias, float* y, int64_t col_begin,
                      int64_t col_end) {
  const int num_segments = seg_end - seg_begin;
  int64_t seg[kNumKSegments + 1];  // segment bounds relative to the slice
  for (int s = 0; s <= num_segments; ++s) {
    seg[s] = KSegmentBegin(k_full, seg_begin + s) - KSegmentBegin(k_full, seg_begin);
  }
  const int64_t k_slice = seg[num_segments];
  ForEachTile(m, k_slice, col_begin, col_end, [&](int64_t r0, int64_t mr, int64_t c0, int64_t nr) {
    kSegmentedTileFns[mr - 1][nr - 1](x + r0 * k_slice, k_slice, w + c0 * k_slice, k_slice, seg,
                                      num_segments, bias == nullptr ? nullptr : bias + c0,
                                      y + r0 * n + c0, n);
  });
}

}  // namespace

float Dot(const float* a, const float* b, int64_t n) {
  float acc[kLanes] = {};
  const int64_t n_full = n / kLanes * kLanes;
  for (int64_t i = 0; i < n_full; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) acc[l] = std::fma(a[i + l], b[i + l], acc[l]);
  }
  Float8 lo, hi;
  std::memcpy(&lo, acc, sizeof(lo));
  std::memcpy(&hi, acc + 8, sizeof(hi));
  return FinishDot(lo, hi, a, b, n_full, n);
}

void MatMul(ThreadPool* pool, const float* x, int64_t m, int64_t k, const float* w, int64_t n,
            const float* bias, float* y) {
  if (m <= 0 || n <= 0) return;
  // Threads split output columns in whole tile widths; every element's arithmetic is fixed by
  // DotTile, so neither the split nor m can change a bit.
  const int64_t num_groups = (n + kTileCols - 1) / kTileCols;
  const int64_t macs_per_group = std::max<int64_t>(1, m * k * kTileCols);
  const int64_t grain = std::max<int64_t>(1, kMinChunkMacs / macs_per_group);
  auto columns = [&](int64_t g0, int64_t g1) {
    MatMulColumns(x, m, k, w, n, bias, y, g0 * kTileCols, std::min(n, g1 * kTileCols));
  };
  if (pool == nullptr) {
    columns(0, num_groups);
  } else {
    pool->ParallelFor(num_groups, grain, columns);
  }
}

bool IsCanonicalSegmentBlock(int seg_begin, int seg_end) {
  const int size = seg_end - seg_begin;
  return seg_begin >= 0 && seg_end <= kNumKSegments && size > 0 && (size & (size - 1)) == 0 &&
         seg_begin % size == 0;
}

void SegmentedPartialMatMul(ThreadPool* pool, const float* x, int64_t m, const float* w, int64_t n,
                            int64_t k_full, int seg_begin, int seg_end, float* y) {
  if (m <= 0 || n <= 0) return;
  // Same column split as MatMul: a column's arithmetic is fixed, whoever computes it.
  const int64_t k_slice = KSegmentBegin(k_full, seg_end) - KSegmentBegin(k_full, seg_begin);
  const int64_t num_groups = (n + kTileCols - 1) / kTileCols;
  const int64_t macs_per_group = std::max<int64_t>(1, m * k_slice * kTileCols);
  const int64_t grain = std::max<int64_t>(1, kMinChunkMacs / macs_per_group);
  auto columns = [&](int64_t g0, int64_t g1) {
    SegmentedColumns(x, m, w, n, k_full, seg_begin, seg_end, nullptr, y, g0 * kTileCols,
                     std::min(n, g1 * kTileCols));
  };
  if (pool == nullptr) {
    columns(0, num_groups);
  } else {
    pool->ParallelFor(num_groups, grain, columns);
  }
}

void SegmentedMatMul(ThreadPool* pool, const float* x, int64_t m, int64_t k, const float* w,
                     int64_t n, const float* bias, float* y) {
  if (m <= 0 || n <= 0) return;
  const int64_t num_groups = (n + kTileCols - 1) / kTileCols;
  const int64_t macs_per_group = std::max<int64_t>(1, m * k * kTileCols);
  const int64_t grain = std::max<int64_t>(1, kMinChunkMacs / macs_per_group);
  auto columns = [&](int64_t g0, int64_t g1) {
    SegmentedColumns(x, m, w, n, k, 0, kNumKSegments, bias, y, g0 * kTileCols,
                     std::min(n, g1 * kTileCols));
  };
  if (pool == nullptr) {
    columns(0, num_groups);
  } else {
    pool->ParallelFor(num_groups, grain, columns);
  }
}

void CombinePartials(const float* parts, int num_parts, int64_t count, float* y) {
  // In chunks: the parts' columns are copied side by side, then each tree level is one
  // contiguous (vectorisable) add; per element the same additions in the same order.
  constexpr int64_t kChunk = 512;
  alignas(32) float buf[kNumKSegments * kChunk];
  for (int64_t j0 = 0; j0 < count; j0 += kChunk) {
    const int64_t width = std::min(kChunk, count - j0);
    for (int i = 0; i < num_parts; ++i) {
      std::memcpy(buf + i * kChunk, parts + i * count + j0, width * sizeof(float));
    }
    TreeCombine(buf, num_parts, kChunk, width);
    std::memcpy(y + j0, buf, width * sizeof(float));
  }
}

void RmsNorm(const float* x, const float* weight, int64_t rows, int64_t dim, float eps, float* y) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * dim;
    float* yr = y + r * dim;
    const float mean = Dot(xr, xr, dim) / static_cast<float>(dim);
    const float inv_rms = 1.0f / std::sqrt(mean + eps);
    for (int64_t i = 0; i < dim; ++i) {
      const float scaled = xr[i] * inv_rms;
      yr[i] = scaled * weight[i];
    }
  }
}

void ApplyRope(float* x, const float* cos, const float* sin, int64_t num_tokens,
               int64_t num_heads, int64_t head_dim) {
  const int64_t half = head_dim / 2;
  for (int64_t t = 0; t < num_tokens; ++t) {
    float* xt = x + t * num_heads * head_dim;  // [num_heads, head_dim]
    for (int64_t i = 0; i < half; ++i) {
      const float cos_a = cos[t * half + i];
      const float sin_a = sin[t * half + i];
      for (int64_t h = 0; h < num_heads; ++h) {
        float* xh = xt + h * head_dim;
        const float x1 = xh[i];
        const float x2 = xh[i + half];
        // The second product is rounded, the first fused into the sum: written out so the
        // compiler cannot pick a different contraction.
        xh[i] = std::fma(x1, cos_a, -(x2 * sin_a));
        xh[i + half] = std::fma(x2, cos_a, x1 * sin_a);
      }
    }
  }
}

void SiluMul(const float* gate_up, int64_t rows, int64_t dim, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* gate = gate_up + r * 2 * dim;
    const float* up = gate + dim;
    float* o = out + r * dim;
    for (int64_t i = 0; i < dim; ++i) {
      const float g = gate[i];
      const float silu = g / (1.0f + std::exp(-g));
      o[i] = silu * up[i];
    }
  }
}

void Add(float* x, const float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] += y[i];
}

namespace {

// Offset in floats of (position, kv head) in one of the cache's [num_blocks, block_size,
// num_kv_heads, head_dim] arrays, for a sequence with block table `table`.
inline int64_t SlotOffset(const KvCacheLayer& cache, const int32_t* table, int64_t position,
                          int64_t kv_head) {
  const int64_t block = table[position / cache.block_size];
  const int64_t slot = block * cache.block_size + position % cache.block_size;
  return (slot * cache.num_kv_heads + kv_head) * cache.head_dim;
}

// Below this many multiply-adds a whole attention call runs on the calling thread.
constexpr int64_t kMinParallelAttentionMacs = 16 * 1024;

}  // namespace

void WriteKv(const float* k, const float* v, const TokenSlots& slots, KvCacheLayer cache) {
  const int64_t row = cache.num_kv_heads * cache.head_dim;  // floats per token
  for (int64_t t = 0; t < slots.num_tokens; ++t) {
    const int64_t offset = SlotOffset(cache, slots.block_tables[t], slots.positions[t], 0);
    std::memcpy(cache.k + offset, k + t * row, row * sizeof(float));
    std::memcpy(cache.v + offset, v + t * row, row * sizeof(float));
  }
}

void PagedAttention(ThreadPool* pool, const float* q, const TokenSlots& slots, int64_t num_heads,
                    KvCacheLayer cache, float scale, float* out) {
  const int64_t head_dim = cache.head_dim;
  const int64_t group = num_heads / cache.num_kv_heads;  // query heads per kv head
  const int64_t num_rows = slots.num_tokens * num_heads;
  if (num_rows <= 0) return;

  // One (token, head) row per index: rows are independent, so any split gives the same bits.
  auto rows = [&](int64_t row_begin, int64_t row_end) {
    int64_t max_len = 0;
    for (int64_t r = row_begin; r < row_end; ++r) {
      max_len = std::max<int64_t>(max_len, slots.positions[r / num_heads] + 1);
    }
    std::vector<float> weights(max_len);  // per-chunk scratch: s_j, then w_j
    for (int64_t r = row_begin; r < row_end; ++r) {
      const int64_t t = r / num_heads;
      const int64_t kv_head = (r % num_heads) / group;
      const int64_t len = static_cast<int64_t>(slots.positions[t]) + 1;
      const int32_t* table = slots.block_tables[t];
      const float* qr = q + r * head_dim;  // [head_dim]
      float* o = out + r * head_dim;       // [head_dim]

      float max_score = -INFINITY;
      for (int64_t j = 0; j < len; ++j) {
        const float s = Dot(qr, cache.k + SlotOffset(cache, table, j, kv_head), head_dim) * scale;
        weights[j] = s;
        max_score = std::max(max_score, s);
      }
      float denom = 0.0f;
      for (int64_t j = 0; j < len; ++j) {
        const float wj = std::exp(weights[j] - max_score);
        weights[j] = wj;
        denom += wj;
      }
      std::fill(o, o + head_dim, 0.0f);
      for (int64_t j = 0; j < len; ++j) {
        const float wj = weights[j];
        const float* vj = cache.v + SlotOffset(cache, table, j, kv_head);
        for (int64_t d = 0; d < head_dim; ++d) o[d] = std::fma(wj, vj[d], o[d]);
      }
      for (int64_t d = 0; d < head_dim; ++d) o[d] /= denom;
    }
  };

  int64_t total_macs = 0;
  for (int64_t t = 0; t < slots.num_tokens; ++t) {
    total_macs += (static_cast<int64_t>(slots.positions[t]) + 1) * num_heads * head_dim * 2;
  }
  if (pool == nullptr || total_macs < kMinParallelAttentionMacs) {
    rows(0, num_rows);
  } else {
    pool->ParallelFor(num_rows, 1, rows);
  }
}

}  // namespace rollout::cpu
