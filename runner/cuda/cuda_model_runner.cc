// CudaModelRunner: the forward pass (metadata, layers, logits) and its profiling. Construction
// and weights are in cuda_model_runner_load.cc.
#include "runner/cuda/cuda_model_runner.h"

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/cuda_status.h"
#include "common/status.h"
#include "glog/logging.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/rank_group.h"
#include "kernels/cuda/sampling.h"
#include "kernels/cuda/tensor_parallel.h"
#include "runner/cuda/batch_plan.h"
#include "runner/cuda/cuda_runner_state.h"

namespace rollout {

using cuda::bf16;
using cuda_runner_internal::CudaGraphExec;
using cuda_runner_internal::kAttention;
using cuda_runner_internal::kEmbed;
using cuda_runner_internal::kFamilyNames;
using cuda_runner_internal::kGemmDown;
using cuda_runner_internal::kGemmGateUp;
using cuda_runner_internal::kGemmO;
using cuda_runner_internal::kGemmQkv;
using cuda_runner_internal::kLmHead;
using cuda_runner_internal::kLogitsCopy;
using cuda_runner_internal::kMeta;
using cuda_runner_internal::kNorm;
using cuda_runner_internal::kNumFamilies;
using cuda_runner_internal::kQkvRope;
using cuda_runner_internal::kSiluMul;
using cuda_runner_internal::LayerWeights;
using cuda_runner_internal::RankState;
using cuda_runner_internal::SlicePlan;
using cuda_runner_internal::SlicePlanOptions;

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

absl::Status CudaModelRunner::Forward(const ForwardBatch& batch, std::vector<float>* logits) {
  if (logits != nullptr) logits->clear();
  return ForwardImpl(batch, nullptr);
}

absl::Status CudaModelRunner::ForwardToHost(const ForwardBatch& batch, std::vector<float>* logits) {
  logits->resize(batch.logit_rows.size() * static_cast<size_t>(config_.vocab_size));
  ROLLOUT_RETURN_IF_ERROR(ForwardImpl(batch, logits->data()));
  if (!state_->last_on_device) state_->spill = *logits;
  return absl::OkStatus();
}

absl::Status CudaModelRunner::ForwardImpl(const ForwardBatch& batch, float* host_logits,
                                          bool async) {
  const ModelConfig& c = config_;
  const int64_t t = batch.num_tokens();
  if (static_cast<int64_t>(batch.positions.size()) != t ||
      static_cast<int64_t>(batch.token_seq.size()) != t) {
    return absl::InvalidArgumentError("token_ids, positions and token_seq differ in length");
  }
  State& s = *state_;
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
  ROLLOUT_RETURN_IF_ERROR(CudaError(cudaSetDevice(s.ranks[0].device), "cudaSetDevice"));
  s.profiler.BeginForward();
  // The logits stay on the device when every row fits the logits buffer at its own row (a
  // vocab of a multiple of 64 floats keeps every row's start 256-byte aligned for the GEMM, or
  // one slice writes them in one pass from row 0); otherwise each pass is copied to the host.
  const int64_t rows = static_cast<int64_t>(batch.logit_rows.size());
  const bool keep_on_device =
      rows <= options_.max_logit_rows && (c.vocab_size % 64 == 0 || t <= options_.max_batch_tokens);
  s.last_rows = rows;
  s.last_on_device = keep_on_device;
  if (!keep_on_device && host_logits == nullptr) {
    s.spill.resize(static_cast<size_t>(rows) * c.vocab_size);
    host_logits = s.spill.data();
  }
  ROLLOUT_RETURN_IF_ERROR(s.Mark(kMeta));
  for (int64_t begin = 0; begin < t; begin += options_.max_batch_tokens) {
    ROLLOUT_RETURN_IF_ERROR(ForwardSlice(batch, begin,
                                         std::min<int64_t>(t, begin + options_.max_batch_tokens),
                                         host_logits, keep_on_device, async));
  }
  if (async) return absl::OkStatus();
  ROLLOUT_RETURN_IF_ERROR(CudaError(cudaStreamSynchronize(s.stream), "forward pass"));
  return s.profiler.EndForward();
}

int64_t CudaModelRunner::graphs_captured() const { return state_->graphs_captured; }
int64_t CudaModelRunner::graph_launches() const { return state_->graph_launches; }

SlicePlanOptions CudaModelRunner::PlanOptions() const {
  const State& s = *state_;
  SlicePlanOptions o;
  o.kv_block_size = options_.kv_block_size;
  o.attention_split_size = options_.attention_split_size;
  // Query heads per KV head in each rank (fewer than the model's when KV heads are replicated).
  o.item_tokens =
      cuda::AttentionItemTokens(static_cast<int>(s.ranks[0].heads / s.ranks[0].kv_heads));
  o.splits_for_every_token = options_.attention_kernel == CudaAttentionKernel::kTensorCore;
  o.largest_graph_bucket =
      options_.cuda_graphs ? std::min<int64_t>({options_.max_graph_batch, options_.max_logit_rows,
                                                options_.max_batch_tokens})
                           : 0;
  o.pad_block = s.pad_block;
  return o;
}

// Tokens [begin, end) of the batch through every layer, then their logit rows.
absl::Status CudaModelRunner::ForwardSlice(const ForwardBatch& batch, int64_t begin, int64_t end,
                                           float* host_logits, bool keep_on_device, bool async) {
  State& s = *state_;
  // Decode graphs replay only what they captured: logits on the device, no profiling marks; and
  // not when the ranks span devices (decode then runs eagerly).
  const bool may_replay_graph =
      keep_on_device && !s.profiler.on() && !s.graphs_failed && !s.multi_device;
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
    ROLLOUT_RETURN_IF_ERROR(EnqueueSlice(plan.shape, host_logits, keep_on_device));
  }
  // The pinned metadata buffer is rewritten by the next slice (async: by the launch after the
  // next, LaunchStep's staging slots).
  if (async) return absl::OkStatus();
  return CudaError(cudaStreamSynchronize(s.stream), "forward pass");
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

absl::Status CudaModelRunner::LaunchDecodeGraph(const cuda_runner_internal::SliceShape& shape) {
  State& s = *state_;
  const std::pair<int64_t, int32_t> key(shape.n, shape.max_splits);
  auto it = s.graphs.find(key);
  if (it == s.graphs.end()) {
    // Capture on this thread only (the engine thread owns the stream); a failure is reported
    // once and decode runs eagerly from then on.
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    absl::Status captured = CudaError(
        cudaStreamBeginCapture(s.stream, cudaStreamCaptureModeThreadLocal), "begin capture");
    if (captured.ok()) {
      captured = EnqueueSlice(shape, nullptr, /*keep_on_device=*/true);
      const absl::Status ended = CudaError(cudaStreamEndCapture(s.stream, &graph), "end capture");
      if (captured.ok()) captured = ended;
    }
    if (captured.ok()) {
      captured = CudaError(cudaGraphInstantiate(&exec, graph, 0), "instantiating a graph");
    }
    if (graph != nullptr) cudaGraphDestroy(graph);
    if (!captured.ok()) {
      (void)cudaGetLastError();  // clear a sticky launch error of the failed capture
      s.graphs_failed = true;
      LOG(WARNING) << "capturing the decode graph of batch " << shape.n
                   << " failed; decode runs without CUDA graphs from now on: " << captured;
      return EnqueueSlice(shape, nullptr, /*keep_on_device=*/true);
    }
    it = s.graphs.emplace(key, CudaGraphExec(exec)).first;
    ++s.graphs_captured;
  }
  ++s.graph_launches;
  return CudaError(cudaGraphLaunch(it->second.get(), s.stream), "launching a decode graph");
}

absl::Status CudaModelRunner::EnqueueSlice(const cuda_runner_internal::SliceShape& shape,
                                           float* host_logits, bool keep_on_device) {
  const ModelConfig& c = config_;
  State& s = *state_;
  // Ranks > 0 start after what rank 0's stream holds so far (the metadata upload); inside a
  // graph capture this forks their streams into it. They join rank 0's stream at the end.
  // Ranks on other devices wait on rank 0's event and record their own with their device
  // current (an event is recorded on a stream of its own device; a stream may wait on an event
  // of any device).
  if (s.tp > 1) {
    ROLLOUT_RETURN_IF_ERROR(CudaError(cudaEventRecord(s.fork.get(), s.stream), "cudaEventRecord"));
    for (RankState& rk : s.ranks) {
      if (rk.index == 0) continue;
      ROLLOUT_RETURN_IF_ERROR(s.SetDevice(rk));
      ROLLOUT_RETURN_IF_ERROR(
          CudaError(cudaStreamWaitEvent(rk.stream.get(), s.fork.get(), 0), "cudaStreamWaitEvent"));
    }
    ROLLOUT_RETURN_IF_ERROR(s.SetDevice(s.ranks[0]));
  }
  ROLLOUT_RETURN_IF_ERROR(EnqueueEmbedding(shape));
  for (int layer = 0; layer < c.num_layers; ++layer) {
    for (RankState& rk : s.ranks) ROLLOUT_RETURN_IF_ERROR(EnqueueAttention(rk, layer, shape));
    ROLLOUT_RETURN_IF_ERROR(CombineRowParallel(shape.n));
    ROLLOUT_RETURN_IF_ERROR(s.Mark(kGemmO));
    for (RankState& rk : s.ranks) ROLLOUT_RETURN_IF_ERROR(EnqueueMlp(rk, layer, shape.n));
    ROLLOUT_RETURN_IF_ERROR(CombineRowParallel(shape.n));
    ROLLOUT_RETURN_IF_ERROR(s.Mark(kGemmDown));
  }
  ROLLOUT_RETURN_IF_ERROR(EnqueueLogits(shape, host_logits, keep_on_device));
  for (RankState& rk : s.ranks) {
    if (rk.index == 0) continue;
    ROLLOUT_RETURN_IF_ERROR(s.SetDevice(rk));
    ROLLOUT_RETURN_IF_ERROR(
        CudaError(cudaEventRecord(rk.done.get(), rk.stream.get()), "cudaEventRecord"));
    ROLLOUT_RETURN_IF_ERROR(s.SetDevice(s.ranks[0]));
    ROLLOUT_RETURN_IF_ERROR(
        CudaError(cudaStreamWaitEvent(s.stream, rk.done.get(), 0), "cudaStreamWaitEvent"));
  }
  return absl::OkStatus();
}

// The embedding rows into every rank's x: gathered directly at tp = 1; else each rank gathers
// the rows of the tokens it owns (zeros elsewhere), the ranks all-gather them, and each takes
// every token's row from its owner.
absl::Status CudaModelRunner::EnqueueEmbedding(const cuda_runner_internal::SliceShape& shape) {
  State& s = *state_;
  const int64_t n = shape.n, h = config_.hidden_size;
  const int32_t* tokens = s.meta.get<int32_t>() + shape.off_tokens();
  auto tokens_of = [&](const RankState& rk) { return s.MetaOf(rk) + shape.off_tokens(); };
  if (s.tp == 1) {
    RankState& rk = s.ranks[0];
    ROLLOUT_RETURN_IF_ERROR(
        CudaError(cuda::EmbeddingGather(tokens, n, rk.embed, h, rk.x.get<float>(), rk.stream.get()),
                  "embedding gather"));
    return s.Mark(kEmbed);
  }
  std::vector<const float*> send;
  std::vector<float*> recv;
  for (RankState& rk : s.ranks) {
    ROLLOUT_RETURN_IF_ERROR(s.SetDevice(rk));
    float* mine = rk.gathered.get<float>() + rk.index * n * h;
    ROLLOUT_RETURN_IF_ERROR(
        CudaError(cuda::EmbeddingGatherShard(tokens_of(rk), n, rk.embed, rk.vocab_begin,
                                             rk.vocab_end, h, mine, rk.stream.get()),
                  "embedding gather (vocab shard)"));
    send.push_back(mine);
    recv.push_back(rk.gathered.get<float>());
  }
  const cuda::GroupStatus gathered = s.group->AllGather(send.data(), n * h, recv.data());
  if (!gathered.ok()) return absl::InternalError("embedding all-gather: " + gathered.message());
  for (RankState& rk : s.ranks) {
    ROLLOUT_RETURN_IF_ERROR(s.SetDevice(rk));
    ROLLOUT_RETURN_IF_ERROR(
        CudaError(cuda::SelectOwnerRows(tokens_of(rk), n, rk.gathered.get<float>(), n * h,
                                        s.vocab_rows, h, rk.x.get<float>(), rk.stream.get()),
                  "embedding owner select"));
  }
  ROLLOUT_RETURN_IF_ERROR(s.SetDevice(s.ranks[0]));
  return s.Mark(kEmbed);
}

// One rank's attention block of `layer`: input norm, its q/k/v heads, qk-norm + RoPE + its KV
// write, attention over its heads, then its part of o_proj.
absl::Status CudaModelRunner::EnqueueAttention(RankState& rk, int layer,
                                               const cuda_runner_internal::SliceShape& shape) {
  const ModelConfig& c = config_;
  State& s = *state_;
  const int64_t n = shape.n, h = c.hidden_size, hd = c.head_dim, nh = rk.heads, nkv = rk.kv_heads;
  const int32_t bs = options_.kv_block_size;
  const bool mma = options_.attention_kernel == CudaAttentionKernel::kTensorCore;
  ROLLOUT_RETURN_IF_ERROR(s.SetDevice(rk));  // the caller restores rank 0's
  const int32_t* d = s.MetaOf(rk);
  cudaStream_t stream = rk.stream.get();
  // Profiling marks follow rank 0's stream.
  auto mark = [&](int family) { return rk.index == 0 ? s.Mark(family) : absl::OkStatus(); };
  float* x = rk.x.get<float>();
  bf16* xn = rk.xn.get<bf16>();
  bf16* attn = rk.attn.get<bf16>();
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const LayerWeights& l = rk.layers[layer];
  bf16* k_cache = rk.kv.get<bf16>() + 2 * layer * rk.kv_layer_elems;
  const cuda::KvCacheView cache{k_cache, k_cache + rk.kv_layer_elems, bs, static_cast<int32_t>(nkv),
                                static_cast<int32_t>(hd)};

  ROLLOUT_RETURN_IF_ERROR(CudaError(
      cuda::RmsNorm(x, nullptr, n, h, l.input_norm, c.rms_norm_eps, xn, stream), "rmsnorm"));
  ROLLOUT_RETURN_IF_ERROR(mark(kNorm));
  ROLLOUT_RETURN_IF_ERROR(
      CublasError(rk.gemm_qkv->Run(xn, n, l.qkv, rk.qkv.get(), stream), "qkv projection"));
  ROLLOUT_RETURN_IF_ERROR(mark(kGemmQkv));

  cuda::QkvParams qp;
  qp.qkv = rk.qkv.get<float>();
  qp.num_tokens = n;
  qp.positions = d + shape.off_pos();
  qp.kv_slots = d + shape.off_slots();
  if (l.qkv_bias != nullptr) {
    qp.q_bias = l.qkv_bias;
    qp.k_bias = l.qkv_bias + nh * hd;
    qp.v_bias = l.qkv_bias + (nh + nkv) * hd;
  }
  qp.q_norm = l.q_norm;
  qp.k_norm = l.k_norm;
  qp.eps = c.rms_norm_eps;
  qp.rope_cos = s.RopeCosOf(rk);
  qp.rope_sin = s.RopeSinOf(rk);
  qp.num_heads = static_cast<int32_t>(nh);
  qp.q_out = rk.q.get<float>();
  ROLLOUT_RETURN_IF_ERROR(
      CudaError(cuda::QkvNormRopeWriteKv(qp, cache, stream), "qk norm, rope and KV write"));
  ROLLOUT_RETURN_IF_ERROR(mark(kQkvRope));

  cuda::AttentionParams ap;
  ap.q = rk.q.get<float>();
  ap.positions = d + shape.off_pos();
  ap.table_offsets = d + shape.off_tab();
  ap.tables = d + shape.off_tables();
  ap.num_heads = static_cast<int32_t>(nh);
  ap.split_size = options_.attention_split_size;
  ap.scale = scale;
  ap.out = attn;
  ap.items = reinterpret_cast<const int2*>(d + shape.off_one());
  ap.num_items = static_cast<int32_t>(shape.num_one);
  if (mma) {
    ap.partials = rk.partials.get<float>();
    ap.max_splits = shape.max_splits;
    ROLLOUT_RETURN_IF_ERROR(
        CudaError(cuda::PagedAttentionMma(ap, cuda::AttentionBlockShape::kOneToken, cache, stream),
                  "attention (one-token items)"));
    // Many-token items fold their splits inside the block (no partials, no merge: the same bits)
    // when there are enough of them for the walks to overlap -- prefill; a few items of long
    // context stay split-parallel. Then only the one-token items' rows are merged.
    const bool fold = shape.num_many > 0 && shape.num_many <= 65535 &&
                      (shape.max_splits <= 4 || shape.num_many * nkv >= 256 * shape.max_splits);
    cuda::AttentionParams many = ap;
    many.items = reinterpret_cast<const int2*>(d + shape.off_many());
    many.num_items = static_cast<int32_t>(shape.num_many);
    if (fold) many.partials = nullptr;
    ROLLOUT_RETURN_IF_ERROR(CudaError(
        cuda::PagedAttentionMma(many, cuda::AttentionBlockShape::kManyTokens, cache, stream),
        "attention (many-token items)"));
    ROLLOUT_RETURN_IF_ERROR(
        CudaError(fold ? cuda::MergeAttentionSplitsOfItems(ap, static_cast<int32_t>(hd), stream)
                       : cuda::MergeAttentionSplits(ap, n, static_cast<int32_t>(hd), stream),
                  "attention split merge"));
  } else {
    if (options_.split_parallel_decode) {
      ap.partials = rk.partials.get<float>();
      ap.max_splits = shape.max_splits;
    }
    ROLLOUT_RETURN_IF_ERROR(
        CudaError(cuda::PagedAttention(ap, cuda::AttentionBlockShape::kOneToken, cache, stream),
                  "attention (one-token items)"));
    ap.partials = nullptr;
    ap.max_splits = 0;
    ap.items = reinterpret_cast<const int2*>(d + shape.off_many());
    ap.num_items = static_cast<int32_t>(shape.num_many);
    ROLLOUT_RETURN_IF_ERROR(
        CudaError(cuda::PagedAttention(ap, cuda::AttentionBlockShape::kManyTokens, cache, stream),
                  "attention (many-token items)"));
  }
  ROLLOUT_RETURN_IF_ERROR(mark(kAttention));
  return EnqueueRowParallel(rk, layer, /*mlp=*/false, n);
}

// One rank's MLP of `layer`: post-attention norm, its gate/up rows, SiLU * up, its part of
// down_proj.
absl::Status CudaModelRunner::EnqueueMlp(RankState& rk, int layer, int64_t n) {
  const ModelConfig& c = config_;
  State& s = *state_;
  auto mark = [&](int family) { return rk.index == 0 ? s.Mark(family) : absl::OkStatus(); };
  ROLLOUT_RETURN_IF_ERROR(s.SetDevice(rk));  // the caller restores rank 0's
  const LayerWeights& l = rk.layers[layer];
  bf16* xn = rk.xn.get<bf16>();
  bf16* gate_up = rk.gate_up.get<bf16>();
  ROLLOUT_RETURN_IF_ERROR(CudaError(cuda::RmsNorm(rk.x.get<float>(), nullptr, n, c.hidden_size,
                                                  l.post_norm, c.rms_norm_eps, xn, rk.stream.get()),
                                    "rmsnorm"));
  ROLLOUT_RETURN_IF_ERROR(mark(kNorm));
  ROLLOUT_RETURN_IF_ERROR(CublasError(
      rk.gemm_gate_up->Run(xn, n, l.gate_up, gate_up, rk.stream.get()), "gate/up projection"));
  ROLLOUT_RETURN_IF_ERROR(mark(kGemmGateUp));
  ROLLOUT_RETURN_IF_ERROR(CudaError(
      cuda::SiluMul(gate_up, n, rk.inter, rk.act.get<bf16>(), rk.stream.get()), "silu * up"));
  ROLLOUT_RETURN_IF_ERROR(mark(kSiluMul));
  return EnqueueRowParallel(rk, layer, /*mlp=*/true, n);
}

// A rank's part of o_proj (mlp = false: input attn, K = heads * head_dim) or down_proj (mlp:
// input act, K = intermediate). Without the canonical tree (tp = 1): x += in . w^T in one GEMM.
// With it: the rank's 8 / tp leaves, one [n, K / 8] x [hidden, K / 8]^T GEMM each (one batched
// call), summed by the tree into the rank's node -- its slot of `gathered` for the all-gather;
// at tp = 1 the whole tree plus the residual goes straight into x.
absl::Status CudaModelRunner::EnqueueRowParallel(RankState& rk, int layer, bool mlp, int64_t n) {
  const ModelConfig& c = config_;
  State& s = *state_;
  const LayerWeights& l = rk.layers[layer];
  const int64_t h = c.hidden_size;
  const bf16* in = mlp ? rk.act.get<bf16>() : rk.attn.get<bf16>();
  const bf16* w = mlp ? l.down : l.o;
  cuda::PinnedGemm* gemm = mlp ? rk.gemm_down.get() : rk.gemm_o.get();
  const char* what = mlp ? "down projection" : "o projection";
  float* x = rk.x.get<float>();
  if (!s.canonical) return CublasError(gemm->Run(in, n, w, x, rk.stream.get()), what);

  const int64_t k_full = mlp ? c.intermediate_size : int64_t{c.num_attention_heads} * c.head_dim;
  const int64_t k_local = k_full / s.tp, seg = k_full / cuda::kNumKSegments;
  const int local = cuda::kNumKSegments / s.tp;
  const int64_t count = n * h;
  float* node = s.tp == 1 ? nullptr : rk.gathered.get<float>() + rk.index * count;
  float* leaves = local == 1 ? node : rk.leaves.get<float>();
  ROLLOUT_RETURN_IF_ERROR(CublasError(
      gemm->RunBatched(in, k_local, seg, n, w, h * seg, leaves, count, local, rk.stream.get()),
      what));
  if (s.tp == 1) {
    return CudaError(
        cuda::SumTree(leaves, local, count, count, x, /*accumulate=*/true, rk.stream.get()),
        "K tree + residual");
  }
  if (local == 1) return absl::OkStatus();
  return CudaError(
      cuda::SumTree(leaves, local, count, count, node, /*accumulate=*/false, rk.stream.get()),
      "K tree node");
}

// tp > 1, after every rank's EnqueueRowParallel: the nodes all-gathered in rank order, then on
// every rank x += the tree's top levels over them (the same bits on every rank).
absl::Status CudaModelRunner::CombineRowParallel(int64_t n) {
  State& s = *state_;
  if (s.tp == 1) return absl::OkStatus();
  const int64_t count = n * config_.hidden_size;
  std::vector<const float*> send;
  std::vector<float*> recv;
  for (RankState& rk : s.ranks) {
    send.push_back(rk.gathered.get<float>() + rk.index * count);
    recv.push_back(rk.gathered.get<float>());
  }
  const cuda::GroupStatus gathered = s.group->AllGather(send.data(), count, recv.data());
  if (!gathered.ok()) return absl::InternalError("K tree all-gather: " + gathered.message());
  for (RankState& rk : s.ranks) {
    ROLLOUT_RETURN_IF_ERROR(s.SetDevice(rk));
    ROLLOUT_RETURN_IF_ERROR(
        CudaError(cuda::SumTree(rk.gathered.get<float>(), s.tp, count, count, rk.x.get<float>(),
                                /*accumulate=*/true, rk.stream.get()),
                  "K tree top + residual"));
  }
  return s.SetDevice(s.ranks[0]);
}

// Logits, max_logit_rows rows at a time: final RMSNorm of the gathered rows, then lm_head. At
// tp > 1 every rank computes its vocab columns ([rows, vocab_rows], one GEMM shape for all),
// the ranks all-gather them and rank 0 copies each rank's real columns into the full rows.
absl::Status CudaModelRunner::EnqueueLogits(const cuda_runner_internal::SliceShape& shape,
                                            float* host_logits, bool keep_on_device) {
  const ModelConfig& c = config_;
  State& s = *state_;
  const int64_t h = c.hidden_size, vocab = c.vocab_size, vr = s.vocab_rows;
  for (int64_t r0 = 0; r0 < shape.num_rows; r0 += options_.max_logit_rows) {
    const int64_t rn = std::min<int64_t>(options_.max_logit_rows, shape.num_rows - r0);
    float* device_rows =
        s.logits.get<float>() + (keep_on_device ? (shape.row_begin + r0) * vocab : 0);
    std::vector<const float*> send;
    std::vector<float*> recv;
    for (RankState& rk : s.ranks) {
      ROLLOUT_RETURN_IF_ERROR(s.SetDevice(rk));
      const int32_t* d = s.MetaOf(rk);
      ROLLOUT_RETURN_IF_ERROR(CudaError(
          cuda::RmsNorm(rk.x.get<float>(), d + shape.off_rows() + r0, rn, h, rk.final_norm,
                        c.rms_norm_eps, rk.final_rows.get<bf16>(), rk.stream.get()),
          "final rmsnorm"));
      float* out = s.tp == 1 ? device_rows : rk.gathered.get<float>() + rk.index * rn * vr;
      ROLLOUT_RETURN_IF_ERROR(CublasError(
          rk.gemm_lm_head->Run(rk.final_rows.get<bf16>(), rn, rk.lm_head, out, rk.stream.get()),
          "lm_head"));
      send.push_back(out);
      recv.push_back(rk.gathered.get<float>());
    }
    ROLLOUT_RETURN_IF_ERROR(s.SetDevice(s.ranks[0]));
    if (s.tp > 1) {
      const cuda::GroupStatus gathered = s.group->AllGather(send.data(), rn * vr, recv.data());
      if (!gathered.ok()) return absl::InternalError("logits all-gather: " + gathered.message());
      const float* all = s.ranks[0].gathered.get<float>();
      for (const RankState& src : s.ranks) {
        const int64_t width = src.vocab_end - src.vocab_begin;
        if (width == 0) continue;
        ROLLOUT_RETURN_IF_ERROR(CudaError(
            cudaMemcpy2DAsync(device_rows + src.vocab_begin, vocab * 4, all + src.index * rn * vr,
                              vr * 4, width * 4, rn, cudaMemcpyDeviceToDevice, s.stream),
            "assembling logits rows"));
      }
    }
    ROLLOUT_RETURN_IF_ERROR(s.Mark(kLmHead));
    if (host_logits != nullptr) {
      float* dst = host_logits + (shape.row_begin + r0) * vocab;
      ROLLOUT_RETURN_IF_ERROR(CudaError(
          cudaMemcpyAsync(dst, device_rows, rn * vocab * 4, cudaMemcpyDeviceToHost, s.stream),
          "copying logits"));
      ROLLOUT_RETURN_IF_ERROR(s.Mark(kLogitsCopy));
    }
  }
  return absl::OkStatus();
}

namespace {

// engine/sampler.cc's logits / T as the device computes it (IEEE division, NaN -> -inf,
// +inf -> FLT_MAX): on the host for rows whose token the host picks.
float HostScaledLogit(float logit, float t) {
  const float x = logit / t;
  if (std::isnan(x)) return -INFINITY;
  if (x == INFINITY) return FLT_MAX;
  return x;
}

bool HostPicksToken(const LogitsRowTask& task, int32_t vocab) {
  const SamplingParams& p = *task.params;
  if (task.score_token.has_value() || !(p.temperature > 0.0f)) return false;
  return (p.top_k > 0 && p.top_k < vocab) || p.top_p < 1.0f || p.min_p > 0.0f;
}

}  // namespace

absl::Status CudaModelRunner::ProcessLogits(const std::vector<LogitsRowTask>& tasks,
                                            const std::vector<float>& logits,
                                            std::vector<SampleResult>* results) {
  State& s = *state_;
  const int64_t rows = static_cast<int64_t>(tasks.size());
  const int64_t vocab = config_.vocab_size;
  const bool from_caller = !logits.empty();
  if (from_caller && static_cast<int64_t>(logits.size()) != rows * vocab) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%d logits rows of %d expected, %d values given", rows, vocab, logits.size()));
  }
  if (!from_caller && rows != s.last_rows) {
    return absl::InternalError(
        absl::StrFormat("%d tasks for the %d logits rows of the last Forward", rows, s.last_rows));
  }
  for (const LogitsRowTask& task : tasks) {
    if (task.params == nullptr) return absl::InvalidArgumentError("task without params");
    if (task.params->top_logprobs > cuda::kMaxDeviceTopN) {
      return absl::InvalidArgumentError(
          absl::StrFormat("top_logprobs %d: at most %d on the CUDA backend",
                          task.params->top_logprobs, cuda::kMaxDeviceTopN));
    }
    if (task.score_token.has_value() && (*task.score_token < 0 || *task.score_token >= vocab)) {
      return absl::InvalidArgumentError(absl::StrCat("score token ", *task.score_token));
    }
  }
  ROLLOUT_RETURN_IF_ERROR(CudaError(cudaSetDevice(s.ranks[0].device), "cudaSetDevice"));
  results->assign(rows, SampleResult());
  const int64_t chunk = options_.max_logit_rows;
  for (int64_t first = 0; first < rows; first += chunk) {
    const int64_t count = std::min(chunk, rows - first);
    const float* source = nullptr;  // host rows to upload, or nullptr: already on the device
    if (from_caller) {
      source = logits.data() + first * vocab;
    } else if (!s.last_on_device) {
      source = s.spill.data() + first * vocab;
    }
    const float* device_rows = s.logits.get<float>() + (source == nullptr ? first * vocab : 0);
    if (source != nullptr) {
      ROLLOUT_RETURN_IF_ERROR(CudaError(cudaMemcpyAsync(s.logits.get(), source, count * vocab * 4,
                                                        cudaMemcpyHostToDevice, s.stream),
                                        "uploading logits"));
    }
    ROLLOUT_RETURN_IF_ERROR(ProcessDeviceRows(device_rows, tasks, first, count, results));
  }
  return absl::OkStatus();
}

