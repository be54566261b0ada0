// rollout-attention-bench: the tensor-core paged attention (PagedAttentionMma, kernels/cuda/
// attention_mma.cu) against the same kernel before its staging was reworked for issue #4 (a copy
// below, kept here only, as the reference for bits and for speed); Qwen3-8B shapes. (The
// in-block split fold was timed against a copy of the kernel just before it: docs/cuda.md.)
//
//   rollout-attention-bench [--quick]
//
// 1. Bit identity: the split partials and the merged outputs of the library kernel equal the old
//    kernel's bitwise, over random caches (pages shuffled), head dims 32/64/128, GQA groups
//    1..32, page sizes 16/32, split sizes 32..256, decode batches of contexts 1..4096 (with idle
//    splits) and prefills cut into items of every size. The folding kManyTokens blocks (no
//    partials, no merge) and the engine's prefill launches (one-token items split-parallel +
//    MergeAttentionSplitsOfItems, many-token items folded) must give the old kernel + merge's
//    outputs bitwise. A mismatch fails the run (exit code 1).
// 2. Timing (CUDA events, median of repeats): one layer's decode attention for 256 sequences at
//    context ~1536 (the benchmark's mean decode step), 32 at ~4K, 95 at 4K..8K, 47 at 8K..16K and
//    16 at ~16K (the long-context steps of 4096/4096 and 8192/8192), and one layer's prefill
//    attention for 8 x 1024 and 4 x 4096 tokens, old vs new, kernel and split merge apart; the
//    decode's K/V bytes per second against a measured device-to-device copy (bytes read + written).
//
// Built with --fmad=false like the kernel library, so the copy below compiles to the same
// arithmetic as the library's kernel did. The sweep of staging variants behind the rework (ring
// depths, split K/V groups, several kv heads per block, 8-warp prefill blocks) ran from an
// earlier revision of this file; attention_mma.cu's comment has its results.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "bench/attention_old_v2.cuh"
#include "bench/device_rates.h"
#include "kernels/cuda/attention_fold.cuh"
#include "kernels/cuda/compare.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/ops.h"

namespace rollout {
namespace {

using cuda::AttentionBlockShape;
using cuda::AttentionParams;
using cuda::bf16;
using cuda::DeviceBuffer;
using cuda::KvCacheView;

void Check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(err));
    std::exit(1);
  }
}

// Uniform values in [-1, 1): a hash of (seed, index), rounded to T.
template <typename T>
__global__ void FillKernel(T* x, int64_t n, uint64_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    uint64_t h = (static_cast<uint64_t>(i) + 1) * 0x9E3779B97F4A7C15ull ^ seed;
    h ^= h >> 31;
    h *= 0xBF58476D1CE4E5B9ull;
    h ^= h >> 29;
    h *= 0x94D049BB133111EBull;
    h ^= h >> 32;
    x[i] = static_cast<T>(static_cast<float>(h >> 40) * (2.0f / 16777216.0f) - 1.0f);
  }
}

template <typename T>
void Fill(DeviceBuffer* buf, int64_t n, uint64_t seed) {
  Check(buf->Allocate(std::max<int64_t>(n, 1) * sizeof(T)), "allocate");
  FillKernel<T><<<132 * 8, 256>>>(buf->get<T>(), n, seed);
  Check(cudaGetLastError(), "fill");
}

struct Shape {
  int nh, nkv, hd, bs, split;
};

std::string Describe(const Shape& s) {
  char buf[96];
  std::snprintf(buf, sizeof(buf), "heads %d/%d, dim %d, page %d, split %d", s.nh, s.nkv, s.hd, s.bs,
                s.split);
  return buf;
}

// Sequences in a paged cache with shuffled pages, and the tokens whose attention is computed
// (each at its own position, its sequence's K/V already in the cache).
struct Problem {
  Shape shape;
  std::vector<int32_t> token_seq, positions;  // [num_tokens]
  DeviceBuffer k, v, q, d_positions, d_offsets, d_tables;
  int max_splits = 0;  // what the tokens need; a launch may use more (idle splits)

