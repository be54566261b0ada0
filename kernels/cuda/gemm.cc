// PinnedGemm (kernels/cuda/gemm.h): the pin -- one split-K-free cuBLASLt algorithm per weight
// shape -- and the calls (Run, RunBatched). The ladder of faster rungs that give the pin's bits,
// its probe and Describe: gemm_ladder.cc.
#include "kernels/cuda/gemm.h"

#include <algorithm>
#include <cstdio>
#include <utility>

#include "common/status.h"

namespace rollout::cuda {
namespace {

cudaDataType_t OutputType(GemmOutput output) {
  return output == GemmOutput::kBf16 ? CUDA_R_16BF : CUDA_R_32F;
}

// The layouts of one call in cuBLAS's column-major view: D^T [n, m] = W^T' [n, k] . X^T [k, m],
// i.e. A = w (k x n, ld k, transposed), B = x (k x m, ld k), C = D = y (n x m, ld n).
struct Layouts {
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  ~Layouts() {
    if (a != nullptr) cublasLtMatrixLayoutDestroy(a);
    if (b != nullptr) cublasLtMatrixLayoutDestroy(b);
    if (c != nullptr) cublasLtMatrixLayoutDestroy(c);
  }
  cublasStatus_t Init(int64_t m, int64_t n, int64_t k, GemmOutput output) {
    ROLLOUT_RETURN_IF_FAILED(cublasLtMatrixLayoutCreate(&a, CUDA_R_16BF, k, n, k),
                             CUBLAS_STATUS_SUCCESS);
    ROLLOUT_RETURN_IF_FAILED(cublasLtMatrixLayoutCreate(&b, CUDA_R_16BF, k, m, k),
                             CUBLAS_STATUS_SUCCESS);
    return cublasLtMatrixLayoutCreate(&c, OutputType(output), n, m, n);
  }
  // x rows ldx apart, and `batch` products with these element strides between them.
  cublasStatus_t InitBatched(int64_t m, int64_t n, int64_t k, GemmOutput output, int64_t ldx,
                             int batch, int64_t x_step, int64_t w_step, int64_t y_step) {
    ROLLOUT_RETURN_IF_FAILED(cublasLtMatrixLayoutCreate(&a, CUDA_R_16BF, k, n, k),
                             CUBLAS_STATUS_SUCCESS);
    ROLLOUT_RETURN_IF_FAILED(cublasLtMatrixLayoutCreate(&b, CUDA_R_16BF, k, m, ldx),
                             CUBLAS_STATUS_SUCCESS);
    ROLLOUT_RETURN_IF_FAILED(cublasLtMatrixLayoutCreate(&c, OutputType(output), n, m, n),
                             CUBLAS_STATUS_SUCCESS);
    if (batch == 1) return CUBLAS_STATUS_SUCCESS;
    const int32_t count = batch;
    const std::pair<cublasLtMatrixLayout_t, int64_t> strided[] = {
        {a, w_step}, {b, x_step}, {c, y_step}};
    for (const auto& [layout, step] : strided) {
      ROLLOUT_RETURN_IF_FAILED(
          cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count,
                                           sizeof(count)),
          CUBLAS_STATUS_SUCCESS);
      ROLLOUT_RETURN_IF_FAILED(
          cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                                           &step, sizeof(step)),
          CUBLAS_STATUS_SUCCESS);
    }
    return CUBLAS_STATUS_SUCCESS;
  }
};

cublasStatus_t CreateDesc(cublasLtMatmulDesc_t* desc) {
  ROLLOUT_RETURN_IF_FAILED(cublasLtMatmulDescCreate(desc, CUBLAS_COMPUTE_32F, CUDA_R_32F),
                           CUBLAS_STATUS_SUCCESS);
  const cublasOperation_t transa = CUBLAS_OP_T, transb = CUBLAS_OP_N;
  ROLLOUT_RETURN_IF_FAILED(
      cublasLtMatmulDescSetAttribute(*desc, CUBLASLT_MATMUL_DESC_TRANSA, &transa, sizeof(transa)),
      CUBLAS_STATUS_SUCCESS);
  return cublasLtMatmulDescSetAttribute(*desc, CUBLASLT_MATMUL_DESC_TRANSB, &transb,
                                        sizeof(transb));
}

template <typename T>
T ConfigAttr(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoConfigAttributes_t attr) {
  T value{};
  size_t written = 0;
  cublasLtMatmulAlgoConfigGetAttribute(&algo, attr, &value, sizeof(value), &written);
  return value;
}

