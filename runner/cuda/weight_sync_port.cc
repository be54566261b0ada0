// CudaModelRunner's port to NCCL weight-sync groups (engine/weight_sync.h): members are NCCL ranks
// on rank 0's device (weight_sync_member.h); a broadcast lands bucket by bucket in the staging
// planned at load (State::weight_staging, CudaRunnerOptions::device_weight_staging), where each
// bucket's completed digest leaves and tensors are hashed on a stream of their own while the next
// bucket arrives (kernels/cuda/device_digest.h); the swap copies the staged tensors device to
// device into the served weights through the bindings every update writes.
//
// Why device staging and no pinned-host fallback: the served weights must not change before the
// last bucket arrived and every digest is accepted, so the bytes need a place of their own. On
// the device that place costs the weights' size of KV cache and the swap is a device copy
// (16.4 GB: ~8 ms at 4.3 TB/s); on the host it would cost as much pinned memory per server, every
// bucket a device-to-host copy at PCIe rate (~50 GB/s at best) and the swap a host-to-device copy
// of the same (hundreds of ms between two steps). A broadcast is a collective: one receiver at
// PCIe rate holds every server of the group to it, far below the >= 100 GB/s per GPU that NVLink
// gives. So a server without the staging refuses to join, naming the flag, and a fleet that
// cannot spare the memory updates by UpdateWeights (which stages on the host by design).
#include <cuda_runtime.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/cuda_status.h"
#include "common/status.h"
#include "engine/broadcast_plan.h"
#include "engine/weight_sync.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/device_digest.h"
#include "kernels/cuda/nccl_library.h"
#include "runner/cuda/cuda_handles.h"
#include "runner/cuda/cuda_model_runner.h"
#include "runner/cuda/cuda_runner_state.h"
#include "runner/cuda/device_weight_copy.h"
#include "runner/cuda/weight_sync_member.h"

namespace rollout {
namespace {

using cuda_runner_internal::CudaStream;

// One broadcast's bytes in the runner's staging, hashed: the claim on the staging is released
// when this is destroyed (after the swap or the refusal, before the reply).
class CudaStagedWeights final : public StagedWeights {
 public:
  CudaStagedWeights(BroadcastPlan plan, TensorDigests digests, const char* staging,
                    const void* owner, std::shared_ptr<std::atomic<bool>> claim)
      : plan_(std::move(plan)),
        digests_(std::move(digests)),
        staging_(staging),
        owner_(owner),
        claim_(std::move(claim)) {}
  ~CudaStagedWeights() override { *claim_ = false; }
  CudaStagedWeights(const CudaStagedWeights&) = delete;
  CudaStagedWeights& operator=(const CudaStagedWeights&) = delete;

  const BroadcastPlan& plan() const override { return plan_; }
  const TensorDigests& digests() const override { return digests_; }
  const char* staging() const { return staging_; }
  const void* owner() const { return owner_; }

 private:
  const BroadcastPlan plan_;
  const TensorDigests digests_;
  const char* const staging_;
  const void* const owner_;
  const std::shared_ptr<std::atomic<bool>> claim_;
};

// The staging as a BroadcastSink. Memory borrowed from the runner (which outlives the port);
// its own hash stream. The weight-sync thread only.
class CudaStagingSink final : public BroadcastSink {
 public:
  struct Memory {
    char* staging = nullptr;
    size_t staging_bytes = 0;
    uint8_t* leaves = nullptr;  // 32 bytes per digest leaf
    size_t leaf_bytes = 0;
    uint8_t* digests = nullptr;  // 32 bytes per tensor
    size_t digest_bytes = 0;
  };
  CudaStagingSink(const void* owner, int device, Memory memory)
      : owner_(owner), device_(device), m_(memory) {}
  ~CudaStagingSink() override {
    if (hash_stream_.get() != nullptr) cudaStreamSynchronize(hash_stream_.get());
  }

  absl::Status Init() {
    ROLLOUT_RETURN_IF_ERROR(CudaError(cudaSetDevice(device_), "cudaSetDevice"));
    ROLLOUT_RETURN_IF_ERROR(
        CudaError(cudaStreamCreateWithFlags(hash_stream_.Receive(), cudaStreamNonBlocking),
                  "the broadcast digest stream"));
    return CudaError(host_digests_.Allocate(m_.digest_bytes), "pinning broadcast digests");
  }