  int num_tokens() const { return static_cast<int>(positions.size()); }
  KvCacheView view() const {
    return KvCacheView{k.get<bf16>(), v.get<bf16>(), shape.bs, shape.nkv, shape.hd};
  }
  // Bytes of K and V the tokens' rows read: (position + 1) keys of every kv head each.
  double KeyBytes() const {
    double keys = 0;
    for (int32_t pos : positions) keys += pos + 1;
    return keys * shape.nkv * shape.hd * 2 * 2;
  }
};

template <typename T>
DeviceBuffer Upload(const std::vector<T>& host) {
  DeviceBuffer buf;
  Check(buf.Allocate(std::max<size_t>(host.size(), 1) * sizeof(T)), "allocate");
  Check(cudaMemcpy(buf.get(), host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice),
        "upload");
  return buf;
}

// decode: one token per sequence at its last position; else every position of every sequence.
void Build(const Shape& shape, const std::vector<int32_t>& lengths, bool decode, uint64_t seed,
           Problem* pb) {
  pb->shape = shape;
  std::mt19937_64 rng(seed);
  std::vector<int32_t> first_page(lengths.size() + 1, 0);
  for (size_t s = 0; s < lengths.size(); ++s) {
    first_page[s + 1] = first_page[s] + (lengths[s] + shape.bs - 1) / shape.bs;
  }
  std::vector<int32_t> tables(first_page.back());
  std::iota(tables.begin(), tables.end(), 0);
  std::shuffle(tables.begin(), tables.end(), rng);
  pb->token_seq.clear();
  pb->positions.clear();
  std::vector<int32_t> offsets;
  for (size_t s = 0; s < lengths.size(); ++s) {
    for (int32_t pos = decode ? lengths[s] - 1 : 0; pos < lengths[s]; ++pos) {
      pb->token_seq.push_back(static_cast<int32_t>(s));
      pb->positions.push_back(pos);
      offsets.push_back(first_page[s]);
    }
  }
  const int64_t cache_elems = static_cast<int64_t>(tables.size()) * shape.bs * shape.nkv * shape.hd;
  Fill<bf16>(&pb->k, cache_elems, seed * 3 + 1);
  Fill<bf16>(&pb->v, cache_elems, seed * 3 + 2);
  Fill<float>(&pb->q, static_cast<int64_t>(pb->positions.size()) * shape.nh * shape.hd,
              seed * 3 + 3);
  pb->d_positions = Upload(pb->positions);
  pb->d_offsets = Upload(offsets);
  pb->d_tables = Upload(tables);
  pb->max_splits = *std::max_element(pb->positions.begin(), pb->positions.end()) / shape.split + 1;
  // Poison: NaN in every K/V row past a sequence's last token in its last page, which no kernel
  // may let into an output (a masked key's p = 0 times a NaN value would be NaN).
  const std::vector<uint16_t> nan(static_cast<size_t>(shape.bs) * shape.hd, 0x7fc0);
  for (size_t s = 0; s < lengths.size(); ++s) {
    const int32_t used = (lengths[s] - 1) % shape.bs + 1;
    if (used == shape.bs) continue;
    const int32_t page = tables[first_page[s + 1] - 1];
    for (int h = 0; h < shape.nkv; ++h) {
      const int64_t at = cuda::KvPageOffset(page, h, used, shape.bs, shape.nkv, shape.hd);
      const size_t bytes = static_cast<size_t>(shape.bs - used) * shape.hd * 2;
      Check(cudaMemcpy(pb->k.get<bf16>() + at, nan.data(), bytes, cudaMemcpyHostToDevice), "nan");
      Check(cudaMemcpy(pb->v.get<bf16>() + at, nan.data(), bytes, cudaMemcpyHostToDevice), "nan");
    }
  }
}

// Work items as the engine cuts them: runs of one sequence's consecutive tokens, at most
// `sizes[k]` tokens each (cycling through `sizes`), never more than max_tokens.
std::vector<int32_t> Items(const Problem& pb, const std::vector<int>& sizes, int max_tokens) {
  std::vector<int32_t> items;
  size_t k = 0;
  for (int i = 0; i < pb.num_tokens();) {
    const int limit = std::min(sizes[k++ % sizes.size()], max_tokens);
    int j = i + 1;
    while (j < pb.num_tokens() && j - i < limit && pb.token_seq[j] == pb.token_seq[i]) ++j;
    items.insert(items.end(), {i, j - i});
    i = j;
  }
  return items;
}

