#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "engine/engine.h"
#include "rollout/v1/rollout.pb.h"

namespace rollout {

// Collects a weight update's tensors in host memory as they stream in, checking each step:
// the header against the served model (known names, dtypes, shapes, no duplicates), every data
// chunk against the header (declared name, inside the tensor, no overlap), and at the end that
// every byte arrived (no gap). Host memory is the only staging; the engine applies the result
// in place. Not thread-safe: one reactor owns it.
class WeightsStaging {
 public:
  // Tensors are hashed on half the cores, so that receiving keeps the others.
  explicit WeightsStaging(const std::vector<WeightSpec>* specs)
      : specs_(specs),
        digests_(std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / 2)) {}

  absl::Status SetHeader(const v1::WeightsHeader& header);
  absl::Status AddData(const v1::TensorData& data);
  // Checks that every declared byte arrived and moves the tensors into a WeightUpdate.
  absl::StatusOr<WeightUpdate> Finish();

  bool has_header() const { return has_header_; }
  uint64_t bytes_received() const { return bytes_received_; }
  size_t num_tensors() const { return tensors_.size(); }

 private:
  struct Staged {
    HostTensor tensor;
    std::map<uint64_t, uint64_t> received;  // disjoint byte ranges [begin, end), by begin
    uint64_t received_bytes = 0;
  };

  const std::vector<WeightSpec>* const specs_;
  bool has_header_ = false;
  std::string version_;
  UpdatePolicy policy_ = UpdatePolicy::kDrain;
  std::map<std::string, Staged> tensors_;
  // Hashes the tensors complete so far; declared after tensors_, so destroyed (its work
  // waited for) before their bytes.
  DigestQueue digests_;
  uint64_t bytes_received_ = 0;
};

UpdatePolicy FromProto(v1::InFlightPolicy policy);

// Reads every weight the model serves from the checkpoint at `path` into an update,
// validated as a streamed one would be. Reads are bounded (Checkpoint::Read): a file truncated
// or rewritten meanwhile is ABORTED, never a crash. `cancelled` (optional) is asked between
// reads: CANCELLED once the caller gave up (deadline, cancel, shutdown).
absl::StatusOr<WeightUpdate> LoadUpdateFromCheckpoint(
    const std::vector<WeightSpec>& specs, const std::string& path, const std::string& version,
    UpdatePolicy policy, const std::function<bool()>& cancelled = nullptr);

// A weight version names what serves and is copied into every completion: non-empty and at most
// kMaxWeightVersionBytes. INVALID_ARGUMENT saying which.
absl::Status CheckWeightVersion(const std::string& version);

}  // namespace rollout
