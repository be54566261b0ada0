// rollout-ipc-exporter: the other process of rollout_gpu_test's IPC tests (ipc_test.cc), since
// cudaIpcOpenMemHandle cannot open a handle exported by its own process. Started with a file of
// bytes, it uploads them into one cudaMalloc allocation on device 0 and prints one line:
//   handle <128 hex digits> uuid <8-4-4-4-12> bytes <n>
// then obeys lines on stdin: "free" frees the allocation (prints "freed"); EOF exits.
#include <cuda_runtime.h>

#include <cstdio>
#include <fstream>
#include <iostream>
#include <iterator>
#include <string>
#include <vector>

namespace {

int Fail(const char* what, cudaError_t e) {
  std::printf("error %s: %s\n", what, cudaGetErrorName(e));
  std::fflush(stdout);
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: rollout-ipc-exporter FILE\n");
    return 2;
  }
  std::ifstream in(argv[1], std::ios::binary);
  const std::vector<char> bytes((std::istreambuf_iterator<char>(in)),
                                std::istreambuf_iterator<char>());
  void* device = nullptr;
  if (cudaError_t e = cudaMalloc(&device, bytes.empty() ? 1 : bytes.size()); e != cudaSuccess) {
    return Fail("cudaMalloc", e);
  }
  if (cudaError_t e = cudaMemcpy(device, bytes.data(), bytes.size(), cudaMemcpyHostToDevice);
      e != cudaSuccess) {
    return Fail("cudaMemcpy", e);
  }
  cudaIpcMemHandle_t handle;
  if (cudaError_t e = cudaIpcGetMemHandle(&handle, device); e != cudaSuccess) {
    return Fail("cudaIpcGetMemHandle", e);
  }
  cudaDeviceProp prop;
  if (cudaError_t e = cudaGetDeviceProperties(&prop, 0); e != cudaSuccess) {
    return Fail("cudaGetDeviceProperties", e);
  }
  std::printf("handle ");
  for (size_t i = 0; i < sizeof(handle); ++i) {
    std::printf("%02x", static_cast<unsigned char>(handle.reserved[i]));
  }
  const unsigned char* u = reinterpret_cast<const unsigned char*>(prop.uuid.bytes);
  std::printf(
      " uuid %02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x bytes %zu\n",
      u[0], u[1], u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13], u[14],
      u[15], bytes.size());
  std::fflush(stdout);
  std::string line;
  while (std::getline(std::cin, line)) {
    if (line == "free" && device != nullptr) {
      cudaFree(device);
      device = nullptr;
      std::printf("freed\n");
      std::fflush(stdout);
    }
  }
  if (device != nullptr) cudaFree(device);
  return 0;
}
