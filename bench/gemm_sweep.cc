// rollout-gemm-sweep: how fast the pinned (split-K-free, one algorithm for every m) cuBLASLt
// GEMMs are on the Qwen3-8B weight shapes, per pinning choice, against cuBLASLt's unconstrained
// best for each m (its heuristic's first pick with a 64 MiB workspace, split-K allowed).
// Informs CudaRunnerOptions::gemm_pin_m. `--equivalence`: instead, for every shape, every
// single-split candidate cuBLASLt offers (at any m) is run against the m = 256 pin and timed:
// which algorithms give the pin's bits, and how fast each is per m. `--small-m`: decode-sized m
// (1 .. 256) per shape: the pin, the ladder's rung, and the hand-written kernel's best
// configuration (kernels/cuda/small_m_gemm.h), with the TB/s of weights read beside the
// device's copy rate; exits 1 if any hand configuration's bits differ from the pin's.
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kernels/cuda/compare.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/event_timer.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/small_m_gemm.h"

namespace rollout {
namespace {

using cuda::GemmOutput;

struct Shape {
  const char* name;
  int64_t n, k;
  GemmOutput output;
};

constexpr int64_t kMs[] = {1, 8, 64, 256, 512, 1024, 4096, 8192};
constexpr int64_t kPins[] = {64, 256, 1024, 2048, 8192};

template <typename F>
double TimeMs(F run) {
  return cuda::MeanMilliseconds(run, /*reps=*/5, /*warmups=*/2);
}

// A raw cuBLASLt matmul of shape s at m, laid out as PinnedGemm lays it out: y[m, n] =
// x[m, k] . w[n, k]^T (+ y for accumulating outputs).
struct RawMatmul {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
  float beta = 0.0f;

  RawMatmul(const Shape& s, int64_t m) {
    cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F);
    const cublasOperation_t t = CUBLAS_OP_T, n = CUBLAS_OP_N;
    cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof(t));
    cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &n, sizeof(n));
    const cudaDataType_t out = s.output == GemmOutput::kBf16 ? CUDA_R_16BF : CUDA_R_32F;
    cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, s.k, s.n, s.k);
    cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, s.k, m, s.k);
    cublasLtMatrixLayoutCreate(&lc, out, s.n, m, s.n);
    beta = s.output == GemmOutput::kF32Accumulate ? 1.0f : 0.0f;
  }
  ~RawMatmul() {
    cublasLtMatrixLayoutDestroy(la);
    cublasLtMatrixLayoutDestroy(lb);
    cublasLtMatrixLayoutDestroy(lc);
    cublasLtMatmulDescDestroy(desc);
  }
  cublasStatus_t Run(cublasLtHandle_t lt, const cublasLtMatmulAlgo_t& algo, const void* x,
                     const void* w, void* y, void* ws, size_t ws_bytes) const {
    const float alpha = 1.0f;
    return cublasLtMatmul(lt, desc, &alpha, w, la, x, lb, &beta, y, lc, y, lc, &algo, ws, ws_bytes,
                          nullptr);
  }
};

// `count` floats of N(0, 1) (seeded) into `buffer`: a nonzero C for the accumulate epilogue (the
// bits of random bf16 weights read as floats would include NaNs, so it is filled from the host).
void FillNormal(cuda::DeviceBuffer* buffer, int64_t count) {
  buffer->Allocate(count * 4);
  std::vector<float> host(count);
  std::mt19937 rng(7);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  for (float& v : host) v = dist(rng);
  cudaMemcpy(buffer->get(), host.data(), host.size() * 4, cudaMemcpyHostToDevice);
}

// 32-bit words that differ between a and b (device, `bytes` each).
unsigned long long DifferentWords(const void* a, const void* b, int64_t bytes) {
  unsigned long long n = 0;
  cuda::CountDifferentWordsOnHost(a, b, bytes, &n);
  return n;
}

