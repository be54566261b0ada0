#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/thread_pool.h"
#include "engine/model_runner.h"
#include "kernels/cpu/ops.h"
#include "model/rope.h"
#include "model/safetensors.h"
#include "model/tensor_parallel.h"
#include "runner/cpu/communicator.h"
#include "runner/cpu/releasable_host_memory.h"
#include "runner/host_logits.h"
#include "runner/memory_plan.h"

namespace rollout {

struct CpuRunnerOptions {
  int64_t kv_cache_bytes = 256ll << 20;
  int32_t kv_block_size = 16;
  int32_t attention_split_size = 64;
  int32_t num_threads = 0;  // 0 = all cores (shared by the tensor-parallel ranks)
  // The engine's step budget: the step workspace is planned for this many tokens.
  int32_t max_batch_tokens = 512;
  // Tensor-parallel degree: 1, 2, 4 or 8 ranks as threads in lockstep, each holding its shard of
  // the weights and of the KV cache (Megatron partitioning; docs/determinism.md, D10). Every
  // degree gives the same bits. Requires heads, intermediate size divisible by it and KV heads
  // a multiple or a divisor of it.
  int32_t tensor_parallel = 1;
  // Negative control for the determinism suites only: the final RMSNorm sums a row in an order
  // chosen by the number of rows in the batch, so batch invariance breaks on purpose.
  bool batch_variant_for_testing = false;
  // The host memory ResumeMemory may take (bytes), asked before it takes the KV cache's pages
  // back: less than the cache needs is refused with RESOURCE_EXHAUSTED instead of being left
  // to the OOM killer. Empty: AvailableHostMemory(). Tests inject a shortage here.
  std::function<int64_t()> available_host_memory;
};

// What a CpuModelRunner of `config` holds in host memory at `options`' limits, and what the host
// has: CpuModelRunner::Create refuses limits that do not fit, naming the one to lower.
MemoryPlan PlanHostMemory(const ModelConfig& config, const CpuRunnerOptions& options);

// The CPU reference backend: fp32 weights and KV, kernels/cpu ops. Engine thread only.
//
// Tensor parallelism (options.tensor_parallel = tp): rank r runs on its own thread (rank 0 on
// the caller's) with an in-process Communicator. Column-parallel q/k/v and gate/up (its heads,
// its slice of the intermediate features; KV heads split, or replicated when fewer than tp),
// row-parallel o_proj and down_proj (its K slice; each rank holds the KV cache of its heads),
// vocab-parallel embedding and lm_head; norms and the residual stream replicated. A row-parallel
// output is the canonical 8-segment K tree of kernels/cpu/ops.h: each rank computes its node,
// the nodes are all-gathered in rank order and combined by the tree's top -- so at every degree,
// tp = 1 included, o_proj and down_proj perform the same operations in the same order. Logits
// are gathered on the full vocabulary; sampling stays in the engine.
class CpuModelRunner final : public ModelRunner {
 public:
  // Loads and shape-checks every tensor of `checkpoint` (converted to fp32), shards it over the
  // ranks and reserves the KV cache (kv_cache_bytes sizes it as for the unsharded model: the
  // block count is the same at every degree). Errors name the missing or mis-shaped tensor, or
  // the dimension that does not split.
  static absl::StatusOr<std::unique_ptr<CpuModelRunner>> Create(const Checkpoint& checkpoint,
                                                                const CpuRunnerOptions& options);
  ~CpuModelRunner() override;

  int32_t tensor_parallel() const { return options_.tensor_parallel; }

  const ModelConfig& config() const override { return config_; }
  const char* backend_name() const override { return "cpu"; }
  int32_t num_kv_blocks() const override { return num_kv_blocks_; }
  int32_t kv_block_size() const override { return options_.kv_block_size; }
  int32_t attention_split_size() const override { return options_.attention_split_size; }

