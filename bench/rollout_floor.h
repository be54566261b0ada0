#pragma once

// The floor of docs/benchmarks.md ("The workload and its floor"): what the GPU cannot beat on a
// workload, from a measured copy rate and GEMM rate. Host-only arithmetic.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "bench/rollout_workload.h"
#include "model/model_config.h"

namespace rollout {

// The floor of docs/benchmarks.md ("The workload and its floor"), from the measured rates.
struct Floor {
  double prefill_s = 0, decode_gemm_s = 0, decode_kv_s = 0;
  double gather_s = 0;  // tensor parallelism across GPUs: the all-gathers at the link rate
  // The decode KV reads with each prompt that samples share read once a step (what attention that
  // shares a prompt's pages among its samples can reach); decode_kv_s when no prompt is shared.
  double decode_kv_shared_s = 0;
  double total() const { return prefill_s + decode_gemm_s + decode_kv_s + gather_s; }
  double total_shared() const { return total() - decode_kv_s + decode_kv_shared_s; }
};

// Tensor parallelism across GPUs: `gpus` ranks, one GPU each, exchanging through links of
// `link_bw` bytes/s into each GPU (the measured peer copy rate). gpus = 1: one GPU (ranks as
// streams of one GPU share its memory and tensor cores, so their floor is the one GPU's).
struct TpSpread {
  int gpus = 1;
  double link_bw = 0;
};

// The projection parameters of all layers but the MLPs of MoE layers, without lm_head.
inline int64_t DenseGemmParams(const ModelConfig& c) {
  const int64_t h = c.hidden_size, hd = c.head_dim;
  int64_t params = 0;
  for (int32_t l = 0; l < c.num_layers; ++l) {
    params += h * (c.num_attention_heads + 2 * c.num_key_value_heads) * hd +
              h * c.num_attention_heads * hd;
    if (!c.IsMoeLayer(l)) params += 3 * h * c.intermediate_size;
  }
  return params;
}

// One expert's parameters (gate, up, down), and a MoE layer's router.
inline int64_t ExpertParams(const ModelConfig& c) {
  return 3 * int64_t{c.hidden_size} * c.moe_intermediate_size;
}
inline int64_t RouterParams(const ModelConfig& c) { return int64_t{c.num_experts} * c.hidden_size; }

// The parameters one token multiplies with (its FLOPs are twice this), without lm_head: for a
// MoE layer the router and num_experts_per_tok experts.
inline int64_t GemmParams(const ModelConfig& c) {
  const int64_t moe = c.NumMoeLayers();
  return DenseGemmParams(c) +
         moe * (RouterParams(c) + int64_t{c.num_experts_per_tok} * ExpertParams(c));
}

// Experts a step of `batch` tokens touches per MoE layer, expected when each token's experts are
// a uniform draw of num_experts_per_tok distinct ones: E (1 - (1 - k / E)^batch). (Synthetic
// weights route close to uniformly; the real routing of the step is not read back.)
inline double TouchedExperts(const ModelConfig& c, int64_t batch) {
  if (!c.is_moe()) return 0.0;
  const double e = c.num_experts, k = c.num_experts_per_tok;
  return e * (1.0 - std::pow(1.0 - k / e, static_cast<double>(batch)));
}

// The parameters a step of `batch` tokens reads at least once (weights read once), without
// lm_head: the dense projections, and per MoE layer its router and the experts it touches.
inline double StepWeightParams(const ModelConfig& c, int64_t batch) {
  return static_cast<double>(DenseGemmParams(c)) +
         c.NumMoeLayers() * (RouterParams(c) + TouchedExperts(c, batch) * ExpertParams(c));
}

inline int64_t KvBytesPerToken(const ModelConfig& c) {
  return 2ll * c.num_layers * c.num_key_value_heads * c.head_dim * 2;
}

// The KV bytes of a token that one of `gpus` ranks holds and reads: its KV heads (an even split,
// or the one head its query heads read when there are fewer KV heads than ranks).
inline double KvBytesPerTokenPerGpu(const ModelConfig& c, int gpus) {
  const int nkv = c.num_key_value_heads;
  const int held = nkv >= gpus ? nkv / gpus : 1;
  return static_cast<double>(KvBytesPerToken(c)) * held / nkv;
}

// Bytes the busiest of `gpus` ranks receives in a step of `tokens` tokens and `logit_rows` logits
// rows (runner/cuda/forward_layers.cc at tp > 1): from each other rank its K-tree node of every
// o_proj and down_proj (fp32 [tokens, hidden]) and its embedding rows (the same), and, on rank 0,
// its logits columns (fp32 [logit_rows, ceil(V / gpus)]). 0 on one GPU.
inline double TpGatherBytes(const ModelConfig& c, int gpus, int64_t tokens, int64_t logit_rows) {
  if (gpus <= 1) return 0.0;
  const double node = static_cast<double>(tokens) * c.hidden_size * 4;
  const double vocab_rows = std::ceil(static_cast<double>(c.vocab_size) / gpus);
  return (gpus - 1) *
         ((2.0 * c.num_layers + 1.0) * node + static_cast<double>(logit_rows) * vocab_rows * 4);
}

// A prefill of `tokens` tokens: its GEMMs' FLOPs at the measured rate, on each of `gpus` GPUs.
inline double PrefillGemmSeconds(const ModelConfig& c, int64_t tokens, double flops, int gpus) {
  return 2.0 * GemmParams(c) * tokens / (flops * gpus);
}

// One decode step of `batch` rows: the weights it touches (lm_head included) read once at the
// copy rate, or its FLOPs at the GEMM rate where those take longer, on each of `gpus` GPUs.
inline double DecodeStepGemmSeconds(const ModelConfig& c, int64_t batch, double flops, double bw,
                                    int gpus) {
  const double p = GemmParams(c), lm = static_cast<double>(c.vocab_size) * c.hidden_size;
  const double read = StepWeightParams(c, batch) + lm;
  return std::max(2.0 * read / (bw * gpus), 2.0 * (p + lm) * batch / (flops * gpus));
}

// prefill_tokens: the prompt tokens to compute (a prompt shared by samples counts once);
// lengths: every sample's generated tokens after `in` prompt tokens, samples_per_prompt
// consecutive ones sharing a prompt. spread: across GPUs, each GPU's share of the weights, FLOPs
// and KV (a lower bound: replicated KV heads' weights count once) at the measured rates, plus the
// all-gathers at the link rate, not overlapped.
inline Floor ComputeFloor(const ModelConfig& c, int64_t prefill_tokens, int64_t in,
                          const std::vector<int>& lengths, int64_t kv_capacity_tokens, double flops,
                          double bw, const TpSpread& spread = {}, int samples_per_prompt = 1) {
  Floor f;
  const int g = std::max(1, spread.gpus);
  f.prefill_s = PrefillGemmSeconds(c, prefill_tokens, flops, g);
  const auto gather = [&](int64_t tokens, int64_t rows) {
    return g > 1 ? TpGatherBytes(c, g, tokens, rows) / spread.link_bw : 0.0;
  };
  f.gather_s = gather(prefill_tokens, static_cast<int64_t>(lengths.size()));
  const double kv_bytes = KvBytesPerTokenPerGpu(c, g);
  // Each decode step: its GEMMs (the weights it touches read once -- for a MoE model the experts
  // its tokens route to --, or compute-bound) and one read of the KV.
  ForEachOracleDecodeStep(
      lengths, static_cast<int>(in), kv_capacity_tokens,
      [&](int64_t batch, int64_t kv_tokens, int64_t shared_kv_tokens) {
        f.decode_gemm_s += DecodeStepGemmSeconds(c, batch, flops, bw, g);
        f.decode_kv_s += kv_tokens * kv_bytes / bw;
        f.decode_kv_shared_s += shared_kv_tokens * kv_bytes / bw;
        f.gather_s += gather(batch, batch);
      },
      samples_per_prompt);
  return f;
}

}  // namespace rollout
