// CudaModelRunner's weight updates from a colocated process's device memory (engine/ipc_tensor.h):
// the exports opened once per distinct handle, every tensor checked to lie inside its exported
// allocation and hashed where it is (device_tensor_digest.h), then copied device to device
// through the same bindings a host update writes (weight_binding.h).
#include <cuda.h>  // CUdeviceptr and CUresult for the driver entry point; links nothing
#include <cuda_runtime.h>

#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_format.h"
#include "common/cuda_device_scope.h"
#include "common/cuda_status.h"
#include "common/status.h"
#include "engine/ipc_tensor.h"
#include "glog/logging.h"
#include "runner/cuda/cuda_model_runner.h"
#include "runner/cuda/cuda_runner_state.h"
#include "runner/cuda/device_tensor_digest.h"
#include "runner/cuda/device_weight_copy.h"

namespace rollout {
namespace {

// The exports of one update mapped into this process, closed (on their device) on destruction.
class CudaIpcTensors final : public OpenedIpcTensors {
 public:
  struct Tensor {
    std::string name;
    DType dtype;
    const char* data;  // the tensor's first byte, in an opened mapping
  };

  CudaIpcTensors(const void* owner, int device) : owner_(owner), device_(device) {}
  ~CudaIpcTensors() override {
    CudaDeviceScope scope;
    cudaSetDevice(device_);
    for (void* base : mapped_) {
      if (const cudaError_t e = cudaIpcCloseMemHandle(base); e != cudaSuccess) {
        LOG(WARNING) << "cudaIpcCloseMemHandle: " << cudaGetErrorName(e);
      }
    }
  }
  CudaIpcTensors(const CudaIpcTensors&) = delete;
  CudaIpcTensors& operator=(const CudaIpcTensors&) = delete;

  const TensorDigests& digests() const override { return digests_; }

  const void* owner() const { return owner_; }
  std::vector<Tensor> tensors;
  std::vector<void*> mapped_;  // every base cudaIpcOpenMemHandle returned, to close
  TensorDigests digests_;

 private:
  const void* const owner_;  // the runner that opened them
  const int device_;
};

// cuMemGetAddressRange through the runtime's driver entry point: the module links no libcuda
// (CI has none), and the runtime finds the driver's at run time.
using GetAddressRange = CUresult (*)(CUdeviceptr* base, size_t* size, CUdeviceptr ptr);

absl::StatusOr<GetAddressRange> AddressRangeFunction() {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  const cudaError_t e = cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fn, 12000,
                                                         cudaEnableDefault, &found);
  if (e != cudaSuccess || found != cudaDriverEntryPointSuccess || fn == nullptr) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "the CUDA driver has no cuMemGetAddressRange (%s): IPC updates need a CUDA 12 driver",
        cudaGetErrorName(e)));
  }
  return reinterpret_cast<GetAddressRange>(fn);
}

}  // namespace

