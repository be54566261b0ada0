#include "engine/weight_sync_agent.h"

#include <chrono>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "glog/logging.h"

namespace rollout {
namespace engine_internal {
namespace {

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// The handshake's wait for a refused update, whose own timeout is unknown.
constexpr std::chrono::milliseconds kDefaultTimeout{60'000};

}  // namespace

WeightSyncAgent::WeightSyncAgent(absl::StatusOr<std::unique_ptr<WeightSyncPort>> port,
                                 EngineCore* core)
    : port_status_(port.status()),
      port_(port.ok() ? *std::move(port) : nullptr),
      core_(core),
      thread_(std::make_unique<SerialExecutor>()) {}

WeightSyncAgent::~WeightSyncAgent() {
  stopping_ = true;
  thread_.reset();  // what runs gives up; what is queued runs and gives up at once
  member_.reset();  // leaves the group
}

std::optional<WeightSyncGroupInfo> WeightSyncAgent::group() const {
  std::lock_guard<std::mutex> lock(mu_);
  return published_;
}

void WeightSyncAgent::Join(WeightSyncGroupSpec spec, std::function<void(JoinResult)> done,
                           GiveUp give_up) {
  JoinResult refused;
  if (!port_status_.ok()) {
    refused.status = port_status_;
    done(std::move(refused));
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (joining_) {
      refused.status = absl::FailedPreconditionError(
          "another JoinWeightSyncGroup call is in progress on this server; one group at a time");
    } else if (published_.has_value()) {
      refused.status = absl::FailedPreconditionError(
          absl::StrFormat("this server is already rank %d of a weight-sync group of %d; call "
                          "LeaveWeightSyncGroup first to join another",
                          published_->rank, published_->world_size));
    } else {
      joining_ = true;
    }
  }
  if (!refused.status.ok()) {
    done(std::move(refused));
    return;
  }
  thread_->Post(
      [this, spec = std::move(spec), done = std::move(done), give_up = std::move(give_up)] {
        const auto start = std::chrono::steady_clock::now();
        absl::StatusOr<std::unique_ptr<WeightSyncMember>> member =
            port_->Join(spec, [&] { return stopping_.load() || (give_up && give_up()); });
        JoinResult result;
        result.seconds = SecondsSince(start);
        result.nccl_version = port_->nccl_version();
        {
          std::lock_guard<std::mutex> lock(mu_);
          joining_ = false;
          if (member.ok()) {
            member_ = *std::move(member);
            published_ = WeightSyncGroupInfo{member_->rank(), member_->world_size()};
            result.group = *published_;
          }
        }
        if (member.ok()) {
          LOG(INFO) << absl::StrFormat("joined a weight-sync group as rank %d of %d (%.2f s)",
                                       spec.rank, spec.world_size, result.seconds);
        } else {
          result.status = member.status();
          LOG(WARNING) << "joining a weight-sync group failed: " << result.status;
        }
        done(std::move(result));
      });
}

void WeightSyncAgent::Leave(std::function<void(std::optional<WeightSyncGroupInfo>)> done) {
  thread_->Post([this, done = std::move(done)] {
    std::optional<WeightSyncGroupInfo> left;
    {
      std::lock_guard<std::mutex> lock(mu_);
      left = published_;
      published_.reset();
    }
    member_.reset();
    if (left.has_value()) {
      LOG(INFO) << "left the weight-sync group (rank " << left->rank << " of " << left->world_size
                << ")";
    }
    done(left);
  });
}

void WeightSyncAgent::DropIfBroken() {
  if (member_ == nullptr || !member_->broken()) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    published_.reset();
  }
  member_.reset();
  LOG(WARNING) << "left the weight-sync group: its communicator was aborted";
}

void WeightSyncAgent::Broadcast(absl::StatusOr<BroadcastUpdate> update,
                                std::function<void(UpdateResult)> done,
                                std::function<bool()> cancelled) {
  thread_->Post([this, update = std::move(update), done = std::move(done),
                 cancelled = std::move(cancelled)]() mutable {
    Receive(update, std::move(done), std::move(cancelled));
  });
}

void WeightSyncAgent::Receive(const absl::StatusOr<BroadcastUpdate>& update,
                              std::function<void(UpdateResult)> done,
                              std::function<bool()> cancelled) {
  UpdateResult failed;
  failed.previous_version = core_->weight_version();
  if (member_ == nullptr) {
    // No group: nobody waits for this server's handshake.
    failed.status = !update.ok()         ? update.status()
                    : !port_status_.ok() ? port_status_
                                         : absl::FailedPreconditionError(
                                               "this server is not a member of a weight-sync "
                                               "group: call JoinWeightSyncGroup first (a group "
                                               "is left after a failed broadcast)");
    done(std::move(failed));
    return;
  }
  const int32_t rank = member_->rank(), world = member_->world_size();
  absl::Status refusal = update.status();
  std::optional<BroadcastPlan> plan;
  if (refusal.ok()) {
    if (update->source_rank >= world) {
      refusal = absl::InvalidArgumentError(absl::StrFormat(
          "source_rank %d is not a rank of the weight-sync group (ranks 0 to %d); it must be the "
          "trainer's rank",
          update->source_rank, world - 1));
    } else if (update->source_rank == rank) {
      refusal = absl::InvalidArgumentError(absl::StrFormat(
          "source_rank %d is this server's own rank in the weight-sync group; it must be the "
          "trainer's rank",
          rank));
    } else {
      plan = PlanBroadcast(update->tensors, update->bucket_bytes);
    }
  }
  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<std::unique_ptr<StagedWeights>> staged = ReceiveBroadcast(
      plan.has_value() ? &*plan : nullptr, update.ok() ? update->source_rank : 0, refusal,
      member_.get(), port_->sink(), update.ok() ? update->timeout : kDefaultTimeout,
      [&] { return stopping_.load() || (cancelled && cancelled()); });
  failed.receive_seconds = SecondsSince(start);
  const bool broken = member_->broken();
  DropIfBroken();
  if (!staged.ok()) {
    failed.status = broken ? absl::Status(staged.status().code(),
                                          absl::StrCat(staged.status().message(),
                                                       "; this server left the weight-sync group "
                                                       "(join it again)"))
                           : staged.status();
    done(std::move(failed));
    return;
  }
  PendingUpdate pending;
  pending.update.version = update->version;
  pending.update.policy = update->policy;
  pending.update.expected_digest = update->expected_digest;
  pending.staged = *std::move(staged);
  pending.receive_seconds = failed.receive_seconds;
  pending.received_bytes = plan->total_bytes;
  pending.done = std::move(done);
  pending.cancelled = std::move(cancelled);
  core_->UpdateWeights(std::move(pending));
}

}  // namespace engine_internal
}  // namespace rollout
