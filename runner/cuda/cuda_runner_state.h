#pragma once

// Internal to the CUDA runner's two translation units (cuda_model_runner.cc: the forward pass;
// cuda_model_runner_load.cc: construction, weights, workspace): what a CudaModelRunner owns on
// the device. Not an API.
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <deque>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/cuda_status.h"
#include "common/status.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/rank_group.h"
#include "kernels/cuda/sampling.h"
#include "kernels/cuda/tensor_parallel.h"
#include "model/tensor_parallel.h"
#include "runner/cuda/batch_plan.h"
#include "runner/cuda/cuda_model_runner.h"

namespace rollout {
namespace cuda_runner_internal {

using cuda::bf16;

// One layer's weights as one rank holds them (heads, kv_heads, intermediate: the rank's own;
// the whole layer at tensor_parallel = 1).
struct LayerWeights {
  bf16* qkv = nullptr;  // [(heads + 2 * kv_heads) * head_dim, hidden]: q rows, k rows, v rows
  // [hidden, heads * head_dim]; with the canonical K tree [segments, hidden, K / 8], the rank's
  // segments of K = all heads * head_dim, each contiguous.
  bf16* o = nullptr;
  bf16* gate_up = nullptr;  // [2 * intermediate, hidden]: gate rows then up rows
  // [hidden, intermediate]; with the canonical K tree [segments, hidden, K / 8] as o.
  bf16* down = nullptr;
  float* input_norm = nullptr;  // [hidden]
  float* post_norm = nullptr;   // [hidden]
  float* q_norm = nullptr;      // [head_dim]; nullptr unless qk_norm
  float* k_norm = nullptr;      // [head_dim]; nullptr unless qk_norm
  float* qkv_bias = nullptr;    // [(heads + 2 * kv_heads) * head_dim]; nullptr unless qkv_bias
};

// A piece of a checkpoint tensor on the device: the tensor seen as [rows, cols] (1-D: [n, 1]),
// rows [row_begin, row_begin + rows) x columns [col_begin, col_begin + cols) of it, stored
// row-major as [rows, cols] at ptr.
struct Piece {
  void* ptr = nullptr;
  int64_t row_begin = 0, rows = 0, col_begin = 0, cols = 0;
  // Ranks on several devices (CudaRunnerOptions::devices): the device ptr is on; -1 otherwise
  // (every piece on the current device).
  int device = -1;
};

// Where a checkpoint tensor goes: its pieces in the ranks (one whole piece at tensor_parallel =
// 1, except the K segments of o/down with the canonical K tree). Loading and weight updates
// write through the same bindings.
struct Binding {
  bool f32 = false;            // fp32 (norms, biases) or bf16 (matrices)
  int64_t rows = 0, cols = 0;  // the full tensor
  std::vector<Piece> pieces;
  bool whole() const {
    return pieces.size() == 1 && pieces[0].rows == rows && pieces[0].cols == cols;
  }
};

// One tensor-parallel rank on the device: its shard of the weights and of the KV cache, its
// activations, GEMMs and stream (the whole model at tensor_parallel = 1). Every rank's work is
// enqueued by the runner's thread.
// RankShard: the rank's own query heads, KV heads (from kv_head_begin: split, or the one its
// query heads read when there are fewer KV heads than ranks), intermediate features, and rows
// [vocab_begin, vocab_end) of the embedding and lm_head (its shards hold vocab_rows rows, the
// ones beyond vocab_end zero).
struct RankState : RankShard {
  int index = 0;
  // The device the rank lives on: CudaRunnerOptions::device, or devices[index] when set.
  int device = 0;

  cudaStream_t stream = nullptr;  // owned by State; rank 0's is State::stream
  cudaEvent_t done = nullptr;     // ranks > 0: joins its stream into rank 0's after a slice
  // The cuBLASLt handle its GEMMs were made with: State::lt, or (a rank on another device than
  // rank 0's) its own, owned by State.
  cublasLtHandle_t lt = nullptr;
  // A rank on another device than rank 0's: its copies of the batch metadata and the RoPE tables
  // (State::meta, rope_cos, rope_sin otherwise).
  cuda::DeviceBuffer meta, rope_cos, rope_sin;

