#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/model_runner.h"
#include "engine/safetensors.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/thread_pool.h"

namespace rollout {

struct CpuRunnerOptions {
  int64_t kv_cache_bytes = 256ll << 20;
  int32_t kv_block_size = 16;
  int32_t attention_split_size = 64;
  int32_t num_threads = 0;  // 0 = all cores
  // Negative control for the determinism suites only: the final RMSNorm sums a row in an order
  // chosen by the number of rows in the batch, so batch invariance breaks on purpose.
  bool batch_variant_for_testing = false;
};

// The CPU reference backend: fp32 weights and KV, kernels/cpu ops. Engine thread only.
class CpuModelRunner final : public ModelRunner {
 public:
  // Loads and shape-checks every tensor of `checkpoint` (converted to fp32) and reserves the
  // KV cache. Errors name the missing or mis-shaped tensor.
  static absl::StatusOr<std::unique_ptr<CpuModelRunner>> Create(const Checkpoint& checkpoint,
                                                                const CpuRunnerOptions& options);

  const ModelConfig& config() const override { return config_; }
  const char* backend_name() const override { return "cpu"; }
  int32_t num_kv_blocks() const override { return num_kv_blocks_; }
  int32_t kv_block_size() const override { return options_.kv_block_size; }
  int32_t attention_split_size() const override { return options_.attention_split_size; }

  absl::Status Forward(const ForwardBatch& batch, std::vector<float>* logits) override;
  absl::Status ProcessLogits(const std::vector<LogitsRowTask>& tasks,
                             const std::vector<float>& logits,
                             std::vector<SampleResult>* results) override {
    return ProcessLogitsOnHost(tasks, logits, config_.vocab_size, pool_.get(), results);
  }
  const std::vector<WeightSpec>& weight_specs() const override { return weight_specs_; }
  absl::Status UpdateWeights(const std::vector<HostTensor>& tensors) override;

 private:
  struct Layer {
    std::vector<float> input_norm;     // [hidden]
    std::vector<float> q, k, v;        // [heads * head_dim, hidden], [kv_heads * head_dim, hidden]
    std::vector<float> q_bias, k_bias, v_bias;  // empty unless qkv_bias
    std::vector<float> q_norm, k_norm;          // [head_dim]; empty unless qk_norm
    std::vector<float> o;              // [hidden, heads * head_dim]
    std::vector<float> post_norm;      // [hidden]
    std::vector<float> gate_up;        // [2 * intermediate, hidden]: gate rows then up rows
    std::vector<float> down;           // [hidden, intermediate]
    std::vector<float> k_cache, v_cache;  // [num_blocks, block_size, kv_heads, head_dim]
  };

  CpuModelRunner(ModelConfig config, CpuRunnerOptions options);
  absl::Status Load(const Checkpoint& checkpoint);

  // Where a named checkpoint tensor lives: `count` floats of `dest` from `offset`.
  struct Binding {
    std::vector<float>* dest;
    int64_t offset;
    int64_t count;
  };

  const ModelConfig config_;
  const CpuRunnerOptions options_;
  int32_t num_kv_blocks_ = 0;
  std::unique_ptr<cpu::ThreadPool> pool_;
  std::vector<float> embed_;    // [vocab, hidden]
  std::vector<float> lm_head_;  // [vocab, hidden]; empty when tied to embed_
  std::vector<float> final_norm_;
  std::vector<Layer> layers_;
  std::vector<WeightSpec> weight_specs_;  // sorted by name
  std::map<std::string, Binding> bindings_;
};

}  // namespace rollout
