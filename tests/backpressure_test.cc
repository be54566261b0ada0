// Reliability: backpressure on Generate streams whose client stops reading. Against the real
// rollout-server binary (its resident memory is read from /proc), bounded in time.
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/reliability_util.h"
#include "tests/test_server.h"

namespace rollout::testing {
namespace {

namespace rel = ::rollout::testing::reliability;

using std::chrono::milliseconds;
using std::chrono::seconds;
using Clock = std::chrono::steady_clock;

const std::vector<uint32_t> kPrompt = {17, 4, 901, 33, 2048, 7, 250, 3999, 12};

// A rollout-server child with `flags`, and a stub on a plain channel to it.
struct Child {
  std::unique_ptr<rel::ChildProcess> process;
  std::string address;
  std::unique_ptr<v1::RolloutService::Stub> stub;
};

std::unique_ptr<Child> StartChild(const std::vector<std::string>& flags) {
  auto child = std::make_unique<Child>();
  // The binary as built, or $ROLLOUT_SERVER_BIN (a GPU host runs a bundle's copy elsewhere).
  std::vector<std::string> argv = {rel::BinaryPath("ROLLOUT_SERVER_BIN", ROLLOUT_SERVER_BIN),
                                   "--port=0", "--address=127.0.0.1", "--metrics_port=0"};
  argv.insert(argv.end(), flags.begin(), flags.end());
  child->process = rel::ChildProcess::Start(
      argv, {"ROLLOUT_CACHE_DIR=" + ::testing::TempDir() + "rollout-test-cache"});
  if (child->process == nullptr) return nullptr;
  const std::string needle = "rollout server listening on port ";
  const std::string line = child->process->WaitForOutput(needle, seconds(120));
  EXPECT_FALSE(line.empty()) << "the server did not start:\n" << child->process->output();
  if (line.empty()) return nullptr;
  child->address = absl::StrCat("127.0.0.1:", std::atoi(line.c_str() + needle.size()));
  child->stub = v1::RolloutService::NewStub(
      grpc::CreateChannel(child->address, grpc::InsecureChannelCredentials()));
  return child;
}

// A client that reads as little as gRPC lets it: no flow-control window growth, 64 KiB of
// lookahead, so what it does not read stays queued on the server.
std::unique_ptr<v1::RolloutService::Stub> StingyStub(const std::string& address) {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 64 << 10);
  args.SetMaxReceiveMessageSize(256 << 20);
  return v1::RolloutService::NewStub(
      grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args));
}

int64_t ResidentKiB(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::atoll(line.c_str() + 6);
  }
  return -1;
}

// 24 samples x 800 tokens, one-token chunks: about 3 MiB of queued messages if none is read.
v1::GenerateRequest LongRequest() {
  v1::GenerateRequest request;
  *request.add_rollouts() = MakeRollout(kPrompt, 5, 800, 1.0f);
  request.mutable_rollouts(0)->set_num_samples(24);
  request.mutable_rollouts(0)->mutable_sampling()->set_ignore_eos(true);
  return request;
}

v1::GenerateRequest ShortRequest() {
  v1::GenerateRequest request;
  *request.add_rollouts() = MakeRollout({5, 6, 7}, 9, 32, 0.8f);
  request.mutable_rollouts(0)->set_num_samples(2);
  return request;
}

std::vector<std::string> Fingerprints(const GenerateOutcome& out) {
  std::vector<std::string> f;
  for (const auto& samples : out.completions) {
    for (const v1::Completion& c : samples) f.push_back(Fingerprint(c));
  }
  return f;
}

// Waits until the server's generated-token counter stops moving (for 500 ms); returns it.
uint64_t WaitUntilGenerationStops(v1::RolloutService::Stub* stub) {
  uint64_t last = rel::FetchServerInfo(stub).counters().generated_tokens();
  const auto deadline = Clock::now() + seconds(90);
  while (Clock::now() < deadline) {
    std::this_thread::sleep_for(milliseconds(500));
    const uint64_t now = rel::FetchServerInfo(stub).counters().generated_tokens();
    if (now == last) return now;
    last = now;
  }
  ADD_FAILURE() << "generation never stopped";
  return last;
}

