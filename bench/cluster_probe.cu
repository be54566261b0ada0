// rollout-cluster-probe: what a decode GEMM's bytes cost without its arithmetic, and what
// thread-block clusters do to that cost. Each CTA streams its own weight rows through a ring of
// shared-memory stages by bulk copies (the small-m kernels' ring: full/empty mbarriers, one
// producer thread, consumer warps that only release), beside the x rows every CTA of a decode
// GEMM also reads (from L2), in four patterns:
//   w        weights only (the floor's bytes);
//   w+x      weights and this CTA's own copy of x, the kernels' pattern today;
//   w+x cC   the same in clusters of C (the launch attribute alone: scheduling);
//   mcast cC x multicast: cluster rank r loads slice r of each x stage into every CTA of the
//            cluster; empty barriers take every cluster CTA's consumers' arrivals, either one
//            per consumer warp (`warps`) or one per CTA after a named barrier (`cta`).
// No MMA, no output: what is left is the memory system and the ring's synchronisation. Prints
// microseconds a launch (median of 9, L2 flushed before each) and TB/s of weights, with the
// resident clusters (cudaOccupancyMaxActiveClusters) of every clustered configuration.
// What it showed (H100, session 28, docs/benchmarks.md): w + x costs what w alone does at m = 95
// (the L2 serves every CTA's copy of x at 5.4 TB/s), so x's bytes do not bound the decode GEMMs;
// w alone streams at the copy rate plus ~11 us a launch (qkv 27.6, gate_up 77.2, down leaves
// 45.3 us: the small-m kernels' own times); clusters alone cost little (66 clusters of 2 and 30 of
// 4 resident), the multicast ring 2-4x (its cross-CTA releases), at m = 1 as at 95.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "kernels/cuda/mma_ptx.cuh"

namespace {

#define CHECK(call)                                                                  \
  do {                                                                               \
    cudaError_t e_ = (call);                                                         \
    if (e_ != cudaSuccess) {                                                         \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call,              \
                   cudaGetErrorString(e_));                                          \
      std::exit(1);                                                                  \
    }                                                                                \
  } while (0)

// The kernels' own barrier and cluster instructions (kernels/cuda/mma_ptx.cuh), so that the ring
// synchronises as theirs does; what they do not need is here.
using rollout::cuda::ptx::ClusterCtaRank;
using rollout::cuda::ptx::ClusterSync;
using rollout::cuda::ptx::FenceMbarrierInit;
using rollout::cuda::ptx::MbarrierArrive;
using rollout::cuda::ptx::MbarrierArriveCluster;
using rollout::cuda::ptx::MbarrierArriveExpectTx;
using rollout::cuda::ptx::MbarrierInit;
using rollout::cuda::ptx::SharedAddress;

// Waits as MbarrierWait does, with cluster-scope acquire: the multicast ring's empty barriers
// take other CTAs' releases.
__device__ __forceinline__ void Wait(uint64_t* b, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred p;\nW_%=:\n"
      "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%0], %1;\n"
      "@!p bra W_%=;\n}\n" ::"r"(SharedAddress(b)),
      "r"(parity)
      : "memory");
}
// A plain bulk copy of `bytes` (a multiple of 16) into this CTA's shared memory, or into every
// cluster CTA of `mask` at the same offset, counted on the barrier at `b`'s offset.
__device__ __forceinline__ void BulkLoad(void* dst, const void* src, uint32_t bytes, uint64_t* b) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::
          "r"(SharedAddress(dst)),
      "l"(src), "r"(bytes), "r"(SharedAddress(b))
      : "memory");
}
__device__ __forceinline__ void BulkLoadMulticast(void* dst, const void* src, uint32_t bytes,
                                                  uint64_t* b, uint16_t mask) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1], %2, [%3], %4;\n" ::"r"(SharedAddress(dst)),
      "l"(src), "r"(bytes), "r"(SharedAddress(b)), "h"(mask)
      : "memory");
}
__device__ __forceinline__ uint32_t ClusterCtas() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_nctarank;\n" : "=r"(r));
  return r;
}

constexpr int kConsumerWarps = 8;

struct Args {
  const char* w;   // [grid][k_tiles][w_bytes]
  const char* x;   // [k_tiles][x_bytes]
  uint32_t w_bytes, x_bytes;
  int k_tiles, stages;
  int multicast;   // 0: every CTA loads its own x; 1: slices multicast over the cluster
  int release_cta; // multicast: one arrival per CTA (after a named barrier) instead of per warp
  int clustered;   // launched with a cluster dimension above 1
  unsigned long long* sink;
};