// One kernel configuration under test: a launcher and the block shape it is given. `folds`: it
// folds the splits in-block (launched without partials) and writes the outputs itself, no merge.
struct Kernel {
  std::string name;
  std::function<cudaError_t(const AttentionParams&, KvCacheView, cudaStream_t)> launch;
  bool folds = false;
};

Kernel Old(AttentionBlockShape shape) {
  return {shape == AttentionBlockShape::kOneToken ? "old one-token" : "old many-token",
          [shape](const AttentionParams& p, KvCacheView c, cudaStream_t s) {
            return old_v2::PagedAttentionMma(p, shape, c, s);
          }};
}
Kernel New(AttentionBlockShape shape) {
  return {shape == AttentionBlockShape::kOneToken ? "new one-token" : "new many-token",
          [shape](const AttentionParams& p, KvCacheView c, cudaStream_t s) {
            return cuda::PagedAttentionMma(p, shape, c, s);
          }};
}
// The library's kManyTokens blocks without partials: every split folded in the block.
Kernel NewFold() {
  return {"new fold",
          [](const AttentionParams& p, KvCacheView c, cudaStream_t s) {
            AttentionParams q = p;
            q.partials = nullptr;
            return cuda::PagedAttentionMma(q, AttentionBlockShape::kManyTokens, c, s);
          },
          /*folds=*/true};
}

// The partials and outputs of one launch (+ merge), left on the device.
struct Run {
  DeviceBuffer items, partials, out;
  int64_t partial_bytes = 0, out_bytes = 0;
  AttentionParams params;
};

void Launch(const Problem& pb, const Kernel& kernel, const std::vector<int32_t>& items,
            int max_splits, Run* run) {
  const Shape& s = pb.shape;
  run->items = Upload(items);
  run->partial_bytes = static_cast<int64_t>(pb.num_tokens()) * s.nh * max_splits * (s.hd + 2) * 4;
  run->out_bytes = static_cast<int64_t>(pb.num_tokens()) * s.nh * s.hd * 2;
  if (run->partials.bytes() < static_cast<size_t>(run->partial_bytes)) {
    Check(run->partials.Allocate(run->partial_bytes), "allocate partials");
  }
  if (run->out.bytes() < static_cast<size_t>(run->out_bytes)) {
    Check(run->out.Allocate(run->out_bytes), "allocate out");
  }
  Check(cudaMemset(run->partials.get(), 0xff, run->partial_bytes), "memset");
  Check(cudaMemset(run->out.get(), 0xff, run->out_bytes), "memset");
  AttentionParams& p = run->params;
  p.q = pb.q.get<float>();
  p.positions = pb.d_positions.get<int32_t>();
  p.table_offsets = pb.d_offsets.get<int32_t>();
  p.tables = pb.d_tables.get<int32_t>();
  p.items = run->items.get<int2>();
  p.num_items = static_cast<int32_t>(items.size() / 2);
  p.num_heads = s.nh;
  p.split_size = s.split;
  p.scale = 1.0f / std::sqrt(static_cast<float>(s.hd));
  p.out = run->out.get<bf16>();
  p.partials = run->partials.get<float>();
  p.max_splits = max_splits;
  Check(kernel.launch(p, pb.view(), nullptr), kernel.name.c_str());
  if (!kernel.folds) Check(cuda::MergeAttentionSplits(p, pb.num_tokens(), s.hd, nullptr), "merge");
  Check(cudaDeviceSynchronize(), kernel.name.c_str());
}

