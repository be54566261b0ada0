// The CPU runner's mixture-of-experts layers (Qwen3-MoE): binding the router and the experts'
// tensors, and the MoE block of a forward (docs/determinism.md, "MoE layers").
#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "kernels/cpu/moe.h"
#include "runner/cpu/cpu_model_runner.h"
#include "runner/cpu/cpu_runner_internal.h"

namespace rollout {

using cpu_runner_internal::LayerName;

void CpuModelRunner::BindMoeLayer(const Checkpoint& checkpoint, int i) {
  const ModelConfig& c = config_;
  const int64_t h = c.hidden_size, mi = c.moe_intermediate_size;
  Bind(checkpoint, LayerName(i, "mlp.gate.weight"), {c.num_experts, h},
       [i](Rank& rk, int64_t rows, int64_t cols) {
         return Piece{&rk.layers[i].router, 0, 0, rows, 0, cols};
       });
  // Expert e as a dense MLP shards: its [2 * moe_inter, hidden] block of experts_gate_up holds
  // the rank's gate rows then its up rows; its [hidden, moe_inter] block of experts_down the
  // rank's K slice.
  for (int64_t e = 0; e < c.num_experts; ++e) {
    const std::string x = absl::StrCat("mlp.experts.", e, ".");
    Bind(checkpoint, LayerName(i, (x + "gate_proj.weight").c_str()), {mi, h},
         [i, e](Rank& rk, int64_t, int64_t cols) {
           return Piece{&rk.layers[i].experts_gate_up, e * 2 * rk.moe_inter * cols,
                        rk.index * rk.moe_inter, rk.moe_inter, 0, cols};
         });
    Bind(checkpoint, LayerName(i, (x + "up_proj.weight").c_str()), {mi, h},
         [i, e](Rank& rk, int64_t, int64_t cols) {
           return Piece{&rk.layers[i].experts_gate_up, (e * 2 + 1) * rk.moe_inter * cols,
                        rk.index * rk.moe_inter, rk.moe_inter, 0, cols};
         });
    Bind(checkpoint, LayerName(i, (x + "down_proj.weight").c_str()), {h, mi},
         [i, e](Rank& rk, int64_t rows, int64_t) {
           return Piece{&rk.layers[i].experts_down, e * rows * rk.moe_inter, 0, rows,
                        rk.index * rk.moe_inter, rk.moe_inter};
         });
  }
}

absl::Status CpuModelRunner::MoeBlock(Rank& rk, const Layer& l, StepRouting* routing,
                                      Activations* a) const {
  const ModelConfig& c = config_;
  const int tp = options_.tensor_parallel;
  const int64_t t = a->t, h = c.hidden_size, num_experts = c.num_experts;
  const int32_t k = c.num_experts_per_tok;
  const int64_t mi = rk.moe_inter, routing_size = c.RoutingSize();
  cpu::ThreadPool* pool = rk.pool.get();
  float *x = a->x.data(), *xn = a->xn.data();
  cpu::RmsNorm(x, l.post_norm.data(), t, h, c.rms_norm_eps, xn);
  // Router logits [t, num_experts], each a Dot over hidden; then each token's routing. Every
  // rank computes the same (replicated) routing.
  std::vector<float> router_logits(t * num_experts);
  cpu::MatMul(pool, xn, t, h, l.router.data(), num_experts, nullptr, router_logits.data());
  std::vector<int32_t> ids(t * k);
  std::vector<float> weights(t * k);
  for (int64_t i = 0; i < t; ++i) {
    const int32_t* forced = routing->forced[i];
    cpu::RouteToken(&router_logits[i * num_experts], static_cast<int32_t>(num_experts), k,
                    c.norm_topk_prob, forced == nullptr ? nullptr : forced + l.moe_index * k,
                    &ids[i * k], &weights[i * k]);
  }
  if (rk.index == 0) {
    for (int64_t i = 0; i < t; ++i) {
      std::copy(&ids[i * k], &ids[i * k] + k, &routing->used[i * routing_size + l.moe_index * k]);
    }
  }
  // Each expert on the rows routed to it: y[i * k + j] = expert ids[i * k + j] on token i (the
  // rank's node of the canonical K tree at tp > 1). Every row is its own Dots, so how many rows
  // an expert gets changes no bit of any of them.
  std::vector<float> y(t * k * h);
  std::vector<int64_t> rows;
  std::vector<float> xe, gate_up, act, ye;
  const int seg_begin = rk.index * cpu::kNumKSegments / tp;
  const int seg_end = (rk.index + 1) * cpu::kNumKSegments / tp;
  for (int64_t e = 0; e < num_experts; ++e) {
    rows.clear();
    for (int64_t p = 0; p < t * k; ++p) {
      if (ids[p] == e) rows.push_back(p);
    }
    if (rows.empty()) continue;
    const int64_t n = static_cast<int64_t>(rows.size());
    xe.resize(n * h);
    gate_up.resize(n * 2 * mi);
    act.resize(n * mi);
    ye.resize(n * h);
    for (int64_t r = 0; r < n; ++r) {
      std::copy(xn + (rows[r] / k) * h, xn + (rows[r] / k + 1) * h, &xe[r * h]);
    }
    const float* w_gate_up = l.experts_gate_up.data() + e * 2 * mi * h;
    const float* w_down = l.experts_down.data() + e * h * mi;
    cpu::MatMul(pool, xe.data(), n, h, w_gate_up, 2 * mi, nullptr, gate_up.data());
    cpu::SiluMul(gate_up.data(), n, mi, act.data());
    if (tp == 1) {
      cpu::SegmentedMatMul(pool, act.data(), n, mi, w_down, h, nullptr, ye.data());
    } else {
      cpu::SegmentedPartialMatMul(pool, act.data(), n, w_down, h, c.moe_intermediate_size,
                                  seg_begin, seg_end, ye.data());
    }
    for (int64_t r = 0; r < n; ++r) {
      std::copy(&ye[r * h], &ye[(r + 1) * h], &y[rows[r] * h]);
    }
  }
  if (tp > 1) {
    std::vector<float> gathered(tp * t * k * h);
    ROLLOUT_RETURN_IF_ERROR(rk.comm->AllGather(y.data(), t * k * h, gathered.data()));
    cpu::CombinePartials(gathered.data(), tp, t * k * h, y.data());
  }
  // Each token's experts combined in rank order, then added to the residual.
  float* out = a->proj.data();
  for (int64_t i = 0; i < t; ++i) {
    cpu::CombineExperts(&y[i * k * h], &weights[i * k], k, h, out + i * h);
  }
  cpu::Add(x, out, t * h);
  return absl::OkStatus();
}

}  // namespace rollout
