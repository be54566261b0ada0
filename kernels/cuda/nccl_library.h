#pragma once

// NCCL loaded with dlopen() at run time, for the tensor-parallel NcclGroup (nccl_group.cc) and
// the weight-sync groups of fleets (runner/cuda/weight_sync_member.cc). Debian has no NCCL
// package, so the build cannot link it (CI has neither a GPU nor NCCL); a GPU host brings its
// own (e.g. the one inside its PyTorch environment). What is used of NCCL's public API (nccl.h,
// stable across NCCL 2.x) is declared here by hand: a few functions, the opaque communicator,
// the 128-byte unique id, the communicator config as NCCL 2.17 laid it out, and enum values.
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <climits>
#include <cstddef>
#include <string>
#include <type_traits>

#include "kernels/cuda/rank_group.h"

namespace rollout::cuda {

// nccl.h: typedef struct ncclComm* ncclComm_t; typedef struct { char internal[128]; }
// ncclUniqueId (passed by value to ncclCommInitRank*); ncclResult_t and ncclDataType_t are C
// enums (int-sized).
struct NcclComm;
using NcclCommHandle = NcclComm*;
struct NcclUniqueId {
  char internal[128];
};
using NcclResult = int;
constexpr NcclResult kNcclSuccess = 0;
constexpr NcclResult kNcclInProgress = 7;  // a non-blocking communicator's call is still running
constexpr int kNcclUint8 = 1;
constexpr int kNcclFloat32 = 7;

// ncclConfig_t up to the fields NCCL 2.17 has (its version field says so): NCCL reads `size`
// bytes of it and gives the fields of later versions their defaults. NCCL_CONFIG_INITIALIZER:
// size, magic 0xcafebeef, the version, then every field NCCL_CONFIG_UNDEF_INT (INT_MIN) or null.
struct NcclConfig {
  size_t size = sizeof(NcclConfig);
  unsigned int magic = 0xcafebeef;
  unsigned int version = 21700;  // NCCL_VERSION(2, 17, 0)
  int blocking = INT_MIN;        // 0: calls return ncclInProgress and complete asynchronously
  int cga_cluster_size = INT_MIN;
  int min_ctas = INT_MIN;
  int max_ctas = INT_MIN;
  const char* net_name = nullptr;
  int split_share = INT_MIN;
};

// The loaded library and its entry points. Closed (dlclose) on destruction; communicators made
// through it must be destroyed first. Load once; then any thread may call the entry points as
// NCCL allows.
class NcclLibrary {
 public:
  NcclLibrary() = default;
  ~NcclLibrary() {
    if (handle_ != nullptr) dlclose(handle_);
  }
  NcclLibrary(const NcclLibrary&) = delete;
  NcclLibrary& operator=(const NcclLibrary&) = delete;

  // `path`: a file, or "" for libnccl.so.2 on the loader's search path. Fails when the library
  // does not load or lacks what tensor parallelism needs; the weight-sync entry points (NCCL >=
  // 2.14) are optional here: has_nonblocking() says whether they are there.
  GroupStatus Load(const std::string& path) {
    name_ = path.empty() ? "libnccl.so.2" : path;
    handle_ = dlopen(name_.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle_ == nullptr) {
      const char* why = dlerror();
      return GroupStatus::Error("cannot load NCCL (" + name_ + "): " + (why ? why : "dlopen"));
    }
    GroupStatus status = GroupStatus::Ok();
    auto bind = [&](auto* fn, const char* symbol, bool required) {
      void* p = dlsym(handle_, symbol);
      if (p == nullptr && required && status.ok()) {
        status = GroupStatus::Error(name_ + " lacks " + symbol);
      }
      *fn = reinterpret_cast<std::remove_pointer_t<decltype(fn)>>(p);
    };
    bind(&GetVersion, "ncclGetVersion", true);
    bind(&GetUniqueId, "ncclGetUniqueId", true);
    bind(&CommInitRank, "ncclCommInitRank", true);
    bind(&CommDestroy, "ncclCommDestroy", true);
    bind(&AllGatherFn, "ncclAllGather", true);
    bind(&GroupStart, "ncclGroupStart", true);
    bind(&GroupEnd, "ncclGroupEnd", true);
    bind(&GetErrorString, "ncclGetErrorString", true);
    bind(&CommInitRankConfig, "ncclCommInitRankConfig", false);
    bind(&CommGetAsyncError, "ncclCommGetAsyncError", false);
    bind(&CommAbort, "ncclCommAbort", false);
    bind(&BroadcastFn, "ncclBroadcast", false);
    return status;
  }

  const std::string& name() const { return name_; }
  // What weight-sync groups need: non-blocking communicators that can be aborted.
  bool has_nonblocking() const {
    return CommInitRankConfig != nullptr && CommGetAsyncError != nullptr && CommAbort != nullptr &&
           BroadcastFn != nullptr;
  }

  GroupStatus Check(NcclResult result, const char* what) const {
    if (result == kNcclSuccess) return GroupStatus::Ok();
    return GroupStatus::Error(std::string(what) + ": " + Describe(result));
  }
  // "NCCL error N (text)".
  std::string Describe(NcclResult result) const {
    const char* text = GetErrorString != nullptr ? GetErrorString(result) : nullptr;
    return "NCCL error " + std::to_string(result) +
           (text != nullptr ? std::string(" (") + text + ")" : "");
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
  // NCCL >= 2.14.
  NcclResult (*CommInitRankConfig)(NcclCommHandle* comm, int nranks, NcclUniqueId id, int rank,
                                   NcclConfig* config) = nullptr;
  NcclResult (*CommGetAsyncError)(NcclCommHandle comm, NcclResult* state) = nullptr;
  NcclResult (*CommAbort)(NcclCommHandle comm) = nullptr;
  NcclResult (*BroadcastFn)(const void* send, void* recv, size_t count, int data_type, int root,
                            NcclCommHandle comm, cudaStream_t stream) = nullptr;

 private:
  void* handle_ = nullptr;
  std::string name_;
};

}  // namespace rollout::cuda