// What the engine launches for a prefill slice: one-token items split-parallel into partials,
// many-token items folding in-block, then MergeAttentionSplitsOfItems over the one-token items.
void LaunchEngineFold(const Problem& pb, const std::vector<int32_t>& items, int max_splits,
                      Run* run, DeviceBuffer* many_items) {
  std::vector<int32_t> one, many;
  for (size_t i = 0; i < items.size(); i += 2) {
    std::vector<int32_t>& list = items[i + 1] == 1 ? one : many;
    list.insert(list.end(), {items[i], items[i + 1]});
  }
  const Kernel split = New(AttentionBlockShape::kOneToken);
  Launch(pb,
         {split.name, [](const AttentionParams&, KvCacheView, cudaStream_t) { return cudaSuccess; },
          /*folds=*/true},
         one, max_splits, run);  // buffers and params only
  AttentionParams p = run->params;
  Check(cuda::PagedAttentionMma(p, AttentionBlockShape::kOneToken, pb.view(), nullptr), "one");
  *many_items = Upload(many);
  AttentionParams q = p;
  q.items = many_items->get<int2>();
  q.num_items = static_cast<int32_t>(many.size() / 2);
  q.partials = nullptr;
  Check(cuda::PagedAttentionMma(q, AttentionBlockShape::kManyTokens, pb.view(), nullptr), "many");
  Check(cuda::MergeAttentionSplitsOfItems(p, pb.shape.hd, nullptr), "merge of items");
  Check(cudaDeviceSynchronize(), "engine fold");
}

uint64_t DifferentWords(const void* a, const void* b, int64_t bytes) {
  unsigned long long host = 0;
  Check(cuda::CountDifferentWordsOnHost(a, b, bytes, &host), "compare");
  return host;
}

int g_checks = 0, g_failures = 0;

void Report(const Problem& pb, const std::string& name, const char* what, uint64_t partials,
            uint64_t outs) {
  ++g_checks;
  if (partials != 0 || outs != 0) {
    ++g_failures;
    std::printf("  MISMATCH %s, %s (%s): %llu partial words, %llu output words differ\n",
                name.c_str(), what, Describe(pb.shape).c_str(),
                static_cast<unsigned long long>(partials), static_cast<unsigned long long>(outs));
  }
}

// The engine's prefill launches (LaunchEngineFold) on `items`: outputs equal `ref`'s bitwise.
void ExpectSameBitsEngineFold(const Problem& pb, const Run& ref, const std::vector<int32_t>& items,
                              const char* what) {
  Run run;
  DeviceBuffer many;
  LaunchEngineFold(pb, items, ref.params.max_splits, &run, &many);
  Report(pb, "engine fold", what, 0, DifferentWords(ref.out.get(), run.out.get(), ref.out_bytes));
}

// Runs `kernel` on `items` and compares its partials (unless it folds: it has none) and outputs
// with `ref`'s, bitwise.
void ExpectSameBits(const Problem& pb, const Run& ref, const Kernel& kernel,
                    const std::vector<int32_t>& items, const char* what) {
  Run run;
  Launch(pb, kernel, items, ref.params.max_splits, &run);
  if (kernel.folds) {
    Report(pb, kernel.name, what, 0, DifferentWords(ref.out.get(), run.out.get(), ref.out_bytes));
    return;
  }
  const uint64_t partials =
      DifferentWords(ref.partials.get(), run.partials.get(), ref.partial_bytes);
  Report(pb, kernel.name, what, partials,
         DifferentWords(ref.out.get(), run.out.get(), ref.out_bytes));
}

// Not vacuous: the reference wrote partials, and every output (all rows have keys) is finite.
void ExpectWritten(const Run& ref) {
  DeviceBuffer untouched;
  Check(untouched.Allocate(ref.partial_bytes), "allocate");
  Check(cudaMemset(untouched.get(), 0xff, ref.partial_bytes), "memset");
  const uint64_t written = DifferentWords(untouched.get(), ref.partials.get(), ref.partial_bytes);
  std::vector<uint16_t> out(ref.out_bytes / 2);
  Check(cudaMemcpy(out.data(), ref.out.get(), ref.out_bytes, cudaMemcpyDeviceToHost), "download");
  int64_t bad = 0;
  for (uint16_t h : out) bad += (h & 0x7f80) == 0x7f80 ? 1 : 0;  // inf or nan
  ++g_checks;
  if (written == 0 || bad != 0) {
    ++g_failures;
    std::printf("  REFERENCE VACUOUS: %llu partial words written, %lld non-finite outputs\n",
                static_cast<unsigned long long>(written), static_cast<long long>(bad));
  }
}

