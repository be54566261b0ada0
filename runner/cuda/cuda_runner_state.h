#pragma once

// Internal to the CUDA runner's translation units (runner/cuda/*.cc): what a CudaModelRunner owns
// on the device. Not an API.
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "common/cuda_status.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/rank_group.h"
#include "runner/cuda/cuda_handles.h"
#include "runner/cuda/cuda_model_runner.h"
#include "runner/cuda/forward_profile.h"
#include "runner/cuda/rank_state.h"
#include "runner/cuda/weight_binding.h"

namespace rollout {

// Everything a runner holds on the device. Engine thread only, like the runner.
//
// Teardown: members are destroyed in reverse order of declaration, and the owners of device
// resources are declared so that this is the order those must go in. ~CudaModelRunner first
// drains every rank's stream and, when ranks span devices, makes rank 0's device current.
//   1. the decode graphs, then the profiling events;
//   2. the host staging slots (their events, then their pinned memory);
//   3. the rank group (NCCL communicators, or the same-device group's events): it uses the ranks'
//      streams, which outlive it;
//   4. the fork event;
//   5. the ranks, in index order, each with its device current (RankList; RankState says in
//      which order a rank's own resources go: its stream last);
//   6. the shared cuBLASLt handle, after every GEMM made with it;
//   7. the device memory on rank 0's device that every rank reads.
struct CudaModelRunner::State {
  using LayerWeights = cuda_runner_internal::LayerWeights;
  using Binding = cuda_runner_internal::Binding;
  using RankState = cuda_runner_internal::RankState;
  using bf16 = cuda::bf16;

  // Tensor parallelism: tp ranks (1 = the whole model in ranks[0]); canonical: o_proj and
  // down_proj as the canonical K tree (always when tp > 1); vocab_rows: rows of each rank's
  // embedding / lm_head shard (vocab at tp = 1, else ceil(vocab / tp) rounded up to 64).
  int tp = 1;
  bool canonical = false;
  int64_t vocab_rows = 0;
  // Ranks on several devices (CudaRunnerOptions::devices with more than one): every enqueue for
  // a rank runs with its device current (SetDevice), the exchanges are NCCL's, and decode runs
  // without CUDA graphs. False: every rank on ranks[0].device, which stays current throughout.
  bool multi_device = false;

  // Waits for `event` (or, when null, everything enqueued on `stream`), as cudaEventSynchronize
  // / cudaStreamSynchronize do -- which is what it calls unless the group's collectives can
  // hang on other GPUs (RankGroup::can_hang: NCCL). Then it polls, with the group's async
  // errors, until collective_timeout; on an error or the timeout it aborts the group, and the
  // runner is `broken`: this and every later step fail with that message (bounded_wait.cc).
  absl::Status Wait(cudaStream_t stream, cudaEvent_t event, const char* what);
  // OK, or the FAILED_PRECONDITION of a runner whose group was aborted (Wait).
  absl::Status CheckUsable() const;
  std::chrono::milliseconds collective_timeout{std::chrono::minutes(5)};
  std::string broken;

  // Makes rk's device current when ranks span devices (nothing otherwise).
  absl::Status SetDevice(const RankState& rk) const {
    if (!multi_device) return absl::OkStatus();
    return CudaError(cudaSetDevice(rk.device), "cudaSetDevice");
  }
  // The batch metadata and RoPE tables as rank rk reads them (on its device).
  bool OwnCopies(const RankState& rk) const { return multi_device && rk.index > 0; }
  const int32_t* MetaOf(const RankState& rk) const {
    return OwnCopies(rk) ? rk.meta.get<int32_t>() : meta.get<int32_t>();
  }
  const float* RopeCosOf(const RankState& rk) const {
    return OwnCopies(rk) ? rk.rope_cos.get<float>() : rope_cos.get<float>();
  }
  const float* RopeSinOf(const RankState& rk) const {
    return OwnCopies(rk) ? rk.rope_sin.get<float>() : rope_sin.get<float>();
  }

  // --- 7. On rank 0's device, read by every rank on it.
  cuda::DeviceBuffer rope_cos;  // [max_position, head_dim / 2]
  cuda::DeviceBuffer rope_sin;  // [max_position, head_dim / 2]
  cuda::DeviceBuffer logits;    // [max_logit_rows, vocab] fp32, full rows (rank 0's stream)
  // int32 batch metadata (SliceShape's layout, runner/cuda/batch_plan.h), read by every rank on
  // rank 0's device (RankState::meta on the others).
  cuda::DeviceBuffer meta;
  // ProcessLogits: per-row specs and results on the device, [max_logit_rows].
  cuda::DeviceBuffer row_specs, row_results;
  // Broadcast staging (CudaRunnerOptions::device_weight_staging; empty without): room for a
  // stream of every served tensor (engine/broadcast_plan.h), 32 bytes per digest leaf of them,
  // and 32 per tensor. The weight-sync port's sink (weight_sync_port.cc) writes them from its
  // thread; the engine thread reads `weight_staging` at the swap (UpdateWeightsFromStaging).
  cuda::DeviceBuffer weight_staging, staging_leaf_digests, staging_tensor_digests;

