#pragma once

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kernels/cuda/device_buffer.h"

// Row-invariant GEMMs for the projections: y[m, n] = x[m, k] . w[n, k]^T, bf16 in, fp32
// accumulation, one cuBLASLt algorithm per weight shape chosen once and used for every m.
//
// Why one algorithm: each output row must come out of the same sequence of operations whatever
// m is (docs/determinism.md, "How the CUDA backend keeps it"). cuBLAS promises nothing about m; its
// heuristics change kernels with m, and a split-K kernel reduces K in an m-dependent way. A pinned
// algorithm with split-K 1 and no reduction scheme walks K in one fixed order per output element;
// tests/gpu/gemm_test.cc checks every row bitwise for m = 1..512 and larger powers of two on every
// weight shape.
//
// The ladder: the pin's bits, faster. Other split-K-free algorithms may walk K in the same order
// with other tiles (on the H200 with CUDA 13, every Hopper kernel cuBLASLt offers for these
// shapes does: `rollout-gemm-sweep --equivalence`), and so does a hand-written mma.sync kernel
// that adds the k16 chunks of K in increasing order into one accumulator per element
// (small_m_gemm.h: full K per CTA, many CTAs at small m). BuildLadder picks, for ranges of m, the
// fastest of the heuristic's algorithms for that range and of the hand kernel's configurations
// that serve it, among those that give the pin's bits on a random probe at the range's ends and
// middle (timed at load; the pin when none beats it); Run then uses the rung of m's range.
// The bits stay the pin's -- the probe is the admission test, gemm_test and small_m_gemm_test
// the proof over m.
namespace rollout::cuda {

inline constexpr size_t kMaxPinnedWorkspace = 1 << 20;

struct GemmProbe;  // gemm_ladder.cc: the ladder's admission test

enum class GemmOutput {
  kBf16,           // y bf16, overwritten
  kF32,            // y fp32, overwritten
  kF32Accumulate,  // y fp32, y += x . w^T (the residual add, fused into the epilogue)
};

// Human-readable identity of a cuBLASLt algorithm configuration.
struct GemmAlgoInfo {
  int32_t id = 0;
  uint32_t tile = 0;
  uint32_t stages = 0;
  int32_t split_k = 1;
  uint32_t reduction = 0;
  uint32_t swizzle = 0;
  uint32_t custom = 0;
  uint16_t cluster = 0;
  std::string ToString() const;
};
GemmAlgoInfo DescribeAlgo(const cublasLtMatmulAlgo_t& algo);

// A GEMM with a fixed weight shape [n, k] and its pinned algorithm. One thread at a time
// (the runner's); the handle must outlive it. REQUIRES: pointers 256-byte aligned.
class PinnedGemm {
 public:
  enum class Mode {
    kPinned,                // one algorithm for every m
    kHeuristicNoWorkspace,  // fallback: the no-workspace heuristic's pick per m (cached); what
                            // measured row-invariant through cublasGemmEx (docs/cuda.md)
  };

