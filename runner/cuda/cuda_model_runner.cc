// CudaModelRunner: construction (Init, the weights, Finish: setup.cc, weights.cc, workspace.cc),
// teardown and the accessors. The forward pass is forward.cc and forward_layers.cc, its host
// plan batch_plan.h, the decode graphs decode_graphs.cc, sampling logits_processing.cc, and the
// step pipeline step_pipeline.cc.
#include "runner/cuda/cuda_model_runner.h"

#include <cuda_runtime.h>

#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "kernels/cuda/numerics.h"
#include "model/model_config.h"
#include "runner/cuda/cuda_runner_state.h"

namespace rollout {
namespace {

using cuda_runner_internal::kFamilyNames;
using cuda_runner_internal::kNumFamilies;
using cuda_runner_internal::RankState;

// The canonical K tree is what every tensor-parallel degree computes.
CudaRunnerOptions WithCanonicalTree(CudaRunnerOptions options) {
  if (options.tensor_parallel > 1) options.canonical_k_tree = true;
  return options;
}

}  // namespace

CudaModelRunner::CudaModelRunner(ModelConfig config, CudaRunnerOptions options)
    : config_(std::move(config)),
      options_(WithCanonicalTree(options)),
      state_(std::make_unique<State>()) {}

// Drains every rank's stream; State's members then release their resources in the order it
// states, rank 0's with its device current (RankList makes the other ranks' current).
CudaModelRunner::~CudaModelRunner() {
  if (state_ == nullptr) return;
  for (const RankState& rk : state_->ranks) {
    if (rk.stream.get() != nullptr) cudaStreamSynchronize(rk.stream.get());
  }
  if (state_->multi_device && !state_->ranks.empty()) cudaSetDevice(state_->ranks[0].device);
  state_.reset();
}

absl::StatusOr<std::unique_ptr<CudaModelRunner>> CudaModelRunner::Create(
    const Checkpoint& checkpoint, const CudaRunnerOptions& options) {
  absl::StatusOr<ModelConfig> config = ReadModelConfig(checkpoint);
  if (!config.ok()) return config.status();
  auto runner = std::unique_ptr<CudaModelRunner>(new CudaModelRunner(*std::move(config), options));
  ROLLOUT_RETURN_IF_ERROR(runner->Init());
  ROLLOUT_RETURN_IF_ERROR(runner->LoadCheckpoint(checkpoint));
  ROLLOUT_RETURN_IF_ERROR(runner->Finish());
  return runner;
}

absl::StatusOr<std::unique_ptr<CudaModelRunner>> CudaModelRunner::CreateSynthetic(
    const ModelConfig& config, uint64_t seed, const CudaRunnerOptions& options) {
  // What a checkpoint of this config must parse to; catches hand-built inconsistent configs.
  absl::StatusOr<ModelConfig> reparsed = ParseModelConfig(ModelConfigToJson(config));
  if (!reparsed.ok()) return reparsed.status();
  auto runner = std::unique_ptr<CudaModelRunner>(new CudaModelRunner(config, options));
  ROLLOUT_RETURN_IF_ERROR(runner->Init());
  ROLLOUT_RETURN_IF_ERROR(runner->LoadSynthetic(seed));
  ROLLOUT_RETURN_IF_ERROR(runner->Finish());
  return runner;
}

void CudaModelRunner::EnableProfiling(bool on) { state_->profiler.set_on(on); }

void CudaModelRunner::ResetProfile() { state_->profiler.Reset(); }

CudaForwardProfile CudaModelRunner::profile() const {
  CudaForwardProfile p;
  for (int f = 0; f < kNumFamilies; ++f) {
    p.names.push_back(kFamilyNames[f]);
    p.ms.push_back(state_->profiler.family_ms(f));
  }
  p.forwards = state_->profiler.forwards();
  return p;
}

RunnerNumerics CudaModelRunner::numerics() const {
  const State& s = *state_;
  const RankState& rk = s.ranks[0];
  RunnerNumerics n;
  // bf16 storage (weights, GEMM inputs, KV), fp32 accumulation, residual and logits.
  n.compute_dtype = "bfloat16+float32";
  n.kernels = cuda::kKernelsVersion;
  n.row_parallel_reduction = s.canonical ? "canonical_k_tree_8" : "fused";
  cuda::DeviceFacts facts;
  if (cuda::DescribeDevice(rk.device, &facts) == cudaSuccess) {
    n.gpu_model = facts.gpu_model;
    n.compute_capability = facts.compute_capability;
    n.cuda_runtime = facts.cuda_runtime;
    n.cublaslt_version = facts.cublaslt_version;
  }
  n.gemm_algorithms = s.pin_lines;
  n.gemm_pin_m = options_.gemm_pin_m;
  n.gemm_ladder = options_.gemm_ladder;
  n.attention_kernel =
      options_.attention_kernel == CudaAttentionKernel::kTensorCore ? "tensor_core" : "simt";
  n.attention_split_size = options_.attention_split_size;
  n.attention_tile = cuda::kReportedAttentionTile;
  return n;
}

const std::vector<std::string>& CudaModelRunner::gemm_descriptions() const {
  return state_->gemm_descriptions;
}

int64_t CudaModelRunner::weight_bytes() const { return state_->weight_bytes; }

int64_t CudaModelRunner::kv_cache_bytes() const {
  int64_t bytes = 0;
  for (const RankState& rk : state_->ranks) bytes += static_cast<int64_t>(rk.kv.bytes());
  return bytes;
}

int64_t CudaModelRunner::graphs_captured() const { return state_->graphs_captured; }
int64_t CudaModelRunner::graph_launches() const { return state_->graph_launches; }

}  // namespace rollout
