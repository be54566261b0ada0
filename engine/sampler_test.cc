#include "engine/sampler.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <set>
#include <vector>

namespace rollout {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

SamplingParams Params(float temperature, int32_t top_k = 0, float top_p = 1.0f, float min_p = 0.0f,
                      int32_t top_logprobs = 0) {
  SamplingParams p;
  p.temperature = temperature;
  p.top_k = top_k;
  p.top_p = top_p;
  p.min_p = min_p;
  p.top_logprobs = top_logprobs;
  return p;
}

std::vector<double> NaiveLogSoftmax(const std::vector<float>& logits, double temperature) {
  double m = -INFINITY;
  for (float x : logits) m = std::max(m, x / temperature);
  double s = 0.0;
  for (float x : logits) s += std::exp(x / temperature - m);
  std::vector<double> out;
  for (float x : logits) out.push_back(x / temperature - m - std::log(s));
  return out;
}

std::vector<double> Softmax(const std::vector<float>& logits, double temperature) {
  std::vector<double> p = NaiveLogSoftmax(logits, temperature);
  for (double& x : p) x = std::exp(x);
  return p;
}

// Counts of the token drawn for each of `num_seeds` fixed seeds at one position.
std::vector<int64_t> DrawCounts(const std::vector<float>& logits, const SamplingParams& params,
                                int num_seeds, int64_t position = 17) {
  std::vector<int64_t> counts(logits.size(), 0);
  std::vector<float> scratch;
  for (int s = 0; s < num_seeds; ++s) {
    const SampleResult r = SampleToken(logits.data(), static_cast<int32_t>(logits.size()), params,
                                       DeriveSampleSeed(0xC0FFEE, s), position, &scratch);
    ++counts[r.token];
  }
  return counts;
}

// Pearson chi-square of `counts` against probabilities `p` (bins with p = 0 must be empty).
// Returns the statistic; df = number of bins with p > 0, minus one.
double ChiSquare(const std::vector<int64_t>& counts, const std::vector<double>& p, int* df) {
  const double n = std::accumulate(counts.begin(), counts.end(), 0.0);
  double stat = 0.0;
  *df = -1;
  for (size_t i = 0; i < counts.size(); ++i) {
    if (p[i] == 0.0) {
      EXPECT_EQ(counts[i], 0) << "token " << i << " has probability 0 but was drawn";
      continue;
    }
    const double e = n * p[i];
    stat += (counts[i] - e) * (counts[i] - e) / e;
    ++*df;
  }
  return stat;
}

// Upper 1e-4 quantiles of the chi-square distribution, by degrees of freedom (index = df).
// A correct sampler fails one of these checks with probability 1e-4 per fixed seed set.
constexpr double kChiSquareCritical[] = {0.0, 15.14, 18.42, 21.11, 23.51, 25.74, 27.86, 29.88};

void ExpectMatchesDistribution(const std::vector<int64_t>& counts, const std::vector<double>& p) {
  int df = 0;
  const double stat = ChiSquare(counts, p, &df);
  ASSERT_GE(df, 1);
  ASSERT_LT(df, 8);
  EXPECT_LT(stat, kChiSquareCritical[df]) << "chi-square with " << df << " df";
}

// Probabilities p restricted to `kept` and renormalised.
std::vector<double> Restrict(std::vector<double> p, const std::set<int>& kept) {
  double mass = 0.0;
  for (size_t i = 0; i < p.size(); ++i) {
    if (kept.count(static_cast<int>(i)) == 0) p[i] = 0.0;
    mass += p[i];
  }
  for (double& x : p) x /= mass;
  return p;
}

const std::vector<float> kEightLogits = {1.0f, 0.5f, 0.0f, -0.5f, 2.0f, -1.0f, 0.3f, 1.5f};

TEST(SplitMix64Test, MatchesReferenceOutputs) {
  // The first two outputs of the reference SplitMix64 generator seeded with 0.
  EXPECT_EQ(SplitMix64(0), 0xE220A8397B1DCDAFULL);
  EXPECT_EQ(SplitMix64(0x9E3779B97F4A7C15ULL), 0x6E789E6AA1B965F4ULL);
}

TEST(DeriveSampleSeedTest, SampleZeroKeepsSeedAndOthersAreDistinct) {
  for (uint64_t seed : {0ULL, 1ULL, 42ULL, 0xFFFFFFFFFFFFFFFFULL}) {
    EXPECT_EQ(DeriveSampleSeed(seed, 0), seed);
    std::set<uint64_t> seen = {seed};
    for (uint32_t j = 1; j <= 1000; ++j) {
      const uint64_t derived = DeriveSampleSeed(seed, j);
      EXPECT_EQ(derived, SplitMix64(seed + j * 0x9E3779B97F4A7C15ULL));
      EXPECT_TRUE(seen.insert(derived).second) << "seed " << seed << " j " << j;
    }
  }
}

TEST(UniformNoiseTest, DeterministicStrictlyInsideUnitIntervalAndUniform) {
  constexpr int kBins = 16;
  std::vector<int64_t> counts(kBins, 0);
  float lo = 1.0f, hi = 0.0f;
  for (int64_t position = 0; position < 100; ++position) {
    for (int32_t token = 0; token < 1000; ++token) {
      const float u = UniformNoise(12345, position, token);
      ASSERT_EQ(u, UniformNoise(12345, position, token));
      lo = std::min(lo, u);
      hi = std::max(hi, u);
      ++counts[static_cast<int>(u * kBins)];
    }
  }
  EXPECT_GT(lo, 0.0f);
  EXPECT_LT(hi, 1.0f);
  // 15 df, upper 1e-4 quantile 42.58.
  const double e = 100000.0 / kBins;
  double stat = 0.0;
  for (int64_t c : counts) stat += (c - e) * (c - e) / e;
  EXPECT_LT(stat, 42.58);
}

TEST(UniformNoiseTest, FollowsDocumentedFormula) {
  for (uint64_t seed : {0ULL, 5ULL, 0xDEADBEEFCAFEF00DULL}) {
    for (int64_t position : {0LL, 1LL, 4096LL, -1LL}) {
      for (int32_t token : {0, 1, 151935, -1}) {
        const uint64_t t = SplitMix64(static_cast<uint32_t>(token));
        const uint64_t h = SplitMix64(
            seed ^ SplitMix64((static_cast<uint64_t>(position) * 0xD1B54A32D192ED03ULL) ^ t));
        const double want = (static_cast<double>(h >> 41) + 0.5) / 8388608.0;
        EXPECT_EQ(static_cast<double>(UniformNoise(seed, position, token)), want);
      }
    }
  }
}

TEST(UniformNoiseTest, ExtremeBitsGiveFiniteGumbel) {
  // The formula's extremes, (0 + 0.5) / 2^23 and (2^23 - 0.5) / 2^23, are exact floats.
  const float u_min = 0.5f * 0x1p-23f;
  const float u_max = (8388607.0f + 0.5f) * 0x1p-23f;
  EXPECT_LT(u_max, 1.0f);
  EXPECT_TRUE(std::isfinite(-std::log(-std::log(u_min))));
  EXPECT_TRUE(std::isfinite(-std::log(-std::log(u_max))));
}

TEST(UniformNoiseTest, DiffersAcrossPositionsTokensAndSeeds) {
  int same_position = 0, same_token = 0, same_seed = 0;
  for (int32_t token = 0; token < 1000; ++token) {
    const float u = UniformNoise(7, 100, token);
    same_position += u == UniformNoise(7, 101, token);
    same_token += u == UniformNoise(7, 100, token + 1);
    same_seed += u == UniformNoise(8, 100, token);
  }
  // Independent 23-bit values collide with probability 2^-23 each.
  EXPECT_LE(same_position, 1);
  EXPECT_LE(same_token, 1);
  EXPECT_LE(same_seed, 1);
}

TEST(LogSoftmaxTest, MatchesDoubleReferenceWithNegInfEntries) {
  std::mt19937 rng(5);
  std::normal_distribution<float> dist(0.0f, 4.0f);
  for (int32_t vocab : {1, 7, 99, 257, 50021}) {
    std::vector<float> logits(vocab);
    for (float& x : logits) x = dist(rng);
    if (vocab > 1) logits[vocab / 2] = kNegInf;
    for (float t : {1.0f, 0.7f, 2.5f}) {
      std::vector<float> out(vocab);
      LogSoftmax(logits.data(), vocab, t, out.data());
      const std::vector<double> want = NaiveLogSoftmax(logits, t);
      for (int32_t i = 0; i < vocab; ++i) {
        ASSERT_LE(out[i], 0.0f);
        if (std::isinf(want[i])) {
          ASSERT_EQ(out[i], kNegInf) << i;
        } else {
          ASSERT_NEAR(out[i], want[i], 1e-5 + 2e-6 * std::fabs(want[i]))
              << "vocab " << vocab << " T " << t << " i " << i;
        }
      }
    }
  }
}

TEST(LogSoftmaxTest, ScalesByDividingByTemperatureBitwise) {
  std::mt19937 rng(6);
  std::normal_distribution<float> dist(0.0f, 3.0f);
  std::vector<float> logits(257), divided(257);
  int differs_from_reciprocal = 0;
  for (int i = 0; i < 257; ++i) {
    logits[i] = dist(rng);
    divided[i] = logits[i] / 0.7f;
    differs_from_reciprocal += divided[i] != logits[i] * (1.0f / 0.7f);
  }
  ASSERT_GT(differs_from_reciprocal, 0);  // otherwise this test could not tell them apart
  std::vector<float> a(257), b(257);
  LogSoftmax(logits.data(), 257, 0.7f, a.data());
  LogSoftmax(divided.data(), 257, 1.0f, b.data());
  EXPECT_EQ(a, b);
}

TEST(LogSoftmaxTest, NonPositiveTemperatureMeansOneBitwise) {
  const std::vector<float> logits = {0.1f, -3.0f, 2.0f, kNegInf, 7.0f, 0.25f, -0.5f};
  std::vector<float> one(7), zero(7), negative(7);
  LogSoftmax(logits.data(), 7, 1.0f, one.data());
  LogSoftmax(logits.data(), 7, 0.0f, zero.data());
  LogSoftmax(logits.data(), 7, -2.0f, negative.data());
  EXPECT_EQ(one, zero);
  EXPECT_EQ(one, negative);
}

TEST(LogSoftmaxTest, AllNegInfRowIsUniformNotNan) {
  const std::vector<float> logits(7, kNegInf);
  std::vector<float> out(7);
  LogSoftmax(logits.data(), 7, 1.0f, out.data());
  for (float x : out) EXPECT_FLOAT_EQ(x, -std::log(7.0f));
}

TEST(SampleTokenTest, GreedyPicksArgmaxWithTiesToLowestIndex) {
  const std::vector<float> logits = {1.0f, 3.0f, kNegInf, 3.0f, 2.0f, 3.0f, -1.0f};
  std::vector<float> scratch;
  for (uint64_t seed : {0ULL, 1ULL, 99ULL}) {
    const SampleResult r = SampleToken(logits.data(), 7, Params(0.0f), seed, 5, &scratch);
    EXPECT_EQ(r.token, 1);
    // Greedy logprob is log_softmax at T = 1.
    EXPECT_NEAR(r.logprob, NaiveLogSoftmax(logits, 1.0)[1], 1e-6);
  }
}

// Diverged weights give NaN or infinite logits; the result says so (the engine then ends the
// sample) while its token and logprobs stay what the NaN-as--inf rules give.
TEST(SampleTokenTest, ARowWithANanOrAnInfinityIsFlaggedNonFinite) {
  std::mt19937 rng(31);
  std::normal_distribution<float> dist(0.0f, 3.0f);
  std::vector<float> finite(99);
  for (float& x : finite) x = dist(rng);
  finite[50] = std::numeric_limits<float>::max();  // the largest finite value is finite
  finite[51] = -std::numeric_limits<float>::max();
  const std::vector<SamplingParams> variants = {Params(0.0f), Params(1.0f, 0, 1.0f, 0.0f, 3),
                                                Params(0.7f, 5), Params(1.3f, 0, 0.9f),
                                                Params(0.9f, 0, 1.0f, 0.1f)};
  std::vector<float> scratch;
  EXPECT_TRUE(LogitsFinite(finite.data(), 99));
  for (const SamplingParams& params : variants) {
    EXPECT_FALSE(SampleToken(finite.data(), 99, params, 5, 17, &scratch).nonfinite);
  }
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  for (const float bad : {nan, inf, -inf}) {
    for (const int32_t at : {0, 13, 98}) {
      std::vector<float> logits = finite;
      logits[at] = bad;
      EXPECT_FALSE(LogitsFinite(logits.data(), 99)) << bad << " at " << at;
      for (const SamplingParams& params : variants) {
        const SampleResult r = SampleToken(logits.data(), 99, params, 5, 17, &scratch);
        EXPECT_TRUE(r.nonfinite) << bad << " at " << at << ", T " << params.temperature;
        EXPECT_FALSE(std::isnan(r.logprob));
      }
    }
  }
  const std::vector<float> all_nan(7, nan);
  EXPECT_TRUE(SampleToken(all_nan.data(), 7, Params(0.8f), 1, 3, &scratch).nonfinite);
  const std::vector<float> all_neg_inf(7, -inf);
  EXPECT_TRUE(SampleToken(all_neg_inf.data(), 7, Params(0.0f), 1, 3, &scratch).nonfinite);
}

TEST(SampleTokenTest, SameSeedAndPositionGiveSameResult) {
  std::mt19937 rng(9);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> logits(257);
  for (float& x : logits) x = dist(rng);
  std::vector<float> scratch_a, scratch_b(1000, std::numeric_limits<float>::quiet_NaN());
  std::set<int32_t> distinct_over_positions;
  for (int64_t position = 0; position < 50; ++position) {
    const SamplingParams params = Params(1.0f, 0, 1.0f, 0.0f, 3);
    const SampleResult a = SampleToken(logits.data(), 257, params, 77, position, &scratch_a);
    const SampleResult b = SampleToken(logits.data(), 257, params, 77, position, &scratch_b);
    EXPECT_EQ(a.token, b.token);
    EXPECT_EQ(a.logprob, b.logprob);
    distinct_over_positions.insert(a.token);
  }
  // Over 50 positions of a flat distribution the noise must move the choice.
  EXPECT_GT(distinct_over_positions.size(), 10u);
}

TEST(SampleTokenTest, FrequenciesMatchSoftmaxAtTemperatureOne) {
  const std::vector<int64_t> counts = DrawCounts(kEightLogits, Params(1.0f), 20000);
  ExpectMatchesDistribution(counts, Softmax(kEightLogits, 1.0));
}

TEST(SampleTokenTest, FrequenciesMatchSoftmaxAtTemperatureBelowOne) {
  const std::vector<int64_t> counts = DrawCounts(kEightLogits, Params(0.7f), 20000);
  ExpectMatchesDistribution(counts, Softmax(kEightLogits, 0.7));
  // The same draws must not fit the T = 1 distribution: the temperature really applies.
  int df = 0;
  EXPECT_GT(ChiSquare(counts, Softmax(kEightLogits, 1.0), &df), kChiSquareCritical[7]);
}

TEST(SampleTokenTest, TopKTwoOnlyYieldsTheTopTwoInProportion) {
  const std::vector<int64_t> counts = DrawCounts(kEightLogits, Params(1.0f, 2), 20000);
  // Logits 2.0 (index 4) and 1.5 (index 7) are the top two.
  ExpectMatchesDistribution(counts, Restrict(Softmax(kEightLogits, 1.0), {4, 7}));
}

// Probabilities 0.5, 0.3, 0.1, 0.05, 0.05 (a permutation, so index order is not sort order).
const std::vector<float> kKnownLogits = {std::log(0.05f), std::log(0.3f), std::log(0.1f),
                                         std::log(0.5f), std::log(0.05f)};

TEST(SampleTokenTest, TopPSamplesOnlyTheNucleus) {
  const std::vector<double> p = Softmax(kKnownLogits, 1.0);
  // 0.5 < 0.75 <= 0.5 + 0.3: the nucleus is {3, 1}.
  ExpectMatchesDistribution(DrawCounts(kKnownLogits, Params(1.0f, 0, 0.75f), 20000),
                            Restrict(p, {3, 1}));
  // 0.8 < 0.85 <= 0.9: the nucleus is {3, 1, 2}.
  ExpectMatchesDistribution(DrawCounts(kKnownLogits, Params(1.0f, 0, 0.85f), 20000),
                            Restrict(p, {3, 1, 2}));
  // top_p below the largest probability keeps just the top token.
  const std::vector<int64_t> one = DrawCounts(kKnownLogits, Params(1.0f, 0, 0.2f), 2000);
  EXPECT_EQ(one[3], 2000);
  // With top-k = 2 on top, the nucleus (measured in full-vocabulary mass) cannot grow past it.
  ExpectMatchesDistribution(DrawCounts(kKnownLogits, Params(1.0f, 2, 0.85f), 20000),
                            Restrict(p, {3, 1}));
}

TEST(SampleTokenTest, MinPKeepsTokensAboveFractionOfTheMax) {
  const std::vector<double> p = Softmax(kKnownLogits, 1.0);
  // min_p * p_max = 0.125: keeps 0.5 and 0.3.
  ExpectMatchesDistribution(DrawCounts(kKnownLogits, Params(1.0f, 0, 1.0f, 0.25f), 20000),
                            Restrict(p, {3, 1}));
  // min_p * p_max = 0.075: keeps 0.5, 0.3 and 0.1.
  ExpectMatchesDistribution(DrawCounts(kKnownLogits, Params(1.0f, 0, 1.0f, 0.15f), 20000),
                            Restrict(p, {3, 1, 2}));
  // min_p = 1 keeps only the max.
  EXPECT_EQ(DrawCounts(kKnownLogits, Params(1.0f, 0, 1.0f, 1.0f), 2000)[3], 2000);
}

TEST(SampleTokenTest, NegInfLogitsAreNeverSampled) {
  std::vector<float> logits(99, kNegInf);
  logits[7] = -50.0f;
  logits[40] = -50.0f;
  logits[98] = 3.0f;
  for (const SamplingParams& params :
       {Params(1.0f), Params(5.0f), Params(1.0f, 50), Params(1.0f, 0, 0.999f)}) {
    const std::vector<int64_t> counts = DrawCounts(logits, params, 3000);
    for (int i = 0; i < 99; ++i) {
      if (i != 7 && i != 40 && i != 98) {
        ASSERT_EQ(counts[i], 0) << "token " << i;
      }
    }
  }
  // At T = 100 every finite token is likely; the -inf ones must still never appear.
  std::vector<float> scratch;
  for (uint64_t seed = 0; seed < 200; ++seed) {
    const SampleResult r = SampleToken(logits.data(), 99, Params(100.0f), seed, 3, &scratch);
    EXPECT_TRUE(r.token == 7 || r.token == 40 || r.token == 98) << r.token;
    EXPECT_TRUE(std::isfinite(r.logprob));
  }
}

TEST(SampleTokenTest, AllNegInfRowPicksLowestIndexWithoutNan) {
  const std::vector<float> logits(7, kNegInf);
  std::vector<float> scratch;
  for (const SamplingParams& params : {Params(0.0f), Params(1.0f), Params(0.5f, 3, 0.5f, 0.5f)}) {
    const SampleResult r = SampleToken(logits.data(), 7, params, 3, 0, &scratch);
    EXPECT_EQ(r.token, 0);
    EXPECT_FALSE(std::isnan(r.logprob));
  }
}

TEST(SampleTokenTest, LogprobIsFullVocabLogSoftmaxOfSampledToken) {
  std::mt19937 rng(11);
  std::normal_distribution<float> dist(0.0f, 3.0f);
  std::vector<float> logits(1031);
  for (float& x : logits) x = dist(rng);
  logits[3] = kNegInf;
  std::vector<float> scratch;
  for (const SamplingParams& params :
       {Params(0.0f), Params(1.0f), Params(0.7f, 5), Params(1.3f, 0, 0.9f, 0.05f)}) {
    const double t = params.temperature > 0.0f ? params.temperature : 1.0;
    const std::vector<double> want = NaiveLogSoftmax(logits, t);
    for (uint64_t seed = 0; seed < 50; ++seed) {
      const SampleResult r = SampleToken(logits.data(), 1031, params, seed, 9, &scratch);
      ASSERT_TRUE(std::isfinite(r.logprob));
      ASSERT_LE(r.logprob, 0.0f);
      ASSERT_NEAR(r.logprob, want[r.token], 1e-5);
    }
  }
}

TEST(SampleTokenTest, TopLogprobsAreSortedWithTiesToLowerIdAndMatchLogSoftmax) {
  const std::vector<float> logits = {0.5f, 2.0f, kNegInf, 2.0f, -1.0f, 0.5f, 3.0f};
  std::vector<float> lp(7), scratch;
  LogSoftmax(logits.data(), 7, 0.7f, lp.data());
  const SampleResult r =
      SampleToken(logits.data(), 7, Params(0.7f, 0, 1.0f, 0.0f, 5), 1, 2, &scratch);
  const std::vector<int32_t> want_ids = {6, 1, 3, 0, 5};
  ASSERT_EQ(r.top.size(), 5u);
  for (int j = 0; j < 5; ++j) {
    EXPECT_EQ(r.top[j].token, want_ids[j]);
    EXPECT_EQ(r.top[j].logprob, lp[want_ids[j]]);
  }
  // More requested than the vocabulary holds: all of it, -inf last.
  const SampleResult all =
      SampleToken(logits.data(), 7, Params(0.0f, 0, 1.0f, 0.0f, 20), 1, 2, &scratch);
  ASSERT_EQ(all.top.size(), 7u);
  EXPECT_EQ(all.top.back().token, 2);
  EXPECT_EQ(all.top.back().logprob, kNegInf);
  EXPECT_TRUE(SampleToken(logits.data(), 7, Params(1.0f), 1, 2, &scratch).top.empty());
}

// The sampler's definition spelled out without shortcuts: full sort, every token's noise.
int32_t NaiveSample(const std::vector<float>& logits, const SamplingParams& params, uint64_t seed,
                    int64_t position) {
  const int32_t vocab = static_cast<int32_t>(logits.size());
  const float t = params.temperature;
  std::vector<float> lp(vocab);
  LogSoftmax(logits.data(), vocab, t, lp.data());
  std::vector<int32_t> order(vocab);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(),
            [&](int32_t a, int32_t b) { return lp[a] > lp[b] || (lp[a] == lp[b] && a < b); });
  int32_t kept = vocab;
  if (params.top_k > 0) kept = std::min(kept, params.top_k);
  if (params.top_p < 1.0f) {
    float mass = 0.0f;
    for (int32_t j = 0; j < kept; ++j) {
      mass += std::exp(lp[order[j]]);
      if (mass >= params.top_p) {
        kept = j + 1;
        break;
      }
    }
  }
  const float min_lp = params.min_p > 0.0f ? std::log(params.min_p) + lp[order[0]] : kNegInf;
  std::vector<int32_t> candidates(order.begin(), order.begin() + kept);
  std::sort(candidates.begin(), candidates.end());
  int32_t best = -1;
  float best_key = 0.0f;
  for (int32_t i : candidates) {
    if (lp[i] < min_lp) continue;
    const float key = logits[i] / t - std::log(-std::log(UniformNoise(seed, position, i)));
    if (best < 0 || key > best_key) {
      best = i;
      best_key = key;
    }
  }
  return best;
}

