// Colocated memory through the real gRPC stack: ReleaseMemory holds new requests and requeues
// what runs, ServerInfo reports what is released, ResumeMemory brings back bitwise the same
// tokens and logprobs; idempotence, auth, updates while released, and a resume the host cannot
// hold. Runs on the CUDA backend too (ROLLOUT_TEST_BACKEND=cuda), where the memory is the GPU's.
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <future>
#include <string>
#include <thread>

#include <sys/wait.h>

#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/reliability_util.h"
#include "tests/test_server.h"

namespace rollout::testing {
namespace {

const std::vector<uint32_t> kPrompt = {3, 14, 15, 92, 65, 35, 89, 79, 323, 846, 26, 43, 38, 32};

bool OnCpuBackend() {
  const char* backend = std::getenv("ROLLOUT_TEST_BACKEND");
  return backend == nullptr || *backend == '\0' || std::string(backend) == "cpu";
}

// Greedy and sampled, one with top logprobs: the probe whose bits must survive a release.
v1::GenerateRequest Probe(uint32_t max_new_tokens = 24) {
  v1::GenerateRequest request;
  *request.add_rollouts() = MakeRollout(kPrompt, 7, max_new_tokens, 0.0f);
  *request.add_rollouts() = MakeRollout(kPrompt, 8, max_new_tokens, 0.9f);
  request.mutable_rollouts(1)->set_num_samples(2);
  request.mutable_rollouts(1)->mutable_sampling()->set_top_logprobs(3);
  for (v1::RolloutRequest& r : *request.mutable_rollouts()) {
    r.mutable_sampling()->set_ignore_eos(true);
  }
  return request;
}

std::string Fingerprints(const GenerateOutcome& out) {
  std::string all;
  for (const auto& rollout : out.completions) {
    for (const v1::Completion& c : rollout) {
      all += Fingerprint(c) + ";";
      for (const v1::TopLogprobs& top : c.top_logprobs()) all += top.SerializeAsString();
      all += "\n";
    }
  }
  return all;
}

grpc::Status Release(v1::RolloutService::Stub* stub, v1::ReleaseMemoryResponse* response,
                     bool abort_in_flight = false, bool weights = false,
                     const std::string& token = "") {
  grpc::ClientContext context;
  if (!token.empty()) context.AddMetadata("authorization", "Bearer " + token);
  v1::ReleaseMemoryRequest request;
  request.set_abort_in_flight(abort_in_flight);
  request.set_weights(weights);
  return stub->ReleaseMemory(&context, request, response);
}

grpc::Status Resume(v1::RolloutService::Stub* stub, v1::ResumeMemoryResponse* response,
                    const std::string& token = "") {
  grpc::ClientContext context;
  if (!token.empty()) context.AddMetadata("authorization", "Bearer " + token);
  return stub->ResumeMemory(&context, v1::ResumeMemoryRequest(), response);
}

v1::ServerInfo Info(v1::RolloutService::Stub* stub) {
  grpc::ClientContext context;
  v1::ServerInfo info;
  EXPECT_TRUE(stub->GetServerInfo(&context, v1::GetServerInfoRequest(), &info).ok());
  return info;
}

class MemoryE2eTest : public SharedServerTest {
 protected:
  void TearDown() override {
    v1::ResumeMemoryResponse r;
    EXPECT_TRUE(Resume(stub(), &r).ok());  // whatever a test left released
  }
};

TEST_F(MemoryE2eTest, ReleasedMemoryHoldsRequestsAndResumeGivesBitwiseTheSameOutputs) {
  const GenerateOutcome before = RunGenerate(stub(), Probe());
  ASSERT_TRUE(before.status.ok()) << before.status.error_message();
  EXPECT_FALSE(Info(stub()).has_memory_released());

  v1::ReleaseMemoryResponse released;
  ASSERT_TRUE(Release(stub(), &released).ok());
  EXPECT_FALSE(released.was_released());
  EXPECT_GT(released.kv_cache_bytes(), 0u);
  EXPECT_EQ(released.weight_bytes(), 0u);
  const v1::ServerInfo info = Info(stub());
  ASSERT_TRUE(info.has_memory_released());
  EXPECT_EQ(info.memory_released().kv_cache_bytes(), released.kv_cache_bytes());
  EXPECT_FALSE(info.memory_released().weights());
  EXPECT_EQ(info.counters().kv_blocks_cached(), 0u) << "the prefix cache was flushed";
  EXPECT_FALSE(info.paused()) << "release is not a pause";

  // A request that arrives now is held, not failed.
  auto held = std::async(std::launch::async, [] { return RunGenerate(stub(), Probe()); });
  EXPECT_EQ(held.wait_for(std::chrono::milliseconds(500)), std::future_status::timeout);
  EXPECT_EQ(Info(stub()).counters().waiting_samples(), 3u);
  EXPECT_EQ(Info(stub()).counters().generated_tokens(), info.counters().generated_tokens());

  v1::ResumeMemoryResponse resumed;
  ASSERT_TRUE(Resume(stub(), &resumed).ok());
  EXPECT_TRUE(resumed.was_released());
  EXPECT_EQ(resumed.kv_cache_bytes(), released.kv_cache_bytes());
  EXPECT_FALSE(Info(stub()).has_memory_released());
  const GenerateOutcome after = held.get();
  ASSERT_TRUE(after.status.ok()) << after.status.error_message();
  EXPECT_EQ(Fingerprints(after), Fingerprints(before));
  EXPECT_EQ(Fingerprints(RunGenerate(stub(), Probe())), Fingerprints(before));
}

TEST_F(MemoryE2eTest, SamplesInFlightArePreemptedAndFinishBitwiseAsUndisturbed) {
  v1::GenerateRequest request = Probe(400);
  const GenerateOutcome undisturbed = RunGenerate(stub(), request);
  ASSERT_TRUE(undisturbed.status.ok());
  grpc::ClientContext context;
  auto reader = stub()->Generate(&context, request);
  v1::GenerateResponse response;
  GenerateOutcome out;
  out.completions = {std::vector<v1::Completion>(1), std::vector<v1::Completion>(2)};
  size_t streamed = 0;
  bool released = false;
  while (reader->Read(&response)) {
    if (response.has_chunk()) streamed += response.chunk().token_ids_size();
    if (response.has_completion()) {
      const v1::Completion& c = response.completion();
      out.completions[c.rollout_index()][c.sample_index()] = c;
    }
    if (!released && streamed >= 6) {
      v1::ReleaseMemoryResponse r;
      ASSERT_TRUE(Release(stub(), &r).ok());
      EXPECT_GE(r.preempted_samples(), 1u);  // the running ones; any others were waiting
      EXPECT_LE(r.preempted_samples(), 3u);
      EXPECT_EQ(r.aborted_samples(), 0u);
      released = true;
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      EXPECT_EQ(Info(stub()).counters().running_samples(), 0u);
      v1::ResumeMemoryResponse resumed;
      ASSERT_TRUE(Resume(stub(), &resumed).ok());
    }
  }
  ASSERT_TRUE(reader->Finish().ok());
  ASSERT_TRUE(released);
  EXPECT_EQ(Fingerprints(out), Fingerprints(undisturbed));
}

TEST_F(MemoryE2eTest, AbortInFlightEndsRunningSamplesWithTheirTokens) {
  v1::GenerateRequest request = Probe(3000);
  grpc::ClientContext context;
  auto reader = stub()->Generate(&context, request);
  v1::GenerateResponse response;
  size_t streamed = 0, aborted = 0;
  bool released = false;
  while (reader->Read(&response)) {
    if (response.has_chunk()) streamed += response.chunk().token_ids_size();
    if (response.has_completion()) {
      aborted += response.completion().finish_reason() == v1::FINISH_REASON_ABORT;
    }
    if (!released && streamed >= 3) {
      v1::ReleaseMemoryResponse r;
      ASSERT_TRUE(Release(stub(), &r, /*abort_in_flight=*/true).ok());
      EXPECT_EQ(r.aborted_samples(), 3u);
      released = true;
    }
  }
  EXPECT_TRUE(reader->Finish().ok());
  EXPECT_EQ(aborted, 3u);
}

TEST_F(MemoryE2eTest, BothCallsAreIdempotent) {
  v1::ResumeMemoryResponse not_released;
  ASSERT_TRUE(Resume(stub(), &not_released).ok());
  EXPECT_FALSE(not_released.was_released());
  EXPECT_EQ(not_released.kv_cache_bytes(), 0u);
  v1::ReleaseMemoryResponse first, second;
  ASSERT_TRUE(Release(stub(), &first).ok());
  ASSERT_TRUE(Release(stub(), &second).ok());
  EXPECT_TRUE(second.was_released());
  EXPECT_EQ(second.kv_cache_bytes(), 0u) << "nothing more was released";
  EXPECT_EQ(Info(stub()).memory_released().kv_cache_bytes(), first.kv_cache_bytes());
  v1::ResumeMemoryResponse resumed, again;
  ASSERT_TRUE(Resume(stub(), &resumed).ok());
  ASSERT_TRUE(Resume(stub(), &again).ok());
  EXPECT_TRUE(resumed.was_released());
  EXPECT_FALSE(again.was_released());
}

// The weights: released too on a backend that holds them on a device (their updates then wait
// for ResumeMemory), kept on the CPU backend (where an update goes on).
TEST_F(MemoryE2eTest, WeightsReleaseIsReportedAndUpdatesFollowIt) {
  const GenerateOutcome before = RunGenerate(stub(), Probe());
  v1::ReleaseMemoryResponse released;
  ASSERT_TRUE(Release(stub(), &released, false, /*weights=*/true).ok());
  const v1::ServerInfo info = Info(stub());
  ASSERT_TRUE(info.has_memory_released());
  EXPECT_EQ(info.memory_released().weights(), !OnCpuBackend());
  EXPECT_EQ(released.weight_bytes() > 0, !OnCpuBackend());
  grpc::ClientContext context;
  v1::UpdateWeightsFromPathRequest update;
  update.set_path(server_->server->model_dir());
  update.set_version("same-bytes-new-name");
  v1::UpdateWeightsResponse response;
  const grpc::Status s = stub()->UpdateWeightsFromPath(&context, update, &response);
  if (info.memory_released().weights()) {
    EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << s.error_message();
    EXPECT_NE(s.error_message().find("ResumeMemory"), std::string::npos) << s.error_message();
    EXPECT_EQ(Info(stub()).weight_version(), info.weight_version());
  } else {
    EXPECT_TRUE(s.ok()) << s.error_message();
  }
  v1::ResumeMemoryResponse resumed;
  ASSERT_TRUE(Resume(stub(), &resumed).ok());
  EXPECT_EQ(resumed.weight_bytes(), released.weight_bytes());
  GenerateOutcome after = RunGenerate(stub(), Probe());
  for (auto& rollout : after.completions) {
    for (v1::Completion& c : rollout) c.clear_weight_version();
  }
  EXPECT_EQ(Fingerprints(after), Fingerprints(before)) << "the same bytes serve";
}

TEST(MemoryAuthE2eTest, ReleaseAndResumeAreControlRpcsThatNeedTheToken) {
  ServerOptions options;
  options.auth_token = "s3cret";
  std::unique_ptr<TestServer> t = StartTestServer(options);
  ASSERT_NE(t, nullptr);
  v1::ReleaseMemoryResponse released;
  EXPECT_EQ(Release(t->stub.get(), &released).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  v1::ResumeMemoryResponse resumed;
  EXPECT_EQ(Resume(t->stub.get(), &resumed).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_FALSE(Info(t->stub.get()).has_memory_released());
  ASSERT_TRUE(Release(t->stub.get(), &released, false, false, "s3cret").ok());
  EXPECT_TRUE(Info(t->stub.get()).has_memory_released());
  ASSERT_TRUE(Resume(t->stub.get(), &resumed, "s3cret").ok());
}

TEST(MemoryMetricsE2eTest, TheReleasedBytesGaugeFollowsReleaseAndResume) {
  namespace rel = ::rollout::testing::reliability;
  ServerOptions options;
  options.metrics_port = rel::PickFreePort();
  ASSERT_GT(options.metrics_port, 0);
  std::unique_ptr<TestServer> t = StartTestServer(options);
  ASSERT_NE(t, nullptr);
  auto gauge = [&] {
    const std::string page = rel::HttpGet(options.metrics_port, "/metrics");
    const std::string name = "\nrollout_memory_released_bytes ";
    const size_t at = page.find(name);
    if (at == std::string::npos) return std::string("(missing)");
    return page.substr(at + name.size(), page.find('\n', at + 1) - at - name.size());
  };
  EXPECT_EQ(gauge(), "0");
  v1::ReleaseMemoryResponse released;
  ASSERT_TRUE(Release(t->stub.get(), &released).ok());
  EXPECT_EQ(gauge(), std::to_string(released.kv_cache_bytes()));
  v1::ResumeMemoryResponse resumed;
  ASSERT_TRUE(Resume(t->stub.get(), &resumed).ok());
  EXPECT_EQ(gauge(), "0");
}

TEST(MemoryShortageE2eTest, AResumeWithoutTheMemoryIsResourceExhaustedAndARetrySucceeds) {
  if (!OnCpuBackend()) GTEST_SKIP() << "the shortage is injected into the CPU backend";
  auto available = std::make_shared<std::atomic<int64_t>>(int64_t{1} << 40);
  ServerOptions options;
  options.available_host_memory_for_testing = [available] { return available->load(); };
  std::unique_ptr<TestServer> t = StartTestServer(options);
  ASSERT_NE(t, nullptr);
  v1::RolloutService::Stub* stub = t->stub.get();
  const GenerateOutcome before = RunGenerate(stub, Probe());
  v1::ReleaseMemoryResponse released;
  ASSERT_TRUE(Release(stub, &released).ok());
  auto held = std::async(std::launch::async, [stub] { return RunGenerate(stub, Probe()); });
  available->store(1 << 20);  // the trainer still holds the memory
  v1::ResumeMemoryResponse refused;
  const grpc::Status s = Resume(stub, &refused);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  EXPECT_NE(s.error_message().find("the memory stays released"), std::string::npos)
      << s.error_message();
  EXPECT_TRUE(Info(stub).has_memory_released());
  EXPECT_EQ(held.wait_for(std::chrono::milliseconds(300)), std::future_status::timeout);
  available->store(int64_t{1} << 40);
  v1::ResumeMemoryResponse resumed;
  ASSERT_TRUE(Resume(stub, &resumed).ok());
  EXPECT_EQ(resumed.kv_cache_bytes(), released.kv_cache_bytes());
  EXPECT_EQ(Fingerprints(held.get()), Fingerprints(before));
}

#if defined(ROLLOUT_CLI_BIN)
// rollout-cli's release-memory and resume-memory: exit 0 and say what changed.
TEST_F(MemoryE2eTest, TheCliReleasesAndResumes) {
  namespace rel = ::rollout::testing::reliability;
  auto run = [](const std::vector<std::string>& args, std::string* output) {
    std::vector<std::string> argv = {rel::BinaryPath("ROLLOUT_CLI_BIN", ROLLOUT_CLI_BIN),
                                     "--server=" + server_->address()};
    argv.insert(argv.end(), args.begin(), args.end());
    std::unique_ptr<rel::ChildProcess> child = rel::ChildProcess::Start(argv, {});
    if (child == nullptr) return -1;
    const int status = child->Wait(std::chrono::seconds(60));
    child->WaitForOutput("\x01", std::chrono::milliseconds(200));
    *output = child->output();
    return status != -1 && WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  };
  std::string out;
  ASSERT_EQ(run({"release-memory", "--weights"}, &out), 0) << out;
  EXPECT_NE(out.find("released_kv_cache"), std::string::npos) << out;
  EXPECT_TRUE(Info(stub()).has_memory_released());
  ASSERT_EQ(run({"info"}, &out), 0) << out;
  EXPECT_NE(out.find("memory_released"), std::string::npos) << out;
  ASSERT_EQ(run({"resume-memory"}, &out), 0) << out;
  EXPECT_NE(out.find("was_released      true"), std::string::npos) << out;
  EXPECT_FALSE(Info(stub()).has_memory_released());
}
#endif

}  // namespace
}  // namespace rollout::testing
