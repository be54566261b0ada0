#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/model_runner.h"
#include "model/safetensors.h"

namespace rollout {

namespace cuda {
class RankGroup;
}  // namespace cuda

namespace cuda_runner_internal {
struct SliceShape;
struct SlicePlan;
struct SlicePlanOptions;
struct RankState;
}  // namespace cuda_runner_internal

// Which attention kernel computes every row (kernels/cuda/ops.h). Each is batch invariant and
// prefill == decode bitwise; they differ from each other in bits, so the choice is part of the
// engine configuration the determinism contract is stated for.
enum class CudaAttentionKernel {
  kTensorCore,  // PagedAttentionMma: mma.sync, bf16 q and P, split-parallel + ordered merge
  kSimt,        // PagedAttention: fp32 SIMT (the first, simplest version)
};

struct CudaRunnerOptions {
  int device = 0;
  // Tensor-parallel ranks on separate GPUs: empty (the default) puts every rank on `device`, as
  // streams of that one GPU. Otherwise one distinct, existing device per rank (its size must be
  // tensor_parallel; INVALID_ARGUMENT else): rank r's weights shard, KV shard, activations,
  // stream, cuBLASLt handle and pinned GEMMs live on devices[r] (rank 0's, devices[0], replaces
  // `device`: metadata, logits and sampling are there), and with more than one device the ranks
  // exchange through NCCL (kernels/cuda/rank_group.h's CreateNcclGroup; libnccl.so.2 is
  // dlopen()ed, FAILED_PRECONDITION when it does not load) and decode steps run without CUDA
  // graphs (cuda_graphs is ignored). The logits are bitwise those of the same degree on one
  // device. With kv_cache_bytes = 0 the KV pool is sized from the least free memory among the
  // devices.
  std::vector<int> devices;
  // The NCCL library dlopen()ed when `devices` spans devices: a path, or "" for libnccl.so.2 on
  // the loader's search path (LD_LIBRARY_PATH).
  std::string nccl_library;
  // With `devices` spanning devices: how long a wait for a step (whose exchanges are NCCL's) may
  // take before the group is aborted and the runner fails every later step (a peer GPU failed
  // or hung; runner/cuda/bounded_wait.cc). > 0.
  int32_t collective_timeout_s = 300;
  // Fleets (UpdateWeightsFromBroadcast, engine/weight_sync.h): reserve on the device, at load and
  // before the KV pool, staging for one update of every served tensor (their checkpoint bytes,
  // each at a 256-byte boundary: 16.4 GB for Qwen3-8B) and its digest workspace. A broadcast
  // lands there bucket by bucket, is hashed there, and is copied device to device into the
  // weights at the swap. Off: CreateWeightSyncPort is FAILED_PRECONDITION naming
  // --device_weight_staging (no pinned-host fallback: docs/cuda.md says why).
  bool device_weight_staging = false;
  // KV page size in tokens. Any positive size works; attention tiles are 32 keys.
  int32_t kv_block_size = 32;
  // Split-KV size S: a multiple of 32 and of kv_block_size. Prefill chunks end on multiples of
  // it (the scheduler cuts them there).
  int32_t attention_split_size = 256;
  // Tokens per pass through the layers: the activation workspace is sized for this many.
  // Larger batches run in consecutive slices (bitwise the same: rows are batch invariant).
  int32_t max_batch_tokens = 8192;
  // Logit rows per lm_head pass (bounds the fp32 logits buffer).
  int32_t max_logit_rows = 512;
  // KV pool: exactly this many bytes when > 0, else this fraction of the memory still free
  // after weights and workspace.
  int64_t kv_cache_bytes = 0;
  double kv_cache_fraction = 0.90;
  // The m for which cuBLASLt's heuristic picks each weight shape's one pinned algorithm; <= 0
  // (or no pinnable algorithm) uses the no-workspace heuristic per m instead. Both are checked
  // row-invariant by tests/gpu/gemm_test.cc.
  int64_t gemm_pin_m = 256;
  // Pinned GEMMs also get a ladder (kernels/cuda/gemm.h): for ranges of m, a faster algorithm
  // admitted only after it gives the pin's bits on a probe. Same bits, faster at small m (decode
  // of few sequences) and large m (prefill).
  bool gemm_ladder = true;
  // The ladder's candidates include the hand-written small-m kernel's configurations
  // (kernels/cuda/small_m_gemm.h) for the ranges of m <= 256, admitted by the same probe.
  bool gemm_hand_kernels = true;
  CudaAttentionKernel attention_kernel = CudaAttentionKernel::kTensorCore;
  // kTensorCore only: decode tokens whose sequences hold the same KV pages for whole attention
  // splits (the samples of one request over their prompt, a cached prefix) read those pages once
  // per group of cuda::AttentionShareTokens(group) tokens instead of once each
  // (runner/cuda/batch_plan.cc, PlanShares). Same bits: which block computes a row's split
  // partial changes, the row's arithmetic does not (tests/gpu/kernels_test.cc).
  bool shared_prefix_attention = true;
  // kSimt only: decode tokens' attention as one block per (token, kv head, split) and an ordered
  // merge, instead of one block walking all splits. Same bits, more parallelism.
  bool split_parallel_decode = true;
  // Decode steps (every token its sequence's only one, all with logits) replay a CUDA graph
  // captured per (batch-size bucket, attention-split bucket): the batch is padded to the bucket
  // (1, 2, 4, 8, 16, 32, then multiples of 32 up to the largest bucket) with rows that write a
  // reserved KV block and are never read, and the split grid to a power of two. Rows are batch
  // invariant, so a row's bits are the same with graphs on or off (tests/gpu/model_test.cc).
  // Off when the ranks span devices (`devices`).
  bool cuda_graphs = true;
  // The largest decode batch run as a graph (capped at max_logit_rows and max_batch_tokens);
  // larger decode batches run eagerly.
  int32_t max_graph_batch = 512;
  // Tensor-parallel degree (docs/determinism.md, D10): 1, 2, 4 or 8 ranks on this one device
  // (or one device each: `devices`),
  // Megatron-partitioned as CpuModelRunner's (column-parallel q/k/v and gate/up, row-parallel
  // o_proj and down_proj, vocab-parallel embedding and lm_head, norms and residual replicated),
  // each rank with its own weights shard, KV-cache shard and stream. Every degree gives the
  // logits of tp = 1 with canonical_k_tree, bitwise. Requires what CheckTensorParallel
  // (model/tensor_parallel.h) requires, pinned GEMMs (gemm_pin_m > 0), and heads * head_dim
  // and the intermediate size multiples of 64.
  int32_t tensor_parallel = 1;
  // o_proj and down_proj as the canonical 8-segment K tree (kernels/cuda/tensor_parallel.h):
  // eight segment GEMMs (fp32 partials) combined, with the residual, by one fixed tree -- the
  // computation every tensor-parallel degree performs. Always on when tensor_parallel > 1. Off by
  // default at tp = 1, where the row-parallel GEMMs are one fused GEMM + residual epilogue
  // (faster; other bits); on, tp = 1 gives exactly the bits of tp = 2, 4 and 8.
  bool canonical_k_tree = false;
};

// Time spent per kernel family, summed over profiled Forward calls (CUDA events).
struct CudaForwardProfile {
  std::vector<std::string> names;
  std::vector<double> ms;  // [names.size()]
  int64_t forwards = 0;
};

// The CUDA backend: bf16 weights and KV cache, fp32 accumulation and residual stream, fp32
// logits. Every row is batch invariant (kernels/cuda/ops.h, kernels/cuda/gemm.h): its logits
// depend only on the weights and its sequence's tokens [0, position], bitwise. Owned and called
// by one thread (the engine thread); uses one CUDA stream on `options.device` per
// tensor-parallel rank.
//
// Tensor parallelism (options.tensor_parallel = tp > 1) on one device: the calling thread
// enqueues every rank's work on the rank's stream, phase by phase; the ranks meet only in
// all-gathers (kernels/cuda/rank_group.h: device copies in rank order between their streams,
// ordered by events): of the embedding rows (each token's row selected from its owner), of the
// row-parallel projections' tree nodes (combined, with the residual, by the tree's top levels on
// every rank), and of the logits columns (rank 0 assembles full rows; sampling is unchanged).
// Column-parallel GEMMs run the full weight's pinned algorithm on the rank's slice, so each
// output column has the unsliced GEMM's bits. Decode steps still replay CUDA graphs: the ranks'
// streams fork from and join into rank 0's, which is what a capture follows.
//
// Ranks on separate devices (options.devices): the same phases, each rank's work enqueued with
// its device current (rank 0's is current between them), the all-gathers NCCL's (one
// ncclAllGather per rank in one group call), the fork and join by events across devices; the
// batch metadata and RoPE tables are copied to every device; decode runs eagerly.
class CudaModelRunner final : public ModelRunner {
 public:
  // Loads every tensor of `checkpoint` (bf16, f16 or f32; converted to bf16, norms to fp32),
  // pins the GEMM algorithms and sizes the KV pool. Errors name the tensor or the CUDA call.
  static absl::StatusOr<std::unique_ptr<CudaModelRunner>> Create(const Checkpoint& checkpoint,
                                                                 const CudaRunnerOptions& options);
  // The same model with seeded weights generated on the GPU: bitwise what
  // WriteRandomModelForConfig(config, {seed, bf16}) writes, without touching the disk.
  static absl::StatusOr<std::unique_ptr<CudaModelRunner>> CreateSynthetic(
      const ModelConfig& config, uint64_t seed, const CudaRunnerOptions& options);
  ~CudaModelRunner() override;

