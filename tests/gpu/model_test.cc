// CudaModelRunner end to end: synthetic weights equal the checkpoint writer's, logits agree with
// the CPU reference, and a sequence's logits rows are bitwise the same alone, inside batches of
// mixed lengths, under any chunking, decode vs prefill, and with its prefix KV computed by
// another sequence (D1, D3, D4, D8 at the runner).
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "model/random_model.h"
#include "runner/cpu/cpu_model_runner.h"
#include "runner/cuda/cuda_model_runner.h"
#include "tests/gpu/forward_script.h"
#include "tests/gpu/gpu_test_util.h"

namespace rollout {
namespace {

using gpu_test::Chunk;
using gpu_test::MakeBatch;
using gpu_test::RandomTokens;
using gpu_test::Seq;

// Hands out KV blocks in order; tests reset it between independent variants.
class BlockPool {
 public:
  BlockPool(int32_t num_blocks, int32_t block_size) : num_(num_blocks), size_(block_size) {}
  Seq Make(std::vector<int32_t> tokens) {
    Seq s;
    const int32_t need = (static_cast<int32_t>(tokens.size()) + size_ - 1) / size_;
    for (int32_t i = 0; i < need; ++i) s.blocks.push_back(next_++ % num_);
    s.tokens = std::move(tokens);
    return s;
  }

 private:
  int32_t num_, size_;
  int32_t next_ = 0;
};

// Runs `chunks` as one Forward; returns the logits rows of chunk `which` (all its logits rows).
std::vector<float> RowsOf(CudaModelRunner* runner, const std::vector<Seq>& seqs,
                          const std::vector<Chunk>& chunks, int which) {
  const ForwardBatch batch = MakeBatch(seqs, chunks);
  std::vector<float> logits;
  const absl::Status s = runner->ForwardToHost(batch, &logits);
  EXPECT_TRUE(s.ok()) << s;
  if (!s.ok()) return {};
  const int64_t vocab = runner->config().vocab_size;
  int64_t first = 0;
  for (int i = 0; i < which; ++i) {
    first += chunks[i].all_logits ? chunks[i].end - chunks[i].begin : 1;
  }
  const int64_t rows = chunks[which].all_logits ? chunks[which].end - chunks[which].begin : 1;
  return std::vector<float>(logits.begin() + first * vocab,
                            logits.begin() + (first + rows) * vocab);
}

// Appends `rows` to `acc`.
void Append(std::vector<float>* acc, const std::vector<float>& rows) {
  acc->insert(acc->end(), rows.begin(), rows.end());
}

// Compares logits rows bitwise, naming the first differing position.
::testing::AssertionResult SameRows(const std::vector<float>& got, const std::vector<float>& want,
                                    int64_t vocab, int first_position) {
  if (got.size() != want.size()) {
    return ::testing::AssertionFailure()
           << "row counts differ: " << got.size() / vocab << " vs " << want.size() / vocab;
  }
  for (size_t r = 0; r < got.size() / vocab; ++r) {
    if (std::memcmp(&got[r * vocab], &want[r * vocab], vocab * sizeof(float)) != 0) {
      return ::testing::AssertionFailure()
             << "logits of position " << first_position + r << " differ bitwise";
    }
  }
  return ::testing::AssertionSuccess();
}

class ModelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!gpu_test::HaveGpu()) GTEST_SKIP() << "no CUDA device";
  }
  static CudaRunnerOptions SmallOptions() {
    CudaRunnerOptions o;
    o.kv_cache_bytes = 256ll << 20;
    o.max_batch_tokens = 2048;
    return o;
  }
  // Real Qwen3-8B shapes (hidden 4096, 32/8 heads x 128, inter 12288, vocab 151936) with two
  // layers: the production GEMM and attention sizes at test cost. Runner options: a 2 GiB KV pool.
  static ModelConfig Qwen3_8bTwoLayers() {
    ModelConfig config = *PresetConfig("qwen3-8b");
    config.num_layers = 2;
    return config;
  }
  static CudaRunnerOptions Qwen3_8bOptions() {
    CudaRunnerOptions o;
    o.kv_cache_bytes = 2ll << 30;
    return o;
  }
  static std::string TempDir(const std::string& name) {
    const std::string dir =
        ::testing::TempDir() + "/rollout_gpu_" + name + "_" + std::to_string(getpid());
    std::filesystem::remove_all(dir);
    return dir;
  }
};

TEST_F(ModelTest, SyntheticWeightsEqualTheCheckpointWritersBitwise) {
  const std::string dir = TempDir("synthetic");
  RandomModelOptions write;
  write.preset = "small";
  write.seed = 5;
  ASSERT_TRUE(WriteRandomModel(write, dir).ok());
  absl::StatusOr<std::unique_ptr<Checkpoint>> ckpt = Checkpoint::Open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  auto from_file = CudaModelRunner::Create(**ckpt, SmallOptions());
  ASSERT_TRUE(from_file.ok()) << from_file.status();
  auto synthetic = CudaModelRunner::CreateSynthetic(*PresetConfig("small"), 5, SmallOptions());
  ASSERT_TRUE(synthetic.ok()) << synthetic.status();

  BlockPool pool((*from_file)->num_kv_blocks(), (*from_file)->kv_block_size());
  std::vector<Seq> seqs = {pool.Make(RandomTokens(100, 4096, 1))};
  const std::vector<Chunk> chunks = {{0, 0, 100, true}};
  const std::vector<float> a = RowsOf(from_file->get(), seqs, chunks, 0);
  const std::vector<float> b = RowsOf(synthetic->get(), seqs, chunks, 0);
  EXPECT_TRUE(SameRows(a, b, 4096, 0));
  std::filesystem::remove_all(dir);
}

