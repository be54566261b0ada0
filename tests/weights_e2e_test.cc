// Weight hot-swap, pause/resume and access control through the real gRPC stack.
#include <chrono>
#include <cstring>
#include <functional>
#include <future>
#include <random>
#include <thread>

#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "model/random_model.h"
#include "model/safetensors.h"
#include "tests/reliability_util.h"
#include "tests/test_server.h"

namespace rollout::testing {
namespace {

using reliability::MakeDataChunks;
using reliability::MakeWeightsHeader;
using reliability::ReadCheckpointTensor;
using reliability::ScaledBf16;

constexpr char kTensor[] = "model.layers.1.mlp.down_proj.weight";
const std::vector<uint32_t> kPrompt = {21, 8, 1000, 77, 3, 512, 64};

struct PushOutcome {
  grpc::Status status;
  v1::UpdateWeightsResponse response;
};

PushOutcome Push(v1::RolloutService::Stub* stub, const v1::WeightsHeader& header,
                 const std::vector<v1::WeightsChunk>& data, const std::string& token = "",
                 bool cancel_midway = false) {
  PushOutcome out;
  grpc::ClientContext context;
  if (!token.empty()) context.AddMetadata("authorization", "Bearer " + token);
  auto writer = stub->UpdateWeights(&context, &out.response);
  v1::WeightsChunk first;
  *first.mutable_header() = header;
  bool ok = writer->Write(first);
  for (size_t i = 0; ok && i < data.size(); ++i) {
    if (cancel_midway && i == data.size() / 2) {
      context.TryCancel();
      break;
    }
    ok = writer->Write(data[i]);
  }
  writer->WritesDone();
  out.status = writer->Finish();
  return out;
}

std::string Generate(v1::RolloutService::Stub* stub, std::string* version = nullptr) {
  v1::GenerateRequest request;
  *request.add_rollouts() = MakeRollout(kPrompt, 5, 10, 0.8f);
  GenerateOutcome out = RunGenerate(stub, request);
  EXPECT_TRUE(out.status.ok()) << out.status.error_message();
  if (version != nullptr) *version = out.completions[0][0].weight_version();
  return Fingerprint(out.completions[0][0]);
}

class WeightsE2eTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ServerOptions options;
    options.metrics_port = reliability::PickFreePort();
    ASSERT_GT(options.metrics_port, 0);
    metrics_port_ = options.metrics_port;
    server_ = StartTestServer(options);
    ASSERT_NE(server_, nullptr);
    original_ = ReadCheckpointTensor(server_->server->model_dir(), kTensor);
  }
  v1::RolloutService::Stub* stub() { return server_->stub.get(); }
  // The weight-update counters on /metrics now.
  struct UpdateCounts {
    uint64_t ok = 0, failed = 0, timed = 0;  // timed: rollout_weight_update_seconds_count
  };
  UpdateCounts ScrapeUpdateCounts() const {
    const std::string page = reliability::HttpGet(metrics_port_, "/metrics");
    EXPECT_FALSE(page.empty()) << "no answer on port " << metrics_port_;
    return {reliability::MetricValue(page, "rollout_weight_updates_total{outcome=\"ok\"}"),
            reliability::MetricValue(page, "rollout_weight_updates_total{outcome=\"failed\"}"),
            reliability::MetricValue(page, "rollout_weight_update_seconds_count")};
  }
  std::unique_ptr<TestServer> server_;
  HostTensor original_;
  int metrics_port_ = 0;
};

TEST_F(WeightsE2eTest, PushChangesOutputsAndVersionAndOriginalBytesRestoreThemBitwise) {
  std::string version;
  const std::string before = Generate(stub(), &version);
  EXPECT_EQ(version, "0");
  const std::vector<HostTensor> changed = {ScaledBf16(original_, 2.5f)};
  PushOutcome push = Push(stub(), MakeWeightsHeader("step-1", v1::IN_FLIGHT_POLICY_DRAIN, changed),
                          MakeDataChunks(changed, 1000));
  ASSERT_TRUE(push.status.ok()) << push.status.error_message();
  EXPECT_EQ(push.response.version(), "step-1");
  EXPECT_EQ(push.response.previous_version(), "0");
  EXPECT_EQ(push.response.tensors_updated(), 1u);
  EXPECT_EQ(push.response.bytes_received(), original_.bytes.size());
  const std::string after = Generate(stub(), &version);
  EXPECT_EQ(version, "step-1");
  EXPECT_NE(after, before);
  PushOutcome back =
      Push(stub(), MakeWeightsHeader("step-2", v1::IN_FLIGHT_POLICY_ABORT, {original_}),
           MakeDataChunks({original_}, 1 << 20));
  ASSERT_TRUE(back.status.ok()) << back.status.error_message();
  EXPECT_EQ(Generate(stub()), before);
}

