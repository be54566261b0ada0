// Work held behind a waiting DRAIN weight update: Generate calls that arrive while the update
// waits for the work in flight are held until the swap. They must stay reachable: Abort by
// request id ends them (and says so), a client's cancel ends them, and a shutdown ends them with
// FINISH_REASON_ABORT completions instead of starting them on the new weights. (Held work was
// once outside what Abort searched: "aborted" and then run after the swap; on SIGTERM it
// started on the new weights and its stream ended UNAVAILABLE without a completion.)
#include <signal.h>
#include <sys/wait.h>

#include <chrono>
#include <future>
#include <string>
#include <thread>
#include <vector>

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

v1::GenerateRequest Request(uint64_t seed, uint32_t max_new_tokens, const std::string& id = "") {
  v1::GenerateRequest r;
  *r.add_rollouts() = MakeRollout(kPrompt, seed, max_new_tokens, 1.0f, id);
  r.mutable_rollouts(0)->mutable_sampling()->set_ignore_eos(true);
  return r;
}

// A Generate call read to its end on another thread.
struct Stream {
  grpc::ClientContext context;
  std::unique_ptr<grpc::ClientReader<v1::GenerateResponse>> reader;
  std::future<GenerateOutcome> outcome;
};

std::unique_ptr<Stream> StartStream(v1::RolloutService::Stub* stub,
                                    const v1::GenerateRequest& request) {
  auto s = std::make_unique<Stream>();
  s->context.set_deadline(std::chrono::system_clock::now() + seconds(120));
  s->reader = stub->Generate(&s->context, request);
  Stream* raw = s.get();
  s->outcome = std::async(std::launch::async, [raw] {
    GenerateOutcome out;
    v1::GenerateResponse response;
    while (raw->reader->Read(&response)) {
      if (response.has_completion()) out.completions.push_back({response.completion()});
      out.responses.push_back(response);
    }
    out.status = raw->reader->Finish();
    return out;
  });
  return s;
}

// A long generation, running once this returns (its first message arrived).
std::unique_ptr<Stream> StartRunning(v1::RolloutService::Stub* stub) {
  auto s = std::make_unique<Stream>();
  s->context.set_deadline(std::chrono::system_clock::now() + seconds(120));
  s->reader = stub->Generate(&s->context, Request(1, 3000));
  v1::GenerateResponse first;
  EXPECT_TRUE(s->reader->Read(&first)) << "the long generation did not start";
  Stream* raw = s.get();
  s->outcome = std::async(std::launch::async, [raw] {
    GenerateOutcome out;
    v1::GenerateResponse response;
    while (raw->reader->Read(&response)) {
      if (response.has_completion()) out.completions.push_back({response.completion()});
    }
    out.status = raw->reader->Finish();
    return out;
  });
  return s;
}

// An UpdateWeightsFromPath with policy DRAIN on another thread; returns once the server holds
// the update slot and has had time to hand the (small) checkpoint to the engine.
std::future<grpc::Status> StartDrainUpdate(v1::RolloutService::Stub* stub, const std::string& path,
                                           const std::string& version) {
  auto update = std::async(std::launch::async, [stub, path, version] {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + seconds(120));
    v1::UpdateWeightsFromPathRequest request;
    request.set_path(path);
    request.set_version(version);
    request.set_policy(v1::IN_FLIGHT_POLICY_DRAIN);
    v1::UpdateWeightsResponse response;
    return stub->UpdateWeightsFromPath(&context, request, &response);
  });
  const auto deadline = Clock::now() + seconds(30);
  while (!rel::FetchServerInfo(stub).weight_update_in_progress() && Clock::now() < deadline) {
    std::this_thread::sleep_for(milliseconds(10));
  }
  std::this_thread::sleep_for(milliseconds(500));
  return update;
}

// The one completion of a held single-sample call that was aborted before it ran.
void ExpectAbortedBeforeItRan(const std::string& what, const GenerateOutcome& out) {
  EXPECT_TRUE(out.status.ok()) << what << ": " << out.status.error_code() << " "
                               << out.status.error_message();
  ASSERT_EQ(out.completions.size(), 1u) << what;
  const v1::Completion& c = out.completions[0][0];
  EXPECT_EQ(c.finish_reason(), v1::FINISH_REASON_ABORT) << what;
  EXPECT_EQ(c.token_ids_size(), 0) << what << ": held work ran";
  EXPECT_EQ(c.weight_version(), "0") << what << ": held work ran on the new weights";
}

