#pragma once

// Fleets: JoinWeightSyncGroup, LeaveWeightSyncGroup and UpdateWeightsFromBroadcast (docs/api.md,
// "Weights by NCCL broadcast"). The requests are checked here against the served model; the
// engine's weight-sync thread joins, receives and hands the update to the engine thread
// (engine/weight_sync.h). The handlers are RolloutServiceImpl's, defined in broadcast_update.cc.

#include <vector>

#include "absl/status/statusor.h"
#include "engine/engine.h"
#include "engine/weight_sync.h"
#include "model/weight_spec.h"
#include "rollout/v1/rollout.pb.h"

namespace rollout {

// The longest wait a request may ask for, and what 0 means.
inline constexpr double kMaxWeightSyncTimeoutSeconds = 3600;
inline constexpr double kDefaultWeightSyncTimeoutSeconds = 60;

// The join as the engine takes it: unique_id of 128 bytes, world_size >= 2, rank < world_size,
// timeout_seconds finite in [0, 3600] (0: 60). INVALID_ARGUMENT naming the field otherwise.
absl::StatusOr<WeightSyncGroupSpec> JoinSpecFromProto(
    const v1::JoinWeightSyncGroupRequest& request);

// The broadcast as the engine takes it: version, tensors (CheckBroadcastTensors: served names,
// dtypes and shapes, no name twice), bucket_bytes, timeout_seconds as for a join, and an
// expected_weight_digest that is empty or "sha256:" and 64 hex digits. INVALID_ARGUMENT naming
// the field otherwise. (source_rank is checked against the group by the engine.)
absl::StatusOr<BroadcastUpdate> BroadcastUpdateFromProto(
    const std::vector<WeightSpec>& specs, const v1::UpdateWeightsFromBroadcastRequest& request);

}  // namespace rollout