absl::StatusOr<std::unique_ptr<OpenedIpcTensors>> CudaModelRunner::OpenIpcTensors(
    const std::vector<IpcTensorSource>& tensors) {
  State& s = *state_;
  if (s.multi_device) {
    return absl::FailedPreconditionError(
        "IPC weight updates into ranks on several GPUs (--devices) are not supported; use "
        "UpdateWeights or UpdateWeightsFromPath");
  }
  ROLLOUT_RETURN_IF_ERROR(CheckIpcTensors(s.weight_specs, tensors));
  const int device = s.ranks[0].device;
  ROLLOUT_RETURN_IF_ERROR(CudaError(cudaSetDevice(device), "cudaSetDevice"));
  cudaDeviceProp prop;
  ROLLOUT_RETURN_IF_ERROR(CudaError(cudaGetDeviceProperties(&prop, device), "the GPU's UUID"));
  const std::string served_uuid =
      FormatGpuUuid(reinterpret_cast<const unsigned char*>(prop.uuid.bytes));
  // Every tensor's GPU first: a handle of another GPU would open (as a peer mapping), and then
  // copy at a fraction of the local bandwidth.
  for (const IpcTensorSource& t : tensors) {
    if (t.device_uuid != served_uuid) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "tensor '%s' is on GPU %s; this server's weights are on GPU %s (device %d): an IPC "
          "update needs the trainer's tensors on the server's GPU",
          t.name, t.device_uuid, served_uuid, device));
    }
  }
  absl::StatusOr<GetAddressRange> address_range = AddressRangeFunction();
  if (!address_range.ok()) return address_range.status();
  auto opened = std::make_unique<CudaIpcTensors>(this, device);
  struct Mapping {
    const char* base;
    size_t size;
  };
  std::map<std::string, Mapping> mappings;  // by handle: each distinct export opened once
  std::vector<DeviceBytes> bytes;
  for (const IpcTensorSource& t : tensors) {
    auto it = mappings.find(t.ipc_handle);
    if (it == mappings.end()) {
      cudaIpcMemHandle_t handle;
      std::memcpy(&handle, t.ipc_handle.data(), sizeof(handle));
      void* base = nullptr;
      const cudaError_t e = cudaIpcOpenMemHandle(&base, handle, cudaIpcMemLazyEnablePeerAccess);
      if (e != cudaSuccess) {
        cudaGetLastError();  // not sticky: clear it, the runner serves on
        return absl::InvalidArgumentError(absl::StrFormat(
            "tensor '%s': its ipc_handle does not open (cudaIpcOpenMemHandle: %s, %s): it must "
            "be a live export of another process on this host -- not freed, not of an exited "
            "process, not of this server itself",
            t.name, cudaGetErrorName(e), cudaGetErrorString(e)));
      }
      opened->mapped_.push_back(base);
      CUdeviceptr range_base = 0;
      size_t range_size = 0;
      if (const CUresult r =
              (*address_range)(&range_base, &range_size, reinterpret_cast<CUdeviceptr>(base));
          r != CUDA_SUCCESS) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "tensor '%s': the size of its exported allocation is unknown (cuMemGetAddressRange: "
            "error %d)",
            t.name, static_cast<int>(r)));
      }
      // The handle maps the allocation from its start; a range that starts before the mapping
      // would make every offset wrong.
      const size_t skipped = reinterpret_cast<CUdeviceptr>(base) - range_base;
      it = mappings
               .emplace(t.ipc_handle, Mapping{static_cast<const char*>(base), range_size - skipped})
               .first;
    }
    const Mapping& m = it->second;
    const size_t n = t.nbytes();
    if (t.offset_bytes > m.size || n > m.size - t.offset_bytes) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "tensor '%s': bytes [%d, %d) lie outside its exported allocation of %d bytes; "
          "offset_bytes must be the tensor's offset in the allocation (torch: the storage "
          "offset _share_cuda_() gives plus storage_offset() * element_size())",
          t.name, t.offset_bytes, t.offset_bytes + n, m.size));
    }
    opened->tensors.push_back({t.name, t.dtype, m.base + t.offset_bytes});
    bytes.push_back({m.base + t.offset_bytes, n});
  }
  absl::StatusOr<std::vector<std::string>> digests = DigestDeviceTensors(bytes, s.stream);
  if (!digests.ok()) return digests.status();
  for (size_t i = 0; i < tensors.size(); ++i) opened->digests_[tensors[i].name] = (*digests)[i];
  return std::unique_ptr<OpenedIpcTensors>(std::move(opened));
}

absl::Status CudaModelRunner::UpdateWeightsFromIpc(const OpenedIpcTensors& opened) {
  State& s = *state_;
  const auto* ipc = dynamic_cast<const CudaIpcTensors*>(&opened);
  if (ipc == nullptr || ipc->owner() != this) {
    return absl::InternalError("UpdateWeightsFromIpc: these tensors were opened by another runner");
  }
  ROLLOUT_RETURN_IF_ERROR(CudaError(cudaSetDevice(s.ranks[0].device), "cudaSetDevice"));
  // Between steps: nothing of ours is in flight, but be explicit.
  ROLLOUT_RETURN_IF_ERROR(CudaError(cudaStreamSynchronize(s.stream), "weight update"));
  for (const CudaIpcTensors::Tensor& t : ipc->tensors) {
    ROLLOUT_RETURN_IF_ERROR(
        CudaError(CopyWeightFromDevice(s.bindings.at(t.name), t.dtype, t.data, s.stream),
                  absl::StrFormat("copying %s from its IPC export", t.name)));
  }
  // Done before the exports are closed and before the next step reads the weights.
  return CudaError(cudaStreamSynchronize(s.stream), "IPC weight update");
}

}  // namespace rollout
