#include "server/update_assembly.h"

#include <algorithm>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "glog/logging.h"
#include "server/rollout_service.h"
#include "server/status_util.h"
#include "server/weights_staging.h"

namespace rollout {
namespace {

constexpr uint32_t kMaxUpdateParts = 64;
constexpr size_t kMaxUpdateIdBytes = 128;

double SecondsSince(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

}  // namespace

absl::Status CheckPartFields(const v1::WeightsHeader& header) {
  if (header.part_count() > kMaxUpdateParts) {
    return absl::InvalidArgumentError(absl::StrFormat("header.part_count is %d; at most %d parts",
                                                      header.part_count(), kMaxUpdateParts));
  }
  if (header.part_count() <= 1) {
    if (header.part_index() != 0) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "header.part_index is %d but part_count is %d (a single-stream update); set "
          "part_count for a multi-part update",
          header.part_index(), header.part_count()));
    }
    return absl::OkStatus();
  }
  if (header.update_id().empty() || header.update_id().size() > kMaxUpdateIdBytes) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "header.update_id is %d bytes; a multi-part update needs one of 1 to %d bytes, the same "
        "in every part and new for each attempt",
        header.update_id().size(), kMaxUpdateIdBytes));
  }
  return absl::OkStatus();
}

UpdateAssembly::UpdateAssembly(RolloutServiceImpl* service, std::string update_id,
                               uint32_t part_count)
    : service_(service), update_id_(std::move(update_id)), part_count_(part_count) {}

UpdateAssembly::~UpdateAssembly() = default;

void UpdateAssembly::ArmPartTimeout(std::chrono::milliseconds timeout) {
  part_timeout_ = std::make_unique<grpc::Alarm>();
  std::weak_ptr<UpdateAssembly> weak = weak_from_this();
  // The alarm runs its callback once: when it fires (ok) or when it is destroyed with the
  // assembly (not ok).
  part_timeout_->Set(std::chrono::system_clock::now() + timeout, [weak, timeout](bool ok) {
    std::shared_ptr<UpdateAssembly> self = weak.lock();
    if (!ok || self == nullptr) return;
    uint32_t joined = self->parts_joined();
    if (joined == self->part_count_) return;
    self->Fail(nullptr,
               absl::DeadlineExceededError(absl::StrFormat(
                   "update '%s': only %d of its %d parts arrived within %g s of the first "
                   "(the server's --update_part_timeout_s); send every part at once, each on its "
                   "own stream",
                   self->update_id_, joined, self->part_count_,
                   std::chrono::duration<double>(timeout).count())));
  });
}

uint32_t UpdateAssembly::parts_joined() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<uint32_t>(parts_.size());
}

absl::StatusOr<const WeightsArena::Lease*> UpdateAssembly::Join(
    const v1::WeightsHeader& header, UpdatePart* part, std::chrono::steady_clock::time_point start,
    bool* joined) {
  *joined = false;
  absl::Status refused;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (state_ != State::kAssembling) {
      // A part that comes after its update failed hears why (with the failure's code).
      return absl::Status(
          failure_.ok() ? absl::StatusCode::kAborted : failure_.code(),
          absl::StrFormat("update '%s' ended before this part joined it: %s", update_id_,
                          failure_.ok() ? "it is being applied" : failure_.message()));
    }
    const uint32_t index = header.part_index();
    parts_.emplace_back(part, index);
    *joined = true;
    if (!has_first_) {
      has_first_ = true;
      version_ = header.version();
      policy_ = header.policy();
      start_ = start;
    }
    start_ = std::min(start_, start);
    const uint32_t count = std::max<uint32_t>(1, header.part_count());
    if (count != part_count_) {
      refused = absl::InvalidArgumentError(absl::StrFormat(
          "header.part_count is %d; the update's first part said %d", count, part_count_));
    } else if (index >= part_count_) {
      refused = absl::InvalidArgumentError(
          absl::StrFormat("header.part_index is %d, not below part_count %d", index, part_count_));
    } else if (!indices_.insert(index).second) {
      refused = absl::InvalidArgumentError(
          absl::StrFormat("header.part_index %d is sent a second time; each index once", index));
    } else if (header.version() != version_) {
      refused = absl::InvalidArgumentError(
          absl::StrFormat("header.version '%s' differs from the update's first part's ('%s')",
                          header.version(), version_));
    } else if (header.policy() != policy_) {
      refused = absl::InvalidArgumentError(absl::StrFormat(
          "header.policy %s differs from the update's first part's (%s)",
          v1::InFlightPolicy_Name(header.policy()), v1::InFlightPolicy_Name(policy_)));
    } else {
      for (const v1::TensorDecl& decl : header.tensors()) {
        if (!tensor_names_.insert(decl.name()).second) {
          refused = absl::InvalidArgumentError(absl::StrFormat(
              "tensor '%s' is declared by another part too; the parts' tensors must be disjoint",
              decl.name()));
          break;
        }
      }
    }
    if (refused.ok() && lease_ == nullptr && !lease_failed_) {
      // The first part takes the arena; the others wait for it here (only the first update
      // allocates, which can take seconds for a large model).
      double setup_seconds = 0;
      absl::StatusOr<std::shared_ptr<WeightsArena::Lease>> lease =
          service_->weights_arena()->Acquire(&setup_seconds);
      setup_seconds_ = setup_seconds;
      if (lease.ok()) {
        lease_ = *std::move(lease);
      } else {
        lease_failed_ = true;
        refused = lease.status();
      }
    }
    if (refused.ok()) return lease_.get();
  }
  Fail(part, refused);
  return refused;
}

