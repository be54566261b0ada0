#include "runner/cuda/batch_plan.h"

#include <algorithm>

namespace rollout {
namespace cuda_runner_internal {

int64_t DecodeGraphBucket(int64_t n, int64_t largest) {
  if (n < 1 || n > largest) return 0;
  int64_t bucket = 1;
  while (bucket < n && bucket < 32) bucket *= 2;
  if (bucket < n) bucket = (n + 31) / 32 * 32;
  return std::min(bucket, largest);
}

namespace {

// Work items: runs of consecutive tokens of one sequence, cut into pieces of item_tokens.
void CutWorkItems(const ForwardBatch& batch, int64_t begin, int64_t end, int item_tokens,
                  SlicePlan* plan) {
  for (int64_t i = begin; i < end;) {
    int64_t j = i + 1;
    while (j < end && j - i < item_tokens && batch.token_seq[j] == batch.token_seq[i]) ++j;
    std::vector<int32_t>& items = j - i == 1 ? plan->items_one : plan->items_many;
    items.push_back(static_cast<int32_t>(i - begin));
    items.push_back(static_cast<int32_t>(j - i));
    i = j;
  }
}

// Prefix sharing (cuda::AttentionShareTokens): one-token items whose sequences hold the same pages
// for whole splits from the first on -- the samples of a request over their prompt, sequences
// over a cached prefix -- form groups of at most share_tokens, in item order among the items of
// one first page; each group's first item (its lead) computes the rows of all of them for the
// splits they have in common with it (whole for every member, the same pages in every table),
// and the others start after those. Which items share changes which block reads the pages, never
// a row's arithmetic, so the plan need not be optimal: a group shares as many splits as its
// member with the fewest in common with the lead. Host work per decode step: one sort of the
// items by their first page id, then page compares; no allocation per item.
void PlanShares(const ForwardBatch& batch, const SlicePlanOptions& options, SlicePlan* plan) {
  const int64_t num_items = static_cast<int64_t>(plan->items_one.size() / 2);
  plan->shares.assign(4 * num_items, 0);
  const int32_t split = options.attention_split_size;
  const int32_t pages = split / options.kv_block_size;
  if (options.share_tokens < 2 || pages < 1 || split % options.kv_block_size != 0) return;
  auto token = [&](int64_t i) { return plan->begin + plan->items_one[2 * i]; };
  auto table = [&](int64_t i) -> const std::vector<int32_t>& {
    return batch.block_tables[batch.token_seq[token(i)]];
  };
  // Splits wholly at or below the item's position: keys it attends to in full.
  auto whole_splits = [&](int64_t i) { return (batch.positions[token(i)] + 1) / split; };
  // Splits [0, k) with the same pages in the tables of items a and b, k <= limit.
  auto same_splits = [&](int64_t a, int64_t b, int32_t limit) {
    int32_t k = 0;
    while (k < limit && std::equal(table(a).begin() + k * pages, table(a).begin() + (k + 1) * pages,
                                   table(b).begin() + k * pages)) {
      ++k;
    }
    return k;
  };
  // (first page, item) of the items with a whole split, by first page, then item order.
  std::vector<std::pair<int32_t, int64_t>> order;
  for (int64_t i = 0; i < num_items; ++i) {
    if (whole_splits(i) >= 1) order.emplace_back(table(i)[0], i);
  }
  std::sort(order.begin(), order.end());
  std::vector<bool> taken(order.size(), false);  // a member of an earlier group
  std::vector<int64_t> group;
  for (size_t run = 0; run < order.size();) {
    size_t run_end = run + 1;
    while (run_end < order.size() && order[run_end].first == order[run].first) ++run_end;
    // Groups in item order: a lead, then the items after it that share a split with it.
    for (size_t l = run; l < run_end; ++l) {
      if (taken[l]) continue;
      const int64_t lead = order[l].second;
      int32_t shared = whole_splits(lead);
      group.assign(1, lead);
      for (size_t m = l + 1; m < run_end && static_cast<int>(group.size()) < options.share_tokens;
           ++m) {
        const int64_t item = order[m].second;
        if (taken[m]) continue;
        const int32_t k = same_splits(lead, item, std::min(whole_splits(lead), whole_splits(item)));
        if (k < 1) continue;
        shared = std::min(shared, k);
        taken[m] = true;
        group.push_back(item);
      }
      if (group.size() < 2) continue;
      int32_t* lead_share = &plan->shares[4 * lead];
      lead_share[1] = shared;
      lead_share[2] = static_cast<int32_t>(group.size());
      lead_share[3] = static_cast<int32_t>(plan->share_tokens.size());
      for (const int64_t member : group) {
        plan->share_tokens.push_back(plan->items_one[2 * member]);
        if (member != lead) plan->shares[4 * member] = shared;  // starts after the shared splits
      }
    }
    run = run_end;
  }
}

// The most KV splits a token of the slice needs partials for: every token with the tensor-core
// kernel, the one-token items with the SIMT kernel's split-parallel decode.
int32_t MaxSplits(const ForwardBatch& batch, int64_t begin, int64_t end,
                  const SlicePlanOptions& options) {
  int32_t max_splits = 1;
  for (int64_t i = begin; i < end; ++i) {
    const bool one_token = (i == begin || batch.token_seq[i - 1] != batch.token_seq[i]) &&
                           (i + 1 == end || batch.token_seq[i + 1] != batch.token_seq[i]);
    if (options.splits_for_every_token || one_token) {
      max_splits = std::max(max_splits, batch.positions[i] / options.attention_split_size + 1);
    }
  }
  return max_splits;
}

}  // namespace

int64_t PlannedTokenSplits(int64_t max_context, int64_t max_tokens,
                           const SlicePlanOptions& options) {
  int64_t splits = 1;
  while (splits * options.attention_split_size < max_context) splits *= 2;
  return std::max(std::max<int64_t>(options.largest_graph_bucket, 1) * splits, max_tokens);
}

int64_t SliceEnd(const ForwardBatch& batch, int64_t begin, int64_t max_tokens, int64_t token_splits,
                 const SlicePlanOptions& options) {
  const int64_t t = batch.num_tokens();
  int64_t end = begin + 1;
  int64_t splits = batch.positions[begin] / options.attention_split_size + 1;
  while (end < t && end - begin < max_tokens) {
    const int64_t with_next =
        std::max<int64_t>(splits, batch.positions[end] / options.attention_split_size + 1);
    if ((end + 1 - begin) * with_next > token_splits) break;
    splits = with_next;
    ++end;
  }
  return end;
}

namespace {

// Block tables of the sequences in the slice, concatenated in order of first use; the padding
// rows' one-block table (the reserved block) last.
void LayOutTables(const ForwardBatch& batch, SlicePlan* plan) {
  int64_t tables_size = 0;
  for (int64_t i = plan->begin; i < plan->end; ++i) {
    if (plan->table_offset_of.emplace(batch.token_seq[i], static_cast<int32_t>(tables_size))
            .second) {
      tables_size += static_cast<int64_t>(batch.block_tables[batch.token_seq[i]].size());
    }
  }
  plan->pad_table = static_cast<int32_t>(tables_size);
  if (plan->shape.n > plan->tokens()) ++tables_size;
  plan->tables_size = tables_size;
}

bool FedIn(const SlicePlan& plan, const FedToken& f) {
  return f.token_index >= plan.begin && f.token_index < plan.end;
}

}  // namespace

SlicePlan PlanSlice(const ForwardBatch& batch, int64_t begin, int64_t end,
                    const SlicePlanOptions& options, bool may_replay_graph) {
  SlicePlan plan;
  plan.begin = begin;
  plan.end = end;
  const int64_t n = end - begin;
  // Logit rows inside this slice: [row_begin, row_end) of batch.logit_rows (ascending).
  const auto row_begin = std::lower_bound(batch.logit_rows.begin(), batch.logit_rows.end(),
                                          static_cast<int32_t>(begin)) -
                         batch.logit_rows.begin();
  const auto row_end = std::lower_bound(batch.logit_rows.begin(), batch.logit_rows.end(),
                                        static_cast<int32_t>(end)) -
                       batch.logit_rows.begin();
  const int64_t num_rows = row_end - row_begin;
  plan.row_end = row_end;
  CutWorkItems(batch, begin, end, options.item_tokens, &plan);
  PlanShares(batch, options, &plan);
  const int32_t max_splits = MaxSplits(batch, begin, end, options);

  // A decode step -- one token per sequence, every one with logits, the whole batch in this
  // slice -- runs as a graph padded to its bucket; its split grid is padded to a power of two.
  const bool decode =
      plan.items_many.empty() && num_rows == n && begin == 0 && row_begin == 0 && may_replay_graph;
  const int64_t bucket = decode ? DecodeGraphBucket(n, options.largest_graph_bucket) : 0;
  plan.graph_bucket = bucket;
  SliceShape& shape = plan.shape;
  shape.n = bucket > 0 ? bucket : n;
  shape.num_rows = bucket > 0 ? bucket : num_rows;
  shape.num_one = static_cast<int64_t>(plan.items_one.size() / 2) + (shape.n - n);
  shape.num_many = static_cast<int64_t>(plan.items_many.size() / 2);
  shape.row_begin = row_begin;
  shape.max_splits = max_splits;
  shape.shares = options.share_tokens > 1;
  if (bucket > 0) {
    while (shape.max_splits < max_splits || (shape.max_splits & (shape.max_splits - 1)) != 0) {
      ++shape.max_splits;
    }
  }

  LayOutTables(batch, &plan);
  plan.num_fed = std::count_if(batch.fed_tokens.begin(), batch.fed_tokens.end(),
                               [&](const FedToken& f) { return FedIn(plan, f); });
  plan.off_fed = shape.off_tables() + plan.tables_size;
  return plan;
}

void PackSliceMetadata(const ForwardBatch& batch, const SlicePlan& plan,
                       const SlicePlanOptions& options, int32_t* m) {
  const SliceShape& shape = plan.shape;
  const int64_t begin = plan.begin, n = plan.tokens(), num_rows = plan.rows();
  const int32_t bs = options.kv_block_size;
  int32_t* fed = m + plan.off_fed;
  for (const FedToken& f : batch.fed_tokens) {
    if (!FedIn(plan, f)) continue;
    *fed++ = static_cast<int32_t>(f.token_index - begin);  // copied in on the device
    *fed++ = f.from_row;
  }
  for (int64_t i = 0; i < n; ++i) {
    const int32_t pos = batch.positions[begin + i];
    const std::vector<int32_t>& table = batch.block_tables[batch.token_seq[begin + i]];
    const int32_t id = batch.token_ids[begin + i];
    m[shape.off_tokens() + i] = id;
    m[shape.off_pos() + i] = pos;
    m[shape.off_slots() + i] = table[pos / bs] * bs + pos % bs;
    m[shape.off_tab() + i] = plan.table_offset_of.at(batch.token_seq[begin + i]);
  }
  // Padding rows: token 0 at position 0 of the reserved block, attending to itself only.
  for (int64_t i = n; i < shape.n; ++i) {
    m[shape.off_tokens() + i] = 0;
    m[shape.off_pos() + i] = 0;
    m[shape.off_slots() + i] = options.pad_block * bs;
    m[shape.off_tab() + i] = plan.pad_table;
  }
  for (int64_t r = 0; r < num_rows; ++r) {
    m[shape.off_rows() + r] = static_cast<int32_t>(batch.logit_rows[shape.row_begin + r] - begin);
  }
  for (int64_t r = num_rows; r < shape.num_rows; ++r) {
    m[shape.off_rows() + r] = static_cast<int32_t>(r);
  }
  std::copy(plan.items_one.begin(), plan.items_one.end(), m + shape.off_one());
  for (int64_t i = n; i < shape.n; ++i) {
    m[shape.off_one() + 2 * (shape.num_one - (shape.n - i))] = static_cast<int32_t>(i);
    m[shape.off_one() + 2 * (shape.num_one - (shape.n - i)) + 1] = 1;
  }
  std::copy(plan.items_many.begin(), plan.items_many.end(), m + shape.off_many());
  if (shape.shares) {
    // The padding rows' items (after the real ones) share nothing.
    std::copy(plan.shares.begin(), plan.shares.end(), m + shape.off_shares());
    std::fill(m + shape.off_shares() + plan.shares.size(), m + shape.off_share_tokens(), 0);
    std::copy(plan.share_tokens.begin(), plan.share_tokens.end(), m + shape.off_share_tokens());
  }
  for (const auto& [seq, offset] : plan.table_offset_of) {
    const std::vector<int32_t>& table = batch.block_tables[seq];
    std::copy(table.begin(), table.end(), m + shape.off_tables() + offset);
  }
  if (shape.n > n) m[shape.off_tables() + plan.pad_table] = options.pad_block;
}

}  // namespace cuda_runner_internal
}  // namespace rollout
