// CudaModelRunner's GEMMs: one cuBLASLt algorithm pinned per weight shape (kernels/cuda/gemm.h),
// for the unsharded model or for every rank's slice of the canonical K tree's shapes.
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/cuda_status.h"
#include "common/status.h"
#include "glog/logging.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/numerics.h"
#include "kernels/cuda/tensor_parallel.h"
#include "runner/cuda/cuda_model_runner.h"
#include "runner/cuda/cuda_runner_state.h"

namespace rollout {

using cuda_runner_internal::RankState;

absl::Status CudaModelRunner::PinGemms() {
  const ModelConfig& c = config_;
  State& s = *state_;
  RankState& rk = s.ranks[0];
  const int64_t h = c.hidden_size, hd = c.head_dim, nh = c.num_attention_heads,
                nkv = c.num_key_value_heads, inter = c.intermediate_size, vocab = c.vocab_size;
  const int64_t pin_m = options_.gemm_pin_m;
  struct GemmSpec {
    const char* name;
    int64_t n, k;
    cuda::GemmOutput output;
    std::unique_ptr<cuda::PinnedGemm>* gemm;
  };
  for (const GemmSpec& g : std::vector<GemmSpec>{
           {"qkv", (nh + 2 * nkv) * hd, h, cuda::GemmOutput::kF32, &rk.gemm_qkv},
           {"o", h, nh * hd, cuda::GemmOutput::kF32Accumulate, &rk.gemm_o},
           {"gate_up", 2 * inter, h, cuda::GemmOutput::kBf16, &rk.gemm_gate_up},
           {"down", h, inter, cuda::GemmOutput::kF32Accumulate, &rk.gemm_down},
           {"lm_head", vocab, h, cuda::GemmOutput::kF32, &rk.gemm_lm_head},
       }) {
    std::string why = "gemm_pin_m <= 0 asks for the heuristic";
    if (pin_m <= 0 || cuda::PinnedGemm::Create(s.lt.get(), g.n, g.k, g.output, pin_m, g.gemm,
                                               &why) != CUBLAS_STATUS_SUCCESS) {
      if (pin_m > 0) {
        LOG(WARNING) << absl::StrFormat(
            "no split-K-free cuBLASLt algorithm could be pinned for %s [%d x %d]; using the "
            "no-workspace heuristic per m (tests/gpu/gemm_test.cc checks its row invariance):\n%s",
            g.name, g.n, g.k, why);
      }
      ROLLOUT_RETURN_IF_ERROR(
          CublasError(cuda::PinnedGemm::CreateHeuristic(s.lt.get(), g.n, g.k, g.output, g.gemm),
                      absl::StrCat("creating the GEMM for ", g.name)));
    } else if (options_.gemm_ladder) {
      ROLLOUT_RETURN_IF_ERROR(CublasError(
          (*g.gemm)->BuildLadder(nullptr, options_.gemm_hand_kernels, options_.max_batch_tokens),
          absl::StrCat("the GEMM ladder for ", g.name)));
    }
    s.gemm_descriptions.push_back(
        absl::StrFormat("%-8s n=%-6d k=%-6d %s", g.name, g.n, g.k, (*g.gemm)->Describe()));
    s.pin_lines.push_back(cuda::DescribePin(g.name, **g.gemm));
  }
  return absl::OkStatus();
}

// The canonical K tree's GEMMs, every rank's: a column-parallel GEMM runs, on the rank's slice,
// the algorithm pinned for the full weight's shape (so every output column has the bits of the
// unsliced GEMM); o_proj and down_proj are [hidden, K / 8] segment GEMMs, one algorithm pinned
// per segment shape -- the same pins at every degree. No heuristic fallback: an algorithm
// chosen per slice shape could differ between degrees.
absl::Status CudaModelRunner::PinCanonicalGemms() {
  const ModelConfig& c = config_;
  State& s = *state_;
  const int64_t h = c.hidden_size, hd = c.head_dim, nh = c.num_attention_heads,
                nkv = c.num_key_value_heads, inter = c.intermediate_size, vocab = c.vocab_size;
  using Member = std::unique_ptr<cuda::PinnedGemm> RankState::*;
  struct GemmSpec {
    const char* name;
    const char* contract_name;  // in ServerInfo.numerics.gemm_algorithms
    int64_t n, k;  // the shape pinned
    cuda::GemmOutput output;
    Member gemm;
    std::function<int64_t(const RankState&)> rank_n;  // the rank's slice of n
    int max_batch;                                    // leaves per RunBatched call
  };
  const int64_t seg_o = nh * hd / cuda::kNumKSegments, seg_down = inter / cuda::kNumKSegments;
  const std::vector<GemmSpec> specs = {
      {"qkv", "qkv", (nh + 2 * nkv) * hd, h, cuda::GemmOutput::kF32, &RankState::gemm_qkv,
       [hd](const RankState& rk) { return (rk.heads + 2 * rk.kv_heads) * hd; }, 1},
      {"o leaf", "o", h, seg_o, cuda::GemmOutput::kF32, &RankState::gemm_o,
       [h](const RankState&) { return h; }, cuda::kNumKSegments},
      {"gate_up", "gate_up", 2 * inter, h, cuda::GemmOutput::kBf16, &RankState::gemm_gate_up,
       [](const RankState& rk) { return 2 * rk.inter; }, 1},
      {"downleaf", "down", h, seg_down, cuda::GemmOutput::kF32, &RankState::gemm_down,
       [h](const RankState&) { return h; }, cuda::kNumKSegments},
      {"lm_head", "lm_head", vocab, h, cuda::GemmOutput::kF32, &RankState::gemm_lm_head,
       [&s](const RankState&) { return s.vocab_rows; }, 1},
  };
  for (const GemmSpec& g : specs) {
    std::unique_ptr<cuda::PinnedGemm> full;
    std::string why;
    // The leaves run batched: the ladder is built (and probed) on the batched full shape.
    if (cuda::PinnedGemm::Create(s.lt.get(), g.n, g.k, g.output, options_.gemm_pin_m, &full, &why,
                                 g.max_batch) != CUBLAS_STATUS_SUCCESS) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "no split-K-free cuBLASLt algorithm could be pinned for %s [%d x %d], which the "
          "canonical K tree (tensor parallelism) needs:\n%s",
          g.name, g.n, g.k, why));
    }
    if (options_.gemm_ladder) {
      ROLLOUT_RETURN_IF_ERROR(CublasError(
          full->BuildLadder(nullptr, options_.gemm_hand_kernels, options_.max_batch_tokens),
          absl::StrCat("the GEMM ladder for ", g.name)));
    }
    s.pin_lines.push_back(cuda::DescribePin(g.contract_name, *full));
    for (RankState& rk : s.ranks) {
      const int64_t n = g.rank_n(rk);
      why.clear();
      ROLLOUT_RETURN_IF_ERROR(s.SetDevice(rk));
      if (cuda::PinnedGemm::CreateWithAlgo(rk.lt, n, g.k, g.output, full->algo(), &(rk.*g.gemm),
                                           &why, g.max_batch) != CUBLAS_STATUS_SUCCESS) {
        return absl::FailedPreconditionError(absl::StrFormat(
            "the algorithm pinned for %s [%d x %d] does not run rank %d's slice [%d x %d]:\n%s",
            g.name, g.n, g.k, rk.index, n, g.k, why));
      }
      if (options_.gemm_ladder) {
        ROLLOUT_RETURN_IF_ERROR(CublasError((rk.*g.gemm)->CopyLadder(*full),
                                            absl::StrCat("the GEMM ladder for ", g.name)));
      }
    }
    ROLLOUT_RETURN_IF_ERROR(s.SetDevice(s.ranks[0]));
    const int64_t slice = g.rank_n(s.ranks[0]);
    s.gemm_descriptions.push_back(absl::StrFormat(
        "%-8s n=%-6d k=%-6d %s%s", g.name, g.n, g.k, (s.ranks[0].*g.gemm)->Describe(),
        slice != g.n ? absl::StrFormat(" (rank slices n=%d)", slice) : ""));
  }
  return absl::OkStatus();
}

