#pragma once

#include <cuda_runtime.h>

#include <cstdint>

// The trainer library's glue around the server's sampling kernel: rows' specs written and their
// results read on the device, so a logprob pass needs no host round trip.
namespace rollout::trainer {

// Bytes of workspace TokenLogprobs needs for `rows` rows (specs then results, 256-aligned).
int64_t LogprobWorkspace(int64_t rows);

// For each row r: the kRowScore spec (temperature t > 0, score_token tokens[r]) into the
// workspace, cuda::ProcessLogitsRows over the rows, then lp[r] = result.logprob,
// row_max[r] = result.max, row_log_sum[r] = result.log_sum.
cudaError_t TokenLogprobs(const float* logits, int64_t rows, int32_t vocab, const int32_t* tokens,
                          float t, void* workspace, float* lp, float* row_max, float* row_log_sum,
                          cudaStream_t stream);

}  // namespace rollout::trainer
