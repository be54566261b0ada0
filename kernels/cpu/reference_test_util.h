#pragma once

// Helpers of the CPU kernel tests (and rollout-tp-bench): seeded inputs, column slices,
// bitwise comparison, and Dot's documented order written out. Include only from code built
// without -march=x86-64-v3 (tests, tools), so nothing here is contracted (only the explicit fma
// fuses).
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

// Columns [c0, c1) of a row-major [rows, cols] matrix, as a contiguous [rows, c1 - c0] one: a
// rank's K slice.
inline std::vector<float> Columns(const std::vector<float>& a, int64_t rows, int64_t cols,
                                  int64_t c0, int64_t c1) {
  std::vector<float> out(rows * (c1 - c0));
  for (int64_t r = 0; r < rows; ++r) {
    std::memcpy(&out[r * (c1 - c0)], &a[r * cols + c0], (c1 - c0) * sizeof(float));
  }
  return out;
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
