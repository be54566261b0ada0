// SHA-256 (FIPS 180-4) on the device: the leaves of model/weight_digest.h's tensor digest, one
// thread per 64 KiB leaf, and the tensors' digests over their leaf digests, one thread per
// tensor (device_digest.h says why and what the contract is).
#include <algorithm>
#include <cstring>

#include "kernels/cuda/device_digest.h"
#include "kernels/cuda/sha256.cuh"

namespace rollout::cuda {
namespace {

constexpr int kLeafThreads = 128;
constexpr int kCombineThreads = 32;

// The batch of a launch travels in kernel parameters (16.4 KB of the 32 KB CUDA 12.1+ allows
// on sm_70+), read through __grid_constant__ without a copy: nothing to upload or keep alive.
struct LeafBatch {
  uint64_t first_leaf[kDigestTensorsPerLaunch + 1];  // prefix sums; [count] = leaves in all
  const uint8_t* data[kDigestTensorsPerLaunch];
  uint64_t size[kDigestTensorsPerLaunch];
  uint8_t* leaf_digests[kDigestTensorsPerLaunch];
  int count;
};

struct CombineBatch {
  const uint8_t* leaf_digests[kDigestTensorsPerLaunch];
  uint64_t num_leaves[kDigestTensorsPerLaunch];
  int count;
};

// Thread = one leaf of the batch; its range is found by binary search over the leaf prefix sums
// (the threads of a warp almost always agree, so the parameter reads broadcast).
__global__ void __launch_bounds__(kLeafThreads)
    LeafDigestsKernel(const __grid_constant__ LeafBatch batch) {
  const uint64_t leaf = uint64_t{blockIdx.x} * kLeafThreads + threadIdx.x;
  if (leaf >= batch.first_leaf[batch.count]) return;
  int lo = 0, hi = batch.count;  // first_leaf[lo] <= leaf < first_leaf[hi]
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (batch.first_leaf[mid] <= leaf) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  const uint64_t i = leaf - batch.first_leaf[lo];
  const uint64_t begin = i * kDigestLeafSize;
  const uint64_t left = batch.size[lo] - begin;
  sha256::Sha256(batch.data[lo] + begin, left < kDigestLeafSize ? left : kDigestLeafSize,
                 batch.leaf_digests[lo] + kDigestBytes * i);
}

// Thread = one tensor: the SHA-256 of its leaf digests.
__global__ void __launch_bounds__(kCombineThreads)
    CombineLeafDigestsKernel(const __grid_constant__ CombineBatch batch, uint8_t* digests) {
  const int i = blockIdx.x * kCombineThreads + threadIdx.x;
  if (i >= batch.count) return;
  sha256::Sha256(batch.leaf_digests[i], kDigestBytes * batch.num_leaves[i],
                 digests + kDigestBytes * i);
}

bool Aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

bool ValidRange(const DeviceLeafRange& r) {
  return r.size == 0 ||
         (r.data != nullptr && r.leaf_digests != nullptr && Aligned16(r.leaf_digests));
}

// Enqueues the leaves of ranges [begin, end) of `range_at(i)` (at most kDigestTensorsPerLaunch).
template <typename RangeAt>
cudaError_t EnqueueLeaves(size_t begin, size_t end, RangeAt range_at, cudaStream_t stream) {
  LeafBatch batch;
  batch.count = static_cast<int>(end - begin);
  batch.first_leaf[0] = 0;
  for (size_t i = begin; i < end; ++i) {
    const DeviceLeafRange r = range_at(i);
    const int j = static_cast<int>(i - begin);
    batch.data[j] = static_cast<const uint8_t*>(r.data);
    batch.size[j] = r.size;
    batch.leaf_digests[j] = r.leaf_digests;
    batch.first_leaf[j + 1] = batch.first_leaf[j] + DigestLeafCount(r.size);
  }
  const uint64_t leaves = batch.first_leaf[batch.count];
  if (leaves == 0) return cudaSuccess;
  const uint64_t blocks = (leaves + kLeafThreads - 1) / kLeafThreads;
  if (blocks > 0x7fffffffu) return cudaErrorInvalidValue;  // > 2^38 leaves: 16 EiB
  LeafDigestsKernel<<<static_cast<unsigned>(blocks), kLeafThreads, 0, stream>>>(batch);
  return cudaGetLastError();
}

template <typename ListAt>
cudaError_t EnqueueCombine(size_t begin, size_t end, ListAt list_at, uint8_t* digests,
                           cudaStream_t stream) {
  CombineBatch batch;
  batch.count = static_cast<int>(end - begin);
  for (size_t i = begin; i < end; ++i) {
    const DeviceLeafList l = list_at(i);
    batch.leaf_digests[i - begin] = l.leaf_digests;
    batch.num_leaves[i - begin] = l.num_leaves;
  }
  const unsigned blocks = (batch.count + kCombineThreads - 1) / kCombineThreads;
  CombineLeafDigestsKernel<<<blocks, kCombineThreads, 0, stream>>>(batch,
                                                                   digests + kDigestBytes * begin);
  return cudaGetLastError();
}

}  // namespace

size_t DeviceDigestWorkspaceBytes(const DeviceDigestTensor* tensors, size_t num_tensors) {
  uint64_t leaves = 0;
  for (size_t i = 0; i < num_tensors; ++i) leaves += DigestLeafCount(tensors[i].size);
  return kDigestBytes * leaves;
}

cudaError_t DeviceLeafDigests(const DeviceLeafRange* ranges, size_t num_ranges,
                              cudaStream_t stream) {
  if (num_ranges == 0) return cudaSuccess;
  if (ranges == nullptr) return cudaErrorInvalidValue;
  for (size_t i = 0; i < num_ranges; ++i) {
    if (!ValidRange(ranges[i])) return cudaErrorInvalidValue;
  }
  for (size_t begin = 0; begin < num_ranges; begin += kDigestTensorsPerLaunch) {
    const size_t end = std::min(num_ranges, begin + kDigestTensorsPerLaunch);
    const cudaError_t err = EnqueueLeaves(
        begin, end, [&](size_t i) { return ranges[i]; }, stream);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

cudaError_t DeviceCombineLeafDigests(const DeviceLeafList* lists, size_t num_lists,
                                     uint8_t* digests, cudaStream_t stream) {
  if (num_lists == 0) return cudaSuccess;
  if (lists == nullptr || digests == nullptr || !Aligned16(digests)) return cudaErrorInvalidValue;
  for (size_t i = 0; i < num_lists; ++i) {
    if (lists[i].num_leaves > 0 && lists[i].leaf_digests == nullptr) return cudaErrorInvalidValue;
  }
  for (size_t begin = 0; begin < num_lists; begin += kDigestTensorsPerLaunch) {
    const size_t end = std::min(num_lists, begin + kDigestTensorsPerLaunch);
    const cudaError_t err = EnqueueCombine(
        begin, end, [&](size_t i) { return lists[i]; }, digests, stream);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

cudaError_t DeviceTensorDigests(const DeviceDigestTensor* tensors, size_t num_tensors,
                                void* workspace, size_t workspace_bytes, uint8_t* digests,
                                cudaStream_t stream) {
  if (num_tensors == 0) return cudaSuccess;
  if (tensors == nullptr || digests == nullptr || !Aligned16(digests)) {
    return cudaErrorInvalidValue;
  }
  for (size_t i = 0; i < num_tensors; ++i) {
    if (tensors[i].size > 0 && tensors[i].data == nullptr) return cudaErrorInvalidValue;
  }
  const size_t needed = DeviceDigestWorkspaceBytes(tensors, num_tensors);
  if (workspace_bytes < needed || (needed > 0 && (workspace == nullptr || !Aligned16(workspace)))) {
    return cudaErrorInvalidValue;
  }
  // Tensor i's leaf digests at workspace + 32 * (leaves of the tensors before it).
  uint8_t* const leaves = static_cast<uint8_t*>(workspace);
  uint64_t first_leaf = 0;
  for (size_t begin = 0; begin < num_tensors; begin += kDigestTensorsPerLaunch) {
    const size_t end = std::min(num_tensors, begin + kDigestTensorsPerLaunch);
    uint64_t leaf = first_leaf;
    cudaError_t err = EnqueueLeaves(
        begin, end,
        [&](size_t i) {
          DeviceLeafRange r{tensors[i].data, tensors[i].size, leaves + kDigestBytes * leaf};
          leaf += DigestLeafCount(tensors[i].size);
          return r;
        },
        stream);
    if (err != cudaSuccess) return err;
    leaf = first_leaf;
    err = EnqueueCombine(
        begin, end,
        [&](size_t i) {
          DeviceLeafList l{leaves + kDigestBytes * leaf, DigestLeafCount(tensors[i].size)};
          leaf += l.num_leaves;
          return l;
        },
        digests, stream);
    if (err != cudaSuccess) return err;
    first_leaf = leaf;
  }
  return cudaSuccess;
}

}  // namespace rollout::cuda
