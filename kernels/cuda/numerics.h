#pragma once

#include <cuda_runtime.h>

#include <string>

#include "kernels/cuda/gemm.h"

// What the CUDA backend's bits depend on beyond the model and its sources, stated one way for
// the server's ServerInfo.numerics (CudaModelRunner::numerics) and for the trainer library
// that reproduces them (trainer/trainer_cuda_ops.cc): two processes that report the same facts
// compute the same bits, and a trainer refuses, naming the fact, a server whose facts differ.
namespace rollout::cuda {

// The build id and version of these kernels' arithmetic (ServerInfo.numerics.kernels): bumped
// whenever a kernel of the forward pass or of the logprob changes a bit.
inline constexpr char kKernelsVersion[] = "rollout-cuda/1";

// Keys per tile of the per-row attention walk (kAttentionTile, ops.h), as reported.
inline constexpr int kReportedAttentionTile = 32;

struct DeviceFacts {
  std::string gpu_model;           // cudaDeviceProp::name, e.g. "NVIDIA H200"
  std::string compute_capability;  // "9.0"
  // The CUDA toolkit the kernels were compiled with (CUDART_VERSION at build time: what decides
  // their machine code), "13.0"; not the runtime that happens to be loaded.
  std::string cuda_runtime;
  std::string cublaslt_version;    // cublasLtGetVersion() of the loaded cuBLASLt, e.g. "130100"
};

// The facts of `device`. cudaError_t of cudaGetDeviceProperties.
cudaError_t DescribeDevice(int device, DeviceFacts* facts);

// One line naming a pinned GEMM's choice: "<name> n=<n> k=<k> out=<output> <algo>" for
// kPinned ("heuristic per m" otherwise). The ladder's rungs are left out: they are chosen by
// timing at load, and are admitted only with the pin's bits (gemm.h), so they do not change a
// bit.
std::string DescribePin(const char* name, const PinnedGemm& gemm);

}  // namespace rollout::cuda
