#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/engine.h"
#include "grpcpp/server.h"
#include "server/metrics.h"
#include "server/rollout_service.h"

namespace rollout {

struct ServerOptions {
  std::string address = "127.0.0.1:50051";  // port 0 picks a free port
  std::string model_dir;                    // empty: the embedded default model
  std::string backend = "cpu";
  // Engine limits; 0 takes the backend's default (WithBackendDefaults): the CPU backend's suit
  // the small demo model, the CUDA backend's a GPU serving a real model (what the benchmark runs).
  //   kv_cache_bytes:        cpu 256 MiB; cuda 0 = 90% of the GPU memory left after weights
  //   kv_block_size:         cpu 16; cuda 32
  //   attention_split_size:  cpu 64; cuda 256
  //   max_running_samples:   cpu 64; cuda 256
  //   max_batch_tokens:      cpu 512; cuda 16384
  int64_t kv_cache_bytes = 0;
  int32_t kv_block_size = 0;
  int32_t attention_split_size = 0;
  int32_t max_running_samples = 0;
  int32_t max_batch_tokens = 0;
  int32_t num_threads = 0;  // CPU backend: 0 = all cores
  // CUDA backend: decode steps replay CUDA graphs over padded batch buckets (same bits on or off).
  bool cuda_graphs = true;
  // Tensor-parallel degree (--tp): 1, 2, 4 or 8 ranks (CPU backend: threads with an in-process
  // communicator; CUDA backend: streams of one GPU, or one GPU each with cuda_devices). Every
  // degree gives the same bits (D10, docs/determinism.md).
  int32_t tensor_parallel = 1;
  // CUDA backend: o_proj and down_proj reduce K by the canonical 8-segment tree at tp = 1 too,
  // so tp = 1 gives the bits of tp = 2, 4 and 8 (forced on at tp > 1). false at tp = 1 runs
  // them as one fused GEMM: faster, other bits (docs/cuda.md has the cost).
  bool tp_invariant = true;
  // CUDA backend (--cuda_devices): one GPU per tensor-parallel rank (its size must be
  // tensor_parallel; ranks exchange through NCCL, libnccl.so.2 loaded at run time). Empty: every
  // rank on GPU 0, as streams of that one device.
  std::vector<int> cuda_devices;
  // CUDA backend across GPUs (--collective_timeout_s): a step whose NCCL exchange is not done in
  // this many seconds (a peer GPU failed or hung) ends with UNAVAILABLE, its samples aborted, and
  // the group is aborted: every later step fails, naming the cause, until the server restarts.
  int32_t collective_timeout_s = 300;
  // CUDA backend (--device_weight_staging): reserve device memory for one update of every served
  // tensor (taken from the KV pool), where UpdateWeightsFromBroadcast receives. Without it a
  // JoinWeightSyncGroup is refused (FAILED_PRECONDITION naming the flag).
  bool device_weight_staging = false;
  std::string weight_version = "0";
  bool prefix_cache = true;
  bool decode_lookahead = true;                            // EngineOptions::decode_lookahead
  AdmissionPolicy admission = AdmissionPolicy::kEstimate;  // EngineOptions::admission
  // Access control: a bearer token for control RPCs (and for all RPCs with auth_all_rpcs).
  std::string auth_token;
  bool auth_all_rpcs = false;
  // TLS: PEM files. With tls_client_ca_file, clients must present a certificate it signed.
  std::string tls_cert_file;
  std::string tls_key_file;
  std::string tls_client_ca_file;
  // Prometheus metrics over HTTP at http://<address host>:<metrics_port>/metrics; 0 = off.
  int32_t metrics_port = 0;
  // Generate and Score answer RESOURCE_EXHAUSTED when unfinished samples (a Score sequence is
  // one) would exceed this.
  int64_t max_queued_samples = 65536;
  // Backpressure: what one Generate stream may buffer for a client that does not read.
  StreamLimits stream_limits;
  // How long the parts of a multi-part weight update may take to arrive (--update_part_timeout_s).
  UpdateLimits update_limits;
  // Negative control for the determinism suite: makes one reduction (the final RMSNorm's sum)
  // depend on the batch size, so batch invariance breaks. Never set it outside tests.
  bool batch_variant_for_testing = false;
  // CPU backend, tests only: the host memory ResumeMemory is told is available (empty: the
  // host's), to exercise its RESOURCE_EXHAUSTED.
  std::function<int64_t()> available_host_memory_for_testing;
  // Tests: wraps the runner before the engine takes it (a fake weight-sync group, for the
  // broadcast protocol through gRPC without NCCL). Never set it outside tests.
  std::function<std::unique_ptr<ModelRunner>(std::unique_ptr<ModelRunner>)> wrap_runner_for_testing;
};

// `options` with every engine limit left at 0 set to its backend's default (see ServerOptions).
// The CUDA backend's kv_cache_bytes stays 0: the runner sizes the pool from free memory.
ServerOptions WithBackendDefaults(ServerOptions options);

// The embedded default model: the "small" preset with seed 0, written once (atomically) under
// $ROLLOUT_CACHE_DIR, else $XDG_CACHE_HOME/rollout, else ~/.cache/rollout, and loaded through
// the same checkpoint loader as any Hugging Face model. Writers hold a lock file there, and the
// holder removes temp directories that a start killed mid-write left behind. Returns its
// directory.
absl::StatusOr<std::string> EnsureDefaultModel();

// A running server: engine, service and gRPC server (with grpc.health.v1). Thread-safe.
class RolloutServer {
 public:
  // Loads the model, starts the engine and listens. Errors name what failed (model path, a port
  // in use -- the gRPC port is never shared -- a metrics port that cannot be bound, TLS files).
  static absl::StatusOr<std::unique_ptr<RolloutServer>> Start(const ServerOptions& options);
  // Shuts down: stops accepting, aborts in-flight samples, waits for calls to finish.
  ~RolloutServer();

  int port() const { return port_; }
  const std::string& model_dir() const { return model_dir_; }
  Engine* engine() const { return engine_.get(); }
  // Blocks until Shutdown() is called from another thread.
  void Wait();
  // Graceful stop: health turns NOT_SERVING, new Generate/Score calls get UNAVAILABLE,
  // in-flight samples may finish for up to `grace`; what is left then ends with
  // FINISH_REASON_ABORT (its tokens so far delivered). Then Shutdown().
  void Drain(std::chrono::milliseconds grace);
  void Shutdown();

 private:
  RolloutServer() = default;

  std::string model_dir_;
  int port_ = 0;
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<ServiceMetrics> metrics_;
  std::unique_ptr<RolloutServiceImpl> service_;
  std::unique_ptr<MetricsHttpServer> metrics_http_;
  std::unique_ptr<grpc::Server> server_;
  // The health status the engine turns NOT_SERVING when the runner becomes unusable
  // (EngineOptions::on_runner_unusable, from the engine thread); shared with that callback.
  struct HealthSwitch {
    std::mutex mu;
    grpc::Server* server = nullptr;  // while attached
    bool unusable = false;
    void Attach(grpc::Server* s);
    void Detach();
    void RunnerUnusable();
  };
  std::shared_ptr<HealthSwitch> health_ = std::make_shared<HealthSwitch>();
};

}  // namespace rollout
