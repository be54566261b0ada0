// rollout-bench: the offline throughput benchmark of docs/benchmarks.md on the CUDA backend.
//
//   rollout-bench [--num_requests=256 --input_len=1024 --output_len=1024]
//   rollout-bench --workload=rl [--rl_prompts=64 --rl_samples=8 --input_len=1024]
//
// 1. Measures this GPU's ceilings: device-to-device copy bandwidth and a bf16 GEMM rate
//    (8192^3, cuBLASLt with a workspace), and computes the floor of docs/benchmarks.md from them.
// 2. Batch-1 decode ms/token vs its floor (weights read once per token).
// 3. A per-kernel profile of one prefill step (max_batch_tokens) and one decode step (the whole
//    batch at the mean decode context), CUDA events around every kernel.
// 4. End to end through the Engine (synthetic Qwen3-8B weights generated on the GPU): random
//    prompts, ignore_eos, fixed max_new_tokens; seconds, tokens/s, time in prefill and decode
//    steps and on the host, and the ratio to the floor; preemptions, recomputed tokens and the
//    peak device memory. A run in which any sample ended short or aborted has failed: it says
//    so, prints no RESULT line and exits 1.
//    --workload=rl: the RL-shaped workload (bench/rollout_workload.h: prompts x samples sharing
//    each prompt, long-tailed output lengths ending on a stop token), with its oracle floor.
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "bench/check_cuda.h"
#include "bench/device_rates.h"
#include "bench/rollout_floor.h"
#include "bench/rollout_workload.h"
#include "bench/timed_runner.h"
#include "common/command_line.h"
#include "common/thread_pool.h"
#include "engine/engine.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/event_timer.h"
#include "kernels/cuda/tensor_parallel.h"
#include "model/random_model.h"
#include "runner/cuda/cuda_model_runner.h"
#include "runner/host_logits.h"

ABSL_FLAG(int32_t, num_requests, 256, "requests in the end-to-end run");
ABSL_FLAG(int32_t, input_len, 1024, "prompt tokens per request");
ABSL_FLAG(int32_t, output_len, 1024, "generated tokens per request (ignore_eos)");
ABSL_FLAG(float, temperature, 1.0f, "sampling temperature (0 = greedy)");
ABSL_FLAG(int32_t, max_running, 256, "engine max_running_samples");
ABSL_FLAG(int32_t, max_batch_tokens, 16384, "engine max_batch_tokens (the cuda server's default)");
ABSL_FLAG(std::string, preset, "qwen3-8b", "model shape (synthetic weights)");
ABSL_FLAG(int32_t, num_layers, 0, "override the preset's layer count (0: keep)");
ABSL_FLAG(int64_t, gemm_pin_m, 256,
          "m at which each weight shape's GEMM algorithm is pinned (<= 0: no-workspace heuristic "
          "per m)");
ABSL_FLAG(bool, gemm_ladder, true,
          "pinned GEMMs also run faster algorithms admitted for ranges of m by a same-bits probe");
ABSL_FLAG(bool, gemm_hand_kernels, true,
          "the GEMM ladder also offers the hand-written small-m kernel (m <= 256), admitted by the "
          "same probe");
ABSL_FLAG(int32_t, attention_split_size, 256,
          "attention split size in tokens (part of a row's arithmetic: other values, other bits)");
ABSL_FLAG(std::string, attention, "mma", "attention kernel: mma (tensor cores) or simt");
ABSL_FLAG(bool, cuda_graphs, true, "replay decode steps as CUDA graphs (padded batch buckets)");
ABSL_FLAG(bool, shared_prefix_attention, true,
          "decode tokens over the same KV pages (the samples of a request over their prompt) read "
          "them once per attention block (same bits)");
ABSL_FLAG(bool, decode_lookahead, true,
          "the engine launches decode step N + 1 before step N's results (EngineOptions)");
ABSL_FLAG(bool, tp_invariant, true,
          "o_proj/down_proj by the canonical K tree (the server's default: tp 1 = tp 2, 4, 8); "
          "false: one fused GEMM");
ABSL_FLAG(int32_t, tp, 1,
          "tensor-parallel degree (1, 2, 4, 8): ranks as streams of GPU 0, or one GPU each with "
          "--cuda_devices (then the floor is that many GPUs', all-gathers at the measured peer "
          "copy rate)");
ABSL_FLAG(std::vector<std::string>, cuda_devices, {},
          "one GPU per rank, e.g. 0,1 for --tp 2 (through NCCL: libnccl.so.2 must load, or "
          "--nccl_library); empty: every rank on GPU 0");
ABSL_FLAG(std::string, nccl_library, "",
          "NCCL library path for --cuda_devices (\"\": libnccl.so.2)");
ABSL_FLAG(bool, e2e, true, "run the end-to-end engine benchmark");
ABSL_FLAG(int32_t, e2e_timeout_s, 0,
          "stop waiting for the end-to-end run after this long and "
          "report what finished (0: wait for all)");
ABSL_FLAG(bool, replay, true,
          "replay the workload's steps on the runner alone (no engine, "
          "logits left on the GPU): the device time of the forward passes");
ABSL_FLAG(int32_t, batch1_tokens, 128, "decode steps timed at batch 1 (0: skip)");
ABSL_FLAG(std::string, admission, "estimate",
          "engine admission policy: estimate (the server's default), reserve or optimistic");
ABSL_FLAG(std::string, workload, "fixed",
          "fixed: num_requests x input_len/output_len, ignore_eos; rl: rl_prompts requests of "
          "rl_samples samples each, output lengths long-tailed (median rl_median, at most "
          "output_len) ending on a stop token");
