#include "server/server.h"

#include <fcntl.h>
#include <netdb.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/regular_file.h"
#include "glog/logging.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"
#include "model/random_model.h"
#include "model/rope.h"
#include "model/safetensors.h"
#include "model/weight_digest.h"
#include "runner/backend.h"
#include "server/weights_staging.h"

namespace rollout {
namespace {

constexpr char kDefaultPreset[] = "small";
constexpr uint64_t kDefaultSeed = 0;

std::string CacheRoot() {
  if (const char* dir = std::getenv("ROLLOUT_CACHE_DIR"); dir != nullptr && *dir != '\0') {
    return dir;
  }
  if (const char* dir = std::getenv("XDG_CACHE_HOME"); dir != nullptr && *dir != '\0') {
    return absl::StrCat(dir, "/rollout");
  }
  if (const char* home = std::getenv("HOME"); home != nullptr && *home != '\0') {
    return absl::StrCat(home, "/.cache/rollout");
  }
  return "/tmp/rollout-cache";
}

// PEM files are a few KiB; a larger "certificate" is a wrong path.
constexpr uint64_t kMaxPemFileBytes = 1 << 20;

absl::StatusOr<std::string> ReadFile(const std::string& path, const char* what) {
  absl::StatusOr<std::string> text = ReadSmallFile(path, kMaxPemFileBytes, what);
  if (!text.ok()) {
    return absl::Status(text.status().code(),
                        absl::StrCat("cannot read the ", what, " file: ", text.status().message()));
  }
  return text;
}

// The PEM block a TLS file must hold, named for the message when it holds the other one.
absl::Status CheckPem(const std::string& text, const std::string& file, const char* flag,
                      bool certificate) {
  const bool has_cert = text.find("-----BEGIN CERTIFICATE-----") != std::string::npos;
  const bool has_key = text.find("PRIVATE KEY-----") != std::string::npos;
  if (certificate ? has_cert : has_key) return absl::OkStatus();
  const bool client_ca = absl::string_view(flag) == "--tls_client_ca";
  return absl::InvalidArgumentError(absl::StrCat(
      flag, " ", file, " holds no PEM ", certificate ? "certificate" : "private key",
      (certificate ? has_key : has_cert)
          ? absl::StrCat(" but a ", certificate ? "private key" : "certificate",
                         client_ca ? ": give the certificate of the CA that signs the clients'"
                                   : ": are --tls_cert and --tls_key swapped?")
          : ""));
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const ServerOptions& options) {
  if (options.tls_cert_file.empty() && options.tls_key_file.empty()) {
    if (!options.tls_client_ca_file.empty()) {
      return absl::InvalidArgumentError("a client CA needs TLS: give a certificate and key too");
    }
    return grpc::InsecureServerCredentials();
  }
  if (options.tls_cert_file.empty() || options.tls_key_file.empty()) {
    return absl::InvalidArgumentError("TLS needs both a certificate and a key file");
  }
  absl::StatusOr<std::string> cert = ReadFile(options.tls_cert_file, "TLS certificate");
  if (!cert.ok()) return cert.status();
  absl::StatusOr<std::string> key = ReadFile(options.tls_key_file, "TLS key");
  if (!key.ok()) return key.status();
  if (absl::Status s = CheckPem(*cert, options.tls_cert_file, "--tls_cert", true); !s.ok())
    return s;
  if (absl::Status s = CheckPem(*key, options.tls_key_file, "--tls_key", false); !s.ok()) return s;
  grpc::SslServerCredentialsOptions ssl;
  ssl.pem_key_cert_pairs.push_back({*key, *cert});
  if (!options.tls_client_ca_file.empty()) {
    absl::StatusOr<std::string> ca = ReadFile(options.tls_client_ca_file, "TLS client CA");
    if (!ca.ok()) return ca.status();
    if (absl::Status s = CheckPem(*ca, options.tls_client_ca_file, "--tls_client_ca", true);
        !s.ok()) {
      return s;
    }
    ssl.pem_root_certs = *ca;
    ssl.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  return grpc::SslServerCredentials(ssl);
}

// Why host:port cannot be bound, found by binding it (with SO_REUSEADDR, as gRPC does, so a
// port in TIME_WAIT is not "in use"); OK when it can be bound now. For error messages only.
absl::Status ProbeBind(const std::string& host, int port) {
  std::string name = host;
  if (name.size() >= 2 && name.front() == '[' && name.back() == ']') {
    name = name.substr(1, name.size() - 2);
  }
  addrinfo hints = {};
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const std::string service = std::to_string(port);
  if (const int e =
          ::getaddrinfo(name.empty() ? nullptr : name.c_str(), service.c_str(), &hints, &found);
      e != 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("host '%s' does not resolve (%s)", host, ::gai_strerror(e)));
  }
  absl::Status status = absl::OkStatus();
  const int fd = ::socket(found->ai_family, found->ai_socktype, found->ai_protocol);
  if (fd >= 0) {
    const int on = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &on, sizeof(on));
    if (::bind(fd, found->ai_addr, found->ai_addrlen) != 0) {
      const int e = errno;
      if (e == EADDRINUSE) {
        status = absl::UnavailableError(
            absl::StrFormat("port %d is in use (another server listens on it)", port));
      } else {
        status = absl::InvalidArgumentError(
            absl::StrFormat("cannot bind %s:%d: %s", host, port, std::strerror(e)));
      }
    }
    ::close(fd);
  }
  ::freeaddrinfo(found);
  return status;
}

// Why gRPC did not listen on `address`, as precisely as can be found out: a port in use, an
// address that cannot be bound, else the TLS credentials (with TLS) or the address's syntax.
absl::Status ListenFailure(const std::string& address, bool tls) {
  const size_t colon = address.rfind(':');
  int port = 0;
  if (colon != std::string::npos && absl::SimpleAtoi(address.substr(colon + 1), &port) &&
      port > 0) {
    absl::Status why = ProbeBind(address.substr(0, colon), port);
    if (!why.ok()) {
      return absl::Status(why.code(), absl::StrFormat("cannot listen on %s: %s; stop it or pick "
                                                      "another --port",
                                                      address, why.message()));
    }
  }
  if (tls) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "cannot listen on %s: gRPC refused the TLS certificate and key (gRPC's log above says "
        "why); check that --tls_key is the private key of --tls_cert",
        address));
  }
  return absl::InvalidArgumentError(absl::StrFormat(
      "cannot listen on %s: not a valid host:port (gRPC's log above says why)", address));
}

}  // namespace

