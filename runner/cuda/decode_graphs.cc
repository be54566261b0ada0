// CudaModelRunner's decode graphs: a decode step replays the CUDA graph of its (batch bucket,
// split bucket), captured the first time from EnqueueSlice on rank 0's stream (the ranks' streams
// fork from and join into it). The metadata is uploaded outside the graph, at the offsets the
// bucket's SliceShape fixes (batch_plan.h); State::Grow drops the graphs.
#include <cuda_runtime.h>

#include <utility>

#include "common/cuda_status.h"
#include "glog/logging.h"
#include "runner/cuda/batch_plan.h"
#include "runner/cuda/cuda_model_runner.h"
#include "runner/cuda/cuda_runner_state.h"

namespace rollout {

using cuda_runner_internal::CudaGraphExec;

absl::Status CudaModelRunner::LaunchDecodeGraph(const cuda_runner_internal::SliceShape& shape) {
  State& s = *state_;
  const std::pair<int64_t, int32_t> key(shape.n, shape.max_splits);
  auto it = s.graphs.find(key);
  if (it == s.graphs.end()) {
    // Capture on this thread only (the engine thread owns the stream); a failure is reported
    // once and decode runs eagerly from then on.
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    absl::Status captured = CudaError(
        cudaStreamBeginCapture(s.stream, cudaStreamCaptureModeThreadLocal), "begin capture");
    if (captured.ok()) {
      captured = EnqueueSlice(shape, nullptr, /*keep_on_device=*/true);
      const absl::Status ended = CudaError(cudaStreamEndCapture(s.stream, &graph), "end capture");
      if (captured.ok()) captured = ended;
    }
    if (captured.ok()) {
      captured = CudaError(cudaGraphInstantiate(&exec, graph, 0), "instantiating a graph");
    }
    if (graph != nullptr) cudaGraphDestroy(graph);
    if (!captured.ok()) {
      (void)cudaGetLastError();  // clear a sticky launch error of the failed capture
      s.graphs_failed = true;
      LOG(WARNING) << "capturing the decode graph of batch " << shape.n
                   << " failed; decode runs without CUDA graphs from now on: " << captured;
      return EnqueueSlice(shape, nullptr, /*keep_on_device=*/true);
    }
    it = s.graphs.emplace(key, CudaGraphExec(exec)).first;
    ++s.graphs_captured;
  }
  ++s.graph_launches;
  return CudaError(cudaGraphLaunch(it->second.get(), s.stream), "launching a decode graph");
}

}  // namespace rollout
