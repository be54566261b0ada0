#include "runner/cuda/batch_plan.h"

#include <cstdint>
#include <vector>

#include "gtest/gtest.h"

namespace rollout {
namespace cuda_runner_internal {
namespace {

using ::std::vector;

// Never written by PackSliceMetadata: marks the ints it must leave alone.
constexpr int32_t kUntouched = -7;

vector<int32_t> Pack(const ForwardBatch& batch, const SlicePlan& plan,
                     const SlicePlanOptions& options) {
  vector<int32_t> meta(plan.meta_ints(), kUntouched);
  PackSliceMetadata(batch, plan, options, meta.data());
  return meta;
}

vector<int32_t> Slice(const vector<int32_t>& v, int64_t begin, int64_t count) {
  return vector<int32_t>(v.begin() + begin, v.begin() + begin + count);
}

SlicePlanOptions Options() {
  SlicePlanOptions o;
  o.kv_block_size = 4;
  o.attention_split_size = 8;
  o.item_tokens = 4;
  o.splits_for_every_token = true;
  o.largest_graph_bucket = 512;
  o.pad_block = 77;
  return o;
}

// Sequence A continues its prefill (positions 30..34, logits of the last), B and C decode one
// token each (C's fed from row 2 of the step launched before).
ForwardBatch MixedBatch() {
  ForwardBatch b;
  b.token_ids = {11, 12, 13, 14, 15, 21, 0};
  b.positions = {30, 31, 32, 33, 34, 20, 7};
  b.token_seq = {0, 0, 0, 0, 0, 1, 2};
  b.block_tables = {
      {100, 101, 102, 103, 104, 105, 106, 107, 108}, {200, 201, 202, 203, 204, 205}, {300, 301}};
  b.logit_rows = {4, 5, 6};
  b.fed_tokens = {FedToken{6, 2}};
  return b;
}

TEST(BatchPlanTest, MixedPrefillAndDecodePacksEveryArrayAtItsOffset) {
  const ForwardBatch batch = MixedBatch();
  const SlicePlan plan = PlanSlice(batch, 0, 7, Options(), /*may_replay_graph=*/true);
  // A prefill chunk in the batch: no graph, no padding.
  EXPECT_EQ(plan.graph_bucket, 0);
  const SliceShape& shape = plan.shape;
  EXPECT_EQ(shape.n, 7);
  EXPECT_EQ(shape.num_rows, 3);
  EXPECT_EQ(shape.row_begin, 0);
  // A's five tokens: one item of item_tokens = 4, then its last token as a one-token item.
  EXPECT_EQ(plan.items_many, (vector<int32_t>{0, 4}));
  EXPECT_EQ(plan.items_one, (vector<int32_t>{4, 1, 5, 1, 6, 1}));
  EXPECT_EQ(shape.num_one, 3);
  EXPECT_EQ(shape.num_many, 1);
  // Splits for every token with the tensor-core kernel: position 34 needs 34 / 8 + 1.
  EXPECT_EQ(shape.max_splits, 5);

  // [tokens 7][positions 7][slots 7][table offsets 7][rows 3] = 31 ints, one skipped, the
  // one-token items at 32, the many-token items at 38, the tables at 40, the fed pair at 57.
  EXPECT_EQ(shape.off_one(), 32);
  EXPECT_EQ(shape.off_many(), 38);
  EXPECT_EQ(shape.off_tables(), 40);
  EXPECT_EQ(plan.tables_size, 9 + 6 + 2);
  EXPECT_EQ(plan.num_fed, 1);
  EXPECT_EQ(plan.off_fed, 57);
  EXPECT_EQ(plan.meta_ints(), 59);
  EXPECT_EQ(plan.meta_bytes(), 59u * 4);

  const vector<int32_t> m = Pack(batch, plan, Options());
  EXPECT_EQ(Slice(m, shape.off_tokens(), 7), (vector<int32_t>{11, 12, 13, 14, 15, 21, 0}));
  EXPECT_EQ(Slice(m, shape.off_pos(), 7), (vector<int32_t>{30, 31, 32, 33, 34, 20, 7}));
  // slot = table[pos / 4] * 4 + pos % 4.
  EXPECT_EQ(Slice(m, shape.off_slots(), 7),
            (vector<int32_t>{107 * 4 + 2, 107 * 4 + 3, 108 * 4, 108 * 4 + 1, 108 * 4 + 2, 205 * 4,
                             301 * 4 + 3}));
  EXPECT_EQ(Slice(m, shape.off_tab(), 7), (vector<int32_t>{0, 0, 0, 0, 0, 9, 15}));
  EXPECT_EQ(Slice(m, shape.off_rows(), 3), (vector<int32_t>{4, 5, 6}));
  EXPECT_EQ(m[31], kUntouched);  // skipped so that the one-token items start on an even offset
  EXPECT_EQ(Slice(m, shape.off_one(), 6), (vector<int32_t>{4, 1, 5, 1, 6, 1}));
  EXPECT_EQ(Slice(m, shape.off_many(), 2), (vector<int32_t>{0, 4}));
  EXPECT_EQ(Slice(m, shape.off_tables(), 17),
            (vector<int32_t>{100, 101, 102, 103, 104, 105, 106, 107, 108, 200, 201, 202, 203, 204,
                             205, 300, 301}));
  // Fed token: (slice-relative token index, row of the previous step).
  EXPECT_EQ(Slice(m, plan.off_fed, 2), (vector<int32_t>{6, 2}));
}

TEST(BatchPlanTest, SimtKernelNeedsSplitsForOneTokenItemsOnly) {
  SlicePlanOptions o = Options();
  o.splits_for_every_token = false;
  const SlicePlan plan = PlanSlice(MixedBatch(), 0, 7, o, /*may_replay_graph=*/true);
  // B's token at position 20 (A's last token shares its sequence with the token before it).
  EXPECT_EQ(plan.shape.max_splits, 3);
}

TEST(BatchPlanTest, LaterSliceIsSliceRelativeAndKeepsOnlyItsFedTokens) {
  ForwardBatch batch = MixedBatch();
  batch.fed_tokens = {FedToken{3, 0}, FedToken{6, 2}};
  const SlicePlan plan = PlanSlice(batch, 5, 7, Options(), /*may_replay_graph=*/true);
  // Not the batch's first slice: never a graph.
  EXPECT_EQ(plan.graph_bucket, 0);
  EXPECT_EQ(plan.shape.n, 2);
  EXPECT_EQ(plan.shape.row_begin, 1);
  EXPECT_EQ(plan.rows(), 2);
  EXPECT_EQ(plan.num_fed, 1);
  const vector<int32_t> m = Pack(batch, plan, Options());
  const SliceShape& shape = plan.shape;
  EXPECT_EQ(Slice(m, shape.off_tokens(), 2), (vector<int32_t>{21, 0}));
  EXPECT_EQ(Slice(m, shape.off_tab(), 2), (vector<int32_t>{0, 6}));
  EXPECT_EQ(Slice(m, shape.off_rows(), 2), (vector<int32_t>{0, 1}));
  EXPECT_EQ(Slice(m, shape.off_one(), 4), (vector<int32_t>{0, 1, 1, 1}));
  EXPECT_EQ(Slice(m, shape.off_tables(), 8),
            (vector<int32_t>{200, 201, 202, 203, 204, 205, 300, 301}));
  EXPECT_EQ(Slice(m, plan.off_fed, 2), (vector<int32_t>{1, 2}));
}

// Three sequences decoding one token each, every one with logits.
ForwardBatch DecodeBatch() {
  ForwardBatch b;
  b.token_ids = {5, 6, 7};
  b.positions = {9, 17, 3};
  b.token_seq = {0, 1, 2};
  b.block_tables = {{1, 2, 3}, {4, 5, 6, 7, 8}, {9}};
  b.logit_rows = {0, 1, 2};
  return b;
}

TEST(BatchPlanTest, DecodeStepIsPaddedToItsGraphBucketWithRowsOnThePadBlock) {
  const ForwardBatch batch = DecodeBatch();
  const SlicePlan plan = PlanSlice(batch, 0, 3, Options(), /*may_replay_graph=*/true);
  EXPECT_EQ(plan.graph_bucket, 4);
  const SliceShape& shape = plan.shape;
  EXPECT_EQ(shape.n, 4);
  EXPECT_EQ(shape.num_rows, 4);
  EXPECT_EQ(shape.num_one, 4);
  EXPECT_EQ(shape.num_many, 0);
  EXPECT_EQ(plan.tokens(), 3);
  EXPECT_EQ(plan.rows(), 3);
  // Position 17 needs 3 splits; the graph's grid is padded to a power of two.
  EXPECT_EQ(shape.max_splits, 4);
  EXPECT_EQ(plan.pad_table, 9);
  EXPECT_EQ(plan.tables_size, 10);
  EXPECT_EQ(plan.meta_ints(), 38);

  const vector<int32_t> m = Pack(batch, plan, Options());
  // The padding row: token 0 at position 0 in the reserved block 77, its own one-block table.
  EXPECT_EQ(Slice(m, shape.off_tokens(), 4), (vector<int32_t>{5, 6, 7, 0}));
  EXPECT_EQ(Slice(m, shape.off_pos(), 4), (vector<int32_t>{9, 17, 3, 0}));
  EXPECT_EQ(Slice(m, shape.off_slots(), 4),
            (vector<int32_t>{3 * 4 + 1, 8 * 4 + 1, 9 * 4 + 3, 77 * 4}));
  EXPECT_EQ(Slice(m, shape.off_tab(), 4), (vector<int32_t>{0, 3, 8, 9}));
  // Padding rows' logits rows are their own token indices.
  EXPECT_EQ(Slice(m, shape.off_rows(), 4), (vector<int32_t>{0, 1, 2, 3}));
  EXPECT_EQ(Slice(m, shape.off_one(), 8), (vector<int32_t>{0, 1, 1, 1, 2, 1, 3, 1}));
  EXPECT_EQ(Slice(m, shape.off_tables(), 10), (vector<int32_t>{1, 2, 3, 4, 5, 6, 7, 8, 9, 77}));
}

TEST(BatchPlanTest, DecodeStepRunsEagerlyWhenTheRunnerAllowsNoGraph) {
  const SlicePlan plan = PlanSlice(DecodeBatch(), 0, 3, Options(), /*may_replay_graph=*/false);
  EXPECT_EQ(plan.graph_bucket, 0);
  EXPECT_EQ(plan.shape.n, 3);
  EXPECT_EQ(plan.shape.num_one, 3);
  EXPECT_EQ(plan.shape.max_splits, 3);  // not padded
  EXPECT_EQ(plan.tables_size, 9);       // no padding table
}

TEST(BatchPlanTest, DecodeStepWithoutLogitsForEveryTokenRunsEagerly) {
  ForwardBatch batch = DecodeBatch();
  batch.logit_rows = {0, 2};
  EXPECT_EQ(PlanSlice(batch, 0, 3, Options(), /*may_replay_graph=*/true).graph_bucket, 0);
}

TEST(BatchPlanTest, GraphBucketsArePowersOfTwoThenMultiplesOf32UpToTheLargest) {
  EXPECT_EQ(DecodeGraphBucket(0, 512), 0);
  EXPECT_EQ(DecodeGraphBucket(1, 512), 1);
  EXPECT_EQ(DecodeGraphBucket(3, 512), 4);
  EXPECT_EQ(DecodeGraphBucket(17, 512), 32);
  EXPECT_EQ(DecodeGraphBucket(33, 512), 64);
  EXPECT_EQ(DecodeGraphBucket(65, 512), 96);
  EXPECT_EQ(DecodeGraphBucket(512, 512), 512);
  EXPECT_EQ(DecodeGraphBucket(513, 512), 0);
  EXPECT_EQ(DecodeGraphBucket(99, 100), 100);  // capped at the largest
  EXPECT_EQ(DecodeGraphBucket(1, 0), 0);       // graphs off
}

// Options with prefix sharing: pages of 4 keys, splits of 8 (two pages), groups of 3 tokens.
SlicePlanOptions SharingOptions() {
  SlicePlanOptions o = Options();
  o.share_tokens = 3;
  return o;
}

// Five samples decoding over one cached prompt of 16 keys (pages 1-4, splits 0 and 1), each with
// pages of its own after it, and a sequence E of other pages.
//   token  seq  position  table
//   0      S0   19        1 2 3 4 10
//   1      E    19        5 6 7 8 11
//   2      S1   18        1 2 3 4 12
//   3      S2   16        1 2 3 4 13   (key 16 is its own: splits 0 and 1 whole)
//   4      S3   23        1 2 3 4 15 16 (splits 0..2 whole, split 2 its own pages)
//   5      S4   20        1 2 9 9 14   (only split 0 is the prompt's pages)
ForwardBatch SharedPromptBatch() {
  ForwardBatch b;
  b.token_ids = {1, 2, 3, 4, 5, 6};
  b.positions = {19, 19, 18, 16, 23, 20};
  b.token_seq = {0, 1, 2, 3, 4, 5};
  b.block_tables = {{1, 2, 3, 4, 10}, {5, 6, 7, 8, 11},     {1, 2, 3, 4, 12},
                    {1, 2, 3, 4, 13}, {1, 2, 3, 4, 15, 16}, {1, 2, 9, 9, 14}};
  b.logit_rows = {0, 1, 2, 3, 4, 5};
  return b;
}

TEST(BatchPlanTest, DecodeTokensOverTheSamePagesShareTheirWholeSplitsInGroups) {
  const ForwardBatch batch = SharedPromptBatch();
  const SlicePlan plan = PlanSlice(batch, 0, 6, SharingOptions(), /*may_replay_graph=*/true);
  // Tokens 0, 2, 3, 4, 5 start on pages 1 2; in groups of 3 in item order: (0, 2, 3), (4, 5).
  // The first group has splits 0 and 1 in common; the second only split 0 (token 5's table
  // leaves the prompt's pages after it). E shares nothing.
  EXPECT_EQ(plan.shares, (vector<int32_t>{0, 2, 3, 0,  // token 0 leads 0, 2, 3 over splits 0, 1
                                          0, 0, 0, 0,  // E
                                          2, 0, 0, 0,  // token 2 starts at split 2
                                          2, 0, 0, 0,  // token 3 too
                                          0, 1, 2, 3,  // token 4 leads 4, 5 over split 0
                                          1, 0, 0, 0}));
  EXPECT_EQ(plan.share_tokens, (vector<int32_t>{0, 2, 3, 4, 5}));

  // Laid out on a multiple of 4 after the items (int4 loads), the padding rows' shares zero.
  const SliceShape& shape = plan.shape;
  EXPECT_TRUE(shape.shares);
  EXPECT_EQ(shape.n, 8);  // the graph bucket
  EXPECT_EQ(shape.off_shares() % 4, 0);
  EXPECT_GE(shape.off_shares(), shape.off_many() + 2 * shape.num_many);
  EXPECT_EQ(shape.off_tables(), shape.off_share_tokens() + shape.n);
  const vector<int32_t> m = Pack(batch, plan, SharingOptions());
  vector<int32_t> expected = plan.shares;
  expected.resize(4 * shape.num_one, 0);
  EXPECT_EQ(Slice(m, shape.off_shares(), 4 * shape.num_one), expected);
  EXPECT_EQ(Slice(m, shape.off_share_tokens(), 5), plan.share_tokens);
}

TEST(BatchPlanTest, ATokenWhoseFirstSplitDivergesAfterTheFirstPageLeavesTheOthersSharing) {
  // Tokens 0, 1, 2 start on page 1; token 1's second page is its own, so split 0 (pages 1, 2)
  // is not the others': 0 and 2 share it, 1 shares nothing.
  ForwardBatch b;
  b.token_ids = {1, 2, 3};
  b.positions = {9, 9, 9};
  b.token_seq = {0, 1, 2};
  b.block_tables = {{1, 2, 10}, {1, 7, 11}, {1, 2, 12}};
  b.logit_rows = {0, 1, 2};
  const SlicePlan plan = PlanSlice(b, 0, 3, SharingOptions(), /*may_replay_graph=*/true);
  EXPECT_EQ(plan.shares, (vector<int32_t>{0, 1, 2, 0, 0, 0, 0, 0, 1, 0, 0, 0}));
  EXPECT_EQ(plan.share_tokens, (vector<int32_t>{0, 2}));
}

TEST(BatchPlanTest, TokensWithoutAWholeSplitOrWithSharingOffShareNothing) {
  ForwardBatch batch = SharedPromptBatch();
  // Positions 6: split 0 (keys 0..7) is not whole for any token.
  batch.positions = {6, 6, 6, 6, 6, 6};
  const SlicePlan partial = PlanSlice(batch, 0, 6, SharingOptions(), true);
  EXPECT_EQ(partial.shares, vector<int32_t>(24, 0));
  EXPECT_TRUE(partial.share_tokens.empty());

  // share_tokens 1 (the SIMT kernel, or sharing off): no shares laid out, the layout as before.
  const SlicePlan off = PlanSlice(SharedPromptBatch(), 0, 6, Options(), true);
  EXPECT_FALSE(off.shape.shares);
  EXPECT_EQ(off.shares, vector<int32_t>(24, 0));
  EXPECT_EQ(off.shape.off_tables(), off.shape.off_many() + 2 * off.shape.num_many);
}

TEST(BatchPlanTest, OnlyTheOneTokenItemsOfAMixedStepShare) {
  // MixedBatch's A (prefill, then its last token as a one-token item), B and C: give B and C the
  // same first split (pages 200, 201 of 4 keys; split 8) and A's last token too.
  ForwardBatch batch = MixedBatch();
  batch.block_tables[2] = {200, 201, 202};
  batch.positions[6] = 9;
  batch.block_tables[0][0] = 200;
  batch.block_tables[0][1] = 201;
  const SlicePlan plan = PlanSlice(batch, 0, 7, SharingOptions(), true);
  EXPECT_EQ(plan.items_one, (vector<int32_t>{4, 1, 5, 1, 6, 1}));
  // The one-token items 4 (A at 34), 5 (B at 20), 6 (C at 9) share split 0.
  EXPECT_EQ(plan.shares, (vector<int32_t>{0, 1, 3, 0, 1, 0, 0, 0, 1, 0, 0, 0}));
  EXPECT_EQ(plan.share_tokens, (vector<int32_t>{4, 5, 6}));
}

// Slices stay within the attention partials planned at load: a long-context prefill is cut into
// slices whose tokens x splits fit, a decode step that may replay a graph never is.
TEST(SliceEndTest, SlicesFitThePlannedPartialsAndDecodeStepsStayWhole) {
  const SlicePlanOptions o = Options();  // split size 8
  // max_context 64 -> 8 splits; largest bucket 512 -> 4096 token-splits (above 100 tokens at 1).
  const int64_t planned = PlannedTokenSplits(64, 100, o);
  EXPECT_EQ(planned, 512 * 8);
  ForwardBatch prefill;  // 2000 tokens of one sequence at positions 0..1999 (250 splits at the end)
  for (int p = 0; p < 2000; ++p) {
    prefill.token_ids.push_back(1);
    prefill.positions.push_back(p);
    prefill.token_seq.push_back(0);
  }
  int64_t begin = 0;
  int slices = 0;
  while (begin < prefill.num_tokens()) {
    const int64_t end = SliceEnd(prefill, begin, 1000, planned, o);
    ASSERT_GT(end, begin);
    EXPECT_LE(end - begin, 1000);
    EXPECT_LE((end - begin) * (prefill.positions[end - 1] / 8 + 1), planned) << begin;
    begin = end;
    ++slices;
  }
  EXPECT_GT(slices, 2) << "the long prefill was cut by the partials, not only by max_tokens";
  ForwardBatch decode;  // 512 sequences decoding at position 63 (8 splits each): one slice
  for (int q = 0; q < 512; ++q) {
    decode.token_ids.push_back(1);
    decode.positions.push_back(63);
    decode.token_seq.push_back(q);
  }
  EXPECT_EQ(SliceEnd(decode, 0, 16384, planned, o), 512);
}

}  // namespace
}  // namespace cuda_runner_internal
}  // namespace rollout
