#pragma once
// The tensor-core paged attention before its staging rework (issue #4), kept as
// rollout-attention-bench's reference for bits and speed; included by attention_bench.cu only,
// which is built with --fmad=false like the kernel library.

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/ops.h"

// kernels/cuda/attention_mma.cu as of commit 6c20307, verbatim but for this namespace and the
// dispatch at its end: q staged in shared memory, each 32-key tile copied with cp.async and
// waited for before its math.
namespace rollout::old_v2 {

using cuda::AttentionBlockShape;
using cuda::AttentionParams;
using cuda::bf16;
using cuda::KvCacheView;

constexpr int kTile = cuda::kAttentionTile;  // keys per tile

__device__ __forceinline__ void Mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two 8x8 bf16 matrices, transposed into the B fragment of m16n8k16: lanes 0-15 give the row
// addresses (rows 0-7 of matrix 0, then of matrix 1).
__device__ __forceinline__ void LdMatrixX2Trans(uint32_t* r0, uint32_t* r1, const bf16* row) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(*r0), "=r"(*r1)
               : "r"(addr));
}

// 16 bytes global -> shared, asynchronously; zero-filled when !valid (src is then not read).
__device__ __forceinline__ void CpAsync16(void* dst, const void* src, bool valid) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(addr), "l"(src),
               "r"(src_bytes));
}

__device__ __forceinline__ void CpAsyncWaitAll() {
  asm volatile("cp.async.commit_group;\n" ::);
  asm volatile("cp.async.wait_group 0;\n" ::);
}

