#pragma once

// One tensor-parallel rank of the CUDA runner on its device, and the list that owns the ranks.
// Internal to runner/cuda/. Engine thread only, like the runner.
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <vector>

#include "common/cuda_device_scope.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/ops.h"
#include "model/tensor_parallel.h"
#include "runner/cuda/cuda_handles.h"
#include "runner/cuda/releasable_device_buffer.h"

namespace rollout {
namespace cuda_runner_internal {

// One layer's weights as one rank holds them (heads, kv_heads, intermediate: the rank's own;
// the whole layer at tensor_parallel = 1). Pointers into RankState::weights_bf16 / weights_f32.
struct LayerWeights {
  cuda::bf16* qkv = nullptr;  // [(heads + 2 * kv_heads) * head_dim, hidden]: q, k, v rows
  // [hidden, heads * head_dim]; with the canonical K tree [segments, hidden, K / 8], the rank's
  // segments of K = all heads * head_dim, each contiguous.
  cuda::bf16* o = nullptr;
  cuda::bf16* gate_up = nullptr;  // [2 * intermediate, hidden]: gate rows then up rows
  // [hidden, intermediate]; with the canonical K tree [segments, hidden, K / 8] as o.
  cuda::bf16* down = nullptr;
  float* input_norm = nullptr;  // [hidden]
  float* post_norm = nullptr;   // [hidden]
  float* q_norm = nullptr;      // [head_dim]; nullptr unless qk_norm
  float* k_norm = nullptr;      // [head_dim]; nullptr unless qk_norm
  float* qkv_bias = nullptr;    // [(heads + 2 * kv_heads) * head_dim]; nullptr unless qkv_bias
  // A MoE layer (ModelConfig::IsMoeLayer; gate_up and down are then null): the router and every
  // expert, experts contiguous so that the grouped GEMM finds expert e at e * its size.
  cuda::bf16* router = nullptr;          // [num_experts, hidden]
  cuda::bf16* expert_gate_up = nullptr;  // [num_experts, 2 * moe_inter, hidden]: gate rows, up rows
  cuda::bf16* expert_down = nullptr;     // [num_experts, hidden, moe_inter]
  int32_t moe_layer = 0;                 // the layer's index among the MoE layers (router set)
  bool moe() const { return router != nullptr; }
};

// One tensor-parallel rank on the device: its shard of the weights and of the KV cache, its
// activations, GEMMs and stream (the whole model at tensor_parallel = 1). Every rank's work is
// enqueued by the runner's thread.
// RankShard: the rank's own query heads, KV heads (from kv_head_begin: split, or the one its
// query heads read when there are fewer KV heads than ranks), intermediate features, and rows
// [vocab_begin, vocab_end) of the embedding and lm_head (its shards hold vocab_rows rows, the
// ones beyond vocab_end zero).
//
// Members are destroyed in reverse order of declaration, once the stream is drained
// (~CudaModelRunner) and with the rank's device current (RankList): the pinned GEMMs (and their
// workspaces), `done`, the own cuBLASLt handle, the device memory, and the stream last.
struct RankState : RankShard {
  int index = 0;
  // The device the rank lives on: CudaRunnerOptions::device, or devices[index] when set.
  int device = 0;

  CudaStream stream;  // rank 0's is State::stream
  // The cuBLASLt handle its GEMMs were made with: State::lt, or (a rank on another device than
  // rank 0's) own_lt.
  cublasLtHandle_t lt = nullptr;
  // A rank on another device than rank 0's: its copies of the batch metadata and the RoPE tables
  // (State::meta, rope_cos, rope_sin otherwise).
  cuda::DeviceBuffer meta, rope_cos, rope_sin;

  // The weights and the KV pool are what ReleaseMemory can give back (ReleasableDeviceBuffer:
  // their addresses, and the decode graphs that hold them, survive a release).
  ReleasableDeviceBuffer weights_bf16;
  ReleasableDeviceBuffer weights_f32;
  cuda::bf16* embed = nullptr;    // [vocab_rows, hidden]
  cuda::bf16* lm_head = nullptr;  // [vocab_rows, hidden]; == embed when tied
  float* final_norm = nullptr;    // [hidden]
  std::vector<LayerWeights> layers;

  // [layers, 2 (k, v), blocks, kv_heads, block_size, head_dim] bf16: per layer its K then its V,
  // each the paged layout of cuda::KvCacheView (kernels/cuda/ops.h, KvPageOffset). blocks =
  // num_kv_blocks + 1 (the last is the decode graphs' padding block); kv_heads are the rank's.
  ReleasableDeviceBuffer kv;
  int64_t kv_layer_elems = 0;  // elements of one layer's K (or V)

