// CudaModelRunner's forward pass: the batch checked, cut into slices of max_batch_tokens, and
// each slice planned on the host (batch_plan.h), its metadata uploaded, then enqueued kernel by
// kernel (forward_layers.cc) or as a decode graph's replay (decode_graphs.cc).
#include <cuda_runtime.h>

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/cuda_status.h"
#include "common/status.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/sampling.h"
#include "runner/cuda/batch_plan.h"
#include "runner/cuda/cuda_model_runner.h"
#include "runner/cuda/cuda_runner_state.h"

namespace rollout {

using cuda_runner_internal::kMeta;
using cuda_runner_internal::RankState;
using cuda_runner_internal::SlicePlan;
using cuda_runner_internal::SlicePlanOptions;

absl::Status CudaModelRunner::Forward(const ForwardBatch& batch, std::vector<float>* logits) {
  if (logits != nullptr) logits->clear();
  if (batch.asks_routing()) {
    if (batch.return_routing) {
      return absl::InvalidArgumentError(
          "a batch that asks for its routing back (return_routing) goes through "
          "ForwardWithRouting");
    }
    std::vector<std::vector<int32_t>> unused;
    return ForwardWithRouting(batch, nullptr, &unused);  // logits stay on the GPU
  }
  return ForwardImpl(batch, nullptr);
}

absl::Status CudaModelRunner::ForwardToHost(const ForwardBatch& batch, std::vector<float>* logits) {
  logits->resize(batch.logit_rows.size() * static_cast<size_t>(config_.vocab_size));
  ROLLOUT_RETURN_IF_ERROR(ForwardImpl(batch, logits->data()));
  if (!state_->last_on_device) state_->spill = *logits;
  return absl::OkStatus();
}

// Every token's id, sequence, position and KV blocks, the fed tokens (async only: rows of the
// step launched before) and the logits rows.
absl::Status CudaModelRunner::CheckBatch(const ForwardBatch& batch, bool async) const {
  ROLLOUT_RETURN_IF_ERROR(state_->CheckUsable());  // a group aborted by a hung exchange
  const ModelConfig& c = config_;
  const State& s = *state_;
  const int64_t t = batch.num_tokens();
  if (s.ranks[0].kv.released() || s.ranks[0].weights_bf16.released()) {
    return absl::FailedPreconditionError("the memory is released (ResumeMemory first)");
  }
  if (static_cast<int64_t>(batch.positions.size()) != t ||
      static_cast<int64_t>(batch.token_seq.size()) != t) {
    return absl::InvalidArgumentError("token_ids, positions and token_seq differ in length");
  }
  for (int64_t i = 0; i < t; ++i) {
    const int32_t id = batch.token_ids[i];
    const int32_t pos = batch.positions[i];
    const int32_t seq = batch.token_seq[i];
    if (id < 0 || id >= c.vocab_size)
      return absl::InvalidArgumentError(absl::StrCat("token id ", id));
    if (seq < 0 || seq >= static_cast<int32_t>(batch.block_tables.size())) {
      return absl::InternalError(absl::StrCat("token_seq ", seq, " has no block table"));
    }
    const std::vector<int32_t>& table = batch.block_tables[seq];
    if (pos < 0 || pos >= c.max_position_embeddings ||
        pos / options_.kv_block_size >= static_cast<int64_t>(table.size())) {
      return absl::InternalError(absl::StrCat("position ", pos, " outside its block table"));
    }
  }
  for (size_t i = 0; i < batch.fed_tokens.size(); ++i) {
    const FedToken& fed = batch.fed_tokens[i];
    if (!async || !s.feed_ready || fed.from_row < 0 || fed.from_row >= s.feed_rows ||
        fed.token_index < 0 || fed.token_index >= t ||
        (i > 0 && fed.token_index <= batch.fed_tokens[i - 1].token_index)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "fed token at index %d from row %d: not a row of the step launched before",
          fed.token_index, fed.from_row));
    }
  }
  for (const std::vector<int32_t>& table : batch.block_tables) {
    for (int32_t b : table) {
      if (b < 0 || b >= num_kv_blocks_) return absl::InternalError(absl::StrCat("KV block ", b));
    }
  }
  for (size_t i = 0; i < batch.logit_rows.size(); ++i) {
    if (batch.logit_rows[i] < 0 || batch.logit_rows[i] >= t ||
        (i > 0 && batch.logit_rows[i] <= batch.logit_rows[i - 1])) {
      return absl::InvalidArgumentError("logit_rows must be ascending token indices");
    }
  }
  return absl::OkStatus();
}