// The CUDA backend's logits of a random `preset` model against CpuModelRunner's (fp32).
void CheckAgainstCpu(const std::string& dir, const std::string& preset,
                     const CudaRunnerOptions& options);

TEST_F(ModelTest, LogitsMatchTheCpuReferenceWithinBf16Tolerance) {
  CheckAgainstCpu(TempDir("cpu_ref"), "small", SmallOptions());
}

// Scaled RoPE (the CUDA tables and the CPU's per-token rotation from one function): Llama 3.1's
// llama3 scaling, and YaRN with its attention factor on cos and sin.
TEST_F(ModelTest, ScaledRopeLogitsMatchTheCpuReferenceWithinBf16Tolerance) {
  CheckAgainstCpu(TempDir("cpu_ref_llama3"), "llama3-small", SmallOptions());
  CheckAgainstCpu(TempDir("cpu_ref_yarn"), "yarn-small", SmallOptions());
}

void CheckAgainstCpu(const std::string& dir, const std::string& preset,
                     const CudaRunnerOptions& options) {
  SCOPED_TRACE(preset);
  RandomModelOptions write;
  write.preset = preset;
  write.seed = 9;
  ASSERT_TRUE(WriteRandomModel(write, dir).ok());
  absl::StatusOr<std::unique_ptr<Checkpoint>> ckpt = Checkpoint::Open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  CudaRunnerOptions gpu_options = options;
  gpu_options.kv_block_size = 16;
  gpu_options.attention_split_size = 64;
  auto gpu = CudaModelRunner::Create(**ckpt, gpu_options);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  auto cpu = CpuModelRunner::Create(**ckpt, CpuRunnerOptions{});
  ASSERT_TRUE(cpu.ok()) << cpu.status();

  BlockPool pool(std::min((*gpu)->num_kv_blocks(), (*cpu)->num_kv_blocks()), 16);
  std::vector<Seq> seqs = {pool.Make(RandomTokens(200, 4096, 2)),
                           pool.Make(RandomTokens(37, 4096, 3))};
  const ForwardBatch batch = MakeBatch(seqs, {{0, 0, 200, true}, {1, 0, 37, true}});
  std::vector<float> got, want;
  ASSERT_TRUE((*gpu)->ForwardToHost(batch, &got).ok());
  ASSERT_TRUE((*cpu)->Forward(batch, &want).ok());
  double sum_sq = 0.0, max_err = 0.0, sum_err = 0.0;
  int64_t argmax_agree = 0;
  const int64_t vocab = 4096, rows = static_cast<int64_t>(want.size()) / vocab;
  for (int64_t r = 0; r < rows; ++r) {
    int64_t best_got = 0, best_want = 0;
    for (int64_t i = 0; i < vocab; ++i) {
      const double g = got[r * vocab + i], w = want[r * vocab + i];
      sum_sq += w * w;
      max_err = std::max(max_err, std::fabs(g - w));
      sum_err += std::fabs(g - w);
      if (g > got[r * vocab + best_got]) best_got = i;
      if (w > want[r * vocab + best_want]) best_want = i;
    }
    argmax_agree += best_got == best_want;
  }
  const double rms = std::sqrt(sum_sq / want.size());
  std::printf(
      "[ vs cpu   ] %s: logits rms %.3f, max |err| %.4f, mean |err| %.5f, argmax agrees on "
      "%ld/%ld rows\n",
      preset.c_str(), rms, max_err, sum_err / want.size(), static_cast<long>(argmax_agree),
      static_cast<long>(rows));
  // bf16 weights are exact in both; the GPU rounds activations to bf16 at every GEMM input,
  // the CPU keeps fp32: errors of a few 2^-8 relative, accumulated over the layers.
  EXPECT_LT(max_err, 0.1 * rms);
  EXPECT_LT(sum_err / want.size(), 0.01 * rms);
  EXPECT_GE(argmax_agree, rows * 9 / 10);
  std::filesystem::remove_all(dir);
}

