// The entry point of librollout_cuda_backend.so, the CUDA backend as a dlopen()ed module
// (runner/cuda/cuda_backend.h says why and how it is found). Its one exported symbol; everything
// else in the module is local to it (engine/CMakeLists.txt).

#include <cuda_runtime.h>

#include <memory>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "runner/cuda/cuda_backend.h"
#include "runner/cuda/cuda_model_runner.h"

namespace rollout {
namespace {

// Why no GPU can run the backend, before CudaModelRunner::Create turns it into a less telling
// error from its first CUDA call (cudaSetDevice "CUDA driver version is insufficient" when
// there is no driver at all).
absl::Status CheckDevice(int device) {
  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "backend 'cuda': no usable GPU (cudaGetDeviceCount: %s [%s]); check that the NVIDIA "
        "driver is installed and a GPU is visible to this process (nvidia-smi; docker --gpus, "
        "the nvidia.com/gpu limit, CUDA_VISIBLE_DEVICES), or use --backend cpu",
        cudaGetErrorString(error), cudaGetErrorName(error)));
  }
  if (count == 0) {
    return absl::FailedPreconditionError(
        "backend 'cuda': no GPU is visible to this process (cudaGetDeviceCount = 0; check "
        "CUDA_VISIBLE_DEVICES, docker --gpus, the nvidia.com/gpu limit), or use --backend cpu");
  }
  if (device < 0 || device >= count) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "backend 'cuda': device %d requested, %d visible (0..%d)", device, count, count - 1));
  }
  return absl::OkStatus();
}

}  // namespace

extern "C" __attribute__((visibility("default"))) void rollout_cuda_backend_create_v1(
    const CudaBackendAbi* abi, const Checkpoint* checkpoint, const CudaRunnerOptions* options,
    absl::StatusOr<std::unique_ptr<ModelRunner>>* result) {
  const CudaBackendAbi mine;
  // Compared before any other argument is read: on a mismatch their layouts are not ours.
  if (abi->version != mine.version || *abi != mine) {
    *result = absl::FailedPreconditionError(
        "backend 'cuda': the CUDA backend module was built from another version or "
        "configuration of the tree than this executable; rebuild both together (target "
        "rollout_cuda_backend), or unset ROLLOUT_CUDA_BACKEND if it points at another build");
    return;
  }
  if (absl::Status s = CheckDevice(options->device); !s.ok()) {
    *result = std::move(s);
    return;
  }
  absl::StatusOr<std::unique_ptr<CudaModelRunner>> runner =
      CudaModelRunner::Create(*checkpoint, *options);
  if (!runner.ok()) {
    *result = runner.status();
    return;
  }
  *result = std::unique_ptr<ModelRunner>(*std::move(runner));
}

}  // namespace rollout
