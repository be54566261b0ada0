// Tensor parallelism on the CUDA backend (D10), end to end on one device: the logits of TP 1
// (canonical K tree), 2, 4 and 8 ranks are bitwise equal through prefill, mixed and decode steps
// (CUDA graphs included), on the device through sampling, and after weight updates -- and with
// the ranks on separate GPUs (TpMultiGpuTest: 2+ GPUs and NCCL, else skipped); the plain
// fused GEMM at TP 1 is the control that shows the comparison can fail; and the cost of the
// canonical tree in whole forward steps. The GEMM-level facts behind it are in
// tp_kernels_test.cc.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda/rank_group.h"
#include "model/random_model.h"
#include "runner/cuda/cuda_model_runner.h"
#include "tests/gpu/forward_script.h"
#include "tests/gpu/gpu_test_util.h"

namespace rollout {
namespace {

using gpu_test::Chunk;
using gpu_test::RandomTokens;
using gpu_test::Seq;

// A fixed script of Forward steps, run at every degree.

struct Script {
  std::vector<Seq> seqs;
  std::vector<std::vector<Chunk>> steps;
};

// Sequences of random prompt lengths up to max_prompt: first mixed steps
// (prefill chunks of up to 300 tokens of up to three sequences beside one
// decode token of every sequence whose prompt is done), then pure decode steps
// of varying batch size -- the ones that replay CUDA graphs.
Script MakeScript(int vocab, int block_size, int num_seqs, int max_prompt, bool all_logits,
                  uint64_t seed) {
  constexpr int kDecodeSteps = 6;
  std::mt19937 rng(seed);
  Script script;
  std::vector<int> prompt(num_seqs), done(num_seqs, 0);
  for (int i = 0; i < num_seqs; ++i) prompt[i] = 1 + static_cast<int>(rng() % max_prompt);
  auto prefilling = [&] {
    std::vector<int> left;
    for (int i = 0; i < num_seqs; ++i) {
      if (done[i] < prompt[i]) left.push_back(i);
    }
    return left;
  };
  for (std::vector<int> left = prefilling(); !left.empty(); left = prefilling()) {
    std::vector<Chunk> step;
    for (int i = 0; i < num_seqs; ++i) {  // decode tokens of finished prompts
      if (done[i] >= prompt[i]) {
        step.push_back({i, done[i], done[i] + 1, true});
        ++done[i];
      }
    }
    for (size_t j = 0; j < left.size() && j < 3; ++j) {
      const int i = left[j];
      const int len = std::min(prompt[i] - done[i], 1 + static_cast<int>(rng() % 300));
      step.insert(step.begin() + rng() % (step.size() + 1),
                  Chunk{i, done[i], done[i] + len, all_logits});
      done[i] += len;
    }
    script.steps.push_back(std::move(step));
  }
  const int sizes[kDecodeSteps] = {1, 3, num_seqs, num_seqs / 2 + 1, 2, num_seqs};
  std::vector<int> order(num_seqs);
  for (int i = 0; i < num_seqs; ++i) order[i] = i;
  for (int k = 0; k < kDecodeSteps; ++k) {
    std::shuffle(order.begin(), order.end(), rng);
    std::vector<Chunk> step;
    for (int j = 0; j < std::min(sizes[k], num_seqs); ++j) {
      const int i = order[j];
      step.push_back({i, done[i], done[i] + 1, true});
      ++done[i];
    }
    script.steps.push_back(std::move(step));
  }
  // The tokens (prompt, then teacher-forced "generated" ones) and KV blocks
  // each sequence needs.
  int32_t next_block = 0;
  for (int i = 0; i < num_seqs; ++i) {
    Seq s;
    s.tokens = RandomTokens(done[i], vocab, seed * 1000 + i);
    for (int b = 0; b < (done[i] + block_size - 1) / block_size; ++b)
      s.blocks.push_back(next_block++);
    script.seqs.push_back(std::move(s));
  }
  return script;
}

ForwardBatch MakeBatch(const Script& script, const std::vector<Chunk>& chunks) {
  return gpu_test::MakeBatch(script.seqs, chunks);
}

// Every step's logits rows, concatenated.
std::vector<float> RunScript(CudaModelRunner* runner, const Script& script) {
  std::vector<float> all;
  for (const std::vector<Chunk>& step : script.steps) {
    std::vector<float> logits;
    const absl::Status s = runner->ForwardToHost(MakeBatch(script, step), &logits);
    EXPECT_TRUE(s.ok()) << s;
    if (!s.ok()) return {};
    all.insert(all.end(), logits.begin(), logits.end());
  }
  return all;
}

int32_t BlocksNeeded(const Script& script) {
  int32_t blocks = 0;
  for (const Seq& s : script.seqs) blocks += static_cast<int32_t>(s.blocks.size());
  return blocks;
}

// Bitwise comparison of logits rows, naming the first differing row and how
// many differ.
::testing::AssertionResult SameBits(const std::vector<float>& got, const std::vector<float>& want,
                                    int64_t vocab) {
  if (got.size() != want.size() || want.empty()) {
    return ::testing::AssertionFailure()
           << "logits sizes differ: " << got.size() << " vs " << want.size();
  }
  const int64_t rows = static_cast<int64_t>(want.size()) / vocab;
  int64_t first = -1, differing = 0;
  for (int64_t r = 0; r < rows; ++r) {
    if (std::memcmp(&got[r * vocab], &want[r * vocab], vocab * sizeof(float)) != 0) {
      if (first < 0) first = r;
      ++differing;
    }
  }
  if (differing == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << differing << " of " << rows
                                       << " logits rows differ bitwise, the first is row " << first;
}

class TpModelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!gpu_test::HaveGpu()) GTEST_SKIP() << "no CUDA device";
  }