// A raw matmul of shape s at m with `algo` into `out`; an accumulating shape first gets C from
// y_init.
cublasStatus_t RunRaw(cublasLtHandle_t lt, const Shape& s, const cublasLtMatmulAlgo_t& algo,
                      int64_t m, const cuda::DeviceBuffer& x, const cuda::DeviceBuffer& w,
                      const cuda::DeviceBuffer& y_init, void* out, void* ws, size_t ws_bytes) {
  if (s.output == GemmOutput::kF32Accumulate) {
    cudaMemcpyAsync(out, y_init.get(), m * s.n * 4, cudaMemcpyDeviceToDevice);
  }
  return RawMatmul(s, m).Run(lt, algo, x.get(), w.get(), out, ws, ws_bytes);
}

// cuBLASLt's first heuristic pick for this m with a workspace: the unconstrained reference.
double BestMs(cublasLtHandle_t lt, const Shape& s, int64_t m, const void* x, const void* w, void* y,
              void* ws, size_t ws_bytes) {
  const RawMatmul mm(s, m);
  cublasLtMatmulPreference_t pref;
  cublasLtMatmulPreferenceCreate(&pref);
  const uint64_t wsb = ws_bytes;
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb,
                                       sizeof(wsb));
  cublasLtMatmulHeuristicResult_t r;
  int found = 0;
  cublasLtMatmulAlgoGetHeuristic(lt, mm.desc, mm.la, mm.lb, mm.lc, mm.lc, pref, 1, &r, &found);
  const double ms = found == 0 ? -1.0 : TimeMs([&] { mm.Run(lt, r.algo, x, w, y, ws, ws_bytes); });
  cublasLtMatmulPreferenceDestroy(pref);
  return ms;
}

