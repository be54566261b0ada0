#include "engine/cpu_model_runner.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "glog/logging.h"

namespace rollout {
namespace {

std::string LayerName(int i, const char* suffix) {
  return absl::StrCat("model.layers.", i, ".", suffix);
}

// The negative control's RMSNorm: the sum of squares runs forwards or backwards depending on
// how many rows the batch has -- exactly the kind of batch dependence the contract forbids.
void BatchVariantRmsNorm(float* x, const float* weight, int64_t rows, int64_t dim, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    float* row = x + r * dim;
    float ss = 0.0f;
    if (rows % 2 == 0) {
      for (int64_t i = 0; i < dim; ++i) ss += row[i] * row[i];
    } else {
      for (int64_t i = dim - 1; i >= 0; --i) ss += row[i] * row[i];
    }
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(dim) + eps);
    for (int64_t i = 0; i < dim; ++i) row[i] = row[i] * inv * weight[i];
  }
}

}  // namespace

CpuModelRunner::CpuModelRunner(ModelConfig config, CpuRunnerOptions options)
    : config_(std::move(config)),
      options_(options),
      pool_(std::make_unique<cpu::ThreadPool>(options.num_threads)) {}

absl::StatusOr<std::unique_ptr<CpuModelRunner>> CpuModelRunner::Create(
    const Checkpoint& checkpoint, const CpuRunnerOptions& options) {
  absl::StatusOr<ModelConfig> config = ParseModelConfig(checkpoint.config_json());
  if (!config.ok()) {
    return absl::Status(config.status().code(),
                        absl::StrCat(checkpoint.dir(), "/config.json: ", config.status().message()));
  }
  if (options.kv_block_size <= 0 || options.attention_split_size <= 0 ||
      options.attention_split_size % options.kv_block_size != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "attention split size (%d) must be a positive multiple of the KV block size (%d)",
        options.attention_split_size, options.kv_block_size));
  }
  auto runner = std::unique_ptr<CpuModelRunner>(new CpuModelRunner(*std::move(config), options));
  if (absl::Status s = runner->Load(checkpoint); !s.ok()) return s;
  return runner;
}

absl::Status CpuModelRunner::Load(const Checkpoint& checkpoint) {
  const ModelConfig& c = config_;
  // Checking against the full list first gives one clear error for a missing tensor even when
  // it is one this backend would read late.
  for (const TensorSpec& spec : ExpectedTensors(c)) {
    if (checkpoint.Find(spec.name) == nullptr) {
      return absl::NotFoundError(
          absl::StrCat(checkpoint.dir(), ": checkpoint lacks tensor ", spec.name));
    }
  }
  const int64_t h = c.hidden_size, hd = c.head_dim, nh = c.num_attention_heads,
                nkv = c.num_key_value_heads, inter = c.intermediate_size;
  // Every tensor is bound to where it lives in fp32; weight updates write through the same
  // bindings.
  auto bind = [&](const std::string& name, std::vector<int64_t> shape, std::vector<float>* dest,
                  int64_t offset) {
    int64_t count = 1;
    for (int64_t d : shape) count *= d;
    if (dest->size() < static_cast<size_t>(offset + count)) dest->resize(offset + count);
    bindings_[name] = Binding{dest, offset, count};
    weight_specs_.push_back(WeightSpec{name, checkpoint.Find(name)->dtype, std::move(shape)});
  };
  bind("model.embed_tokens.weight", {c.vocab_size, h}, &embed_, 0);
  bind("model.norm.weight", {h}, &final_norm_, 0);
  if (!c.tie_word_embeddings) bind("lm_head.weight", {c.vocab_size, h}, &lm_head_, 0);
  layers_.resize(c.num_layers);
  for (int i = 0; i < c.num_layers; ++i) {
    Layer& l = layers_[i];
    bind(LayerName(i, "input_layernorm.weight"), {h}, &l.input_norm, 0);
    bind(LayerName(i, "self_attn.q_proj.weight"), {nh * hd, h}, &l.q, 0);
    bind(LayerName(i, "self_attn.k_proj.weight"), {nkv * hd, h}, &l.k, 0);
    bind(LayerName(i, "self_attn.v_proj.weight"), {nkv * hd, h}, &l.v, 0);
    bind(LayerName(i, "self_attn.o_proj.weight"), {h, nh * hd}, &l.o, 0);
    bind(LayerName(i, "post_attention_layernorm.weight"), {h}, &l.post_norm, 0);
    // One [2 * inter, hidden] matrix: the MLP's two input projections in one pass over x.
    bind(LayerName(i, "mlp.gate_proj.weight"), {inter, h}, &l.gate_up, 0);
    bind(LayerName(i, "mlp.up_proj.weight"), {inter, h}, &l.gate_up, inter * h);
    bind(LayerName(i, "mlp.down_proj.weight"), {h, inter}, &l.down, 0);
    if (c.qkv_bias) {
      bind(LayerName(i, "self_attn.q_proj.bias"), {nh * hd}, &l.q_bias, 0);
      bind(LayerName(i, "self_attn.k_proj.bias"), {nkv * hd}, &l.k_bias, 0);
      bind(LayerName(i, "self_attn.v_proj.bias"), {nkv * hd}, &l.v_bias, 0);
    }
    if (c.qk_norm) {
      bind(LayerName(i, "self_attn.q_norm.weight"), {hd}, &l.q_norm, 0);
      bind(LayerName(i, "self_attn.k_norm.weight"), {hd}, &l.k_norm, 0);
    }
  }
  std::sort(weight_specs_.begin(), weight_specs_.end(),
            [](const WeightSpec& a, const WeightSpec& b) { return a.name < b.name; });
  for (const WeightSpec& spec : weight_specs_) {
    absl::StatusOr<std::vector<float>> t = checkpoint.ReadF32(spec.name, spec.shape);
    if (!t.ok()) return t.status();
    const Binding& b = bindings_.at(spec.name);
    std::copy(t->begin(), t->end(), b.dest->begin() + b.offset);
  }

  const int64_t kv_bytes_per_block =
      2ll * c.num_layers * options_.kv_block_size * nkv * hd * static_cast<int64_t>(sizeof(float));
  num_kv_blocks_ = static_cast<int32_t>(options_.kv_cache_bytes / kv_bytes_per_block);
  if (num_kv_blocks_ < 1) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "KV cache of %d bytes holds no block of %d tokens (%d bytes each)",
        options_.kv_cache_bytes, options_.kv_block_size, kv_bytes_per_block));
  }
  const int64_t cache_floats =
      static_cast<int64_t>(num_kv_blocks_) * options_.kv_block_size * nkv * hd;
  for (Layer& l : layers_) {
    l.k_cache.assign(cache_floats, 0.0f);
    l.v_cache.assign(cache_floats, 0.0f);
  }
  return absl::OkStatus();
}

