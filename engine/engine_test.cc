#include "engine/engine.h"

#include <sys/resource.h>

#include <condition_variable>
#include <cstring>
#include <iostream>
#include <map>
#include <mutex>
#include <thread>

#include "absl/strings/str_cat.h"
#include "engine/engine_test_util.h"
#include "engine/sampler.h"
#include "gtest/gtest.h"
#include "model/random_model.h"
#include "runner/cpu/cpu_model_runner.h"

namespace rollout {
namespace {

const std::string& TinyModelDir() {
  static const std::string dir = [] {
    std::string d = ::testing::TempDir() + "engine-test-tiny";
    RandomModelOptions options;
    options.preset = "tiny";
    options.seed = 3;
    absl::Status s = WriteRandomModel(options, d);
    EXPECT_TRUE(s.ok()) << s;
    return d;
  }();
  return dir;
}

std::unique_ptr<Engine> MakeEngine(CpuRunnerOptions runner_options, EngineOptions options = {}) {
  absl::StatusOr<std::unique_ptr<Checkpoint>> ck = Checkpoint::Open(TinyModelDir());
  EXPECT_TRUE(ck.ok()) << ck.status();
  absl::StatusOr<std::unique_ptr<CpuModelRunner>> runner =
      CpuModelRunner::Create(**ck, runner_options);
  EXPECT_TRUE(runner.ok()) << runner.status();
  absl::StatusOr<std::unique_ptr<Engine>> engine = Engine::Create(*std::move(runner), options);
  EXPECT_TRUE(engine.ok()) << engine.status();
  return *std::move(engine);
}

// A fixed mix of prompts (short, page-crossing, multi-chunk) and sampling settings.
std::vector<SampleSpec> Workload() {
  std::vector<SampleSpec> specs;
  const std::vector<int> lengths = {1, 5, 17, 40, 90, 130};
  for (size_t i = 0; i < lengths.size(); ++i) {
    SampleSpec s;
    s.sample_index = static_cast<int32_t>(i);
    for (int t = 0; t < lengths[i]; ++t) s.prompt.push_back((t * 31 + i * 7 + 3) % 256);
    s.params.temperature = i % 2 == 0 ? 0.0f : 0.8f;
    s.params.top_p = i % 3 == 0 ? 0.9f : 1.0f;
    s.params.max_new_tokens = 20 + static_cast<int32_t>(i);
    s.params.ignore_eos = true;
    s.sample_seed = DeriveSampleSeed(99, static_cast<uint32_t>(i));
    specs.push_back(s);
  }
  return specs;
}

// CPU time of this process so far (every thread).
double ProcessCpuSeconds() {
  rusage usage;
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_utime.tv_sec + usage.ru_stime.tv_sec +
         1e-6 * (usage.ru_utime.tv_usec + usage.ru_stime.tv_usec);
}

// Every completion of `specs`, in sample order; none (and a test failure) if the engine refused
// them.
std::vector<SampleCompletion> RunToCompletion(Engine* engine,
                                              const std::vector<SampleSpec>& specs) {
  Collector collector(specs.size());
  if (auto job = engine->Submit(specs, collector.Sink()); !job.ok()) {
    ADD_FAILURE() << "Submit: " << job.status();
    return {};
  }
  return collector.Wait();
}

std::vector<std::string> RunWorkload(Engine* engine, std::vector<SampleSpec> specs) {
  std::vector<std::string> bits;
  for (const SampleCompletion& c : RunToCompletion(engine, specs)) bits.push_back(Bits(c));
  return bits;
}

TEST(EngineTest, ChunkSizeSplitSizeAndBudgetDoNotChangeAnyBit) {
  const std::vector<std::string> reference = RunWorkload(MakeEngine({}).get(), Workload());
  struct Config {
    int32_t split, budget, running;
  };
  for (Config c : {Config{16, 16, 4}, Config{32, 48, 8}, Config{64, 64, 64}, Config{16, 200, 2}}) {
    CpuRunnerOptions runner;
    runner.attention_split_size = c.split;
    runner.num_threads = 1 + c.split % 3;
    EngineOptions options;
    options.max_batch_tokens = c.budget;
    options.max_running_samples = c.running;
    EXPECT_EQ(RunWorkload(MakeEngine(runner, options).get(), Workload()), reference)
        << "split " << c.split << " budget " << c.budget << " running " << c.running;
  }
}

TEST(EngineTest, EachSampleAloneEqualsTheMixedBatch) {
  std::unique_ptr<Engine> engine = MakeEngine({});
  const std::vector<SampleSpec> specs = Workload();
  const std::vector<std::string> together = RunWorkload(engine.get(), specs);
  for (size_t i = 0; i < specs.size(); ++i) {
    SampleSpec alone = specs[i];
    alone.sample_index = 0;  // the Collector indexes a job's samples from 0
    EXPECT_EQ(RunWorkload(engine.get(), {alone})[0], together[i]) << "sample " << i;
  }
}

TEST(EngineTest, PreemptionUnderKvPressureGivesTheSameBits) {
  const std::vector<std::string> reference = RunWorkload(MakeEngine({}).get(), Workload());
  CpuRunnerOptions small;
  // 10 blocks of 16 tokens (K and V, 2 layers, 2 KV heads of 16 floats): just enough for the
  // longest sample alone, far less than the workload needs at once.
  small.kv_cache_bytes = 10ll * (2 * 2 * 16 * 2 * 16 * sizeof(float));
  EngineOptions optimistic;
  optimistic.admission = AdmissionPolicy::kOptimistic;  // admits on the prompt: preempts
  std::unique_ptr<Engine> engine = MakeEngine(small, optimistic);
  ASSERT_EQ(engine->counters().kv_blocks_total, 10);
  EXPECT_EQ(RunWorkload(engine.get(), Workload()), reference);
  EXPECT_GT(engine->counters().preemptions, 0u);
  const EngineCounters c = engine->counters();
  EXPECT_EQ(c.kv_blocks_free + c.kv_blocks_cached, c.kv_blocks_total) << "no block leaked";
}

// 32 rollouts of 64 + 192 tokens against a pool of 2048 tokens (4x over-subscribed). Under the
// default admission (kReserve) every sample completes with all its tokens and the bits of a
// roomy pool, and nothing is recomputed; the optimistic policy, run beside it as the yardstick,
// preempts and recomputes (and keeps the bits too: D5).
std::vector<SampleSpec> OverSubscribingWorkload(std::vector<int32_t> stop_token_ids) {
  std::vector<SampleSpec> specs;
  for (int i = 0; i < 32; ++i) {
    SampleSpec s;
    s.sample_index = i;
    for (int t = 0; t < 64; ++t) s.prompt.push_back((t * 13 + i * 29 + 1) % 256);
    s.params.temperature = 0.8f;
    s.params.max_new_tokens = 192;
    s.params.ignore_eos = true;
    s.params.stop_token_ids = stop_token_ids;
    s.sample_seed = DeriveSampleSeed(5, static_cast<uint32_t>(i));
    specs.push_back(s);
  }
  return specs;
}

CpuRunnerOptions PoolOf2048Tokens() {
  CpuRunnerOptions small;
  small.kv_cache_bytes = 2048ll * (2 * 2 * 16 * 2 * sizeof(float));  // the tiny model's KV/token
  return small;
}

TEST(EngineAdmissionTest, FourTimesOverSubscribedPoolFinishesEverySampleWithoutRecompute) {
  const std::vector<SampleSpec> specs = OverSubscribingWorkload({});
  const std::vector<std::string> reference = RunWorkload(MakeEngine({}).get(), specs);
  const CpuRunnerOptions small = PoolOf2048Tokens();
  uint64_t reserve_steps = 0;
  for (AdmissionPolicy policy :
       {AdmissionPolicy::kReserve, AdmissionPolicy::kEstimate, AdmissionPolicy::kOptimistic}) {
    const char* name = AdmissionPolicyName(policy);
    EngineOptions options;
    options.admission = policy;
    std::unique_ptr<Engine> engine = MakeEngine(small, options);
    ASSERT_EQ(engine->counters().kv_blocks_total * 16, 2048);
    const std::vector<SampleCompletion> done = RunToCompletion(engine.get(), specs);
    ASSERT_EQ(done.size(), specs.size());
    for (size_t i = 0; i < done.size(); ++i) {
      EXPECT_EQ(done[i].token_ids.size(), 192u) << name << ", sample " << i;
      EXPECT_EQ(done[i].finish_reason, FinishReason::kLength) << name << ", sample " << i;
      EXPECT_EQ(Bits(done[i]), reference[i]) << name << ", sample " << i;
    }
    const EngineCounters c = engine->counters();
    std::cout << "[admission] " << name << ": " << c.preemptions << " preemptions, "
              << c.recomputed_tokens << " recomputed tokens, " << c.prefilled_tokens
              << " prefilled for " << c.prompt_tokens << " prompt tokens, " << c.steps << " steps"
              << std::endl;
    if (policy == AdmissionPolicy::kReserve) {
      EXPECT_EQ(c.preemptions, 0u);
      EXPECT_LE(c.recomputed_tokens, c.prompt_tokens / 4);
      reserve_steps = c.steps;
    } else if (policy == AdmissionPolicy::kEstimate) {
      // Samples that cannot stop early (ignore_eos, no stop tokens) are charged all of
      // max_new_tokens, as under kReserve: the same schedule, nothing preempted (before they
      // were charged the estimate too: 2 preemptions, 415 tokens recomputed).
      EXPECT_EQ(c.preemptions, 0u);
      EXPECT_EQ(c.recomputed_tokens, 0u);
      EXPECT_EQ(c.steps, reserve_steps);
    } else {
      EXPECT_GT(c.preemptions, 0u) << "the yardstick was never short of KV";
    }
    EXPECT_EQ(c.kv_blocks_free + c.kv_blocks_cached, c.kv_blocks_total) << "no block leaked";
  }
}

// A pool that holds a quarter of the samples (long generations bound by KV): the decode
// lookahead runs beside the samples that wait, since the next schedule could not admit them,
// except on the steps after which a sample ends by length (its KV admits the next one). The
// schedule is that of one step at a time, step for step, and the bits those of a roomy pool.
// (Before, any waiting sample turned the lookahead off: only the last wave's steps ran ahead.)
TEST(EngineAdmissionTest, TheLookaheadRunsBesideSamplesThatCannotBeAdmittedYet) {
  const std::vector<SampleSpec> specs = OverSubscribingWorkload({});
  const std::vector<std::string> reference = RunWorkload(MakeEngine({}).get(), specs);
  for (AdmissionPolicy policy : {AdmissionPolicy::kReserve, AdmissionPolicy::kEstimate}) {
    const char* name = AdmissionPolicyName(policy);
    EngineOptions one_at_a_time, ahead;
    one_at_a_time.admission = ahead.admission = policy;
    ahead.lookahead_on_synchronous_runners = true;  // the CPU runner computes at launch
    std::unique_ptr<Engine> plain = MakeEngine(PoolOf2048Tokens(), one_at_a_time);
    std::unique_ptr<Engine> engine = MakeEngine(PoolOf2048Tokens(), ahead);
    EXPECT_EQ(RunWorkload(plain.get(), specs), reference) << name;
    EXPECT_EQ(RunWorkload(engine.get(), specs), reference) << name;
    const EngineCounters p = plain->counters(), c = engine->counters();
    std::cout << "[lookahead beside waiting samples] " << name << ": " << c.lookahead_steps
              << " of " << c.steps << " steps launched ahead (one at a time: " << p.steps
              << " steps)" << std::endl;
    EXPECT_EQ(p.lookahead_steps, 0u) << name;
    EXPECT_EQ(c.steps, p.steps) << name << ": the lookahead changed the schedule";
    EXPECT_EQ(c.preemptions, p.preemptions) << name;
    // 8 of the 32 samples run at once: the last wave alone is a quarter of the steps.
    EXPECT_GT(c.lookahead_steps, c.steps / 2) << name;
    EXPECT_EQ(c.kv_blocks_free + c.kv_blocks_cached, c.kv_blocks_total) << "no block leaked";
  }
}

// The same pool, samples that stop early on sampled tokens (mostly well before max_new_tokens,
// as RL rollouts do): kEstimate runs more of them at once than kReserve, which holds room for
// max_new_tokens, and both keep the bits and the lengths of a roomy pool.
TEST(EngineAdmissionTest, SamplesThatStopEarlyRunMoreAtOnceUnderTheEstimate) {
  std::vector<int32_t> stops;
  for (int32_t t = 5; t < 256; t += 8) stops.push_back(t);  // 1/8 of the vocabulary
  const std::vector<SampleSpec> specs = OverSubscribingWorkload(stops);
  const std::vector<SampleCompletion> reference = RunToCompletion(MakeEngine({}).get(), specs);
  ASSERT_EQ(reference.size(), specs.size());
  size_t stopped_early = 0;
  for (const SampleCompletion& c : reference) stopped_early += c.token_ids.size() < 96;
  ASSERT_GE(stopped_early, specs.size() / 3) << "the workload is not RL-shaped";
  uint64_t steps[2] = {0, 0};
  for (AdmissionPolicy policy : {AdmissionPolicy::kReserve, AdmissionPolicy::kEstimate}) {
    const bool estimate = policy == AdmissionPolicy::kEstimate;
    EngineOptions options;
    options.admission = policy;
    std::unique_ptr<Engine> engine = MakeEngine(PoolOf2048Tokens(), options);
    const std::vector<SampleCompletion> done = RunToCompletion(engine.get(), specs);
    ASSERT_EQ(done.size(), specs.size());
    for (size_t i = 0; i < done.size(); ++i) {
      EXPECT_EQ(Bits(done[i]), Bits(reference[i])) << "sample " << i;
      EXPECT_EQ(done[i].finish_reason, reference[i].finish_reason) << "sample " << i;
    }
    const EngineCounters c = engine->counters();
    std::cout << "[admission, early stops] " << (estimate ? "estimate" : "reserve") << ": "
              << c.preemptions << " preemptions, " << c.recomputed_tokens << " recomputed tokens, "
              << c.prefilled_tokens << " prefilled for " << c.prompt_tokens << " prompt tokens, "
              << c.steps << " steps" << std::endl;
    steps[estimate] = c.steps;
    EXPECT_LE(c.recomputed_tokens, c.prompt_tokens / 4);
    EXPECT_EQ(c.kv_blocks_free + c.kv_blocks_cached, c.kv_blocks_total) << "no block leaked";
  }
  EXPECT_LT(steps[1], steps[0]) << "the estimate admitted no more at once than the reservation";
}

TEST(EngineTest, DecodeLookaheadGivesTheBitsOfOneStepAtATime) {
  EngineOptions one_at_a_time;
  one_at_a_time.decode_lookahead = false;
  std::unique_ptr<Engine> plain = MakeEngine({}, one_at_a_time);
  const std::vector<std::string> reference = RunWorkload(plain.get(), Workload());
  EXPECT_EQ(plain->counters().lookahead_steps, 0u);
  EngineOptions ahead;
  ahead.lookahead_on_synchronous_runners = true;  // the CPU runner computes at launch
  std::unique_ptr<Engine> engine = MakeEngine({}, ahead);
  EXPECT_EQ(RunWorkload(engine.get(), Workload()), reference);
  EXPECT_GT(engine->counters().lookahead_steps, 10u);
  // By default the engine does not look ahead on a runner that computes at launch.
  std::unique_ptr<Engine> cpu_default = MakeEngine({});
  EXPECT_EQ(RunWorkload(cpu_default.get(), Workload()), reference);
  EXPECT_EQ(cpu_default->counters().lookahead_steps, 0u);

  // Samples that stop on a sampled token while the next step is launched with their rows (the
  // rows are dropped), beside samples that go on, and one that ends by length.
  std::vector<SampleSpec> specs = Workload();
  {
    Collector collector(specs.size());
    ASSERT_TRUE(plain->Submit(specs, collector.Sink()).ok());
    const std::vector<SampleCompletion> full = collector.Wait();
    for (size_t i = 0; i + 1 < specs.size(); ++i) {
      ASSERT_GT(full[i].token_ids.size(), 3 + i);
      specs[i].params.stop_token_ids = {full[i].token_ids[3 + i]};
    }
  }
  Collector stopped(specs.size()), stopped_plain(specs.size());
  const uint64_t lookahead_before = engine->counters().lookahead_steps;
  ASSERT_TRUE(engine->Submit(specs, stopped.Sink()).ok());
  ASSERT_TRUE(plain->Submit(specs, stopped_plain.Sink()).ok());
  const std::vector<SampleCompletion> got = stopped.Wait(), want = stopped_plain.Wait();
  for (size_t i = 0; i < specs.size(); ++i) {
    EXPECT_EQ(Bits(got[i]), Bits(want[i])) << "sample " << i;
    const bool stops = i + 1 < specs.size();
    EXPECT_EQ(got[i].finish_reason, stops ? FinishReason::kStop : FinishReason::kLength) << i;
  }
  const EngineCounters c = engine->counters();
  EXPECT_GT(c.lookahead_steps, lookahead_before + 10);
  EXPECT_EQ(c.kv_blocks_free + c.kv_blocks_cached, c.kv_blocks_total) << "no block leaked";
  EXPECT_EQ(c.unfinished_samples, 0);
}

// ModelRunner's step pipeline as the CPU runner has it (the default): its errors, and a fed
// token that gives the bits of the same token passed explicitly.
TEST(ModelRunnerStepTest, LaunchAndCollectKeepTheirContract) {
  absl::StatusOr<std::unique_ptr<Checkpoint>> ck = Checkpoint::Open(TinyModelDir());
  ASSERT_TRUE(ck.ok()) << ck.status();
  absl::StatusOr<std::unique_ptr<CpuModelRunner>> made = CpuModelRunner::Create(**ck, {});
  ASSERT_TRUE(made.ok()) << made.status();
  CpuModelRunner& runner = **made;
  SamplingParams greedy;
  greedy.temperature = 0.0f;
  LogitsRowTask task;
  task.params = &greedy;
  // fed_row set: the token is row fed_row of the step launched before.
  auto one_token = [](int32_t id, int32_t pos, std::optional<int32_t> fed_row = std::nullopt) {
    ForwardBatch b;
    b.token_ids = {id};
    if (fed_row.has_value()) b.fed_tokens = {{0, *fed_row}};
    b.positions = {pos};
    b.token_seq = {0};
    b.block_tables = {{0}};
    b.logit_rows = {0};
    return b;
  };
  std::vector<SampleResult> results;
  EXPECT_EQ(runner.CollectStep(&results).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(runner.LaunchStep(one_token(0, 1, 0), {task}).code(),
            absl::StatusCode::kInvalidArgument);  // fed, with nothing launched before

  task.position = 1;
  ASSERT_TRUE(runner.LaunchStep(one_token(7, 0), {task}).ok());
  EXPECT_EQ(runner.LaunchStep(one_token(0, 1, 1), {task}).code(),
            absl::StatusCode::kInvalidArgument);  // row 1 of a one-row step
  task.position = 2;
  ASSERT_TRUE(runner.LaunchStep(one_token(0, 1, 0), {task}).ok());
  EXPECT_EQ(runner.LaunchStep(one_token(0, 2, 0), {task}).code(),
            absl::StatusCode::kFailedPrecondition);  // a third step in flight
  std::vector<SampleResult> first, second;
  ASSERT_TRUE(runner.CollectStep(&first).ok());
  ASSERT_TRUE(runner.CollectStep(&second).ok());
  ASSERT_EQ(first.size(), 1u);
  ASSERT_EQ(second.size(), 1u);

  // The same two steps with the first token passed explicitly.
  std::vector<float> logits;
  std::vector<SampleResult> want;
  ASSERT_TRUE(runner.Forward(one_token(7, 0), &logits).ok());
  ASSERT_TRUE(runner.Forward(one_token(first[0].token, 1), &logits).ok());
  ASSERT_TRUE(runner.ProcessLogits({task}, logits, &want).ok());
  EXPECT_EQ(second[0].token, want[0].token);
  EXPECT_EQ(std::memcmp(&second[0].logprob, &want[0].logprob, 4), 0);
}

TEST(EngineTest, StreamedTokensEqualTheCompletion) {
  std::unique_ptr<Engine> engine = MakeEngine({});
  std::vector<SampleSpec> specs = Workload();
  Collector collector(specs.size());
  ASSERT_TRUE(engine->Submit(specs, collector.Sink()).ok());
  std::vector<SampleCompletion> done = collector.Wait();
  for (size_t i = 0; i < specs.size(); ++i) {
    EXPECT_EQ(collector.streamed(static_cast<int>(i)), done[i].token_ids);
    EXPECT_EQ(done[i].token_ids.size(), done[i].logprobs.size());
    EXPECT_EQ(done[i].finish_reason, FinishReason::kLength);
    EXPECT_EQ(static_cast<int32_t>(done[i].token_ids.size()), specs[i].params.max_new_tokens);
  }
}

TEST(EngineTest, AbortEndsSamplesWithTheirTokensSoFarAndFreesKv) {
  std::unique_ptr<Engine> engine = MakeEngine({});
  SampleSpec spec = Workload()[2];
  spec.sample_index = 0;
  spec.params.max_new_tokens = 400;
  Collector collector(1);
  absl::StatusOr<uint64_t> job = engine->Submit({spec}, collector.Sink());
  ASSERT_TRUE(job.ok());
  while (collector.streamed(0).size() < 3) std::this_thread::yield();
  engine->Abort(*job);
  SampleCompletion c = collector.Wait()[0];
  EXPECT_EQ(c.finish_reason, FinishReason::kAbort);
  EXPECT_GE(c.token_ids.size(), 3u);
  EXPECT_LT(c.token_ids.size(), 400u);
  EXPECT_EQ(c.token_ids, collector.streamed(0));
  for (int i = 0; i < 100 && engine->counters().running > 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  const EngineCounters counters = engine->counters();
  EXPECT_EQ(counters.kv_blocks_free + counters.kv_blocks_cached, counters.kv_blocks_total);
}

TEST(EngineTest, DestroyingTheEngineCompletesEverySampleWithAbort) {
  Collector collector(3);
  {
    std::unique_ptr<Engine> engine = MakeEngine({});
    std::vector<SampleSpec> specs(3, Workload()[1]);
    for (int i = 0; i < 3; ++i) {
      specs[i].sample_index = i;
      specs[i].params.max_new_tokens = 400;
    }
    ASSERT_TRUE(engine->Submit(specs, collector.Sink()).ok());
  }
  for (const SampleCompletion& c : collector.Wait()) {
    EXPECT_EQ(c.finish_reason, FinishReason::kAbort);
  }
}

TEST(EngineTest, SubmitRejectsInvalidSamplesWithAnActionableMessage) {
  std::unique_ptr<Engine> engine = MakeEngine({});
  SampleSpec spec = Workload()[0];
  spec.prompt.push_back(256);
  absl::StatusOr<uint64_t> job = engine->Submit({spec}, [](std::vector<SampleEvent>) {});
  ASSERT_FALSE(job.ok());
  EXPECT_EQ(job.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(job.status().message().find("outside the vocabulary [0, 256)"), std::string::npos)
      << job.status();
}

// Below kMinTemperature, logits / T leave fp32's range (at 1e-45 every positive logit became
// the largest float and logprobs -inf): such temperatures are refused; 0 (greedy) and the
// minimum itself run.
TEST(EngineTest, TemperaturesBetweenZeroAndTheMinimumAreRefused) {
  std::unique_ptr<Engine> engine = MakeEngine({});
  for (float t : {1e-45f, 1e-38f, 1e-6f, 0.00099f}) {
    SampleSpec spec = Workload()[0];
    spec.params.temperature = t;
    const absl::Status s = engine->Validate(spec);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << t;
    EXPECT_NE(s.message().find("at least 0.001"), std::string::npos) << s;
  }
  for (float t : {0.0f, kMinTemperature, 1.0f}) {
    SampleSpec spec = Workload()[0];
    spec.params.temperature = t;
    EXPECT_TRUE(engine->Validate(spec).ok()) << t;
  }
}

// The server validates each request where its client learns of an error, then submits without
// a second check: the same samples give the same bits either way, and an empty job is refused.
TEST(EngineTest, SubmitValidatedRunsTheSamplesOfSubmitBitwise) {
  std::unique_ptr<Engine> engine = MakeEngine({});
  const std::vector<SampleSpec> specs = Workload();
  for (const SampleSpec& spec : specs) ASSERT_TRUE(engine->Validate(spec).ok());
  const std::vector<std::string> submitted = RunWorkload(engine.get(), specs);
  Collector collector(specs.size());
  ASSERT_TRUE(engine->SubmitValidated(specs, collector.Sink()).ok());
  std::vector<std::string> bits;
  for (const SampleCompletion& c : collector.Wait()) bits.push_back(Bits(c));
  EXPECT_EQ(bits, submitted);
  EXPECT_EQ(engine->SubmitValidated({}, [](std::vector<SampleEvent>) {}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(EngineTest, CreateRejectsABudgetSmallerThanTheSplitSize) {
  absl::StatusOr<std::unique_ptr<Checkpoint>> ck = Checkpoint::Open(TinyModelDir());
  ASSERT_TRUE(ck.ok());
  auto runner = CpuModelRunner::Create(**ck, {});
  ASSERT_TRUE(runner.ok());
  EngineOptions options;
  options.max_batch_tokens = 32;  // split size is 64
  options.max_running_samples = 8;
  absl::StatusOr<std::unique_ptr<Engine>> engine = Engine::Create(*std::move(runner), options);
  ASSERT_FALSE(engine.ok());
  EXPECT_NE(engine.status().message().find("split size"), std::string::npos);
}

TEST(EngineTest, APausedJobKeepsItsKvAndPlaceWhileOthersRunThenResumesWithTheSameBits) {
  EngineOptions ahead;
  ahead.lookahead_on_synchronous_runners = true;  // the lookahead must leave paused samples out
  for (const EngineOptions& options : {EngineOptions(), ahead}) {
    SCOPED_TRACE(options.lookahead_on_synchronous_runners ? "lookahead" : "one step at a time");
    std::unique_ptr<Engine> engine = MakeEngine({}, options);
    const std::vector<std::string> alone = RunWorkload(engine.get(), Workload());
    std::vector<SampleSpec> others = Workload();
    for (SampleSpec& s : others) s.sample_seed += 1000;

    Collector paused(Workload().size());
    absl::StatusOr<uint64_t> job = engine->Submit(Workload(), paused.Sink());
    ASSERT_TRUE(job.ok());
    engine->PauseJob(*job);
    // Another job runs to its end meanwhile.
    RunWorkload(engine.get(), others);
    const size_t streamed = paused.num_streamed();
    const double cpu_before = ProcessCpuSeconds();
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    EXPECT_EQ(paused.num_streamed(), streamed);
    EXPECT_EQ(paused.num_done(), 0u);
    // Nothing else to run: the engine thread sleeps instead of looping over nothing.
    EXPECT_LT(ProcessCpuSeconds() - cpu_before, 0.05);
    const EngineCounters held = engine->counters();
    EXPECT_EQ(held.running + held.waiting, static_cast<int32_t>(Workload().size()));

    engine->ResumeJob(*job);
    std::vector<std::string> resumed;
    for (const SampleCompletion& c : paused.Wait()) resumed.push_back(Bits(c));
    EXPECT_EQ(resumed, alone);
  }
}

TEST(EngineTest, PauseAndResumeOfUnknownOrFinishedJobsAreIgnored) {
  std::unique_ptr<Engine> engine = MakeEngine({});
  Collector collector(Workload().size());
  absl::StatusOr<uint64_t> job = engine->Submit(Workload(), collector.Sink());
  ASSERT_TRUE(job.ok());
  collector.Wait();
  engine->PauseJob(*job);
  engine->PauseJob(*job + 100);
  engine->ResumeJob(*job + 100);
  EXPECT_EQ(RunWorkload(engine.get(), Workload()).size(), Workload().size());
}

}  // namespace
}  // namespace rollout

namespace rollout {
namespace {

TEST(EngineCacheTest, PrefixCacheHitsGiveTheBitsOfMissesAndAreCounted) {
  std::unique_ptr<Engine> engine = MakeEngine({});
  const std::vector<std::string> cold = RunWorkload(engine.get(), Workload());
  const uint64_t hits_before = engine->counters().cache_hit_tokens;
  const std::vector<std::string> warm = RunWorkload(engine.get(), Workload());
  EXPECT_EQ(warm, cold);
  EXPECT_GT(engine->counters().cache_hit_tokens, hits_before) << "the second run must hit";
  EXPECT_GT(engine->counters().kv_blocks_cached, 0);

  CpuRunnerOptions runner;
  EngineOptions no_cache;
  no_cache.prefix_cache = false;
  std::unique_ptr<Engine> uncached = MakeEngine(runner, no_cache);
  EXPECT_EQ(RunWorkload(uncached.get(), Workload()), cold);
  EXPECT_EQ(uncached->counters().cache_hit_tokens, 0u);
}

TEST(EngineCacheTest, AMultiTurnPromptHitsOnTheGeneratedTokens) {
  std::unique_ptr<Engine> engine = MakeEngine({});
  SampleSpec first = Workload()[3];  // 40 prompt tokens
  first.sample_index = 0;
  first.params.max_new_tokens = 30;
  Collector c1(1);
  ASSERT_TRUE(engine->Submit({first}, c1.Sink()).ok());
  const SampleCompletion done = c1.Wait()[0];
  SampleSpec second = first;
  second.prompt.insert(second.prompt.end(), done.token_ids.begin(), done.token_ids.end());
  second.prompt.push_back(7);  // the next user turn
  Collector c2(1);
  ASSERT_TRUE(engine->Submit({second}, c2.Sink()).ok());
  const SampleCompletion hit = c2.Wait()[0];
  // 40 + 30 = 70 tokens were computed before; whole pages of 16 of them are reusable.
  EXPECT_EQ(hit.cached_prompt_tokens, 64);

  std::unique_ptr<Engine> fresh = MakeEngine({});
  Collector c3(1);
  ASSERT_TRUE(fresh->Submit({second}, c3.Sink()).ok());
  const SampleCompletion miss = c3.Wait()[0];
  EXPECT_EQ(miss.cached_prompt_tokens, 0);
  EXPECT_EQ(Bits(hit), Bits(miss));
}

TEST(EngineCacheTest, FlushWhileRunningLeavesRunningSamplesUndisturbed) {
  std::unique_ptr<Engine> engine = MakeEngine({});
  const std::vector<std::string> reference = RunWorkload(engine.get(), Workload());
  std::vector<SampleSpec> specs = Workload();
  Collector collector(specs.size());
  ASSERT_TRUE(engine->Submit(specs, collector.Sink()).ok());
  std::mutex mu;
  std::condition_variable cv;
  int flushes = 0;
  for (int i = 0; i < 5; ++i) {
    engine->FlushCache([&](FlushResult) {
      std::lock_guard<std::mutex> lock(mu);
      ++flushes;
      cv.notify_all();
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  std::vector<std::string> bits;
  for (const SampleCompletion& c : collector.Wait()) bits.push_back(Bits(c));
  EXPECT_EQ(bits, reference);
  std::unique_lock<std::mutex> lock(mu);
  cv.wait(lock, [&] { return flushes == 5; });
  const EngineCounters counters = engine->counters();
  EXPECT_EQ(counters.kv_blocks_free + counters.kv_blocks_cached, counters.kv_blocks_total);
}

TEST(EngineScoreTest, ScoreEqualsGenerationLogprobsBitwise) {
  std::unique_ptr<Engine> engine = MakeEngine({});
  for (float temperature : {0.0f, 0.7f, 1.0f, 1.3f}) {
    for (int prompt_len : {1, 15, 16, 17, 70}) {
      SampleSpec gen;
      for (int t = 0; t < prompt_len; ++t) gen.prompt.push_back((t * 13 + 5) % 256);
      gen.params.temperature = temperature;
      gen.params.max_new_tokens = 12;
      gen.params.ignore_eos = true;
      gen.params.top_logprobs = 3;
      gen.sample_seed = 42;
      Collector g(1);
      ASSERT_TRUE(engine->Submit({gen}, g.Sink()).ok());
      const SampleCompletion generated = g.Wait()[0];

      SampleSpec score;
      score.prompt = gen.prompt;
      score.prompt.insert(score.prompt.end(), generated.token_ids.begin(),
                          generated.token_ids.end());
      score.score_start = prompt_len;
      score.params.temperature = temperature;
      score.params.top_logprobs = 3;
      Collector s(1);
      ASSERT_TRUE(engine->Submit({score}, s.Sink()).ok());
      const SampleCompletion scored = s.Wait()[0];
      ASSERT_EQ(scored.logprobs.size(), generated.logprobs.size());
      for (size_t i = 0; i < scored.logprobs.size(); ++i) {
        EXPECT_EQ(std::memcmp(&scored.logprobs[i], &generated.logprobs[i], 4), 0)
            << "T=" << temperature << " prompt " << prompt_len << " token " << i;
        ASSERT_EQ(scored.top_logprobs[i].size(), 3u);
        EXPECT_EQ(scored.top_logprobs[i][0].token, generated.top_logprobs[i][0].token);
      }
    }
  }
  EXPECT_GT(engine->counters().scored_tokens, 0u);
}

TEST(EngineScoreTest, ScoreRejectsAStartOutsideTheSequence) {
  std::unique_ptr<Engine> engine = MakeEngine({});
  SampleSpec score;
  score.prompt = {1, 2, 3};
  score.score_start = 3;
  absl::StatusOr<uint64_t> job = engine->Submit({score}, [](std::vector<SampleEvent>) {});
  ASSERT_FALSE(job.ok());
  EXPECT_NE(job.status().message().find("start = 3"), std::string::npos) << job.status();
}

// top_logprobs is the sampling's field for a generated sample and the sequence's own for a
// scored one (a ScoreSequence has no sampling); either way the message gives the bound.
TEST(EngineScoreTest, TopLogprobsBeyondTheBoundNameEachKindsFieldAndTheBound) {
  std::unique_ptr<Engine> engine = MakeEngine({});
  SampleSpec generate = Workload()[0];
  generate.params.top_logprobs = kMaxTopLogprobs + 1;
  EXPECT_EQ(std::string(engine->Validate(generate).message()),
            "sampling.top_logprobs = 21; at most 20 are returned");
  SampleSpec score;
  score.prompt = {1, 2, 3};
  score.score_start = 1;
  score.params.top_logprobs = kMaxTopLogprobs + 1;
  EXPECT_EQ(std::string(engine->Validate(score).message()),
            "top_logprobs = 21; at most 20 are returned");
  score.params.top_logprobs = kMaxTopLogprobs;
  EXPECT_TRUE(engine->Validate(score).ok());
}

TEST(EngineTest, AbortOfOneRolloutLeavesTheOthersRunning) {
  std::unique_ptr<Engine> engine = MakeEngine({});
  std::vector<SampleSpec> specs = Workload();
  for (size_t i = 0; i < specs.size(); ++i) {
    specs[i].rollout_index = static_cast<int32_t>(i % 2);
    specs[i].params.max_new_tokens = 200;
  }
  Collector collector(specs.size());
  absl::StatusOr<uint64_t> job = engine->Submit(specs, collector.Sink());
  ASSERT_TRUE(job.ok());
  engine->Abort(*job, 1);
  const std::vector<SampleCompletion> done = collector.Wait();
  for (size_t i = 0; i < specs.size(); ++i) {
    EXPECT_EQ(done[i].finish_reason, i % 2 == 1 ? FinishReason::kAbort : FinishReason::kLength)
        << "sample " << i;
  }
}

}  // namespace
}  // namespace rollout
