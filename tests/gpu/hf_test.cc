// Both backends against an independent implementation: Hugging Face transformers in fp32 on the
// same bf16 weights (tests/gpu/make_hf_reference.py writes the model and the reference: plain
// Qwen3, a Llama 3.1-style model with llama3 RoPE scaling, a Qwen3 with YaRN, a Qwen3-MoE).
// Skipped unless ROLLOUT_HF_REFERENCE names that script's output directories, separated by ':'.
// MoE: a row where transformers' k-th and (k+1)-th router probabilities nearly tie at some
// layer may route differently in other arithmetic; such rows are near-ties for every check
// below, and where the backend returns its routing, it must equal transformers' everywhere else.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"
#include "model/rope.h"
#include "nlohmann/json.hpp"
#include "runner/cpu/cpu_model_runner.h"
#include "runner/cuda/cuda_model_runner.h"
#include "tests/gpu/gpu_test_util.h"

namespace rollout {
namespace {

struct Reference {
  std::string arch;
  int64_t vocab = 0;
  std::vector<std::vector<int32_t>> prompts, greedy;
  std::vector<std::vector<float>> margins;
  std::vector<std::vector<float>> logits;  // per prompt: [prompt + greedy, vocab]
  std::vector<double> inv_freq;            // the rotary embedding's (float32 in transformers)
  double attention_scaling = 1.0;
  // MoE: per prompt, per row of prompt + greedy, per MoE layer: transformers' top-k ids and the
  // gap between its k-th and (k+1)-th router probability. Empty for dense models.
  std::vector<std::vector<std::vector<std::vector<int32_t>>>> routing;
  std::vector<std::vector<std::vector<float>>> routing_gaps;
  bool fused_model = false;  // model_fused/ holds the weights with transformers 5's fused experts

  // Row `row` of prompt `i` has a router near-tie at some MoE layer.
  bool RoutingTie(size_t i, size_t row) const {
    if (routing_gaps.empty()) return false;
    for (float gap : routing_gaps[i][row]) {
      if (gap < kRoutingTieGap) return true;
    }
    return false;
  }
  static constexpr float kRoutingTieGap = 5e-3f;
};

// One forward of a backend: logits of batch.logit_rows, on the host.
struct Backend {
  std::function<absl::Status(const ForwardBatch&, std::vector<float>*)> forward;
  // A forward that also returns each logits row's routing; null when the backend has no
  // routing replay (then routing is not compared).
  std::function<absl::Status(const ForwardBatch&, std::vector<float>*,
                             std::vector<std::vector<int32_t>>*)>
      forward_with_routing;
  int kv_block_size = 16;
  ModelConfig config;
  // The share of (row, MoE layer) routings away from a near-tie whose experts must be
  // transformers'. The fp32 CPU: all. bf16 activations (cuda) drift from transformers' fp32
  // reference layer by layer, so a gap just above the near-tie bound can flip: measured on the
  // H200, 1 of 3090 (prompt 5, row 467, layer 2).
  double routing_agreement = 1.0;
};

std::vector<std::string> ReferenceDirs() {
  const char* dirs = std::getenv("ROLLOUT_HF_REFERENCE");
  if (dirs == nullptr) return {};
  return absl::StrSplit(dirs, ':', absl::SkipEmpty());
}

// (reference directory, backend) pairs: "cpu" or "cuda".
class HfTest : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    if (!gpu_test::HaveGpu()) GTEST_SKIP() << "no CUDA device";
    if (ReferenceDirs().empty()) GTEST_SKIP() << "ROLLOUT_HF_REFERENCE is not set";
  }