absl::Status CudaModelRunner::ForwardImpl(const ForwardBatch& batch, float* host_logits, bool async,
                                          RoutingIo* routing) {
  const ModelConfig& c = config_;
  ROLLOUT_RETURN_IF_ERROR(CheckBatch(batch, async));
  State& s = *state_;
  ROLLOUT_RETURN_IF_ERROR(CudaError(cudaSetDevice(s.ranks[0].device), "cudaSetDevice"));
  s.profiler.BeginForward();
  // The logits stay on the device when every row fits the logits buffer at its own row (a
  // vocab of a multiple of 64 floats keeps every row's start 256-byte aligned for the GEMM, or
  // one slice writes them in one pass from row 0); otherwise each pass is copied to the host.
  // Slices of at most max_batch_tokens tokens and of the attention partials planned at load.
  const std::vector<int64_t> ends = SliceEnds(batch);
  if (async && ends.size() > 1) {
    // A slice's pinned metadata is rewritten by the next slice: only a synchronous forward waits.
    return absl::InternalError("an enqueued step must be one slice (LaunchStep checks SliceEnd)");
  }
  const int64_t rows = static_cast<int64_t>(batch.logit_rows.size());
  const bool keep_on_device =
      rows <= options_.max_logit_rows && (c.vocab_size % 64 == 0 || ends.size() == 1);
  s.last_rows = rows;
  s.last_on_device = keep_on_device;
  if (!keep_on_device && host_logits == nullptr) {
    s.spill.resize(static_cast<size_t>(rows) * c.vocab_size);
    host_logits = s.spill.data();
  }
  ROLLOUT_RETURN_IF_ERROR(s.Mark(kMeta));
  int64_t begin = 0;
  for (int64_t end : ends) {
    ROLLOUT_RETURN_IF_ERROR(
        ForwardSlice(batch, begin, end, host_logits, keep_on_device, async, routing));
    begin = end;
  }
  if (async) return absl::OkStatus();
  ROLLOUT_RETURN_IF_ERROR(s.Wait(s.stream, nullptr, "forward pass"));
  return s.profiler.EndForward();
}

std::vector<int64_t> CudaModelRunner::SliceEnds(const ForwardBatch& batch) const {
  const SlicePlanOptions options = PlanOptions();
  std::vector<int64_t> ends;
  for (int64_t begin = 0; begin < batch.num_tokens(); begin = ends.back()) {
    ends.push_back(
        SliceEnd(batch, begin, options_.max_batch_tokens, state_->partial_token_splits, options));
  }
  return ends;
}

SlicePlanOptions CudaModelRunner::PlanOptions() const {
  const State& s = *state_;
  SlicePlanOptions o;
  o.kv_block_size = options_.kv_block_size;
  o.attention_split_size = options_.attention_split_size;
  // Query heads per KV head in each rank (fewer than the model's when KV heads are replicated).
  o.item_tokens =
      cuda::AttentionItemTokens(static_cast<int>(s.ranks[0].heads / s.ranks[0].kv_heads));
  o.splits_for_every_token = options_.attention_kernel == CudaAttentionKernel::kTensorCore;
  o.share_tokens =
      o.splits_for_every_token && options_.shared_prefix_attention
          ? cuda::AttentionShareTokens(static_cast<int>(s.ranks[0].heads / s.ranks[0].kv_heads))
          : 1;
  o.largest_graph_bucket =
      options_.cuda_graphs ? std::min<int64_t>({options_.max_graph_batch, options_.max_logit_rows,
                                                options_.max_batch_tokens})
                           : 0;
  o.pad_block = s.pad_block;
  return o;
}

