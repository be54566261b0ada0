// librollout_trainer_cuda_ops.so: the CUDA backend's kernels behind a C ABI, for the trainer
// library (trainer/python/rollout_trainer/cuda_ops.py, through ctypes). Each entry point calls
// the very launcher CudaModelRunner calls (kernels/cuda/ops.h, gemm.h, tensor_parallel.h,
// sampling.h, moe.h), linked from the same static library built with the same flags, on raw device
// pointers and a caller's stream (torch's current stream: a driver object, whichever CUDA
// runtime the caller has). Nothing here allocates device memory but the pinned GEMMs' own
// workspaces (RtCudaModel, created once); every other buffer is the caller's.
//
// Entry points return 0 on success, else a nonzero code; rt_cuda_last_error() then says what
// failed (a thread-local message). Shapes, dtypes and alignment are checked by the Python side
// and again by the launchers (cudaErrorInvalidValue).
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "kernels/cuda/gemm.h"
#include "kernels/cuda/moe.h"
#include "kernels/cuda/numerics.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/sampling.h"
#include "kernels/cuda/tensor_parallel.h"
#include "model/rope.h"
#include "trainer/trainer_cuda_kernels.h"

namespace {

using rollout::cuda::bf16;
using rollout::cuda::GemmOutput;
using rollout::cuda::PinnedGemm;

thread_local std::string last_error;

int Fail(const std::string& what) {
  last_error = what;
  return 1;
}

int Check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return 0;
  return Fail(std::string(what) + ": " + cudaGetErrorString(e));
}

int Check(cublasStatus_t s, const char* what) {
  if (s == CUBLAS_STATUS_SUCCESS) return 0;
  return Fail(std::string(what) + ": " + rollout::cuda::CublasStatusName(s));
}

// Launchers whose grid holds at most this many rows (EmbeddingGather, SiluMul) are called
// in pieces: rows are independent, so the cut changes no bit.
constexpr int64_t kMaxGridRows = 65535;

}  // namespace

// The GEMMs of one dense model, pinned exactly as CudaModelRunner pins them at TP 1
// (runner/cuda/pinned_gemms.cc): canonical (the default --tp_invariant): PinCanonicalGemms'
// shapes and outputs (o and down as [hidden, K / 8] leaves, fp32, batched 8); else PinGemms'
// (o and down fused with the residual, kF32Accumulate). With `ladder`, the rungs as the runner
// builds them (same bits; speed). One thread at a time.
struct RtCudaModel {
  cublasLtHandle_t lt = nullptr;
  bool canonical = true;
  std::unique_ptr<PinnedGemm> qkv, o, gate_up, down, lm_head;
  std::unique_ptr<PinnedGemm> router;  // MoE models only (rt_cuda_model_add_router)
  int64_t hidden = 0, o_k = 0, down_k = 0;
  int64_t pin_m = 0;
  bool ladder = false;
  int device = 0;
  std::string algorithms;  // DescribePin lines, '\n'-separated, in the runner's order

  ~RtCudaModel() {
    qkv.reset();
    o.reset();
    gate_up.reset();
    down.reset();
    lm_head.reset();
    router.reset();
    if (lt != nullptr) cublasLtDestroy(lt);
  }
};

