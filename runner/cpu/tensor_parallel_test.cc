// Tensor parallelism of the CPU backend (D10): TP 1, 2, 4 and 8 give the same bits -- logits of
// the runner, and tokens + logprobs of greedy and sampled rollouts through the engine -- and
// weight updates slice into the ranks' shards.
#include <cstring>
#include <random>
#include <set>

#include "absl/strings/str_cat.h"
#include "engine/engine.h"
#include "engine/engine_test_util.h"
#include "engine/sampler.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/random_model.h"
#include "runner/cpu/cpu_model_runner.h"

namespace rollout {
namespace {

using ::testing::HasSubstr;

std::string ModelDir(const std::string& name, const ModelConfig& config, uint64_t seed) {
  const std::string dir = ::testing::TempDir() + "tp-test-" + name;
  RandomModelOptions options;
  options.seed = seed;
  absl::Status s = WriteRandomModelForConfig(config, options, dir);
  EXPECT_TRUE(s.ok()) << s;
  return dir;
}

const std::string& TinyDir() {  // 4 heads, 2 KV heads, tied embeddings
  static const std::string dir = ModelDir("tiny", *PresetConfig("tiny"), 5);
  return dir;
}
const std::string& SmallDir() {  // 8 heads, 2 KV heads (replicated at TP 4 and 8)
  static const std::string dir = ModelDir("small", *PresetConfig("small"), 6);
  return dir;
}
// Qwen3-MoE: 8 experts of width 128 (16 per rank at TP 8), a dense layer among MoE ones.
const std::string& MoeSmallDir() {
  static const std::string dir = ModelDir("moe-small", *PresetConfig("moe-small"), 8);
  return dir;
}
// Qwen2-style: qkv biases, no q/k norm, untied lm_head, 4 KV heads, and a vocabulary (250)
// that no degree divides, so the vocab shards are uneven.
const std::string& Qwen2Dir() {
  static const std::string dir = [] {
    ModelConfig c = *PresetConfig("tiny");
    c.architecture = "Qwen2ForCausalLM";
    c.family = ModelFamily::kQwen2;
    c.qk_norm = false;
    c.qkv_bias = true;
    c.tie_word_embeddings = false;
    c.num_attention_heads = 8;
    c.num_key_value_heads = 4;
    c.head_dim = 8;
    c.intermediate_size = 96;
    c.vocab_size = 250;
    return ModelDir("qwen2", c, 7);
  }();
  return dir;
}

std::unique_ptr<CpuModelRunner> MakeRunner(const std::string& dir, int tp, int threads = 0) {
  absl::StatusOr<std::unique_ptr<Checkpoint>> ck = Checkpoint::Open(dir);
  EXPECT_TRUE(ck.ok()) << ck.status();
  CpuRunnerOptions options;
  options.tensor_parallel = tp;
  options.num_threads = threads;
  options.kv_cache_bytes = 16 << 20;
  absl::StatusOr<std::unique_ptr<CpuModelRunner>> runner = CpuModelRunner::Create(**ck, options);
  EXPECT_TRUE(runner.ok()) << runner.status();
  return runner.ok() ? *std::move(runner) : nullptr;
}

std::string FloatBits(const std::vector<float>& v) {
  std::string out(v.size() * sizeof(float), '\0');
  if (!v.empty()) std::memcpy(out.data(), v.data(), out.size());
  return out;
}

// Two sequences: a prefill of 37 and 20 tokens in one batch, then three decode steps of both,
// then a chunk of 10 more prompt tokens beside a decode token. Returns every step's logits.
std::vector<std::string> RunSteps(ModelRunner* runner) {
  const int32_t vocab = runner->config().vocab_size;
  const int32_t block = runner->kv_block_size();
  std::vector<std::vector<int32_t>> tables = {{3, 7, 1, 9, 4}, {0, 2, 8, 5, 6}};
  std::mt19937 rng(11);
  std::vector<int32_t> length = {0, 0};
  std::vector<std::string> out;
  auto step = [&](const std::vector<std::pair<int, int>>& adds) {  // (sequence, tokens)
    ForwardBatch b;
    b.block_tables = tables;
    std::set<int32_t> rows = {0};  // also the first token's (a prefill row not at the end)
    for (auto [seq, n] : adds) {
      for (int i = 0; i < n; ++i) {
        b.token_ids.push_back(static_cast<int32_t>(rng() % vocab));
        b.positions.push_back(length[seq]++);
        b.token_seq.push_back(seq);
      }
      rows.insert(static_cast<int32_t>(b.token_ids.size()) - 1);
    }
    b.logit_rows.assign(rows.begin(), rows.end());
    std::vector<float> logits;
    absl::Status s = runner->Forward(b, &logits);
    EXPECT_TRUE(s.ok()) << s;
    EXPECT_EQ(logits.size(), b.logit_rows.size() * static_cast<size_t>(vocab));
    out.push_back(FloatBits(logits));
  };
  EXPECT_LE(37 + 3 + 10, 5 * block);
  step({{0, 37}, {1, 20}});
  for (int i = 0; i < 3; ++i) step({{0, 1}, {1, 1}});
  step({{1, 10}, {0, 1}});
  return out;
}

TEST(TensorParallelRunnerTest, LogitsAreBitwiseEqualAtEveryDegree) {
  struct Model {
    std::string name;
    const std::string& dir;
    std::vector<int> degrees;
  };
  const std::vector<Model> models = {{"tiny", TinyDir(), {1, 2, 4}},
                                     {"small", SmallDir(), {1, 2, 4, 8}},
                                     {"qwen2-uneven-vocab", Qwen2Dir(), {1, 2, 4, 8}},
                                     {"moe-small", MoeSmallDir(), {1, 2, 4, 8}}};
  for (const Model& m : models) {
    std::unique_ptr<CpuModelRunner> tp1 = MakeRunner(m.dir, 1);
    ASSERT_NE(tp1, nullptr);
    const std::vector<std::string> want = RunSteps(tp1.get());
    for (int tp : m.degrees) {
      for (int threads : {1, 0}) {
        std::unique_ptr<CpuModelRunner> runner = MakeRunner(m.dir, tp, threads);
        ASSERT_NE(runner, nullptr);
        EXPECT_EQ(runner->tensor_parallel(), tp);
        EXPECT_EQ(runner->num_kv_blocks(), tp1->num_kv_blocks()) << m.name;
        EXPECT_EQ(runner->weight_specs().size(), tp1->weight_specs().size());
        const std::vector<std::string> got = RunSteps(runner.get());
        ASSERT_EQ(got.size(), want.size());
        for (size_t i = 0; i < got.size(); ++i) {
          EXPECT_TRUE(got[i] == want[i]) << m.name << ": TP " << tp << " (threads " << threads
                                         << ") step " << i << " logits differ from TP 1";
        }
      }
    }
  }
}

// A full HF tensor of seeded random values in [offset - scale, offset + scale], in the dtype
// the model serves it in (bf16 for these checkpoints).
HostTensor RandomTensor(const WeightSpec& spec, uint32_t seed, float scale, float offset = 0.0f) {
  HostTensor t{spec.name, spec.dtype, spec.shape, {}};
  int64_t n = 1;
  for (int64_t d : spec.shape) n *= d;
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-scale, scale);
  t.bytes.resize(n * DTypeSize(spec.dtype));
  for (int64_t i = 0; i < n; ++i) {
    const float v = offset + dist(rng);
    if (spec.dtype == DType::kF32) {
      std::memcpy(&t.bytes[4 * i], &v, 4);
    } else {
      const uint16_t b = spec.dtype == DType::kBF16 ? F32ToBF16(v) : F32ToF16(v);
      std::memcpy(&t.bytes[2 * i], &b, 2);
    }
  }
  return t;
}

TEST(TensorParallelRunnerTest, WeightUpdatesSliceIntoTheRankShards) {
  // Every kind of binding: vocab rows (embed, lm_head), head rows (q, k, v and biases), K
  // slices (o, down), gate and up into one matrix, replicated norms.
  const std::vector<std::string> names = {"model.embed_tokens.weight",
                                          "lm_head.weight",
                                          "model.layers.0.self_attn.q_proj.weight",
                                          "model.layers.1.self_attn.k_proj.weight",
                                          "model.layers.0.self_attn.v_proj.bias",
                                          "model.layers.1.self_attn.o_proj.weight",
                                          "model.layers.0.mlp.gate_proj.weight",
                                          "model.layers.1.mlp.up_proj.weight",
                                          "model.layers.0.mlp.down_proj.weight",
                                          "model.layers.1.input_layernorm.weight",
                                          "model.norm.weight"};
  std::unique_ptr<CpuModelRunner> tp1 = MakeRunner(Qwen2Dir(), 1);
  ASSERT_NE(tp1, nullptr);
  std::vector<HostTensor> update;
  uint32_t seed = 100;
  for (const std::string& name : names) {
    const WeightSpec* spec = FindWeightSpec(tp1->weight_specs(), name);
    ASSERT_NE(spec, nullptr) << name;
    const bool norm = name.find("norm") != std::string::npos;  // keep norms near 1
    update.push_back(RandomTensor(*spec, seed++, norm ? 0.2f : 0.1f, norm ? 1.0f : 0.0f));
  }
  const std::vector<std::string> before = RunSteps(MakeRunner(Qwen2Dir(), 1).get());
  ASSERT_TRUE(tp1->UpdateWeights(ViewsOf(update)).ok());
  const std::vector<std::string> want = RunSteps(tp1.get());
  EXPECT_NE(want, before) << "the update changed nothing";
  for (int tp : {2, 4, 8}) {
    std::unique_ptr<CpuModelRunner> runner = MakeRunner(Qwen2Dir(), tp);
    ASSERT_NE(runner, nullptr);
    absl::Status s = runner->UpdateWeights(ViewsOf(update));
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_EQ(RunSteps(runner.get()), want) << "TP " << tp;
  }
  // An fp32 update of a model served in fp32 goes through the same slicing.
  ModelConfig c = *PresetConfig("small");
  RandomModelOptions f32;
  f32.dtype = DType::kF32;
  const std::string dir = ::testing::TempDir() + "tp-test-small-f32";
  ASSERT_TRUE(WriteRandomModelForConfig(c, f32, dir).ok());
  std::unique_ptr<CpuModelRunner> f32_tp1 = MakeRunner(dir, 1);
  std::unique_ptr<CpuModelRunner> f32_tp8 = MakeRunner(dir, 8);
  const WeightSpec* down =
      FindWeightSpec(f32_tp1->weight_specs(), "model.layers.2.mlp.down_proj.weight");
  ASSERT_NE(down, nullptr);
  ASSERT_EQ(down->dtype, DType::kF32);
  const HostTensor t = RandomTensor(*down, 9, 0.05f);
  ASSERT_TRUE(f32_tp1->UpdateWeights({t}).ok());
  ASSERT_TRUE(f32_tp8->UpdateWeights({t}).ok());
  EXPECT_EQ(RunSteps(f32_tp8.get()), RunSteps(f32_tp1.get()));
}

TEST(TensorParallelRunnerTest, MoeWeightUpdatesSliceEveryExpertIntoTheRankShards) {
  // The router (replicated) and an expert's gate and up rows and down K slice.
  const std::vector<std::string> names = {"model.layers.0.mlp.gate.weight",
                                          "model.layers.2.mlp.experts.3.gate_proj.weight",
                                          "model.layers.2.mlp.experts.3.up_proj.weight",
                                          "model.layers.3.mlp.experts.7.down_proj.weight",
                                          "model.layers.1.mlp.down_proj.weight"};
  std::unique_ptr<CpuModelRunner> tp1 = MakeRunner(MoeSmallDir(), 1);
  ASSERT_NE(tp1, nullptr);
  std::vector<HostTensor> update;
  uint32_t seed = 300;
  for (const std::string& name : names) {
    const WeightSpec* spec = FindWeightSpec(tp1->weight_specs(), name);
    ASSERT_NE(spec, nullptr) << name;
    update.push_back(RandomTensor(*spec, seed++, 0.2f));
  }
  const std::vector<std::string> before = RunSteps(MakeRunner(MoeSmallDir(), 1).get());
  ASSERT_TRUE(tp1->UpdateWeights(ViewsOf(update)).ok());
  const std::vector<std::string> want = RunSteps(tp1.get());
  EXPECT_NE(want, before) << "the update changed nothing";
  for (int tp : {2, 4, 8}) {
    std::unique_ptr<CpuModelRunner> runner = MakeRunner(MoeSmallDir(), tp);
    ASSERT_NE(runner, nullptr);
    absl::Status s = runner->UpdateWeights(ViewsOf(update));
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_EQ(RunSteps(runner.get()), want) << "TP " << tp;
  }
}

TEST(TensorParallelRunnerTest, DegreesThatDoNotSplitTheModelAreRefusedClearly) {
  absl::StatusOr<std::unique_ptr<Checkpoint>> ck = Checkpoint::Open(TinyDir());
  ASSERT_TRUE(ck.ok());
  CpuRunnerOptions options;
  options.tensor_parallel = 8;  // tiny has 4 attention heads
  absl::StatusOr<std::unique_ptr<CpuModelRunner>> r = CpuModelRunner::Create(**ck, options);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("4 attention heads"));
  for (int tp : {0, 3, 6, 16}) {
    options.tensor_parallel = tp;
    r = CpuModelRunner::Create(**ck, options);
    ASSERT_FALSE(r.ok()) << tp;
    EXPECT_THAT(r.status().message(), HasSubstr("must be 1, 2, 4 or 8")) << tp;
  }
  ModelConfig c = *PresetConfig("small");
  c.num_attention_heads = 24;
  c.num_key_value_heads = 3;  // neither a multiple nor a divisor of 2
  EXPECT_THAT(CheckTensorParallel(c, 2).message(), HasSubstr("3 KV heads"));
  c = *PresetConfig("small");
  c.intermediate_size = 100;
  EXPECT_THAT(CheckTensorParallel(c, 8).message(), HasSubstr("intermediate size 100"));
  EXPECT_TRUE(CheckTensorParallel(*PresetConfig("qwen3-8b"), 8).ok());
}

