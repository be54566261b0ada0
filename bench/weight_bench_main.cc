// rollout-weight-bench: a weight update of every tensor through the streaming UpdateWeights RPC,
// end to end over loopback gRPC, with the server's time split and the copy floors of the same
// machine beside it.
//
//   rollout-weight-bench --backend=cuda --preset=qwen3-8b --model_dir=/tmp/rollout-qwen3-8b
//   rollout-weight-bench --backend=cuda --preset=qwen3-8b --model_dir=DIR --streams=8
//   rollout-weight-bench --backend=cpu --preset=tiny                    (the CI smoke)
//
// Starts a server in this process (RolloutServer, the real service on a loopback port) on the
// model in --model_dir (written there from --preset first if it has no config.json; a temporary
// directory without --model_dir), then pushes --updates updates of every served tensor through
// the C++ client (RolloutClient::UpdateWeightsFromTensors, --chunk_mb chunks) on one stream, then
// --updates more spread over --streams streams (one connection each), each with other
// synthetic bytes (bf16 values of magnitude 2^-7..2^-6, so the model stays finite). After each
// update it checks that the digest the server serves (the response's and GetServerInfo's) is the
// digest of the bytes it sent (model/weight_digest.h), and exits 1 printing no RESULT
// otherwise. The first update also allocates the server's staging (staging_setup in its line);
// each stream count's RESULT is the fastest of its updates after the first. Floors: host memcpy
// on one thread and on all, loopback TCP on one connection and on four, and on cuda the
// host-to-device copy from pinned and pageable memory.
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "bench/copy_floors.h"
#include "client/rollout_client.h"
#include "common/command_line.h"
#include "model/random_model.h"
#include "model/weight_digest.h"
#include "server/server.h"

ABSL_FLAG(std::string, backend, "cpu", "cpu or cuda");
ABSL_FLAG(std::string, preset, "tiny",
          "model shape when --model_dir has none (model/random_model.h: tiny, small, medium, "
          "qwen3-8b)");
ABSL_FLAG(std::string, model_dir, "",
          "checkpoint to serve; written from --preset when it has no config.json (kept for the "
          "next run). Empty: a temporary directory, removed at exit");
ABSL_FLAG(int32_t, updates, 3, "updates to push (>= 2: the first also allocates the staging)");
ABSL_FLAG(int32_t, chunk_mb, 4, "MiB per TensorData message");
ABSL_FLAG(int32_t, streams, 4,
          "concurrent streams (one connection each) one update is spread over; the bench also "
          "runs one stream, for comparison, unless this is 1");
ABSL_FLAG(int64_t, kv_cache_mb, 0, "the server's KV cache; 0: 64 MiB on cpu, 2048 MiB on cuda");
ABSL_FLAG(int32_t, floor_mb, 1024, "MiB copied by each floor measurement");
ABSL_FLAG(bool, tamper_for_testing, false,
          "expect the digest of other bytes than those sent: the check must fail (exit 1, no "
          "RESULT); for the bench's own test");

namespace rollout {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point since) {
  return std::chrono::duration<double>(Clock::now() - since).count();
}

// The process's CPU time (user + system) and minor page faults so far.
struct Usage {
  double cpu_seconds = 0;
  int64_t page_faults = 0;
};
Usage ProcessUsage() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  auto s = [](const timeval& t) { return t.tv_sec + t.tv_usec / 1e6; };
  return Usage{s(usage.ru_utime) + s(usage.ru_stime), usage.ru_minflt};
}

uint64_t Mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Synthetic values of `dtype` with magnitudes in [2^-7, 2^-6) and random signs and mantissas,
// from `key`; element 0 of the tensor also encodes `update`, so every update changes every
// tensor (and so its digest).
void FillTensor(DType dtype, uint64_t key, uint64_t update, uint8_t* out, size_t nbytes) {
  const size_t size = DTypeSize(dtype);
  for (size_t i = 0; i * size < nbytes; ++i) {
    const uint64_t h = Mix64(key + (i == 0 ? update : 0) + i * 0x632be59bd9b4e019ull);
    switch (dtype) {
      case DType::kBF16: {
        const uint16_t v = static_cast<uint16_t>(0x3C00 | (h & 0x807F));
        std::memcpy(out + 2 * i, &v, 2);
        break;
      }
      case DType::kF16: {
        const uint16_t v = static_cast<uint16_t>(0x2000 | (h & 0x83FF));
        std::memcpy(out + 2 * i, &v, 2);
        break;
      }
      case DType::kF32: {
        const uint32_t v = static_cast<uint32_t>(0x3C000000 | (h & 0x807FFFFF));
        std::memcpy(out + 4 * i, &v, 4);
        break;
      }
    }
  }
}