// A MoE model's router GEMM: logits [tokens, num_experts] fp32, pinned like the others (its rows
// must not depend on the batch either: routing reads them). TP 1 only (CheckSupported). The
// expert GEMMs are kernels/cuda/moe.h's, no cuBLASLt.
absl::Status CudaModelRunner::PinMoeGemms() {
  const ModelConfig& c = config_;
  State& s = *state_;
  if (!c.is_moe()) return absl::OkStatus();
  RankState& rk = s.ranks[0];
  const int64_t n = c.num_experts, k = c.hidden_size;
  std::string why = "gemm_pin_m <= 0 asks for the heuristic";
  if (options_.gemm_pin_m <= 0 ||
      cuda::PinnedGemm::Create(s.lt.get(), n, k, cuda::GemmOutput::kF32, options_.gemm_pin_m,
                               &rk.gemm_router, &why) != CUBLAS_STATUS_SUCCESS) {
    if (options_.gemm_pin_m > 0) {
      LOG(WARNING) << absl::StrFormat(
          "no split-K-free cuBLASLt algorithm could be pinned for router [%d x %d]; using the "
          "no-workspace heuristic per m:\n%s",
          n, k, why);
    }
    ROLLOUT_RETURN_IF_ERROR(
        CublasError(cuda::PinnedGemm::CreateHeuristic(s.lt.get(), n, k, cuda::GemmOutput::kF32,
                                                      &rk.gemm_router),
                    "creating the GEMM for router"));
  } else if (options_.gemm_ladder) {
    ROLLOUT_RETURN_IF_ERROR(CublasError(
        rk.gemm_router->BuildLadder(nullptr, options_.gemm_hand_kernels, options_.max_batch_tokens),
        "the GEMM ladder for router"));
  }
  s.gemm_descriptions.push_back(
      absl::StrFormat("%-8s n=%-6d k=%-6d %s", "router", n, k, rk.gemm_router->Describe()));
  s.pin_lines.push_back(cuda::DescribePin("router", *rk.gemm_router));
  return absl::OkStatus();
}

}  // namespace rollout
