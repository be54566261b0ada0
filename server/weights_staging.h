#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "engine/engine.h"
#include "rollout/v1/rollout.pb.h"
#include "server/weights_arena.h"

namespace rollout {

// Collects a weight update's tensors in the server's staging arena as they stream in, checking
// each step: the header against the served model (known names, float dtypes, shapes, no
// duplicates), every data chunk against the header (declared name, inside the tensor, no
// overlap), and at the end that every byte arrived (no gap). A tensor declared in another float
// dtype than the served one is cast into its place as its chunks arrive (model/dtype_cast.h:
// round to nearest even; a chunk that cuts an element waits in a side buffer until the tensor is
// complete). Each tensor is hashed, as served, once its last byte arrived. The
// arena is held from SetHeader until Finish hands it to the update, or Abandon (or destruction)
// gives it back. Not thread-safe: one reactor owns it.
class WeightsStaging {
 public:
  // Copies a chunk's bytes to where they are staged.
  using CopyTo = std::function<void(uint8_t* destination)>;

  // `specs` and `arena` are borrowed. Tensors are hashed on half the cores, so that receiving
  // keeps the others (shared by the parts of a multi-part update).
  WeightsStaging(const std::vector<WeightSpec>* specs, WeightsArena* arena)
      : specs_(specs), arena_(arena) {}
  ~WeightsStaging() { Abandon(); }
  WeightsStaging(const WeightsStaging&) = delete;
  WeightsStaging& operator=(const WeightsStaging&) = delete;

  // Checks the header and takes the arena (allocated by the first update: setup_seconds).
  absl::Status SetHeader(const v1::WeightsHeader& header);
  // The same in two steps, for one part of a multi-part update whose arena lease another owner
  // (the UpdateAssembly) holds: CheckHeader validates the header against the served model, then
  // Bind gives the tensors their places in `lease`, which must outlive every AddData and the
  // hashing (Abandon or Finish ends both). Finish's update then owns no bytes.
  absl::Status CheckHeader(const v1::WeightsHeader& header);
  // REQUIRES: CheckHeader passed, not bound yet.
  void Bind(const WeightsArena::Lease& lease);
  // Checks a chunk of `size` bytes at byte `offset` of tensor `name`, then has `copy` write
  // them to their place.
  absl::Status AddData(absl::string_view name, uint64_t offset, uint64_t size, const CopyTo& copy);
  absl::Status AddData(const v1::TensorData& data);
  // Checks that every declared byte arrived, waits for the hashing (how long in
  // *digest_wait_seconds), and hands the tensors and the arena to a WeightUpdate.
  absl::StatusOr<WeightUpdate> Finish(double* digest_wait_seconds = nullptr);
  // Gives the arena back (at once for the next update): drops the hashing not started and
  // waits for the runs being hashed. Idempotent.
  void Abandon();

  bool has_header() const { return has_header_; }
  bool bound() const { return bound_; }
  bool declared(absl::string_view name) const { return tensors_.find(name) != tensors_.end(); }
  uint64_t bytes_received() const { return bytes_received_; }
  size_t num_tensors() const { return tensors_.size(); }
  double setup_seconds() const { return setup_seconds_; }

 private:
  struct Staged {
    HostTensorView tensor;     // as served (the spec's dtype); tensor.data: `place`
    uint8_t* place = nullptr;  // the arena's place for its bytes
    // What the stream carries: the declared dtype and its byte count. Chunks, their ranges and
    // the completeness check are in these bytes.
    DType wire_dtype = DType::kBF16;
    uint64_t wire_bytes = 0;
    std::map<uint64_t, uint64_t> received;  // disjoint byte ranges [begin, end), by begin
    uint64_t received_bytes = 0;
    // A cast tensor's chunks that cut an element (the rest are cast on arrival): their bytes
    // (allocated at the first such chunk, wire_bytes long) and ranges, cast when it completes.
    std::vector<uint8_t> unaligned;
    std::vector<std::pair<uint64_t, uint64_t>> unaligned_ranges;
  };
  // Writes a chunk's bytes [begin, begin + size) of `staged` to where they go: its place, or
  // for a cast tensor through the cast (or into its side buffer). Then, when it is complete,
  // finishes its cast and queues its hashing.
  absl::Status Place(Staged& staged, uint64_t begin, uint64_t size, const CopyTo& copy);

  const std::vector<WeightSpec>* const specs_;
  WeightsArena* const arena_;
  bool has_header_ = false;
  bool bound_ = false;  // places given (Bind, or SetHeader's own lease)
  std::string version_;
  UpdatePolicy policy_ = UpdatePolicy::kDrain;
  std::shared_ptr<WeightsArena::Lease> lease_;  // from SetHeader to Finish or Abandon
  double setup_seconds_ = 0;
  std::map<std::string, Staged, std::less<>> tensors_;
  // Hashes the tensors complete so far, reading the arena: Abandon stops it before the lease
  // goes.
  std::unique_ptr<DigestQueue> digests_;  // from CheckHeader
  uint64_t bytes_received_ = 0;
  std::vector<uint8_t> chunk_bytes_;  // a cast tensor's chunk before its cast
};

UpdatePolicy FromProto(v1::InFlightPolicy policy);

// OK when `policy` is one of InFlightPolicy's values; else INVALID_ARGUMENT naming `field` and
// the values. (Unchecked, a policy this server does not know -- from a client built against a
// newer proto, or a stray number -- ran as DRAIN, the one policy that can block.)
absl::Status CheckPolicy(v1::InFlightPolicy policy, absl::string_view field);

// How long the parts of LoadUpdateFromCheckpoint took.
struct CheckpointLoadTimes {
  double setup_seconds = 0;   // allocating the arena (the first update only)
  double digest_seconds = 0;  // hashing what was read
};

// Reads every weight the model serves from the checkpoint at `path` into the arena, as an
// update validated as a streamed one would be (a tensor in another float dtype is cast to the
// served one, then hashed as served). `served` (the served model; null only where the specs are
// not a model's, in tests): the checkpoint's config.json must describe it (CheckSameModel:
// FAILED_PRECONDITION naming the field, nothing read). Reads are bounded (Checkpoint::Read): a
// file truncated or rewritten meanwhile is ABORTED, never a crash. `cancelled` (optional) is
// asked between reads: CANCELLED once the caller gave up (deadline, cancel, shutdown). On failure
// the arena is free again when this returns.
absl::StatusOr<WeightUpdate> LoadUpdateFromCheckpoint(
    const std::vector<WeightSpec>& specs, const ModelConfig* served, WeightsArena* arena,
    const std::string& path, const std::string& version, UpdatePolicy policy,
    const std::function<bool()>& cancelled = nullptr, CheckpointLoadTimes* times = nullptr);

// A weight version names what serves and is copied into every completion: non-empty, at most
// kMaxWeightVersionBytes, no control characters (bytes below 0x20, 0x7f; UTF-8 is fine).
// INVALID_ARGUMENT saying which.
absl::Status CheckWeightVersion(const std::string& version);

}  // namespace rollout
