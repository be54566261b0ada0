// The NCCL RankGroup: one device per rank, NCCL loaded with dlopen() at run time
// (kernels/cuda/nccl_library.h says why and what of its API is used).
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/cuda_device_scope.h"
#include "common/status.h"
#include "kernels/cuda/nccl_library.h"
#include "kernels/cuda/rank_group.h"

namespace rollout::cuda {
namespace {

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

  bool can_hang() const override { return true; }

  GroupStatus CheckAsync() override {
    if (aborted_) return GroupStatus::Error("the NCCL group was aborted");
    if (nccl_->CommGetAsyncError == nullptr) return GroupStatus::Ok();  // NCCL < 2.14
    for (int r = 0; r < world_size(); ++r) {
      NcclResult state = kNcclSuccess;
      ROLLOUT_RETURN_IF_ERROR(
          nccl_->Check(nccl_->CommGetAsyncError(comms_[r], &state), "ncclCommGetAsyncError"));
      if (state != kNcclSuccess && state != kNcclInProgress) {
        return GroupStatus::Error("rank " + std::to_string(r) + " (GPU " +
                                  std::to_string(devices_[r]) + "): " + nccl_->Describe(state));
      }
    }
    return GroupStatus::Ok();
  }

  void Abort() override {
    if (aborted_) return;
    aborted_ = true;
    if (nccl_->CommAbort == nullptr) return;  // NCCL < 2.14: the communicators stay
    CudaDeviceScope guard;
    for (int r = 0; r < world_size(); ++r) {
      if (comms_[r] == nullptr) continue;
      cudaSetDevice(devices_[r]);
      nccl_->CommAbort(comms_[r]);  // frees the communicator
      comms_[r] = nullptr;
    }
  }

  GroupStatus AllGather(const float* const* send, int64_t count, float* const* recv) override {
    if (aborted_) return GroupStatus::Error("the NCCL group was aborted");
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
  bool aborted_ = false;
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