// Bitwise equivalence of the single-split candidates with the m = 256 pin, and their speed.
int Equivalence(cublasLtHandle_t lt, const Shape* shapes, size_t num_shapes, cuda::DeviceBuffer& x,
                cuda::DeviceBuffer& w, cuda::DeviceBuffer& y, const char* only) {
  constexpr int64_t kCheckMs[] = {1,    3,    8,    61,   64,   200,  256, 300,
                                  1000, 1024, 2048, 3000, 4096, 5000, 8192};
  cuda::DeviceBuffer y_ref, y_init;
  const int64_t max_out = 8192ll * 151936;
  y_ref.Allocate(max_out * 4);
  FillNormal(&y_init, 8192ll * 4096);  // the accumulating shapes' C
  auto run = [&](cuda::PinnedGemm& g, int64_t m, void* out) {
    const size_t bytes = m * g.n() * (g.output() == GemmOutput::kBf16 ? 2 : 4);
    if (g.output() == GemmOutput::kF32Accumulate) {
      cudaMemcpyAsync(out, y_init.get(), bytes, cudaMemcpyDeviceToDevice);
    }
    return g.Run(x.get<cuda::bf16>(), m, w.get<cuda::bf16>(), out, nullptr);
  };
  auto time_run = [&](cuda::PinnedGemm& g, int64_t m) {
    g.Run(x.get<cuda::bf16>(), m, w.get<cuda::bf16>(), y.get(), nullptr);
  };
  // A candidate run without any workspace (cuBLASLt then schedules tiles without its counter).
  auto run_no_ws = [&](const Shape& s, const cublasLtMatmulAlgo_t& algo, int64_t m, void* out) {
    return RunRaw(lt, s, algo, m, x, w, y_init, out, nullptr, 0);
  };
  for (size_t si = 0; si < num_shapes; ++si) {
    const Shape& s = shapes[si];
    if (only != nullptr && std::strcmp(only, s.name) != 0) continue;
    std::unique_ptr<cuda::PinnedGemm> pin;
    cuda::PinnedGemm::Create(lt, s.n, s.k, s.output, 256, &pin);
    std::printf("\n%s [n %ld, k %ld]  pin: %s\n", s.name, static_cast<long>(s.n),
                static_cast<long>(s.k), pin->Describe().c_str());
    std::vector<cublasLtMatmulAlgo_t> all;
    for (int64_t m : {1, 8, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192}) {
      std::vector<cublasLtMatmulAlgo_t> algos;
      cuda::PinnedGemm::Candidates(lt, s.n, s.k, s.output, m, 32, &algos);
      for (const auto& a : algos) {
        bool seen = false;
        for (const auto& b : all) seen = seen || std::memcmp(&a, &b, sizeof(a)) == 0;
        if (!seen) all.push_back(a);
      }
    }
    std::printf("  %zu distinct candidates; us per GEMM at m =", all.size());
    for (int64_t m : kMs) std::printf(" %8ld", static_cast<long>(m));
    std::printf("\n  %-4s %-9s", "", "pin");
    std::vector<double> pin_us;
    for (int64_t m : kMs) {
      pin_us.push_back(TimeMs([&] { time_run(*pin, m); }) * 1e3);
      std::printf(" %8.1f", pin_us.back());
    }
    std::printf("\n");
    std::vector<double> best_equal(std::size(kMs), 1e30);
    for (size_t ci = 0; ci < all.size(); ++ci) {
      std::unique_ptr<cuda::PinnedGemm> g;
      std::string why;
      if (cuda::PinnedGemm::CreateWithAlgo(lt, s.n, s.k, s.output, all[ci], &g, &why) !=
          CUBLAS_STATUS_SUCCESS) {
        std::printf("  %-4zu refused: %s", ci, why.c_str());
        continue;
      }
      std::string differs;
      for (int64_t m : kCheckMs) {
        const size_t bytes = m * s.n * (s.output == GemmOutput::kBf16 ? 2 : 4);
        run(*pin, m, y_ref.get());
        if (run(*g, m, y.get()) != CUBLAS_STATUS_SUCCESS) {
          differs += " m" + std::to_string(m) + ":fail";
          continue;
        }
        const unsigned long long n_diff = DifferentWords(y_ref.get(), y.get(), bytes);
        if (n_diff != 0) differs += " m" + std::to_string(m) + ":" + std::to_string(n_diff);
      }
      std::printf("  %-4zu %-9s", ci, differs.empty() ? "EQUAL" : "differs");
      for (size_t mi = 0; mi < std::size(kMs); ++mi) {
        const double us = TimeMs([&] { time_run(*g, kMs[mi]); }) * 1e3;
        if (differs.empty()) best_equal[mi] = std::min(best_equal[mi], us);
        std::printf(" %8.1f", us);
      }
      std::printf("   %s%s\n", cuda::DescribeAlgo(all[ci]).ToString().c_str(), differs.c_str());
      // The same algorithm with no workspace at all: bits at a few m, and speed.
      std::string no_ws_differs;
      for (int64_t m : {256, 4096, 8192}) {
        const size_t bytes = m * s.n * (s.output == GemmOutput::kBf16 ? 2 : 4);
        run(*pin, m, y_ref.get());
        if (run_no_ws(s, all[ci], m, y.get()) != CUBLAS_STATUS_SUCCESS) {
          no_ws_differs += " m" + std::to_string(m) + ":fail";
          continue;
        }
        const unsigned long long n_diff = DifferentWords(y_ref.get(), y.get(), bytes);
        if (n_diff != 0) no_ws_differs += " m" + std::to_string(m) + ":" + std::to_string(n_diff);
      }
      std::printf("  %-4s %-9s", "", no_ws_differs.empty() ? "no-ws EQ" : "no-ws DIF");
      for (size_t mi = 0; mi < std::size(kMs); ++mi) {
        const double us = TimeMs([&] { run_no_ws(s, all[ci], kMs[mi], y.get()); }) * 1e3;
        std::printf(" %8.1f", us);
      }
      std::printf("  %s\n", no_ws_differs.c_str());
    }
    std::printf("  best bit-equal / pin:");
    for (size_t mi = 0; mi < std::size(kMs); ++mi) {
      std::printf(" m%ld %.2f", static_cast<long>(kMs[mi]), best_equal[mi] / pin_us[mi]);
    }
    std::printf("\n");
    std::fflush(stdout);
  }
  return 0;
}