  cuda::DeviceBuffer weights_bf16;
  cuda::DeviceBuffer weights_f32;
  bf16* embed = nullptr;        // [vocab_rows, hidden]
  bf16* lm_head = nullptr;      // [vocab_rows, hidden]; == embed when tied
  float* final_norm = nullptr;  // [hidden]
  std::vector<LayerWeights> layers;

  cuda::DeviceBuffer kv;       // [layers, 2 (k, v), num_blocks, block_size, kv_heads, head_dim]
  int64_t kv_layer_elems = 0;  // elements of one layer's K (or V)

  // Activations for max_batch_tokens tokens.
  cuda::DeviceBuffer x;           // [tokens, hidden] fp32: the residual stream (replicated)
  cuda::DeviceBuffer xn;          // [tokens, hidden] bf16: normed GEMM input
  cuda::DeviceBuffer qkv;         // [tokens, (heads + 2 * kv_heads) * head_dim] fp32
  cuda::DeviceBuffer q;           // [tokens, heads, head_dim] fp32
  cuda::DeviceBuffer attn;        // [tokens, heads * head_dim] bf16
  cuda::DeviceBuffer gate_up;     // [tokens, 2 * intermediate] bf16
  cuda::DeviceBuffer act;         // [tokens, intermediate] bf16
  cuda::DeviceBuffer final_rows;  // [max_logit_rows, hidden] bf16
  cuda::DeviceBuffer partials;    // [tokens, heads, splits, head_dim + 2] fp32
  // Canonical K tree, when the rank owns more than one leaf: [8 / tp, tokens, hidden] fp32.
  cuda::DeviceBuffer leaves;
  // tensor_parallel > 1: [tp, max(tokens * hidden, max_logit_rows * vocab_rows)] fp32, what the
  // all-gathers receive (the rank's own part in its slot).
  cuda::DeviceBuffer gathered;

  // Column-parallel GEMMs run the algorithm pinned for the full weight's shape; with the
  // canonical K tree, gemm_o and gemm_down are the [hidden, K / 8] segment GEMMs.
  std::unique_ptr<cuda::PinnedGemm> gemm_qkv, gemm_o, gemm_gate_up, gemm_down, gemm_lm_head;

  // Frees the rank's device memory (with its device current).
  void ReleaseBuffers() {
    for (cuda::DeviceBuffer* b :
         {&meta, &rope_cos, &rope_sin, &weights_bf16, &weights_f32, &kv, &x, &xn, &qkv, &q, &attn,
          &gate_up, &act, &final_rows, &partials, &leaves, &gathered}) {
      b->Reset();
    }
  }
};

enum Family {
  kMeta,
  kEmbed,
  kNorm,
  kGemmQkv,
  kQkvRope,
  kAttention,
  kGemmO,
  kGemmGateUp,
  kSiluMul,
  kGemmDown,
  kLmHead,
  kLogitsCopy,
  kNumFamilies
};
inline constexpr const char* kFamilyNames[kNumFamilies] = {"metadata h2d",
                                                           "embedding",
                                                           "rmsnorm",
                                                           "gemm qkv",
                                                           "qk-norm+rope+kv write",
                                                           "attention",
                                                           "gemm o (+res)",
                                                           "gemm gate_up",
                                                           "silu*up",
                                                           "gemm down (+res)",
                                                           "lm_head (+final norm)",
                                                           "logits d2h"};

}  // namespace cuda_runner_internal

// Everything a runner holds on the device. Engine thread only, like the runner.
struct CudaModelRunner::State {
  using LayerWeights = cuda_runner_internal::LayerWeights;
  using Binding = cuda_runner_internal::Binding;
  using RankState = cuda_runner_internal::RankState;
  using bf16 = cuda::bf16;

