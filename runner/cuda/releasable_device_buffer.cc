#include "runner/cuda/releasable_device_buffer.h"

// Types and prototypes only: every driver function is called through a pointer from
// cudaGetDriverEntryPointByVersion, so nothing here links libcuda.
#include <cuda.h>

#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "glog/logging.h"

namespace rollout {
namespace cuda_runner_internal {
namespace {

// The driver ABI these entry points are asked for (CUDA 12.0's; VMM dates from 10.2).
constexpr unsigned int kDriverAbi = 12000;

// The driver's virtual memory management entry points. Looked up once per process and
// constant after: a table of function pointers, like a dlsym() result, not state.
struct DriverVmm {
  decltype(&cuDeviceGet) device_get = nullptr;
  decltype(&cuDeviceGetAttribute) device_attribute = nullptr;
  decltype(&cuMemGetAllocationGranularity) granularity = nullptr;
  decltype(&cuMemAddressReserve) address_reserve = nullptr;
  decltype(&cuMemAddressFree) address_free = nullptr;
  decltype(&cuMemCreate) create = nullptr;
  decltype(&cuMemRelease) release = nullptr;
  decltype(&cuMemMap) map = nullptr;
  decltype(&cuMemUnmap) unmap = nullptr;
  decltype(&cuMemSetAccess) set_access = nullptr;
  decltype(&cuGetErrorName) error_name = nullptr;
  std::string missing;  // the first entry point not found; empty when all were
};

template <typename Fn>
void Lookup(const char* name, Fn* fn, std::string* missing) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  if (cudaGetDriverEntryPointByVersion(name, &p, kDriverAbi, cudaEnableDefault, &found) !=
          cudaSuccess ||
      found != cudaDriverEntryPointSuccess || p == nullptr) {
    (void)cudaGetLastError();
    if (missing->empty()) *missing = name;
    return;
  }
  *fn = reinterpret_cast<Fn>(p);
}

const DriverVmm& Vmm() {
  static const DriverVmm vmm = [] {
    DriverVmm v;
    Lookup("cuDeviceGet", &v.device_get, &v.missing);
    Lookup("cuDeviceGetAttribute", &v.device_attribute, &v.missing);
    Lookup("cuMemGetAllocationGranularity", &v.granularity, &v.missing);
    Lookup("cuMemAddressReserve", &v.address_reserve, &v.missing);
    Lookup("cuMemAddressFree", &v.address_free, &v.missing);
    Lookup("cuMemCreate", &v.create, &v.missing);
    Lookup("cuMemRelease", &v.release, &v.missing);
    Lookup("cuMemMap", &v.map, &v.missing);
    Lookup("cuMemUnmap", &v.unmap, &v.missing);
    Lookup("cuMemSetAccess", &v.set_access, &v.missing);
    Lookup("cuGetErrorName", &v.error_name, &v.missing);
    return v;
  }();
  return vmm;
}

std::string DriverError(CUresult r) {
  const char* name = nullptr;
  if (Vmm().error_name != nullptr) Vmm().error_name(r, &name);
  return name != nullptr ? name : absl::StrCat("CUresult ", static_cast<int>(r));
}

CUmemAllocationProp DeviceMemory(CUdevice device) {
  CUmemAllocationProp prop = {};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  return prop;
}

// Why `ordinal` cannot have virtual memory management; empty when it can.
std::string NoVmm(int ordinal, CUdevice* device) {
  const DriverVmm& vmm = Vmm();
  if (!vmm.missing.empty()) return absl::StrCat("the driver has no entry point ", vmm.missing);
  if (CUresult r = vmm.device_get(device, ordinal); r != CUDA_SUCCESS) {
    return absl::StrCat("cuDeviceGet: ", DriverError(r));
  }
  int supported = 0;
  CUresult r = vmm.device_attribute(
      &supported, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, *device);
  if (r != CUDA_SUCCESS) return absl::StrCat("cuDeviceGetAttribute: ", DriverError(r));
  if (supported == 0) return "the device does not support virtual memory management";
  return "";
}

}  // namespace

ReleasableDeviceBuffer::ReleasableDeviceBuffer(ReleasableDeviceBuffer&& other) noexcept
    : ptr_(std::exchange(other.ptr_, 0)),
      bytes_(std::exchange(other.bytes_, 0)),
      reserved_(std::exchange(other.reserved_, 0)),
      device_(other.device_),
      vmm_(std::exchange(other.vmm_, false)),
      handle_(std::exchange(other.handle_, 0)),
      released_(std::exchange(other.released_, false)) {}

ReleasableDeviceBuffer& ReleasableDeviceBuffer::operator=(ReleasableDeviceBuffer&& other) noexcept {
  if (this != &other) {
    Reset();
    ptr_ = std::exchange(other.ptr_, 0);
    bytes_ = std::exchange(other.bytes_, 0);
    reserved_ = std::exchange(other.reserved_, 0);
    device_ = other.device_;
    vmm_ = std::exchange(other.vmm_, false);
    handle_ = std::exchange(other.handle_, 0);
    released_ = std::exchange(other.released_, false);
  }
  return *this;
}

cudaError_t ReleasableDeviceBuffer::Allocate(size_t bytes) {
  Reset();
  if (bytes == 0) return cudaSuccess;
  if (cudaError_t e = cudaGetDevice(&device_); e != cudaSuccess) return e;
  // The runtime's context of the device exists before the driver is asked for anything.
  if (cudaError_t e = cudaFree(nullptr); e != cudaSuccess) return e;
  CUdevice device = 0;
  const std::string why = NoVmm(device_, &device);
  if (!why.empty()) {
    LOG(WARNING) << "GPU " << device_ << ": " << why << "; " << bytes
                 << " bytes allocated with cudaMalloc, which ReleaseMemory cannot release";
    void* p = nullptr;
    const cudaError_t e = cudaMalloc(&p, bytes);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();  // returned: not left for the next launch check to report
      return e;
    }
    ptr_ = reinterpret_cast<uintptr_t>(p);
    bytes_ = bytes;
    return cudaSuccess;
  }
  const DriverVmm& vmm = Vmm();
  const CUmemAllocationProp prop = DeviceMemory(device);
  size_t granularity = 0;
  if (vmm.granularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED) != CUDA_SUCCESS ||
      granularity == 0) {
    return cudaErrorNotSupported;
  }
  const size_t reserved = (bytes + granularity - 1) / granularity * granularity;
  CUdeviceptr ptr = 0;
  if (CUresult r = vmm.address_reserve(&ptr, reserved, granularity, 0, 0); r != CUDA_SUCCESS) {
    LOG(WARNING) << "cuMemAddressReserve of " << reserved << " bytes: " << DriverError(r);
    return cudaErrorMemoryAllocation;
  }
  ptr_ = ptr;
  bytes_ = bytes;
  reserved_ = reserved;
  vmm_ = true;
  released_ = true;  // reserved, nothing mapped yet
  if (absl::Status s = Map(); !s.ok()) {
    LOG(WARNING) << s;
    Reset();
    return cudaErrorMemoryAllocation;
  }
  released_ = false;
  return cudaSuccess;
}