void CheckBits(bool quick) {
  std::printf("== bit identity: new vs old (partials and merged outputs, bitwise)\n");
  const std::vector<Shape> shapes = {
      {32, 8, 128, 32, 256},  {32, 8, 128, 16, 64}, {8, 2, 32, 16, 64},    {16, 2, 64, 32, 32},
      {16, 16, 128, 32, 128}, {32, 2, 64, 16, 256}, {64, 8, 128, 32, 256}, {32, 1, 128, 16, 32}};
  std::mt19937 rng(7);
  uint64_t seed = 1;
  for (const Shape& s : shapes) {
    const int group = s.nh / s.nkv;
    // Decode batches, contexts 1..4096 (1 and 4096 included), with idle splits past the need
    // (a CUDA graph's fixed max_splits).
    for (int batch : quick ? std::vector<int>{1, 64} : std::vector<int>{1, 7, 64, 256}) {
      std::vector<int32_t> lengths(batch);
      std::uniform_int_distribution<int32_t> len(1, 4096);
      for (int32_t& l : lengths) l = len(rng);
      lengths[0] = batch == 1 ? 777 : 1;
      if (batch > 1) lengths[1] = 4096;
      Problem pb;
      Build(s, lengths, /*decode=*/true, seed++, &pb);
      const std::vector<int32_t> items = Items(pb, {1}, 1);
      Run ref;
      Launch(pb, Old(AttentionBlockShape::kOneToken), items, pb.max_splits + 3, &ref);
      ExpectWritten(ref);
      ExpectSameBits(pb, ref, New(AttentionBlockShape::kOneToken), items, "decode");
      ExpectSameBits(pb, ref, New(AttentionBlockShape::kManyTokens), items, "decode items");
      ExpectSameBits(pb, ref, NewFold(), items, "decode items, folded");
    }
    // Prefills: every position of a few sequences, cut into items of the most tokens a block
    // takes (the reference) and at odd places.
    for (int round = 0; round < (quick ? 1 : 3); ++round) {
      std::uniform_int_distribution<int32_t> len(1, 1500);
      std::vector<int32_t> lengths = {len(rng), 1, len(rng), 33};
      Problem pb;
      Build(s, lengths, /*decode=*/false, seed++, &pb);
      const int cap = cuda::AttentionItemTokens(group);
      Run ref;
      Launch(pb, Old(AttentionBlockShape::kManyTokens), Items(pb, {cap}, cap), pb.max_splits + 1,
             &ref);
      ExpectWritten(ref);
      const Kernel many = New(AttentionBlockShape::kManyTokens);
      ExpectSameBits(pb, ref, many, Items(pb, {cap}, cap), "prefill");
      ExpectSameBits(pb, ref, many, Items(pb, {3, 1, cap, 7, 2}, cap), "prefill, chunked");
      ExpectSameBits(pb, ref, NewFold(), Items(pb, {cap}, cap), "prefill, folded");
      ExpectSameBits(pb, ref, NewFold(), Items(pb, {3, 1, cap, 7, 2}, cap),
                     "prefill, chunked, folded");
      ExpectSameBitsEngineFold(pb, ref, Items(pb, {cap}, cap), "prefill");
      ExpectSameBitsEngineFold(pb, ref, Items(pb, {3, 1, cap, 7, 2, 1, 1}, cap),
                               "prefill, chunked with one-token items");
      ExpectSameBits(pb, ref, Old(AttentionBlockShape::kManyTokens), Items(pb, {5, cap, 1}, cap),
                     "prefill, chunked (old vs old)");
      if (group <= 16) {
        ExpectSameBits(pb, ref, New(AttentionBlockShape::kOneToken), Items(pb, {1}, 1),
                       "prefill as one-token items");
      }
    }
    std::printf("  %-45s done (%d checks, %d failures so far)\n", Describe(s).c_str(), g_checks,
                g_failures);
  }
  std::printf("bitwise equal: %s (%d checks, %d failures)\n", g_failures == 0 ? "yes" : "NO",
              g_checks, g_failures);
}

