#include "server/broadcast_update.h"

#include <chrono>
#include <cmath>
#include <string>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_format.h"
#include "glog/logging.h"
#include "server/rollout_service.h"
#include "server/status_util.h"
#include "server/weights_staging.h"

namespace rollout {
namespace {

absl::StatusOr<std::chrono::milliseconds> Timeout(double seconds, const char* field) {
  if (!std::isfinite(seconds) || seconds < 0 || seconds > kMaxWeightSyncTimeoutSeconds) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s = %g; it must be in [0, %g] seconds (0: %g)", field, seconds,
                        kMaxWeightSyncTimeoutSeconds, kDefaultWeightSyncTimeoutSeconds));
  }
  if (seconds == 0) seconds = kDefaultWeightSyncTimeoutSeconds;
  return std::chrono::milliseconds(static_cast<int64_t>(std::ceil(seconds * 1000)));
}

absl::Status CheckDigestSpelling(const std::string& digest) {
  if (digest.empty()) return absl::OkStatus();
  bool ok = absl::StartsWith(digest, "sha256:") && digest.size() == 7 + 64;
  for (size_t i = 7; ok && i < digest.size(); ++i) {
    ok = absl::ascii_isxdigit(static_cast<unsigned char>(digest[i])) &&
         !absl::ascii_isupper(static_cast<unsigned char>(digest[i]));
  }
  if (ok) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrFormat(
      "expected_weight_digest '%s' is not a weights digest: \"sha256:\" and 64 lowercase hex "
      "digits, as ServerInfo.weight_digest reports it (or empty for no check)",
      absl::CHexEscape(digest.substr(0, 100))));
}

}  // namespace

absl::StatusOr<WeightSyncGroupSpec> JoinSpecFromProto(
    const v1::JoinWeightSyncGroupRequest& request) {
  if (request.unique_id().size() != kNcclUniqueIdBytes) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "unique_id has %d bytes; an ncclUniqueId has %d: send the trainer's ncclGetUniqueId() "
        "bytes unchanged (the same to every server of the group)",
        request.unique_id().size(), kNcclUniqueIdBytes));
  }
  if (request.world_size() < 2 || request.world_size() > (1u << 16)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "world_size = %d; a weight-sync group holds the trainer's rank and at least one "
        "server's (2 to 65536 ranks)",
        request.world_size()));
  }
  if (request.rank() >= request.world_size()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("rank = %d is not a rank of a group of world_size %d (0 to %d)",
                        request.rank(), request.world_size(), request.world_size() - 1));
  }
  absl::StatusOr<std::chrono::milliseconds> timeout =
      Timeout(request.timeout_seconds(), "timeout_seconds");
  if (!timeout.ok()) return timeout.status();
  WeightSyncGroupSpec spec;
  spec.unique_id = request.unique_id();
  spec.rank = static_cast<int32_t>(request.rank());
  spec.world_size = static_cast<int32_t>(request.world_size());
  spec.timeout = *timeout;
  return spec;
}

absl::StatusOr<BroadcastUpdate> BroadcastUpdateFromProto(
    const std::vector<WeightSpec>& specs, const v1::UpdateWeightsFromBroadcastRequest& request) {
  if (absl::Status s = CheckWeightVersion(request.version()); !s.ok()) return s;
  if (absl::Status s = CheckPolicy(request.policy(), "policy"); !s.ok()) return s;
  BroadcastUpdate update;
  update.version = request.version();
  update.policy = FromProto(request.policy());
  for (int i = 0; i < request.tensors_size(); ++i) {
    const v1::BroadcastTensor& t = request.tensors(i);
    absl::StatusOr<DType> dtype = ParseDType(t.dtype());
    if (!dtype.ok()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "tensors[%d] ('%s'): dtype '%s' is not BF16, F16 or F32", i, t.name(), t.dtype()));
    }
    BroadcastTensor tensor{t.name(), *dtype, {}};
    tensor.shape.assign(t.shape().begin(), t.shape().end());
    update.tensors.push_back(std::move(tensor));
  }
  if (absl::Status s = CheckBroadcastTensors(specs, update.tensors, request.bucket_bytes());
      !s.ok()) {
    return s;
  }
  update.bucket_bytes = request.bucket_bytes();
  if (request.source_rank() > (1u << 16)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("source_rank = %d is beyond any group", request.source_rank()));
  }
  update.source_rank = static_cast<int32_t>(request.source_rank());
  absl::StatusOr<std::chrono::milliseconds> timeout =
      Timeout(request.timeout_seconds(), "timeout_seconds");
  if (!timeout.ok()) return timeout.status();
  update.timeout = *timeout;
  if (absl::Status s = CheckDigestSpelling(request.expected_weight_digest()); !s.ok()) return s;
  update.expected_digest = request.expected_weight_digest();
  return update;
}

