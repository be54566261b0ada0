#include "model/random_model.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string_view>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/thread_pool.h"
#include "nlohmann/json.hpp"

namespace rollout {
namespace {

// Standard deviation of the logits (lm_head rows dotted with the unit-RMS final hidden state).
// At 3, a 4096-token vocabulary puts ~0.07-0.5 (median ~0.17) on its top token at T = 1: peaked
// enough for sampling to matter, far from one-hot.
constexpr double kLogitStd = 3.0;
constexpr double kBiasStd = 0.02;
constexpr size_t kChunkElements = 1 << 22;

ModelConfig Qwen3Base() {
  ModelConfig c;
  c.architecture = "Qwen3ForCausalLM";
  c.family = ModelFamily::kQwen3;
  c.qk_norm = true;
  c.qkv_bias = false;
  c.rms_norm_eps = 1e-6f;
  c.torch_dtype = "bfloat16";
  return c;
}

uint64_t Fnv1a64(std::string_view s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char ch : s) {
    h ^= ch;
    h *= 0x100000001b3ull;
  }
  return h;
}

// The SplitMix64 output function: a bijective avalanche mix of a 64-bit counter.
uint64_t Mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

}  // namespace

RandomTensorInit RandomInitFor(const ModelConfig& config, uint64_t seed, const std::string& name,
                               const std::vector<int64_t>& shape) {
  const double h = config.hidden_size;
  double stddev = 0.0;
  RandomTensorInit init;
  if (absl::EndsWith(name, "norm.weight")) {
    init.norm_weight = true;
  } else if (absl::EndsWith(name, ".bias")) {
    stddev = kBiasStd;
  } else if (name == "lm_head.weight") {
    stddev = kLogitStd / std::sqrt(h);
  } else if (name == "model.embed_tokens.weight") {
    // The first RMSNorm makes the embedding scale irrelevant to layer 0, but a tied matrix is
    // also the lm_head, where std 1 would make the logits std sqrt(hidden): one-hot.
    stddev = config.tie_word_embeddings ? kLogitStd / std::sqrt(h) : 1.0;
  } else {
    // Linear [out, in]: std 1/sqrt(in) keeps each output's variance equal to the input's.
    stddev = 1.0 / std::sqrt(static_cast<double>(shape.back()));
  }
  // The sum of four uniforms on {0, ..., 65535} has variance 4 * (65536^2 - 1) / 12.
  init.scale = stddev / std::sqrt((65536.0 * 65536.0 - 1.0) / 3.0);
  init.key = Mix64(Mix64(seed) ^ Fnv1a64(name));
  return init;
}

