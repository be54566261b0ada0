// librollout_trainer_ops.so: the CPU backend's kernels behind a C ABI, for the trainer library
// (trainer/python/rollout_trainer, through ctypes). Each entry point calls the very function
// the CPU runner calls (kernels/cpu/ops.h, model/rope.h, engine/sampler.h), compiled from the
// same sources with the same flags, so a forward built from them has the server's bits by
// construction. Pointers are borrowed, fp32 and contiguous; nothing is checked here (the Python
// side checks shapes, dtypes and contiguity before calling).
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "common/thread_pool.h"
#include "engine/sampler.h"
#include "kernels/cpu/moe.h"
#include "kernels/cpu/ops.h"
#include "model/rope.h"

namespace {

// One pool for every call (threads split output columns or rows, never a reduction: the count
// cannot change a bit). Created on first use.
rollout::cpu::ThreadPool* Pool() {
  static rollout::cpu::ThreadPool* pool = new rollout::cpu::ThreadPool(
      static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
  return pool;
}

}  // namespace

extern "C" {

// The kernels' build id and version (ServerInfo.numerics.kernels of a server built from the
// same sources).
const char* rt_kernels_version() { return rollout::cpu::kKernelsVersion; }

// y[m, n] = x[m, k] . w[n, k]^T (+ bias[n]): cpu::MatMul (q/k/v, gate/up, lm_head).
void rt_matmul(const float* x, int64_t m, int64_t k, const float* w, int64_t n, const float* bias,
               float* y) {
  rollout::cpu::MatMul(Pool(), x, m, k, w, n, bias, y);
}

// The same product through the canonical K tree: cpu::SegmentedMatMul (o_proj, down_proj).
void rt_segmented_matmul(const float* x, int64_t m, int64_t k, const float* w, int64_t n,
                         const float* bias, float* y) {
  rollout::cpu::SegmentedMatMul(Pool(), x, m, k, w, n, bias, y);
}

void rt_rms_norm(const float* x, const float* weight, int64_t rows, int64_t dim, float eps,
                 float* y) {
  rollout::cpu::RmsNorm(x, weight, rows, dim, eps, y);
}

// cos, sin: [n, head_dim / 2] of each position, default RoPE with base theta (given as the
// float config.json's rope_theta becomes, widened to double as ModelConfig's is).
void rt_rope_cos_sin(float theta, int64_t head_dim, const int32_t* positions, int64_t n, float* cos,
                     float* sin) {
  const rollout::RopeFrequencies f =
      rollout::ComputeRopeFrequencies(rollout::RopeScaling{}, theta, head_dim);
  const int64_t half = head_dim / 2;
  for (int64_t i = 0; i < n; ++i)
    rollout::RopeCosSin(f, positions[i], cos + i * half, sin + i * half);
}

// In place on x [t, heads, head_dim].
void rt_apply_rope(float* x, const float* cos, const float* sin, int64_t t, int64_t heads,
                   int64_t head_dim) {
  rollout::cpu::ApplyRope(x, cos, sin, t, heads, head_dim);
}

void rt_silu_mul(const float* gate_up, int64_t rows, int64_t dim, float* out) {
  rollout::cpu::SiluMul(gate_up, rows, dim, out);
}

// x[i] += y[i] (the residual).
void rt_add(float* x, const float* y, int64_t n) { rollout::cpu::Add(x, y, n); }

// Causal attention over packed sequences: q [t, heads, head_dim], k and v [t, kv_heads,
// head_dim] (already normed and rotated), token i at `positions[i]` of the sequence that
// starts at packed row `starts[i]` (so its keys are rows starts[i] .. starts[i] + positions[i]).
// cpu::PagedAttention over a cache of blocks of one token whose block ids are the packed rows:
// the server's per-row arithmetic exactly, whichever blocks held its KV there.
void rt_attention(const float* q, const float* k, const float* v, const int32_t* positions,
                  const int32_t* starts, int64_t t, int64_t heads, int64_t kv_heads,
                  int64_t head_dim, float scale, float* out) {
  std::vector<int32_t> rows(t);
  for (int64_t i = 0; i < t; ++i) rows[i] = static_cast<int32_t>(i);
  std::vector<const int32_t*> tables(t);
  for (int64_t i = 0; i < t; ++i) tables[i] = rows.data() + starts[i];
  const rollout::cpu::TokenSlots slots{positions, tables.data(), t};
  // The kernel reads the cache only; the packed k and v are that cache.
  rollout::cpu::KvCacheLayer cache{const_cast<float*>(k), const_cast<float*>(v), 1, kv_heads,
                                   head_dim};
  rollout::cpu::PagedAttention(Pool(), q, slots, heads, cache, scale, out);
}

// out[r, :] = log_softmax(logits[r, :] / T) with the sampler's definition (LogSoftmax): what
// Generate streams and Score returns. T <= 0 means 1.
void rt_log_softmax(const float* logits, int64_t rows, int32_t vocab, float temperature,
                    float* out) {
  Pool()->ParallelFor(rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      rollout::LogSoftmax(logits + r * vocab, vocab, temperature, out + r * vocab);
    }
  });
}

