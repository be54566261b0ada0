#include "model/weight_digest.h"

#include <openssl/evp.h>

#include <algorithm>
#include <thread>

#include "absl/strings/escaping.h"
#include "glog/logging.h"
#include "model/dtype_cast.h"

namespace rollout {

namespace {

constexpr size_t kSha256Bytes = 32;

void Sha256Into(const uint8_t* data, size_t size, uint8_t* out) {
  unsigned int len = 0;
  CHECK_EQ(EVP_Digest(data, size, out, &len, EVP_sha256(), nullptr), 1) << "SHA-256";
  CHECK_EQ(len, kSha256Bytes);
}

size_t NumLeaves(size_t size) { return (size + kDigestLeafBytes - 1) / kDigestLeafBytes; }

// Hashes leaf `i` of `size` bytes at `data` into leaves + 32 i.
void HashLeaf(const uint8_t* data, size_t size, size_t i, uint8_t* leaves) {
  const size_t begin = i * kDigestLeafBytes;
  Sha256Into(data + begin, std::min(kDigestLeafBytes, size - begin), leaves + kSha256Bytes * i);
}

}  // namespace

std::string Sha256(const uint8_t* data, size_t size) {
  std::string out(kSha256Bytes, '\0');
  Sha256Into(data, size, reinterpret_cast<uint8_t*>(out.data()));
  return out;
}

std::string TensorDigest(const uint8_t* data, size_t size) {
  std::vector<uint8_t> leaves(kSha256Bytes * NumLeaves(size));
  for (size_t i = 0; i < NumLeaves(size); ++i) HashLeaf(data, size, i, leaves.data());
  return Sha256(leaves.data(), leaves.size());
}

std::string WeightsDigest(const std::vector<WeightSpec>& specs, const TensorDigests& digests) {
  std::string listing;
  for (const WeightSpec& spec : specs) {
    auto it = digests.find(spec.name);
    if (it == digests.end()) return "";
    listing.append(spec.name).push_back('\0');
    listing.append(it->second);
  }
  const std::string digest =
      Sha256(reinterpret_cast<const uint8_t*>(listing.data()), listing.size());
  return "sha256:" + absl::BytesToHexString(digest);
}

TensorDigests DigestCheckpoint(const Checkpoint& checkpoint, const std::vector<WeightSpec>& specs,
                               int num_threads) {
  DigestQueue queue(num_threads);
  std::vector<const WeightSpec*> cast;  // held in another float dtype: hashed as served, below
  for (const WeightSpec& spec : specs) {
    const TensorView* view = checkpoint.Find(spec.name);
    if (view == nullptr || view->shape != spec.shape) continue;
    if (view->dtype == spec.dtype) {
      queue.Add(spec.name, view->data, view->nbytes);
    } else {
      cast.push_back(&spec);
    }
  }
  TensorDigests digests = queue.Finish();
  // One cast tensor in memory at a time, its leaves hashed on all the workers.
  std::vector<uint8_t> bytes;
  for (const WeightSpec* spec : cast) {
    const TensorView* view = checkpoint.Find(spec->name);
    bytes.resize(spec->nbytes());
    if (!CastFloats(spec->name, view->dtype, view->data, view->nbytes / DTypeSize(view->dtype),
                    spec->dtype, bytes.data())
             .ok()) {
      continue;  // not servable: the runner refused it already
    }
    queue.Add(spec->name, bytes.data(), bytes.size());
    digests.merge(queue.Finish());
  }
  return digests;
}

TensorDigests DigestTensors(const std::vector<HostTensorView>& tensors, int num_threads) {
  DigestQueue queue(num_threads);
  for (const HostTensorView& t : tensors) queue.Add(t.name, t.data, t.nbytes);
  return queue.Finish();
}

struct DigestQueue::Tensor {
  std::string name;
  const uint8_t* data;
  size_t size;
  std::vector<uint8_t> leaves;  // 32 bytes per leaf, written by the runs
};

DigestQueue::DigestQueue(int num_threads) {
  const int threads =
      num_threads > 0 ? num_threads : static_cast<int>(std::thread::hardware_concurrency());
  for (int t = 0; t < std::max(1, threads); ++t) workers_.emplace_back([this] { Work(); });
}

DigestQueue::~DigestQueue() {
  {
    std::unique_lock<std::mutex> lock(mu_);
    done_cv_.wait(lock, [this] { return pending_runs_ == 0; });
    stop_ = true;
  }
  work_cv_.notify_all();
  for (std::thread& t : workers_) t.join();
}

void DigestQueue::Add(const std::string& name, const uint8_t* data, size_t size) {
  constexpr size_t kLeavesPerRun = 64;  // 4 MiB
  auto tensor = std::make_unique<Tensor>(Tensor{name, data, size, {}});
  tensor->leaves.resize(kSha256Bytes * NumLeaves(size));
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t leaf = 0; leaf < NumLeaves(size); leaf += kLeavesPerRun) {
    runs_.push_back({tensor.get(), leaf, std::min(NumLeaves(size), leaf + kLeavesPerRun)});
    ++pending_runs_;
  }
  tensors_.push_back(std::move(tensor));
  work_cv_.notify_all();
}

void DigestQueue::Work() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    work_cv_.wait(lock, [this] { return stop_ || !runs_.empty(); });
    if (runs_.empty()) return;  // stop_, and nothing left
    const Run run = runs_.front();
    runs_.pop_front();
    lock.unlock();
    for (size_t leaf = run.first_leaf; leaf < run.end_leaf; ++leaf) {
      HashLeaf(run.tensor->data, run.tensor->size, leaf, run.tensor->leaves.data());
    }
    lock.lock();
    if (--pending_runs_ == 0) done_cv_.notify_all();
  }
}

void DigestQueue::Cancel() {
  std::unique_lock<std::mutex> lock(mu_);
  pending_runs_ -= runs_.size();
  runs_.clear();
  done_cv_.wait(lock, [this] { return pending_runs_ == 0; });
  tensors_.clear();
}

TensorDigests DigestQueue::Finish() {
  std::unique_lock<std::mutex> lock(mu_);
  done_cv_.wait(lock, [this] { return pending_runs_ == 0; });
  TensorDigests digests;
  for (const auto& t : tensors_) digests[t->name] = Sha256(t->leaves.data(), t->leaves.size());
  tensors_.clear();
  return digests;
}

}  // namespace rollout