  absl::Status Begin(const BroadcastPlan& plan) override {
    uint64_t leaves = 0;
    for (const BroadcastTensor& t : plan.tensors) leaves += cuda::DigestLeafCount(t.nbytes());
    if (plan.total_bytes > m_.staging_bytes || cuda::kDigestBytes * leaves > m_.leaf_bytes ||
        cuda::kDigestBytes * plan.tensors.size() > m_.digest_bytes) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "the broadcast's %d bytes (%d tensors) do not fit the device staging of %d bytes",
          plan.total_bytes, plan.tensors.size(), m_.staging_bytes));
    }
    bool free = false;
    if (!claim_->compare_exchange_strong(free, true)) {
      return absl::AbortedError(
          "the device staging still holds an earlier broadcast (waiting for its swap, e.g. a "
          "DRAIN update): one broadcast update at a time");
    }
    plan_ = plan;
    leaf_offset_.clear();
    uint64_t offset = 0;
    for (const BroadcastTensor& t : plan.tensors) {
      leaf_offset_.push_back(offset);
      offset += cuda::kDigestBytes * cuda::DigestLeafCount(t.nbytes());
    }
    return absl::OkStatus();
  }

  void* BucketAddress(size_t bucket) override {
    return m_.staging + plan_.buckets[bucket].stream_offset;
  }

  // The bucket's bytes are complete (the member waited for them): hash what it completed.
  absl::Status BucketArrived(size_t bucket) override {
    ROLLOUT_RETURN_IF_ERROR(CudaError(cudaSetDevice(device_), "cudaSetDevice"));
    const BucketLeaves done = LeavesCompletedBy(plan_, bucket);
    std::vector<cuda::DeviceLeafRange> ranges;
    for (const LeafRun& r : done.runs) {
      const uint64_t n = plan_.tensors[r.tensor].nbytes();
      const uint64_t begin = r.first_leaf * cuda::kDigestLeafSize;
      ranges.push_back({m_.staging + plan_.offsets[r.tensor] + begin,
                        std::min(r.num_leaves * cuda::kDigestLeafSize, n - begin),
                        m_.leaves + leaf_offset_[r.tensor] + cuda::kDigestBytes * r.first_leaf});
    }
    ROLLOUT_RETURN_IF_ERROR(
        CudaError(cuda::DeviceLeafDigests(ranges.data(), ranges.size(), hash_stream_.get()),
                  "hashing a broadcast bucket"));
    std::vector<cuda::DeviceLeafList> lists;
    for (size_t t = done.first_completed; t < done.end_completed; ++t) {
      lists.push_back(
          {m_.leaves + leaf_offset_[t], cuda::DigestLeafCount(plan_.tensors[t].nbytes())});
    }
    return CudaError(
        cuda::DeviceCombineLeafDigests(lists.data(), lists.size(),
                                       m_.digests + cuda::kDigestBytes * done.first_completed,
                                       hash_stream_.get()),
        "combining a broadcast tensor's digest");
  }

  absl::StatusOr<std::unique_ptr<StagedWeights>> Finish() override {
    const size_t n = plan_.tensors.size();
    absl::Status done = CudaError(cudaSetDevice(device_), "cudaSetDevice");
    if (done.ok()) {
      done = CudaError(cudaMemcpyAsync(host_digests_.get(), m_.digests, cuda::kDigestBytes * n,
                                       cudaMemcpyDeviceToHost, hash_stream_.get()),
                       "copying the broadcast's digests");
    }
    if (done.ok()) {
      done = CudaError(cudaStreamSynchronize(hash_stream_.get()), "hashing the broadcast");
    }
    if (!done.ok()) {
      Abandon();
      return done;
    }
    TensorDigests digests;
    const char* bytes = host_digests_.get<char>();
    for (size_t i = 0; i < n; ++i) {
      digests[plan_.tensors[i].name] =
          std::string(bytes + cuda::kDigestBytes * i, cuda::kDigestBytes);
    }
    return std::unique_ptr<StagedWeights>(
        std::make_unique<CudaStagedWeights>(plan_, std::move(digests), m_.staging, owner_, claim_));
  }

  void Abandon() override {
    // The hash kernels read the staging: done before anything may write it again.
    cudaSetDevice(device_);
    cudaStreamSynchronize(hash_stream_.get());
    *claim_ = false;
  }

 private:
  const void* const owner_;  // the runner
  const int device_;
  const Memory m_;
  CudaStream hash_stream_;
  cuda::PinnedHostBuffer host_digests_;
  std::shared_ptr<std::atomic<bool>> claim_ = std::make_shared<std::atomic<bool>>(false);
  BroadcastPlan plan_;                 // the claimed broadcast's
  std::vector<uint64_t> leaf_offset_;  // per tensor of plan_: where its leaf digests go
};

class CudaWeightSyncPort final : public WeightSyncPort {
 public:
  CudaWeightSyncPort(int device, std::string nccl_library, std::unique_ptr<CudaStagingSink> sink)
      : device_(device), nccl_library_(std::move(nccl_library)), sink_(std::move(sink)) {}