  // Asks cuBLASLt's heuristic (no workspace) for algorithms for m = pin_m and pins the first
  // with split-K 1 and no reduction scheme that also passes cublasLtMatmulAlgoCheck for m in
  // {1, 7, 64, 1000, 8192, 65535} with at most kMaxPinnedWorkspace of workspace. (On the H200
  // with CUDA 13 the Hopper kernels ask for 4 bytes beyond m = 256 or so -- a tile-scheduler
  // counter, not a split: split-K stays 1; the row-invariance test is the proof.) The gemm
  // owns that workspace. The choice is a pure function of (GPU model,
  // cuBLAS version, shape, output, pin_m): restarts and replicas pin the same algorithm.
  // `diagnostics` (optional) receives why each candidate was refused.
  // max_batch: as for CreateWithAlgo (the batched checks never change which algorithm is pinned).
  static cublasStatus_t Create(cublasLtHandle_t handle, int64_t n, int64_t k, GemmOutput output,
                               int64_t pin_m, std::unique_ptr<PinnedGemm>* gemm,
                               std::string* diagnostics = nullptr, int max_batch = 1);
  // The same with an explicit algorithm: benchmarks, and tensor parallelism, where a rank's
  // slice [n / tp, k] of a column-parallel weight runs the algorithm pinned for the full [n, k]
  // (so every output column has the bits of the unsliced GEMM's; tests/gpu/tp_test.cc proves it)
  // and every K segment runs the one algorithm of its shape. max_batch > 1: RunBatched will be
  // called with up to that many products; the algorithm is also checked (and the workspace sized)
  // for batched layouts of 2, 4, ... max_batch products, and when any check fails RunBatched
  // runs the products one call each instead -- a choice fixed here, a function of (GPU model,
  // cuBLAS version, shape, algorithm, max_batch) like the pin itself.
  static cublasStatus_t CreateWithAlgo(cublasLtHandle_t handle, int64_t n, int64_t k,
                                       GemmOutput output, const cublasLtMatmulAlgo_t& algo,
                                       std::unique_ptr<PinnedGemm>* gemm,
                                       std::string* diagnostics = nullptr, int max_batch = 1);
  // Builds the ladder (see the top of this file) for a kPinned gemm: for each range of m in
  // Ladder(), of the heuristic's first 16 split-K-free algorithms for the range's representative
  // m, those that pass CreateWithAlgo's checks at the range's ends and representative m (with
  // this gemm's max_batch; a rung serves its range only) and give this gemm's bits on the probe
  // (RunBatched over max_batch products, random inputs, m at the range's ends and middle) are timed
  // at that m; the fastest becomes the range's rung if it beats the pin by 3%. Ranges without one
  // keep the pin. Then, when hand_kernels, for each finer range of HandLadder() (m <= 256) the
  // hand kernel's configurations of the smallest max_m that covers it (small_m_gemm.h; k a
  // multiple of 16) that give this gemm's bits on the same probe are timed at the range's ends
  // and representative m against what serves each of those m so far (a cuBLASLt rung or the
  // pin; L2 flushed before each timed run); the fastest over the three becomes a hand rung over
  // the range if it is no slower at the representative m and 3% faster over the three. The pin
  // competes too: where it wins, the range goes back to it (a coarse rung timed at one m can lose
  // to the pin elsewhere in its range). Without hand rungs the ladder is the cuBLASLt one alone.
  // Allocates (and frees) probe buffers of up to ~3.3 GiB (lm_head); without the memory, no ladder
  // (Describe says so). `diagnostics` receives one line per range. step_m: the largest m a step
  // runs (the runner's max_batch_tokens); where it passes the last range's representative, that
  // range is asked and timed there (as far as the probe reaches): prefill runs its steps at that m,
  // and a rung timed at 4096 was admitted in one run and not in the next while it was 14% faster at
  // 16384 (qkv, an H100, session 21).
  cublasStatus_t BuildLadder(std::string* diagnostics = nullptr, bool hand_kernels = true,
                             int64_t step_m = 0);
  // The same rungs as `from`'s (a gemm of another n with the same k and pin: a rank's slice of a
  // column-parallel weight), each admitted again by the probe on this gemm's shape.
  cublasStatus_t CopyLadder(const PinnedGemm& from, std::string* diagnostics = nullptr);
  // The ranges of m BuildLadder considers: [min_m, next range's min_m), the heuristic asked at
  // representative_m.
  struct LadderRange {
    int64_t min_m;
    int64_t representative_m;
  };
  static const std::vector<LadderRange>& Ladder();
  // The ranges [min_m, end_m) BuildLadder offers the hand kernel, timed at representative_m.
  struct HandRange {
    int64_t min_m;
    int64_t end_m;
    int64_t representative_m;
  };
  static const std::vector<HandRange>& HandLadder();

  // The kHeuristicNoWorkspace fallback.
  static cublasStatus_t CreateHeuristic(cublasLtHandle_t handle, int64_t n, int64_t k,
                                        GemmOutput output, std::unique_ptr<PinnedGemm>* gemm);
  // Up to `max_results` heuristic algorithms for m that have split-K 1 and no reduction scheme.
  static cublasStatus_t Candidates(cublasLtHandle_t handle, int64_t n, int64_t k, GemmOutput output,
                                   int64_t m, int max_results,
                                   std::vector<cublasLtMatmulAlgo_t>* algos,
                                   std::string* diagnostics = nullptr);

  ~PinnedGemm();
  PinnedGemm(const PinnedGemm&) = delete;
  PinnedGemm& operator=(const PinnedGemm&) = delete;

  // x: [m, k] bf16; w: [n, k] bf16; y: [m, n] (bf16 or fp32 per output()).
  cublasStatus_t Run(const __nv_bfloat16* x, int64_t m, const __nv_bfloat16* w, void* y,
                     cudaStream_t stream);
  // `batch` products y_b = x_b . w_b^T, b = 0 .. batch - 1: x_b = x + b * x_step, [m, k] with
  // rows ldx elements apart (ldx >= k: a column block of a wider matrix); w_b = w + b * w_step,
  // [n, k]; y_b = y + b * y_step, [m, n] (offsets in elements). Each product gets the bits Run
  // gives it alone (tests/gpu/tp_test.cc). One cuBLASLt call when batching passed the checks at
  // creation, else one per product. REQUIRES: kPinned; batch <= the max_batch of creation;
  // x_b, w_b, y_b 16-byte aligned and ldx a multiple of 8.
  cublasStatus_t RunBatched(const __nv_bfloat16* x, int64_t ldx, int64_t x_step, int64_t m,
                            const __nv_bfloat16* w, int64_t w_step, void* y, int64_t y_step,
                            int batch, cudaStream_t stream);

