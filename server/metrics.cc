#include "server/metrics.h"

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "civetweb.h"
#include "common/build_info.h"
#include "grpcpp/server_context.h"

namespace rollout {
namespace {

const char* CodeName(int code) {
  static const char* kNames[] = {"OK",
                                 "CANCELLED",
                                 "UNKNOWN",
                                 "INVALID_ARGUMENT",
                                 "DEADLINE_EXCEEDED",
                                 "NOT_FOUND",
                                 "ALREADY_EXISTS",
                                 "PERMISSION_DENIED",
                                 "RESOURCE_EXHAUSTED",
                                 "FAILED_PRECONDITION",
                                 "ABORTED",
                                 "OUT_OF_RANGE",
                                 "UNIMPLEMENTED",
                                 "INTERNAL",
                                 "UNAVAILABLE",
                                 "DATA_LOSS",
                                 "UNAUTHENTICATED"};
  return code >= 0 && code <= 16 ? kNames[code] : "UNKNOWN";
}

void Header(std::string* out, const char* name, const char* type, const char* help) {
  absl::StrAppend(out, "# HELP ", name, " ", help, "\n# TYPE ", name, " ", type, "\n");
}

void Scalar(std::string* out, const char* name, const char* type, const char* help, double value) {
  Header(out, name, type, help);
  absl::StrAppend(out, name, " ", absl::StrFormat("%.17g", value), "\n");
}

template <typename Bounds>
void Histogram(std::string* out, const char* name, const char* help,
               const DurationHistogram<Bounds>& h) {
  using H = DurationHistogram<Bounds>;
  Header(out, name, "histogram", help);
  uint64_t cumulative = 0;
  for (int b = 0; b < H::kNumBuckets; ++b) {
    cumulative += h.counts[b];
    const std::string le =
        b < H::kNumBuckets - 1 ? absl::StrFormat("%g", H::kBounds[b]) : std::string("+Inf");
    absl::StrAppend(out, name, "_bucket{le=\"", le, "\"} ", cumulative, "\n");
  }
  absl::StrAppend(out, name, "_sum ", absl::StrFormat("%.9g", h.sum_seconds), "\n", name, "_count ",
                  h.count, "\n");
}

std::string EscapeLabel(const std::string& v) {
  std::string out;
  for (char c : v) {
    if (c == '\\' || c == '"') out.push_back('\\');
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    out.push_back(c);
  }
  return out;
}

class MetricsInterceptor : public grpc::experimental::Interceptor {
 public:
  MetricsInterceptor(ServiceMetrics* metrics, std::string method, grpc::ServerContextBase* context)
      : metrics_(metrics), method_(std::move(method)), context_(context) {}
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::PRE_SEND_STATUS)) {
      // A call its client cancelled (or whose deadline passed) counts as CANCELLED, whatever
      // the handler then sends: gRPC's health service ends a cancelled Watch UNKNOWN, which
      // would read as a server error. (IsCancelled is safe to call on sync and callback
      // services, which every service here is: reflection is sync, the rest callback. An async
      // service added later must not be counted this way.)
      const bool cancelled = context_ != nullptr && context_->IsCancelled();
      metrics_->RecordCall(
          method_, cancelled ? grpc::StatusCode::CANCELLED : methods->GetSendStatus().error_code());
    }
    methods->Proceed();
  }

 private:
  ServiceMetrics* const metrics_;
  const std::string method_;
  grpc::ServerContextBase* const context_;
};

}  // namespace

void ServiceMetrics::RecordCall(const std::string& method, grpc::StatusCode code) {
  std::lock_guard<std::mutex> lock(mu_);
  ++calls_[{method, static_cast<int>(code)}];
}

void ServiceMetrics::RecordSample(FinishReason reason) { ++samples_[static_cast<int>(reason)]; }

void ServiceMetrics::RecordUpdate(double seconds, bool ok) {
  (ok ? updates_ok_ : updates_failed_)++;
  std::lock_guard<std::mutex> lock(mu_);
  update_seconds_.Record(seconds);
}