ABSL_FLAG(int32_t, rl_prompts, 64, "--workload=rl: prompts (one request each)");
ABSL_FLAG(int32_t, rl_samples, 8, "--workload=rl: samples per prompt");
ABSL_FLAG(int32_t, rl_median, 2048, "--workload=rl: median output length");

namespace rollout {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

void Check(const absl::Status& s) {
  if (!s.ok()) {
    std::fprintf(stderr, "forward failed: %s\n", s.ToString().c_str());
    std::exit(1);
  }
}

// A batch of `seqs` sequences, each with blocks [i * per_seq, (i + 1) * per_seq), taking tokens
// [begin, end) of each (same range for all).
ForwardBatch SyntheticBatch(int seqs, int begin, int end, int block_size, int vocab,
                            std::mt19937_64* rng) {
  ForwardBatch b;
  const int per_seq = (end + block_size - 1) / block_size;
  for (int s = 0; s < seqs; ++s) {
    std::vector<int32_t> table(per_seq);
    for (int i = 0; i < per_seq; ++i) table[i] = s * per_seq + i;
    b.block_tables.push_back(std::move(table));
    for (int p = begin; p < end; ++p) {
      b.token_ids.push_back(static_cast<int32_t>((*rng)() % vocab));
      b.positions.push_back(p);
      b.token_seq.push_back(s);
    }
    b.logit_rows.push_back(static_cast<int32_t>(b.token_ids.size()) - 1);
  }
  return b;
}

void PrintProfile(const char* title, const CudaForwardProfile& p, int64_t tokens) {
  double total = 0;
  for (double ms : p.ms) total += ms;
  std::printf("\n%s: %.2f ms per step (%ld steps profiled, %ld tokens each)\n", title,
              total / std::max<int64_t>(1, p.forwards), static_cast<long>(p.forwards),
              static_cast<long>(tokens));
  for (size_t i = 0; i < p.names.size(); ++i) {
    if (p.ms[i] <= 0) continue;
    std::printf("  %-24s %9.3f ms  %5.1f%%\n", p.names[i].c_str(),
                p.ms[i] / std::max<int64_t>(1, p.forwards), 100.0 * p.ms[i] / total);
  }
}

// The workload's forward passes without the engine: all prompts prefilled in chunks of
// max_batch_tokens (cut at split multiples), then output_len - 1 decode steps of the whole batch.
// Logits are computed but stay on the GPU. Returns the seconds, or -1 when the KV pool cannot
// hold the batch.
double ReplayDeviceOnly(CudaModelRunner* runner, int requests, int in, int out, int budget,
                        std::mt19937_64* rng) {
  const int bs = runner->kv_block_size(), split = runner->attention_split_size();
  const int vocab = runner->config().vocab_size;
  const int per_seq = (in + out + bs - 1) / bs;
  if (static_cast<int64_t>(requests) * per_seq > runner->num_kv_blocks()) {
    std::printf("\nreplay skipped: %d sequences x %d blocks exceed the pool\n", requests, per_seq);
    return -1.0;
  }
  std::vector<std::vector<int32_t>> tables(requests), tokens(requests);
  for (int r = 0; r < requests; ++r) {
    for (int i = 0; i < per_seq; ++i) tables[r].push_back(r * per_seq + i);
    tokens[r] = RandomPrompt(in + out, vocab, rng);
  }
  // Prefill: chunks [begin, end) of request r, packed into steps of at most `budget` tokens.
  const auto t0 = Clock::now();
  int prefill_steps = 0;
  int r = 0, begin = 0;
  while (r < requests) {
    ForwardBatch b;
    int room = budget;
    while (r < requests && room > 0) {
      int end = std::min(in, begin + room);
      if (end < in) end = begin + (end - begin) / split * split;  // cut at a split multiple
      if (end <= begin) break;
      b.block_tables.push_back(tables[r]);
      for (int p = begin; p < end; ++p) {
        b.token_ids.push_back(tokens[r][p]);
        b.positions.push_back(p);
        b.token_seq.push_back(static_cast<int32_t>(b.block_tables.size()) - 1);
      }
      if (end == in) b.logit_rows.push_back(static_cast<int32_t>(b.token_ids.size()) - 1);
      room -= end - begin;
      begin = end;
      if (begin == in) {
        ++r;
        begin = 0;
      }
    }
    Check(runner->Forward(b, nullptr));
    ++prefill_steps;
  }
  const auto t1 = Clock::now();
  ForwardBatch d;
  d.block_tables = tables;
  for (int q = 0; q < requests; ++q) {
    d.token_ids.push_back(0);
    d.positions.push_back(0);
    d.token_seq.push_back(q);
    d.logit_rows.push_back(q);
  }
  double report_at = 10.0;
  for (int k = 1; k < out; ++k) {
    for (int q = 0; q < requests; ++q) {
      d.token_ids[q] = tokens[q][in + k - 1];
      d.positions[q] = in + k - 1;
    }
    Check(runner->Forward(d, nullptr));
    if (Seconds(t1, Clock::now()) > report_at) {
      std::printf("  replay: decode step %d/%d, %.1f s\n", k, out - 1, Seconds(t1, Clock::now()));
      std::fflush(stdout);
      report_at += 10.0;
    }
  }
  const auto t2 = Clock::now();
  std::printf(
      "\nREPLAY device-only %d x %d/%d: %.2f s = prefill %.2f s (%d steps) + decode %.2f "
      "s (%d steps, %.2f ms/step)\n",
      requests, in, out, Seconds(t0, t2), Seconds(t0, t1), prefill_steps, Seconds(t1, t2), out - 1,
      Seconds(t1, t2) / std::max(1, out - 1) * 1e3);
  return Seconds(t0, t2);
}

// The end-to-end workload: the jobs to submit (one Submit each), every sample's expected
// generated tokens and finish reason, and what its floor counts.
struct Workload {
  std::string name;
  std::vector<std::vector<SampleSpec>> jobs;
  std::vector<int> lengths;  // every sample's generated tokens, in job order
  FinishReason finish = FinishReason::kLength;
  int64_t prefill_tokens = 0;  // prompt tokens to compute (a shared prompt once)
  int32_t stop_token = 0;      // rl: the stand-in EOS (TimedRunner::EmulateStops)
  int samples_per_prompt = 1;  // consecutive samples sharing a prompt
};

Workload MakeWorkload(int vocab, std::mt19937_64* rng) {
  const int in = absl::GetFlag(FLAGS_input_len), out = absl::GetFlag(FLAGS_output_len);
  const float temperature = absl::GetFlag(FLAGS_temperature);
  Workload w;
  if (absl::GetFlag(FLAGS_workload) == "rl") {
    const int prompts = absl::GetFlag(FLAGS_rl_prompts), samples = absl::GetFlag(FLAGS_rl_samples);
    w.stop_token = 1;
    w.jobs = RlWorkload(prompts, samples, in, out, w.stop_token, temperature, vocab, rng);
    w.lengths = RlOutputLengths(prompts * samples, absl::GetFlag(FLAGS_rl_median), out);
    w.finish = FinishReason::kStop;
    w.prefill_tokens = static_cast<int64_t>(prompts) * in;
    w.samples_per_prompt = samples;
    std::vector<int> sorted = w.lengths;
    std::sort(sorted.begin(), sorted.end());
    int64_t total = 0;
    for (int l : sorted) total += l;
    w.name = absl::StrFormat("rl %d x %d samples, %d prompt + %d..%d (median %d, mean %.0f) tokens",
                             prompts, samples, in, sorted.front(), sorted.back(),
                             sorted[sorted.size() / 2], double(total) / sorted.size());
    return w;
  }
  const int requests = absl::GetFlag(FLAGS_num_requests);
  w.jobs = {RolloutWorkload(requests, in, out, temperature, vocab, rng)};
  w.lengths.assign(requests, out);
  w.prefill_tokens = static_cast<int64_t>(requests) * in;
  w.name = absl::StrFormat("%d x %d/%d", requests, in, out);
  return w;
}

// The GPU's rates, the runner on synthetic weights, and the floor of the workload.
struct Setup {
  ModelConfig config;
  CudaRunnerOptions options;
  std::unique_ptr<CudaModelRunner> runner;
  double bw = 0, flops = 0, batch1_floor_ms = 0;
  TpSpread spread;  // across GPUs: their count and the measured peer copy rate
};

absl::StatusOr<Setup> MakeSetup() {
  Setup setup;
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs, %.1f GiB\n", prop.name, prop.multiProcessorCount,
              prop.totalGlobalMem / double(1 << 30));
  setup.bw = bench::MeasureCopyBandwidth();
  setup.flops = bench::MeasureGemmFlops();
  std::printf("measured: device copy %.2f TB/s (read + write), bf16 GEMM 8192^3 %.0f TFLOP/s\n",
              setup.bw / 1e12, setup.flops / 1e12);

