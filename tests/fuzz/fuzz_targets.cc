#include "tests/fuzz/fuzz_targets.h"

#include <stdlib.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <string_view>

#include "engine/engine.h"
#include "engine/sampler.h"
#include "glog/logging.h"
#include "google/protobuf/stubs/logging.h"
#include "model/model_config.h"
#include "model/random_model.h"
#include "model/safetensors.h"
#include "rollout/v1/rollout.pb.h"
#include "runner/cpu/cpu_model_runner.h"
#include "server/proto_convert.h"
#include "server/weights_staging.h"

namespace rollout::fuzz {
namespace {

// A property violation: print what broke and abort, so the fuzzer keeps the input.
[[noreturn]] void Violation(const std::string& what) {
  std::fprintf(stderr, "fuzz property violated: %s\n", what.c_str());
  std::fflush(stderr);
  std::abort();
}

#define FUZZ_CHECK(cond, what)                                \
  do {                                                        \
    if (!(cond)) Violation(std::string(#cond ": ") + (what)); \
  } while (0)

// A scratch directory for this process, removed at exit.
const std::string& ScratchDir() {
  static const std::string* dir = [] {
    const char* base = std::getenv("TMPDIR");
    std::string pattern =
        std::string(base != nullptr && *base ? base : "/tmp") + "/rollout-fuzz-XXXXXX";
    if (::mkdtemp(pattern.data()) == nullptr) Violation("mkdtemp failed");
    auto* d = new std::string(pattern);
    std::atexit([] {
      std::error_code ec;
      std::filesystem::remove_all(ScratchDir(), ec);
    });
    return d;
  }();
  return *dir;
}

void WriteFile(const std::string& path, const uint8_t* data, size_t size) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) Violation("cannot write " + path);
  if (size > 0 && std::fwrite(data, 1, size, f) != size) Violation("short write " + path);
  std::fclose(f);
}

void WriteFile(const std::string& path, const std::string& text) {
  WriteFile(path, reinterpret_cast<const uint8_t*>(text.data()), text.size());
}

void DropProtobufLog(google::protobuf::LogLevel, const char*, int, const std::string&) {}

void QuietLogs() {
  static const bool once = [] {
    FLAGS_minloglevel = 2;  // errors only: the engine logs at INFO
    // Parsing logs every string field with invalid UTF-8; the input is random, so drop those.
    google::protobuf::SetLogHandler(&DropProtobufLog);
    return true;
  }();
  (void)once;
}

// The tiny preset's config.json text.
const std::string& TinyConfigJson() {
  static const std::string* text = [] {
    absl::StatusOr<ModelConfig> config = PresetConfig("tiny");
    if (!config.ok()) Violation("no tiny preset");
    return new std::string(ModelConfigToJson(*config));
  }();
  return *text;
}

// A real engine over the tiny preset (CPU backend, one thread, a small KV cache). Built once,
// never destroyed (its thread idles between inputs).
const Engine& TinyEngine() {
  static const Engine* engine = [] {
    QuietLogs();
    const std::string dir = ScratchDir() + "/tiny-model";
    RandomModelOptions options;
    options.preset = "tiny";
    if (absl::Status s = WriteRandomModel(options, dir); !s.ok()) Violation(s.ToString());
    absl::StatusOr<std::unique_ptr<Checkpoint>> checkpoint = Checkpoint::Open(dir);
    if (!checkpoint.ok()) Violation(checkpoint.status().ToString());
    CpuRunnerOptions runner_options;
    runner_options.kv_cache_bytes = 4 << 20;
    runner_options.num_threads = 1;
    absl::StatusOr<std::unique_ptr<CpuModelRunner>> runner =
        CpuModelRunner::Create(**checkpoint, runner_options);
    if (!runner.ok()) Violation(runner.status().ToString());
    EngineOptions engine_options;
    engine_options.max_running_samples = 8;
    engine_options.max_batch_tokens = 64;
    absl::StatusOr<std::unique_ptr<Engine>> engine =
        Engine::Create(*std::move(runner), engine_options);
    if (!engine.ok()) Violation(engine.status().ToString());
    return engine->release();
  }();
  return *engine;
}

// Touches every byte of every tensor and converts it, so a view that points outside its file
// faults (or ASan reports it).
void ReadEveryTensor(const Checkpoint& checkpoint) {
  for (const std::string& name : checkpoint.TensorNames()) {
    const TensorView* view = checkpoint.Find(name);
    FUZZ_CHECK(view != nullptr, name);
    size_t expected = DTypeSize(view->dtype);
    for (int64_t d : view->shape) {
      FUZZ_CHECK(d >= 0, name);
      expected *= static_cast<size_t>(d);
    }
    FUZZ_CHECK(expected == view->nbytes, name + ": nbytes disagrees with shape x dtype");
    FUZZ_CHECK(view->nbytes == 0 || view->data != nullptr, name);
    volatile uint8_t sum = 0;
    for (size_t i = 0; i < view->nbytes; ++i) sum += view->data[i];
    absl::StatusOr<std::vector<float>> values = checkpoint.ReadF32(name, view->shape);
    FUZZ_CHECK(values.ok(), name + ": " + values.status().ToString());
    FUZZ_CHECK(values->size() == view->nbytes / DTypeSize(view->dtype), name);
  }
}

}  // namespace

int FuzzCheckpoint(const uint8_t* data, size_t size) {
  static const std::string dir = [] {
    const std::string d = ScratchDir() + "/single";
    std::filesystem::create_directories(d);
    WriteFile(d + "/config.json", TinyConfigJson());
    return d;
  }();
  WriteFile(dir + "/model.safetensors", data, size);
  absl::StatusOr<std::unique_ptr<Checkpoint>> checkpoint = Checkpoint::Open(dir);
  if (!checkpoint.ok()) {
    FUZZ_CHECK(!checkpoint.status().message().empty(), "an error without a message");
    return 0;
  }
  ReadEveryTensor(**checkpoint);
  return 0;
}

int FuzzCheckpointIndex(const uint8_t* data, size_t size) {
  static const std::string dir = [] {
    const std::string d = ScratchDir() + "/sharded";
    std::filesystem::create_directories(d);
    WriteFile(d + "/config.json", TinyConfigJson());
    auto tensor = [](const std::string& name, DType dtype, std::vector<int64_t> shape) {
      size_t n = DTypeSize(dtype);
      for (int64_t x : shape) n *= static_cast<size_t>(x);
      std::vector<uint8_t> bytes(n);
      for (size_t i = 0; i < n; ++i) bytes[i] = static_cast<uint8_t>(i * 37 + 11);
      return HostTensor{name, dtype, std::move(shape), std::move(bytes)};
    };
    if (!WriteSafetensors(d + "/a.safetensors",
                          {tensor("x", DType::kBF16, {3, 4}), tensor("y", DType::kF32, {5})})
             .ok() ||
        !WriteSafetensors(d + "/b.safetensors", {tensor("z", DType::kF16, {2, 2, 2})}).ok()) {
      Violation("cannot write the shards");
    }
    return d;
  }();
  WriteFile(dir + "/model.safetensors.index.json", data, size);
  absl::StatusOr<std::unique_ptr<Checkpoint>> checkpoint = Checkpoint::Open(dir);
  if (!checkpoint.ok()) {
    FUZZ_CHECK(!checkpoint.status().message().empty(), "an error without a message");
    return 0;
  }
  // Whatever the index says, only tensors of the two shards can come out.
  for (const std::string& name : (*checkpoint)->TensorNames()) {
    FUZZ_CHECK(name == "x" || name == "y" || name == "z", "unexpected tensor " + name);
  }
  ReadEveryTensor(**checkpoint);
  return 0;
}

int FuzzModelConfig(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<ModelConfig> config = ParseModelConfig(text);
  if (!config.ok()) {
    FUZZ_CHECK(absl::IsInvalidArgument(config.status()), config.status().ToString());
    return 0;
  }
  const ModelConfig& c = *config;
  FUZZ_CHECK(c.num_layers > 0 && c.hidden_size > 0 && c.intermediate_size > 0 &&
                 c.num_attention_heads > 0 && c.num_key_value_heads > 0 && c.vocab_size > 0 &&
                 c.max_position_embeddings > 0 && c.head_dim > 0 && c.head_dim % 2 == 0,
             "accepted a non-positive size");
  FUZZ_CHECK(c.num_attention_heads % c.num_key_value_heads == 0, "heads vs kv heads");
  FUZZ_CHECK(std::isfinite(c.rms_norm_eps) && c.rms_norm_eps > 0,
             "accepted rms_norm_eps = " + std::to_string(c.rms_norm_eps));
  FUZZ_CHECK(std::isfinite(c.rope_theta) && c.rope_theta > 0,
             "accepted rope_theta = " + std::to_string(c.rope_theta));
  for (int32_t eos : c.eos_token_ids) FUZZ_CHECK(eos >= 0, "negative eos id");
  if (c.is_moe()) {
    FUZZ_CHECK(c.num_experts_per_tok > 0 && c.num_experts_per_tok <= c.num_experts &&
                   c.moe_intermediate_size > 0 && c.decoder_sparse_step > 0,
               "accepted a MoE size out of range");
    for (int32_t layer : c.mlp_only_layers) {
      FUZZ_CHECK(layer >= 0 && layer < c.num_layers, "mlp_only_layers outside the model");
    }
    FUZZ_CHECK(c.RoutingSize() == c.NumMoeLayers() * c.num_experts_per_tok, "routing size");
  }
  // What we write, we read back identically.
  const std::string written = ModelConfigToJson(c);
  absl::StatusOr<ModelConfig> again = ParseModelConfig(written);
  FUZZ_CHECK(again.ok(), again.status().ToString() + "\n" + written);
  const ModelConfig& d = *again;
  FUZZ_CHECK(
      d.architecture == c.architecture && d.family == c.family && d.num_layers == c.num_layers &&
          d.hidden_size == c.hidden_size && d.intermediate_size == c.intermediate_size &&
          d.num_attention_heads == c.num_attention_heads &&
          d.num_key_value_heads == c.num_key_value_heads && d.head_dim == c.head_dim &&
          d.vocab_size == c.vocab_size && d.max_position_embeddings == c.max_position_embeddings &&
          d.rms_norm_eps == c.rms_norm_eps && d.rope_theta == c.rope_theta &&
          d.tie_word_embeddings == c.tie_word_embeddings && d.qk_norm == c.qk_norm &&
          d.qkv_bias == c.qkv_bias && d.eos_token_ids == c.eos_token_ids &&
          d.torch_dtype == c.torch_dtype && d.rope_scaling == c.rope_scaling &&
          d.num_experts == c.num_experts && d.num_experts_per_tok == c.num_experts_per_tok &&
          d.moe_intermediate_size == c.moe_intermediate_size &&
          d.norm_topk_prob == c.norm_topk_prob && d.decoder_sparse_step == c.decoder_sparse_step &&
          d.mlp_only_layers == c.mlp_only_layers,
      "ModelConfigToJson does not round-trip:\n" + written);
  return 0;
}

int FuzzGenerateRequest(const uint8_t* data, size_t size) {
  QuietLogs();
  const Engine& engine = TinyEngine();
  v1::GenerateRequest request;
  if (!request.ParseFromArray(data, static_cast<int>(size))) return 0;
  absl::StatusOr<std::vector<SampleSpec>> specs = ToSampleSpecs(request, engine);
  if (!specs.ok()) {
    FUZZ_CHECK(absl::IsInvalidArgument(specs.status()), specs.status().ToString());
    FUZZ_CHECK(!specs.status().message().empty(), "an error without a message");
    return 0;
  }
  size_t expected = 0;
  for (const v1::RolloutRequest& r : request.rollouts()) {
    expected += r.num_samples() == 0 ? 1 : r.num_samples();
  }
  FUZZ_CHECK(specs->size() == expected, "sample count");
  FUZZ_CHECK(expected <= kMaxSamplesPerRequest, "more samples than the request limit");
  size_t k = 0;
  for (int i = 0; i < request.rollouts_size(); ++i) {
    const v1::RolloutRequest& r = request.rollouts(i);
    const uint32_t n = r.num_samples() == 0 ? 1 : r.num_samples();
    for (uint32_t j = 0; j < n; ++j, ++k) {
      const SampleSpec& s = (*specs)[k];
      FUZZ_CHECK(s.rollout_index == i && s.sample_index == static_cast<int32_t>(j), "order");
      FUZZ_CHECK(s.sample_seed == DeriveSampleSeed(r.seed(), j), "seed derivation");
      FUZZ_CHECK(s.score_start == 0, "a generate sample marked as scoring");
      FUZZ_CHECK(static_cast<int>(s.prompt.size()) == r.prompt_token_ids_size(), "prompt");
      FUZZ_CHECK(s.params.max_new_tokens >= 1, "max_new_tokens");
      FUZZ_CHECK(
          static_cast<int64_t>(s.prompt.size()) + s.params.max_new_tokens <= engine.max_context(),
          "beyond the context");
      FUZZ_CHECK(std::isfinite(s.params.temperature) && s.params.temperature >= 0, "temperature");
      const absl::Status valid = engine.Validate(s);
      FUZZ_CHECK(valid.ok(), valid.ToString());
    }
  }
  return 0;
}

int FuzzScoreRequest(const uint8_t* data, size_t size) {
  QuietLogs();
  const Engine& engine = TinyEngine();
  v1::ScoreRequest request;
  if (!request.ParseFromArray(data, static_cast<int>(size))) return 0;
  absl::StatusOr<std::vector<SampleSpec>> specs = ToScoreSpecs(request, engine);
  if (!specs.ok()) {
    FUZZ_CHECK(absl::IsInvalidArgument(specs.status()), specs.status().ToString());
    FUZZ_CHECK(!specs.status().message().empty(), "an error without a message");
    return 0;
  }
  FUZZ_CHECK(static_cast<int>(specs->size()) == request.sequences_size(), "sequence count");
  for (size_t i = 0; i < specs->size(); ++i) {
    const SampleSpec& s = (*specs)[i];
    FUZZ_CHECK(s.rollout_index == static_cast<int32_t>(i), "order");
    FUZZ_CHECK(s.score_start >= 1 && s.score_start < static_cast<int32_t>(s.prompt.size()),
               "start");
    FUZZ_CHECK(static_cast<int64_t>(s.prompt.size()) <= engine.max_context(), "context");
    const absl::Status valid = engine.Validate(s);
    FUZZ_CHECK(valid.ok(), valid.ToString());
  }
  return 0;
}

std::string EncodeWeightsStream(const std::string& header,
                                const std::vector<std::string>& data_chunks) {
  std::string out;
  auto frame = [&](const std::string& bytes) {
    const size_t n = std::min<size_t>(bytes.size(), 0xffff);
    out.push_back(static_cast<char>(n & 0xff));
    out.push_back(static_cast<char>(n >> 8));
    out.append(bytes, 0, n);
  };
  frame(header);
  for (const std::string& chunk : data_chunks) frame(chunk);
  return out;
}

int FuzzWeightsStream(const uint8_t* data, size_t size) {
  QuietLogs();
  const std::vector<WeightSpec>& specs = TinyEngine().weight_specs();
  size_t at = 0;
  // The next length-prefixed frame, or false at the end of the input.
  auto next = [&](const uint8_t** frame, size_t* length) {
    if (size - at < 2) return false;
    *length = std::min<size_t>(data[at] | (data[at + 1] << 8), size - at - 2);
    *frame = data + at + 2;
    at += 2 + *length;
    return true;
  };
  const uint8_t* frame;
  size_t length;
  if (!next(&frame, &length)) return 0;
  v1::WeightsHeader header;
  if (!header.ParseFromArray(frame, static_cast<int>(length))) return 0;
  static WeightsArena* const arena = new WeightsArena(specs, AllocatePlainHostStaging);
  WeightsStaging staging(&specs, arena);
  if (!staging.SetHeader(header).ok()) return 0;
  FUZZ_CHECK(staging.has_header(), "header not recorded");
  // A shadow copy of what was accepted, to check the result byte for byte.
  std::map<std::string, std::vector<uint8_t>> shadow;
  std::map<std::string, std::vector<bool>> seen;
  for (const v1::TensorDecl& decl : header.tensors()) {
    const WeightSpec* spec = FindWeightSpec(specs, decl.name());
    FUZZ_CHECK(spec != nullptr, "an unknown tensor was accepted: " + decl.name());
    shadow[decl.name()].assign(spec->nbytes(), 0);
    seen[decl.name()].assign(spec->nbytes(), false);
  }
  uint64_t accepted_bytes = 0;
  while (next(&frame, &length)) {
    v1::TensorData chunk;
    if (!chunk.ParseFromArray(frame, static_cast<int>(length))) continue;
    if (!staging.AddData(chunk).ok()) continue;
    auto it = shadow.find(chunk.name());
    FUZZ_CHECK(it != shadow.end(), "data for an undeclared tensor was accepted");
    FUZZ_CHECK(chunk.offset() < it->second.size() &&
                   chunk.data().size() <= it->second.size() - chunk.offset(),
               "data beyond the tensor was accepted");
    for (size_t i = 0; i < chunk.data().size(); ++i) {
      FUZZ_CHECK(!seen[chunk.name()][chunk.offset() + i], "overlapping data was accepted");
      seen[chunk.name()][chunk.offset() + i] = true;
      it->second[chunk.offset() + i] = static_cast<uint8_t>(chunk.data()[i]);
    }
    accepted_bytes += chunk.data().size();
    FUZZ_CHECK(staging.bytes_received() == accepted_bytes, "bytes_received");
  }
  absl::StatusOr<WeightUpdate> update = staging.Finish();
  if (!update.ok()) return 0;
  FUZZ_CHECK(update->version == header.version() && !update->version.empty(), "version");
  FUZZ_CHECK(update->tensors.size() == shadow.size(), "tensor count");
  for (const HostTensorView& t : update->tensors) {
    FUZZ_CHECK(CheckTensorAgainstSpec(specs, t.name, t.dtype, t.shape).ok(), t.name);
    FUZZ_CHECK(std::vector<uint8_t>(t.data, t.data + t.nbytes) == shadow[t.name],
               t.name + ": bytes differ from what was sent");
    for (bool b : seen[t.name]) FUZZ_CHECK(b, t.name + ": accepted with a gap");
  }
  return 0;
}

const std::vector<Target>& Targets() {
  static const std::vector<Target> targets = {
      {"checkpoint", &FuzzCheckpoint},      {"checkpoint_index", &FuzzCheckpointIndex},
      {"model_config", &FuzzModelConfig},   {"generate_request", &FuzzGenerateRequest},
      {"score_request", &FuzzScoreRequest}, {"weights_stream", &FuzzWeightsStream},
  };
  return targets;
}

}  // namespace rollout::fuzz
