#include "model/weight_digest.h"

#include <openssl/evp.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <thread>

#include "absl/strings/escaping.h"
#include "glog/logging.h"

namespace rollout {

std::string TensorDigest(const uint8_t* data, size_t size) {
  unsigned char out[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  CHECK_EQ(EVP_Digest(data, size, out, &len, EVP_sha256(), nullptr), 1) << "SHA-256";
  return std::string(reinterpret_cast<const char*>(out), len);
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
      TensorDigest(reinterpret_cast<const uint8_t*>(listing.data()), listing.size());
  return "sha256:" + absl::BytesToHexString(digest);
}

namespace {

struct Bytes {
  const std::string* name;
  const uint8_t* data;
  size_t size;
};

// Hashes each of `work` on up to `num_threads` threads, largest first (so that one big tensor
// does not start last).
TensorDigests DigestAll(std::vector<Bytes> work, int num_threads) {
  std::sort(work.begin(), work.end(), [](const Bytes& a, const Bytes& b) { return a.size > b.size; });
  const int cores = static_cast<int>(std::thread::hardware_concurrency());
  const int threads = std::max(
      1, std::min<int>(num_threads > 0 ? num_threads : cores, static_cast<int>(work.size())));
  TensorDigests digests;
  std::mutex mu;
  std::atomic<size_t> next{0};
  auto worker = [&] {
    for (size_t i = next++; i < work.size(); i = next++) {
      std::string digest = TensorDigest(work[i].data, work[i].size);
      std::lock_guard<std::mutex> lock(mu);
      digests.emplace(*work[i].name, std::move(digest));
    }
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(worker);
  worker();
  for (std::thread& t : pool) t.join();
  return digests;
}

}  // namespace

TensorDigests DigestCheckpoint(const Checkpoint& checkpoint, const std::vector<WeightSpec>& specs,
                               int num_threads) {
  std::vector<Bytes> work;
  for (const WeightSpec& spec : specs) {
    const TensorView* view = checkpoint.Find(spec.name);
    if (view != nullptr && view->dtype == spec.dtype && view->nbytes == spec.nbytes()) {
      work.push_back({&spec.name, view->data, view->nbytes});
    }
  }
  return DigestAll(std::move(work), num_threads);
}

TensorDigests DigestTensors(const std::vector<HostTensor>& tensors, int num_threads) {
  std::vector<Bytes> work;
  for (const HostTensor& t : tensors) work.push_back({&t.name, t.bytes.data(), t.bytes.size()});
  return DigestAll(std::move(work), num_threads);
}

}  // namespace rollout