  ModelConfig& config = setup.config;
  config = *PresetConfig(absl::GetFlag(FLAGS_preset));
  if (absl::GetFlag(FLAGS_num_layers) > 0) config.num_layers = absl::GetFlag(FLAGS_num_layers);
  CudaRunnerOptions& options = setup.options;
  options.max_batch_tokens = absl::GetFlag(FLAGS_max_batch_tokens);
  options.gemm_pin_m = absl::GetFlag(FLAGS_gemm_pin_m);
  options.gemm_ladder = absl::GetFlag(FLAGS_gemm_ladder);
  options.gemm_hand_kernels = absl::GetFlag(FLAGS_gemm_hand_kernels);
  options.attention_split_size = absl::GetFlag(FLAGS_attention_split_size);
  options.attention_kernel = absl::GetFlag(FLAGS_attention) == "simt"
                                 ? CudaAttentionKernel::kSimt
                                 : CudaAttentionKernel::kTensorCore;
  options.cuda_graphs = absl::GetFlag(FLAGS_cuda_graphs);
  options.shared_prefix_attention = absl::GetFlag(FLAGS_shared_prefix_attention);
  options.canonical_k_tree = absl::GetFlag(FLAGS_tp_invariant);
  options.tensor_parallel = absl::GetFlag(FLAGS_tp);
  for (const std::string& device : absl::GetFlag(FLAGS_cuda_devices)) {
    int index = 0;
    if (!absl::SimpleAtoi(device, &index)) {
      return absl::InvalidArgumentError("--cuda_devices: '" + device + "' is not a device index");
    }
    options.devices.push_back(index);
  }
  options.nccl_library = absl::GetFlag(FLAGS_nccl_library);
  if (options.devices.size() > 1) {
    setup.spread.gpus = static_cast<int>(options.devices.size());
    setup.spread.link_bw = bench::MeasurePeerBandwidth(options.devices[0], options.devices[1]);
    std::printf("tp %d on GPUs %s: peer copy GPU %d -> GPU %d %.1f GB/s (the all-gathers' rate)\n",
                options.tensor_parallel, absl::StrJoin(options.devices, ",").c_str(),
                options.devices[1], options.devices[0], setup.spread.link_bw / 1e9);
  } else if (options.tensor_parallel > 1) {
    std::printf("tp %d as streams of GPU 0 (the floor is one GPU's)\n", options.tensor_parallel);
  }
  std::printf(
      "attention kernel: %s, shared-prefix decode attention: %s, decode CUDA graphs: %s, "
      "row-parallel K: %s\n",
      absl::GetFlag(FLAGS_attention).c_str(), options.shared_prefix_attention ? "on" : "off",
      options.cuda_graphs ? "on" : "off",
      options.canonical_k_tree ? "canonical 8-segment tree (tp-invariant)" : "fused GEMM");
  const auto t0 = Clock::now();
  auto created = CudaModelRunner::CreateSynthetic(config, 0, options);
  if (!created.ok()) return created.status();
  setup.runner = *std::move(created);
  CudaModelRunner& runner = *setup.runner;
  std::printf(
      "synthetic %s weights generated on the GPU in %.1f s: %.2f GB weights, KV pool "
      "%.1f GB = %d blocks x %d tokens\n",
      absl::GetFlag(FLAGS_preset).c_str(), Seconds(t0, Clock::now()), runner.weight_bytes() / 1e9,
      runner.kv_cache_bytes() / 1e9, runner.num_kv_blocks(), runner.kv_block_size());
  for (const std::string& line : runner.gemm_descriptions()) {
    std::printf("  pinned %s\n", line.c_str());
  }
  setup.batch1_floor_ms =
      DecodeStepGemmSeconds(config, 1, setup.flops, setup.bw, setup.spread.gpus) * 1e3 +
      (setup.spread.gpus > 1
           ? TpGatherBytes(config, setup.spread.gpus, 1, 1) / setup.spread.link_bw * 1e3
           : 0.0);
  if (config.is_moe()) {
    std::printf(
        "MoE: %d of %d layers, %d experts (%d per token) of width %d; active parameters per token "
        "%.2f B; a decode step of 256 tokens touches %.1f experts per layer (uniform routing)\n",
        config.NumMoeLayers(), config.num_layers, config.num_experts, config.num_experts_per_tok,
        config.moe_intermediate_size, GemmParams(config) / 1e9, TouchedExperts(config, 256));
  }
  return setup;
}

