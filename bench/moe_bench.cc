// rollout-moe-bench: one MoE layer of Qwen3-30B-A3B's shape (kernels/cuda/moe.h) timed kernel by
// kernel for decode and prefill token counts, beside its floor, and the grouped expert GEMM in
// every block shape and version (kernels/cuda/moe_gemm.cu), each checked bitwise against version
// 1's decode shape first (exit status 1 when any bit differs).
//
//   rollout-moe-bench [--experts=128] [--top_k=8] [--hidden=2048] [--inter=768]
//                     [--tokens=1,8,64,256,512,2048,8192] [--repeats=20]
//                     [--tile_rows=0]
//
// The floor of a step is a lower bound: the larger of the bytes of the experts it touches (each
// read once) at the device's memory rate -- the faster of a device copy's bytes moved (read plus
// written) and a read-only compare's bytes read, per second -- and its expert FLOPs at the
// measured bf16 GEMM rate (cuBLASLt, 8192^3). (Until this version the copy's read rate alone,
// half its traffic, so the floor overcounted and rows showed under 1x.)
//
// Weights, norms and router logits are random (FillRandomWeights); routing is what the logits
// give (close to uniform). Each timing is the median of `repeats` launches (CUDA events), L2 not
// flushed (the experts of a layer are 1.2 GB, far beyond it).
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "common/command_line.h"
#include "kernels/cuda/compare.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/moe.h"
#include "kernels/cuda/ops.h"

ABSL_FLAG(int32_t, experts, 128, "experts per layer");
ABSL_FLAG(int32_t, top_k, 8, "experts per token");
ABSL_FLAG(int64_t, hidden, 2048, "hidden size");
ABSL_FLAG(int64_t, inter, 768, "moe_intermediate_size");
ABSL_FLAG(std::string, tokens, "1,8,64,256,512,2048,8192", "token counts to time");
ABSL_FLAG(int32_t, repeats, 20, "launches per timing (median)");
ABSL_FLAG(int32_t, tile_rows, 0,
          "the step's expert GEMM block shape: 32 (decode), 64 or 128 (prefill); 0: "
          "MoeTileRowsFor's choice");

namespace rollout {
namespace {

using cuda::bf16;
using cuda::DeviceBuffer;

void Check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(err));
    std::exit(1);
  }
}