// The stalled call's 24 samples fill --max_running_samples: paused, they leave their places to
// other calls (which waited for the stall timeout when paused samples still counted).
TEST(ReliabilityBackpressureTest,
     AStalledReaderPausesItsSamplesInBoundedMemoryThenGetsTheSameBits) {
  std::unique_ptr<Child> child = StartChild(
      {"--stream_buffer_mb=1", "--stream_stall_timeout_s=300", "--max_running_samples=24"});
  ASSERT_NE(child, nullptr);
  v1::RolloutService::Stub* stub = child->stub.get();
  const GenerateOutcome reference = RunGenerate(stub, LongRequest());
  ASSERT_TRUE(reference.status.ok()) << reference.status.error_message();
  const GenerateOutcome short_reference = RunGenerate(stub, ShortRequest());
  ASSERT_TRUE(short_reference.status.ok());
  const uint64_t before = rel::FetchServerInfo(stub).counters().generated_tokens();

  std::unique_ptr<v1::RolloutService::Stub> stingy = StingyStub(child->address);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + seconds(300));
  auto reader = stingy->Generate(&context, LongRequest());
  v1::GenerateResponse response;
  ASSERT_TRUE(reader->Read(&response));
  // The reader stops here. Its samples pause short of their end and hold their place.
  const uint64_t paused_at = WaitUntilGenerationStops(stub);
  EXPECT_LT(paused_at - before, 24u * 800) << "the stalled stream's samples ran to the end";
  EXPECT_EQ(rel::FetchServerInfo(stub).counters().running_samples(), 24u);
  // All 24 hold their place paused, and are counted as such (running_samples counts them too).
  EXPECT_EQ(rel::FetchServerInfo(stub).counters().paused_samples(), 24u);
  const int64_t rss = ResidentKiB(child->process->pid());

  // Another stream meanwhile runs normally, at once, with its bits.
  const auto other_start = Clock::now();
  const GenerateOutcome other = RunGenerate(stub, ShortRequest());
  ASSERT_TRUE(other.status.ok()) << other.status.error_message();
  const auto other_s = std::chrono::duration_cast<seconds>(Clock::now() - other_start).count();
  EXPECT_LT(other_s, 30) << "the other call waited for the paused samples";
  EXPECT_EQ(Fingerprints(other), Fingerprints(short_reference));
  std::this_thread::sleep_for(seconds(1));
  EXPECT_LT(ResidentKiB(child->process->pid()) - rss, 8 << 10) << "KiB grown while paused";
  EXPECT_EQ(rel::FetchServerInfo(stub).counters().generated_tokens(),
            paused_at + other.completions[0][0].token_ids_size() +
                other.completions[0][1].token_ids_size());

  // Reading again resumes the samples; they end with the bits of an unpaused run.
  GenerateOutcome resumed;
  resumed.completions.resize(1);
  resumed.completions[0].resize(24);
  do {
    if (response.has_completion()) {
      resumed.completions[0][response.completion().sample_index()] = response.completion();
    }
  } while (reader->Read(&response));
  const grpc::Status status = reader->Finish();
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(Fingerprints(resumed), Fingerprints(reference));
}

// A LongRequest on a stingy channel whose client read its first message only, and nothing
// more until the server stalled it: its samples aborted, their KV back in the pool.
struct StalledStream {
  std::unique_ptr<v1::RolloutService::Stub> stub;
  grpc::ClientContext context;
  std::unique_ptr<grpc::ClientReader<v1::GenerateResponse>> reader;
  v1::GenerateResponse first;
  bool started = false;    // the first message came
  uint64_t generated = 0;  // the server's generated tokens once it stalled the stream

  // Reads the stream to its end: the tokens received, the first message's included.
  uint64_t ReadTokens() {
    uint64_t received = first.chunk().token_ids_size();
    v1::GenerateResponse response;
    while (reader->Read(&response)) received += response.chunk().token_ids_size();
    return received;
  }
};

std::unique_ptr<StalledStream> StallAStream(Child* child) {
  auto s = std::make_unique<StalledStream>();
  s->stub = StingyStub(child->address);
  s->context.set_deadline(std::chrono::system_clock::now() + seconds(300));
  s->reader = s->stub->Generate(&s->context, LongRequest());
  s->started = s->reader->Read(&s->first);
  if (!s->started) return s;
  std::string last;
  std::this_thread::sleep_for(seconds(1));
  EXPECT_TRUE(rel::WaitForQuiescence(child->stub.get(), seconds(90), &last)) << last;
  s->generated = rel::FetchServerInfo(child->stub.get()).counters().generated_tokens();
  return s;
}