  ~State() {
    DropGraphs();
    for (cudaEvent_t e : events) cudaEventDestroy(e);
    for (HostSlot& h : slots) {
      if (h.done != nullptr) cudaEventDestroy(h.done);
    }
    group.reset();
    if (fork != nullptr) cudaEventDestroy(fork);
    for (RankState& rk : ranks) {
      if (multi_device) cudaSetDevice(rk.device);
      if (rk.stream != nullptr) cudaStreamSynchronize(rk.stream);
      rk.gemm_qkv.reset();
      rk.gemm_o.reset();
      rk.gemm_gate_up.reset();
      rk.gemm_down.reset();
      rk.gemm_lm_head.reset();
      if (rk.done != nullptr) cudaEventDestroy(rk.done);
      if (rk.lt != nullptr && rk.lt != lt) cublasLtDestroy(rk.lt);
      if (multi_device) rk.ReleaseBuffers();
    }
    if (multi_device && !ranks.empty()) cudaSetDevice(ranks[0].device);
    if (lt != nullptr) cublasLtDestroy(lt);
    for (RankState& rk : ranks) {
      if (multi_device) cudaSetDevice(rk.device);
      if (rk.stream != nullptr) cudaStreamDestroy(rk.stream);
    }
    if (multi_device && !ranks.empty()) cudaSetDevice(ranks[0].device);
  }

  // Tensor parallelism: tp ranks (1 = the whole model in ranks[0]); canonical: o_proj and
  // down_proj as the canonical K tree (always when tp > 1); vocab_rows: rows of each rank's
  // embedding / lm_head shard (vocab at tp = 1, else ceil(vocab / tp) rounded up to 64).
  int tp = 1;
  bool canonical = false;
  int64_t vocab_rows = 0;
  std::vector<RankState> ranks;
  // tp > 1: the ranks' exchanges, and the event that starts ranks > 0 after what rank 0's
  // stream enqueued before a slice (the metadata upload; in a capture, what forks them into it).
  std::unique_ptr<cuda::RankGroup> group;
  cudaEvent_t fork = nullptr;
  // Ranks on several devices (CudaRunnerOptions::devices with more than one): every enqueue for
  // a rank runs with its device current (SetDevice), the exchanges are NCCL's, and decode runs
  // without CUDA graphs. False: every rank on ranks[0].device, which stays current throughout.
  bool multi_device = false;

  // Makes rk's device current when ranks span devices (nothing otherwise).
  absl::Status SetDevice(const RankState& rk) const {
    if (!multi_device) return absl::OkStatus();
    return CudaError(cudaSetDevice(rk.device), "cudaSetDevice");
  }
  // The batch metadata and RoPE tables as rank rk reads them (on its device).
  bool OwnCopies(const RankState& rk) const { return multi_device && rk.index > 0; }
  const int32_t* MetaOf(const RankState& rk) const {
    return OwnCopies(rk) ? rk.meta.get<int32_t>() : meta.get<int32_t>();
  }
  const float* RopeCosOf(const RankState& rk) const {
    return OwnCopies(rk) ? rk.rope_cos.get<float>() : rope_cos.get<float>();
  }
  const float* RopeSinOf(const RankState& rk) const {
    return OwnCopies(rk) ? rk.rope_sin.get<float>() : rope_sin.get<float>();
  }

  cudaStream_t stream = nullptr;  // rank 0's: metadata, logits, sampling, capture origin
  cublasLtHandle_t lt = nullptr;

  int64_t weight_bytes = 0;
  std::map<std::string, Binding> bindings;
  std::vector<WeightSpec> weight_specs;  // sorted by name

  cuda::DeviceBuffer rope_cos;  // [max_position, head_dim / 2]
  cuda::DeviceBuffer rope_sin;  // [max_position, head_dim / 2]

  cuda::DeviceBuffer logits;  // [max_logit_rows, vocab] fp32, full rows (rank 0's stream)
  // int32 batch metadata (SliceShape's layout, runner/cuda/batch_plan.h), read by every rank on
  // rank 0's device (RankState::meta on the others).
  cuda::DeviceBuffer meta;