  const ModelConfig& config() const override { return config_; }
  const char* backend_name() const override { return "cuda"; }
  int32_t num_kv_blocks() const override { return num_kv_blocks_; }
  int32_t kv_block_size() const override { return options_.kv_block_size; }
  int32_t attention_split_size() const override { return options_.attention_split_size; }
  // The GPU, the toolkit and cuBLASLt, the pinned GEMMs (rank 0's: every rank runs the same
  // algorithms), the attention kernel and its split and tile (kernels/cuda/numerics.h).
  RunnerNumerics numerics() const override;

  // As ModelRunner::Forward, except that the fp32 logits stay on the GPU for ProcessLogits:
  // `logits` (may be nullptr) is left empty. ForwardToHost also copies them to the host.
  // A batch that asks for routing (ForwardBatch::asks_routing) is run as ForwardWithRouting
  // when it only forces routings; one that asks them back is refused (InvalidArgument).
  absl::Status Forward(const ForwardBatch& batch, std::vector<float>* logits) override;
  // MoE routing replay (engine/model_runner.h), a MoE model only (tp = 1): forced rows' ids go
  // to the routing kernel (the weights from their probabilities), every logits row's ids come
  // back from the device after each slice. Runs synchronously, without decode graphs. The logits
  // stay on the GPU when `logits` is null, else come to the host as ForwardToHost's.
  // InvalidArgument for a forced routing of the wrong size, an id out of range or twice in a
  // layer, or a dense model.
  bool SupportsRoutingReplay() const override { return config_.is_moe(); }
  absl::Status ForwardWithRouting(const ForwardBatch& batch, std::vector<float>* logits,
                                  std::vector<std::vector<int32_t>>* routing) override;
  // Forward, then the logits of batch.logit_rows in `logits` ([rows, vocab]; tests, benchmarks).
  absl::Status ForwardToHost(const ForwardBatch& batch, std::vector<float>* logits);
  // Samples / scores on the GPU (kernels/cuda/sampling.h, one block per row, fixed-order
  // reductions): the rows are the device logits of the last Forward when `logits` is empty, else
  // `logits` ([tasks.size(), vocab], uploaded: tests). lp = log_softmax(logits / T) (T = 0 -> 1)
  // is the device's for every row, sampled or scored, so Score equals Generate bitwise. Greedy,
  // plain-temperature sampling (Gumbel-max with UniformNoise, bitwise the host's u), scoring and
  // top-N run on the device; a sampled row with top_k, top_p < 1 or min_p > 0 has its token
  // chosen on the host (SampleToken on the row copied back), and its logprob is then computed
  // from the device's max and log-sum with the same two subtractions (bitwise the device's lp).
  absl::Status ProcessLogits(const std::vector<LogitsRowTask>& tasks,
                             const std::vector<float>& logits,
                             std::vector<SampleResult>* results) override;
  // The step pipeline. A step whose logits stay on the GPU in one pass and whose rows are all
  // processed there (CanFeed) is only enqueued: metadata upload, the fed tokens copied from the
  // previous step's sampling results on the device, the forward pass (a decode graph's replay),
  // sampling, the results' download, an event; CollectStep waits for that event. Other steps run
  // at launch (Forward + ProcessLogits). Host staging is double-buffered (State::HostSlot).
  absl::Status LaunchStep(const ForwardBatch& batch,
                          const std::vector<LogitsRowTask>& tasks) override;
  absl::Status CollectStep(std::vector<SampleResult>* results) override;
  // Rows the device picks every token of (greedy, plain-temperature sampling; no scoring, no
  // top-k / top-p / min-p), at most max_logit_rows, on one device, not profiling.
  bool CanFeed(const std::vector<LogitsRowTask>& tasks) const override;
  bool LaunchesAsync() const override { return true; }
  // Forward and ProcessLogits (and ForwardToHost) must not be called while a launched step is
  // uncollected: they stage in the host buffers LaunchStep uses.
  // Weights as the checkpoint had them (bf16 for synthetic models); updates are converted to the
  // device layout (bf16 matrices, fp32 norms and biases) on the host, then copied.
  const std::vector<WeightSpec>& weight_specs() const override;
  absl::Status UpdateWeights(const std::vector<HostTensorView>& tensors) override;
  // Page-locked (cudaHostAlloc, portable to every device), so that UpdateWeights enqueues every
  // copy at once and waits once; plain memory, with a warning, if the driver refuses.
  absl::StatusOr<std::unique_ptr<HostStagingBuffer>> AllocateHostStaging(
      size_t bytes) const override;
  // IPC updates (ipc_weights.cc), ranks on one GPU (FAILED_PRECONDITION with `devices`): every
  // tensor's GPU must be rank 0's (by UUID), each distinct handle is opened once, each tensor
  // checked inside its exported allocation (cuMemGetAddressRange) and hashed on the device
  // (device_tensor_digest.h); the update copies device to device (converted, bitwise as the host
  // path, where the dtype is not the device's) and waits for the copies.
  absl::StatusOr<std::unique_ptr<OpenedIpcTensors>> OpenIpcTensors(
      const std::vector<IpcTensorSource>& tensors) override;
  absl::Status UpdateWeightsFromIpc(const OpenedIpcTensors& opened) override;
  // Fleets (weight_sync_port.cc): with device_weight_staging and ranks on one GPU, a port whose
  // members are NCCL ranks on rank 0's device (NCCL dlopen()ed from options.nccl_library when
  // the first group is joined) and whose sink stages and hashes in the reserved staging;
  // FAILED_PRECONDITION naming --device_weight_staging (or --cuda_devices) otherwise. The swap
  // copies the staged tensors device to device (converted where the dtype is not the device's)
  // and waits for the copies.
  absl::StatusOr<std::unique_ptr<WeightSyncPort>> CreateWeightSyncPort() override;
  absl::Status UpdateWeightsFromStaging(const StagedWeights& staged) override;

