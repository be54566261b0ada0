# The CUDA backend. ROLLOUT_CUDA = AUTO (default) builds it when nvcc is found, ON requires it,
# OFF never builds it. Sets ROLLOUT_HAVE_CUDA, which the kernels, engine, GPU tests and benchmarks
# read. Hopper only (sm_90a: wgmma/TMA-capable code and the cuBLASLt kernels we pin are measured
# there); override with -DCMAKE_CUDA_ARCHITECTURES=... for experiments.
set(ROLLOUT_CUDA AUTO CACHE STRING "Build the CUDA backend: AUTO (when nvcc is found), ON or OFF")
set_property(CACHE ROLLOUT_CUDA PROPERTY STRINGS AUTO ON OFF)

set(ROLLOUT_HAVE_CUDA OFF)
if(NOT ROLLOUT_CUDA STREQUAL "OFF" AND (ROLLOUT_CUDA STREQUAL "AUTO" OR ROLLOUT_CUDA))
  # CI and the dev images keep nvcc at /usr/local/cuda without putting it on PATH.
  if(NOT DEFINED CMAKE_CUDA_COMPILER AND NOT DEFINED ENV{CUDACXX}
     AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      set(CMAKE_CUDA_ARCHITECTURES 90a)
    endif()
    # One CUDA runtime per process: the shared libcudart that cuBLASLt uses too (the GPU hosts
    # bring their own), also for C++ executables that link the CUDA kernels.
    set(CMAKE_CUDA_RUNTIME_LIBRARY Shared)
    enable_language(CUDA)
    set(CMAKE_CUDA_STANDARD 17)
    set(CMAKE_CUDA_STANDARD_REQUIRED ON)
    find_package(CUDAToolkit REQUIRED)
    if(CCACHE_PROGRAM)
      set(CMAKE_CUDA_COMPILER_LAUNCHER ${CCACHE_PROGRAM})
    endif()
    set(ROLLOUT_HAVE_CUDA ON)
    message(STATUS "CUDA backend: ON (nvcc ${CMAKE_CUDA_COMPILER_VERSION}, "
                   "arch ${CMAKE_CUDA_ARCHITECTURES})")
  elseif(NOT ROLLOUT_CUDA STREQUAL "AUTO")
    message(FATAL_ERROR "ROLLOUT_CUDA=${ROLLOUT_CUDA} but no CUDA compiler (nvcc) was found")
  else()
    message(STATUS "CUDA backend: OFF (no nvcc found)")
  endif()
else()
  message(STATUS "CUDA backend: OFF (ROLLOUT_CUDA=OFF)")
endif()
