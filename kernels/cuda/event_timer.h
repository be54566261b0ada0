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

}  // namespace rollout::cuda