// Median milliseconds of `repeats` runs of `fn` on the default stream.
double MedianMs(int repeats, const std::function<void()>& fn) {
  cudaEvent_t a, b;
  Check(cudaEventCreate(&a), "event");
  Check(cudaEventCreate(&b), "event");
  fn();  // warm-up
  std::vector<float> ms(repeats);
  for (int i = 0; i < repeats; ++i) {
    Check(cudaEventRecord(a, nullptr), "record");
    fn();
    Check(cudaEventRecord(b, nullptr), "record");
    Check(cudaEventSynchronize(b), "sync");
    Check(cudaEventElapsedTime(&ms[i], a, b), "elapsed");
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(ms.begin(), ms.end());
  return ms[repeats / 2];
}

// Bytes moved per second by the device's memory: the faster of a device-to-device copy of 1 GiB
// (each byte read and written: 2 GiB moved) and CountDifferentWords over two 1 GiB buffers (read
// only: 2 GiB read).
double MemoryRate() {
  const size_t bytes = size_t{1} << 30;
  DeviceBuffer src, dst, count;
  Check(src.Allocate(bytes), "alloc");
  Check(dst.Allocate(bytes), "alloc");
  Check(count.Allocate(sizeof(unsigned long long)), "alloc");
  Check(cudaMemset(src.get(), 1, bytes), "memset");
  Check(cudaMemset(dst.get(), 2, bytes), "memset");
  const double copy_ms = MedianMs(10, [&] {
    Check(cudaMemcpyAsync(dst.get(), src.get(), bytes, cudaMemcpyDeviceToDevice, nullptr), "copy");
  });
  const double read_ms = MedianMs(10, [&] {
    Check(cuda::CountDifferentWords(src.get(), dst.get(), bytes, count.get<unsigned long long>(),
                                    nullptr),
          "compare");
  });
  return 2.0 * bytes / (std::min(copy_ms, read_ms) * 1e-3);
}

// bf16 GEMM rate of cuBLASLt's pinned algorithm at 8192^3, FLOP/s.
double GemmRate() {
  const int64_t n = 8192;
  cublasLtHandle_t lt;
  if (cublasLtCreate(&lt) != CUBLAS_STATUS_SUCCESS) return 0.0;
  std::unique_ptr<cuda::PinnedGemm> gemm;
  if (cuda::PinnedGemm::Create(lt, n, n, cuda::GemmOutput::kBf16, n, &gemm) !=
      CUBLAS_STATUS_SUCCESS) {
    cublasLtDestroy(lt);
    return 0.0;
  }
  DeviceBuffer x, w, y;
  Check(x.Allocate(n * n * 2), "alloc");
  Check(w.Allocate(n * n * 2), "alloc");
  Check(y.Allocate(n * n * 2), "alloc");
  Check(cuda::FillRandomWeights(1, 0.01, 0, n * n, x.get<bf16>(), nullptr, nullptr), "fill");
  Check(cuda::FillRandomWeights(2, 0.01, 0, n * n, w.get<bf16>(), nullptr, nullptr), "fill");
  const double ms =
      MedianMs(5, [&] { gemm->Run(x.get<bf16>(), n, w.get<bf16>(), y.get(), nullptr); });
  gemm.reset();
  cublasLtDestroy(lt);
  return 2.0 * n * n * n / (ms * 1e-3);
}

int Main() {
  const int32_t e = absl::GetFlag(FLAGS_experts), k = absl::GetFlag(FLAGS_top_k);
  const int64_t h = absl::GetFlag(FLAGS_hidden), mi = absl::GetFlag(FLAGS_inter);
  const int repeats = std::max(1, absl::GetFlag(FLAGS_repeats));
  std::vector<int64_t> counts;
  for (absl::string_view part : absl::StrSplit(absl::GetFlag(FLAGS_tokens), ',')) {
    int64_t t = 0;
    if (absl::SimpleAtoi(part, &t) && t > 0) counts.push_back(t);
  }
  if (counts.empty()) return 1;
  const int64_t max_t = *std::max_element(counts.begin(), counts.end()), max_a = max_t * k;

  cudaDeviceProp prop;
  Check(cudaGetDeviceProperties(&prop, 0), "device");
  const double memory_rate = MemoryRate(), flops = GemmRate();
  std::printf("device: %s; memory %.2f TB/s (bytes moved), bf16 GEMM %.0f TFLOP/s\n", prop.name,
              memory_rate / 1e12, flops / 1e12);
  std::printf(
      "layer: %d experts, %d per token, hidden %lld, expert width %lld (%.2f GB of experts)\n", e,
      k, static_cast<long long>(h), static_cast<long long>(mi), 3.0 * e * h * mi * 2 / 1e9);

  DeviceBuffer w_gate_up, w_down, logits, xn, x, ids, weights, grouping, gate_up, act, y,
      gate_up_reference, y_reference;
  Check(w_gate_up.Allocate(int64_t{e} * 2 * mi * h * 2), "alloc");
  Check(w_down.Allocate(int64_t{e} * h * mi * 2), "alloc");
  Check(logits.Allocate(max_t * e * 4), "alloc");
  Check(xn.Allocate(max_t * h * 2), "alloc");
  Check(x.Allocate(max_t * h * 4), "alloc");
  Check(ids.Allocate(max_a * 4), "alloc");
  Check(weights.Allocate(max_a * 4), "alloc");
  Check(grouping.Allocate(cuda::MoeGroupingInts(e, max_a) * sizeof(int32_t)), "alloc");
  Check(gate_up.Allocate(max_a * 2 * mi * 2), "alloc");
  Check(act.Allocate(max_a * mi * 2), "alloc");
  Check(y.Allocate(max_a * h * 4), "alloc");
  Check(gate_up_reference.Allocate(max_a * 2 * mi * 2), "alloc");
  Check(y_reference.Allocate(max_a * h * 4), "alloc");
  Check(cuda::FillRandomWeights(3, 0.02, 0, int64_t{e} * 2 * mi * h, w_gate_up.get<bf16>(), nullptr,
                                nullptr),
        "fill");
  Check(cuda::FillRandomWeights(4, 0.03, 0, int64_t{e} * h * mi, w_down.get<bf16>(), nullptr,
                                nullptr),
        "fill");
  Check(cuda::FillRandomWeights(5, 1.0, 0, max_t * h, xn.get<bf16>(), nullptr, nullptr), "fill");
  Check(cuda::FillRandomWeights(6, 0.5, 0, max_t * e, nullptr, logits.get<float>(), nullptr),
        "fill");
  Check(cudaMemset(x.get(), 0, max_t * h * 4), "memset");
  int32_t* g = grouping.get<int32_t>();

  // The expert GEMM's block shapes, version 1's decode shape first: the reference of the others'
  // bits.
  struct GemmShape {
    const char* name;
    int32_t tile_rows, tile_columns;
    bool version1;
  };
  const GemmShape shapes[] = {
      {"v1 32x64", cuda::kMoeTileRows, 0, true},
      {"v1 64x128", cuda::kMoeTileRowsLarge, 0, true},
      {"v2 32x64", cuda::kMoeTileRows, 0, false},
      {"v2 64x128", cuda::kMoeTileRowsLarge, 0, false},
      {"v2 128x128", cuda::kMoeTileRowsXLarge, 0, false},
      {"v3 128x256", cuda::kMoeTileRowsXLarge, cuda::kMoeTileColumnsWide, false}};
  int differing_runs = 0;
  for (int64_t t : counts) {
    const int64_t a = t * k;
    const cuda::MoeGrouping gr = cuda::MoeGroupingIn(g, e, a);
    const int32_t step_tile_rows = absl::GetFlag(FLAGS_tile_rows) > 0
                                       ? absl::GetFlag(FLAGS_tile_rows)
                                       : cuda::MoeTileRowsFor(a, e, h, mi);
    const int32_t step_columns = cuda::MoeTileColumnsFor(step_tile_rows, h, mi);
    // The runner's operands (kernels/cuda/moe.h); the shapes timed below override the tiles.
    cuda::MoeLayerParams mp;
    mp.xn = xn.get<bf16>();
    mp.num_tokens = t;
    mp.hidden = h;
    mp.inter = mi;
    mp.num_experts = e;
    mp.top_k = k;
    mp.w_gate_up = w_gate_up.get<bf16>();
    mp.w_down = w_down.get<bf16>();
    mp.grouping = gr;
    mp.gate_up = gate_up.get<bf16>();
    mp.act = act.get<bf16>();
    mp.y = y.get<float>();
    const cuda::MoeGemmParams up = cuda::MoeGateUpGemm(mp, step_tile_rows);
    const cuda::MoeGemmParams down = cuda::MoeDownGemm(mp, step_tile_rows);
    auto route = [&] {
      Check(cuda::MoeRoute(logits.get<float>(), t, e, k, true, nullptr, nullptr, ids.get<int32_t>(),
                           weights.get<float>(), nullptr),
            "route");
    };
    auto group = [&](int32_t tile_rows) {
      Check(cuda::MoeGroup(ids.get<int32_t>(), t, e, k, tile_rows, gr, nullptr), "group");
    };
    auto gemm = [&](const cuda::MoeGemmParams& p, bool version1, int32_t tile_rows,
                    int32_t tile_columns, const char* what) {
      cuda::MoeGemmParams q = p;
      q.tile_rows = tile_rows;
      q.tile_columns = tile_columns;
      Check(version1 ? cuda::MoeExpertGemmV1(q, nullptr) : cuda::MoeExpertGemm(q, nullptr), what);
    };
    auto silu = [&] {
      Check(cuda::SiluMul(gate_up.get<bf16>(), a, mi, act.get<bf16>(), nullptr), "silu");
    };
    auto combine = [&] {
      Check(cuda::MoeCombine(y.get<float>(), gr.slots, weights.get<float>(), t, k, h,
                             x.get<float>(), nullptr),
            "combine");
    };
    route();
    group(step_tile_rows);
    Check(cudaDeviceSynchronize(), "routing");
    std::vector<int32_t> counts_host(e);
    Check(cudaMemcpy(counts_host.data(), g, e * 4, cudaMemcpyDeviceToHost), "counts");
    const int64_t touched =
        std::count_if(counts_host.begin(), counts_host.end(), [](int32_t c) { return c > 0; });
    const double bytes = 3.0 * touched * h * mi * 2;
    const double expert_flops = 2.0 * 3.0 * a * h * mi;
    const double floor_ms =
        std::max(bytes / memory_rate, flops > 0 ? expert_flops / flops : 0.0) * 1e3;

    // The step in the block shape it runs in (version 2).
    const double ms[6] = {
        MedianMs(repeats, route),
        MedianMs(repeats, [&] { group(step_tile_rows); }),
        MedianMs(repeats, [&] { gemm(up, false, step_tile_rows, step_columns, "gate_up"); }),
        MedianMs(repeats, silu),
        MedianMs(repeats, [&] { gemm(down, false, step_tile_rows, step_columns, "down"); }),
        MedianMs(repeats, combine)};
    const double total = MedianMs(repeats, [&] {
      route();
      group(step_tile_rows);
      gemm(up, false, step_tile_rows, step_columns, "gate_up");
      silu();
      gemm(down, false, step_tile_rows, step_columns, "down");
      combine();
    });
    std::printf("\n%7s %8s %5s | %8s %8s %8s %8s %8s %8s | %9s %9s | %7s\n", "tokens", "experts",
                "tile", "route", "group", "gate_up", "silu", "down", "combine", "total ms",
                "floor ms", "x floor");
    std::printf("%7lld %8lld %5d | %8.3f %8.3f %8.3f %8.3f %8.3f %8.3f | %9.3f %9.3f | %7.2f\n",
                static_cast<long long>(t), static_cast<long long>(touched), step_tile_rows, ms[0],
                ms[1], ms[2], ms[3], ms[4], ms[5], total, floor_ms, total / floor_ms);

    // Every block shape's expert GEMMs on this routing: gate/up on xn, down on the reference's
    // act, each output against version 1's decode shape bit for bit.
    const int64_t gate_up_bytes = a * 2 * mi * 2, y_bytes = a * h * 4;
    for (const GemmShape& shape : shapes) {
      const int64_t columns = shape.tile_columns != 0                 ? shape.tile_columns
                              : shape.tile_rows == cuda::kMoeTileRows ? 64
                                                                      : 128;
      if (h % columns != 0 || (2 * mi) % columns != 0) continue;
      group(shape.tile_rows);
      const bool reference = &shape == &shapes[0];
      cuda::MoeGemmParams up_shape = up, down_shape = down;
      up_shape.y = reference ? gate_up_reference.get() : gate_up.get();
      down_shape.y = reference ? y_reference.get() : y.get();
      Check(cudaMemset(up_shape.y, 0xff, gate_up_bytes), "memset");
      Check(cudaMemset(down_shape.y, 0xff, y_bytes), "memset");
      gemm(up_shape, shape.version1, shape.tile_rows, shape.tile_columns, "gate_up");
      if (reference) {
        // act from the reference gate/up: the down GEMM's input for every shape.
        Check(cuda::SiluMul(gate_up_reference.get<bf16>(), a, mi, act.get<bf16>(), nullptr),
              "silu");
      }
      gemm(down_shape, shape.version1, shape.tile_rows, shape.tile_columns, "down");
      unsigned long long up_differing = 0, down_differing = 0;
      if (!reference) {
        Check(cuda::CountDifferentWordsOnHost(gate_up_reference.get(), up_shape.y, gate_up_bytes,
                                              &up_differing),
              "compare");
        Check(cuda::CountDifferentWordsOnHost(y_reference.get(), down_shape.y, y_bytes,
                                              &down_differing),
              "compare");
      }
      auto run_up = [&] {
        gemm(up_shape, shape.version1, shape.tile_rows, shape.tile_columns, "gate_up");
      };
      auto run_down = [&] {
        gemm(down_shape, shape.version1, shape.tile_rows, shape.tile_columns, "down");
      };
      const double up_ms = MedianMs(repeats, run_up), down_ms = MedianMs(repeats, run_down);
      const double both_s = (up_ms + down_ms) * 1e-3;
      const bool same = up_differing == 0 && down_differing == 0;
      if (!same) ++differing_runs;
      std::printf(
          "%7s %-10s gate_up %7.3f ms  down %7.3f ms  | %5.2f TB/s of touched weights, %4.0f "
          "TFLOP/s | %s\n",
          "", shape.name, up_ms, down_ms, bytes / both_s / 1e12, expert_flops / both_s / 1e12,
          reference ? "reference"
          : same    ? "bits equal"
                    : "BITS DIFFER");
      if (!same) {
        std::printf("%7s %-10s %llu gate_up and %llu down words differ from %s\n", "", "",
                    up_differing, down_differing, shapes[0].name);
      }
    }
  }
  if (differing_runs > 0) {
    std::printf("\n%d block shape runs differ from version 1 in some bit\n", differing_runs);
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace rollout

int main(int argc, char** argv) {
  rollout::ParseCommandLine(argc, argv,
                            "one MoE layer's kernels timed beside their floor.\nUsage: "
                            "rollout-moe-bench [--experts=128 --top_k=8 --hidden=2048 "
                            "--inter=768] [--tokens=1,8,64,256,512,2048,8192] [--repeats=20]",
                            "moe_bench.cc");
  return rollout::Main();
}
