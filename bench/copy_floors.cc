#include "bench/copy_floors.h"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"

namespace rollout::bench {
namespace {

using Clock = std::chrono::steady_clock;

constexpr int kRepetitions = 3;

double Seconds(Clock::time_point since) {
  return std::chrono::duration<double>(Clock::now() - since).count();
}

// An fd closed when it goes out of scope.
class Fd {
 public:
  explicit Fd(int fd = -1) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }

 private:
  int fd_;
};

absl::Status Errno(const char* what) {
  return absl::InternalError(absl::StrCat(what, ": ", std::strerror(errno)));
}

}  // namespace

double HostMemcpyGBps(size_t bytes, int threads) {
  threads = std::max(1, threads);
  std::unique_ptr<uint8_t[]> from(new uint8_t[bytes]), to(new uint8_t[bytes]);
  std::memset(from.get(), 1, bytes);
  std::memset(to.get(), 2, bytes);
  double best = 0;
  for (int r = 0; r < kRepetitions; ++r) {
    const auto start = Clock::now();
    std::vector<std::thread> workers;
    const size_t slice = (bytes + threads - 1) / threads;
    for (int t = 0; t < threads; ++t) {
      const size_t begin = std::min(bytes, t * slice), end = std::min(bytes, begin + slice);
      workers.emplace_back(
          [&, begin, end] { std::memcpy(to.get() + begin, from.get() + begin, end - begin); });
    }
    for (std::thread& w : workers) w.join();
    best = std::max(best, bytes / Seconds(start) / 1e9);
  }
  return best;
}

namespace {

// One connected pair of loopback sockets.
struct Connection {
  std::unique_ptr<Fd> sender, receiver;
};

absl::StatusOr<Connection> Connect(int listener, const sockaddr_in& address) {
  Connection c;
  c.sender = std::make_unique<Fd>(socket(AF_INET, SOCK_STREAM, 0));
  if (connect(c.sender->get(), reinterpret_cast<const sockaddr*>(&address), sizeof(address)) != 0) {
    return Errno("connect");
  }
  c.receiver = std::make_unique<Fd>(accept(listener, nullptr, nullptr));
  if (c.receiver->get() < 0) return Errno("accept");
  return c;
}

// Sends `bytes` from `sender` and reads them at `receiver`; false if either side failed.
bool Transfer(const Connection& c, size_t bytes) {
  // 4 MiB writes and reads, the size of a weight update's chunks.
  constexpr size_t kBlock = size_t{4} << 20;
  std::unique_ptr<uint8_t[]> out(new uint8_t[kBlock]), in(new uint8_t[kBlock]);
  std::memset(out.get(), 3, kBlock);
  std::memset(in.get(), 4, kBlock);
  bool write_failed = false;
  std::thread writer([&] {
    for (size_t sent = 0; sent < bytes;) {
      const ssize_t n = write(c.sender->get(), out.get(), std::min(kBlock, bytes - sent));
      if (n <= 0) {
        write_failed = true;
        return;
      }
      sent += static_cast<size_t>(n);
    }
  });
  size_t received = 0;
  while (received < bytes) {
    const ssize_t n = read(c.receiver->get(), in.get(), std::min(kBlock, bytes - received));
    if (n <= 0) break;
    received += static_cast<size_t>(n);
  }
  writer.join();
  return !write_failed && received == bytes;
}

}  // namespace

absl::StatusOr<double> LoopbackTcpGBps(size_t bytes, int connections) {
  connections = std::max(1, connections);
  Fd listener(socket(AF_INET, SOCK_STREAM, 0));
  if (listener.get() < 0) return Errno("socket");
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = 0;
  socklen_t length = sizeof(address);
  if (bind(listener.get(), reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0 ||
      listen(listener.get(), connections) != 0 ||
      getsockname(listener.get(), reinterpret_cast<sockaddr*>(&address), &length) != 0) {
    return Errno("listening on loopback");
  }
  std::vector<Connection> pairs;
  for (int i = 0; i < connections; ++i) {
    absl::StatusOr<Connection> c = Connect(listener.get(), address);
    if (!c.ok()) return c.status();
    pairs.push_back(*std::move(c));
  }
  const size_t share = bytes / connections;
  double best = 0;
  for (int r = 0; r < kRepetitions; ++r) {
    const auto start = Clock::now();
    std::vector<std::thread> threads;
    std::vector<char> ok(connections, 0);
    for (int i = 0; i < connections; ++i) {
      threads.emplace_back([&, i] { ok[i] = Transfer(pairs[i], share); });
    }
    for (std::thread& t : threads) t.join();
    if (std::find(ok.begin(), ok.end(), 0) != ok.end()) return Errno("loopback transfer");
    best = std::max(best, share * connections / Seconds(start) / 1e9);
  }
  return best;
}

}  // namespace rollout::bench
