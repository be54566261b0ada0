#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/ipc_tensor.h"
#include "engine/sampler.h"
#include "engine/sampling_params.h"
#include "engine/weight_sync.h"
#include "model/model_config.h"
#include "model/safetensors.h"
#include "model/weight_spec.h"

namespace rollout {

// A token of a launched batch that the runner takes from the step launched just before it: the
// token sampled for logits row `from_row` of that step (ModelRunner::LaunchStep).
struct FedToken {
  int32_t token_index = 0;  // into ForwardBatch::token_ids, whose value there is ignored
  int32_t from_row = 0;
};

// One engine step's tokens, flattened: prefill chunks and decode tokens of many sequences.
struct ForwardBatch {
  std::vector<int32_t> token_ids;  // [num_tokens]; a fed token's entry is a placeholder (0)
  std::vector<int32_t> positions;  // [num_tokens] absolute position in its sequence
  std::vector<int32_t> token_seq;  // [num_tokens] index into block_tables
  std::vector<std::vector<int32_t>> block_tables;  // per sequence: KV block ids
  std::vector<int32_t> logit_rows;   // tokens whose next-token logits are wanted, ascending
  std::vector<FedToken> fed_tokens;  // ascending token_index; only in launched batches

  // MoE routing replay (ModelRunner::SupportsRoutingReplay). A token's routing is the experts it
  // uses at every MoE layer: ModelConfig::RoutingSize() ids, MoE layers ascending, each layer's
  // num_experts_per_tok ids in rank order (router probability descending, ties to the lower id).
  // forced_routing: empty (every token chooses), or one entry per logits row (parallel to
  // logit_rows), each empty (the row's token chooses) or the routing its token uses instead of
  // choosing -- the weights are then the router probabilities at those ids, renormalised as
  // chosen ones are (docs/determinism.md). REQUIRES: each forced id in [0, num_experts), no id
  // twice in one layer. Only logits rows can be forced; the other tokens choose.
  std::vector<std::vector<int32_t>> forced_routing;
  // Return every logits row's routing (the forced one where forced) in SampleResult::routing.
  bool return_routing = false;

  bool asks_routing() const { return return_routing || !forced_routing.empty(); }
  int64_t num_tokens() const { return static_cast<int64_t>(token_ids.size()); }
};

// Memory a runner gave back by ModelRunner::ReleaseMemory (or took again by ResumeMemory).
struct ReleasedMemory {
  int64_t kv_cache_bytes = 0;
  int64_t weight_bytes = 0;
  bool weights = false;  // the weights are (were) among it
};

// What the engine wants from one logits row of the last Forward: sample the next token, or
// (score_token set) the teacher-forced logprob of a given token.
struct LogitsRowTask {
  const SamplingParams* params = nullptr;  // temperature (0 = greedy), filters, top_logprobs
  uint64_t sample_seed = 0;
  int64_t position = 0;  // absolute position of the token being sampled
  std::optional<int32_t> score_token;
};

// Host memory to stage weight updates in, from the backend that copies out of it
// (ModelRunner::AllocateHostStaging). Uninitialised when allocated. Owns the memory; not
// thread-safe (one update writes it at a time).
class HostStagingBuffer {
 public:
  virtual ~HostStagingBuffer() = default;
  virtual uint8_t* data() const = 0;
  virtual size_t size() const = 0;
  // Page-locked: the backend's device copies from it run asynchronously at the bus rate.
  virtual bool pinned() const = 0;
};

// `bytes` of plain heap memory, uninitialised (ModelRunner::AllocateHostStaging's default):
// RESOURCE_EXHAUSTED when it cannot be had.
absl::StatusOr<std::unique_ptr<HostStagingBuffer>> AllocatePlainHostStaging(size_t bytes);

// What only the loaded runner knows about its arithmetic, for ServerInfo.numerics (docs/api.md,
// "Numerics contract"): the device, libraries and kernel choices its bits depend on. Empty
// strings and zeros: not applicable (the CPU backend reports none of it here).
struct RunnerNumerics {
  std::string compute_dtype;  // what activations are held in, e.g. "bfloat16+float32"
  std::string kernels;        // the kernels' build id and version
  std::string row_parallel_reduction;  // "canonical_k_tree_8" or "fused"
  std::string gpu_model;
  std::string compute_capability;
  std::string cuda_runtime;
  std::string cublaslt_version;
  std::vector<std::string> gemm_algorithms;  // one line per pinned weight shape
  int64_t gemm_pin_m = 0;
  bool gemm_ladder = false;
  std::string attention_kernel;  // "tensor_core" or "simt"
  int32_t attention_split_size = 0;
  int32_t attention_tile = 0;
};

// A backend's forward pass with its KV cache. Owned and called by the engine thread only (but
// AllocateHostStaging, which any thread may call).
// Contract: the logits of a row are a pure function of the weights and the tokens at positions
// [0, position] of its sequence -- bitwise, whatever the rest of the batch, the chunking, or
// where the cached KV came from.
class ModelRunner {
 public:
  virtual ~ModelRunner() = default;