// Split-K candidates at m = 256 (any reduction scheme, a 64 MiB workspace): their speed at
// m = 256 and 8192 against the pin's, and whether each is row-invariant -- rows of m = 1 .. 1000
// against the same rows of an m = 8192 run, bitwise.
int SplitK(cublasLtHandle_t lt, const Shape* shapes, size_t num_shapes, cuda::DeviceBuffer& x,
           cuda::DeviceBuffer& w, cuda::DeviceBuffer& y, cuda::DeviceBuffer& ws, const char* only) {
  cuda::DeviceBuffer y_ref, y_init;
  y_ref.Allocate(8192ll * 24576 * 4);
  FillNormal(&y_init, 8192ll * 24576);
  for (size_t si = 0; si < num_shapes; ++si) {
    const Shape& s = shapes[si];
    if (s.n > 24576 || (only != nullptr && std::strcmp(only, s.name) != 0)) continue;
    const size_t elem = s.output == GemmOutput::kBf16 ? 2 : 4;
    auto run = [&](const cublasLtMatmulAlgo_t& algo, int64_t m, void* out) {
      return RunRaw(lt, s, algo, m, x, w, y_init, out, ws.get(), ws.bytes());
    };
    std::unique_ptr<cuda::PinnedGemm> pin;
    cuda::PinnedGemm::Create(lt, s.n, s.k, s.output, 256, &pin);
    const double pin256 =
        TimeMs([&] { pin->Run(x.get<cuda::bf16>(), 256, w.get<cuda::bf16>(), y.get(), nullptr); });
    const double pin8192 =
        TimeMs([&] { pin->Run(x.get<cuda::bf16>(), 8192, w.get<cuda::bf16>(), y.get(), nullptr); });
    std::printf("\n%s [n %ld, k %ld]: pin %.1f us at m=256, %.1f us at m=8192\n", s.name,
                static_cast<long>(s.n), static_cast<long>(s.k), pin256 * 1e3, pin8192 * 1e3);
    const RawMatmul mm(s, 256);
    cublasLtMatmulPreference_t pref;
    cublasLtMatmulPreferenceCreate(&pref);
    const uint64_t wsb = ws.bytes();
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb,
                                         sizeof(wsb));
    cublasLtMatmulHeuristicResult_t results[32];
    int found = 0;
    cublasLtMatmulAlgoGetHeuristic(lt, mm.desc, mm.la, mm.lb, mm.lc, mm.lc, pref, 32, results,
                                   &found);
    cublasLtMatmulPreferenceDestroy(pref);
    for (int i = 0; i < found; ++i) {
      const cublasLtMatmulAlgo_t& algo = results[i].algo;
      const cuda::GemmAlgoInfo info = cuda::DescribeAlgo(algo);
      const double t256 = TimeMs([&] { run(algo, 256, y.get()); });
      const double t8192 = TimeMs([&] { run(algo, 8192, y.get()); });
      // Row invariance: m = 8192 as the reference, then smaller m against its first rows.
      std::string verdict = "row-invariant";
      if (run(algo, 8192, y_ref.get()) != CUBLAS_STATUS_SUCCESS) verdict = "fails at 8192";
      for (int64_t m : {1, 7, 64, 255, 256, 300, 1000, 4096}) {
        if (verdict != "row-invariant") break;
        if (run(algo, m, y.get()) != CUBLAS_STATUS_SUCCESS) {
          verdict = "fails at m=" + std::to_string(m);
          break;
        }
        const unsigned long long n_diff = DifferentWords(y_ref.get(), y.get(), m * s.n * elem);
        if (n_diff != 0) verdict = "DIFFERS at m=" + std::to_string(m);
      }
      std::printf(
          "  %2d  m=256 %7.1f us (%.2fx pin)  m=8192 %8.1f us (%.2fx pin)  ws %7zu  %s  %s\n", i,
          t256 * 1e3, t256 / pin256, t8192 * 1e3, t8192 / pin8192, results[i].workspaceSize,
          info.ToString().c_str(), verdict.c_str());
    }
    std::fflush(stdout);
  }
  return 0;
}

// Mean milliseconds of `run` with L2 flushed before each call (the leaves' weights fit in L2):
// each call timed alone between events.
template <typename F>
double FlushedMs(F run, cuda::DeviceBuffer& flush, int reps = 5) {
  run();  // warm-up
  cudaEvent_t begin, end;
  cudaEventCreate(&begin);
  cudaEventCreate(&end);
  double total = 0.0;
  for (int i = 0; i < reps; ++i) {
    cudaMemsetAsync(flush.get(), i, flush.bytes(), nullptr);
    cudaEventRecord(begin, nullptr);
    run();
    cudaEventRecord(end, nullptr);
    cudaEventSynchronize(end);
    float ms = 0.0f;
    cudaEventElapsedTime(&ms, begin, end);
    total += ms;
  }
  cudaEventDestroy(begin);
  cudaEventDestroy(end);
  return total / reps;
}

