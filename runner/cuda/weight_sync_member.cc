#include "runner/cuda/weight_sync_member.h"

#include <cstring>
#include <string>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/cuda_status.h"
#include "common/status.h"
#include "glog/logging.h"

namespace rollout {
namespace {

using cuda::kNcclInProgress;
using cuda::kNcclSuccess;
using cuda::NcclResult;

constexpr size_t kRecordBytes = 64;  // the largest AllGather: a handshake record
// After an abort, how long the stream may take to drain (NCCL's kernels poll the abort flag).
constexpr std::chrono::seconds kDrainAfterAbort{10};

double Seconds(std::chrono::milliseconds ms) { return ms.count() / 1000.0; }

}  // namespace

CudaWeightSyncMember::CudaWeightSyncMember(std::shared_ptr<const cuda::NcclLibrary> nccl,
                                           int device, int32_t rank, int32_t world)
    : nccl_(std::move(nccl)), device_(device), rank_(rank), world_(world) {}

CudaWeightSyncMember::~CudaWeightSyncMember() {
  cudaSetDevice(device_);  // this thread's (the weight-sync thread's) device from here on
  Abort();
}

absl::Status CudaWeightSyncMember::Break(absl::Status status) {
  Abort();
  return status;
}

void CudaWeightSyncMember::Abort() {
  if (comm_ != nullptr) {
    if (const NcclResult r = nccl_->CommAbort(comm_); r != kNcclSuccess) {
      LOG(WARNING) << "ncclCommAbort: " << nccl_->Describe(r);
    }
    comm_ = nullptr;
    // Kernels that waited for a peer exit once they see the abort flag; nothing of this member
    // may still write device memory when its caller reuses it.
    if (stream_.get() != nullptr) {
      const auto deadline = std::chrono::steady_clock::now() + kDrainAfterAbort;
      cudaError_t e;
      while ((e = cudaStreamQuery(stream_.get())) == cudaErrorNotReady &&
             std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      if (e != cudaSuccess) {
        LOG(ERROR) << "the weight-sync stream did not drain after ncclCommAbort: "
                   << cudaGetErrorName(e);
      }
    }
  }
}

absl::StatusOr<std::unique_ptr<CudaWeightSyncMember>> CudaWeightSyncMember::Join(
    std::shared_ptr<const cuda::NcclLibrary> nccl, int device, const WeightSyncGroupSpec& spec,
    const GiveUp& give_up) {
  if (!nccl->has_nonblocking()) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "%s has no non-blocking, abortable communicators (ncclCommInitRankConfig, "
        "ncclCommGetAsyncError, ncclCommAbort, ncclBroadcast): weight-sync groups need NCCL "
        ">= 2.14",
        nccl->name()));
  }
  if (spec.unique_id.size() != sizeof(cuda::NcclUniqueId)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("unique_id has %d bytes; an ncclUniqueId has %d", spec.unique_id.size(),
                        sizeof(cuda::NcclUniqueId)));
  }
  std::unique_ptr<CudaWeightSyncMember> m(
      new CudaWeightSyncMember(std::move(nccl), device, spec.rank, spec.world_size));
  ROLLOUT_RETURN_IF_ERROR(CudaError(cudaSetDevice(device), "cudaSetDevice"));
  ROLLOUT_RETURN_IF_ERROR(CudaError(
      cudaStreamCreateWithFlags(m->stream_.Receive(), cudaStreamNonBlocking), "cudaStreamCreate"));
  ROLLOUT_RETURN_IF_ERROR(CudaError(
      cudaEventCreateWithFlags(m->done_.Receive(), cudaEventDisableTiming), "cudaEventCreate"));
  const size_t gathered = kRecordBytes * static_cast<size_t>(spec.world_size);
  ROLLOUT_RETURN_IF_ERROR(CudaError(m->send_.Allocate(kRecordBytes), "handshake buffers"));
  ROLLOUT_RETURN_IF_ERROR(CudaError(m->recv_.Allocate(gathered), "handshake buffers"));
  ROLLOUT_RETURN_IF_ERROR(
      CudaError(m->host_.Allocate(kRecordBytes + gathered), "handshake buffers"));

  cuda::NcclUniqueId id;
  std::memcpy(id.internal, spec.unique_id.data(), sizeof(id.internal));
  cuda::NcclConfig config;
  config.blocking = 0;  // every call returns at once; Wait polls with a deadline
  const NcclResult r =
      m->nccl_->CommInitRankConfig(&m->comm_, spec.world_size, id, spec.rank, &config);
  if (r != kNcclSuccess && r != kNcclInProgress) {
    return m->Break(
        absl::InternalError(absl::StrCat("ncclCommInitRankConfig (rank ", spec.rank, " of ",
                                         spec.world_size, "): ", m->nccl_->Describe(r))));
  }
  absl::Status joined = m->Wait("joining the weight-sync group", false, spec.timeout, give_up);
  if (absl::IsDeadlineExceeded(joined)) {
    return absl::DeadlineExceededError(absl::StrFormat(
        "the weight-sync group of %d ranks was not complete within %.3g s (this server is rank "
        "%d): every rank -- the trainer's and each server's -- must join with the same "
        "unique_id, made by the trainer's ncclGetUniqueId in a process that still runs",
        spec.world_size, Seconds(spec.timeout), spec.rank));
  }
  if (!joined.ok()) return joined;
  return m;
}

