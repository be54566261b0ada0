#pragma once

// Versions bound to bytes: the content digest of the served weights (docs/api.md, "Weight
// digests"). A tensor's digest is a SHA-256 tree over its bytes as served (dtype, row-major,
// little endian): the SHA-256 of the concatenated SHA-256s of its 64 KiB leaves (the last one
// shorter), so that leaves hash in parallel -- on host threads, or one per GPU thread where the
// bytes are on the device. The weights' digest is "sha256:" and the hex SHA-256 of, for each
// served tensor in name order, its name, a NUL byte and its tensor digest. So the same bytes give
// the same digest whatever they were called, however they arrived, and any changed byte
// changes it.

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "model/safetensors.h"
#include "model/weight_spec.h"

namespace rollout {

// Tensor name -> the 32 raw bytes of its SHA-256.
using TensorDigests = std::map<std::string, std::string>;

inline constexpr size_t kDigestLeafBytes = size_t{1} << 16;

// The 32 raw bytes of the SHA-256 of `data`.
std::string Sha256(const uint8_t* data, size_t size);

// The 32 raw bytes of the tensor digest of `data` (the tree above), on the calling thread.
std::string TensorDigest(const uint8_t* data, size_t size);

// The digest of weights whose tensors have `digests`: "" (unknown) unless every spec has one.
std::string WeightsDigest(const std::vector<WeightSpec>& specs, const TensorDigests& digests);

// The digests of the served tensors as `checkpoint` holds them, hashed on `num_threads` threads
// (0: one per core). A spec the checkpoint lacks or holds in another dtype (one the runner
// converts, or derives, as a tied lm_head) is left out, so WeightsDigest is then unknown.
TensorDigests DigestCheckpoint(const Checkpoint& checkpoint, const std::vector<WeightSpec>& specs,
                               int num_threads = 0);

// The digests of `tensors`, on `num_threads` threads (0: one per core).
TensorDigests DigestTensors(const std::vector<HostTensor>& tensors, int num_threads = 0);

}  // namespace rollout
