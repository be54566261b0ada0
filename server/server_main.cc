// rollout-server: serves rollout.v1.RolloutService over gRPC.
//   rollout-server [--model DIR] [--port N] [--address HOST] ...   (--help lists all flags)
#include <chrono>
#include <csignal>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/build_info.h"
#include "common/command_line.h"
#include "glog/logging.h"
#include "server/server.h"

ABSL_FLAG(std::string, model, "",
          "Hugging Face model directory (config.json + safetensors); empty serves the embedded "
          "default model");
ABSL_FLAG(std::string, address, "127.0.0.1", "address to listen on (0.0.0.0 for all)");
ABSL_FLAG(int32_t, port, 50051, "port to listen on; 0 picks a free one");
ABSL_FLAG(std::string, backend, "cpu",
          "compute backend: cpu, or cuda in builds with the CUDA backend (bf16 on the GPU)");
ABSL_FLAG(int64_t, kv_cache_mb, 0,
          "KV cache size in MiB (0: the backend's default: cpu 256; cuda 90% of the GPU memory "
          "left after the weights)");
ABSL_FLAG(int32_t, kv_block_size, 0, "tokens per KV cache block (0: cpu 16, cuda 32)");
ABSL_FLAG(int32_t, attention_split_size, 0,
          "attention split size in tokens; prefill chunks end at its multiples (0: cpu 64, cuda "
          "256)");
ABSL_FLAG(int32_t, max_running_samples, 0,
          "samples decoded together in one step (0: cpu 64, cuda 256)");
ABSL_FLAG(int32_t, max_batch_tokens, 0, "token budget of one engine step (0: cpu 512, cuda 16384)");
ABSL_FLAG(int32_t, threads, 0, "CPU backend worker threads; 0 = all cores");
ABSL_FLAG(bool, cuda_graphs, true,
          "cuda backend: replay decode steps as CUDA graphs (padded batch buckets; same bits)");
ABSL_FLAG(bool, tp_invariant, true,
          "cuda backend at --tp 1: reduce o_proj/down_proj by the canonical K tree, so the bits "
          "equal those of --tp 2, 4, 8 (false: one fused GEMM, faster, other bits)");
ABSL_FLAG(int32_t, tp, 1,
          "tensor-parallel degree: 1, 2, 4 or 8 ranks (cpu backend: threads; cuda backend: "
          "streams of one GPU, or one GPU each with --cuda_devices); same bits at every degree");
ABSL_FLAG(std::vector<std::string>, cuda_devices, {},
          "cuda backend: one GPU per tensor-parallel rank, e.g. 0,1 for --tp 2 (ranks exchange "
          "through NCCL: libnccl.so.2 must load); empty: every rank on GPU 0");
ABSL_FLAG(int32_t, collective_timeout_s, 300,
          "cuda backend with --cuda_devices: seconds a step may wait for its NCCL exchanges "
          "before the group is aborted (a peer GPU failed or hung): the step's samples end, and "
          "every later step fails naming the cause until the server restarts");
ABSL_FLAG(bool, device_weight_staging, false,
          "cuda backend: reserve GPU memory for one update of every served tensor (as large as "
          "the weights; taken from the KV cache), where UpdateWeightsFromBroadcast receives an "
          "NCCL broadcast before the atomic swap. Needed to JoinWeightSyncGroup");
ABSL_FLAG(std::string, weight_version, "0", "version string reported with every completion");
ABSL_FLAG(bool, prefix_cache, true, "reuse the KV of shared prefixes across requests");
ABSL_FLAG(std::string, admission, "estimate",
          "when a waiting sample starts: estimate (when the KV pool can hold what it may still "
          "need beside the running ones, a sample that may stop early -- EOS not ignored, or stop "
          "tokens -- charged an estimate of its tokens to come that adapts to preemptions, one "
          "that cannot charged all of max_new_tokens: more samples at once when they stop early, "
          "as reserve when they cannot), reserve (every sample charged its prompt plus "
          "max_new_tokens: no preemption, no recomputation) or optimistic (as soon as its prompt "
          "fits; preempts and recomputes under KV pressure)");
ABSL_FLAG(bool, decode_lookahead, true,
          "cuda backend: launch decode step N + 1 before step N's results are applied (its "
          "tokens fed on the device); false: one step at a time. Never changes a bit");
ABSL_FLAG(std::string, auth_token_file, "",
          "file holding the bearer token that control RPCs (UpdateWeights, UpdateWeightsFromPath, "
          "UpdateWeightsFromIpc, UpdateWeightsFromBroadcast, JoinWeightSyncGroup, "
          "LeaveWeightSyncGroup, Pause, Resume, ReleaseMemory, ResumeMemory, Abort, FlushCache) "
          "require");
ABSL_FLAG(std::string, auth_token, "",
          "the bearer token itself (visible in the process list; prefer --auth_token_file)");
