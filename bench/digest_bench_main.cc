// rollout-digest-bench: the weight digest on the device (kernels/cuda/device_digest.h) beside
// the device copy rate and the host digest of the same code base (model/weight_digest.h), on a
// model's real tensor layout (default Qwen3-8B: 399 bf16 tensors, 16.4 GB).
//
//   rollout-digest-bench [--preset=qwen3-8b] [--repeats=5] [--threads=0]
//
// 1. Fills the tensors with seeded bytes on the host, each at a 256-byte boundary of one
//    buffer (as a staging buffer holds a model), and uploads them.
// 2. The host digest (DigestQueue on --threads threads, 0 = one per core) of the same bytes.
// 3. Validation before any timing: every tensor's device digest equals the host's, bitwise;
//    the leaf-kernel variants' leaf digests equal the library's. A mismatch exits 1.
// 4. Timing (CUDA events, median of --repeats): the device-to-device copy rate (bytes read +
//    written, as docs/benchmarks.md counts it) and what a copy of the model's bytes costs at it;
//    DeviceTensorDigests of all tensors in one call, its two halves, one call per tensor, the
//    leaves with the host combining the leaf digests instead, the leaf-kernel variants and a
//    read probe (the hashing path's loads without the arithmetic), and single tensors alone.
// The summary is on the lines that begin with RESULT.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "bench/digest_bench_kernels.h"
#include "common/command_line.h"
#include "common/thread_pool.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/device_digest.h"
#include "model/model_config.h"
#include "model/random_model.h"
#include "model/weight_digest.h"

ABSL_FLAG(std::string, preset, "qwen3-8b", "the model whose tensor layout is hashed (bf16)");
ABSL_FLAG(int, repeats, 5, "timed repeats of each measurement (the median is printed)");
ABSL_FLAG(int, threads, 0, "host digest threads (0: one per core)");

namespace rollout {
namespace {

using Clock = std::chrono::steady_clock;
using cuda::DeviceBuffer;
using cuda::kDigestBytes;

void Check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(err));
    std::exit(1);
  }
}

double Seconds(Clock::time_point since) {
  return std::chrono::duration<double>(Clock::now() - since).count();
}