// One host copy of every served tensor: what a trainer would send.
struct SourceWeights {
  std::vector<WeightSpec> specs;
  std::vector<std::unique_ptr<uint8_t[]>> bytes;  // per spec
  uint64_t total = 0;

  // Rewrites element 0 of every tensor for update `update` (the rest is written once).
  void Fill(uint64_t update, bool first) {
    std::vector<std::thread> workers;
    const size_t threads = std::max(1u, std::thread::hardware_concurrency());
    for (size_t t = 0; t < threads; ++t) {
      workers.emplace_back([this, t, threads, update, first] {
        for (size_t i = t; i < specs.size(); i += threads) {
          const WeightSpec& spec = specs[i];
          const size_t n = first ? spec.nbytes() : std::min(spec.nbytes(), DTypeSize(spec.dtype));
          FillTensor(spec.dtype, Mix64(i), update, bytes[i].get(), n);
        }
      });
    }
    for (std::thread& w : workers) w.join();
  }

  std::vector<TensorSource> Sources() const {
    std::vector<TensorSource> sources;
    for (size_t i = 0; i < specs.size(); ++i) {
      TensorSource& s = sources.emplace_back();
      s.name = specs[i].name;
      s.dtype = DTypeName(specs[i].dtype);
      s.shape.assign(specs[i].shape.begin(), specs[i].shape.end());
      s.data = bytes[i].get();
      s.nbytes = specs[i].nbytes();
    }
    return sources;
  }

  std::string Digest() const {
    std::vector<HostTensorView> views;
    for (size_t i = 0; i < specs.size(); ++i) {
      views.emplace_back(specs[i].name, specs[i].dtype, specs[i].shape, bytes[i].get(),
                         specs[i].nbytes());
    }
    return WeightsDigest(specs, DigestTensors(views));
  }
};

struct UpdateFigures {
  double e2e = 0, cpu = 0;
  int64_t page_faults = 0;
  v1::UpdateWeightsResponse response;
};

std::string Split(const UpdateFigures& u, uint64_t bytes) {
  const v1::UpdateWeightsResponse& r = u.response;
  const double gb = bytes / 1e9;
  return absl::StrFormat(
      "receive %.3f s (%.2f GB/s; staging setup %.3f s), digest wait %.3f s, engine wait %.3f "
      "s, device copy %.3f s (%.2f GB/s), swap %.3f s; process CPU %.1f s (%.1f cores), %.2f "
      "page faults per 4 KiB sent",
      r.receive_seconds(), gb / r.receive_seconds(), r.staging_setup_seconds(),
      r.digest_wait_seconds(), r.engine_wait_seconds(), r.device_copy_seconds(),
      r.device_copy_seconds() > 0 ? gb / r.device_copy_seconds() : 0.0, r.swap_seconds(), u.cpu,
      u.cpu / u.e2e, u.page_faults / (bytes / 4096.0));
}