// --- MoE ---
// The CPU runner's mixture-of-experts arithmetic (runner/cpu/cpu_moe_layer.cc's MoeBlock,
// kernels/cpu/moe.h). The router logits are rt_matmul's and each expert's MLP is rt_matmul +
// rt_silu_mul + rt_segmented_matmul on the rows routed to it (a row's bits do not depend on how
// many rows an expert gets), as MoeBlock computes them at TP 1 (every degree has TP 1's bits,
// D10); these two are the rest.

// Each token's routing: cpu::RouteToken on logits [t, num_experts]. forced: null (every row
// chooses) or [t, k] ids, used for the rows r with forced_rows[r] != 0 (forced_rows [t]; the
// other rows choose). ids [t, k] in rank order, weights [t, k] (renormalised with
// norm_topk_prob). REQUIRES: forced ids in [0, num_experts), none twice in a row.
void rt_moe_route(const float* logits, int64_t t, int32_t num_experts, int32_t k,
                  int32_t norm_topk_prob, const int32_t* forced, const uint8_t* forced_rows,
                  int32_t* ids, float* weights) {
  for (int64_t r = 0; r < t; ++r) {
    const int32_t* f = forced != nullptr && forced_rows[r] != 0 ? forced + r * k : nullptr;
    rollout::cpu::RouteToken(logits + r * num_experts, num_experts, k, norm_topk_prob != 0, f,
                             ids + r * k, weights + r * k);
  }
}

// out[r, :] = the experts' outputs y[r, 0..k) combined in rank order: cpu::CombineExperts per
// token. y [t, k, dim], weights [t, k], out [t, dim].
void rt_moe_combine(const float* y, const float* weights, int64_t t, int32_t k, int64_t dim,
                    float* out) {
  Pool()->ParallelFor(t, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      rollout::cpu::CombineExperts(y + r * k * dim, weights + r * k, k, dim, out + r * dim);
    }
  });
}

// --- TP ---
// The row-parallel layers' canonical K tree split across trainer ranks, exactly as a CPU server
// rank splits it (CpuModelRunner::RowParallel): a rank computes the node of the tree over its
// aligned block of segments from its K slice alone, the ranks' nodes are all-gathered in rank
// order and every rank folds them with the tree's top levels. Each degree 1, 2, 4, 8 performs
// SegmentedMatMul's floating-point operations in SegmentedMatMul's order: TP 1's bits.

// y[m, n] = the tree node over canonical segments [seg_begin, seg_end) of the reduction of full
// length k_full; x [m, k_slice] and w [n, k_slice] hold only the node's K columns
// (cpu::SegmentedPartialMatMul). REQUIRES rt_is_canonical_segment_block(seg_begin, seg_end).
void rt_segmented_partial_matmul(const float* x, int64_t m, const float* w, int64_t n,
                                 int64_t k_full, int32_t seg_begin, int32_t seg_end, float* y) {
  rollout::cpu::SegmentedPartialMatMul(Pool(), x, m, w, n, k_full, seg_begin, seg_end, y);
}

// parts [num_parts, count] (the nodes of ranks 0 .. num_parts - 1, num_parts = 1, 2, 4 or 8)
// -> y [count], the tree's root (cpu::CombinePartials). y may alias parts.
void rt_combine_partials(const float* parts, int32_t num_parts, int64_t count, float* y) {
  rollout::cpu::CombinePartials(parts, num_parts, count, y);
}

// 1 when [seg_begin, seg_end) is a node of the tree (what a rank of degree 1, 2, 4, 8 owns).
int32_t rt_is_canonical_segment_block(int32_t seg_begin, int32_t seg_end) {
  return rollout::cpu::IsCanonicalSegmentBlock(seg_begin, seg_end) ? 1 : 0;
}

}  // extern "C"