  // Colocated memory (ModelRunner::ReleaseMemory): the KV pool and, with `weights`, the weights
  // are ReleasableDeviceBuffers (CUDA virtual memory: the addresses stay reserved, the decode
  // graphs stay valid); released weights are copied to host memory first and copied back by
  // ResumeMemory, which zeroes the KV pool as at load. FAILED_PRECONDITION on a device or driver
  // without virtual memory management (the start-up log says which), RESOURCE_EXHAUSTED for a
  // weights backup the host cannot hold or device memory a resume cannot get back (everything
  // then stays as it was). Bytes are the physical memory given back (whole granules).
  absl::StatusOr<ReleasedMemory> ReleaseMemory(bool weights) override;
  absl::StatusOr<ReleasedMemory> ResumeMemory() override;
  bool kv_cache_released() const;

  // Per-kernel-family timing of later Forward calls (adds one event per kernel; off by default).
  void EnableProfiling(bool on);
  CudaForwardProfile profile() const;
  void ResetProfile();

  // Tests of faults across ranks (tests/gpu/tp_test.cc): the rank group becomes wrap(the
  // group) -- e.g. one that says its exchanges can hang -- and the waits bound by
  // CudaRunnerOptions::collective_timeout_s apply to it. Returns rank 0's stream (a
  // cudaStream_t), where a test can enqueue work that never ends. tp > 1 only (else null).
  // Not OK once a hung or failed exchange across GPUs aborted the tensor-parallel group.
  absl::Status Usable() const override;
  void* WrapRankGroupForTesting(
      const std::function<std::unique_ptr<cuda::RankGroup>(std::unique_ptr<cuda::RankGroup>)>&
          wrap);

