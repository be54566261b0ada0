// RMSNorm of hidden rows, and the attention input stage (bias, q/k RMSNorm, RoPE, KV write).
#include "kernels/cuda/ops.h"
#include "kernels/cuda/warp_reduce.cuh"

namespace rollout::cuda {
namespace {

// A constant of the kernel, never chosen from the batch: it fixes the reduction order.
constexpr int kNormThreads = 256;
constexpr int kNormWarps = kNormThreads / 32;

__global__ void __launch_bounds__(kNormThreads)
    RmsNormKernel(const float* x, const int32_t* rows, int64_t dim, const float* weight, float eps,
                  bf16* y) {
  const int64_t r = blockIdx.x;
  const int64_t src = rows != nullptr ? rows[r] : r;
  const float4* xr = reinterpret_cast<const float4*>(x + src * dim);  // [dim / 4]
  const int64_t n4 = dim / 4;
  float ss = 0.0f;
  for (int64_t i = threadIdx.x; i < n4; i += kNormThreads) {
    const float4 v = xr[i];
    ss = fmaf(v.x, v.x, ss);
    ss = fmaf(v.y, v.y, ss);
    ss = fmaf(v.z, v.z, ss);
    ss = fmaf(v.w, v.w, ss);
  }
  ss = WarpSum(ss);
  __shared__ float warp_sums[kNormWarps];
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = ss;
  __syncthreads();
  float total = 0.0f;
#pragma unroll
  for (int w = 0; w < kNormWarps; ++w) total += warp_sums[w];
  const float inv_rms = 1.0f / sqrtf(total / static_cast<float>(dim) + eps);
  const float4* w4 = reinterpret_cast<const float4*>(weight);
  __nv_bfloat162* yr = reinterpret_cast<__nv_bfloat162*>(y + r * dim);
  for (int64_t i = threadIdx.x; i < n4; i += kNormThreads) {
    const float4 v = xr[i];
    const float4 w = w4[i];
    yr[2 * i] = __floats2bfloat162_rn((v.x * inv_rms) * w.x, (v.y * inv_rms) * w.y);
    yr[2 * i + 1] = __floats2bfloat162_rn((v.z * inv_rms) * w.z, (v.w * inv_rms) * w.w);
  }
}

constexpr int kQkvWarpsPerBlock = 8;

// One warp per (token, head) of q|k|v; lane l holds dims [l * E, (l + 1) * E), so the RoPE
// partner of dim i < head_dim / 2 (i + head_dim / 2) sits in lane l + 16 at the same slot.
template <int kHeadDim>
__global__ void __launch_bounds__(kQkvWarpsPerBlock * 32)
    QkvNormRopeKernel(QkvParams p, KvCacheView cache) {
  constexpr int E = kHeadDim / 32;
  constexpr int kHalf = kHeadDim / 2;
  const int lane = threadIdx.x % 32;
  const int heads = p.num_heads + 2 * cache.num_kv_heads;
  const int64_t w = static_cast<int64_t>(blockIdx.x) * kQkvWarpsPerBlock + threadIdx.x / 32;
  if (w >= p.num_tokens * heads) return;  // whole warps only
  const int64_t t = w / heads;
  const int h = static_cast<int>(w % heads);
  const bool is_q = h < p.num_heads;
  const bool is_k = !is_q && h < p.num_heads + cache.num_kv_heads;
  const float* src = p.qkv + w * kHeadDim + lane * E;  // [E]

  float x[E];
#pragma unroll
  for (int e = 0; e < E; ++e) x[e] = src[e];
  const float* bias = is_q ? p.q_bias : (is_k ? p.k_bias : p.v_bias);
  if (bias != nullptr) {
    const int head_in_part =
        is_q ? h : (is_k ? h - p.num_heads : h - p.num_heads - cache.num_kv_heads);
#pragma unroll
    for (int e = 0; e < E; ++e) x[e] = x[e] + bias[head_in_part * kHeadDim + lane * E + e];
  }
  if (is_q || is_k) {
    const float* norm = is_q ? p.q_norm : p.k_norm;
    if (norm != nullptr) {
      float ss = 0.0f;
#pragma unroll
      for (int e = 0; e < E; ++e) ss = fmaf(x[e], x[e], ss);
      ss = WarpSum(ss);
      const float inv_rms = 1.0f / sqrtf(ss / static_cast<float>(kHeadDim) + p.eps);
#pragma unroll
      for (int e = 0; e < E; ++e) x[e] = (x[e] * inv_rms) * norm[lane * E + e];
    }
    const int64_t pos = p.positions[t];
    const bool upper = lane >= 16;
#pragma unroll
    for (int e = 0; e < E; ++e) {
      const float partner = __shfl_xor_sync(kFullMask, x[e], 16);
      const int i = (lane * E + e) % kHalf;
      const float c = p.rope_cos[pos * kHalf + i];
      const float s = p.rope_sin[pos * kHalf + i];
      // Lower lanes hold x1 (partner x2), upper lanes x2 (partner x1).
      x[e] = upper ? fmaf(x[e], c, partner * s) : fmaf(x[e], c, -(partner * s));
    }
  }
  if (is_q) {
    float* dst = p.q_out + (t * p.num_heads + h) * kHeadDim + lane * E;
#pragma unroll
    for (int e = 0; e < E; ++e) dst[e] = x[e];
    return;
  }
  const int kv_head = is_k ? h - p.num_heads : h - p.num_heads - cache.num_kv_heads;
  bf16* dst = (is_k ? cache.k : cache.v) +
              KvOffset(p.kv_slots[t], kv_head, cache.block_size, cache.num_kv_heads, kHeadDim) +
              lane * E;
#pragma unroll
  for (int e = 0; e < E; ++e) dst[e] = __float2bfloat16_rn(x[e]);
}

}  // namespace

cudaError_t RmsNorm(const float* x, const int32_t* rows, int64_t num_rows, int64_t dim,
                    const float* weight, float eps, bf16* y, cudaStream_t stream) {
  if (dim % 4 != 0) return cudaErrorInvalidValue;
  if (num_rows == 0) return cudaSuccess;
  RmsNormKernel<<<static_cast<unsigned>(num_rows), kNormThreads, 0, stream>>>(x, rows, dim, weight,
                                                                              eps, y);
  return cudaGetLastError();
}

cudaError_t QkvNormRopeWriteKv(const QkvParams& params, KvCacheView cache, cudaStream_t stream) {
  if (params.num_tokens == 0) return cudaSuccess;
  const int64_t warps = params.num_tokens * (params.num_heads + 2 * cache.num_kv_heads);
  const unsigned blocks =
      static_cast<unsigned>((warps + kQkvWarpsPerBlock - 1) / kQkvWarpsPerBlock);
  const int threads = kQkvWarpsPerBlock * 32;
  switch (cache.head_dim) {
    case 32:
      QkvNormRopeKernel<32><<<blocks, threads, 0, stream>>>(params, cache);
      break;
    case 64:
      QkvNormRopeKernel<64><<<blocks, threads, 0, stream>>>(params, cache);
      break;
    case 128:
      QkvNormRopeKernel<128><<<blocks, threads, 0, stream>>>(params, cache);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace rollout::cuda
