#pragma once

// This server's rank of an NCCL weight-sync group (engine/weight_sync.h's WeightSyncMember) on
// one device, with a deadline on every wait: the communicator is made non-blocking
// (ncclCommInitRankConfig with blocking = 0) and every call is polled -- ncclCommGetAsyncError
// for NCCL's own progress, a CUDA event for the device's -- until it completes, the timeout
// passes or the caller gives up; then ncclCommAbort, which also stops kernels that wait for a
// peer that never sends. Nothing can hang forever. Internal to runner/cuda/.

#include <cuda_runtime.h>

#include <chrono>
#include <memory>

#include "absl/status/statusor.h"
#include "engine/weight_sync.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/nccl_library.h"
#include "runner/cuda/cuda_handles.h"

namespace rollout {

class CudaWeightSyncMember final : public WeightSyncMember {
 public:
  // Joins as spec.rank of spec.world_size on `device`, through `nccl` (loaded; it must
  // has_nonblocking()). DEADLINE_EXCEEDED when the ranks do not all join within spec.timeout,
  // CANCELLED once `give_up`, INTERNAL naming the NCCL or CUDA call otherwise; the communicator
  // is aborted on every failure.
  static absl::StatusOr<std::unique_ptr<CudaWeightSyncMember>> Join(
      std::shared_ptr<const cuda::NcclLibrary> nccl, int device, const WeightSyncGroupSpec& spec,
      const GiveUp& give_up);
  // Aborts the communicator (local: no peer is waited for), then frees the rest.
  ~CudaWeightSyncMember() override;
  CudaWeightSyncMember(const CudaWeightSyncMember&) = delete;
  CudaWeightSyncMember& operator=(const CudaWeightSyncMember&) = delete;

  int32_t rank() const override { return rank_; }
  int32_t world_size() const override { return world_; }
  bool broken() const override { return comm_ == nullptr; }
  // ncclAllGather of `bytes` per rank (staged through the device: NCCL moves device memory).
  // REQUIRES: bytes <= 64 (a handshake record).
  absl::Status AllGather(const void* mine, size_t bytes, void* all,
                         std::chrono::milliseconds timeout, const GiveUp& give_up) override;
  // ncclBroadcast from `root` into `dst` (device memory of `device`).
  absl::Status Receive(void* dst, size_t bytes, int32_t root, std::chrono::milliseconds timeout,
                       const GiveUp& give_up) override;

 private:
  CudaWeightSyncMember(std::shared_ptr<const cuda::NcclLibrary> nccl, int device, int32_t rank,
                       int32_t world);
  // Polls until the communicator's last call is done (ncclCommGetAsyncError leaves
  // ncclInProgress) and, with `event`, until the device passed it.
  absl::Status Wait(const char* what, bool event, std::chrono::milliseconds timeout,
                    const GiveUp& give_up);
  // Aborts the communicator (the member is broken from now on) and waits for its stream.
  void Abort();
  // Abort(), then `status`. REQUIRES: !status.ok().
  absl::Status Break(absl::Status status);

  const std::shared_ptr<const cuda::NcclLibrary> nccl_;
  const int device_;
  const int32_t rank_, world_;
  cuda::NcclCommHandle comm_ = nullptr;  // nullptr once aborted
  cuda_runner_internal::CudaStream stream_;
  cuda_runner_internal::CudaEvent done_;
  cuda::DeviceBuffer send_, recv_;  // the all-gather's: 64 bytes, 64 * world bytes
  cuda::PinnedHostBuffer host_;     // 64 + 64 * world bytes
};

}  // namespace rollout