  // Loads `dir`'s reference and a runner of the backend under test on its model.
  void Load(const std::string& dir) {
    std::ifstream in(dir + "/reference.json");
    ASSERT_TRUE(in.good()) << dir << "/reference.json";
    const nlohmann::json j = nlohmann::json::parse(in);
    ref_ = Reference();
    ref_.arch = j.value("arch", "qwen3");
    ref_.vocab = j["vocab"];
    ref_.prompts = j["prompts"].get<std::vector<std::vector<int32_t>>>();
    ref_.greedy = j["greedy"].get<std::vector<std::vector<int32_t>>>();
    ref_.margins = j["margins"].get<std::vector<std::vector<float>>>();
    if (j.contains("inv_freq")) ref_.inv_freq = j["inv_freq"].get<std::vector<double>>();
    ref_.attention_scaling = j.value("attention_scaling", 1.0);
    if (j.contains("routing") && !j["routing"].empty()) {
      ref_.routing = j["routing"].get<decltype(ref_.routing)>();
      ref_.routing_gaps = j["routing_gaps"].get<decltype(ref_.routing_gaps)>();
    }
    ref_.fused_model = j.value("fused_model", false);
    for (size_t i = 0; i < ref_.prompts.size(); ++i) {
      const size_t rows = ref_.prompts[i].size() + ref_.greedy[i].size();
      std::vector<float> l(rows * ref_.vocab);
      std::ifstream f(dir + "/" + j["logits_files"][i].get<std::string>(), std::ios::binary);
      f.read(reinterpret_cast<char*>(l.data()), l.size() * sizeof(float));
      ASSERT_TRUE(f.good()) << "reading logits of prompt " << i;
      ref_.logits.push_back(std::move(l));
    }
    checkpoint_.reset();
    cpu_.reset();
    cuda_.reset();
    auto ckpt = Checkpoint::Open(dir + "/model");
    ASSERT_TRUE(ckpt.ok()) << ckpt.status();
    checkpoint_ = *std::move(ckpt);
    if (std::string(GetParam()) == "cpu") {
      CpuRunnerOptions o;
      o.kv_cache_bytes = 256ll << 20;
      o.max_batch_tokens = 1024;
      auto runner = CpuModelRunner::Create(*checkpoint_, o);
      ASSERT_TRUE(runner.ok()) << runner.status();
      cpu_ = *std::move(runner);
      backend_ = {[this](const ForwardBatch& b, std::vector<float>* l) {
                    return cpu_->Forward(b, l);
                  },
                  nullptr, cpu_->kv_block_size(), cpu_->config()};
      if (cpu_->SupportsRoutingReplay()) {
        backend_.forward_with_routing = [this](const ForwardBatch& b, std::vector<float>* l,
                                               std::vector<std::vector<int32_t>>* r) {
          return cpu_->ForwardWithRouting(b, l, r);
        };
      }
    } else {
      CudaRunnerOptions o;
      o.kv_cache_bytes = 256ll << 20;
      o.max_batch_tokens = 1024;
      auto runner = CudaModelRunner::Create(*checkpoint_, o);
      ASSERT_TRUE(runner.ok()) << runner.status();
      cuda_ = *std::move(runner);
      backend_ = {[this](const ForwardBatch& b, std::vector<float>* l) {
                    return cuda_->ForwardToHost(b, l);
                  },
                  nullptr, cuda_->kv_block_size(), cuda_->config(), 0.99};
      if (cuda_->SupportsRoutingReplay()) {
        backend_.forward_with_routing = [this](const ForwardBatch& b, std::vector<float>* l,
                                               std::vector<std::vector<int32_t>>* r) {
          return cuda_->ForwardWithRouting(b, l, r);
        };
      }
    }
  }

  // One sequence in blocks [0, n): KV of earlier steps stays where the table says.
  ForwardBatch Batch(const std::vector<int32_t>& tokens, int begin, int end, bool all_logits) {
    ForwardBatch b;
    const int bs = backend_.kv_block_size;
    std::vector<int32_t> table;
    for (int i = 0; i * bs < end; ++i) table.push_back(i);
    b.block_tables.push_back(table);
    for (int p = begin; p < end; ++p) {
      if (all_logits || p == end - 1) b.logit_rows.push_back(p - begin);
      b.token_ids.push_back(tokens[p]);
      b.positions.push_back(p);
      b.token_seq.push_back(0);
    }
    return b;
  }

