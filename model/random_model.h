#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "model/model_config.h"
#include "model/safetensors.h"

namespace rollout {

// Named model shapes. Of the Qwen3 architecture: "tiny" is for unit tests, "small" is the
// embedded default the demo and end-to-end tests serve, "medium" (~0.5 B parameters, 1 GB in
// bf16) measures weight updates on the CPU, "qwen3-8b" is the real 8B shape (weights are
// ~16 GB; for speed work). With scaled RoPE, "small"'s shape and a 4096 context pre-trained at
// 1024: "llama3-small" (LlamaForCausalLM, Llama 3.1's rope_scaling: llama3, factor 8, low 1,
// high 4, theta 500000) and "yarn-small" (Qwen3, yarn factor 4, theta 1e6). Of
// Qwen3MoeForCausalLM: "moe-small" ("small"'s attention, 8 experts of width 128, 2 per token,
// norm_topk_prob, layer 1 dense by mlp_only_layers) for tests, and "qwen3-30b-a3b" (the real
// Qwen3-30B-A3B shape: 48 layers, hidden 2048, 32 / 4 heads x 128, 128 experts of width 768,
// 8 per token; ~61 GB in bf16 -- for the GPU benchmarks, never written in CI).
absl::StatusOr<ModelConfig> PresetConfig(const std::string& preset);
std::vector<std::string> PresetNames();

struct RandomModelOptions {
  std::string preset = "small";
  uint64_t seed = 0;
  DType dtype = DType::kBF16;
  int num_shards = 1;  // > 1 writes model-0000i-of-0000n.safetensors plus the index json
  // Overrides the preset's tie_word_embeddings when set (tests cover both layouts).
  std::optional<bool> tie_word_embeddings;
  // Called after each tensor is written, in file order, with the bytes written so far and in
  // all. Lets a CLI show progress on multi-GB presets; the library itself prints nothing.
  std::function<void(const std::string& tensor, uint64_t bytes_done, uint64_t bytes_total)>
      progress;
};

// How WriteRandomModel generates one tensor: element i comes from Mix64(key + (i + 1) * golden),
// as 1 + k / 65536 for a norm weight, else as an Irwin-Hall sum of four 16-bit uniforms times
// `scale`. CudaModelRunner::CreateSynthetic generates the same values on the GPU from this.
struct RandomTensorInit {
  uint64_t key = 0;
  double scale = 0.0;        // normal tensors only
  bool norm_weight = false;  // "...norm.weight": values around 1
};
RandomTensorInit RandomInitFor(const ModelConfig& config, uint64_t seed, const std::string& name,
                               const std::vector<int64_t>& shape);

// Number of parameters (elements of all ExpectedTensors) of `config`.
int64_t ParameterCount(const ModelConfig& config);

// Writes config.json and seeded random weights of the preset to `out_dir` (created if needed)
// in the Hugging Face layout that Checkpoint::Open reads. The same (preset, seed, dtype) always
// writes the same bytes. Weights are scaled so activations stay O(1) through every layer and
// the next-token distribution is neither flat nor one-hot.
absl::Status WriteRandomModel(const RandomModelOptions& options, const std::string& out_dir);

// WriteRandomModel for any config (e.g. Qwen2 with qkv biases, which no preset has).
// `options.preset` and `options.tie_word_embeddings` are ignored: `config` decides.
absl::Status WriteRandomModelForConfig(const ModelConfig& config, const RandomModelOptions& options,
                                       const std::string& out_dir);

}  // namespace rollout