namespace {

// Value `index` of a tensor. Integer arithmetic plus one multiply (or an exact sum), so FMA
// contraction or -march flags cannot change a bit: the bytes depend only on (seed, name, index).
float RandomValue(const RandomTensorInit& init, uint64_t index) {
  const uint64_t bits = Mix64(init.key + (index + 1) * 0x9e3779b97f4a7c15ull);
  if (init.norm_weight) {
    // 1 + k / 65536 with |k| <= 3276: within +-0.05 of 1, and exact in float.
    const int64_t k = static_cast<int64_t>((bits >> 32) % 6553) - 3276;
    return static_cast<float>(1.0 + static_cast<double>(k) * (1.0 / 65536.0));
  }
  // Irwin-Hall with four 16-bit uniforms: close to normal, mean 0 after centring.
  const int64_t sum = static_cast<int64_t>((bits & 0xffff) + ((bits >> 16) & 0xffff) +
                                           ((bits >> 32) & 0xffff) + (bits >> 48)) -
                      2 * 65535;
  return static_cast<float>(static_cast<double>(sum) * init.scale);
}

// values[0, n) in `dtype` at p (n * DTypeSize(dtype) bytes).
void EncodeInto(DType dtype, const float* values, size_t n, uint8_t* p) {
  for (size_t i = 0; i < n; ++i) {
    if (dtype == DType::kF32) {
      std::memcpy(p + 4 * i, &values[i], 4);
    } else {
      const uint16_t half = dtype == DType::kBF16 ? F32ToBF16(values[i]) : F32ToF16(values[i]);
      std::memcpy(p + 2 * i, &half, 2);
    }
  }
}

uint64_t NumElements(const std::vector<int64_t>& shape) {
  uint64_t n = 1;
  for (int64_t d : shape) n *= static_cast<uint64_t>(d);
  return n;
}

absl::Status WriteFileAtomically(const std::string& path, const std::string& text) {
  const std::string temp_path = absl::StrCat(path, ".tmp.", ::getpid());
  std::FILE* f = std::fopen(temp_path.c_str(), "wb");
  if (f == nullptr) {
    return absl::InternalError(absl::StrCat(temp_path, ": ", std::strerror(errno)));
  }
  const bool wrote = std::fwrite(text.data(), 1, text.size(), f) == text.size();
  if (std::fclose(f) != 0 || !wrote || std::rename(temp_path.c_str(), path.c_str()) != 0) {
    const std::string message = absl::StrCat(path, ": write failed: ", std::strerror(errno));
    std::remove(temp_path.c_str());
    return absl::InternalError(message);
  }
  return absl::OkStatus();
}

// Assigns sorted tensors to `num_shards` contiguous runs of roughly equal bytes, none empty.
std::vector<int> AssignShards(const std::vector<uint64_t>& bytes, int num_shards) {
  uint64_t total = 0;
  for (uint64_t b : bytes) total += b;
  const size_t n = bytes.size();
  std::vector<int> shard_of(n);
  int shard = 0;
  size_t in_shard = 0;
  uint64_t before = 0;
  for (size_t i = 0; i < n; ++i) {
    const bool past_boundary = static_cast<long double>(before) * num_shards >=
                               static_cast<long double>(total) * (shard + 1);
    const bool must_advance = n - i <= static_cast<size_t>(num_shards - 1 - shard);
    if (in_shard > 0 && shard + 1 < num_shards && (past_boundary || must_advance)) {
      ++shard;
      in_shard = 0;
    }
    shard_of[i] = shard;
    ++in_shard;
    before += bytes[i];
  }
  return shard_of;
}

const char* TorchDtype(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return "float32";
    case DType::kF16:
      return "float16";
    case DType::kBF16:
      return "bfloat16";
  }
  return "bfloat16";
}

// "small"'s shape as a Llama (no q/k norm) or Qwen3 with a scaled RoPE whose frequencies fall
// in every band of the scaling: the pre-training context 1024 of a 4096 context.
// "small"'s shape, which the small presets of other kinds (scaled RoPE, MoE) share.
void SmallShape(ModelConfig* m) {
  ModelConfig& c = *m;
  c.num_layers = 4;
  c.hidden_size = 256;
  c.intermediate_size = 768;
  c.num_attention_heads = 8;
  c.num_key_value_heads = 2;
  c.head_dim = 32;
  c.vocab_size = 4096;
  c.max_position_embeddings = 4096;
  c.eos_token_ids = {2};
}

ModelConfig SmallWithScaledRope(const std::string& preset) {
  ModelConfig c = Qwen3Base();
  SmallShape(&c);
  c.tie_word_embeddings = false;
  c.rope_scaling.original_max_position_embeddings = 1024;
  if (preset == "llama3-small") {
    // Llama 3.1's rope_scaling (factor 8, low 1, high 4) and theta.
    c.architecture = "LlamaForCausalLM";
    c.family = ModelFamily::kLlama;
    c.qk_norm = false;
    c.rope_theta = 500000.0f;
    c.rope_scaling.type = RopeType::kLlama3;
    c.rope_scaling.factor = 8.0;
    c.rope_scaling.low_freq_factor = 1.0;
    c.rope_scaling.high_freq_factor = 4.0;
  } else {  // "yarn-small": Qwen's long-context recipe, factor 4
    c.rope_theta = 1000000.0f;
    c.rope_scaling.type = RopeType::kYarn;
    c.rope_scaling.factor = 4.0;
  }
  return c;
}

// Qwen3-MoE: "qwen3-30b-a3b" is Qwen/Qwen3-30B-A3B's config.json; "moe-small" is "small"'s
// attention with 8 experts of width 128, 2 per token, and layer 1 dense (mlp_only_layers), so
// that a test model has both kinds of layer.
ModelConfig Qwen3Moe(const std::string& preset) {
  ModelConfig c = Qwen3Base();
  c.architecture = "Qwen3MoeForCausalLM";
  c.norm_topk_prob = true;
  c.decoder_sparse_step = 1;
  c.rope_theta = 1000000.0f;
  c.tie_word_embeddings = false;
  if (preset == "qwen3-30b-a3b") {
    c.num_layers = 48;
    c.hidden_size = 2048;
    c.intermediate_size = 6144;  // in the config, though no layer is dense
    c.num_attention_heads = 32;
    c.num_key_value_heads = 4;
    c.head_dim = 128;
    c.vocab_size = 151936;
    c.max_position_embeddings = 40960;
    c.eos_token_ids = {151645};
    c.num_experts = 128;
    c.num_experts_per_tok = 8;
    c.moe_intermediate_size = 768;
  } else {
    SmallShape(&c);
    c.num_experts = 8;
    c.num_experts_per_tok = 2;
    c.moe_intermediate_size = 128;
    c.mlp_only_layers = {1};
  }
  return c;
}