// The batch-invariance suite for one model: reference = the sequence alone in one shot.
void CheckInvariance(CudaModelRunner* runner, int len, uint64_t seed) {
  const int64_t vocab = runner->config().vocab_size;
  const int split = runner->attention_split_size();
  BlockPool pool(runner->num_kv_blocks(), runner->kv_block_size());
  const std::vector<int32_t> tokens = RandomTokens(len, static_cast<int>(vocab), seed);

  std::vector<Seq> alone = {pool.Make(tokens)};
  const std::vector<float> ref = RowsOf(runner, alone, {{0, 0, len, true}}, 0);

  {  // Chunked prefill at multiples of the split size, each chunk its own step.
    std::vector<Seq> seqs = {pool.Make(tokens)};
    std::vector<float> rows;
    for (int b = 0; b < len; b += split) {
      Append(&rows, RowsOf(runner, seqs, {{0, b, std::min(len, b + split), true}}, 0));
    }
    EXPECT_TRUE(SameRows(rows, ref, vocab, 0)) << "chunked at the split size " << split;
  }
  {  // Chunked at odd places (stronger than the scheduler needs).
    std::vector<Seq> seqs = {pool.Make(tokens)};
    std::vector<float> rows;
    const int cuts[] = {0, 1, 50, len - 1, len};
    for (int i = 0; i + 1 < 5; ++i) {
      Append(&rows, RowsOf(runner, seqs, {{0, cuts[i], cuts[i + 1], true}}, 0));
    }
    EXPECT_TRUE(SameRows(rows, ref, vocab, 0)) << "chunked at 1, 50, len - 1";
  }
  {  // Inside a batch of mixed lengths: other prefills before and after it.
    std::vector<Seq> seqs;
    std::vector<Chunk> chunks;
    std::mt19937 rng(seed);
    for (int i = 0; i < 12; ++i) {
      const int other = 1 + static_cast<int>(rng() % 700);
      seqs.push_back(pool.Make(RandomTokens(other, static_cast<int>(vocab), seed + 100 + i)));
      chunks.push_back({static_cast<int>(seqs.size()) - 1, 0, other, i == 0});
      if (i == 5) {
        seqs.push_back(pool.Make(tokens));
        chunks.push_back({static_cast<int>(seqs.size()) - 1, 0, len, true});
      }
    }
    EXPECT_TRUE(SameRows(RowsOf(runner, seqs, chunks, 6), ref, vocab, 0)) << "in a mixed batch";
  }
  {  // Prefill of most of it, then decode one token per step beside other decoding sequences.
    std::vector<Seq> seqs = {pool.Make(tokens)};
    const int decode_from = len - 20;
    for (int i = 0; i < 30; ++i) {
      seqs.push_back(pool.Make(RandomTokens(600, static_cast<int>(vocab), seed + 200 + i)));
    }
    std::vector<Chunk> first = {{0, 0, decode_from, true}};
    for (int i = 1; i <= 30; ++i) first.push_back({i, 0, 500 + i, false});
    std::vector<float> rows = RowsOf(runner, seqs, first, 0);
    for (int pos = decode_from; pos < len; ++pos) {
      std::vector<Chunk> step;
      // A varying number of other decoders, the sequence under test in varying places.
      const int others = 1 + (pos * 7) % 30;
      for (int i = 1; i <= others; ++i) {
        step.push_back({i, 500 + i + pos - decode_from, 501 + i + pos - decode_from, false});
      }
      const int at = pos % (others + 1);
      step.insert(step.begin() + at, {0, pos, pos + 1, true});
      Append(&rows, RowsOf(runner, seqs, step, at));
    }
    EXPECT_TRUE(SameRows(rows, ref, vocab, 0)) << "decode vs prefill";
  }
  {  // The prefix KV computed by another sequence sharing the first `shared` tokens.
    const int shared = (len / 2) / runner->kv_block_size() * runner->kv_block_size();
    std::vector<int32_t> other_tokens(tokens.begin(), tokens.begin() + shared);
    const std::vector<int32_t> tail = RandomTokens(len - shared, static_cast<int>(vocab), 77);
    other_tokens.insert(other_tokens.end(), tail.begin(), tail.end());
    std::vector<Seq> seqs = {pool.Make(other_tokens), pool.Make(tokens)};
    RowsOf(runner, seqs, {{0, 0, len, false}}, 0);
    const int shared_blocks = shared / runner->kv_block_size();
    std::copy(seqs[0].blocks.begin(), seqs[0].blocks.begin() + shared_blocks,
              seqs[1].blocks.begin());
    const std::vector<float> rows = RowsOf(runner, seqs, {{1, shared, len, true}}, 0);
    const std::vector<float> want(ref.begin() + static_cast<int64_t>(shared) * vocab, ref.end());
    EXPECT_TRUE(SameRows(rows, want, vocab, shared)) << "prefix KV from another sequence";
  }
}

// The memory plan refuses limits the device cannot meet, naming the limit: with all but part of
// a large step's workspace taken by another allocation, creating the runner fails
// RESOURCE_EXHAUSTED at the workspace and says to lower --max_batch_tokens.
TEST_F(ModelTest, AWorkspaceThatDoesNotFitIsRefusedNamingTheLimit) {
  auto used_by = [](const CudaRunnerOptions& o) -> int64_t {
    size_t before = 0, after = 0, total = 0;
    EXPECT_EQ(cudaMemGetInfo(&before, &total), cudaSuccess);
    auto runner = CudaModelRunner::CreateSynthetic(Qwen3_8bTwoLayers(), 3, o);
    EXPECT_TRUE(runner.ok()) << runner.status();
    EXPECT_EQ(cudaMemGetInfo(&after, &total), cudaSuccess);
    return static_cast<int64_t>(before) - static_cast<int64_t>(after);
  };
  CudaRunnerOptions small = SmallOptions(), large = SmallOptions();
  small.max_batch_tokens = 256;
  large.max_batch_tokens = 65535;
  // The GEMM ladder is not what this test is about, and building it at these shapes took ~20 s
  // a runner (the test 43.6 s on the H200 with it).
  small.gemm_ladder = large.gemm_ladder = false;
  const int64_t small_bytes = used_by(small), large_bytes = used_by(large);
  ASSERT_GT(large_bytes - small_bytes, int64_t{1} << 28) << "the large step's workspace";
  size_t free_bytes = 0, total = 0;
  ASSERT_EQ(cudaMemGetInfo(&free_bytes, &total), cudaSuccess);
  const int64_t leave = small_bytes + (large_bytes - small_bytes) / 2;
  void* hog = nullptr;
  ASSERT_EQ(cudaMalloc(&hog, static_cast<size_t>(free_bytes) - leave), cudaSuccess);
  auto refused = CudaModelRunner::CreateSynthetic(Qwen3_8bTwoLayers(), 3, large);
  cudaFree(hog);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_NE(refused.status().message().find("--max_batch_tokens=65535"), std::string::npos)
      << refused.status();
}

