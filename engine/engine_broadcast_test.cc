// Weight updates by NCCL broadcast (engine/weight_sync.h), driven offline through the engine with
// a fake group (engine/fake_weight_sync.h) whose other ranks the test plays and a host staging
// that hashes bucket by bucket as the cuda backend does on the device: the receive off the engine
// thread, the handshake, buckets, timeouts, digests and the atomic swap, without NCCL or a GPU.
#include <atomic>
#include <chrono>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "engine/engine.h"
#include "engine/engine_test_util.h"
#include "engine/fake_weight_sync.h"
#include "engine/weight_sync.h"
#include "gtest/gtest.h"
#include "model/random_model.h"
#include "runner/cpu/cpu_model_runner.h"

namespace rollout {
namespace {

using testing::FakeBroadcastGroup;
using testing::FakeBroadcastRunner;

constexpr char kDown[] = "model.layers.0.mlp.down_proj.weight";  // [256, 768] bf16: 6 leaves
constexpr char kUp[] = "model.layers.0.mlp.up_proj.weight";
constexpr char kNorm[] = "model.layers.1.input_layernorm.weight";  // 512 bytes
// Buckets that cut tensors and leaves at places of their own (a multiple of 256).
constexpr uint64_t kBucketBytes = 65536 + 4096;
constexpr std::chrono::milliseconds kShort{300};

const std::string& ModelDir() {
  static const std::string dir = [] {
    std::string d = ::testing::TempDir() + "engine-broadcast-test-small";
    RandomModelOptions options;
    options.preset = "small";  // slow enough on the CPU that a long sample is still running
    options.seed = 9;
    EXPECT_TRUE(WriteRandomModel(options, d).ok());
    return d;
  }();
  return dir;
}

// An engine serving the model as "v0" with its load digests; its runner receives broadcasts from
// `group` when set, else it is the plain CPU runner (which cannot).
std::unique_ptr<Engine> MakeEngine(FakeBroadcastGroup* group,
                                   FakeBroadcastRunner** fake = nullptr) {
  auto ck = Checkpoint::Open(ModelDir());
  EXPECT_TRUE(ck.ok());
  auto cpu = CpuModelRunner::Create(**ck, {});
  EXPECT_TRUE(cpu.ok());
  EngineOptions options;
  options.weight_version = "v0";
  options.weight_digests = DigestCheckpoint(**ck, (*cpu)->weight_specs());
  std::unique_ptr<ModelRunner> runner = *std::move(cpu);
  if (group != nullptr) {
    auto wrapped = std::make_unique<FakeBroadcastRunner>(std::move(runner), group);
    if (fake != nullptr) *fake = wrapped.get();
    runner = std::move(wrapped);
  }
  auto engine = Engine::Create(std::move(runner), options);
  EXPECT_TRUE(engine.ok());
  return *std::move(engine);
}

// The checkpoint's bytes of `name`, each bf16 value times `scale`.
HostTensor Scaled(const std::string& name, float scale) {
  return ScaledCheckpointTensor(ModelDir(), name, scale);
}

std::vector<BroadcastTensor> Declared(const std::vector<HostTensor>& tensors) {
  std::vector<BroadcastTensor> out;
  for (const HostTensor& t : tensors) out.push_back({t.name, t.dtype, t.shape});
  return out;
}

BroadcastUpdate Request(const std::vector<HostTensor>& tensors, std::string version,
                        UpdatePolicy policy = UpdatePolicy::kDrain) {
  BroadcastUpdate u;
  u.version = std::move(version);
  u.policy = policy;
  u.tensors = Declared(tensors);
  u.bucket_bytes = kBucketBytes;
  u.source_rank = 0;
  u.timeout = kShort;
  return u;
}

// Arms the group's source to broadcast `tensors` as Request() declares them.
FakeBroadcastGroup::Broadcast Source(const std::vector<HostTensor>& tensors,
                                     uint64_t bucket_bytes = kBucketBytes) {
  FakeBroadcastGroup::Broadcast b;
  b.plan = PlanBroadcast(Declared(tensors), bucket_bytes);
  b.stream = FakeBroadcastGroup::Stream(b.plan, tensors);
  return b;
}

JoinResult Join(Engine* engine, int32_t rank = 1, int32_t world = 3,
                std::chrono::milliseconds timeout = kShort, GiveUp give_up = nullptr) {
  WeightSyncGroupSpec spec;
  spec.unique_id = std::string(kNcclUniqueIdBytes, 'u');
  spec.rank = rank;
  spec.world_size = world;
  spec.timeout = timeout;
  std::promise<JoinResult> promise;
  engine->JoinWeightSyncGroup(
      spec, [&](JoinResult r) { promise.set_value(std::move(r)); }, std::move(give_up));
  return promise.get_future().get();
}

std::optional<WeightSyncGroupInfo> Leave(Engine* engine) {
  std::promise<std::optional<WeightSyncGroupInfo>> promise;
  engine->LeaveWeightSyncGroup([&](std::optional<WeightSyncGroupInfo> r) { promise.set_value(r); });
  return promise.get_future().get();
}

UpdateResult Broadcast(Engine* engine, absl::StatusOr<BroadcastUpdate> update,
                       std::function<bool()> cancelled = nullptr) {
  std::promise<UpdateResult> promise;
  engine->UpdateWeightsFromBroadcast(
      std::move(update), [&](UpdateResult r) { promise.set_value(std::move(r)); },
      std::move(cancelled));
  return promise.get_future().get();
}

UpdateResult Streamed(Engine* engine, const std::vector<HostTensor>& tensors,
                      const std::string& version) {
  WeightUpdate u = OwnedWeightUpdate(version, UpdatePolicy::kDrain, tensors);
  std::promise<UpdateResult> promise;
  engine->UpdateWeights(std::move(u), [&](UpdateResult r) { promise.set_value(std::move(r)); });
  return promise.get_future().get();
}

SampleSpec Spec(int32_t max_new_tokens = 10) {
  SampleSpec s;
  s.prompt = {5, 17, 99, 3, 200, 41, 7};
  s.params.temperature = 0.8f;
  s.params.max_new_tokens = max_new_tokens;
  s.params.ignore_eos = true;
  s.sample_seed = 11;
  return s;
}

SampleCompletion RunOne(Engine* engine, SampleSpec spec = Spec()) {
  Collector collector(1);
  EXPECT_TRUE(engine->Submit({spec}, collector.Sink()).ok());
  return collector.Wait()[0];
}

bool Contains(const absl::Status& s, const std::string& text) {
  return s.message().find(text) != std::string::npos;
}

TEST(EngineBroadcastTest, ABroadcastServesTheBitsAndDigestOfTheSameBytesStreamed) {
  FakeBroadcastGroup group;
  FakeBroadcastRunner* fake = nullptr;
  std::unique_ptr<Engine> engine = MakeEngine(&group, &fake);
  std::unique_ptr<Engine> streamed = MakeEngine(nullptr);
  const JoinResult joined = Join(engine.get());
  ASSERT_TRUE(joined.status.ok()) << joined.status;
  EXPECT_EQ(joined.group.rank, 1);
  EXPECT_EQ(joined.group.world_size, 3);
  ASSERT_TRUE(engine->weight_sync_group().has_value());

  const std::vector<HostTensor> tensors = {Scaled(kDown, 3.0f), Scaled(kNorm, 0.5f),
                                           Scaled(kUp, 0.25f)};
  group.Arm(Source(tensors));
  const UpdateResult r = Broadcast(engine.get(), Request(tensors, "v1"));
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(r.previous_version, "v0");
  const BroadcastPlan plan = PlanBroadcast(Declared(tensors), kBucketBytes);
  ASSERT_GE(plan.buckets.size(), 10u);
  EXPECT_EQ(group.buckets_sent(), plan.buckets.size());
  EXPECT_EQ(fake->port()->host_sink()->buckets_hashed(), static_cast<int>(plan.buckets.size()));
  EXPECT_EQ(r.received_bytes, plan.total_bytes);
  EXPECT_GT(r.receive_seconds, 0.0);
  EXPECT_FALSE(fake->port()->host_sink()->claimed()) << "the staging is free once answered";

  const UpdateResult s = Streamed(streamed.get(), tensors, "v1");
  ASSERT_TRUE(s.status.ok()) << s.status;
  EXPECT_EQ(r.digest, s.digest) << "bucket by bucket hashing gives the host path's digest";
  EXPECT_EQ(engine->weight_digest(), r.digest);
  EXPECT_EQ(engine->weight_version(), "v1");
  EXPECT_EQ(Bits(RunOne(engine.get())), Bits(RunOne(streamed.get())));
  EXPECT_TRUE(engine->weight_sync_group().has_value()) << "the group stays for the next one";

  // The next step's broadcast through the same group.
  const std::vector<HostTensor> next = {Scaled(kDown, 0.5f)};
  group.Arm(Source(next));
  const UpdateResult r2 = Broadcast(engine.get(), Request(next, "v2"));
  ASSERT_TRUE(r2.status.ok()) << r2.status;
  ASSERT_TRUE(Streamed(streamed.get(), next, "v2").status.ok());
  EXPECT_EQ(engine->weight_digest(), streamed->weight_digest());
  EXPECT_EQ(Bits(RunOne(engine.get())), Bits(RunOne(streamed.get())));
  EXPECT_EQ(fake->staging_updates(), 2);
}

TEST(EngineBroadcastTest, ABroadcastThatStopsHalfWayChangesNothingAndLeavesTheGroup) {
  FakeBroadcastGroup group;
  FakeBroadcastRunner* fake = nullptr;
  std::unique_ptr<Engine> engine = MakeEngine(&group, &fake);
  ASSERT_TRUE(Join(engine.get()).status.ok());
  const std::string before = Bits(RunOne(engine.get()));
  const std::string digest = engine->weight_digest();
  const std::vector<HostTensor> tensors = {Scaled(kDown, 3.0f), Scaled(kUp, 2.0f)};
  FakeBroadcastGroup::Broadcast source = Source(tensors);
  source.stop_after = 5;  // the trainer dies after five buckets
  group.Arm(source);
  const UpdateResult r = Broadcast(engine.get(), Request(tensors, "v1"));
  EXPECT_EQ(r.status.code(), absl::StatusCode::kDeadlineExceeded) << r.status;
  EXPECT_TRUE(Contains(r.status, "bucket 5 of")) << r.status;
  EXPECT_TRUE(Contains(r.status, "left the weight-sync group")) << r.status;
  EXPECT_EQ(group.buckets_sent(), 5u);
  EXPECT_EQ(engine->weight_version(), "v0");
  EXPECT_EQ(engine->weight_digest(), digest);
  EXPECT_EQ(Bits(RunOne(engine.get())), before) << "served bits unchanged";
  EXPECT_EQ(fake->staging_updates(), 0);
  EXPECT_FALSE(engine->weight_sync_group().has_value());
  EXPECT_EQ(group.members_alive(), 0) << "the broken member was destroyed";
  EXPECT_FALSE(fake->port()->host_sink()->claimed());

  // Joined again, the same broadcast in full goes through.
  ASSERT_TRUE(Join(engine.get()).status.ok());
  group.Arm(Source(tensors));
  const UpdateResult again = Broadcast(engine.get(), Request(tensors, "v1"));
  ASSERT_TRUE(again.status.ok()) << again.status;
  EXPECT_EQ(engine->weight_version(), "v1");
  EXPECT_NE(Bits(RunOne(engine.get())), before);
}

TEST(EngineBroadcastTest, DigestMismatchesAreRefusedAndChangeNothing) {
  FakeBroadcastGroup group;
  std::unique_ptr<Engine> engine = MakeEngine(&group);
  ASSERT_TRUE(Join(engine.get()).status.ok());
  const std::string before = Bits(RunOne(engine.get()));
  const std::string boot = engine->weight_digest();
  const std::vector<HostTensor> tensors = {Scaled(kDown, 3.0f)};

  // The served version name for other bytes.
  group.Arm(Source(tensors));
  UpdateResult r = Broadcast(engine.get(), Request(tensors, "v0", UpdatePolicy::kAbort));
  EXPECT_EQ(r.status.code(), absl::StatusCode::kFailedPrecondition) << r.status;
  EXPECT_EQ(engine->weight_digest(), boot);

  // Bytes that are not the ones the trainer meant (a corrupted byte on the way).
  FakeBroadcastGroup::Broadcast corrupted = Source(tensors);
  corrupted.stream[1000] ^= 0x40;
  group.Arm(corrupted);
  std::unique_ptr<Engine> reference = MakeEngine(nullptr);
  ASSERT_TRUE(Streamed(reference.get(), tensors, "v1").status.ok());
  BroadcastUpdate expecting = Request(tensors, "v1");
  expecting.expected_digest = reference->weight_digest();
  r = Broadcast(engine.get(), expecting);
  EXPECT_EQ(r.status.code(), absl::StatusCode::kDataLoss) << r.status;
  EXPECT_TRUE(Contains(r.status, reference->weight_digest())) << r.status;
  EXPECT_EQ(engine->weight_version(), "v0");
  EXPECT_EQ(engine->weight_digest(), boot);
  EXPECT_EQ(Bits(RunOne(engine.get())), before);
  EXPECT_TRUE(engine->weight_sync_group().has_value()) << "a refused digest keeps the group";

  // The intact bytes with the same expectation are accepted.
  group.Arm(Source(tensors));
  r = Broadcast(engine.get(), expecting);
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(r.digest, reference->weight_digest());
}

TEST(EngineBroadcastTest, ARefusedRequestStillTakesPartInTheHandshakeSoTheGroupSurvives) {
  FakeBroadcastGroup group;
  std::unique_ptr<Engine> engine = MakeEngine(&group);
  ASSERT_TRUE(Join(engine.get(), /*rank=*/1, /*world=*/3).status.ok());
  const std::vector<HostTensor> tensors = {Scaled(kDown, 3.0f)};
  group.Arm(Source(tensors));

  // The server's own validation failed (as the service reports it).
  UpdateResult r = Broadcast(engine.get(), absl::InvalidArgumentError("tensors[0]: bad"));
  EXPECT_EQ(r.status.code(), absl::StatusCode::kInvalidArgument) << r.status;
  EXPECT_EQ(r.status.message(), "tensors[0]: bad");
  EXPECT_EQ(group.handshakes(), 1);
  EXPECT_EQ(group.last_server_ready(), false);
  EXPECT_EQ(group.buckets_sent(), 0u);

  // A source rank that is this server's own, or outside the group.
  BroadcastUpdate own = Request(tensors, "v1");
  own.source_rank = 1;
  r = Broadcast(engine.get(), own);
  EXPECT_EQ(r.status.code(), absl::StatusCode::kInvalidArgument) << r.status;
  EXPECT_TRUE(Contains(r.status, "this server's own rank")) << r.status;
  BroadcastUpdate outside = Request(tensors, "v1");
  outside.source_rank = 3;
  r = Broadcast(engine.get(), outside);
  EXPECT_EQ(r.status.code(), absl::StatusCode::kInvalidArgument) << r.status;
  EXPECT_TRUE(Contains(r.status, "not a rank of the weight-sync group")) << r.status;
  EXPECT_EQ(group.handshakes(), 3);
  EXPECT_EQ(group.buckets_sent(), 0u);

  // Another server refuses: nobody receives anything.
  FakeBroadcastGroup::Broadcast refused = Source(tensors);
  refused.refusing_rank = 2;
  group.Arm(refused);
  r = Broadcast(engine.get(), Request(tensors, "v1"));
  EXPECT_EQ(r.status.code(), absl::StatusCode::kAborted) << r.status;
  EXPECT_TRUE(Contains(r.status, "rank(s) 2")) << r.status;
  EXPECT_EQ(group.last_server_ready(), true);

  // The source broadcasts another plan (here: other buckets) than the request declares.
  group.Arm(Source(tensors, 2 * kBucketBytes));
  r = Broadcast(engine.get(), Request(tensors, "v1"));
  EXPECT_EQ(r.status.code(), absl::StatusCode::kInvalidArgument) << r.status;
  EXPECT_TRUE(Contains(r.status, "differs from the source's")) << r.status;
  EXPECT_EQ(group.buckets_sent(), 0u);
  EXPECT_EQ(engine->weight_version(), "v0");

  // Through all of that the group stayed usable.
  ASSERT_TRUE(engine->weight_sync_group().has_value());
  group.Arm(Source(tensors));
  r = Broadcast(engine.get(), Request(tensors, "v1"));
  EXPECT_TRUE(r.status.ok()) << r.status;
}

TEST(EngineBroadcastTest, JoinsLeavesAndBroadcastsWithoutAGroupAnswerClearly) {
  FakeBroadcastGroup group;
  std::unique_ptr<Engine> engine = MakeEngine(&group);
  const std::vector<HostTensor> tensors = {Scaled(kDown, 3.0f)};
  UpdateResult r = Broadcast(engine.get(), Request(tensors, "v1"));
  EXPECT_EQ(r.status.code(), absl::StatusCode::kFailedPrecondition) << r.status;
  EXPECT_TRUE(Contains(r.status, "JoinWeightSyncGroup first")) << r.status;
  EXPECT_EQ(group.handshakes(), 0) << "no group, nobody to shake hands with";
  // Without a group the refusal itself is the answer.
  r = Broadcast(engine.get(), absl::InvalidArgumentError("bucket_bytes = 0"));
  EXPECT_EQ(r.status.code(), absl::StatusCode::kInvalidArgument) << r.status;

  EXPECT_FALSE(Leave(engine.get()).has_value()) << "leaving without a group is a no-op";
  ASSERT_TRUE(Join(engine.get(), 2, 4).status.ok());
  const JoinResult twice = Join(engine.get(), 3, 4);
  EXPECT_EQ(twice.status.code(), absl::StatusCode::kFailedPrecondition) << twice.status;
  EXPECT_TRUE(Contains(twice.status, "already rank 2 of a weight-sync group of 4")) << twice.status;
  EXPECT_EQ(group.joins(), 1) << "a duplicate join never reaches the runner";
  const std::optional<WeightSyncGroupInfo> left = Leave(engine.get());
  ASSERT_TRUE(left.has_value());
  EXPECT_EQ(left->rank, 2);
  EXPECT_FALSE(engine->weight_sync_group().has_value());
  EXPECT_EQ(group.members_alive(), 0);
  EXPECT_TRUE(Join(engine.get(), 3, 4).status.ok()) << "after leaving, joining again works";

  // A join the other ranks never complete times out, and a given-up one is cancelled.
  Leave(engine.get());
  group.set_join_never_completes(true);
  JoinResult j = Join(engine.get(), 1, 2, std::chrono::milliseconds(100));
  EXPECT_EQ(j.status.code(), absl::StatusCode::kDeadlineExceeded) << j.status;
  j = Join(engine.get(), 1, 2, std::chrono::milliseconds(60'000), [] { return true; });
  EXPECT_EQ(j.status.code(), absl::StatusCode::kCancelled) << j.status;
  EXPECT_FALSE(engine->weight_sync_group().has_value());
}

TEST(EngineBroadcastTest, TheCpuBackendRefusesGroupsAndBroadcastsNamingTheCudaBackend) {
  std::unique_ptr<Engine> engine = MakeEngine(nullptr);
  const JoinResult j = Join(engine.get());
  EXPECT_EQ(j.status.code(), absl::StatusCode::kFailedPrecondition) << j.status;
  EXPECT_TRUE(Contains(j.status, "--backend cuda")) << j.status;
  const UpdateResult r = Broadcast(engine.get(), Request({Scaled(kDown, 2.0f)}, "v1"));
  EXPECT_EQ(r.status.code(), absl::StatusCode::kFailedPrecondition) << r.status;
  EXPECT_TRUE(Contains(r.status, "--backend cuda --device_weight_staging")) << r.status;
  EXPECT_EQ(engine->weight_version(), "v0");
}

TEST(EngineBroadcastTest, TheEngineKeepsServingWhileABroadcastIsReceived) {
  FakeBroadcastGroup group;
  std::unique_ptr<Engine> engine = MakeEngine(&group);
  ASSERT_TRUE(Join(engine.get()).status.ok());
  const std::string before = Bits(RunOne(engine.get()));
  const std::vector<HostTensor> tensors = {Scaled(kDown, 3.0f)};
  FakeBroadcastGroup::Broadcast held = Source(tensors);
  held.hold_at = 2;  // the source pauses after two buckets
  group.Arm(held);
  std::promise<UpdateResult> promise;
  BroadcastUpdate request = Request(tensors, "v1");
  request.timeout = std::chrono::milliseconds(60'000);
  engine->UpdateWeightsFromBroadcast(request,
                                     [&](UpdateResult r) { promise.set_value(std::move(r)); });
  while (group.buckets_sent() < 2) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  // Half received: generation runs on the old weights meanwhile.
  const SampleCompletion during = RunOne(engine.get());
  EXPECT_EQ(Bits(during), before);
  EXPECT_EQ(during.weight_version, "v0");
  group.Release();
  const UpdateResult r = promise.get_future().get();
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(RunOne(engine.get()).weight_version, "v1");
}

TEST(EngineBroadcastTest, PoliciesActOnlyOnceEveryBucketArrived) {
  FakeBroadcastGroup group;
  std::unique_ptr<Engine> engine = MakeEngine(&group);
  ASSERT_TRUE(Join(engine.get()).status.ok());
  const std::vector<HostTensor> tensors = {Scaled(kDown, 3.0f)};
  const std::string old_bits = Bits(RunOne(engine.get(), Spec(60)));

  // DRAIN: a sample in flight finishes on the old weights.
  Collector draining(1);
  ASSERT_TRUE(engine->Submit({Spec(60)}, draining.Sink()).ok());
  while (draining.num_streamed() < 2) std::this_thread::yield();
  group.Arm(Source(tensors));
  UpdateResult r = Broadcast(engine.get(), Request(tensors, "v1", UpdatePolicy::kDrain));
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(Bits(draining.Wait()[0]), old_bits);

  // ABORT: a sample in flight ends.
  Collector aborted(1);
  ASSERT_TRUE(engine->Submit({Spec(400)}, aborted.Sink()).ok());
  while (aborted.num_streamed() < 2) std::this_thread::yield();
  const std::vector<HostTensor> next = {Scaled(kDown, 0.5f)};
  group.Arm(Source(next));
  r = Broadcast(engine.get(), Request(next, "v2", UpdatePolicy::kAbort));
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(r.aborted_samples, 1);
  EXPECT_EQ(aborted.Wait()[0].finish_reason, FinishReason::kAbort);
  EXPECT_EQ(RunOne(engine.get()).weight_version, "v2");
}

TEST(EngineBroadcastTest, AWaitingUpdateHoldsTheStagingAndCancelledOnesApplyNothing) {
  FakeBroadcastGroup group;
  FakeBroadcastRunner* fake = nullptr;
  std::unique_ptr<Engine> engine = MakeEngine(&group, &fake);
  ASSERT_TRUE(Join(engine.get()).status.ok());
  const std::vector<HostTensor> tensors = {Scaled(kDown, 3.0f)};
  Collector in_flight(1);
  ASSERT_TRUE(engine->Submit({Spec(400)}, in_flight.Sink()).ok());
  while (in_flight.num_streamed() < 2) std::this_thread::yield();

  // A DRAIN broadcast received, waiting for the sample: its bytes stay staged.
  group.Arm(Source(tensors));
  std::atomic<bool> cancelled{false};
  std::promise<UpdateResult> first;
  engine->UpdateWeightsFromBroadcast(
      Request(tensors, "v1", UpdatePolicy::kDrain),
      [&](UpdateResult r) { first.set_value(std::move(r)); }, [&] { return cancelled.load(); });
  const BroadcastPlan plan = PlanBroadcast(Declared(tensors), kBucketBytes);
  while (group.buckets_sent() < plan.buckets.size() || !fake->port()->host_sink()->claimed()) {
    std::this_thread::yield();
  }
  // Another broadcast meanwhile is refused at the handshake: the staging is taken.
  group.Arm(Source(tensors));
  UpdateResult second = Broadcast(engine.get(), Request(tensors, "v2"));
  EXPECT_EQ(second.status.code(), absl::StatusCode::kAborted) << second.status;
  EXPECT_EQ(group.last_server_ready(), false);

  // The first one's caller gives up: nothing is applied and the staging is free again.
  cancelled = true;
  const UpdateResult r = first.get_future().get();
  EXPECT_EQ(r.status.code(), absl::StatusCode::kCancelled) << r.status;
  EXPECT_EQ(engine->weight_version(), "v0");
  EXPECT_FALSE(fake->port()->host_sink()->claimed());
  EXPECT_EQ(fake->staging_updates(), 0);
  engine->AbortAll();
  in_flight.Wait();

  // A caller that gives up while the bytes arrive: the receive stops, the group is left.
  FakeBroadcastGroup::Broadcast held = Source(tensors);
  held.hold_at = 1;
  group.Arm(held);
  std::atomic<bool> give_up{false};
  std::promise<UpdateResult> third;
  BroadcastUpdate patient = Request(tensors, "v3");
  patient.timeout = std::chrono::milliseconds(60'000);
  engine->UpdateWeightsFromBroadcast(
      patient, [&](UpdateResult u) { third.set_value(std::move(u)); },
      [&] { return give_up.load(); });
  while (group.buckets_sent() < 1) std::this_thread::yield();
  give_up = true;
  const UpdateResult t = third.get_future().get();
  EXPECT_EQ(t.status.code(), absl::StatusCode::kCancelled) << t.status;
  EXPECT_FALSE(engine->weight_sync_group().has_value());
  EXPECT_EQ(engine->weight_version(), "v0");
}

TEST(EngineBroadcastTest, DestroyingTheEngineEndsAReceiveThatWaitsForItsSource) {
  FakeBroadcastGroup group;
  std::unique_ptr<Engine> engine = MakeEngine(&group);
  ASSERT_TRUE(Join(engine.get()).status.ok());
  const std::vector<HostTensor> tensors = {Scaled(kDown, 3.0f)};
  FakeBroadcastGroup::Broadcast held = Source(tensors);
  held.hold_at = 1;
  group.Arm(held);
  std::promise<UpdateResult> promise;
  BroadcastUpdate request = Request(tensors, "v1");
  request.timeout = std::chrono::milliseconds(60'000);
  engine->UpdateWeightsFromBroadcast(request,
                                     [&](UpdateResult r) { promise.set_value(std::move(r)); });
  while (group.buckets_sent() < 1) std::this_thread::yield();
  const auto start = std::chrono::steady_clock::now();
  engine.reset();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
  EXPECT_EQ(promise.get_future().get().status.code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(group.members_alive(), 0);
}

TEST(EngineBroadcastTest, CheckBroadcastTensorsNamesTheField) {
  std::unique_ptr<Engine> engine = MakeEngine(nullptr);
  const std::vector<WeightSpec>& specs = engine->weight_specs();
  const BroadcastTensor ok = Declared({Scaled(kDown, 1.0f)})[0];
  EXPECT_TRUE(CheckBroadcastTensors(specs, {ok}, kBucketBytes).ok());
  std::vector<std::pair<std::string, std::vector<BroadcastTensor>>> cases;
  BroadcastTensor t = ok;
  t.name = "model.layers.0.mlp.nonexistent.weight";
  cases.push_back(
      {"tensors[0]: tensor 'model.layers.0.mlp.nonexistent.weight' is not a weight", {t}});
  t = ok;
  t.shape[0] -= 1;
  cases.push_back({"shape", {t}});
  t = ok;
  t.dtype = DType::kF32;
  cases.push_back({"dtype F32 given", {t}});
  cases.push_back({"tensors[1] ('model.layers.0.mlp.down_proj.weight') is given twice", {ok, ok}});
  cases.push_back({"tensors is empty", {}});
  for (const auto& [expected, tensors] : cases) {
    const absl::Status s = CheckBroadcastTensors(specs, tensors, kBucketBytes);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_TRUE(Contains(s, expected)) << s;
  }
  for (uint64_t bad : {0ull, 1000ull, 255ull}) {
    const absl::Status s = CheckBroadcastTensors(specs, {ok}, bad);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_TRUE(Contains(s, "bucket_bytes")) << s;
  }
}

}  // namespace
}  // namespace rollout