absl::Status CudaModelRunner::EnqueueDeviceRows(const float* rows,
                                                const std::vector<LogitsRowTask>& tasks,
                                                int64_t first, int64_t count) {
  State& s = *state_;
  const int32_t vocab = config_.vocab_size;
  cuda::LogitsRowSpec* specs = s.staging().specs.get<cuda::LogitsRowSpec>();
  for (int64_t i = 0; i < count; ++i) {
    const LogitsRowTask& task = tasks[first + i];
    const SamplingParams& p = *task.params;
    cuda::LogitsRowSpec& spec = specs[i];
    spec = cuda::LogitsRowSpec();
    spec.seed = task.sample_seed;
    spec.position = task.position;
    spec.temperature = p.temperature > 0.0f ? p.temperature : 1.0f;
    spec.top_n = p.top_logprobs;
    if (task.score_token.has_value()) {
      spec.mode = cuda::kRowScore;
      spec.score_token = *task.score_token;
    } else if (!(p.temperature > 0.0f)) {
      spec.mode = cuda::kRowGreedy;
    } else if (HostPicksToken(task, vocab)) {
      spec.mode = cuda::kRowStats;
    } else {
      spec.mode = cuda::kRowSample;
    }
  }
  ROLLOUT_RETURN_IF_ERROR(
      CudaError(cudaMemcpyAsync(s.row_specs.get(), specs, count * sizeof(cuda::LogitsRowSpec),
                                cudaMemcpyHostToDevice, s.stream),
                "uploading sampling specs"));
  ROLLOUT_RETURN_IF_ERROR(
      CudaError(cuda::ProcessLogitsRows(rows, count, vocab, s.row_specs.get<cuda::LogitsRowSpec>(),
                                        s.row_results.get<cuda::LogitsRowResult>(), s.stream),
                "sampling kernel"));
  return CudaError(
      cudaMemcpyAsync(s.staging().results.get(), s.row_results.get(),
                      count * sizeof(cuda::LogitsRowResult), cudaMemcpyDeviceToHost, s.stream),
      "downloading sampling results");
}

