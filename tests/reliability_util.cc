#include "tests/reliability_util.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/generic/generic_stub.h"
#include "gtest/gtest.h"

extern char** environ;

namespace rollout::testing::reliability {

v1::ServerInfo FetchServerInfo(v1::RolloutService::Stub* stub) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  v1::ServerInfo info;
  grpc::Status status = stub->GetServerInfo(&context, v1::GetServerInfoRequest(), &info);
  EXPECT_TRUE(status.ok()) << status.error_message();
  return info;
}

bool WaitForQuiescence(v1::RolloutService::Stub* stub, std::chrono::milliseconds timeout,
                       std::string* last) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (true) {
    const v1::EngineCounters c = FetchServerInfo(stub).counters();
    if (c.kv_blocks_free() + c.kv_blocks_cached() == c.kv_blocks_total() &&
        c.running_samples() == 0 && c.waiting_samples() == 0) {
      return true;
    }
    if (std::chrono::steady_clock::now() >= deadline) {
      if (last != nullptr) {
        *last = absl::StrCat("kv free ", c.kv_blocks_free(), " + cached ", c.kv_blocks_cached(),
                             " of ", c.kv_blocks_total(), ", running ", c.running_samples(),
                             ", waiting ", c.waiting_samples());
      }
      return false;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

bool IsServing(const std::shared_ptr<grpc::Channel>& channel, const std::string& service) {
  auto health = grpc::health::v1::Health::NewStub(channel);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(service);
  grpc::health::v1::HealthCheckResponse response;
  return health->Check(&context, request, &response).ok() &&
         response.status() == grpc::health::v1::HealthCheckResponse::SERVING;
}

grpc::Status RawCall(const std::shared_ptr<grpc::Channel>& channel, const std::string& method,
                     const std::string& payload, std::chrono::milliseconds timeout) {
  grpc::GenericStub stub(channel);
  grpc::CompletionQueue cq;
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + timeout);
  std::unique_ptr<grpc::GenericClientAsyncReaderWriter> call =
      stub.PrepareCall(&context, method, &cq);
  if (call == nullptr) return grpc::Status(grpc::StatusCode::INTERNAL, "PrepareCall failed");
  void* tag;
  bool ok;
  // Every operation is awaited before the next; tags are only for sanity.
  auto await = [&](intptr_t expected) {
    if (!cq.Next(&tag, &ok)) return false;
    EXPECT_EQ(reinterpret_cast<intptr_t>(tag), expected);
    return ok;
  };
  call->StartCall(reinterpret_cast<void*>(1));
  bool alive = await(1);
  if (alive) {
    grpc::Slice slice(payload);
    grpc::ByteBuffer buffer(&slice, 1);
    call->Write(buffer, reinterpret_cast<void*>(2));
    alive = await(2);
  }
  if (alive) {
    call->WritesDone(reinterpret_cast<void*>(3));
    alive = await(3);
  }
  // Read until the server ends the stream (a failed read means it is over).
  for (int i = 0; alive && i < 1000000; ++i) {
    grpc::ByteBuffer response;
    call->Read(&response, reinterpret_cast<void*>(4));
    alive = await(4);
  }
  grpc::Status status;
  call->Finish(&status, reinterpret_cast<void*>(5));
  await(5);
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
  return status;
}

int PickFreePort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return 0;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  int port = 0;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
    port = ntohs(addr.sin_port);
  }
  ::close(fd);
  return port;
}

std::string HttpGet(int port, const std::string& path) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return "";
  timeval tv{10, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    ::close(fd);
    return "";
  }
  const std::string request = absl::StrCat("GET ", path, " HTTP/1.1\r\nHost: 127.0.0.1:", port,
                                           "\r\nConnection: close\r\n\r\n");
  size_t sent = 0;
  while (sent < request.size()) {
    const ssize_t n = ::send(fd, request.data() + sent, request.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) break;
    sent += static_cast<size_t>(n);
  }
  std::string response;
  char buffer[4096];
  ssize_t n;
  while ((n = ::recv(fd, buffer, sizeof(buffer), 0)) > 0) response.append(buffer, n);
  ::close(fd);
  return response;
}

uint64_t MetricValue(const std::string& page, const std::string& series) {
  // At a line's start only: one series' name may end another's.
  const std::string line = absl::StrCat("\n", series, " ");
  const size_t at = page.find(line);
  if (at == std::string::npos) return 0;
  return std::strtoull(page.c_str() + at + line.size(), nullptr, 10);
}

v1::WeightsHeader MakeWeightsHeader(const std::string& version, v1::InFlightPolicy policy,
                                    const std::vector<HostTensor>& tensors) {
  v1::WeightsHeader header;
  header.set_version(version);
  header.set_policy(policy);
  for (const HostTensor& t : tensors) {
    v1::TensorDecl* decl = header.add_tensors();
    decl->set_name(t.name);
    decl->set_dtype(DTypeName(t.dtype));
    for (int64_t d : t.shape) decl->add_shape(static_cast<uint64_t>(d));
  }
  return header;
}

std::vector<v1::WeightsChunk> MakeDataChunks(const std::vector<HostTensor>& tensors,
                                             size_t chunk_bytes) {
  std::vector<v1::WeightsChunk> chunks;
  for (const HostTensor& t : tensors) {
    for (size_t off = 0; off < t.bytes.size(); off += chunk_bytes) {
      v1::TensorData* data = chunks.emplace_back().mutable_data();
      data->set_name(t.name);
      data->set_offset(off);
      data->set_data(t.bytes.data() + off, std::min(chunk_bytes, t.bytes.size() - off));
    }
  }
  return chunks;
}

