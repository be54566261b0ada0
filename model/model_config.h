#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "model/rope.h"

namespace rollout {

// The decoder families the engine runs. They share one forward pass and differ in flags.
// Qwen3-MoE (Qwen3MoeForCausalLM) is kQwen3 attention with MoE MLPs (ModelConfig::num_experts).
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
  RopeScaling rope_scaling;  // "rope_scaling" / "rope_parameters"; default RoPE when absent
  bool tie_word_embeddings = false;
  bool qk_norm = false;                  // true for Qwen3
  bool qkv_bias = false;                 // true for Qwen2
  // "eos_token_id": int or list; may be empty. ReadModelConfig appends the ids that
  // generation_config.json adds.
  std::vector<int32_t> eos_token_ids;
  // "torch_dtype" (or "dtype"): bfloat16, float16 or float32; absent means bfloat16. The dtype
  // every weight is served in (ServedDType, model/dtype_cast.h).
  std::string torch_dtype = "bfloat16";

  // Mixture of experts (Qwen3MoeForCausalLM only; num_experts = 0: every layer is dense). A MoE
  // layer's MLP is a router ("mlp.gate", [num_experts, hidden]) choosing num_experts_per_tok of
  // num_experts SwiGLU experts of width moe_intermediate_size; dense layers of a MoE model use
  // intermediate_size (docs/determinism.md: how a MoE layer computes a row).
  int32_t num_experts = 0;
  int32_t num_experts_per_tok = 0;
  int32_t moe_intermediate_size = 0;
  bool norm_topk_prob = false;  // renormalise the chosen experts' probabilities to sum 1
  int32_t decoder_sparse_step = 1;
  std::vector<int32_t> mlp_only_layers;  // dense layers, whatever decoder_sparse_step says

  bool is_moe() const { return num_experts > 0; }
  // Transformers' rule: num_experts > 0, layer not in mlp_only_layers and
  // (layer + 1) % decoder_sparse_step == 0.
  bool IsMoeLayer(int32_t layer) const;
  std::vector<int32_t> MoeLayers() const;  // the MoE layers' indices, ascending
  int32_t NumMoeLayers() const;
  // The ids of one token's routing (engine/model_runner.h): at every MoE layer (ascending), its
  // num_experts_per_tok experts in rank order. 0 for a dense model.
  int32_t RoutingSize() const { return NumMoeLayers() * num_experts_per_tok; }
};

// Parses config.json text. Unknown architectures, missing or non-positive sizes, inconsistent
// head counts (heads not divisible by kv heads) and features the forward pass does not
// implement (RoPE variants other than those of model/rope.h, partial rotary, sliding windows,
// MLP or o_proj biases, dtypes other than bfloat16/float16/float32, shared experts) are
// INVALID_ARGUMENT with a message naming the field.
absl::StatusOr<ModelConfig> ParseModelConfig(std::string_view json_text);

// Adds generation_config.json's "eos_token_id" (int or list) to config->eos_token_ids: those
// not there yet, in its order after config.json's, as vLLM and SGLang merge them. Empty text
// (no such file) changes nothing; invalid JSON or ids are INVALID_ARGUMENT naming the field.
absl::Status MergeGenerationConfig(std::string_view generation_config_json, ModelConfig* config);

class Checkpoint;
// The served config of a checkpoint directory: its config.json, with generation_config.json's
// EOS ids merged. Errors name the file.
absl::StatusOr<ModelConfig> ReadModelConfig(const Checkpoint& checkpoint);

// What decides whether a checkpoint can update a served model: the architecture, every size,
// the experts, the MoE layers and the tying. A weight update checks each tensor it names, not
// the set, so a checkpoint of another model whose tensor names overlap the served ones (Llama's
// are a subset of Qwen3's) would update those it shares: both UpdateWeightsFromPath (the
// server) and the client's checkpoint upload compare identities first. Plain value type.
struct ModelIdentity {
  std::string architecture;
  int64_t num_layers = 0, hidden_size = 0, intermediate_size = 0, num_attention_heads = 0,
          num_key_value_heads = 0, head_dim = 0, vocab_size = 0, num_experts = 0,
          num_experts_per_tok = 0, moe_intermediate_size = 0;
  bool tie_word_embeddings = false;
  std::vector<int32_t> moe_layers;  // ascending
};
ModelIdentity IdentityOf(const ModelConfig& config);

// OK when the checkpoint in `dir` (its config.json read as `checkpoint`) is of the `served`
// model; else FAILED_PRECONDITION naming the first field that differs, with both values:
// "DIR/config.json has FIELD X; the served model has Y: a checkpoint of another model cannot
// update it".
absl::Status CheckSameModel(const std::string& dir, const ModelIdentity& checkpoint,
                            const ModelIdentity& served);

// Serialises a config in the Hugging Face format (what ParseModelConfig reads back).
std::string ModelConfigToJson(const ModelConfig& config);

// One tensor a model of `config` must have in its checkpoint, with its HF name and shape.
struct TensorSpec {
  std::string name;            // e.g. "model.layers.0.self_attn.q_proj.weight"
  std::vector<int64_t> shape;  // e.g. {num_heads * head_dim, hidden_size}
};

// Every tensor the checkpoint of `config` must hold (lm_head.weight only when not tied). A MoE
// layer holds, instead of mlp.{gate,up,down}_proj, the Hub's per-expert layout:
//   mlp.gate.weight [num_experts, hidden] (the router),
//   mlp.experts.E.{gate,up}_proj.weight [moe_intermediate_size, hidden],
//   mlp.experts.E.down_proj.weight [hidden, moe_intermediate_size].
// These are the served names (weight updates use them).
std::vector<TensorSpec> ExpectedTensors(const ModelConfig& config);

}  // namespace rollout