bool IsSingleSplit(const cublasLtMatmulAlgo_t& algo) {
  const GemmAlgoInfo info = DescribeAlgo(algo);
  return info.split_k <= 1 && info.reduction == CUBLASLT_REDUCTION_SCHEME_NONE;
}

}  // namespace

GemmAlgoInfo DescribeAlgo(const cublasLtMatmulAlgo_t& algo) {
  GemmAlgoInfo info;
  info.id = ConfigAttr<int32_t>(algo, CUBLASLT_ALGO_CONFIG_ID);
  info.tile = ConfigAttr<uint32_t>(algo, CUBLASLT_ALGO_CONFIG_TILE_ID);
  info.stages = ConfigAttr<uint32_t>(algo, CUBLASLT_ALGO_CONFIG_STAGES_ID);
  info.split_k = ConfigAttr<int32_t>(algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM);
  info.reduction = ConfigAttr<uint32_t>(algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME);
  info.swizzle = ConfigAttr<uint32_t>(algo, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING);
  info.custom = ConfigAttr<uint32_t>(algo, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION);
  info.cluster = ConfigAttr<uint16_t>(algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID);
  return info;
}

std::string GemmAlgoInfo::ToString() const {
  char buf[160];
  std::snprintf(buf, sizeof(buf),
                "algo %d tile %u stages %u split_k %d reduction %u swizzle %u custom %u "
                "cluster %u",
                id, tile, stages, split_k, reduction, swizzle, custom, cluster);
  return buf;
}

cublasStatus_t PinnedGemm::Candidates(cublasLtHandle_t handle, int64_t n, int64_t k,
                                      GemmOutput output, int64_t m, int max_results,
                                      std::vector<cublasLtMatmulAlgo_t>* algos,
                                      std::string* diagnostics) {
  algos->clear();
  cublasLtMatmulDesc_t desc = nullptr;
  ROLLOUT_RETURN_IF_FAILED(CreateDesc(&desc), CUBLAS_STATUS_SUCCESS);
  Layouts layouts;
  cublasStatus_t status = layouts.Init(m, n, k, output);
  cublasLtMatmulPreference_t pref = nullptr;
  if (status == CUBLAS_STATUS_SUCCESS) status = cublasLtMatmulPreferenceCreate(&pref);
  const uint64_t workspace = 0;
  const uint32_t reduction_mask = CUBLASLT_REDUCTION_SCHEME_NONE;
  if (status == CUBLAS_STATUS_SUCCESS) {
    status = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                  &workspace, sizeof(workspace));
  }
  if (status == CUBLAS_STATUS_SUCCESS) {
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
                                         &reduction_mask, sizeof(reduction_mask));
  }
  std::vector<cublasLtMatmulHeuristicResult_t> results(32);
  int found = 0;
  if (status == CUBLAS_STATUS_SUCCESS) {
    status = cublasLtMatmulAlgoGetHeuristic(handle, desc, layouts.a, layouts.b, layouts.c,
                                            layouts.c, pref, static_cast<int>(results.size()),
                                            results.data(), &found);
  }
  if (status == CUBLAS_STATUS_SUCCESS && found == 0) {
    // Some versions read a mask of NONE alone as "nothing"; ask without it and filter here.
    const uint32_t all = CUBLASLT_REDUCTION_SCHEME_MASK;
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &all,
                                         sizeof(all));
    status = cublasLtMatmulAlgoGetHeuristic(handle, desc, layouts.a, layouts.b, layouts.c,
                                            layouts.c, pref, static_cast<int>(results.size()),
                                            results.data(), &found);
  }
  for (int i = 0; i < found && static_cast<int>(algos->size()) < max_results; ++i) {
    if (diagnostics != nullptr) {
      *diagnostics += "  heuristic " + std::to_string(i) + ": " +
                      DescribeAlgo(results[i].algo).ToString() + " state " +
                      CublasStatusName(results[i].state) + " workspace " +
                      std::to_string(results[i].workspaceSize) + "\n";
    }
    if (results[i].state == CUBLAS_STATUS_SUCCESS && IsSingleSplit(results[i].algo)) {
      algos->push_back(results[i].algo);
    }
  }
  if (pref != nullptr) cublasLtMatmulPreferenceDestroy(pref);
  cublasLtMatmulDescDestroy(desc);
  return status;
}

cublasStatus_t PinnedGemm::CreateWithAlgo(cublasLtHandle_t handle, int64_t n, int64_t k,
                                          GemmOutput output, const cublasLtMatmulAlgo_t& algo,
                                          std::unique_ptr<PinnedGemm>* gemm,
                                          std::string* diagnostics, int max_batch) {
  return CreateChecked(handle, n, k, output, algo, {1, 7, 64, 1000, 8192, 65535}, gemm, diagnostics,
                       max_batch);
}