grpc::Status PushChunks(v1::RolloutService::Stub* stub, const std::vector<v1::WeightsChunk>& chunks,
                        v1::UpdateWeightsResponse* response) {
  v1::UpdateWeightsResponse ignored;
  if (response == nullptr) response = &ignored;
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
  auto writer = stub->UpdateWeights(&context, response);
  for (const v1::WeightsChunk& chunk : chunks) {
    if (!writer->Write(chunk)) break;
  }
  writer->WritesDone();
  return writer->Finish();
}

double Quantile(std::vector<double> sorted_ms, double q) {
  if (sorted_ms.empty()) return 0;
  std::sort(sorted_ms.begin(), sorted_ms.end());
  const size_t rank = static_cast<size_t>(std::ceil(q * sorted_ms.size()));
  return sorted_ms[std::min(sorted_ms.size() - 1, rank == 0 ? 0 : rank - 1)];
}

std::unique_ptr<ChildProcess> ChildProcess::Start(const std::vector<std::string>& argv,
                                                  const std::vector<std::string>& extra_env) {
  // Everything the child needs is built before fork: only async-signal-safe calls after it.
  std::vector<std::string> env_strings;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string entry(*e);
    bool overridden = false;
    for (const std::string& x : extra_env) {
      if (entry.compare(0, x.find('=') + 1, x, 0, x.find('=') + 1) == 0) overridden = true;
    }
    if (!overridden) env_strings.push_back(entry);
  }
  for (const std::string& x : extra_env) env_strings.push_back(x);
  std::vector<char*> envp, args;
  for (std::string& s : env_strings) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::vector<std::string> argv_copy = argv;
  for (std::string& s : argv_copy) args.push_back(s.data());
  args.push_back(nullptr);

  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) return nullptr;
  const pid_t pid = ::fork();
  if (pid < 0) {
    ::close(fds[0]);
    ::close(fds[1]);
    return nullptr;
  }
  if (pid == 0) {
    ::dup2(fds[1], STDOUT_FILENO);
    ::dup2(fds[1], STDERR_FILENO);
    // The parent blocks nothing we care about, but reset the mask in case its threads do.
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    ::execve(args[0], args.data(), envp.data());
    ::_exit(127);
  }
  ::close(fds[1]);
  std::unique_ptr<ChildProcess> child(new ChildProcess());
  child->pid_ = pid;
  child->fd_ = fds[0];
  ChildProcess* self = child.get();
  child->reader_ = std::thread([self] {
    char buffer[4096];
    while (true) {
      const ssize_t n = ::read(self->fd_, buffer, sizeof(buffer));
      if (n < 0 && errno == EINTR) continue;
      std::lock_guard<std::mutex> lock(self->mu_);
      if (n <= 0) {
        self->eof_ = true;
        return;
      }
      self->output_.append(buffer, static_cast<size_t>(n));
    }
  });
  return child;
}

ChildProcess::~ChildProcess() {
  if (!reaped_ && pid_ > 0) {
    ::kill(pid_, SIGKILL);
    int status;
    ::waitpid(pid_, &status, 0);
  }
  if (reader_.joinable()) reader_.join();
  if (fd_ >= 0) ::close(fd_);
}

std::string ChildProcess::WaitForOutput(const std::string& needle,
                                        std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      const size_t at = output_.find(needle);
      if (at != std::string::npos) {
        const size_t end = output_.find('\n', at);
        if (end != std::string::npos) return output_.substr(at, end - at);
      }
      if (eof_) return "";
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return "";
}

std::string ChildProcess::output() const {
  std::lock_guard<std::mutex> lock(mu_);
  return output_;
}

bool ChildProcess::Signal(int signal) { return !reaped_ && ::kill(pid_, signal) == 0; }

int ChildProcess::Wait(std::chrono::milliseconds timeout) {
  if (reaped_) return wait_status_;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (true) {
    int status = 0;
    const pid_t r = ::waitpid(pid_, &status, WNOHANG);
    if (r == pid_) {
      reaped_ = true;
      wait_status_ = status;
      return status;
    }
    if (std::chrono::steady_clock::now() >= deadline) return -1;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

std::string BinaryPath(const char* env_var, const std::string& built) {
  const char* path = std::getenv(env_var);
  return path != nullptr && *path != '\0' ? path : built;
}

std::string TestModelCache() { return ::testing::TempDir() + "rollout-test-cache"; }

ServerProcess StartServerProcess(const std::vector<std::string>& args,
                                 const std::vector<std::string>& extra_env) {
  ServerProcess server;
#ifdef ROLLOUT_SERVER_BIN
  std::vector<std::string> argv = {BinaryPath("ROLLOUT_SERVER_BIN", ROLLOUT_SERVER_BIN)};
  argv.insert(argv.end(), args.begin(), args.end());
  std::vector<std::string> env = extra_env;
  const bool own_cache = std::any_of(env.begin(), env.end(), [](const std::string& e) {
    return e.rfind("ROLLOUT_CACHE_DIR=", 0) == 0;
  });
  if (!own_cache) env.push_back("ROLLOUT_CACHE_DIR=" + TestModelCache());
  server.child = ChildProcess::Start(argv, env);
  if (server.child == nullptr) return server;
  const std::string needle = "rollout server listening on port ";
  const std::string line = server.child->WaitForOutput(needle, std::chrono::seconds(120));
  if (!line.empty()) server.port = std::atoi(line.c_str() + needle.size());
#endif
  return server;
}

}  // namespace rollout::testing::reliability
