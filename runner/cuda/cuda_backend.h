#pragma once

// The CUDA backend, loaded on demand. CudaModelRunner and the CUDA kernels (with cudart and
// cuBLASLt) live in a shared module, librollout_cuda_backend.so, which only the processes that
// ask for --backend cuda dlopen(). Nothing else links a CUDA library.
//
// Why a module: libcublasLt has ~94 KB of TLS. Linked into an executable, glibc carves it as
// *static* TLS out of every thread's stack, so threads created with small stacks (civetweb's
// 100 KiB workers, serving /metrics) fail in pthread_create. A dlopen()ed library's TLS is
// dynamic (allocated per thread on first use), so the threads start as before.
//
// Where the module is looked for: $ROLLOUT_CUDA_BACKEND when set (the path of the file), else
// next to the running executable's directory: <exe dir>/../lib, then <exe dir> (the build puts
// it in build/lib beside build/bin; installs put it in /usr/local/lib beside /usr/local/bin).

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/model_runner.h"
#include "engine/sampler.h"
#include "engine/sampling_params.h"
#include "model/model_config.h"
#include "model/safetensors.h"
#include "runner/cuda/cuda_model_runner.h"  // CudaRunnerOptions only: declares, links nothing

namespace rollout {

// OK when this build has the CUDA backend and its module loads (dlopen + the factory symbol);
// does not touch a GPU. Otherwise, with what to do about it in the message:
//   UNIMPLEMENTED       this build has no CUDA backend (configured with ROLLOUT_CUDA=OFF or
//                       without nvcc);
//   NOT_FOUND           the module file is not where it is looked for;
//   FAILED_PRECONDITION dlopen() failed (dlerror() quoted: typically a missing libcudart or
//                       libcublasLt), or the file is not a module of this build.
// Loading is idempotent; the module stays loaded for the life of the process.
absl::Status LoadCudaBackend();

// CudaModelRunner::Create(checkpoint, options) through the module: LoadCudaBackend's errors,
// FAILED_PRECONDITION when no GPU is usable (no driver, none visible, `options.device` out of
// range), else whatever CudaModelRunner::Create returns.
absl::StatusOr<std::unique_ptr<ModelRunner>> CreateCudaModelRunner(
    const Checkpoint& checkpoint, const CudaRunnerOptions& options);

// --- The interface between the loader (runner/cuda/cuda_backend.cc) and the module
// --- (runner/cuda/cuda_backend_module.cc). Nothing else uses it.

// The types that cross the boundary are passed as they are (C++ structs and classes, absl
// statuses, std::unique_ptr): the loader and the module are always built from the same tree in
// the same configure, so they agree on every layout. As a guard against a stale or foreign
// module (ROLLOUT_CUDA_BACKEND pointing elsewhere, a partial install) both sides compare this
// fingerprint of the crossing types before anything else.
struct CudaBackendAbi {
  // 2: ForwardBatch::fed_tokens; 3: ModelRunner::ReleaseMemory; 4: ModelRunner::OpenIpcTensors;
  // 5: weight updates as HostTensorView, ModelRunner::AllocateHostStaging;
  // 6: ModelRunner::CreateWeightSyncPort; 7: ModelRunner::numerics
  uint32_t version = 7;
  uint32_t options_size = sizeof(CudaRunnerOptions);
  uint32_t checkpoint_size = sizeof(Checkpoint);
  uint32_t config_size = sizeof(ModelConfig);
  uint32_t batch_size = sizeof(ForwardBatch);
  uint32_t task_size = sizeof(LogitsRowTask);
  uint32_t sampling_params_size = sizeof(SamplingParams);
  uint32_t sample_result_size = sizeof(SampleResult);
  uint32_t weight_spec_size = sizeof(WeightSpec);
  uint32_t host_tensor_size = sizeof(HostTensor);
  uint32_t host_tensor_view_size = sizeof(HostTensorView);
  uint32_t runner_size = sizeof(ModelRunner);
  uint32_t ipc_tensor_size = sizeof(IpcTensorSource);

  bool operator==(const CudaBackendAbi& o) const {
    return version == o.version && options_size == o.options_size &&
           checkpoint_size == o.checkpoint_size && config_size == o.config_size &&
           batch_size == o.batch_size && task_size == o.task_size &&
           sampling_params_size == o.sampling_params_size &&
           sample_result_size == o.sample_result_size && weight_spec_size == o.weight_spec_size &&
           host_tensor_size == o.host_tensor_size &&
           host_tensor_view_size == o.host_tensor_view_size && runner_size == o.runner_size &&
           ipc_tensor_size == o.ipc_tensor_size;
  }
  bool operator!=(const CudaBackendAbi& o) const { return !(*this == o); }
};

// The module's one exported symbol (C linkage for an unmangled dlsym() name; the version is in
// the name so an incompatible future module is "not a module of this build", not a crash).
// Writes CudaModelRunner::Create's result, or why there is none, to *result.
inline constexpr char kCudaBackendFactorySymbol[] = "rollout_cuda_backend_create_v1";
extern "C" void rollout_cuda_backend_create_v1(
    const CudaBackendAbi* abi, const Checkpoint* checkpoint, const CudaRunnerOptions* options,
    absl::StatusOr<std::unique_ptr<ModelRunner>>* result);

}  // namespace rollout
