// rollout-make-model: writes a seeded random checkpoint of a named preset in the Hugging Face
// layout, e.g. `rollout-make-model --preset small --out /tmp/m --seed 0`.

#include <cstdint>
#include <cstdio>
#include <string>

#include "absl/flags/flag.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/command_line.h"
#include "model/random_model.h"

ABSL_FLAG(std::string, preset, "small",
          "model shape: tiny, small, medium, qwen3-8b, qwen3-32b, moe-small, qwen3-30b-a3b, llama3-small or "
          "yarn-small");
ABSL_FLAG(std::string, out, "", "output directory (required; created if needed)");
ABSL_FLAG(uint64_t, seed, 0, "weights seed; the same seed writes the same bytes");
ABSL_FLAG(std::string, dtype, "bf16", "weight dtype: bf16, f16 or f32");
ABSL_FLAG(int, shards, 1, "number of safetensors files (> 1 also writes the index json)");

namespace {

// Beyond this the write takes long enough that progress lines are worth printing.
constexpr uint64_t kProgressBytes = 1ull << 30;

// "model.layers.7" for a layer's tensors, the full name otherwise.
std::string ProgressGroup(const std::string& tensor) {
  constexpr absl::string_view kLayers = "model.layers.";
  if (!absl::StartsWith(tensor, kLayers)) return tensor;
  const size_t dot = tensor.find('.', kLayers.size());
  return tensor.substr(0, dot);
}

int Run() {
  const std::string out = absl::GetFlag(FLAGS_out);
  if (out.empty()) {
    std::fprintf(stderr, "rollout-make-model: --out DIR is required\n");
    return 1;
  }
  rollout::RandomModelOptions options;
  options.preset = absl::GetFlag(FLAGS_preset);
  options.seed = absl::GetFlag(FLAGS_seed);
  options.num_shards = absl::GetFlag(FLAGS_shards);
  const std::string dtype = absl::GetFlag(FLAGS_dtype);
  if (dtype == "bf16") {
    options.dtype = rollout::DType::kBF16;
  } else if (dtype == "f16") {
    options.dtype = rollout::DType::kF16;
  } else if (dtype == "f32") {
    options.dtype = rollout::DType::kF32;
  } else {
    std::fprintf(stderr, "rollout-make-model: --dtype must be bf16, f16 or f32, got '%s'\n",
                 dtype.c_str());
    return 1;
  }

  absl::StatusOr<rollout::ModelConfig> config = rollout::PresetConfig(options.preset);
  if (!config.ok()) {
    std::fprintf(stderr, "rollout-make-model: %s\n", config.status().ToString().c_str());
    return 1;
  }
  const int64_t params = rollout::ParameterCount(*config);
  const uint64_t total_bytes = static_cast<uint64_t>(params) * rollout::DTypeSize(options.dtype);
  if (total_bytes >= kProgressBytes) {
    // Tensors arrive in name order, so a layer's tensors are contiguous: report each group
    // (layer, or lone tensor) once it is complete.
    std::string group;
    uint64_t group_done = 0;
    options.progress = [&](const std::string& tensor, uint64_t done, uint64_t total) {
      const std::string next = ProgressGroup(tensor);
      if (next != group && !group.empty()) {
        std::fprintf(stderr, "  %-28s %7.2f / %.2f GB\n", group.c_str(), group_done / 1e9,
                     total / 1e9);
      }
      group = next;
      group_done = done;
      if (done == total) {
        std::fprintf(stderr, "  %-28s %7.2f / %.2f GB\n", group.c_str(), done / 1e9, total / 1e9);
      }
    };
    std::fprintf(stderr, "writing %.2f GB to %s ...\n", total_bytes / 1e9, out.c_str());
  }

  absl::Status status = rollout::WriteRandomModel(options, out);
  if (!status.ok()) {
    std::fprintf(stderr, "rollout-make-model: %s\n", status.ToString().c_str());
    return 1;
  }
  std::printf("wrote %s: preset %s, seed %llu, %s, %lld parameters, %llu weight bytes in %d %s\n",
              out.c_str(), options.preset.c_str(), static_cast<unsigned long long>(options.seed),
              dtype.c_str(), static_cast<long long>(params),
              static_cast<unsigned long long>(total_bytes), options.num_shards,
              options.num_shards == 1 ? "file" : "shards");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  rollout::ParseCommandLine(
      argc, argv,
      "writes a seeded random checkpoint in the Hugging Face layout.\nUsage: rollout-make-model "
      "--out DIR [--preset small] [--seed 0] [--dtype bf16] [--shards 1]",
      "make_model_main.cc");
  return Run();
}
