#include "tests/gpu/gpu_test_util.h"

#include <cmath>
#include <sstream>

namespace rollout::gpu_test {

bool HaveGpu() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

std::vector<float> RandomFloats(size_t n, uint64_t seed, float scale) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

void RandomBf16(size_t n, uint64_t seed, float scale, std::vector<__nv_bfloat16>* bits,
                std::vector<float>* widened) {
  const std::vector<float> f = RandomFloats(n, seed, scale);
  bits->resize(n);
  widened->resize(n);
  for (size_t i = 0; i < n; ++i) {
    (*bits)[i] = __float2bfloat16_rn(f[i]);
    (*widened)[i] = __bfloat162float((*bits)[i]);
  }
}

std::vector<float> Widen(const std::vector<__nv_bfloat16>& v) {
  std::vector<float> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = __bfloat162float(v[i]);
  return out;
}

::testing::AssertionResult AllClose(const std::vector<float>& got, const std::vector<float>& want,
                                    float atol, float rtol) {
  if (got.size() != want.size()) {
    return ::testing::AssertionFailure() << "sizes differ: " << got.size() << " vs " << want.size();
  }
  std::ostringstream msg;
  size_t bad = 0;
  double worst = 0.0;
  size_t worst_i = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::fabs(static_cast<double>(got[i]) - want[i]);
    const double bound = atol + rtol * std::fabs(static_cast<double>(want[i]));
    if (!(err <= bound)) {
      if (bad < 5) msg << "  [" << i << "] got " << got[i] << " want " << want[i] << "\n";
      ++bad;
    }
    if (err > worst || std::isnan(err)) {
      worst = err;
      worst_i = i;
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << bad << " of " << got.size() << " elements out of tolerance (atol " << atol << ", rtol "
         << rtol << "); worst |err| " << worst << " at " << worst_i << "\n"
         << msg.str();
}

}  // namespace rollout::gpu_test