grpc::ServerUnaryReactor* RolloutServiceImpl::JoinWeightSyncGroup(
    grpc::CallbackServerContext* context, const v1::JoinWeightSyncGroupRequest* request,
    v1::JoinWeightSyncGroupResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  absl::StatusOr<WeightSyncGroupSpec> spec = JoinSpecFromProto(*request);
  absl::Status access = CheckAccess(context, /*control=*/true);
  if (!access.ok() || !spec.ok()) {
    reactor->Finish(ToGrpcStatus(access.ok() ? spec.status() : access));
    return reactor;
  }
  // A collective: the weight-sync thread waits for every rank (or the timeout, or a cancel);
  // the context and response live until Finish.
  engine_->JoinWeightSyncGroup(
      *std::move(spec),
      [reactor, response](JoinResult r) {
        response->set_rank(static_cast<uint32_t>(r.group.rank));
        response->set_world_size(static_cast<uint32_t>(r.group.world_size));
        response->set_seconds(r.seconds);
        response->set_nccl_version(static_cast<uint32_t>(r.nccl_version));
        reactor->Finish(ToGrpcStatus(r.status));
      },
      [context] { return CallerGaveUp(context); });
  return reactor;
}

grpc::ServerUnaryReactor* RolloutServiceImpl::LeaveWeightSyncGroup(
    grpc::CallbackServerContext* context, const v1::LeaveWeightSyncGroupRequest* request,
    v1::LeaveWeightSyncGroupResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (absl::Status access = CheckAccess(context, /*control=*/true); !access.ok()) {
    reactor->Finish(ToGrpcStatus(access));
    return reactor;
  }
  engine_->LeaveWeightSyncGroup([reactor, response](std::optional<WeightSyncGroupInfo> left) {
    response->set_was_member(left.has_value());
    if (left.has_value()) {
      response->set_rank(static_cast<uint32_t>(left->rank));
      response->set_world_size(static_cast<uint32_t>(left->world_size));
    }
    reactor->Finish(grpc::Status::OK);
  });
  return reactor;
}

grpc::ServerUnaryReactor* RolloutServiceImpl::UpdateWeightsFromBroadcast(
    grpc::CallbackServerContext* context, const v1::UpdateWeightsFromBroadcastRequest* request,
    v1::UpdateWeightsResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  // A caller without the token takes no part in the group: a stray handshake would pair with
  // the trainer's next one.
  if (absl::Status access = CheckAccess(context, /*control=*/true); !access.ok()) {
    reactor->Finish(ToGrpcStatus(access));
    return reactor;
  }
  const auto start = std::chrono::steady_clock::now();
  // A refused request (the slot taken, a bad field) still goes to the weight-sync thread, which
  // joins the group's handshake to say so: the trainer and the other servers then stop at once
  // instead of waiting for this server until their timeout.
  absl::Status slot = ClaimUpdateSlot();
  absl::StatusOr<BroadcastUpdate> update =
      slot.ok() ? BroadcastUpdateFromProto(engine_->weight_specs(), *request)
                : absl::StatusOr<BroadcastUpdate>(slot);
  uint64_t bytes = 0;
  if (update.ok()) {
    for (const BroadcastTensor& t : update->tensors) bytes += t.nbytes();
    response->set_version(update->version);
    response->set_tensors_updated(static_cast<uint32_t>(update->tensors.size()));
  }
  response->set_bytes_received(bytes);
  engine_->UpdateWeightsFromBroadcast(
      std::move(update),
      [this, reactor, response, start, holds_slot = slot.ok()](UpdateResult r) {
        const double total =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        response->set_receive_seconds(r.receive_seconds);
        response->set_swap_seconds(total - r.receive_seconds);
        response->set_previous_version(r.previous_version);
        response->set_weight_digest(r.digest);
        response->set_aborted_samples(static_cast<uint32_t>(r.aborted_samples));
        if (metrics_ != nullptr) metrics_->RecordUpdate(total, r.status.ok());
        if (!r.status.ok()) {
          LOG(WARNING) << "broadcast weight update to '" << response->version()
                       << "' failed: " << r.status;
        }
        if (holds_slot) ReleaseUpdateSlot();
        reactor->Finish(ToGrpcStatus(r.status));
      },
      // A caller that gives up stops the receive (the group is left) or, once received, gets
      // nothing applied.
      [context] { return CallerGaveUp(context); });
  return reactor;
}

}  // namespace rollout