int Main() {
  const std::string backend = absl::GetFlag(FLAGS_backend);
  const int updates = absl::GetFlag(FLAGS_updates);
  const size_t chunk_bytes = static_cast<size_t>(absl::GetFlag(FLAGS_chunk_mb)) << 20;
  const int streams = absl::GetFlag(FLAGS_streams);
  if (updates < 2 || chunk_bytes == 0 || streams < 1 || streams > 64) {
    std::fprintf(stderr, "--updates must be >= 2, --chunk_mb >= 1 and --streams in [1, 64]\n");
    return 2;
  }
  if (backend != "cpu" && backend != "cuda") {
    // Before the floors: they take seconds, and the server would refuse it after them.
    std::fprintf(stderr, "--backend '%s': give cpu or cuda\n", backend.c_str());
    return 2;
  }

  // Floors first, before the server takes the GPU's memory.
  const size_t floor_bytes = static_cast<size_t>(absl::GetFlag(FLAGS_floor_mb)) << 20;
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const double memcpy_one = bench::HostMemcpyGBps(floor_bytes, 1);
  const double memcpy_all = bench::HostMemcpyGBps(floor_bytes, cores);
  std::string floors = absl::StrFormat("host memcpy %.2f GB/s on 1 thread, %.2f on %d; ",
                                       memcpy_one, memcpy_all, cores);
  // One connection is what one stream crosses; four, what spreading an update would give.
  for (int connections : {1, 4}) {
    absl::StatusOr<double> tcp = bench::LoopbackTcpGBps(floor_bytes * 4, connections);
    absl::StrAppend(&floors, connections == 1 ? "loopback TCP " : ", ",
                    tcp.ok() ? absl::StrFormat("%.2f GB/s on %d connection%s", *tcp, connections,
                                               connections == 1 ? "" : "s")
                             : tcp.status().ToString());
  }
  if (backend == "cuda") {
    absl::StatusOr<bench::HostToDeviceFloors> h2d =
        bench::MeasureHostToDevice(floor_bytes, /*device=*/0);
    absl::StrAppend(&floors, h2d.ok() ? absl::StrFormat("; host to device %.2f GB/s pinned, "
                                                        "%.2f GB/s pageable",
                                                        h2d->pinned_gbps, h2d->pageable_gbps)
                                      : "; host to device: " + h2d.status().ToString());
  }
  std::printf("floors: %s\n", floors.c_str());

  // The model.
  std::string dir = absl::GetFlag(FLAGS_model_dir);
  const bool temporary = dir.empty();
  if (temporary) {
    dir = (std::filesystem::temp_directory_path() / absl::StrCat("rollout-weight-bench-", getpid()))
              .string();
  }
  struct Cleanup {
    std::string dir;
    ~Cleanup() {
      if (!dir.empty()) std::filesystem::remove_all(dir);
    }
  } cleanup{temporary ? dir : ""};
  if (!std::filesystem::exists(dir + "/config.json")) {
    const auto start = Clock::now();
    RandomModelOptions model;
    model.preset = absl::GetFlag(FLAGS_preset);
    if (absl::Status s = WriteRandomModel(model, dir); !s.ok()) {
      std::fprintf(stderr, "writing the %s model to %s: %s\n", model.preset.c_str(), dir.c_str(),
                   s.ToString().c_str());
      return 2;
    }
    std::printf("wrote the %s model to %s in %.1f s\n", model.preset.c_str(), dir.c_str(),
                Seconds(start));
  }

  ServerOptions options;
  options.address = "127.0.0.1:0";
  options.model_dir = dir;
  options.backend = backend;
  const int64_t kv_mb = absl::GetFlag(FLAGS_kv_cache_mb);
  options.kv_cache_bytes = (kv_mb > 0 ? kv_mb : backend == "cuda" ? 2048 : 64) << 20;
  options.weight_version = "bench-0";
  const auto server_start = Clock::now();
  absl::StatusOr<std::unique_ptr<RolloutServer>> server = RolloutServer::Start(options);
  if (!server.ok()) {
    std::fprintf(stderr, "starting the server: %s\n", server.status().ToString().c_str());
    return 2;
  }
  std::printf("server on port %d (%s backend) started in %.1f s\n", (*server)->port(),
              backend.c_str(), Seconds(server_start));
  absl::StatusOr<std::unique_ptr<RolloutClient>> client =
      RolloutClient::Connect(absl::StrCat("127.0.0.1:", (*server)->port()), ClientOptions());
  if (!client.ok()) {
    std::fprintf(stderr, "connecting: %s\n", client.status().ToString().c_str());
    return 2;
  }

  SourceWeights source;
  source.specs = (*server)->engine()->weight_specs();
  for (const WeightSpec& spec : source.specs) {
    source.bytes.emplace_back(new uint8_t[spec.nbytes()]);
    source.total += spec.nbytes();
  }
  const double gb = source.total / 1e9;
  std::printf("pushing %d updates of %zu tensors, %.3f GB each, in %d MiB chunks\n", updates,
              source.specs.size(), gb, absl::GetFlag(FLAGS_chunk_mb));

  // One stream first (the first update of all also allocates the server's staging), then
  // --streams.
  std::vector<int> stream_counts = {1};
  if (streams != 1) stream_counts.push_back(streams);
  uint64_t update_number = 0;  // over all runs: every update has other bytes
  std::string results;
  for (int stream_count : stream_counts) {
    std::vector<UpdateFigures> figures;
    for (int u = 1; u <= updates; ++u) {
      ++update_number;
      source.Fill(update_number, /*first=*/update_number == 1);
      std::string expected = source.Digest();  // hashed here, outside the timed update
      if (absl::GetFlag(FLAGS_tamper_for_testing)) expected[expected.size() - 1] ^= 1;
      const std::vector<TensorSource> sources = source.Sources();
      const Usage before = ProcessUsage();
      const auto start = Clock::now();
      absl::StatusOr<v1::UpdateWeightsResponse> response = (*client)->UpdateWeightsFromTensors(
          absl::StrCat("bench-", stream_count, "x-", u), v1::IN_FLIGHT_POLICY_ABORT, sources,
          chunk_bytes, nullptr, stream_count);
      UpdateFigures f;
      f.e2e = Seconds(start);
      const Usage after = ProcessUsage();
      f.cpu = after.cpu_seconds - before.cpu_seconds;
      f.page_faults = after.page_faults - before.page_faults;
      if (!response.ok()) {
        std::fprintf(stderr, "update %d (%d streams) failed: %s\n", u, stream_count,
                     response.status().ToString().c_str());
        return 1;
      }
      f.response = *response;
      absl::StatusOr<v1::ServerInfo> info = (*client)->GetServerInfo();
      if (!info.ok()) {
        std::fprintf(stderr, "GetServerInfo: %s\n", info.status().ToString().c_str());
        return 1;
      }
      const uint32_t parts = std::min<uint32_t>(stream_count, source.specs.size());
      if (response->weight_digest() != expected || info->weight_digest() != expected ||
          response->bytes_received() != source.total || response->part_count() != parts) {
        std::fprintf(
            stderr,
            "update %d (%d streams): the server serves %s (GetServerInfo: %s) after %llu "
            "bytes in %u parts; the %llu bytes sent in %u give %s\n",
            u, stream_count, response->weight_digest().c_str(), info->weight_digest().c_str(),
            static_cast<unsigned long long>(response->bytes_received()), response->part_count(),
            static_cast<unsigned long long>(source.total), parts, expected.c_str());
        return 1;
      }
      std::printf("update %d, %d stream%s: %.3f s end to end, %.2f GB/s; %s\n", u, stream_count,
                  stream_count == 1 ? "" : "s", f.e2e, gb / f.e2e, Split(f, source.total).c_str());
      figures.push_back(f);
    }
    const UpdateFigures& best = *std::min_element(
        figures.begin() + 1, figures.end(),
        [](const UpdateFigures& a, const UpdateFigures& b) { return a.e2e < b.e2e; });
    absl::StrAppend(
        &results,
        absl::StrFormat(
            "\nRESULT weight update, %s backend, %s, %d stream%s: %.3f GB of %zu tensors in "
            "%.3f s end to end = %.2f GB/s (fastest of updates 2..%d; %d MiB chunks, %d "
            "connection%s, loopback)\n  split: %s\n  served digest = digest of the bytes sent: "
            "%s\n",
            backend, absl::GetFlag(FLAGS_preset), stream_count, stream_count == 1 ? "" : "s", gb,
            source.specs.size(), best.e2e, gb / best.e2e, updates, absl::GetFlag(FLAGS_chunk_mb),
            stream_count, stream_count == 1 ? "" : "s", Split(best, source.total),
            best.response.weight_digest()));
  }
  std::printf("%s  floors: %s\n", results.c_str(), floors.c_str());
  return 0;
}

}  // namespace
}  // namespace rollout

int main(int argc, char** argv) {
  rollout::ParseCommandLine(argc, argv,
                            "a weight update of every tensor through UpdateWeights over loopback, "
                            "with its time split and the copy floors: rollout-weight-bench "
                            "--backend=cuda --preset=qwen3-8b [--model_dir=DIR --updates=3]",
                            "weight_bench_main.cc");
  return rollout::Main();
}
