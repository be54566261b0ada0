#include "engine/ipc_tensor.h"

#include <set>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_format.h"

namespace rollout {

size_t IpcTensorSource::nbytes() const {
  size_t n = DTypeSize(dtype);
  for (int64_t d : shape) n *= static_cast<size_t>(d);
  return n;
}

absl::StatusOr<std::string> CanonicalGpuUuid(const std::string& uuid) {
  std::string out = absl::AsciiStrToLower(uuid);
  if (absl::StartsWith(out, "gpu-")) out.erase(0, 4);
  constexpr size_t kDashes[] = {8, 13, 18, 23};
  bool ok = out.size() == 36;
  for (size_t i = 0; ok && i < out.size(); ++i) {
    const bool dash = i == kDashes[0] || i == kDashes[1] || i == kDashes[2] || i == kDashes[3];
    ok = dash ? out[i] == '-' : absl::ascii_isxdigit(static_cast<unsigned char>(out[i]));
  }
  if (!ok) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "'%s' is not a GPU UUID; expected 8-4-4-4-12 hex digits, optionally after \"GPU-\" "
        "(nvidia-smi -L; str(torch.cuda.get_device_properties(i).uuid))",
        absl::CHexEscape(uuid)));
  }
  return out;
}

std::string FormatGpuUuid(const unsigned char bytes[16]) {
  std::string out;
  for (int i = 0; i < 16; ++i) {
    if (i == 4 || i == 6 || i == 8 || i == 10) out.push_back('-');
    absl::StrAppendFormat(&out, "%02x", bytes[i]);
  }
  return out;
}

absl::Status CheckIpcTensors(const std::vector<WeightSpec>& specs,
                             const std::vector<IpcTensorSource>& tensors) {
  if (tensors.empty()) {
    return absl::InvalidArgumentError("tensors is empty; name the tensors to replace");
  }
  std::set<std::string> seen;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const IpcTensorSource& t = tensors[i];
    const std::string where = absl::StrFormat("tensors[%d] ('%s')", i, t.name);
    if (absl::Status s = CheckTensorAgainstSpec(specs, t.name, t.dtype, t.shape); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrFormat("tensors[%d]: %s", i, s.message()));
    }
    if (t.ipc_handle.size() != kIpcHandleBytes) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: ipc_handle has %d bytes; a cudaIpcMemHandle_t has %d (torch's _share_cuda_() "
          "prefixes 2 bytes of its own: a version and 'c'; send the 64 after them)",
          where, t.ipc_handle.size(), kIpcHandleBytes));
    }
    if (absl::StatusOr<std::string> uuid = CanonicalGpuUuid(t.device_uuid); !uuid.ok()) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s: device_uuid %s", where, uuid.status().message()));
    } else if (*uuid != t.device_uuid) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: device_uuid '%s' is not canonical (want '%s')", where, t.device_uuid, *uuid));
    }
    if (t.offset_bytes > UINT64_MAX - t.nbytes()) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s: offset_bytes %d overflows with the tensor's %d bytes", where,
                          t.offset_bytes, t.nbytes()));
    }
    if (!seen.insert(t.name).second) {
      return absl::InvalidArgumentError(absl::StrFormat("%s is given twice", where));
    }
  }
  return absl::OkStatus();
}

}  // namespace rollout
