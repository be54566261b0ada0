// JoinWeightSyncGroup, LeaveWeightSyncGroup and UpdateWeightsFromBroadcast through the real gRPC
// stack. On the plain cpu backend: every request's validation (INVALID_ARGUMENT naming the
// field), the backend's refusal (FAILED_PRECONDITION naming the cuda backend), access control.
// With the runner wrapped in a fake weight-sync group (engine/fake_weight_sync.h, the trainer's
// and the other servers' ranks played by the test): the protocol end to end -- join, ServerInfo,
// duplicate joins, a broadcast bitwise equal to the same bytes streamed, a source rank that is
// the server's own, a broadcast that stops half way, the update slot -- without NCCL. The NCCL
// transport itself is proved on a GPU host: tests/gpu/nccl_broadcast.sh.
#include <chrono>
#include <cmath>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "engine/fake_weight_sync.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/reliability_util.h"
#include "tests/test_server.h"

namespace rollout::testing {
namespace {

namespace rel = ::rollout::testing::reliability;

constexpr char kDown[] = "model.layers.1.mlp.down_proj.weight";
constexpr char kNorm[] = "model.norm.weight";
constexpr uint64_t kBucketBytes = 16384;
const std::vector<uint32_t> kPrompt = {21, 8, 1000, 77, 3, 512, 64};

bool Contains(const std::string& text, const std::string& needle) {
  return text.find(needle) != std::string::npos;
}

v1::JoinWeightSyncGroupRequest JoinRequest(uint32_t rank = 1, uint32_t world = 2) {
  v1::JoinWeightSyncGroupRequest r;
  r.set_unique_id(std::string(kNcclUniqueIdBytes, '\x07'));
  r.set_rank(rank);
  r.set_world_size(world);
  r.set_timeout_seconds(5);
  return r;
}

grpc::Status Join(v1::RolloutService::Stub* stub,
                  const v1::JoinWeightSyncGroupRequest& request = JoinRequest(),
                  v1::JoinWeightSyncGroupResponse* response = nullptr,
                  const std::string& token = "") {
  grpc::ClientContext context;
  if (!token.empty()) context.AddMetadata("authorization", "Bearer " + token);
  v1::JoinWeightSyncGroupResponse ignored;
  return stub->JoinWeightSyncGroup(&context, request, response ? response : &ignored);
}

grpc::Status Leave(v1::RolloutService::Stub* stub, v1::LeaveWeightSyncGroupResponse* response,
                   const std::string& token = "") {
  grpc::ClientContext context;
  if (!token.empty()) context.AddMetadata("authorization", "Bearer " + token);
  return stub->LeaveWeightSyncGroup(&context, {}, response);
}

v1::UpdateWeightsFromBroadcastRequest BroadcastRequest(const std::vector<HostTensor>& tensors,
                                                       const std::string& version = "bc-1") {
  v1::UpdateWeightsFromBroadcastRequest r;
  r.set_version(version);
  r.set_policy(v1::IN_FLIGHT_POLICY_CONTINUE);
  for (const HostTensor& t : tensors) {
    v1::BroadcastTensor* b = r.add_tensors();
    b->set_name(t.name);
    b->set_dtype(DTypeName(t.dtype));
    for (int64_t d : t.shape) b->add_shape(static_cast<uint64_t>(d));
  }
  r.set_bucket_bytes(kBucketBytes);
  r.set_source_rank(0);
  r.set_timeout_seconds(0.5);
  return r;
}

grpc::Status Broadcast(v1::RolloutService::Stub* stub,
                       const v1::UpdateWeightsFromBroadcastRequest& request,
                       v1::UpdateWeightsResponse* response = nullptr,
                       const std::string& token = "") {
  grpc::ClientContext context;
  if (!token.empty()) context.AddMetadata("authorization", "Bearer " + token);
  v1::UpdateWeightsResponse ignored;
  return stub->UpdateWeightsFromBroadcast(&context, request, response ? response : &ignored);
}

std::string Generate(v1::RolloutService::Stub* stub) {
  v1::GenerateRequest request;
  *request.add_rollouts() = MakeRollout(kPrompt, 5, 8, 0.8f);
  GenerateOutcome out = RunGenerate(stub, request);
  EXPECT_TRUE(out.status.ok()) << out.status.error_message();
  return out.status.ok() ? Fingerprint(out.completions[0][0]) : "";
}

// The checkpoint's tensors, scaled (so that they differ from the served ones).
std::vector<HostTensor> NewTensors(const std::string& model_dir, float scale) {
  return {rel::ScaledBf16(rel::ReadCheckpointTensor(model_dir, kDown), scale),
          rel::ScaledBf16(rel::ReadCheckpointTensor(model_dir, kNorm), scale)};
}

// The fake group's source, sending `tensors` as BroadcastRequest declares them.
FakeBroadcastGroup::Broadcast Source(const v1::UpdateWeightsFromBroadcastRequest& request,
                                     const std::vector<HostTensor>& tensors) {
  std::vector<BroadcastTensor> declared;
  for (const HostTensor& t : tensors) declared.push_back({t.name, t.dtype, t.shape});
  FakeBroadcastGroup::Broadcast b;
  b.plan = PlanBroadcast(declared, request.bucket_bytes());
  b.stream = FakeBroadcastGroup::Stream(b.plan, tensors);
  return b;
}

class WeightsBroadcastE2eTest : public SharedServerTest {
 protected:
  static std::string ModelDir() { return server_->server->model_dir(); }
};

TEST_F(WeightsBroadcastE2eTest, MalformedJoinsAreInvalidArgumentNamingTheField) {
  std::vector<std::pair<v1::JoinWeightSyncGroupRequest, std::string>> cases;
  v1::JoinWeightSyncGroupRequest r = JoinRequest();
  r.set_unique_id(std::string(127, 'x'));
  cases.push_back({r, "unique_id has 127 bytes; an ncclUniqueId has 128"});
  r = JoinRequest();
  r.clear_unique_id();
  cases.push_back({r, "unique_id has 0 bytes"});
  r = JoinRequest(0, 1);
  cases.push_back({r, "world_size = 1"});
  r = JoinRequest(2, 2);
  cases.push_back({r, "rank = 2 is not a rank of a group of world_size 2"});
  r = JoinRequest();
  r.set_timeout_seconds(-1);
  cases.push_back({r, "timeout_seconds = -1"});
  r = JoinRequest();
  r.set_timeout_seconds(7200);
  cases.push_back({r, "timeout_seconds = 7200"});
  for (const auto& [request, expected] : cases) {
    const grpc::Status s = Join(stub(), request);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
    EXPECT_TRUE(Contains(s.error_message(), expected)) << s.error_message();
  }
}

TEST_F(WeightsBroadcastE2eTest,
       MalformedBroadcastsAreInvalidArgumentNamingTheFieldAndChangeNothing) {
  const std::string before = Generate(stub());
  const std::vector<HostTensor> tensors = NewTensors(ModelDir(), 2.0f);
  std::vector<std::pair<v1::UpdateWeightsFromBroadcastRequest, std::string>> cases;
  v1::UpdateWeightsFromBroadcastRequest r = BroadcastRequest(tensors);
  r.mutable_tensors(1)->set_name("model.layers.99.mlp.down_proj.weight");
  cases.push_back({r, "tensors[1]: tensor 'model.layers.99.mlp.down_proj.weight' is not a weight"});
  r = BroadcastRequest(tensors);
  r.mutable_tensors(0)->set_shape(0, 3);
  cases.push_back({r, "tensors[0]: tensor '" + std::string(kDown) + "': shape [3"});
  r = BroadcastRequest(tensors);
  r.mutable_tensors(0)->set_dtype("F32");
  cases.push_back({r, "dtype F32 given, the served tensor is BF16"});
  r = BroadcastRequest(tensors);
  r.mutable_tensors(0)->set_dtype("I64");
  cases.push_back({r, "dtype 'I64' is not BF16, F16 or F32"});
  r = BroadcastRequest({tensors[0], tensors[0]});
  cases.push_back({r, "is given twice"});
  r = BroadcastRequest({});
  cases.push_back({r, "tensors is empty"});
  r = BroadcastRequest(tensors);
  r.set_bucket_bytes(1000);
  cases.push_back({r, "bucket_bytes = 1000; it must be a positive multiple of 256"});
  r = BroadcastRequest(tensors);
  r.set_bucket_bytes(0);
  cases.push_back({r, "bucket_bytes = 0"});
  r = BroadcastRequest(tensors, "");
  cases.push_back({r, "version"});
  r = BroadcastRequest(tensors);
  r.set_timeout_seconds(std::nan(""));
  cases.push_back({r, "timeout_seconds = nan"});
  r = BroadcastRequest(tensors);
  r.set_expected_weight_digest("sha256:XYZ");
  cases.push_back({r, "expected_weight_digest 'sha256:XYZ' is not a weights digest"});
  for (const auto& [request, expected] : cases) {
    const grpc::Status s = Broadcast(stub(), request);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
    EXPECT_TRUE(Contains(s.error_message(), expected)) << s.error_message();
  }
  EXPECT_EQ(rel::FetchServerInfo(stub()).weight_version(), "0");
  EXPECT_EQ(Generate(stub()), before);
}

TEST_F(WeightsBroadcastE2eTest, TheCpuBackendRefusesGroupsAndBroadcastsNamingTheCudaBackend) {
  grpc::Status s = Join(stub(), JoinRequest());
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << s.error_message();
  EXPECT_TRUE(Contains(s.error_message(), "--backend cuda --device_weight_staging"))
      << s.error_message();
  s = Broadcast(stub(), BroadcastRequest(NewTensors(ModelDir(), 2.0f)));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << s.error_message();
  EXPECT_TRUE(Contains(s.error_message(), "the cpu backend cannot receive NCCL weight broadcasts"))
      << s.error_message();
  v1::LeaveWeightSyncGroupResponse left;
  s = Leave(stub(), &left);
  EXPECT_TRUE(s.ok()) << s.error_message();
  EXPECT_FALSE(left.was_member());
  EXPECT_FALSE(rel::FetchServerInfo(stub()).has_weight_sync_group());
}

TEST_F(WeightsBroadcastE2eTest, EveryWeightSyncRpcNeedsTheTokenAndAStrayCallerTouchesNoGroup) {
  FakeBroadcastGroup group;
  ServerOptions options;
  options.auth_token = "s3cret";
  options.wrap_runner_for_testing = [&group](std::unique_ptr<ModelRunner> runner) {
    return std::unique_ptr<ModelRunner>(
        std::make_unique<FakeBroadcastRunner>(std::move(runner), &group));
  };
  std::unique_ptr<TestServer> server = StartTestServer(options);
  ASSERT_TRUE(Join(server->stub.get(), JoinRequest(), nullptr, "s3cret").ok());
  v1::LeaveWeightSyncGroupResponse left;
  for (const std::string& token : {std::string(), std::string("wrong")}) {
    EXPECT_EQ(Join(server->stub.get(), JoinRequest(), nullptr, token).error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
    EXPECT_EQ(
        Broadcast(server->stub.get(), BroadcastRequest(NewTensors(server->server->model_dir(), 2)),
                  nullptr, token)
            .error_code(),
        grpc::StatusCode::UNAUTHENTICATED);
    EXPECT_EQ(Leave(server->stub.get(), &left, token).error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
  }
  EXPECT_EQ(group.handshakes(), 0) << "an unauthenticated broadcast never reaches the group";
  EXPECT_TRUE(rel::FetchServerInfo(server->stub.get()).has_weight_sync_group());
  EXPECT_TRUE(Leave(server->stub.get(), &left, "s3cret").ok());
  EXPECT_TRUE(left.was_member());
}

// A server whose runner joins the fake group.
struct FakeGroupServer {
  FakeBroadcastGroup group;
  std::unique_ptr<TestServer> server;
  FakeGroupServer() {
    ServerOptions options;
    options.wrap_runner_for_testing = [this](std::unique_ptr<ModelRunner> runner) {
      return std::unique_ptr<ModelRunner>(
          std::make_unique<FakeBroadcastRunner>(std::move(runner), &group));
    };
    server = StartTestServer(options);
  }
  v1::RolloutService::Stub* stub() { return server->stub.get(); }
};

TEST_F(WeightsBroadcastE2eTest, ABroadcastServesTheBitsAndDigestOfTheSameBytesStreamed) {
  FakeGroupServer fleet;
  v1::JoinWeightSyncGroupResponse joined;
  grpc::Status s = Join(fleet.stub(), JoinRequest(2, 4), &joined);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(joined.rank(), 2u);
  EXPECT_EQ(joined.world_size(), 4u);
  EXPECT_EQ(joined.nccl_version(), 22703u);
  EXPECT_EQ(fleet.group.last_spec().unique_id, std::string(kNcclUniqueIdBytes, '\x07'));
  const v1::ServerInfo info = rel::FetchServerInfo(fleet.stub());
  ASSERT_TRUE(info.has_weight_sync_group());
  EXPECT_EQ(info.weight_sync_group().rank(), 2u);
  EXPECT_EQ(info.weight_sync_group().world_size(), 4u);
  s = Join(fleet.stub(), JoinRequest(3, 4));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << s.error_message();
  EXPECT_TRUE(Contains(s.error_message(), "LeaveWeightSyncGroup first")) << s.error_message();

  const std::string model_dir = fleet.server->server->model_dir();
  const std::vector<HostTensor> tensors = NewTensors(model_dir, 3.0f);
  const v1::UpdateWeightsFromBroadcastRequest request = BroadcastRequest(tensors, "bc-1");
  fleet.group.Arm(Source(request, tensors));
  v1::UpdateWeightsResponse response;
  s = Broadcast(fleet.stub(), request, &response);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(response.version(), "bc-1");
  EXPECT_EQ(response.previous_version(), "0");
  EXPECT_EQ(response.tensors_updated(), 2u);
  EXPECT_EQ(response.bytes_received(), tensors[0].bytes.size() + tensors[1].bytes.size());
  EXPECT_GT(response.receive_seconds(), 0.0);
  EXPECT_GE(fleet.group.buckets_sent(), 3u);

  // The same bytes streamed into a plain server: same digest, same bits.
  std::unique_ptr<TestServer> streamed = StartTestServer();
  std::vector<v1::WeightsChunk> chunks(1);
  *chunks[0].mutable_header() =
      rel::MakeWeightsHeader("bc-1", v1::IN_FLIGHT_POLICY_CONTINUE, tensors);
  for (v1::WeightsChunk& c : rel::MakeDataChunks(tensors, 4096)) chunks.push_back(std::move(c));
  v1::UpdateWeightsResponse streamed_response;
  ASSERT_TRUE(rel::PushChunks(streamed->stub.get(), chunks, &streamed_response).ok());
  EXPECT_EQ(response.weight_digest(), streamed_response.weight_digest());
  EXPECT_EQ(rel::FetchServerInfo(fleet.stub()).weight_digest(), response.weight_digest());
  EXPECT_EQ(Generate(fleet.stub()), Generate(streamed->stub.get()));
}

TEST_F(WeightsBroadcastE2eTest, RefusalsInAGroupStopEveryRankWithoutBreakingIt) {
  FakeGroupServer fleet;
  ASSERT_TRUE(Join(fleet.stub(), JoinRequest(1, 3)).ok());
  const std::string before = Generate(fleet.stub());
  const std::vector<HostTensor> tensors = NewTensors(fleet.server->server->model_dir(), 3.0f);
  v1::UpdateWeightsFromBroadcastRequest request = BroadcastRequest(tensors);
  fleet.group.Arm(Source(request, tensors));

  v1::UpdateWeightsFromBroadcastRequest own = request;
  own.set_source_rank(1);
  grpc::Status s = Broadcast(fleet.stub(), own);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_TRUE(Contains(s.error_message(), "this server's own rank")) << s.error_message();
  // An invalid request in a group is refused at the handshake too.
  v1::UpdateWeightsFromBroadcastRequest bad = request;
  bad.set_bucket_bytes(1000);
  s = Broadcast(fleet.stub(), bad);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_EQ(fleet.group.handshakes(), 2);
  EXPECT_EQ(fleet.group.last_server_ready(), false);
  EXPECT_EQ(fleet.group.buckets_sent(), 0u);
  EXPECT_TRUE(rel::FetchServerInfo(fleet.stub()).has_weight_sync_group());
  EXPECT_EQ(Generate(fleet.stub()), before);
  s = Broadcast(fleet.stub(), request);
  EXPECT_TRUE(s.ok()) << s.error_message();
}

TEST_F(WeightsBroadcastE2eTest, ABroadcastThatStopsHalfWayIsDeadlineExceededAndChangesNothing) {
  FakeGroupServer fleet;
  ASSERT_TRUE(Join(fleet.stub()).ok());
  const std::string before = Generate(fleet.stub());
  const v1::ServerInfo info = rel::FetchServerInfo(fleet.stub());
  const std::vector<HostTensor> tensors = NewTensors(fleet.server->server->model_dir(), 3.0f);
  const v1::UpdateWeightsFromBroadcastRequest request = BroadcastRequest(tensors);
  FakeBroadcastGroup::Broadcast source = Source(request, tensors);
  source.stop_after = 2;
  fleet.group.Arm(source);
  v1::UpdateWeightsResponse response;
  const grpc::Status s = Broadcast(fleet.stub(), request, &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << s.error_message();
  EXPECT_TRUE(Contains(s.error_message(), "bucket 2 of")) << s.error_message();
  EXPECT_TRUE(Contains(s.error_message(), "join it again")) << s.error_message();
  const v1::ServerInfo after = rel::FetchServerInfo(fleet.stub());
  EXPECT_EQ(after.weight_version(), info.weight_version());
  EXPECT_EQ(after.weight_digest(), info.weight_digest());
  EXPECT_FALSE(after.has_weight_sync_group()) << "the aborted group was left";
  EXPECT_EQ(Generate(fleet.stub()), before);
  EXPECT_TRUE(Join(fleet.stub()).ok()) << "and can be joined again";
}

TEST_F(WeightsBroadcastE2eTest, ABroadcastWhileAnotherUpdateHoldsTheSlotIsAbortedAtTheHandshake) {
  FakeGroupServer fleet;
  ASSERT_TRUE(Join(fleet.stub()).ok());
  const std::vector<HostTensor> tensors = NewTensors(fleet.server->server->model_dir(), 3.0f);
  // A streamed update that has sent its header and not finished holds the update slot.
  grpc::ClientContext stream_context;
  v1::UpdateWeightsResponse stream_response;
  std::unique_ptr<grpc::ClientWriter<v1::WeightsChunk>> writer =
      fleet.stub()->UpdateWeights(&stream_context, &stream_response);
  v1::WeightsChunk header;
  *header.mutable_header() =
      rel::MakeWeightsHeader("other", v1::IN_FLIGHT_POLICY_CONTINUE, tensors);
  ASSERT_TRUE(writer->Write(header));
  while (!rel::FetchServerInfo(fleet.stub()).weight_update_in_progress()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  const v1::UpdateWeightsFromBroadcastRequest request = BroadcastRequest(tensors);
  fleet.group.Arm(Source(request, tensors));
  grpc::Status s = Broadcast(fleet.stub(), request);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::ABORTED) << s.error_message();
  EXPECT_TRUE(Contains(s.error_message(), "another weight update is in progress"))
      << s.error_message();
  EXPECT_EQ(fleet.group.handshakes(), 1) << "the refusal took part in the handshake";
  EXPECT_EQ(fleet.group.last_server_ready(), false);
  EXPECT_EQ(fleet.group.buckets_sent(), 0u);
  stream_context.TryCancel();
  writer->Finish();
  while (rel::FetchServerInfo(fleet.stub()).weight_update_in_progress()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  // Once the slot is free, the same broadcast goes through.
  s = Broadcast(fleet.stub(), request);
  EXPECT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(rel::FetchServerInfo(fleet.stub()).weight_version(), "bc-1");
}

}  // namespace
}  // namespace rollout::testing
