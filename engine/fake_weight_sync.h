#pragma once

// Test doubles of engine/weight_sync.h (header only; tests include it, nothing else does): a
// weight-sync group whose other ranks a test plays (FakeBroadcastGroup: the trainer's source rank
// and the other servers), a sink that stages and hashes in host memory exactly as the cuda
// backend's does on the device (per bucket, the leaves LeavesCompletedBy names), and a runner
// that wraps any ModelRunner with them (FakeBroadcastRunner). So the protocol -- handshake,
// buckets, timeouts, digests, the atomic swap -- is tested without NCCL or a GPU: engine tests
// drive the engine, tests/weights_broadcast_e2e_test.cc a real server over gRPC.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "engine/broadcast_plan.h"
#include "engine/engine_test_util.h"
#include "engine/model_runner.h"
#include "engine/weight_sync.h"
#include "model/weight_digest.h"

namespace rollout::testing {

// The other ranks of one group, as a test plays them. Thread-safe: the test arms broadcasts and
// releases held buckets while the server's weight-sync thread gathers and receives.
class FakeBroadcastGroup {
 public:
  // What the source does at the next handshake (Arm).
  struct Broadcast {
    BroadcastPlan plan;  // what the source declares (its handshake's digest) and sends
    std::string stream;  // the plan's stream: bucket j is stream[plan.buckets[j] range)
    // Buckets sent before the source stops (a trainer that dies half way): the next Receive
    // waits for its timeout. Unset: all.
    std::optional<size_t> stop_after;
    // Bucket at which the source waits until Release() (to show the engine steps meanwhile).
    std::optional<size_t> hold_at;
    // Rank of another server that refuses at the handshake.
    std::optional<int32_t> refusing_rank;
    int32_t source_rank = 0;  // the trainer's rank
  };

  // The stream of `plan` with `tensors`' bytes (by name, each plan.tensors[i].nbytes()) in place
  // and zero padding.
  static std::string Stream(const BroadcastPlan& plan, const std::vector<HostTensor>& tensors) {
    std::string stream(plan.total_bytes, '\0');
    for (size_t i = 0; i < plan.tensors.size(); ++i) {
      for (const HostTensor& t : tensors) {
        if (t.name == plan.tensors[i].name) {
          std::memcpy(stream.data() + plan.offsets[i], t.bytes.data(), t.bytes.size());
        }
      }
    }
    return stream;
  }

  void Arm(Broadcast broadcast) {
    std::lock_guard<std::mutex> lock(mu_);
    armed_ = std::move(broadcast);
    sent_ = 0;
    cv_.notify_all();
  }
  void Release() {
    std::lock_guard<std::mutex> lock(mu_);
    released_ = true;
    cv_.notify_all();
  }
  // What the group saw.
  int joins() const {
    std::lock_guard<std::mutex> lock(mu_);
    return joins_;
  }
  int handshakes() const {
    std::lock_guard<std::mutex> lock(mu_);
    return handshakes_;
  }
  size_t buckets_sent() const {
    std::lock_guard<std::mutex> lock(mu_);
    return sent_;
  }
  int members_alive() const {
    std::lock_guard<std::mutex> lock(mu_);
    return alive_;
  }
  // The server's last handshake record, decoded: ready?
  std::optional<bool> last_server_ready() const {
    std::lock_guard<std::mutex> lock(mu_);
    return last_ready_;
  }
  WeightSyncGroupSpec last_spec() const {
    std::lock_guard<std::mutex> lock(mu_);
    return spec_;
  }
  // Joins that time out (as when another rank never joins).
  void set_join_never_completes(bool v) {
    std::lock_guard<std::mutex> lock(mu_);
    join_never_completes_ = v;
  }

  class Member;
  absl::StatusOr<std::unique_ptr<WeightSyncMember>> Join(const WeightSyncGroupSpec& spec,
                                                         const GiveUp& give_up);

