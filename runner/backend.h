#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/model_runner.h"
#include "model/safetensors.h"

namespace rollout {

// Which backend runs the model, with its limits. Every limit must be set (the server's
// WithBackendDefaults fills the ones a user left at 0).
struct BackendOptions {
  std::string backend = "cpu";  // "cpu" or "cuda"
  int64_t kv_cache_bytes = 0;   // cuda: 0 = sized from the GPU memory left after weights
  int32_t kv_block_size = 16;
  int32_t attention_split_size = 64;
  int32_t max_batch_tokens = 512;
  int32_t num_threads = 0;  // cpu: 0 = all cores
  int32_t tensor_parallel = 1;
  bool cuda_graphs = true;             // cuda
  bool tp_invariant = true;            // cuda: the canonical K tree at tp = 1 too
  std::vector<int> cuda_devices;       // cuda: one per rank, or empty (every rank on GPU 0)
  int32_t collective_timeout_s = 300;  // cuda across GPUs: CudaRunnerOptions'
  bool device_weight_staging = false;  // cuda: staging for broadcast updates (CudaRunnerOptions)
  bool batch_variant_for_testing = false;  // cpu: the determinism suites' negative control
  // cpu: CpuRunnerOptions::available_host_memory (tests inject a shortage for ResumeMemory).
  std::function<int64_t()> available_host_memory_for_testing;
};

// What a trainer-side forward needs to know about the backend's arithmetic to reproduce its
// bits (ServerInfo.numerics; docs/api.md, "Numerics contract"). Empty strings: not reported
// (the CUDA backend's device fields come from the loaded runner: `runner`).
struct BackendNumerics {
  std::string compute_dtype;           // "float32" on the CPU
  std::string row_parallel_reduction;  // "canonical_k_tree_8" or "fused"
  std::string kernels;                 // e.g. cpu::kKernelsVersion
  RunnerNumerics runner;               // ModelRunner::numerics(): the CUDA backend's device facts
};
// The options' part, then (with `runner`) the loaded runner's: its compute dtype and kernels
// replace the options' where it reports them.
BackendNumerics DescribeNumerics(const BackendOptions& options, const ModelRunner* runner = nullptr);

// OK when `options.backend` names a backend this build can run, checked before any model is
// read: INVALID_ARGUMENT for an unknown name, and LoadCudaBackend's errors for "cuda" (no GPU is
// touched yet).
absl::Status CheckBackend(const BackendOptions& options);

// The runner of `options.backend` over `checkpoint`. Errors name what failed (a dimension that
// cannot be split, memory that does not fit, no usable GPU, ...).
absl::StatusOr<std::unique_ptr<ModelRunner>> CreateModelRunner(const Checkpoint& checkpoint,
                                                               const BackendOptions& options);

}  // namespace rollout