// Milliseconds of one `run` as a decode step's CUDA graph sees it: `reps` of (flush, run)
// captured on `stream` into one graph, less the same graph of flushes alone, so neither host
// launch costs (tensor-map encodes, cuBLASLt's dispatch) nor a warm L2 count.
template <typename F>
double GraphFlushedMs(F run, cuda::DeviceBuffer& flush, cudaStream_t stream, int reps = 8) {
  run();  // warm-up (and any one-time set-up, outside the capture)
  cudaStreamSynchronize(stream);
  int i = 0;
  auto flush_once = [&] { return cudaMemsetAsync(flush.get(), i++, flush.bytes(), stream) == 0; };
  const double with = cuda::GraphMilliseconds(
      [&] {
        const bool flushed = flush_once();
        run();
        return flushed;
      },
      reps, stream);
  const double without = cuda::GraphMilliseconds(flush_once, reps, stream);
  if (with < 0.0 || without < 0.0) {
    std::printf("GraphFlushedMs: capture failed\n");
    std::exit(1);
  }
  return (with - without) / reps;
}

// Decode-sized m: pin, ladder rung, best hand configuration (bits checked against the pin).
int SmallM(cublasLtHandle_t lt, const char* only) {
  struct SmallShape {
    const char* name;
    int64_t n, k;
    GemmOutput output;
    int batch;  // products per call (the canonical K tree's leaves: 8)
  };
  const SmallShape shapes[] = {
      {"qkv", 6144, 4096, GemmOutput::kF32, 1},
      {"o", 4096, 4096, GemmOutput::kF32Accumulate, 1},
      {"gate_up", 24576, 4096, GemmOutput::kBf16, 1},
      {"down", 4096, 12288, GemmOutput::kF32Accumulate, 1},
      {"lm_head", 151936, 4096, GemmOutput::kF32, 1},
      {"o_leaf", 4096, 512, GemmOutput::kF32, 8},
      {"down_leaf", 4096, 1536, GemmOutput::kF32, 8},
      {"moe_router", 128, 2048, GemmOutput::kF32, 1},
      {"moe_qkv", 5120, 2048, GemmOutput::kF32, 1},
  };
  constexpr int64_t kSmallMs[] = {1, 8, 16, 32, 47, 64, 95, 128, 192, 256};
  constexpr int64_t kMaxM = 256;
  cuda::DeviceBuffer flush, copy_a, copy_b;
  flush.Allocate(size_t{256} << 20);
  // The copy rate: a 1 GiB device-to-device copy reads and writes 1 GiB each.
  const size_t copy_bytes = size_t{1} << 30;
  copy_a.Allocate(copy_bytes);
  copy_b.Allocate(copy_bytes);
  const double copy_ms = FlushedMs(
      [&] { cudaMemcpyAsync(copy_b.get(), copy_a.get(), copy_bytes, cudaMemcpyDeviceToDevice); },
      flush);
  const double copy_read_tbs = copy_bytes / (copy_ms * 1e-3) / 1e12;
  std::printf(
      "device copy (1 GiB D2D): %.3f ms = %.2f TB/s read (+ as much written, %.2f TB/s "
      "in all)\n",
      copy_ms, copy_read_tbs, 2 * copy_read_tbs);
  // A blocking stream: the resets on the legacy default stream stay ordered with it.
  cudaStream_t stream = nullptr;
  cudaStreamCreate(&stream);
  const std::vector<cuda::SmallMGemmConfig>& configs = cuda::SmallMGemmConfigs();
  for (int c = 0; c < static_cast<int>(configs.size()); ++c) {
    if (cuda::PrepareSmallMGemm(c) != cudaSuccess) {
      std::printf("%s: shared memory refused\n", configs[c].Name().c_str());
      return 1;
    }
  }
  // The TMA kernel's clusters the device holds at once: with one CTA an SM, clusters of c
  // should fill ~SMs / c; far fewer would run a grid in waves.
  for (int c = 0; c < static_cast<int>(configs.size()); ++c) {
    int clusters = 0;
    const cudaError_t err = cuda::SmallMGemmResidentClusters(c, &clusters);
    if (err == cudaErrorNotSupported) continue;  // not the TMA kernel
    if (err != cudaSuccess) {
      cudaGetLastError();
      std::printf("%-28s resident clusters unknown: %s\n", configs[c].Name().c_str(),
                  cudaGetErrorString(err));
      continue;
    }
    std::printf("%-28s %3d clusters resident (%d CTAs, %zu KB of shared memory each)\n",
                configs[c].Name().c_str(), clusters, clusters * configs[c].cluster,
                configs[c].SharedBytes() / 1024);
  }
  int differing = 0;
  for (const SmallShape& s : shapes) {
    if (only != nullptr && std::strcmp(only, s.name) != 0) continue;
    const int64_t out_bytes = s.output == GemmOutput::kBf16 ? 2 : 4;
    const int64_t k_in = s.batch * s.k;
    const int64_t out_count = s.batch * kMaxM * s.n;
    cuda::DeviceBuffer x, w, y_ref, y, y_init;
    x.Allocate(kMaxM * k_in * 2);
    w.Allocate(s.batch * s.n * s.k * 2);
    y_ref.Allocate(out_count * out_bytes);
    y.Allocate(out_count * out_bytes);
    FillNormal(&y_init, out_count);
    cuda::FillRandomWeights(1, 1.0, 0, kMaxM * k_in, x.get<cuda::bf16>(), nullptr, 0);
    cuda::FillRandomWeights(2, 0.02, 0, s.batch * s.n * s.k, w.get<cuda::bf16>(), nullptr, 0);
    std::unique_ptr<cuda::PinnedGemm> pin, ladder;
    std::string why;
    if (cuda::PinnedGemm::Create(lt, s.n, s.k, s.output, 256, &pin, &why, s.batch) !=
            CUBLAS_STATUS_SUCCESS ||
        cuda::PinnedGemm::Create(lt, s.n, s.k, s.output, 256, &ladder, &why, s.batch) !=
            CUBLAS_STATUS_SUCCESS) {
      std::printf("%s: no pin:\n%s", s.name, why.c_str());
      return 1;
    }
    std::string ladder_why;
    const auto t0 = std::chrono::steady_clock::now();
    ladder->BuildLadder(&ladder_why);
    const double ladder_s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double weight_bytes = double(s.batch) * s.n * s.k * 2;
    std::printf("\n%s [n %ld, k %ld] x %d, %.1f MB of weights; ladder built in %.2f s:\n%s", s.name,
                static_cast<long>(s.n), static_cast<long>(s.k), s.batch, weight_bytes / 1e6,
                ladder_s, ladder_why.c_str());
    std::printf("  %-5s %18s %18s %18s  %-26s %18s  %-22s %s\n", "m", "pin us (TB/s)",
                "ladder us (TB/s)", "hand us (TB/s)", "best hand", "wgmma us (TB/s)", "best wgmma",
                "ladder rung");
    auto reset = [&](void* out, int64_t m) {
      const size_t bytes = s.batch * m * s.n * out_bytes;
      if (s.output == GemmOutput::kF32Accumulate) {
        cudaMemcpyAsync(out, y_init.get(), bytes, cudaMemcpyDeviceToDevice);
      } else {
        cudaMemsetAsync(out, 0, bytes);
      }
    };
    auto run_gemm = [&](cuda::PinnedGemm& g, int64_t m, void* out) {
      return g.RunBatched(x.get<cuda::bf16>(), k_in, s.k, m, w.get<cuda::bf16>(), s.n * s.k, out,
                          m * s.n, s.batch, stream);
    };
    auto run_hand = [&](int c, int64_t m, void* out) {
      return cuda::SmallMGemm(c, x.get<cuda::bf16>(), k_in, s.k, m, w.get<cuda::bf16>(), s.n * s.k,
                              s.n, s.k, out, m * s.n, s.batch, s.output, stream);
    };
    auto tbs = [&](double ms) { return weight_bytes / (ms * 1e-3) / 1e12; };
    for (int64_t m : kSmallMs) {
      reset(y_ref.get(), m);
      run_gemm(*pin, m, y_ref.get());
      const size_t bytes = s.batch * m * s.n * out_bytes;
      // The ladder's bits, then every hand configuration's.
      std::string differs;
      reset(y.get(), m);
      run_gemm(*ladder, m, y.get());
      if (DifferentWords(y_ref.get(), y.get(), bytes) != 0) differs += " LADDER DIFFERS";
      const double pin_ms = GraphFlushedMs([&] { run_gemm(*pin, m, y.get()); }, flush, stream);
      const double ladder_ms =
          GraphFlushedMs([&] { run_gemm(*ladder, m, y.get()); }, flush, stream);
      double best_ms = 0.0, best_wg_ms = 0.0;
      std::string best = "none", best_wg = "none";
      for (int c = 0; c < static_cast<int>(configs.size()); ++c) {
        if (configs[c].max_m < m) continue;
        reset(y.get(), m);
        if (run_hand(c, m, y.get()) != cudaSuccess) {
          differs += " " + configs[c].Name() + ":launch failed";
          continue;
        }
        const unsigned long long n_diff = DifferentWords(y_ref.get(), y.get(), bytes);
        if (n_diff != 0) {
          differs += " " + configs[c].Name() + ":" + std::to_string(n_diff) + " differ";
          continue;
        }
        const double ms = GraphFlushedMs([&] { run_hand(c, m, y.get()); }, flush, stream);
        if (best_ms == 0.0 || ms < best_ms) best_ms = ms, best = configs[c].Name();
        if (configs[c].warpgroups > 0 && (best_wg_ms == 0.0 || ms < best_wg_ms)) {
          best_wg_ms = ms, best_wg = configs[c].Name();
        }
      }
      if (!differs.empty()) ++differing;
      std::printf(
          "  %-5ld %9.1f (%5.2f) %9.1f (%5.2f) %9.1f (%5.2f)  %-26s %9.1f (%5.2f)  %-22s %s%s\n",
          static_cast<long>(m), pin_ms * 1e3, tbs(pin_ms), ladder_ms * 1e3, tbs(ladder_ms),
          best_ms * 1e3, best_ms > 0 ? tbs(best_ms) : 0.0, best.c_str(), best_wg_ms * 1e3,
          best_wg_ms > 0 ? tbs(best_wg_ms) : 0.0, best_wg.c_str(), ladder->DescribeFor(m).c_str(),
          differs.c_str());
      std::fflush(stdout);
    }
  }
  std::printf("\n%s\n", differing == 0 ? "every hand configuration and the ladder: the pin's bits"
                                       : "BITS DIFFER from the pin (see the rows above)");
  return differing == 0 ? 0 : 1;
}