__global__ void __launch_bounds__(32 * kConsumerWarps + 32, 1) Stream(Args a) {
  extern __shared__ unsigned char raw[];
  unsigned char* const smem =
      reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(raw) + 127) & ~uintptr_t{127});
  const uint32_t stage_bytes = a.w_bytes + a.x_bytes;
  uint64_t* const full = reinterpret_cast<uint64_t*>(smem + static_cast<size_t>(stage_bytes) * a.stages);
  uint64_t* const empty = full + a.stages;
  const uint32_t ranks = a.clustered ? ClusterCtas() : 1, rank = a.clustered ? ClusterCtaRank() : 0;
  const bool mc = a.multicast && ranks > 1;
  const uint32_t releases = mc ? (a.release_cta ? ranks : ranks * kConsumerWarps) : kConsumerWarps;
  if (threadIdx.x == 0) {
    for (int s = 0; s < a.stages; ++s) {
      MbarrierInit(&full[s], 1);
      MbarrierInit(&empty[s], releases);
    }
    FenceMbarrierInit();
  }
  if (a.clustered) {
    ClusterSync();
  } else {
    __syncthreads();
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (warp == kConsumerWarps) {
    if (lane == 0) {
      const char* w = a.w + static_cast<size_t>(blockIdx.x) * a.k_tiles * a.w_bytes;
      const uint32_t slice = mc ? a.x_bytes / ranks : a.x_bytes;
      for (int kt = 0; kt < a.k_tiles; ++kt) {
        const int s = kt % a.stages;
        if (kt >= a.stages) Wait(&empty[s], ((kt / a.stages) - 1) & 1);
        MbarrierArriveExpectTx(&full[s], stage_bytes);
        unsigned char* const st = smem + static_cast<size_t>(s) * stage_bytes;
        BulkLoad(st, w + static_cast<size_t>(kt) * a.w_bytes, a.w_bytes, &full[s]);
        if (a.x_bytes == 0) continue;
        const char* x = a.x + static_cast<size_t>(kt) * a.x_bytes;
        if (mc) {
          BulkLoadMulticast(st + a.w_bytes + rank * slice, x + rank * slice, slice, &full[s],
                            static_cast<uint16_t>((1u << ranks) - 1));
        } else {
          BulkLoad(st + a.w_bytes, x, a.x_bytes, &full[s]);
        }
      }
    }
  } else {
    unsigned long long acc = 0;
    for (int kt = 0; kt < a.k_tiles; ++kt) {
      const int s = kt % a.stages;
      Wait(&full[s], (kt / a.stages) & 1);
      const unsigned char* st = smem + static_cast<size_t>(s) * stage_bytes;
      acc += st[(warp * 32 + lane) % stage_bytes];  // one read, so the stage is "used"
      if (!mc) {
        __syncwarp();
        if (lane == 0) MbarrierArrive(&empty[s]);
      } else if (!a.release_cta) {
        __syncwarp();
        if (lane < ranks) MbarrierArriveCluster(&empty[s], lane);
      } else {
        asm volatile("bar.sync 1, %0;\n" ::"n"(32 * kConsumerWarps) : "memory");
        if (threadIdx.x < ranks) MbarrierArriveCluster(&empty[s], threadIdx.x);
      }
    }
    if (acc == 0xffffffffffffull) *a.sink = acc;
  }
  if (a.clustered) ClusterSync();  // no CTA leaves while others may still write to it
}

struct Config {
  std::string name;
  uint32_t x_bytes;
  int cluster, multicast, release_cta;
};

}  // namespace

