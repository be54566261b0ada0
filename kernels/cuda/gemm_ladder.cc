// PinnedGemm's ladder (kernels/cuda/gemm.h): for ranges of m, faster algorithms -- cuBLASLt's
// split-K-free candidates and the hand-written small-m kernels -- admitted only after a probe
// shows they give the pin's bits, timed as the decode step runs them (inside CUDA graphs,
// weights read from DRAM). The pin itself and the GEMM calls are gemm.cc's.
#include <algorithm>
#include <climits>
#include <functional>
#include <string>
#include <utility>

#include "common/status.h"
#include "kernels/cuda/compare.h"
#include "kernels/cuda/event_timer.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/small_m_gemm.h"

namespace rollout::cuda {

// Random inputs for the ladder's admission test: `batch` products as RunBatched lays them out (x
// [m, batch * k], w and y back to back), m up to max_m, two outputs to compare.
struct GemmProbe {
  int64_t n = 0, k = 0;
  int batch = 1;
  GemmOutput output = GemmOutput::kF32;
  int64_t max_m = 0;
  DeviceBuffer x, w, a, b, count;

  size_t OutBytes(int64_t m) const {
    return static_cast<size_t>(batch) * m * n * (output == GemmOutput::kBf16 ? 2 : 4);
  }
  cudaError_t Init(int64_t n_, int64_t k_, int batch_, GemmOutput output_) {
    n = n_, k = k_, batch = batch_, output = output_;
    constexpr int64_t kMaxOutputBytes = int64_t{1} << 30;
    max_m = std::clamp<int64_t>(kMaxOutputBytes / static_cast<int64_t>(OutBytes(1)), 1, 16384);
    cudaError_t err = x.Allocate(static_cast<size_t>(max_m) * batch * k * 2);
    if (err == cudaSuccess) err = w.Allocate(static_cast<size_t>(batch) * n * k * 2);
    if (err == cudaSuccess) err = a.Allocate(OutBytes(max_m));
    if (err == cudaSuccess) err = b.Allocate(OutBytes(max_m));
    if (err == cudaSuccess) err = count.Allocate(sizeof(unsigned long long));
    if (err == cudaSuccess) {
      err = FillRandomWeights(0x6c6164646572, 1.0, 0, max_m * batch * k, x.get<bf16>(), nullptr,
                              nullptr);
    }
    if (err == cudaSuccess) {
      err = FillRandomWeights(0x70726f6265, 0.02, 0, int64_t{batch} * n * k, w.get<bf16>(), nullptr,
                              nullptr);
    }
    return err;
  }
  // One run of a candidate (or the reference) at m into y on `stream`: RunBatched's layout over
  // `batch` products of this probe's x and w.
  using Runner = std::function<cublasStatus_t(int64_t m, void* y, cudaStream_t stream)>;
  Runner Of(PinnedGemm& gemm) {
    return [this, &gemm](int64_t m, void* y, cudaStream_t stream) {
      return gemm.RunBatched(x.get<bf16>(), batch * k, k, m, w.get<bf16>(), n * k, y, m * n, batch,
                             stream);
    };
  }
  // Microseconds of `run` at m as it runs in a decode step: inside a CUDA graph (no host launch
  // gaps, which at decode's m would be as long as the kernel), each run after up to 128 MB of the
  // scratch output `b` read, so that the weights come from DRAM, not from a warm L2, which would
  // favour the kernels that reread them (a read leaves no dirty lines whose write-back the timed
  // run would pay). The graph of the reads alone is timed once and taken off. Where a graph
  // cannot be captured, events around single runs on the legacy stream (host gaps included).
  double Microseconds(const Runner& run, int64_t m) {
    const int64_t half = static_cast<int64_t>(std::min(b.bytes(), size_t{128} << 20) / 2) & ~15;
    auto flush = [&](cudaStream_t s) {
      return CountDifferentWords(b.get(), b.get<unsigned char>() + half, half,
                                 count.get<unsigned long long>(), s) == cudaSuccess;
    };
    constexpr int kReps = 6;
    if (stream == nullptr && !graph_failed &&
        cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess) {
      cudaGetLastError();
      stream = nullptr, graph_failed = true;
    }
    if (!graph_failed) {
      // Equal halves: the read's cost does not depend on what SameBits left in `b` (differing
      // words cost the count's atomics), so the reads-alone graph timed once holds for every run.
      cudaMemsetAsync(b.get(), 0, static_cast<size_t>(2 * half), nullptr);
      cudaStreamSynchronize(nullptr);  // the probe's fills and checks ran on the legacy stream
      run(m, a.get(), stream);  // warm-up, and any one-time set-up outside the capture
      if (flush_only_ms < 0.0) flush_only_ms = GraphMilliseconds([&] { return flush(stream); },
                                                                 kReps, stream);
      const double with_run = GraphMilliseconds(
          [&] { return flush(stream) && run(m, a.get(), stream) == CUBLAS_STATUS_SUCCESS; }, kReps,
          stream);
      if (flush_only_ms >= 0.0 && with_run >= 0.0) {
        return std::max(0.0, 1e3 * (with_run - flush_only_ms) / kReps);
      }
      graph_failed = true;
    }
    run(m, a.get(), nullptr);
    double total = 0.0;
    for (int i = 0; i < 3; ++i) {
      flush(nullptr);
      total += MeanMilliseconds([&] { run(m, a.get(), nullptr); }, /*reps=*/1, /*warmups=*/0);
    }
    return 1e3 * total / 3;
  }
  ~GemmProbe() {
    if (stream != nullptr) cudaStreamDestroy(stream);
  }
  cudaStream_t stream = nullptr;  // the timing graphs' (created at the first timing)
  bool graph_failed = false;
  double flush_only_ms = -1.0;
  // Whether `candidate` gives `reference`'s bits at m. A fixed nonzero start for accumulating
  // outputs, so that the residual epilogue is compared too.
  cublasStatus_t SameBits(const Runner& reference, const Runner& candidate, int64_t m, bool* same) {
    const size_t bytes = OutBytes(m);
    cudaMemsetAsync(a.get(), 0x3c, bytes, nullptr);
    cudaMemsetAsync(b.get(), 0x3c, bytes, nullptr);
    ROLLOUT_RETURN_IF_FAILED(reference(m, a.get(), nullptr), CUBLAS_STATUS_SUCCESS);
    ROLLOUT_RETURN_IF_FAILED(candidate(m, b.get(), nullptr), CUBLAS_STATUS_SUCCESS);
    unsigned long long differ = 1;
    if (CountDifferentWords(a.get(), b.get(), static_cast<int64_t>(bytes),
                            count.get<unsigned long long>(), nullptr) != cudaSuccess ||
        cudaMemcpy(&differ, count.get(), sizeof(differ), cudaMemcpyDeviceToHost) != cudaSuccess) {
      return CUBLAS_STATUS_EXECUTION_FAILED;
    }
    *same = differ == 0;
    return CUBLAS_STATUS_SUCCESS;
  }
};

namespace {

cublasStatus_t HandStatus(cudaError_t err) {
  if (err == cudaSuccess) return CUBLAS_STATUS_SUCCESS;
  return err == cudaErrorInvalidValue ? CUBLAS_STATUS_INVALID_VALUE
                                      : CUBLAS_STATUS_EXECUTION_FAILED;
}

std::string RangeText(int64_t min_m, int64_t end_m) {
  return "[" + std::to_string(min_m) + ", " +
         (end_m == INT64_MAX ? std::string("inf") : std::to_string(end_m)) + ")";
}

}  // namespace

// How many of the heuristic's split-K-free algorithms BuildLadder times per range.
constexpr int kLadderCandidates = 16;

const std::vector<PinnedGemm::LadderRange>& PinnedGemm::Ladder() {
  static const std::vector<LadderRange> ladder = {{1, 1},     {8, 16},     {48, 64},
                                                  {160, 256}, {640, 1024}, {2560, 4096}};
  return ladder;
}

const std::vector<PinnedGemm::HandRange>& PinnedGemm::HandLadder() {
  // Whole m16 tiles, with the decode batches of docs/benchmarks.md (47, 95) among the
  // representatives: the cuBLASLt rung of [8, 48) is timed at 16 and is a poor choice at 47.
  static const std::vector<HandRange> ranges = {{1, 8, 1},      {8, 17, 16},     {17, 33, 32},
                                                {33, 49, 47},   {49, 65, 64},    {65, 97, 95},
                                                {97, 129, 128}, {129, 193, 192}, {193, 257, 256}};
  return ranges;
}

const PinnedGemm::Rung* PinnedGemm::For(int64_t m) const {
  for (const Rung& rung : rungs_) {
    if (m >= rung.min_m && m < rung.end_m) return rung.pin() ? nullptr : &rung;
  }
  return nullptr;
}

std::string PinnedGemm::Rung::Describe() const {
  if (hand) return SmallMGemmConfigs()[*hand].Name();
  if (pin()) return "the pin";
  const GemmAlgoInfo info = DescribeAlgo(gemm->algo_);
  return "algo tile " + std::to_string(info.tile) + " custom " + std::to_string(info.custom) +
         " cluster " + std::to_string(info.cluster);
}

int PinnedGemm::hand_rungs() const {
  return static_cast<int>(std::count_if(rungs_.begin(), rungs_.end(),
                                        [](const Rung& r) { return r.hand.has_value(); }));
}

std::string PinnedGemm::Describe() const {
  if (mode_ == Mode::kPinned) {
    std::string batching;
    if (max_batch_ > 1) {
      batching = batched_ ? " batched up to " + std::to_string(max_batch_)
                          : " (batches run one call per product)";
    }
    std::string ladder;
    for (const Rung& rung : rungs_) {
      ladder += "; m in " + RangeText(rung.min_m, rung.end_m) + ": " + rung.Describe();
    }
    return "pinned " + DescribeAlgo(algo_).ToString() + " workspace " +
           std::to_string(workspace_.bytes()) + batching +
           (rungs_.empty() ? "" : " (same bits, ladder" + ladder + ")") + ladder_note_;
  }
  return "not pinned: cuBLASLt heuristic per m, no workspace (like cublasGemmEx, workspace 0)";
}

std::string PinnedGemm::DescribeFor(int64_t m) const {
  const Rung* rung = For(m);
  return rung == nullptr ? std::string("pin") : rung->Describe();
}

cublasStatus_t PinnedGemm::RunHand(int config, const __nv_bfloat16* x, int64_t ldx, int64_t x_step,
                                   int64_t m, const __nv_bfloat16* w, int64_t w_step, void* y,
                                   int64_t y_step, int batch, cudaStream_t stream) const {
  return HandStatus(
      SmallMGemm(config, x, ldx, x_step, m, w, w_step, n_, k_, y, y_step, batch, output_, stream));
}

cublasStatus_t PinnedGemm::Admit(int64_t min_m, int64_t end_m, int64_t representative_m,
                                 const cublasLtMatmulAlgo_t& algo, GemmProbe& probe,
                                 std::unique_ptr<PinnedGemm>* admitted, std::string* diagnostics) {
  // A rung serves only its range: it is checked at the range's ends and middle (the pin at every
  // m). The largest m a slice can have is 65535 rows (CudaRunnerOptions caps max_batch_tokens).
  const int64_t last_m = std::min<int64_t>(end_m - 1, 65535);
  std::unique_ptr<PinnedGemm> rung;
  std::string why;
  if (CreateChecked(handle_, n_, k_, output_, algo, {min_m, representative_m, last_m}, &rung, &why,
                    max_batch_) != CUBLAS_STATUS_SUCCESS ||
      rung->batched() != batched()) {
    if (diagnostics != nullptr) *diagnostics += "    refused by the checks:\n" + why;
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  std::vector<int64_t> ms = {min_m, representative_m, end_m - 1};
  for (int64_t& m : ms) m = std::min(m, probe.max_m);
  for (int64_t m : ms) {
    bool same = false;
    ROLLOUT_RETURN_IF_FAILED(probe.SameBits(probe.Of(*this), probe.Of(*rung), m, &same),
                             CUBLAS_STATUS_SUCCESS);
    if (!same) {
      if (diagnostics != nullptr) {
        *diagnostics += "    " + DescribeAlgo(algo).ToString() +
                        ": other bits at m=" + std::to_string(m) + "\n";
      }
      return CUBLAS_STATUS_NOT_SUPPORTED;
    }
  }
  *admitted = std::move(rung);
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t PinnedGemm::AdmitHand(int64_t min_m, int64_t end_m, int64_t representative_m,
                                     int config, GemmProbe& probe, std::string* diagnostics) {
  const SmallMGemmConfig& c = SmallMGemmConfigs()[config];
  auto refuse = [&](const std::string& why) {
    if (diagnostics != nullptr) *diagnostics += "    " + c.Name() + ": " + why + "\n";
    return CUBLAS_STATUS_NOT_SUPPORTED;
  };
  if (end_m == INT64_MAX || end_m - 1 > c.max_m) {
    return refuse("serves m <= " + std::to_string(c.max_m));
  }
  if (k_ % 16 != 0) return refuse("k is not a multiple of 16");
  if (end_m - 1 > probe.max_m) {
    return refuse("the probe holds " + std::to_string(probe.max_m) + " rows only");
  }
  // This gemm's device (a rank's slice is admitted on its own): the rung's launches need it.
  if (PrepareSmallMGemm(config) != cudaSuccess) {
    cudaGetLastError();
    return refuse("its shared memory (" + std::to_string(c.SharedBytes()) + " bytes) refused");
  }
  GemmProbe::Runner hand = [&](int64_t m, void* y, cudaStream_t stream) {
    return RunHand(config, probe.x.get<bf16>(), probe.batch * k_, k_, m, probe.w.get<bf16>(),
                   n_ * k_, y, m * n_, probe.batch, stream);
  };
  for (int64_t m : {min_m, representative_m, end_m - 1}) {
    bool same = false;
    const cublasStatus_t status = probe.SameBits(probe.Of(*this), hand, m, &same);
    if (status == CUBLAS_STATUS_INVALID_VALUE) {
      cudaGetLastError();
      return refuse("refused by the launcher at m=" + std::to_string(m));
    }
    ROLLOUT_RETURN_IF_FAILED(status, CUBLAS_STATUS_SUCCESS);
    if (!same) return refuse("other bits at m=" + std::to_string(m));
  }
  return CUBLAS_STATUS_SUCCESS;
}

bool PinnedGemm::InitProbe(GemmProbe& probe) {
  const cudaError_t err = probe.Init(n_, k_, max_batch_, output_);
  if (err == cudaSuccess) return true;
  cudaGetLastError();  // an allocation failure is not sticky; clear it
  ladder_note_ = std::string(" (no ladder: its probe buffers: ") + cudaGetErrorString(err) + ")";
  return false;
}

cublasStatus_t PinnedGemm::BuildLadder(std::string* diagnostics, bool hand_kernels,
                                       int64_t step_m) {
  if (mode_ != Mode::kPinned) return CUBLAS_STATUS_INVALID_VALUE;
  rungs_.clear();
  GemmProbe probe;
  if (!InitProbe(probe)) return CUBLAS_STATUS_SUCCESS;
  const std::vector<LadderRange>& ladder = Ladder();
  for (size_t i = 0; i < ladder.size(); ++i) {
    const int64_t min_m = ladder[i].min_m;
    const int64_t end_m = i + 1 < ladder.size() ? ladder[i + 1].min_m : INT64_MAX;
    const int64_t rep = ladder[i].representative_m;
    // The m the candidates are asked for and timed at: the last range's at the step's m.
    const int64_t asked_m = i + 1 == ladder.size() ? std::max(rep, step_m) : rep;
    std::vector<cublasLtMatmulAlgo_t> algos;
    ROLLOUT_RETURN_IF_FAILED(
        Candidates(handle_, n_, k_, output_, asked_m, kLadderCandidates, &algos),
        CUBLAS_STATUS_SUCCESS);
    // The fastest admitted candidate at that m (as far as the probe reaches), if it beats the
    // pin there by 3%: which one wins is a matter of speed only, every candidate gives the pin's
    // bits.
    const int64_t timed_m = std::min(asked_m, probe.max_m);
    double best_us = 0.97 * probe.Microseconds(probe.Of(*this), timed_m);
    std::unique_ptr<PinnedGemm> best;
    std::string why;
    for (const cublasLtMatmulAlgo_t& algo : algos) {
      if (std::memcmp(&algo, &algo_, sizeof(algo)) == 0) continue;  // the pin itself
      std::unique_ptr<PinnedGemm> candidate;
      const cublasStatus_t status = Admit(min_m, end_m, rep, algo, probe, &candidate, &why);
      if (status == CUBLAS_STATUS_NOT_SUPPORTED) continue;
      ROLLOUT_RETURN_IF_FAILED(status, CUBLAS_STATUS_SUCCESS);
      const double us = probe.Microseconds(probe.Of(*candidate), timed_m);
      if (us < best_us) best_us = us, best = std::move(candidate);
    }
    const bool admitted = best != nullptr;
    if (admitted) rungs_.push_back(Rung{min_m, end_m, rep, std::move(best), std::nullopt});
    if (diagnostics != nullptr) {
      *diagnostics +=
          "  m in " + RangeText(min_m, end_m) + ": " +
          (admitted ? DescribeAlgo(rungs_.back().gemm->algo_).ToString() : std::string("the pin")) +
          "\n" + why;
    }
  }
  if (!hand_kernels) return CUBLAS_STATUS_SUCCESS;
  return BuildHandRungs(probe, diagnostics);
}

cublasStatus_t PinnedGemm::BuildHandRungs(GemmProbe& probe, std::string* diagnostics) {
  const std::vector<SmallMGemmConfig>& configs = SmallMGemmConfigs();
  std::vector<Rung> hand_rungs;
  for (const HandRange& range : HandLadder()) {
    // What serves the range without a hand rung (a cuBLASLt rung or the pin) is timed at the
    // range's ends and its representative m: a candidate takes the range only if it is no slower
    // at the representative m and 3% faster over the three (a rung timed at one m alone was seen
    // losing to the pin inside its own range).
    std::vector<int64_t> points;
    for (int64_t m : {range.min_m, range.representative_m, range.end_m - 1}) {
      m = std::min(m, probe.max_m);
      if (std::find(points.begin(), points.end(), m) == points.end()) points.push_back(m);
    }
    const int64_t rep = std::min(range.representative_m, probe.max_m);
    const Rung* serving = For(rep);
    const std::string serving_name = serving == nullptr ? "the pin" : serving->Describe();
    std::vector<double> serving_us;
    double serving_total = 0.0;
    std::string why;
    for (int64_t m : points) {
      const Rung* at = For(m);
      serving_us.push_back(probe.Microseconds(probe.Of(at == nullptr ? *this : *at->gemm), m));
      serving_total += serving_us.back();
    }
    if (diagnostics != nullptr) {
      why += std::string("    serving (") + (probe.graph_failed ? "events" : "graphs") + ") us:";
      for (double us : serving_us) why += " " + std::to_string(us);
      why += "\n";
    }
    double best_total = 0.97 * serving_total;
    std::optional<int> best;
    // The pin itself is a candidate too: a coarse cuBLASLt rung, timed at its own representative
    // m, can lose to the pin inside a finer range (the [8, 48) rung at m = 47).
    bool pin_best = false;
    if (serving != nullptr || For(points.front()) != nullptr || For(points.back()) != nullptr) {
      double total = 0.0;
      bool slower_somewhere = false;
      for (size_t i = 0; i < points.size(); ++i) {
        const double us = probe.Microseconds(probe.Of(*this), points[i]);
        total += us;
        slower_somewhere = slower_somewhere || (points[i] == rep && us > serving_us[i]);
      }
      if (!slower_somewhere && total < best_total) best_total = total, pin_best = true;
    }
    // Every configuration that covers the range.
    for (int c = 0; c < static_cast<int>(configs.size()); ++c) {
      if (configs[c].max_m < range.end_m - 1) continue;
      const cublasStatus_t status =
          AdmitHand(range.min_m, range.end_m, range.representative_m, c, probe, &why);
      if (status == CUBLAS_STATUS_NOT_SUPPORTED) continue;
      ROLLOUT_RETURN_IF_FAILED(status, CUBLAS_STATUS_SUCCESS);
      double total = 0.0;
      bool slower_somewhere = false;
      for (size_t i = 0; i < points.size(); ++i) {
        const double us = probe.Microseconds(
            [&](int64_t m, void* y, cudaStream_t stream) {
              return RunHand(c, probe.x.get<bf16>(), probe.batch * k_, k_, m, probe.w.get<bf16>(),
                             n_ * k_, y, m * n_, probe.batch, stream);
            },
            points[i]);
        total += us;
        slower_somewhere = slower_somewhere || (points[i] == rep && us > serving_us[i]);
        if (diagnostics != nullptr) {
          why += (i == 0 ? "    " + configs[c].Name() + " us:" : std::string()) + " " +
                 std::to_string(us) + (i + 1 == points.size() ? "\n" : "");
        }
      }
      if (!slower_somewhere && total < best_total) best_total = total, best = c, pin_best = false;
    }
    if (diagnostics != nullptr) {
      std::string chosen;
      if (best) {
        chosen = configs[*best].Name() + " (over " + serving_name + ")";
      } else if (pin_best) {
        chosen = "the pin (over " + serving_name + ")";
      } else {
        chosen = serving_name + " (nothing beats it by 3% over the range's ends and middle)";
      }
      *diagnostics += "  m in " + RangeText(range.min_m, range.end_m) + ": " + chosen + "\n" + why;
    }
    if (best || pin_best) {
      // A pin rung (no gemm, no hand configuration) sends its range back to the pin.
      hand_rungs.push_back(Rung{range.min_m, range.end_m, range.representative_m, nullptr, best});
    }
  }
  // Hand rungs first: For() takes the first rung whose range holds m.
  rungs_.insert(rungs_.begin(), std::make_move_iterator(hand_rungs.begin()),
                std::make_move_iterator(hand_rungs.end()));
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t PinnedGemm::CopyLadder(const PinnedGemm& from, std::string* diagnostics) {
  if (mode_ != Mode::kPinned || from.k_ != k_) return CUBLAS_STATUS_INVALID_VALUE;
  rungs_.clear();
  if (from.rungs_.empty()) return CUBLAS_STATUS_SUCCESS;
  GemmProbe probe;
  if (!InitProbe(probe)) return CUBLAS_STATUS_SUCCESS;
  for (const Rung& rung : from.rungs_) {
    Rung copy{rung.min_m, rung.end_m, rung.representative_m, nullptr, rung.hand};
    if (rung.pin()) {
      rungs_.push_back(std::move(copy));
      continue;
    }
    const cublasStatus_t status = rung.hand
                                      ? AdmitHand(rung.min_m, rung.end_m, rung.representative_m,
                                                  *rung.hand, probe, diagnostics)
                                      : Admit(rung.min_m, rung.end_m, rung.representative_m,
                                              rung.gemm->algo_, probe, &copy.gemm, diagnostics);
    if (status == CUBLAS_STATUS_SUCCESS) {
      rungs_.push_back(std::move(copy));
    } else if (status != CUBLAS_STATUS_NOT_SUPPORTED) {
      return status;
    }
  }
  return CUBLAS_STATUS_SUCCESS;
}

}  // namespace rollout::cuda
