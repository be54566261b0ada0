// rollout-grpc-bench: the offline workload of docs/benchmarks.md over gRPC, against a running
// server.
//
//   rollout-grpc-bench --target=127.0.0.1:50051 --num_requests=256 --input_len=1024
//       --output_len=1024
//
// Every request is its own Generate call (one rollout, one sample, random prompt, ignore_eos,
// max_new_tokens = output_len), at most --concurrency in flight. Prints end-to-end seconds and
// tokens/s, time to first token and per-request latency (p50/p99), and checks that every sample
// completed with exactly output_len tokens: otherwise it says how many did not and prints no
// RESULT (exit 1). TLS and mutual TLS as rollout-cli (--tls_root_cert, --tls_client_cert,
// --tls_client_key). Compare the figure with the same
// workload through the engine in-process (rollout-bench on the same machine, same run): the
// difference is what the server, gRPC and the network cost.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "client/rollout_client.h"
#include "common/command_line.h"

ABSL_FLAG(std::string, target, "127.0.0.1:50051", "server address");
ABSL_FLAG(int32_t, num_requests, 256, "Generate calls, one rollout of one sample each");
ABSL_FLAG(int32_t, input_len, 1024, "prompt tokens per request (random ids)");
ABSL_FLAG(int32_t, output_len, 1024, "generated tokens per request (ignore_eos)");
ABSL_FLAG(int32_t, concurrency, 0,
          "calls in flight at once; 0 = all of them (keep it under the server's "
          "--max_queued_samples, or calls get RESOURCE_EXHAUSTED)");
ABSL_FLAG(float, temperature, 1.0f, "sampling temperature (0 = greedy)");
ABSL_FLAG(uint64_t, seed, 1, "seed of the prompts and of the requests");
ABSL_FLAG(std::string, auth_token_file, "",
          "file whose first line is the bearer token, if the server requires one for Generate");
ABSL_FLAG(std::string, auth_token, "", "the bearer token itself (prefer --auth_token_file)");
ABSL_FLAG(int32_t, progress_s, 10, "print progress every this many seconds (0: never)");
ABSL_FLAG(std::string, tls_root_cert, "",
          "PEM file of root certificates; when set the connection uses TLS");
ABSL_FLAG(std::string, tls_client_cert, "",
          "PEM file of this client's certificate chain (mutual TLS); needs --tls_client_key");
ABSL_FLAG(std::string, tls_client_key, "", "PEM file of the private key of --tls_client_cert");