  absl::StatusOr<std::unique_ptr<WeightSyncMember>> Join(const WeightSyncGroupSpec& spec,
                                                         const GiveUp& give_up) override {
    absl::StatusOr<std::shared_ptr<const cuda::NcclLibrary>> nccl = Nccl();
    if (!nccl.ok()) return nccl.status();
    absl::StatusOr<std::unique_ptr<CudaWeightSyncMember>> member =
        CudaWeightSyncMember::Join(*std::move(nccl), device_, spec, give_up);
    if (!member.ok()) return member.status();
    return std::unique_ptr<WeightSyncMember>(*std::move(member));
  }
  BroadcastSink* sink() override { return sink_.get(); }
  int nccl_version() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return version_;
  }

 private:
  // The library, loaded by the first join (a server that never joins needs no NCCL).
  absl::StatusOr<std::shared_ptr<const cuda::NcclLibrary>> Nccl() {
    std::lock_guard<std::mutex> lock(mu_);
    if (nccl_ != nullptr) return nccl_;
    auto nccl = std::make_shared<cuda::NcclLibrary>();
    if (const cuda::GroupStatus loaded = nccl->Load(nccl_library_); !loaded.ok()) {
      return absl::FailedPreconditionError(
          absl::StrCat("weight-sync groups need NCCL, which did not load: ", loaded.message(),
                       ". Put the directory holding libnccl.so.2 (e.g. a PyTorch environment's "
                       "site-packages/nvidia/nccl/lib) on LD_LIBRARY_PATH"));
    }
    nccl->GetVersion(&version_);
    nccl_ = std::move(nccl);
    return nccl_;
  }

  const int device_;
  const std::string nccl_library_;
  const std::unique_ptr<CudaStagingSink> sink_;
  mutable std::mutex mu_;  // guards nccl_ and version_ (nccl_version() is any thread's)
  std::shared_ptr<const cuda::NcclLibrary> nccl_;
  int version_ = 0;
};

}  // namespace

absl::StatusOr<std::unique_ptr<WeightSyncPort>> CudaModelRunner::CreateWeightSyncPort() {
  State& s = *state_;
  if (s.multi_device) {
    return absl::FailedPreconditionError(
        "NCCL weight broadcasts into ranks on several GPUs (--cuda_devices with --tp > 1) are "
        "not supported: serve one GPU per server, or update with UpdateWeights or "
        "UpdateWeightsFromPath");
  }
  if (s.weight_staging.bytes() == 0) {
    uint64_t bytes = 0;
    for (const WeightSpec& spec : s.weight_specs) bytes += spec.nbytes();
    return absl::FailedPreconditionError(absl::StrFormat(
        "this server has no device staging for NCCL weight broadcasts: start it with "
        "--device_weight_staging, which reserves %.2f GiB (the weights' size) of GPU memory "
        "from the KV cache. (A broadcast must not touch the served weights before its last byte "
        "and its digests are checked, and a host staging would hold the whole group to PCIe "
        "speed.)",
        static_cast<double>(bytes) / (1 << 30)));
  }
  CudaStagingSink::Memory memory;
  memory.staging = s.weight_staging.get<char>();
  memory.staging_bytes = s.weight_staging.bytes();
  memory.leaves = s.staging_leaf_digests.get<uint8_t>();
  memory.leaf_bytes = s.staging_leaf_digests.bytes();
  memory.digests = s.staging_tensor_digests.get<uint8_t>();
  memory.digest_bytes = s.staging_tensor_digests.bytes();
  auto sink = std::make_unique<CudaStagingSink>(this, s.ranks[0].device, memory);
  ROLLOUT_RETURN_IF_ERROR(sink->Init());
  ROLLOUT_RETURN_IF_ERROR(CudaError(cudaSetDevice(s.ranks[0].device), "cudaSetDevice"));
  return std::unique_ptr<WeightSyncPort>(std::make_unique<CudaWeightSyncPort>(
      s.ranks[0].device, options_.nccl_library, std::move(sink)));
}

absl::Status CudaModelRunner::UpdateWeightsFromStaging(const StagedWeights& staged) {
  State& s = *state_;
  const auto* cuda = dynamic_cast<const CudaStagedWeights*>(&staged);
  if (cuda == nullptr || cuda->owner() != this) {
    return absl::InternalError(
        "UpdateWeightsFromStaging: these weights were staged by another runner");
  }
  const BroadcastPlan& plan = staged.plan();
  for (const BroadcastTensor& t : plan.tensors) {
    ROLLOUT_RETURN_IF_ERROR(CheckTensorAgainstSpec(s.weight_specs, t.name, t.dtype, t.shape));
  }
  ROLLOUT_RETURN_IF_ERROR(CudaError(cudaSetDevice(s.ranks[0].device), "cudaSetDevice"));
  // Between steps: nothing of ours is in flight, but be explicit.
  ROLLOUT_RETURN_IF_ERROR(CudaError(cudaStreamSynchronize(s.stream), "weight update"));
  for (size_t i = 0; i < plan.tensors.size(); ++i) {
    const BroadcastTensor& t = plan.tensors[i];
    ROLLOUT_RETURN_IF_ERROR(
        CudaError(CopyWeightFromDevice(s.bindings.at(t.name), t.dtype,
                                       cuda->staging() + plan.offsets[i], s.stream),
                  absl::StrFormat("copying %s from the broadcast staging", t.name)));
  }
  return CudaError(cudaStreamSynchronize(s.stream), "broadcast weight update");
}

}  // namespace rollout