TEST(ReliabilityBackpressureTest, AReaderStalledPastTheTimeoutEndsResourceExhaustedAndFreesItsKv) {
  std::unique_ptr<Child> child = StartChild({"--stream_buffer_mb=1", "--stream_stall_timeout_s=2"});
  ASSERT_NE(child, nullptr);
  v1::RolloutService::Stub* stub = child->stub.get();

  // The samples pause, then end at the timeout, their KV back in the pool; other streams run.
  std::unique_ptr<StalledStream> stalled = StallAStream(child.get());
  ASSERT_TRUE(stalled->started);
  EXPECT_LT(stalled->generated, 24u * 800);
  EXPECT_TRUE(RunGenerate(stub, ShortRequest()).status.ok());

  // What the client still reads is every token generated for it, then the status.
  EXPECT_EQ(stalled->ReadTokens(), stalled->generated)
      << "tokens queued for the stalled client were dropped";
  const grpc::Status status = stalled->reader->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << status.error_message();
  EXPECT_NE(status.error_message().find("--stream_buffer_mb"), std::string::npos)
      << status.error_message();
  // The timer runs from the client's last read, and the message says so.
  EXPECT_NE(status.error_message().find("read nothing for 2.0 s"), std::string::npos)
      << status.error_message();
}

// A stalled client that reads nothing for another timeout is not coming back for its queue:
// dropped (but for the message in flight), so such clients do not hold --stream_buffer_mb each
// for as long as they stay connected; the status still follows.
TEST(ReliabilityBackpressureTest, AStalledStreamsQueueIsDroppedAfterAnotherTimeoutWithoutARead) {
  std::unique_ptr<Child> child = StartChild({"--stream_buffer_mb=1", "--stream_stall_timeout_s=1"});
  ASSERT_NE(child, nullptr);
  std::unique_ptr<StalledStream> stalled = StallAStream(child.get());
  ASSERT_TRUE(stalled->started);
  std::this_thread::sleep_for(seconds(3));
  EXPECT_LT(stalled->ReadTokens() + 4000, stalled->generated)
      << "the queue of a client gone quiet was kept";
  const grpc::Status status = stalled->reader->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << status.error_message();
}

// A client that reads steadily, just slower than its samples come, is not stalled, even where
// draining half the bound (where its samples resume) takes it longer than the stall timeout.
TEST(ReliabilityBackpressureTest, AReaderThatReadsSlowlyIsNotTakenForStalled) {
  std::unique_ptr<Child> child = StartChild({"--stream_buffer_mb=4", "--stream_stall_timeout_s=8"});
  ASSERT_NE(child, nullptr);
  v1::RolloutService::Stub* stub = child->stub.get();
  v1::GenerateRequest request = LongRequest();
  request.mutable_rollouts(0)->set_num_samples(48);  // about 6 MiB of messages
  const GenerateOutcome reference = RunGenerate(stub, request);
  ASSERT_TRUE(reference.status.ok()) << reference.status.error_message();
  const uint64_t before = rel::FetchServerInfo(stub).counters().generated_tokens();
  std::unique_ptr<v1::RolloutService::Stub> stingy = StingyStub(child->address);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + seconds(300));
  auto reader = stingy->Generate(&context, request);
  v1::GenerateResponse response;
  ASSERT_TRUE(reader->Read(&response));
  const uint64_t paused_at = WaitUntilGenerationStops(stub);  // 4 MiB queued
  ASSERT_LT(paused_at - before, 48u * 800) << "the samples did not pause";

  // One message a millisecond for the first 16000. Half the bound is about 13000 messages
  // (13 s); the server sees reads as the stingy client's window opens: first after about 5 s
  // (what gRPC buffered), then each 1 to 2 s.
  GenerateOutcome slow;
  slow.completions.resize(1);
  slow.completions[0].resize(48);
  int read = 0;
  do {
    if (response.has_completion()) {
      slow.completions[0][response.completion().sample_index()] = response.completion();
    }
    if (++read < 16000) std::this_thread::sleep_for(milliseconds(1));
  } while (reader->Read(&response));
  const grpc::Status status = reader->Finish();
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(Fingerprints(slow), Fingerprints(reference));
}

}  // namespace
}  // namespace rollout::testing