  virtual const ModelConfig& config() const = 0;
  virtual const char* backend_name() const = 0;
  // The device facts of ServerInfo.numerics (RunnerNumerics); the default reports none.
  virtual RunnerNumerics numerics() const { return {}; }
  virtual int32_t num_kv_blocks() const = 0;
  virtual int32_t kv_block_size() const = 0;
  // Prefill chunks are cut at multiples of this (absolute positions).
  virtual int32_t attention_split_size() const = 0;

  // OK while the runner can run steps. An error (with why) once it cannot any more: a
  // fault it cannot recover from (the CUDA runner after its tensor-parallel group across GPUs
  // was aborted). The engine asks after a failed step (EngineCore::NoteFailedStep).
  virtual absl::Status Usable() const { return absl::OkStatus(); }

  // Writes the K/V of every token into its block slot, then returns the fp32 logits of
  // batch.logit_rows: [logit_rows.size(), vocab_size] in `logits`.
  // REQUIRES: every block table covers its tokens' positions.
  virtual absl::Status Forward(const ForwardBatch& batch, std::vector<float>* logits) = 0;

  // MoE routing replay: whether this runner honours ForwardBatch::forced_routing and
  // return_routing (a MoE model on a backend that implements it). The engine refuses requests
  // that ask for routing otherwise; a runner given such a batch anyway refuses it
  // (RefuseRouting), never ignores it.
  virtual bool SupportsRoutingReplay() const { return false; }
  // Forward, and (batch.return_routing) each logits row's routing in `routing`
  // ([logit_rows.size()], each RoutingSize() ids). The default: Forward for a batch that asks
  // no routing, else RefuseRouting.
  virtual absl::Status ForwardWithRouting(const ForwardBatch& batch, std::vector<float>* logits,
                                          std::vector<std::vector<int32_t>>* routing);

  // Samples or scores every row of the last Forward's logits: tasks[i] for row i, results[i]
  // its token (the scored token for scoring rows), logprob and top-N. `logits` is what Forward
  // returned. The same row and task always give the same bits.
  virtual absl::Status ProcessLogits(const std::vector<LogitsRowTask>& tasks,
                                     const std::vector<float>& logits,
                                     std::vector<SampleResult>* results) = 0;

  // The step pipeline, what the engine drives. LaunchStep starts a step: Forward(batch), then
  // its logits rows processed as ProcessLogits does (tasks[i] for row i). CollectStep waits for
  // the oldest launched step that is not collected yet and returns its results; every launched
  // step is collected, in launch order. A backend may leave a launched step running on its
  // device and return at once (the CUDA backend does), so that the engine prepares the next one
  // meanwhile.
  // Fed tokens (batch.fed_tokens): a token the batch takes from logits row r of the step launched
  // just before (not yet collected). That is how the engine launches decode
  // step N + 1 before it has seen step N's tokens; the CUDA backend copies them on the device.
  // At most two steps are in flight. The default runs Forward and ProcessLogits inside LaunchStep.
  virtual absl::Status LaunchStep(const ForwardBatch& batch,
                                  const std::vector<LogitsRowTask>& tasks);
  virtual absl::Status CollectStep(std::vector<SampleResult>* results);
  // Whether the tokens of a launched step with these tasks can be fed to the next launched step
  // (the CUDA backend: rows whose token the device picks, few enough for one sampling pass).
  virtual bool CanFeed(const std::vector<LogitsRowTask>& tasks) const { return true; }
  // Whether LaunchStep returns while the step still runs (on a device), so that launching the
  // next step early overlaps host and device work. The default computes at launch: false.
  virtual bool LaunchesAsync() const { return false; }

  // Every tensor a weight update may replace, sorted by name. Constant after construction.
  virtual const std::vector<WeightSpec>& weight_specs() const = 0;

  // Replaces the named tensors with the bytes `tensors` view (which stay valid until it
  // returns). All-or-nothing: validates every tensor (known name, dtype and shape as in
  // weight_specs(), exact byte count) before changing anything. Returns once the bytes are no
  // longer read. Fastest from memory AllocateHostStaging gave.
  virtual absl::Status UpdateWeights(const std::vector<HostTensorView>& tensors) = 0;

