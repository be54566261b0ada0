#pragma once

// The host half of one forward slice of the CUDA runner: the attention work items, the split
// count of the attention grid, whether the slice replays a decode graph (padded to its bucket),
// and the int32 metadata every kernel of the slice reads, packed at fixed offsets. Includes no
// CUDA header, so it is tested on a CPU (batch_plan_test.cc); the CUDA runner uploads what it
// packs and launches (forward.cc). Pure functions; any thread.

#include <cstddef>
#include <cstdint>
#include <map>
#include <vector>

#include "engine/model_runner.h"

namespace rollout {
namespace cuda_runner_internal {

// One slice's launch shape, and where its int32 metadata lives in State::meta: token_ids [n],
// positions [n], kv_slots [n], table_offsets [n], logit rows [num_rows], one-token items
// [2 * num_one], many-token items [2 * num_many], with `shares` the one-token items' prefix
// shares [4 * num_one] and their token lists [n], then the block tables (and, after them, the
// fed-token pairs: SlicePlan::off_fed). The item arrays start on even offsets (int2 loads), the
// shares on multiples of 4 (int4); the ints skipped before them are never written. A decode
// graph is captured for one shape and replayed with new metadata at the same offsets.
struct SliceShape {
  int64_t n = 0;  // tokens, padding rows included
  int64_t num_rows = 0;
  int64_t num_one = 0;   // items of one token
  int64_t num_many = 0;  // items of several tokens
  int32_t max_splits = 1;
  int64_t row_begin = 0;  // the slice's first logits row among the Forward's
  bool shares = false;    // SlicePlanOptions::share_tokens > 1

  static int64_t Even(int64_t x) { return (x + 1) / 2 * 2; }
  static int64_t Quad(int64_t x) { return (x + 3) / 4 * 4; }
  int64_t off_tokens() const { return 0; }
  int64_t off_pos() const { return n; }
  int64_t off_slots() const { return 2 * n; }
  int64_t off_tab() const { return 3 * n; }
  int64_t off_rows() const { return 4 * n; }
  int64_t off_one() const { return Even(off_rows() + num_rows); }
  int64_t off_many() const { return Even(off_one() + 2 * num_one); }
  int64_t off_shares() const { return Quad(off_many() + 2 * num_many); }
  int64_t off_share_tokens() const { return off_shares() + 4 * num_one; }
  int64_t off_tables() const { return shares ? off_share_tokens() + n : off_many() + 2 * num_many; }
};

// What a plan needs of the runner; fixed after construction.
struct SlicePlanOptions {
  int32_t kv_block_size = 32;
  int32_t attention_split_size = 256;
  // Most tokens in one many-token work item (cuda::AttentionItemTokens of the GQA group).
  int item_tokens = 1;
  // Split partials for every token (the tensor-core kernel), else for one-token items only
  // (the SIMT kernel's split-parallel decode).
  bool splits_for_every_token = true;
  // The largest decode-graph bucket; 0: no decode graphs (CudaRunnerOptions::cuda_graphs off).
  int64_t largest_graph_bucket = 0;
  // The KV block outside the engine's pool that padding rows write and read.
  int32_t pad_block = 0;
  // Most decode tokens one attention block reads a shared split's pages for
  // (cuda::AttentionShareTokens of the GQA group, with the tensor-core kernel); <= 1: no prefix
  // sharing (the shares are not laid out).
  int share_tokens = 1;
};

// The bucket a decode batch of n tokens is padded to: 1, 2, 4, 8, 16, 32, then multiples of 32,
// capped at `largest`; 0 when n is above `largest` (or below 1).
int64_t DecodeGraphBucket(int64_t n, int64_t largest);

// Tokens [begin, end) of a batch as one slice.
struct SlicePlan {
  int64_t begin = 0, end = 0;
  // The slice's logits rows: batch.logit_rows[shape.row_begin, row_end).
  int64_t row_end = 0;
  // > 0: a decode step replayed as the graph of this many rows (shape.n == graph_bucket); the
  // rows beyond end - begin are padding.
  int64_t graph_bucket = 0;
  SliceShape shape;
  // (first token, count) pairs, slice-relative: runs of consecutive tokens of one sequence, cut
  // into pieces of at most item_tokens; one-token runs in items_one. Padding rows not included.
  std::vector<int32_t> items_one, items_many;
  // With SlicePlanOptions::share_tokens > 1: the prefix share of each one-token item, 4 ints
  // each (cuda::AttentionShareTokens says what they mean; zeros: none), and the slice-relative
  // tokens the leads' shares list (PlanShares says which items share).
  std::vector<int32_t> shares, share_tokens;
  // Each sequence's block table offset among the slice's tables (in order of first use); the
  // padding rows' one-entry table at pad_table, after them.
  std::map<int32_t, int32_t> table_offset_of;
  int32_t pad_table = 0;
  int64_t tables_size = 0;  // ints of block tables, the padding rows' included
  // Fed tokens of the slice: (slice-relative token index, row of the step launched before)
  // pairs at off_fed, which FeedSampledTokens copies into the token ids on the device.
  int64_t num_fed = 0;
  int64_t off_fed = 0;

  int64_t tokens() const { return end - begin; }  // without padding rows
  int64_t rows() const { return row_end - shape.row_begin; }
  int64_t meta_ints() const { return off_fed + 2 * num_fed; }
  size_t meta_bytes() const { return static_cast<size_t>(meta_ints()) * 4; }
};

// The attention partials a runner holds, in tokens x splits (they are laid out [tokens, heads,
// splits, head_dim + 2] for the largest split count of the slice): enough for every decode step
// that may replay a graph -- the largest graph bucket at the split count of max_context, rounded
// up to a power of two as the graphs' grids are -- and for max_tokens tokens at one split.
int64_t PlannedTokenSplits(int64_t max_context, int64_t max_tokens,
                           const SlicePlanOptions& options);

// The end of the slice that starts at `begin`: at most max_tokens tokens, and at most
// `token_splits` tokens x the largest split count among them, so that no slice needs more
// attention partials than were planned at load. Cutting a step into slices changes no bit (rows
// are batch invariant). At least one token; REQUIRES: begin < batch.num_tokens().
int64_t SliceEnd(const ForwardBatch& batch, int64_t begin, int64_t max_tokens, int64_t token_splits,
                 const SlicePlanOptions& options);

// The plan of tokens [begin, end) of `batch`. may_replay_graph: what the runner allows beyond the
// batch's shape (the logits stay on the device, not profiling, no capture failed, one device).
// REQUIRES: the batch passed CudaModelRunner::ForwardImpl's checks; 0 <= begin < end <=
// batch.num_tokens().
SlicePlan PlanSlice(const ForwardBatch& batch, int64_t begin, int64_t end,
                    const SlicePlanOptions& options, bool may_replay_graph);

// Writes the plan's metadata into meta[0, plan.meta_ints()) (SliceShape's layout; the ints
// skipped for even offsets are left as they are).
void PackSliceMetadata(const ForwardBatch& batch, const SlicePlan& plan,
                       const SlicePlanOptions& options, int32_t* meta);

}  // namespace cuda_runner_internal
}  // namespace rollout
