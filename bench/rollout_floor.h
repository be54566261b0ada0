#pragma once

// The floor of docs/benchmarks.md ("The workload and its floor"): what the GPU cannot beat on a
// workload, from a measured copy rate and GEMM rate. Host-only arithmetic.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "bench/rollout_workload.h"
#include "model/model_config.h"

namespace rollout {

// The floor of docs/benchmarks.md ("The workload and its floor"), from the measured rates.
struct Floor {
  double prefill_s = 0, decode_gemm_s = 0, decode_kv_s = 0;
  double total() const { return prefill_s + decode_gemm_s + decode_kv_s; }
};

inline int64_t GemmParams(const ModelConfig& c) {  // projections of all layers, without lm_head
  const int64_t h = c.hidden_size, hd = c.head_dim;
  const int64_t per_layer = h * (c.num_attention_heads + 2 * c.num_key_value_heads) * hd +
                            h * c.num_attention_heads * hd + 3 * h * c.intermediate_size;
  return per_layer * c.num_layers;
}

inline int64_t KvBytesPerToken(const ModelConfig& c) {
  return 2ll * c.num_layers * c.num_key_value_heads * c.head_dim * 2;
}

// prefill_tokens: the prompt tokens to compute (a prompt shared by samples counts once);
// lengths: every sample's generated tokens after `in` prompt tokens.
inline Floor ComputeFloor(const ModelConfig& c, int64_t prefill_tokens, int64_t in,
                          const std::vector<int>& lengths, int64_t kv_capacity_tokens, double flops,
                          double bw) {
  Floor f;
  const double p = GemmParams(c), lm = static_cast<double>(c.vocab_size) * c.hidden_size;
  f.prefill_s = 2.0 * p * prefill_tokens / flops;
  const double kv_bytes = static_cast<double>(KvBytesPerToken(c));
  // Each decode step: its GEMMs (weights read once, or compute-bound) and one read of the KV.
  ForEachOracleDecodeStep(
      lengths, static_cast<int>(in), kv_capacity_tokens, [&](int64_t batch, int64_t kv_tokens) {
        f.decode_gemm_s += std::max(2.0 * (p + lm) / bw, 2.0 * (p + lm) * batch / flops);
        f.decode_kv_s += kv_tokens * kv_bytes / bw;
      });
  return f;
}

}  // namespace rollout
