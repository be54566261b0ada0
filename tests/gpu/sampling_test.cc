// GPU sampling and scoring (CudaModelRunner::ProcessLogits, kernels/cuda/sampling.cu): the
// device's uniform noise equals the host's bitwise; results agree with the host sampler
// (ProcessLogitsOnHost) within tolerance; a row's results are bitwise independent of the other
// rows of the call; device-kept logits give what uploaded logits give; and through the Engine,
// Score reproduces Generate's logprobs bitwise.
#include <cfloat>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <random>

#include "common/thread_pool.h"
#include "engine/engine.h"
#include "engine/sampler.h"
#include "kernels/cuda/sampling.h"
#include "model/random_model.h"
#include "runner/cuda/cuda_model_runner.h"
#include "runner/host_logits.h"
#include "tests/gpu/gpu_test_util.h"

namespace rollout {
namespace {

using gpu_test::HaveGpu;

constexpr int32_t kVocab = 151936;

std::unique_ptr<CudaModelRunner> BigVocabRunner() {
  ModelConfig c = *PresetConfig("small");
  c.num_layers = 1;
  c.vocab_size = kVocab;
  CudaRunnerOptions o;
  o.kv_cache_bytes = 64ll << 20;
  o.max_batch_tokens = 1024;
  auto r = CudaModelRunner::CreateSynthetic(c, 9, o);
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? *std::move(r) : nullptr;
}

// Rows of logits that look like a language model's (a few large values over a noisy floor),
// with ties, NaN, +-inf and an all -inf row mixed in.
std::vector<float> MakeRows(int rows, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::vector<float> l(static_cast<size_t>(rows) * kVocab);
  for (int r = 0; r < rows; ++r) {
    float* row = l.data() + static_cast<size_t>(r) * kVocab;
    for (int i = 0; i < kVocab; ++i) row[i] = normal(rng);
    for (int k = 0; k < 20; ++k) row[rng() % kVocab] = 8.0f + normal(rng);
    if (r % 17 == 3) row[rng() % kVocab] = row[rng() % kVocab] = 30.0f;  // tied max
    if (r % 19 == 5) row[rng() % kVocab] = NAN;
    if (r % 23 == 7) row[rng() % kVocab] = -INFINITY;
    if (r % 29 == 13) row[rng() % kVocab] = INFINITY;
    if (r == 11) std::fill(row, row + kVocab, -INFINITY);
  }
  return l;
}

// The rows MakeRows gives a NaN or an infinity: SampleResult::nonfinite.
bool MadeNonFinite(int r) { return r % 19 == 5 || r % 23 == 7 || r % 29 == 13 || r == 11; }

std::vector<SamplingParams> ParamVariants() {
  std::vector<SamplingParams> v(9);
  v[0].temperature = 0.0f;
  v[1].temperature = 1.0f;
  v[2].temperature = 0.7f;
  v[2].top_logprobs = 5;
  v[3].temperature = 1.3f;
  v[3].top_logprobs = 20;
  v[4].temperature = 1.0f;
  v[4].top_k = 50;
  v[5].temperature = 0.8f;
  v[5].top_p = 0.9f;
  v[6].temperature = 1.0f;
  v[6].min_p = 0.05f;
  v[6].top_logprobs = 3;
  v[7].temperature = 0.0f;
  v[7].top_logprobs = 20;
  v[8].temperature = 0.6f;  // scoring rows use this one
  v[8].top_logprobs = 7;
  return v;
}

std::vector<LogitsRowTask> MakeTasks(int rows, const std::vector<SamplingParams>& params) {
  std::vector<LogitsRowTask> tasks(rows);
  for (int r = 0; r < rows; ++r) {
    tasks[r].params = &params[r % params.size()];
    tasks[r].sample_seed = 1000 + 7 * r;
    tasks[r].position = 100 + r;
    if (r % params.size() == 8) tasks[r].score_token = (r * 7919) % kVocab;
  }
  return tasks;
}

bool SameBits(const SampleResult& a, const SampleResult& b) {
  if (a.token != b.token || std::memcmp(&a.logprob, &b.logprob, 4) != 0) return false;
  if (a.nonfinite != b.nonfinite) return false;
  if (a.top.size() != b.top.size()) return false;
  for (size_t j = 0; j < a.top.size(); ++j) {
    if (a.top[j].token != b.top[j].token ||
        std::memcmp(&a.top[j].logprob, &b.top[j].logprob, 4) != 0) {
      return false;
    }
  }
  return true;
}

TEST(SamplingTest, DeviceUniformNoiseEqualsTheHostsBitwise) {
  if (!HaveGpu()) GTEST_SKIP() << "no GPU";
  cuda::DeviceBuffer out;
  ASSERT_CUDA_OK(out.Allocate(kVocab * 4));
  int64_t mismatches = 0;
  for (uint64_t seed : {0ull, 1ull, 0xFFFFFFFFFFFFFFFFull, 123456789ull}) {
    for (int64_t pos : {0ll, 1ll, 1023ll, 40000ll}) {
      ASSERT_CUDA_OK(cuda::UniformNoiseRow(seed, pos, kVocab, out.get<float>(), nullptr));
      const std::vector<float> got = gpu_test::Download<float>(out, kVocab);
      for (int i = 0; i < kVocab; ++i) {
        const float want = UniformNoise(seed, pos, i);
        mismatches += std::memcmp(&got[i], &want, 4) != 0;
      }
    }
  }
  EXPECT_EQ(mismatches, 0);
}

TEST(SamplingTest, DeviceResultsMatchTheHostSamplerWithinTolerance) {
  if (!HaveGpu()) GTEST_SKIP() << "no GPU";
  auto runner = BigVocabRunner();
  ASSERT_NE(runner, nullptr);
  const int rows = 300;  // > one 256-row decode batch; one chunk of max_logit_rows
  const std::vector<float> logits = MakeRows(rows, 1);
  const std::vector<SamplingParams> params = ParamVariants();
  const std::vector<LogitsRowTask> tasks = MakeTasks(rows, params);
  std::vector<SampleResult> got, want;
  ASSERT_TRUE(runner->ProcessLogits(tasks, logits, &got).ok());
  cpu::ThreadPool pool;
  ASSERT_TRUE(ProcessLogitsOnHost(tasks, logits, kVocab, &pool, &want).ok());
  int token_diffs = 0, greedy_diffs = 0, far_diffs = 0;
  float max_lp_err = 0.0f, max_top_err = 0.0f;
  for (int r = 0; r < rows; ++r) {
    const SamplingParams& p = *tasks[r].params;
    const float* row = logits.data() + static_cast<size_t>(r) * kVocab;
    EXPECT_EQ(got[r].nonfinite, MadeNonFinite(r)) << r;
    EXPECT_EQ(want[r].nonfinite, MadeNonFinite(r)) << r;
    max_lp_err = std::max(max_lp_err, std::fabs(got[r].logprob - want[r].logprob));
    ASSERT_EQ(got[r].top.size(), want[r].top.size()) << r;
    for (size_t j = 0; j < got[r].top.size(); ++j) {
      max_top_err =
          std::max(max_top_err, std::fabs(got[r].top[j].logprob - want[r].top[j].logprob));
      // Ids agree unless the host's neighbours are near-equal.
      const bool near_tie =
          (j > 0 && want[r].top[j - 1].logprob - want[r].top[j].logprob < 1e-4f) ||
          (j + 1 < want[r].top.size() &&
           want[r].top[j].logprob - want[r].top[j + 1].logprob < 1e-4f);
      if (!near_tie) {
        EXPECT_EQ(got[r].top[j].token, want[r].top[j].token) << r << " " << j;
      }
    }
    if (got[r].token == want[r].token) continue;
    ++token_diffs;
    if (!(p.temperature > 0.0f) || tasks[r].score_token.has_value()) {
      ++greedy_diffs;
      continue;
    }
    // A sampled mismatch is allowed only where the two Gumbel keys are within a tiny epsilon.
    auto key = [&](int32_t i) {
      return row[i] / p.temperature +
             -std::log(-std::log(UniformNoise(tasks[r].sample_seed, tasks[r].position, i)));
    };
    if (std::fabs(key(got[r].token) - key(want[r].token)) > 1e-4f) ++far_diffs;
  }
  std::printf("sampling vs host: %d rows, max |logprob err| %.3g, top-N %.3g, token diffs %d\n",
              rows, max_lp_err, max_top_err, token_diffs);
  EXPECT_LE(max_lp_err, 1e-4f);
  EXPECT_LE(max_top_err, 1e-4f);
  EXPECT_EQ(greedy_diffs, 0);
  EXPECT_EQ(far_diffs, 0);
  EXPECT_LE(token_diffs, rows / 100);
}

TEST(SamplingTest, EachRowIsBitwiseIndependentOfTheOtherRows) {
  if (!HaveGpu()) GTEST_SKIP() << "no GPU";
  auto runner = BigVocabRunner();
  ASSERT_NE(runner, nullptr);
  const int rows = 256;
  const std::vector<float> logits = MakeRows(rows, 2);
  const std::vector<SamplingParams> params = ParamVariants();
  const std::vector<LogitsRowTask> tasks = MakeTasks(rows, params);
  std::vector<SampleResult> all;
  ASSERT_TRUE(runner->ProcessLogits(tasks, logits, &all).ok());
  std::mt19937_64 rng(3);
  int checked = 0, differing = 0;
  for (int n : {1, 2, 3, 17, 64, 129, 255, 256}) {
    for (int trial = 0; trial < 3; ++trial) {
      // n rows drawn from the pool (with repeats), in a random order.
      std::vector<int> pick(n);
      for (int& p : pick) p = static_cast<int>(rng() % rows);
      std::vector<float> sub(static_cast<size_t>(n) * kVocab);
      std::vector<LogitsRowTask> sub_tasks(n);
      for (int i = 0; i < n; ++i) {
        std::memcpy(sub.data() + static_cast<size_t>(i) * kVocab,
                    logits.data() + static_cast<size_t>(pick[i]) * kVocab, kVocab * 4);
        sub_tasks[i] = tasks[pick[i]];
      }
      std::vector<SampleResult> out;
      ASSERT_TRUE(runner->ProcessLogits(sub_tasks, sub, &out).ok());
      for (int i = 0; i < n; ++i) {
        ++checked;
        differing += !SameBits(out[i], all[pick[i]]);
      }
    }
  }
  std::printf("row independence: %d rows checked in batches of 1..256, %d differ\n", checked,
              differing);
  EXPECT_EQ(differing, 0);
}

// Device-kept logits (Forward) and the same logits uploaded give the same bits, also when a
// Forward's rows exceed max_logit_rows (spilled to the host) or span several slices.
TEST(SamplingTest, DeviceKeptLogitsEqualUploadedLogits) {
  if (!HaveGpu()) GTEST_SKIP() << "no GPU";
  for (int max_logit_rows : {512, 7}) {
    ModelConfig c = *PresetConfig("small");
    CudaRunnerOptions o;
    o.kv_cache_bytes = 64ll << 20;
    o.max_batch_tokens = 100;
    o.max_logit_rows = max_logit_rows;
    auto runner = CudaModelRunner::CreateSynthetic(c, 4, o);
    ASSERT_TRUE(runner.ok()) << runner.status();
    ForwardBatch b;
    std::mt19937_64 rng(5);
    for (int s = 0; s < 6; ++s) {
      b.block_tables.push_back({});
      for (int k = 0; k < 2; ++k) b.block_tables.back().push_back(s * 2 + k);
      for (int p = 0; p < 40; ++p) {
        b.token_ids.push_back(static_cast<int32_t>(rng() % c.vocab_size));
        b.positions.push_back(p);
        b.token_seq.push_back(s);
        if (p % 3 == 0 || p == 39)
          b.logit_rows.push_back(static_cast<int32_t>(b.token_ids.size()) - 1);
      }
    }
    std::vector<SamplingParams> params = ParamVariants();
    std::vector<LogitsRowTask> tasks(b.logit_rows.size());
    for (size_t r = 0; r < tasks.size(); ++r) {
      tasks[r].params = &params[r % params.size()];
      tasks[r].sample_seed = r;
      tasks[r].position = r;
      if (r % params.size() == 8)
        tasks[r].score_token = static_cast<int32_t>(r * 31 % c.vocab_size);
    }
    std::vector<float> host;
    ASSERT_TRUE((*runner)->ForwardToHost(b, &host).ok());
    std::vector<SampleResult> kept, uploaded;
    ASSERT_TRUE((*runner)->ProcessLogits(tasks, {}, &kept).ok());
    ASSERT_TRUE((*runner)->ProcessLogits(tasks, host, &uploaded).ok());
    std::vector<float> none;
    ASSERT_TRUE((*runner)->Forward(b, &none).ok());
    EXPECT_TRUE(none.empty());
    std::vector<SampleResult> again;
    ASSERT_TRUE((*runner)->ProcessLogits(tasks, {}, &again).ok());
    for (size_t r = 0; r < tasks.size(); ++r) {
      EXPECT_TRUE(SameBits(kept[r], uploaded[r])) << max_logit_rows << " row " << r;
      EXPECT_TRUE(SameBits(again[r], uploaded[r])) << max_logit_rows << " row " << r;
    }
  }
}

// Sample i of a test job: rollout_index i, a prompt of `prompt_len` random tokens.
SampleSpec RandomSample(int i, size_t prompt_len, int32_t vocab, std::mt19937_64* rng) {
  SampleSpec s;
  s.rollout_index = i;
  s.prompt.resize(prompt_len);
  for (int32_t& t : s.prompt) t = static_cast<int32_t>((*rng)() % vocab);
  return s;
}

// Runs `samples` as one job and returns the completions, by rollout_index.
std::vector<SampleCompletion> RunJob(Engine* engine, std::vector<SampleSpec> samples) {
  std::mutex mu;
  std::condition_variable cv;
  const size_t n = samples.size();
  std::vector<SampleCompletion> done(n);
  size_t finished = 0;
  auto job = engine->Submit(std::move(samples), [&](std::vector<SampleEvent> events) {
    std::lock_guard<std::mutex> lock(mu);
    for (SampleEvent& e : events) {
      if (e.completion.has_value()) {
        done[e.rollout_index] = std::move(*e.completion);
        ++finished;
      }
    }
    cv.notify_all();
  });
  EXPECT_TRUE(job.ok()) << job.status();
  if (!job.ok()) return {};
  std::unique_lock<std::mutex> lock(mu);
  cv.wait_for(lock, std::chrono::seconds(120), [&] { return finished == n; });
  EXPECT_EQ(finished, n);
  return done;
}

TEST(SamplingTest, ScoreEqualsGenerateBitwiseThroughTheEngine) {
  if (!HaveGpu()) GTEST_SKIP() << "no GPU";
  CudaRunnerOptions o;
  o.kv_cache_bytes = 256ll << 20;
  o.max_batch_tokens = 2048;
  auto runner = CudaModelRunner::CreateSynthetic(*PresetConfig("small"), 6, o);
  ASSERT_TRUE(runner.ok()) << runner.status();
  const int32_t vocab = (*runner)->config().vocab_size;
  EngineOptions eo;
  eo.max_running_samples = 64;
  eo.max_batch_tokens = 512;
  auto engine = Engine::Create(*std::move(runner), eo);
  ASSERT_TRUE(engine.ok()) << engine.status();
  std::vector<SamplingParams> variants(6);
  variants[0].temperature = 0.0f;
  variants[1].temperature = 1.0f;
  variants[2].temperature = 0.7f;
  variants[2].top_logprobs = 5;
  variants[3].temperature = 1.0f;
  variants[3].top_k = 20;  // token picked on the host
  variants[4].temperature = 0.9f;
  variants[4].top_p = 0.8f;
  variants[4].top_logprobs = 20;
  variants[5].temperature = 1.2f;
  variants[5].min_p = 0.1f;
  std::mt19937_64 rng(8);
  std::vector<SampleSpec> gen;
  for (int i = 0; i < 24; ++i) {
    SampleSpec s = RandomSample(i, 20 + 37 * i % 300, vocab, &rng);
    s.params = variants[i % variants.size()];
    s.params.max_new_tokens = 48;
    s.params.ignore_eos = true;
    s.sample_seed = 77 + i;
    gen.push_back(s);
  }
  const std::vector<SampleCompletion> generated = RunJob(engine->get(), gen);
  ASSERT_EQ(generated.size(), gen.size());
  std::vector<SampleSpec> score;
  for (size_t i = 0; i < gen.size(); ++i) {
    SampleSpec s = gen[i];
    s.score_start = static_cast<int32_t>(s.prompt.size());
    s.prompt.insert(s.prompt.end(), generated[i].token_ids.begin(), generated[i].token_ids.end());
    score.push_back(s);
  }
  const std::vector<SampleCompletion> scored = RunJob(engine->get(), score);
  ASSERT_EQ(scored.size(), gen.size());
  int64_t compared = 0, differing = 0;
  for (size_t i = 0; i < gen.size(); ++i) {
    ASSERT_EQ(generated[i].logprobs.size(), 48u) << i;
    ASSERT_EQ(scored[i].logprobs.size(), generated[i].logprobs.size()) << i;
    for (size_t k = 0; k < scored[i].logprobs.size(); ++k) {
      ++compared;
      differing += std::memcmp(&scored[i].logprobs[k], &generated[i].logprobs[k], 4) != 0;
      if (gen[i].params.top_logprobs > 0) {
        SampleResult a, b;
        a.top = scored[i].top_logprobs[k];
        b.top = generated[i].top_logprobs[k];
        differing += !SameBits(a, b);
      }
    }
  }
  std::printf("score vs generate: %ld logprobs compared, %ld differ\n", static_cast<long>(compared),
              static_cast<long>(differing));
  EXPECT_EQ(differing, 0);
}

// The engine's decode lookahead on the CUDA backend (LaunchStep enqueues, tokens fed on the
// device): every sample bitwise as one step at a time, including samples that stop on a sampled
// token while the next step already has their rows, and a job whose top-k rows (picked on the
// host) keep their steps one at a time.
TEST(SamplingTest, DecodeLookaheadGivesTheBitsOfOneStepAtATime) {
  if (!HaveGpu()) GTEST_SKIP() << "no GPU";
  auto make = [](bool lookahead) {
    CudaRunnerOptions o;
    o.kv_cache_bytes = 256ll << 20;
    o.max_batch_tokens = 2048;
    auto runner = CudaModelRunner::CreateSynthetic(*PresetConfig("small"), 6, o);
    EXPECT_TRUE(runner.ok()) << runner.status();
    EngineOptions eo;
    eo.max_running_samples = 64;
    eo.max_batch_tokens = 512;
    eo.decode_lookahead = lookahead;
    auto engine = Engine::Create(*std::move(runner), eo);
    EXPECT_TRUE(engine.ok()) << engine.status();
    return *std::move(engine);
  };
  std::unique_ptr<Engine> ahead = make(true), plain = make(false);
  std::mt19937_64 rng(9);
  std::vector<SampleSpec> gen;
  for (int i = 0; i < 20; ++i) {
    SampleSpec s = RandomSample(i, 10 + 29 * i % 200, 4096, &rng);
    s.params.temperature = i % 3 == 0 ? 0.0f : (i % 3 == 1 ? 1.0f : 0.7f);
    s.params.top_logprobs = i % 4 == 0 ? 5 : 0;
    s.params.max_new_tokens = 24 + i;
    s.params.ignore_eos = true;
    s.sample_seed = 300 + i;
    gen.push_back(s);
  }
  auto same = [](const std::vector<SampleCompletion>& a, const std::vector<SampleCompletion>& b) {
    int64_t differing = 0;
    for (size_t i = 0; i < a.size(); ++i) {
      differing += a[i].token_ids != b[i].token_ids || a[i].finish_reason != b[i].finish_reason ||
                   a[i].logprobs.size() != b[i].logprobs.size() ||
                   std::memcmp(a[i].logprobs.data(), b[i].logprobs.data(),
                               4 * std::min(a[i].logprobs.size(), b[i].logprobs.size())) != 0;
    }
    return differing;
  };
  const std::vector<SampleCompletion> want = RunJob(plain.get(), gen);
  ASSERT_EQ(want.size(), gen.size());
  EXPECT_EQ(same(RunJob(ahead.get(), gen), want), 0);
  const uint64_t after_first = ahead->counters().lookahead_steps;
  EXPECT_GT(after_first, 10u);
  EXPECT_EQ(plain->counters().lookahead_steps, 0u);

  // Stops on sampled tokens (the rows already launched for the next step are dropped).
  std::vector<SampleSpec> stopping = gen;
  for (size_t i = 0; i + 2 < stopping.size(); ++i) {
    stopping[i].params.stop_token_ids = {want[i].token_ids[5 + i % 11]};
  }
  const std::vector<SampleCompletion> stop_want = RunJob(plain.get(), stopping);
  EXPECT_EQ(same(RunJob(ahead.get(), stopping), stop_want), 0);
  for (size_t i = 0; i + 2 < stopping.size(); ++i) {
    EXPECT_EQ(stop_want[i].finish_reason, FinishReason::kStop) << i;
  }
  EXPECT_GT(ahead->counters().lookahead_steps, after_first);

  // Top-k rows: their tokens are picked on the host, so their steps are not fed ahead.
  std::vector<SampleSpec> mixed = gen;
  for (size_t i = 0; i < mixed.size(); i += 5) {
    mixed[i].params.temperature = 1.0f;
    mixed[i].params.top_k = 20;
  }
  EXPECT_EQ(same(RunJob(ahead.get(), mixed), RunJob(plain.get(), mixed)), 0);
  const EngineCounters c = ahead->counters();
  EXPECT_EQ(c.kv_blocks_free + c.kv_blocks_cached, c.kv_blocks_total) << "no block leaked";
}

}  // namespace
}  // namespace rollout
