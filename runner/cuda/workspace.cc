// CudaModelRunner::Finish and its steps, after the weights: the RoPE tables, the workspace
// (activations, logits, sampling buffers, host staging), the pinned GEMMs (pinned_gemms.cc),
// then the KV pool from the memory left.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/cuda_status.h"
#include "common/status.h"
#include "engine/broadcast_plan.h"
#include "glog/logging.h"
#include "kernels/cuda/moe.h"
#include "kernels/cuda/sampling.h"
#include "kernels/cuda/tensor_parallel.h"
#include "model/rope.h"
#include "model/weight_digest.h"
#include "runner/cuda/batch_plan.h"
#include "runner/cuda/cuda_model_runner.h"
#include "runner/cuda/cuda_runner_state.h"
#include "runner/memory_plan.h"

namespace rollout {
namespace {

using cuda_runner_internal::RankState;

// cos/sin [max_position, head_dim / 2]: RopeCosSin of every position (model/rope.h), the
// floats the CPU reference rotates with.
void RopeTables(const ModelConfig& c, std::vector<float>* cos_table,
                std::vector<float>* sin_table) {
  const int64_t half = c.head_dim / 2, max_pos = c.max_position_embeddings;
  cos_table->resize(max_pos * half);
  sin_table->resize(max_pos * half);
  const RopeFrequencies f = ComputeRopeFrequencies(c.rope_scaling, c.rope_theta, c.head_dim);
  for (int64_t p = 0; p < max_pos; ++p) {
    RopeCosSin(f, p, cos_table->data() + p * half, sin_table->data() + p * half);
  }
}

}  // namespace

absl::Status CudaModelRunner::Finish() {
  // Rank 0's device: the memory plan the start-up log prints (weights, then every workspace a
  // step can need at the limits, then the KV pool from what is left; nothing grows later).
  size_t free_before = 0, free_after = 0, total = 0;
  ROLLOUT_RETURN_IF_ERROR(CudaError(cudaMemGetInfo(&free_before, &total), "cudaMemGetInfo"));
  ROLLOUT_RETURN_IF_ERROR(UploadRopeTables());
  if (absl::Status workspace = AllocateWorkspace(); !workspace.ok()) {
    // Out of memory here is a limit the device cannot meet: say which one to lower.
    if (!absl::StrContains(workspace.message(), "cudaErrorMemoryAllocation")) return workspace;
    return absl::ResourceExhaustedError(absl::StrFormat(
        "the step workspace at --max_batch_tokens=%d (attention partials for %d token-splits, "
        "from a maximum context of %d) does not fit in the %.2f GiB left after the weights: "
        "lower --max_batch_tokens (%s)",
        options_.max_batch_tokens, state_->partial_token_splits, config_.max_position_embeddings,
        static_cast<double>(free_before) / (1 << 30), workspace.message()));
  }
  ROLLOUT_RETURN_IF_ERROR(AllocateWeightStaging());
  const int64_t staging_bytes =
      static_cast<int64_t>(state_->weight_staging.bytes() + state_->staging_leaf_digests.bytes() +
                           state_->staging_tensor_digests.bytes());
  ROLLOUT_RETURN_IF_ERROR(state_->canonical ? PinCanonicalGemms() : PinGemms());
  ROLLOUT_RETURN_IF_ERROR(PinMoeGemms());
  ROLLOUT_RETURN_IF_ERROR(CudaError(cudaMemGetInfo(&free_after, &total), "cudaMemGetInfo"));
  ROLLOUT_RETURN_IF_ERROR(AllocateKvCache());
  size_t free_left = 0;
  ROLLOUT_RETURN_IF_ERROR(CudaError(cudaMemGetInfo(&free_left, &total), "cudaMemGetInfo"));
  MemoryPlan plan;
  plan.where = absl::StrFormat("GPU %d", state_->ranks[0].device);
  plan.items = {
      {"weights", weight_bytes(), ""},
      {absl::StrFormat("workspace at %d tokens per step, attention partials for %d token-splits",
                       options_.max_batch_tokens, state_->partial_token_splits),
       static_cast<int64_t>(free_before - free_after) - staging_bytes, "--max_batch_tokens"},
  };
  if (staging_bytes > 0) {
    plan.items.push_back({"broadcast staging (every served tensor) and its digests", staging_bytes,
                          "--device_weight_staging"});
  }
  plan.items.push_back({"KV cache", static_cast<int64_t>(free_after - free_left), "--kv_cache_mb"});
  plan.available = static_cast<int64_t>(free_before) + weight_bytes();
  LOG(INFO) << "memory plan, " << plan.ToString();
  return absl::OkStatus();
}

// On rank 0's device, and a copy on each other device the ranks span.
absl::Status CudaModelRunner::UploadRopeTables() {
  State& s = *state_;
  std::vector<float> cos_table, sin_table;
  RopeTables(config_, &cos_table, &sin_table);
  const size_t bytes = cos_table.size() * sizeof(float);
  ROLLOUT_RETURN_IF_ERROR(CudaError(s.rope_cos.Allocate(bytes), "allocating RoPE tables"));
  ROLLOUT_RETURN_IF_ERROR(CudaError(s.rope_sin.Allocate(bytes), "allocating RoPE tables"));
  ROLLOUT_RETURN_IF_ERROR(CudaError(
      cudaMemcpy(s.rope_cos.get(), cos_table.data(), bytes, cudaMemcpyHostToDevice), "RoPE"));
  ROLLOUT_RETURN_IF_ERROR(CudaError(
      cudaMemcpy(s.rope_sin.get(), sin_table.data(), bytes, cudaMemcpyHostToDevice), "RoPE"));
  for (RankState& rk : s.ranks) {  // ranks on other devices: their own copies
    if (!s.OwnCopies(rk)) continue;
    ROLLOUT_RETURN_IF_ERROR(s.SetDevice(rk));
    ROLLOUT_RETURN_IF_ERROR(CudaError(rk.rope_cos.Allocate(bytes), "allocating RoPE tables"));
    ROLLOUT_RETURN_IF_ERROR(CudaError(rk.rope_sin.Allocate(bytes), "allocating RoPE tables"));
    ROLLOUT_RETURN_IF_ERROR(CudaError(
        cudaMemcpy(rk.rope_cos.get(), cos_table.data(), bytes, cudaMemcpyHostToDevice), "RoPE"));
    ROLLOUT_RETURN_IF_ERROR(CudaError(
        cudaMemcpy(rk.rope_sin.get(), sin_table.data(), bytes, cudaMemcpyHostToDevice), "RoPE"));
  }
  return s.SetDevice(s.ranks[0]);
}

// Each rank's activations for max_batch_tokens tokens (RankState), then on rank 0's device the
// logits and sampling buffers for max_logit_rows rows and the two host staging slots.
absl::Status CudaModelRunner::AllocateWorkspace() {
  const ModelConfig& c = config_;
  State& s = *state_;
  const int64_t h = c.hidden_size, hd = c.head_dim, vocab = c.vocab_size;
  const int tp = s.tp;
  const int64_t t = options_.max_batch_tokens, r = options_.max_logit_rows;
  // A rank's leaves of the canonical K tree: a separate buffer when it owns more than one.
  const int local_segments = cuda::kNumKSegments / tp;
  // Attention split partials for every slice the forward cuts (SliceEnd), planned here so that
  // no step allocates them: [token-splits, heads, head_dim + 2] fp32.
  const bool partials = options_.attention_kernel == CudaAttentionKernel::kTensorCore ||
                        options_.split_parallel_decode;
  s.partial_token_splits = partials ? cuda_runner_internal::PlannedTokenSplits(
                                          c.max_position_embeddings, t, PlanOptions())
                                    : std::numeric_limits<int64_t>::max() / 2;
  for (RankState& rk : s.ranks) {
    ROLLOUT_RETURN_IF_ERROR(s.SetDevice(rk));
    const int64_t qkv_cols = (rk.heads + 2 * rk.kv_heads) * hd;
    const int64_t leaves = s.canonical && local_segments > 1 ? local_segments * t * h * 4 : 0;
    const int64_t gathered = tp > 1 ? tp * std::max(t * h, r * s.vocab_rows) * 4 : 0;
    // A MoE model: the dense MLP buffers only if a layer is dense; the MoE buffers for every
    // token's top_k assignments (kernels/cuda/moe.h).
    const int64_t moe_layers = c.NumMoeLayers();
    const bool dense_mlp = moe_layers < c.num_layers;
    const int64_t e = c.num_experts, k = c.num_experts_per_tok, a = t * k;
    const int64_t mi = c.moe_intermediate_size;
    for (auto [buffer, bytes] : std::vector<std::pair<cuda::DeviceBuffer*, int64_t>>{
             {&rk.x, t * h * 4},
             {&rk.xn, t * h * 2},
             {&rk.qkv, t * qkv_cols * 4},
             {&rk.q, t * rk.heads * hd * 4},
             {&rk.attn, t * rk.heads * hd * 2},
             {&rk.gate_up, dense_mlp ? t * 2 * rk.inter * 2 : 0},
             {&rk.act, dense_mlp ? t * rk.inter * 2 : 0},
             {&rk.router_logits, t * e * 4},
             {&rk.moe_ids, moe_layers * a * 4},
             {&rk.moe_weights, a * 4},
             {&rk.moe_forced_ids, moe_layers * a * 4},
             {&rk.moe_forced_rows, moe_layers > 0 ? t * 4 : 0},
             {&rk.moe_grouping, moe_layers > 0 ? cuda::MoeGroupingInts(e, a) * 4 : 0},
             {&rk.moe_gate_up, a * 2 * mi * 2},
             {&rk.moe_act, a * mi * 2},
             {&rk.moe_y, a * h * 4},
             {&rk.final_rows, r * h * 2},
             {&rk.leaves, leaves},
             {&rk.gathered, gathered},
             {&rk.partials, partials ? s.partial_token_splits * rk.heads * (hd + 2) * 4 : 0},
         }) {
      ROLLOUT_RETURN_IF_ERROR(CudaError(buffer->Allocate(bytes), "allocating activations"));
    }
  }
  ROLLOUT_RETURN_IF_ERROR(s.SetDevice(s.ranks[0]));
  for (auto [buffer, bytes] : std::vector<std::pair<cuda::DeviceBuffer*, int64_t>>{
           {&s.logits, r * vocab * 4},
           {&s.row_specs, r * static_cast<int64_t>(sizeof(cuda::LogitsRowSpec))},
           {&s.row_results, r * static_cast<int64_t>(sizeof(cuda::LogitsRowResult))},
       }) {
    ROLLOUT_RETURN_IF_ERROR(CudaError(buffer->Allocate(bytes), "allocating activations"));
  }
  for (State::HostSlot& slot : s.slots) {
    ROLLOUT_RETURN_IF_ERROR(CudaError(slot.specs.Allocate(r * sizeof(cuda::LogitsRowSpec)),
                                      "allocating sampling specs"));
    ROLLOUT_RETURN_IF_ERROR(CudaError(slot.results.Allocate(r * sizeof(cuda::LogitsRowResult)),
                                      "allocating sampling results"));
    ROLLOUT_RETURN_IF_ERROR(CudaError(
        cudaEventCreateWithFlags(slot.done.Receive(), cudaEventDisableTiming), "cudaEventCreate"));
  }
  return absl::OkStatus();
}

// Room for a broadcast of every served tensor as the checkpoint holds them, laid out as
// engine/broadcast_plan.h lays a stream (each tensor at a 256-byte boundary), with its digest
// leaves and tensor digests; on rank 0's device, before the KV pool takes what is left.
absl::Status CudaModelRunner::AllocateWeightStaging() {
  State& s = *state_;
  if (!options_.device_weight_staging || s.multi_device) return absl::OkStatus();
  uint64_t stream = 0, leaves = 0;
  for (const WeightSpec& spec : s.weight_specs) {
    const uint64_t n = spec.nbytes();
    stream += (n + kBroadcastAlignment - 1) / kBroadcastAlignment * kBroadcastAlignment;
    leaves += (n + kDigestLeafBytes - 1) / kDigestLeafBytes;
  }
  const absl::Status allocated = [&]() -> absl::Status {
    ROLLOUT_RETURN_IF_ERROR(CudaError(s.weight_staging.Allocate(stream), "broadcast staging"));
    ROLLOUT_RETURN_IF_ERROR(
        CudaError(s.staging_leaf_digests.Allocate(32 * leaves), "broadcast digest leaves"));
    return CudaError(s.staging_tensor_digests.Allocate(32 * s.weight_specs.size()),
                     "broadcast tensor digests");
  }();
  if (!allocated.ok()) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "--device_weight_staging needs %.2f GiB of GPU memory for a broadcast of every served "
        "tensor, which does not fit beside the weights and the step workspace (%s): serve "
        "without it (and update by UpdateWeights, UpdateWeightsFromPath or IPC), or on a GPU "
        "with more memory",
        static_cast<double>(stream + 32 * leaves) / (1 << 30), allocated.message()));
  }
  return absl::OkStatus();
}

