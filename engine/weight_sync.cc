#include "engine/weight_sync.h"

#include <set>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace rollout {

absl::Status CheckBroadcastTensors(const std::vector<WeightSpec>& specs,
                                   const std::vector<BroadcastTensor>& tensors,
                                   uint64_t bucket_bytes) {
  if (tensors.empty()) {
    return absl::InvalidArgumentError(
        "tensors is empty; declare the tensors the source broadcasts, in broadcast order");
  }
  std::set<std::string> seen;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const BroadcastTensor& t = tensors[i];
    if (absl::Status s = CheckTensorAgainstSpec(specs, t.name, t.dtype, t.shape); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrFormat("tensors[%d]: %s", i, s.message()));
    }
    if (!seen.insert(t.name).second) {
      return absl::InvalidArgumentError(
          absl::StrFormat("tensors[%d] ('%s') is given twice", i, t.name));
    }
  }
  if (bucket_bytes == 0 || bucket_bytes % kBroadcastAlignment != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "bucket_bytes = %d; it must be a positive multiple of %d (e.g. 268435456 for 256 MiB "
        "buckets)",
        bucket_bytes, kBroadcastAlignment));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<StagedWeights>> ReceiveBroadcast(
    const BroadcastPlan* plan, int32_t source_rank, const absl::Status& refusal,
    WeightSyncMember* member, BroadcastSink* sink, std::chrono::milliseconds timeout,
    const GiveUp& give_up) {
  absl::Status why_not = refusal;
  if (why_not.ok()) why_not = sink->Begin(*plan);
  const bool claimed = why_not.ok();
  // Every rank takes part in the handshake, also one that refuses: otherwise the others would
  // wait for it until their timeout, and the group would be lost.
  HandshakeRecord mine;
  mine.role = HandshakeRole::kReceiver;
  mine.ready = claimed;
  mine.source_rank = source_rank;
  if (plan != nullptr) {
    mine.total_bytes = plan->total_bytes;
    mine.plan_digest = plan->digest;
  }
  const std::string record = EncodeHandshake(mine);
  std::string gathered(kHandshakeBytes * static_cast<size_t>(member->world_size()), '\0');
  absl::Status status =
      member->AllGather(record.data(), record.size(), gathered.data(), timeout, give_up);
  if (!status.ok()) {
    if (claimed) sink->Abandon();
    return absl::Status(status.code(),
                        absl::StrCat("the handshake before the broadcast: ", status.message(),
                                     "; nothing was received or changed"));
  }
  if (!claimed) return why_not;
  if (absl::Status verdict = HandshakeVerdict(gathered, member->world_size(), member->rank());
      !verdict.ok()) {
    sink->Abandon();
    return verdict;
  }
  const size_t n = plan->buckets.size();
  for (size_t b = 0; b < n; ++b) {
    const BroadcastBucket& bucket = plan->buckets[b];
    status = member->Receive(sink->BucketAddress(b), bucket.size, source_rank, timeout, give_up);
    if (status.ok()) status = sink->BucketArrived(b);
    if (!status.ok()) {
      sink->Abandon();
      return absl::Status(
          status.code(),
          absl::StrFormat("bucket %d of %d (stream bytes [%d, %d) of %d): %s; the %d bucket(s) "
                          "received before are dropped, nothing was changed",
                          b, n, bucket.stream_offset, bucket.stream_offset + bucket.size,
                          plan->total_bytes, status.message(), b));
    }
  }
  return sink->Finish();
}

}  // namespace rollout
