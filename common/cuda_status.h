#pragma once

// CUDA and cuBLAS error codes as absl::Status, for the host code of the CUDA backend. Header
// only: included by CUDA code alone, so common/ links no CUDA library.

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace rollout {

// OK for cudaSuccess; otherwise INTERNAL "<what>: <error name> (<error string>)".
inline absl::Status CudaError(cudaError_t err, const std::string& what) {
  if (err == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(
      absl::StrCat(what, ": ", cudaGetErrorName(err), " (", cudaGetErrorString(err), ")"));
}

// OK for CUBLAS_STATUS_SUCCESS; otherwise INTERNAL "<what>: <status name>".
inline absl::Status CublasError(cublasStatus_t status, const std::string& what) {
  if (status == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", cublasLtGetStatusName(status)));
}

}  // namespace rollout
