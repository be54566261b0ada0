// UpdateWeightsFromPath against checkpoints that are not what they seem: a file truncated while
// the server reads it (once a SIGBUS that killed the server and every rollout in it), a FIFO
// as config.json (once held the update slot forever and kept SIGTERM from ending the process),
// config.json linked to /dev/zero (once grew the server's memory without bound), directories
// and symlink loops where files belong, an empty path, an overlong version. Each is an error for
// that update only, with the code a caller can act on; the server serves on. The signal and
// memory cases run on the real binary.
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "model/random_model.h"
#include "tests/reliability_util.h"
#include "tests/test_server.h"

namespace rollout::testing {
namespace {

namespace fs = std::filesystem;
namespace rel = ::rollout::testing::reliability;

using std::chrono::milliseconds;
using std::chrono::seconds;
using Clock = std::chrono::steady_clock;

grpc::Status UpdateFromPath(v1::RolloutService::Stub* stub, const std::string& path,
                            const std::string& version, milliseconds deadline = seconds(120)) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + deadline);
  v1::UpdateWeightsFromPathRequest request;
  request.set_path(path);
  request.set_version(version);
  request.set_policy(v1::IN_FLIGHT_POLICY_CONTINUE);
  v1::UpdateWeightsResponse response;
  return stub->UpdateWeightsFromPath(&context, request, &response);
}

bool Contains(const std::string& text, const std::string& needle) {
  return text.find(needle) != std::string::npos;
}

// A fresh directory under the test temp dir.
std::string FreshDir(const std::string& name) {
  const std::string dir = ::testing::TempDir() + "reliability-checkpoint-files/" + name;
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

// The served model's files copied into a fresh directory, but for the file named `replace`,
// which `make` creates instead.
std::string CopyWithout(const std::string& served, const std::string& name,
                        const std::string& replace,
                        const std::function<void(const std::string& path)>& make) {
  const std::string dir = FreshDir(name);
  for (const char* file : {"config.json", "model.safetensors"}) {
    if (replace != file) fs::copy_file(served + "/" + file, dir + "/" + file);
  }
  make(dir + "/" + replace);
  return dir;
}

// Lets a reader blocked opening the FIFO at `path` go on (it then reads EOF).
void ReleaseFifo(const std::string& path) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_NONBLOCK);
  if (fd >= 0) ::close(fd);
}

int64_t ResidentMiB(pid_t pid) {
  std::ifstream status("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::atoll(line.c_str() + 6) / 1024;
  }
  return 0;
}