TEST_F(ModelTest, SmallModelRowsAreBatchAndChunkInvariant) {
  auto runner = CudaModelRunner::CreateSynthetic(*PresetConfig("small"), 1, SmallOptions());
  ASSERT_TRUE(runner.ok()) << runner.status();
  CheckInvariance(runner->get(), 300, 11);
}

TEST_F(ModelTest, SmallModelSmallSplitAndPagesAreInvariant) {
  CudaRunnerOptions o = SmallOptions();
  o.kv_block_size = 16;
  o.attention_split_size = 32;
  auto runner = CudaModelRunner::CreateSynthetic(*PresetConfig("small"), 1, o);
  ASSERT_TRUE(runner.ok()) << runner.status();
  CheckInvariance(runner->get(), 333, 12);
}

TEST_F(ModelTest, SmallModelWithSimtAttentionIsInvariant) {
  CudaRunnerOptions o = SmallOptions();
  o.attention_kernel = CudaAttentionKernel::kSimt;
  auto runner = CudaModelRunner::CreateSynthetic(*PresetConfig("small"), 1, o);
  ASSERT_TRUE(runner.ok()) << runner.status();
  CheckInvariance(runner->get(), 300, 14);
}

TEST_F(ModelTest, TwoRunnersAndSlicedBatchesGiveTheSameBits) {
  auto a = CudaModelRunner::CreateSynthetic(*PresetConfig("small"), 4, SmallOptions());
  CudaRunnerOptions sliced = SmallOptions();
  sliced.max_batch_tokens = 100;  // a 300-token prefill runs as three slices
  sliced.max_logit_rows = 7;
  auto b = CudaModelRunner::CreateSynthetic(*PresetConfig("small"), 4, sliced);
  ASSERT_TRUE(a.ok() && b.ok());
  BlockPool pool((*a)->num_kv_blocks(), (*a)->kv_block_size());
  std::vector<Seq> seqs = {pool.Make(RandomTokens(300, 4096, 5))};
  EXPECT_TRUE(SameRows(RowsOf(a->get(), seqs, {{0, 0, 300, true}}, 0),
                       RowsOf(b->get(), seqs, {{0, 0, 300, true}}, 0), 4096, 0));
}

// Decode steps replayed as CUDA graphs (padded to their bucket) against the same steps run
// kernel by kernel: every logits row bitwise equal, for batches of 1 to 256 sequences of mixed
// lengths, sizes on and off the buckets (so padding rows are present) and split counts that
// need the split grid padded.
void CheckGraphsMatchEager(const ModelConfig& config, CudaRunnerOptions options, int num_seqs,
                           int max_len, const std::vector<int>& step_sizes) {
  options.cuda_graphs = false;
  auto eager = CudaModelRunner::CreateSynthetic(config, 9, options);
  options.cuda_graphs = true;
  auto graphed = CudaModelRunner::CreateSynthetic(config, 9, options);
  ASSERT_TRUE(eager.ok() && graphed.ok()) << eager.status() << graphed.status();
  const int64_t vocab = config.vocab_size;
  const int steps = static_cast<int>(step_sizes.size());
  BlockPool pool((*eager)->num_kv_blocks(), (*eager)->kv_block_size());
  std::mt19937 rng(21);
  std::vector<Seq> seqs;
  std::vector<int> length;  // tokens in the cache so far
  std::vector<Chunk> prefill;
  for (int i = 0; i < num_seqs; ++i) {
    const int len = 1 + static_cast<int>(rng() % max_len);
    seqs.push_back(pool.Make(RandomTokens(len + steps, static_cast<int>(vocab), 500 + i)));
    length.push_back(len);
    prefill.push_back({i, 0, len, false});
  }
  // Prefill in batches of at most 16 sequences (eager on both: not decode steps).
  for (size_t first = 0; first < prefill.size(); first += 16) {
    const std::vector<Chunk> part(prefill.begin() + first,
                                  prefill.begin() + std::min(prefill.size(), first + 16));
    EXPECT_TRUE(SameRows(RowsOf(graphed->get(), seqs, part, 0), RowsOf(eager->get(), seqs, part, 0),
                         vocab, 0));
  }
  ASSERT_EQ((*graphed)->graph_launches(), 0);
  std::vector<int> order(num_seqs);
  for (int i = 0; i < num_seqs; ++i) order[i] = i;
  for (int step = 0; step < steps; ++step) {
    std::shuffle(order.begin(), order.end(), rng);
    std::vector<Chunk> chunks;
    for (int j = 0; j < step_sizes[step]; ++j) {
      const int i = order[j];
      chunks.push_back({i, length[i], length[i] + 1, true});
      ++length[i];
    }
    const ForwardBatch batch = MakeBatch(seqs, chunks);
    std::vector<float> got, want;
    ASSERT_TRUE((*graphed)->ForwardToHost(batch, &got).ok());
    ASSERT_TRUE((*eager)->ForwardToHost(batch, &want).ok());
    EXPECT_TRUE(SameRows(got, want, vocab, 0))
        << "decode step " << step << " of " << step_sizes[step] << " sequences";
  }
  EXPECT_EQ((*graphed)->graph_launches(), steps) << "every decode step should replay a graph";
  EXPECT_GT((*graphed)->graphs_captured(), 0);
  EXPECT_EQ((*eager)->graph_launches(), 0);
}