namespace rollout {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// The p-th percentile (0..100) of `v` (sorted in place), nearest rank.
double Percentile(std::vector<double>* v, double p) {
  if (v->empty()) return 0.0;
  std::sort(v->begin(), v->end());
  const size_t rank = static_cast<size_t>(p / 100.0 * static_cast<double>(v->size() - 1) + 0.5);
  return (*v)[std::min(rank, v->size() - 1)];
}

struct RequestResult {
  double ttft_s = -1.0;     // first token, from the call's start
  double latency_s = -1.0;  // completion, from the call's start
  int64_t tokens = 0;       // in chunks
  int64_t completed_tokens = -1;
  std::string error;
};

int Main() {
  const int32_t requests = absl::GetFlag(FLAGS_num_requests);
  const int32_t in = absl::GetFlag(FLAGS_input_len);
  const int32_t out = absl::GetFlag(FLAGS_output_len);
  int32_t concurrency = absl::GetFlag(FLAGS_concurrency);
  if (requests < 1 || in < 1 || out < 1) {
    std::fprintf(stderr, "--num_requests, --input_len and --output_len must be >= 1\n");
    return 2;
  }
  if (concurrency < 0) {
    std::fprintf(stderr, "--concurrency %d: give the calls in flight, or 0 for all of them\n",
                 concurrency);
    return 2;
  }
  if (concurrency == 0 || concurrency > requests) concurrency = requests;
  const float temperature = absl::GetFlag(FLAGS_temperature);
  if (!(temperature >= 0 && std::isfinite(temperature))) {
    std::fprintf(stderr, "--temperature %g: give 0 (greedy) or more\n", temperature);
    return 2;
  }

  ClientOptions options;
  options.bearer_token = absl::GetFlag(FLAGS_auth_token);
  if (const std::string file = absl::GetFlag(FLAGS_auth_token_file); !file.empty()) {
    absl::StatusOr<std::string> token = ReadTokenFile(file);
    if (!token.ok()) {
      std::fprintf(stderr, "%s\n", token.status().ToString().c_str());
      return 1;
    }
    options.bearer_token = *std::move(token);
  }
  auto path = [](const std::string& flag) -> std::optional<std::string> {
    if (flag.empty()) return std::nullopt;
    return flag;
  };
  options.tls_root_cert_path = path(absl::GetFlag(FLAGS_tls_root_cert));
  options.tls_client_cert_path = path(absl::GetFlag(FLAGS_tls_client_cert));
  options.tls_client_key_path = path(absl::GetFlag(FLAGS_tls_client_key));
  absl::StatusOr<std::unique_ptr<RolloutClient>> client =
      RolloutClient::Connect(absl::GetFlag(FLAGS_target), options);
  if (!client.ok()) {
    std::fprintf(stderr, "connecting to %s: %s\n", absl::GetFlag(FLAGS_target).c_str(),
                 client.status().ToString().c_str());
    return 1;
  }
  absl::StatusOr<v1::ServerInfo> info = (*client)->GetServerInfo();
  if (!info.ok()) {
    std::fprintf(stderr, "GetServerInfo: %s\n", info.status().ToString().c_str());
    return 1;
  }
  const uint32_t vocab = info->model().vocab_size();
  if (vocab == 0) {
    std::fprintf(stderr, "the server reports a vocabulary of 0 tokens\n");
    return 1;
  }
  if (static_cast<uint32_t>(in + out) > info->model().max_context()) {
    std::fprintf(stderr, "input_len + output_len = %d exceeds the model's context of %u\n",
                 in + out, info->model().max_context());
    return 2;
  }
  std::printf(
      "server %s: %s, %u layers, hidden %u, vocab %u, backend %s, weights %s\n"
      "workload: %d requests x %d prompt + %d generated tokens, %d in flight, temperature %g\n",
      absl::GetFlag(FLAGS_target).c_str(), info->model().architecture().c_str(),
      info->model().num_layers(), info->model().hidden_size(), vocab, info->backend().c_str(),
      info->weight_version().c_str(), requests, in, out, concurrency, temperature);

  // Prompts drawn up front so that the clock measures the service only.
  std::mt19937_64 rng(absl::GetFlag(FLAGS_seed));
  const uint64_t run_id = std::random_device()();
  std::vector<v1::GenerateRequest> calls(requests);
  for (int32_t i = 0; i < requests; ++i) {
    v1::RolloutRequest* r = calls[i].add_rollouts();
    // Unique per run, so that two benchmarks against one server do not collide.
    r->set_request_id(absl::StrCat("bench-", run_id, "-", i));
    for (int32_t t = 0; t < in; ++t) r->add_prompt_token_ids(static_cast<uint32_t>(rng() % vocab));
    r->set_seed(absl::GetFlag(FLAGS_seed) * 1000003 + i);
    v1::SamplingParams* p = r->mutable_sampling();
    p->set_temperature(temperature);
    p->set_max_new_tokens(out);
    p->set_ignore_eos(true);
  }

  std::vector<RequestResult> results(requests);
  std::atomic<int32_t> next{0}, finished{0};
  std::atomic<int64_t> tokens{0};
  const Clock::time_point start = Clock::now();
  auto worker = [&] {
    for (int32_t i = next.fetch_add(1); i < requests; i = next.fetch_add(1)) {
      RequestResult& result = results[i];
      const Clock::time_point call_start = Clock::now();
      const absl::Status status =
          (*client)->Generate(calls[i], [&](const v1::GenerateResponse& response) {
            if (response.has_chunk()) {
              if (result.ttft_s < 0) result.ttft_s = Seconds(call_start, Clock::now());
              result.tokens += response.chunk().token_ids_size();
              tokens += response.chunk().token_ids_size();
            } else if (response.has_completion()) {
              result.completed_tokens = response.completion().token_ids_size();
              result.latency_s = Seconds(call_start, Clock::now());
            }
          });
      if (!status.ok()) result.error = status.ToString();
      ++finished;
    }
  };
  std::vector<std::thread> threads;
  for (int32_t t = 0; t < concurrency; ++t) threads.emplace_back(worker);
  const int32_t progress_s = absl::GetFlag(FLAGS_progress_s);
  Clock::time_point last_progress = start;
  while (finished.load() < requests) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    if (progress_s > 0 && Seconds(last_progress, Clock::now()) >= progress_s) {
      last_progress = Clock::now();
      std::printf("  %6.1f s: %d/%d finished, %ld tokens received\n", Seconds(start, last_progress),
                  finished.load(), requests, static_cast<long>(tokens.load()));
      std::fflush(stdout);
    }
  }
  for (std::thread& t : threads) t.join();
  const double e2e = Seconds(start, Clock::now());

  int failures = 0;
  std::vector<double> ttft, latency;
  for (int32_t i = 0; i < requests; ++i) {
    const RequestResult& r = results[i];
    std::string problem = r.error;
    if (problem.empty() && (r.completed_tokens != out || r.tokens != out)) {
      problem = absl::StrCat(r.tokens, " tokens streamed, ", r.completed_tokens,
                             " in the completion; ", out, " expected");
    }
    if (!problem.empty()) {
      if (++failures <= 5) std::fprintf(stderr, "request %d: %s\n", i, problem.c_str());
      continue;
    }
    ttft.push_back(r.ttft_s);
    latency.push_back(r.latency_s);
  }
  if (failures > 0) {
    // A figure over fewer or shorter samples than asked is no figure (docs/benchmarks.md).
    std::fprintf(stderr, "FAILED: %d of %d requests failed or did not get %d tokens; no result\n",
                 failures, requests, out);
    return 1;
  }
  const double ttft_p50 = Percentile(&ttft, 50), ttft_p99 = Percentile(&ttft, 99);
  const double lat_p50 = Percentile(&latency, 50), lat_p99 = Percentile(&latency, 99);
  std::printf(
      "\nRESULT grpc %d x %d/%d: %.2f s end to end, %.0f output tok/s, %.0f total tok/s\n"
      "  time to first token p50 %.3f s, p99 %.3f s; request latency p50 %.2f s, p99 %.2f s\n"
      "  %d of %d requests completed with %d tokens\n",
      requests, in, out, e2e, static_cast<double>(tokens.load()) / e2e,
      (static_cast<double>(tokens.load()) + static_cast<double>(requests) * in) / e2e, ttft_p50,
      ttft_p99, lat_p50, lat_p99, requests, requests, out);
  return 0;
}

}  // namespace
}  // namespace rollout

int main(int argc, char** argv) {
  rollout::ParseCommandLine(argc, argv,
                            "the offline rollout workload of docs/benchmarks.md over gRPC: "
                            "rollout-grpc-bench --target=HOST:PORT "
                            "[--num_requests=256 --input_len=1024 --output_len=1024]",
                            "grpc_bench_main.cc");
  return rollout::Main();
}
