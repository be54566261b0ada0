// Writes the seed corpora of the fuzz targets into <dir>/<target>/ (tests/fuzz/corpus is its
// output, committed). Not part of CI: run it when the input formats change.
//   rollout-fuzz-seeds tests/fuzz/corpus
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "model/model_config.h"
#include "model/random_model.h"
#include "model/safetensors.h"
#include "rollout/v1/rollout.pb.h"
#include "tests/fuzz/fuzz_targets.h"

namespace fs = std::filesystem;
using namespace rollout;

namespace {

void Write(const fs::path& dir, const std::string& name, const std::string& bytes) {
  fs::create_directories(dir);
  std::ofstream(dir / name, std::ios::binary) << bytes;
}

std::string ReadAll(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

HostTensor Tensor(const std::string& name, DType dtype, std::vector<int64_t> shape) {
  size_t n = DTypeSize(dtype);
  for (int64_t x : shape) n *= static_cast<size_t>(x);
  std::vector<uint8_t> bytes(n);
  for (size_t i = 0; i < n; ++i) bytes[i] = static_cast<uint8_t>(i * 29 + 3);
  return HostTensor{name, dtype, std::move(shape), std::move(bytes)};
}

std::string Safetensors(const std::vector<HostTensor>& tensors) {
  const fs::path tmp = fs::temp_directory_path() / "rollout-fuzz-seed.safetensors";
  if (!WriteSafetensors(tmp.string(), tensors).ok()) std::abort();
  std::string bytes = ReadAll(tmp);
  fs::remove(tmp);
  return bytes;
}

v1::RolloutRequest Rollout(std::vector<uint32_t> prompt, uint64_t seed, uint32_t max_new,
                           float temperature) {
  v1::RolloutRequest r;
  for (uint32_t t : prompt) r.add_prompt_token_ids(t);
  r.set_seed(seed);
  r.mutable_sampling()->set_max_new_tokens(max_new);
  r.mutable_sampling()->set_temperature(temperature);
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s CORPUS_DIR\n", argv[0]);
    return 2;
  }
  const fs::path out(argv[1]);

  // checkpoint: single-file safetensors.
  Write(out / "checkpoint", "two-tensors",
        Safetensors({Tensor("model.norm.weight", DType::kBF16, {8}),
                     Tensor("lm_head.weight", DType::kF32, {2, 3})}));
  Write(out / "checkpoint", "f16-3d", Safetensors({Tensor("w", DType::kF16, {2, 2, 3})}));
  Write(out / "checkpoint", "scalar-and-empty",
        Safetensors({Tensor("s", DType::kF32, {}), Tensor("e", DType::kBF16, {0, 4})}));
  Write(out / "checkpoint", "no-tensors", Safetensors({}));

  // checkpoint_index: the index of the two shards FuzzCheckpointIndex provides.
  Write(out / "checkpoint_index", "both-shards",
        R"({"metadata": {"total_size": 76}, "weight_map": {"x": "a.safetensors", )"
        R"("y": "a.safetensors", "z": "b.safetensors"}})");
  Write(out / "checkpoint_index", "one-shard", R"({"weight_map": {"z": "b.safetensors"}})");

  // model_config: presets and the other families.
  for (const char* preset : {"tiny", "small", "llama3-small", "yarn-small", "moe-small"}) {
    Write(out / "model_config", preset, ModelConfigToJson(*PresetConfig(preset)));
  }
  {
    ModelConfig c = *PresetConfig("tiny");
    c.family = ModelFamily::kQwen2;
    c.architecture = "Qwen2ForCausalLM";
    c.qk_norm = false;
    c.qkv_bias = true;
    c.eos_token_ids = {1, 2, 3};
    Write(out / "model_config", "qwen2", ModelConfigToJson(c));
    c.family = ModelFamily::kLlama;
    c.architecture = "LlamaForCausalLM";
    c.qkv_bias = false;
    c.eos_token_ids = {};
    Write(out / "model_config", "llama", ModelConfigToJson(c));
  }
  Write(out / "model_config", "by-model-type",
        R"({"model_type": "mistral", "num_hidden_layers": 2, "hidden_size": 64,)"
        R"( "intermediate_size": 128, "num_attention_heads": 4, "vocab_size": 256,)"
        R"( "max_position_embeddings": 512, "sliding_window": null, "eos_token_id": 2})");

  // generate_request (the tiny preset: vocab 256, context 512).
  {
    v1::GenerateRequest r;
    *r.add_rollouts() = Rollout({1, 2, 3, 4}, 7, 8, 0.7f);
    Write(out / "generate_request", "one", r.SerializeAsString());
    r.mutable_rollouts(0)->set_num_samples(3);
    r.mutable_rollouts(0)->set_request_id("a");
    v1::SamplingParams* s = r.mutable_rollouts(0)->mutable_sampling();
    s->set_top_k(5);
    s->set_top_p(0.9f);
    s->set_min_p(0.05f);
    s->add_stop_token_ids(9);
    s->set_ignore_eos(true);
    s->set_top_logprobs(2);
    *r.add_rollouts() = Rollout({200, 100, 50}, 1, 500, 0.0f);
    r.mutable_rollouts(1)->set_request_id("b");
    Write(out / "generate_request", "every-field", r.SerializeAsString());
    *r.add_rollouts() = Rollout({255}, 0, 511, 2.0f);
    r.mutable_rollouts(2)->set_num_samples(1024);
    Write(out / "generate_request", "limits", r.SerializeAsString());
  }

  // score_request.
  {
    v1::ScoreRequest r;
    v1::ScoreSequence* s = r.add_sequences();
    for (uint32_t t : {5u, 6u, 7u, 8u, 9u}) s->add_token_ids(t);
    s->set_start(2);
    Write(out / "score_request", "one", r.SerializeAsString());
    s->set_temperature(0.5f);
    s->set_top_logprobs(3);
    v1::ScoreSequence* t = r.add_sequences();
    for (uint32_t i = 0; i < 40; ++i) t->add_token_ids(i * 6 % 256);
    t->set_start(39);
    Write(out / "score_request", "two", r.SerializeAsString());
  }

  // weights_stream: model.norm.weight of the tiny preset, [64] BF16 = 128 bytes.
  {
    v1::WeightsHeader h;
    h.set_version("v1");
    h.set_policy(v1::IN_FLIGHT_POLICY_CONTINUE);
    v1::TensorDecl* d = h.add_tensors();
    d->set_name("model.norm.weight");
    d->set_dtype("BF16");
    d->add_shape(64);
    std::vector<std::string> chunks;
    for (uint64_t off : {0u, 100u}) {
      v1::TensorData data;
      data.set_name("model.norm.weight");
      data.set_offset(off);
      data.set_data(std::string(off == 0 ? 100 : 28, static_cast<char>(0x3f)));
      chunks.push_back(data.SerializeAsString());
    }
    Write(out / "weights_stream", "one-tensor-two-chunks",
          fuzz::EncodeWeightsStream(h.SerializeAsString(), chunks));
    v1::TensorDecl* q = h.add_tensors();
    q->set_name("model.layers.1.self_attn.k_norm.weight");
    q->set_dtype("BF16");
    q->add_shape(16);
    v1::TensorData data;
    data.set_name("model.layers.1.self_attn.k_norm.weight");
    data.set_data(std::string(32, '\x01'));
    chunks.push_back(data.SerializeAsString());
    Write(out / "weights_stream", "two-tensors",
          fuzz::EncodeWeightsStream(h.SerializeAsString(), chunks));
  }
  std::printf("seeds written under %s\n", out.c_str());
  return 0;
}