  static CudaRunnerOptions Options(int tp, bool canonical, bool graphs, int64_t kv_bytes,
                                   int32_t max_batch_tokens) {
    CudaRunnerOptions o;
    o.tensor_parallel = tp;
    o.canonical_k_tree = canonical;
    o.cuda_graphs = graphs;
    o.kv_cache_bytes = kv_bytes;
    o.max_batch_tokens = max_batch_tokens;
    return o;
  }

  // The script's logits at TP 1 with the canonical tree (eager: no graphs),
  // then at each degree (graphs on): every degree bitwise equal to the
  // reference, every degree > 1 having replayed decode graphs.
  static void CheckDegrees(const ModelConfig& config, const std::vector<int>& degrees,
                           const Script& script, int64_t kv_bytes, int32_t max_batch_tokens) {
    const int64_t vocab = config.vocab_size;
    std::vector<float> want;
    {
      auto ref = CudaModelRunner::CreateSynthetic(
          config, 7, Options(1, true, false, kv_bytes, max_batch_tokens));
      ASSERT_TRUE(ref.ok()) << ref.status();
      ASSERT_GE((*ref)->num_kv_blocks(), BlocksNeeded(script));
      for (const std::string& line : (*ref)->gemm_descriptions()) {
        std::printf("[ pinned   ] %s\n", line.c_str());
      }
      const auto t0 = std::chrono::steady_clock::now();
      want = RunScript(ref->get(), script);
      std::printf(
          "[ tp       ] tp 1 (canonical, eager): %zu logits rows, %.1f ms\n", want.size() / vocab,
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
    for (int tp : degrees) {
      auto runner = CudaModelRunner::CreateSynthetic(
          config, 7, Options(tp, tp == 1, true, kv_bytes, max_batch_tokens));
      ASSERT_TRUE(runner.ok()) << "tp " << tp << ": " << runner.status();
      const auto t0 = std::chrono::steady_clock::now();
      const std::vector<float> got = RunScript(runner->get(), script);
      std::printf(
          "[ tp       ] tp %d (graphs): %.1f ms, %ld decode graphs replayed\n", tp,
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count(),
          static_cast<long>((*runner)->graph_launches()));
      EXPECT_TRUE(SameBits(got, want, vocab)) << "tensor-parallel degree " << tp;
      EXPECT_GT((*runner)->graph_launches(), 0) << "tp " << tp << " replayed no decode graph";
    }
  }
};

TEST_F(TpModelTest, SmallModelLogitsAreBitwiseEqualAtTp1Tp2Tp4Tp8) {
  // 8 heads, 2 KV heads (replicated at TP 4 and 8), vocab 4096; 4 layers. Steps
  // of up to ~900 tokens run in slices of 512.
  const ModelConfig config = *PresetConfig("small");
  const Script script = MakeScript(config.vocab_size, 32, 12, 700, /*all_logits=*/true, 31);
  CheckDegrees(config, {1, 2, 4, 8}, script, 256ll << 20, 512);
}

TEST_F(TpModelTest, Qwen3_8bShapedLogitsAreBitwiseEqualAtTp1Tp2Tp4Tp8) {
  // Hidden 4096, 32 / 8 heads x 128, intermediate 12288, vocab 151936: two
  // layers.
  ModelConfig config = *PresetConfig("qwen3-8b");
  config.num_layers = 2;
  const Script script = MakeScript(config.vocab_size, 32, 10, 900, /*all_logits=*/false, 32);
  CheckDegrees(config, {1, 2, 4, 8}, script, 1ll << 30, 1024);
}

// New bf16 values (seeded) for every tensor of layer 1 and every tensor outside the layers
// (embedding, final norm, lm_head): an update that touches each kind of binding.
std::vector<HostTensor> RandomLayer1AndTopLevelUpdate(const ModelConfig& config, uint32_t seed) {
  std::vector<HostTensor> update;
  std::mt19937 rng(seed);
  for (const TensorSpec& spec : ExpectedTensors(config)) {
    const bool pick = spec.name.find("layers.1.") != std::string::npos ||
                      spec.name.find("layers.") == std::string::npos;
    if (!pick) continue;
    HostTensor t{spec.name, DType::kBF16, spec.shape, {}};
    int64_t count = 1;
    for (int64_t d : spec.shape) count *= d;
    std::normal_distribution<float> dist(spec.name.find("norm") != std::string::npos ? 1.0f : 0.0f,
                                         0.05f);
    t.bytes.resize(count * 2);
    for (int64_t i = 0; i < count; ++i) {
      const uint16_t v = F32ToBF16(dist(rng));
      std::memcpy(&t.bytes[2 * i], &v, 2);
    }
    update.push_back(std::move(t));
  }
  return update;
}

// Qwen2-style: qkv biases, no q/k norm, untied lm_head, 4 KV heads (replicated
// at TP 8), and a vocabulary of 4000 that no shard size divides: the last
// rank's shard is shorter.
ModelConfig Qwen2StyleConfig() {
  ModelConfig config = *PresetConfig("small");
  config.architecture = "Qwen2ForCausalLM";
  config.family = ModelFamily::kQwen2;
  config.qk_norm = false;
  config.qkv_bias = true;
  config.tie_word_embeddings = false;
  config.num_layers = 2;
  config.num_key_value_heads = 4;
  config.vocab_size = 4000;
  return config;
}

TEST_F(TpModelTest, Qwen2StyleBiasesAndUnevenVocabAreBitwiseEqualAtEveryDegree) {
  const ModelConfig config = Qwen2StyleConfig();
  const Script script = MakeScript(config.vocab_size, 32, 8, 400, /*all_logits=*/true, 33);
  CheckDegrees(config, {1, 2, 4, 8}, script, 128ll << 20, 2048);
}

// The control: at TP 1 the plain fused GEMM (one K walk + residual epilogue)
// gives other bits than the canonical tree -- close (the same model), but not
// equal. Without the tree, TP 1 would differ from every TP > 1, and the
// equality tests above would fail.
TEST_F(TpModelTest, PlainFusedGemmAtTp1DiffersFromTheCanonicalTree) {
  const ModelConfig config = *PresetConfig("small");
  const Script script = MakeScript(config.vocab_size, 32, 6, 300, /*all_logits=*/true, 34);
  auto plain =
      CudaModelRunner::CreateSynthetic(config, 7, Options(1, false, true, 128ll << 20, 2048));
  auto tree =
      CudaModelRunner::CreateSynthetic(config, 7, Options(1, true, true, 128ll << 20, 2048));
  ASSERT_TRUE(plain.ok() && tree.ok()) << plain.status() << tree.status();
  const std::vector<float> a = RunScript(plain->get(), script);
  const std::vector<float> b = RunScript(tree->get(), script);
  ASSERT_EQ(a.size(), b.size());
  EXPECT_FALSE(SameBits(a, b, config.vocab_size)) << "the fused GEMM gave the tree's bits";
  double max_err = 0.0, sum_sq = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    max_err = std::max(max_err, std::fabs(static_cast<double>(a[i]) - b[i]));
    sum_sq += static_cast<double>(b[i]) * b[i];
  }
  const double rms = std::sqrt(sum_sq / b.size());
  std::printf("[ control  ] plain vs tree at tp 1: logits rms %.3f, max |diff| %.4f\n", rms,
              max_err);
  EXPECT_LT(max_err, 0.1 * rms) << "plain and tree should be the same model";
}

// Every kind of binding (vocab rows, head rows, K segments, gate/up rows,
// norms) after the same update: TP 4 and 8 give TP 1's bits, and the update
// changed them.
TEST_F(TpModelTest, WeightUpdatesSliceIntoTheRankShards) {
  const ModelConfig config = *PresetConfig("small");
  const Script script = MakeScript(config.vocab_size, 32, 5, 200, /*all_logits=*/true, 35);
  const std::vector<HostTensor> update = RandomLayer1AndTopLevelUpdate(config, 36);
  std::vector<float> before, want;
  for (int tp : {1, 4, 8}) {
    auto runner =
        CudaModelRunner::CreateSynthetic(config, 7, Options(tp, true, true, 128ll << 20, 2048));
    ASSERT_TRUE(runner.ok()) << runner.status();
    if (tp == 1) before = RunScript(runner->get(), script);
    const absl::Status s = (*runner)->UpdateWeights(ViewsOf(update));
    ASSERT_TRUE(s.ok()) << s;
    const std::vector<float> got = RunScript(runner->get(), script);
    if (tp == 1) {
      want = got;
      EXPECT_FALSE(SameBits(want, before, config.vocab_size)) << "the update changed nothing";
    } else {
      EXPECT_TRUE(SameBits(got, want, config.vocab_size)) << "after the update, tp " << tp;
    }
  }
}

// An update staged in the runner's page-locked staging (AllocateHostStaging), whose bf16 copies
// are all enqueued asynchronously and waited for once, gives the bits of the same update from
// pageable memory (copied one by one), at TP 1 and with pieces at TP 4; twice, as the server
// reuses its staging.
TEST_F(TpModelTest, UpdatesFromPinnedStagingGiveTheBitsOfPageableOnes) {
  const ModelConfig config = *PresetConfig("small");
  const Script script = MakeScript(config.vocab_size, 32, 5, 200, /*all_logits=*/true, 35);
  for (int tp : {1, 4}) {
    auto pageable =
        CudaModelRunner::CreateSynthetic(config, 7, Options(tp, true, true, 128ll << 20, 2048));
    auto pinned =
        CudaModelRunner::CreateSynthetic(config, 7, Options(tp, true, true, 128ll << 20, 2048));
    ASSERT_TRUE(pageable.ok() && pinned.ok());
    size_t total = 0;
    for (uint32_t seed : {36u, 37u}) {
      for (const HostTensor& t : RandomLayer1AndTopLevelUpdate(config, seed))
        total += t.bytes.size();
    }
    absl::StatusOr<std::unique_ptr<HostStagingBuffer>> staging =
        (*pinned)->AllocateHostStaging(total);
    ASSERT_TRUE(staging.ok()) << staging.status();
    EXPECT_TRUE((*staging)->pinned());
    for (uint32_t seed : {36u, 37u}) {
      const std::vector<HostTensor> update = RandomLayer1AndTopLevelUpdate(config, seed);
      ASSERT_TRUE((*pageable)->UpdateWeights(ViewsOf(update)).ok());
      std::vector<HostTensorView> views;
      uint8_t* at = (*staging)->data();
      for (const HostTensor& t : update) {
        std::memcpy(at, t.bytes.data(), t.bytes.size());
        views.emplace_back(t.name, t.dtype, t.shape, at, t.bytes.size());
        at += t.bytes.size();
      }
      const absl::Status s = (*pinned)->UpdateWeights(views);
      ASSERT_TRUE(s.ok()) << s;
      EXPECT_TRUE(SameBits(RunScript(pinned->get(), script), RunScript(pageable->get(), script),
                           config.vocab_size))
          << "tp " << tp << ", update seeded " << seed;
    }
  }
}

TEST_F(TpModelTest, DegreesTheModelCannotSplitAreRefused) {
  ModelConfig config = *PresetConfig("small");
  for (int tp : {3, 16}) {
    auto runner =
        CudaModelRunner::CreateSynthetic(config, 7, Options(tp, true, true, 64 << 20, 512));
    EXPECT_FALSE(runner.ok()) << "tp " << tp;
  }
  config.intermediate_size = 776;  // divisible by 8 but not by 64: no 16-byte K segments
  auto runner = CudaModelRunner::CreateSynthetic(config, 7, Options(2, true, true, 64 << 20, 512));
  ASSERT_FALSE(runner.ok());
  std::printf("[ refused  ] %s\n", runner.status().ToString().c_str());
}

// Forward + ProcessLogits over the script: greedy, sampled with top-N logprobs and scored rows,
// each result's token, logprob and top-N as bytes.
std::vector<std::string> ProcessScript(CudaModelRunner* runner, const Script& script,
                                       int32_t vocab) {
  SamplingParams greedy, sampled;
  greedy.temperature = 0.0f;
  greedy.top_logprobs = 3;
  sampled.temperature = 0.8f;
  sampled.top_logprobs = 5;
  std::vector<std::string> got;
  for (const std::vector<Chunk>& step : script.steps) {
    const ForwardBatch batch = MakeBatch(script, step);
    const absl::Status forward = runner->Forward(batch, nullptr);
    EXPECT_TRUE(forward.ok()) << forward;
    if (!forward.ok()) return {};
    std::vector<LogitsRowTask> tasks(batch.logit_rows.size());
    for (size_t i = 0; i < tasks.size(); ++i) {
      tasks[i].params = i % 3 == 0 ? &greedy : &sampled;
      tasks[i].sample_seed = 1000 + i;
      tasks[i].position = batch.positions[batch.logit_rows[i]] + 1;
      if (i % 3 == 2) tasks[i].score_token = static_cast<int32_t>((i * 37) % vocab);
    }
    std::vector<SampleResult> results;
    const absl::Status s = runner->ProcessLogits(tasks, {}, &results);
    EXPECT_TRUE(s.ok()) << s;
    if (!s.ok()) return {};
    for (const SampleResult& r : results) {
      std::string bits(reinterpret_cast<const char*>(&r.token), 4);
      bits.append(reinterpret_cast<const char*>(&r.logprob), 4);
      for (const TokenLogprob& t : r.top) {
        bits.append(reinterpret_cast<const char*>(&t), sizeof(t));
      }
      got.push_back(bits);
    }
  }
  return got;
}

// The engine's path: logits left on the device (Forward) and processed there (ProcessLogits) --
// greedy, sampled with top-N logprobs, and scored rows get the same tokens and logprob bits at
// every degree.
TEST_F(TpModelTest, DeviceLogitsSampleAndScoreToTheSameBitsAtEveryDegree) {
  const ModelConfig config = *PresetConfig("small");
  const Script script = MakeScript(config.vocab_size, 32, 6, 300, /*all_logits=*/false, 37);
  std::vector<std::string> want;
  for (int tp : {1, 2, 4, 8}) {
    auto runner =
        CudaModelRunner::CreateSynthetic(config, 7, Options(tp, true, true, 128ll << 20, 2048));
    ASSERT_TRUE(runner.ok()) << runner.status();
    const std::vector<std::string> got =
        ProcessScript(runner->get(), script, static_cast<int32_t>(config.vocab_size));
    ASSERT_FALSE(HasFailure()) << "tp " << tp;
    if (tp == 1) {
      want = got;
    } else {
      ASSERT_EQ(got.size(), want.size());
      int differing = 0;
      for (size_t i = 0; i < got.size(); ++i) differing += got[i] != want[i];
      EXPECT_EQ(differing, 0) << "tp " << tp << ": of " << got.size() << " processed rows";
    }
  }
}

// Whole steps of a 2-layer Qwen3-8B-shaped model with canonical_k_tree off and
// on (TP 1): a decode step of 256 sequences at context 512 (graph replay) and a
// prefill step of 16 x 512.
TEST_F(TpModelTest, CostOfTheCanonicalKTreeInForwardSteps) {
  ModelConfig config = *PresetConfig("qwen3-8b");
  config.num_layers = 2;
  constexpr int kSeqs = 256, kContext = 512;
  for (bool canonical : {false, true}) {
    auto runner =
        CudaModelRunner::CreateSynthetic(config, 7, Options(1, canonical, true, 4ll << 30, 8192));
    ASSERT_TRUE(runner.ok()) << runner.status();
    const int32_t bs = (*runner)->kv_block_size();
    Script script;
    for (int i = 0; i < kSeqs; ++i) {
      Seq s;
      s.tokens = RandomTokens(kContext + 64, config.vocab_size, 800 + i);
      for (int b = 0; b < (kContext + 64) / bs; ++b)
        s.blocks.push_back(i * ((kContext + 64) / bs) + b);
      script.seqs.push_back(std::move(s));
    }
    ASSERT_GE((*runner)->num_kv_blocks(), BlocksNeeded(script));
    std::vector<float> logits;
    for (int first = 0; first < kSeqs; first += 16) {  // prefill the contexts
      std::vector<Chunk> step;
      for (int i = first; i < first + 16; ++i) step.push_back({i, 0, kContext, false});
      ASSERT_TRUE((*runner)->Forward(MakeBatch(script, step), &logits).ok());
    }
    auto time_steps = [&](const std::function<std::vector<Chunk>(int)>& step_at, int steps) {
      bool ok = (*runner)->Forward(MakeBatch(script, step_at(0)), &logits).ok();  // warm-up
      const auto t0 = std::chrono::steady_clock::now();
      for (int k = 1; k <= steps && ok; ++k) {
        ok = (*runner)->Forward(MakeBatch(script, step_at(k)), &logits).ok();
      }
      EXPECT_TRUE(ok);
      return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0)
                 .count() /
             steps;
    };
    const double decode_ms = time_steps(
        [&](int k) {
          std::vector<Chunk> step;
          for (int i = 0; i < kSeqs; ++i) step.push_back({i, kContext + k, kContext + k + 1, true});
          return step;
        },
        20);
    // 16 contexts recomputed (the same KV bits): 8192 tokens.
    const double prefill_ms = time_steps(
        [&](int k) {
          std::vector<Chunk> step;
          for (int i = 0; i < 16; ++i) step.push_back({(i + 16 * k) % kSeqs, 0, kContext, false});
          return step;
        },
        5);
    std::printf(
        "[ cost     ] 2-layer forward, canonical_k_tree %-3s: decode step of "
        "256 seqs at "
        "context 512: %.3f ms; prefill step of 16 x 512 tokens: %.3f ms\n",
        canonical ? "on" : "off", decode_ms, prefill_ms);
  }
}

