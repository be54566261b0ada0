#include "server/ipc_update.h"

#include <chrono>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "engine/ipc_tensor.h"
#include "glog/logging.h"
#include "server/rollout_service.h"
#include "server/status_util.h"
#include "server/weights_staging.h"

namespace rollout {

absl::StatusOr<WeightUpdate> IpcUpdateFromProto(const std::vector<WeightSpec>& specs,
                                                const v1::UpdateWeightsFromIpcRequest& request) {
  if (absl::Status s = CheckWeightVersion(request.version()); !s.ok()) return s;
  if (absl::Status s = CheckPolicy(request.policy(), "policy"); !s.ok()) return s;
  WeightUpdate update;
  update.version = request.version();
  update.policy = FromProto(request.policy());
  for (int i = 0; i < request.tensors_size(); ++i) {
    const v1::IpcTensor& t = request.tensors(i);
    const std::string where = absl::StrFormat("tensors[%d] ('%s')", i, t.name());
    IpcTensorSource source;
    source.name = t.name();
    absl::StatusOr<DType> dtype = ParseDType(t.dtype());
    if (!dtype.ok()) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s: dtype '%s' is not BF16, F16 or F32", where, t.dtype()));
    }
    source.dtype = *dtype;
    source.shape.assign(t.shape().begin(), t.shape().end());
    source.ipc_handle = t.ipc_handle();
    source.offset_bytes = t.offset_bytes();
    absl::StatusOr<std::string> uuid = CanonicalGpuUuid(t.device_uuid());
    if (!uuid.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": device_uuid ", uuid.status().message()));
    }
    source.device_uuid = *std::move(uuid);
    update.ipc_tensors.push_back(std::move(source));
  }
  if (absl::Status s = CheckIpcTensors(specs, update.ipc_tensors); !s.ok()) return s;
  return update;
}

grpc::ServerUnaryReactor* RolloutServiceImpl::UpdateWeightsFromIpc(
    grpc::CallbackServerContext* context, const v1::UpdateWeightsFromIpcRequest* request,
    v1::UpdateWeightsResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  absl::Status admission = CheckAccess(context, /*control=*/true);
  if (admission.ok()) admission = ClaimUpdateSlot();
  if (!admission.ok()) {
    reactor->Finish(ToGrpcStatus(admission));
    return reactor;
  }
  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<WeightUpdate> update = IpcUpdateFromProto(engine_->weight_specs(), *request);
  if (!update.ok()) {
    if (metrics_ != nullptr) metrics_->RecordUpdate(0, false);
    ReleaseUpdateSlot();
    reactor->Finish(ToGrpcStatus(update.status()));
    return reactor;
  }
  uint64_t bytes = 0;
  for (const IpcTensorSource& t : update->ipc_tensors) bytes += t.nbytes();
  response->set_version(update->version);
  response->set_tensors_updated(static_cast<uint32_t>(update->ipc_tensors.size()));
  response->set_bytes_received(bytes);
  // The engine opens the handles and hashes the bytes on its thread (the runner's device); the
  // context and response live until reactor->Finish, which only the engine's answer calls.
  engine_->UpdateWeights(
      *std::move(update),
      [this, reactor, response, start](UpdateResult r) {
        const double total =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        // "Receiving" an IPC update is opening and hashing it; the rest is the policy's wait and
        // the device copy.
        response->set_receive_seconds(r.ipc_open_seconds);
        response->set_swap_seconds(total - r.ipc_open_seconds);
        response->set_previous_version(r.previous_version);
        response->set_weight_digest(r.digest);
        response->set_aborted_samples(static_cast<uint32_t>(r.aborted_samples));
        if (metrics_ != nullptr) metrics_->RecordUpdate(total, r.status.ok());
        if (!r.status.ok()) {
          LOG(WARNING) << "IPC weight update to '" << response->version()
                       << "' failed: " << r.status;
        }
        ReleaseUpdateSlot();
        reactor->Finish(ToGrpcStatus(r.status));
      },
      // A caller that gave up (deadline, cancel) before the swap gets nothing applied.
      [context] { return CallerGaveUp(context); });
  return reactor;
}

}  // namespace rollout
