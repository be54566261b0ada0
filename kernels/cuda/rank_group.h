#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

// The exchanges of tensor parallelism on the GPU: a group of ranks, each with a
// device and a stream, whose collectives one host thread enqueues for all ranks
// at once (as one thread drives several NCCL ranks between ncclGroupStart and
// ncclGroupEnd). The device-side sibling of runner/cpu/communicator.h's
// Communicator (one rank per thread, host memory), with the same rule: the only
// collectives are the ones that move bits without arithmetic -- every sum of
// tensor parallelism is done by the ranks on gathered partials, in a fixed
// order (tensor_parallel.h), so nothing can depend on message size, algorithm
// or chunking.
//
// Two implementations, both used by CudaModelRunner: ranks on one device
// exchanging by device copies (CreateSameDeviceGroup), and NCCL loaded at run
// time (CreateNcclGroup; one device per rank, --cuda_devices). kernels/cuda links no NCCL: the
// build needs neither the library nor its header.
namespace rollout::cuda {

// The outcome of a group call: ok, or a message naming the CUDA or NCCL call
// that failed.
class GroupStatus {
 public:
  static GroupStatus Ok() { return GroupStatus(); }
  static GroupStatus Error(std::string message) { return GroupStatus(std::move(message)); }
  bool ok() const { return message_.empty(); }
  const std::string& message() const { return message_; }

 private:
  GroupStatus() = default;
  explicit GroupStatus(std::string message)
      : message_(message.empty() ? "unknown error" : std::move(message)) {}
  std::string message_;
};

// One thread at a time (the thread that owns the ranks' streams). The streams
// outlive the group.
class RankGroup {
 public:
  virtual ~RankGroup() = default;

  virtual int world_size() const = 0;
  virtual const char* kind() const = 0;  // "same-device", "nccl"

  // For every rank r and every rank i: recv[r][i * count, (i + 1) * count) =
  // send[i][0, count) (floats, exact copies, in rank order), enqueued on rank
  // r's stream. send[r] may be recv[r] + r * count (in place). On return the
  // work is enqueued: in each rank's stream order, what follows may read
  // recv[r] and rewrite send[r] (no peer reads it any more).
  virtual GroupStatus AllGather(const float* const* send, int64_t count, float* const* recv) = 0;

  // Faults of other parties (docs/cuda.md, "Faults across GPUs"). can_hang: a collective of this
  // group waits on other GPUs (NCCL), so a wait for the work it is in must be bounded: poll
  // CheckAsync and give up at a deadline, then Abort. The same-device group's copies cannot
  // hang on anyone: false, and the others are no-ops.
  virtual bool can_hang() const { return false; }
  // An error a rank's communicator reported asynchronously (ncclCommGetAsyncError), or ok.
  virtual GroupStatus CheckAsync() { return GroupStatus::Ok(); }
  // Aborts every rank's communicator (ncclCommAbort): kernels waiting on a peer exit, and every
  // later AllGather fails. For a group whose exchange hung or failed; it cannot be resumed.
  virtual void Abort() {}
};

// Ranks that share the current device, rank r on streams[r]. AllGather: every
// rank records an event after its send buffer is written; each rank's stream
// waits for its peers' events and copies their buffers into its recv
// (cudaMemcpyAsync, rank order); then a second round of events so that no rank
// rewrites its send buffer while a peer still copies it. Captures into a CUDA
// graph like any stream work (the streams must be part of the capture).
GroupStatus CreateSameDeviceGroup(const std::vector<cudaStream_t>& streams,
                                  std::unique_ptr<RankGroup>* group);

// NCCL ranks in this process, rank r on devices[r] and streams[r] (a stream of
// that device): the library is dlopen()ed from `library` ("" = "libnccl.so.2"
// on the loader's search path), the communicators made with ncclGetUniqueId +
// ncclCommInitRank in one group; AllGather is ncclAllGather of every rank in
// one group. NCCL refuses two ranks on one device.
GroupStatus CreateNcclGroup(const std::vector<int>& devices,
                            const std::vector<cudaStream_t>& streams, const std::string& library,
                            std::unique_ptr<RankGroup>* group);

// The version NCCL reports (ncclGetVersion, e.g. 22703 for 2.27.3) when
// `library` loads, else an error saying why it did not.
GroupStatus NcclLibraryVersion(const std::string& library, int* version);

}  // namespace rollout::cuda
