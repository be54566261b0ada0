#include "runner/cuda/device_tensor_digest.h"

#include <algorithm>
#include <cstdint>
#include <thread>

#include "absl/strings/str_format.h"
#include "common/cuda_status.h"
#include "common/status.h"
#include "common/thread_pool.h"
#include "kernels/cuda/device_buffer.h"
#include "model/weight_digest.h"
#include "runner/cuda/cuda_handles.h"

namespace rollout {
namespace {

using cuda_runner_internal::CudaEvent;

// Bytes per copied chunk: whole leaves, large enough that the copy runs at its bandwidth.
constexpr size_t kChunkBytes = size_t{64} << 20;
static_assert(kChunkBytes % kDigestLeafBytes == 0);

// A piece of one tensor: [begin, begin + size) of tensor `tensor`, in whole leaves but the last.
struct Chunk {
  size_t tensor, begin, size;
};

}  // namespace

absl::StatusOr<std::vector<std::string>> DigestDeviceTensors(
    const std::vector<DeviceBytes>& tensors, cudaStream_t stream) {
  std::vector<Chunk> chunks;
  std::vector<std::vector<uint8_t>> leaves(tensors.size());  // 32 bytes per leaf, per tensor
  size_t largest = 0;
  for (size_t t = 0; t < tensors.size(); ++t) {
    const size_t size = tensors[t].size;
    leaves[t].resize(32 * ((size + kDigestLeafBytes - 1) / kDigestLeafBytes));
    for (size_t begin = 0; begin < size; begin += kChunkBytes) {
      chunks.push_back({t, begin, std::min(kChunkBytes, size - begin)});
      largest = std::max(largest, chunks.back().size);
    }
  }
  std::vector<std::string> digests;
  if (!chunks.empty()) {
    cuda::PinnedHostBuffer host[2];
    CudaEvent copied[2];
    for (int i = 0; i < 2; ++i) {
      ROLLOUT_RETURN_IF_ERROR(CudaError(host[i].Allocate(largest), "pinning digest staging"));
      ROLLOUT_RETURN_IF_ERROR(
          CudaError(cudaEventCreateWithFlags(copied[i].Receive(), cudaEventDisableTiming),
                    "digest staging event"));
    }
    auto enqueue = [&](size_t k) -> absl::Status {
      const Chunk& c = chunks[k];
      const char* from = static_cast<const char*>(tensors[c.tensor].data) + c.begin;
      ROLLOUT_RETURN_IF_ERROR(CudaError(
          cudaMemcpyAsync(host[k % 2].get<uint8_t>(), from, c.size, cudaMemcpyDeviceToHost, stream),
          "copying a tensor to the host to hash it"));
      return CudaError(cudaEventRecord(copied[k % 2].get(), stream), "digest staging event");
    };
    cpu::ThreadPool pool(static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
    ROLLOUT_RETURN_IF_ERROR(enqueue(0));
    for (size_t k = 0; k < chunks.size(); ++k) {
      // Chunk k + 1 lands in the other buffer, whose chunk (k - 1) was hashed already.
      if (k + 1 < chunks.size()) ROLLOUT_RETURN_IF_ERROR(enqueue(k + 1));
      ROLLOUT_RETURN_IF_ERROR(
          CudaError(cudaEventSynchronize(copied[k % 2].get()), "copying a tensor to hash it"));
      const Chunk& c = chunks[k];
      const uint8_t* data = host[k % 2].get<uint8_t>();
      uint8_t* out = leaves[c.tensor].data() + 32 * (c.begin / kDigestLeafBytes);
      const int64_t num_leaves =
          static_cast<int64_t>((c.size + kDigestLeafBytes - 1) / kDigestLeafBytes);
      pool.ParallelFor(num_leaves, 16, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
          const size_t offset = static_cast<size_t>(i) * kDigestLeafBytes;
          const std::string leaf =
              Sha256(data + offset, std::min(kDigestLeafBytes, c.size - offset));
          std::copy(leaf.begin(), leaf.end(), out + 32 * i);
        }
      });
    }
  }
  for (size_t t = 0; t < tensors.size(); ++t) {
    const uint8_t none = 0;  // an empty tensor hashes no leaves
    digests.push_back(Sha256(leaves[t].empty() ? &none : leaves[t].data(), leaves[t].size()));
  }
  return digests;
}

}  // namespace rollout