TEST_F(ModelTest, SmallModelDecodeGraphsEqualEagerBitwise) {
  CheckGraphsMatchEager(
      *PresetConfig("small"), SmallOptions(), 256, 700,
      {1, 2, 3, 4, 5, 7, 13, 16, 17, 31, 32, 33, 63, 100, 129, 200, 255, 256, 256, 1, 33});
}

TEST_F(ModelTest, SmallModelDecodeGraphsWithSmallSplitsEqualEagerBitwise) {
  CudaRunnerOptions o = SmallOptions();
  o.kv_block_size = 16;
  o.attention_split_size = 32;  // up to 22 splits: the split grid is padded to 32
  CheckGraphsMatchEager(*PresetConfig("small"), o, 64, 700, {1, 3, 9, 33, 64, 2, 40});
}

TEST_F(ModelTest, Qwen3_8bShapedDecodeGraphsEqualEagerBitwise) {
  CheckGraphsMatchEager(Qwen3_8bTwoLayers(), Qwen3_8bOptions(), 256, 1500,
                        {1, 2, 5, 8, 31, 64, 97, 200, 256});
}

// The pinned GEMM algorithms and the attention kernel at their production sizes.
TEST_F(ModelTest, Qwen3_8bShapedRowsAreBatchAndChunkInvariant) {
  CudaRunnerOptions o = Qwen3_8bOptions();
  o.max_batch_tokens = 8192;
  auto runner = CudaModelRunner::CreateSynthetic(Qwen3_8bTwoLayers(), 3, o);
  ASSERT_TRUE(runner.ok()) << runner.status();
  for (const std::string& line : (*runner)->gemm_descriptions()) {
    std::printf("[ pinned   ] %s\n", line.c_str());
  }
  CheckInvariance(runner->get(), 600, 13);
}

// The GEMM ladder (kernels/cuda/gemm.h) against the pins alone, Qwen3-8B shapes: a prefill of
// ~8000 rows, then decode steps of 1 .. 300 rows (every ladder range) -- every logits row
// bitwise equal.
TEST_F(ModelTest, Qwen3_8bShapedGemmLadderGivesThePinsBits) {
  const ModelConfig config = Qwen3_8bTwoLayers();
  CudaRunnerOptions o = Qwen3_8bOptions();
  o.max_batch_tokens = 8192;
  o.gemm_ladder = false;
  auto pinned = CudaModelRunner::CreateSynthetic(config, 5, o);
  o.gemm_ladder = true;
  auto ladder = CudaModelRunner::CreateSynthetic(config, 5, o);
  ASSERT_TRUE(pinned.ok() && ladder.ok()) << pinned.status() << ladder.status();
  int rungs = 0;
  for (const std::string& line : (*ladder)->gemm_descriptions()) {
    std::printf("[ ladder   ] %s\n", line.c_str());
    rungs += line.find("ladder") != std::string::npos ? 1 : 0;
  }
  EXPECT_GT(rungs, 0) << "no GEMM got a ladder: this test would compare the pins with themselves";
  const int64_t vocab = config.vocab_size;
  BlockPool pool((*pinned)->num_kv_blocks(), (*pinned)->kv_block_size());
  auto all_rows = [](CudaModelRunner* runner, const ForwardBatch& batch) {
    std::vector<float> logits;
    const absl::Status s = runner->ForwardToHost(batch, &logits);
    EXPECT_TRUE(s.ok()) << s;
    return logits;
  };
  std::vector<Seq> seqs;
  std::vector<int> length;
  std::vector<Chunk> prefill;
  for (int i = 0; i < 300; ++i) {
    length.push_back(i < 11 ? 700 + i : 3);  // 11 x ~700 + 289 x 3 = ~8600 rows: two slices
    seqs.push_back(pool.Make(RandomTokens(length[i] + 4, static_cast<int>(vocab), 900 + i)));
    prefill.push_back({i, 0, length[i], i % 50 == 0});
  }
  ForwardBatch batch = MakeBatch(seqs, prefill);
  EXPECT_TRUE(SameRows(all_rows(ladder->get(), batch), all_rows(pinned->get(), batch), vocab, 0))
      << "prefill";
  for (int rows : {1, 20, 100, 300}) {
    std::vector<Chunk> step;
    for (int i = 0; i < rows; ++i) {
      step.push_back({i, length[i], length[i] + 1, true});
      ++length[i];
    }
    batch = MakeBatch(seqs, step);
    EXPECT_TRUE(SameRows(all_rows(ladder->get(), batch), all_rows(pinned->get(), batch), vocab, 0))
        << "decode of " << rows << " rows";
  }
}

TEST_F(ModelTest, Qwen3_8bShapedWithSimtAttentionIsInvariant) {
  CudaRunnerOptions o = Qwen3_8bOptions();
  o.attention_kernel = CudaAttentionKernel::kSimt;
  auto runner = CudaModelRunner::CreateSynthetic(Qwen3_8bTwoLayers(), 3, o);
  ASSERT_TRUE(runner.ok()) << runner.status();
  CheckInvariance(runner->get(), 600, 15);
}

// --- Qwen3-MoE (kernels/cuda/moe.h): the invariance suite, graphs, the CPU reference, replay.

