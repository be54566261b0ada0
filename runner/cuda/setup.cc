// CudaModelRunner::Init and its steps: the options and the model checked against what the
// kernels support, the ranks, their streams and events, the rank group and the cuBLASLt handles;
// then the weights are laid out (weights.cc).
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/cuda_status.h"
#include "common/status.h"
#include "kernels/cuda/moe.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/rank_group.h"
#include "model/tensor_parallel.h"
#include "runner/cuda/cuda_model_runner.h"
#include "runner/cuda/cuda_runner_state.h"

namespace rollout {
namespace {

using cuda_runner_internal::RankState;

// CudaRunnerOptions::devices: empty, or one distinct, existing device per rank.
absl::Status CheckDevices(const CudaRunnerOptions& o) {
  if (o.devices.empty()) return absl::OkStatus();
  if (static_cast<int64_t>(o.devices.size()) != o.tensor_parallel) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "devices lists %d device(s) for tensor_parallel %d: give one device per rank (or none "
        "for every rank on device %d)",
        o.devices.size(), o.tensor_parallel, o.device));
  }
  for (size_t i = 0; i < o.devices.size(); ++i) {
    for (size_t j = 0; j < i; ++j) {
      if (o.devices[i] == o.devices[j]) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "devices lists device %d twice (ranks %d and %d): ranks on separate devices need "
            "distinct devices (leave devices empty to put every rank on one device)",
            o.devices[i], j, i));
      }
    }
  }
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) return CudaError(err, "cudaGetDeviceCount");
  for (size_t r = 0; r < o.devices.size(); ++r) {
    if (o.devices[r] < 0 || o.devices[r] >= count) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "devices: rank %d's device %d does not exist (%d CUDA device(s) visible: 0..%d)", r,
          o.devices[r], count, count - 1));
    }
  }
  return absl::OkStatus();
}

// A mixture-of-experts model against what kernels/cuda/moe.h supports (nothing for a dense one).
absl::Status CheckMoeSupported(const ModelConfig& c, const CudaRunnerOptions& o) {
  if (!c.is_moe()) return absl::OkStatus();
  if (o.tensor_parallel > 1) {
    return absl::UnimplementedError(absl::StrFormat(
        "tensor parallelism (tensor_parallel %d) is not implemented for mixture-of-experts "
        "models (Qwen3MoeForCausalLM) on the cuda backend: serve it at --tp 1 (or on the cpu "
        "backend)",
        o.tensor_parallel));
  }
  if (c.num_experts > cuda::kMoeMaxExperts || c.num_experts_per_tok < 1 ||
      c.num_experts_per_tok > std::min(c.num_experts, cuda::kMoeMaxTopK)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "the cuda backend supports up to %d experts and 1..%d experts per token (not more than "
        "num_experts), not num_experts %d, num_experts_per_tok %d",
        cuda::kMoeMaxExperts, cuda::kMoeMaxTopK, c.num_experts, c.num_experts_per_tok));
  }
  if (c.moe_intermediate_size % cuda::kMoeGemmAlign != 0 ||
      c.hidden_size % cuda::kMoeGemmAlign != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "the cuda backend's expert GEMMs need hidden_size (%d) and moe_intermediate_size (%d) to "
        "be multiples of %d",
        c.hidden_size, c.moe_intermediate_size, cuda::kMoeGemmAlign));
  }
  return absl::OkStatus();
}