  // Activations for max_batch_tokens tokens.
  cuda::DeviceBuffer x;           // [tokens, hidden] fp32: the residual stream (replicated)
  cuda::DeviceBuffer xn;          // [tokens, hidden] bf16: normed GEMM input
  // The norm weight with which xn already holds RmsNorm(x), left by the kernel that added the
  // last term into x (cuda::SumTreeRmsNorm, cuda::MoeCombineRmsNorm); nullptr when none. Host
  // state of the enqueue: set by that add, taken (and cleared) by the next NormIntoXn.
  const float* xn_norm = nullptr;
  cuda::DeviceBuffer qkv;         // [tokens, (heads + 2 * kv_heads) * head_dim] fp32
  cuda::DeviceBuffer q;           // [tokens, heads, head_dim] fp32
  cuda::DeviceBuffer attn;        // [tokens, heads * head_dim] bf16
  cuda::DeviceBuffer gate_up;     // [tokens, 2 * intermediate] bf16
  cuda::DeviceBuffer act;         // [tokens, intermediate] bf16
  cuda::DeviceBuffer final_rows;  // [max_logit_rows, hidden] bf16
  cuda::DeviceBuffer partials;    // [tokens, heads, splits, head_dim + 2] fp32
  // MoE layers (empty for a dense model), for T = max_batch_tokens tokens and A = T * top_k
  // assignments (kernels/cuda/moe.h).
  cuda::DeviceBuffer router_logits;    // [T, num_experts] fp32
  cuda::DeviceBuffer moe_ids;          // [moe layers, T', top_k] int32: a slice of T' tokens'
                                       // routing, layer-major (routing replay reads it back)
  cuda::DeviceBuffer moe_weights;      // [T, top_k] fp32
  cuda::DeviceBuffer moe_forced_ids;   // [moe layers, T', top_k] int32: routing replay's
  cuda::DeviceBuffer moe_forced_rows;  // [T] int32: nonzero where the token's routing is forced
  cuda::DeviceBuffer moe_grouping;     // int32: counts [E], offsets [E + 1], tiles [E + 1],
                                       // rows [A], slots [A]
  cuda::DeviceBuffer moe_gate_up;      // [A, 2 * moe_inter] bf16
  cuda::DeviceBuffer moe_act;          // [A, moe_inter] bf16
  cuda::DeviceBuffer moe_y;            // [A, hidden] fp32
  // Canonical K tree, when the rank owns more than one leaf: [8 / tp, tokens, hidden] fp32.
  cuda::DeviceBuffer leaves;
  // tensor_parallel > 1: [tp, max(tokens * hidden, max_logit_rows * vocab_rows)] fp32, what the
  // all-gathers receive (the rank's own part in its slot).
  cuda::DeviceBuffer gathered;

  CublasLt own_lt;
  CudaEvent done;  // ranks > 0: joins its stream into rank 0's after a slice

  // Column-parallel GEMMs run the algorithm pinned for the full weight's shape; with the
  // canonical K tree, gemm_o and gemm_down are the [hidden, K / 8] segment GEMMs.
  std::unique_ptr<cuda::PinnedGemm> gemm_qkv, gemm_o, gemm_gate_up, gemm_down, gemm_lm_head;
  // MoE: the router logits [tokens, num_experts] fp32 (null for a dense model).
  std::unique_ptr<cuda::PinnedGemm> gemm_router;
};

// The tensor-parallel ranks, rank r at [r]. Destroys them in index order, each with its device
// current when they span devices (a rank's memory, pinned GEMMs, event, cuBLASLt handle and
// stream belong to its device); the caller's device is current again after each.
class RankList {
 public:
  RankList() = default;
  ~RankList() {
    while (!ranks_.empty()) {
      std::optional<CudaDeviceScope> restore;
      if (span_devices_) {
        restore.emplace();
        cudaSetDevice(ranks_.front().device);
      }
      ranks_.pop_front();
    }
  }
  RankList(const RankList&) = delete;
  RankList& operator=(const RankList&) = delete;

  // REQUIRES: empty. `count` ranks; span_devices: on several devices (CudaRunnerOptions::devices).
  void Create(int count, bool span_devices) {
    ranks_.resize(count);
    span_devices_ = span_devices;
  }

  RankState& operator[](size_t r) { return ranks_[r]; }
  const RankState& operator[](size_t r) const { return ranks_[r]; }
  size_t size() const { return ranks_.size(); }
  bool empty() const { return ranks_.empty(); }
  std::deque<RankState>::iterator begin() { return ranks_.begin(); }
  std::deque<RankState>::iterator end() { return ranks_.end(); }
  std::deque<RankState>::const_iterator begin() const { return ranks_.begin(); }
  std::deque<RankState>::const_iterator end() const { return ranks_.end(); }

 private:
  std::deque<RankState> ranks_;
  bool span_devices_ = false;
};

}  // namespace cuda_runner_internal
}  // namespace rollout