// --- Ranks on separate GPUs (CudaRunnerOptions::devices, exchanges through NCCL) ---

std::string NcclLibraryPath() {
  const char* path = std::getenv("ROLLOUT_NCCL_LIBRARY");
  return path != nullptr ? path : "";
}

// Runs when at least 2 GPUs are visible and NCCL loads; skips, saying what it needs, otherwise.
class TpMultiGpuTest : public TpModelTest {
 protected:
  void SetUp() override {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) count = 0;
    if (count < 2) {
      GTEST_SKIP() << "needs at least 2 visible CUDA devices (found " << count
                   << ") and NCCL (libnccl.so.2 on LD_LIBRARY_PATH, or ROLLOUT_NCCL_LIBRARY): "
                      "runs TP 2 on 2 GPUs (TP 4 on 4, TP 8 on 8 when there are that many) "
                      "against TP 1 on one GPU";
    }
    int version = 0;
    const cuda::GroupStatus loaded = cuda::NcclLibraryVersion(NcclLibraryPath(), &version);
    if (!loaded.ok()) {
      GTEST_SKIP() << "needs NCCL (libnccl.so.2 on LD_LIBRARY_PATH, or ROLLOUT_NCCL_LIBRARY) for "
                      "ranks on separate GPUs; "
                   << count << " GPUs are visible but it did not load: " << loaded.message();
    }
    std::printf("[ multi    ] %d GPUs, NCCL %d\n", count, version);
    for (int tp : {2, 4, 8}) {
      if (tp <= count) degrees_.push_back(tp);
    }
  }

  static CudaRunnerOptions SpreadOptions(int tp, int64_t kv_bytes, int32_t max_batch_tokens) {
    CudaRunnerOptions o = Options(tp, true, true, kv_bytes, max_batch_tokens);
    for (int r = 0; r < tp; ++r) o.devices.push_back(r);
    o.nccl_library = NcclLibraryPath();
    return o;
  }

  // TP 1 (canonical K tree) on GPU 0 vs TP d with rank r on GPU r, for every degree d the host
  // has GPUs for: the script's logits (ForwardToHost), and Forward + ProcessLogits results.
  void CheckSpread(const ModelConfig& config, const Script& script, int64_t kv_bytes,
                   int32_t max_batch_tokens) {
    const int32_t vocab = config.vocab_size;
    std::vector<float> want_logits;
    std::vector<std::string> want_processed;
    {
      auto ref = CudaModelRunner::CreateSynthetic(
          config, 7, Options(1, true, false, kv_bytes, max_batch_tokens));
      ASSERT_TRUE(ref.ok()) << ref.status();
      ASSERT_GE((*ref)->num_kv_blocks(), BlocksNeeded(script));
      want_logits = RunScript(ref->get(), script);
    }
    {
      auto ref = CudaModelRunner::CreateSynthetic(
          config, 7, Options(1, true, false, kv_bytes, max_batch_tokens));
      ASSERT_TRUE(ref.ok()) << ref.status();
      want_processed = ProcessScript(ref->get(), script, vocab);
    }
    for (int tp : degrees_) {
      {
        auto runner = CudaModelRunner::CreateSynthetic(
            config, 7, SpreadOptions(tp, kv_bytes, max_batch_tokens));
        ASSERT_TRUE(runner.ok()) << "tp " << tp << " on " << tp << " GPUs: " << runner.status();
        EXPECT_GE((*runner)->num_kv_blocks(), BlocksNeeded(script));
        const auto t0 = std::chrono::steady_clock::now();
        const std::vector<float> got = RunScript(runner->get(), script);
        std::printf("[ multi    ] tp %d on %d GPUs: %zu logits rows, %.1f ms\n", tp, tp,
                    got.size() / vocab,
                    std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0)
                        .count());
        EXPECT_TRUE(SameBits(got, want_logits, vocab)) << "tp " << tp << " on " << tp << " GPUs";
        EXPECT_EQ((*runner)->graph_launches(), 0) << "decode graphs are off across devices";
      }
      {
        auto runner = CudaModelRunner::CreateSynthetic(
            config, 7, SpreadOptions(tp, kv_bytes, max_batch_tokens));
        ASSERT_TRUE(runner.ok()) << runner.status();
        const std::vector<std::string> got = ProcessScript(runner->get(), script, vocab);
        ASSERT_EQ(got.size(), want_processed.size()) << "tp " << tp;
        int differing = 0;
        for (size_t i = 0; i < got.size(); ++i) differing += got[i] != want_processed[i];
        EXPECT_EQ(differing, 0) << "tp " << tp << " on " << tp << " GPUs: of " << got.size()
                                << " processed rows";
      }
    }
  }

  std::vector<int> degrees_;
};