// Batch-1 decode on the runner after a prompt of input_len tokens.
void RunBatch1(const Setup& setup, std::mt19937_64* rng) {
  const int steps = absl::GetFlag(FLAGS_batch1_tokens), in = absl::GetFlag(FLAGS_input_len);
  CudaModelRunner& runner = *setup.runner;
  const int bs = runner.kv_block_size(), vocab = setup.config.vocab_size;
  std::vector<float> logits;
  ForwardBatch prefill = SyntheticBatch(1, 0, in, bs, vocab, rng);
  prefill.block_tables[0].resize((in + steps + bs - 1) / bs);
  for (int i = 0; i < static_cast<int>(prefill.block_tables[0].size()); ++i) {
    prefill.block_tables[0][i] = i;
  }
  Check(runner.Forward(prefill, &logits));
  ForwardBatch step = prefill;
  double total = 0;
  for (int s = 0; s < steps; ++s) {
    step.token_ids = {static_cast<int32_t>((*rng)() % vocab)};
    step.positions = {in + s};
    step.token_seq = {0};
    step.logit_rows = {0};
    const auto a = Clock::now();
    Check(runner.Forward(step, &logits));
    if (s >= 8) total += Seconds(a, Clock::now());
  }
  const double ms = total / (steps - 8) * 1e3;
  std::printf(
      "\nbatch-1 decode at context %d: %.3f ms/token (floor %.3f ms: weights once at "
      "the measured copy rate) = %.2fx the floor\n",
      in, ms, setup.batch1_floor_ms, ms / setup.batch1_floor_ms);
}

// Samples `tasks` rows on the GPU and on the host, and prints both times.
void CompareSampling(CudaModelRunner& runner, const ForwardBatch& decode, int batch, int ctx) {
  SamplingParams sp;
  sp.temperature = 1.0f;
  std::vector<LogitsRowTask> tasks(batch);
  for (int q = 0; q < batch; ++q) {
    tasks[q].params = &sp;
    tasks[q].sample_seed = q;
    tasks[q].position = ctx + 1;
  }
  std::vector<SampleResult> results;
  std::vector<float> logits;
  Check(runner.ProcessLogits(tasks, {}, &results));
  const auto a = Clock::now();
  for (int i = 0; i < 10; ++i) Check(runner.ProcessLogits(tasks, {}, &results));
  const double gpu_ms = Seconds(a, Clock::now()) / 10 * 1e3;
  Check(runner.ForwardToHost(decode, &logits));
  cpu::ThreadPool pool;
  const auto b = Clock::now();
  Check(ProcessLogitsOnHost(tasks, logits, runner.config().vocab_size, &pool, &results));
  const double host_ms = Seconds(b, Clock::now()) * 1e3;
  std::printf(
      "  sampling %d rows x %d vocab (T = 1): %.3f ms on the GPU (ProcessLogits: kernel + "
      "transfers + sync) vs %.1f ms on the host (%d threads, after the logits copy)\n",
      batch, runner.config().vocab_size, gpu_ms, host_ms,
      static_cast<int>(std::thread::hardware_concurrency()));
}

