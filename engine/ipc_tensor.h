#pragma once

// Weight updates from a colocated trainer (UpdateWeightsFromIpc): tensors that another process
// on this host holds in device memory, named by CUDA IPC exports. The engine sees the handles as
// opaque bytes (engine/ has no CUDA type); only a backend that reads device memory opens them
// (ModelRunner::OpenIpcTensors).

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "model/safetensors.h"
#include "model/weight_digest.h"
#include "model/weight_spec.h"

namespace rollout {

// sizeof(cudaIpcMemHandle_t).
inline constexpr size_t kIpcHandleBytes = 64;

// One tensor of an IPC update: `shape` elements of `dtype`, contiguous and row-major, starting
// `offset_bytes` into the device allocation that `ipc_handle` exports, on the GPU `device_uuid`.
struct IpcTensorSource {
  std::string name;
  DType dtype = DType::kBF16;
  std::vector<int64_t> shape;
  std::string ipc_handle;  // kIpcHandleBytes bytes: a cudaIpcMemHandle_t
  uint64_t offset_bytes = 0;
  std::string device_uuid;  // canonical (CanonicalGpuUuid)
  size_t nbytes() const;
};

// The IPC exports of one update, opened by a runner (ModelRunner::OpenIpcTensors): mapped into
// this process until this object is destroyed, which unmaps every one of them. Owned by the
// engine thread, like the runner that made it, which must outlive it.
class OpenedIpcTensors {
 public:
  virtual ~OpenedIpcTensors() = default;
  // The tensor digest (model/weight_digest.h) of each opened tensor's bytes, by name: the same
  // as any other path gives for the same bytes.
  virtual const TensorDigests& digests() const = 0;
};

// A GPU UUID as 8-4-4-4-12 lowercase hex digits: what str(torch.cuda.get_device_properties(i)
// .uuid) prints, and nvidia-smi -L after its "GPU-". Accepts either spelling (any case);
// INVALID_ARGUMENT for anything else.
absl::StatusOr<std::string> CanonicalGpuUuid(const std::string& uuid);

// The 16 bytes of a UUID in canonical form.
std::string FormatGpuUuid(const unsigned char bytes[16]);

// Checks an IPC update's tensors before any backend sees them: at least one; each a weight of
// `specs` with its dtype and shape; handles of kIpcHandleBytes; device UUIDs canonical; no name
// twice. INVALID_ARGUMENT naming the tensor ("tensors[i] ('name'): ...") otherwise.
absl::Status CheckIpcTensors(const std::vector<WeightSpec>& specs,
                             const std::vector<IpcTensorSource>& tensors);

}  // namespace rollout