absl::Status CpuModelRunner::UpdateWeights(const std::vector<HostTensor>& tensors) {
  for (const HostTensor& t : tensors) {
    if (absl::Status s = CheckTensorAgainstSpec(weight_specs_, t.name, t.dtype, t.shape);
        !s.ok()) {
      return s;
    }
    const Binding& b = bindings_.at(t.name);
    if (t.bytes.size() != static_cast<size_t>(b.count) * DTypeSize(t.dtype)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "tensor '%s': %d bytes given, expected %d", t.name, t.bytes.size(),
          static_cast<size_t>(b.count) * DTypeSize(t.dtype)));
    }
  }
  for (const HostTensor& t : tensors) {
    const Binding& b = bindings_.at(t.name);
    float* out = b.dest->data() + b.offset;
    const uint8_t* in = t.bytes.data();
    for (int64_t i = 0; i < b.count; ++i) {
      switch (t.dtype) {
        case DType::kF32:
          std::memcpy(&out[i], in + 4 * i, 4);
          break;
        case DType::kBF16: {
          uint16_t v;
          std::memcpy(&v, in + 2 * i, 2);
          out[i] = BF16ToF32(v);
          break;
        }
        case DType::kF16: {
          uint16_t v;
          std::memcpy(&v, in + 2 * i, 2);
          out[i] = F16ToF32(v);
          break;
        }
      }
    }
  }
  return absl::OkStatus();
}