  int64_t n() const { return n_; }
  int64_t k() const { return k_; }
  GemmOutput output() const { return output_; }
  Mode mode() const { return mode_; }
  const cublasLtMatmulAlgo_t& algo() const { return algo_; }  // kPinned only
  // Whether RunBatched runs its products in one call (see CreateWithAlgo).
  bool batched() const { return max_batch_ > 1 && batched_; }
  std::string Describe() const;
  // What serves m: "pin", a cuBLASLt rung's "algo ..." or a hand rung's "hand n32 m16 ...".
  std::string DescribeFor(int64_t m) const;
  // Number of rungs admitted (0 without a ladder), and of those the hand kernel's.
  int rungs() const { return static_cast<int>(rungs_.size()); }
  int hand_rungs() const;

 private:
  PinnedGemm(cublasLtHandle_t handle, int64_t n, int64_t k, GemmOutput output)
      : handle_(handle), n_(n), k_(k), output_(output) {}

  const cublasLtHandle_t handle_;
  const int64_t n_;
  const int64_t k_;
  const GemmOutput output_;
  Mode mode_ = Mode::kPinned;
  cublasLtMatmulDesc_t desc_ = nullptr;
  cublasLtMatmulAlgo_t algo_{};
  int max_batch_ = 1;
  bool batched_ = false;
  DeviceBuffer workspace_;  // kPinned: what the algorithm asks for at the largest m checked
  std::map<int64_t, cublasLtMatmulAlgo_t> per_m_;  // kHeuristicNoWorkspace: m -> its algorithm

  // The ladder: a rung serves m in [min_m, end_m); the hand rungs first (increasing min_m), then
  // the cuBLASLt rungs (increasing min_m), whose ranges may hold a hand rung's: the first rung
  // that holds m serves it. Empty: the pin serves every m.
  struct Rung {
    int64_t min_m;
    int64_t end_m;                     // exclusive; INT64_MAX for the last range
    int64_t representative_m;          // where the range's candidates were timed
    std::unique_ptr<PinnedGemm> gemm;  // a cuBLASLt rung; null for a hand rung
    std::optional<int> hand;           // a hand rung: its index in SmallMGemmConfigs()
    // Neither: a finer range given back to the pin, which beat the coarse rung there.
    bool pin() const { return gemm == nullptr && !hand; }
    std::string Describe() const;
  };
  std::vector<Rung> rungs_;
  std::string ladder_note_;  // why there is no ladder, when the probe could not run
  // The rung serving m, or nullptr (the pin).
  const Rung* For(int64_t m) const;
  // The hand kernel of configuration `config` on this gemm's shape and output.
  cublasStatus_t RunHand(int config, const __nv_bfloat16* x, int64_t ldx, int64_t x_step, int64_t m,
                         const __nv_bfloat16* w, int64_t w_step, void* y, int64_t y_step, int batch,
                         cudaStream_t stream) const;
  // Allocates the probe; on failure (no memory) notes it and returns false: no ladder.
  bool InitProbe(GemmProbe& probe);
  // CreateWithAlgo with cublasLtMatmulAlgoCheck asked at the m of check_ms only (batched: those
  // up to 8192).
  static cublasStatus_t CreateChecked(cublasLtHandle_t handle, int64_t n, int64_t k,
                                      GemmOutput output, const cublasLtMatmulAlgo_t& algo,
                                      const std::vector<int64_t>& check_ms,
                                      std::unique_ptr<PinnedGemm>* gemm, std::string* diagnostics,
                                      int max_batch);
  // A gemm of `algo` for [min_m, end_m) if it passes the checks at the range's ends and
  // representative m and gives this gemm's bits on the probe; else CUBLAS_STATUS_NOT_SUPPORTED.
  cublasStatus_t Admit(int64_t min_m, int64_t end_m, int64_t representative_m,
                       const cublasLtMatmulAlgo_t& algo, GemmProbe& probe,
                       std::unique_ptr<PinnedGemm>* admitted, std::string* diagnostics);
  // BuildLadder's second part: hand rungs over HandLadder()'s ranges, before the cuBLASLt rungs.
  cublasStatus_t BuildHandRungs(GemmProbe& probe, std::string* diagnostics);
  // Whether hand-kernel configuration `config` serves [min_m, end_m) with this gemm's bits on the
  // probe (CUBLAS_STATUS_NOT_SUPPORTED when not).
  cublasStatus_t AdmitHand(int64_t min_m, int64_t end_m, int64_t representative_m, int config,
                           GemmProbe& probe, std::string* diagnostics);
};

const char* CublasStatusName(cublasStatus_t status);

}  // namespace rollout::cuda