__device__ __forceinline__ uint32_t PackBf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// The quad (4 lanes of one MMA row) reductions, in one fixed order.
__device__ __forceinline__ float QuadMax(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float QuadSum(float v) {
  v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

template <int kHeadDim, int kWarps>
struct MmaSmem {
  static constexpr int kStride = kHeadDim + 8;  // bf16 per staged row: 16 B pad, no conflicts
  static constexpr int kRows = 16 * kWarps;
  static constexpr size_t kBytes = sizeof(bf16) * kStride * (kRows + 2 * kTile);
};

// The online-softmax update of one row for one tile: s[8] are the thread's scores of the row
// (keys 8j + 2t + {0, 1}, j = 0..3), already masked; p[8] receives the probabilities.
__device__ __forceinline__ float RowUpdate(const float (&s)[8], float* m, float* l, float (&p)[8]) {
  float tile_max = s[0];
#pragma unroll
  for (int i = 1; i < 8; ++i) tile_max = fmaxf(tile_max, s[i]);
  tile_max = QuadMax(tile_max);
  const float m_new = fmaxf(*m, tile_max);
  // A row with no key so far (only padding rows) stays at m = -inf with p = 0, o untouched.
  const bool none = m_new == -INFINITY;
  const float alpha = none ? 1.0f : expf(*m - m_new);
  float sum = 0.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    p[i] = (none || s[i] == -INFINITY) ? 0.0f : expf(s[i] - m_new);
    sum = sum + p[i];
  }
  *l = *l * alpha + QuadSum(sum);
  *m = m_new;
  return alpha;
}

template <int kHeadDim, int kWarps>
__global__ void __launch_bounds__(kWarps * 32)
    MmaAttentionKernel(AttentionParams p, KvCacheView cache) {
  using Smem = MmaSmem<kHeadDim, kWarps>;
  constexpr int kStride = Smem::kStride;
  constexpr int kSteps = kHeadDim / 16;    // k-steps of Q K^T
  constexpr int kDimTiles = kHeadDim / 8;  // n-tiles of P V
  constexpr int kChunks = kHeadDim / 8;    // 16-byte chunks per key
  extern __shared__ uint4 smem[];
  bf16* q_s = reinterpret_cast<bf16*>(smem);  // [16 * kWarps, kStride]
  bf16* k_s = q_s + Smem::kRows * kStride;    // [kTile, kStride]
  bf16* v_s = k_s + kTile * kStride;          // [kTile, kStride]

  const int2 item = p.items[blockIdx.x];  // (first token, count)
  const int kv_head = blockIdx.y;
  const int split = blockIdx.z;
  const int num_kv_heads = cache.num_kv_heads;
  const int group = p.num_heads / num_kv_heads;
  const int num_rows = item.y * group;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t4 = lane % 4;

  int max_pos = 0;
  for (int i = 0; i < item.y; ++i) max_pos = max(max_pos, p.positions[item.x + i]);
  const int walk_begin = split * p.split_size;
  const int walk_end = min(max_pos + 1, walk_begin + p.split_size);
  if (walk_begin >= walk_end) return;  // idle split: block-uniform, before any barrier
  const int32_t* table = p.tables + p.table_offsets[item.x];

  // Query rows as bf16; row r = (token item.x + r / group, head kv_head * group + r % group).
  for (int i = threadIdx.x; i < Smem::kRows * (kHeadDim / 4); i += kWarps * 32) {
    const int r = i / (kHeadDim / 4);
    const int c = i % (kHeadDim / 4);
    float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (r < num_rows) {
      const int64_t t = item.x + r / group;
      const int h = kv_head * group + r % group;
      v = reinterpret_cast<const float4*>(p.q + (t * p.num_heads + h) * kHeadDim)[c];
    }
    __nv_bfloat162* dst = reinterpret_cast<__nv_bfloat162*>(q_s + r * kStride + 4 * c);
    dst[0] = __floats2bfloat162_rn(v.x, v.y);
    dst[1] = __floats2bfloat162_rn(v.z, v.w);
  }
  // This thread's two rows: g and g + 8 of the warp's 16.
  const int r0 = warp * 16 + g, r1 = r0 + 8;
  const int pos0 = r0 < num_rows ? p.positions[item.x + r0 / group] : -1;
  const int pos1 = r1 < num_rows ? p.positions[item.x + r1 / group] : -1;
  int warp_max_pos = max(pos0, pos1);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    warp_max_pos = max(warp_max_pos, __shfl_xor_sync(0xffffffffu, warp_max_pos, o));
  }
  __syncthreads();

  uint32_t qa[kSteps][4];  // A fragments of the warp's 16 query rows
  {
    const bf16* q0 = q_s + r0 * kStride + 2 * t4;
    const bf16* q1 = q_s + r1 * kStride + 2 * t4;
#pragma unroll
    for (int kk = 0; kk < kSteps; ++kk) {
      qa[kk][0] = *reinterpret_cast<const uint32_t*>(q0 + 16 * kk);
      qa[kk][1] = *reinterpret_cast<const uint32_t*>(q1 + 16 * kk);
      qa[kk][2] = *reinterpret_cast<const uint32_t*>(q0 + 16 * kk + 8);
      qa[kk][3] = *reinterpret_cast<const uint32_t*>(q1 + 16 * kk + 8);
    }
  }

  float o[kDimTiles][4];
#pragma unroll
  for (int n = 0; n < kDimTiles; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;

  for (int tile_start = walk_begin; tile_start < walk_end; tile_start += kTile) {
    __syncthreads();  // every warp is done with the previous tile
    for (int i = threadIdx.x; i < kTile * kChunks; i += kWarps * 32) {
      const int j = i / kChunks;
      const int c = i % kChunks;
      const int key = tile_start + j;
      const bool valid = key <= max_pos;
      int64_t offset = 0;
      if (valid) {
        const int64_t slot =
            static_cast<int64_t>(table[key / cache.block_size]) * cache.block_size +
            key % cache.block_size;
        offset = cuda::KvOffset(slot, kv_head, cache.block_size, num_kv_heads, kHeadDim) + c * 8;
      }
      CpAsync16(k_s + j * kStride + c * 8, cache.k + offset, valid);
      CpAsync16(v_s + j * kStride + c * 8, cache.v + offset, valid);
    }
    CpAsyncWaitAll();
    __syncthreads();
    if (tile_start > warp_max_pos) continue;  // warp-uniform: no row of this warp reaches it

    // S = Q K^T: key tile j (keys 8j..8j+7), dims in increasing k-steps.
    float acc[4][4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
      const bf16* k_row = k_s + (8 * j + g) * kStride + 2 * t4;
#pragma unroll
      for (int kk = 0; kk < kSteps; ++kk) {
        const uint32_t b0 = *reinterpret_cast<const uint32_t*>(k_row + 16 * kk);
        const uint32_t b1 = *reinterpret_cast<const uint32_t*>(k_row + 16 * kk + 8);
        Mma16816(acc[j], qa[kk], b0, b1);
      }
    }
    float s0[8], s1[8];  // rows g and g + 8: keys 8j + 2 t4 + {0, 1}
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int key = tile_start + 8 * j + 2 * t4 + c;
        s0[2 * j + c] = key <= pos0 ? acc[j][c] * p.scale : -INFINITY;
        s1[2 * j + c] = key <= pos1 ? acc[j][2 + c] * p.scale : -INFINITY;
      }
    }
    float p0[8], p1[8];
    const float alpha0 = RowUpdate(s0, &m0, &l0, p0);
    const float alpha1 = RowUpdate(s1, &m1, &l1, p1);
#pragma unroll
    for (int n = 0; n < kDimTiles; ++n) {
      o[n][0] = o[n][0] * alpha0;
      o[n][1] = o[n][1] * alpha0;
      o[n][2] = o[n][2] * alpha1;
      o[n][3] = o[n][3] * alpha1;
    }
    // P as A fragments of the two 16-key chunks (the S accumulator layout is the A layout).
    uint32_t pa[2][4];
#pragma unroll
    for (int kc = 0; kc < 2; ++kc) {
      pa[kc][0] = PackBf16(p0[4 * kc + 0], p0[4 * kc + 1]);
      pa[kc][1] = PackBf16(p1[4 * kc + 0], p1[4 * kc + 1]);
      pa[kc][2] = PackBf16(p0[4 * kc + 2], p0[4 * kc + 3]);
      pa[kc][3] = PackBf16(p1[4 * kc + 2], p1[4 * kc + 3]);
    }
    // O += P V: dim tile n, key chunks in increasing order.
#pragma unroll
    for (int n = 0; n < kDimTiles; ++n) {
#pragma unroll
      for (int kc = 0; kc < 2; ++kc) {
        uint32_t b0, b1;
        LdMatrixX2Trans(&b0, &b1, v_s + (16 * kc + lane % 16) * kStride + 8 * n);
        Mma16816(o[n], pa[kc], b0, b1);
      }
    }
  }

  // This split's partial of each real row with keys in it.
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = half == 0 ? r0 : r1;
    const int pos = half == 0 ? pos0 : pos1;
    if (pos < walk_begin) continue;  // padding row, or no key of this split
    const int64_t row =
        (item.x + r / group) * static_cast<int64_t>(p.num_heads) + kv_head * group + r % group;
    float* dst = p.partials + (row * p.max_splits + split) * (kHeadDim + 2);
    if (t4 == 0) {
      dst[0] = half == 0 ? m0 : m1;
      dst[1] = half == 0 ? l0 : l1;
    }