TEST(SampleTokenTest, MatchesNaiveDefinitionOnRandomRows) {
  std::mt19937 rng(13);
  std::normal_distribution<float> dist(0.0f, 2.0f);
  std::vector<float> scratch;
  int checked = 0;
  for (int32_t vocab : {1, 2, 7, 99, 1031}) {
    std::vector<float> logits(vocab);
    for (float& x : logits) x = dist(rng);
    if (vocab > 2) logits[1] = kNegInf;
    if (vocab > 5) logits[5] = logits[4];  // an exact tie
    for (const SamplingParams& params :
         {Params(1.0f), Params(0.3f), Params(3.0f, 40), Params(1.0f, 0, 0.95f),
          Params(2.0f, 300, 0.99f), Params(0.8f, 0, 1.0f, 0.01f), Params(1.5f, 7, 0.5f, 0.2f)}) {
      for (uint64_t seed = 0; seed < 40; ++seed) {
        const int64_t position = static_cast<int64_t>(seed) * 31;
        const SampleResult r = SampleToken(logits.data(), vocab, params, seed, position, &scratch);
        ASSERT_EQ(r.token, NaiveSample(logits, params, seed, position))
            << "vocab " << vocab << " seed " << seed << " T " << params.temperature;
        ++checked;
      }
    }
  }
  EXPECT_EQ(checked, 5 * 7 * 40);
}

}  // namespace
}  // namespace rollout
