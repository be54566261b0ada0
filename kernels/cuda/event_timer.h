#pragma once

#include <cuda_runtime.h>

namespace rollout::cuda {

// Mean milliseconds per call of `run` (work it enqueues on `stream`), timed by CUDA events over
// `reps` calls after `warmups` untimed ones. For benchmarks and load-time choices of speed only.
template <typename F>
double MeanMilliseconds(F&& run, int reps, int warmups = 1, cudaStream_t stream = nullptr) {
  for (int i = 0; i < warmups; ++i) run();
  cudaEvent_t begin, end;
  cudaEventCreate(&begin);
  cudaEventCreate(&end);
  cudaEventRecord(begin, stream);
  for (int i = 0; i < reps; ++i) run();
  cudaEventRecord(end, stream);
  cudaEventSynchronize(end);
  float ms = 0.0f;
  cudaEventElapsedTime(&ms, begin, end);
  cudaEventDestroy(begin);
  cudaEventDestroy(end);
  return static_cast<double>(ms) / reps;
}

// Milliseconds of one launch of a CUDA graph holding `reps` calls of `run` (each call enqueues on
// `stream`, returning true when it could), best of three launches after a warm-up. A graph
// launch has no host launch gaps between its kernels, so a microsecond kernel is timed as it runs
// inside the decode step's graph. Negative when `run` failed or the capture did; the error is
// cleared. `stream` must not be the legacy default stream (it cannot be captured).
template <typename F>
double GraphMilliseconds(F&& run, int reps, cudaStream_t stream) {
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  bool ran = cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal) == cudaSuccess;
  if (ran) {
    for (int i = 0; i < reps && ran; ++i) ran = run();
    ran = cudaStreamEndCapture(stream, &graph) == cudaSuccess && ran;
  }
  ran = ran && graph != nullptr && cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess;
  if (graph != nullptr) cudaGraphDestroy(graph);
  double best = -1.0;
  if (ran) {
    cudaEvent_t begin, end;
    cudaEventCreate(&begin);
    cudaEventCreate(&end);
    cudaGraphLaunch(exec, stream);  // warm-up
    for (int i = 0; i < 3; ++i) {
      cudaEventRecord(begin, stream);
      cudaGraphLaunch(exec, stream);
      cudaEventRecord(end, stream);
      float ms = -1.0f;
      if (cudaEventSynchronize(end) != cudaSuccess ||
          cudaEventElapsedTime(&ms, begin, end) != cudaSuccess) {
        best = -1.0;
        break;
      }
      best = best < 0.0 ? ms : (ms < best ? ms : best);
    }
    cudaEventDestroy(begin);
    cudaEventDestroy(end);
  }
  if (exec != nullptr) cudaGraphExecDestroy(exec);
  if (best < 0.0) cudaGetLastError();
  return best;
}

}  // namespace rollout::cuda
