#include "trainer/trainer_cuda_kernels.h"

#include "kernels/cuda/sampling.h"

namespace rollout::trainer {
namespace {

using cuda::LogitsRowResult;
using cuda::LogitsRowSpec;

int64_t SpecBytes(int64_t rows) { return (rows * sizeof(LogitsRowSpec) + 255) / 256 * 256; }

__global__ void ScoreSpecsKernel(const int32_t* tokens, int64_t rows, float t,
                                 LogitsRowSpec* specs) {
  const int64_t r = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (r >= rows) return;
  LogitsRowSpec s;
  s.seed = 0;
  s.position = 0;
  s.temperature = t;
  s.mode = cuda::kRowScore;
  s.score_token = tokens[r];
  s.top_n = 0;
  specs[r] = s;
}

__global__ void ScoreResultsKernel(const LogitsRowResult* results, int64_t rows, float* lp,
                                   float* row_max, float* row_log_sum) {
  const int64_t r = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (r >= rows) return;
  lp[r] = results[r].logprob;
  row_max[r] = results[r].max;
  row_log_sum[r] = results[r].log_sum;
}

}  // namespace

int64_t LogprobWorkspace(int64_t rows) {
  return SpecBytes(rows) + (rows * sizeof(LogitsRowResult) + 255) / 256 * 256;
}

cudaError_t TokenLogprobs(const float* logits, int64_t rows, int32_t vocab, const int32_t* tokens,
                          float t, void* workspace, float* lp, float* row_max, float* row_log_sum,
                          cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  auto* specs = static_cast<LogitsRowSpec*>(workspace);
  auto* results =
      reinterpret_cast<LogitsRowResult*>(static_cast<char*>(workspace) + SpecBytes(rows));
  const unsigned blocks = static_cast<unsigned>((rows + 255) / 256);
  ScoreSpecsKernel<<<blocks, 256, 0, stream>>>(tokens, rows, t, specs);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  // One block per row in a grid of at most 2^31 - 1 rows: the server launches it the same way.
  e = cuda::ProcessLogitsRows(logits, rows, vocab, specs, results, stream);
  if (e != cudaSuccess) return e;
  ScoreResultsKernel<<<blocks, 256, 0, stream>>>(results, rows, lp, row_max, row_log_sum);
  return cudaGetLastError();
}

}  // namespace rollout::trainer
