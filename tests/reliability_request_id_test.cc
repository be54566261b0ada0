// Request ids on a server with a token and --auth_all_rpcs off, where Generate needs no token:
// callers without it have ids of their own. They once shared the trainer's: an unauthenticated
// caller could probe which ids were in flight (ALREADY_EXISTS), take a trainer's next id first,
// and have the trainer's Abort end its job instead of the trainer's.
#include <chrono>
#include <future>
#include <string>
#include <vector>

#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/reliability_util.h"
#include "tests/test_server.h"

namespace rollout::testing {
namespace {

namespace rel = ::rollout::testing::reliability;

using std::chrono::seconds;

const std::vector<uint32_t> kPrompt = {17, 4, 901, 33, 2048, 7, 250, 3999, 12};
constexpr char kToken[] = "s3cret";

// A long Generate call, with or without the token, read on another thread once it started
// (or failed).
struct Call {
  grpc::ClientContext context;
  std::unique_ptr<grpc::ClientReader<v1::GenerateResponse>> reader;
  bool started = false;
  std::shared_future<GenerateOutcome> outcome;
};

std::unique_ptr<Call> StartCall(v1::RolloutService::Stub* stub, const std::string& id,
                                bool with_token) {
  auto call = std::make_unique<Call>();
  call->context.set_deadline(std::chrono::system_clock::now() + seconds(120));
  if (with_token) call->context.AddMetadata("authorization", std::string("Bearer ") + kToken);
  v1::GenerateRequest request;
  *request.add_rollouts() = MakeRollout(kPrompt, 1, 3000, 1.0f, id);
  request.mutable_rollouts(0)->mutable_sampling()->set_ignore_eos(true);
  call->reader = stub->Generate(&call->context, request);
  v1::GenerateResponse first;
  call->started = call->reader->Read(&first);
  Call* raw = call.get();
  call->outcome = std::async(std::launch::async, [raw] {
                    GenerateOutcome out;
                    v1::GenerateResponse response;
                    while (raw->reader->Read(&response)) {
                      if (response.has_completion())
                        out.completions.push_back({response.completion()});
                    }
                    out.status = raw->reader->Finish();
                    return out;
                  }).share();
  return call;
}

// The trainer's Abort (with the token) of `ids`, or of all when `ids` is empty.
grpc::Status CallAbort(v1::RolloutService::Stub* stub, const std::vector<std::string>& ids,
                       v1::AbortResponse* response) {
  grpc::ClientContext context;
  context.AddMetadata("authorization", std::string("Bearer ") + kToken);
  v1::AbortRequest request;
  for (const std::string& id : ids) request.add_request_ids(id);
  request.set_all(ids.empty());
  return stub->Abort(&context, request, response);
}

v1::AbortResponse AbortIds(v1::RolloutService::Stub* stub, const std::vector<std::string>& ids) {
  v1::AbortResponse response;
  EXPECT_TRUE(CallAbort(stub, ids, &response).ok());
  return response;
}

TEST(ReliabilityRequestIdTest, CallersWithoutTheTokenCannotProbeTakeOrAbortATrainersIds) {
  ServerOptions options;
  options.auth_token = kToken;
  options.max_running_samples = 8;
  std::unique_ptr<TestServer> server = StartTestServer(options);
  ASSERT_NE(server, nullptr);
  v1::RolloutService::Stub* stub = server->stub.get();

  // The trainer's id in flight is invisible to a caller without the token: its own call with
  // that id runs (no ALREADY_EXISTS that would reveal it).
  std::unique_ptr<Call> trainer = StartCall(stub, "step-1/0", /*with_token=*/true);
  ASSERT_TRUE(trainer->started) << trainer->outcome.get().status.error_message();
  std::unique_ptr<Call> prober = StartCall(stub, "step-1/0", /*with_token=*/false);
  EXPECT_TRUE(prober->started) << "the probe learnt the trainer's id is in flight: "
                               << prober->outcome.get().status.error_message();

  // An id taken first by a caller without the token is still the trainer's to use ...
  std::unique_ptr<Call> squatter = StartCall(stub, "step-2/0", /*with_token=*/false);
  ASSERT_TRUE(squatter->started) << squatter->outcome.get().status.error_message();
  std::unique_ptr<Call> next = StartCall(stub, "step-2/0", /*with_token=*/true);
  EXPECT_TRUE(next->started) << "the trainer's next id was taken: "
                             << next->outcome.get().status.error_message();

  // From here on nothing runs, so that no rollout ends by itself before the checks below (on a
  // GPU 3000 tokens take a few seconds): aborts still reach held work.
  {
    grpc::ClientContext pause_context;
    pause_context.AddMetadata("authorization", std::string("Bearer ") + kToken);
    v1::PauseResponse paused;
    ASSERT_TRUE(stub->Pause(&pause_context, {}, &paused).ok());
  }

  // ... and the trainer's Abort ends the trainer's rollout, not the other caller's.
  const v1::AbortResponse aborted = AbortIds(stub, {"step-2/0"});
  EXPECT_EQ(aborted.aborted_rollouts(), 1u);
  const GenerateOutcome ended = next->outcome.get();
  EXPECT_TRUE(ended.status.ok()) << ended.status.error_message();
  ASSERT_EQ(ended.completions.size(), 1u);
  EXPECT_EQ(ended.completions[0][0].finish_reason(), v1::FINISH_REASON_ABORT);
  EXPECT_EQ(squatter->outcome.wait_for(std::chrono::milliseconds(500)), std::future_status::timeout)
      << "the trainer's Abort ended another caller's job";

  // Within a scope ids stay unique: a second call without the token cannot reuse one.
  std::unique_ptr<Call> twice = StartCall(stub, "step-2/0", /*with_token=*/false);
  EXPECT_FALSE(twice->started);
  EXPECT_EQ(twice->outcome.get().status.error_code(), grpc::StatusCode::ALREADY_EXISTS);

  // Ids of callers without the token are not reachable by id at all; Abort all still ends them.
  const v1::AbortResponse unknown = AbortIds(stub, {"step-1/0", "step-2/0"});
  EXPECT_EQ(unknown.aborted_rollouts(), 1u);  // the trainer's step-1/0
  ASSERT_EQ(unknown.unknown_request_ids_size(), 1);
  EXPECT_EQ(unknown.unknown_request_ids(0), "step-2/0");
  v1::AbortResponse all;
  ASSERT_TRUE(CallAbort(stub, {}, &all).ok());
  for (Call* call : {trainer.get(), prober.get(), squatter.get()}) {
    EXPECT_TRUE(call->outcome.get().status.ok());
  }
  grpc::ClientContext resume_context;
  resume_context.AddMetadata("authorization", std::string("Bearer ") + kToken);
  v1::ResumeResponse resumed;
  EXPECT_TRUE(stub->Resume(&resume_context, {}, &resumed).ok());
  std::string last;
  EXPECT_TRUE(rel::WaitForQuiescence(stub, seconds(30), &last)) << last;
}

// Abort counts the rollouts it ends: not one of the call that finished already (it is unknown,
// and its id free for a resubmission while the call's other rollout runs), nor one named twice,
// nor again in an Abort of all. (All three counted, and the finished rollout's id answered
// ALREADY_EXISTS until its whole call ended; review24 finding 4.)
TEST(ReliabilityRequestIdTest, AbortCountsOnlyRunningRolloutsOnceAndAnEndedRolloutsIdIsFree) {
  ServerOptions options;
  options.auth_token = kToken;
  std::unique_ptr<TestServer> server = StartTestServer(options);
  ASSERT_NE(server, nullptr);
  v1::RolloutService::Stub* stub = server->stub.get();
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + seconds(120));
  context.AddMetadata("authorization", std::string("Bearer ") + kToken);
  v1::GenerateRequest request;
  *request.add_rollouts() = MakeRollout(kPrompt, 1, 3000, 1.0f, "long");
  *request.add_rollouts() = MakeRollout(kPrompt, 2, 2, 1.0f, "short");
  request.mutable_rollouts(0)->mutable_sampling()->set_ignore_eos(true);
  request.mutable_rollouts(1)->mutable_sampling()->set_ignore_eos(true);
  auto reader = stub->Generate(&context, request);
  v1::GenerateResponse response;
  bool short_done = false;
  while (!short_done && reader->Read(&response)) {
    short_done = response.has_completion() && response.completion().rollout_index() == 1;
  }
  ASSERT_TRUE(short_done);