  void CheckAgainst(const std::string& dir);

  Reference ref_;
  std::unique_ptr<Checkpoint> checkpoint_;
  std::unique_ptr<CpuModelRunner> cpu_;
  std::unique_ptr<CudaModelRunner> cuda_;
  Backend backend_;
};

int32_t Argmax(const float* row, int64_t n) {
  int64_t best = 0;
  for (int64_t i = 1; i < n; ++i) {
    if (row[i] > row[best]) best = i;
  }
  return static_cast<int32_t>(best);
}

// Teacher-forced logits of every position of prompt + reference continuation: checks them
// against the reference, returns the largest error seen (used below to tell near-ties from real
// divergence) and, per prompt, our argmax at each generated position given the reference prefix.
double MaxLogitError(const Backend& backend, const Reference& ref, std::vector<double>* rms_out,
                     std::vector<std::vector<int32_t>>* forced_argmax) {
  double worst = 0.0;
  for (size_t i = 0; i < ref.prompts.size(); ++i) {
    std::vector<int32_t> seq = ref.prompts[i];
    seq.insert(seq.end(), ref.greedy[i].begin(), ref.greedy[i].end());
    ForwardBatch b;
    std::vector<int32_t> table;
    for (int k = 0; k * backend.kv_block_size < static_cast<int>(seq.size()); ++k) {
      table.push_back(k);
    }
    b.block_tables.push_back(table);
    for (size_t p = 0; p < seq.size(); ++p) {
      b.logit_rows.push_back(static_cast<int32_t>(p));
      b.token_ids.push_back(seq[p]);
      b.positions.push_back(static_cast<int32_t>(p));
      b.token_seq.push_back(0);
    }
    std::vector<float> got;
    const bool check_routing = !ref.routing.empty() && backend.forward_with_routing != nullptr;
    if (check_routing) {
      b.return_routing = true;
      std::vector<std::vector<int32_t>> routing;
      EXPECT_TRUE(backend.forward_with_routing(b, &got, &routing).ok());
      // Every (row, MoE layer) away from a near-tie picks transformers' experts (as a set: the
      // rank order inside the top-k is only the order they are summed in, and two of them can
      // be near-tied without the k-th and the (k+1)-th being so).
      int compared = 0, agree = 0;
      const int32_t k = backend.config.num_experts_per_tok;
      for (size_t row = 0; row < routing.size() && row < ref.routing[i].size(); ++row) {
        for (size_t layer = 0; layer < ref.routing[i][row].size(); ++layer) {
          std::vector<int32_t> ours(routing[row].begin() + layer * k,
                                    routing[row].begin() + (layer + 1) * k);
          std::vector<int32_t> theirs = ref.routing[i][row][layer];
          if (ref.routing_gaps[i][row][layer] < Reference::kRoutingTieGap) continue;
          std::sort(ours.begin(), ours.end());
          std::sort(theirs.begin(), theirs.end());
          ++compared;
          agree += ours == theirs;
          if (ours != theirs) {
            std::printf("[ routing  ] prompt %zu row %zu MoE layer %zu: experts %s, transformers' "
                        "%s (gap %.4f)\n",
                        i, row, layer, absl::StrJoin(ours, ",").c_str(),
                        absl::StrJoin(theirs, ",").c_str(), ref.routing_gaps[i][row][layer]);
          }
        }
      }
      std::printf("[ routing  ] prompt %zu: %d of %d (row, MoE layer) routings choose "
                  "transformers' experts (near-ties left out)\n",
                  i, agree, compared);
      if (backend.routing_agreement >= 1.0) {
        EXPECT_EQ(agree, compared) << "prompt " << i;
      } else {
        EXPECT_GE(agree, backend.routing_agreement * compared) << "prompt " << i;
      }
    } else {
      EXPECT_TRUE(backend.forward(b, &got).ok());
    }
    const std::vector<float>& want = ref.logits[i];
    forced_argmax->emplace_back();
    for (size_t step = 0; step < ref.greedy[i].size(); ++step) {
      const size_t row = ref.prompts[i].size() - 1 + step;
      forced_argmax->back().push_back(Argmax(&got[row * ref.vocab], ref.vocab));
    }
    double sum_sq = 0.0, max_err = 0.0, sum_err = 0.0;
    int tie_rows = 0;
    for (size_t k = 0; k < want.size(); ++k) {
      sum_sq += double(want[k]) * want[k];
      const double err = std::fabs(double(got[k]) - want[k]);
      const bool tie = ref.RoutingTie(i, k / ref.vocab);  // may route differently: not in max
      if (!tie) max_err = std::max(max_err, err);
      tie_rows += tie && k % ref.vocab == 0;
      sum_err += err;
    }
    if (!ref.routing.empty()) {
      std::printf("[ vs hf    ] prompt %zu: %d of %zu rows at a router near-tie (gap < %g)\n", i,
                  tie_rows, seq.size(), Reference::kRoutingTieGap);
    }
    const double rms = std::sqrt(sum_sq / want.size());
    rms_out->push_back(rms);
    std::printf(
        "[ vs hf    ] prompt %zu (%zu + %zu tokens): logits rms %.3f, max |err| %.4f, "
        "mean |err| %.5f\n",
        i, ref.prompts[i].size(), ref.greedy[i].size(), rms, max_err, sum_err / want.size());
    EXPECT_LT(max_err, 0.1 * rms) << "prompt " << i;
    EXPECT_LT(sum_err / want.size(), 0.01 * rms) << "prompt " << i;
    worst = std::max(worst, max_err);
  }
  return worst;
}

