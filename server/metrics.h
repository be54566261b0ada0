#pragma once

#include <array>
#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "absl/status/statusor.h"
#include "engine/engine.h"
#include "grpcpp/support/server_interceptor.h"

struct mg_connection;
struct mg_context;

namespace rollout {

// Weight updates, receive to swap: 50 ms to 10 min.
struct UpdateBounds {
  static constexpr double kSeconds[] = {0.05, 0.1,  0.25, 0.5,  1.0,  2.5, 5.0,
                                        10.0, 25.0, 50.0, 100., 250., 600.};
};

// What the gRPC layer counts: finished calls by method and status code, samples by how they
// ended, and weight updates. Thread-safe.
class ServiceMetrics {
 public:
  void RecordCall(const std::string& method, grpc::StatusCode code);
  void RecordSample(FinishReason reason);
  void RecordUpdate(double seconds, bool ok);

  // Prometheus text exposition of these and of `engine` (counters, gauges, histograms).
  // `released_bytes`: device (or host) memory ReleaseMemory holds released now; 0 when none.
  std::string Render(const EngineCounters& engine, const std::string& weight_version,
                     bool paused, int64_t released_bytes = 0) const;

 private:
  mutable std::mutex mu_;
  std::map<std::pair<std::string, int>, uint64_t> calls_;  // guarded by mu_
  std::array<std::atomic<uint64_t>, 3> samples_{};         // by FinishReason
  std::atomic<uint64_t> updates_ok_{0}, updates_failed_{0};
  DurationHistogram<UpdateBounds> update_seconds_;  // guarded by mu_
};

// Counts every RPC's final status into ServiceMetrics: one mechanism for all methods.
class MetricsInterceptorFactory : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit MetricsInterceptorFactory(ServiceMetrics* metrics) : metrics_(metrics) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override;

 private:
  ServiceMetrics* const metrics_;
};

// Serves GET /metrics over HTTP (civetweb's C API, which reports why a start failed) with the
// text `render` returns. Owns civetweb's threads; stops them on destruction.
class MetricsHttpServer {
 public:
  // `address` like "0.0.0.0:9400" (port 0 is not supported by civetweb; pick one).
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(
      const std::string& address, std::function<std::string()> render);
  ~MetricsHttpServer();

 private:
  MetricsHttpServer() = default;
  static int HandleRequest(struct mg_connection* conn, void* self);

  std::function<std::string()> render_;
  mg_context* context_ = nullptr;
};

}  // namespace rollout
