#include "runner/cuda/device_weight_copy.h"

#include "kernels/cuda/weight_convert.h"

namespace rollout {
namespace {

cuda::WeightSourceType SourceType(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return cuda::WeightSourceType::kF32;
    case DType::kF16:
      return cuda::WeightSourceType::kF16;
    case DType::kBF16:
      break;
  }
  return cuda::WeightSourceType::kBF16;
}

}  // namespace

cudaError_t CopyWeightFromDevice(const cuda_runner_internal::Binding& b, DType dtype,
                                 const void* src, cudaStream_t stream) {
  const char* from_tensor = static_cast<const char*>(src);
  const size_t in = DTypeSize(dtype), out = b.f32 ? sizeof(float) : 2;
  const bool same = b.f32 ? dtype == DType::kF32 : dtype == DType::kBF16;
  for (const cuda_runner_internal::Piece& p : b.pieces) {
    const char* from = from_tensor + (p.row_begin * b.cols + p.col_begin) * in;
    const cudaError_t e =
        same ? cudaMemcpy2DAsync(p.ptr, p.cols * out, from, b.cols * in, p.cols * out, p.rows,
                                 cudaMemcpyDeviceToDevice, stream)
             : cuda::ConvertWeightRows(from, SourceType(dtype), b.cols, p.ptr, b.f32, p.cols,
                                       p.rows, p.cols, stream);
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

}  // namespace rollout
