// rollout-moe-bench: one MoE layer of Qwen3-30B-A3B's shape (kernels/cuda/moe.h) timed kernel by
// kernel for decode and prefill token counts, beside its floor: the experts the step touches
// read once at the measured device copy rate, and its expert FLOPs at the measured bf16 GEMM
// rate (cuBLASLt, 8192^3).
//
//   rollout-moe-bench [--experts=128] [--top_k=8] [--hidden=2048] [--inter=768]
//                     [--tokens=1,8,64,256,512,2048,8192] [--repeats=20]
//                     [--tile_rows=0]
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
          "expert GEMM block shape: 32 (decode) or 64 (prefill); 0: MoeTileRowsFor's choice");

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

// Bytes read per second by a device-to-device copy of 1 GiB (each byte is also written).
double CopyReadRate() {
  const size_t bytes = size_t{1} << 30;
  DeviceBuffer src, dst;
  Check(src.Allocate(bytes), "alloc");
  Check(dst.Allocate(bytes), "alloc");
  const double ms = MedianMs(10, [&] {
    Check(cudaMemcpyAsync(dst.get(), src.get(), bytes, cudaMemcpyDeviceToDevice, nullptr), "copy");
  });
  return bytes / (ms * 1e-3);
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
  const double read_rate = CopyReadRate(), flops = GemmRate();
  std::printf("device: %s; copy %.2f TB/s read (+ as much written), bf16 GEMM %.0f TFLOP/s\n",
              prop.name, read_rate / 1e12, flops / 1e12);
  std::printf(
      "layer: %d experts, %d per token, hidden %lld, expert width %lld (%.2f GB of experts)\n", e,
      k, static_cast<long long>(h), static_cast<long long>(mi), 3.0 * e * h * mi * 2 / 1e9);

  DeviceBuffer w_gate_up, w_down, logits, xn, x, ids, weights, grouping, gate_up, act, y;
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

  std::printf("\n%7s %8s %5s | %8s %8s %8s %8s %8s %8s | %9s %9s | %7s\n", "tokens", "experts",
              "tile", "route", "group", "gate_up", "silu", "down", "combine", "total ms",
              "floor ms", "x floor");
  for (int64_t t : counts) {
    const int64_t a = t * k;
    const cuda::MoeGrouping gr = cuda::MoeGroupingIn(g, e, a);
    const int32_t tile_rows = absl::GetFlag(FLAGS_tile_rows) > 0 ? absl::GetFlag(FLAGS_tile_rows)
                                                                 : cuda::MoeTileRowsFor(a, e, h);
    cuda::MoeGemmParams up;
    up.x = xn.get<bf16>();
    up.rows = gr.rows;
    up.assignments = a;
    up.w = w_gate_up.get<bf16>();
    up.expert_stride = 2 * mi * h;
    up.n = 2 * mi;
    up.k = h;
    up.expert_offsets = gr.expert_offsets;
    up.tile_offsets = gr.tile_offsets;
    up.num_experts = e;
    up.output = cuda::MoeGemmOutput::kBf16;
    up.y = gate_up.get();
    up.tile_rows = tile_rows;
    cuda::MoeGemmParams down = up;
    down.x = act.get<bf16>();
    down.rows = nullptr;
    down.w = w_down.get<bf16>();
    down.expert_stride = h * mi;
    down.n = h;
    down.k = mi;
    down.output = cuda::MoeGemmOutput::kF32;
    down.y = y.get();
    auto route = [&] {
      Check(cuda::MoeRoute(logits.get<float>(), t, e, k, true, nullptr, nullptr, ids.get<int32_t>(),
                           weights.get<float>(), nullptr),
            "route");
    };
    auto group = [&] {
      Check(cuda::MoeGroup(ids.get<int32_t>(), t, e, k, tile_rows, gr, nullptr), "group");
    };
    auto gemm_up = [&] { Check(cuda::MoeExpertGemm(up, nullptr), "gate_up"); };
    auto silu = [&] {
      for (int64_t r0 = 0; r0 < a; r0 += 65535) {
        const int64_t rn = std::min<int64_t>(65535, a - r0);
        Check(cuda::SiluMul(gate_up.get<bf16>() + r0 * 2 * mi, rn, mi, act.get<bf16>() + r0 * mi,
                            nullptr),
              "silu");
      }
    };
    auto gemm_down = [&] { Check(cuda::MoeExpertGemm(down, nullptr), "down"); };
    auto combine = [&] {
      Check(cuda::MoeCombine(y.get<float>(), gr.slots, weights.get<float>(), t, k, h,
                             x.get<float>(), nullptr),
            "combine");
    };
    route();
    group();
    Check(cudaDeviceSynchronize(), "routing");
    std::vector<int32_t> counts_host(e);
    Check(cudaMemcpy(counts_host.data(), g, e * 4, cudaMemcpyDeviceToHost), "counts");
    const int64_t touched =
        std::count_if(counts_host.begin(), counts_host.end(), [](int32_t c) { return c > 0; });
    const double ms[6] = {MedianMs(repeats, route),     MedianMs(repeats, group),
                          MedianMs(repeats, gemm_up),   MedianMs(repeats, silu),
                          MedianMs(repeats, gemm_down), MedianMs(repeats, combine)};
    const double total = MedianMs(repeats, [&] {
      route();
      group();
      gemm_up();
      silu();
      gemm_down();
      combine();
    });
    const double bytes = 3.0 * touched * h * mi * 2;
    const double expert_flops = 2.0 * 3.0 * a * h * mi;
    const double floor_ms =
        std::max(bytes / read_rate, flops > 0 ? expert_flops / flops : 0.0) * 1e3;
    std::printf("%7lld %8lld %5d | %8.3f %8.3f %8.3f %8.3f %8.3f %8.3f | %9.3f %9.3f | %7.2f\n",
                static_cast<long long>(t), static_cast<long long>(touched), tile_rows, ms[0], ms[1],
                ms[2], ms[3], ms[4], ms[5], total, floor_ms, total / floor_ms);
    std::printf("%7s %8s %5s   expert GEMMs: %.2f TB/s of touched weights, %.0f TFLOP/s\n", "", "",
                "", bytes / ((ms[2] + ms[4]) * 1e-3) / 1e12,
                expert_flops / ((ms[2] + ms[4]) * 1e-3) / 1e12);
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
