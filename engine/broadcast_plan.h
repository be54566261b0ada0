#pragma once

// The layout of an NCCL weight broadcast (UpdateWeightsFromBroadcast; docs/api.md, "Weights by
// NCCL broadcast"): which bytes of which tensor travel in which bucket, at which offset. One pure
// function, computed by the server (here) and by the trainer (client/python/rollout_client/
// broadcast.py) from the same request; both are tested against one golden vector
// (tests/testdata/broadcast_plan_golden.json), so the two sides cannot drift apart.
//
// The tensors are laid end to end, in broadcast order, into one byte stream, each starting at a
// multiple of kBroadcastAlignment (the gap bytes are padding: sent, never read). The stream is
// cut into buckets of bucket_bytes, the last one shorter: bucket j is stream bytes
// [j * bucket_bytes, min((j + 1) * bucket_bytes, total_bytes)). A tensor may span buckets and a
// bucket may hold pieces of several tensors; a receiver that stages the whole stream contiguously
// receives every bucket straight into its place, and every tensor lies contiguous and aligned
// there (what the device digest and the swap read).
//
// Also here, pure as well: the plan's digest (SHA-256 of its canonical text, so that two ranks can
// tell whether they agree), the 64-byte handshake record every rank contributes before the
// buckets, the verdict every rank draws from the gathered records, and the digest leaves each
// bucket completes (so that a receiver hashes a bucket's leaves while the next one arrives).

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "model/safetensors.h"

namespace rollout {

// Every tensor starts at a multiple of this in the stream (and so in a staging of it).
inline constexpr uint64_t kBroadcastAlignment = 256;

// One tensor of a broadcast, as the request declares it.
struct BroadcastTensor {
  std::string name;
  DType dtype = DType::kBF16;
  std::vector<int64_t> shape;
  uint64_t nbytes() const;
};

// Bytes [tensor_offset, tensor_offset + size) of tensors[tensor], at bucket_offset in its bucket.
struct BroadcastSlice {
  size_t tensor = 0;
  uint64_t tensor_offset = 0;
  uint64_t bucket_offset = 0;
  uint64_t size = 0;
};

// Stream bytes [stream_offset, stream_offset + size), with the tensor slices in them in stream
// order (padding between them is in no slice).
struct BroadcastBucket {
  uint64_t stream_offset = 0;
  uint64_t size = 0;
  std::vector<BroadcastSlice> slices;
};

struct BroadcastPlan {
  std::vector<BroadcastTensor> tensors;  // in broadcast order
  uint64_t bucket_bytes = 0;
  std::vector<uint64_t> offsets;  // [tensors.size()]: where each tensor starts in the stream
  uint64_t total_bytes = 0;       // the stream: up to the last tensor's last byte
  uint64_t payload_bytes = 0;     // the tensors' bytes, without padding
  std::vector<BroadcastBucket> buckets;
  std::string digest;  // 32 raw bytes: SHA-256 of BroadcastPlanText(tensors, bucket_bytes)
};

// The plan of `tensors` in buckets of `bucket_bytes`. REQUIRES: bucket_bytes > 0.
BroadcastPlan PlanBroadcast(std::vector<BroadcastTensor> tensors, uint64_t bucket_bytes);

// What the plan's digest hashes: "rollout.broadcast.v1\n", "bucket_bytes N\n", "alignment 256\n",
// then "tensor NAME DTYPE D0,D1,...\n" per tensor in broadcast order (DTYPE as safetensors
// spells it).
std::string BroadcastPlanText(const std::vector<BroadcastTensor>& tensors, uint64_t bucket_bytes);

// The digest leaves (64 KiB runs of a tensor, model/weight_digest.h) whose last byte arrives in
// a bucket: leaves [first_leaf, first_leaf + num_leaves) of tensors[tensor]. Every leaf of every
// tensor is in exactly one bucket's runs.
struct LeafRun {
  size_t tensor = 0;
  uint64_t first_leaf = 0;
  uint64_t num_leaves = 0;
};
struct BucketLeaves {
  std::vector<LeafRun> runs;
  // Tensors [first_completed, end_completed) have their last byte in this bucket (tensors
  // complete in broadcast order): once its runs are hashed, their digests can be combined. The
  // last bucket also completes empty tensors that no earlier bucket did.
  size_t first_completed = 0;
  size_t end_completed = 0;
};
BucketLeaves LeavesCompletedBy(const BroadcastPlan& plan, size_t bucket);

// The handshake: before any bucket, every rank of the group contributes one record (all-gather),
// so that all of them learn whether the update goes ahead, from the same bytes: a rank that
// refuses (a bad request, no staging) or disagrees (another plan, another source) stops it for
// all without a bucket sent and without breaking the group.
inline constexpr size_t kHandshakeBytes = 64;
enum class HandshakeRole : uint8_t { kSource = 1, kReceiver = 2 };
struct HandshakeRecord {
  HandshakeRole role = HandshakeRole::kReceiver;
  bool ready = false;        // a receiver: it accepted the request and holds room for it
  int32_t source_rank = 0;   // the rank it expects to broadcast
  uint64_t total_bytes = 0;  // the plan's stream (for messages)
  std::string plan_digest;   // 32 raw bytes (zeros when the request had no plan)
};
// 64 bytes: "RLBCAST1", role, ready, two zero bytes, source_rank (int32 little endian),
// total_bytes (uint64 LE), eight zero bytes, plan_digest.
std::string EncodeHandshake(const HandshakeRecord& record);

// The verdict on `gathered` (world_size records, rank order), the same go / no-go on every rank:
// OK when exactly one record is a source, at index s, and every other one is a ready receiver
// that expects source s and holds the source's plan digest. Otherwise, an error for `rank`:
// ABORTED naming the ranks that refused (their own answers say why), INVALID_ARGUMENT when the
// plans or the sources disagree (naming the source's and this rank's), FAILED_PRECONDITION for
// records that are not handshakes.
absl::Status HandshakeVerdict(const std::string& gathered, int32_t world_size, int32_t rank);

}  // namespace rollout