  int32_t tensor_parallel() const { return options_.tensor_parallel; }
  // True when tensor_parallel > 1 even if the options said false.
  bool canonical_k_tree() const { return options_.canonical_k_tree; }
  // What was pinned per weight shape, one line each.
  const std::vector<std::string>& gemm_descriptions() const;
  int64_t weight_bytes() const;
  int64_t kv_cache_bytes() const;
  // Decode graphs captured so far, and decode steps that replayed one.
  int64_t graphs_captured() const;
  int64_t graph_launches() const;

 private:
  struct State;
  CudaModelRunner(ModelConfig config, CudaRunnerOptions options);

  // Construction (Create, CreateSynthetic): Init, the weights (LoadCheckpoint or LoadSynthetic),
  // then Finish; Init and Finish each run the named steps below them, in this order.
  // Init (setup.cc): the options and the model checked against what the kernels support, then
  absl::Status Init();
  void SetUpRanks();                 // the ranks' shards and devices
  absl::Status CreateStreams();      // each rank's stream and event (the fork event at tp > 1)
  absl::Status CreateRankGroup();    // tp > 1: the ranks' exchanges (same device, or NCCL)
  absl::Status CreateBlasHandles();  // cuBLASLt: one per device
  absl::Status LayOutWeights();      // each rank's weight allocations (weights.cc)
  absl::Status BindTensors();        // every checkpoint tensor to the pieces the ranks hold
  // The weights (weights.cc).
  absl::Status LoadCheckpoint(const Checkpoint& checkpoint);
  absl::Status LoadSynthetic(uint64_t seed);
  // Finish (workspace.cc, pinned_gemms.cc):
  absl::Status Finish();
  absl::Status UploadRopeTables();
  absl::Status AllocateWorkspace();      // activations, logits, sampling buffers, host staging
  absl::Status AllocateWeightStaging();  // device_weight_staging: broadcast staging, digests
  absl::Status PinGemms();
  absl::Status PinCanonicalGemms();
  absl::Status PinMoeGemms();      // a MoE model's router
  absl::Status AllocateKvCache();  // the KV pool from the memory left