TEST_F(TpMultiGpuTest, SmallModelOnSeparateGpusEqualsTp1OnOneGpu) {
  const ModelConfig config = *PresetConfig("small");
  const Script script = MakeScript(config.vocab_size, 32, 12, 700, /*all_logits=*/true, 31);
  CheckSpread(config, script, 256ll << 20, 512);
}

TEST_F(TpMultiGpuTest, Qwen2StyleOnSeparateGpusEqualsTp1OnOneGpu) {
  const ModelConfig config = Qwen2StyleConfig();
  const Script script = MakeScript(config.vocab_size, 32, 8, 400, /*all_logits=*/true, 33);
  CheckSpread(config, script, 128ll << 20, 2048);
}

// The fixed probe set of the multi-GPU runs (issue 20): Qwen3-8B's shapes (two layers), rank r
// on GPU r through NCCL, at every degree the host has GPUs for, against TP 1 on GPU 0.
TEST_F(TpMultiGpuTest, Qwen3_8bShapedOnSeparateGpusEqualsTp1OnOneGpu) {
  ModelConfig config = *PresetConfig("qwen3-8b");
  config.num_layers = 2;
  const Script script = MakeScript(config.vocab_size, 32, 10, 900, /*all_logits=*/false, 32);
  CheckSpread(config, script, 1ll << 30, 1024);
}

