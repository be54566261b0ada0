#pragma once

#include <cuda_runtime.h>

#include <cstdint>

// Weights from device memory in a checkpoint dtype into the CUDA backend's layout (bf16 matrices,
// fp32 norms and biases), bitwise what the host path computes (model/safetensors.h: F32ToBF16
// rounds to nearest even and keeps NaNs quiet; F16ToF32 and BF16ToF32 are exact), so a tensor
// served from an IPC update has the bits of the same bytes streamed.
namespace rollout::cuda {

// The element types a weight tensor arrives in; values are safetensors' (model/safetensors.h
// DType: kF32, kF16, kBF16).
enum class WeightSourceType : int { kF32 = 0, kF16 = 1, kBF16 = 2 };

// dst[r * dst_pitch + c] = convert(src[r * src_pitch + c]) for r < rows, c < cols (pitches in
// elements): into bf16 (dst_f32 false) or fp32. A straight copy when the types agree (use
// cudaMemcpy2DAsync for that instead; this is for the conversions). Allocates nothing.
// REQUIRES: src and dst do not overlap.
cudaError_t ConvertWeightRows(const void* src, WeightSourceType src_type, int64_t src_pitch,
                              void* dst, bool dst_f32, int64_t dst_pitch, int64_t rows,
                              int64_t cols, cudaStream_t stream);

}  // namespace rollout::cuda
