#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace rollout {

// The dense decoder families the engine runs. They share one forward pass and differ in flags.
enum class ModelFamily {
  kQwen3,  // q/k RMSNorm per head, no qkv bias
  kQwen2,  // qkv bias, no q/k norm
  kLlama,  // neither (also Mistral; attention_bias is refused: it adds an o_proj bias)
};

// A model's hyper-parameters, read from a Hugging Face config.json. Plain value type.
struct ModelConfig {
  std::string architecture;  // HF "architectures"[0], e.g. "Qwen3ForCausalLM"
  ModelFamily family = ModelFamily::kQwen3;
  int32_t num_layers = 0;  // num_hidden_layers
  int32_t hidden_size = 0;
  int32_t intermediate_size = 0;
  int32_t num_attention_heads = 0;
  int32_t num_key_value_heads = 0;  // defaults to num_attention_heads
  int32_t head_dim = 0;             // defaults to hidden_size / num_attention_heads
  int32_t vocab_size = 0;
  int32_t max_position_embeddings = 0;
  float rms_norm_eps = 1e-6f;
  float rope_theta = 10000.0f;
  bool tie_word_embeddings = false;
  bool qk_norm = false;                  // true for Qwen3
  bool qkv_bias = false;                 // true for Qwen2
  std::vector<int32_t> eos_token_ids;    // "eos_token_id": int or list; may be empty
  std::string torch_dtype = "bfloat16";  // informational
};

// Parses config.json text. Unknown architectures, missing or non-positive sizes, inconsistent
// head counts (heads not divisible by kv heads) and features the forward pass does not
// implement (RoPE scaling, sliding windows, MLP or o_proj biases) are INVALID_ARGUMENT with a
// message naming the field.
absl::StatusOr<ModelConfig> ParseModelConfig(std::string_view json_text);

// Serialises a config in the Hugging Face format (what ParseModelConfig reads back).
std::string ModelConfigToJson(const ModelConfig& config);

// One tensor a model of `config` must have in its checkpoint, with its HF name and shape.
struct TensorSpec {
  std::string name;            // e.g. "model.layers.0.self_attn.q_proj.weight"
  std::vector<int64_t> shape;  // e.g. {num_heads * head_dim, hidden_size}
};

// Every tensor the checkpoint of `config` must hold (lm_head.weight only when not tied).
std::vector<TensorSpec> ExpectedTensors(const ModelConfig& config);

}  // namespace rollout
