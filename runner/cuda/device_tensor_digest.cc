#include "runner/cuda/device_tensor_digest.h"

#include <cstdint>

#include "common/cuda_status.h"
#include "common/status.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/device_digest.h"

namespace rollout {

absl::StatusOr<std::vector<std::string>> DigestDeviceTensors(
    const std::vector<DeviceBytes>& tensors, cudaStream_t stream) {
  const size_t n = tensors.size();
  std::vector<std::string> digests;
  if (n == 0) return digests;
  std::vector<cuda::DeviceDigestTensor> batch(n);
  for (size_t i = 0; i < n; ++i) batch[i] = {tensors[i].data, tensors[i].size};
  const size_t workspace_bytes = cuda::DeviceDigestWorkspaceBytes(batch.data(), n);
  cuda::DeviceBuffer workspace, device_digests;
  cuda::PinnedHostBuffer host_digests;
  // cudaMalloc'd memory is 256-byte aligned, as the kernels want 16.
  ROLLOUT_RETURN_IF_ERROR(CudaError(workspace.Allocate(workspace_bytes == 0 ? 16 : workspace_bytes),
                                    "allocating the digest workspace"));
  ROLLOUT_RETURN_IF_ERROR(
      CudaError(device_digests.Allocate(cuda::kDigestBytes * n), "allocating the tensor digests"));
  ROLLOUT_RETURN_IF_ERROR(
      CudaError(host_digests.Allocate(cuda::kDigestBytes * n), "pinning the tensor digests"));
  ROLLOUT_RETURN_IF_ERROR(
      CudaError(cuda::DeviceTensorDigests(batch.data(), n, workspace.get(), workspace.bytes(),
                                          device_digests.get<uint8_t>(), stream),
                "hashing tensors on the device"));
  ROLLOUT_RETURN_IF_ERROR(
      CudaError(cudaMemcpyAsync(host_digests.get(), device_digests.get(), cuda::kDigestBytes * n,
                                cudaMemcpyDeviceToHost, stream),
                "copying the tensor digests"));
  ROLLOUT_RETURN_IF_ERROR(
      CudaError(cudaStreamSynchronize(stream), "hashing tensors on the device"));
  const char* out = host_digests.get<char>();
  for (size_t i = 0; i < n; ++i) {
    digests.emplace_back(out + cuda::kDigestBytes * i, cuda::kDigestBytes);
  }
  return digests;
}

}  // namespace rollout