// The prefill step's GEMMs at the measured rate and, with the canonical K tree, what its fp32
// leaves cost at the copy rate: o_proj's and every dense down_proj's eight [tokens, hidden]
// leaves are written and read back by the tree kernel (at decode's rows they are small).
void PrintPrefillFloor(const Setup& setup, int64_t tokens) {
  const ModelConfig& c = setup.config;
  const int g = setup.spread.gpus;
  const double gemm_ms = PrefillGemmSeconds(c, tokens, setup.flops, g) * 1e3;
  std::string tree;
  if (setup.options.canonical_k_tree) {
    int row_parallel = 0;
    for (int layer = 0; layer < c.num_layers; ++layer) row_parallel += c.IsMoeLayer(layer) ? 1 : 2;
    const double bytes = 2.0 * row_parallel * cuda::kNumKSegments * tokens * c.hidden_size * 4 / g;
    tree = absl::StrFormat(
        "; the K tree's fp32 leaves: %.2f GB written and read = %.2f ms at "
        "the copy rate",
        bytes / 1e9, bytes / setup.bw * 1e3);
  }
  std::printf("  floor of this step: GEMMs %.2f ms at the measured rate%s\n", gemm_ms,
              tree.c_str());
}

// Per-kernel profiles: one full prefill step, one decode step of the whole batch at the mean
// decode context, each beside its floor.
void RunProfiles(const Setup& setup, int requests, std::mt19937_64* rng) {
  const int in = absl::GetFlag(FLAGS_input_len), out = absl::GetFlag(FLAGS_output_len);
  CudaModelRunner& runner = *setup.runner;
  const ModelConfig& config = setup.config;
  const int bs = runner.kv_block_size(), vocab = config.vocab_size;
  std::vector<float> logits;
  runner.EnableProfiling(true);
  const int per_step = std::max(1, setup.options.max_batch_tokens / in);
  ForwardBatch prefill = SyntheticBatch(per_step, 0, in, bs, vocab, rng);
  Check(runner.Forward(prefill, &logits));  // warm-up
  runner.ResetProfile();
  for (int i = 0; i < 3; ++i) Check(runner.Forward(prefill, &logits));
  PrintProfile("prefill step profile", runner.profile(), prefill.num_tokens());
  PrintPrefillFloor(setup, prefill.num_tokens());
  const int batch = std::min(requests, absl::GetFlag(FLAGS_max_running));
  const int ctx = in + out / 2;
  const int64_t blocks = static_cast<int64_t>(batch) * ((ctx + bs) / bs + 1);
  if (blocks > runner.num_kv_blocks()) {
    std::printf(
        "\nno decode step profile: %d sequences at the mean context %d need %ld KV blocks, "
        "the pool holds %d (lower --num_requests or --max_running)\n",
        batch, ctx, static_cast<long>(blocks), runner.num_kv_blocks());
  } else {
    ForwardBatch decode = SyntheticBatch(batch, ctx, ctx + 1, bs, vocab, rng);
    Check(runner.ForwardToHost(decode, &logits));
    runner.ResetProfile();
    for (int i = 0; i < 5; ++i) Check(runner.ForwardToHost(decode, &logits));
    PrintProfile("decode step profile (mean context), logits copied to the host", runner.profile(),
                 batch);
    const int g = setup.spread.gpus;
    const double kv_ms = double(batch) * ctx * KvBytesPerTokenPerGpu(config, g) / setup.bw * 1e3;
    const double gemm_ms = DecodeStepGemmSeconds(config, batch, setup.flops, setup.bw, g) * 1e3;
    const double gather_ms =
        g > 1 ? TpGatherBytes(config, g, batch, batch) / setup.spread.link_bw * 1e3 : 0.0;
    const double floor_ms = gemm_ms + kv_ms + gather_ms;
    std::printf("  floor of this step: GEMMs %.2f ms + KV read %.2f ms%s = %.2f ms\n", gemm_ms,
                kv_ms, g > 1 ? absl::StrFormat(" + all-gathers %.2f ms", gather_ms).c_str() : "",
                floor_ms);
    if (config.is_moe()) {
      const double lm = double(vocab) * config.hidden_size;
      const double read = 2.0 * (StepWeightParams(config, batch) + lm);
      const double compute = 2.0 * (GemmParams(config) + lm) * batch;
      std::printf(
          "  (MoE: %.2f GB of weights touched = %.1f experts per layer of %d read once, %.2f "
          "TFLOP)\n",
          read / 1e9, TouchedExperts(config, batch), config.num_experts, compute / 1e12);
    }
    // The device work alone, without the logits copy to the host.
    runner.ResetProfile();
    for (int i = 0; i < 5; ++i) Check(runner.Forward(decode, nullptr));
    PrintProfile("decode step profile, logits left on the GPU", runner.profile(), batch);
    CompareSampling(runner, decode, batch, ctx);
    // The same step unprofiled (no events between kernels: its CUDA graph when graphs are on),
    // wall time per step including the metadata upload.
    runner.EnableProfiling(false);
    Check(runner.Forward(decode, nullptr));
    CHECK_CUDA(cudaDeviceSynchronize());
    constexpr int kTimed = 20;
    const auto t0 = Clock::now();
    for (int i = 0; i < kTimed; ++i) Check(runner.Forward(decode, nullptr));
    CHECK_CUDA(cudaDeviceSynchronize());
    const double step_ms = Seconds(t0, Clock::now()) * 1e3 / kTimed;
    std::printf(
        "decode step unprofiled, logits left on the GPU: %.3f ms per step (%d steps) against the "
        "floor of %.2f ms: %.2fx\n",
        step_ms, kTimed, floor_ms, step_ms / floor_ms);
  }
  runner.EnableProfiling(false);
}