absl::Status ReleasableDeviceBuffer::Map() {
  const DriverVmm& vmm = Vmm();
  CUdevice device = 0;
  if (CUresult r = vmm.device_get(&device, device_); r != CUDA_SUCCESS) {
    return absl::InternalError(absl::StrCat("cuDeviceGet: ", DriverError(r)));
  }
  const CUmemAllocationProp prop = DeviceMemory(device);
  CUmemGenericAllocationHandle handle = 0;
  if (CUresult r = vmm.create(&handle, reserved_, &prop, 0); r != CUDA_SUCCESS) {
    const std::string what =
        absl::StrFormat("cuMemCreate of %.2f GiB on GPU %d: %s",
                        static_cast<double>(reserved_) / (1 << 30), device_, DriverError(r));
    if (r == CUDA_ERROR_OUT_OF_MEMORY) return absl::ResourceExhaustedError(what);
    return absl::InternalError(what);
  }
  if (CUresult r = vmm.map(ptr_, reserved_, 0, handle, 0); r != CUDA_SUCCESS) {
    vmm.release(handle);
    return absl::InternalError(absl::StrCat("cuMemMap: ", DriverError(r)));
  }
  CUmemAccessDesc access = {};
  access.location = prop.location;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  if (CUresult r = vmm.set_access(ptr_, reserved_, &access, 1); r != CUDA_SUCCESS) {
    vmm.unmap(ptr_, reserved_);
    vmm.release(handle);
    return absl::InternalError(absl::StrCat("cuMemSetAccess: ", DriverError(r)));
  }
  handle_ = handle;
  return absl::OkStatus();
}

void ReleasableDeviceBuffer::Unmap() {
  const DriverVmm& vmm = Vmm();
  vmm.unmap(ptr_, reserved_);
  vmm.release(handle_);
  handle_ = 0;
}

void ReleasableDeviceBuffer::Reset() {
  if (ptr_ != 0) {
    if (vmm_) {
      if (!released_) Unmap();
      Vmm().address_free(ptr_, reserved_);
    } else {
      cudaFree(reinterpret_cast<void*>(ptr_));
    }
  }
  ptr_ = 0;
  bytes_ = 0;
  reserved_ = 0;
  vmm_ = false;
  handle_ = 0;
  released_ = false;
}

absl::Status ReleasableDeviceBuffer::Release() {
  if (released_ || ptr_ == 0) return absl::OkStatus();
  if (!vmm_) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "GPU %d: its memory was allocated without CUDA virtual memory management (the start-up "
        "log says why), so it cannot be released and re-acquired at the same addresses",
        device_));
  }
  const DriverVmm& vmm = Vmm();
  if (CUresult r = vmm.unmap(ptr_, reserved_); r != CUDA_SUCCESS) {
    return absl::InternalError(absl::StrCat("cuMemUnmap: ", DriverError(r)));
  }
  const CUresult freed = vmm.release(handle_);
  // Unmapped either way: the addresses are unusable until Reacquire.
  handle_ = 0;
  released_ = true;
  if (freed != CUDA_SUCCESS) {
    return absl::InternalError(absl::StrCat("cuMemRelease: ", DriverError(freed)));
  }
  return absl::OkStatus();
}

absl::Status ReleasableDeviceBuffer::Reacquire() {
  if (!released_) return absl::OkStatus();
  if (absl::Status s = Map(); !s.ok()) return s;
  released_ = false;
  return absl::OkStatus();
}

}  // namespace cuda_runner_internal
}  // namespace rollout