// A trainer's F32 tensor pushed to a bfloat16 model is cast on arrival, round to nearest even:
// it serves the bits, and gets the digest, of its BF16 cast pushed as such.
TEST_F(WeightsE2eTest, AnF32PushToABf16ModelServesItsBf16CastBitwise) {
  const HostTensor changed = ScaledBf16(original_, 2.5f);
  // Each F32 value three quarters of a BF16 ulp above a BF16 value: to nearest it rounds up to
  // the next BF16 (`up`); truncation would give the one below.
  HostTensor up = changed;
  HostTensor f32{changed.name, DType::kF32, changed.shape,
                 std::vector<uint8_t>(changed.bytes.size() * 2)};
  for (size_t i = 0; i < changed.bytes.size() / 2; ++i) {
    uint16_t h;
    std::memcpy(&h, &changed.bytes[2 * i], 2);
    uint32_t bits = static_cast<uint32_t>(h) << 16;
    if ((h & 0x7fff) != 0 && (h & 0x7f80) != 0x7f80) {  // finite and non-zero
      bits += 0xc000;
      const uint16_t next = h + 1;  // the next BF16 away from zero
      std::memcpy(&up.bytes[2 * i], &next, 2);
    }
    std::memcpy(&f32.bytes[4 * i], &bits, 4);
  }
  PushOutcome bf16 = Push(stub(), MakeWeightsHeader("bf16", v1::IN_FLIGHT_POLICY_DRAIN, {up}),
                          MakeDataChunks({up}, 4096));
  ASSERT_TRUE(bf16.status.ok()) << bf16.status.error_message();
  const std::string want = Generate(stub());
  PushOutcome back =
      Push(stub(), MakeWeightsHeader("back", v1::IN_FLIGHT_POLICY_DRAIN, {original_}),
           MakeDataChunks({original_}, 1 << 20));
  ASSERT_TRUE(back.status.ok());
  ASSERT_NE(Generate(stub()), want);
  // Chunks of 4095 bytes: most cut an F32 element in two.
  PushOutcome cast = Push(stub(), MakeWeightsHeader("f32", v1::IN_FLIGHT_POLICY_DRAIN, {f32}),
                          MakeDataChunks({f32}, 4095));
  ASSERT_TRUE(cast.status.ok()) << cast.status.error_message();
  EXPECT_EQ(cast.response.bytes_received(), f32.bytes.size());
  EXPECT_EQ(cast.response.weight_digest(), bf16.response.weight_digest());
  EXPECT_EQ(Generate(stub()), want);
}

