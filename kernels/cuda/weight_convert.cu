// ConvertWeightRows: one thread per element, grid-stride; the conversions are the host's
// integer arithmetic (model/safetensors.cc), not the CUDA intrinsics, so the bits are the
// host's by construction (NaN payloads included).
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "kernels/cuda/weight_convert.h"

namespace rollout::cuda {
namespace {

constexpr int kThreads = 256;

__device__ inline float BitsToFloat(uint32_t b) { return __uint_as_float(b); }

__device__ inline float F16ToF32(uint16_t x) {
  const uint32_t sign = static_cast<uint32_t>(x & 0x8000u) << 16;
  const uint32_t exponent = (x >> 10) & 0x1fu;
  uint32_t mantissa = x & 0x3ffu;
  if (exponent == 0x1f) return BitsToFloat(sign | 0x7f800000u | (mantissa << 13));
  if (exponent != 0) return BitsToFloat(sign | ((exponent + 112) << 23) | (mantissa << 13));
  if (mantissa == 0) return BitsToFloat(sign);
  int32_t e = -14;
  while ((mantissa & 0x400u) == 0) {
    mantissa <<= 1;
    --e;
  }
  mantissa &= 0x3ffu;
  return BitsToFloat(sign | (static_cast<uint32_t>(e + 127) << 23) | (mantissa << 13));
}

__device__ inline uint16_t F32ToBF16(float x) {
  const uint32_t bits = __float_as_uint(x);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  const uint32_t lsb = (bits >> 16) & 1u;
  return static_cast<uint16_t>((bits + 0x7fffu + lsb) >> 16);
}

__device__ inline float Load(const void* src, WeightSourceType type, int64_t i) {
  switch (type) {
    case WeightSourceType::kF32:
      return static_cast<const float*>(src)[i];
    case WeightSourceType::kF16:
      return F16ToF32(static_cast<const uint16_t*>(src)[i]);
    case WeightSourceType::kBF16:
      break;
  }
  return BitsToFloat(static_cast<uint32_t>(static_cast<const uint16_t*>(src)[i]) << 16);
}

__global__ void ConvertWeightRowsKernel(const void* src, WeightSourceType src_type,
                                        int64_t src_pitch, void* dst, bool dst_f32,
                                        int64_t dst_pitch, int64_t rows, int64_t cols) {
  const int64_t n = rows * cols;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / cols, c = i % cols;
    const float v = Load(src, src_type, r * src_pitch + c);
    if (dst_f32) {
      static_cast<float*>(dst)[r * dst_pitch + c] = v;
    } else {
      static_cast<uint16_t*>(dst)[r * dst_pitch + c] = F32ToBF16(v);
    }
  }
}

}  // namespace

cudaError_t ConvertWeightRows(const void* src, WeightSourceType src_type, int64_t src_pitch,
                              void* dst, bool dst_f32, int64_t dst_pitch, int64_t rows,
                              int64_t cols, cudaStream_t stream) {
  if (src == nullptr || dst == nullptr || rows < 0 || cols < 0 || src_pitch < cols ||
      dst_pitch < cols) {
    return cudaErrorInvalidValue;
  }
  const int64_t n = rows * cols;
  if (n == 0) return cudaSuccess;
  const int64_t blocks = std::min<int64_t>((n + kThreads - 1) / kThreads, 132 * 32);
  ConvertWeightRowsKernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      src, src_type, src_pitch, dst, dst_f32, dst_pitch, rows, cols);
  return cudaGetLastError();
}

}  // namespace rollout::cuda
