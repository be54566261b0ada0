// rollout-tp-bench: the cost of tensor-parallel-degree invariance (D10) on the CPU backend.
//
// For the row-parallel layers (o_proj, down_proj) it times, at TP 1, 2, 4 and 8:
//   plain     -- each rank one Dot per output over its contiguous K slice (MatMul), the ranks'
//                partials summed in rank order: deterministic for one degree, different bits
//                at each degree (at TP 1 it is the plain MatMul);
//   canonical -- each rank its node of the 8-segment K tree (SegmentedPartialMatMul), the nodes
//                combined by the tree's top (CombinePartials): the same bits at every degree.
// Part 1 runs the ranks one after another on one thread (pure compute: the sum of the ranks'
// kernel times plus the final reduction). Part 2 runs them as threads with the in-process
// communicator (wall time of one layer, all-gather included). Both variants send the same
// bytes: one float per output per rank. Part 3 times whole forward passes of the CPU runner at
// TP 1, 2, 4 on the "small" preset.
//
// Usage: rollout-tp-bench [--quick] [--filter=SHAPE_NAME_PART]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "common/command_line.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/reference_test_util.h"
#include "model/random_model.h"
#include "runner/cpu/communicator.h"
#include "runner/cpu/cpu_model_runner.h"

ABSL_FLAG(bool, quick, false, "fewer sizes and repeats");
ABSL_FLAG(std::string, filter, "",
          "only the shapes whose name contains this (parts 1 and 2; part 3 is skipped)");