// The dense Qwen3 releases' config.json (Qwen/Qwen3-8B, Qwen/Qwen3-32B): what they share (8 KV
// heads of 128, the 151,936-token vocabulary, 40,960 positions, theta 1e6, untied) and their size.
void Qwen3Release(ModelConfig* c, int32_t layers, int32_t hidden, int32_t intermediate,
                  int32_t heads) {
  c->num_layers = layers;
  c->hidden_size = hidden;
  c->intermediate_size = intermediate;
  c->num_attention_heads = heads;
  c->num_key_value_heads = 8;
  c->head_dim = 128;
  c->vocab_size = 151936;
  c->max_position_embeddings = 40960;
  c->eos_token_ids = {151645};
  c->rope_theta = 1000000.0f;
  c->tie_word_embeddings = false;
}

}  // namespace

std::vector<std::string> PresetNames() {
  return {"tiny",      "small",         "medium",       "qwen3-8b",  "qwen3-32b",
          "moe-small", "qwen3-30b-a3b", "llama3-small", "yarn-small"};
}

absl::StatusOr<ModelConfig> PresetConfig(const std::string& preset) {
  if (preset == "llama3-small" || preset == "yarn-small") return SmallWithScaledRope(preset);
  if (preset == "moe-small" || preset == "qwen3-30b-a3b") return Qwen3Moe(preset);
  ModelConfig c = Qwen3Base();
  if (preset == "tiny") {
    c.num_layers = 2;
    c.hidden_size = 64;
    c.intermediate_size = 128;
    c.num_attention_heads = 4;
    c.num_key_value_heads = 2;
    c.head_dim = 16;
    c.vocab_size = 256;
    c.max_position_embeddings = 512;
    c.eos_token_ids = {1};
    c.rope_theta = 10000.0f;
    c.tie_word_embeddings = true;
  } else if (preset == "small") {
    SmallShape(&c);
    c.rope_theta = 1000000.0f;
    c.tie_word_embeddings = false;
  } else if (preset == "medium") {
    // About 0.5 B parameters (1 GB in bf16): big enough to measure weight-update throughput
    // and loading on the CPU.
    c.num_layers = 8;
    c.hidden_size = 2048;
    c.intermediate_size = 5632;
    c.num_attention_heads = 16;
    c.num_key_value_heads = 4;
    c.head_dim = 128;
    c.vocab_size = 32000;
    c.max_position_embeddings = 4096;
    c.eos_token_ids = {2};
    c.rope_theta = 1000000.0f;
    c.tie_word_embeddings = false;
  } else if (preset == "qwen3-8b") {
    Qwen3Release(&c, 36, 4096, 12288, 32);
  } else if (preset == "qwen3-32b") {
    // A model that wants several GPUs (65.5 GB of bf16 weights).
    Qwen3Release(&c, 64, 5120, 25600, 64);
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "unknown preset '", preset, "' (presets: ", absl::StrJoin(PresetNames(), ", "), ")"));
  }
  return c;
}

int64_t ParameterCount(const ModelConfig& config) {
  int64_t n = 0;
  for (const TensorSpec& spec : ExpectedTensors(config)) {
    n += static_cast<int64_t>(NumElements(spec.shape));
  }
  return n;
}

absl::Status WriteRandomModel(const RandomModelOptions& options, const std::string& out_dir) {
  absl::StatusOr<ModelConfig> config = PresetConfig(options.preset);
  if (!config.ok()) return config.status();
  if (options.tie_word_embeddings.has_value()) {
    config->tie_word_embeddings = *options.tie_word_embeddings;
  }
  return WriteRandomModelForConfig(*config, options, out_dir);
}

