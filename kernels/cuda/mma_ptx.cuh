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

// --- mbarriers, the tensor memory accelerator (TMA) and thread-block clusters (sm_90) ---------
// Used by small_m_gemm.cu's multicast kernel. Addresses are 32-bit shared-window addresses.

__device__ __forceinline__ uint32_t SharedAddress(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void MbarrierInit(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(SharedAddress(bar)), "r"(count));
}

// Makes the initialised barriers visible to the cluster (and to the async proxy).
__device__ __forceinline__ void FenceMbarrierInit() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// One arrival that also expects `bytes` more of asynchronous transactions this phase.
__device__ __forceinline__ void MbarrierArriveExpectTx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(SharedAddress(bar)),
               "r"(bytes)
               : "memory");
}

// Waits until the phase of parity `parity` of the barrier has completed.
__device__ __forceinline__ void MbarrierWait(uint64_t* bar, uint32_t parity) {
  const uint32_t addr = SharedAddress(bar);
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n"
      "}\n" ::"r"(addr),
      "r"(parity)
      : "memory");
}

__device__ __forceinline__ void MbarrierArrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(SharedAddress(bar)) : "memory");
}

// One arrival on the barrier at the same offset in the shared memory of cluster CTA `cta`
// (release at cluster scope: this thread's earlier shared-memory reads are done).
__device__ __forceinline__ void MbarrierArriveCluster(uint64_t* bar, uint32_t cta) {
  asm volatile(
      "{\n"
      ".reg .b32 remote;\n"
      "mapa.shared::cluster.u32 remote, %0, %1;\n"
      "mbarrier.arrive.release.cluster.shared::cluster.b64 _, [remote];\n"
      "}\n" ::"r"(SharedAddress(bar)),
      "r"(cta)
      : "memory");
}

__device__ __forceinline__ uint32_t ClusterCtaRank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}

// Every thread of every CTA of the cluster arrives, then waits for all.
__device__ __forceinline__ void ClusterSync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::
                   : "memory");
}

// Fetches a kernel-parameter tensor map's descriptor ahead of its first use.
__device__ __forceinline__ void PrefetchTensorMap(const void* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(map) : "memory");
}

// A 3-d tile of the tensor map `map` at coordinates (c0, c1, c2) into this CTA's shared memory
// at `dst`, its bytes counted on `bar`.
__device__ __forceinline__ void TmaLoad3d(void* dst, const void* map, int c0, int c1, int c2,
                                          uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(SharedAddress(dst)),
      "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(SharedAddress(bar))
      : "memory");
}

// The same tile into the shared memory of every cluster CTA in `mask`, at the same offset, each
// copy counted on that CTA's barrier at `bar`'s offset.
__device__ __forceinline__ void TmaLoad3dMulticast(void* dst, const void* map, int c0, int c1,
                                                   int c2, uint64_t* bar, uint16_t mask) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      ".multicast::cluster [%0], [%1, {%2, %3, %4}], [%5], %6;\n" ::"r"(SharedAddress(dst)),
      "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(SharedAddress(bar)), "h"(mask)
      : "memory");
}

// Warpgroup MMA (wgmma_ptx.cuh issues the MMAs). Fence before a warpgroup's first wgmma that
// reads accumulators written by ordinary code; commit closes a group of issued wgmmas; wait
// returns when at most kPending groups are still running.
__device__ __forceinline__ void WgmmaFence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void WgmmaCommit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void WgmmaWait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
// Keeps the compiler from moving reads or writes of `v` across the asynchronous MMAs around it.
__device__ __forceinline__ void FenceOperand(float& v) { asm volatile("" : "+f"(v)::"memory"); }
// The same for each register of an accumulator.
template <int N>
__device__ __forceinline__ void FenceOperands(float (&v)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) FenceOperand(v[i]);
}
// Makes this thread's generic-proxy writes to shared memory (cp.async copies once waited for)
// visible to the async proxy that wgmma reads through.
__device__ __forceinline__ void FenceProxyAsyncShared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// The shared-memory matrix descriptor of a K-major tile of 128-byte rows (64 bf16) stored with
// the 128-byte swizzle (the TMA's CU_TENSOR_MAP_SWIZZLE_128B: 16-byte chunk c of row r at
// c ^ (r % 8)), from a 1024-byte aligned base: 8-row groups 1024 bytes apart (stride byte
// offset), the leading byte offset unused by swizzled K-major layouts. The k16 slice j of the
// tile is the descriptor + 2 j (its start address + 32 j bytes, in 16-byte units).
// (SwizzledDescriptor: either layout's fields, the leading byte offset given.)
__device__ __forceinline__ uint64_t SwizzledDescriptor(const void* tile,
                                                       uint32_t leading_byte_offset) {
  const uint64_t addr = SharedAddress(tile);
  return ((addr & 0x3FFFF) >> 4) | (uint64_t{leading_byte_offset >> 4} << 16) |
         (uint64_t{1024 >> 4} << 32) | (uint64_t{1} << 62);
}
__device__ __forceinline__ uint64_t SwizzledKMajorDescriptor(const void* tile) {
  return SwizzledDescriptor(tile, 16);
}

// The descriptor of an MN-major B operand (wgmma's transposed B: N contiguous) in the same
// 128-byte swizzle: rows of 64 bf16 along N, one row per k (8-row groups of k 1024 bytes apart,
// the stride byte offset), the next 64 columns of N `n_block_bytes` further (the leading byte
// offset). The k16 slice j of the tile starts 16 rows (2048 bytes) further: the descriptor + 128 j.
__device__ __forceinline__ uint64_t SwizzledMnMajorDescriptor(const void* tile,
                                                              uint32_t n_block_bytes) {
  return SwizzledDescriptor(tile, n_block_bytes);
}

}  // namespace rollout::cuda::ptx