ABSL_FLAG(bool, auth_all_rpcs, false, "require the token for Generate, Score, GetServerInfo too");
ABSL_FLAG(int32_t, metrics_port, 9400,
          "serve Prometheus metrics at http://<address>:<port>/metrics; 0 turns them off");
ABSL_FLAG(int32_t, shutdown_grace_s, 30,
          "on SIGTERM/SIGINT: seconds in-flight rollouts may take to finish before they are "
          "aborted");
ABSL_FLAG(int64_t, max_queued_samples, 65536,
          "unfinished samples (Generate samples, Score sequences) the server holds before Generate "
          "and Score answer RESOURCE_EXHAUSTED");
ABSL_FLAG(int64_t, stream_buffer_mb, 16,
          "backpressure: MiB of unread messages one Generate stream may queue before its "
          "samples pause (they resume at half)");
ABSL_FLAG(int32_t, stream_stall_timeout_s, 60,
          "a paused Generate stream whose client reads nothing for this long ends "
          "RESOURCE_EXHAUSTED after what was queued, its samples aborted");
ABSL_FLAG(double, update_part_timeout_s, 60,
          "a multi-part UpdateWeights (header.part_count > 1) fails, nothing applied, unless "
          "every part's header arrives within this many seconds of the first's");
ABSL_FLAG(std::string, tls_cert, "", "TLS certificate chain (PEM); with --tls_key enables TLS");
ABSL_FLAG(std::string, tls_key, "", "TLS private key (PEM)");
ABSL_FLAG(std::string, tls_client_ca, "",
          "CA (PEM) that client certificates must chain to: mutual TLS");