  absl::Status Forward(const ForwardBatch& batch, std::vector<float>* logits) override;
  // MoE models: routing replay (engine/model_runner.h) is implemented.
  bool SupportsRoutingReplay() const override { return config_.is_moe(); }
  absl::Status ForwardWithRouting(const ForwardBatch& batch, std::vector<float>* logits,
                                  std::vector<std::vector<int32_t>>* routing) override;
  absl::Status ProcessLogits(const std::vector<LogitsRowTask>& tasks,
                             const std::vector<float>& logits,
                             std::vector<SampleResult>* results) override {
    // Rank 0 holds the gathered logits; its threads are idle between steps.
    return ProcessLogitsOnHost(tasks, logits, config_.vocab_size, ranks_[0].pool.get(), results);
  }
  const std::vector<WeightSpec>& weight_specs() const override { return weight_specs_; }
  absl::Status UpdateWeights(const std::vector<HostTensorView>& tensors) override;

  // The KV cache's pages go back to the OS (ReleasableHostMemory) and come back zeroed at the
  // same addresses. The weights are in host memory already, where a backup would go: `weights`
  // releases nothing more (ReleasedMemory::weights stays false).
  absl::StatusOr<ReleasedMemory> ReleaseMemory(bool weights) override;
  absl::StatusOr<ReleasedMemory> ResumeMemory() override;
  // Bytes of the KV cache (every rank's shard).
  int64_t kv_cache_bytes() const;
  // Of those, resident in physical memory now (tests).
  absl::StatusOr<int64_t> ResidentKvCacheBytes() const;

 private:
  // One layer's weights and KV cache as one rank holds them (the whole layer at tp = 1).
  struct Layer {
    std::vector<float> input_norm;  // [hidden]
    std::vector<float> q, k, v;     // [heads * head_dim, hidden], [kv_heads * head_dim, hidden]
    std::vector<float> q_bias, k_bias, v_bias;  // empty unless qkv_bias
    std::vector<float> q_norm, k_norm;          // [head_dim]; empty unless qk_norm
    std::vector<float> o;                       // [hidden, heads * head_dim]: its heads' K slice
    std::vector<float> post_norm;               // [hidden]
    std::vector<float> gate_up;           // [2 * inter, hidden]: its gate rows then its up rows
    std::vector<float> down;              // [hidden, inter]: its K slice
    // A MoE layer (ModelConfig::IsMoeLayer) holds these instead of gate_up and down: the
    // router, replicated, and every expert sharded as a dense MLP is (moe_inter features).
    bool moe = false;
    int32_t moe_index = 0;                 // among the MoE layers: its place in a routing
    std::vector<float> router;             // [num_experts, hidden]
    std::vector<float> experts_gate_up;    // [num_experts][2 * moe_inter, hidden]
    std::vector<float> experts_down;       // [num_experts][hidden, moe_inter]: K slices
    // [num_blocks, block_size, kv_heads, head_dim], in Rank::kv.
    float* k_cache = nullptr;
    float* v_cache = nullptr;
  };

  // What the rank holds (RankShard: heads, KV heads, intermediate features, vocab rows), and
  // its weights, KV cache and workers.
  struct Rank : RankShard {
    int index = 0;
    std::unique_ptr<Communicator> comm;
    std::unique_ptr<cpu::ThreadPool> pool;
    std::vector<float> embed;    // [vocab_end - vocab_begin, hidden]
    std::vector<float> lm_head;  // same rows of lm_head; empty when tied to embed
    std::vector<float> final_norm;
    std::vector<Layer> layers;
    ReleasableHostMemory kv;  // every layer's K and V cache
  };

  class RankThreads;
  struct Activations;  // one rank's buffers for one Forward (cpu_runner_internal.h)
  // One Forward's MoE routing: per token, nullptr (it chooses) or its forced routing
  // (RoutingSize() ids); and every token's routing as used, [t, RoutingSize()] (rank 0's).
  struct StepRouting {
    std::vector<const int32_t*> forced;
    std::vector<int32_t> used;
  };

  CpuModelRunner(ModelConfig config, CpuRunnerOptions options);