void UpdateAssembly::PartReceived(WeightUpdate update, uint64_t bytes_received,
                                  double digest_wait_seconds) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (state_ != State::kAssembling) return;
    for (HostTensorView& t : update.tensors) update_.tensors.push_back(std::move(t));
    update_.digests.merge(update.digests);
    bytes_received_ += bytes_received;
    digest_wait_seconds_ = std::max(digest_wait_seconds_, digest_wait_seconds);
    if (++received_ < part_count_) return;
    state_ = State::kSubmitted;
  }
  Submit();
}

void UpdateAssembly::Submit() {
  v1::UpdateWeightsResponse response;
  WeightUpdate update;
  {
    std::lock_guard<std::mutex> lock(mu_);
    response.set_receive_seconds(SecondsSince(start_));
    response.set_staging_setup_seconds(setup_seconds_);
    response.set_digest_wait_seconds(digest_wait_seconds_);
    response.set_bytes_received(bytes_received_);
    response.set_tensors_updated(static_cast<uint32_t>(update_.tensors.size()));
    response.set_part_count(part_count_);
    response.set_version(version_);
    update = std::move(update_);
    update_ = WeightUpdate{};
    // In name order, as one stream stages them.
    std::sort(update.tensors.begin(), update.tensors.end(),
              [](const HostTensorView& a, const HostTensorView& b) { return a.name < b.name; });
    update.version = version_;
    update.policy = FromProto(policy_);
    // The engine holds the only reference: the arena is free again when it answers.
    update.bytes = std::move(lease_);
  }
  const auto swap_start = std::chrono::steady_clock::now();
  std::shared_ptr<UpdateAssembly> self = shared_from_this();
  service_->engine()->UpdateWeights(
      std::move(update),
      [self, response, swap_start](UpdateResult r) mutable {
        response.set_previous_version(r.previous_version);
        response.set_weight_digest(r.digest);
        response.set_aborted_samples(static_cast<uint32_t>(r.aborted_samples));
        response.set_swap_seconds(SecondsSince(swap_start));
        response.set_engine_wait_seconds(r.wait_seconds);
        response.set_device_copy_seconds(r.copy_seconds);
        std::vector<std::pair<UpdatePart*, uint32_t>> parts;
        {
          std::lock_guard<std::mutex> lock(self->mu_);
          self->state_ = State::kEnded;
          parts = self->parts_;
          if (self->service_->metrics() != nullptr) {
            self->service_->metrics()->RecordUpdate(SecondsSince(self->start_), r.status.ok());
          }
        }
        grpc::ByteBuffer bytes;
        if (r.status.ok()) {
          grpc::Slice slice(response.SerializeAsString());
          bytes = grpc::ByteBuffer(&slice, 1);
        }
        self->End(parts, ToGrpcStatus(r.status), r.status.ok() ? &bytes : nullptr,
                  /*abandon=*/false);
      },
      // A cancel of any part before the swap cancels the update.
      [self] { return self->AnyPartCancelled(); });
}

bool UpdateAssembly::AnyPartCancelled() const {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [part, index] : parts_) {
    if (part->Cancelled()) return true;
  }
  return false;
}

void UpdateAssembly::Fail(UpdatePart* part, const absl::Status& status) {
  std::vector<std::pair<UpdatePart*, uint32_t>> parts;
  std::string message(status.message());
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (state_ != State::kAssembling) return;
    state_ = State::kEnded;
    parts = parts_;
    if (part_count_ > 1) {
      for (const auto& [p, index] : parts_) {
        if (p == part) {
          message = absl::StrFormat("part %d of the %d of update '%s': %s", index, part_count_,
                                    update_id_, message);
          break;
        }
      }
    }
    if (!absl::StrContains(message, "nothing was applied")) {
      absl::StrAppend(&message, "; nothing was applied");
    }
    // Under the same lock as the state: a part joining now hears this failure, never an
    // ended update without a reason (which reads as "being applied").
    failure_ = absl::Status(status.code(), message);
    // Once per update, however many of its parts fail: the state leaves kAssembling once.
    if (service_->metrics() != nullptr) {
      service_->metrics()->RecordUpdate(has_first_ ? SecondsSince(start_) : 0, false);
    }
  }
  LOG(WARNING) << "weight update" << (part_count_ > 1 ? " '" + update_id_ + "'" : "")
               << " failed: " << absl::StatusCodeToString(status.code()) << ": " << message;
  End(parts, ToGrpcStatus(absl::Status(status.code(), message)), nullptr, /*abandon=*/true);
}

void UpdateAssembly::End(const std::vector<std::pair<UpdatePart*, uint32_t>>& parts,
                         const grpc::Status& status, const grpc::ByteBuffer* response,
                         bool abandon) {
  // The arena and the slot go back before any caller hears back, so that a retry is staged at
  // once: first nothing writes into the arena any more, then the lease goes, then the slot.
  if (abandon) {
    for (const auto& [part, index] : parts) part->AbandonStaging();
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    lease_.reset();
    update_ = WeightUpdate{};
  }
  service_->EndUpdate(this, static_cast<absl::StatusCode>(status.error_code()),
                      status.error_message());
  for (const auto& [part, index] : parts) part->FinishPart(status, response);
}

}  // namespace rollout
