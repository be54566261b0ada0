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
// shards) here, memory-mapped, and streams every tensor in it to the server in name order,
// as `version` with `policy`, in chunks of at most chunk_bytes, over `streams` concurrent
// streams (RolloutClient::UpdateWeightsFromTensors). A checkpoint that cannot be
// opened fails before anything is sent, with the reader's error; the server checks names,
// dtypes and shapes against the served model and applies nothing unless every tensor arrived.
absl::StatusOr<rollout::v1::UpdateWeightsResponse> UpdateWeightsFromCheckpoint(
    RolloutClient& client, const std::string& dir, const std::string& version,
    rollout::v1::InFlightPolicy policy, size_t chunk_bytes = kDefaultWeightsChunkBytes,
    const UploadProgress& progress = nullptr, int streams = 1);

}  // namespace rollout