  // The forward pass (forward.cc). async (LaunchStep): fed tokens (batch.fed_tokens: rows of the
  // device's sampling results) allowed, and nothing waits for the device.
  // routing (ForwardWithRouting): the batch's forced routings in, its rows' routings out.
  struct RoutingIo;
  absl::Status ForwardImpl(const ForwardBatch& batch, float* host_logits, bool async = false,
                           RoutingIo* routing = nullptr);
  absl::Status CheckBatch(const ForwardBatch& batch, bool async) const;
  // Tokens [begin, end) of the batch: planned (batch_plan.h), the metadata uploaded, the slice
  // enqueued or its decode graph replayed.
  absl::Status ForwardSlice(const ForwardBatch& batch, int64_t begin, int64_t end,
                            float* host_logits, bool keep_on_device, bool async,
                            RoutingIo* routing);
  // Routing replay around a slice (routing_replay.cc): its forced routings uploaded (returns
  // whether it has any), and after it ran, its logits rows' routings downloaded.
  absl::StatusOr<bool> UploadForcedRouting(const RoutingIo& routing, int64_t begin, int64_t end);
  // `forward`'s status; when it is OK and `logits` (host rows of it) is set, keeps them for
  // ProcessLogits as ForwardToHost does.
  absl::Status FinishHostLogits(absl::Status forward, std::vector<float>* logits);
  absl::Status DownloadRouting(const ForwardBatch& batch, int64_t begin, int64_t end,
                               RoutingIo* routing);
  cuda_runner_internal::SlicePlanOptions PlanOptions() const;
  // Where ForwardImpl ends the slices of `batch` (SliceEnd: max_batch_tokens and the planned
  // attention partials); empty for an empty batch.
  std::vector<int64_t> SliceEnds(const ForwardBatch& batch) const;
  absl::Status GrowAttentionPartials(const cuda_runner_internal::SliceShape& shape);
  // The plan's metadata packed into the staging slot, uploaded to every device, and the fed
  // tokens copied in from the device's sampling results.
  absl::Status UploadSliceMetadata(const ForwardBatch& batch,
                                   const cuda_runner_internal::SlicePlan& plan,
                                   const cuda_runner_internal::SlicePlanOptions& options);
  // Enqueues a slice whose metadata is on the device: the layers, then the logits rows (copied
  // to `host_logits` pass by pass when it is set). forward_layers.cc.
  // forced_routing: the slice's routing replay is uploaded (EnqueueMoe).
  absl::Status EnqueueSlice(const cuda_runner_internal::SliceShape& shape, float* host_logits,
                            bool keep_on_device, bool forced_routing = false);
  // The parts of EnqueueSlice. Per rank: the attention block up to its o_proj part (input norm
  // and q/k/v, then attention), the MLP up to its down_proj part, and a row-parallel projection's
  // part (mlp: down_proj, else o_proj; the fused GEMM + residual, or the rank's leaves of the K
  // tree into its node -- at tp = 1 the whole tree into x). Across ranks: the embedding, the
  // all-gather of the nodes and the tree's top into x, the logits.
  absl::Status EnqueueEmbedding(const cuda_runner_internal::SliceShape& shape);
  absl::Status EnqueueAttention(cuda_runner_internal::RankState& rk, int layer,
                                const cuda_runner_internal::SliceShape& shape);
  absl::Status EnqueueQkv(cuda_runner_internal::RankState& rk, int layer,
                          const cuda_runner_internal::SliceShape& shape);
  absl::Status EnqueuePagedAttention(cuda_runner_internal::RankState& rk, int layer,
                                     const cuda_runner_internal::SliceShape& shape);
  absl::Status EnqueueMlp(cuda_runner_internal::RankState& rk, int layer, int64_t n);
  // A MoE layer's MLP (tp = 1): router GEMM, routing (forced where the slice's routing replay
  // says), grouping, the grouped expert GEMMs, the combine into x. `forced`: the slice has
  // forced rows (their ids and flags uploaded to moe_forced_ids / moe_forced_rows).
  absl::Status EnqueueMoe(cuda_runner_internal::RankState& rk, int layer, int64_t n, bool forced);
  absl::Status EnqueueRowParallel(cuda_runner_internal::RankState& rk, int layer, bool mlp,
                                  int64_t n);
  absl::Status CombineRowParallel(int64_t n);
  // xn = RmsNorm(x) with `weight`, unless the add before it already left exactly that in xn
  // (rk.xn_norm == weight: the fused SumTreeRmsNorm / MoeCombineRmsNorm). Clears rk.xn_norm.
  absl::Status NormIntoXn(cuda_runner_internal::RankState& rk, int64_t n, const float* weight);
  // The RMSNorm that follows a layer's attention (mlp = false: its post norm) or MLP (the next
  // layer's input norm; nullptr after the last layer, whose final norm takes the logits rows):
  // the add into x that precedes it takes it too.
  const float* NextNorm(const cuda_runner_internal::RankState& rk, int layer, bool mlp) const;
  absl::Status EnqueueLogits(const cuda_runner_internal::SliceShape& shape, float* host_logits,
                             bool keep_on_device);
  // Replays (capturing it the first time) the decode graph of `shape`'s bucket. decode_graphs.cc.
  absl::Status LaunchDecodeGraph(const cuda_runner_internal::SliceShape& shape);

