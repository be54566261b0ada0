// The NCCL RankGroup: one device per rank, NCCL loaded with dlopen() at run
// time. Debian has no NCCL package, so the build cannot link it (CI has neither
// a GPU nor NCCL); a GPU host brings its own (e.g. the one inside its PyTorch
// environment). What this file needs of NCCL's public API (nccl.h, stable
// across NCCL 2.x) is declared below by hand: a few functions, the opaque
// communicator, the 128-byte unique id, and two enum values.
#include <dlfcn.h>

#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "common/cuda_device_scope.h"
#include "common/status.h"
#include "kernels/cuda/rank_group.h"

namespace rollout::cuda {
namespace {

// nccl.h: typedef struct ncclComm* ncclComm_t; typedef struct { char
// internal[128]; } ncclUniqueId (NCCL_UNIQUE_ID_BYTES = 128, passed by value to
// ncclCommInitRank); ncclResult_t and ncclDataType_t are C enums (int-sized):
// ncclSuccess = 0, ncclFloat32 = 7.
struct NcclComm;
using NcclCommHandle = NcclComm*;
struct NcclUniqueId {
  char internal[128];
};
using NcclResult = int;
constexpr NcclResult kNcclSuccess = 0;
constexpr int kNcclFloat32 = 7;

// The loaded library and its entry points. Closed (dlclose) on destruction;
// communicators made through it must be destroyed first.
class NcclLibrary {
 public:
  ~NcclLibrary() {
    if (handle_ != nullptr) dlclose(handle_);
  }

  GroupStatus Load(const std::string& path) {
    const std::string name = path.empty() ? "libnccl.so.2" : path;
    handle_ = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle_ == nullptr) {
      const char* why = dlerror();
      return GroupStatus::Error("cannot load NCCL (" + name + "): " + (why ? why : "dlopen"));
    }
    GroupStatus status = GroupStatus::Ok();
    auto bind = [&](auto* fn, const char* symbol) {
      void* p = dlsym(handle_, symbol);
      if (p == nullptr && status.ok()) {
        status = GroupStatus::Error(name + " lacks " + symbol);
      }
      *fn = reinterpret_cast<std::remove_pointer_t<decltype(fn)>>(p);
    };
    bind(&GetVersion, "ncclGetVersion");
    bind(&GetUniqueId, "ncclGetUniqueId");
    bind(&CommInitRank, "ncclCommInitRank");
    bind(&CommDestroy, "ncclCommDestroy");
    bind(&AllGatherFn, "ncclAllGather");
    bind(&GroupStart, "ncclGroupStart");
    bind(&GroupEnd, "ncclGroupEnd");
    bind(&GetErrorString, "ncclGetErrorString");
    return status;
  }

  GroupStatus Check(NcclResult result, const char* what) const {
    if (result == kNcclSuccess) return GroupStatus::Ok();
    const char* text = GetErrorString != nullptr ? GetErrorString(result) : nullptr;
    return GroupStatus::Error(std::string(what) + ": NCCL error " + std::to_string(result) +
                              (text != nullptr ? std::string(" (") + text + ")" : ""));
  }

  NcclResult (*GetVersion)(int* version) = nullptr;
  NcclResult (*GetUniqueId)(NcclUniqueId* id) = nullptr;
  NcclResult (*CommInitRank)(NcclCommHandle* comm, int nranks, NcclUniqueId id, int rank) = nullptr;
  NcclResult (*CommDestroy)(NcclCommHandle comm) = nullptr;
  NcclResult (*AllGatherFn)(const void* send, void* recv, size_t send_count, int data_type,
                            NcclCommHandle comm, cudaStream_t stream) = nullptr;
  NcclResult (*GroupStart)() = nullptr;
  NcclResult (*GroupEnd)() = nullptr;
  const char* (*GetErrorString)(NcclResult result) = nullptr;

 private:
  void* handle_ = nullptr;
};

class NcclGroup final : public RankGroup {
 public:
  NcclGroup(std::unique_ptr<NcclLibrary> nccl, std::vector<int> devices,
            std::vector<cudaStream_t> streams)
      : nccl_(std::move(nccl)), devices_(std::move(devices)), streams_(std::move(streams)) {}
  ~NcclGroup() override {
    for (NcclCommHandle comm : comms_) {
      if (comm != nullptr) nccl_->CommDestroy(comm);
    }
  }

