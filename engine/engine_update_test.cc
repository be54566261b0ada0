// Weight updates and pause/resume, driven offline through the engine.
#include <atomic>
#include <condition_variable>
#include <functional>
#include <future>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "engine/engine.h"
#include "engine/engine_test_util.h"
#include "engine/sampler.h"
#include "gtest/gtest.h"
#include "model/random_model.h"
#include "runner/cpu/cpu_model_runner.h"

namespace rollout {
namespace {

constexpr char kTensor[] = "model.layers.0.mlp.down_proj.weight";

// Writes a random model of `preset` (seed 5) and returns its directory.
std::string WriteModel(const std::string& preset) {
  std::string d = ::testing::TempDir() + "engine-update-test-" + preset;
  RandomModelOptions options;
  options.preset = preset;
  options.seed = 5;
  EXPECT_TRUE(WriteRandomModel(options, d).ok());
  return d;
}

const std::string& ModelDir() {
  static const std::string dir = WriteModel("tiny");
  return dir;
}

// The small preset: slow enough on the CPU that a long sample is still running a while later.
const std::string& SmallModelDir() {
  static const std::string dir = WriteModel("small");
  return dir;
}

// `digested`: with the checkpoint's tensor digests, as the server passes them. `options`: the
// engine's, at version v0.
std::unique_ptr<Engine> MakeEngine(const std::string& dir = ModelDir(), bool digested = false,
                                   EngineOptions options = {}) {
  auto ck = Checkpoint::Open(dir);
  EXPECT_TRUE(ck.ok());
  auto runner = CpuModelRunner::Create(**ck, {});
  EXPECT_TRUE(runner.ok());
  options.weight_version = "v0";
  if (digested) options.weight_digests = DigestCheckpoint(**ck, (*runner)->weight_specs());
  auto engine = Engine::Create(*std::move(runner), options);
  EXPECT_TRUE(engine.ok());
  return *std::move(engine);
}

HostTensor OriginalTensor(const std::string& dir = ModelDir()) {
  return ReadCheckpointTensor(dir, kTensor);
}

HostTensor ScaledTensor(float scale) { return ScaledCheckpointTensor(ModelDir(), kTensor, scale); }

SampleSpec Spec(int32_t max_new_tokens = 12) {
  SampleSpec s;
  s.prompt = {5, 17, 99, 3, 200, 41, 7};
  s.params.temperature = 0.8f;
  s.params.max_new_tokens = max_new_tokens;
  s.params.ignore_eos = true;
  s.sample_seed = 11;
  return s;
}

// Runs one job to completion and returns its completions.
std::vector<SampleCompletion> RunJob(Engine* engine, std::vector<SampleSpec> specs) {
  auto promise = std::make_shared<std::promise<std::vector<SampleCompletion>>>();
  auto done = std::make_shared<std::vector<SampleCompletion>>(specs.size());
  auto left = std::make_shared<size_t>(specs.size());
  for (size_t i = 0; i < specs.size(); ++i) specs[i].sample_index = static_cast<int32_t>(i);
  auto future = promise->get_future();
  EXPECT_TRUE(engine
                  ->Submit(specs,
                           [promise, done, left](std::vector<SampleEvent> events) {
                             for (SampleEvent& e : events) {
                               if (!e.completion) continue;
                               (*done)[e.sample_index] = *std::move(e.completion);
                               if (--*left == 0) promise->set_value(*done);
                             }
                           })
                  .ok());
  return future.get();
}

// Runs `spec` on another thread and returns once the engine has made three more steps, so that
// the sample is in flight; the future holds its completion.
std::future<std::vector<SampleCompletion>> StartInFlight(Engine* engine, SampleSpec spec) {
  const uint64_t steps = engine->counters().steps;
  auto run = std::async(std::launch::async, [engine, spec] { return RunJob(engine, {spec}); });
  while (engine->counters().steps < steps + 3) std::this_thread::yield();
  return run;
}

UpdateResult Update(Engine* engine, std::string version, UpdatePolicy policy,
                    std::vector<HostTensor> tensors) {
  std::promise<UpdateResult> promise;
  auto future = promise.get_future();
  engine->UpdateWeights(OwnedWeightUpdate(std::move(version), policy, std::move(tensors)),
                        [&promise](UpdateResult r) { promise.set_value(std::move(r)); });
  return future.get();
}

TEST(EngineUpdateTest, NewWeightsChangeOutputsAndTheOriginalBytesRestoreThemBitwise) {
  std::unique_ptr<Engine> engine = MakeEngine();
  const SampleCompletion before = RunJob(engine.get(), {Spec()})[0];
  EXPECT_EQ(before.weight_version, "v0");
  UpdateResult r = Update(engine.get(), "v1", UpdatePolicy::kDrain, {ScaledTensor(3.0f)});
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(r.previous_version, "v0");
  EXPECT_EQ(engine->weight_version(), "v1");
  const SampleCompletion changed = RunJob(engine.get(), {Spec()})[0];
  EXPECT_EQ(changed.weight_version, "v1");
  EXPECT_NE(Bits(changed), Bits(before));
  ASSERT_TRUE(Update(engine.get(), "v2", UpdatePolicy::kContinue, {OriginalTensor()}).status.ok());
  const SampleCompletion restored = RunJob(engine.get(), {Spec()})[0];
  EXPECT_EQ(Bits(restored), Bits(before));
  EXPECT_EQ(restored.cached_prompt_tokens, 0) << "no KV of v0 or v1 may serve v2";
}

TEST(EngineUpdateTest, AVersionNameIsBoundToTheBytesItServes) {
  std::unique_ptr<Engine> engine = MakeEngine(ModelDir(), /*digested=*/true);
  const std::string boot = engine->weight_digest();
  ASSERT_EQ(boot.rfind("sha256:", 0), 0u) << "every served tensor hashed at load: " << boot;
  const SampleCompletion before = RunJob(engine.get(), {Spec()})[0];
  EXPECT_EQ(before.weight_digest, boot);

  UpdateResult reuse = Update(engine.get(), "v0", UpdatePolicy::kDrain, {ScaledTensor(3.0f)});
  EXPECT_EQ(reuse.status.code(), absl::StatusCode::kFailedPrecondition) << reuse.status;
  EXPECT_NE(reuse.status.message().find(boot), std::string::npos) << reuse.status;
  EXPECT_EQ(engine->weight_version(), "v0");
  EXPECT_EQ(engine->weight_digest(), boot);
  EXPECT_EQ(Bits(RunJob(engine.get(), {Spec()})[0]), Bits(before)) << "served bits unchanged";

  UpdateResult scaled = Update(engine.get(), "v1", UpdatePolicy::kDrain, {ScaledTensor(3.0f)});
  ASSERT_TRUE(scaled.status.ok()) << scaled.status;
  EXPECT_NE(scaled.digest, boot);
  EXPECT_EQ(engine->weight_digest(), scaled.digest);
  EXPECT_EQ(RunJob(engine.get(), {Spec()})[0].weight_digest, scaled.digest);
  // The boot bytes under a new name: the boot digest again; the same bytes under the served
  // name: accepted.
  UpdateResult restored = Update(engine.get(), "v2", UpdatePolicy::kDrain, {OriginalTensor()});
  ASSERT_TRUE(restored.status.ok()) << restored.status;
  EXPECT_EQ(restored.digest, boot);
  UpdateResult again = Update(engine.get(), "v2", UpdatePolicy::kDrain, {OriginalTensor()});
  EXPECT_TRUE(again.status.ok()) << again.status;
  EXPECT_EQ(engine->weight_digest(), boot);
}

TEST(EngineUpdateTest, WithoutLoadDigestsTheDigestIsUnknownAndNameReuseIsNotChecked) {
  std::unique_ptr<Engine> engine = MakeEngine();
  EXPECT_EQ(engine->weight_digest(), "");
  UpdateResult r = Update(engine.get(), "v0", UpdatePolicy::kDrain, {ScaledTensor(3.0f)});
  EXPECT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(r.digest, "") << "one tensor of many is not the weights";
}

TEST(EngineUpdateTest, AnInvalidUpdateLeavesTheOldWeightsServingBitwise) {
  std::unique_ptr<Engine> engine = MakeEngine();
  const SampleCompletion before = RunJob(engine.get(), {Spec()})[0];
  HostTensor wrong_shape = ScaledTensor(2.0f);
  wrong_shape.shape[0] -= 1;
  HostTensor unknown = ScaledTensor(2.0f);
  unknown.name = "model.layers.0.mlp.nonexistent.weight";
  HostTensor wrong_dtype = ScaledTensor(2.0f);
  wrong_dtype.dtype = DType::kF16;
  HostTensor short_bytes = ScaledTensor(2.0f);
  short_bytes.bytes.resize(short_bytes.bytes.size() - 2);
  for (const HostTensor& bad : {wrong_shape, unknown, wrong_dtype, short_bytes}) {
    // A valid tensor beside the bad one must not be applied either: all or nothing.
    UpdateResult r =
        Update(engine.get(), "bad", UpdatePolicy::kContinue, {ScaledTensor(5.0f), bad});
    EXPECT_EQ(r.status.code(), absl::StatusCode::kInvalidArgument) << r.status;
    EXPECT_EQ(engine->weight_version(), "v0");
    EXPECT_EQ(Bits(RunJob(engine.get(), {Spec()})[0]), Bits(before)) << r.status;
  }
}

// An update's bytes with a marker of whether the engine still holds them.
struct TrackedUpdate {
  WeightUpdate update;
  std::shared_ptr<std::atomic<bool>> released = std::make_shared<std::atomic<bool>>(false);
};
TrackedUpdate Tracked(std::string version, std::vector<HostTensor> tensors) {
  TrackedUpdate t;
  t.update = OwnedWeightUpdate(std::move(version), UpdatePolicy::kContinue, std::move(tensors));
  // The owner of the bytes, wrapped: the marker flips when the engine drops its reference.
  std::shared_ptr<const void> inner = std::move(t.update.bytes);
  t.update.bytes =
      std::shared_ptr<const void>(inner.get(), [inner, released = t.released](const void*) mutable {
        inner.reset();
        *released = true;
      });
  return t;
}

TEST(EngineUpdateTest, TheEngineDropsAnUpdatesBytesBeforeItsCallerHearsBack) {
  // So the server's staging is free again when the client gets its answer, whatever it is.
  std::unique_ptr<Engine> engine = MakeEngine();
  HostTensor unknown = ScaledTensor(2.0f);
  unknown.name = "model.layers.0.mlp.nonexistent.weight";
  struct Case {
    std::string what;
    std::vector<HostTensor> tensors;
    std::function<bool()> cancelled;
    absl::StatusCode code;
  };
  const std::vector<Case> cases = {
      {"applied", {ScaledTensor(2.0f)}, nullptr, absl::StatusCode::kOk},
      {"refused by the runner", {unknown}, nullptr, absl::StatusCode::kInvalidArgument},
      {"cancelled", {ScaledTensor(3.0f)}, [] { return true; }, absl::StatusCode::kCancelled},
  };
  for (const Case& c : cases) {
    TrackedUpdate t = Tracked("v-" + c.what, c.tensors);
    std::promise<bool> released_at_done;
    std::promise<UpdateResult> result;
    engine->UpdateWeights(
        std::move(t.update),
        [&, released = t.released](UpdateResult r) {
          released_at_done.set_value(released->load());
          result.set_value(std::move(r));
        },
        c.cancelled);
    EXPECT_TRUE(released_at_done.get_future().get()) << c.what;
    EXPECT_EQ(result.get_future().get().status.code(), c.code) << c.what;
  }
}

TEST(EngineUpdateTest, TheResultSaysHowLongTheCopyAndTheWaitBeforeItTook) {
  std::unique_ptr<Engine> engine = MakeEngine();
  const UpdateResult r = Update(engine.get(), "v1", UpdatePolicy::kDrain, {ScaledTensor(2.0f)});
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_GT(r.copy_seconds, 0.0);
  EXPECT_GE(r.wait_seconds, 0.0);
  EXPECT_LT(r.copy_seconds + r.wait_seconds, 60.0);
}

TEST(EngineUpdateTest, AbortPolicyEndsInFlightSamplesThenSwaps) {
  std::unique_ptr<Engine> engine = MakeEngine();
  auto long_run = std::async(std::launch::async, [&] {
    return RunJob(engine.get(), {Spec(400), Spec(400)});
  });
  while (engine->counters().generated_tokens < 4) std::this_thread::yield();
  UpdateResult r = Update(engine.get(), "v1", UpdatePolicy::kAbort, {ScaledTensor(2.0f)});
  ASSERT_TRUE(r.status.ok());
  EXPECT_EQ(r.aborted_samples, 2);
  for (const SampleCompletion& c : long_run.get()) {
    EXPECT_EQ(c.finish_reason, FinishReason::kAbort);
    EXPECT_LT(c.token_ids.size(), 400u);
  }
  EXPECT_EQ(RunJob(engine.get(), {Spec()})[0].weight_version, "v1");
}

// The aborted samples' completions reach their sinks before the ABORT update's reply, so a
// caller that saw the reply has seen them too.
TEST(EngineUpdateTest, AbortPolicyDeliversTheAbortedCompletionsBeforeItsReply) {
  std::unique_ptr<Engine> engine = MakeEngine();
  auto completions = std::make_shared<std::atomic<int>>(0);
  std::vector<SampleSpec> specs = {Spec(400), Spec(400)};
  specs[1].sample_index = 1;
  ASSERT_TRUE(engine
                  ->Submit(specs,
                           [completions](std::vector<SampleEvent> events) {
                             for (const SampleEvent& e : events)
                               *completions += e.completion.has_value();
                           })
                  .ok());
  while (engine->counters().generated_tokens < 4) std::this_thread::yield();
  std::promise<int> seen_at_reply;
  engine->UpdateWeights(OwnedWeightUpdate("v1", UpdatePolicy::kAbort, {ScaledTensor(2.0f)}),
                        [&](UpdateResult r) {
                          EXPECT_TRUE(r.status.ok()) << r.status;
                          seen_at_reply.set_value(completions->load());
                        });
  EXPECT_EQ(seen_at_reply.get_future().get(), 2);
}

// A Pause while a DRAIN update waits for the samples in flight is refused: it would hold them,
// and the update with its slot, until a Resume (review26 finding 1; a DRAIN update while paused
// was refused already). With abort_in_flight the samples end and the update applies.
TEST(EngineUpdateTest, APauseWhileADrainUpdateWaitsIsRefusedUnlessItAbortsTheSamples) {
  std::unique_ptr<Engine> engine = MakeEngine(SmallModelDir());
  auto in_flight = StartInFlight(engine.get(), Spec(4000));
  std::promise<UpdateResult> promise;
  auto answered = promise.get_future();
  engine->UpdateWeights(
      OwnedWeightUpdate("v1", UpdatePolicy::kDrain, {OriginalTensor(SmallModelDir())}),
      [&promise](UpdateResult r) { promise.set_value(std::move(r)); });
  // Let the engine take the update (it waits for the in-flight sample).
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  const absl::StatusOr<bool> refused = engine->Pause(false);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_NE(refused.status().message().find("DRAIN weight update waits"), std::string::npos)
      << refused.status();
  EXPECT_FALSE(engine->paused());
  const absl::StatusOr<bool> aborting = engine->Pause(true);
  ASSERT_TRUE(aborting.ok()) << aborting.status();
  ASSERT_EQ(answered.wait_for(std::chrono::seconds(10)), std::future_status::ready)
      << "the DRAIN update did not apply once the pause aborted its samples";
  EXPECT_TRUE(answered.get().status.ok());
  EXPECT_EQ(engine->weight_version(), "v1");
  const SampleCompletion c = in_flight.get()[0];
  EXPECT_EQ(c.finish_reason, FinishReason::kAbort) << "the sample ended before the pause";
  EXPECT_EQ(c.abort_cause, "Pause with abort_in_flight");
  EXPECT_EQ(c.weight_version, "v0");
  EXPECT_TRUE(engine->Resume());
  // No update waits now: a plain pause is taken.
  EXPECT_TRUE(engine->Pause(false).ok());
}

TEST(EngineUpdateTest, DrainFinishesInFlightOnOldWeightsAndNewWorkRunsOnTheNew) {
  std::unique_ptr<Engine> engine = MakeEngine();
  const std::string old_bits = Bits(RunJob(engine.get(), {Spec(400)})[0]);
  auto in_flight = StartInFlight(engine.get(), Spec(400));
  std::promise<UpdateResult> promise;
  engine->UpdateWeights(OwnedWeightUpdate("v1", UpdatePolicy::kDrain, {ScaledTensor(2.0f)}),
                        [&promise](UpdateResult r) { promise.set_value(std::move(r)); });
  auto waiting = std::async(std::launch::async, [&] { return RunJob(engine.get(), {Spec(400)}); });
  const SampleCompletion drained = in_flight.get()[0];
  EXPECT_EQ(drained.finish_reason, FinishReason::kLength);
  EXPECT_EQ(Bits(drained), old_bits) << "in-flight work finishes on the old weights";
  EXPECT_EQ(drained.weight_version, "v0");
  ASSERT_TRUE(promise.get_future().get().status.ok());
  const SampleCompletion after = waiting.get()[0];
  EXPECT_EQ(after.weight_version, "v1");
  ASSERT_EQ(after.version_spans.size(), 1u);
  EXPECT_EQ(after.version_spans[0].version, "v1");
  EXPECT_NE(Bits(after), old_bits);
}

TEST(EngineUpdateTest, ContinueRecordsTheVersionOfEveryToken) {
  std::unique_ptr<Engine> engine = MakeEngine();
  auto in_flight =
      std::async(std::launch::async, [&] { return RunJob(engine.get(), {Spec(300)}); });
  while (engine->counters().generated_tokens < 5) std::this_thread::yield();
  ASSERT_TRUE(
      Update(engine.get(), "v1", UpdatePolicy::kContinue, {ScaledTensor(2.0f)}).status.ok());
  const SampleCompletion c = in_flight.get()[0];
  EXPECT_EQ(c.finish_reason, FinishReason::kLength);
  EXPECT_EQ(c.weight_version, "v1");
  ASSERT_EQ(c.version_spans.size(), 2u);
  EXPECT_EQ(c.version_spans[0].version, "v0");
  EXPECT_EQ(c.version_spans[0].first_token, 0);
  EXPECT_EQ(c.version_spans[1].version, "v1");
  EXPECT_EQ(c.version_spans[1].first_token, c.version_spans[0].last_token + 1);
  EXPECT_EQ(c.version_spans[1].last_token, 299);
}

// An engine of `dir` at version v0 whose steps take 64 tokens: a long prompt prefills over
// many steps, so that an update lands in the middle.
std::unique_ptr<Engine> MakeSmallStepEngine(const std::string& dir) {
  EngineOptions options;
  options.max_running_samples = 4;
  options.max_batch_tokens = 64;
  return MakeEngine(dir, /*digested=*/false, options);
}

// A CONTINUE update while a sample's prompt is being prefilled: the sample starts again on the
// new weights, so its one version span is true and its bits are those of the new weights alone.
// (Its prompt's first chunks kept the old weights' KV: the completion said "all v1" with
// logprobs of neither version; review24 finding 1.)
TEST(EngineUpdateTest, AContinueUpdateDuringAPromptsPrefillRestartsItOnTheNewWeights) {
  auto make = [] { return MakeSmallStepEngine(SmallModelDir()); };  // 30 prefill steps
  const HostTensor v1 = ScaledCheckpointTensor(SmallModelDir(), kTensor, 2.0f);
  SampleSpec spec = Spec(6);
  spec.prompt.clear();
  for (int32_t i = 0; i < 1900; ++i) spec.prompt.push_back((i * 7919 + 13) % 4000 + 3);

  std::unique_ptr<Engine> reference_engine = make();
  ASSERT_TRUE(Update(reference_engine.get(), "v1", UpdatePolicy::kContinue, {v1}).status.ok());
  const SampleCompletion reference = RunJob(reference_engine.get(), {spec})[0];

  std::unique_ptr<Engine> engine = make();
  auto in_flight = std::async(std::launch::async, [&] { return RunJob(engine.get(), {spec}); });
  while (engine->counters().prefilled_tokens < 256) std::this_thread::yield();
  ASSERT_TRUE(Update(engine.get(), "v1", UpdatePolicy::kContinue, {v1}).status.ok());
  const SampleCompletion c = in_flight.get()[0];
  ASSERT_EQ(c.version_spans.size(), 1u) << "the update came after the prefill: proves nothing";
  EXPECT_EQ(c.version_spans[0].version, "v1");
  EXPECT_EQ(c.weight_version, "v1");
  EXPECT_EQ(Bits(c), Bits(reference)) << "the prompt kept KV of the old weights";
  EXPECT_EQ(engine->counters().preemptions, 0u) << "a restart is not a preemption";
  EXPECT_EQ(engine->counters().recomputed_tokens, 0u) << "nor recomputation (a KV alert's)";
}

// The same for a Score sequence with its routing asked for: scored again from its start, its
// routing holds each scored row once (the first pass's rows stayed in it, shifting every row
// after them: a routing longer than its tokens).
TEST(EngineUpdateTest, AScoreRestartedByAContinueUpdateReturnsEachRowsRoutingOnce) {
  static const std::string dir = WriteModel("moe-small");
  auto make = [] { return MakeSmallStepEngine(dir); };
  const HostTensor v1 = ScaledCheckpointTensor(dir, "model.norm.weight", 2.0f);
  SampleSpec score;
  for (int32_t i = 0; i < 1500; ++i) score.prompt.push_back((i * 7919 + 13) % 4000 + 3);
  score.score_start = 1;
  score.return_routing = true;

  std::unique_ptr<Engine> reference_engine = make();
  ASSERT_TRUE(Update(reference_engine.get(), "v1", UpdatePolicy::kContinue, {v1}).status.ok());
  const SampleCompletion reference = RunJob(reference_engine.get(), {score})[0];
  ASSERT_FALSE(reference.routing.empty());
  ASSERT_EQ(reference.routing.size() % reference.logprobs.size(), 0u);

  std::unique_ptr<Engine> engine = make();
  auto in_flight = std::async(std::launch::async, [&] { return RunJob(engine.get(), {score}); });
  while (engine->counters().prefilled_tokens < 256) std::this_thread::yield();
  ASSERT_TRUE(Update(engine.get(), "v1", UpdatePolicy::kContinue, {v1}).status.ok());
  const SampleCompletion c = in_flight.get()[0];
  EXPECT_EQ(c.weight_version, "v1");
  EXPECT_EQ(c.logprobs.size(), reference.logprobs.size());
  EXPECT_EQ(c.routing.size(), reference.routing.size()) << "rows of the first pass stayed";
  EXPECT_EQ(c.routing, reference.routing);
  EXPECT_EQ(Bits(c), Bits(reference));
}

TEST(EngineUpdateTest, AnUpdateCancelledBeforeItActsAppliesNothingWhateverItsPolicy) {
  std::unique_ptr<Engine> engine = MakeEngine();
  auto in_flight =
      std::async(std::launch::async, [&] { return RunJob(engine.get(), {Spec(200)}); });
  while (engine->counters().generated_tokens < 2) std::this_thread::yield();
  for (UpdatePolicy policy :
       {UpdatePolicy::kAbort, UpdatePolicy::kContinue, UpdatePolicy::kDrain}) {
    std::promise<UpdateResult> promise;
    engine->UpdateWeights(
        OwnedWeightUpdate("v1", policy, {ScaledTensor(2.0f)}),
        [&promise](UpdateResult r) { promise.set_value(std::move(r)); }, [] { return true; });
    const UpdateResult r = promise.get_future().get();
    EXPECT_EQ(r.status.code(), absl::StatusCode::kCancelled) << r.status;
    EXPECT_EQ(r.previous_version, "v0");
    EXPECT_EQ(engine->weight_version(), "v0");
  }
  const SampleCompletion c = in_flight.get()[0];
  EXPECT_EQ(c.finish_reason, FinishReason::kLength) << "a cancelled ABORT update aborts nothing";
  EXPECT_EQ(c.weight_version, "v0");
}

TEST(EngineUpdateTest, ADrainUpdateCancelledWhileItWaitsAppliesNothingAndReleasesHeldWork) {
  std::unique_ptr<Engine> engine = MakeEngine();
  auto in_flight = StartInFlight(engine.get(), Spec(400));
  std::atomic<bool> cancelled{false};
  std::promise<UpdateResult> promise;
  engine->UpdateWeights(
      OwnedWeightUpdate("v1", UpdatePolicy::kDrain, {ScaledTensor(2.0f)}),
      [&promise](UpdateResult r) { promise.set_value(std::move(r)); },
      [&cancelled] { return cancelled.load(); });
  auto held = std::async(std::launch::async, [&] { return RunJob(engine.get(), {Spec()}); });
  cancelled = true;
  const UpdateResult r = promise.get_future().get();
  EXPECT_EQ(r.status.code(), absl::StatusCode::kCancelled) << r.status;
  EXPECT_EQ(held.get()[0].weight_version, "v0");
  EXPECT_EQ(in_flight.get()[0].weight_version, "v0");
  EXPECT_EQ(engine->weight_version(), "v0");
}

// Work submitted while a DRAIN update waits is held until the swap; it is a job all the same:
// an Abort of it (a client that cancelled, or the service's Abort by request id) ends it at
// once with FINISH_REASON_ABORT and no tokens, and nothing of it ever runs. (Held work was once
// outside the jobs Abort searched: it was "aborted" and then ran to completion on the new
// weights.) Only the aborted rollout ends; the job's other rollout runs after the swap.
TEST(EngineUpdateTest, AnAbortReachesWorkHeldBehindADrainUpdateAndItNeverRuns) {
  std::unique_ptr<Engine> engine = MakeEngine(SmallModelDir());
  auto in_flight = StartInFlight(engine.get(), Spec(4000));
  std::promise<UpdateResult> promise;
  auto answered = promise.get_future();
  engine->UpdateWeights(
      OwnedWeightUpdate("v1", UpdatePolicy::kDrain, {OriginalTensor(SmallModelDir())}),
      [&promise](UpdateResult r) { promise.set_value(std::move(r)); });
  std::vector<SampleSpec> specs = {Spec(4), Spec(4)};
  for (int32_t i = 0; i < 2; ++i) specs[i].rollout_index = specs[i].sample_index = i;
  Collector held(2);
  absl::StatusOr<uint64_t> job = engine->Submit(specs, held.Sink());
  ASSERT_TRUE(job.ok());
  engine->Abort(*job, /*rollout_index=*/1);
  Collector whole(1);
  absl::StatusOr<uint64_t> cancelled = engine->Submit({Spec(4)}, whole.Sink());
  ASSERT_TRUE(cancelled.ok());
  engine->Abort(*cancelled);
  const SampleCompletion c = whole.Wait()[0];
  EXPECT_EQ(c.finish_reason, FinishReason::kAbort);
  EXPECT_TRUE(c.token_ids.empty()) << "held work ran";
  EXPECT_EQ(c.weight_version, "v0");
  EXPECT_EQ(in_flight.wait_for(std::chrono::seconds(0)), std::future_status::timeout)
      << "the drain ended first; the test proves nothing about held work";
  engine->Abort(1);  // the in-flight sample's job: the drain ends, the update applies
  ASSERT_TRUE(answered.get().status.ok());
  const std::vector<SampleCompletion> rollouts = held.Wait();
  EXPECT_EQ(rollouts[0].finish_reason, FinishReason::kLength);
  EXPECT_EQ(rollouts[0].weight_version, "v1") << "the rollout not aborted runs after the swap";
  EXPECT_EQ(rollouts[1].finish_reason, FinishReason::kAbort);
  EXPECT_TRUE(rollouts[1].token_ids.empty());
  EXPECT_EQ(in_flight.get()[0].finish_reason, FinishReason::kAbort);
}

// AbortAll (what a shutdown does when its grace period ends) reaches held work too: it ends with
// FINISH_REASON_ABORT before the swap instead of starting on the new weights.
TEST(EngineUpdateTest, AbortAllEndsWorkHeldBehindADrainUpdate) {
  std::unique_ptr<Engine> engine = MakeEngine(SmallModelDir());
  auto in_flight = StartInFlight(engine.get(), Spec(4000));
  std::promise<UpdateResult> promise;
  auto answered = promise.get_future();
  engine->UpdateWeights(
      OwnedWeightUpdate("v1", UpdatePolicy::kDrain, {OriginalTensor(SmallModelDir())}),
      [&promise](UpdateResult r) { promise.set_value(std::move(r)); });
  Collector held(1);
  ASSERT_TRUE(engine->Submit({Spec(4)}, held.Sink()).ok());
  engine->AbortAll();
  const SampleCompletion c = held.Wait()[0];
  EXPECT_EQ(c.finish_reason, FinishReason::kAbort);
  EXPECT_TRUE(c.token_ids.empty()) << "held work ran";
  EXPECT_EQ(c.weight_version, "v0");
  EXPECT_EQ(in_flight.get()[0].finish_reason, FinishReason::kAbort);
  EXPECT_TRUE(answered.get().status.ok());
  EXPECT_EQ(engine->unfinished_samples(), 0);
}

TEST(EngineUpdateTest, PauseHoldsRequestsAndResumeRunsThemUnchanged) {
  std::unique_ptr<Engine> engine = MakeEngine();
  const std::string expected = Bits(RunJob(engine.get(), {Spec()})[0]);
  EXPECT_FALSE(*engine->Pause(false));
  EXPECT_TRUE(engine->paused());
  auto held = std::async(std::launch::async, [&] { return RunJob(engine.get(), {Spec()}); });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_EQ(held.wait_for(std::chrono::seconds(0)), std::future_status::timeout);
  EXPECT_EQ(engine->counters().waiting, 1);
  EXPECT_TRUE(engine->Resume());
  EXPECT_EQ(Bits(held.get()[0]), expected);
}

TEST(EngineUpdateTest, DrainWhilePausedWithWorkInFlightIsRefusedWithAReason) {
  std::unique_ptr<Engine> engine = MakeEngine();
  ASSERT_TRUE(engine->Pause(false).ok());
  auto held = std::async(std::launch::async, [&] { return RunJob(engine.get(), {Spec()}); });
  while (engine->counters().waiting == 0) std::this_thread::yield();
  UpdateResult r = Update(engine.get(), "v1", UpdatePolicy::kDrain, {ScaledTensor(2.0f)});
  EXPECT_EQ(r.status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(r.status.message().find("resume first"), std::string::npos);
  EXPECT_EQ(engine->weight_version(), "v0");
  engine->Resume();
  EXPECT_EQ(held.get()[0].weight_version, "v0");
}

TEST(EngineUpdateTest, PauseWithAbortEndsWhatRuns) {
  std::unique_ptr<Engine> engine = MakeEngine();
  auto running = std::async(std::launch::async, [&] { return RunJob(engine.get(), {Spec(400)}); });
  while (engine->counters().generated_tokens < 2) std::this_thread::yield();
  ASSERT_TRUE(engine->Pause(true).ok());
  EXPECT_EQ(running.get()[0].finish_reason, FinishReason::kAbort);
  engine->Resume();
}

}  // namespace
}  // namespace rollout