  // `bytes` of host memory for staging weight updates, the memory UpdateWeights copies from
  // fastest: page-locked on the CUDA backend (so the swap's copies run at the bus rate, all
  // enqueued at once), plain memory here (the CPU backend reads it where it is). Thread-safe,
  // unlike the rest of the class: the server stages updates while the engine steps. The buffer
  // may outlive the runner. RESOURCE_EXHAUSTED when the memory cannot be had.
  virtual absl::StatusOr<std::unique_ptr<HostStagingBuffer>> AllocateHostStaging(
      size_t bytes) const;

  // Colocated memory (Engine::ReleaseMemory). ReleaseMemory gives the KV cache's memory back
  // to the system (the GPU, or the host for the CPU backend) and keeps its addresses reserved,
  // so that what holds them (captured decode graphs) stays valid; with `weights`, the weights'
  // memory too, their bytes kept in host memory (a backend whose weights are in host memory
  // already keeps them: nothing more is released). The KV contents are lost. What is released
  // already stays so and is not counted again. Returns what this call released.
  // REQUIRES: no launched step is uncollected, and no KV block holds anything that will be
  // read (the engine requeues or ends every sample and flushes the prefix cache first).
  // The default: UNIMPLEMENTED, naming the backend.
  virtual absl::StatusOr<ReleasedMemory> ReleaseMemory(bool weights);
  // Takes back everything released: the KV cache at its old addresses, zeroed as at load; the
  // weights at theirs, restored bitwise. All or nothing: when the memory is not there,
  // RESOURCE_EXHAUSTED (what is missing, and how much is free) leaves everything released as it
  // was, for a later retry. Returns what this call took back (nothing when nothing was
  // released). Between the two, only ResumeMemory, ReleaseMemory and the constant accessors may
  // be called: no Forward, LaunchStep or UpdateWeights.
  virtual absl::StatusOr<ReleasedMemory> ResumeMemory();

  // Weight updates from another process's device memory (engine/ipc_tensor.h), in two steps so
  // that the digest is known before anything is applied. OpenIpcTensors maps every export into
  // this process, checks each tensor lies inside its exported allocation and hashes its bytes;
  // the exports stay mapped until the result is destroyed. A handle that cannot be opened
  // (freed, of an exited process, of another GPU) or a tensor outside its allocation is
  // INVALID_ARGUMENT naming the tensor. REQUIRES: CheckIpcTensors(weight_specs(), tensors).ok().
  // The default (the cpu backend): FAILED_PRECONDITION.
  virtual absl::StatusOr<std::unique_ptr<OpenedIpcTensors>> OpenIpcTensors(
      const std::vector<IpcTensorSource>& tensors);
  // Copies what OpenIpcTensors opened (this runner's, not yet applied) into the served weights,
  // as UpdateWeights does host bytes: everything was checked before, so only a device failing
  // mid-copy can leave it half done. The default: FAILED_PRECONDITION.
  virtual absl::Status UpdateWeightsFromIpc(const OpenedIpcTensors& opened);

  // Fleets (engine/weight_sync.h): this runner's port to NCCL weight-sync groups, receiving into
  // staging it planned with its memory. Called once, before the engine thread starts; the port
  // is then the weight-sync thread's, and must be destroyed before the runner. The default (the
  // cpu backend, whose weights are not on a device): FAILED_PRECONDITION naming the cuda backend.
  virtual absl::StatusOr<std::unique_ptr<WeightSyncPort>> CreateWeightSyncPort();
  // Copies what this runner's port staged (every tensor of staged.plan(), received and hashed)
  // into the served weights, between two steps: only a device failing mid-copy can leave it
  // half done. The default: FAILED_PRECONDITION.
  virtual absl::Status UpdateWeightsFromStaging(const StagedWeights& staged);

 protected:
  // Writes the tokens of `fed_from` (the previous launch's results) into the fed tokens' places
  // and clears batch->fed_tokens; InvalidArgument for a row or place it does not have.
  static absl::Status ResolveFedTokens(const std::vector<SampleResult>& fed_from,
                                       ForwardBatch* batch);
  // UNIMPLEMENTED naming the backend when `batch` asks for routing (ForwardBatch::asks_routing);
  // else OK. For runners that do not implement routing replay.
  static absl::Status RefuseRouting(const ForwardBatch& batch, const char* backend);
  // `batch` has a fed token.
  static bool HasFedTokens(const ForwardBatch& batch) { return !batch.fed_tokens.empty(); }

 private:
  // The default pipeline: results of launched, uncollected steps, oldest first.
  std::deque<std::vector<SampleResult>> launched_results_;
};

}  // namespace rollout