cublasStatus_t PinnedGemm::CreateChecked(cublasLtHandle_t handle, int64_t n, int64_t k,
                                         GemmOutput output, const cublasLtMatmulAlgo_t& algo,
                                         const std::vector<int64_t>& check_ms,
                                         std::unique_ptr<PinnedGemm>* gemm,
                                         std::string* diagnostics, int max_batch) {
  std::unique_ptr<PinnedGemm> g(new PinnedGemm(handle, n, k, output));
  ROLLOUT_RETURN_IF_FAILED(CreateDesc(&g->desc_), CUBLAS_STATUS_SUCCESS);
  g->algo_ = algo;
  const GemmAlgoInfo info = DescribeAlgo(algo);
  auto note = [&](const std::string& what) {
    if (diagnostics != nullptr) *diagnostics += "  " + info.ToString() + ": " + what + "\n";
  };
  if (!IsSingleSplit(algo)) {
    note("split-K or a reduction scheme");
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  size_t workspace = 0;
  for (int64_t m : check_ms) {
    Layouts layouts;
    ROLLOUT_RETURN_IF_FAILED(layouts.Init(m, n, k, output), CUBLAS_STATUS_SUCCESS);
    cublasLtMatmulHeuristicResult_t check{};
    const cublasStatus_t status = cublasLtMatmulAlgoCheck(handle, g->desc_, layouts.a, layouts.b,
                                                          layouts.c, layouts.c, &g->algo_, &check);
    if (status != CUBLAS_STATUS_SUCCESS || check.workspaceSize > kMaxPinnedWorkspace) {
      note("m=" + std::to_string(m) + " check " + CublasStatusName(status) + " workspace " +
           std::to_string(check.workspaceSize));
      return status != CUBLAS_STATUS_SUCCESS ? status : CUBLAS_STATUS_NOT_SUPPORTED;
    }
    workspace = std::max(workspace, check.workspaceSize);
  }
  // Batched layouts as RunBatched uses them for the K segments of a row: b products of [m, k]
  // column blocks of one [m, b * k] matrix, weights and outputs back to back.
  g->max_batch_ = std::max(1, max_batch);
  g->batched_ = g->max_batch_ > 1;
  for (int batch = 2; g->batched_ && batch <= g->max_batch_; batch *= 2) {
    for (int64_t m : check_ms) {
      if (m > 8192) continue;  // batched products are K segments of at most a slice's rows
      Layouts layouts;
      ROLLOUT_RETURN_IF_FAILED(
          layouts.InitBatched(m, n, k, output, batch * k, batch, k, n * k, m * n),
          CUBLAS_STATUS_SUCCESS);
      cublasLtMatmulHeuristicResult_t check{};
      const cublasStatus_t status = cublasLtMatmulAlgoCheck(
          handle, g->desc_, layouts.a, layouts.b, layouts.c, layouts.c, &g->algo_, &check);
      if (status != CUBLAS_STATUS_SUCCESS || check.workspaceSize > kMaxPinnedWorkspace) {
        note("batch " + std::to_string(batch) + " m=" + std::to_string(m) + " check " +
             CublasStatusName(status) + " workspace " + std::to_string(check.workspaceSize) +
             ": products run one call each");
        g->batched_ = false;
        break;
      }
      workspace = std::max(workspace, check.workspaceSize);
    }
  }
  if (workspace > 0 && g->workspace_.Allocate(workspace) != cudaSuccess) {
    return CUBLAS_STATUS_ALLOC_FAILED;
  }
  g->mode_ = Mode::kPinned;
  *gemm = std::move(g);
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t PinnedGemm::Create(cublasLtHandle_t handle, int64_t n, int64_t k, GemmOutput output,
                                  int64_t pin_m, std::unique_ptr<PinnedGemm>* gemm,
                                  std::string* diagnostics, int max_batch) {
  std::vector<cublasLtMatmulAlgo_t> algos;
  ROLLOUT_RETURN_IF_FAILED(Candidates(handle, n, k, output, pin_m, 32, &algos, diagnostics),
                           CUBLAS_STATUS_SUCCESS);
  if (diagnostics != nullptr) {
    *diagnostics += std::to_string(algos.size()) +
                    " single-split candidates at m=" + std::to_string(pin_m) + "\n";
  }
  for (const cublasLtMatmulAlgo_t& algo : algos) {
    if (CreateWithAlgo(handle, n, k, output, algo, gemm, diagnostics, max_batch) ==
        CUBLAS_STATUS_SUCCESS) {
      return CUBLAS_STATUS_SUCCESS;
    }
  }
  return CUBLAS_STATUS_NOT_SUPPORTED;
}

cublasStatus_t PinnedGemm::CreateHeuristic(cublasLtHandle_t handle, int64_t n, int64_t k,
                                           GemmOutput output, std::unique_ptr<PinnedGemm>* gemm) {
  std::unique_ptr<PinnedGemm> g(new PinnedGemm(handle, n, k, output));
  ROLLOUT_RETURN_IF_FAILED(CreateDesc(&g->desc_), CUBLAS_STATUS_SUCCESS);
  g->mode_ = Mode::kHeuristicNoWorkspace;
  *gemm = std::move(g);
  return CUBLAS_STATUS_SUCCESS;
}

PinnedGemm::~PinnedGemm() {
  if (desc_ != nullptr) cublasLtMatmulDescDestroy(desc_);
}

cublasStatus_t PinnedGemm::Run(const __nv_bfloat16* x, int64_t m, const __nv_bfloat16* w, void* y,
                               cudaStream_t stream) {
  if (m == 0) return CUBLAS_STATUS_SUCCESS;
  if (const Rung* rung = For(m); rung != nullptr) {
    if (rung->hand) return RunHand(*rung->hand, x, k_, 0, m, w, 0, y, 0, 1, stream);
    return rung->gemm->Run(x, m, w, y, stream);
  }
  Layouts layouts;
  ROLLOUT_RETURN_IF_FAILED(layouts.Init(m, n_, k_, output_), CUBLAS_STATUS_SUCCESS);
  const float alpha = 1.0f;
  const float beta = output_ == GemmOutput::kF32Accumulate ? 1.0f : 0.0f;
  const cublasLtMatmulAlgo_t* algo = &algo_;
  if (mode_ == Mode::kHeuristicNoWorkspace) {
    auto it = per_m_.find(m);
    if (it == per_m_.end()) {
      std::vector<cublasLtMatmulAlgo_t> algos;
      ROLLOUT_RETURN_IF_FAILED(Candidates(handle_, n_, k_, output_, m, 1, &algos),
                               CUBLAS_STATUS_SUCCESS);
      if (algos.empty()) return CUBLAS_STATUS_NOT_SUPPORTED;
      it = per_m_.emplace(m, algos[0]).first;
    }
    algo = &it->second;
  }
  return cublasLtMatmul(handle_, desc_, &alpha, w, layouts.a, x, layouts.b, &beta, y, layouts.c, y,
                        layouts.c, algo, workspace_.get(), workspace_.bytes(), stream);
}

cublasStatus_t PinnedGemm::RunBatched(const __nv_bfloat16* x, int64_t ldx, int64_t x_step,
                                      int64_t m, const __nv_bfloat16* w, int64_t w_step, void* y,
                                      int64_t y_step, int batch, cudaStream_t stream) {
  if (mode_ != Mode::kPinned || batch < 1 || batch > max_batch_ || ldx < k_) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  if (m == 0) return CUBLAS_STATUS_SUCCESS;
  if (const Rung* rung = For(m); rung != nullptr) {
    // A hand rung runs every product in one launch, batched or not at creation: a product's
    // bits do not depend on the launch.
    if (rung->hand)
      return RunHand(*rung->hand, x, ldx, x_step, m, w, w_step, y, y_step, batch, stream);
    return rung->gemm->RunBatched(x, ldx, x_step, m, w, w_step, y, y_step, batch, stream);
  }
  const float alpha = 1.0f;
  const float beta = output_ == GemmOutput::kF32Accumulate ? 1.0f : 0.0f;
  if (batch == 1 || batched_) {
    Layouts layouts;
    ROLLOUT_RETURN_IF_FAILED(
        layouts.InitBatched(m, n_, k_, output_, ldx, batch, x_step, w_step, y_step),
        CUBLAS_STATUS_SUCCESS);
    return cublasLtMatmul(handle_, desc_, &alpha, w, layouts.a, x, layouts.b, &beta, y, layouts.c,
                          y, layouts.c, &algo_, workspace_.get(), workspace_.bytes(), stream);
  }
  const size_t y_bytes = output_ == GemmOutput::kBf16 ? 2 : 4;
  for (int b = 0; b < batch; ++b) {
    ROLLOUT_RETURN_IF_FAILED(RunBatched(x + b * x_step, ldx, 0, m, w + b * w_step, 0,
                                        static_cast<char*>(y) + b * y_step * y_bytes, 0, 1, stream),
                             CUBLAS_STATUS_SUCCESS);
  }
  return CUBLAS_STATUS_SUCCESS;
}

const char* CublasStatusName(cublasStatus_t status) { return cublasLtGetStatusName(status); }

}  // namespace rollout::cuda