int Main(bool equivalence, const char* only, bool splitk = false) {
  const Shape shapes[] = {
      {"qkv", 6144, 4096, GemmOutput::kF32},
      {"o", 4096, 4096, GemmOutput::kF32Accumulate},
      {"gate_up", 24576, 4096, GemmOutput::kBf16},
      {"down", 4096, 12288, GemmOutput::kF32Accumulate},
      {"lm_head", 151936, 4096, GemmOutput::kF32},
      {"o segment", 4096, 512, GemmOutput::kF32},
      {"down segment", 4096, 1536, GemmOutput::kF32},
  };
  cublasLtHandle_t lt;
  cublasLtCreate(&lt);
  cuda::DeviceBuffer x, w, y, ws;
  const size_t ws_bytes = 64 << 20;
  x.Allocate(8192ll * 12288 * 2);
  w.Allocate(151936ll * 4096 * 2);
  y.Allocate(8192ll * 151936 * 4);
  ws.Allocate(ws_bytes);
  cuda::FillRandomWeights(1, 1.0 / 37837.0, 0, 8192ll * 12288, x.get<cuda::bf16>(), nullptr, 0);
  cuda::FillRandomWeights(2, 1.0 / (37837.0 * 64), 0, 151936ll * 4096, w.get<cuda::bf16>(), nullptr,
                          0);
  cudaMemset(y.get(), 0, 8192ll * 151936 * 4);
  cudaDeviceSynchronize();
  if (splitk) {
    const int rc = SplitK(lt, shapes, std::size(shapes), x, w, y, ws, only);
    cublasLtDestroy(lt);
    return rc;
  }
  if (equivalence) {
    const int rc = Equivalence(lt, shapes, std::size(shapes), x, w, y, only);
    cublasLtDestroy(lt);
    return rc;
  }

  for (const Shape& s : shapes) {
    std::printf("\n%s [n %ld, k %ld]: microseconds per GEMM (TFLOP/s)\n", s.name,
                static_cast<long>(s.n), static_cast<long>(s.k));
    std::printf("  %-22s", "m =");
    for (int64_t m : kMs) std::printf(" %14ld", static_cast<long>(m));
    std::printf("\n  %-22s", "cuBLASLt best (any)");
    for (int64_t m : kMs) {
      const double ms = BestMs(lt, s, m, x.get(), w.get(), y.get(), ws.get(), ws_bytes);
      std::printf(" %7.1f (%4.0f)", ms * 1e3, 2.0 * m * s.n * s.k / (ms * 1e-3) / 1e12);
    }
    std::printf("\n  %-22s", "no-workspace per m");
    {
      std::unique_ptr<cuda::PinnedGemm> g;
      cuda::PinnedGemm::CreateHeuristic(lt, s.n, s.k, s.output, &g);
      for (int64_t m : kMs) {
        const double ms =
            TimeMs([&] { g->Run(x.get<cuda::bf16>(), m, w.get<cuda::bf16>(), y.get(), nullptr); });
        std::printf(" %7.1f (%4.0f)", ms * 1e3, 2.0 * m * s.n * s.k / (ms * 1e-3) / 1e12);
      }
    }
    std::printf("\n");
    for (int64_t pin : kPins) {
      std::unique_ptr<cuda::PinnedGemm> g;
      std::string why;
      if (cuda::PinnedGemm::Create(lt, s.n, s.k, s.output, pin, &g, &why) !=
          CUBLAS_STATUS_SUCCESS) {
        std::printf("  pinned at m=%-10ld none:\n%s", static_cast<long>(pin), why.c_str());
        continue;
      }
      std::printf("  pinned at m=%-10ld", static_cast<long>(pin));
      for (int64_t m : kMs) {
        const double ms =
            TimeMs([&] { g->Run(x.get<cuda::bf16>(), m, w.get<cuda::bf16>(), y.get(), nullptr); });
        std::printf(" %7.1f (%4.0f)", ms * 1e3, 2.0 * m * s.n * s.k / (ms * 1e-3) / 1e12);
      }
      std::printf("   %s\n", g->Describe().c_str());
      std::string ladder;
      if (pin == 256 && g->BuildLadder(&ladder) == CUBLAS_STATUS_SUCCESS) {
        std::printf("  ladder:\n%s", ladder.c_str());
        std::printf("  %-22s", "  + ladder (same bits)");
        for (int64_t m : kMs) {
          const double ms = TimeMs(
              [&] { g->Run(x.get<cuda::bf16>(), m, w.get<cuda::bf16>(), y.get(), nullptr); });
          std::printf(" %7.1f (%4.0f)", ms * 1e3, 2.0 * m * s.n * s.k / (ms * 1e-3) / 1e12);
        }
        std::printf("   %d rungs\n", g->rungs());
      }
    }
    std::fflush(stdout);
  }
  cublasLtDestroy(lt);
  return 0;
}

}  // namespace
}  // namespace rollout

int main(int argc, char** argv) {
  // --equivalence [shape name]: all shapes, or only that one. --splitk [shape name]: split-K
  // candidates at m = 256, their speed and row invariance.
  const bool splitk = argc > 1 && std::strcmp(argv[1], "--splitk") == 0;
  if (argc > 1 && std::strcmp(argv[1], "--small-m") == 0) {
    // --small-m [shape name]: decode-sized m, pin / ladder / hand kernel; exit 1 on other bits.
    cublasLtHandle_t lt;
    cublasLtCreate(&lt);
    const int rc = rollout::SmallM(lt, argc > 2 ? argv[2] : nullptr);
    cublasLtDestroy(lt);
    return rc;
  }
  return rollout::Main(argc > 1 && std::strcmp(argv[1], "--equivalence") == 0,
                       argc > 2 ? argv[2] : nullptr, splitk);
}