// What the end-to-end run's sink sees, under mu.
struct E2eProgress {
  std::mutex mu;
  std::condition_variable cv;
  int finished = 0;
  int64_t generated = 0;
  // Per job, per sample: generated tokens and finish reason of its completion.
  std::vector<std::vector<std::optional<SampleCompletion>>> completions;
};

// The samples that did not end as the workload says (tokens, finish reason), printed; 0 when
// every sample is whole.
int CountBrokenSamples(const Workload& w, const E2eProgress& progress) {
  int broken = 0;
  size_t k = 0;
  for (size_t j = 0; j < w.jobs.size(); ++j) {
    for (size_t i = 0; i < w.jobs[j].size(); ++i, ++k) {
      const std::optional<SampleCompletion>& c = progress.completions[j][i];
      const bool whole = c.has_value() && c->finish_reason == w.finish &&
                         static_cast<int>(c->token_ids.size()) == w.lengths[k];
      if (whole) continue;
      if (++broken <= 5) {
        std::printf("  sample %zu of request %zu: %s\n", i, j,
                    !c.has_value()
                        ? "no completion"
                        : absl::StrFormat("%d of %d tokens, finish reason %d", c->token_ids.size(),
                                          w.lengths[k], static_cast<int>(c->finish_reason))
                              .c_str());
      }
    }
  }
  return broken;
}

// Waits for the run, printing progress every 10 s and tracking the device memory in use; false
// when --e2e_timeout_s ran out first.
bool WaitForRun(E2eProgress* progress, int samples, const TimedRunner& timer,
                Clock::time_point start, int64_t* peak_used_bytes) {
  std::unique_lock<std::mutex> lock(progress->mu);
  const int timeout_s = absl::GetFlag(FLAGS_e2e_timeout_s);
  double next_report = 10.0;
  while (progress->finished < samples) {
    progress->cv.wait_for(lock, std::chrono::seconds(1));
    size_t free_bytes = 0, total_bytes = 0;
    if (cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess) {
      *peak_used_bytes = std::max<int64_t>(*peak_used_bytes, total_bytes - free_bytes);
    }
    const double now = Seconds(start, Clock::now());
    if (timeout_s > 0 && now > timeout_s) return false;
    if (now < next_report && progress->finished < samples) continue;
    next_report += 10.0;
    std::printf(
        "  %6.1f s: %d/%d finished, %ld tokens generated, prefill steps %.1f s, decode "
        "steps %.1f s\n",
        now, progress->finished, samples, static_cast<long>(progress->generated),
        timer.prefill.total_s(), timer.decode.total_s());
    std::fflush(stdout);
  }
  return true;
}

