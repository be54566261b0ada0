#include "client/checkpoint_upload.h"

#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "model/safetensors.h"

namespace rollout {

absl::StatusOr<rollout::v1::UpdateWeightsResponse> UpdateWeightsFromCheckpoint(
    RolloutClient& client, const std::string& dir, const std::string& version,
    rollout::v1::InFlightPolicy policy, size_t chunk_bytes, const UploadProgress& progress,
    int streams) {
  absl::StatusOr<std::unique_ptr<Checkpoint>> checkpoint = Checkpoint::Open(dir);
  if (!checkpoint.ok()) return checkpoint.status();
  std::vector<TensorSource> tensors;
  for (const std::string& name : (*checkpoint)->TensorNames()) {
    const TensorView* view = (*checkpoint)->Find(name);
    if (view == nullptr) {
      return absl::InternalError(
          absl::StrCat(dir, ": tensor '", name, "' is listed but not found"));
    }
    TensorSource& tensor = tensors.emplace_back();
    tensor.name = name;
    tensor.dtype = DTypeName(view->dtype);
    tensor.shape.assign(view->shape.begin(), view->shape.end());
    tensor.data = view->data;
    tensor.nbytes = view->nbytes;
  }
  // The views borrow the mapping, which lives until this returns.
  return client.UpdateWeightsFromTensors(version, policy, tensors, chunk_bytes, progress, streams);
}

}  // namespace rollout
