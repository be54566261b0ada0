// Sampling and scoring of logits rows: log_softmax, greedy / Gumbel-max tokens, top-N logprobs.
#include <cfloat>
#include <climits>

#include "kernels/cuda/sampling.h"
#include "kernels/cuda/warp_reduce.cuh"

namespace rollout::cuda {
namespace {

// A constant of the kernel: it fixes the reduction order. Two blocks per SM (32 registers): a
// 256-row step runs in one wave on 132 SMs.
constexpr int kSampleThreads = 1024;
constexpr int kSampleWarps = kSampleThreads / 32;

__device__ __forceinline__ uint64_t SplitMix64(uint64_t x) {
  uint64_t z = x + 0x9E3779B97F4A7C15ULL;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

// engine/sampler.cc's UniformNoise: integer hashing, then an exact float conversion.
__device__ __forceinline__ float UniformNoise(uint64_t seed, int64_t position, int32_t token) {
  const uint64_t token_hash = SplitMix64(static_cast<uint64_t>(static_cast<uint32_t>(token)));
  const uint64_t position_hash =
      SplitMix64((static_cast<uint64_t>(position) * 0xD1B54A32D192ED03ULL) ^ token_hash);
  const uint64_t h = SplitMix64(seed ^ position_hash);
  const uint32_t bits = static_cast<uint32_t>(h >> 41);
  return __fmul_rn(__fadd_rn(__uint2float_rn(bits), 0.5f), 0x1p-23f);
}

__device__ __forceinline__ float ScaledLogit(float logit, float t) {
  // logit / 1 is logit exactly (NaN and infinities included): skip the IEEE division at T = 1.
  const float x = t == 1.0f ? logit : __fdiv_rn(logit, t);
  if (isnan(x)) return -INFINITY;
  if (x == INFINITY) return FLT_MAX;
  return x;
}

// (v, i) is better than (bv, bi): higher value, lower index on ties. A strict total order on
// non-NaN values, so any reduction order gives the same winner.
__device__ __forceinline__ bool Better(float v, int i, float bv, int bi) {
  return v > bv || (v == bv && i < bi);
}

// (m, s) := the pair of (om, os) and (m, s), where s is a sum of expf(x - m) over some x:
// M = max(m, om), s = s expf(m - M) + os expf(om - M). Commutative bitwise (so both lanes of an
// xor-butterfly step get the same bits); a pair with m = -inf has s = 0 and adds nothing.
__device__ __forceinline__ void CombineMaxSum(float om, float os, float* m, float* s) {
  const float big = fmaxf(*m, om);
  if (big == -INFINITY) return;  // both empty: (-inf, 0)
  *s = __fadd_rn(__fmul_rn(*s, expf(__fsub_rn(*m, big))), __fmul_rn(os, expf(__fsub_rn(om, big))));
  *m = big;
}

struct Shared {
  float v[kSampleWarps];
  int i[kSampleWarps];
  float v2[kSampleWarps];
  int i2[kSampleWarps];
  float bcast_v, bcast_v2;
  int bcast_i, bcast_i2;
};

__device__ __forceinline__ void WarpBest(float* v, int* i) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const float ov = __shfl_xor_sync(kFullMask, *v, off);
    const int oi = __shfl_xor_sync(kFullMask, *i, off);
    if (Better(ov, oi, *v, *i)) {
      *v = ov;
      *i = oi;
    }
  }
}

// Block-wide best (v, i); every thread gets the result.
__device__ void BlockBest(Shared& sh, float* v, int* i) {
  WarpBest(v, i);
  const int warp = threadIdx.x / 32;
  __syncthreads();
  if (threadIdx.x % 32 == 0) {
    sh.v[warp] = *v;
    sh.i[warp] = *i;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float bv = sh.v[0];
    int bi = sh.i[0];
    for (int w = 1; w < kSampleWarps; ++w) {
      if (Better(sh.v[w], sh.i[w], bv, bi)) {
        bv = sh.v[w];
        bi = sh.i[w];
      }
    }
    sh.bcast_v = bv;
    sh.bcast_i = bi;
  }
  __syncthreads();
  *v = sh.bcast_v;
  *i = sh.bcast_i;
}

__global__ void __launch_bounds__(kSampleThreads, 2)
    ProcessLogitsKernel(const float* logits, int32_t vocab, const LogitsRowSpec* specs,
                        LogitsRowResult* results) {
  __shared__ Shared sh;
  __shared__ float warp_max[kSampleWarps], warp_sums[kSampleWarps];
  __shared__ float bcast_max, bcast_sum;
  const int64_t r = blockIdx.x;
  const LogitsRowSpec spec = specs[r];
  const float* row = logits + r * static_cast<int64_t>(vocab);
  const float t = spec.temperature;
  const int tid = threadIdx.x;
  // 1 once any thread met a NaN or infinite raw logit (LogitsRowResult::nonfinite); set in the
  // pass below, read after its barrier. A flag in shared memory rather than a per-thread one
  // OR-ed by __syncthreads_or: the pass is at the 32 registers of two blocks per SM, and one
  // more live value there spilled.
  __shared__ int row_nonfinite;
  if (tid == 0) row_nonfinite = 0;
  __syncthreads();

  // One pass over the row: this thread's running (max, sum of expf(x - max)) of x, and the
  // greedy argmax of the raw logits or the Gumbel-max key. Unrolled so that several elements'
  // loads, hash and log chains are in flight per thread; each thread still visits its elements
  // in increasing order (the bits do not change).
  float tmax = -INFINITY, tsum = 0.0f;
  float best_v = -INFINITY;
  int best_i = INT_MAX;
#pragma unroll 4
  for (int i = tid; i < vocab; i += kSampleThreads) {
    const float l = row[i];
    if (!isfinite(l)) row_nonfinite = 1;
    const float x = ScaledLogit(l, t);
    if (x > tmax) {
      // A new maximum rescales the sum so far (0 while the maximum was -inf).
      tsum = __fadd_rn(__fmul_rn(tsum, expf(__fsub_rn(tmax, x))), 1.0f);
      tmax = x;
    } else if (x != -INFINITY) {
      tsum = __fadd_rn(tsum, expf(__fsub_rn(x, tmax)));
    }
    if (spec.mode == kRowGreedy) {
      const float g = isnan(l) ? -INFINITY : l;
      if (Better(g, i, best_v, best_i)) {
        best_v = g;
        best_i = i;
      }
    } else if (spec.mode == kRowSample) {
      const float u = UniformNoise(spec.seed, spec.position, i);
      const float key = __fadd_rn(x, -logf(-logf(u)));
      if (Better(key, i, best_v, best_i)) {
        best_v = key;
        best_i = i;
      }
    }
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    CombineMaxSum(__shfl_xor_sync(kFullMask, tmax, off), __shfl_xor_sync(kFullMask, tsum, off),
                  &tmax, &tsum);
  }
  if (tid % 32 == 0) {
    warp_max[tid / 32] = tmax;
    warp_sums[tid / 32] = tsum;
  }
  __syncthreads();
  if (tid == 0) {
    float m = warp_max[0], total = warp_sums[0];
    for (int w = 1; w < kSampleWarps; ++w) CombineMaxSum(warp_max[w], warp_sums[w], &m, &total);
    bcast_max = m;
    bcast_sum = logf(total);
  }
  __syncthreads();
  const float m = bcast_max;
  if (spec.mode == kRowGreedy || spec.mode == kRowSample) BlockBest(sh, &best_v, &best_i);
  const float log_sum = bcast_sum;
  const bool all_inf = m == -INFINITY;
  const float uniform_lp = -logf(static_cast<float>(vocab));
  auto lp_of = [&](float x) { return all_inf ? uniform_lp : __fsub_rn(__fsub_rn(x, m), log_sum); };

  // Top-N: N block-wide searches, each for the best entry after the previous one in the order
  // (lp desc, id asc).
  const int top_n = min(spec.top_n, min(kMaxDeviceTopN, vocab));
  float prev_v = INFINITY;
  int prev_i = -1;
  for (int j = 0; j < top_n; ++j) {
    float bv = -INFINITY;
    int bi = INT_MAX;
    for (int i = tid; i < vocab; i += kSampleThreads) {
      const float lp = lp_of(ScaledLogit(row[i], t));
      const bool after = lp < prev_v || (lp == prev_v && i > prev_i);
      if (after && Better(lp, i, bv, bi)) {
        bv = lp;
        bi = i;
      }
    }
    BlockBest(sh, &bv, &bi);
    if (tid == 0) {
      results[r].top_ids[j] = bi;
      results[r].top_lps[j] = bv;
    }
    prev_v = bv;
    prev_i = bi;
  }
  if (tid == 0) {
    int token = -1;
    if (spec.mode == kRowGreedy || spec.mode == kRowSample) token = best_i;
    if (spec.mode == kRowScore) token = spec.score_token;
    LogitsRowResult& out = results[r];
    out.token = token;
    out.logprob = token >= 0 && token < vocab ? lp_of(ScaledLogit(row[token], t)) : 0.0f;
    out.max = m;
    out.log_sum = log_sum;
    out.uniform_lp = uniform_lp;
    out.top_n = top_n;
    out.nonfinite = row_nonfinite;
  }
}

__global__ void FeedKernel(const LogitsRowResult* results, const int32_t* pairs, int32_t count,
                           int32_t* tokens) {
  const int k = blockIdx.x * blockDim.x + threadIdx.x;
  if (k < count) tokens[pairs[2 * k]] = results[pairs[2 * k + 1]].token;
}

__global__ void UniformNoiseKernel(uint64_t seed, int64_t position, int32_t n, float* out) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = UniformNoise(seed, position, i);
}

}  // namespace

cudaError_t ProcessLogitsRows(const float* logits, int64_t num_rows, int32_t vocab,
                              const LogitsRowSpec* specs, LogitsRowResult* results,
                              cudaStream_t stream) {
  if (num_rows <= 0) return cudaSuccess;
  if (vocab <= 0 || num_rows > INT_MAX) return cudaErrorInvalidValue;
  ProcessLogitsKernel<<<static_cast<unsigned>(num_rows), kSampleThreads, 0, stream>>>(
      logits, vocab, specs, results);
  return cudaGetLastError();
}

cudaError_t FeedSampledTokens(const LogitsRowResult* results, const int32_t* pairs, int32_t count,
                              int32_t* tokens, cudaStream_t stream) {
  if (count <= 0) return cudaSuccess;
  FeedKernel<<<(count + 255) / 256, 256, 0, stream>>>(results, pairs, count, tokens);
  return cudaGetLastError();
}

cudaError_t UniformNoiseRow(uint64_t seed, int64_t position, int32_t n, float* out,
                            cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  UniformNoiseKernel<<<(n + 255) / 256, 256, 0, stream>>>(seed, position, n, out);
  return cudaGetLastError();
}

}  // namespace rollout::cuda