// The RoPE the engine computes from the config transformers saved is the one transformers'
// rotary embedding uses (its inverse frequencies are float32).
void CheckRope(const ModelConfig& c, const Reference& ref) {
  if (ref.inv_freq.empty()) return;  // a reference of an older script
  const RopeFrequencies f = ComputeRopeFrequencies(c.rope_scaling, c.rope_theta, c.head_dim);
  ASSERT_EQ(f.inv_freq.size(), ref.inv_freq.size());
  for (size_t i = 0; i < f.inv_freq.size(); ++i) {
    EXPECT_NEAR(f.inv_freq[i], ref.inv_freq[i], 1e-5 * ref.inv_freq[i]) << "inv_freq " << i;
  }
  EXPECT_NEAR(f.attention_factor, ref.attention_scaling, 1e-5);
  std::printf("[ rope     ] %s: %s matches transformers' inv_freq and attention scaling %.6f\n",
              ref.arch.c_str(), RopeTypeName(c.rope_scaling.type), ref.attention_scaling);
}

void HfTest::CheckAgainst(const std::string& dir) {
  Load(dir);
  if (HasFatalFailure()) return;
  std::printf("[ model    ] %s (%s) on the %s backend\n", dir.c_str(), ref_.arch.c_str(),
              GetParam());
  CheckRope(backend_.config, ref_);
  std::vector<double> rms;
  std::vector<std::vector<int32_t>> forced;
  const double max_err = MaxLogitError(backend_, ref_, &rms, &forced);
  // A reference step whose top-1 / top-2 margin is within twice our largest logit error is a
  // near-tie: bf16 arithmetic may pick either token there, and only there.
  const double tie = 2.0 * max_err;

  // Teacher-forced: given transformers' prefix, our next token is transformers' at every step
  // that is not a near-tie.
  int forced_steps = 0, forced_agree = 0;
  for (size_t i = 0; i < ref_.prompts.size(); ++i) {
    for (size_t step = 0; step < ref_.greedy[i].size(); ++step) {
      ++forced_steps;
      if (forced[i][step] == ref_.greedy[i][step]) {
        ++forced_agree;
      } else if (!ref_.RoutingTie(i, ref_.prompts[i].size() - 1 + step)) {
        EXPECT_LE(ref_.margins[i][step], tie)
            << "prompt " << i << " step " << step << ": teacher-forced argmax " << forced[i][step]
            << " vs transformers' " << ref_.greedy[i][step];
      }
    }
  }
  std::printf(
      "[ forced   ] teacher-forced greedy agrees on %d of %d steps (near-tie margin %.3f)\n",
      forced_agree, forced_steps, tie);
  EXPECT_GE(forced_agree * 100, forced_steps * 97);

  // Free-running: our own greedy loop (prefill the prompt, then one token per step) matches
  // transformers' continuation until a near-tie, and for at least 32 tokens where none occurs.
  int full_matches = 0;
  for (size_t i = 0; i < ref_.prompts.size(); ++i) {
    std::vector<int32_t> seq = ref_.prompts[i];
    const int n = static_cast<int>(seq.size());
    const int steps = static_cast<int>(ref_.greedy[i].size());
    std::vector<float> logits;
    ASSERT_TRUE(backend_.forward(Batch(seq, 0, n, false), &logits).ok());
    for (int s = 0; s < steps; ++s) {
      seq.push_back(Argmax(logits.data(), ref_.vocab));
      if (s + 1 < steps) {
        const int len = static_cast<int>(seq.size());
        ASSERT_TRUE(backend_.forward(Batch(seq, len - 1, len, false), &logits).ok());
      }
    }
    int agree = 0;
    while (agree < steps && seq[n + agree] == ref_.greedy[i][agree]) ++agree;
    full_matches += agree == steps;
    std::printf("[ greedy   ] prompt %zu: %d of %d tokens equal transformers'", i, agree, steps);
    if (agree < steps) std::printf(" (reference margin there: %.4f)", ref_.margins[i][agree]);
    std::printf("\n");
    if (agree < 32 && !ref_.RoutingTie(i, n - 1 + agree)) {
      EXPECT_LE(ref_.margins[i][agree], tie)
          << "prompt " << i << " diverges at token " << agree << ", not a near-tie";
    }
  }
  EXPECT_GE(full_matches * 2, static_cast<int>(ref_.prompts.size()))
      << "fewer than half of the prompts match all their tokens";

  // The same weights with transformers 5's fused experts (model_fused/) serve the same bits.
  if (ref_.fused_model && std::string(GetParam()) == "cpu") {
    auto fused = Checkpoint::Open(dir + "/model_fused");
    ASSERT_TRUE(fused.ok()) << fused.status();
    CpuRunnerOptions o;
    o.kv_cache_bytes = 64ll << 20;
    o.max_batch_tokens = 1024;
    auto runner = CpuModelRunner::Create(**fused, o);
    ASSERT_TRUE(runner.ok()) << runner.status();
    const std::vector<int32_t>& prompt = ref_.prompts.back();
    const int n = static_cast<int>(prompt.size());
    std::vector<float> a, b;
    ASSERT_TRUE((*runner)->Forward(Batch(prompt, 0, n, true), &a).ok());
    ASSERT_TRUE(backend_.forward(Batch(prompt, 0, n, true), &b).ok());
    EXPECT_TRUE(a == b) << "the fused-expert checkpoint serves other logits";
    std::printf("[ fused    ] model_fused/ (transformers' in-memory expert layout) serves the "
                "same logits\n");
  }
}

TEST_P(HfTest, LogitsMatchTransformersAndGreedyContinuationsAgree) {
  for (const std::string& dir : ReferenceDirs()) {
    SCOPED_TRACE(dir);
    CheckAgainst(dir);
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, HfTest, ::testing::Values("cpu", "cuda"),
                         [](const ::testing::TestParamInfo<const char*>& info) {
                           return std::string(info.param);
                         });

}  // namespace
}  // namespace rollout