TEST(ReliabilityHeldWorkTest, AbortByIdAndACancelEndHeldWorkBeforeTheDrainEnds) {
  std::unique_ptr<TestServer> server = StartTestServer();
  ASSERT_NE(server, nullptr);
  v1::RolloutService::Stub* stub = server->stub.get();
  std::unique_ptr<Stream> running = StartRunning(stub);
  std::future<grpc::Status> update = StartDrainUpdate(stub, server->server->model_dir(), "v1");

  std::unique_ptr<Stream> held = StartStream(stub, Request(2, 3000, "held-by-drain"));
  std::unique_ptr<Stream> cancelled = StartStream(stub, Request(3, 3000));
  const auto deadline = Clock::now() + seconds(10);
  while (server->server->engine()->unfinished_samples() < 3 && Clock::now() < deadline) {
    std::this_thread::sleep_for(milliseconds(10));
  }
  ASSERT_EQ(server->server->engine()->unfinished_samples(), 3);

  grpc::ClientContext abort_context;
  v1::AbortRequest abort;
  abort.add_request_ids("held-by-drain");
  v1::AbortResponse aborted;
  ASSERT_TRUE(stub->Abort(&abort_context, abort, &aborted).ok());
  EXPECT_EQ(aborted.aborted_rollouts(), 1u);
  EXPECT_EQ(aborted.unknown_request_ids_size(), 0);
  ASSERT_EQ(held->outcome.wait_for(seconds(10)), std::future_status::ready)
      << "the aborted request still waits for the drain";
  ExpectAbortedBeforeItRan("aborted by id", held->outcome.get());

  // The cancelled client's sample is gone from the engine at once, not after the swap.
  cancelled->context.TryCancel();
  EXPECT_EQ(cancelled->outcome.get().status.error_code(), grpc::StatusCode::CANCELLED);
  const auto gone = Clock::now() + seconds(10);
  while (server->server->engine()->unfinished_samples() > 1 && Clock::now() < gone) {
    std::this_thread::sleep_for(milliseconds(10));
  }
  EXPECT_EQ(server->server->engine()->unfinished_samples(), 1)
      << "a cancelled client's held sample is still queued";
  EXPECT_EQ(running->outcome.wait_for(milliseconds(0)), std::future_status::timeout)
      << "the drain ended first; the test proves nothing about held work";

  const uint64_t prompt_tokens = rel::FetchServerInfo(stub).counters().prompt_tokens();
  grpc::ClientContext all_context;
  v1::AbortRequest all;
  all.set_all(true);
  ASSERT_TRUE(stub->Abort(&all_context, all, &aborted).ok());
  EXPECT_TRUE(running->outcome.get().status.ok());
  EXPECT_TRUE(update.get().ok());
  std::string last;
  EXPECT_TRUE(rel::WaitForQuiescence(stub, seconds(30), &last)) << last;
  EXPECT_EQ(rel::FetchServerInfo(stub).counters().prompt_tokens(), prompt_tokens)
      << "held work that was aborted or cancelled was admitted after the swap";
}

#ifdef ROLLOUT_SERVER_BIN
TEST(ReliabilityHeldWorkTest, SigtermEndsHeldWorkWithAbortCompletionsNotOnTheNewWeights) {
  rel::ServerProcess server = rel::StartServerProcess(
      {"--port=0", "--address=127.0.0.1", "--metrics_port=0", "--shutdown_grace_s=1"});
  ASSERT_GT(server.port, 0) << "the server did not start:\n" << server.child->output();
  auto channel = grpc::CreateChannel(server.address(), grpc::InsecureChannelCredentials());
  ASSERT_TRUE(channel->WaitForConnected(std::chrono::system_clock::now() + seconds(30)));
  auto stub = v1::RolloutService::NewStub(channel);
  const std::string model = rel::FetchServerInfo(stub.get()).model().source();

  std::unique_ptr<Stream> running = StartRunning(stub.get());
  std::future<grpc::Status> update = StartDrainUpdate(stub.get(), model, "v1");
  std::unique_ptr<Stream> held = StartStream(stub.get(), Request(2, 3000));
  std::this_thread::sleep_for(milliseconds(300));
  ASSERT_EQ(held->outcome.wait_for(milliseconds(0)), std::future_status::timeout);
  ASSERT_TRUE(server.child->Signal(SIGTERM));

  ASSERT_EQ(held->outcome.wait_for(seconds(30)), std::future_status::ready);
  ExpectAbortedBeforeItRan("held at SIGTERM", held->outcome.get());
  const GenerateOutcome ran = running->outcome.get();
  EXPECT_TRUE(ran.status.ok()) << ran.status.error_message();
  ASSERT_EQ(ran.completions.size(), 1u);
  EXPECT_EQ(ran.completions[0][0].finish_reason(), v1::FINISH_REASON_ABORT);
  update.wait();
  const int status = server.child->Wait(seconds(30));
  ASSERT_NE(status, -1) << "still running 30 s after SIGTERM:\n" << server.child->output();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << server.child->output();
}
#endif  // ROLLOUT_SERVER_BIN

}  // namespace
}  // namespace rollout::testing
