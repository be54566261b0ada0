#pragma once

// Versions bound to bytes: the content digest of the served weights (docs/api.md, "Weight
// digests"). A tensor's digest is a SHA-256 tree over its bytes as served (dtype, row-major,
// little endian): the SHA-256 of the concatenated SHA-256s of its 64 KiB leaves (the last one
// shorter), so that leaves hash in parallel -- on host threads, or one per GPU thread where the
// bytes are on the device. The weights' digest is "sha256:" and the hex SHA-256 of, for each
// served tensor in name order, its name, a NUL byte and its tensor digest. So the same bytes give
// the same digest whatever they were called, however they arrived, and any changed byte
// changes it.

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
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

// The digests of the served tensors of `checkpoint`, hashed on `num_threads` threads (0: one
// per core). A tensor held in another float dtype than its spec's is hashed as served: its cast
// to the spec's dtype (model/dtype_cast.h). A spec the checkpoint lacks (one the runner derives)
// is left out, so WeightsDigest is then unknown.
TensorDigests DigestCheckpoint(const Checkpoint& checkpoint, const std::vector<WeightSpec>& specs,
                               int num_threads = 0);

// The digests of `tensors`, on `num_threads` threads (0: one per core).
TensorDigests DigestTensors(const std::vector<HostTensorView>& tensors, int num_threads = 0);
inline TensorDigests DigestTensors(const std::vector<HostTensor>& tensors, int num_threads = 0) {
  return DigestTensors(ViewsOf(tensors), num_threads);
}

// Hashes tensors on worker threads while the caller goes on (receiving the next ones): their
// leaves are queued in runs of 4 MiB, so all workers share a big tensor. Add and Finish from one
// thread.
class DigestQueue {
 public:
  // num_threads = 0: one per core.
  explicit DigestQueue(int num_threads = 0);
  // Waits for the queued work (the bytes must live until then) and joins the workers.
  ~DigestQueue();
  DigestQueue(const DigestQueue&) = delete;
  DigestQueue& operator=(const DigestQueue&) = delete;

  // Queues the tensor `name` of `size` bytes at `data` (borrowed until Finish or destruction).
  void Add(const std::string& name, const uint8_t* data, size_t size);
  // Waits for every queued tensor and returns their digests; the queue is empty after.
  TensorDigests Finish();
  // Drops the work not started yet and waits only for the runs being hashed (4 MiB each), so
  // that the queued bytes may be reused at once; the queue is empty after.
  void Cancel();

 private:
  struct Tensor;
  struct Run {
    Tensor* tensor;
    size_t first_leaf, end_leaf;
  };
  void Work();

  std::mutex mu_;
  std::condition_variable work_cv_, done_cv_;
  std::vector<std::unique_ptr<Tensor>> tensors_;  // protected by mu_, as below
  std::deque<Run> runs_;
  size_t pending_runs_ = 0;  // queued or being hashed
  bool stop_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace rollout