std::string ServiceMetrics::Render(const EngineCounters& e, const std::string& weight_version,
                                   bool paused, int64_t released_bytes) const {
  std::string out;
  const BuildInfo build = GetBuildInfo();
  Header(&out, "rollout_build_info", "gauge", "The build serving (value 1).");
  absl::StrAppend(&out, "rollout_build_info{version=\"", EscapeLabel(build.version), "\",commit=\"",
                  EscapeLabel(build.commit), "\",build_type=\"", EscapeLabel(build.build_type),
                  "\"} 1\n");
  Header(&out, "rollout_rpcs_total", "counter", "Finished RPCs by method and status code.");
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [key, n] : calls_) {
      absl::StrAppend(&out, "rollout_rpcs_total{method=\"", EscapeLabel(key.first), "\",code=\"",
                      CodeName(key.second), "\"} ", n, "\n");
    }
  }
  Header(&out, "rollout_samples_total", "counter", "Completed samples by finish reason.");
  const char* reasons[] = {"stop", "length", "abort"};
  for (int r = 0; r < 3; ++r) {
    absl::StrAppend(&out, "rollout_samples_total{finish_reason=\"", reasons[r], "\"} ",
                    samples_[r].load(), "\n");
  }
  Scalar(&out, "rollout_running_samples", "gauge", "Samples in the running batch.", e.running);
  Scalar(&out, "rollout_paused_samples", "gauge",
         "Of the running samples, those paused for a Generate reader that fell behind.", e.paused);
  Scalar(&out, "rollout_waiting_samples", "gauge", "Samples queued for admission.", e.waiting);
  Scalar(&out, "rollout_unfinished_samples", "gauge", "Samples submitted and not yet completed.",
         static_cast<double>(e.unfinished_samples));
  Scalar(&out, "rollout_generated_tokens_total", "counter", "Tokens sampled.",
         static_cast<double>(e.generated_tokens));
  Scalar(&out, "rollout_prefilled_tokens_total", "counter",
         "Prompt (and recomputed) tokens run through the model.",
         static_cast<double>(e.prefilled_tokens));
  Scalar(&out, "rollout_scored_tokens_total", "counter", "Tokens scored by Score.",
         static_cast<double>(e.scored_tokens));
  Scalar(&out, "rollout_prompt_tokens_total", "counter", "Prompt tokens admitted.",
         static_cast<double>(e.prompt_tokens));
  Scalar(&out, "rollout_prefix_cache_hit_tokens_total", "counter",
         "Prompt tokens whose KV came from the prefix cache.",
         static_cast<double>(e.cache_hit_tokens));
  Scalar(&out, "rollout_kv_blocks_capacity", "gauge", "KV cache blocks in the pool.",
         e.kv_blocks_total);
  Scalar(&out, "rollout_kv_blocks_free", "gauge", "KV cache blocks free.", e.kv_blocks_free);
  Scalar(&out, "rollout_kv_blocks_cached", "gauge", "KV cache blocks held by the prefix cache.",
         e.kv_blocks_cached);
  Scalar(&out, "rollout_kv_blocks_used", "gauge", "KV cache blocks used by samples.",
         e.kv_blocks_total - e.kv_blocks_free - e.kv_blocks_cached);
  Scalar(&out, "rollout_preemptions_total", "counter", "Samples preempted under KV pressure.",
         static_cast<double>(e.preemptions));
  Scalar(&out, "rollout_recomputed_tokens_total", "counter",
         "Tokens prefilled again because their sample was preempted.",
         static_cast<double>(e.recomputed_tokens));
  Scalar(&out, "rollout_nonfinite_logits_total", "counter",
         "Logits rows with a NaN or an infinity (diverged weights): their samples were ended.",
         static_cast<double>(e.nonfinite_logit_rows));
  Scalar(&out, "rollout_engine_steps_total", "counter", "Engine steps.",
         static_cast<double>(e.steps));
  Scalar(&out, "rollout_engine_lookahead_steps_total", "counter",
         "Decode steps launched before the previous step's tokens were known.",
         static_cast<double>(e.lookahead_steps));
  Histogram(&out, "rollout_prefill_step_seconds", "Duration of steps that prefill.",
            e.prefill_steps);
  Histogram(&out, "rollout_decode_step_seconds", "Duration of decode-only steps.", e.decode_steps);
  Histogram(&out, "rollout_sample_queue_seconds",
            "Generated samples: submission to their first engine step.", e.queue_time);
  Histogram(&out, "rollout_time_to_first_token_seconds",
            "Generated samples: submission to their first token.", e.time_to_first_token);
  Histogram(&out, "rollout_sample_seconds",
            "Generated samples that ended by stop or length: submission to their end.",
            e.sample_time);
  Header(&out, "rollout_weight_updates_total", "counter", "Weight updates by outcome.");
  absl::StrAppend(&out, "rollout_weight_updates_total{outcome=\"ok\"} ", updates_ok_.load(),
                  "\nrollout_weight_updates_total{outcome=\"failed\"} ", updates_failed_.load(),
                  "\n");
  {
    std::lock_guard<std::mutex> lock(mu_);
    Histogram(&out, "rollout_weight_update_seconds",
              "Weight updates (ok or failed): receive to swap.", update_seconds_);
  }
  Scalar(&out, "rollout_weight_swap_seconds_last", "gauge",
         "Engine-side time of the last weight swap.", e.last_update_seconds);
  Header(&out, "rollout_weight_version_info", "gauge", "The weight version being served.");
  absl::StrAppend(&out, "rollout_weight_version_info{version=\"", EscapeLabel(weight_version),
                  "\"} 1\n");
  Scalar(&out, "rollout_paused", "gauge", "1 while scheduling is paused.", paused ? 1 : 0);
  Scalar(&out, "rollout_memory_released_bytes", "gauge",
         "Memory given back by ReleaseMemory (KV cache and weights); 0 when none.", released_bytes);
  return out;
}

