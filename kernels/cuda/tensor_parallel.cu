// Tensor-parallel kernels (kernels/cuda/tensor_parallel.h): the canonical K
// tree's SumTree and the vocab-parallel embedding. No reduction across threads;
// each thread owns four floats.
#include <algorithm>

#include "kernels/cuda/residual_terms.cuh"
#include "kernels/cuda/tensor_parallel.h"

namespace rollout::cuda {
namespace {

constexpr int kThreads = 256;
// Grid-stride loops cap the grid; the cap changes which thread handles an
// element, never what is computed for it.
constexpr int64_t kMaxBlocks = 4096;

template <int kParts>
__global__ void SumTreeKernel(const float4* parts, int64_t part_stride4, int64_t count4,
                              const float4* residual, float4* out) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count4;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float4 tree = TreeSum4<kParts>(parts, part_stride4, i);
    out[i] = residual != nullptr ? Add4(residual[i], tree) : tree;
  }
}

__global__ void EmbeddingGatherShardKernel(const int32_t* token_ids, const __nv_bfloat16* shard,
                                           int64_t vocab_begin, int64_t vocab_end, int64_t hidden,
                                           float* x) {
  const int64_t t = blockIdx.y;
  const int64_t chunk = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (chunk * 8 >= hidden) return;
  const int64_t id = token_ids[t];
  float4* out = reinterpret_cast<float4*>(x + t * hidden + chunk * 8);
  if (id < vocab_begin || id >= vocab_end) {
    out[0] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    out[1] = out[0];
    return;
  }
  const __nv_bfloat162* in =
      reinterpret_cast<const __nv_bfloat162*>(shard + (id - vocab_begin) * hidden + chunk * 8);
  const float2 a = __bfloat1622float2(in[0]), b = __bfloat1622float2(in[1]);
  const float2 c = __bfloat1622float2(in[2]), d = __bfloat1622float2(in[3]);
  out[0] = make_float4(a.x, a.y, b.x, b.y);
  out[1] = make_float4(c.x, c.y, d.x, d.y);
}

__global__ void SelectOwnerRowsKernel(const int32_t* token_ids, const float* gathered,
                                      int64_t rank_stride, int64_t rows_per_rank, int64_t hidden,
                                      float* x) {
  const int64_t t = blockIdx.y;
  const int64_t chunk = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (chunk * 4 >= hidden) return;
  const int64_t owner = token_ids[t] / rows_per_rank;
  reinterpret_cast<float4*>(x + t * hidden)[chunk] =
      reinterpret_cast<const float4*>(gathered + owner * rank_stride + t * hidden)[chunk];
}

}  // namespace

cudaError_t SumTree(const float* parts, int num_parts, int64_t part_stride, int64_t count,
                    float* out, bool accumulate, cudaStream_t stream) {
  return SumTreeOnto(parts, num_parts, part_stride, count, accumulate ? out : nullptr, out, stream);
}

cudaError_t SumTreeOnto(const float* parts, int num_parts, int64_t part_stride, int64_t count,
                        const float* residual, float* out, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  if (count % 4 != 0 || part_stride % 4 != 0) return cudaErrorInvalidValue;
  const int64_t count4 = count / 4;
  const unsigned blocks =
      static_cast<unsigned>(std::min(kMaxBlocks, (count4 + kThreads - 1) / kThreads));
  const float4* p = reinterpret_cast<const float4*>(parts);
  float4* o = reinterpret_cast<float4*>(out);
  const float4* r = reinterpret_cast<const float4*>(residual);
  const int64_t stride4 = part_stride / 4;
  switch (num_parts) {
    case 1:
      SumTreeKernel<1><<<blocks, kThreads, 0, stream>>>(p, stride4, count4, r, o);
      break;
    case 2:
      SumTreeKernel<2><<<blocks, kThreads, 0, stream>>>(p, stride4, count4, r, o);
      break;
    case 4:
      SumTreeKernel<4><<<blocks, kThreads, 0, stream>>>(p, stride4, count4, r, o);
      break;
    case 8:
      SumTreeKernel<8><<<blocks, kThreads, 0, stream>>>(p, stride4, count4, r, o);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

cudaError_t EmbeddingGatherShard(const int32_t* token_ids, int64_t num_tokens,
                                 const __nv_bfloat16* shard, int64_t vocab_begin, int64_t vocab_end,
                                 int64_t hidden, float* x, cudaStream_t stream) {
  if (num_tokens == 0) return cudaSuccess;
  if (hidden % 8 != 0 || num_tokens > 65535) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>((hidden / 8 + kThreads - 1) / kThreads),
                  static_cast<unsigned>(num_tokens));
  EmbeddingGatherShardKernel<<<grid, kThreads, 0, stream>>>(token_ids, shard, vocab_begin,
                                                            vocab_end, hidden, x);
  return cudaGetLastError();
}

cudaError_t SelectOwnerRows(const int32_t* token_ids, int64_t num_tokens, const float* gathered,
                            int64_t rank_stride, int64_t rows_per_rank, int64_t hidden, float* x,
                            cudaStream_t stream) {
  if (num_tokens == 0) return cudaSuccess;
  if (hidden % 4 != 0 || num_tokens > 65535 || rows_per_rank < 1) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>((hidden / 4 + kThreads - 1) / kThreads),
                  static_cast<unsigned>(num_tokens));
  SelectOwnerRowsKernel<<<grid, kThreads, 0, stream>>>(token_ids, gathered, rank_stride,
                                                       rows_per_rank, hidden, x);
  return cudaGetLastError();
}

}  // namespace rollout::cuda
