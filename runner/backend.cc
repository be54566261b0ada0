#include "runner/backend.h"

#include <algorithm>

#include "absl/strings/str_format.h"
#include "glog/logging.h"
#include "kernels/cpu/ops.h"
#include "model/model_config.h"
#include "runner/cpu/cpu_model_runner.h"
#include "runner/cuda/cuda_backend.h"

namespace rollout {
namespace {

absl::StatusOr<std::unique_ptr<ModelRunner>> CreateCpuRunner(const Checkpoint& checkpoint,
                                                             const BackendOptions& options) {
  CpuRunnerOptions runner_options;
  runner_options.kv_cache_bytes = options.kv_cache_bytes;
  runner_options.kv_block_size = options.kv_block_size;
  runner_options.attention_split_size = options.attention_split_size;
  runner_options.num_threads = options.num_threads;
  runner_options.max_batch_tokens = options.max_batch_tokens;
  runner_options.tensor_parallel = options.tensor_parallel;  // checked against the model there
  runner_options.batch_variant_for_testing = options.batch_variant_for_testing;
  runner_options.available_host_memory = options.available_host_memory_for_testing;
  absl::StatusOr<std::unique_ptr<CpuModelRunner>> runner =
      CpuModelRunner::Create(checkpoint, runner_options);
  if (!runner.ok()) return runner.status();
  return std::unique_ptr<ModelRunner>(*std::move(runner));
}

// Through the module loaded on demand (runner/cuda/cuda_backend.h).
absl::StatusOr<std::unique_ptr<ModelRunner>> CreateCudaRunner(const Checkpoint& checkpoint,
                                                              const BackendOptions& options) {
  CudaRunnerOptions runner_options;
  runner_options.kv_cache_bytes = options.kv_cache_bytes;
  runner_options.kv_block_size = options.kv_block_size;
  runner_options.attention_split_size = options.attention_split_size;
  // Activations are sized for this many tokens; a larger engine step runs as several passes.
  runner_options.max_batch_tokens = std::clamp(options.max_batch_tokens, 1, 16384);
  runner_options.cuda_graphs = options.cuda_graphs;
  runner_options.tensor_parallel = options.tensor_parallel;  // checked against the model there
  runner_options.canonical_k_tree = options.tp_invariant;
  runner_options.devices = options.cuda_devices;  // checked against tensor_parallel there
  runner_options.collective_timeout_s = options.collective_timeout_s;
  runner_options.device_weight_staging = options.device_weight_staging;
  // A model whose dimensions cannot take the tree cannot be split at any degree either, so
  // at tp = 1 there is no other degree to agree with: the fused GEMM serves it.
  absl::StatusOr<ModelConfig> config = ReadModelConfig(checkpoint);
  if (config.ok() && options.tensor_parallel == 1 && options.tp_invariant &&
      ((config->num_attention_heads * config->head_dim) % 64 != 0 ||
       config->intermediate_size % 64 != 0)) {
    LOG(WARNING) << "this model cannot be split for tensor parallelism on the cuda backend "
                    "(heads * head_dim and the intermediate size must be multiples of 64); "
                    "serving it with fused row-parallel GEMMs";
    runner_options.canonical_k_tree = false;
  }
  return CreateCudaModelRunner(checkpoint, runner_options);
}

}  // namespace

BackendNumerics DescribeNumerics(const BackendOptions& options, const ModelRunner* runner) {
  BackendNumerics n;
  if (options.backend == "cpu") {
    n.compute_dtype = "float32";
    n.row_parallel_reduction = "canonical_k_tree_8";  // at every degree, TP 1 included
    n.kernels = cpu::kKernelsVersion;
  } else if (options.backend == "cuda") {
    n.row_parallel_reduction =
        options.tp_invariant || options.tensor_parallel > 1 ? "canonical_k_tree_8" : "fused";
  }
  if (runner != nullptr) {
    n.runner = runner->numerics();
    if (!n.runner.compute_dtype.empty()) n.compute_dtype = n.runner.compute_dtype;
    if (!n.runner.kernels.empty()) n.kernels = n.runner.kernels;
    // The runner's own choice: a model that cannot take the tree is served fused at TP 1.
    if (!n.runner.row_parallel_reduction.empty()) {
      n.row_parallel_reduction = n.runner.row_parallel_reduction;
    }
  }
  return n;
}

absl::Status CheckBackend(const BackendOptions& options) {
  if (options.backend == "cpu") return absl::OkStatus();
  // A build without the CUDA backend, or a module that cannot load, fails here, before the
  // model is read.
  if (options.backend == "cuda") return LoadCudaBackend();
  return absl::InvalidArgumentError(
      absl::StrFormat("unknown backend '%s' (cpu or cuda)", options.backend));
}

absl::StatusOr<std::unique_ptr<ModelRunner>> CreateModelRunner(const Checkpoint& checkpoint,
                                                               const BackendOptions& options) {
  if (absl::Status s = CheckBackend(options); !s.ok()) return s;
  if (options.backend == "cuda") return CreateCudaRunner(checkpoint, options);
  return CreateCpuRunner(checkpoint, options);
}

}  // namespace rollout