  GroupStatus Init() {
    CudaDeviceScope guard;
    NcclUniqueId id{};
    ROLLOUT_RETURN_IF_ERROR(nccl_->Check(nccl_->GetUniqueId(&id), "ncclGetUniqueId"));
    const int n = world_size();
    comms_.assign(n, nullptr);
    // Every device must be usable before the group starts: a group that ends with fewer than
    // n ncclCommInitRank calls would wait for the missing peers forever.
    for (int r = 0; r < n; ++r) {
      const cudaError_t err = cudaSetDevice(devices_[r]);
      if (err != cudaSuccess) {
        return GroupStatus::Error(std::string("cudaSetDevice(") + std::to_string(devices_[r]) +
                                  "): " + cudaGetErrorName(err));
      }
    }
    // ncclCommInitRank waits for its peers: inside one group, one thread may
    // create them all.
    ROLLOUT_RETURN_IF_ERROR(nccl_->Check(nccl_->GroupStart(), "ncclGroupStart"));
    GroupStatus status = GroupStatus::Ok();
    for (int r = 0; r < n && status.ok(); ++r) {
      const cudaError_t err = cudaSetDevice(devices_[r]);
      if (err != cudaSuccess) {
        status = GroupStatus::Error(std::string("cudaSetDevice: ") + cudaGetErrorName(err));
        break;
      }
      status = nccl_->Check(nccl_->CommInitRank(&comms_[r], n, id, r), "ncclCommInitRank");
    }
    const GroupStatus ended = nccl_->Check(nccl_->GroupEnd(), "ncclGroupEnd (communicator init)");
    return status.ok() ? ended : status;
  }

  int world_size() const override { return static_cast<int>(devices_.size()); }
  const char* kind() const override { return "nccl"; }

  GroupStatus AllGather(const float* const* send, int64_t count, float* const* recv) override {
    if (count == 0) return GroupStatus::Ok();
    CudaDeviceScope guard;
    ROLLOUT_RETURN_IF_ERROR(nccl_->Check(nccl_->GroupStart(), "ncclGroupStart"));
    GroupStatus status = GroupStatus::Ok();
    for (int r = 0; r < world_size() && status.ok(); ++r) {
      const cudaError_t err = cudaSetDevice(devices_[r]);
      if (err != cudaSuccess) {
        status = GroupStatus::Error(std::string("cudaSetDevice: ") + cudaGetErrorName(err));
        break;
      }
      status = nccl_->Check(nccl_->AllGatherFn(send[r], recv[r], static_cast<size_t>(count),
                                               kNcclFloat32, comms_[r], streams_[r]),
                            "ncclAllGather");
    }
    const GroupStatus ended = nccl_->Check(nccl_->GroupEnd(), "ncclGroupEnd (all-gather)");
    return status.ok() ? ended : status;
  }

 private:
  const std::unique_ptr<NcclLibrary> nccl_;  // outlives comms_ (destroyed after the body)
  const std::vector<int> devices_;
  const std::vector<cudaStream_t> streams_;
  std::vector<NcclCommHandle> comms_;
};

}  // namespace

GroupStatus CreateNcclGroup(const std::vector<int>& devices,
                            const std::vector<cudaStream_t>& streams, const std::string& library,
                            std::unique_ptr<RankGroup>* group) {
  if (devices.empty() || devices.size() != streams.size()) {
    return GroupStatus::Error("an NCCL group needs one device and one stream per rank");
  }
  auto nccl = std::make_unique<NcclLibrary>();
  ROLLOUT_RETURN_IF_ERROR(nccl->Load(library));
  auto g = std::make_unique<NcclGroup>(std::move(nccl), devices, streams);
  ROLLOUT_RETURN_IF_ERROR(g->Init());
  *group = std::move(g);
  return GroupStatus::Ok();
}

GroupStatus NcclLibraryVersion(const std::string& library, int* version) {
  NcclLibrary nccl;
  ROLLOUT_RETURN_IF_ERROR(nccl.Load(library));
  return nccl.Check(nccl.GetVersion(version), "ncclGetVersion");
}

}  // namespace rollout::cuda