ServerOptions WithBackendDefaults(ServerOptions options) {
  const bool cuda = options.backend == "cuda";
  auto fill = [](auto* value, auto cpu, auto gpu, bool on_gpu) {
    if (*value == 0) *value = on_gpu ? gpu : cpu;
  };
  fill(&options.kv_cache_bytes, int64_t{256} << 20, int64_t{0}, cuda);
  fill(&options.kv_block_size, 16, 32, cuda);
  fill(&options.attention_split_size, 64, 256, cuda);
  fill(&options.max_running_samples, 64, 256, cuda);
  fill(&options.max_batch_tokens, 512, 16384, cuda);
  return options;
}

absl::StatusOr<std::string> EnsureDefaultModel() {
  namespace fs = std::filesystem;
  const std::string name = absl::StrCat(kDefaultPreset, "-seed", kDefaultSeed);
  const std::string dir = absl::StrCat(CacheRoot(), "/", name);
  std::error_code ec;
  fs::create_directories(CacheRoot(), ec);
  if (ec) {
    return absl::InternalError(absl::StrCat("cannot create ", CacheRoot(), ": ", ec.message()));
  }
  // Writers hold this lock while they write, so whoever holds it knows that any temp directory
  // left is a dead writer's (killed mid-write: SIGKILL, OOM, a power cut) and removes it. Where
  // the file system has no locks, starts go on without (and without the cleanup).
  const std::string lock_path = absl::StrCat(CacheRoot(), "/.", name, ".lock");
  const int lock = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  const bool locked = lock >= 0 && ::flock(lock, LOCK_EX) == 0;
  struct CloseOnReturn {
    int fd;
    ~CloseOnReturn() {
      if (fd >= 0) ::close(fd);  // also releases the lock
    }
  } close_lock{lock};
  if (locked) {
    const std::string stale_prefix = name + ".tmp.";
    for (const fs::directory_entry& entry : fs::directory_iterator(CacheRoot(), ec)) {
      if (entry.path().filename().string().rfind(stale_prefix, 0) != 0) continue;
      LOG(INFO) << "removing " << entry.path().string() << ", left by a start killed while it "
                << "wrote the default model";
      fs::remove_all(entry.path(), ec);
    }
  }
  if (fs::exists(fs::path(dir) / "config.json", ec)) return dir;
  // Written beside and renamed into place, so concurrent starts never see half a model.
  const std::string tmp = absl::StrCat(dir, ".tmp.", getpid());
  RandomModelOptions options;
  options.preset = kDefaultPreset;
  options.seed = kDefaultSeed;
  LOG(INFO) << "writing the embedded default model (preset " << kDefaultPreset << ", seed "
            << kDefaultSeed << ") to " << dir;
  if (absl::Status s = WriteRandomModel(options, tmp); !s.ok()) {
    fs::remove_all(tmp, ec);
    return s;
  }
  fs::rename(tmp, dir, ec);
  if (ec) {
    fs::remove_all(tmp, ec);  // another process won the race; its copy is identical
    if (!fs::exists(fs::path(dir) / "config.json")) {
      return absl::InternalError(absl::StrCat("cannot move the default model into ", dir));
    }
  }
  return dir;
}