  // The last Forward's logits: on the device in `logits` rows [0, last_rows) when they fit
  // (last_on_device), else copied pass by pass to `spill` [last_rows, vocab].
  int64_t last_rows = 0;
  bool last_on_device = false;
  std::vector<float> spill;
  // ProcessLogits: per-row specs and results on the device, [max_logit_rows].
  cuda::DeviceBuffer row_specs, row_results;

  // Host staging (pinned): the batch metadata, the sampling specs ([max_logit_rows]) and
  // results ([max_logit_rows]) of a step. Two, so that LaunchStep prepares step N + 1 while
  // the device still copies step N's; `done` is recorded after a launched step's last copy, and
  // a slot is written again only after it. Forward and ProcessLogits stage in the current slot:
  // LaunchStep's own calls use a slot no uncollected step holds; callers outside LaunchStep
  // must not call them while a launched step is uncollected.
  struct HostSlot {
    cuda::PinnedHostBuffer meta, specs, results;
    cudaEvent_t done = nullptr;
  };
  HostSlot slots[2];
  int slot = 0;  // the slot being staged in
  HostSlot& staging() { return slots[slot]; }
  // Launched steps not collected yet (LaunchStep / CollectStep), oldest first.
  struct Launched {
    int slot = -1;  // >= 0: on the device; the results are in slots[slot].results after `done`
    int64_t rows = 0;
    std::vector<SampleResult> results;  // slot < 0: computed at launch
  };
  std::deque<Launched> launched;
  // The device's row_results hold the tokens of the last launched step's feed_rows rows: a
  // launched batch may take its fed tokens from them.
  bool feed_ready = false;
  int64_t feed_rows = 0;

  std::vector<std::string> gemm_descriptions;

  // Decode graphs by (padded batch size, split bucket). They hold the device pointers of the
  // buffers above: reallocating one (Grow) drops them all.
  std::map<std::pair<int64_t, int32_t>, cudaGraphExec_t> graphs;
  bool graphs_failed = false;  // a capture failed once: decode runs eagerly from then on
  int64_t graphs_captured = 0;
  int64_t graph_launches = 0;
  // A KV block outside the engine's pool: padding rows of a decode graph write and read it.
  int32_t pad_block = 0;

  void DropGraphs() {
    for (auto& [key, exec] : graphs) cudaGraphExecDestroy(exec);
    graphs.clear();
  }
  // Makes `buffer` hold at least `bytes` (allocating `alloc_bytes` when it must grow).
  cudaError_t Grow(cuda::DeviceBuffer* buffer, size_t bytes, size_t alloc_bytes) {
    if (buffer->bytes() >= bytes) return cudaSuccess;
    // A launched step (LaunchStep) may still read the buffer and replay the graphs.
    const cudaError_t idle = cudaDeviceSynchronize();
    if (idle != cudaSuccess) return idle;
    DropGraphs();
    return buffer->Allocate(alloc_bytes);
  }

  bool profiling = false;
  std::vector<cudaEvent_t> events;  // recorded in order during one Forward
  std::vector<int> event_family;    // family of the work that ends at events[i]
  size_t num_events = 0;
  double family_ms[cuda_runner_internal::kNumFamilies] = {};
  int64_t profiled_forwards = 0;

  absl::Status Mark(int family) {
    if (!profiling) return absl::OkStatus();
    if (num_events == events.size()) {
      cudaEvent_t e;
      ROLLOUT_RETURN_IF_ERROR(CudaError(cudaEventCreate(&e), "cudaEventCreate"));
      events.push_back(e);
      event_family.push_back(0);
    }
    event_family[num_events] = family;
    ROLLOUT_RETURN_IF_ERROR(
        CudaError(cudaEventRecord(events[num_events], stream), "cudaEventRecord"));
    ++num_events;
    return absl::OkStatus();
  }
};

}  // namespace rollout
