#include "client/checkpoint_upload.h"

#include <algorithm>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "model/model_config.h"
#include "model/safetensors.h"

namespace rollout {
namespace {

// The served model as GetServerInfo describes it, for CheckSameModel (model/model_config.h).
ModelIdentity IdentityOf(const rollout::v1::ModelInfo& served) {
  ModelIdentity id;
  id.architecture = served.architecture();
  id.num_layers = served.num_layers();
  id.hidden_size = served.hidden_size();
  id.intermediate_size = served.intermediate_size();
  id.num_attention_heads = served.num_attention_heads();
  id.num_key_value_heads = served.num_key_value_heads();
  id.head_dim = served.head_dim();
  id.vocab_size = served.vocab_size();
  id.num_experts = served.num_experts();
  id.num_experts_per_tok = served.num_experts_per_tok();
  id.moe_intermediate_size = served.moe_intermediate_size();
  id.tie_word_embeddings = served.tie_word_embeddings();
  id.moe_layers.assign(served.moe_layers().begin(), served.moe_layers().end());
  return id;
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
  if (absl::Status s = CheckSameModel(dir, IdentityOf(*config), IdentityOf(info->model()));
      !s.ok()) {
    return absl::FailedPreconditionError(absl::StrCat(s.message(), " (nothing was sent)"));
  }
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