// --- Through the engine: tokens and logprobs of greedy and sampled rollouts ---

// Bits() of engine_test_util.h plus the top logprobs.
std::string BitsWithTops(const SampleCompletion& c) {
  std::string out = Bits(c);
  for (const auto& tops : c.top_logprobs) {
    for (const auto& e : tops) {
      uint32_t b;
      std::memcpy(&b, &e.logprob, 4);
      absl::StrAppend(&out, e.token, ":", b, " ");
    }
  }
  return out;
}

// Greedy, T = 0.8 with top-p and T = 1.3 with top-k rollouts of several prompt lengths (one
// crossing prefill chunks), n = 2 for one, with top logprobs.
std::vector<std::string> RunRollouts(const std::string& dir, int tp, int vocab) {
  absl::StatusOr<std::unique_ptr<Checkpoint>> ck = Checkpoint::Open(dir);
  EXPECT_TRUE(ck.ok());
  CpuRunnerOptions runner_options;
  runner_options.tensor_parallel = tp;
  runner_options.kv_cache_bytes = 16 << 20;
  absl::StatusOr<std::unique_ptr<CpuModelRunner>> runner =
      CpuModelRunner::Create(**ck, runner_options);
  EXPECT_TRUE(runner.ok()) << runner.status();
  if (!runner.ok()) return {};
  EngineOptions options;
  options.max_batch_tokens = 64;  // the 90-token prompt comes in two chunks
  absl::StatusOr<std::unique_ptr<Engine>> engine = Engine::Create(*std::move(runner), options);
  EXPECT_TRUE(engine.ok()) << engine.status();
  std::vector<SampleSpec> specs;
  const std::vector<int> lengths = {1, 17, 40, 90, 33, 5};
  for (size_t i = 0; i < lengths.size(); ++i) {
    SampleSpec s;
    s.sample_index = static_cast<int32_t>(i);
    for (int t = 0; t < lengths[i]; ++t) s.prompt.push_back((t * 31 + i * 7 + 3) % vocab);
    switch (i % 3) {
      case 0:
        s.params.temperature = 0.0f;
        break;
      case 1:
        s.params.temperature = 0.8f;
        s.params.top_p = 0.9f;
        break;
      default:
        s.params.temperature = 1.3f;
        s.params.top_k = 20;
        break;
    }
    s.params.max_new_tokens = 24;
    s.params.ignore_eos = true;
    s.params.top_logprobs = 2;
    s.sample_seed = DeriveSampleSeed(1234, static_cast<uint32_t>(i));
    specs.push_back(s);
  }
  Collector collector(specs.size());
  EXPECT_TRUE((*engine)->Submit(specs, collector.Sink()).ok());
  std::vector<std::string> bits;
  for (const SampleCompletion& c : collector.Wait()) {
    EXPECT_EQ(c.token_ids.size(), 24u);
    bits.push_back(BitsWithTops(c));
  }
  return bits;
}

TEST(TensorParallelEngineTest, GreedyAndSampledRolloutsAreBitwiseEqualAtTp1Tp2Tp4) {
  struct Model {
    std::string name;
    const std::string& dir;
    int vocab;
  };
  for (const Model& m : {Model{"tiny", TinyDir(), 256}, Model{"small", SmallDir(), 4096}}) {
    const std::vector<std::string> tp1 = RunRollouts(m.dir, 1, m.vocab);
    ASSERT_EQ(tp1.size(), 6u);
    for (int tp : {2, 4}) {
      const std::vector<std::string> got = RunRollouts(m.dir, tp, m.vocab);
      ASSERT_EQ(got.size(), tp1.size());
      for (size_t i = 0; i < got.size(); ++i) {
        EXPECT_EQ(got[i], tp1[i]) << m.name << ": rollout " << i << " differs at TP " << tp;
      }
    }
  }
}

}  // namespace
}  // namespace rollout
