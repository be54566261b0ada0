#include "model/rope.h"

#include <cmath>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace rollout {
namespace {

using ::testing::HasSubstr;

constexpr double kPi = 3.14159265358979323846;

RopeScaling Llama31() {  // meta-llama/Llama-3.1-8B's rope_scaling
  RopeScaling s;
  s.type = RopeType::kLlama3;
  s.factor = 8.0;
  s.low_freq_factor = 1.0;
  s.high_freq_factor = 4.0;
  s.original_max_position_embeddings = 8192;
  return s;
}

RopeScaling QwenYarn() {  // Qwen's long-context recipe: yarn, factor 4, from 32768
  RopeScaling s;
  s.type = RopeType::kYarn;
  s.factor = 4.0;
  s.original_max_position_embeddings = 32768;
  return s;
}

TEST(RopeTest, DefaultIsThetaToTheMinusTwoIOverD) {
  const RopeFrequencies f = ComputeRopeFrequencies(RopeScaling(), 10000.0, 64);
  ASSERT_EQ(f.inv_freq.size(), 32u);
  for (int i = 0; i < 32; ++i) {
    EXPECT_EQ(f.inv_freq[i], std::pow(10000.0, -(2.0 * i) / 64)) << i;
  }
  EXPECT_EQ(f.attention_factor, 1.0);
}

TEST(RopeTest, LinearDividesEveryFrequencyByTheFactor) {
  RopeScaling s;
  s.type = RopeType::kLinear;
  s.factor = 4.0;
  const RopeFrequencies f = ComputeRopeFrequencies(s, 10000.0, 64);
  for (int i = 0; i < 32; ++i) EXPECT_EQ(f.inv_freq[i], std::pow(10000.0, -(2.0 * i) / 64) / 4.0);
  EXPECT_EQ(f.attention_factor, 1.0);
}

// Below max_position_embeddings dynamic NTK's base is theta itself: plain RoPE.
TEST(RopeTest, DynamicIsPlainRope) {
  RopeScaling s;
  s.type = RopeType::kDynamic;
  s.factor = 2.0;
  const RopeFrequencies plain = ComputeRopeFrequencies(RopeScaling(), 1e6, 128);
  const RopeFrequencies dynamic = ComputeRopeFrequencies(s, 1e6, 128);
  EXPECT_EQ(dynamic.inv_freq, plain.inv_freq);
  EXPECT_EQ(dynamic.attention_factor, 1.0);
}

// Llama-3.1-8B: theta 500000, head_dim 128, factor 8, low 1, high 4, original 8192. Expected by
// the formula of Meta's reference (wavelength 2 pi / f against 8192 / high and 8192 / low).
TEST(RopeTest, Llama3MatchesTheHandFormulaOnLlama31) {
  const RopeFrequencies f = ComputeRopeFrequencies(Llama31(), 500000.0, 128);
  ASSERT_EQ(f.inv_freq.size(), 64u);
  int high = 0, medium = 0, low = 0;
  for (int i = 0; i < 64; ++i) {
    const double base = std::pow(500000.0, -2.0 * i / 128.0);
    const double wavelen = 2.0 * kPi / base;
    double want;
    if (wavelen < 8192.0 / 4.0) {
      want = base;
      ++high;
    } else if (wavelen > 8192.0 / 1.0) {
      want = base / 8.0;
      ++low;
    } else {
      const double smooth = (8192.0 / wavelen - 1.0) / (4.0 - 1.0);
      want = (1.0 - smooth) * base / 8.0 + smooth * base;
      ++medium;
    }
    EXPECT_NEAR(f.inv_freq[i], want, 1e-15 * base) << i;
  }
  // Every band is exercised: 29 unchanged, 6 blended, 29 divided by 8.
  EXPECT_EQ(high, 29);
  EXPECT_EQ(medium, 6);
  EXPECT_EQ(low, 29);
  // Values computed independently (Python, double).
  EXPECT_DOUBLE_EQ(f.inv_freq[0], 1.0);
  EXPECT_DOUBLE_EQ(f.inv_freq[28], 0.003211445994752591);
  EXPECT_DOUBLE_EQ(f.inv_freq[29], 0.002166570763503359);
  EXPECT_DOUBLE_EQ(f.inv_freq[31], 0.0008567514129196321);
  EXPECT_DOUBLE_EQ(f.inv_freq[34], 0.0001785078127679964);
  EXPECT_DOUBLE_EQ(f.inv_freq[35], 9.556212353964683e-05);
  EXPECT_DOUBLE_EQ(f.inv_freq[63], 3.068925988914511e-07);
  EXPECT_EQ(f.attention_factor, 1.0);
}

// YaRN on Qwen's recipe: the correction range is dims [floor(23.6), ceil(39.7)] = [23, 40];
// below 23 the frequencies are extrapolated (unchanged), above 40 interpolated (divided by 4),
// a linear ramp between; cos and sin are scaled by 0.1 ln 4 + 1.
TEST(RopeTest, YarnMatchesTheHandFormulaOnQwensRecipe) {
  const RopeFrequencies f = ComputeRopeFrequencies(QwenYarn(), 1e6, 128);
  ASSERT_EQ(f.inv_freq.size(), 64u);
  for (int i = 0; i < 64; ++i) {
    const double pos_freq = std::pow(1e6, 2.0 * i / 128.0);
    const double ramp = std::min(1.0, std::max(0.0, (i - 23.0) / (40.0 - 23.0)));
    const double want = (1.0 / (4.0 * pos_freq)) * ramp + (1.0 / pos_freq) * (1.0 - ramp);
    EXPECT_NEAR(f.inv_freq[i], want, 1e-15 / pos_freq) << i;
  }
  EXPECT_DOUBLE_EQ(f.inv_freq[0], 1.0);
  EXPECT_DOUBLE_EQ(f.inv_freq[20], 0.01333521432163324);  // extrapolated
  EXPECT_DOUBLE_EQ(f.inv_freq[30], 0.0010643609812470017);
  EXPECT_DOUBLE_EQ(f.inv_freq[63], 3.102344401879299e-07);  // interpolated
  EXPECT_DOUBLE_EQ(f.attention_factor, 1.138629436111989);
}

TEST(RopeTest, YarnWithoutTruncationRampsOverTheExactRange) {
  RopeScaling s = QwenYarn();
  s.truncate = false;
  EXPECT_DOUBLE_EQ(ComputeRopeFrequencies(s, 1e6, 128).inv_freq[30], 0.0010792377416765538);
}

TEST(RopeTest, YarnAttentionFactorFromMscales) {
  RopeScaling s = QwenYarn();
  s.factor = 40.0;
  s.mscale = 1.0;
  s.mscale_all_dim = 0.707;
  EXPECT_DOUBLE_EQ(ComputeRopeFrequencies(s, 1e4, 64).attention_factor,
                   (0.1 * std::log(40.0) + 1.0) / (0.1 * 0.707 * std::log(40.0) + 1.0));
  s.mscale_all_dim = 0.0;  // transformers: `mscale and mscale_all_dim` is false
  EXPECT_DOUBLE_EQ(ComputeRopeFrequencies(s, 1e4, 64).attention_factor,
                   0.1 * std::log(40.0) + 1.0);
  s.attention_factor = 0.75;  // explicit: wins
  EXPECT_EQ(ComputeRopeFrequencies(s, 1e4, 64).attention_factor, 0.75);
  s = QwenYarn();
  s.factor = 1.0;  // get_mscale(1) = 1
  EXPECT_EQ(ComputeRopeFrequencies(s, 1e4, 64).attention_factor, 1.0);
}

TEST(RopeTest, YarnBetasMoveTheRamp) {
  // More rotations put the correction dimensions lower: the ramp starts and ends earlier.
  RopeScaling narrow = QwenYarn();
  narrow.beta_fast = 64.0;
  narrow.beta_slow = 2.0;
  const RopeFrequencies a = ComputeRopeFrequencies(QwenYarn(), 1e6, 128);
  const RopeFrequencies b = ComputeRopeFrequencies(narrow, 1e6, 128);
  EXPECT_EQ(a.inv_freq[0], b.inv_freq[0]);
  EXPECT_NE(a.inv_freq[30], b.inv_freq[30]);
}

TEST(RopeTest, CosSinAreDoubleRoundedToFloatTimesTheAttentionFactor) {
  const RopeFrequencies f = ComputeRopeFrequencies(QwenYarn(), 1e6, 128);
  std::vector<float> cos(64), sin(64);
  RopeCosSin(f, 4097, cos.data(), sin.data());
  for (int i = 0; i < 64; ++i) {
    const double angle = 4097.0 * f.inv_freq[i];
    EXPECT_EQ(cos[i], static_cast<float>(std::cos(angle) * f.attention_factor)) << i;
    EXPECT_EQ(sin[i], static_cast<float>(std::sin(angle) * f.attention_factor)) << i;
  }
  // Position 0 of plain RoPE is the identity rotation.
  RopeCosSin(ComputeRopeFrequencies(RopeScaling(), 1e6, 128), 0, cos.data(), sin.data());
  for (int i = 0; i < 64; ++i) {
    EXPECT_EQ(cos[i], 1.0f);
    EXPECT_EQ(sin[i], 0.0f);
  }
}

TEST(RopeTest, DescribeSaysWhatDynamicServesAndWhereYarnsContextEnds) {
  RopeScaling dynamic;
  dynamic.type = RopeType::kDynamic;
  dynamic.factor = 2.0;
  const std::string d = DescribeRope(dynamic, 1e4, 4096);
  EXPECT_THAT(d, HasSubstr("dynamic"));
  EXPECT_THAT(d, HasSubstr("plain RoPE"));
  EXPECT_THAT(d, HasSubstr("capped at max_position_embeddings = 4096"));
  const std::string y = DescribeRope(QwenYarn(), 1e6, 40960);
  EXPECT_THAT(y, HasSubstr("attention factor 1.13863"));
  EXPECT_THAT(y, HasSubstr("131072"));
  EXPECT_THAT(DescribeRope(Llama31(), 5e5, 131072),
              HasSubstr("original_max_position_embeddings 8192"));
}

}  // namespace
}  // namespace rollout
