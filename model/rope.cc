#include "model/rope.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_format.h"

namespace rollout {
namespace {

constexpr double kPi = 3.14159265358979323846;

// theta^(-2i/d): the expression the engine has always used, so default RoPE keeps its bits.
double DefaultInvFreq(double theta, int64_t i, int64_t head_dim) {
  return std::pow(theta, -(2.0 * static_cast<double>(i)) / head_dim);
}

// transformers' yarn get_mscale.
double YarnMscale(double scale, double mscale) {
  return scale <= 1.0 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0;
}

void Llama3(const RopeScaling& s, std::vector<double>* inv_freq) {
  const double old_context = s.original_max_position_embeddings;
  const double low_freq_wavelen = old_context / s.low_freq_factor;
  const double high_freq_wavelen = old_context / s.high_freq_factor;
  for (double& inv : *inv_freq) {
    const double wavelen = 2.0 * kPi / inv;
    if (wavelen < high_freq_wavelen) continue;  // high frequencies: unchanged
    if (wavelen > low_freq_wavelen) {           // low frequencies: interpolated
      inv /= s.factor;
      continue;
    }
    // Between: a linear blend in old_context / wavelen.
    const double smooth =
        (old_context / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
    inv = (1.0 - smooth) * inv / s.factor + smooth * inv;
  }
}

void Yarn(const RopeScaling& s, double theta, int64_t head_dim, std::vector<double>* inv_freq) {
  const double d = static_cast<double>(head_dim);
  const double beta_fast = s.beta_fast.value_or(32.0);
  const double beta_slow = s.beta_slow.value_or(1.0);
  // The dimension at which a frequency turns `rotations` times over the original context.
  auto correction_dim = [&](double rotations) {
    return d * std::log(s.original_max_position_embeddings / (rotations * 2.0 * kPi)) /
           (2.0 * std::log(theta));
  };
  double low = correction_dim(beta_fast), high = correction_dim(beta_slow);
  if (s.truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, d - 1.0);
  if (low == high) high += 0.001;  // transformers' guard against a zero-width ramp
  for (int64_t i = 0; i < static_cast<int64_t>(inv_freq->size()); ++i) {
    const double pos_freq = std::pow(theta, 2.0 * static_cast<double>(i) / d);
    const double extrapolation = 1.0 / pos_freq;
    const double interpolation = 1.0 / (s.factor * pos_freq);
    const double ramp = std::clamp((static_cast<double>(i) - low) / (high - low), 0.0, 1.0);
    const double extrapolation_weight = 1.0 - ramp;
    (*inv_freq)[i] = interpolation * (1.0 - extrapolation_weight) +
                     extrapolation * extrapolation_weight;
  }
}

double YarnAttentionFactor(const RopeScaling& s) {
  if (s.attention_factor.has_value()) return *s.attention_factor;
  // Python truthiness: both present and non-zero.
  if (s.mscale.value_or(0.0) != 0.0 && s.mscale_all_dim.value_or(0.0) != 0.0) {
    return YarnMscale(s.factor, *s.mscale) / YarnMscale(s.factor, *s.mscale_all_dim);
  }
  return YarnMscale(s.factor, 1.0);
}

}  // namespace

const char* RopeTypeName(RopeType type) {
  switch (type) {
    case RopeType::kDefault:
      return "default";
    case RopeType::kLinear:
      return "linear";
    case RopeType::kDynamic:
      return "dynamic";
    case RopeType::kYarn:
      return "yarn";
    case RopeType::kLlama3:
      return "llama3";
  }
  return "?";
}

bool RopeScaling::operator==(const RopeScaling& o) const {
  return type == o.type && factor == o.factor &&
         original_max_position_embeddings == o.original_max_position_embeddings &&
         low_freq_factor == o.low_freq_factor && high_freq_factor == o.high_freq_factor &&
         attention_factor == o.attention_factor && beta_fast == o.beta_fast &&
         beta_slow == o.beta_slow && mscale == o.mscale && mscale_all_dim == o.mscale_all_dim &&
         truncate == o.truncate;
}

RopeFrequencies ComputeRopeFrequencies(const RopeScaling& scaling, double theta,
                                       int64_t head_dim) {
  RopeFrequencies f;
  f.inv_freq.resize(head_dim / 2);
  for (int64_t i = 0; i < head_dim / 2; ++i) f.inv_freq[i] = DefaultInvFreq(theta, i, head_dim);
  switch (scaling.type) {
    case RopeType::kDefault:
    case RopeType::kDynamic:  // below max_position_embeddings, transformers' base is theta
      break;
    case RopeType::kLinear:
      for (double& inv : f.inv_freq) inv /= scaling.factor;
      break;
    case RopeType::kLlama3:
      Llama3(scaling, &f.inv_freq);
      break;
    case RopeType::kYarn:
      Yarn(scaling, theta, head_dim, &f.inv_freq);
      f.attention_factor = YarnAttentionFactor(scaling);
      break;
  }
  return f;
}

void RopeCosSin(const RopeFrequencies& frequencies, int64_t position, float* cos, float* sin) {
  const double p = static_cast<double>(position);
  const double scale = frequencies.attention_factor;
  for (size_t i = 0; i < frequencies.inv_freq.size(); ++i) {
    const double angle = p * frequencies.inv_freq[i];
    cos[i] = static_cast<float>(std::cos(angle) * scale);
    sin[i] = static_cast<float>(std::sin(angle) * scale);
  }
}

std::string DescribeRope(const RopeScaling& s, double theta, int32_t max_position_embeddings) {
  std::string text = absl::StrFormat("RoPE %s, theta %g", RopeTypeName(s.type), theta);
  switch (s.type) {
    case RopeType::kDefault:
      break;
    case RopeType::kLinear:
      absl::StrAppendFormat(&text, ", factor %g", s.factor);
      break;
    case RopeType::kDynamic:
      absl::StrAppendFormat(
          &text,
          ", factor %g: served as plain RoPE, which is what dynamic NTK computes below "
          "max_position_embeddings; the context is capped at max_position_embeddings = %d "
          "(beyond it the frequencies would change with the sequence length, not a function of "
          "the position)",
          s.factor, max_position_embeddings);
      break;
    case RopeType::kLlama3:
      absl::StrAppendFormat(&text,
                            ", factor %g, low_freq_factor %g, high_freq_factor %g, "
                            "original_max_position_embeddings %d",
                            s.factor, s.low_freq_factor, s.high_freq_factor,
                            s.original_max_position_embeddings);
      break;
    case RopeType::kYarn: {
      const RopeFrequencies f = ComputeRopeFrequencies(s, theta, 2);
      absl::StrAppendFormat(&text,
                            ", factor %g, original_max_position_embeddings %d, beta_fast %g, "
                            "beta_slow %g, attention factor %.6g%s",
                            s.factor, s.original_max_position_embeddings,
                            s.beta_fast.value_or(32.0), s.beta_slow.value_or(1.0),
                            f.attention_factor, s.truncate ? "" : ", not truncated");
      const double extended = s.factor * s.original_max_position_embeddings;
      if (extended > max_position_embeddings) {
        absl::StrAppendFormat(&text,
                              "; the context is max_position_embeddings = %d: to serve up to "
                              "factor x original_max_position_embeddings = %.0f, raise "
                              "max_position_embeddings in config.json",
                              max_position_embeddings, extended);
      }
      break;
    }
  }
  return text;
}

}  // namespace rollout