void CudaModelRunner::ConvertDeviceRows(const void* host, int64_t first, int64_t count,
                                        std::vector<SampleResult>* results) {
  const cuda::LogitsRowResult* out = static_cast<const cuda::LogitsRowResult*>(host);
  for (int64_t i = 0; i < count; ++i) {
    const cuda::LogitsRowResult& o = out[i];
    SampleResult& result = (*results)[first + i];
    result.top.clear();
    for (int j = 0; j < o.top_n; ++j) result.top.push_back({o.top_ids[j], o.top_lps[j]});
    result.token = o.token;
    result.logprob = o.logprob;
  }
}

// Rows [first, first + count) of `tasks`, their logits at `rows` on the device.
absl::Status CudaModelRunner::ProcessDeviceRows(const float* rows,
                                                const std::vector<LogitsRowTask>& tasks,
                                                int64_t first, int64_t count,
                                                std::vector<SampleResult>* results) {
  State& s = *state_;
  const int32_t vocab = config_.vocab_size;
  ROLLOUT_RETURN_IF_ERROR(EnqueueDeviceRows(rows, tasks, first, count));
  ROLLOUT_RETURN_IF_ERROR(CudaError(cudaStreamSynchronize(s.stream), "sampling"));
  ConvertDeviceRows(s.staging().results.get(), first, count, results);
  const cuda::LogitsRowSpec* specs = s.staging().specs.get<cuda::LogitsRowSpec>();
  const cuda::LogitsRowResult* out = s.staging().results.get<cuda::LogitsRowResult>();
  std::vector<float> row, scratch;
  for (int64_t i = 0; i < count; ++i) {
    const LogitsRowTask& task = tasks[first + i];
    const cuda::LogitsRowResult& o = out[i];
    SampleResult& result = (*results)[first + i];
    if (specs[i].mode != cuda::kRowStats) continue;
    // top-k / top-p / min-p: the host's SampleToken picks the token from the row; the logprob
    // is the device's formula on the device's max and log-sum.
    row.resize(vocab);
    ROLLOUT_RETURN_IF_ERROR(CudaError(cudaMemcpy(row.data(), rows + i * static_cast<int64_t>(vocab),
                                                 vocab * sizeof(float), cudaMemcpyDeviceToHost),
                                      "copying a filtered row"));
    SamplingParams params = *task.params;
    params.top_logprobs = 0;
    const SampleResult picked =
        SampleToken(row.data(), vocab, params, task.sample_seed, task.position, &scratch);
    result.token = picked.token;
    result.logprob =
        o.max == -INFINITY
            ? o.uniform_lp
            : (HostScaledLogit(row[picked.token], specs[i].temperature) - o.max) - o.log_sum;
  }
  return absl::OkStatus();
}

