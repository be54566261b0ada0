#include "engine/broadcast_plan.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "model/weight_digest.h"

namespace rollout {
namespace {

constexpr char kHandshakeMagic[] = "RLBCAST1";  // 8 bytes, no NUL on the wire
constexpr uint64_t kLeaf = kDigestLeafBytes;

uint64_t RoundUp(uint64_t x, uint64_t to) { return (x + to - 1) / to * to; }

void PutLittleEndian(uint64_t v, int bytes, char* out) {
  for (int i = 0; i < bytes; ++i) out[i] = static_cast<char>((v >> (8 * i)) & 0xff);
}
uint64_t GetLittleEndian(const char* in, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= uint64_t{static_cast<unsigned char>(in[i])} << (8 * i);
  return v;
}

std::string Hex(const std::string& raw) { return absl::BytesToHexString(raw).substr(0, 16); }

}  // namespace

uint64_t BroadcastTensor::nbytes() const {
  uint64_t n = DTypeSize(dtype);
  for (int64_t d : shape) n *= static_cast<uint64_t>(d);
  return n;
}

std::string BroadcastPlanText(const std::vector<BroadcastTensor>& tensors, uint64_t bucket_bytes) {
  std::string text = absl::StrCat("rollout.broadcast.v1\nbucket_bytes ", bucket_bytes,
                                  "\nalignment ", kBroadcastAlignment, "\n");
  for (const BroadcastTensor& t : tensors) {
    absl::StrAppend(&text, "tensor ", t.name, " ", DTypeName(t.dtype), " ",
                    absl::StrJoin(t.shape, ","), "\n");
  }
  return text;
}

BroadcastPlan PlanBroadcast(std::vector<BroadcastTensor> tensors, uint64_t bucket_bytes) {
  BroadcastPlan plan;
  plan.bucket_bytes = bucket_bytes;
  plan.digest = [&] {
    const std::string text = BroadcastPlanText(tensors, bucket_bytes);
    return Sha256(reinterpret_cast<const uint8_t*>(text.data()), text.size());
  }();
  plan.tensors = std::move(tensors);
  uint64_t end = 0;
  for (const BroadcastTensor& t : plan.tensors) {
    const uint64_t offset = RoundUp(end, kBroadcastAlignment);
    plan.offsets.push_back(offset);
    end = offset + t.nbytes();
    plan.payload_bytes += t.nbytes();
  }
  plan.total_bytes = end;
  // Tensors in stream order; each bucket takes the slices that overlap it.
  size_t first = 0;  // the first tensor that may still overlap the next bucket
  for (uint64_t begin = 0; begin < plan.total_bytes; begin += bucket_bytes) {
    BroadcastBucket bucket;
    bucket.stream_offset = begin;
    bucket.size = std::min(bucket_bytes, plan.total_bytes - begin);
    const uint64_t stop = begin + bucket.size;
    for (size_t i = first; i < plan.tensors.size() && plan.offsets[i] < stop; ++i) {
      const uint64_t t_begin = plan.offsets[i], t_end = t_begin + plan.tensors[i].nbytes();
      if (t_end <= begin) {  // before this bucket (or empty, at its start)
        if (i == first) ++first;
        continue;
      }
      const uint64_t from = std::max(begin, t_begin), to = std::min(stop, t_end);
      bucket.slices.push_back({i, from - t_begin, from - begin, to - from});
    }
    plan.buckets.push_back(std::move(bucket));
  }
  return plan;
}

BucketLeaves LeavesCompletedBy(const BroadcastPlan& plan, size_t bucket) {
  BucketLeaves leaves;
  for (const BroadcastSlice& s : plan.buckets[bucket].slices) {
    const uint64_t n = plan.tensors[s.tensor].nbytes();
    const uint64_t num_leaves = (n + kLeaf - 1) / kLeaf;
    // Leaf i of a tensor ends at its byte min((i + 1) * leaf, n) - 1: the leaves that end in
    // [a, z] are those from floor(a / leaf) up to floor((z + 1) / leaf) - 1, and the last leaf
    // too when z is the tensor's last byte.
    const uint64_t a = s.tensor_offset, z = s.tensor_offset + s.size - 1;
    const uint64_t first_leaf = a / kLeaf;
    const uint64_t end_leaf = z + 1 == n ? num_leaves : (z + 1) / kLeaf;
    if (end_leaf > first_leaf) leaves.runs.push_back({s.tensor, first_leaf, end_leaf - first_leaf});
  }
  // Tensor i ends at stream byte offsets[i] + nbytes (non-decreasing in i): it is completed by
  // the first bucket that reaches its end (an empty one, by the first that reaches its offset).
  auto completed_by = [&](size_t b) -> size_t {
    if (b + 1 == plan.buckets.size()) return plan.tensors.size();
    const uint64_t reach = plan.buckets[b].stream_offset + plan.buckets[b].size;
    size_t count = 0;
    while (count < plan.tensors.size() &&
           plan.offsets[count] + plan.tensors[count].nbytes() <= reach) {
      ++count;
    }
    return count;
  };
  leaves.first_completed = bucket == 0 ? 0 : completed_by(bucket - 1);
  leaves.end_completed = completed_by(bucket);
  return leaves;
}

std::string EncodeHandshake(const HandshakeRecord& record) {
  std::string out(kHandshakeBytes, '\0');
  std::memcpy(out.data(), kHandshakeMagic, 8);
  out[8] = static_cast<char>(record.role);
  out[9] = record.ready ? 1 : 0;
  PutLittleEndian(static_cast<uint32_t>(record.source_rank), 4, out.data() + 12);
  PutLittleEndian(record.total_bytes, 8, out.data() + 16);
  std::memcpy(out.data() + 32, record.plan_digest.data(),
              std::min<size_t>(32, record.plan_digest.size()));
  return out;
}

absl::Status HandshakeVerdict(const std::string& gathered, int32_t world_size, int32_t rank) {
  if (world_size <= 0 || gathered.size() != kHandshakeBytes * static_cast<size_t>(world_size)) {
    return absl::FailedPreconditionError(
        absl::StrFormat("the handshake gathered %d bytes; %d ranks of %d bytes were expected",
                        gathered.size(), world_size, kHandshakeBytes));
  }
  struct Record {
    HandshakeRole role;
    bool ready;
    int32_t source_rank;
    uint64_t total_bytes;
    std::string digest;
  };
  std::vector<Record> records;
  for (int32_t r = 0; r < world_size; ++r) {
    const char* p = gathered.data() + kHandshakeBytes * r;
    const auto role = static_cast<HandshakeRole>(static_cast<unsigned char>(p[8]));
    if (std::memcmp(p, kHandshakeMagic, 8) != 0 ||
        (role != HandshakeRole::kSource && role != HandshakeRole::kReceiver)) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "rank %d's handshake record is not one (it starts %s): every rank of the weight-sync "
          "group must run this protocol's handshake before a broadcast (docs/api.md)",
          r, absl::BytesToHexString(std::string(p, 8))));
    }
    records.push_back({role, p[9] != 0, static_cast<int32_t>(GetLittleEndian(p + 12, 4)),
                       GetLittleEndian(p + 16, 8), std::string(p + 32, 32)});
  }
  std::vector<int32_t> sources, refused;
  for (int32_t r = 0; r < world_size; ++r) {
    if (records[r].role == HandshakeRole::kSource) sources.push_back(r);
    if (records[r].role == HandshakeRole::kReceiver && !records[r].ready) refused.push_back(r);
  }
  if (sources.size() != 1) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%d ranks of the weight-sync group broadcast (%s); exactly one, the trainer's, must",
        sources.size(), absl::StrJoin(sources, ", ")));
  }
  if (!refused.empty()) {
    return absl::AbortedError(absl::StrFormat(
        "rank(s) %s of the weight-sync group refused this update (their answers say why); "
        "nothing was received or changed",
        absl::StrJoin(refused, ", ")));
  }
  const int32_t source = sources[0];
  const Record& src = records[source];
  for (int32_t r = 0; r < world_size; ++r) {
    if (r == source) continue;
    if (records[r].source_rank != source) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "rank %d expects rank %d to broadcast, but rank %d does: every server's source_rank "
          "must be the trainer's rank in the group; nothing was received",
          r, records[r].source_rank, source));
    }
    if (records[r].digest != src.digest) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "rank %d's broadcast plan (%s..., %d bytes) differs from the source's (rank %d: %s..., "
          "%d bytes)%s: the trainer must broadcast exactly the tensors, in the order and the "
          "bucket size, that its request to every server declares; nothing was received",
          r, Hex(records[r].digest), records[r].total_bytes, source, Hex(src.digest),
          src.total_bytes, r == rank ? " (this server's)" : ""));
    }
  }
  return absl::OkStatus();
}

}  // namespace rollout
