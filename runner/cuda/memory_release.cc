// CudaModelRunner's colocated memory (ModelRunner::ReleaseMemory / ResumeMemory): the KV pool
// and the weights are ReleasableDeviceBuffers, so giving their physical memory back to the GPU
// and taking it again keeps every device address -- the pointers the layers were bound to and
// the decode graphs captured over them. Only the bytes need care: the KV pool's are dropped (the
// engine holds no block) and zeroed on the way back, the weights' are copied to host memory
// first and copied back.
#include <cuda_runtime.h>

#include <new>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/cuda_status.h"
#include "common/status.h"
#include "runner/cuda/cuda_model_runner.h"
#include "runner/cuda/cuda_runner_state.h"
#include "runner/memory_plan.h"

namespace rollout {
namespace {

using cuda_runner_internal::RankState;
using cuda_runner_internal::ReleasableDeviceBuffer;

double GiB(int64_t bytes) { return static_cast<double>(bytes) / (1 << 30); }

// The buffers ReleaseMemory gives back on `rk`: its KV pool, and its weights if asked.
std::vector<ReleasableDeviceBuffer*> BuffersOf(RankState& rk, bool weights) {
  std::vector<ReleasableDeviceBuffer*> buffers = {&rk.kv};
  if (weights) {
    buffers.push_back(&rk.weights_bf16);
    buffers.push_back(&rk.weights_f32);
  }
  return buffers;
}

}  // namespace

bool CudaModelRunner::kv_cache_released() const { return state_->ranks[0].kv.released(); }

absl::Status CudaModelRunner::SynchronizeRanks() {
  State& s = *state_;
  for (const RankState& rk : s.ranks) {
    ROLLOUT_RETURN_IF_ERROR(s.SetDevice(rk));
    ROLLOUT_RETURN_IF_ERROR(CudaError(cudaDeviceSynchronize(), "synchronizing before a release"));
  }
  return s.SetDevice(s.ranks[0]);
}

absl::StatusOr<ReleasedMemory> CudaModelRunner::ReleaseMemory(bool weights) {
  State& s = *state_;
  if (!s.launched.empty()) {
    return absl::FailedPreconditionError("ReleaseMemory with a launched step not collected");
  }
  weights = weights && !s.ranks[0].weights_bf16.released();  // released already otherwise
  for (RankState& rk : s.ranks) {
    for (ReleasableDeviceBuffer* b : BuffersOf(rk, weights)) {
      if (b->bytes() > 0 && !b->releasable()) {
        return absl::FailedPreconditionError(absl::StrFormat(
            "GPU %d has no CUDA virtual memory management for this process (the start-up log "
            "says why), so its memory cannot be released and taken back at the same addresses; "
            "nothing was released",
            rk.device));
      }
    }
  }
  ROLLOUT_RETURN_IF_ERROR(CudaError(cudaSetDevice(s.ranks[0].device), "cudaSetDevice"));
  // Nothing of ours may touch the memory any more.
  ROLLOUT_RETURN_IF_ERROR(SynchronizeRanks());
  ReleasedMemory freed;
  if (weights) {
    // The backup first: it is the part that can fail for want of host memory, before anything
    // was given away.
    int64_t backup_bytes = 0;
    for (const RankState& rk : s.ranks) {
      backup_bytes += static_cast<int64_t>(rk.weights_bf16.bytes() + rk.weights_f32.bytes());
    }
    const int64_t available = AvailableHostMemory();
    if (available > 0 && available < backup_bytes) {
      return absl::ResourceExhaustedError(absl::StrFormat(
          "releasing the weights keeps their %.2f GiB in host memory, and the host has %.2f GiB "
          "available: release the KV cache only (weights = false), or free host memory "
          "(nothing was released)",
          GiB(backup_bytes), GiB(available)));
    }
    std::vector<std::unique_ptr<uint8_t[]>> backup(s.ranks.size());
    for (RankState& rk : s.ranks) {
      const size_t bf16 = rk.weights_bf16.bytes(), f32 = rk.weights_f32.bytes();
      backup[rk.index].reset(new (std::nothrow) uint8_t[bf16 + f32]);
      if (backup[rk.index] == nullptr) {
        return absl::ResourceExhaustedError(absl::StrFormat(
            "cannot allocate %.2f GiB of host memory for the weights' backup (nothing was "
            "released)",
            GiB(static_cast<int64_t>(bf16 + f32))));
      }
      ROLLOUT_RETURN_IF_ERROR(s.SetDevice(rk));
      uint8_t* out = backup[rk.index].get();
      ROLLOUT_RETURN_IF_ERROR(CudaError(
          cudaMemcpy(out, rk.weights_bf16.get(), bf16, cudaMemcpyDeviceToHost), "weights backup"));
      ROLLOUT_RETURN_IF_ERROR(CudaError(
          cudaMemcpy(out + bf16, rk.weights_f32.get(), f32, cudaMemcpyDeviceToHost),
          "weights backup"));
    }
    ROLLOUT_RETURN_IF_ERROR(s.SetDevice(s.ranks[0]));
    s.weights_backup = std::move(backup);
  }
  for (RankState& rk : s.ranks) {
    ROLLOUT_RETURN_IF_ERROR(s.SetDevice(rk));
    for (ReleasableDeviceBuffer* b : BuffersOf(rk, weights)) {
      if (b->released()) continue;
      const int64_t physical = static_cast<int64_t>(b->physical_bytes());
      if (absl::Status released = b->Release(); !released.ok()) {
        // A driver failure: take back what this call gave away, so that it changed nothing.
        ReleasedMemory undone;
        (void)Reacquire(&undone);
        return released;
      }
      (b == &rk.kv ? freed.kv_cache_bytes : freed.weight_bytes) += physical;
    }
  }
  freed.weights = weights;
  ROLLOUT_RETURN_IF_ERROR(s.SetDevice(s.ranks[0]));
  return freed;
}

absl::StatusOr<ReleasedMemory> CudaModelRunner::ResumeMemory() {
  ReleasedMemory taken;
  ROLLOUT_RETURN_IF_ERROR(Reacquire(&taken));
  return taken;
}

absl::Status CudaModelRunner::Reacquire(ReleasedMemory* taken) {
  State& s = *state_;
  ROLLOUT_RETURN_IF_ERROR(CudaError(cudaSetDevice(s.ranks[0].device), "cudaSetDevice"));
  // All or nothing: map every released buffer, or give back those mapped here.
  std::vector<std::pair<const RankState*, ReleasableDeviceBuffer*>> mapped;
  int64_t needed = 0;
  for (RankState& rk : s.ranks) {
    for (ReleasableDeviceBuffer* b : BuffersOf(rk, /*weights=*/true)) {
      if (b->released()) needed += static_cast<int64_t>(b->bytes());
    }
  }
  for (RankState& rk : s.ranks) {
    ROLLOUT_RETURN_IF_ERROR(s.SetDevice(rk));
    for (ReleasableDeviceBuffer* b : BuffersOf(rk, /*weights=*/true)) {
      if (!b->released()) continue;
      if (absl::Status status = b->Reacquire(); !status.ok()) {
        size_t free_bytes = 0, total = 0;
        cudaMemGetInfo(&free_bytes, &total);
        for (auto& [owner, m] : mapped) {
          (void)s.SetDevice(*owner);
          (void)m->Release();
        }
        (void)s.SetDevice(s.ranks[0]);
        return absl::Status(
            status.code(),
            absl::StrFormat("ResumeMemory needs %.2f GiB of GPU memory and GPU %d has %.2f GiB "
                            "free (%s); free it (the trainer's tensors, its caching allocator: "
                            "torch.cuda.empty_cache()) and call ResumeMemory again; the memory "
                            "stays released",
                            GiB(needed), rk.device, GiB(static_cast<int64_t>(free_bytes)),
                            status.message()));
      }
      mapped.emplace_back(&rk, b);
    }
  }
  for (auto& [owner, b] : mapped) {
    const RankState& rk = *owner;
    ROLLOUT_RETURN_IF_ERROR(s.SetDevice(rk));
    const int64_t physical = static_cast<int64_t>(b->physical_bytes());
    if (b == &rk.kv) {
      ROLLOUT_RETURN_IF_ERROR(
          CudaError(cudaMemset(b->get(), 0, b->bytes()), "clearing the KV cache"));
      taken->kv_cache_bytes += physical;
      continue;
    }
    const uint8_t* backup = s.weights_backup.at(rk.index).get();
    if (b == &rk.weights_f32) backup += rk.weights_bf16.bytes();
    ROLLOUT_RETURN_IF_ERROR(CudaError(
        cudaMemcpy(b->get(), backup, b->bytes(), cudaMemcpyHostToDevice), "restoring weights"));
    taken->weight_bytes += physical;
    taken->weights = true;
  }
  // cudaMemcpy from pageable memory may return before its DMA lands: the backup goes after.
  ROLLOUT_RETURN_IF_ERROR(SynchronizeRanks());
  s.weights_backup.clear();  // every buffer is mapped now
  return s.SetDevice(s.ranks[0]);
}

}  // namespace rollout
