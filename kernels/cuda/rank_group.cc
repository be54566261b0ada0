// The same-device RankGroup: ranks on one GPU, exchanges by device copies
// between their streams.
#include "kernels/cuda/rank_group.h"

#include "common/status.h"

#include <string>
#include <utility>

namespace rollout::cuda {
namespace {

GroupStatus CudaStatus(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return GroupStatus::Ok();
  return GroupStatus::Error(std::string(what) + ": " + cudaGetErrorName(err) + " (" +
                            cudaGetErrorString(err) + ")");
}

class SameDeviceGroup final : public RankGroup {
 public:
  explicit SameDeviceGroup(std::vector<cudaStream_t> streams) : streams_(std::move(streams)) {}
  ~SameDeviceGroup() override {
    for (cudaEvent_t e : ready_) cudaEventDestroy(e);
    for (cudaEvent_t e : read_) cudaEventDestroy(e);
  }

  GroupStatus Init() {
    for (size_t r = 0; r < streams_.size(); ++r) {
      cudaEvent_t ready = nullptr, read = nullptr;
      ROLLOUT_RETURN_IF_ERROR(
          CudaStatus(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming), "cudaEventCreate"));
      ready_.push_back(ready);
      ROLLOUT_RETURN_IF_ERROR(
          CudaStatus(cudaEventCreateWithFlags(&read, cudaEventDisableTiming), "cudaEventCreate"));
      read_.push_back(read);
    }
    return GroupStatus::Ok();
  }

  int world_size() const override { return static_cast<int>(streams_.size()); }
  const char* kind() const override { return "same-device"; }

  GroupStatus AllGather(const float* const* send, int64_t count, float* const* recv) override {
    const int n = world_size();
    const size_t bytes = static_cast<size_t>(count) * sizeof(float);
    if (count == 0) return GroupStatus::Ok();
    // A stream waits on the latest record of an event at the time of the wait
    // call, so one event per rank per round serves every call (all enqueued by
    // this one thread, in order).
    for (int r = 0; r < n; ++r) {
      ROLLOUT_RETURN_IF_ERROR(
          CudaStatus(cudaEventRecord(ready_[r], streams_[r]), "all-gather: cudaEventRecord"));
    }
    for (int r = 0; r < n; ++r) {
      for (int i = 0; i < n; ++i) {
        float* dst = recv[r] + i * count;
        if (dst == send[i]) continue;  // rank r's own slot, in place
        if (i != r) {
          ROLLOUT_RETURN_IF_ERROR(CudaStatus(cudaStreamWaitEvent(streams_[r], ready_[i], 0),
                                             "all-gather: cudaStreamWaitEvent"));
        }
        ROLLOUT_RETURN_IF_ERROR(
            CudaStatus(cudaMemcpyAsync(dst, send[i], bytes, cudaMemcpyDeviceToDevice, streams_[r]),
                       "all-gather: cudaMemcpyAsync"));
      }
    }
    if (n == 1) return GroupStatus::Ok();
    for (int r = 0; r < n; ++r) {
      ROLLOUT_RETURN_IF_ERROR(
          CudaStatus(cudaEventRecord(read_[r], streams_[r]), "all-gather: cudaEventRecord"));
    }
    for (int r = 0; r < n; ++r) {
      for (int i = 0; i < n; ++i) {
        if (i == r) continue;
        ROLLOUT_RETURN_IF_ERROR(CudaStatus(cudaStreamWaitEvent(streams_[r], read_[i], 0),
                                           "all-gather: cudaStreamWaitEvent"));
      }
    }
    return GroupStatus::Ok();
  }

 private:
  const std::vector<cudaStream_t> streams_;
  std::vector<cudaEvent_t> ready_;  // [rank]: its send buffer is written
  std::vector<cudaEvent_t> read_;   // [rank]: it has copied every peer's send buffer
};

}  // namespace

GroupStatus CreateSameDeviceGroup(const std::vector<cudaStream_t>& streams,
                                  std::unique_ptr<RankGroup>* group) {
  if (streams.empty()) return GroupStatus::Error("a rank group needs at least one rank");
  auto g = std::make_unique<SameDeviceGroup>(streams);
  ROLLOUT_RETURN_IF_ERROR(g->Init());
  *group = std::move(g);
  return GroupStatus::Ok();
}

}  // namespace rollout::cuda