  // Colocated memory (memory_release.cc). Every rank's device drained.
  absl::Status SynchronizeRanks();
  // Takes back every released buffer (all or nothing), zeroes the KV pool, restores the weights
  // from weights_backup; what it took back in *taken.
  absl::Status Reacquire(ReleasedMemory* taken);

  // Logits processing (logits_processing.cc).
  absl::Status ProcessDeviceRows(const float* rows, const std::vector<LogitsRowTask>& tasks,
                                 int64_t first, int64_t count, std::vector<SampleResult>* results);
  // Enqueues the processing of tasks[first, first + count) (their logits at `rows` on the device):
  // specs staged and uploaded, the sampling kernel, the results' download into the staging slot.
  absl::Status EnqueueDeviceRows(const float* rows, const std::vector<LogitsRowTask>& tasks,
                                 int64_t first, int64_t count);
  // The device results of `count` rows from `out` (host) into results[first ..].
  static void ConvertDeviceRows(const void* out, int64_t first, int64_t count,
                                std::vector<SampleResult>* results);
  // The results of the launched step staged in `slot` (`rows` rows), once its event fires.
  // step_pipeline.cc.
  absl::Status SlotResults(int slot, int64_t rows, std::vector<SampleResult>* results);

  const ModelConfig config_;
  const CudaRunnerOptions options_;
  int32_t num_kv_blocks_ = 0;
  std::unique_ptr<State> state_;
};

}  // namespace rollout