#pragma unroll
    for (int n = 0; n < kDimTiles; ++n) {
      dst[2 + 8 * n + 2 * t4] = o[n][2 * half];
      dst[2 + 8 * n + 2 * t4 + 1] = o[n][2 * half + 1];
    }
  }
}

template <int kHeadDim, int kWarps>
cudaError_t LaunchMma(const AttentionParams& p, KvCacheView cache, cudaStream_t stream) {
  constexpr size_t kSmem = MmaSmem<kHeadDim, kWarps>::kBytes;
  auto kernel = MmaAttentionKernel<kHeadDim, kWarps>;
  if (kSmem > 48 * 1024) {
    const cudaError_t err =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
    if (err != cudaSuccess) return err;
  }
  const dim3 grid(static_cast<unsigned>(p.num_items), static_cast<unsigned>(cache.num_kv_heads),
                  static_cast<unsigned>(p.max_splits));
  kernel<<<grid, kWarps * 32, kSmem, stream>>>(p, cache);
  return cudaGetLastError();
}

inline cudaError_t PagedAttentionMma(const AttentionParams& p, AttentionBlockShape shape,
                                     KvCacheView cache, cudaStream_t stream) {
  const int group = p.num_heads / cache.num_kv_heads;
  const bool one = shape == AttentionBlockShape::kOneToken && group <= 16;
  switch (cache.head_dim) {
    case 32:
      return one ? LaunchMma<32, 1>(p, cache, stream) : LaunchMma<32, 4>(p, cache, stream);
    case 64:
      return one ? LaunchMma<64, 1>(p, cache, stream) : LaunchMma<64, 4>(p, cache, stream);
    case 128:
      return one ? LaunchMma<128, 1>(p, cache, stream) : LaunchMma<128, 4>(p, cache, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace rollout::old_v2