// End to end through the engine. Returns the exit code: 1 when any sample ended short or
// aborted (no RESULT line then), or when the run did not finish.
int RunEndToEnd(const Setup& setup, const Workload& w, const Floor& floor, std::mt19937_64* rng) {
  CudaModelRunner* runner = setup.runner.get();
  auto timed = std::make_unique<TimedRunner>(runner);
  TimedRunner* timer = timed.get();
  if (w.finish == FinishReason::kStop) {
    std::map<uint64_t, int> stop_after;
    size_t k = 0;
    for (const auto& job : w.jobs) {
      for (const SampleSpec& spec : job) stop_after[spec.sample_seed] = w.lengths[k++];
    }
    timer->EmulateStops(w.stop_token, absl::GetFlag(FLAGS_input_len), std::move(stop_after));
  }
  EngineOptions engine_options;
  engine_options.max_running_samples = absl::GetFlag(FLAGS_max_running);
  engine_options.max_batch_tokens = absl::GetFlag(FLAGS_max_batch_tokens);
  engine_options.decode_lookahead = absl::GetFlag(FLAGS_decode_lookahead);
  const std::optional<AdmissionPolicy> admission =
      ParseAdmissionPolicy(absl::GetFlag(FLAGS_admission));
  if (!admission.has_value()) {
    std::fprintf(stderr, "--admission: '%s' is not reserve, estimate or optimistic\n",
                 absl::GetFlag(FLAGS_admission).c_str());
    return 1;
  }
  engine_options.admission = *admission;
  // The engine owns the decorator; it is destroyed (and its thread joined) before `runner`.
  auto engine = Engine::Create(std::move(timed), engine_options);
  if (!engine.ok()) {
    std::fprintf(stderr, "engine: %s\n", engine.status().ToString().c_str());
    return 1;
  }
  E2eProgress progress;
  int samples = 0;
  int64_t expected_tokens = 0;
  for (const auto& job : w.jobs) {
    progress.completions.emplace_back(job.size());
    samples += static_cast<int>(job.size());
  }
  for (int l : w.lengths) expected_tokens += l;
  std::printf(
      "\nend to end: %s, temperature %.2g, max_running %d, max_batch_tokens %d, admission %s\n",
      w.name.c_str(), absl::GetFlag(FLAGS_temperature), engine_options.max_running_samples,
      engine_options.max_batch_tokens, absl::GetFlag(FLAGS_admission).c_str());
  // Where each (rollout_index, sample_index) of a job sits in it: events name their sample so.
  std::vector<std::map<std::pair<int32_t, int32_t>, size_t>> position_of(w.jobs.size());
  for (size_t j = 0; j < w.jobs.size(); ++j) {
    for (size_t i = 0; i < w.jobs[j].size(); ++i) {
      position_of[j][{w.jobs[j][i].rollout_index, w.jobs[j][i].sample_index}] = i;
    }
  }
  const auto start = Clock::now();
  for (size_t j = 0; j < w.jobs.size(); ++j) {
    const auto* positions = &position_of[j];
    auto job =
        (*engine)->Submit(w.jobs[j], [&progress, j, positions](std::vector<SampleEvent> events) {
          std::lock_guard<std::mutex> lock(progress.mu);
          for (SampleEvent& e : events) {
            progress.generated += static_cast<int64_t>(e.new_token_ids.size());
            if (!e.completion.has_value()) continue;
            ++progress.finished;
            const size_t i = positions->at({e.rollout_index, e.sample_index});
            progress.completions[j][i] = *std::move(e.completion);
          }
          progress.cv.notify_all();
        });
    if (!job.ok()) {
      std::fprintf(stderr, "submit: %s\n", job.status().ToString().c_str());
      return 1;
    }
  }
  int64_t peak_used = 0;
  const bool done = WaitForRun(&progress, samples, *timer, start, &peak_used);
  const double e2e = Seconds(start, Clock::now());
  const double forward = timer->prefill.total_s() + timer->decode.total_s();
  const int64_t decode_steps = timer->decode.steps.load();
  const int64_t steps = timer->prefill.steps.load() + decode_steps;
  const EngineCounters counters = (*engine)->counters();
  std::printf(
      "  steps with prefill: %ld (%ld tokens), %.2f s in their launches and collections (%.2f "
      "launching); decode-only steps: %ld, %.2f s (%.2f ms/step; %.3f ms/step launching), %ld "
      "of them launched ahead (decode lookahead)\n"
      "  engine host work outside launches and collections (scheduling, results, events): "
      "%.2f s (%.3f ms/step)\n",
      static_cast<long>(timer->prefill.steps.load()),
      static_cast<long>(timer->prefill.tokens.load()), timer->prefill.total_s(),
      timer->prefill.launch_s(), static_cast<long>(decode_steps), timer->decode.total_s(),
      timer->decode.ms_per_step(),
      timer->decode.launch_s() / std::max<int64_t>(1, decode_steps) * 1e3,
      static_cast<long>(counters.lookahead_steps), e2e - forward,
      (e2e - forward) / std::max<int64_t>(1, steps) * 1e3);
  std::printf(
      "  KV: %lu preemptions, %lu recomputed tokens, %lu prefilled for %lu prompt tokens (%lu "
      "from the prefix cache); peak device memory in use %.2f GB of which KV pool %.2f GB\n",
      static_cast<unsigned long>(counters.preemptions),
      static_cast<unsigned long>(counters.recomputed_tokens),
      static_cast<unsigned long>(counters.prefilled_tokens),
      static_cast<unsigned long>(counters.prompt_tokens),
      static_cast<unsigned long>(counters.cache_hit_tokens), peak_used / 1e9,
      runner->kv_cache_bytes() / 1e9);
  engine->reset();  // joins the engine thread before `runner` goes
  if (!done) {
    std::printf(
        "\nE2E INCOMPLETE after %.1f s (--e2e_timeout_s): %d/%d samples finished, %ld of %ld "
        "tokens generated: no result\n",
        e2e, progress.finished, samples, static_cast<long>(progress.generated),
        static_cast<long>(expected_tokens));
    return 1;
  }
  if (const int broken = CountBrokenSamples(w, progress); broken > 0) {
    std::printf(
        "\nE2E FAILED: %d of %d samples ended short or aborted (%ld of %ld tokens generated): "
        "no result\n",
        broken, samples, static_cast<long>(progress.generated), static_cast<long>(expected_tokens));
    return 1;
  }
  std::printf("\nRESULT %s %s: %.2f s end to end, %.0f output tok/s, %.0f total tok/s\n",
              absl::GetFlag(FLAGS_preset).c_str(), w.name.c_str(), e2e, expected_tokens / e2e,
              (expected_tokens + double(absl::GetFlag(FLAGS_input_len)) * samples) / e2e);
  std::printf("  decode graphs: %ld captured, %ld replays\n",
              static_cast<long>(runner->graphs_captured()),
              static_cast<long>(runner->graph_launches()));
  // The published figures are Qwen3-8B's: printed beside that shape only.
  const bool published = absl::GetFlag(FLAGS_preset) == "qwen3-8b" && w.name == "256 x 1024/1024";
  std::printf("  floor %.2f s -> %.2fx the floor%s\n", floor.total(), e2e / floor.total(),
              published ? " (published on H200 for Qwen3-8B 256 x 1024/1024: SGLang 30.85 s, "
                          "SGLang deterministic 43.99 s, floor ~23 s)"
                        : "");
  if (w.samples_per_prompt > 1) {
    std::printf("  floor with each prompt's KV read once a step %.2f s -> %.2fx that floor\n",
                floor.total_shared(), e2e / floor.total_shared());
  }
  // Where the gap is, by phase (steps with prefill also carry the decode rows beside them, so
  // the split is approximate): each phase's device steps against its terms of the floor.
  const double decode_floor = floor.decode_gemm_s + floor.decode_kv_s + floor.gather_s;
  std::printf(
      "  by phase: steps with prefill %.2f s against the prefill floor %.2f s (%.2fx); decode-only "
      "steps %.2f s against the decode floor %.2f s (%.2fx); host outside steps %.2f s\n",
      timer->prefill.total_s(), floor.prefill_s,
      floor.prefill_s > 0 ? timer->prefill.total_s() / floor.prefill_s : 0.0,
      timer->decode.total_s(), decode_floor,
      decode_floor > 0 ? timer->decode.total_s() / decode_floor : 0.0, e2e - forward);
  return 0;
}

