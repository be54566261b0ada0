#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "runner/cpu/cpu_model_runner.h"

// What the CPU runner's files share (cpu_model_runner.cc: dense layers, attention, logits;
// cpu_moe_layer.cc: mixture-of-experts layers). Not part of the runner's interface.
namespace rollout {
namespace cpu_runner_internal {

inline std::string LayerName(int i, const char* suffix) {
  return absl::StrCat("model.layers.", i, ".", suffix);
}

}  // namespace cpu_runner_internal

// One rank's buffers for one Forward.
struct CpuModelRunner::Activations {
  Activations(int64_t t, const ModelConfig& c, const Rank& rk, int tp)
      : t(t),
        x(t * c.hidden_size),
        xn(t * c.hidden_size),
        q(t * rk.heads * c.head_dim),
        attn(t * rk.heads * c.head_dim),
        k(t * rk.kv_heads * c.head_dim),
        v(t * rk.kv_heads * c.head_dim),
        gate_up(t * 2 * rk.inter),
        act(t * rk.inter),
        proj(t * c.hidden_size),
        gathered(tp > 1 ? tp * t * c.hidden_size : 0),
        rope_cos(t * c.head_dim / 2),
        rope_sin(t * c.head_dim / 2) {}

  const int64_t t;
  std::vector<float> x, xn;     // [t, hidden], replicated: the residual stream, and normed
  std::vector<float> q, attn;   // [t, heads, head_dim]
  std::vector<float> k, v;      // [t, kv_heads, head_dim]
  std::vector<float> gate_up;   // [t, 2 * inter]
  std::vector<float> act;       // [t, inter]
  std::vector<float> proj;      // [t, hidden]: a row-parallel projection (or embedding) result
  std::vector<float> gathered;  // [tp, t, hidden]; empty at tp = 1
  std::vector<float> rope_cos, rope_sin;  // [t, head_dim / 2]: each token's rotation
};

}  // namespace rollout