 private:
  // Waits until `ready()` (under mu_), `timeout` or `give_up`: OK, DEADLINE_EXCEEDED or
  // CANCELLED.
  template <typename Ready>
  absl::Status WaitFor(std::unique_lock<std::mutex>& lock, Ready ready,
                       std::chrono::milliseconds timeout, const GiveUp& give_up) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (!ready()) {
      if (give_up && give_up()) return absl::CancelledError("the wait was given up");
      if (std::chrono::steady_clock::now() >= deadline) {
        return absl::DeadlineExceededError(
            absl::StrFormat("no progress within %d ms", timeout.count()));
      }
      cv_.wait_for(lock, std::chrono::milliseconds(5));
    }
    return absl::OkStatus();
  }

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::optional<Broadcast> armed_;
  size_t sent_ = 0;
  bool released_ = false;
  bool join_never_completes_ = false;
  int joins_ = 0, handshakes_ = 0, alive_ = 0;
  std::optional<bool> last_ready_;
  WeightSyncGroupSpec spec_;
};

class FakeBroadcastGroup::Member final : public WeightSyncMember {
 public:
  Member(FakeBroadcastGroup* group, int32_t rank, int32_t world)
      : group_(group), rank_(rank), world_(world) {}
  ~Member() override {
    std::lock_guard<std::mutex> lock(group_->mu_);
    --group_->alive_;
  }
  int32_t rank() const override { return rank_; }
  int32_t world_size() const override { return world_; }
  bool broken() const override { return broken_; }

  absl::Status AllGather(const void* mine, size_t bytes, void* all,
                         std::chrono::milliseconds timeout, const GiveUp& give_up) override {
    std::unique_lock<std::mutex> lock(group_->mu_);
    ++group_->handshakes_;
    group_->last_ready_ = static_cast<const char*>(mine)[9] != 0;
    // The source's record exists once the test armed a broadcast (a trainer that called).
    absl::Status waited = group_->WaitFor(
        lock, [&] { return group_->armed_.has_value(); }, timeout, give_up);
    if (!waited.ok()) return Break(waited);
    const Broadcast& b = *group_->armed_;
    const int32_t source = b.source_rank;
    std::string gathered;
    for (int32_t r = 0; r < world_; ++r) {
      if (r == rank_) {
        gathered.append(static_cast<const char*>(mine), bytes);
      } else if (r == source) {
        gathered += EncodeHandshake(
            {HandshakeRole::kSource, true, source, b.plan.total_bytes, b.plan.digest});
      } else {
        gathered += EncodeHandshake({HandshakeRole::kReceiver, b.refusing_rank != r, source,
                                     b.plan.total_bytes, b.plan.digest});
      }
    }
    std::memcpy(all, gathered.data(), gathered.size());
    handshake_done_ = true;
    return absl::OkStatus();
  }

