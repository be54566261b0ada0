// CudaModelRunner's layers: one slice enqueued kernel by kernel on every rank's stream -- the
// embedding, per layer the attention block and the MLP (each ending in its row-parallel
// projection, combined across ranks), then the logits rows. Also what a decode graph captures.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "common/cuda_status.h"
#include "common/status.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/moe.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/rank_group.h"
#include "kernels/cuda/tensor_parallel.h"
#include "runner/cuda/batch_plan.h"
#include "runner/cuda/cuda_model_runner.h"
#include "runner/cuda/cuda_runner_state.h"

namespace rollout {

using cuda::bf16;
using cuda_runner_internal::kAttention;
using cuda_runner_internal::kEmbed;
using cuda_runner_internal::kGemmDown;
using cuda_runner_internal::kGemmGateUp;
using cuda_runner_internal::kGemmO;
using cuda_runner_internal::kGemmQkv;
using cuda_runner_internal::kLmHead;
using cuda_runner_internal::kLogitsCopy;
using cuda_runner_internal::kMoeCombine;
using cuda_runner_internal::kMoeDown;
using cuda_runner_internal::kMoeGateUp;
using cuda_runner_internal::kMoeGroup;
using cuda_runner_internal::kMoeRoute;
using cuda_runner_internal::kNorm;
using cuda_runner_internal::kQkvRope;
using cuda_runner_internal::kSiluMul;
using cuda_runner_internal::LayerWeights;
using cuda_runner_internal::RankState;

namespace {

// One layer's K and V of a rank's KV cache (RankState::kv).
cuda::KvCacheView LayerCache(const RankState& rk, int layer, int32_t block_size, int64_t head_dim) {
  bf16* k_cache = rk.kv.get<bf16>() + 2 * layer * rk.kv_layer_elems;
  return cuda::KvCacheView{k_cache, k_cache + rk.kv_layer_elems, block_size,
                           static_cast<int32_t>(rk.kv_heads), static_cast<int32_t>(head_dim)};
}

}  // namespace

absl::Status CudaModelRunner::EnqueueSlice(const cuda_runner_internal::SliceShape& shape,
                                           float* host_logits, bool keep_on_device,
                                           bool forced_routing) {
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
  // The embedding writes x: no norm of it is in xn (one left by a slice that stopped at an error).
  for (RankState& rk : s.ranks) rk.xn_norm = nullptr;
  ROLLOUT_RETURN_IF_ERROR(EnqueueEmbedding(shape));
  for (int layer = 0; layer < c.num_layers; ++layer) {
    for (RankState& rk : s.ranks) ROLLOUT_RETURN_IF_ERROR(EnqueueAttention(rk, layer, shape));
    ROLLOUT_RETURN_IF_ERROR(CombineRowParallel(shape.n));
    ROLLOUT_RETURN_IF_ERROR(s.Mark(kGemmO));
    if (c.IsMoeLayer(layer)) {  // tp = 1 (CheckSupported)
      ROLLOUT_RETURN_IF_ERROR(EnqueueMoe(s.ranks[0], layer, shape.n, forced_routing));
      continue;
    }
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
  ROLLOUT_RETURN_IF_ERROR(state_->SetDevice(rk));  // the caller restores rank 0's
  ROLLOUT_RETURN_IF_ERROR(EnqueueQkv(rk, layer, shape));
  ROLLOUT_RETURN_IF_ERROR(EnqueuePagedAttention(rk, layer, shape));
  return EnqueueRowParallel(rk, layer, /*mlp=*/false, shape.n);
}

// Input norm, the q/k/v projection, then qk-norm + RoPE into q and the KV cache write.
absl::Status CudaModelRunner::EnqueueQkv(RankState& rk, int layer,
                                         const cuda_runner_internal::SliceShape& shape) {
  const ModelConfig& c = config_;
  State& s = *state_;
  const int64_t n = shape.n, hd = c.head_dim, nh = rk.heads, nkv = rk.kv_heads;
  const int32_t* d = s.MetaOf(rk);
  cudaStream_t stream = rk.stream.get();
  // Profiling marks follow rank 0's stream.
  auto mark = [&](int family) { return rk.index == 0 ? s.Mark(family) : absl::OkStatus(); };
  bf16* xn = rk.xn.get<bf16>();
  const LayerWeights& l = rk.layers[layer];
  const cuda::KvCacheView cache = LayerCache(rk, layer, options_.kv_block_size, hd);

  ROLLOUT_RETURN_IF_ERROR(NormIntoXn(rk, n, l.input_norm));
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
  return mark(kQkvRope);
}

// Paged attention of the rank's heads over the KV cache into attn: the one-token items, then the
// many-token items (with the tensor-core kernel, and the merge of their split partials).
absl::Status CudaModelRunner::EnqueuePagedAttention(RankState& rk, int layer,
                                                    const cuda_runner_internal::SliceShape& shape) {
  State& s = *state_;
  const int64_t n = shape.n, hd = config_.head_dim, nh = rk.heads, nkv = rk.kv_heads;
  const bool mma = options_.attention_kernel == CudaAttentionKernel::kTensorCore;
  const int32_t* d = s.MetaOf(rk);
  cudaStream_t stream = rk.stream.get();
  auto mark = [&](int family) { return rk.index == 0 ? s.Mark(family) : absl::OkStatus(); };
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const cuda::KvCacheView cache = LayerCache(rk, layer, options_.kv_block_size, hd);

  cuda::AttentionParams ap;
  ap.q = rk.q.get<float>();
  ap.positions = d + shape.off_pos();
  ap.table_offsets = d + shape.off_tab();
  ap.tables = d + shape.off_tables();
  ap.num_heads = static_cast<int32_t>(nh);
  ap.split_size = options_.attention_split_size;
  ap.scale = scale;
  ap.out = rk.attn.get<bf16>();
  ap.items = reinterpret_cast<const int2*>(d + shape.off_one());
  ap.num_items = static_cast<int32_t>(shape.num_one);
  if (mma) {
    ap.partials = rk.partials.get<float>();
    ap.max_splits = shape.max_splits;
    if (shape.shares) {
      ap.shares = reinterpret_cast<const int4*>(d + shape.off_shares());
      ap.share_tokens = d + shape.off_share_tokens();
    }
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
    many.shares = nullptr;  // the shares are the one-token items'
    many.share_tokens = nullptr;
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
  return mark(kAttention);
}

// One rank's MLP of `layer`: post-attention norm, its gate/up rows, SiLU * up, its part of
// down_proj.
absl::Status CudaModelRunner::EnqueueMlp(RankState& rk, int layer, int64_t n) {
  State& s = *state_;
  auto mark = [&](int family) { return rk.index == 0 ? s.Mark(family) : absl::OkStatus(); };
  ROLLOUT_RETURN_IF_ERROR(s.SetDevice(rk));  // the caller restores rank 0's
  const LayerWeights& l = rk.layers[layer];
  bf16* xn = rk.xn.get<bf16>();
  bf16* gate_up = rk.gate_up.get<bf16>();
  ROLLOUT_RETURN_IF_ERROR(NormIntoXn(rk, n, l.post_norm));
  ROLLOUT_RETURN_IF_ERROR(CublasError(
      rk.gemm_gate_up->Run(xn, n, l.gate_up, gate_up, rk.stream.get()), "gate/up projection"));
  ROLLOUT_RETURN_IF_ERROR(mark(kGemmGateUp));
  ROLLOUT_RETURN_IF_ERROR(CudaError(
      cuda::SiluMul(gate_up, n, rk.inter, rk.act.get<bf16>(), rk.stream.get()), "silu * up"));
  ROLLOUT_RETURN_IF_ERROR(mark(kSiluMul));
  return EnqueueRowParallel(rk, layer, /*mlp=*/true, n);
}

// The MoE MLP (kernels/cuda/moe.h): post-attention norm, router logits by the pinned router
// GEMM (fp32), routing into the layer's slice of moe_ids, grouping, gate/up, SiLU * up, down,
// and the combine into x. Every launch is sized by n (host-known): graph-capturable.
absl::Status CudaModelRunner::EnqueueMoe(RankState& rk, int layer, int64_t n, bool forced) {
  const ModelConfig& c = config_;
  State& s = *state_;
  const LayerWeights& l = rk.layers[layer];
  cudaStream_t stream = rk.stream.get();
  const int32_t e = c.num_experts, k = c.num_experts_per_tok;
  const int64_t h = c.hidden_size, mi = c.moe_intermediate_size, a = n * k;
  bf16* xn = rk.xn.get<bf16>();
  ROLLOUT_RETURN_IF_ERROR(NormIntoXn(rk, n, l.post_norm));
  float* logits = rk.router_logits.get<float>();
  ROLLOUT_RETURN_IF_ERROR(
      CublasError(rk.gemm_router->Run(xn, n, l.router, logits, stream), "router"));
  // This layer's routing: [n, k] at the layer's place in the slice's [moe layers, n, k].
  int32_t* ids = rk.moe_ids.get<int32_t>() + l.moe_layer * a;
  const int32_t* forced_ids = forced ? rk.moe_forced_ids.get<int32_t>() + l.moe_layer * a : nullptr;
  const int32_t* forced_rows = forced ? rk.moe_forced_rows.get<int32_t>() : nullptr;
  float* weights = rk.moe_weights.get<float>();
  ROLLOUT_RETURN_IF_ERROR(CudaError(cuda::MoeRoute(logits, n, e, k, c.norm_topk_prob, forced_ids,
                                                   forced_rows, ids, weights, stream),
                                    "moe routing"));
  ROLLOUT_RETURN_IF_ERROR(s.Mark(kMoeRoute));
  const cuda::MoeGrouping grouping = cuda::MoeGroupingIn(rk.moe_grouping.get<int32_t>(), e, a);
  // The expert GEMMs' block shape for this many assignments (host-known; the bits do not
  // depend on it).
  const int32_t tile_rows = cuda::MoeTileRowsFor(a, e, h, mi);
  ROLLOUT_RETURN_IF_ERROR(
      CudaError(cuda::MoeGroup(ids, n, e, k, tile_rows, grouping, stream), "moe grouping"));
  ROLLOUT_RETURN_IF_ERROR(s.Mark(kMoeGroup));
  // The expert GEMMs' operands (the trainer's rt_cuda_moe_experts builds them by the same
  // functions); each GEMM in the faster version for its tiles (the same bits either way).
  cuda::MoeLayerParams mp;
  mp.xn = xn;
  mp.num_tokens = n;
  mp.hidden = h;
  mp.inter = mi;
  mp.num_experts = e;
  mp.top_k = k;
  mp.w_gate_up = l.expert_gate_up;
  mp.w_down = l.expert_down;
  mp.grouping = grouping;
  mp.gate_up = rk.moe_gate_up.get<bf16>();
  mp.act = rk.moe_act.get<bf16>();
  mp.y = rk.moe_y.get<float>();
  ROLLOUT_RETURN_IF_ERROR(CudaError(
      cuda::MoeExpertGemmForTiles(cuda::MoeGateUpGemm(mp, tile_rows), stream), "moe gate/up"));
  ROLLOUT_RETURN_IF_ERROR(s.Mark(kMoeGateUp));
  ROLLOUT_RETURN_IF_ERROR(
      CudaError(cuda::SiluMul(mp.gate_up, a, mi, mp.act, stream), "moe silu * up"));
  ROLLOUT_RETURN_IF_ERROR(s.Mark(kSiluMul));
  ROLLOUT_RETURN_IF_ERROR(CudaError(
      cuda::MoeExpertGemmForTiles(cuda::MoeDownGemm(mp, tile_rows), stream), "moe down"));
  ROLLOUT_RETURN_IF_ERROR(s.Mark(kMoeDown));
  if (const float* next = NextNorm(rk, layer, /*mlp=*/true); next != nullptr) {
    ROLLOUT_RETURN_IF_ERROR(CudaError(
        cuda::MoeCombineRmsNorm(rk.moe_y.get<float>(), grouping.slots, weights, n, k, h,
                                rk.x.get<float>(), next, c.rms_norm_eps, xn, stream),
        "moe combine + rmsnorm"));
    rk.xn_norm = next;
  } else {
    ROLLOUT_RETURN_IF_ERROR(CudaError(cuda::MoeCombine(rk.moe_y.get<float>(), grouping.slots,
                                                       weights, n, k, h, rk.x.get<float>(), stream),
                                      "moe combine"));
  }
  return s.Mark(kMoeCombine);
}

absl::Status CudaModelRunner::NormIntoXn(RankState& rk, int64_t n, const float* weight) {
  const bool done = rk.xn_norm == weight;
  rk.xn_norm = nullptr;
  if (done) return absl::OkStatus();
  ROLLOUT_RETURN_IF_ERROR(
      CudaError(cuda::RmsNorm(rk.x.get<float>(), nullptr, n, config_.hidden_size, weight,
                              config_.rms_norm_eps, rk.xn.get<bf16>(), rk.stream.get()),
                "rmsnorm"));
  // Profiling marks follow rank 0's stream.
  return rk.index == 0 ? state_->Mark(kNorm) : absl::OkStatus();
}

const float* CudaModelRunner::NextNorm(const RankState& rk, int layer, bool mlp) const {
  if (!mlp) return rk.layers[layer].post_norm;
  return layer + 1 < config_.num_layers ? rk.layers[layer + 1].input_norm : nullptr;
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
    if (const float* next = NextNorm(rk, layer, mlp); next != nullptr) {
      ROLLOUT_RETURN_IF_ERROR(
          CudaError(cuda::SumTreeRmsNorm(leaves, local, count, n, h, x, next, c.rms_norm_eps,
                                         rk.xn.get<bf16>(), rk.stream.get()),
                    "K tree + residual + rmsnorm"));
      rk.xn_norm = next;
      return absl::OkStatus();
    }
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

}  // namespace rollout
