#include "client/checkpoint_upload.h"

#include <algorithm>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "model/model_config.h"
#include "model/safetensors.h"

namespace rollout {
namespace {

// A streamed update checks each tensor it declares, not the set: a checkpoint of another model
// whose names overlap the served ones (Llama's are a subset of Qwen3's) would otherwise update
// those it shares and leave the rest. So a checkpoint must describe the served model.
absl::Status CheckSameModel(const std::string& dir, const ModelConfig& config,
                            const rollout::v1::ModelInfo& served) {
  auto differs = [&](const std::string& field, const std::string& ours, const std::string& theirs) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "%s/config.json has %s %s; the served model has %s: a checkpoint of another model "
        "cannot update it (nothing was sent)",
        dir, field, ours, theirs));
  };
  if (config.architecture != served.architecture()) {
    return differs("architecture", config.architecture, served.architecture());
  }
  const struct {
    const char* field;
    int64_t ours, theirs;
  } sizes[] = {
      {"num_hidden_layers", config.num_layers, served.num_layers()},
      {"hidden_size", config.hidden_size, served.hidden_size()},
      {"intermediate_size", config.intermediate_size, served.intermediate_size()},
      {"num_attention_heads", config.num_attention_heads, served.num_attention_heads()},
      {"num_key_value_heads", config.num_key_value_heads, served.num_key_value_heads()},
      {"head_dim", config.head_dim, served.head_dim()},
      {"vocab_size", config.vocab_size, served.vocab_size()},
      {"num_experts", config.num_experts, served.num_experts()},
      {"num_experts_per_tok", config.num_experts_per_tok, served.num_experts_per_tok()},
      {"moe_intermediate_size", config.moe_intermediate_size, served.moe_intermediate_size()},
      {"tie_word_embeddings", config.tie_word_embeddings, served.tie_word_embeddings()},
  };
  for (const auto& s : sizes) {
    if (s.ours != s.theirs) {
      return differs(s.field, absl::StrCat(s.ours), absl::StrCat(s.theirs));
    }
  }
  const std::vector<int32_t> moe_layers = config.MoeLayers();
  if (!std::equal(moe_layers.begin(), moe_layers.end(), served.moe_layers().begin(),
                  served.moe_layers().end())) {
    return differs("MoE layers", absl::StrCat("[", absl::StrJoin(moe_layers, ","), "]"),
                   absl::StrCat("[", absl::StrJoin(served.moe_layers(), ","), "]"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<rollout::v1::UpdateWeightsResponse> UpdateWeightsFromCheckpoint(
    RolloutClient& client, const std::string& dir, const std::string& version,
    rollout::v1::InFlightPolicy policy, size_t chunk_bytes, const UploadProgress& progress,
    int streams) {
  absl::StatusOr<std::unique_ptr<Checkpoint>> checkpoint = Checkpoint::Open(dir);
  if (!checkpoint.ok()) return checkpoint.status();
  absl::StatusOr<ModelConfig> config = ReadModelConfig(**checkpoint);
  if (!config.ok()) return config.status();
  absl::StatusOr<rollout::v1::ServerInfo> info = client.GetServerInfo();
  if (!info.ok()) return info.status();
  if (absl::Status s = CheckSameModel(dir, *config, info->model()); !s.ok()) return s;
  // Of the served model (the same as the checkpoint's now), as UpdateWeightsFromPath reads it:
  // every tensor, and nothing else (a tied model's lm_head.weight is not served).
  std::vector<TensorSource> tensors;
  for (const TensorSpec& spec : ExpectedTensors(*config)) {
    const TensorView* view = (*checkpoint)->Find(spec.name);
    if (view == nullptr) {
      return absl::FailedPreconditionError(
          absl::StrFormat("%s: checkpoint lacks tensor '%s' of the served model (nothing was sent)",
                          dir, spec.name));
    }
    TensorSource& tensor = tensors.emplace_back();
    tensor.name = spec.name;
    tensor.dtype = DTypeName(view->dtype);
    tensor.shape.assign(view->shape.begin(), view->shape.end());
    tensor.data = view->data;
    tensor.nbytes = view->nbytes;
  }
  std::sort(tensors.begin(), tensors.end(),
            [](const TensorSource& a, const TensorSource& b) { return a.name < b.name; });
  // The views borrow the mapping, which lives until this returns.
  return client.UpdateWeightsFromTensors(version, policy, tensors, chunk_bytes, progress, streams);
}

}  // namespace rollout