TEST_F(WeightsE2eTest, EachBadUpdateIsRefusedAndTheOldWeightsServeBitwise) {
  const std::string before = Generate(stub());
  const std::vector<HostTensor> changed = {ScaledBf16(original_, 2.0f)};
  const std::vector<v1::WeightsChunk> good_data = MakeDataChunks(changed, 4096);
  struct Case {
    std::string name;
    std::function<void(v1::WeightsHeader*, std::vector<v1::WeightsChunk>*)> tamper;
    std::string expect;
  };
  const std::vector<Case> cases = {
      {"unknown tensor",
       [](v1::WeightsHeader* h, std::vector<v1::WeightsChunk>*) {
         h->mutable_tensors(0)->set_name("model.layers.1.mlp.missing.weight");
       },
       "not a weight of the served model"},
      {"wrong shape",
       [](v1::WeightsHeader* h, std::vector<v1::WeightsChunk>*) {
         h->mutable_tensors(0)->set_shape(0, 3);
       },
       "shape"},
      // Another float dtype is cast, so F32 needs its own byte count: BF16's is half of it.
      {"F32 declared, BF16's bytes sent",
       [](v1::WeightsHeader* h, std::vector<v1::WeightsChunk>*) {
         h->mutable_tensors(0)->set_dtype("F32");
       },
       "incomplete"},
      {"bad dtype name",
       [](v1::WeightsHeader* h, std::vector<v1::WeightsChunk>*) {
         h->mutable_tensors(0)->set_dtype("I64");
       },
       "dtype 'I64'"},
      {"empty version",
       [](v1::WeightsHeader* h, std::vector<v1::WeightsChunk>*) { h->clear_version(); },
       "version is empty"},
      {"a control character in the version",
       [](v1::WeightsHeader* h, std::vector<v1::WeightsChunk>*) { h->set_version("v\x1b[31m"); },
       "control character 0x1b at byte 1"},
      {"duplicate declaration",
       [](v1::WeightsHeader* h, std::vector<v1::WeightsChunk>*) {
         *h->add_tensors() = h->tensors(0);
       },
       "declared twice"},
      {"missing bytes",
       [](v1::WeightsHeader*, std::vector<v1::WeightsChunk>* d) { d->erase(d->begin() + 3); },
       "incomplete"},
      {"truncated stream",
       [](v1::WeightsHeader*, std::vector<v1::WeightsChunk>* d) { d->pop_back(); }, "incomplete"},
      {"overlap",
       [](v1::WeightsHeader*, std::vector<v1::WeightsChunk>* d) {
         d->at(2).mutable_data()->set_offset(d->at(2).data().offset() - 10);
       },
       "overlaps"},
      {"beyond the tensor",
       [](v1::WeightsHeader*, std::vector<v1::WeightsChunk>* d) {
         d->back().mutable_data()->set_offset(1u << 30);
       },
       "beyond its"},
      {"undeclared data",
       [](v1::WeightsHeader*, std::vector<v1::WeightsChunk>* d) {
         d->at(0).mutable_data()->set_name("model.norm.weight");
       },
       "did not declare"},
      {"second header",
       [](v1::WeightsHeader* h, std::vector<v1::WeightsChunk>* d) {
         *d->at(1).mutable_header() = *h;
       },
       "second WeightsHeader"},
  };
  for (const Case& c : cases) {
    v1::WeightsHeader header = MakeWeightsHeader("bad", v1::IN_FLIGHT_POLICY_DRAIN, changed);
    std::vector<v1::WeightsChunk> data = good_data;
    c.tamper(&header, &data);
    PushOutcome push = Push(stub(), header, data);
    EXPECT_EQ(push.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << c.name;
    EXPECT_NE(push.status.error_message().find(c.expect), std::string::npos)
        << c.name << ": " << push.status.error_message();
    std::string version;
    EXPECT_EQ(Generate(stub(), &version), before) << c.name;
    EXPECT_EQ(version, "0") << c.name;
  }
  // A stream cancelled halfway applies nothing either.
  PushOutcome cancelled =
      Push(stub(), MakeWeightsHeader("cancelled", v1::IN_FLIGHT_POLICY_DRAIN, changed), good_data,
           "", /*cancel_midway=*/true);
  EXPECT_EQ(cancelled.status.error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_EQ(Generate(stub()), before);
}

// Alerts on failed pushes read rollout_weight_updates_total{outcome="failed"}: a stream the
// server refuses counts there once (and once in the update-time histogram), wherever it failed
// -- at its header (before any update slot is taken), on a chunk, at its end, or cancelled --
// like a failed UpdateWeightsFromPath. Streamed refusals once went uncounted.
TEST_F(WeightsE2eTest, EachFailedStreamCountsOnceAsAFailedUpdate) {
  const std::vector<HostTensor> changed = {ScaledBf16(original_, 2.0f)};
  const std::vector<v1::WeightsChunk> data = MakeDataChunks(changed, 4096);
  auto header = [&changed] {
    return MakeWeightsHeader("bad", v1::IN_FLIGHT_POLICY_DRAIN, changed);
  };
  struct Case {
    std::string name;
    std::function<grpc::Status()> push;
    grpc::StatusCode code;
  };
  const std::vector<Case> cases = {
      {"wrong shape",
       [&] {
         v1::WeightsHeader h = header();
         h.mutable_tensors(0)->set_shape(0, 3);
         return Push(stub(), h, data).status;
       },
       grpc::StatusCode::INVALID_ARGUMENT},
      {"unknown tensor",
       [&] {
         v1::WeightsHeader h = header();
         h.mutable_tensors(0)->set_name("model.layers.1.mlp.missing.weight");
         return Push(stub(), h, data).status;
       },
       grpc::StatusCode::INVALID_ARGUMENT},
      {"no header", [&] { return reliability::PushChunks(stub(), data); },
       grpc::StatusCode::INVALID_ARGUMENT},
      {"overlapping chunk",
       [&] {
         std::vector<v1::WeightsChunk> d = data;
         d.at(2).mutable_data()->set_offset(d.at(2).data().offset() - 10);
         return Push(stub(), header(), d).status;
       },
       grpc::StatusCode::INVALID_ARGUMENT},
      {"truncated",
       [&] {
         std::vector<v1::WeightsChunk> d = data;
         d.pop_back();
         return Push(stub(), header(), d).status;
       },
       grpc::StatusCode::INVALID_ARGUMENT},
      {"cancelled midway",
       [&] { return Push(stub(), header(), data, "", /*cancel_midway=*/true).status; },
       grpc::StatusCode::CANCELLED},
  };
  for (const Case& c : cases) {
    const UpdateCounts before = ScrapeUpdateCounts();
    const grpc::Status status = c.push();
    EXPECT_EQ(status.error_code(), c.code) << c.name << ": " << status.error_message();
    // The server counts a failure before it answers; a cancel it learns of some time after the
    // client.
    UpdateCounts after = ScrapeUpdateCounts();
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (after.failed == before.failed && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
      after = ScrapeUpdateCounts();
    }
    EXPECT_EQ(after.failed, before.failed + 1) << c.name;
    EXPECT_EQ(after.timed, before.timed + 1) << c.name;
    EXPECT_EQ(after.ok, before.ok) << c.name;
  }
  // A good push counts as ok, and not as failed.
  const UpdateCounts before = ScrapeUpdateCounts();
  ASSERT_TRUE(Push(stub(), MakeWeightsHeader("good", v1::IN_FLIGHT_POLICY_DRAIN, changed), data)
                  .status.ok());
  const UpdateCounts after = ScrapeUpdateCounts();
  EXPECT_EQ(after.ok, before.ok + 1);
  EXPECT_EQ(after.failed, before.failed);
  EXPECT_EQ(after.timed, before.timed + 1);
}

TEST_F(WeightsE2eTest, ASecondConcurrentUpdateIsRefusedWhileTheFirstStreams) {
  const std::vector<HostTensor> changed = {ScaledBf16(original_, 2.0f)};
  grpc::ClientContext context;
  v1::UpdateWeightsResponse response;
  auto writer = stub()->UpdateWeights(&context, &response);
  v1::WeightsChunk first;
  *first.mutable_header() = MakeWeightsHeader("first", v1::IN_FLIGHT_POLICY_DRAIN, changed);
  ASSERT_TRUE(writer->Write(first));
  // The server claims the slot when it reads the header.
  while (!reliability::FetchServerInfo(stub()).weight_update_in_progress()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  grpc::Status second;
  for (int i = 0; i < 50; ++i) {
    second = Push(stub(), MakeWeightsHeader("second", v1::IN_FLIGHT_POLICY_DRAIN, changed),
                  MakeDataChunks(changed, 1 << 20))
                 .status;
    if (second.error_code() == grpc::StatusCode::ABORTED) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_EQ(second.error_code(), grpc::StatusCode::ABORTED);
  EXPECT_NE(second.error_message().find("another weight update"), std::string::npos);
  // As for UpdateWeightsFromPath, a call refused for the update in progress failed no update.
  EXPECT_EQ(ScrapeUpdateCounts().failed, 0u);
  for (const v1::WeightsChunk& c : MakeDataChunks(changed, 1 << 20)) ASSERT_TRUE(writer->Write(c));
  writer->WritesDone();
  ASSERT_TRUE(writer->Finish().ok());
  EXPECT_EQ(response.version(), "first");
}

TEST_F(WeightsE2eTest, APathUpdateIsRefusedWhileAStreamStagesAndChangesNothing) {
  // Both kinds stage in the one arena: the slot admits one update of either kind.
  using reliability::FetchServerInfo;
  const std::vector<HostTensor> changed = {ScaledBf16(original_, 2.0f)};
  grpc::ClientContext context;
  v1::UpdateWeightsResponse response;
  auto writer = stub()->UpdateWeights(&context, &response);
  v1::WeightsChunk first;
  *first.mutable_header() = MakeWeightsHeader("streamed", v1::IN_FLIGHT_POLICY_DRAIN, changed);
  ASSERT_TRUE(writer->Write(first));
  const std::vector<v1::WeightsChunk> data = MakeDataChunks(changed, 1 << 16);
  ASSERT_TRUE(writer->Write(data[0]));
  // The server claims the slot when it reads the header.
  while (!FetchServerInfo(stub()).weight_update_in_progress()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  grpc::Status refused;
  for (int i = 0; i < 50; ++i) {
    grpc::ClientContext path_context;
    v1::UpdateWeightsFromPathRequest request;
    request.set_path(server_->server->model_dir());
    request.set_version("from-path");
    v1::UpdateWeightsResponse path_response;
    refused = stub()->UpdateWeightsFromPath(&path_context, request, &path_response);
    if (refused.error_code() == grpc::StatusCode::ABORTED) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::ABORTED) << refused.error_message();
  for (size_t i = 1; i < data.size(); ++i) ASSERT_TRUE(writer->Write(data[i]));
  writer->WritesDone();
  ASSERT_TRUE(writer->Finish().ok());
  EXPECT_EQ(FetchServerInfo(stub()).weight_version(), "streamed");
  EXPECT_EQ(FetchServerInfo(stub()).weight_digest(), response.weight_digest());
}

TEST_F(WeightsE2eTest, AnUpdateRightAfterAFailedOneIsStagedAtOnce) {
  // A stream the server fails (mid-stream, or at its end) gives the staging memory back before
  // its caller hears back, so a retry at once is never refused as "in progress". (A stream the
  // client cancels is another matter: the server learns of it some time after the client.)
  const std::vector<HostTensor> changed = {ScaledBf16(original_, 2.0f)};
  const std::vector<v1::WeightsChunk> data = MakeDataChunks(changed, 1 << 14);
  std::vector<v1::WeightsChunk> overlapping = data, truncated = data;
  overlapping.back().mutable_data()->set_offset(0);
  truncated.pop_back();
  for (int round = 0; round < 6; ++round) {
    const std::string version = "good-" + std::to_string(round);
    PushOutcome failed = Push(stub(), MakeWeightsHeader("bad", v1::IN_FLIGHT_POLICY_DRAIN, changed),
                              round % 2 == 0 ? overlapping : truncated);
    EXPECT_EQ(failed.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << round;
    PushOutcome good =
        Push(stub(), MakeWeightsHeader(version, v1::IN_FLIGHT_POLICY_DRAIN, changed), data);
    ASSERT_TRUE(good.status.ok()) << round << ": " << good.status.error_message();
    EXPECT_EQ(good.response.version(), version);
  }
}

TEST_F(WeightsE2eTest, TheResponseSplitsTheTimeAndOnlyTheFirstUpdateSetsUpTheStaging) {
  const std::vector<HostTensor> changed = {ScaledBf16(original_, 2.0f)};
  std::vector<v1::UpdateWeightsResponse> responses;
  for (const char* version : {"first", "second", "third"}) {
    PushOutcome push = Push(stub(), MakeWeightsHeader(version, v1::IN_FLIGHT_POLICY_DRAIN, changed),
                            MakeDataChunks(changed, 1 << 16));
    ASSERT_TRUE(push.status.ok()) << push.status.error_message();
    responses.push_back(push.response);
  }
  for (size_t i = 0; i < responses.size(); ++i) {
    const v1::UpdateWeightsResponse& r = responses[i];
    EXPECT_GT(r.receive_seconds(), 0.0) << i;
    EXPECT_GE(r.digest_wait_seconds(), 0.0) << i;
    EXPECT_GT(r.device_copy_seconds(), 0.0) << i;
    EXPECT_GE(r.engine_wait_seconds(), 0.0) << i;
    // The engine's wait and copy are parts of the swap the reactor timed around them.
    EXPECT_GE(r.swap_seconds() + 1e-3, r.engine_wait_seconds() + r.device_copy_seconds()) << i;
    EXPECT_LE(r.staging_setup_seconds(), r.receive_seconds()) << i;
    if (i > 0) {
      EXPECT_EQ(r.staging_setup_seconds(), 0.0) << "update " << i << " allocated";
    }
  }
}

// Starts a long generation, waits for its first tokens, then pushes with `policy`.
struct PolicyRun {
  v1::Completion completion;
  PushOutcome push;
};

PolicyRun RunWithUpdate(v1::RolloutService::Stub* stub, v1::InFlightPolicy policy,
                        const std::vector<HostTensor>& tensors) {
  PolicyRun run;
  v1::GenerateRequest request;
  *request.add_rollouts() = MakeRollout(kPrompt, 9, 400, 0.8f);
  request.mutable_rollouts(0)->mutable_sampling()->set_ignore_eos(true);
  grpc::ClientContext context;
  auto reader = stub->Generate(&context, request);
  v1::GenerateResponse response;
  EXPECT_TRUE(reader->Read(&response));
  auto pushed = std::async(std::launch::async, [&] {
    return Push(stub, MakeWeightsHeader("new", policy, tensors), MakeDataChunks(tensors, 1 << 20));
  });
  while (reader->Read(&response)) {
    if (response.has_completion()) run.completion = response.completion();
  }
  EXPECT_TRUE(reader->Finish().ok());
  run.push = pushed.get();
  return run;
}

TEST_F(WeightsE2eTest, AbortPolicyEndsInFlightSamples) {
  PolicyRun run = RunWithUpdate(stub(), v1::IN_FLIGHT_POLICY_ABORT, {ScaledBf16(original_, 2.0f)});
  ASSERT_TRUE(run.push.status.ok()) << run.push.status.error_message();
  EXPECT_EQ(run.push.response.aborted_samples(), 1u);
  EXPECT_EQ(run.completion.finish_reason(), v1::FINISH_REASON_ABORT);
  EXPECT_LT(run.completion.token_ids_size(), 400);
}

// A Score call of 4 x 3000 tokens (many steps of 512), once its first chunk was computed.
std::future<grpc::Status> ScoreInFlight(v1::RolloutService::Stub* stub) {
  auto request = std::make_shared<v1::ScoreRequest>();
  std::mt19937 rng(26);
  for (int s = 0; s < 4; ++s) {
    v1::ScoreSequence* seq = request->add_sequences();
    for (int t = 0; t < 3000; ++t) seq->add_token_ids(3 + rng() % 4000);
    seq->set_start(1);
  }
  const uint64_t prefilled_before = reliability::FetchServerInfo(stub).counters().prefilled_tokens();
  std::future<grpc::Status> scored = std::async(std::launch::async, [stub, request] {
    grpc::ClientContext context;
    v1::ScoreResponse response;
    return stub->Score(&context, *request, &response);
  });
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (reliability::FetchServerInfo(stub).counters().prefilled_tokens() == prefilled_before &&
         std::chrono::steady_clock::now() < give_up) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return scored;
}

// A Score call in flight when an ABORT update swaps fails ABORTED naming the update (it named
// "server shutting down or Abort all", which sent a trainer looking for a dying replica:
// review26 finding 2).
TEST_F(WeightsE2eTest, AbortPolicyEndsAScoreInFlightNamingTheUpdate) {
  std::future<grpc::Status> scored = ScoreInFlight(stub());
  const std::vector<HostTensor> changed = {ScaledBf16(original_, 2.0f)};
  PushOutcome push = Push(stub(), MakeWeightsHeader("sa-1", v1::IN_FLIGHT_POLICY_ABORT, changed),
                          MakeDataChunks(changed, 1 << 20));
  ASSERT_TRUE(push.status.ok()) << push.status.error_message();
  const grpc::Status s = scored.get();
  ASSERT_EQ(s.error_code(), grpc::StatusCode::ABORTED)
      << "the Score ended before the update: " << s.error_message();
  EXPECT_NE(s.error_message().find("a weight update to 'sa-1' with policy ABORT"),
            std::string::npos)
      << s.error_message();
  EXPECT_EQ(push.response.aborted_samples(), 4u);
}

// An Abort of all ends a Score call in flight too, and its response says so (it counted only
// rollouts, so a trainer saw 0 while its Score failed: review26 observation); once.
TEST_F(WeightsE2eTest, AbortOfAllCountsTheScoreCallItEnds) {
  std::future<grpc::Status> scored = ScoreInFlight(stub());
  v1::AbortRequest all;
  all.set_all(true);
  v1::AbortResponse first, second;
  {
    grpc::ClientContext context;
    ASSERT_TRUE(stub()->Abort(&context, all, &first).ok());
  }
  {
    grpc::ClientContext context;
    ASSERT_TRUE(stub()->Abort(&context, all, &second).ok());
  }
  const grpc::Status s = scored.get();
  ASSERT_EQ(s.error_code(), grpc::StatusCode::ABORTED)
      << "the Score ended before the Abort: " << s.error_message();
  EXPECT_NE(s.error_message().find("an Abort of all rollouts"), std::string::npos)
      << s.error_message();
  EXPECT_EQ(first.aborted_rollouts(), 0u);
  EXPECT_EQ(first.aborted_score_calls(), 1u);
  EXPECT_EQ(second.aborted_score_calls(), 0u) << "the Score call was counted again";
  // A Score call that finished is not counted either.
  v1::ScoreRequest small;
  for (int s = 0; s < 4; ++s) small.add_sequences();
  for (int i = 0; i < small.sequences_size(); ++i) {
    for (uint32_t t = 3; t < 40; ++t) small.mutable_sequences(i)->add_token_ids(t + i);
    small.mutable_sequences(i)->set_start(1);
  }
  {
    grpc::ClientContext context;
    v1::ScoreResponse response;
    ASSERT_TRUE(stub()->Score(&context, small, &response).ok());
  }
  grpc::ClientContext context;
  v1::AbortResponse third;
  ASSERT_TRUE(stub()->Abort(&context, all, &third).ok());
  EXPECT_EQ(third.aborted_score_calls(), 0u) << "a finished Score call was counted";
}

TEST_F(WeightsE2eTest, DrainPolicyFinishesInFlightSamplesOnTheOldWeights) {
  PolicyRun run = RunWithUpdate(stub(), v1::IN_FLIGHT_POLICY_DRAIN, {ScaledBf16(original_, 2.0f)});
  ASSERT_TRUE(run.push.status.ok()) << run.push.status.error_message();
  EXPECT_EQ(run.completion.finish_reason(), v1::FINISH_REASON_LENGTH);
  EXPECT_EQ(run.completion.weight_version(), "0");
  ASSERT_EQ(run.completion.version_spans_size(), 1);
  EXPECT_EQ(run.completion.version_spans(0).last_token(), 399u);
  std::string version;
  Generate(stub(), &version);
  EXPECT_EQ(version, "new");
}

TEST_F(WeightsE2eTest, ContinuePolicyReportsTheVersionOfEveryToken) {
  PolicyRun run =
      RunWithUpdate(stub(), v1::IN_FLIGHT_POLICY_CONTINUE, {ScaledBf16(original_, 2.0f)});
  ASSERT_TRUE(run.push.status.ok()) << run.push.status.error_message();
  const v1::Completion& c = run.completion;
  EXPECT_EQ(c.finish_reason(), v1::FINISH_REASON_LENGTH);
  EXPECT_EQ(c.weight_version(), "new");
  ASSERT_EQ(c.version_spans_size(), 2);
  EXPECT_EQ(c.version_spans(0).version(), "0");
  EXPECT_EQ(c.version_spans(0).first_token(), 0u);
  EXPECT_EQ(c.version_spans(1).version(), "new");
  EXPECT_EQ(c.version_spans(1).first_token(), c.version_spans(0).last_token() + 1);
  EXPECT_EQ(c.version_spans(1).last_token(), 399u);
}

// Versions bound to bytes (docs/api.md, "Weight digests"): ServerInfo and every completion carry
// the served weights' digest; reusing the served name for other bytes is refused with nothing
// changed; the same bytes give the same digest under any name and along any path.
TEST_F(WeightsE2eTest, AVersionNameIsBoundToItsBytesByADigest) {
  using reliability::FetchServerInfo;
  const std::string boot = FetchServerInfo(stub()).weight_digest();
  ASSERT_EQ(boot.rfind("sha256:", 0), 0u) << boot;
  v1::GenerateRequest request;
  *request.add_rollouts() = MakeRollout(kPrompt, 5, 10, 0.8f);
  GenerateOutcome first = RunGenerate(stub(), request);
  ASSERT_TRUE(first.status.ok()) << first.status.error_message();
  EXPECT_EQ(first.completions[0][0].weight_digest(), boot);

  const std::vector<HostTensor> changed = {ScaledBf16(original_, 2.5f)};
  PushOutcome reuse = Push(stub(), MakeWeightsHeader("0", v1::IN_FLIGHT_POLICY_DRAIN, changed),
                           MakeDataChunks(changed, 1000));
  EXPECT_EQ(reuse.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION)
      << reuse.status.error_message();
  EXPECT_NE(reuse.status.error_message().find("new version name"), std::string::npos)
      << reuse.status.error_message();
  EXPECT_EQ(FetchServerInfo(stub()).weight_digest(), boot);
  EXPECT_EQ(FetchServerInfo(stub()).weight_version(), "0");
  EXPECT_EQ(Generate(stub()), Fingerprint(first.completions[0][0])) << "served bits unchanged";

  PushOutcome renamed =
      Push(stub(), MakeWeightsHeader("step-1", v1::IN_FLIGHT_POLICY_DRAIN, changed),
           MakeDataChunks(changed, 777));
  ASSERT_TRUE(renamed.status.ok()) << renamed.status.error_message();
  const std::string changed_digest = renamed.response.weight_digest();
  EXPECT_NE(changed_digest, boot);
  EXPECT_EQ(FetchServerInfo(stub()).weight_digest(), changed_digest);
  // The boot checkpoint read back from its path under another name: the boot digest.
  grpc::ClientContext context;
  v1::UpdateWeightsFromPathRequest from_path;
  from_path.set_path(server_->server->model_dir());
  from_path.set_version("boot-again");
  v1::UpdateWeightsResponse response;
  ASSERT_TRUE(stub()->UpdateWeightsFromPath(&context, from_path, &response).ok());
  EXPECT_EQ(response.weight_digest(), boot);
  EXPECT_EQ(FetchServerInfo(stub()).weight_digest(), boot);

  // A name served earlier stays bound to its bytes: "step-1" (the changed weights) again with
  // other bytes is refused though "boot-again" serves now (it was accepted: review26 finding 6),
  // and with its own bytes it serves again.
  const std::vector<HostTensor> other = {ScaledBf16(original_, 3.0f)};
  PushOutcome earlier = Push(stub(), MakeWeightsHeader("step-1", v1::IN_FLIGHT_POLICY_DRAIN, other),
                             MakeDataChunks(other, 1000));
  EXPECT_EQ(earlier.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION)
      << earlier.status.error_message();
  EXPECT_NE(earlier.status.error_message().find("version 'step-1' was served with weights " +
                                                changed_digest),
            std::string::npos)
      << earlier.status.error_message();
  EXPECT_EQ(FetchServerInfo(stub()).weight_version(), "boot-again");
  PushOutcome same = Push(stub(), MakeWeightsHeader("step-1", v1::IN_FLIGHT_POLICY_DRAIN, changed),
                          MakeDataChunks(changed, 1000));
  ASSERT_TRUE(same.status.ok()) << same.status.error_message();
  EXPECT_EQ(same.response.weight_digest(), changed_digest);
}

TEST_F(WeightsE2eTest, UpdateFromPathSwapsToAnotherCheckpointAndBack) {
  const std::string before = Generate(stub());
  const std::string other = ::testing::TempDir() + "weights-e2e-other-model";
  RandomModelOptions options;
  options.preset = "small";
  options.seed = 7;
  ASSERT_TRUE(WriteRandomModel(options, other).ok());
  for (const auto& [path, version] : {std::pair<std::string, std::string>{other, "seed7"},
                                      {server_->server->model_dir(), "seed0"}}) {
    grpc::ClientContext context;
    v1::UpdateWeightsFromPathRequest request;
    request.set_path(path);
    request.set_version(version);
    v1::UpdateWeightsResponse response;
    ASSERT_TRUE(stub()->UpdateWeightsFromPath(&context, request, &response).ok());
    EXPECT_EQ(response.version(), version);
    std::string served;
    const std::string out = Generate(stub(), &served);
    EXPECT_EQ(served, version);
    if (version == "seed7") {
      EXPECT_NE(out, before);
    }
    if (version == "seed0") {
      EXPECT_EQ(out, before);
    }
  }
  grpc::ClientContext context;
  v1::UpdateWeightsFromPathRequest missing;
  missing.set_path("/nonexistent/model");
  missing.set_version("x");
  v1::UpdateWeightsResponse response;
  grpc::Status status = stub()->UpdateWeightsFromPath(&context, missing, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_NE(status.error_message().find("/nonexistent/model"), std::string::npos);
}

// Pause while a DRAIN update waits for samples in flight is FAILED_PRECONDITION: accepted, it
// held the update (and its slot) until a Resume (review26 finding 1).
TEST_F(WeightsE2eTest, PauseWhileADrainUpdateWaitsIsRefused) {
  v1::GenerateRequest request;
  // 4000 tokens (the small model's context): seconds of decode, ended below by an Abort.
  *request.add_rollouts() = MakeRollout(kPrompt, 9, 4000, 0.8f);
  request.mutable_rollouts(0)->mutable_sampling()->set_ignore_eos(true);
  auto generated = std::async(std::launch::async, [&] { return RunGenerate(stub(), request); });
  const std::vector<HostTensor> changed = {ScaledBf16(original_, 2.0f)};
  auto pushed = std::async(std::launch::async, [&] {
    return Push(stub(), MakeWeightsHeader("pd-1", v1::IN_FLIGHT_POLICY_DRAIN, changed),
                MakeDataChunks(changed, 1 << 20));
  });
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (!reliability::FetchServerInfo(stub()).weight_update_in_progress() &&
         std::chrono::steady_clock::now() < give_up) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // the engine takes the update
  grpc::ClientContext pause_context;
  v1::PauseResponse paused;
  const grpc::Status s = stub()->Pause(&pause_context, {}, &paused);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << s.error_message();
  EXPECT_NE(s.error_message().find("DRAIN weight update waits"), std::string::npos)
      << s.error_message();
  EXPECT_FALSE(reliability::FetchServerInfo(stub()).paused());
  // The sample ends (Abort all), the update applies.
  grpc::ClientContext abort_context;
  v1::AbortRequest abort;
  abort.set_all(true);
  v1::AbortResponse aborted;
  ASSERT_TRUE(stub()->Abort(&abort_context, abort, &aborted).ok());
  EXPECT_TRUE(pushed.get().status.ok());
  EXPECT_TRUE(generated.get().status.ok());
}

TEST_F(WeightsE2eTest, PauseHoldsRequestsUntilResume) {
  const std::string expected = Generate(stub());
  grpc::ClientContext pause_context;
  v1::PauseResponse paused;
  ASSERT_TRUE(stub()->Pause(&pause_context, {}, &paused).ok());
  EXPECT_FALSE(paused.was_paused());
  grpc::ClientContext info_context;
  v1::ServerInfo info;
  ASSERT_TRUE(stub()->GetServerInfo(&info_context, {}, &info).ok());
  EXPECT_TRUE(info.paused());
  auto held = std::async(std::launch::async, [&] { return Generate(stub()); });
  EXPECT_EQ(held.wait_for(std::chrono::milliseconds(300)), std::future_status::timeout);
  grpc::ClientContext resume_context;
  v1::ResumeResponse resumed;
  ASSERT_TRUE(stub()->Resume(&resume_context, {}, &resumed).ok());
  EXPECT_TRUE(resumed.was_paused());
  EXPECT_EQ(held.get(), expected);
}

TEST(AccessControlE2eTest, ControlCallsNeedTheTokenAndNothingChangesWithoutIt) {
  ServerOptions options;
  options.auth_token = "s3cret";
  std::unique_ptr<TestServer> server = StartTestServer(options);
  ASSERT_NE(server, nullptr);
  v1::RolloutService::Stub* stub = server->stub.get();
  const std::string before = Generate(stub);  // Generate stays open
  const HostTensor original = ReadCheckpointTensor(server->server->model_dir(), kTensor);
  const std::vector<HostTensor> changed = {ScaledBf16(original, 2.0f)};
  for (const std::string& token : {std::string(), std::string("wrong")}) {
    PushOutcome push = Push(stub, MakeWeightsHeader("x", v1::IN_FLIGHT_POLICY_DRAIN, changed),
                            MakeDataChunks(changed, 1 << 20), token);
    EXPECT_EQ(push.status.error_code(), grpc::StatusCode::UNAUTHENTICATED) << token;
    grpc::ClientContext context;
    if (!token.empty()) context.AddMetadata("authorization", "Bearer " + token);
    v1::PauseResponse paused;
    EXPECT_EQ(stub->Pause(&context, {}, &paused).error_code(), grpc::StatusCode::UNAUTHENTICATED);
    grpc::ClientContext flush_context;
    v1::FlushCacheResponse flushed;
    EXPECT_EQ(stub->FlushCache(&flush_context, {}, &flushed).error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
    grpc::ClientContext abort_context;
    v1::AbortRequest abort;
    abort.set_all(true);
    v1::AbortResponse aborted;
    EXPECT_EQ(stub->Abort(&abort_context, abort, &aborted).error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
  }
  EXPECT_EQ(Generate(stub), before) << "refused calls change nothing";
  PushOutcome push = Push(stub, MakeWeightsHeader("x", v1::IN_FLIGHT_POLICY_DRAIN, changed),
                          MakeDataChunks(changed, 1 << 20), "s3cret");
  EXPECT_TRUE(push.status.ok()) << push.status.error_message();
  EXPECT_NE(Generate(stub), before);
}

TEST(AccessControlE2eTest, AllRpcsModeProtectsGenerateToo) {
  ServerOptions options;
  options.auth_token = "s3cret";
  options.auth_all_rpcs = true;
  std::unique_ptr<TestServer> server = StartTestServer(options);
  ASSERT_NE(server, nullptr);
  v1::GenerateRequest request;
  *request.add_rollouts() = MakeRollout(kPrompt, 5, 4, 0.8f);
  GenerateOutcome out = RunGenerate(server->stub.get(), request);
  EXPECT_EQ(out.status.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_TRUE(out.responses.empty());
  grpc::ClientContext context;
  context.AddMetadata("authorization", "Bearer s3cret");
  v1::ServerInfo info;
  ASSERT_TRUE(server->stub->GetServerInfo(&context, {}, &info).ok());
  EXPECT_TRUE(info.auth_required_for_generate());
}

}  // namespace
}  // namespace rollout::testing