absl::Status WriteRandomModelForConfig(const ModelConfig& config_in,
                                       const RandomModelOptions& options,
                                       const std::string& out_dir) {
  ModelConfig config = config_in;
  config.torch_dtype = TorchDtype(options.dtype);
  const std::string config_json = ModelConfigToJson(config);
  // What we write must be what the engine accepts; this also validates hand-built configs.
  absl::StatusOr<ModelConfig> reparsed = ParseModelConfig(config_json);
  if (!reparsed.ok()) return reparsed.status();

  std::vector<TensorMeta> tensors;
  for (TensorSpec& spec : ExpectedTensors(config)) {
    tensors.push_back({std::move(spec.name), options.dtype, std::move(spec.shape)});
  }
  std::sort(tensors.begin(), tensors.end(),
            [](const TensorMeta& a, const TensorMeta& b) { return a.name < b.name; });
  if (options.num_shards < 1 || options.num_shards > 99999 ||
      static_cast<size_t>(options.num_shards) > tensors.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_shards must be in [1, ", tensors.size(), "], got ", options.num_shards));
  }

  std::error_code ec;
  std::filesystem::create_directories(out_dir, ec);
  if (ec) return absl::InternalError(absl::StrCat("create ", out_dir, ": ", ec.message()));

  std::vector<uint64_t> bytes;
  uint64_t total_bytes = 0;
  for (const TensorMeta& t : tensors) {
    bytes.push_back(NumElements(t.shape) * DTypeSize(t.dtype));
    total_bytes += bytes.back();
  }
  const std::vector<int> shard_of = AssignShards(bytes, options.num_shards);

  uint64_t bytes_done = 0;
  cpu::ThreadPool pool;  // all cores: a Qwen3-8B checkpoint is 8 billion values
  std::vector<float> values;
  std::vector<uint8_t> encoded;
  TensorProducer produce = [&](const TensorMeta& t, const ByteSink& sink) -> absl::Status {
    const RandomTensorInit init = RandomInitFor(config, options.seed, t.name, t.shape);
    const uint64_t count = NumElements(t.shape);
    for (uint64_t begin = 0; begin < count; begin += kChunkElements) {
      const size_t n = static_cast<size_t>(std::min<uint64_t>(kChunkElements, count - begin));
      values.resize(n);
      encoded.resize(n * DTypeSize(t.dtype));
      // Each value depends only on (key, index): the threads cannot change a byte.
      pool.ParallelFor(static_cast<int64_t>(n), 1 << 14, [&](int64_t lo, int64_t hi) {
        for (int64_t i = lo; i < hi; ++i) values[i] = RandomValue(init, begin + i);
        EncodeInto(t.dtype, values.data() + lo, static_cast<size_t>(hi - lo),
                   encoded.data() + lo * DTypeSize(t.dtype));
      });
      absl::Status status = sink(encoded.data(), encoded.size());
      if (!status.ok()) return status;
    }
    bytes_done += count * DTypeSize(t.dtype);
    if (options.progress) options.progress(t.name, bytes_done, total_bytes);
    return absl::OkStatus();
  };

  const std::string single_path = out_dir + "/model.safetensors";
  const std::string index_path = out_dir + "/model.safetensors.index.json";
  // Checkpoint::Open prefers model.safetensors over the index, so the other layout's entry
  // file from an earlier run must go or it would shadow (or confuse) what we write now.
  std::filesystem::remove(options.num_shards == 1 ? index_path : single_path, ec);
  if (ec) return absl::InternalError(absl::StrCat("remove stale file: ", ec.message()));

  if (options.num_shards == 1) {
    absl::Status status = WriteSafetensorsStreaming(single_path, tensors, produce);
    if (!status.ok()) return status;
  } else {
    nlohmann::json weight_map = nlohmann::json::object();
    for (int shard = 0; shard < options.num_shards; ++shard) {
      const std::string file_name =
          absl::StrFormat("model-%05d-of-%05d.safetensors", shard + 1, options.num_shards);
      std::vector<TensorMeta> part;
      for (size_t i = 0; i < tensors.size(); ++i) {
        if (shard_of[i] != shard) continue;
        part.push_back(tensors[i]);
        weight_map[tensors[i].name] = file_name;
      }
      absl::Status status =
          WriteSafetensorsStreaming(out_dir + "/" + file_name, std::move(part), produce);
      if (!status.ok()) return status;
    }
    nlohmann::json index = {{"metadata", {{"total_size", total_bytes}}},
                            {"weight_map", std::move(weight_map)}};
    absl::Status status = WriteFileAtomically(index_path, index.dump(2) + "\n");
    if (!status.ok()) return status;
  }
  return WriteFileAtomically(out_dir + "/config.json", config_json);
}

}  // namespace rollout
