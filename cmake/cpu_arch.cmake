# The CPU kernels are written so the compiler vectorises their fixed-order reductions. Build for
# AVX2+FMA when the build machine has them (every replica must run the same binary for bitwise
# equal results, D7); ROLLOUT_CPU_ARCH overrides, e.g. -DROLLOUT_CPU_ARCH=x86-64.
if(NOT DEFINED ROLLOUT_CPU_ARCH)
  set(ROLLOUT_CPU_ARCH "")
  if(EXISTS /proc/cpuinfo AND CMAKE_SYSTEM_PROCESSOR MATCHES "x86_64|AMD64")
    file(READ /proc/cpuinfo _cpuinfo)
    if(_cpuinfo MATCHES " avx2" AND _cpuinfo MATCHES " fma")
      set(ROLLOUT_CPU_ARCH "x86-64-v3")
    endif()
  endif()
endif()
if(ROLLOUT_CPU_ARCH)
  message(STATUS "CPU kernels built with -march=${ROLLOUT_CPU_ARCH}")
  set(ROLLOUT_CPU_FLAGS -march=${ROLLOUT_CPU_ARCH})
else()
  set(ROLLOUT_CPU_FLAGS "")
endif()
