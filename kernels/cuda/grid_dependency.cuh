#pragma once

// Programmatic dependent launch (sm_90). A kernel launched with
// cudaLaunchAttributeProgrammaticStreamSerialization may start before the kernel ahead of it in
// the stream has finished -- once every block of that kernel has run LaunchDependents() (or
// exited) -- and must run WaitForPrerequisites() before it reads anything that kernel writes or
// writes anything it reads: the wait returns when the kernel ahead has completed and its writes
// are visible. Without that attribute both are no-ops, so a kernel may call them whoever launches
// it. Used by the small-m warpgroup GEMM, which streams its weights (written by no kernel of a
// step) into shared memory before the wait, while the norm, SiLU or attention merge ahead of it
// finishes (kernels/cuda/small_m_gemm_wgmma.cu).
namespace rollout::cuda::ptx {

__device__ __forceinline__ void LaunchDependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void WaitForPrerequisites() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

}  // namespace rollout::cuda::ptx
