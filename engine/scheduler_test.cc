#include "engine/scheduler.h"

#include <algorithm>
#include <memory>
#include <vector>

#include "gtest/gtest.h"

namespace rollout {
namespace {

std::unique_ptr<Sequence> MakeSeq(uint64_t arrival, int64_t prompt_len) {
  auto seq = std::make_unique<Sequence>();
  seq->arrival = arrival;
  seq->prompt_len = prompt_len;
  seq->tokens.assign(prompt_len, 1);
  return seq;
}

// Applies a schedule as the engine would: computed tokens advance; a finished prefill or a
// decode step appends one generated token.
void Apply(const std::vector<ScheduledChunk>& chunks) {
  for (const ScheduledChunk& c : chunks) {
    const bool logits = c.wants_logits();
    c.seq->num_computed = c.end;
    if (logits) c.seq->tokens.push_back(2);
  }
}

TEST(SchedulerTest, PrefillChunksEndOnSplitBoundariesWithinTheBudget) {
  KvBlockManager blocks(100, 16);
  PrefixCache cache(&blocks);
  Scheduler scheduler({/*max_running=*/8, /*max_batch_tokens=*/100, /*split_size=*/32}, &blocks,
                      &cache, "v");
  auto seq = MakeSeq(0, 150);
  scheduler.Add(seq.get());
  std::vector<int64_t> ends;
  while (seq->num_computed < 150) {
    std::vector<ScheduledChunk> chunks = scheduler.Schedule();
    ASSERT_EQ(chunks.size(), 1u);
    ends.push_back(chunks[0].end);
    Apply(chunks);
  }
  // 100 tokens of budget -> 96 (3 splits), then 96..150 fits.
  EXPECT_EQ(ends, (std::vector<int64_t>{96, 150}));
  EXPECT_EQ(seq->num_tokens(), 151);
}

TEST(SchedulerTest, DecodersRunBeforePrefillsAndAdmissionIsFcfs) {
  KvBlockManager blocks(100, 16);
  PrefixCache cache(&blocks);
  Scheduler scheduler({8, 64, 32}, &blocks, &cache, "v");
  auto a = MakeSeq(0, 10), b = MakeSeq(1, 200), c = MakeSeq(2, 5);
  scheduler.Add(c.get());
  scheduler.Add(b.get());
  scheduler.Add(a.get());  // added last, arrived first
  std::vector<ScheduledChunk> first = scheduler.Schedule();
  ASSERT_GE(first.size(), 2u);
  EXPECT_EQ(first[0].seq, a.get());
  EXPECT_EQ(first[1].seq, b.get());
  EXPECT_EQ(first[1].end, 32);  // 64 - 10 = 54 left -> one split
  Apply(first);
  std::vector<ScheduledChunk> second = scheduler.Schedule();
  ASSERT_FALSE(second.empty());
  EXPECT_EQ(second[0].seq, a.get()) << "the decoder goes first";
  EXPECT_EQ(second[0].end - second[0].begin, 1);
}

TEST(SchedulerTest, ASampleWaitsForThePrefillOfTheSharedPromptAndThenReadsItFromTheCache) {
  KvBlockManager blocks(100, 16);
  PrefixCache cache(&blocks);
  Scheduler scheduler({8, 512, 32}, &blocks, &cache, "v");
  auto first = MakeSeq(0, 64), second = MakeSeq(1, 64), other = MakeSeq(2, 40);
  other->tokens.assign(40, 7);  // shares nothing: it is behind `second` in FCFS all the same
  for (auto* seq : {first.get(), second.get(), other.get()}) scheduler.Add(seq);
  std::vector<ScheduledChunk> step = scheduler.Schedule();
  ASSERT_EQ(step.size(), 1u) << "the second sample waits for the first one's prefill";
  EXPECT_EQ(step[0].seq, first.get());
  Apply(step);
  scheduler.CachePages(first.get());
  step = scheduler.Schedule();
  ASSERT_EQ(step.size(), 3u);
  EXPECT_EQ(step[1].seq, second.get());
  EXPECT_EQ(step[1].begin, 48) << "three whole pages of the 63-token prefix come from the cache";
  EXPECT_EQ(*second->cached_prompt_tokens, 48);
  EXPECT_EQ(step[2].seq, other.get());
  EXPECT_EQ(scheduler.num_cache_hit_tokens(), 48u);
}

TEST(SchedulerTest, WithoutACacheNothingWaitsForASharedPrompt) {
  KvBlockManager blocks(100, 16);
  PrefixCache cache(&blocks, /*enabled=*/false);
  Scheduler scheduler({8, 512, 32}, &blocks, &cache, "v");
  auto first = MakeSeq(0, 64), second = MakeSeq(1, 64);
  scheduler.Add(first.get());
  scheduler.Add(second.get());
  EXPECT_EQ(scheduler.Schedule().size(), 2u);
}

TEST(SchedulerTest, TheEstimateChargesAFallingShareOfTheTokensStillToCome) {
  KvBlockManager blocks(12, 16);  // 192 tokens
  PrefixCache cache(&blocks, /*enabled=*/false);
  Scheduler scheduler({8, 512, 16, AdmissionPolicy::kEstimate}, &blocks, &cache, "v");
  // Each charges 16 prompt tokens + 0.7 x 100 to come = 86 tokens (6 blocks): two fit, not three.
  std::vector<std::unique_ptr<Sequence>> seqs;
  for (uint64_t i = 0; i < 3; ++i) {
    seqs.push_back(MakeSeq(i, 16));
    seqs.back()->params.max_new_tokens = 100;
    scheduler.Add(seqs.back().get());
  }
  EXPECT_EQ(scheduler.Schedule().size(), 2u);
  EXPECT_DOUBLE_EQ(scheduler.new_token_ratio(), Scheduler::kInitialNewTokenRatio - 0.001);
  for (int i = 0; i < 1000; ++i) scheduler.Schedule();
  EXPECT_DOUBLE_EQ(scheduler.new_token_ratio(), Scheduler::kMinNewTokenRatio);
  EXPECT_EQ(scheduler.num_running(), 3u) << "at a ratio of 0.1 the third fits beside the two";
}

// A sample that cannot stop before max_new_tokens (EOS ignored, no stop tokens, or a model
// without EOS ids) is charged all of it under kEstimate, as under kReserve: fixed-length work
// is admitted exactly as kReserve admits it, never on an estimate that can only be short.
TEST(SchedulerTest, TheEstimateChargesASampleThatCannotStopEarlyAllItsTokens) {
  struct Case {
    const char* what;
    bool ignore_eos;
    std::vector<int32_t> stop_token_ids;
    bool model_has_eos;
    size_t admitted;  // of three that each need 16 + 100 tokens (8 blocks) of a 12-block pool
  };
  const Case cases[] = {
      {"EOS not ignored: the estimate (6 blocks each)", false, {}, true, 2},
      {"EOS ignored: all of it, as reserve", true, {}, true, 1},
      {"EOS ignored, but a stop token: the estimate", true, {5}, true, 2},
      {"a model without EOS ids: all of it", false, {}, false, 1},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    for (AdmissionPolicy policy : {AdmissionPolicy::kEstimate, AdmissionPolicy::kReserve}) {
      KvBlockManager blocks(12, 16);
      PrefixCache cache(&blocks, /*enabled=*/false);
      Scheduler scheduler({8, 512, 16, policy, 0, c.model_has_eos}, &blocks, &cache, "v");
      std::vector<std::unique_ptr<Sequence>> seqs;
      for (uint64_t i = 0; i < 3; ++i) {
        seqs.push_back(MakeSeq(i, 16));
        seqs.back()->params.max_new_tokens = 100;
        seqs.back()->params.ignore_eos = c.ignore_eos;
        seqs.back()->params.stop_token_ids = c.stop_token_ids;
        scheduler.Add(seqs.back().get());
      }
      EXPECT_EQ(scheduler.Schedule().size(),
                policy == AdmissionPolicy::kReserve ? size_t{1} : c.admitted)
          << AdmissionPolicyName(policy);
    }
  }
}

TEST(SchedulerTest, AdmissionPolicyNamesParseBack) {
  for (AdmissionPolicy p :
       {AdmissionPolicy::kReserve, AdmissionPolicy::kEstimate, AdmissionPolicy::kOptimistic}) {
    EXPECT_EQ(ParseAdmissionPolicy(AdmissionPolicyName(p)), p) << AdmissionPolicyName(p);
  }
  EXPECT_EQ(ParseAdmissionPolicy("lazy"), std::nullopt);
}

TEST(SchedulerTest, OptimisticAdmissionUnderKvPressurePreemptsAndTheVictimResumesLater) {
  KvBlockManager blocks(4, 4);  // 16 tokens of KV in all
  PrefixCache cache(&blocks, /*enabled=*/false);
  Scheduler scheduler({8, 32, 4, AdmissionPolicy::kOptimistic}, &blocks, &cache, "v");
  auto old_seq = MakeSeq(0, 6), new_seq = MakeSeq(1, 6);
  scheduler.Add(old_seq.get());
  scheduler.Add(new_seq.get());
  int steps = 0;
  bool saw_preemption = false;
  while (old_seq->num_generated() < 8 && steps++ < 100) {
    Apply(scheduler.Schedule());
    saw_preemption |= scheduler.num_preemptions() > 0;
    EXPECT_GE(blocks.num_free(), 0);
  }
  EXPECT_TRUE(saw_preemption);
  EXPECT_EQ(old_seq->num_generated(), 8) << "the oldest sequence always makes progress";
  EXPECT_EQ(new_seq->num_computed, 0) << "the preempted one waits, its KV dropped";
  scheduler.Remove(old_seq.get());
  EXPECT_EQ(blocks.num_free(), 4);
  // With room again, the preempted sequence is readmitted and recomputes everything.
  std::vector<ScheduledChunk> chunks = scheduler.Schedule();
  ASSERT_EQ(chunks.size(), 1u);
  EXPECT_EQ(chunks[0].seq, new_seq.get());
  EXPECT_EQ(chunks[0].begin, 0);
  // Its KV was computed before (6 prompt tokens, then decode steps): all of it is recomputed,
  // all but its last token, sampled before the preemption and never computed.
  EXPECT_EQ(scheduler.num_recomputed_tokens(), static_cast<uint64_t>(chunks[0].end - 1));
}

// kReserve: a sequence starts only when the pool can hold its prompt plus max_new_tokens beside
// what the running ones may still take, so no running sequence ever waits for a block.
TEST(SchedulerTest, ReserveAdmissionFinishesWhatItStartsWithoutPreemption) {
  KvBlockManager blocks(6, 4);  // 24 tokens of KV in all
  PrefixCache cache(&blocks, /*enabled=*/false);
  Scheduler scheduler({8, 32, 4}, &blocks, &cache, "v");  // kReserve is the default
  std::vector<std::unique_ptr<Sequence>> seqs;
  for (int i = 0; i < 3; ++i) {
    seqs.push_back(MakeSeq(i, 6));
    seqs.back()->params.max_new_tokens = 6;  // 12 tokens = 3 blocks each: two fit at once
    scheduler.Add(seqs.back().get());
  }
  size_t most_running = 0;
  for (int step = 0; step < 200 && !scheduler.idle(); ++step) {
    Apply(scheduler.Schedule());
    most_running = std::max(most_running, scheduler.num_running());
    for (auto& seq : seqs) {
      if (seq->num_generated() == 6 && !seq->block_table.empty()) scheduler.Remove(seq.get());
    }
  }
  EXPECT_TRUE(scheduler.idle());
  EXPECT_EQ(most_running, 2u) << "two reservations of three blocks fit in six";
  EXPECT_EQ(scheduler.num_preemptions(), 0u);
  EXPECT_EQ(scheduler.num_recomputed_tokens(), 0u);
  for (auto& seq : seqs) EXPECT_EQ(seq->num_generated(), 6);
  EXPECT_EQ(blocks.num_free(), 6);
}

// The engine's lookahead asks whether the next Schedule() would admit the head of the queue;
// the answer must agree with what Schedule() then does.
TEST(SchedulerTest, NextScheduleCouldAdmitSaysWhatTheNextScheduleDoes) {
  KvBlockManager blocks(6, 4);  // 24 tokens of KV in all
  PrefixCache cache(&blocks, /*enabled=*/false);
  Scheduler scheduler({8, 32, 4}, &blocks, &cache, "v");  // kReserve
  std::vector<std::unique_ptr<Sequence>> seqs;
  for (int i = 0; i < 3; ++i) {
    seqs.push_back(MakeSeq(i, 6));
    seqs.back()->params.max_new_tokens = 6;  // 3 blocks each: two fit at once
  }
  EXPECT_FALSE(scheduler.NextScheduleCouldAdmit()) << "nothing waits";
  for (auto& seq : seqs) scheduler.Add(seq.get());
  EXPECT_TRUE(scheduler.NextScheduleCouldAdmit());
  Apply(scheduler.Schedule());
  ASSERT_EQ(scheduler.num_running(), 2u);
  ASSERT_EQ(scheduler.num_waiting(), 1u);
  for (int step = 0; step < 3; ++step) {
    EXPECT_FALSE(scheduler.NextScheduleCouldAdmit()) << "the third reservation does not fit";
    Apply(scheduler.Schedule());
    EXPECT_EQ(scheduler.num_running(), 2u);
  }
  scheduler.Remove(seqs[1].get());  // its blocks would hold the third
  seqs[2]->paused = true;
  EXPECT_FALSE(scheduler.NextScheduleCouldAdmit()) << "a paused sequence is passed over";
  seqs[2]->paused = false;
  EXPECT_TRUE(scheduler.NextScheduleCouldAdmit()) << "the freed blocks hold the third";
  Apply(scheduler.Schedule());
  EXPECT_EQ(scheduler.num_waiting(), 0u);
  EXPECT_FALSE(scheduler.NextScheduleCouldAdmit());
}

// Under pressure the running sequence that loses least gives way: the fewest computed tokens,
// not the latest arrival.
TEST(SchedulerTest, PreemptionTakesTheSequenceWithTheFewestComputedTokens) {
  KvBlockManager blocks(7, 4);  // 28 tokens
  PrefixCache cache(&blocks, /*enabled=*/false);
  Scheduler scheduler({8, 64, 4, AdmissionPolicy::kOptimistic}, &blocks, &cache, "v");
  auto a = MakeSeq(0, 11), b = MakeSeq(1, 3), c = MakeSeq(2, 7);
  for (Sequence* seq : {a.get(), b.get(), c.get()}) scheduler.Add(seq);
  Apply(scheduler.Schedule());  // 3 + 1 + 2 blocks, one left
  Apply(scheduler.Schedule());  // every decode fits its blocks
  ASSERT_EQ(scheduler.num_preemptions(), 0u);
  // a takes the last block; b (4 computed tokens) needs one: b, not the later c (8), gives way.
  Apply(scheduler.Schedule());
  EXPECT_EQ(scheduler.num_preemptions(), 1u);
  EXPECT_EQ(b->num_computed, 0) << "the sequence with the least KV gave way";
  EXPECT_EQ(c->num_computed, 9);
  EXPECT_EQ(a->num_computed, 13);
}

// A scoring sequence preempted half way is scored again from its start: the logprobs of its
// first pass must go, or its result would hold some positions twice.
TEST(SchedulerTest, APreemptedScoreSequenceStartsItsLogprobsAgain) {
  KvBlockManager blocks(4, 4);  // 16 tokens
  PrefixCache cache(&blocks, /*enabled=*/false);
  Scheduler scheduler({8, 8, 4, AdmissionPolicy::kOptimistic}, &blocks, &cache, "v");
  auto gen = MakeSeq(0, 4);
  auto score = MakeSeq(1, 12);
  score->score_start = 1;  // positions 0..10 predict tokens 1..11: 11 logprobs
  scheduler.Add(gen.get());
  scheduler.Add(score.get());
  bool score_preempted = false;
  for (int step = 0; step < 100 && score->num_computed < score->num_tokens(); ++step) {
    const uint64_t preemptions = scheduler.num_preemptions();
    std::vector<ScheduledChunk> chunks = scheduler.Schedule();
    for (const ScheduledChunk& c : chunks) {
      if (!c.seq->is_score()) continue;
      // What the engine appends: one logprob per scored position the chunk computed.
      const int64_t from = std::max(c.begin, c.seq->score_start - 1);
      const int64_t to = std::min(c.end, c.seq->num_tokens() - 1);
      for (int64_t p = from; p < to; ++p) c.seq->logprobs.push_back(static_cast<float>(p));
    }
    for (const ScheduledChunk& c : chunks) {
      c.seq->num_computed = c.end;
      if (!c.seq->is_score() && c.wants_logits()) c.seq->tokens.push_back(2);
    }
    if (scheduler.num_preemptions() > preemptions && score->num_computed == 0) {
      score_preempted = true;
      EXPECT_TRUE(score->logprobs.empty()) << "the first pass's logprobs were kept";
    }
    if (gen->num_generated() >= 6 && !gen->block_table.empty()) scheduler.Remove(gen.get());
  }
  ASSERT_TRUE(score_preempted) << "the test needs the score sequence to give way";
  ASSERT_EQ(score->num_computed, score->num_tokens());
  std::vector<float> want;
  for (int p = 0; p < 11; ++p) want.push_back(static_cast<float>(p));
  EXPECT_EQ(score->logprobs, want);
}

TEST(SchedulerTest, RemoveReleasesBlocksOfRunningAndWaiting) {
  KvBlockManager blocks(10, 4);
  PrefixCache cache(&blocks);
  Scheduler scheduler({1, 64, 4}, &blocks, &cache, "v");
  auto a = MakeSeq(0, 8), b = MakeSeq(1, 8);
  scheduler.Add(a.get());
  scheduler.Add(b.get());
  Apply(scheduler.Schedule());
  EXPECT_EQ(scheduler.num_running(), 1u);
  EXPECT_EQ(scheduler.num_waiting(), 1u);
  scheduler.Remove(a.get());
  scheduler.Remove(b.get());
  EXPECT_TRUE(scheduler.idle());
  EXPECT_EQ(blocks.num_free(), 10);
}

TEST(SchedulerTest, PausedSequencesAreLeftOutKeepingTheirBlocksAndTheOthersKeepTheirOrder) {
  KvBlockManager blocks(100, 16);
  PrefixCache cache(&blocks);
  Scheduler scheduler({8, 64, 32}, &blocks, &cache, "v");
  auto running = MakeSeq(0, 10), head = MakeSeq(1, 5), next = MakeSeq(2, 5);
  scheduler.Add(running.get());
  Apply(scheduler.Schedule());  // running decodes from now on
  const size_t blocks_held = running->block_table.size();
  running->paused = true;
  head->paused = true;
  scheduler.Add(head.get());
  scheduler.Add(next.get());
  EXPECT_TRUE(scheduler.has_unpaused());
  const std::vector<ScheduledChunk> chunks = scheduler.Schedule();
  ASSERT_EQ(chunks.size(), 1u);  // a paused head does not hold up the queue behind it
  EXPECT_EQ(chunks[0].seq, next.get());
  EXPECT_EQ(running->block_table.size(), blocks_held);
  EXPECT_EQ(scheduler.num_running(), 2u);
  EXPECT_EQ(scheduler.num_waiting(), 1u);
  Apply(chunks);
  next->paused = true;
  EXPECT_FALSE(scheduler.has_unpaused());
  EXPECT_TRUE(scheduler.Schedule().empty());
  EXPECT_FALSE(scheduler.idle());
}

TEST(SchedulerTest, PausedSequencesLeaveTheirPlaceUnderMaxRunningToOthers) {
  KvBlockManager blocks(100, 16);
  PrefixCache cache(&blocks);
  Scheduler scheduler({/*max_running=*/2, 64, 32}, &blocks, &cache, "v");
  auto a = MakeSeq(0, 10), b = MakeSeq(1, 10), c = MakeSeq(2, 10), d = MakeSeq(3, 10);
  scheduler.Add(a.get());
  scheduler.Add(b.get());
  scheduler.Add(c.get());
  Apply(scheduler.Schedule());
  EXPECT_EQ(scheduler.num_running(), 2u);
  EXPECT_FALSE(scheduler.NextScheduleCouldAdmit()) << "two run unpaused";
  a->paused = true;
  b->paused = true;
  EXPECT_EQ(scheduler.num_unpaused_running(), 0);
  EXPECT_TRUE(scheduler.NextScheduleCouldAdmit());
  scheduler.Add(d.get());
  std::vector<ScheduledChunk> chunks = scheduler.Schedule();
  ASSERT_EQ(chunks.size(), 2u) << "c and d run while a and b are paused";
  EXPECT_EQ(chunks[0].seq, c.get());
  EXPECT_EQ(chunks[1].seq, d.get());
  Apply(chunks);
  EXPECT_EQ(scheduler.num_running(), 4u);
  // Resumed, four run and two take part in each step: the earliest arrivals.
  a->paused = false;
  b->paused = false;
  chunks = scheduler.Schedule();
  ASSERT_EQ(chunks.size(), 2u);
  EXPECT_EQ(chunks[0].seq, a.get());
  EXPECT_EQ(chunks[1].seq, b.get());
  auto e = MakeSeq(4, 10);
  scheduler.Add(e.get());
  EXPECT_FALSE(scheduler.NextScheduleCouldAdmit());
  Apply(chunks);
  scheduler.Remove(a.get());
  scheduler.Remove(b.get());
  chunks = scheduler.Schedule();
  ASSERT_EQ(chunks.size(), 2u);
  EXPECT_EQ(chunks[0].seq, c.get());
  EXPECT_EQ(chunks[1].seq, d.get());
  EXPECT_EQ(scheduler.num_waiting(), 1u) << "e waits while two run unpaused";
}

// Paused sequences that hold the KV the queue's head needs, with nothing else to run, give it
// up (a preemption): nothing ran until their streams ended (codereview24).
TEST(SchedulerTest, PausedSequencesHoldingTheKvTheQueueNeedsArePreemptedWhenNothingElseRuns) {
  KvBlockManager blocks(20, 16);
  PrefixCache cache(&blocks);
  SchedulerOptions options{8, 512, 32};
  options.admission = AdmissionPolicy::kOptimistic;
  Scheduler scheduler(options, &blocks, &cache, "v");
  auto small = MakeSeq(0, 100), big = MakeSeq(1, 150), next = MakeSeq(2, 140);
  for (Sequence* seq : {small.get(), big.get(), next.get()}) {  // no prefix shared
    for (size_t i = 0; i < seq->tokens.size(); ++i) seq->tokens[i] = seq->arrival * 1000 + i;
  }
  scheduler.Add(small.get());
  scheduler.Add(big.get());
  Apply(scheduler.Schedule());  // 7 + 10 of the 20 blocks
  ASSERT_EQ(blocks.num_free(), 3);
  small->paused = true;
  big->paused = true;
  scheduler.Add(next.get());  // 9 blocks: only with one of them gone
  const std::vector<ScheduledChunk> chunks = scheduler.Schedule();
  ASSERT_EQ(chunks.size(), 1u);
  EXPECT_EQ(chunks[0].seq, next.get());
  EXPECT_EQ(scheduler.num_preemptions(), 1u);
  EXPECT_TRUE(small->block_table.empty()) << "the one with fewer computed tokens goes";
  EXPECT_FALSE(big->block_table.empty());
  EXPECT_EQ(scheduler.num_waiting(), 1u);  // small, paused: back once resumed
  // Nothing waits that is not paused: the paused keep their KV.
  Apply(chunks);
  EXPECT_TRUE(scheduler.Schedule().size() == 1u);
  EXPECT_EQ(scheduler.num_preemptions(), 1u);
}

TEST(SchedulerTest, AnAdmissionDoesNotWaitForThePrefillOfAPausedSequenceItShares) {
  KvBlockManager blocks(100, 16);
  PrefixCache cache(&blocks);
  Scheduler scheduler({8, 64, 32}, &blocks, &cache, "v");
  auto first = MakeSeq(0, 200), twin = MakeSeq(1, 200);
  scheduler.Add(first.get());
  Apply(scheduler.Schedule());  // 64 of its 200 prompt tokens
  first->paused = true;
  scheduler.Add(twin.get());
  const std::vector<ScheduledChunk> chunks = scheduler.Schedule();
  ASSERT_EQ(chunks.size(), 1u);
  EXPECT_EQ(chunks[0].seq, twin.get());
}

}  // namespace
}  // namespace rollout