// Real Qwen3-30B-A3B shapes (hidden 2048, 32/4 heads x 128, 128 experts of width 768, 8 per
// token) with two layers.
ModelConfig Qwen3MoeTwoLayers() {
  ModelConfig config = *PresetConfig("qwen3-30b-a3b");
  config.num_layers = 2;
  return config;
}

// The CPU reference on a MoE model. Near-tied router probabilities may pick other experts under
// the two backends' roundings (bf16 GEMM inputs here, fp32 there), so the CPU runs with the GPU's
// routing forced (routing replay) and the logits are compared as for dense models; how often the
// CPU would have chosen otherwise is printed and bounded.
TEST_F(ModelTest, MoeSmallLogitsMatchTheCpuReferenceWithinBf16Tolerance) {
  const std::string dir = TempDir("cpu_ref_moe");
  RandomModelOptions write;
  write.preset = "moe-small";
  write.seed = 9;
  ASSERT_TRUE(WriteRandomModel(write, dir).ok());
  absl::StatusOr<std::unique_ptr<Checkpoint>> ckpt = Checkpoint::Open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  CudaRunnerOptions gpu_options = SmallOptions();
  gpu_options.kv_block_size = 16;
  gpu_options.attention_split_size = 64;
  auto gpu = CudaModelRunner::Create(**ckpt, gpu_options);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  auto cpu = CpuModelRunner::Create(**ckpt, CpuRunnerOptions{});
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  const int64_t vocab = (*gpu)->config().vocab_size;

  BlockPool pool(std::min((*gpu)->num_kv_blocks(), (*cpu)->num_kv_blocks()), 16);
  std::vector<Seq> seqs = {pool.Make(RandomTokens(200, static_cast<int>(vocab), 2)),
                           pool.Make(RandomTokens(37, static_cast<int>(vocab), 3))};
  ForwardBatch batch = MakeBatch(seqs, {{0, 0, 200, true}, {1, 0, 37, true}});
  std::vector<float> got, want;
  ASSERT_TRUE((*gpu)->ForwardToHost(batch, &got).ok());
  batch.return_routing = true;
  std::vector<std::vector<int32_t>> gpu_routing, cpu_routing, unused;
  ASSERT_TRUE((*gpu)->ForwardWithRouting(batch, nullptr, &gpu_routing).ok());
  std::vector<float> cpu_free;
  ASSERT_TRUE((*cpu)->ForwardWithRouting(batch, &cpu_free, &cpu_routing).ok());
  ASSERT_EQ(cpu_routing.size(), gpu_routing.size());
  int64_t ids = 0, differing = 0;
  for (size_t r = 0; r < gpu_routing.size(); ++r) {
    ASSERT_EQ(cpu_routing[r].size(), gpu_routing[r].size());
    for (size_t i = 0; i < gpu_routing[r].size(); ++i) {
      ++ids;
      differing += cpu_routing[r][i] != gpu_routing[r][i];
    }
  }
  ForwardBatch forced = batch;
  forced.return_routing = false;
  forced.forced_routing = gpu_routing;
  const absl::Status replayed = (*cpu)->ForwardWithRouting(forced, &want, &unused);
  ASSERT_TRUE(replayed.ok()) << replayed;
  ASSERT_EQ(got.size(), want.size());
  double sum_sq = 0.0, max_err = 0.0, sum_err = 0.0;
  int64_t argmax_agree = 0;
  const int64_t rows = static_cast<int64_t>(want.size()) / vocab;
  for (int64_t r = 0; r < rows; ++r) {
    int64_t best_got = 0, best_want = 0;
    for (int64_t i = 0; i < vocab; ++i) {
      const double g = got[r * vocab + i], w = want[r * vocab + i];
      sum_sq += w * w;
      max_err = std::max(max_err, std::fabs(g - w));
      sum_err += std::fabs(g - w);
      if (g > got[r * vocab + best_got]) best_got = i;
      if (w > want[r * vocab + best_want]) best_want = i;
    }
    argmax_agree += best_got == best_want;
  }
  const double rms = std::sqrt(sum_sq / want.size());
  std::printf(
      "[ vs cpu   ] moe-small (the GPU's routing replayed on the CPU): logits rms %.3f, max |err| "
      "%.4f, mean |err| %.5f, argmax agrees on %ld/%ld rows; the CPU alone chose %ld of %ld "
      "expert ids otherwise\n",
      rms, max_err, sum_err / want.size(), static_cast<long>(argmax_agree), static_cast<long>(rows),
      static_cast<long>(differing), static_cast<long>(ids));
  EXPECT_LT(max_err, 0.1 * rms);
  EXPECT_LT(sum_err / want.size(), 0.01 * rms);
  EXPECT_GE(argmax_agree, rows * 9 / 10);
  EXPECT_LE(differing, ids / 20) << "the backends' routings should differ only at near ties";
  std::filesystem::remove_all(dir);
}

TEST_F(ModelTest, MoeSmallModelRowsAreBatchAndChunkInvariant) {
  for (bool canonical : {false, true}) {
    SCOPED_TRACE(canonical ? "canonical K tree" : "fused row-parallel GEMMs");
    CudaRunnerOptions o = SmallOptions();
    o.canonical_k_tree = canonical;
    auto runner = CudaModelRunner::CreateSynthetic(*PresetConfig("moe-small"), 1, o);
    ASSERT_TRUE(runner.ok()) << runner.status();
    CheckInvariance(runner->get(), 300, 11);
  }
}