// A rank group whose exchanges can hang, as NCCL's across GPUs can (RankGroup::can_hang): it
// forwards to the real group (ranks as streams of one GPU) and records Abort.
class HangableGroup final : public cuda::RankGroup {
 public:
  HangableGroup(std::unique_ptr<cuda::RankGroup> inner, std::atomic<bool>* aborted)
      : inner_(std::move(inner)), aborted_(aborted) {}
  int world_size() const override { return inner_->world_size(); }
  const char* kind() const override { return "hangable (test)"; }
  cuda::GroupStatus AllGather(const float* const* send, int64_t count,
                              float* const* recv) override {
    if (*aborted_) return cuda::GroupStatus::Error("aborted");
    return inner_->AllGather(send, count, recv);
  }
  bool can_hang() const override { return true; }
  void Abort() override { *aborted_ = true; }

 private:
  std::unique_ptr<cuda::RankGroup> inner_;
  std::atomic<bool>* aborted_;
};

// Faults across ranks: a step whose exchange never completes (here rank 0's stream is held by a
// host function, as a peer that never answers would hold an NCCL kernel) ends after the
// collective timeout with UNAVAILABLE naming it, the group is aborted, and every later step
// fails with FAILED_PRECONDITION saying to restart -- nothing waits forever. On one GPU.
TEST_F(TpModelTest, AHungExchangeEndsTheStepAtTheTimeoutAndLaterStepsAreRefused) {
  const ModelConfig config = *PresetConfig("small");
  CudaRunnerOptions o = Options(2, true, /*graphs=*/false, 64ll << 20, 512);
  o.collective_timeout_s = 2;
  auto runner = CudaModelRunner::CreateSynthetic(config, 7, o);
  ASSERT_TRUE(runner.ok()) << runner.status();
  std::atomic<bool> aborted{false};
  auto* stream = static_cast<cudaStream_t>(
      (*runner)->WrapRankGroupForTesting([&](std::unique_ptr<cuda::RankGroup> g) {
        return std::make_unique<HangableGroup>(std::move(g), &aborted);
      }));
  ASSERT_NE(stream, nullptr);
  const std::vector<Seq> seqs = {{RandomTokens(40, config.vocab_size, 3), {0, 1, 2}}};
  const ForwardBatch batch = gpu_test::MakeBatch(seqs, {{0, 0, 40, false}});
  std::vector<float> logits;
  ASSERT_TRUE((*runner)->Forward(batch, &logits).ok()) << "the wrapped group works unfaulted";

  std::atomic<bool> release{false};
  ASSERT_EQ(cudaLaunchHostFunc(
                stream,
                [](void* flag) {
                  while (!static_cast<std::atomic<bool>*>(flag)->load()) {
                    std::this_thread::sleep_for(std::chrono::milliseconds(1));
                  }
                },
                &release),
            cudaSuccess);
  const auto t0 = std::chrono::steady_clock::now();
  const absl::Status hung = (*runner)->Forward(batch, &logits);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  release = true;
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_EQ(hung.code(), absl::StatusCode::kUnavailable) << hung;
  EXPECT_NE(hung.message().find("not done within 2 s"), std::string::npos) << hung;
  EXPECT_TRUE(aborted) << "the group was not aborted";
  EXPECT_GE(seconds, 2.0);
  EXPECT_LT(seconds, 30.0);
  const absl::Status later = (*runner)->Forward(batch, &logits);
  EXPECT_EQ(later.code(), absl::StatusCode::kFailedPrecondition) << later;
  EXPECT_NE(later.message().find("restart the server"), std::string::npos) << later;
}

