#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "engine/sampling_params.h"

namespace rollout {

// Seed of sample j of a request with seed `seed`: j = 0 keeps `seed` itself, so a request with
// num_samples = n equals n requests with num_samples = 1 and seeds DeriveSampleSeed(seed, j)
// (D9). For j >= 1: SplitMix64(seed + j * 0x9E3779B97F4A7C15).
uint64_t DeriveSampleSeed(uint64_t seed, uint32_t sample_index);

// The SplitMix64 finaliser (Steele et al.), used for every hash here, in uint64 arithmetic:
//   z = x + 0x9E3779B97F4A7C15; z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9;
//   z = (z ^ (z >> 27)) * 0x94D049BB133111EB; return z ^ (z >> 31).
uint64_t SplitMix64(uint64_t x);

// u in (0, 1) from a hash of (sample seed, absolute position of the token being sampled,
// vocab index), in uint64 wrap-around arithmetic with C = 0xD1B54A32D192ED03:
//   t    = SplitMix64(uint64(uint32(token)))
//   h    = SplitMix64(sample_seed ^ SplitMix64((uint64(position) * C) ^ t))
//   bits = h >> 41                  (the top 23 bits)
//   u    = (bits + 0.5) * 2^-23     (exact in float: u in [2^-24, 1 - 2^-24], never 0 or 1)
// 23 rather than 24 bits because (bits + 0.5) must fit float's 24-bit significand exactly;
// with 24 bits the largest value would round to u = 1 and g = -log(-log(u)) = +inf.
float UniformNoise(uint64_t sample_seed, int64_t position, int32_t token);

struct TokenLogprob {
  int32_t token;
  float logprob;
};

struct SampleResult {
  int32_t token = 0;
  float logprob = 0.0f;           // log_softmax(logits / T)[token], T = 1 when greedy
  std::vector<TokenLogprob> top;  // top-N by logprob, ties by lower id; N = top_logprobs
  // The MoE routing of the row whose logits gave this result (ModelConfig::RoutingSize() ids,
  // engine/model_runner.h) when its batch asked (ForwardBatch::return_routing); else empty.
  std::vector<int32_t> routing;
  // Some logit of the row was NaN or +/-inf (!LogitsFinite). Token and logprobs are still
  // computed (NaN as -inf, +inf as the largest float: never NaN) but mean nothing; the engine
  // ends the sample instead of applying them (docs/api.md, "Non-finite logits").
  bool nonfinite = false;
};

// Picks the token at absolute `position` from one row of fp32 logits [vocab]:
//   greedy (T = 0): argmax of logits, ties to the lowest index;
//   otherwise: argmax over the kept set of logits_i / T + g_i, g_i = -logf(-logf(u_i)),
//   u_i = UniformNoise(sample_seed, position, i), with the kept set = top-k, then top-p
//   (smallest prefix of the probability-sorted vocab whose mass reaches top_p), then min-p
//   (p_i >= min_p * p_max); ties to the lowest index.
// Precisely, with lp = LogSoftmax(logits, T) over the full vocabulary and the vocabulary sorted
// by (lp descending, index ascending):
//   top-k (0 < top_k < vocab): the first top_k tokens of that order;
//   top-p (top_p < 1): the shortest prefix of that order (within the top-k tokens if top-k is
//     on) whose sum of expf(lp), accumulated in that order in float, is >= top_p -- the
//     probabilities are the full-vocabulary ones, not renormalised after top-k; if rounding
//     keeps the sum below top_p, the whole candidate list stays;
//   min-p (min_p > 0): tokens with lp_i >= logf(min_p) + max_i lp_i.
// The most likely token always survives, so the kept set is never empty; a -inf logit can win
// only if every kept logit is -inf (then the lowest kept index does). NaN logits count as -inf.
// Logprobs are log_softmax(logits / T) over the full vocabulary, before any filtering.
// Every reduction runs in a fixed order, so the result depends on nothing but the arguments.
// SampleResult::nonfinite is !LogitsFinite(logits, vocab_size).
// `scratch` is reused between calls to avoid allocation (index orderings use a per-thread
// buffer inside the sampler).
SampleResult SampleToken(const float* logits, int32_t vocab_size, const SamplingParams& params,
                         uint64_t sample_seed, int64_t position, std::vector<float>* scratch);

// The n largest of a row of logprobs [vocab], ordered by (logprob descending, id ascending):
// the top-N entries that Generate and Score return.
std::vector<TokenLogprob> TopLogprobs(const float* logprobs, int32_t vocab_size, int32_t n);

// False when any of logits[0, vocab_size) is NaN or +/-inf: a model's logits are finite for
// finite weights and activations, so such a row means the weights (or the forward) diverged.
bool LogitsFinite(const float* logits, int32_t vocab_size);

// log_softmax(logits / T)[i] for the whole row, written to `out` [vocab]. T <= 0 means T = 1.
// x_i = logits[i] / T (a division, not a multiplication by 1 / T; NaN -> -inf, +inf -> FLT_MAX),
// m = max_i x_i, s = sum_i expf(x_i - m) accumulated in 16 lanes (lane i % 16, increasing i)
// combined by the tree 8, 4, 2, 1, and out_i = (x_i - m) - logf(s). Every out_i is <= 0 and
// never NaN; a row that is all -inf gets the uniform -logf(vocab).
void LogSoftmax(const float* logits, int32_t vocab_size, float temperature, float* out);

}  // namespace rollout