TEST(ReliabilityCheckpointFilesTest, CallerMistakesInAPathAreInvalidArgumentOrNotFound) {
  std::unique_ptr<TestServer> server = StartTestServer();
  ASSERT_NE(server, nullptr);
  v1::RolloutService::Stub* stub = server->stub.get();
  const std::string served = server->server->model_dir();
  struct Case {
    std::string name, path, version;
    grpc::StatusCode code;
    std::vector<std::string> expect;
  };
  const std::string dir_config = CopyWithout(served, "dir-config", "config.json",
                                             [](const std::string& p) { fs::create_directory(p); });
  const std::string dir_weights =
      CopyWithout(served, "dir-weights", "model.safetensors",
                  [](const std::string& p) { fs::create_directory(p); });
  const std::string loop = CopyWithout(served, "loop", "config.json", [](const std::string& p) {
    fs::create_symlink(p + ".b", p + ".a");
    fs::create_symlink(p + ".a", p + ".b");
    fs::create_symlink(p + ".a", p);
  });
  const std::string huge = CopyWithout(served, "huge", "config.json", [](const std::string& p) {
    std::ofstream(p) << "{}";
    fs::resize_file(p, 100u << 20);  // sparse
  });
  const std::vector<Case> cases = {
      {"empty path", "", "x", grpc::StatusCode::INVALID_ARGUMENT, {"path is empty"}},
      {"config.json a directory",
       dir_config,
       "x",
       grpc::StatusCode::INVALID_ARGUMENT,
       {dir_config + "/config.json is a directory"}},
      {"model.safetensors a directory",
       dir_weights,
       "x",
       grpc::StatusCode::INVALID_ARGUMENT,
       {dir_weights + "/model.safetensors is a directory"}},
      {"config.json a symlink loop",
       loop,
       "x",
       grpc::StatusCode::INVALID_ARGUMENT,
       {loop + "/config.json", "symbolic links"}},
      {"a 100 MiB config.json",
       huge,
       "x",
       grpc::StatusCode::INVALID_ARGUMENT,
       {huge + "/config.json", "beyond the 64 MiB"}},
      {"a 257-byte version",
       served,
       std::string(257, 'v'),
       grpc::StatusCode::INVALID_ARGUMENT,
       {"version is 257 bytes, beyond the limit of 256"}},
      {"a missing path", served + "-nope", "x", grpc::StatusCode::NOT_FOUND, {served + "-nope"}},
  };
  for (const Case& c : cases) {
    const grpc::Status status = UpdateFromPath(stub, c.path, c.version);
    EXPECT_EQ(status.error_code(), c.code) << c.name << ": " << status.error_message();
    for (const std::string& needle : c.expect) {
      EXPECT_TRUE(Contains(status.error_message(), needle))
          << c.name << ": '" << status.error_message() << "' lacks '" << needle << "'";
    }
    EXPECT_FALSE(rel::FetchServerInfo(stub).weight_update_in_progress()) << c.name;
  }
  // A version of exactly the limit is fine, on both update paths.
  EXPECT_TRUE(UpdateFromPath(stub, served, std::string(256, 'v')).ok());
  const HostTensor t = rel::ReadCheckpointTensor(served, "model.norm.weight");
  std::vector<v1::WeightsChunk> chunks(1);
  *chunks[0].mutable_header() =
      rel::MakeWeightsHeader(std::string(257, 'w'), v1::IN_FLIGHT_POLICY_CONTINUE, {t});
  for (v1::WeightsChunk& c : rel::MakeDataChunks({t}, 1 << 20)) chunks.push_back(std::move(c));
  const grpc::Status streamed = rel::PushChunks(stub, chunks);
  EXPECT_EQ(streamed.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(Contains(streamed.error_message(), "header.version is 257 bytes"))
      << streamed.error_message();
  EXPECT_EQ(rel::FetchServerInfo(stub).weight_version(), std::string(256, 'v'));
}

TEST(ReliabilityCheckpointFilesTest, AnOverlongWeightVersionFlagIsRefusedAtStart) {
  ServerOptions options;
  options.weight_version = std::string(300, 'v');
  absl::StatusOr<std::unique_ptr<RolloutServer>> server = RolloutServer::Start(options);
  ASSERT_FALSE(server.ok());
  EXPECT_EQ(server.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(std::string(server.status().message()), "300 bytes")) << server.status();
}

#ifdef ROLLOUT_SERVER_BIN
// A FIFO as config.json is refused at once, so it neither keeps the update slot past the
// caller's deadline nor keeps SIGTERM from ending the process; config.json linked to /dev/zero
// is refused without being read, so memory stays flat.
TEST(ReliabilityCheckpointFilesTest, AFifoOrDevZeroAsConfigJsonIsRefusedAtOnceAndSigtermIsNotHeld) {
  rel::ServerProcess server =
      rel::StartServerProcess({"--port=0", "--metrics_port=0", "--shutdown_grace_s=1"});
  ASSERT_GT(server.port, 0) << "the server did not start:\n" << server.child->output();
  auto channel = grpc::CreateChannel(server.address(), grpc::InsecureChannelCredentials());
  auto stub = v1::RolloutService::NewStub(channel);
  const std::string served = rel::FetchServerInfo(stub.get()).model().source();
  const std::string fifo = CopyWithout(served, "fifo", "config.json", [](const std::string& p) {
    ASSERT_EQ(::mkfifo(p.c_str(), 0600), 0);
  });
  const std::string zero = CopyWithout(served, "zero", "config.json", [](const std::string& p) {
    fs::create_symlink("/dev/zero", p);
  });

  const auto start = Clock::now();
  const grpc::Status fifo_status = UpdateFromPath(stub.get(), fifo, "fifo", seconds(3));
  EXPECT_EQ(fifo_status.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
      << fifo_status.error_message();
  EXPECT_TRUE(Contains(fifo_status.error_message(), fifo + "/config.json is not a regular file"))
      << fifo_status.error_message();
  EXPECT_LT(Clock::now() - start, seconds(2));
  EXPECT_FALSE(rel::FetchServerInfo(stub.get()).weight_update_in_progress())
      << "the slot is still held after the caller's deadline";
  ReleaseFifo(fifo + "/config.json");

  // Watched: were /dev/zero read, the server would be killed before it ate the machine.
  const int64_t rss_before = ResidentMiB(server.child->pid());
  auto zero_update = std::async(
      std::launch::async, [&] { return UpdateFromPath(stub.get(), zero, "zero", seconds(2)); });
  int64_t rss_peak = rss_before;
  while (zero_update.wait_for(milliseconds(20)) != std::future_status::ready) {
    rss_peak = std::max(rss_peak, ResidentMiB(server.child->pid()));
    if (rss_peak > rss_before + 1024) server.child->Signal(SIGKILL);
  }
  const grpc::Status zero_status = zero_update.get();
  EXPECT_EQ(zero_status.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
      << zero_status.error_message();
  EXPECT_TRUE(Contains(zero_status.error_message(), zero + "/config.json is not a regular file"))
      << zero_status.error_message();
  EXPECT_LT(rss_peak - rss_before, 256) << "MiB of resident memory gained reading /dev/zero";

  // An update on the FIFO under way when SIGTERM comes does not hold the process up.
  fs::remove(fifo + "/config.json");
  ASSERT_EQ(::mkfifo((fifo + "/config.json").c_str(), 0600), 0);
  auto pending = std::async(
      std::launch::async, [&] { return UpdateFromPath(stub.get(), fifo, "fifo-2", seconds(20)); });
  std::this_thread::sleep_for(milliseconds(200));
  ASSERT_TRUE(server.child->Signal(SIGTERM));
  const int status = server.child->Wait(seconds(15));
  ReleaseFifo(fifo + "/config.json");
  ASSERT_NE(status, -1) << "still running 15 s after SIGTERM:\n" << server.child->output();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << server.child->output();
  pending.wait();
}

// The defect as found: a 1 GB checkpoint truncated while UpdateWeightsFromPath reads it. That
// update fails (ABORTED, naming the file); the server and its rollouts go on, the old weights
// serve, and the next update works. Also: a caller whose deadline passes mid-read gets the slot
// back within a bounded read, not when the whole checkpoint was read.
TEST(ReliabilityCheckpointFilesTest, ACheckpointTruncatedWhileItLoadsFailsThatUpdateOnly) {
  const std::string served = ::testing::TempDir() + "reliability-truncation-medium";
  RandomModelOptions model;
  model.preset = "medium";
  model.seed = 3;
  ASSERT_TRUE(WriteRandomModel(model, served).ok());
  rel::ServerProcess server = rel::StartServerProcess(
      {"--port=0", "--metrics_port=0", "--kv_cache_mb=64", "--model=" + served});
  ASSERT_GT(server.port, 0) << "the server did not start:\n" << server.child->output();
  auto channel = grpc::CreateChannel(server.address(), grpc::InsecureChannelCredentials());
  auto stub = v1::RolloutService::NewStub(channel);
  v1::GenerateRequest request;
  *request.add_rollouts() = MakeRollout({5, 6, 7, 8}, 3, 4, 0.7f);
  const GenerateOutcome before = RunGenerate(stub.get(), request);
  ASSERT_TRUE(before.status.ok()) << before.status.error_message();

  const std::string copy = FreshDir("truncated-medium");
  for (const char* file : {"config.json", "model.safetensors"}) {
    fs::copy_file(served + "/" + file, copy + "/" + file);
  }
  auto update =
      std::async(std::launch::async, [&] { return UpdateFromPath(stub.get(), copy, "t"); });
  const auto deadline = Clock::now() + seconds(30);
  while (!rel::FetchServerInfo(stub.get()).weight_update_in_progress() && Clock::now() < deadline) {
    std::this_thread::sleep_for(milliseconds(1));
  }
  std::this_thread::sleep_for(milliseconds(100));
  fs::resize_file(copy + "/model.safetensors", 100u << 20);
  const grpc::Status truncated = update.get();
  EXPECT_FALSE(truncated.ok()) << "the update read the whole file before the truncation";
  EXPECT_TRUE(truncated.error_code() == grpc::StatusCode::ABORTED ||
              truncated.error_code() == grpc::StatusCode::INVALID_ARGUMENT)
      << truncated.error_code() << ": " << truncated.error_message();
  EXPECT_TRUE(Contains(truncated.error_message(), copy + "/model.safetensors"))
      << truncated.error_message();
  ASSERT_EQ(server.child->Wait(milliseconds(0)), -1) << "the server died:\n"
                                                     << server.child->output();
  EXPECT_EQ(rel::FetchServerInfo(stub.get()).weight_version(), "0");
  const GenerateOutcome after = RunGenerate(stub.get(), request);
  ASSERT_TRUE(after.status.ok()) << after.status.error_message();
  EXPECT_EQ(Fingerprint(after.completions[0][0]), Fingerprint(before.completions[0][0]));

  // The next update works; how long its read took (receive_seconds) is the yardstick below.
  v1::UpdateWeightsResponse whole;
  {
    grpc::ClientContext context;
    v1::UpdateWeightsFromPathRequest r;
    r.set_path(served);
    r.set_version("whole");
    ASSERT_TRUE(stub->UpdateWeightsFromPath(&context, r, &whole).ok());
  }
  EXPECT_EQ(rel::FetchServerInfo(stub.get()).weight_version(), "whole");

  // A deadline that passes while the checkpoint is read frees the slot within one bounded read,
  // not once the whole checkpoint was read (as it once did).
  const auto call_start = Clock::now();
  const grpc::Status expired = UpdateFromPath(stub.get(), served, "late", milliseconds(100));
  EXPECT_EQ(expired.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  while (rel::FetchServerInfo(stub.get()).weight_update_in_progress() &&
         Clock::now() - call_start < seconds(60)) {
    std::this_thread::sleep_for(milliseconds(5));
  }
  const double held_s = std::chrono::duration<double>(Clock::now() - call_start).count();
  std::printf("[ deadline ] slot free %.3f s after a 0.1 s deadline; a whole read takes %.3f s\n",
              held_s, whole.receive_seconds());
  EXPECT_LT(held_s, 0.1 + std::max(0.2, whole.receive_seconds() / 2))
      << "the update slot was held after the caller's deadline as long as a whole read takes ("
      << whole.receive_seconds() << " s)";
  EXPECT_EQ(rel::FetchServerInfo(stub.get()).weight_version(), "whole");
  fs::remove_all(copy);
  fs::remove_all(served);
}
#endif  // ROLLOUT_SERVER_BIN

}  // namespace
}  // namespace rollout::testing
