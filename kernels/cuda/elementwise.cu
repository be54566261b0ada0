// Embedding gather, SiLU * up, and the seeded weight generator: kernels with no reduction, one
// thread per group of elements.
#include <algorithm>

#include "kernels/cuda/ops.h"

namespace rollout::cuda {
namespace {

constexpr int kThreads = 256;

// Eight bf16 values, one 16-byte load.
struct alignas(16) Bf16x8 {
  __nv_bfloat162 h[4];
};

__global__ void EmbeddingGatherKernel(const int32_t* token_ids, const bf16* embed, int64_t hidden,
                                      float* x) {
  const int64_t t = blockIdx.y;
  const int64_t chunk = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (chunk * 8 >= hidden) return;
  const Bf16x8 in =
      reinterpret_cast<const Bf16x8*>(embed + static_cast<int64_t>(token_ids[t]) * hidden)[chunk];
  float4* out = reinterpret_cast<float4*>(x + t * hidden + chunk * 8);
  const float2 a = __bfloat1622float2(in.h[0]), b = __bfloat1622float2(in.h[1]);
  const float2 c = __bfloat1622float2(in.h[2]), d = __bfloat1622float2(in.h[3]);
  out[0] = make_float4(a.x, a.y, b.x, b.y);
  out[1] = make_float4(c.x, c.y, d.x, d.y);
}

__device__ __forceinline__ float Silu(float g) { return g / (1.0f + expf(-g)); }

__global__ void SiluMulKernel(const bf16* gate_up, int64_t dim, bf16* out) {
  const int64_t r = blockIdx.y;
  const int64_t chunk = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (chunk * 8 >= dim) return;
  const Bf16x8 g = reinterpret_cast<const Bf16x8*>(gate_up + r * 2 * dim)[chunk];
  const Bf16x8 u = reinterpret_cast<const Bf16x8*>(gate_up + r * 2 * dim + dim)[chunk];
  Bf16x8 o;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 gf = __bfloat1622float2(g.h[i]);
    const float2 uf = __bfloat1622float2(u.h[i]);
    o.h[i] = __floats2bfloat162_rn(Silu(gf.x) * uf.x, Silu(gf.y) * uf.y);
  }
  reinterpret_cast<Bf16x8*>(out + r * dim)[chunk] = o;
}

// The SplitMix64 output function, as model/random_model.cc's Mix64.
__device__ __forceinline__ uint64_t Mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// model/random_model.cc's RandomValue, transcribed: integer arithmetic plus one double
// multiply (or an exact sum), then one rounding to float.
__device__ __forceinline__ float RandomValue(uint64_t key, double scale, int kind, uint64_t index) {
  const uint64_t bits = Mix64(key + (index + 1) * 0x9e3779b97f4a7c15ull);
  if (kind == 1) {
    const int64_t k = static_cast<int64_t>((bits >> 32) % 6553) - 3276;
    return static_cast<float>(1.0 + static_cast<double>(k) * (1.0 / 65536.0));
  }
  const int64_t sum = static_cast<int64_t>((bits & 0xffff) + ((bits >> 16) & 0xffff) +
                                           ((bits >> 32) & 0xffff) + (bits >> 48)) -
                      2 * 65535;
  return static_cast<float>(static_cast<double>(sum) * scale);
}

__global__ void FillRandomKernel(uint64_t key, double scale, int kind, int64_t count,
                                 bf16* out_bf16, float* out_f32) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const bf16 v = __float2bfloat16_rn(RandomValue(key, scale, kind, static_cast<uint64_t>(i)));
    if (out_bf16 != nullptr) {
      out_bf16[i] = v;
    } else {
      out_f32[i] = __bfloat162float(v);
    }
  }
}

}  // namespace

cudaError_t EmbeddingGather(const int32_t* token_ids, int64_t num_tokens, const bf16* embed,
                            int64_t hidden, float* x, cudaStream_t stream) {
  if (hidden % 8 != 0 || num_tokens > 65535) return cudaErrorInvalidValue;
  if (num_tokens == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>((hidden / 8 + kThreads - 1) / kThreads),
                  static_cast<unsigned>(num_tokens));
  EmbeddingGatherKernel<<<grid, kThreads, 0, stream>>>(token_ids, embed, hidden, x);
  return cudaGetLastError();
}

cudaError_t SiluMul(const bf16* gate_up, int64_t rows, int64_t dim, bf16* out,
                    cudaStream_t stream) {
  if (dim % 8 != 0) return cudaErrorInvalidValue;
  // A grid holds 65535 rows: consecutive row ranges, one launch each (rows are independent).
  constexpr int64_t kMaxRows = 65535;
  for (int64_t r0 = 0; r0 < rows; r0 += kMaxRows) {
    const int64_t n = std::min(kMaxRows, rows - r0);
    const dim3 grid(static_cast<unsigned>((dim / 8 + kThreads - 1) / kThreads),
                    static_cast<unsigned>(n));
    SiluMulKernel<<<grid, kThreads, 0, stream>>>(gate_up + r0 * 2 * dim, dim, out + r0 * dim);
    if (const cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

cudaError_t FillRandomWeights(uint64_t key, double scale, int kind, int64_t count, bf16* out_bf16,
                              float* out_f32, cudaStream_t stream) {
  if ((out_bf16 == nullptr) == (out_f32 == nullptr) || (kind != 0 && kind != 1)) {
    return cudaErrorInvalidValue;
  }
  if (count == 0) return cudaSuccess;
  const int64_t blocks = std::min<int64_t>((count + kThreads - 1) / kThreads, 132 * 32);
  FillRandomKernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(key, scale, kind, count,
                                                                           out_bf16, out_f32);
  return cudaGetLastError();
}

}  // namespace rollout::cuda
