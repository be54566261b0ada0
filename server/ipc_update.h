#pragma once

// UpdateWeightsFromIpc: a colocated trainer's device tensors, by CUDA IPC handle. The request is
// checked here against the served model (RolloutServiceImpl::UpdateWeightsFromIpc, defined in
// ipc_update.cc, then hands it to the engine); the runner opens the handles.

#include <vector>

#include "absl/status/statusor.h"
#include "engine/engine.h"
#include "model/weight_spec.h"
#include "rollout/v1/rollout.pb.h"

namespace rollout {

// The request as an engine update whose ipc_tensors passed CheckIpcTensors: version, dtypes,
// shapes, names, handle sizes and device UUIDs (any spelling CanonicalGpuUuid accepts).
// INVALID_ARGUMENT naming the field or tensor otherwise.
absl::StatusOr<WeightUpdate> IpcUpdateFromProto(const std::vector<WeightSpec>& specs,
                                                const v1::UpdateWeightsFromIpcRequest& request);

}  // namespace rollout
