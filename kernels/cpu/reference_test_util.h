#pragma once

// Helpers of the CPU kernel tests: seeded inputs, bitwise comparison, and Dot's documented
// order written out. Include from test files only: they are built without -march=x86-64-v3, so
// nothing here is contracted (only the explicit fma fuses).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

namespace rollout::cpu {

inline std::vector<float> RandomVector(int64_t n, uint32_t seed, float lo = -1.0f,
                                       float hi = 1.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

inline bool BitwiseEqual(float a, float b) { return std::memcmp(&a, &b, sizeof(float)) == 0; }

// Index of the first element that differs bitwise, or -1 (0 when the sizes differ).
inline int64_t FirstBitwiseMismatch(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!BitwiseEqual(a[i], b[i])) return static_cast<int64_t>(i);
  }
  return -1;
}

// The documented order of Dot, transcribed lane by lane.
inline float ScalarDot(const float* a, const float* b, int64_t n) {
  float acc[16] = {};
  for (int64_t i = 0; i < n; ++i) acc[i % 16] = std::fma(a[i], b[i], acc[i % 16]);
  for (int l = 0; l < 8; ++l) acc[l] += acc[l + 8];
  for (int l = 0; l < 4; ++l) acc[l] += acc[l + 4];
  for (int l = 0; l < 2; ++l) acc[l] += acc[l + 2];
  return acc[0] + acc[1];
}

}  // namespace rollout::cpu