absl::Status CudaWeightSyncMember::Wait(const char* what, bool event,
                                        std::chrono::milliseconds timeout, const GiveUp& give_up) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (int polls = 0;; ++polls) {
    NcclResult state = kNcclInProgress;
    if (const NcclResult r = nccl_->CommGetAsyncError(comm_, &state); r != kNcclSuccess) {
      return Break(
          absl::InternalError(absl::StrCat(what, ": ncclCommGetAsyncError: ", nccl_->Describe(r))));
    }
    if (state != kNcclSuccess && state != kNcclInProgress) {
      return Break(absl::UnavailableError(absl::StrCat(what, ": the weight-sync group failed (",
                                                       nccl_->Describe(state),
                                                       "): a rank left, failed or disagrees")));
    }
    if (state == kNcclSuccess) {
      if (!event) return absl::OkStatus();
      const cudaError_t e = cudaEventQuery(done_.get());
      if (e == cudaSuccess) return absl::OkStatus();
      if (e != cudaErrorNotReady) return Break(CudaError(e, what));
    }
    if (give_up && give_up()) {
      return Break(absl::CancelledError(
          absl::StrCat(what, ": given up (the call was cancelled, or the server stops)")));
    }
    if (std::chrono::steady_clock::now() >= deadline) {
      return Break(absl::DeadlineExceededError(absl::StrFormat(
          "%s: not done within %.3g s (timeout_seconds): the source stopped sending, or another "
          "rank is not taking part",
          what, Seconds(timeout))));
    }
    // A bucket takes milliseconds: spin first, then sleep a little.
    if (polls < 2000) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }
}

absl::Status CudaWeightSyncMember::AllGather(const void* mine, size_t bytes, void* all,
                                             std::chrono::milliseconds timeout,
                                             const GiveUp& give_up) {
  if (comm_ == nullptr) {
    return absl::FailedPreconditionError("the weight-sync group was aborted; join it again");
  }
  if (bytes > kRecordBytes) return absl::InternalError("AllGather: more than 64 bytes per rank");
  ROLLOUT_RETURN_IF_ERROR(CudaError(cudaSetDevice(device_), "cudaSetDevice"));
  char* host = host_.get<char>();
  std::memcpy(host, mine, bytes);
  cudaStream_t s = stream_.get();
  if (absl::Status up = CudaError(
          cudaMemcpyAsync(send_.get(), host, bytes, cudaMemcpyHostToDevice, s), "handshake upload");
      !up.ok()) {
    return Break(up);
  }
  const NcclResult r =
      nccl_->AllGatherFn(send_.get(), recv_.get(), bytes, cuda::kNcclUint8, comm_, s);
  if (r != kNcclSuccess && r != kNcclInProgress) {
    return Break(absl::InternalError(absl::StrCat("ncclAllGather: ", nccl_->Describe(r))));
  }
  ROLLOUT_RETURN_IF_ERROR(Wait("the handshake (ncclAllGather)", false, timeout, give_up));
  const size_t gathered = bytes * static_cast<size_t>(world_);
  absl::Status queued = CudaError(
      cudaMemcpyAsync(host + kRecordBytes, recv_.get(), gathered, cudaMemcpyDeviceToHost, s),
      "handshake download");
  if (queued.ok()) queued = CudaError(cudaEventRecord(done_.get(), s), "cudaEventRecord");
  if (!queued.ok()) return Break(queued);
  ROLLOUT_RETURN_IF_ERROR(Wait("the handshake (ncclAllGather)", true, timeout, give_up));
  std::memcpy(all, host + kRecordBytes, gathered);
  return absl::OkStatus();
}

absl::Status CudaWeightSyncMember::Receive(void* dst, size_t bytes, int32_t root,
                                           std::chrono::milliseconds timeout,
                                           const GiveUp& give_up) {
  if (comm_ == nullptr) {
    return absl::FailedPreconditionError("the weight-sync group was aborted; join it again");
  }
  if (bytes == 0) return absl::OkStatus();
  ROLLOUT_RETURN_IF_ERROR(CudaError(cudaSetDevice(device_), "cudaSetDevice"));
  cudaStream_t s = stream_.get();
  // A receiving rank's send buffer is ignored; dst for both is what NCCL's in-place form takes.
  const NcclResult r = nccl_->BroadcastFn(dst, dst, bytes, cuda::kNcclUint8, root, comm_, s);
  if (r != kNcclSuccess && r != kNcclInProgress) {
    return Break(absl::InternalError(absl::StrCat("ncclBroadcast: ", nccl_->Describe(r))));
  }
  ROLLOUT_RETURN_IF_ERROR(Wait("ncclBroadcast", false, timeout, give_up));
  if (absl::Status recorded = CudaError(cudaEventRecord(done_.get(), s), "cudaEventRecord");
      !recorded.ok()) {
    return Break(recorded);
  }
  return Wait("ncclBroadcast", true, timeout, give_up);
}

}  // namespace rollout