// Batch-1 decode through the engine: one request, input_len prompt, batch1_tokens generated.
void RunBatch1ThroughEngine(const Setup& setup, std::mt19937_64* rng) {
  const int b1 = absl::GetFlag(FLAGS_batch1_tokens), in = absl::GetFlag(FLAGS_input_len);
  auto timed1 = std::make_unique<TimedRunner>(setup.runner.get());
  TimedRunner* timer1 = timed1.get();
  EngineOptions engine_options;
  engine_options.decode_lookahead = absl::GetFlag(FLAGS_decode_lookahead);
  auto engine1 = Engine::Create(std::move(timed1), engine_options);
  if (!engine1.ok()) return;
  std::vector<SampleSpec> one(1);
  one[0].prompt = RandomPrompt(in, setup.config.vocab_size, rng);
  one[0].params.temperature = absl::GetFlag(FLAGS_temperature);
  one[0].params.max_new_tokens = b1;
  one[0].params.ignore_eos = true;
  one[0].sample_seed = 5;
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  int64_t got = 0;
  Clock::time_point first_token, last_token;
  auto job1 = (*engine1)->Submit(std::move(one), [&](std::vector<SampleEvent> events) {
    std::lock_guard<std::mutex> lock(mu);
    for (const SampleEvent& e : events) {
      if (!e.new_token_ids.empty()) {
        if (got == 0) first_token = Clock::now();
        got += static_cast<int64_t>(e.new_token_ids.size());
        last_token = Clock::now();
      }
      if (e.completion.has_value()) done = true;
    }
    cv.notify_all();
  });
  if (!job1.ok()) return;
  {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait_for(lock, std::chrono::seconds(120), [&] { return done; });
  }
  const double ms = Seconds(first_token, last_token) / std::max<int64_t>(1, got - 1) * 1e3;
  std::printf(
      "\nbatch-1 decode through the Engine at context %d..%d: %.3f ms/token (launch + "
      "collect %.3f ms per step) = %.2fx the %.3f ms floor\n",
      in, in + b1, ms, timer1->decode.ms_per_step(), ms / setup.batch1_floor_ms,
      setup.batch1_floor_ms);
  engine1->reset();
}

int Main() {
  absl::StatusOr<Setup> setup = MakeSetup();
  if (!setup.ok()) {
    std::fprintf(stderr, "creating the runner: %s\n", setup.status().ToString().c_str());
    return 1;
  }
  std::mt19937_64 rng(7);
  const int in = absl::GetFlag(FLAGS_input_len), out = absl::GetFlag(FLAGS_output_len);
  const Workload workload = MakeWorkload(setup->config.vocab_size, &rng);
  const int64_t kv_tokens =
      static_cast<int64_t>(setup->runner->num_kv_blocks()) * setup->runner->kv_block_size();
  const Floor floor = ComputeFloor(setup->config, workload.prefill_tokens, in, workload.lengths,
                                   kv_tokens, setup->flops, setup->bw, setup->spread,
                                   workload.samples_per_prompt);
  std::printf(
      "floor of %s (docs/benchmarks.md, measured rates): %.2f s = prefill GEMMs %.2f + decode "
      "GEMMs %.2f + decode KV reads %.2f%s\n",
      workload.name.c_str(), floor.total(), floor.prefill_s, floor.decode_gemm_s, floor.decode_kv_s,
      setup->spread.gpus > 1
          ? absl::StrFormat(" + all-gathers %.2f (%d GPUs, each its share of weights and KV)",
                            floor.gather_s, setup->spread.gpus)
                .c_str()
          : "");
  if (workload.samples_per_prompt > 1) {
    std::printf(
        "  with each prompt's KV read once a step by its samples (shared-prefix attention): "
        "decode KV reads %.2f s, floor %.2f s\n",
        floor.decode_kv_shared_s, floor.total_shared());
  }
  const int requests = static_cast<int>(workload.lengths.size());
  if (absl::GetFlag(FLAGS_batch1_tokens) > 0) RunBatch1(*setup, &rng);
  RunProfiles(*setup, requests, &rng);
  if (absl::GetFlag(FLAGS_replay) && absl::GetFlag(FLAGS_workload) == "fixed") {
    const double replay_s = ReplayDeviceOnly(setup->runner.get(), requests, in, out,
                                             setup->options.max_batch_tokens, &rng);
    if (replay_s > 0) {
      std::printf("  floor %.2f s -> device-only replay at %.2fx the floor\n", floor.total(),
                  replay_s / floor.total());
    }
  }
  if (!absl::GetFlag(FLAGS_e2e)) return 0;
  if (const int rc = RunEndToEnd(*setup, workload, floor, &rng); rc != 0) return rc;
  if (absl::GetFlag(FLAGS_batch1_tokens) > 1) RunBatch1ThroughEngine(*setup, &rng);
  return 0;
}

}  // namespace
}  // namespace rollout

int main(int argc, char** argv) {
  rollout::ParseCommandLine(argc, argv,
                            "the offline throughput benchmark of docs/benchmarks.md on the CUDA "
                            "backend.\nUsage: rollout-bench [--num_requests=256 --input_len=1024 "
                            "--output_len=1024] | --workload=rl [--rl_prompts=64 --rl_samples=8]",
                            "rollout_bench.cc");
  return rollout::Main();
}
