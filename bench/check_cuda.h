#pragma once

// CHECK_CUDA(expr): the benchmarks' way out of a CUDA error -- the expression and the error on
// stderr, then exit(1). Benchmarks only; library code returns the error.

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#define CHECK_CUDA(expr)                                                      \
  do {                                                                        \
    const cudaError_t _e = (expr);                                            \
    if (_e != cudaSuccess) {                                                  \
      std::fprintf(stderr, "%s failed: %s\n", #expr, cudaGetErrorString(_e)); \
      std::exit(1);                                                           \
    }                                                                         \
  } while (0)