grpc::experimental::Interceptor* MetricsInterceptorFactory::CreateServerInterceptor(
    grpc::experimental::ServerRpcInfo* info) {
  return new MetricsInterceptor(metrics_, info->method(), info->server_context());
}

int MetricsHttpServer::HandleRequest(struct mg_connection* conn, void* self) {
  const std::string body = static_cast<MetricsHttpServer*>(self)->render_();
  mg_printf(conn,
            "HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n"
            "Content-Length: %zu\r\nConnection: close\r\n\r\n",
            body.size());
  mg_write(conn, body.data(), body.size());
  return 200;
}

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(
    const std::string& address, std::function<std::string()> render) {
  auto server = std::unique_ptr<MetricsHttpServer>(new MetricsHttpServer());
  server->render_ = std::move(render);
  static const bool initialised = [] {
    mg_init_library(0);
    return true;
  }();
  (void)initialised;
  const char* options[] = {"listening_ports", address.c_str(), "num_threads", "4", nullptr};
  mg_callbacks callbacks = {};
  mg_init_data init = {};
  init.callbacks = &callbacks;
  init.configuration_options = options;
  char text[256] = {0};
  unsigned code = 0;
  mg_error_data error = {&code, text, sizeof(text)};
  server->context_ = mg_start2(&init, &error);
  if (server->context_ == nullptr) {
    return absl::UnavailableError(
        absl::StrCat("cannot serve metrics on ", address, ": ", text[0] ? text : "unknown error",
                     code != 0 ? absl::StrCat(" (error ", code, ")") : ""));
  }
  mg_set_request_handler(server->context_, "/metrics", &MetricsHttpServer::HandleRequest,
                         server.get());
  return server;
}

MetricsHttpServer::~MetricsHttpServer() {
  if (context_ != nullptr) mg_stop(context_);
}

}  // namespace rollout