// The KV pool. kv_cache_bytes sizes it as for the unsharded model, so the block count (and every
// scheduling decision) is the same at every degree; a fraction of the free memory is shared by
// the ranks' shards (which hold more than the model's KV heads when replicated).
absl::Status CudaModelRunner::AllocateKvCache() {
  const ModelConfig& c = config_;
  State& s = *state_;
  const int64_t hd = c.head_dim, nkv = c.num_key_value_heads;
  size_t free_bytes = 0, total_bytes = 0;
  ROLLOUT_RETURN_IF_ERROR(CudaError(cudaMemGetInfo(&free_bytes, &total_bytes), "cudaMemGetInfo"));
  auto block_bytes = [&](int64_t kv_heads) {
    return 2 * c.num_layers * static_cast<int64_t>(options_.kv_block_size) * kv_heads * hd * 2;
  };
  int64_t bytes_per_block = block_bytes(nkv);
  if (options_.kv_cache_bytes <= 0 && !s.multi_device) {
    bytes_per_block = 0;
    for (const RankState& rk : s.ranks) bytes_per_block += block_bytes(rk.kv_heads);
  } else if (options_.kv_cache_bytes <= 0) {
    // Ranks on separate devices: each device holds one rank's shard, so the pool is what the
    // device with the least free memory can hold of the largest shard.
    bytes_per_block = 0;
    for (const RankState& rk : s.ranks) {
      bytes_per_block = std::max(bytes_per_block, block_bytes(rk.kv_heads));
      size_t rank_free = 0, rank_total = 0;
      ROLLOUT_RETURN_IF_ERROR(s.SetDevice(rk));
      ROLLOUT_RETURN_IF_ERROR(CudaError(cudaMemGetInfo(&rank_free, &rank_total), "cudaMemGetInfo"));
      free_bytes = std::min(free_bytes, rank_free);
    }
    ROLLOUT_RETURN_IF_ERROR(s.SetDevice(s.ranks[0]));
  }
  const int64_t budget = options_.kv_cache_bytes > 0
                             ? options_.kv_cache_bytes
                             : static_cast<int64_t>(free_bytes * options_.kv_cache_fraction);
  // Slots (block * block_size + offset) are int32 in the kernels.
  const int64_t max_blocks = (int64_t{1} << 31) / options_.kv_block_size - 1;
  // One block beyond the engine's pool is reserved for the padding rows of decode graphs.
  const int64_t blocks = std::min(budget / bytes_per_block, max_blocks);
  if (blocks < 2) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "KV cache of %d bytes holds fewer than 2 blocks of %d tokens (%d bytes each); %d bytes "
        "free",
        budget, options_.kv_block_size, bytes_per_block, free_bytes));
  }
  ROLLOUT_RETURN_IF_ERROR(CudaError(cudaDeviceSynchronize(), "uploading RoPE tables"));
  num_kv_blocks_ = static_cast<int32_t>(blocks - 1);
  s.pad_block = static_cast<int32_t>(blocks - 1);
  for (RankState& rk : s.ranks) {
    ROLLOUT_RETURN_IF_ERROR(s.SetDevice(rk));
    rk.kv_layer_elems = blocks * options_.kv_block_size * rk.kv_heads * hd;
    const int64_t bytes = blocks * block_bytes(rk.kv_heads);
    ROLLOUT_RETURN_IF_ERROR(CudaError(rk.kv.Allocate(bytes),
                                      absl::StrCat("allocating a KV cache of ", bytes, " bytes")));
    // Zero, as ResumeMemory leaves it: the pool's state after a release is its state at load.
    ROLLOUT_RETURN_IF_ERROR(CudaError(cudaMemset(rk.kv.get(), 0, bytes), "clearing the KV cache"));
    if (!rk.kv.releasable()) {
      LOG(WARNING) << "GPU " << rk.device << ": the KV cache is not in CUDA virtual memory; "
                   << "ReleaseMemory will be refused";
    }
  }
  return s.SetDevice(s.ranks[0]);
}

}  // namespace rollout