int main(int argc, char** argv) {
  // Shapes: name n k rows-of-x; defaults are Qwen3-8B's qkv and gate_up at m = 95.
  struct Shape {
    const char* name;
    int n, k, block_n;
  };
  const int m = argc > 1 ? std::atoi(argv[1]) : 95;
  const std::vector<Shape> shapes = {{"qkv", 6144, 4096, 48}, {"gate_up", 24576, 4096, 192},
                                     {"down_leaf", 4096 * 8, 1536, 256}};
  int dev = 0;
  CHECK(cudaSetDevice(dev));
  cudaDeviceProp prop{};
  CHECK(cudaGetDeviceProperties(&prop, dev));
  std::printf("device %s, %d SMs, L2 %d MB, m = %d\n", prop.name, prop.multiProcessorCount,
              prop.l2CacheSize >> 20, m);
  CHECK(cudaFuncSetAttribute(Stream, cudaFuncAttributeMaxDynamicSharedMemorySize, 227 * 1024));
  CHECK(cudaFuncSetAttribute(Stream, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  const size_t flush_bytes = 256u << 20;
  char* flush = nullptr;
  CHECK(cudaMalloc(&flush, flush_bytes));
  unsigned long long* sink = nullptr;
  CHECK(cudaMalloc(&sink, sizeof(*sink)));
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  for (const Shape& sh : shapes) {
    const int k_tiles = sh.k / 64, grid = sh.n / sh.block_n;
    const uint32_t w_bytes = sh.block_n * 128, x_full = static_cast<uint32_t>(m) * 128;
    char *w = nullptr, *x = nullptr;
    CHECK(cudaMalloc(&w, static_cast<size_t>(grid) * k_tiles * w_bytes));
    CHECK(cudaMalloc(&x, static_cast<size_t>(k_tiles) * x_full));
    CHECK(cudaMemset(w, 1, static_cast<size_t>(grid) * k_tiles * w_bytes));
    CHECK(cudaMemset(x, 1, static_cast<size_t>(k_tiles) * x_full));
    const double weight_gb = double(grid) * k_tiles * w_bytes / 1e9;
    std::printf("%s: %d CTAs of %d rows, K %d, %u B of w and %u B of x a stage, %.1f MB of w\n",
                sh.name, grid, sh.block_n, sh.k, w_bytes, x_full, weight_gb * 1e3);
    std::vector<Config> configs = {{"w", 0, 1, 0, 0}, {"w+x", x_full, 1, 0, 0}};
    for (int c : {2, 4}) {
      if (grid % c != 0 || x_full % (16 * c) != 0) continue;
      configs.push_back({"w+x c" + std::to_string(c), x_full, c, 0, 0});
      configs.push_back({"mcast c" + std::to_string(c) + " warps", x_full, c, 1, 0});
      configs.push_back({"mcast c" + std::to_string(c) + " cta", x_full, c, 1, 1});
    }
    for (const Config& cf : configs) {
      const uint32_t stage_bytes = w_bytes + cf.x_bytes;
      const int stages = std::min(16, static_cast<int>((220 * 1024) / stage_bytes));
      const size_t smem = static_cast<size_t>(stage_bytes) * stages + 16 * stages + 128;
      Args a{w, x, w_bytes, cf.x_bytes, k_tiles, stages, cf.multicast, cf.release_cta,
             cf.cluster > 1, sink};
      cudaLaunchConfig_t lc{};
      lc.gridDim = dim3(grid);
      lc.blockDim = dim3(32 * kConsumerWarps + 32);
      lc.dynamicSmemBytes = smem;
      cudaLaunchAttribute attr[1];
      attr[0].id = cudaLaunchAttributeClusterDimension;
      attr[0].val.clusterDim.x = cf.cluster;
      attr[0].val.clusterDim.y = 1;
      attr[0].val.clusterDim.z = 1;
      lc.attrs = attr;
      lc.numAttrs = cf.cluster > 1 ? 1 : 0;
      int resident = -1;
      if (cf.cluster > 1) {
        cudaError_t e = cudaOccupancyMaxActiveClusters(&resident, Stream, &lc);
        if (e != cudaSuccess) {
          std::printf("  %-16s occupancy query: %s\n", cf.name.c_str(), cudaGetErrorString(e));
          cudaGetLastError();
        }
      }
      std::vector<float> times;
      for (int it = 0; it < 10; ++it) {
        CHECK(cudaMemsetAsync(flush, it, flush_bytes));
        CHECK(cudaEventRecord(e0));
        CHECK(cudaLaunchKernelEx(&lc, Stream, a));
        CHECK(cudaEventRecord(e1));
        CHECK(cudaEventSynchronize(e1));
        float ms = 0;
        CHECK(cudaEventElapsedTime(&ms, e0, e1));
        if (it > 0) times.push_back(ms * 1e3f);
      }
      CHECK(cudaGetLastError());
      std::sort(times.begin(), times.end());
      const float us = times[times.size() / 2];
      std::printf("  %-16s %2d stages  %7.1f us  %5.2f TB/s of w  %5.2f TB/s through L2",
                  cf.name.c_str(), stages, us, weight_gb / (us * 1e-6) / 1e3,
                  (weight_gb + double(grid) * k_tiles * cf.x_bytes / 1e9 /
                                   (cf.multicast ? cf.cluster : 1)) /
                      (us * 1e-6) / 1e3);
      if (resident >= 0) std::printf("  resident clusters %d", resident);
      std::printf("\n");
    }
    CHECK(cudaFree(w));
    CHECK(cudaFree(x));
  }
  return 0;
}