absl::Status CpuModelRunner::Forward(const ForwardBatch& batch, std::vector<float>* logits) {
  const ModelConfig& c = config_;
  const int64_t t = batch.num_tokens();
  const int64_t h = c.hidden_size, hd = c.head_dim, nh = c.num_attention_heads,
                nkv = c.num_key_value_heads, inter = c.intermediate_size, vocab = c.vocab_size;
  const int64_t max_blocks = num_kv_blocks_;
  for (int64_t i = 0; i < t; ++i) {
    const int32_t id = batch.token_ids[i];
    const int32_t pos = batch.positions[i];
    const std::vector<int32_t>& table = batch.block_tables[batch.token_seq[i]];
    if (id < 0 || id >= vocab) return absl::InvalidArgumentError(absl::StrCat("token id ", id));
    if (pos < 0 || pos / options_.kv_block_size >= static_cast<int64_t>(table.size())) {
      return absl::InternalError(absl::StrCat("position ", pos, " outside its block table"));
    }
    for (int32_t b : table) {
      if (b < 0 || b >= max_blocks) return absl::InternalError(absl::StrCat("KV block ", b));
    }
  }

  std::vector<const int32_t*> tables(t);
  for (int64_t i = 0; i < t; ++i) tables[i] = batch.block_tables[batch.token_seq[i]].data();
  cpu::TokenSlots slots{batch.positions.data(), tables.data(), t};

  std::vector<float> x(t * h), xn(t * h);            // [t, hidden]
  std::vector<float> q(t * nh * hd), attn(t * nh * hd);  // [t, heads, head_dim]
  std::vector<float> k(t * nkv * hd), v(t * nkv * hd);   // [t, kv_heads, head_dim]
  std::vector<float> gate_up(t * 2 * inter), act(t * inter), proj(t * h);
  for (int64_t i = 0; i < t; ++i) {
    std::memcpy(&x[i * h], &embed_[static_cast<int64_t>(batch.token_ids[i]) * h],
                h * sizeof(float));
  }
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  for (Layer& l : layers_) {
    cpu::RmsNorm(x.data(), l.input_norm.data(), t, h, c.rms_norm_eps, xn.data());
    cpu::MatMul(pool_.get(), xn.data(), t, h, l.q.data(), nh * hd,
                l.q_bias.empty() ? nullptr : l.q_bias.data(), q.data());
    cpu::MatMul(pool_.get(), xn.data(), t, h, l.k.data(), nkv * hd,
                l.k_bias.empty() ? nullptr : l.k_bias.data(), k.data());
    cpu::MatMul(pool_.get(), xn.data(), t, h, l.v.data(), nkv * hd,
                l.v_bias.empty() ? nullptr : l.v_bias.data(), v.data());
    if (c.qk_norm) {
      cpu::RmsNorm(q.data(), l.q_norm.data(), t * nh, hd, c.rms_norm_eps, q.data());
      cpu::RmsNorm(k.data(), l.k_norm.data(), t * nkv, hd, c.rms_norm_eps, k.data());
    }
    cpu::ApplyRope(q.data(), batch.positions.data(), t, nh, hd, c.rope_theta);
    cpu::ApplyRope(k.data(), batch.positions.data(), t, nkv, hd, c.rope_theta);
    cpu::KvCacheLayer cache{l.k_cache.data(), l.v_cache.data(), options_.kv_block_size, nkv, hd};
    cpu::WriteKv(k.data(), v.data(), slots, cache);
    cpu::PagedAttention(pool_.get(), q.data(), slots, nh, cache, scale, attn.data());
    cpu::MatMul(pool_.get(), attn.data(), t, nh * hd, l.o.data(), h, nullptr, proj.data());
    cpu::Add(x.data(), proj.data(), t * h);

    cpu::RmsNorm(x.data(), l.post_norm.data(), t, h, c.rms_norm_eps, xn.data());
    cpu::MatMul(pool_.get(), xn.data(), t, h, l.gate_up.data(), 2 * inter, nullptr,
                gate_up.data());
    cpu::SiluMul(gate_up.data(), t, inter, act.data());
    cpu::MatMul(pool_.get(), act.data(), t, inter, l.down.data(), h, nullptr, proj.data());
    cpu::Add(x.data(), proj.data(), t * h);
  }

  const int64_t r = static_cast<int64_t>(batch.logit_rows.size());
  std::vector<float> rows(r * h);  // [logit rows, hidden]
  for (int64_t i = 0; i < r; ++i) {
    std::memcpy(&rows[i * h], &x[static_cast<int64_t>(batch.logit_rows[i]) * h],
                h * sizeof(float));
  }
  if (options_.batch_variant_for_testing) {
    BatchVariantRmsNorm(rows.data(), final_norm_.data(), r, h, c.rms_norm_eps);
  } else {
    cpu::RmsNorm(rows.data(), final_norm_.data(), r, h, c.rms_norm_eps, rows.data());
  }
  logits->resize(r * vocab);
  const float* head = lm_head_.empty() ? embed_.data() : lm_head_.data();
  cpu::MatMul(pool_.get(), rows.data(), r, h, head, vocab, nullptr, logits->data());
  return absl::OkStatus();
}

}  // namespace rollout