// Tokens [begin, end) of the batch through every layer, then their logit rows.
absl::Status CudaModelRunner::ForwardSlice(const ForwardBatch& batch, int64_t begin, int64_t end,
                                           float* host_logits, bool keep_on_device, bool async,
                                           RoutingIo* routing) {
  State& s = *state_;
  // Decode graphs replay only what they captured: logits on the device, no profiling marks, no
  // routing replay; and not when the ranks span devices (decode then runs eagerly).
  const bool may_replay_graph = keep_on_device && !s.profiler.on() && !s.graphs_failed &&
                                !s.multi_device && routing == nullptr;
  const SlicePlanOptions options = PlanOptions();
  const SlicePlan plan = PlanSlice(batch, begin, end, options, may_replay_graph);
  ROLLOUT_RETURN_IF_ERROR(GrowAttentionPartials(plan.shape));
  ROLLOUT_RETURN_IF_ERROR(UploadSliceMetadata(batch, plan, options));
  if (plan.graph_bucket > 0) {
    ROLLOUT_RETURN_IF_ERROR(LaunchDecodeGraph(plan.shape));
    if (host_logits != nullptr) {
      ROLLOUT_RETURN_IF_ERROR(CudaError(
          cudaMemcpyAsync(host_logits, s.logits.get(), plan.rows() * config_.vocab_size * 4,
                          cudaMemcpyDeviceToHost, s.stream),
          "copying logits"));
    }
  } else {
    bool forced = false;
    if (routing != nullptr) {
      absl::StatusOr<bool> uploaded = UploadForcedRouting(*routing, begin, end);
      if (!uploaded.ok()) return uploaded.status();
      forced = *uploaded;
    }
    ROLLOUT_RETURN_IF_ERROR(EnqueueSlice(plan.shape, host_logits, keep_on_device, forced));
  }
  // The pinned metadata buffer is rewritten by the next slice (async: by the launch after the
  // next, LaunchStep's staging slots).
  if (async) return absl::OkStatus();
  ROLLOUT_RETURN_IF_ERROR(s.Wait(s.stream, nullptr, "forward pass"));
  return routing != nullptr ? DownloadRouting(batch, begin, end, routing) : absl::OkStatus();
}

// Every rank's attention split partials for the shape (the tensor-core kernel, or the SIMT
// kernel's split-parallel decode); growing one drops the decode graphs.
absl::Status CudaModelRunner::GrowAttentionPartials(const cuda_runner_internal::SliceShape& shape) {
  State& s = *state_;
  const bool mma = options_.attention_kernel == CudaAttentionKernel::kTensorCore;
  if (!mma && !options_.split_parallel_decode) return absl::OkStatus();
  const int64_t hd = config_.head_dim;
  for (RankState& rk : s.ranks) {
    ROLLOUT_RETURN_IF_ERROR(s.SetDevice(rk));
    const size_t bytes =
        static_cast<size_t>(shape.n) * rk.heads * shape.max_splits * (hd + 2) * sizeof(float);
    ROLLOUT_RETURN_IF_ERROR(
        CudaError(s.Grow(&rk.partials, bytes, bytes + bytes / 2), "allocating attention partials"));
  }
  return s.SetDevice(s.ranks[0]);
}

absl::Status CudaModelRunner::UploadSliceMetadata(const ForwardBatch& batch, const SlicePlan& plan,
                                                  const SlicePlanOptions& options) {
  State& s = *state_;
  const size_t meta_bytes = plan.meta_bytes();
  cuda::PinnedHostBuffer& meta_host = s.staging().meta;
  if (meta_host.bytes() < meta_bytes) {
    ROLLOUT_RETURN_IF_ERROR(
        CudaError(meta_host.Allocate(2 * meta_bytes), "allocating batch metadata"));
  }
  // Headroom against regrowth (which drops the graphs).
  ROLLOUT_RETURN_IF_ERROR(
      CudaError(s.Grow(&s.meta, meta_bytes, 2 * meta_bytes), "allocating batch metadata"));
  int32_t* m = meta_host.get<int32_t>();
  PackSliceMetadata(batch, plan, options, m);
  ROLLOUT_RETURN_IF_ERROR(
      CudaError(cudaMemcpyAsync(s.meta.get(), m, meta_bytes, cudaMemcpyHostToDevice, s.stream),
                "uploading batch metadata"));
  if (plan.num_fed > 0) {
    ROLLOUT_RETURN_IF_ERROR(CudaError(
        cuda::FeedSampledTokens(s.row_results.get<cuda::LogitsRowResult>(),
                                s.meta.get<int32_t>() + plan.off_fed,
                                static_cast<int32_t>(plan.num_fed),
                                s.meta.get<int32_t>() + plan.shape.off_tokens(), s.stream),
        "feeding sampled tokens"));
  }
  // Ranks on other devices get their own copy, on their own streams (the slice's fork orders
  // them after rank 0's upload too).
  for (RankState& rk : s.ranks) {
    if (!s.OwnCopies(rk)) continue;
    ROLLOUT_RETURN_IF_ERROR(s.SetDevice(rk));
    ROLLOUT_RETURN_IF_ERROR(
        CudaError(s.Grow(&rk.meta, meta_bytes, 2 * meta_bytes), "allocating batch metadata"));
    ROLLOUT_RETURN_IF_ERROR(CudaError(
        cudaMemcpyAsync(rk.meta.get(), m, meta_bytes, cudaMemcpyHostToDevice, rk.stream.get()),
        "uploading batch metadata"));
  }
  ROLLOUT_RETURN_IF_ERROR(s.SetDevice(s.ranks[0]));
  return s.Mark(kMeta);
}

}  // namespace rollout
