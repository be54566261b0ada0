#pragma once

// Fleets: weights broadcast by a trainer to many servers at once through an NCCL group
// (JoinWeightSyncGroup, UpdateWeightsFromBroadcast; docs/api.md, "Weights by NCCL broadcast").
// The engine sees the group through the small interfaces below, which a runner that holds its
// weights on a device implements (runner/cuda: NCCL loaded at run time, device staging); the
// engine's tests implement them with host memory (engine/fake_weight_sync.h), so the protocol --
// handshake, buckets, digests, atomic swap -- is tested without NCCL or a GPU.
//
// Atomicity: a broadcast lands in staging of the whole stream, never in the served weights; the
// engine swaps it in between two steps only after every bucket arrived and every digest is known
// and accepted. A broadcast that stops half way, a refused handshake, a timeout or a refused
// digest drops the staged bytes: the served weights, version and digest stay as they were.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/broadcast_plan.h"
#include "model/weight_digest.h"
#include "model/weight_spec.h"

namespace rollout {

// sizeof(ncclUniqueId).
inline constexpr size_t kNcclUniqueIdBytes = 128;

// How a server joins a weight-sync group: the trainer's ncclGetUniqueId bytes, this server's
// rank and the group's size (the trainer's rank and every server's).
struct WeightSyncGroupSpec {
  std::string unique_id;  // kNcclUniqueIdBytes
  int32_t rank = 0;
  int32_t world_size = 0;
  std::chrono::milliseconds timeout{60'000};  // for the join: every rank must arrive by then
};

// Answers whether the caller gave up (its call cancelled, the server stopping). Thread-safe and
// non-blocking; may be empty (never).
using GiveUp = std::function<bool()>;

// One member of a weight-sync group: this server's rank of an NCCL communicator (the cuda
// backend's), or a fake. Made by WeightSyncPort::Join; used by one thread at a time (the
// engine's weight-sync thread); destroying it leaves the group.
//
// Every wait ends after `timeout` without completion, or as soon as `give_up` answers true:
// DEADLINE_EXCEEDED or CANCELLED, and then (as after any communication error) the member is
// broken(): its communicator was aborted, and the group must be joined again.
class WeightSyncMember {
 public:
  virtual ~WeightSyncMember() = default;
  virtual int32_t rank() const = 0;
  virtual int32_t world_size() const = 0;
  // all[r * bytes, (r + 1) * bytes) = rank r's `mine`, for every rank (host memory; all holds
  // world_size() * bytes).
  virtual absl::Status AllGather(const void* mine, size_t bytes, void* all,
                                 std::chrono::milliseconds timeout, const GiveUp& give_up) = 0;
  // Receives the `bytes` that rank `root` broadcasts into `dst` (the sink's memory: device
  // memory on the cuda backend); returns once they are all there.
  virtual absl::Status Receive(void* dst, size_t bytes, int32_t root,
                               std::chrono::milliseconds timeout, const GiveUp& give_up) = 0;
  virtual bool broken() const = 0;
};

// Tensors a sink staged (every byte of a plan, hashed), waiting for the swap: the runner that
// owns the sink copies them into its weights (ModelRunner::UpdateWeightsFromStaging). Holds the
// staging until destroyed; owned by the update that carries it (engine thread).
class StagedWeights {
 public:
  virtual ~StagedWeights() = default;
  virtual const BroadcastPlan& plan() const = 0;
  // The tensor digest (model/weight_digest.h) of each staged tensor, by name.
  virtual const TensorDigests& digests() const = 0;
};

// Where a broadcast's buckets land: staging for a whole plan's stream (one at a time), hashed as
// the buckets arrive. Used by the weight-sync thread only.
class BroadcastSink {
 public:
  virtual ~BroadcastSink() = default;
  // Claims the staging for `plan`: FAILED_PRECONDITION when the stream is larger than the
  // staging, ABORTED while an earlier update's StagedWeights still hold it.
  virtual absl::Status Begin(const BroadcastPlan& plan) = 0;
  // Where bucket `bucket` of the claimed plan goes (a Receive destination).
  virtual void* BucketAddress(size_t bucket) = 0;
  // Bucket `bucket` arrived: its completed leaves and tensors are hashed (asynchronously where
  // the sink can, while the next bucket arrives).
  virtual absl::Status BucketArrived(size_t bucket) = 0;
  // After the last bucket: waits for the hashing and returns the staged weights (the claim
  // passes to them).
  virtual absl::StatusOr<std::unique_ptr<StagedWeights>> Finish() = 0;
  // Gives the claim up after a failure; nothing received is ever read.
  virtual void Abandon() = 0;
};

// What a runner that can receive broadcasts offers (ModelRunner::CreateWeightSyncPort): members
// of groups on its device, and its staging. Made once, before the engine thread starts; then used
// by the weight-sync thread only. Borrows the runner's memory: destroyed before the runner.
class WeightSyncPort {
 public:
  virtual ~WeightSyncPort() = default;
  // Joins the group of `spec` (a collective: returns once every rank joined, or after
  // spec.timeout with DEADLINE_EXCEEDED, or CANCELLED once `give_up`).
  virtual absl::StatusOr<std::unique_ptr<WeightSyncMember>> Join(const WeightSyncGroupSpec& spec,
                                                                 const GiveUp& give_up) = 0;
  virtual BroadcastSink* sink() = 0;
  // The NCCL version (e.g. 22703), 0 when unknown.
  virtual int nccl_version() const { return 0; }
};

// Checks a broadcast's tensors and bucket size before anything is received: at least one tensor;
// each a weight of `specs` with its dtype and shape, no name twice; bucket_bytes a positive
// multiple of kBroadcastAlignment. INVALID_ARGUMENT naming the field ("tensors[i] ('name'): ...",
// "bucket_bytes ...") otherwise.
absl::Status CheckBroadcastTensors(const std::vector<WeightSpec>& specs,
                                   const std::vector<BroadcastTensor>& tensors,
                                   uint64_t bucket_bytes);

// One broadcast as the receiving server runs it, on the weight-sync thread: the handshake (this
// rank's record: ready unless `refusal` is an error or the sink cannot take the plan), then, only
// if every rank agreed, each bucket received into the sink and hashed, then the staged weights.
// A refused update returns the refusal (or the verdict: who refused, which plans differ) with
// nothing received and the group intact; a failed Receive or AllGather returns its error (the
// member is then broken), naming the bucket. The sink's claim is given up on every failure.
// REQUIRES: plan is non-null when refusal.ok().
absl::StatusOr<std::unique_ptr<StagedWeights>> ReceiveBroadcast(
    const BroadcastPlan* plan, int32_t source_rank, const absl::Status& refusal,
    WeightSyncMember* member, BroadcastSink* sink, std::chrono::milliseconds timeout,
    const GiveUp& give_up);

}  // namespace rollout
