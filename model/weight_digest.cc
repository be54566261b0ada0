#include "model/weight_digest.h"

#include <openssl/evp.h>

#include <algorithm>
#include <atomic>
#include <thread>

#include "absl/strings/escaping.h"
#include "glog/logging.h"

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
  const std::string digest = Sha256(reinterpret_cast<const uint8_t*>(listing.data()), listing.size());
  return "sha256:" + absl::BytesToHexString(digest);
}

namespace {

struct Bytes {
  const std::string* name;
  const uint8_t* data;
  size_t size;
};

// Hashes every leaf of every one of `work` on up to `num_threads` threads (leaves in one list,
// so one big tensor is spread over all of them), then each tensor's leaf digests.
TensorDigests DigestAll(const std::vector<Bytes>& work, int num_threads) {
  std::vector<size_t> first_leaf(work.size() + 1, 0);
  for (size_t t = 0; t < work.size(); ++t) first_leaf[t + 1] = first_leaf[t] + NumLeaves(work[t].size);
  std::vector<uint8_t> leaves(kSha256Bytes * first_leaf.back());
  const int cores = static_cast<int>(std::thread::hardware_concurrency());
  const int threads = std::max(1, std::min<int>(num_threads > 0 ? num_threads : cores,
                                                static_cast<int>(first_leaf.back())));
  constexpr size_t kLeavesPerClaim = 64;  // 4 MiB
  std::atomic<size_t> next{0};
  auto worker = [&] {
    for (size_t begin = next.fetch_add(kLeavesPerClaim); begin < first_leaf.back();
         begin = next.fetch_add(kLeavesPerClaim)) {
      const size_t end = std::min(first_leaf.back(), begin + kLeavesPerClaim);
      size_t t = std::upper_bound(first_leaf.begin(), first_leaf.end(), begin) - first_leaf.begin() - 1;
      for (size_t leaf = begin; leaf < end; ++leaf) {
        while (leaf >= first_leaf[t + 1]) ++t;  // tensors of no leaves are skipped here
        HashLeaf(work[t].data, work[t].size, leaf - first_leaf[t],
                 leaves.data() + kSha256Bytes * first_leaf[t]);
      }
    }
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(worker);
  worker();
  for (std::thread& t : pool) t.join();
  TensorDigests digests;
  for (size_t t = 0; t < work.size(); ++t) {
    digests.emplace(*work[t].name,
                    Sha256(leaves.data() + kSha256Bytes * first_leaf[t],
                           kSha256Bytes * (first_leaf[t + 1] - first_leaf[t])));
  }
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
  return DigestAll(work, num_threads);
}

TensorDigests DigestTensors(const std::vector<HostTensor>& tensors, int num_threads) {
  std::vector<Bytes> work;
  for (const HostTensor& t : tensors) work.push_back({&t.name, t.bytes.data(), t.bytes.size()});
  return DigestAll(work, num_threads);
}

}  // namespace rollout