  v1::AbortResponse ended = AbortIds(stub, {"short"});
  EXPECT_EQ(ended.aborted_rollouts(), 0u);
  ASSERT_EQ(ended.unknown_request_ids_size(), 1);
  EXPECT_EQ(ended.unknown_request_ids(0), "short");
  std::unique_ptr<Call> again = StartCall(stub, "short", /*with_token=*/true);
  EXPECT_TRUE(again->started) << "the ended rollout's id is still taken: "
                              << again->outcome.get().status.error_message();
  EXPECT_EQ(AbortIds(stub, {"short"}).aborted_rollouts(), 1u);  // the resubmission's

  const v1::AbortResponse twice = AbortIds(stub, {"long", "long", "nope", "nope"});
  EXPECT_EQ(twice.aborted_rollouts(), 1u);
  EXPECT_EQ(twice.unknown_request_ids_size(), 1) << "named twice, listed twice";
  v1::AbortResponse all;
  ASSERT_TRUE(CallAbort(stub, {}, &all).ok());
  EXPECT_EQ(all.aborted_rollouts(), 0u) << "aborted rollouts counted again";
  while (reader->Read(&response)) {
  }
  EXPECT_TRUE(reader->Finish().ok());
  EXPECT_TRUE(again->outcome.get().status.ok());
}

}  // namespace
}  // namespace rollout::testing