int main(int argc, char** argv) {
  rollout::ParseCommandLine(argc, argv,
                            "Serves deterministic rollouts over gRPC (rollout.v1).\n"
                            "Usage: rollout-server [--model DIR] [--port N] [flags]",
                            "server_main.cc");
  FLAGS_logtostderr = true;
  google::InitGoogleLogging(argv[0]);
  LOG(INFO) << rollout::BuildInfoLine();

  // SIGINT/SIGTERM are taken by a waiting thread, so shutdown runs outside signal context.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  // gRPC and civetweb take a port modulo 65536 (70000 listened on 4464, logged as 70000).
  auto not_a_port = [](const char* flag, int32_t port, const char* zero) {
    if (port >= 0 && port <= 65535) return false;
    std::fprintf(stderr, "rollout-server: --%s %d is not a port: give 0 to 65535 (0 %s)\n", flag,
                 port, zero);
    return true;
  };
  if (not_a_port("port", absl::GetFlag(FLAGS_port), "picks a free one") ||
      not_a_port("metrics_port", absl::GetFlag(FLAGS_metrics_port), "turns them off")) {
    return 1;
  }
  // Counts and durations outside what they can mean (a MiB count past 2^43 would overflow).
  auto out_of_range = [](const char* flag, int64_t value, int64_t low, int64_t high) {
    if (value >= low && value <= high) return false;
    std::fprintf(stderr, "rollout-server: --%s %lld is out of range: give %lld to %lld\n", flag,
                 static_cast<long long>(value), static_cast<long long>(low),
                 static_cast<long long>(high));
    return true;
  };
  if (out_of_range("threads", absl::GetFlag(FLAGS_threads), 0, 4096) ||
      out_of_range("shutdown_grace_s", absl::GetFlag(FLAGS_shutdown_grace_s), 0, 86400) ||
      out_of_range("max_queued_samples", absl::GetFlag(FLAGS_max_queued_samples), 1,
                   int64_t{1} << 32) ||
      out_of_range("stream_buffer_mb", absl::GetFlag(FLAGS_stream_buffer_mb), 1, 1 << 20) ||
      out_of_range("stream_stall_timeout_s", absl::GetFlag(FLAGS_stream_stall_timeout_s), 1,
                   86400) ||
      // 0: the backend's default (the flags' help says which).
      out_of_range("kv_cache_mb", absl::GetFlag(FLAGS_kv_cache_mb), 0, int64_t{1} << 30) ||
      out_of_range("kv_block_size", absl::GetFlag(FLAGS_kv_block_size), 0, 4096) ||
      out_of_range("attention_split_size", absl::GetFlag(FLAGS_attention_split_size), 0,
                   1 << 16) ||
      out_of_range("max_running_samples", absl::GetFlag(FLAGS_max_running_samples), 0,
                   1 << 20) ||
      out_of_range("max_batch_tokens", absl::GetFlag(FLAGS_max_batch_tokens), 0, 1 << 24)) {
    return 1;
  }
  if (const int32_t tp = absl::GetFlag(FLAGS_tp); tp != 1 && tp != 2 && tp != 4 && tp != 8) {
    std::fprintf(
        stderr, "rollout-server: --tp %d is not a tensor-parallel degree: give 1, 2, 4 or 8\n", tp);
    return 1;
  }
  rollout::ServerOptions options;
  options.model_dir = absl::GetFlag(FLAGS_model);
  options.address = absl::StrCat(absl::GetFlag(FLAGS_address), ":", absl::GetFlag(FLAGS_port));
  options.backend = absl::GetFlag(FLAGS_backend);
  options.kv_cache_bytes = absl::GetFlag(FLAGS_kv_cache_mb) << 20;
  options.kv_block_size = absl::GetFlag(FLAGS_kv_block_size);
  options.attention_split_size = absl::GetFlag(FLAGS_attention_split_size);
  options.max_running_samples = absl::GetFlag(FLAGS_max_running_samples);
  options.max_batch_tokens = absl::GetFlag(FLAGS_max_batch_tokens);
  options.num_threads = absl::GetFlag(FLAGS_threads);
  options.tensor_parallel = absl::GetFlag(FLAGS_tp);
  options.cuda_graphs = absl::GetFlag(FLAGS_cuda_graphs);
  options.tp_invariant = absl::GetFlag(FLAGS_tp_invariant);
  for (const std::string& device : absl::GetFlag(FLAGS_cuda_devices)) {
    int index = 0;
    if (!absl::SimpleAtoi(device, &index)) {
      std::fprintf(stderr, "rollout-server: --cuda_devices: '%s' is not a device index\n",
                   device.c_str());
      return 1;
    }
    options.cuda_devices.push_back(index);
  }
  options.collective_timeout_s = absl::GetFlag(FLAGS_collective_timeout_s);
  options.device_weight_staging = absl::GetFlag(FLAGS_device_weight_staging);
  options.weight_version = absl::GetFlag(FLAGS_weight_version);
  options.prefix_cache = absl::GetFlag(FLAGS_prefix_cache);
  options.decode_lookahead = absl::GetFlag(FLAGS_decode_lookahead);
  const std::string admission = absl::GetFlag(FLAGS_admission);
  if (auto policy = rollout::ParseAdmissionPolicy(admission)) {
    options.admission = *policy;
  } else {
    std::fprintf(stderr,
                 "rollout-server: --admission: '%s' is not reserve, estimate or optimistic\n",
                 admission.c_str());
    return 1;
  }
  options.auth_token = absl::GetFlag(FLAGS_auth_token);
  if (const std::string file = absl::GetFlag(FLAGS_auth_token_file); !file.empty()) {
    absl::StatusOr<std::string> token = rollout::ReadTokenFile(file);
    if (!token.ok()) {
      std::fprintf(stderr, "rollout-server: cannot read a token from %s: %s\n", file.c_str(),
                   token.status().ToString().c_str());
      return 1;
    }
    options.auth_token = *std::move(token);
  }
  options.auth_all_rpcs = absl::GetFlag(FLAGS_auth_all_rpcs);
  if (options.auth_all_rpcs && options.auth_token.empty()) {
    std::fprintf(stderr, "rollout-server: --auth_all_rpcs needs --auth_token_file\n");
    return 1;
  }
  options.tls_cert_file = absl::GetFlag(FLAGS_tls_cert);
  options.tls_key_file = absl::GetFlag(FLAGS_tls_key);
  options.tls_client_ca_file = absl::GetFlag(FLAGS_tls_client_ca);
  options.metrics_port = absl::GetFlag(FLAGS_metrics_port);
  options.max_queued_samples = absl::GetFlag(FLAGS_max_queued_samples);
  options.stream_limits.max_buffered_bytes = absl::GetFlag(FLAGS_stream_buffer_mb) << 20;
  options.stream_limits.max_paused =
      std::chrono::seconds(absl::GetFlag(FLAGS_stream_stall_timeout_s));
  const double part_timeout_s = absl::GetFlag(FLAGS_update_part_timeout_s);
  if (!(part_timeout_s > 0 && part_timeout_s <= 86400)) {
    std::fprintf(stderr, "rollout-server: --update_part_timeout_s must be in (0, 86400]\n");
    return 1;
  }
  options.update_limits.part_timeout =
      std::chrono::milliseconds(static_cast<int64_t>(part_timeout_s * 1000 + 0.5));
  absl::StatusOr<std::unique_ptr<rollout::RolloutServer>> server =
      rollout::RolloutServer::Start(options);
  if (!server.ok()) {
    std::fprintf(stderr, "rollout-server: %s\n", server.status().ToString().c_str());
    return 1;
  }
  std::thread waiter([&] {
    int signal = 0;
    sigwait(&signals, &signal);
    LOG(INFO) << "signal " << signal << ": draining, then shutting down";
    (*server)->Drain(std::chrono::seconds(absl::GetFlag(FLAGS_shutdown_grace_s)));
  });
  (*server)->Wait();
  waiter.join();
  server->reset();
  LOG(INFO) << "stopped";
  return 0;
}