namespace rollout {
namespace {

using Clock = std::chrono::steady_clock;
using cpu::Columns;

// Median seconds of `fn` over `runs` runs, each repeated until it lasts >= min_seconds.
// Seconds per call of `fn`, called repeatedly for at least min_seconds.
double SecondsPerCall(const std::function<void()>& fn, double min_seconds) {
  int reps = 0;
  const auto t0 = Clock::now();
  double elapsed = 0;
  do {
    fn();
    ++reps;
    elapsed = std::chrono::duration<double>(Clock::now() - t0).count();
  } while (elapsed < min_seconds);
  return elapsed / reps;
}

double Time(const std::function<void()>& fn, int runs = 5, double min_seconds = 0.05) {
  fn();  // warm up
  std::vector<double> samples;
  for (int r = 0; r < runs; ++r) samples.push_back(SecondsPerCall(fn, min_seconds));
  std::sort(samples.begin(), samples.end());
  return samples[samples.size() / 2];
}

// Median seconds of `a` and of `b`, timed alternately (a, b, a, b, ...) so that load from other
// processes on a shared machine falls on both alike.
std::pair<double, double> TimePair(const std::function<void()>& a, const std::function<void()>& b,
                                   int rounds = 7, double min_seconds = 0.05) {
  a();
  b();
  std::vector<double> sa, sb;
  for (int r = 0; r < rounds; ++r) {
    sa.push_back(SecondsPerCall(a, min_seconds));
    sb.push_back(SecondsPerCall(b, min_seconds));
  }
  std::sort(sa.begin(), sa.end());
  std::sort(sb.begin(), sb.end());
  return {sa[sa.size() / 2], sb[sb.size() / 2]};
}

struct Shape {
  const char* name;
  int64_t k, n;  // y[m, n] = x[m, k] . w[n, k]^T
};

struct Shards {
  std::vector<std::vector<float>> x, w;  // per rank
};

Shards MakeShards(const std::vector<float>& x, const std::vector<float>& w, int64_t m,
                  const Shape& s, int tp) {
  Shards sh;
  for (int r = 0; r < tp; ++r) {
    // Rank slices sit on canonical segment boundaries, so both variants use the same slices.
    const int64_t c0 = cpu::KSegmentBegin(s.k, r * cpu::kNumKSegments / tp);
    const int64_t c1 = cpu::KSegmentBegin(s.k, (r + 1) * cpu::kNumKSegments / tp);
    sh.x.push_back(Columns(x, m, s.k, c0, c1));
    sh.w.push_back(Columns(w, s.n, s.k, c0, c1));
  }
  return sh;
}

void PlainRank(const Shards& sh, int r, int64_t m, const Shape& s, float* out) {
  const int64_t k_local = static_cast<int64_t>(sh.x[r].size()) / m;
  cpu::MatMul(nullptr, sh.x[r].data(), m, k_local, sh.w[r].data(), s.n, nullptr, out);
}
void CanonicalRank(const Shards& sh, int r, int tp, int64_t m, const Shape& s, float* out) {
  const int s0 = r * cpu::kNumKSegments / tp, s1 = (r + 1) * cpu::kNumKSegments / tp;
  cpu::SegmentedPartialMatMul(nullptr, sh.x[r].data(), m, sh.w[r].data(), s.n, s.k, s0, s1, out);
}
void PlainReduce(std::vector<float>& parts, int tp, int64_t count, float* y) {
  std::memcpy(y, parts.data(), count * sizeof(float));
  for (int r = 1; r < tp; ++r) cpu::Add(y, &parts[r * count], count);
}

void Part1And2(bool quick, const std::string& filter) {
  const std::vector<Shape> shapes = {
      {"small o_proj", 256, 256},      {"small down_proj", 768, 256},
      {"medium o_proj", 2048, 2048},   {"medium down_proj", 5632, 2048},
      {"qwen3-8b o_proj", 4096, 4096}, {"qwen3-8b down_proj", 12288, 4096}};
  const std::vector<int64_t> ms = quick ? std::vector<int64_t>{1} : std::vector<int64_t>{1, 64};
  std::printf("\n## Part 1: compute only (ranks one after another, one thread)\n\n");
  std::printf("| shape (K x N) | m | TP | plain ms | canonical ms | canonical / plain |\n");
  std::printf("|---|---|---|---|---|---|\n");
  for (const Shape& s : shapes) {
    if (quick && s.k > 4096) continue;
    if (std::string(s.name).find(filter) == std::string::npos) continue;
    for (int64_t m : ms) {
      const std::vector<float> x = cpu::RandomVector(m * s.k, 1);
      const std::vector<float> w = cpu::RandomVector(s.n * s.k, 2);
      for (int tp : {1, 2, 4, 8}) {
        const Shards sh = MakeShards(x, w, m, s, tp);
        std::vector<float> parts(tp * m * s.n), y(m * s.n);
        const auto [plain, canonical] = TimePair(
            [&] {
              for (int r = 0; r < tp; ++r) PlainRank(sh, r, m, s, &parts[r * m * s.n]);
              PlainReduce(parts, tp, m * s.n, y.data());
            },
            [&] {
              for (int r = 0; r < tp; ++r) CanonicalRank(sh, r, tp, m, s, &parts[r * m * s.n]);
              cpu::CombinePartials(parts.data(), tp, m * s.n, y.data());
            },
            quick ? 3 : 7);
        std::printf("| %s (%ld x %ld) | %ld | %d | %.3f | %.3f | %.2fx |\n", s.name, s.k, s.n, m,
                    tp, plain * 1e3, canonical * 1e3, canonical / plain);
        std::fflush(stdout);
      }
    }
  }

  std::printf("\n## Part 2: ranks as threads, in-process all-gather (one layer, wall)\n\n");
  std::printf("| shape (K x N) | m | TP | plain ms | canonical ms | canonical / plain |\n");
  std::printf("|---|---|---|---|---|---|\n");
  for (const Shape& s : shapes) {
    if (s.k > 2048 && s.n > 2048) continue;  // the small and medium shapes suffice here
    if (std::string(s.name).find(filter) == std::string::npos) continue;
    for (int64_t m : ms) {
      const std::vector<float> x = cpu::RandomVector(m * s.k, 1);
      const std::vector<float> w = cpu::RandomVector(s.n * s.k, 2);
      for (int tp : {1, 2, 4, 8}) {
        const Shards sh = MakeShards(x, w, m, s, tp);
        // Both variants on the same threads and communicator, alternating in rounds (so load
        // from other processes falls on both alike); a layer's time is its slowest rank's.
        std::vector<std::unique_ptr<Communicator>> comms = CreateInProcessGroup(tp);
        const int rounds = quick ? 3 : 7;
        std::vector<std::vector<double>> seconds(2, std::vector<double>(tp * rounds));
        std::vector<std::thread> threads;
        for (int r = 0; r < tp; ++r) {
          threads.emplace_back([&, r] {
            std::vector<float> mine(m * s.n), all(tp * m * s.n), y(m * s.n);
            auto layer = [&](int variant) {
              if (variant == 0) {
                PlainRank(sh, r, m, s, mine.data());
              } else {
                CanonicalRank(sh, r, tp, m, s, mine.data());
              }
              (void)comms[r]->AllGather(mine.data(), m * s.n, all.data());
              if (variant == 0) {
                PlainReduce(all, tp, m * s.n, y.data());
              } else {
                cpu::CombinePartials(all.data(), tp, m * s.n, y.data());
              }
            };
            layer(0);
            layer(1);
            // Every rank runs the same number of layers (a fixed count, not a time budget).
            const int reps = std::max<int64_t>(2, (quick ? 2e7 : 1e8) / (m * s.k * s.n + 1));
            for (int round = 0; round < rounds; ++round) {
              for (int variant = 0; variant < 2; ++variant) {
                (void)comms[r]->Barrier();
                const auto t0 = Clock::now();
                for (int i = 0; i < reps; ++i) layer(variant);
                seconds[variant][round * tp + r] =
                    std::chrono::duration<double>(Clock::now() - t0).count() / reps;
              }
            }
          });
        }
        for (std::thread& t : threads) t.join();
        double result[2];
        for (int variant = 0; variant < 2; ++variant) {
          std::vector<double> per_round;
          for (int round = 0; round < rounds; ++round) {
            per_round.push_back(*std::max_element(&seconds[variant][round * tp],
                                                  &seconds[variant][round * tp] + tp));
          }
          std::sort(per_round.begin(), per_round.end());
          result[variant] = per_round[per_round.size() / 2];
        }
        std::printf("| %s (%ld x %ld) | %ld | %d | %.3f | %.3f | %.2fx |\n", s.name, s.k, s.n, m,
                    tp, result[0] * 1e3, result[1] * 1e3, result[1] / result[0]);
        std::fflush(stdout);
      }
    }
  }
}

void Part3(bool quick) {
  const std::string dir = "/tmp/rollout-tp-bench-small";
  RandomModelOptions options;
  options.preset = "small";
  if (absl::Status s = WriteRandomModel(options, dir); !s.ok()) {
    std::printf("cannot write the model: %s\n", std::string(s.message()).c_str());
    return;
  }
  std::printf(
      "\n## Part 3: CPU runner forward, \"small\" preset, all cores shared by the ranks\n\n");
  std::printf(
      "| TP | decode step, 16 sequences at context 128 (ms) | prefill, 512 tokens (ms) |\n");
  std::printf("|---|---|---|\n");
  for (int tp : {1, 2, 4}) {
    absl::StatusOr<std::unique_ptr<Checkpoint>> ck = Checkpoint::Open(dir);
    CpuRunnerOptions ro;
    ro.tensor_parallel = tp;
    ro.kv_cache_bytes = 64 << 20;
    absl::StatusOr<std::unique_ptr<CpuModelRunner>> runner = CpuModelRunner::Create(**ck, ro);
    if (!runner.ok()) {
      std::printf("| %d | %s | |\n", tp, std::string(runner.status().message()).c_str());
      continue;
    }
    // 16 sequences of 8 blocks each; decode at position 127, prefill of one 512-token sequence.
    ForwardBatch decode, prefill;
    for (int s = 0; s < 16; ++s) {
      std::vector<int32_t> table;
      for (int b = 0; b < 8; ++b) table.push_back(s * 8 + b);
      decode.block_tables.push_back(table);
      decode.token_ids.push_back(100 + s);
      decode.positions.push_back(127);
      decode.token_seq.push_back(s);
      decode.logit_rows.push_back(s);
    }
    std::vector<int32_t> table;
    for (int b = 0; b < 32; ++b) table.push_back(128 + b);
    prefill.block_tables.push_back(table);
    for (int i = 0; i < 512; ++i) {
      prefill.token_ids.push_back((i * 37) % 4096);
      prefill.positions.push_back(i);
      prefill.token_seq.push_back(0);
    }
    prefill.logit_rows.push_back(511);
    std::vector<float> logits;
    const double d = Time([&] { (void)(*runner)->Forward(decode, &logits); }, quick ? 3 : 5);
    const double p = Time([&] { (void)(*runner)->Forward(prefill, &logits); }, quick ? 3 : 5);
    std::printf("| %d | %.2f | %.1f |\n", tp, d * 1e3, p * 1e3);
    std::fflush(stdout);
  }
}

}  // namespace
}  // namespace rollout

int main(int argc, char** argv) {
  rollout::ParseCommandLine(
      argc, argv,
      "the cost of tensor-parallel-degree invariance (D10) on the CPU "
      "backend.\nUsage: rollout-tp-bench [--quick] [--filter=SHAPE_NAME_PART]",
      "tp_bench_main.cc");
  const bool quick = absl::GetFlag(FLAGS_quick);
  const std::string filter = absl::GetFlag(FLAGS_filter);
  std::printf("# rollout-tp-bench: %u hardware threads\n", std::thread::hardware_concurrency());
  rollout::Part1And2(quick, filter);
  if (filter.empty()) rollout::Part3(quick);
  return 0;
}