extern "C" {

const char* rt_cuda_last_error() { return last_error.c_str(); }

// ServerInfo.numerics.kernels of a cuda server built from the same sources.
const char* rt_cuda_kernels_version() { return rollout::cuda::kKernelsVersion; }

// Keys per tile of the attention walk (ServerInfo.numerics.attention_tile).
int32_t rt_cuda_attention_tile() { return rollout::cuda::kReportedAttentionTile; }

// Most tokens of one attention work item for `group` query heads per kv head.
int32_t rt_cuda_attention_item_tokens(int32_t group) {
  return rollout::cuda::AttentionItemTokens(group);
}

// The device facts (kernels/cuda/numerics.h) of the current device, '\n'-separated:
// gpu_model, compute_capability, cuda_runtime, cublaslt_version. Into buf (NUL-terminated).
int rt_cuda_device_facts(char* buf, int64_t len) {
  int device = 0;
  if (int e = Check(cudaGetDevice(&device), "cudaGetDevice")) return e;
  rollout::cuda::DeviceFacts f;
  if (int e = Check(rollout::cuda::DescribeDevice(device, &f), "cudaGetDeviceProperties")) return e;
  const std::string s =
      f.gpu_model + "\n" + f.compute_capability + "\n" + f.cuda_runtime + "\n" + f.cublaslt_version;
  if (static_cast<int64_t>(s.size()) >= len) return Fail("device facts buffer too small");
  std::copy(s.begin(), s.end(), buf);
  buf[s.size()] = '\0';
  return 0;
}

// The model's pinned GEMMs on the current device, for rank slices of tensor parallelism (the
// runner's PinCanonicalGemms): every GEMM is pinned (and its ladder built) on the full weight's
// shape, and a column-parallel one whose rank slice is narrower -- qkv_rows of qkv, gate_up_rows
// of gate_up, vocab_rows of lm_head -- runs that algorithm (and ladder) on the slice, so each
// output column has the unsliced GEMM's bits. The o / down leaves [hidden, K / 8] are the same
// shape at every degree. Slices narrower than the full shapes need `canonical`. *out receives
// the handle (free with rt_cuda_model_free); `algorithms` lists the full shapes' pins, as
// ServerInfo.numerics.gemm_algorithms does at every degree.
int rt_cuda_model_create_tp(int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim,
                            int64_t intermediate, int64_t vocab, int64_t pin_m, int32_t ladder,
                            int32_t canonical, int64_t qkv_rows, int64_t gate_up_rows,
                            int64_t vocab_rows, RtCudaModel** out) {
  *out = nullptr;
  if (pin_m <= 0) return Fail("gemm_pin_m must be > 0 (a server on the heuristic is not reproduced)");
  auto m = std::make_unique<RtCudaModel>();
  if (int e = Check(cudaGetDevice(&m->device), "cudaGetDevice")) return e;
  if (int e = Check(cublasLtCreate(&m->lt), "cublasLtCreate")) return e;
  m->canonical = canonical != 0;
  m->hidden = hidden;
  m->o_k = heads * head_dim;
  m->down_k = intermediate;
  m->pin_m = pin_m;
  m->ladder = ladder != 0;
  const int seg = rollout::cuda::kNumKSegments;
  if (m->canonical && (m->o_k % (8 * seg) != 0 || intermediate % (8 * seg) != 0)) {
    return Fail("the canonical K tree needs heads * head_dim and the intermediate size to be "
                "multiples of 64");
  }
  const int64_t qkv_n = (heads + 2 * kv_heads) * head_dim;
  if (!m->canonical && (qkv_rows != qkv_n || gate_up_rows != 2 * intermediate ||
                        vocab_rows != vocab)) {
    return Fail("rank slices (tensor parallelism) need the canonical K tree");
  }
  struct Spec {
    const char* name;
    int64_t n, k;
    GemmOutput output;
    std::unique_ptr<PinnedGemm>* gemm;
    int max_batch;
    int64_t slice_n;  // the rank's columns
  };
  const GemmOutput row_out = m->canonical ? GemmOutput::kF32 : GemmOutput::kF32Accumulate;
  const int row_batch = m->canonical ? seg : 1;
  const std::vector<Spec> specs = {
      {"qkv", qkv_n, hidden, GemmOutput::kF32, &m->qkv, 1, qkv_rows},
      {"o", hidden, m->canonical ? m->o_k / seg : m->o_k, row_out, &m->o, row_batch, hidden},
      {"gate_up", 2 * intermediate, hidden, GemmOutput::kBf16, &m->gate_up, 1, gate_up_rows},
      {"down", hidden, m->canonical ? intermediate / seg : intermediate, row_out, &m->down,
       row_batch, hidden},
      {"lm_head", vocab, hidden, GemmOutput::kF32, &m->lm_head, 1, vocab_rows},
  };
  for (const Spec& g : specs) {
    if (g.slice_n < 1 || g.slice_n > g.n) {
      return Fail(std::string("rank slice of ") + g.name + " out of range: " +
                  std::to_string(g.slice_n) + " of " + std::to_string(g.n) + " rows");
    }
    std::string why;
    const cublasStatus_t s =
        PinnedGemm::Create(m->lt, g.n, g.k, g.output, pin_m, g.gemm, &why, g.max_batch);
    if (s != CUBLAS_STATUS_SUCCESS) {
      return Fail(std::string("no split-K-free cuBLASLt algorithm could be pinned for ") + g.name +
                  ": " + why);
    }
    if (m->ladder) {
      if (int e = Check((*g.gemm)->BuildLadder(), "the GEMM ladder")) return e;
    }
    if (!m->algorithms.empty()) m->algorithms += "\n";
    m->algorithms += rollout::cuda::DescribePin(g.name, **g.gemm);
    if (g.slice_n == g.n) continue;
    std::unique_ptr<PinnedGemm> slice;
    if (PinnedGemm::CreateWithAlgo(m->lt, g.slice_n, g.k, g.output, (*g.gemm)->algo(), &slice,
                                   &why, g.max_batch) != CUBLAS_STATUS_SUCCESS) {
      return Fail(std::string("the algorithm pinned for ") + g.name + " does not run the rank's " +
                  std::to_string(g.slice_n) + "-row slice: " + why);
    }
    if (m->ladder) {
      if (int e = Check(slice->CopyLadder(**g.gemm), "the GEMM ladder of a rank slice")) return e;
    }
    *g.gemm = std::move(slice);
  }
  *out = m.release();
  return 0;
}

// The model's pinned GEMMs as CudaModelRunner pins them at TP 1: rt_cuda_model_create_tp with
// every slice the whole weight.
int rt_cuda_model_create(int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim,
                         int64_t intermediate, int64_t vocab, int64_t pin_m, int32_t ladder,
                         int32_t canonical, RtCudaModel** out) {
  return rt_cuda_model_create_tp(hidden, heads, kv_heads, head_dim, intermediate, vocab, pin_m,
                                 ladder, canonical, (heads + 2 * kv_heads) * head_dim,
                                 2 * intermediate, vocab, out);
}

void rt_cuda_model_free(RtCudaModel* m) { delete m; }

// The pins, one DescribePin line each ('\n'-separated): ServerInfo.numerics.gemm_algorithms.
const char* rt_cuda_model_algorithms(const RtCudaModel* m) { return m->algorithms.c_str(); }

// y = x . w^T by the pinned GEMM `which` (0 qkv: fp32 y; 1 gate_up: bf16 y; 2 lm_head: fp32 y;
// 3 the MoE router, after rt_cuda_model_add_router: fp32 y). x [m, k] bf16, w [n, k] bf16,
// y [m, n]; every pointer 256-byte aligned.
int rt_cuda_gemm(RtCudaModel* model, int32_t which, const void* x, int64_t m, const void* w,
                 void* y, void* stream) {
  PinnedGemm* g = which == 0 ? model->qkv.get() : which == 1 ? model->gate_up.get()
                                            : which == 2 ? model->lm_head.get()
                                            : which == 3 ? model->router.get() : nullptr;
  if (g == nullptr) {
    return Fail("rt_cuda_gemm: which must be 0 (qkv), 1 (gate_up), 2 (lm_head) or 3 (router, "
                "after rt_cuda_model_add_router)");
  }
  return Check(g->Run(static_cast<const bf16*>(x), m, static_cast<const bf16*>(w), y,
                      static_cast<cudaStream_t>(stream)),
               "pinned GEMM");
}

// The residual projection `which` (0 o_proj, 1 down_proj) as the runner's EnqueueRowParallel at
// TP 1: out[m, hidden] = x[m, hidden] + in[m, K] . w^T (out may be x: in place, as the runner).
// Canonical: w is the runner's segment-major layout [8, hidden, K / 8]; the eight leaves (one
// batched call) into `leaves` [8, m, hidden] fp32, then SumTreeOnto adds the tree to x into
// out (x read once, out written once: no copy of the residual). Fused: w [hidden, K], x copied
// into out (unless out is x), then one GEMM with the residual epilogue (leaves unused).
int rt_cuda_row_parallel(RtCudaModel* model, int32_t which, const void* in, int64_t m,
                         const void* w, float* leaves, const float* x, float* out, void* stream) {
  PinnedGemm* g = which == 0 ? model->o.get() : which == 1 ? model->down.get() : nullptr;
  if (g == nullptr) return Fail("rt_cuda_row_parallel: which must be 0 (o) or 1 (down)");
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const bf16* a = static_cast<const bf16*>(in);
  const bf16* wb = static_cast<const bf16*>(w);
  if (!model->canonical) {
    if (out != x) {
      if (int e = Check(cudaMemcpyAsync(out, x, static_cast<size_t>(m) * model->hidden * 4,
                                        cudaMemcpyDeviceToDevice, s),
                        "residual copy")) {
        return e;
      }
    }
    return Check(g->Run(a, m, wb, out, s), "row-parallel GEMM");
  }
  const int64_t k_full = which == 0 ? model->o_k : model->down_k;
  const int64_t h = model->hidden, seg = k_full / rollout::cuda::kNumKSegments;
  const int64_t count = m * h;
  const int leaves_n = rollout::cuda::kNumKSegments;
  if (int e = Check(g->RunBatched(a, k_full, seg, m, wb, h * seg, leaves, count, leaves_n, s),
                    "K tree leaves")) {
    return e;
  }
  return Check(rollout::cuda::SumTreeOnto(leaves, leaves_n, count, count, x, out, s),
               "K tree + residual");
}

// A rank's node of the canonical K tree (tensor parallelism; the runner's EnqueueRowParallel
// at tp > 1): in [m, k_local] bf16 is the rank's K columns (k_local = K / tp, the aligned
// block of 8 / tp segments under one node), w its segment-major weight [8 / tp, hidden, K / 8];
// the 8 / tp leaves (one batched call) into `leaves` [8 / tp, m, hidden] fp32, then SumTree of
// them into node [m, hidden] (one leaf: the GEMM writes node directly, leaves unused).
int rt_cuda_row_parallel_node(RtCudaModel* model, int32_t which, const void* in, int64_t m,
                              int64_t k_local, const void* w, float* leaves, float* node,
                              void* stream) {
  PinnedGemm* g = which == 0 ? model->o.get() : which == 1 ? model->down.get() : nullptr;
  if (g == nullptr) return Fail("rt_cuda_row_parallel_node: which must be 0 (o) or 1 (down)");
  if (!model->canonical) return Fail("rt_cuda_row_parallel_node needs the canonical K tree");
  const int64_t k_full = which == 0 ? model->o_k : model->down_k;
  const int64_t h = model->hidden, seg = k_full / rollout::cuda::kNumKSegments;
  if (k_local <= 0 || k_local % seg != 0 || k_full % k_local != 0) {
    return Fail("rt_cuda_row_parallel_node: k_local must be K / tp, tp in {1, 2, 4, 8}");
  }
  const int local = static_cast<int>(k_local / seg);
  const int64_t count = m * h;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  float* out = local == 1 ? node : leaves;
  if (int e = Check(g->RunBatched(static_cast<const bf16*>(in), k_local, seg, m,
                                  static_cast<const bf16*>(w), h * seg, out, count, local, s),
                    "K tree leaves")) {
    return e;
  }
  if (local == 1) return 0;
  return Check(rollout::cuda::SumTree(leaves, local, count, count, node, /*accumulate=*/false, s),
               "K tree node");
}

// The tree's top levels over the ranks' all-gathered nodes, onto the residual: out = residual +
// SumTree(parts [num_parts, count] at part_stride) (SumTreeOnto; out may be residual).
int rt_cuda_sum_tree_onto(const float* parts, int32_t num_parts, int64_t part_stride,
                          int64_t count, const float* residual, float* out, void* stream) {
  return Check(rollout::cuda::SumTreeOnto(parts, num_parts, part_stride, count, residual, out,
                                          static_cast<cudaStream_t>(stream)),
               "K tree top + residual");
}

// The vocab-parallel embedding, a rank's part (EmbeddingGatherShard): x[t, :] = the row of
// shard [vocab_end - vocab_begin, hidden] bf16 for a token in [vocab_begin, vocab_end), else
// zeros; x fp32 [t, hidden].
int rt_cuda_embedding_shard(const int32_t* ids, int64_t t, const void* shard, int64_t vocab_begin,
                            int64_t vocab_end, int64_t hidden, float* x, void* stream) {
  for (int64_t r = 0; r < t; r += kMaxGridRows) {
    const int64_t n = std::min(kMaxGridRows, t - r);
    if (int e = Check(rollout::cuda::EmbeddingGatherShard(
                          ids + r, n, static_cast<const bf16*>(shard), vocab_begin, vocab_end,
                          hidden, x + r * hidden, static_cast<cudaStream_t>(stream)),
                      "embedding shard gather")) {
      return e;
    }
  }
  return 0;
}

// After the ranks' rt_cuda_embedding_shard rows are all-gathered ([ranks, t, hidden] fp32, rank
// i at i * rank_stride): x[t, :] = the owner's row (SelectOwnerRows: selected, never summed).
int rt_cuda_select_owner_rows(const int32_t* ids, int64_t t, const float* gathered,
                              int64_t rank_stride, int64_t rows_per_rank, int64_t hidden,
                              float* x, void* stream) {
  for (int64_t r = 0; r < t; r += kMaxGridRows) {
    const int64_t n = std::min(kMaxGridRows, t - r);
    if (int e = Check(rollout::cuda::SelectOwnerRows(ids + r, n, gathered + r * hidden,
                                                     rank_stride, rows_per_rank, hidden,
                                                     x + r * hidden,
                                                     static_cast<cudaStream_t>(stream)),
                      "embedding owner select")) {
      return e;
    }
  }
  return 0;
}

// x[t, :] = float(embed[ids[t], :]): EmbeddingGather. ids int32 [t], embed bf16, x fp32.
int rt_cuda_embedding(const int32_t* ids, int64_t t, const void* embed, int64_t hidden, float* x,
                      void* stream) {
  for (int64_t r = 0; r < t; r += kMaxGridRows) {
    const int64_t n = std::min(kMaxGridRows, t - r);
    if (int e = Check(rollout::cuda::EmbeddingGather(ids + r, n, static_cast<const bf16*>(embed),
                                                     hidden, x + r * hidden,
                                                     static_cast<cudaStream_t>(stream)),
                      "embedding gather")) {
      return e;
    }
  }
  return 0;
}

// y[r] = bf16(rmsnorm(x[rows ? rows[r] : r]) * weight): RmsNorm (layer norms, final norm).
int rt_cuda_rms_norm(const float* x, const int32_t* rows, int64_t num_rows, int64_t dim,
                     const float* weight, float eps, void* y, void* stream) {
  return Check(rollout::cuda::RmsNorm(x, rows, num_rows, dim, weight, eps, static_cast<bf16*>(y),
                                      static_cast<cudaStream_t>(stream)),
               "rmsnorm");
}

// QkvNormRopeWriteKv over a "cache" of one-token pages whose page ids are the packed rows: row
// i's k and v land at k_out[i], v_out[i] ([t, kv_heads, head_dim] bf16: the page layout of a
// page of one token) -- slots[i] = i. qkv fp32 [t, (heads + 2 kv_heads) head_dim]; positions
// int32 [t]; q_norm, k_norm fp32 [head_dim]; rope tables fp32 [max_position, head_dim / 2];
// q_out fp32 [t, heads, head_dim].
int rt_cuda_qkv_norm_rope(const float* qkv, int64_t t, const int32_t* positions,
                          const int32_t* slots, const float* q_norm, const float* k_norm,
                          float eps, const float* rope_cos, const float* rope_sin, int32_t heads,
                          int32_t kv_heads, int32_t head_dim, float* q_out, void* k_out,
                          void* v_out, void* stream) {
  rollout::cuda::QkvParams p;
  p.qkv = qkv;
  p.num_tokens = t;
  p.positions = positions;
  p.kv_slots = slots;
  p.q_norm = q_norm;
  p.k_norm = k_norm;
  p.eps = eps;
  p.rope_cos = rope_cos;
  p.rope_sin = rope_sin;
  p.num_heads = heads;
  p.q_out = q_out;
  const rollout::cuda::KvCacheView cache{static_cast<bf16*>(k_out), static_cast<bf16*>(v_out), 1,
                                         kv_heads, head_dim};
  return Check(rollout::cuda::QkvNormRopeWriteKv(p, cache, static_cast<cudaStream_t>(stream)),
               "qk norm + rope + kv write");
}

// Causal attention of packed sequences in the runner's prefill form: kManyTokens items
// (int2 (first token, count) [num_items], consecutive tokens of one sequence, at most
// rt_cuda_attention_item_tokens(group) each), every split folded in the block (no partials),
// over the one-token-page cache of rt_cuda_qkv_norm_rope: token i's table is tables +
// table_offsets[i] (the rows of its sequence, from its first). `tensor_core`: PagedAttentionMma
// (the server's default), else the SIMT PagedAttention. q fp32 [t, heads, head_dim]; out bf16.
int rt_cuda_attention(const float* q, const int32_t* positions, const int32_t* table_offsets,
                      const int32_t* tables, const void* items, int32_t num_items, int32_t heads,
                      int32_t kv_heads, int32_t head_dim, int32_t split_size, float scale,
                      const void* k, const void* v, int32_t tensor_core, void* out,
                      void* stream) {
  rollout::cuda::AttentionParams p;
  p.q = q;
  p.positions = positions;
  p.table_offsets = table_offsets;
  p.tables = tables;
  p.num_heads = heads;
  p.split_size = split_size;
  p.scale = scale;
  p.out = static_cast<bf16*>(out);
  const rollout::cuda::KvCacheView cache{const_cast<bf16*>(static_cast<const bf16*>(k)),
                                         const_cast<bf16*>(static_cast<const bf16*>(v)), 1,
                                         kv_heads, head_dim};
  const int2* all = static_cast<const int2*>(items);
  for (int32_t i = 0; i < num_items; i += static_cast<int32_t>(kMaxGridRows)) {
    p.items = all + i;
    p.num_items = std::min<int32_t>(static_cast<int32_t>(kMaxGridRows), num_items - i);
    const cudaError_t e =
        tensor_core ? rollout::cuda::PagedAttentionMma(
                          p, rollout::cuda::AttentionBlockShape::kManyTokens, cache,
                          static_cast<cudaStream_t>(stream))
                    : rollout::cuda::PagedAttention(p, rollout::cuda::AttentionBlockShape::kManyTokens,
                                                    cache, static_cast<cudaStream_t>(stream));
    if (int r = Check(e, "attention")) return r;
  }
  return 0;
}

// out = bf16(silu(gate) * up): SiluMul. gate_up bf16 [rows, 2 dim], out bf16 [rows, dim].
int rt_cuda_silu_mul(const void* gate_up, int64_t rows, int64_t dim, void* out, void* stream) {
  return Check(rollout::cuda::SiluMul(static_cast<const bf16*>(gate_up), rows, dim,
                                      static_cast<bf16*>(out), static_cast<cudaStream_t>(stream)),
               "silu * up");
}

// The scored token's logprob of each fp32 logits row as the server's sampling kernel computes
// it (ProcessLogitsRows in kRowScore mode: what Generate streams and Score returns on the cuda
// backend): lp[r] = (x - m) - log_sum with x = logits[r, tokens[r]] / T; also m and log_sum
// per row (the backward's softmax). workspace: rt_cuda_logprob_workspace(rows) bytes, 256-byte
// aligned. T <= 0 means 1, as the server maps it.
int64_t rt_cuda_logprob_workspace(int64_t rows) { return rollout::trainer::LogprobWorkspace(rows); }

int rt_cuda_token_logprobs(const float* logits, int64_t rows, int32_t vocab,
                           const int32_t* tokens, float temperature, void* workspace, float* lp,
                           float* row_max, float* row_log_sum, void* stream) {
  const float t = temperature > 0.0f ? temperature : 1.0f;
  return Check(rollout::trainer::TokenLogprobs(logits, rows, vocab, tokens, t, workspace, lp,
                                               row_max, row_log_sum,
                                               static_cast<cudaStream_t>(stream)),
               "logprobs");
}

// cos, sin [n, head_dim / 2] (host memory) of positions 0 .. n - 1: default RoPE with base
// theta, as the runner's RopeTables (runner/cuda/workspace.cc) computes them.
void rt_cuda_rope_tables(float theta, int64_t head_dim, int64_t n, float* cos, float* sin) {
  const rollout::RopeFrequencies f =
      rollout::ComputeRopeFrequencies(rollout::RopeScaling{}, theta, head_dim);
  const int64_t half = head_dim / 2;
  for (int64_t p = 0; p < n; ++p) rollout::RopeCosSin(f, p, cos + p * half, sin + p * half);
}

// --- MoE ---
// Qwen3-MoE's MLP as CudaModelRunner::EnqueueMoe runs it (runner/cuda/forward_layers.cc, TP 1
// only, as the runner): the router GEMM (rt_cuda_gemm 3), rt_cuda_moe_route (cuda::MoeRoute),
// rt_cuda_moe_experts (MoeGroup with MoeTileRowsFor's tile rows, the gate/up and down expert
// GEMMs of moe_gemm.cu by the same version choice, SiluMul between) and rt_cuda_moe_combine
// (MoeCombine into the residual). Every row's bits depend on its own row only (kernels/cuda/
// moe.h), so the trainer's batch -- other tokens, other tile rows -- gives the server's step's.

// Pins the router GEMM [num_experts, hidden] (fp32 logits) as PinMoeGemms does: the model's
// pin_m and ladder, its DescribePin line ("router") appended to rt_cuda_model_algorithms, after
// the dense ones -- the server's ServerInfo.numerics.gemm_algorithms order. Once per model.
int rt_cuda_model_add_router(RtCudaModel* m, int64_t num_experts) {
  if (m->router != nullptr) return Fail("rt_cuda_model_add_router: the router is pinned already");
  std::string why;
  const cublasStatus_t s = PinnedGemm::Create(m->lt, num_experts, m->hidden, GemmOutput::kF32,
                                              m->pin_m, &m->router, &why);
  if (s != CUBLAS_STATUS_SUCCESS) {
    return Fail("no split-K-free cuBLASLt algorithm could be pinned for router: " + why);
  }
  if (m->ladder) {
    if (int e = Check(m->router->BuildLadder(), "the GEMM ladder for router")) return e;
  }
  m->algorithms += "\n" + rollout::cuda::DescribePin("router", *m->router);
  return 0;
}

// cuda::MoeRoute: per row of logits [n, e] fp32, ids [n, k] int32 (the top k by router
// probability, ties to the lower id; or forced_ids [n, k] where forced_rows [n] int32 is
// nonzero -- both null when nothing is replayed) and weights [n, k] fp32 (renormalised over the
// k with norm_topk_prob).
int rt_cuda_moe_route(const float* logits, int64_t n, int32_t e, int32_t k, int32_t norm_topk_prob,
                      const int32_t* forced_ids, const int32_t* forced_rows, int32_t* ids,
                      float* weights, void* stream) {
  return Check(rollout::cuda::MoeRoute(logits, n, e, k, norm_topk_prob != 0, forced_ids,
                                       forced_rows, ids, weights,
                                       static_cast<cudaStream_t>(stream)),
               "moe routing");
}

// int32 of the grouping workspace for n * k assignments over e experts: cuda::MoeGroupingIn's
// layout, counts [e], expert_offsets [e + 1], tile_offsets [e + 1], rows [a] (grouped row ->
// token), slots [a] (assignment t * k + j -> its grouped row).
int64_t rt_cuda_moe_grouping_ints(int64_t e, int64_t assignments) {
  return rollout::cuda::MoeGroupingInts(e, assignments);
}

// The experts of one MoE layer before the combine, EnqueueMoe's launches: the assignments of
// ids [n, k] grouped by expert into `grouping` (rt_cuda_moe_grouping_ints(e, n * k) int32) in
// tiles of MoeTileRowsFor(n * k, e, hidden, inter) rows; gate_up [a, 2 inter] bf16 = the grouped rows
// of xn [n, hidden] bf16 times each expert's w_gate_up [e, 2 inter, hidden] (its gate rows, then
// its up rows); act [a, inter] bf16 = SiluMul(gate_up); y [a, hidden] fp32 = act times each
// expert's w_down [e, hidden, inter]. Rows of gate_up, act and y are in grouped order. Pointers
// 16-byte aligned; hidden and inter multiples of 64.
int rt_cuda_moe_experts(const void* xn, int64_t n, int64_t hidden, int64_t inter, int32_t e,
                        int32_t k, const int32_t* ids, const void* w_gate_up, const void* w_down,
                        int32_t* grouping_buffer, void* gate_up, void* act, float* y,
                        void* stream) {
  // EnqueueMoe's launches up to the combine, by the same functions (kernels/cuda/moe.h).
  if (n * k == 0) return 0;
  rollout::cuda::MoeLayerParams mp;
  mp.xn = static_cast<const bf16*>(xn);
  mp.num_tokens = n;
  mp.hidden = hidden;
  mp.inter = inter;
  mp.num_experts = e;
  mp.top_k = k;
  mp.ids = ids;
  mp.w_gate_up = static_cast<const bf16*>(w_gate_up);
  mp.w_down = static_cast<const bf16*>(w_down);
  mp.grouping = rollout::cuda::MoeGroupingIn(grouping_buffer, e, n * k);
  mp.gate_up = static_cast<bf16*>(gate_up);
  mp.act = static_cast<bf16*>(act);
  mp.y = y;
  return Check(rollout::cuda::MoeExpertOutputs(mp, static_cast<cudaStream_t>(stream)),
               "moe experts");
}

// cuda::MoeCombine: x[t] += sum over ranks j in order of weights[t, j] * y[slots[t * k + j]]
// (fp32, one fma each from 0, then added to x). y [a, hidden] fp32 in grouped order, slots the
// grouping's, weights [n, k], x [n, hidden]; x and y 16-byte aligned. Tokens in pieces of the
// launcher's grid (rows are independent).
int rt_cuda_moe_combine(const float* y, const int32_t* slots, const float* weights, int64_t n,
                        int32_t k, int64_t hidden, float* x, void* stream) {
  for (int64_t t0 = 0; t0 < n; t0 += kMaxGridRows) {
    const int64_t tn = std::min(kMaxGridRows, n - t0);
    if (int r = Check(rollout::cuda::MoeCombine(y, slots + t0 * k, weights + t0 * k, tn, k, hidden,
                                                x + t0 * hidden, static_cast<cudaStream_t>(stream)),
                      "moe combine")) {
      return r;
    }
  }
  return 0;
}

}  // extern "C"
