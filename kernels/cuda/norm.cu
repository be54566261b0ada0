// RMSNorm of hidden rows (alone, or after the residual add it follows: the K tree, the MoE combine),
// and the attention input stage (bias, q/k RMSNorm, RoPE, KV write).
#include <type_traits>

#include "kernels/cuda/ops.h"
#include "kernels/cuda/residual_terms.cuh"
#include "kernels/cuda/warp_reduce.cuh"

namespace rollout::cuda {
namespace {

// A constant of the kernel, never chosen from the batch: it fixes the reduction order.
constexpr int kNormThreads = 256;
constexpr int kNormWarps = kNormThreads / 32;
// Float4s per thread held in registers between the sum and the scaling: rows up to
// kNormThreads * kNormCached * 4 = 4096 wide are read from memory once, not twice (H200, 8192
// rows of 4096: 0.0512 ms against 0.0530).
constexpr int kNormCached = 4;

// N consecutive values moved as one access of N * sizeof(T) bytes (up to 16). Formed only at
// multiples of N elements from bases that the launchers checked to be aligned to a Run's size.
template <typename T, int N>
struct alignas(N * sizeof(T)) Run {
  T v[N];
};

template <int N, typename T>
__device__ __forceinline__ Run<T, N> LoadRun(const T* p) {
  return *reinterpret_cast<const Run<T, N>*>(p);
}

template <int N, typename T>
bool RunAligned(const T* p) {
  return reinterpret_cast<uintptr_t>(p) % sizeof(Run<T, N>) == 0;
}

// Where a row's float4s come from. Load(i) gives float4 i of the row; Reread(i) gives it again
// for the scaling pass (from memory: the same value Load(i) gave this thread).
struct PlainRows {  // x[rows ? rows[r] : r], read only
  const float* x;
  const int32_t* rows;
  int64_t dim;
  struct Row {
    const float4* xr;
    __device__ float4 Load(int64_t i) const { return xr[i]; }
    __device__ float4 Reread(int64_t i) const { return xr[i]; }
  };
  __device__ Row Of(int64_t r) const {
    const int64_t src = rows != nullptr ? rows[r] : r;
    return Row{reinterpret_cast<const float4*>(x + src * dim)};
  }
};

// x[r] += a term (residual_terms.cuh), stored as it is loaded: the row after the add.
template <class Term>
struct AddedRows {
  float* x;
  int64_t dim;
  Term term;
  struct Row {
    float4* xr;
    int64_t r;
    Term term;
    __device__ float4 Load(int64_t i) const {
      const float4 v = Add4(xr[i], term(r, i));
      xr[i] = v;
      return v;
    }
    __device__ float4 Reread(int64_t i) const { return xr[i]; }
  };
  __device__ Row Of(int64_t r) const { return Row{reinterpret_cast<float4*>(x + r * dim), r, term}; }
};

// The canonical K tree of row r's float4 i: parts [num_parts][rows, dim].
template <int kParts>
struct TreeTerm {
  const float4* parts;
  int64_t part_stride4, dim4;
  __device__ float4 operator()(int64_t r, int64_t i) const {
    return TreeSum4<kParts>(parts, part_stride4, r * dim4 + i);
  }
};

struct MoeCombineTerm {
  const float* y;
  const int32_t* slots;
  const float* weights;
  int32_t top_k;
  int64_t hidden;
  __device__ float4 operator()(int64_t t, int64_t c4) const {
    return MoeCombine4(y, slots, weights, top_k, hidden, t, c4);
  }
};

template <class Rows>
__global__ void __launch_bounds__(kNormThreads)
    RmsNormKernel(Rows rows, int64_t dim, const float* weight, float eps, bf16* y) {
  const int64_t r = blockIdx.x;
  const typename Rows::Row xr = rows.Of(r);
  const int64_t n4 = dim / 4;
  // This thread's first kNormCached float4s of the row (index tid + k * kNormThreads) stay in
  // registers for the scaling pass; the sum still takes all of its float4s in increasing index.
  float4 cached[kNormCached];
#pragma unroll
  for (int k = 0; k < kNormCached; ++k) {
    const int64_t i = threadIdx.x + k * kNormThreads;
    if (i < n4) cached[k] = xr.Load(i);
  }
  float ss = 0.0f;
  auto add_squares = [&](float4 v) {
    ss = fmaf(v.x, v.x, ss);
    ss = fmaf(v.y, v.y, ss);
    ss = fmaf(v.z, v.z, ss);
    ss = fmaf(v.w, v.w, ss);
  };
#pragma unroll
  for (int k = 0; k < kNormCached; ++k) {
    if (threadIdx.x + k * kNormThreads < n4) add_squares(cached[k]);
  }
  for (int64_t i = threadIdx.x + kNormCached * kNormThreads; i < n4; i += kNormThreads) {
    add_squares(xr.Load(i));
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
  Run<bf16, 4>* yr = reinterpret_cast<Run<bf16, 4>*>(y + r * dim);  // [dim / 4]
  auto scale = [&](int64_t i, float4 v) {
    const float4 w = w4[i];
    const __nv_bfloat162 lo = __floats2bfloat162_rn((v.x * inv_rms) * w.x, (v.y * inv_rms) * w.y);
    const __nv_bfloat162 hi = __floats2bfloat162_rn((v.z * inv_rms) * w.z, (v.w * inv_rms) * w.w);
    yr[i] = Run<bf16, 4>{{lo.x, lo.y, hi.x, hi.y}};
  };
#pragma unroll
  for (int k = 0; k < kNormCached; ++k) {
    const int64_t i = threadIdx.x + k * kNormThreads;
    if (i < n4) scale(i, cached[k]);
  }
  for (int64_t i = threadIdx.x + kNormCached * kNormThreads; i < n4; i += kNormThreads) {
    scale(i, xr.Reread(i));
  }
}

template <class Rows>
cudaError_t LaunchRmsNorm(const Rows& rows, int64_t num_rows, int64_t dim, const float* weight,
                          float eps, bf16* y, cudaStream_t stream) {
  if (num_rows == 0) return cudaSuccess;
  RmsNormKernel<<<static_cast<unsigned>(num_rows), kNormThreads, 0, stream>>>(rows, dim, weight,
                                                                              eps, y);
  return cudaGetLastError();
}

constexpr int kQkvWarpsPerBlock = 8;
// Full occupancy (32 registers a thread): the kernel waits on its loads, and left to itself ptxas
// takes 36 registers for head_dim 128, 48 warps per SM instead of 64, and 20% more time (H200,
// Qwen3-8B prefill of 8192 tokens: 0.130 ms against 0.107).
constexpr int kQkvBlocksPerSm = 2048 / (kQkvWarpsPerBlock * 32);

// One warp per (token, head) of q|k|v; lane l holds dims [l * E, (l + 1) * E), so the RoPE
// partner of dim i < head_dim / 2 (i + head_dim / 2) sits in lane l + 16 at the same slot, and
// the lane's RoPE table entries are E consecutive ones: (l * E + e) % (head_dim / 2) =
// (l * E) % (head_dim / 2) + e, as head_dim / 2 is a multiple of E. Every offset below is a
// multiple of E elements (rows are whole heads of head_dim = 32 * E), so with the launcher's
// alignment check every access is one aligned vector access per lane.
template <int kHeadDim>
__global__ void __launch_bounds__(kQkvWarpsPerBlock * 32, kQkvBlocksPerSm)
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
  const int head_in_part =
      is_q ? h : (is_k ? h - p.num_heads : h - p.num_heads - cache.num_kv_heads);

  // Every load is issued before the first result is needed: the RoPE rows (behind the position)
  // and the KV slot would otherwise wait for the qkv row, the bias and the norm's shuffles.
  Run<float, E> x = LoadRun<E>(p.qkv + w * kHeadDim + lane * E);
  const float* bias = is_q ? p.q_bias : (is_k ? p.k_bias : p.v_bias);
  Run<float, E> b{};
  if (bias != nullptr) b = LoadRun<E>(bias + head_in_part * kHeadDim + lane * E);
  const float* norm = is_q ? p.q_norm : (is_k ? p.k_norm : nullptr);
  Run<float, E> nw{};
  if (norm != nullptr) nw = LoadRun<E>(norm + lane * E);
  Run<float, E> c{}, s{};
  if (is_q || is_k) {
    const int64_t pos = p.positions[t];
    const int64_t at = pos * kHalf + (lane * E) % kHalf;
    c = LoadRun<E>(p.rope_cos + at);
    s = LoadRun<E>(p.rope_sin + at);
  }
  const int64_t slot = is_q ? 0 : p.kv_slots[t];

  if (bias != nullptr) {
#pragma unroll
    for (int e = 0; e < E; ++e) x.v[e] = x.v[e] + b.v[e];
  }
  if (is_q || is_k) {
    if (norm != nullptr) {
      float ss = 0.0f;
#pragma unroll
      for (int e = 0; e < E; ++e) ss = fmaf(x.v[e], x.v[e], ss);
      ss = WarpSum(ss);
      const float inv_rms = 1.0f / sqrtf(ss / static_cast<float>(kHeadDim) + p.eps);
#pragma unroll
      for (int e = 0; e < E; ++e) x.v[e] = (x.v[e] * inv_rms) * nw.v[e];
    }
    const bool upper = lane >= 16;
#pragma unroll
    for (int e = 0; e < E; ++e) {
      const float partner = __shfl_xor_sync(kFullMask, x.v[e], 16);
      // Lower lanes hold x1 (partner x2), upper lanes x2 (partner x1).
      x.v[e] = upper ? fmaf(x.v[e], c.v[e], partner * s.v[e])
                     : fmaf(x.v[e], c.v[e], -(partner * s.v[e]));
    }
  }
  if (is_q) {
    *reinterpret_cast<Run<float, E>*>(p.q_out + (t * p.num_heads + h) * kHeadDim + lane * E) = x;
    return;
  }
  Run<bf16, E> y;
#pragma unroll
  for (int e = 0; e < E; ++e) y.v[e] = __float2bfloat16_rn(x.v[e]);
  bf16* dst = (is_k ? cache.k : cache.v) +
              KvOffset(slot, head_in_part, cache.block_size, cache.num_kv_heads, kHeadDim) +
              lane * E;
  *reinterpret_cast<Run<bf16, E>*>(dst) = y;
}

// The kernel moves Runs of head_dim / 32 elements, so every pointer must be aligned to a Run's
// size (up to 16 bytes: cudaMalloc and the weight arena give 256). Null pointers pass.
template <int kHeadDim>
cudaError_t LaunchQkvNormRope(const QkvParams& p, KvCacheView cache, unsigned blocks,
                              cudaStream_t stream) {
  constexpr int E = kHeadDim / 32;
  for (const float* f : {p.qkv, p.q_bias, p.k_bias, p.v_bias, p.q_norm, p.k_norm, p.rope_cos,
                         p.rope_sin, static_cast<const float*>(p.q_out)}) {
    if (!RunAligned<E>(f)) return cudaErrorInvalidValue;
  }
  if (!RunAligned<E>(cache.k) || !RunAligned<E>(cache.v)) return cudaErrorInvalidValue;
  QkvNormRopeKernel<kHeadDim><<<blocks, kQkvWarpsPerBlock * 32, 0, stream>>>(p, cache);
  return cudaGetLastError();
}

}  // namespace

cudaError_t RmsNorm(const float* x, const int32_t* rows, int64_t num_rows, int64_t dim,
                    const float* weight, float eps, bf16* y, cudaStream_t stream) {
  if (dim % 4 != 0) return cudaErrorInvalidValue;
  if (!RunAligned<4>(x) || !RunAligned<4>(weight) || !RunAligned<4>(y)) {
    return cudaErrorInvalidValue;
  }
  return LaunchRmsNorm(PlainRows{x, rows, dim}, num_rows, dim, weight, eps, y, stream);
}

cudaError_t SumTreeRmsNorm(const float* parts, int num_parts, int64_t part_stride,
                           int64_t num_rows, int64_t dim, float* x, const float* weight, float eps,
                           bf16* y, cudaStream_t stream) {
  if (dim % 4 != 0 || part_stride % 4 != 0 || part_stride < num_rows * dim) {
    return cudaErrorInvalidValue;
  }
  if (!RunAligned<4>(parts) || !RunAligned<4>(x) || !RunAligned<4>(weight) || !RunAligned<4>(y)) {
    return cudaErrorInvalidValue;
  }
  const float4* p = reinterpret_cast<const float4*>(parts);
  const int64_t stride4 = part_stride / 4, dim4 = dim / 4;
  auto launch = [&](auto parts_count) {
    constexpr int kParts = decltype(parts_count)::value;
    return LaunchRmsNorm(AddedRows<TreeTerm<kParts>>{x, dim, {p, stride4, dim4}}, num_rows, dim,
                         weight, eps, y, stream);
  };
  switch (num_parts) {
    case 1:
      return launch(std::integral_constant<int, 1>{});
    case 2:
      return launch(std::integral_constant<int, 2>{});
    case 4:
      return launch(std::integral_constant<int, 4>{});
    case 8:
      return launch(std::integral_constant<int, 8>{});
    default:
      return cudaErrorInvalidValue;
  }
}

cudaError_t MoeCombineRmsNorm(const float* expert_y, const int32_t* slots, const float* weights,
                              int64_t num_tokens, int32_t top_k, int64_t hidden, float* x,
                              const float* norm_weight, float eps, bf16* y, cudaStream_t stream) {
  if (hidden % 4 != 0 || top_k < 1) return cudaErrorInvalidValue;
  if (!RunAligned<4>(expert_y) || !RunAligned<4>(x) || !RunAligned<4>(norm_weight) ||
      !RunAligned<4>(y)) {
    return cudaErrorInvalidValue;
  }
  return LaunchRmsNorm(
      AddedRows<MoeCombineTerm>{x, hidden, {expert_y, slots, weights, top_k, hidden}}, num_tokens,
      hidden, norm_weight, eps, y, stream);
}

cudaError_t QkvNormRopeWriteKv(const QkvParams& params, KvCacheView cache, cudaStream_t stream) {
  if (params.num_tokens == 0) return cudaSuccess;
  const int64_t warps = params.num_tokens * (params.num_heads + 2 * cache.num_kv_heads);
  const unsigned blocks =
      static_cast<unsigned>((warps + kQkvWarpsPerBlock - 1) / kQkvWarpsPerBlock);
  switch (cache.head_dim) {
    case 32:
      return LaunchQkvNormRope<32>(params, cache, blocks, stream);
    case 64:
      return LaunchQkvNormRope<64>(params, cache, blocks, stream);
    case 128:
      return LaunchQkvNormRope<128>(params, cache, blocks, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace rollout::cuda
