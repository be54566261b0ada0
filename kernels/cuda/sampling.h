#pragma once

#include <cuda_runtime.h>

#include <cstdint>

// Sampling and scoring of fp32 logits rows on the GPU (CudaModelRunner::ProcessLogits). One
// 1024-thread block per row, one pass over the row (plus one per top-N entry); every reduction
// runs in one fixed order that depends on nothing but the row, so a row's results are bitwise the
// same whatever the other rows of the launch.
namespace rollout::cuda {

inline constexpr int kMaxDeviceTopN = 20;

enum LogitsRowMode : int32_t {
  kRowGreedy = 0,  // token = argmax logits (NaN as -inf), ties to the lowest index
  kRowSample = 1,  // token = argmax x_i + g_i, g_i = -logf(-logf(UniformNoise(seed, pos, i)))
  kRowScore = 2,   // token = score_token
  kRowStats = 3,   // no token: max and log-sum only (the host picks the token)
};

struct LogitsRowSpec {
  uint64_t seed = 0;
  int64_t position = 0;
  float temperature = 1.0f;  // > 0 (the caller maps T = 0 to 1)
  int32_t mode = kRowGreedy;
  int32_t score_token = 0;
  int32_t top_n = 0;  // <= kMaxDeviceTopN
};

// Per row, with x_i = ScaledLogit(logits_i / T) (NaN -> -inf, +inf -> FLT_MAX), m = max_i x_i,
// s = sum_i expf(x_i - m), log_sum = logf(s). s in one fixed order: thread j of the block keeps
// a running (max, sum) over i = j, j + 1024, ... in increasing i (a new maximum M' rescales the
// sum by expf(M - M')), then pairs (m_a, s_a), (m_b, s_b) combine as s_a expf(m_a - M) +
// s_b expf(m_b - M), M = max(m_a, m_b): the 16-lane xor butterfly per warp, then the 32 warps in
// increasing order. Then:
//   lp_i = (x_i - m) - log_sum   (all lp_i = uniform_lp = -logf(vocab) when m = -inf).
struct LogitsRowResult {
  int32_t token = -1;
  float logprob = 0.0f;  // lp_token (0 when token = -1)
  float max = 0.0f;      // m
  float log_sum = 0.0f;  // logf(s)
  float uniform_lp = 0.0f;
  int32_t top_n = 0;
  // 1 when some raw logit of the row is NaN or +/-inf (engine/sampler.h's LogitsFinite false),
  // else 0. Read by the engine only; nothing above depends on it.
  int32_t nonfinite = 0;
  int32_t top_ids[kMaxDeviceTopN];  // by (lp desc, id asc)
  float top_lps[kMaxDeviceTopN];
};

// logits: row r at logits + r * vocab; specs, results: [num_rows] device arrays.
cudaError_t ProcessLogitsRows(const float* logits, int64_t num_rows, int32_t vocab,
                              const LogitsRowSpec* specs, LogitsRowResult* results,
                              cudaStream_t stream);

// tokens[pairs[2k]] = results[pairs[2k + 1]].token for k < count: the engine's fed tokens, the
// tokens a step sampled copied into the next step's batch metadata on the device.
cudaError_t FeedSampledTokens(const LogitsRowResult* results, const int32_t* pairs, int32_t count,
                              int32_t* tokens, cudaStream_t stream);

// out[i] = UniformNoise(seed, position, i) for i < n, computed on the device (for tests: it must
// equal engine/sampler.h's host function bitwise).
cudaError_t UniformNoiseRow(uint64_t seed, int64_t position, int32_t n, float* out,
                            cudaStream_t stream);

}  // namespace rollout::cuda