// The options and the model against what the kernels support.
absl::Status CheckSupported(const ModelConfig& c, const CudaRunnerOptions& o) {
  if (o.kv_block_size <= 0 || o.attention_split_size <= 0 ||
      o.attention_split_size % cuda::kAttentionTile != 0 ||
      o.attention_split_size % o.kv_block_size != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "attention split size (%d, --attention_split_size) must be a positive multiple of 32 "
        "and of the KV block size (%d, --kv_block_size)",
        o.attention_split_size, o.kv_block_size));
  }
  if (o.max_batch_tokens < 1 || o.max_batch_tokens > 65535 || o.max_logit_rows < 1) {
    return absl::InvalidArgumentError(
        "max_batch_tokens must be in [1, 65535], max_logit_rows >= 1");
  }
  if (c.head_dim != 32 && c.head_dim != 64 && c.head_dim != 128) {
    return absl::InvalidArgumentError(
        absl::StrCat("the CUDA backend supports head_dim 32, 64 or 128, not ", c.head_dim));
  }
  const int group = c.num_attention_heads / c.num_key_value_heads;
  if (group > 64) {
    return absl::InvalidArgumentError(
        absl::StrCat("the CUDA backend supports up to 64 query heads per kv head, not ", group));
  }
  if (c.hidden_size % 8 != 0 || c.intermediate_size % 8 != 0) {
    return absl::InvalidArgumentError("hidden and intermediate sizes must be multiples of 8");
  }
  ROLLOUT_RETURN_IF_ERROR(CheckMoeSupported(c, o));
  ROLLOUT_RETURN_IF_ERROR(CheckTensorParallel(c, o.tensor_parallel));
  ROLLOUT_RETURN_IF_ERROR(CheckDevices(o));
  if (o.canonical_k_tree) {
    // Segment offsets of K / 8 elements stay 16-byte aligned for the GEMMs, at every degree.
    if ((c.num_attention_heads * c.head_dim) % 64 != 0 || c.intermediate_size % 64 != 0) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "the canonical K tree (tensor parallelism) needs heads * head_dim (%d) and the "
          "intermediate size (%d) to be multiples of 64",
          c.num_attention_heads * c.head_dim, c.intermediate_size));
    }
    if (o.gemm_pin_m <= 0) {
      return absl::InvalidArgumentError(
          "the canonical K tree (tensor parallelism) needs pinned GEMM algorithms "
          "(gemm_pin_m > 0): a rank's slice must run the algorithm of the full shape");
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CudaModelRunner::Init() {
  ROLLOUT_RETURN_IF_ERROR(CheckSupported(config_, options_));
  SetUpRanks();
  ROLLOUT_RETURN_IF_ERROR(CreateStreams());
  ROLLOUT_RETURN_IF_ERROR(CreateRankGroup());
  ROLLOUT_RETURN_IF_ERROR(CreateBlasHandles());
  ROLLOUT_RETURN_IF_ERROR(LayOutWeights());
  return BindTensors();
}

void CudaModelRunner::SetUpRanks() {
  const ModelConfig& c = config_;
  const CudaRunnerOptions& o = options_;
  State& s = *state_;
  const int tp = o.tensor_parallel;
  const int64_t vocab = c.vocab_size;
  s.tp = tp;
  s.canonical = o.canonical_k_tree;
  // Vocab shards of ceil(vocab / tp) rows rounded up to 64, so that every rank's lm_head GEMM
  // has one shape and its logits rows stay aligned; the last shards are shorter (or empty).
  s.vocab_rows = tp == 1 ? vocab : ((vocab + tp - 1) / tp + 63) / 64 * 64;
  s.multi_device = o.devices.size() > 1;
  s.collective_timeout = std::chrono::seconds(std::max(1, o.collective_timeout_s));
  s.ranks.Create(tp, s.multi_device);
  for (int r = 0; r < tp; ++r) {
    RankState& rk = s.ranks[r];
    rk.index = r;
    rk.device = o.devices.empty() ? o.device : o.devices[r];
    static_cast<RankShard&>(rk) = ShardOf(c, tp, r, s.vocab_rows);
  }
}

// Each rank's stream and event on its device (all on one device unless options_.devices is set);
// rank 0's device is current from here on, between enqueues for other ranks.
absl::Status CudaModelRunner::CreateStreams() {
  State& s = *state_;
  for (RankState& rk : s.ranks) {
    ROLLOUT_RETURN_IF_ERROR(CudaError(cudaSetDevice(rk.device), "cudaSetDevice"));
    ROLLOUT_RETURN_IF_ERROR(CudaError(
        cudaStreamCreateWithFlags(rk.stream.Receive(), cudaStreamNonBlocking), "cudaStreamCreate"));
    if (rk.index > 0) {
      ROLLOUT_RETURN_IF_ERROR(CudaError(
          cudaEventCreateWithFlags(rk.done.Receive(), cudaEventDisableTiming), "cudaEventCreate"));
    }
  }
  ROLLOUT_RETURN_IF_ERROR(CudaError(cudaSetDevice(s.ranks[0].device), "cudaSetDevice"));
  s.stream = s.ranks[0].stream.get();
  if (s.tp > 1) {
    ROLLOUT_RETURN_IF_ERROR(CudaError(
        cudaEventCreateWithFlags(s.fork.Receive(), cudaEventDisableTiming), "cudaEventCreate"));
  }
  return absl::OkStatus();
}

absl::Status CudaModelRunner::CreateRankGroup() {
  const CudaRunnerOptions& o = options_;
  State& s = *state_;
  if (s.tp == 1) return absl::OkStatus();
  std::vector<cudaStream_t> streams;
  std::vector<int> devices;
  for (const RankState& rk : s.ranks) {
    streams.push_back(rk.stream.get());
    devices.push_back(rk.device);
  }
  if (!s.multi_device) {
    const cuda::GroupStatus group = cuda::CreateSameDeviceGroup(streams, &s.group);
    if (!group.ok()) return absl::InternalError(group.message());
    return absl::OkStatus();
  }
  // Ranks on separate devices exchange through NCCL, loaded at run time.
  int version = 0;
  const cuda::GroupStatus loaded = cuda::NcclLibraryVersion(o.nccl_library, &version);
  if (!loaded.ok()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "tensor parallelism across devices needs NCCL (",
        o.nccl_library.empty() ? "libnccl.so.2" : o.nccl_library,
        ", loaded at run time), which did not load: ", loaded.message(),
        ". Install NCCL 2.x, or put the directory holding libnccl.so.2 (e.g. a PyTorch "
        "environment's site-packages/nvidia/nccl/lib) on LD_LIBRARY_PATH; or leave devices "
        "empty to run every rank on one device"));
  }
  const cuda::GroupStatus group = cuda::CreateNcclGroup(devices, streams, o.nccl_library, &s.group);
  if (!group.ok()) {
    return absl::InternalError(absl::StrCat("creating the NCCL group of devices ",
                                            absl::StrJoin(devices, ","), " (NCCL ", version,
                                            "): ", group.message()));
  }
  return CudaError(cudaSetDevice(s.ranks[0].device), "cudaSetDevice");
}

// One cuBLASLt handle per device: rank 0's (State::lt) serves every rank on its device.
absl::Status CudaModelRunner::CreateBlasHandles() {
  State& s = *state_;
  ROLLOUT_RETURN_IF_ERROR(CublasError(cublasLtCreate(s.lt.Receive()), "cublasLtCreate"));
  for (RankState& rk : s.ranks) {
    if (!s.OwnCopies(rk)) {
      rk.lt = s.lt.get();
      continue;
    }
    ROLLOUT_RETURN_IF_ERROR(s.SetDevice(rk));
    ROLLOUT_RETURN_IF_ERROR(CublasError(cublasLtCreate(rk.own_lt.Receive()), "cublasLtCreate"));
    rk.lt = rk.own_lt.get();
  }
  return s.SetDevice(s.ranks[0]);
}

}  // namespace rollout