  // Where (part of) a named checkpoint tensor lives in a rank: rows [row_begin, row_begin +
  // rows) and columns [col_begin, col_begin + cols) of the tensor seen as [shape[0], rest]
  // (1-D: [n, 1]), stored row-major as [rows, cols] in `dest` from `offset`.
  struct Piece {
    std::vector<float>* dest;
    int64_t offset;
    int64_t row_begin, rows, col_begin, cols;
  };
  struct Binding {
    int64_t count = 0;       // elements of the full tensor
    int64_t row_length = 0;  // elements per row of the full tensor
    std::vector<Piece> pieces;
  };
  // Rank `rk`'s piece of a tensor seen as [rows, cols].
  using PieceOf = std::function<Piece(Rank& rk, int64_t rows, int64_t cols)>;

  // Load checks that the checkpoint has every tensor, then in order: shards the ranks, binds
  // every tensor to the pieces the ranks hold (weight updates write through the same
  // bindings), reads the checkpoint into them in fp32 and reserves the KV cache.
  absl::Status Load(const Checkpoint& checkpoint);
  // Records tensor `name`'s binding and weight spec, and sizes each rank's destination to hold
  // its piece. REQUIRES: `checkpoint` has `name`.
  void Bind(const Checkpoint& checkpoint, const std::string& name, std::vector<int64_t> shape,
            const PieceOf& piece);
  void BindWeights(const Checkpoint& checkpoint);
  void BindLayer(const Checkpoint& checkpoint, int layer);
  void BindMoeLayer(const Checkpoint& checkpoint, int layer);
  absl::Status ReadWeights(const Checkpoint& checkpoint);
  absl::Status ReserveKvCache();

  // Rank `rank`'s part of Forward; all ranks run it at once and meet in its collectives, so
  // every rank takes the same steps below. Rank 0 writes `logits`.
  absl::Status RankForward(Rank& rank, const ForwardBatch& batch, const cpu::TokenSlots& slots,
                           StepRouting* routing, std::vector<float>* logits);
  // Writes the batch's embedding rows into a->x.
  absl::Status EmbedTokens(Rank& rank, const ForwardBatch& batch, Activations* a) const;
  // a->x += o_proj(attention(a->x)), writing the batch's K and V into the layer's cache.
  absl::Status AttentionBlock(Rank& rank, Layer& layer, const ForwardBatch& batch,
                              const cpu::TokenSlots& slots, Activations* a) const;
  // a->x += down_proj(silu(gate) * up) of the normed a->x.
  absl::Status MlpBlock(Rank& rank, const Layer& layer, Activations* a) const;
  // a->x += the MoE layer's output for the normed a->x (docs/determinism.md): each token routed
  // (or forced), each expert run on the rows routed to it, the rows' outputs combined in rank
  // order. Rank 0 records the routing used in routing->used.
  absl::Status MoeBlock(Rank& rank, const Layer& layer, StepRouting* routing,
                        Activations* a) const;
  // OK, or INVALID_ARGUMENT for a batch whose routing request does not fit this model.
  absl::Status CheckRouting(const ForwardBatch& batch) const;
  // A row-parallel projection of `in` ([t, k_local], the rank's K slice of a reduction of
  // length k_full) into a->proj: the rank's node of the canonical K tree, gathered, combined by
  // the tree's top.
  absl::Status RowParallel(Rank& rank, const float* in, int64_t k_full, const float* w,
                           Activations* a) const;
  // The final norm and lm_head over the rows of `x` that batch.logit_rows names.
  absl::Status ComputeLogits(Rank& rank, const ForwardBatch& batch, const std::vector<float>& x,
                             std::vector<float>* logits) const;

  const ModelConfig config_;
  const CpuRunnerOptions options_;
  const RopeFrequencies rope_;  // of config_ (model/rope.h), as the CUDA backend's tables
  const DType served_dtype_;    // ServedDType(config_): the weight specs' dtype
  int32_t num_kv_blocks_ = 0;
  int64_t vocab_per_rank_ = 0;  // ceil(vocab / tp): the padded width of gathered logits
  std::vector<Rank> ranks_;
  std::unique_ptr<RankThreads> threads_;
  std::vector<WeightSpec> weight_specs_;  // sorted by name
  std::map<std::string, Binding> bindings_;
};

}  // namespace rollout
