#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

// The tensor-core and asynchronous-copy instructions the hand-written kernels (attention_mma.cu,
// moe.cu, small_m_gemm.cu) issue, one definition each. m16n8k16 MMA: bf16 in, fp32 accumulated
// in place, one fixed instruction whatever the caller's tiling (the per-element order is the
// caller's K loop).
namespace rollout::cuda::ptx {

__device__ __forceinline__ void Mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two 8x8 bf16 matrices, transposed into the B fragment of m16n8k16: lanes 0-15 give the row
// addresses (rows 0-7 of matrix 0, then of matrix 1).
__device__ __forceinline__ void LdMatrixX2Trans(uint32_t* r0, uint32_t* r1,
                                                const __nv_bfloat16* row) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(*r0), "=r"(*r1)
               : "r"(addr));
}

// Two 8x8 bf16 matrices (lanes 0-7 give matrix 0's row addresses, lanes 8-15 matrix 1's; the
// other lanes' are ignored); lane l receives row l / 4, columns 2 (l % 4) + {0, 1} of each: the B
// fragment (b0, b1) of m16n8k16 when the rows are n and the columns k (w[n, k] row-major).
__device__ __forceinline__ void LdMatrixX2(uint32_t* r0, uint32_t* r1, const __nv_bfloat16* row) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(*r0), "=r"(*r1)
               : "r"(addr));
}

// Four 8x8 bf16 matrices (lanes 8m .. 8m + 7 give the row addresses of matrix m); lane l receives
// row l / 4, columns 2 (l % 4) + {0, 1} of each: the B fragments of m16n8k16 when the rows are
// keys and the columns dims.
__device__ __forceinline__ void LdMatrixX4(uint32_t (&r)[4], const __nv_bfloat16* row) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// 16 bytes global -> shared, asynchronously; zero-filled when !valid (src is then not read).
__device__ __forceinline__ void CpAsync16(void* dst, const void* src, bool valid) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(addr), "l"(src),
               "r"(src_bytes));
}

// Closes this thread's current group of cp.async copies.
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::); }

// Waits until at most kPending of this thread's committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

}  // namespace rollout::cuda::ptx