TEST_F(ModelTest, MoeSmallModelDecodeGraphsEqualEagerBitwise) {
  CheckGraphsMatchEager(*PresetConfig("moe-small"), SmallOptions(), 256, 700,
                        {1, 2, 3, 4, 5, 7, 13, 16, 17, 31, 32, 33, 63, 100, 129, 200, 255, 256});
}

TEST_F(ModelTest, Qwen3MoeShapedRowsAreBatchAndChunkInvariant) {
  CudaRunnerOptions o = Qwen3_8bOptions();
  o.max_batch_tokens = 8192;
  auto runner = CudaModelRunner::CreateSynthetic(Qwen3MoeTwoLayers(), 2, o);
  ASSERT_TRUE(runner.ok()) << runner.status();
  CheckInvariance(runner->get(), 1100, 12);
}

TEST_F(ModelTest, Qwen3MoeShapedDecodeGraphsEqualEagerBitwise) {
  CheckGraphsMatchEager(Qwen3MoeTwoLayers(), Qwen3_8bOptions(), 256, 1500,
                        {1, 2, 5, 8, 31, 64, 97, 200, 256});
}

// The expert and router bindings: a MoE checkpoint loaded from disk equals the synthetic model
// of its seed bitwise, and a runner of another seed updated with every served tensor of that
// checkpoint (by name, through UpdateWeights) becomes it, bitwise.
TEST_F(ModelTest, MoeCheckpointSyntheticAndUpdatedWeightsGiveTheSameBits) {
  const std::string dir = TempDir("moe_synthetic");
  RandomModelOptions write;
  write.preset = "moe-small";
  write.seed = 5;
  ASSERT_TRUE(WriteRandomModel(write, dir).ok());
  absl::StatusOr<std::unique_ptr<Checkpoint>> ckpt = Checkpoint::Open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  const ModelConfig config = *PresetConfig("moe-small");
  auto from_file = CudaModelRunner::Create(**ckpt, SmallOptions());
  ASSERT_TRUE(from_file.ok()) << from_file.status();
  auto synthetic = CudaModelRunner::CreateSynthetic(config, 5, SmallOptions());
  ASSERT_TRUE(synthetic.ok()) << synthetic.status();
  auto updated = CudaModelRunner::CreateSynthetic(config, 6, SmallOptions());
  ASSERT_TRUE(updated.ok()) << updated.status();

  const int64_t vocab = config.vocab_size;
  BlockPool pool((*from_file)->num_kv_blocks(), (*from_file)->kv_block_size());
  std::vector<Seq> seqs = {pool.Make(RandomTokens(100, static_cast<int>(vocab), 1))};
  const std::vector<Chunk> chunks = {{0, 0, 100, true}};
  const std::vector<float> want = RowsOf(from_file->get(), seqs, chunks, 0);
  EXPECT_TRUE(SameRows(RowsOf(synthetic->get(), seqs, chunks, 0), want, vocab, 0))
      << "synthetic vs checkpoint";
  const std::vector<float> before = RowsOf(updated->get(), seqs, chunks, 0);
  EXPECT_FALSE(SameRows(before, want, vocab, 0)) << "seeds 5 and 6 gave the same logits";

  std::vector<HostTensorView> views;
  int experts = 0;
  for (const WeightSpec& spec : (*updated)->weight_specs()) {
    const TensorView* t = (*ckpt)->Find(spec.name);
    ASSERT_NE(t, nullptr) << spec.name;
    views.emplace_back(spec.name, t->dtype, t->shape, t->data, t->nbytes);
    experts += spec.name.find(".mlp.experts.") != std::string::npos;
  }
  EXPECT_EQ(experts, 3 * config.num_experts * config.NumMoeLayers());
  const absl::Status s = (*updated)->UpdateWeights(views);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_TRUE(SameRows(RowsOf(updated->get(), seqs, chunks, 0), want, vocab, 0))
      << "updated by name vs checkpoint";
  std::filesystem::remove_all(dir);
}