absl::StatusOr<std::unique_ptr<RolloutServer>> RolloutServer::Start(const ServerOptions& given) {
  const ServerOptions options = WithBackendDefaults(given);
  auto server = std::unique_ptr<RolloutServer>(new RolloutServer());
  // Configuration errors first, before minutes of model loading.
  if (absl::Status s = CheckWeightVersion(options.weight_version); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--weight_version: ", s.message()));
  }
  // The engine checks these too, once the model is loaded (minutes, for a large checkpoint).
  if (options.max_running_samples < 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--max_running_samples %d: give 0 (the backend's default) or a positive "
                        "count",
                        given.max_running_samples));
  }
  if (options.kv_block_size < 1 || options.attention_split_size < 1 ||
      options.attention_split_size % options.kv_block_size != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--attention_split_size %d is not a positive multiple of --kv_block_size %d (0 for either "
        "takes the backend's default: cpu 64 and 16, cuda 256 and 32)",
        options.attention_split_size, options.kv_block_size));
  }
  const bool below_split = options.max_batch_tokens < options.attention_split_size;
  if (below_split || options.max_batch_tokens < options.max_running_samples) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--max_batch_tokens %d is below %s %d: every prefill chunk ends on a split boundary, "
        "and every running sample decodes one token a step",
        options.max_batch_tokens, below_split ? "--attention_split_size" : "--max_running_samples",
        below_split ? options.attention_split_size : options.max_running_samples));
  }
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> credentials =
      MakeServerCredentials(options);
  if (!credentials.ok()) return credentials.status();
  if (options.model_dir.empty()) {
    absl::StatusOr<std::string> dir = EnsureDefaultModel();
    if (!dir.ok()) return dir.status();
    server->model_dir_ = *dir;
  } else {
    server->model_dir_ = options.model_dir;
  }
  BackendOptions backend;
  backend.backend = options.backend;
  backend.kv_cache_bytes = options.kv_cache_bytes;
  backend.kv_block_size = options.kv_block_size;
  backend.attention_split_size = options.attention_split_size;
  backend.max_batch_tokens = options.max_batch_tokens;
  backend.num_threads = options.num_threads;
  backend.tensor_parallel = options.tensor_parallel;
  backend.cuda_graphs = options.cuda_graphs;
  backend.tp_invariant = options.tp_invariant;
  backend.cuda_devices = options.cuda_devices;
  backend.collective_timeout_s = options.collective_timeout_s;
  backend.device_weight_staging = options.device_weight_staging;
  backend.batch_variant_for_testing = options.batch_variant_for_testing;
  backend.available_host_memory_for_testing = options.available_host_memory_for_testing;
  if (absl::Status s = CheckBackend(backend); !s.ok()) return s;
  absl::StatusOr<std::unique_ptr<Checkpoint>> checkpoint = Checkpoint::Open(server->model_dir_);
  if (!checkpoint.ok()) return checkpoint.status();
  uint64_t checkpoint_bytes = 0;
  for (const std::string& name : (*checkpoint)->TensorNames()) {
    checkpoint_bytes += (*checkpoint)->Find(name)->nbytes;
  }
  LOG(INFO) << absl::StrFormat("loading the model from %s: %d tensors, %.1f MiB, on the %s backend",
                               server->model_dir_, (*checkpoint)->TensorNames().size(),
                               checkpoint_bytes / 1048576.0, options.backend);
  absl::StatusOr<std::unique_ptr<ModelRunner>> runner = CreateModelRunner(**checkpoint, backend);
  if (!runner.ok()) return runner.status();
  if (options.wrap_runner_for_testing) {
    runner = options.wrap_runner_for_testing(*std::move(runner));
  }
  const ModelConfig& c = (*runner)->config();
  BackendNumerics numerics = DescribeNumerics(backend, runner->get());
  LOG(INFO) << absl::StrFormat(
      "loaded %s from %s: %d layers, hidden %d, %d/%d heads x %d, vocab %d; KV cache %d blocks "
      "x %d tokens (%s) on the %s backend, tensor parallel %d; split size %d, at most %d "
      "samples running and %d tokens per step",
      c.architecture, server->model_dir_, c.num_layers, c.hidden_size, c.num_attention_heads,
      c.num_key_value_heads, c.head_dim, c.vocab_size, (*runner)->num_kv_blocks(),
      (*runner)->kv_block_size(),
      options.kv_cache_bytes > 0 ? absl::StrFormat("%.1f MiB", options.kv_cache_bytes / 1048576.0)
                                 : std::string("sized from free GPU memory"),
      (*runner)->backend_name(), options.tensor_parallel, options.attention_split_size,
      options.max_running_samples, options.max_batch_tokens);
  // What the config decided beyond the shapes: RoPE (and for dynamic NTK, the context cap),
  // the dtype weights are served in, the EOS set.
  LOG(INFO) << absl::StrFormat(
      "%s; weights served as %s; EOS ids [%s] (config.json, then generation_config.json)",
      DescribeRope(c.rope_scaling, c.rope_theta, c.max_position_embeddings), c.torch_dtype,
      absl::StrJoin(c.eos_token_ids, ", "));
  EngineOptions engine_options;
  {
    // Binds the version to the bytes (model/weight_digest.h): hashed on every core.
    const auto start = std::chrono::steady_clock::now();
    engine_options.weight_digests = DigestCheckpoint(**checkpoint, (*runner)->weight_specs());
    const std::string digest =
        WeightsDigest((*runner)->weight_specs(), engine_options.weight_digests);
    LOG(INFO)
        << "weights " << options.weight_version << ": "
        << (digest.empty() ? "digest unknown (a served tensor is converted or derived)" : digest)
        << absl::StrFormat(
               " (hashed in %.2f s)",
               std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  engine_options.max_running_samples = options.max_running_samples;
  engine_options.max_batch_tokens = options.max_batch_tokens;
  engine_options.weight_version = options.weight_version;
  engine_options.prefix_cache = options.prefix_cache;
  engine_options.decode_lookahead = options.decode_lookahead;
  engine_options.admission = options.admission;
  engine_options.on_runner_unusable = [health = server->health_](const absl::Status&) {
    health->RunnerUnusable();
  };
  absl::StatusOr<std::unique_ptr<Engine>> engine =
      Engine::Create(*std::move(runner), engine_options);
  if (!engine.ok()) return engine.status();
  server->engine_ = *std::move(engine);
  server->metrics_ = std::make_unique<ServiceMetrics>();
  server->service_ = std::make_unique<RolloutServiceImpl>(
      server->engine_.get(),
      ServedModel{server->model_dir_, options.tensor_parallel, std::move(numerics)},
      AccessPolicy{options.auth_token, options.auth_all_rpcs}, server->metrics_.get(),
      options.max_queued_samples, options.stream_limits, options.update_limits);

  const std::string host = options.address.substr(0, options.address.rfind(':'));
  if (options.metrics_port > 0) {
    // Before the gRPC port, so that no client reaches a server about to refuse to start. A
    // metrics port that cannot be bound stops the start: monitoring that silently sees nothing
    // is worse than a server that says why it will not run.
    const std::string address = absl::StrCat(host, ":", options.metrics_port);
    Engine* engine = server->engine_.get();
    ServiceMetrics* metrics = server->metrics_.get();
    absl::StatusOr<std::unique_ptr<MetricsHttpServer>> http =
        MetricsHttpServer::Start(address, [engine, metrics] {
          const std::optional<ReleasedMemory> released = engine->memory_released();
          return metrics->Render(
              engine->counters(), engine->weight_version(), engine->paused(),
              released.has_value() ? released->kv_cache_bytes + released->weight_bytes : 0);
        });
    if (!http.ok()) {
      const absl::Status why = ProbeBind(host, options.metrics_port);
      return absl::UnavailableError(absl::StrFormat(
          "cannot serve metrics on %s (--metrics_port %d): %s; pick another --metrics_port, or "
          "--metrics_port=0 to serve without metrics",
          address, options.metrics_port, why.ok() ? http.status().message() : why.message()));
    }
    server->metrics_http_ = *std::move(http);
    LOG(INFO) << "metrics at http://" << address << "/metrics";
  }

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> interceptors;
  interceptors.push_back(std::make_unique<MetricsInterceptorFactory>(server->metrics_.get()));
  builder.experimental().SetInterceptorCreators(std::move(interceptors));
  // gRPC turns SO_REUSEPORT on by default, which lets a second server (another model, another
  // version) listen on a taken port and take half the clients; one server per port.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.AddListeningPort(options.address, *credentials, &server->port_);
  builder.RegisterService(server->service_.get());
  builder.SetMaxReceiveMessageSize(64 << 20);
  builder.SetMaxSendMessageSize(256 << 20);
  server->server_ = builder.BuildAndStart();
  if (server->server_ == nullptr || server->port_ == 0) {
    return ListenFailure(options.address, !options.tls_cert_file.empty());
  }
  server->health_->Attach(server->server_.get());
  LOG(INFO) << "rollout server listening on port " << server->port_ << " (" << options.address
            << ")";
  return server;
}

void RolloutServer::Wait() { server_->Wait(); }

void RolloutServer::Drain(std::chrono::milliseconds grace) {
  if (server_ == nullptr) return;
  server_->GetHealthCheckService()->SetServingStatus(false);
  service_->StopAdmission();
  const auto deadline = std::chrono::steady_clock::now() + grace;
  int64_t left = engine_->unfinished_samples();
  LOG(INFO) << "draining: " << left << " samples in flight, grace " << grace.count() << " ms";
  while (left > 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    left = engine_->unfinished_samples();
  }
  if (left > 0) {
    LOG(INFO) << "grace over: aborting " << left << " samples";
    engine_->AbortAll();
    // Give their reactors a moment to write the ABORT completions before calls are cut.
    const auto flush_deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (engine_->unfinished_samples() > 0 && std::chrono::steady_clock::now() < flush_deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
  Shutdown();
}

void RolloutServer::Shutdown() {
  if (server_ == nullptr) return;
  server_->GetHealthCheckService()->SetServingStatus(false);
  // In-flight streams are cancelled at the deadline; their reactors abort their samples.
  server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
}

void RolloutServer::HealthSwitch::Attach(grpc::Server* s) {
  std::lock_guard<std::mutex> lock(mu);
  server = s;
  // By the service's name too, as meshes and grpc_health_probe -service ask; SetServingStatus
  // (bool) from then on sets both.
  s->GetHealthCheckService()->SetServingStatus(v1::RolloutService::service_full_name(), !unusable);
  s->GetHealthCheckService()->SetServingStatus(!unusable);
}

void RolloutServer::HealthSwitch::Detach() {
  std::lock_guard<std::mutex> lock(mu);
  server = nullptr;
}

void RolloutServer::HealthSwitch::RunnerUnusable() {
  std::lock_guard<std::mutex> lock(mu);
  unusable = true;
  if (server != nullptr) server->GetHealthCheckService()->SetServingStatus(false);
}

RolloutServer::~RolloutServer() {
  Shutdown();
  if (server_ != nullptr) server_->Wait();
  health_->Detach();
  server_.reset();
  metrics_http_.reset();
  engine_.reset();
  service_.reset();
}

}  // namespace rollout
