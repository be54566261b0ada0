#pragma once

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda/device_buffer.h"

// Helpers shared by the GPU tests: device buffers filled from host vectors, seeded random data
// and an llm.c-style closeness check that prints the first mismatches.
namespace rollout::gpu_test {

#define ASSERT_CUDA_OK(expr)                                                   \
  do {                                                                         \
    const cudaError_t _err = (expr);                                           \
    ASSERT_EQ(_err, cudaSuccess) << #expr << ": " << cudaGetErrorString(_err); \
  } while (0)

// True when a CUDA device is usable; tests skip otherwise.
bool HaveGpu();

// A fixture base owning a cuBLASLt handle, lt_ (the test skips without a GPU). Base: the gtest
// fixture to derive from, ::testing::Test or a ::testing::TestWithParam<...>.
template <class Base = ::testing::Test>
class CublasLtTest : public Base {
 protected:
  void SetUp() override {
    if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
    ASSERT_EQ(CUBLAS_STATUS_SUCCESS, cublasLtCreate(&lt_));
  }
  void TearDown() override {
    if (lt_ != nullptr) cublasLtDestroy(lt_);
  }
  cublasLtHandle_t lt_ = nullptr;
};

template <typename T>
cuda::DeviceBuffer Upload(const std::vector<T>& host) {
  cuda::DeviceBuffer buffer;
  if (buffer.Allocate(host.size() * sizeof(T)) == cudaSuccess && !host.empty()) {
    cudaMemcpy(buffer.get(), host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice);
  }
  return buffer;
}

template <typename T>
std::vector<T> Download(const cuda::DeviceBuffer& buffer, size_t count) {
  std::vector<T> host(count);
  cudaMemcpy(host.data(), buffer.get(), count * sizeof(T), cudaMemcpyDeviceToHost);
  return host;
}

std::vector<float> RandomFloats(size_t n, uint64_t seed, float scale);
// bf16 values (as raw bits) and their exact fp32 widening.
void RandomBf16(size_t n, uint64_t seed, float scale, std::vector<__nv_bfloat16>* bits,
                std::vector<float>* widened);
std::vector<float> Widen(const std::vector<__nv_bfloat16>& v);

// Checks |got - want| <= atol + rtol * |want| elementwise; prints up to 5 mismatches and the
// worst error. Returns whether all passed.
::testing::AssertionResult AllClose(const std::vector<float>& got, const std::vector<float>& want,
                                    float atol, float rtol);

}  // namespace rollout::gpu_test