// Routing replay: the routing a Forward returns, forced back, gives the same logits bitwise and
// is returned unchanged; a row's routing is the same in prefill and in decode; another forced
// routing changes the logits; bad routings are refused before anything runs.
TEST_F(ModelTest, MoeRoutingReplayGivesBackTheLogitsOfTheRoutingItReturned) {
  const ModelConfig config = *PresetConfig("moe-small");
  auto made = CudaModelRunner::CreateSynthetic(config, 4, SmallOptions());
  ASSERT_TRUE(made.ok()) << made.status();
  CudaModelRunner& runner = **made;
  ASSERT_TRUE(runner.SupportsRoutingReplay());
  const int64_t vocab = config.vocab_size;
  const size_t size = static_cast<size_t>(config.RoutingSize());
  BlockPool pool(runner.num_kv_blocks(), runner.kv_block_size());
  const int len = 90;
  std::vector<Seq> seqs = {pool.Make(RandomTokens(len, static_cast<int>(vocab), 31)),
                           pool.Make(RandomTokens(40, static_cast<int>(vocab), 32))};
  ForwardBatch batch = MakeBatch(seqs, {{0, 0, len, true}, {1, 0, 40, false}});
  batch.return_routing = true;
  std::vector<std::vector<int32_t>> chosen;
  std::vector<float> chosen_logits, plain_logits, replayed_logits;
  ASSERT_TRUE(runner.ForwardWithRouting(batch, &chosen_logits, &chosen).ok());
  ASSERT_TRUE(
      runner.ForwardToHost(MakeBatch(seqs, {{0, 0, len, true}, {1, 0, 40, false}}), &plain_logits)
          .ok());
  EXPECT_TRUE(SameRows(chosen_logits, plain_logits, vocab, 0))
      << "returning the routing changed the logits";
  ASSERT_EQ(chosen.size(), batch.logit_rows.size());
  for (const auto& r : chosen) ASSERT_EQ(r.size(), size);
  // Forced to what it chose: the same routing back, and the same logits -- compared through
  // the device's scoring of every row (logprob of a fixed token and the top 20, bitwise).
  ForwardBatch forced = batch;
  forced.forced_routing = chosen;
  std::vector<std::vector<int32_t>> back;
  ASSERT_TRUE(runner.ForwardWithRouting(forced, &replayed_logits, &back).ok());
  EXPECT_EQ(back, chosen);
  EXPECT_TRUE(SameRows(replayed_logits, plain_logits, vocab, 0)) << "the replayed routing";
  ASSERT_TRUE(runner.ForwardWithRouting(forced, nullptr, &back).ok());  // logits on the GPU
  SamplingParams scoring;
  scoring.top_logprobs = 20;
  std::vector<LogitsRowTask> tasks(batch.logit_rows.size());
  for (size_t i = 0; i < tasks.size(); ++i) {
    tasks[i].params = &scoring;
    tasks[i].position = batch.positions[batch.logit_rows[i]] + 1;
    tasks[i].score_token = static_cast<int32_t>((i * 37) % vocab);
  }
  std::vector<SampleResult> replayed, plain;
  ASSERT_TRUE(runner.ProcessLogits(tasks, {}, &replayed).ok());
  ASSERT_TRUE(
      runner.Forward(MakeBatch(seqs, {{0, 0, len, true}, {1, 0, 40, false}}), nullptr).ok());
  ASSERT_TRUE(runner.ProcessLogits(tasks, {}, &plain).ok());
  ASSERT_EQ(replayed.size(), plain.size());
  for (size_t i = 0; i < tasks.size(); ++i) {
    EXPECT_EQ(0, std::memcmp(&replayed[i].logprob, &plain[i].logprob, 4)) << "row " << i;
    ASSERT_EQ(replayed[i].top.size(), plain[i].top.size());
    for (size_t j = 0; j < plain[i].top.size(); ++j) {
      EXPECT_EQ(replayed[i].top[j].token, plain[i].top[j].token) << "row " << i << " top " << j;
      EXPECT_EQ(0, std::memcmp(&replayed[i].top[j].logprob, &plain[i].top[j].logprob, 4))
          << "row " << i << " top " << j;
    }
  }

  // Decode: the last position alone after a prefill of the rest routes as in the prefill.
  {
    std::vector<Seq> dseqs = {pool.Make(seqs[0].tokens)};
    ASSERT_TRUE(runner.Forward(MakeBatch(dseqs, {{0, 0, len - 1, false}}), nullptr).ok());
    ForwardBatch step = MakeBatch(dseqs, {{0, len - 1, len, true}});
    step.return_routing = true;
    std::vector<std::vector<int32_t>> decoded;
    ASSERT_TRUE(runner.ForwardWithRouting(step, nullptr, &decoded).ok());
    ASSERT_EQ(decoded.size(), 1u);
    EXPECT_EQ(decoded[0], chosen[len - 1]) << "the last token's routing, decode vs prefill";
  }

  // Another routing for the first row comes back as forced; the unforced row chooses as before.
  {
    ForwardBatch other = batch;
    other.forced_routing.assign(batch.logit_rows.size(), {});
    std::vector<int32_t> ids(size);
    for (size_t i = 0; i < size; ++i) {
      // Per layer the experts the row did not choose first (k <= E / 2 for moe-small).
      const size_t layer = i / config.num_experts_per_tok, j = i % config.num_experts_per_tok;
      ids[i] = (chosen[0][layer * config.num_experts_per_tok] + 1 + static_cast<int32_t>(j)) %
               config.num_experts;
    }
    other.forced_routing[0] = ids;
    std::vector<std::vector<int32_t>> routed;
    ASSERT_TRUE(runner.ForwardWithRouting(other, nullptr, &routed).ok());
    EXPECT_EQ(routed[0], ids);
    // Seq 1's row does not attend to seq 0: it chooses as before (seq 0's later rows see the
    // forced row's K/V and may route otherwise past the first MoE layer).
    EXPECT_EQ(routed.back(), chosen.back()) << "an unforced row of another sequence";
  }

  // Refused: wrong size, an id out of range, an id twice in a layer, a count of rows that is
  // not the batch's.
  auto refused = [&](std::vector<std::vector<int32_t>> routing, const char* what) {
    ForwardBatch bad = batch;
    bad.forced_routing = std::move(routing);
    std::vector<std::vector<int32_t>> out;
    const absl::Status s = runner.ForwardWithRouting(bad, nullptr, &out);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << what << ": " << s;
  };
  std::vector<std::vector<int32_t>> bad = chosen;
  bad[0].pop_back();
  refused(bad, "short routing");
  bad = chosen;
  bad[0][0] = config.num_experts;
  refused(bad, "id out of range");
  bad = chosen;
  bad[0][1] = bad[0][0];
  refused(bad, "id twice in a layer");
  refused({chosen[0]}, "one routing for two rows");
  // Asking for the routing back through plain Forward is refused, not ignored.
  EXPECT_EQ(runner.Forward(batch, nullptr).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace rollout
