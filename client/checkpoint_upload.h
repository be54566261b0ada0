#pragma once

#include <cstddef>
#include <string>

#include "absl/status/statusor.h"
#include "client/rollout_client.h"
#include "rollout/v1/rollout.pb.h"

// Uploading a local safetensors checkpoint through RolloutClient::UpdateWeights. Kept out of
// rollout_client (library rollout_client_checkpoint) because reading checkpoints needs the
// engine's safetensors reader, and the core client stays proto/gRPC-only.
namespace rollout {

// Opens the checkpoint directory `dir` (config.json plus model.safetensors, or an index with
// shards) here, memory-mapped, and streams the served model's tensors from it to the server in
// name order, as `version` with `policy`, in chunks of at most chunk_bytes, over `streams`
// concurrent streams (RolloutClient::UpdateWeightsFromTensors): every tensor of the model, as
// UpdateWeightsFromPath reads one, and no other (a tied model's lm_head.weight stays home).
// Before anything is sent: a checkpoint that cannot be opened fails with the reader's error;
// one whose config.json describes another model than GetServerInfo's (architecture, sizes,
// experts, tied embeddings), or that lacks one of the model's tensors, is FAILED_PRECONDITION
// naming the field or tensor. The server then checks dtypes and shapes and applies nothing
// unless every tensor arrived.
absl::StatusOr<rollout::v1::UpdateWeightsResponse> UpdateWeightsFromCheckpoint(
    RolloutClient& client, const std::string& dir, const std::string& version,
    rollout::v1::InFlightPolicy policy, size_t chunk_bytes = kDefaultWeightsChunkBytes,
    const UploadProgress& progress = nullptr, int streams = 1);

}  // namespace rollout