// Weight updates write every rank's pieces on its own device.
TEST_F(TpMultiGpuTest, WeightUpdatesReachEveryDevice) {
  const ModelConfig config = *PresetConfig("small");
  const Script script = MakeScript(config.vocab_size, 32, 5, 200, /*all_logits=*/true, 35);
  const std::vector<HostTensor> update = RandomLayer1AndTopLevelUpdate(config, 36);
  std::vector<float> want;
  {
    auto ref =
        CudaModelRunner::CreateSynthetic(config, 7, Options(1, true, false, 128ll << 20, 2048));
    ASSERT_TRUE(ref.ok()) << ref.status();
    ASSERT_TRUE((*ref)->UpdateWeights(ViewsOf(update)).ok());
    want = RunScript(ref->get(), script);
  }
  for (int tp : degrees_) {
    auto runner = CudaModelRunner::CreateSynthetic(config, 7, SpreadOptions(tp, 128ll << 20, 2048));
    ASSERT_TRUE(runner.ok()) << runner.status();
    const absl::Status s = (*runner)->UpdateWeights(ViewsOf(update));
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_TRUE(SameBits(RunScript(runner->get(), script), want, config.vocab_size))
        << "after the update, tp " << tp << " on " << tp << " GPUs";
  }
}

// The devices option is checked before anything is allocated: runs on a one-GPU host.
TEST_F(TpModelTest, DevicesOptionIsValidated) {
  const ModelConfig config = *PresetConfig("small");
  int count = 0;
  ASSERT_EQ(cudaSuccess, cudaGetDeviceCount(&count));
  auto with_devices = [&](int tp, std::vector<int> devices) {
    CudaRunnerOptions o = Options(tp, true, true, 64 << 20, 512);
    o.devices = std::move(devices);
    return CudaModelRunner::CreateSynthetic(config, 7, o);
  };
  auto expect_refused = [](const absl::StatusOr<std::unique_ptr<CudaModelRunner>>& runner,
                           const std::string& needle, const char* what) {
    ASSERT_FALSE(runner.ok()) << what;
    EXPECT_EQ(runner.status().code(), absl::StatusCode::kInvalidArgument) << runner.status();
    EXPECT_NE(std::string(runner.status().message()).find(needle), std::string::npos)
        << what << ": " << runner.status();
    std::printf("[ refused  ] %s: %s\n", what, runner.status().ToString().c_str());
  };
  expect_refused(with_devices(2, {0}), "1 device(s) for tensor_parallel 2", "size != tp");
  expect_refused(with_devices(1, {0, 1}), "2 device(s) for tensor_parallel 1", "size != tp");
  expect_refused(with_devices(2, {0, 0}), "twice", "duplicate device");
  expect_refused(with_devices(2, {0, count}), "does not exist", "device beyond the last");
  expect_refused(with_devices(2, {-1, 0}), "does not exist", "negative device");
  // One rank listed on one device: that device, the default's bits.
  const Script script = MakeScript(config.vocab_size, 32, 3, 100, /*all_logits=*/true, 38);
  auto listed = with_devices(1, {0});
  ASSERT_TRUE(listed.ok()) << listed.status();
  auto plain = CudaModelRunner::CreateSynthetic(config, 7, Options(1, true, true, 64 << 20, 512));
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_TRUE(SameBits(RunScript(listed->get(), script), RunScript(plain->get(), script),
                       config.vocab_size));
}

}  // namespace
}  // namespace rollout