  // --- 6. The cuBLASLt handle of rank 0's device: RankState::lt of every rank on it.
  cuda_runner_internal::CublasLt lt;
  // --- 5. The tensor-parallel ranks.
  cuda_runner_internal::RankList ranks;
  cudaStream_t stream = nullptr;  // ranks[0].stream's: metadata, logits, sampling, capture origin
  // --- 4, 3. tp > 1: the event that starts ranks > 0 after what rank 0's stream enqueued before
  // a slice (the metadata upload; in a capture, what forks them into it), and the ranks'
  // exchanges.
  cuda_runner_internal::CudaEvent fork;
  std::unique_ptr<cuda::RankGroup> group;

  int64_t weight_bytes = 0;
  // ReleaseMemory with weights: each rank's weights_bf16 then weights_f32 bytes, kept in host
  // memory until ResumeMemory copies them back ([rank]; empty while the weights are on the
  // device).
  std::vector<std::unique_ptr<uint8_t[]>> weights_backup;
  std::map<std::string, Binding> bindings;
  std::vector<WeightSpec> weight_specs;  // sorted by name
  std::vector<std::string> gemm_descriptions;
  // ServerInfo.numerics.gemm_algorithms: cuda::DescribePin of each weight shape's pin (the full
  // shape's at tp > 1, whose algorithm every rank's slice runs).
  std::vector<std::string> pin_lines;

  // The last Forward's logits: on the device in `logits` rows [0, last_rows) when they fit
  // (last_on_device), else copied pass by pass to `spill` [last_rows, vocab].
  int64_t last_rows = 0;
  bool last_on_device = false;
  std::vector<float> spill;

  // --- 2. Host staging (pinned): the batch metadata, the sampling specs ([max_logit_rows]) and
  // results ([max_logit_rows]) of a step. Two, so that LaunchStep prepares step N + 1 while
  // the device still copies step N's; `done` is recorded after a launched step's last copy, and
  // a slot is written again only after it. Forward and ProcessLogits stage in the current slot:
  // LaunchStep's own calls use a slot no uncollected step holds; callers outside LaunchStep
  // must not call them while a launched step is uncollected.
  struct HostSlot {
    cuda::PinnedHostBuffer meta, specs, results;
    cuda_runner_internal::CudaEvent done;
  };
  HostSlot slots[2];
  int slot = 0;  // the slot being staged in
  HostSlot& staging() { return slots[slot]; }
  // Launched steps not collected yet (LaunchStep / CollectStep), oldest first.
  struct Launched {
    // Set: on the device; the results are in slots[*slot].results after `done`. None: computed
    // at launch, in `results`.
    std::optional<int> slot;
    int64_t rows = 0;
    std::vector<SampleResult> results;
  };
  std::deque<Launched> launched;
  // The device's row_results hold the tokens of the last launched step's feed_rows rows: a
  // launched batch may take its fed tokens from them.
  bool feed_ready = false;
  int64_t feed_rows = 0;

  // --- 1. Per-kernel-family timing (EnableProfiling).
  cuda_runner_internal::ForwardProfiler profiler;
  // The end of `family`'s work on rank 0's stream, when profiling.
  absl::Status Mark(int family) { return profiler.Mark(family, stream); }

  // Decode graphs by (padded batch size, split bucket). They hold the device pointers of
  // the buffers above: reallocating one (Grow) drops them all.
  std::map<std::pair<int64_t, int32_t>, cuda_runner_internal::CudaGraphExec> graphs;
  bool graphs_failed = false;  // a capture failed once: decode runs eagerly from then on
  // Tokens x splits every rank's attention partials hold (planned at load; SliceEnd keeps every
  // slice within it).
  int64_t partial_token_splits = 0;
  int64_t graphs_captured = 0;
  int64_t graph_launches = 0;
  // A KV block outside the engine's pool: padding rows of a decode graph write and read it.
  int32_t pad_block = 0;

  void DropGraphs() { graphs.clear(); }

  // Makes `buffer` hold at least `bytes` (allocating `alloc_bytes` when it must grow).
  cudaError_t Grow(cuda::DeviceBuffer* buffer, size_t bytes, size_t alloc_bytes) {
    if (buffer->bytes() >= bytes) return cudaSuccess;
    // A launched step (LaunchStep) may still read the buffer and replay the graphs.
    const cudaError_t idle = cudaDeviceSynchronize();
    if (idle != cudaSuccess) return idle;
    DropGraphs();
    return buffer->Allocate(alloc_bytes);
  }
};

}  // namespace rollout