bool CudaModelRunner::CanFeed(const std::vector<LogitsRowTask>& tasks) const {
  const State& s = *state_;
  if (s.multi_device || s.profiler.on() ||
      static_cast<int64_t>(tasks.size()) > options_.max_logit_rows) {
    return false;
  }
  for (const LogitsRowTask& task : tasks) {
    if (task.params == nullptr || task.score_token.has_value() ||
        task.params->top_logprobs > cuda::kMaxDeviceTopN ||
        HostPicksToken(task, config_.vocab_size)) {
      return false;
    }
  }
  return true;
}

absl::Status CudaModelRunner::LaunchStep(const ForwardBatch& batch,
                                         const std::vector<LogitsRowTask>& tasks) {
  State& s = *state_;
  if (s.launched.size() >= 2) {
    return absl::FailedPreconditionError("two launched steps are not collected yet");
  }
  if (tasks.size() != batch.logit_rows.size()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%d tasks for %d logits rows", tasks.size(), batch.logit_rows.size()));
  }
  const bool fed = HasFedTokens(batch);
  if (fed && s.launched.empty()) {
    return absl::InvalidArgumentError("fed tokens without a launched step to feed them");
  }
  ROLLOUT_RETURN_IF_ERROR(CudaError(cudaSetDevice(s.ranks[0].device), "cudaSetDevice"));
  // A staging slot no uncollected step uses, once the step that used it last is done with it.
  s.slot = s.launched.empty() || !s.launched.back().slot.has_value() ? s.slot ^ 1
                                                                     : *s.launched.back().slot ^ 1;
  ROLLOUT_RETURN_IF_ERROR(
      CudaError(cudaEventSynchronize(s.staging().done.get()), "waiting for a staging slot"));
  const int64_t rows = static_cast<int64_t>(tasks.size());
  State::Launched launched;
  launched.rows = rows;
  // Enqueued only: one slice, its logits on the device, every row processed there, its fed
  // tokens (if any) in the device's results of the step before.
  absl::Status status;
  if (batch.num_tokens() <= options_.max_batch_tokens && CanFeed(tasks) && (!fed || s.feed_ready)) {
    status = ForwardImpl(batch, nullptr, /*async=*/true);
    if (status.ok() && rows > 0) {
      status = EnqueueDeviceRows(s.logits.get<float>(), tasks, 0, rows);
    }
    if (status.ok()) {
      status = CudaError(cudaEventRecord(s.staging().done.get(), s.stream), "cudaEventRecord");
    }
    launched.slot = s.slot;
  } else {
    ForwardBatch resolved;
    const ForwardBatch* run = &batch;
    if (fed) {
      // The previous launched step's tokens, from its results.
      const State::Launched& previous = s.launched.back();
      std::vector<SampleResult> fed_from = previous.results;  // computed at its launch, or:
      if (previous.slot.has_value()) {
        status = SlotResults(*previous.slot, previous.rows, &fed_from);
      }
      resolved = batch;
      if (status.ok()) status = ResolveFedTokens(fed_from, &resolved);
      run = &resolved;
    }
    if (status.ok()) status = Forward(*run, nullptr);
    if (status.ok()) status = ProcessLogits(tasks, {}, &launched.results);
  }
  // The device's results are this step's tokens when one sampling pass picked them all (a failed
  // launch may have overwritten them: nothing to feed from).
  s.feed_ready = status.ok() && CanFeed(tasks);
  s.feed_rows = rows;
  if (!status.ok()) return status;
  s.launched.push_back(std::move(launched));
  return absl::OkStatus();
}

absl::Status CudaModelRunner::CollectStep(std::vector<SampleResult>* results) {
  State& s = *state_;
  if (s.launched.empty()) return absl::FailedPreconditionError("no launched step to collect");
  State::Launched launched = std::move(s.launched.front());
  s.launched.pop_front();
  // Fed tokens refer to an uncollected step, as in ModelRunner's contract.
  if (s.launched.empty()) s.feed_ready = false;
  if (!launched.slot.has_value()) {
    *results = std::move(launched.results);
    return absl::OkStatus();
  }
  ROLLOUT_RETURN_IF_ERROR(CudaError(cudaSetDevice(s.ranks[0].device), "cudaSetDevice"));
  return SlotResults(*launched.slot, launched.rows, results);
}

absl::Status CudaModelRunner::SlotResults(int slot, int64_t rows,
                                          std::vector<SampleResult>* results) {
  State& s = *state_;
  ROLLOUT_RETURN_IF_ERROR(
      CudaError(cudaEventSynchronize(s.slots[slot].done.get()), "a launched step"));
  results->assign(rows, SampleResult());
  ConvertDeviceRows(s.slots[slot].results.get(), 0, rows, results);
  return absl::OkStatus();
}

}  // namespace rollout
