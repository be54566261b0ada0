#include "tests/naive_model.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "model/dtype_cast.h"
#include "model/rope.h"
#include "model/safetensors.h"

namespace rollout::testing {
namespace {

using Vec = std::vector<double>;

Vec MatVec(const std::vector<float>& w, const Vec& x, size_t out, const std::vector<float>& b) {
  Vec y(out, 0.0);
  const size_t in = x.size();
  for (size_t o = 0; o < out; ++o) {
    double s = b.empty() ? 0.0 : b[o];
    for (size_t i = 0; i < in; ++i) s += static_cast<double>(w[o * in + i]) * x[i];
    y[o] = s;
  }
  return y;
}

void RmsNormInPlace(double* x, size_t n, const std::vector<float>& w, double eps) {
  double ss = 0;
  for (size_t i = 0; i < n; ++i) ss += x[i] * x[i];
  const double inv = 1.0 / std::sqrt(ss / n + eps);
  for (size_t i = 0; i < n; ++i) x[i] = x[i] * inv * w[i];
}

// In double throughout: the frequencies and attention factor of model/rope.h (whose values
// model/rope_test.cc checks against hand-written formulas), cos and sin never rounded to float.
void Rope(double* x, int64_t pos, size_t d, const RopeFrequencies& f) {
  for (size_t i = 0; i < d / 2; ++i) {
    const double angle = pos * f.inv_freq[i];
    const double c = std::cos(angle) * f.attention_factor, s = std::sin(angle) * f.attention_factor;
    const double a = x[i], b = x[i + d / 2];
    x[i] = a * c - b * s;
    x[i + d / 2] = b * c + a * s;
  }
}

}  // namespace

absl::StatusOr<NaiveModel> NaiveModel::Load(const std::string& dir) {
  absl::StatusOr<std::unique_ptr<Checkpoint>> ck = Checkpoint::Open(dir);
  if (!ck.ok()) return ck.status();
  NaiveModel m;
  absl::StatusOr<ModelConfig> config = ReadModelConfig(**ck);
  if (!config.ok()) return config.status();
  m.config_ = *config;
  const ModelConfig& c = m.config_;
  absl::Status status;
  auto read = [&](const std::string& name, std::vector<int64_t> shape) {
    absl::StatusOr<std::vector<float>> t = (*ck)->ReadF32(name, shape);
    if (!t.ok()) {
      status.Update(t.status());
      return std::vector<float>();
    }
    // The values the model serves (model/dtype_cast.h).
    status.Update(RoundToDType(name, ServedDType(m.config_), t->data(), t->size()));
    return *std::move(t);
  };
  const int64_t h = c.hidden_size, hd = c.head_dim, nh = c.num_attention_heads,
                nkv = c.num_key_value_heads, in = c.intermediate_size;
  m.embed_ = read("model.embed_tokens.weight", {c.vocab_size, h});
  m.final_norm_ = read("model.norm.weight", {h});
  m.lm_head_ = c.tie_word_embeddings ? m.embed_ : read("lm_head.weight", {c.vocab_size, h});
  for (int i = 0; i < c.num_layers; ++i) {
    const std::string p = absl::StrCat("model.layers.", i, ".");
    Layer l;
    l.in_norm = read(p + "input_layernorm.weight", {h});
    l.q = read(p + "self_attn.q_proj.weight", {nh * hd, h});
    l.k = read(p + "self_attn.k_proj.weight", {nkv * hd, h});
    l.v = read(p + "self_attn.v_proj.weight", {nkv * hd, h});
    if (c.qkv_bias) {
      l.q_bias = read(p + "self_attn.q_proj.bias", {nh * hd});
      l.k_bias = read(p + "self_attn.k_proj.bias", {nkv * hd});
      l.v_bias = read(p + "self_attn.v_proj.bias", {nkv * hd});
    }
    if (c.qk_norm) {
      l.q_norm = read(p + "self_attn.q_norm.weight", {hd});
      l.k_norm = read(p + "self_attn.k_norm.weight", {hd});
    }
    l.o = read(p + "self_attn.o_proj.weight", {h, nh * hd});
    l.post_norm = read(p + "post_attention_layernorm.weight", {h});
    if (c.IsMoeLayer(i)) {
      const int64_t mi = c.moe_intermediate_size;
      l.moe = true;
      l.router = read(p + "mlp.gate.weight", {c.num_experts, h});
      for (int e = 0; e < c.num_experts; ++e) {
        const std::string x = absl::StrCat(p, "mlp.experts.", e, ".");
        l.expert_gate.push_back(read(x + "gate_proj.weight", {mi, h}));
        l.expert_up.push_back(read(x + "up_proj.weight", {mi, h}));
        l.expert_down.push_back(read(x + "down_proj.weight", {h, mi}));
      }
    } else {
      l.gate = read(p + "mlp.gate_proj.weight", {in, h});
      l.up = read(p + "mlp.up_proj.weight", {in, h});
      l.down = read(p + "mlp.down_proj.weight", {h, in});
    }
    m.layers_.push_back(std::move(l));
  }
  if (!status.ok()) return status;
  return m;
}

std::vector<std::vector<double>> NaiveModel::Logits(const std::vector<int32_t>& tokens) const {
  const ModelConfig& c = config_;
  const size_t n = tokens.size(), h = c.hidden_size, hd = c.head_dim, nh = c.num_attention_heads,
               nkv = c.num_key_value_heads, group = nh / nkv;
  std::vector<Vec> x(n, Vec(h));
  for (size_t t = 0; t < n; ++t) {
    for (size_t i = 0; i < h; ++i) x[t][i] = embed_[tokens[t] * h + i];
  }
  const RopeFrequencies rope = ComputeRopeFrequencies(c.rope_scaling, c.rope_theta, hd);
  for (const Layer& l : layers_) {
    std::vector<Vec> q(n), k(n), v(n);
    for (size_t t = 0; t < n; ++t) {
      Vec xn = x[t];
      RmsNormInPlace(xn.data(), h, l.in_norm, c.rms_norm_eps);
      q[t] = MatVec(l.q, xn, nh * hd, l.q_bias);
      k[t] = MatVec(l.k, xn, nkv * hd, l.k_bias);
      v[t] = MatVec(l.v, xn, nkv * hd, l.v_bias);
      for (size_t hh = 0; hh < nh; ++hh) {
        if (c.qk_norm) RmsNormInPlace(&q[t][hh * hd], hd, l.q_norm, c.rms_norm_eps);
        Rope(&q[t][hh * hd], t, hd, rope);
      }
      for (size_t hh = 0; hh < nkv; ++hh) {
        if (c.qk_norm) RmsNormInPlace(&k[t][hh * hd], hd, l.k_norm, c.rms_norm_eps);
        Rope(&k[t][hh * hd], t, hd, rope);
      }
    }
    for (size_t t = 0; t < n; ++t) {
      Vec attn(nh * hd, 0.0);
      for (size_t hh = 0; hh < nh; ++hh) {
        const size_t kvh = hh / group;
        Vec s(t + 1);
        double m = -INFINITY;
        for (size_t j = 0; j <= t; ++j) {
          double d = 0;
          for (size_t i = 0; i < hd; ++i) d += q[t][hh * hd + i] * k[j][kvh * hd + i];
          s[j] = d / std::sqrt(static_cast<double>(hd));
          m = std::max(m, s[j]);
        }
        double sum = 0;
        for (size_t j = 0; j <= t; ++j) sum += (s[j] = std::exp(s[j] - m));
        for (size_t j = 0; j <= t; ++j) {
          for (size_t i = 0; i < hd; ++i) attn[hh * hd + i] += s[j] / sum * v[j][kvh * hd + i];
        }
      }
      Vec o = MatVec(l.o, attn, h, {});
      for (size_t i = 0; i < h; ++i) x[t][i] += o[i];
      Vec xn = x[t];
      RmsNormInPlace(xn.data(), h, l.post_norm, c.rms_norm_eps);
      const Vec d = l.moe ? Moe(l, xn) : Mlp(l.gate, l.up, l.down, c.intermediate_size, xn);
      for (size_t i = 0; i < h; ++i) x[t][i] += d[i];
    }
  }
  std::vector<std::vector<double>> logits(n);
  for (size_t t = 0; t < n; ++t) {
    Vec xn = x[t];
    RmsNormInPlace(xn.data(), h, final_norm_, c.rms_norm_eps);
    logits[t] = MatVec(lm_head_, xn, c.vocab_size, {});
  }
  return logits;
}

std::vector<double> NaiveModel::Mlp(const Matrix& gate, const Matrix& up, const Matrix& down,
                                    size_t inter, const std::vector<double>& xn) {
  Vec g = MatVec(gate, xn, inter, {});
  Vec u = MatVec(up, xn, inter, {});
  for (size_t i = 0; i < g.size(); ++i) g[i] = g[i] / (1.0 + std::exp(-g[i])) * u[i];
  return MatVec(down, g, xn.size(), {});
}

std::vector<double> NaiveModel::Moe(const Layer& l, const std::vector<double>& xn) const {
  const ModelConfig& c = config_;
  Vec p = MatVec(l.router, xn, c.num_experts, {});
  const double m = *std::max_element(p.begin(), p.end());
  double sum = 0;
  for (double& v : p) sum += (v = std::exp(v - m));
  for (double& v : p) v /= sum;
  std::vector<int> order(c.num_experts);
  for (int e = 0; e < c.num_experts; ++e) order[e] = e;
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return p[a] > p[b]; });
  double chosen = 0;
  for (int j = 0; j < c.num_experts_per_tok; ++j) chosen += p[order[j]];
  Vec out(xn.size(), 0.0);
  for (int j = 0; j < c.num_experts_per_tok; ++j) {
    const int e = order[j];
    const double w = c.norm_topk_prob ? p[e] / chosen : p[e];
    const Vec y = Mlp(l.expert_gate[e], l.expert_up[e], l.expert_down[e],
                      c.moe_intermediate_size, xn);
    for (size_t i = 0; i < out.size(); ++i) out[i] += w * y[i];
  }
  return out;
}

double NaiveLogprob(const std::vector<double>& logits, double temperature, int32_t token) {
  const double t = temperature > 0 ? temperature : 1.0;
  double m = -INFINITY;
  for (double l : logits) m = std::max(m, l / t);
  double sum = 0;
  for (double l : logits) sum += std::exp(l / t - m);
  return logits[token] / t - m - std::log(sum);
}

}  // namespace rollout::testing
