// Helpers of the reliability suite (tests/reliability_test.cc): raw gRPC calls, health and KV
// checks, a tiny HTTP GET, weight-update streams, and a child rollout-server process.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "engine/engine_test_util.h"
#include "grpcpp/grpcpp.h"
#include "model/safetensors.h"
#include "rollout/v1/rollout.grpc.pb.h"

namespace rollout::testing::reliability {

// GetServerInfo, failing the test on error.
v1::ServerInfo FetchServerInfo(v1::RolloutService::Stub* stub);

// True when every KV block is back (free + cached == total) and nothing runs or waits. Polls
// GetServerInfo for up to `timeout`; on failure `last` (if given) describes the last counters.
bool WaitForQuiescence(v1::RolloutService::Stub* stub,
                       std::chrono::milliseconds timeout = std::chrono::seconds(30),
                       std::string* last = nullptr);

// grpc.health.v1 Check of `service` ("": the whole server). SERVING -> true.
bool IsServing(const std::shared_ptr<grpc::Channel>& channel, const std::string& service = "");

// One call of `method` (e.g. "/rollout.v1.RolloutService/Generate") that sends `payload` as a
// single raw message, half-closes, reads every response and returns the final status. Works for
// unary and streaming methods alike (the wire format is the same).
grpc::Status RawCall(const std::shared_ptr<grpc::Channel>& channel, const std::string& method,
                     const std::string& payload,
                     std::chrono::milliseconds timeout = std::chrono::seconds(30));

// A port that was free a moment ago (bound to 0, read back, closed).
int PickFreePort();

// GET `path` from 127.0.0.1:`port` over a plain socket; returns the whole response (status
// line, headers and body), or "" on a connection error.
std::string HttpGet(int port, const std::string& path);

// The value of `series` (a metric's full name with its labels, as the exposition writes it:
// `rollout_weight_updates_total{outcome="failed"}`) on a /metrics `page` HttpGet returned; 0
// when the page has no such line (counters not yet written, or no page).
uint64_t MetricValue(const std::string& page, const std::string& series);

// Weight updates.
using ::rollout::ReadCheckpointTensor;  // engine/engine_test_util.h
using ::rollout::ScaledBf16;
v1::WeightsHeader MakeWeightsHeader(const std::string& version, v1::InFlightPolicy policy,
                                    const std::vector<HostTensor>& tensors);
std::vector<v1::WeightsChunk> MakeDataChunks(const std::vector<HostTensor>& tensors,
                                             size_t chunk_bytes);

// Streams `chunks` as one UpdateWeights call (no header is added) and returns the status.
grpc::Status PushChunks(v1::RolloutService::Stub* stub, const std::vector<v1::WeightsChunk>& chunks,
                        v1::UpdateWeightsResponse* response = nullptr);

// Sorted latencies -> the q-quantile (nearest rank), in ms.
double Quantile(std::vector<double> sorted_ms, double q);

// A child process with its stderr (and stdout) captured by a reader thread.
class ChildProcess {
 public:
  // Starts `argv[0]` with `argv` and the current environment plus `extra_env` ("K=V").
  static std::unique_ptr<ChildProcess> Start(const std::vector<std::string>& argv,
                                             const std::vector<std::string>& extra_env);
  ~ChildProcess();  // kills (SIGKILL) and reaps it if still running

  pid_t pid() const { return pid_; }
  // Waits until the output contains `needle` and returns the text from it to the line end, or
  // "" after `timeout` or when the child exits first.
  std::string WaitForOutput(const std::string& needle, std::chrono::milliseconds timeout);
  std::string output() const;
  bool Signal(int signal);
  // Waits for the child to exit; returns its wait status, or -1 after `timeout` (still running).
  int Wait(std::chrono::milliseconds timeout);

 private:
  ChildProcess() = default;
  pid_t pid_ = -1;
  int fd_ = -1;
  bool reaped_ = false;
  int wait_status_ = 0;
  mutable std::mutex mu_;
  std::string output_;  // guarded by mu_
  bool eof_ = false;    // guarded by mu_
  std::thread reader_;
};

// The rollout-server binary (ROLLOUT_SERVER_BIN, or $ROLLOUT_SERVER_BIN) started with `args` (after
// the binary's name), `extra_env`, and ROLLOUT_CACHE_DIR set to the test binary's model cache
// unless `extra_env` sets it, once it logged the port it listens on. On failure (no such line
// within two minutes) `port` is 0 and the child is returned all the same, for its output.
struct ServerProcess {
  std::unique_ptr<ChildProcess> child;
  int port = 0;
  std::string address() const { return "127.0.0.1:" + std::to_string(port); }
};
ServerProcess StartServerProcess(const std::vector<std::string>& args,
                                 const std::vector<std::string>& extra_env = {});

// A binary the test runs: `built` (the path CMake compiled in), or $`env_var` when set (a
// bundle run on another machine, where the build's paths do not exist).
std::string BinaryPath(const char* env_var, const std::string& built);

// The test binary's model cache (where the embedded default model is written once).
std::string TestModelCache();

}  // namespace rollout::testing::reliability