  absl::Status Receive(void* dst, size_t bytes, int32_t root, std::chrono::milliseconds timeout,
                       const GiveUp& give_up) override {
    std::unique_lock<std::mutex> lock(group_->mu_);
    if (!group_->armed_.has_value() || !handshake_done_) {
      return Break(absl::InternalError("fake group: a Receive before the handshake"));
    }
    const Broadcast& b = *group_->armed_;
    const size_t j = group_->sent_;
    if (root != b.source_rank) {
      return Break(
          absl::InternalError(absl::StrFormat("fake group: root %d is not the source", root)));
    }
    if (b.hold_at == j) {
      absl::Status held = group_->WaitFor(
          lock, [&] { return group_->released_; }, std::chrono::milliseconds(60'000), give_up);
      if (!held.ok()) return Break(held);
    }
    if (b.stop_after.has_value() && j >= *b.stop_after) {
      // The source is gone: nothing more arrives.
      return Break(group_->WaitFor(
          lock, [] { return false; }, timeout, give_up));
    }
    if (j >= b.plan.buckets.size() || b.plan.buckets[j].size != bytes) {
      // NCCL would hang or corrupt; the fake says so.
      return Break(absl::InternalError(
          absl::StrFormat("fake group: bucket %d of %d bytes received where the source sends %d", j,
                          bytes, j < b.plan.buckets.size() ? b.plan.buckets[j].size : 0)));
    }
    std::memcpy(dst, b.stream.data() + b.plan.buckets[j].stream_offset, bytes);
    ++group_->sent_;
    return absl::OkStatus();
  }

 private:
  absl::Status Break(absl::Status status) {
    broken_ = true;
    return status;
  }
  FakeBroadcastGroup* const group_;
  const int32_t rank_, world_;
  bool broken_ = false;
  bool handshake_done_ = false;
};

inline absl::StatusOr<std::unique_ptr<WeightSyncMember>> FakeBroadcastGroup::Join(
    const WeightSyncGroupSpec& spec, const GiveUp& give_up) {
  std::unique_lock<std::mutex> lock(mu_);
  ++joins_;
  spec_ = spec;
  if (join_never_completes_) {
    absl::Status waited = WaitFor(
        lock, [] { return false; }, spec.timeout, give_up);
    return absl::Status(waited.code(),
                        absl::StrCat("joining the weight-sync group: ", waited.message()));
  }
  ++alive_;
  return std::unique_ptr<WeightSyncMember>(
      std::make_unique<Member>(this, spec.rank, spec.world_size));
}

// Host staging of a whole stream, hashed bucket by bucket as the cuda backend hashes on the
// device: the leaves each bucket completes, then the tensors it completes.
class HostBroadcastSink final : public BroadcastSink {
 public:
  class Staged final : public StagedWeights {
   public:
    Staged(BroadcastPlan plan, TensorDigests digests, const uint8_t* bytes,
           std::shared_ptr<std::atomic<bool>> claim, const void* owner)
        : plan_(std::move(plan)),
          digests_(std::move(digests)),
          bytes_(bytes),
          claim_(std::move(claim)),
          owner_(owner) {}
    ~Staged() override { *claim_ = false; }
    const BroadcastPlan& plan() const override { return plan_; }
    const TensorDigests& digests() const override { return digests_; }
    const uint8_t* bytes() const { return bytes_; }
    const void* owner() const { return owner_; }

   private:
    const BroadcastPlan plan_;
    const TensorDigests digests_;
    const uint8_t* const bytes_;
    const std::shared_ptr<std::atomic<bool>> claim_;
    const void* const owner_;
  };

  HostBroadcastSink(size_t capacity, const void* owner) : staging_(capacity), owner_(owner) {}

  absl::Status Begin(const BroadcastPlan& plan) override {
    if (plan.total_bytes > staging_.size()) {
      return absl::FailedPreconditionError(
          absl::StrFormat("the broadcast's %d bytes exceed the %d bytes of staging",
                          plan.total_bytes, staging_.size()));
    }
    bool expected = false;
    if (!claim_->compare_exchange_strong(expected, true)) {
      return absl::AbortedError("the staging still holds an earlier broadcast");
    }
    plan_ = plan;
    leaves_.assign(plan.tensors.size(), {});
    digests_.clear();
    return absl::OkStatus();
  }
  void* BucketAddress(size_t bucket) override {
    return staging_.data() + plan_.buckets[bucket].stream_offset;
  }
  absl::Status BucketArrived(size_t bucket) override {
    ++buckets_hashed_;
    const BucketLeaves done = LeavesCompletedBy(plan_, bucket);
    for (const LeafRun& r : done.runs) {
      const uint64_t n = plan_.tensors[r.tensor].nbytes();
      for (uint64_t i = r.first_leaf; i < r.first_leaf + r.num_leaves; ++i) {
        const uint64_t begin = i * kDigestLeafBytes;
        leaves_[r.tensor] += Sha256(staging_.data() + plan_.offsets[r.tensor] + begin,
                                    std::min<uint64_t>(kDigestLeafBytes, n - begin));
      }
    }
    for (size_t t = done.first_completed; t < done.end_completed; ++t) {
      const std::string& l = leaves_[t];
      digests_[plan_.tensors[t].name] =
          Sha256(reinterpret_cast<const uint8_t*>(l.data()), l.size());
    }
    return absl::OkStatus();
  }
  absl::StatusOr<std::unique_ptr<StagedWeights>> Finish() override {
    return std::unique_ptr<StagedWeights>(
        std::make_unique<Staged>(plan_, digests_, staging_.data(), claim_, owner_));
  }
  void Abandon() override { *claim_ = false; }

  int buckets_hashed() const { return buckets_hashed_; }
  bool claimed() const { return *claim_; }

 private:
  std::vector<uint8_t> staging_;
  const void* const owner_;
  std::shared_ptr<std::atomic<bool>> claim_ = std::make_shared<std::atomic<bool>>(false);
  BroadcastPlan plan_;
  std::vector<std::string> leaves_;  // per tensor: its leaf digests so far
  TensorDigests digests_;
  int buckets_hashed_ = 0;
};

class FakeWeightSyncPort final : public WeightSyncPort {
 public:
  FakeWeightSyncPort(FakeBroadcastGroup* group, size_t capacity, const void* owner)
      : group_(group), sink_(capacity, owner) {}
  absl::StatusOr<std::unique_ptr<WeightSyncMember>> Join(const WeightSyncGroupSpec& spec,
                                                         const GiveUp& give_up) override {
    return group_->Join(spec, give_up);
  }
  BroadcastSink* sink() override { return &sink_; }
  int nccl_version() const override { return 22703; }
  HostBroadcastSink* host_sink() { return &sink_; }

 private:
  FakeBroadcastGroup* const group_;
  HostBroadcastSink sink_;
};

// Any runner, with a FakeWeightSyncPort over `group` whose staging holds every served tensor:
// staged weights are applied as a host update of the same bytes (UpdateWeights), which is what
// the cuda backend's device copy must be bitwise.
class FakeBroadcastRunner final : public WrappingRunner {
 public:
  FakeBroadcastRunner(std::unique_ptr<ModelRunner> inner, FakeBroadcastGroup* group)
      : WrappingRunner(std::move(inner)), group_(group) {}


  absl::StatusOr<std::unique_ptr<WeightSyncPort>> CreateWeightSyncPort() override {
    size_t capacity = 0;
    for (const WeightSpec& s : weight_specs()) {
      capacity +=
          (s.nbytes() + kBroadcastAlignment - 1) / kBroadcastAlignment * kBroadcastAlignment;
    }
    auto port = std::make_unique<FakeWeightSyncPort>(group_, capacity, this);
    port_ = port.get();
    return std::unique_ptr<WeightSyncPort>(std::move(port));
  }
  absl::Status UpdateWeightsFromStaging(const StagedWeights& staged) override {
    const auto* host = dynamic_cast<const HostBroadcastSink::Staged*>(&staged);
    if (host == nullptr || host->owner() != this) {
      return absl::InternalError("staged weights of another runner");
    }
    ++staging_updates_;
    std::vector<HostTensorView> tensors;
    const BroadcastPlan& plan = staged.plan();
    for (size_t i = 0; i < plan.tensors.size(); ++i) {
      const BroadcastTensor& t = plan.tensors[i];
      tensors.emplace_back(t.name, t.dtype, t.shape, host->bytes() + plan.offsets[i], t.nbytes());
    }
    return inner().UpdateWeights(tensors);
  }

  // The port it made (borrowed: the engine owns it), for a test to look at its sink.
  FakeWeightSyncPort* port() const { return port_; }
  int staging_updates() const { return staging_updates_; }

 private:
  FakeBroadcastGroup* const group_;
  FakeWeightSyncPort* port_ = nullptr;
  int staging_updates_ = 0;
};

}  // namespace rollout::testing