// Median milliseconds of `run` (work it enqueues on `stream`) over `repeats` runs after one
// untimed run, each timed by its own pair of events.
double MedianMs(int repeats, cudaStream_t stream, const std::function<void()>& run) {
  cudaEvent_t begin, end;
  Check(cudaEventCreate(&begin), "event");
  Check(cudaEventCreate(&end), "event");
  run();
  std::vector<float> ms;
  for (int i = 0; i < repeats; ++i) {
    Check(cudaEventRecord(begin, stream), "record");
    run();
    Check(cudaEventRecord(end, stream), "record");
    Check(cudaEventSynchronize(end), "sync");
    float t = 0;
    Check(cudaEventElapsedTime(&t, begin, end), "elapsed");
    ms.push_back(t);
  }
  cudaEventDestroy(begin);
  cudaEventDestroy(end);
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

// Median wall milliseconds of `run` (which waits for its own work).
double MedianWallMs(int repeats, const std::function<void()>& run) {
  run();
  std::vector<double> ms;
  for (int i = 0; i < repeats; ++i) {
    const auto t0 = Clock::now();
    run();
    ms.push_back(1e3 * Seconds(t0));
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

struct Layout {
  std::vector<std::string> names;
  std::vector<uint64_t> offsets, sizes;
  uint64_t span = 0;         // bytes from the first tensor's start to the last one's end
  uint64_t model_bytes = 0;  // the tensors' bytes, without the alignment gaps
};

Layout MakeLayout(const ModelConfig& config) {
  Layout l;
  for (const TensorSpec& t : ExpectedTensors(config)) {
    uint64_t size = 2;  // bf16
    for (int64_t d : t.shape) size *= static_cast<uint64_t>(d);
    const uint64_t offset = (l.span + 255) / 256 * 256;
    l.names.push_back(t.name);
    l.offsets.push_back(offset);
    l.sizes.push_back(size);
    l.span = offset + size;
    l.model_bytes += size;
  }
  return l;
}

uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

int Run() {
  const int repeats = std::max(1, absl::GetFlag(FLAGS_repeats));
  const int threads = absl::GetFlag(FLAGS_threads) > 0
                          ? absl::GetFlag(FLAGS_threads)
                          : static_cast<int>(std::thread::hardware_concurrency());
  auto config = PresetConfig(absl::GetFlag(FLAGS_preset));
  if (!config.ok()) {
    std::fprintf(stderr, "%s\n", config.status().ToString().c_str());
    return 2;
  }
  const Layout layout = MakeLayout(*config);
  const size_t n = layout.names.size();
  const double gb = layout.model_bytes / 1e9;
  cudaDeviceProp prop;
  Check(cudaGetDeviceProperties(&prop, 0), "device");
  std::printf("%s, %d SMs; %s: %zu bf16 tensors, %.2f GB; %d host threads\n", prop.name,
              prop.multiProcessorCount, absl::GetFlag(FLAGS_preset).c_str(), n, gb, threads);

  // 1. The bytes: seeded on the host, uploaded to the same offsets.
  cpu::ThreadPool pool(threads);
  std::unique_ptr<uint8_t[]> host(new uint8_t[layout.span]);
  auto t0 = Clock::now();
  constexpr uint64_t kFillChunk = uint64_t{1} << 20;
  pool.ParallelFor(static_cast<int64_t>((layout.span + kFillChunk - 1) / kFillChunk), 1,
                   [&](int64_t begin, int64_t end) {
                     for (int64_t c = begin; c < end; ++c) {
                       const uint64_t first = c * kFillChunk;
                       const uint64_t last = std::min(layout.span, first + kFillChunk);
                       for (uint64_t i = first; i < last; i += 8) {
                         const uint64_t v = SplitMix64(i);
                         std::memcpy(host.get() + i, &v, std::min<uint64_t>(8, last - i));
                       }
                     }
                   });
  DeviceBuffer model;
  Check(model.Allocate(layout.span), "allocate the model");
  Check(cudaMemcpy(model.get(), host.get(), layout.span, cudaMemcpyHostToDevice), "upload");
  std::printf("filled and uploaded in %.1f s\n", Seconds(t0));

  // 2. The host digest of this code, on every core.
  TensorDigests host_digests;
  const double host_ms = MedianWallMs(std::min(repeats, 3), [&] {
    DigestQueue queue(threads);
    for (size_t i = 0; i < n; ++i) {
      queue.Add(layout.names[i], host.get() + layout.offsets[i], layout.sizes[i]);
    }
    host_digests = queue.Finish();
  });

  // 3. Validation: the device digests of every tensor, bitwise the host's.
  std::vector<cuda::DeviceDigestTensor> tensors;
  std::vector<cuda::DeviceLeafRange> ranges;
  std::vector<cuda::DeviceLeafList> lists;
  const size_t ws_bytes = [&] {
    for (size_t i = 0; i < n; ++i) {
      tensors.push_back({model.get<uint8_t>() + layout.offsets[i], layout.sizes[i]});
    }
    return cuda::DeviceDigestWorkspaceBytes(tensors.data(), n);
  }();
  DeviceBuffer ws, digests;
  Check(ws.Allocate(ws_bytes), "workspace");
  Check(digests.Allocate(kDigestBytes * n), "digests");
  uint64_t leaf = 0;
  for (size_t i = 0; i < n; ++i) {
    uint8_t* leaves = ws.get<uint8_t>() + kDigestBytes * leaf;
    ranges.push_back({tensors[i].data, tensors[i].size, leaves});
    lists.push_back({leaves, cuda::DigestLeafCount(tensors[i].size)});
    leaf += lists.back().num_leaves;
  }
  cuda::PinnedHostBuffer leaves_host, digests_host;
  Check(leaves_host.Allocate(ws_bytes), "pinned");
  Check(digests_host.Allocate(kDigestBytes * n), "pinned");
  cudaStream_t s;
  Check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");
  auto digest_all = [&] {
    Check(
        cuda::DeviceTensorDigests(tensors.data(), n, ws.get(), ws_bytes, digests.get<uint8_t>(), s),
        "DeviceTensorDigests");
  };
  digest_all();
  Check(cudaMemcpyAsync(digests_host.get(), digests.get(), kDigestBytes * n, cudaMemcpyDeviceToHost,
                        s),
        "download");
  Check(cudaStreamSynchronize(s), "sync");
  int mismatches = 0;
  for (size_t i = 0; i < n; ++i) {
    const std::string got(digests_host.get<char>() + kDigestBytes * i, kDigestBytes);
    if (got != host_digests.at(layout.names[i]) && ++mismatches <= 5) {
      std::printf("MISMATCH %s (%llu bytes)\n", layout.names[i].c_str(),
                  static_cast<unsigned long long>(layout.sizes[i]));
    }
  }
  // The variants against the library's leaves, over the whole span as one range.
  const uint64_t span_leaves = cuda::DigestLeafCount(layout.span);
  DeviceBuffer span_ref, span_var, sink;
  Check(span_ref.Allocate(kDigestBytes * span_leaves), "allocate");
  Check(span_var.Allocate(kDigestBytes * span_leaves), "allocate");
  Check(sink.Allocate(4 * span_leaves), "allocate");
  const cuda::DeviceLeafRange span_range{model.get(), layout.span, span_ref.get<uint8_t>()};
  Check(cuda::DeviceLeafDigests(&span_range, 1, s), "DeviceLeafDigests");
  std::vector<uint8_t> ref(kDigestBytes * span_leaves), var(ref.size());
  Check(cudaMemcpyAsync(ref.data(), span_ref.get(), ref.size(), cudaMemcpyDeviceToHost, s), "dl");
  Check(cudaStreamSynchronize(s), "sync");
  const std::vector<digest_bench::LeafVariant> variants = {
      digest_bench::LeafVariant::kThreads128, digest_bench::LeafVariant::kThreads128Regs64,
      digest_bench::LeafVariant::kThreads256};
  for (digest_bench::LeafVariant v : variants) {
    Check(cudaMemsetAsync(span_var.get(), 0, var.size(), s), "memset");
    Check(digest_bench::LeafDigestsVariant(v, model.get<uint8_t>(), layout.span,
                                           span_var.get<uint8_t>(), s),
          "variant");
    Check(cudaMemcpyAsync(var.data(), span_var.get(), var.size(), cudaMemcpyDeviceToHost, s), "dl");
    Check(cudaStreamSynchronize(s), "sync");
    if (var != ref && ++mismatches <= 5) {
      std::printf("MISMATCH variant %s\n", digest_bench::LeafVariantName(v));
    }
  }
  std::printf(
      "validation: %zu tensor digests equal the host's, %zu leaf variants equal the "
      "library's: %s\n",
      n, variants.size(), mismatches == 0 ? "ok" : "FAILED");
  if (mismatches > 0) return 1;

  // 4. Timing.
  double copy_ms = 0;
  {
    const size_t bytes = size_t{4} << 30;
    DeviceBuffer a, b;
    Check(a.Allocate(bytes), "allocate");
    Check(b.Allocate(bytes), "allocate");
    Check(cudaMemset(a.get(), 1, bytes), "memset");
    copy_ms = MedianMs(repeats, s, [&] {
      Check(cudaMemcpyAsync(b.get(), a.get(), bytes, cudaMemcpyDeviceToDevice, s), "copy");
    });
    copy_ms *= layout.model_bytes / static_cast<double>(bytes);  // scaled to the model's bytes
  }
  const double copy_tbs = 2 * layout.model_bytes / (copy_ms * 1e-3) / 1e12;
  std::printf("device copy: %.2f TB/s (read + write); a copy of the %.2f GB takes %.2f ms\n",
              copy_tbs, gb, copy_ms);
  auto line = [&](const char* what, double ms) {
    std::printf("  %-52s %9.3f ms  %8.1f GB/s  %5.2fx the copy\n", what, ms, gb / (ms * 1e-3),
                ms / copy_ms);
  };
  const double all_ms = MedianMs(repeats, s, digest_all);
  line("DeviceTensorDigests, all tensors in one call", all_ms);
  const double leaves_ms = MedianMs(repeats, s, [&] {
    Check(cuda::DeviceLeafDigests(ranges.data(), n, s), "DeviceLeafDigests");
  });
  line("  its leaves (DeviceLeafDigests)", leaves_ms);
  const double combine_ms = MedianMs(repeats, s, [&] {
    Check(cuda::DeviceCombineLeafDigests(lists.data(), n, digests.get<uint8_t>(), s), "combine");
  });
  line("  its combine (DeviceCombineLeafDigests)", combine_ms);
  const double per_tensor_ms = MedianMs(repeats, s, [&] {
    for (size_t i = 0; i < n; ++i) {
      Check(cuda::DeviceTensorDigests(&tensors[i], 1, ranges[i].leaf_digests,
                                      kDigestBytes * lists[i].num_leaves,
                                      digests.get<uint8_t>() + kDigestBytes * i, s),
            "DeviceTensorDigests");
    }
  });
  line("one DeviceTensorDigests call per tensor", per_tensor_ms);
  // The alternative to the device combine: the leaf array to the host, combined there.
  TensorDigests host_combined;
  const double host_combine_ms = MedianWallMs(repeats, [&] {
    Check(cuda::DeviceLeafDigests(ranges.data(), n, s), "DeviceLeafDigests");
    Check(cudaMemcpyAsync(leaves_host.get(), ws.get(), ws_bytes, cudaMemcpyDeviceToHost, s), "dl");
    Check(cudaStreamSynchronize(s), "sync");
    std::vector<std::string> out(n);
    const uint8_t* base = leaves_host.get<uint8_t>();
    pool.ParallelFor(static_cast<int64_t>(n), 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const uint8_t* leaves = base + (lists[i].leaf_digests - ws.get<uint8_t>());
        out[i] = Sha256(leaves, kDigestBytes * lists[i].num_leaves);
      }
    });
    for (size_t i = 0; i < n; ++i) host_combined[layout.names[i]] = out[i];
  });
  if (host_combined != host_digests) {
    std::printf("MISMATCH: the host combine of the device leaves\n");
    return 1;
  }
  line("leaves on the device, leaf array to the host, host combine", host_combine_ms);
  for (digest_bench::LeafVariant v : variants) {
    const double ms = MedianMs(repeats, s, [&] {
      Check(digest_bench::LeafDigestsVariant(v, model.get<uint8_t>(), layout.span,
                                             span_var.get<uint8_t>(), s),
            "variant");
    });
    const std::string name = std::string("leaves of the span, ") +
                             digest_bench::LeafVariantName(v) + ", " +
                             std::to_string(digest_bench::LeafVariantRegisters(v)) + " regs";
    line(name.c_str(), ms);
  }
  const double probe_ms = MedianMs(repeats, s, [&] {
    Check(digest_bench::LeafReadProbe(model.get<uint8_t>(), layout.span, sink.get<uint32_t>(), s),
          "probe");
  });
  line("read probe: the leaves' loads, no hashing", probe_ms);
  // Single tensors alone: what one call costs when there is little to spread over the GPU.
  std::printf("single tensors, one call each:\n");
  for (size_t i : {size_t{0}, size_t{1}, size_t{2}, n - 1}) {
    const double ms = MedianMs(repeats, s, [&] {
      Check(
          cuda::DeviceTensorDigests(&tensors[i], 1, ranges[i].leaf_digests,
                                    kDigestBytes * lists[i].num_leaves, digests.get<uint8_t>(), s),
          "DeviceTensorDigests");
    });
    std::printf("  %-52s %9.3f ms  (%llu bytes, %.1f GB/s)\n", layout.names[i].c_str(), ms,
                static_cast<unsigned long long>(layout.sizes[i]),
                layout.sizes[i] / 1e9 / (ms * 1e-3));
  }
  const double host_gbs = gb / (host_ms * 1e-3);
  std::printf(
      "RESULT device digest %.1f GB/s: %.2f GB in %.2f ms (leaves %.2f + combine %.2f) = %.1fx "
      "the %.2f ms copy of those bytes at %.2f TB/s read + write\n",
      gb / (all_ms * 1e-3), gb, all_ms, leaves_ms, combine_ms, all_ms / copy_ms, copy_ms, copy_tbs);
  std::printf("RESULT host digest %.1f GB/s on %d threads (%.0f ms); device / host = %.1fx\n",
              host_gbs, threads, host_ms, host_ms / all_ms);
  std::printf(
      "RESULT per-tensor calls %.2f ms for %zu tensors; host combine of device leaves "
      "%.2f ms\n",
      per_tensor_ms, n, host_combine_ms);
  cudaStreamDestroy(s);
  return 0;
}

}  // namespace
}  // namespace rollout

int main(int argc, char** argv) {
  rollout::ParseCommandLine(
      argc, argv,
      "the weight digest on the device beside the copy rate and the host digest.\n"
      "Usage: rollout-digest-bench [--preset=qwen3-8b] [--repeats=5] [--threads=0]",
      "digest_bench_main.cc");
  return rollout::Run();
}
