#include "engine/sampler.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <numeric>

namespace rollout {
namespace {

constexpr uint64_t kGoldenGamma = 0x9E3779B97F4A7C15ULL;
constexpr uint64_t kPositionMultiplier = 0xD1B54A32D192ED03ULL;

// Every Gumbel value is below this: u <= 1 - 2^-24 gives g <= -log(-log(1 - 2^-24)) ~ 16.64.
// A token whose logit / T plus this bound is still below the best key cannot win, so its noise
// is never computed; the bound only skips work, it never changes the answer.
constexpr float kGumbelUpperBound = 17.0f;

constexpr int kLanes = 16;

// logit / T as every sampling and logprob path sees it. NaN becomes -inf and +inf the largest
// finite float, so every later difference x - max is a number (at worst -inf) and no NaN can
// reach a logprob.
inline float ScaledLogit(float logit, float temperature) {
  const float x = logit / temperature;
  if (std::isnan(x)) return -INFINITY;
  if (x == INFINITY) return FLT_MAX;
  return x;
}

inline float Gumbel(float u) { return -std::log(-std::log(u)); }

// Per-thread index buffer for the orderings top-k, top-p and top-N need; only its capacity
// survives a call, never its contents.
std::vector<int32_t>& OrderScratch() {
  thread_local std::vector<int32_t> order;
  return order;
}

// The order "higher logprob first, lower index on ties" -- a strict total order, since
// LogSoftmax never writes NaN.
struct ByLogprobDesc {
  const float* lp;
  bool operator()(int32_t a, int32_t b) const { return lp[a] > lp[b] || (lp[a] == lp[b] && a < b); }
};

int32_t GreedyToken(const float* logits, int32_t vocab_size) {
  int32_t best = 0;
  float best_logit = -INFINITY;
  for (int32_t i = 0; i < vocab_size; ++i) {
    if (logits[i] > best_logit) {  // strict: ties keep the lower index; NaN never wins
      best_logit = logits[i];
      best = i;
    }
  }
  return best;
}

// Shrinks the candidate order[0, num_candidates) to the smallest prefix of the probability-sorted
// order whose mass, summed in that order in float, reaches top_p (at least one token). Sorts only
// as far as the prefix reaches: the sorted prefix of a strict total order is unique, so sorting
// lazily in growing steps gives the same prefix as a full sort. `sorted` entries are already in
// order on entry.
int64_t TopPPrefix(const float* lp, float top_p, int32_t* order, int64_t num_candidates,
                   int64_t sorted) {
  const ByLogprobDesc by_logprob{lp};
  float mass = 0.0f;
  int64_t kept = 0;
  while (kept < num_candidates) {
    if (kept == sorted) {
      const int64_t next = std::min(num_candidates, std::max<int64_t>(64, 4 * sorted));
      if (next < num_candidates) {
        std::nth_element(order + sorted, order + next, order + num_candidates, by_logprob);
      }
      std::sort(order + sorted, order + next, by_logprob);
      sorted = next;
    }
    mass += std::exp(lp[order[kept]]);
    ++kept;
    if (mass >= top_p) break;
  }
  return kept;
}

}  // namespace

uint64_t SplitMix64(uint64_t x) {
  uint64_t z = x + kGoldenGamma;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

uint64_t DeriveSampleSeed(uint64_t seed, uint32_t sample_index) {
  if (sample_index == 0) return seed;
  return SplitMix64(seed + static_cast<uint64_t>(sample_index) * kGoldenGamma);
}

float UniformNoise(uint64_t sample_seed, int64_t position, int32_t token) {
  const uint64_t token_hash = SplitMix64(static_cast<uint64_t>(static_cast<uint32_t>(token)));
  const uint64_t position_hash =
      SplitMix64((static_cast<uint64_t>(position) * kPositionMultiplier) ^ token_hash);
  const uint64_t h = SplitMix64(sample_seed ^ position_hash);
  // 23 bits so that bits + 0.5 (24 significant bits) and the scaling are exact in float.
  const uint32_t bits = static_cast<uint32_t>(h >> 41);
  return (static_cast<float>(bits) + 0.5f) * 0x1p-23f;
}

bool LogitsFinite(const float* logits, int32_t vocab_size) {
  // No early exit: a branch-free pass the compiler vectorises, and rows are nearly always finite.
  bool finite = true;
  for (int32_t i = 0; i < vocab_size; ++i) finite &= std::isfinite(logits[i]);
  return finite;
}

void LogSoftmax(const float* logits, int32_t vocab_size, float temperature, float* out) {
  if (vocab_size <= 0) return;
  const float t = temperature > 0.0f ? temperature : 1.0f;
  float max_x = -INFINITY;
  for (int32_t i = 0; i < vocab_size; ++i) {
    out[i] = ScaledLogit(logits[i], t);
    max_x = std::max(max_x, out[i]);
  }
  if (max_x == -INFINITY) {
    // Nothing is possible; call every token equally likely rather than produce NaN.
    std::fill(out, out + vocab_size, -std::log(static_cast<float>(vocab_size)));
    return;
  }
  // sum_i exp(x_i - max) in 16 lanes (i % 16, increasing i), combined by the tree 8, 4, 2, 1.
  float acc[kLanes] = {};
  for (int32_t i = 0; i < vocab_size; ++i) acc[i % kLanes] += std::exp(out[i] - max_x);
  for (int l = 0; l < 8; ++l) acc[l] += acc[l + 8];
  for (int l = 0; l < 4; ++l) acc[l] += acc[l + 4];
  for (int l = 0; l < 2; ++l) acc[l] += acc[l + 2];
  const float log_sum = std::log(acc[0] + acc[1]);  // >= 0: the max term alone is 1
  for (int32_t i = 0; i < vocab_size; ++i) out[i] = (out[i] - max_x) - log_sum;
}

std::vector<TokenLogprob> TopLogprobs(const float* lp, int32_t vocab_size, int32_t n) {
  std::vector<TokenLogprob> top;
  const int32_t num_top = std::min(n, vocab_size);
  if (num_top <= 0) return top;
  std::vector<int32_t>& order = OrderScratch();
  order.resize(vocab_size);
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + num_top, order.end(), ByLogprobDesc{lp});
  top.reserve(num_top);
  for (int32_t j = 0; j < num_top; ++j) top.push_back({order[j], lp[order[j]]});
  return top;
}

SampleResult SampleToken(const float* logits, int32_t vocab_size, const SamplingParams& params,
                         uint64_t sample_seed, int64_t position, std::vector<float>* scratch) {
  SampleResult result;
  if (vocab_size <= 0) return result;
  result.nonfinite = !LogitsFinite(logits, vocab_size);
  const bool greedy = !(params.temperature > 0.0f);
  const float t = greedy ? 1.0f : params.temperature;
  scratch->resize(vocab_size);
  float* lp = scratch->data();  // [vocab] log_softmax(logits / t)
  LogSoftmax(logits, vocab_size, t, lp);
  std::vector<int32_t>& order = OrderScratch();
  const ByLogprobDesc by_logprob{lp};

  if (greedy) {
    result.token = GreedyToken(logits, vocab_size);
  } else {
    // The kept set is either order[0, num_kept) (top-k and/or top-p: a prefix of the
    // logprob-sorted vocabulary) or, with neither, the whole vocabulary.
    bool ordered = false;
    int64_t num_kept = vocab_size;
    if (params.top_k > 0 && params.top_k < vocab_size) {
      order.resize(vocab_size);
      std::iota(order.begin(), order.end(), 0);
      std::partial_sort(order.begin(), order.begin() + params.top_k, order.end(), by_logprob);
      ordered = true;
      num_kept = params.top_k;
    }
    if (params.top_p < 1.0f) {
      if (!ordered) {
        order.resize(vocab_size);
        std::iota(order.begin(), order.end(), 0);
      }
      num_kept = TopPPrefix(lp, params.top_p, order.data(), num_kept, ordered ? num_kept : 0);
      ordered = true;
    }
    // The most likely token survives every filter; it seeds the search so that the bound below
    // skips most of the vocabulary.
    int32_t top_token = 0;
    if (ordered) {
      top_token = order[0];
    } else {
      for (int32_t i = 1; i < vocab_size; ++i) {
        if (by_logprob(i, top_token)) top_token = i;
      }
    }
    // min-p: p_i >= min_p * p_max, i.e. lp_i >= log(min_p) + lp_max; off at min_p = 0.
    const float min_lp = params.min_p > 0.0f ? std::log(params.min_p) + lp[top_token] : -INFINITY;

    int32_t best = top_token;
    float best_key =
        ScaledLogit(logits[top_token], t) + Gumbel(UniformNoise(sample_seed, position, top_token));
    auto consider = [&](int32_t i) {
      if (lp[i] < min_lp) return;
      const float x = ScaledLogit(logits[i], t);
      if (x + kGumbelUpperBound < best_key) return;
      const float key = x + Gumbel(UniformNoise(sample_seed, position, i));
      if (key > best_key || (key == best_key && i < best)) {
        best_key = key;
        best = i;
      }
    };
    if (ordered) {
      for (int64_t j = 1; j < num_kept; ++j) consider(order[j]);
    } else {
      for (int32_t i = 0; i < vocab_size; ++i) consider(i);
    }
    result.token = best;
  }
  result.logprob = lp[result.token];

  result.top = TopLogprobs(lp, vocab_size, params.top_logprobs);
  return result;
}

}  // namespace rollout