// Median milliseconds of `reps` launches of f (after two warm-ups).
template <typename F>
double MedianMs(int reps, F f) {
  cudaEvent_t start, stop;
  Check(cudaEventCreate(&start), "event");
  Check(cudaEventCreate(&stop), "event");
  std::vector<float> ms;
  for (int i = 0; i < reps + 2; ++i) {
    Check(cudaEventRecord(start), "record");
    f();
    Check(cudaEventRecord(stop), "record");
    Check(cudaEventSynchronize(stop), "sync");
    float t = 0;
    Check(cudaEventElapsedTime(&t, start, stop), "elapsed");
    if (i >= 2) ms.push_back(t);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

constexpr int kLayers = 36;  // Qwen3-8B: figures per step are one layer's times 36

// Read-rate probes, no math: how fast the device streams bytes it only reads, linearly and in
// the decode kernel's exact access pattern (one warp per (token, split, kv head), kv heads
// fastest, each key's 256-byte K and V rows of one head, pages shuffled). `smem` pads a block's
// shared memory to limit blocks per SM as the real kernel's does.
__global__ void LinearReadKernel(const uint4* a, int64_t n, uint32_t* sink) {
  uint32_t acc = 0;
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  for (; i + 3 * stride < n; i += 4 * stride) {  // four loads in flight per thread
    uint4 v[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) v[u] = __ldcs(a + i + u * stride);
#pragma unroll
    for (int u = 0; u < 4; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  for (; i < n; i += stride) {
    const uint4 v = __ldcs(a + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9e3779b9u) sink[0] = acc;
}

// kHeadMajor: pages as the cache stores them, [kv head][token][dim] (a head's 32 keys 8 KB
// contiguous); else as it stored them before, [token][kv head][dim] (256 B per key and head, 2 KB
// apart). Each warp loads a whole 32-key tile of K and V (16 KB) before touching it, as cp.async
// does.
template <bool kHeadMajor>
__global__ void PatternReadKernel(const int32_t* positions, const int32_t* offsets,
                                  const int32_t* tables, const bf16* k, const bf16* v, int nkv,
                                  int bs, int split_size, int max_splits, uint32_t* sink) {
  extern __shared__ uint4 pad[];
  const int kv_head = blockIdx.x % nkv;
  const int flat = blockIdx.x / nkv;
  const int token = flat / max_splits, split = flat % max_splits;
  const int pos = positions[token];
  const int begin = split * split_size, end = min(pos + 1, begin + split_size);
  if (begin >= end) return;
  const int32_t* table = tables + offsets[token];
  const int lane = threadIdx.x;
  uint32_t acc = 0;
  for (int tile = begin; tile < end; tile += 32) {
    uint4 x[32];
#pragma unroll
    for (int q = 0; q < 16; ++q) {
      const int idx = q * 32 + lane;
      const int key = tile + idx / 16, chunk = idx % 16;
      const int64_t page = table[min(key, pos) / bs];
      const int64_t off = (kHeadMajor ? cuda::KvPageOffset(page, kv_head, key % bs, bs, nkv, 128)
                                      : ((page * bs + key % bs) * nkv + kv_head) * 128) +
                          chunk * 8;
      x[q] = __ldcs(reinterpret_cast<const uint4*>(k + off));
      x[16 + q] = __ldcs(reinterpret_cast<const uint4*>(v + off));
    }
#pragma unroll
    for (int c = 0; c < 32; ++c) acc ^= x[c].x ^ x[c].y ^ x[c].z ^ x[c].w;
  }
  if (acc == 0x9e3779b9u) sink[0] = acc ^ pad[0].x;
}

void ReadProbes(const Problem& pb, double copy_bw, int reps) {
  DeviceBuffer sink;
  Check(sink.Allocate(4), "allocate");
  const int64_t cache_bytes = static_cast<int64_t>(pb.KeyBytes());
  const int64_t n = cache_bytes / 2 / 16;  // of K alone, in uint4
  const double lin = MedianMs(reps, [&] {
    LinearReadKernel<<<132 * 16, 256>>>(pb.k.get<uint4>(), n, sink.get<uint32_t>());
    LinearReadKernel<<<132 * 16, 256>>>(pb.v.get<uint4>(), n, sink.get<uint32_t>());
  });
  std::printf("   probe, linear read of %.1f MB: %.4f ms = %.2f TB/s (%.0f%% of copy)\n",
              2.0 * n * 16 / 1e6, lin, 2.0 * n * 16 / (lin * 1e-3) / 1e12,
              100.0 * 2.0 * n * 16 / (lin * 1e-3) / copy_bw);
  const Shape& s = pb.shape;
  const unsigned blocks = static_cast<unsigned>(pb.num_tokens() * pb.max_splits * s.nkv);
  for (int head_major = 0; head_major < 2; ++head_major) {
    for (int smem : {0, 17 * 1024 + 512}) {
      auto kernel = head_major ? PatternReadKernel<true> : PatternReadKernel<false>;
      const double ms = MedianMs(reps, [&] {
        kernel<<<blocks, 32, smem>>>(pb.d_positions.get<int32_t>(), pb.d_offsets.get<int32_t>(),
                                     pb.d_tables.get<int32_t>(), pb.k.get<bf16>(), pb.v.get<bf16>(),
                                     s.nkv, s.bs, s.split, pb.max_splits, sink.get<uint32_t>());
      });
      Check(cudaGetLastError(), "pattern probe");
      std::printf(
          "   probe, decode pattern (%s), no math, %s: %.4f ms = %.2f TB/s (%.0f%% of copy)\n",
          head_major ? "head-major pages, the cache's" : "token-major pages",
          smem == 0 ? "32 warps/SM" : "12 warps/SM", ms, pb.KeyBytes() / (ms * 1e-3) / 1e12,
          100.0 * pb.KeyBytes() / (ms * 1e-3) / copy_bw);
    }
  }
}

double TimeKernel(const Problem& pb, const Kernel& kernel, const std::vector<int32_t>& items,
                  int max_splits, int reps) {
  Run run;
  Launch(pb, kernel, items, max_splits, &run);
  return MedianMs(reps, [&] { Check(kernel.launch(run.params, pb.view(), nullptr), "launch"); });
}

double TimeMerge(const Problem& pb, int max_splits, int reps) {
  Run run;
  Launch(pb, New(AttentionBlockShape::kOneToken), Items(pb, {1}, 1), max_splits, &run);
  return MedianMs(reps, [&] {
    Check(cuda::MergeAttentionSplits(run.params, pb.num_tokens(), pb.shape.hd, nullptr), "merge");
  });
}

// One layer's decode attention for `batch` sequences of lengths lo..hi, old vs new.
void TimeDecode(int batch, int lo, int hi, double copy_bw, bool quick) {
  const Shape s{32, 8, 128, 32, 256};
  std::mt19937 rng(11);
  std::uniform_int_distribution<int32_t> len(lo, hi);
  std::vector<int32_t> lengths(batch);
  for (int32_t& l : lengths) l = len(rng);
  Problem pb;
  Build(s, lengths, /*decode=*/true, 99, &pb);
  const std::vector<int32_t> items = Items(pb, {1}, 1);
  const double bytes = pb.KeyBytes();
  const int reps = quick ? 5 : 21;
  std::printf("\n== decode: %d sequences at context %d..%d (%s), one layer; step = x%d\n", batch,
              lo, hi, Describe(s).c_str(), kLayers);
  std::printf("   K/V read per layer %.1f MB; device copy %.2f TB/s\n", bytes / 1e6,
              copy_bw / 1e12);
  if (s.hd == 128) ReadProbes(pb, copy_bw, reps);
  const double merge = TimeMerge(pb, pb.max_splits, reps);
  std::printf("   merge of the splits: %.4f ms/layer = %.2f ms/step\n", merge, merge * kLayers);
  std::printf(
      "   (the old kernel's copy addresses the head-major cache through cuda::KvOffset, a\n"
      "   division per key: a bitwise reference, its times no longer the old kernel's)\n");
  const int padded = 2 * pb.max_splits;  // half the blocks idle, as in a padded CUDA graph
  double cur_ms = 0;                     // x factors against the old kernel
  for (const Kernel& k :
       {Old(AttentionBlockShape::kOneToken), New(AttentionBlockShape::kOneToken)}) {
    const double ms = TimeKernel(pb, k, items, pb.max_splits, reps);
    const double idle = TimeKernel(pb, k, items, padded, reps);
    if (cur_ms == 0) cur_ms = ms;
    std::printf(
        "   %-15s %.4f ms/layer = %6.2f ms/step (with merge %6.2f)  %4.2f TB/s = %3.0f%% of copy"
        "  x%.2f  [max_splits %d -> %d: %.4f ms]\n",
        k.name.c_str(), ms, ms * kLayers, (ms + (k.folds ? 0.0 : merge)) * kLayers,
        bytes / (ms * 1e-3) / 1e12, 100.0 * bytes / (ms * 1e-3) / copy_bw, cur_ms / ms,
        pb.max_splits, padded, idle);
  }
}

// One layer's prefill attention for `sequences` x `length` tokens, old vs new.
void TimePrefill(int sequences, int length, bool quick) {
  const Shape s{32, 8, 128, 32, 256};
  Problem pb;
  Build(s, std::vector<int32_t>(sequences, length), /*decode=*/false, 5, &pb);
  const int reps = quick ? 3 : 9;
  const int cap = cuda::AttentionItemTokens(s.nh / s.nkv);
  std::printf("\n== prefill: %d x %d tokens (%s), items of %d tokens, one layer; step = x%d\n",
              sequences, length, Describe(s).c_str(), cap, kLayers);
  const double merge = TimeMerge(pb, pb.max_splits, reps);
  std::printf("   merge of the splits: %.4f ms/layer = %.2f ms/step\n", merge, merge * kLayers);
  double cur_total = 0;  // x factors of kernel + merge against the old kernel's
  for (const Kernel& k :
       {Old(AttentionBlockShape::kManyTokens), New(AttentionBlockShape::kManyTokens), NewFold()}) {
    const double ms = TimeKernel(pb, k, Items(pb, {cap}, cap), pb.max_splits, reps);
    const double total = ms + (k.folds ? 0.0 : merge);
    if (cur_total == 0) cur_total = total;
    std::printf(
        "   %-17s %.4f ms/layer = %6.2f ms/step; with merge %.4f ms/layer = %6.2f ms/step"
        "  x%.2f%s\n",
        k.name.c_str(), ms, ms * kLayers, total, total * kLayers, cur_total / total,
        k.folds ? " (no merge: splits folded in-block)" : "");
  }
}

}  // namespace
}  // namespace rollout

int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  cudaDeviceProp prop;
  rollout::Check(cudaGetDeviceProperties(&prop, 0), "device");
  std::printf("%s, %d SMs\n", prop.name, prop.multiProcessorCount);
  // ROLLOUT_ATTENTION_BENCH_TIMES_ONLY=1 skips the bit checks (for profilers: the first launch
  // of the library kernel is then the first decode problem's).
  if (std::getenv("ROLLOUT_ATTENTION_BENCH_TIMES_ONLY") == nullptr) rollout::CheckBits(quick);
  const double copy_bw = rollout::bench::MeasureCopyBandwidth();
  rollout::TimeDecode(256, 1473, 1600, copy_bw, quick);  // the benchmark's mean decode step
  rollout::TimeDecode(32, 3800, 4096, copy_bw, quick);
  // Long contexts (issue 16): the decode steps of 4096/4096 (95 running, contexts 4K..8K) and
  // 8192/8192 (47 running, 8K..16K), and a few sequences at ~16K.
  rollout::TimeDecode(95, 4096, 8192, copy_bw, quick);
  rollout::TimeDecode(47, 8192, 16384, copy_bw, quick);
  rollout::TimeDecode(16, 15360, 16384, copy_bw, quick);
  rollout::TimePrefill(8, 1024, quick);
  rollout::TimePrefill(4, 4096, quick);  // the 16,384-token prefill step of 4096-token prompts
  return rollout::g_failures == 0 ? 0 : 1;
}
