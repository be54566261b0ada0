#pragma once

// The weight digest of model/weight_digest.h for bytes already on the device (issue 17, item 4;
// docs/cuda.md, "Weight digests on the GPU"): a tensor's digest is the SHA-256 of the
// concatenated SHA-256s (FIPS 180-4) of its 64 KiB leaves, the last leaf shorter, no leaf for
// an empty tensor. These launchers compute exactly the 32 bytes TensorDigest() computes on the
// host for the same bytes; the weights' digest ("sha256:" over names and tensor digests) stays
// on the host (WeightsDigest), fed with the tensor digests copied back.
//
// The seam for the update paths (IPC, NCCL, streamed staging), with the weights' bytes in
// device memory once they have all arrived:
//
//   // At planning (the tensor list of the served model; sizes are all that matter):
//   const size_t ws_bytes = cuda::DeviceDigestWorkspaceBytes(tensors, n);  // 8 MB for 16.4 GB
//   // ... a device workspace of ws_bytes and a device array of 32 * n bytes, held for reuse.
//   // Per update, on the stream that wrote the bytes (or after an event of it):
//   cudaError_t err = cuda::DeviceTensorDigests(tensors, n, ws, ws_bytes, digests, stream);
//   cudaMemcpyAsync(pinned, digests, 32 * n, cudaMemcpyDeviceToHost, stream);
//   // After the stream: pinned + 32 i is TensorDigest() of tensor i; put it in the update's
//   // TensorDigests under the tensor's name and call WeightsDigest(specs, digests).
//
// How it runs: one thread hashes one leaf (a leaf's SHA-256 is one chain of 1025 compressions
// that a warp could not share), every leaf of the batch in one launch; then one thread per
// tensor hashes that tensor's leaf digests. A single thread walks a whole leaf, so even a
// small tensor costs one leaf's chain; rollout-digest-bench times a whole model, its two
// halves, and single tensors.
//
// Every launcher only enqueues on `stream`: no allocation, no synchronization, no host memory
// read after it returns (the batch travels in kernel parameters), so it can be captured in a
// CUDA graph. Batches of more than kDigestTensorsPerLaunch entries take several launches.
// Arguments are checked before any launch: cudaErrorInvalidValue for a null pointer with bytes
// behind it, an output or workspace not 16-byte aligned, or a workspace that is too small; a
// launch error is returned as cudaGetLastError() gives it. The launchers keep no state: any
// thread may call them, for any stream.

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace rollout::cuda {

inline constexpr uint64_t kDigestLeafSize = uint64_t{1} << 16;  // model/weight_digest.h's leaf
inline constexpr size_t kDigestBytes = 32;                      // one SHA-256
inline constexpr size_t kDigestTensorsPerLaunch = 512;

// Leaves of a tensor of `size` bytes: ceil(size / 64 KiB), 0 for an empty tensor.
constexpr uint64_t DigestLeafCount(uint64_t size) {
  return (size + kDigestLeafSize - 1) / kDigestLeafSize;
}

// A tensor's bytes in device memory. Any alignment: 16-byte-aligned data takes 16-byte loads,
// other data byte loads (slower: place tensors at 16-byte boundaries where you can).
struct DeviceDigestTensor {
  const void* data = nullptr;  // may be null when size == 0
  uint64_t size = 0;           // bytes
};

// Workspace of DeviceTensorDigests for these tensors: 32 bytes per leaf, 16-byte aligned
// (16.4 GB of weights: 8 MB).
size_t DeviceDigestWorkspaceBytes(const DeviceDigestTensor* tensors, size_t num_tensors);

// digests + 32 i = the tensor digest of tensors[i] (TensorDigest's 32 raw bytes), on `stream`.
// REQUIRES: the tensors' bytes are not written until the stream passes this call; `workspace`
// holds workspace_bytes >= DeviceDigestWorkspaceBytes(tensors, num_tensors), both 16-byte
// aligned; `digests` is device memory of 32 * num_tensors bytes, 16-byte aligned.
// `tensors` is read before the call returns (the caller may reuse it).
cudaError_t DeviceTensorDigests(const DeviceDigestTensor* tensors, size_t num_tensors,
                                void* workspace, size_t workspace_bytes, uint8_t* digests,
                                cudaStream_t stream);

// The two halves of DeviceTensorDigests, for bytes that arrive in parts (a streamed update
// hashes each staged chunk's leaves as it lands, and the tensor's digest after its last chunk).

// A run of whole leaves of one tensor, and where its leaf digests go.
struct DeviceLeafRange {
  const void* data = nullptr;       // the run's first byte: a leaf boundary of its tensor
  uint64_t size = 0;                // a multiple of 64 KiB, unless the run ends the tensor
  uint8_t* leaf_digests = nullptr;  // 32 * DigestLeafCount(size) bytes, 16-byte aligned
};

// leaf_digests of each range = the SHA-256s of its leaves, in order, on `stream`.
// REQUIRES: as above; ranges with size 0 write nothing.
cudaError_t DeviceLeafDigests(const DeviceLeafRange* ranges, size_t num_ranges,
                              cudaStream_t stream);

// A tensor's leaf digests, all of them, in leaf order (as DeviceLeafDigests wrote them).
struct DeviceLeafList {
  const uint8_t* leaf_digests = nullptr;  // 32 * num_leaves bytes; may be null when 0 leaves
  uint64_t num_leaves = 0;
};

// digests + 32 i = the SHA-256 of lists[i]'s 32 * num_leaves bytes (an empty tensor: SHA-256 of
// nothing, as on the host), on `stream`. One thread per tensor walks its list, so the largest
// tensor of a batch (Qwen3-8B's embedding: 18,992 leaves) sets this step's time.
// REQUIRES: `digests` 16-byte aligned, 32 * num_lists bytes.
cudaError_t DeviceCombineLeafDigests(const DeviceLeafList* lists, size_t num_lists,
                                     uint8_t* digests, cudaStream_t stream);

}  // namespace rollout::cuda
