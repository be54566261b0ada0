#include "engine/scheduler.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <utility>

#include "glog/logging.h"

namespace rollout {

Scheduler::Scheduler(const SchedulerOptions& options, KvBlockManager* blocks, PrefixCache* cache,
                     std::string cache_version)
    : options_(options), blocks_(blocks), cache_(cache), cache_version_(std::move(cache_version)) {
  CHECK_GT(options.split_size, 0);
  CHECK_GE(options.max_batch_tokens, options.split_size);
}

void Scheduler::InsertByArrival(Sequence* seq, std::vector<Sequence*>* list) {
  auto it = std::upper_bound(list->begin(), list->end(), seq,
                             [](Sequence* a, Sequence* b) { return a->arrival < b->arrival; });
  list->insert(it, seq);
}

void Scheduler::Add(Sequence* seq) { InsertByArrival(seq, &waiting_); }

void Scheduler::Remove(Sequence* seq) {
  for (auto* list : {&running_, &waiting_}) {
    auto it = std::find(list->begin(), list->end(), seq);
    if (it != list->end()) list->erase(it);
  }
  ReleaseKv(seq);
}

int32_t Scheduler::RequeueRunning() {
  const int32_t n = static_cast<int32_t>(running_.size());
  for (Sequence* seq : running_) {
    ForgetComputed(seq);
    InsertByArrival(seq, &waiting_);
  }
  running_.clear();
  return n;
}

int32_t Scheduler::RestartUnstarted() {
  int32_t n = 0;
  for (size_t i = 0; i < running_.size();) {
    Sequence* seq = running_[i];
    if (!seq->is_score() && seq->num_generated() > 0) {
      ++i;
      continue;
    }
    ForgetComputed(seq);
    seq->max_computed = 0;  // what it computes again is new weights' work, not recomputation
    running_.erase(running_.begin() + static_cast<std::ptrdiff_t>(i));
    InsertByArrival(seq, &waiting_);
    ++n;
  }
  return n;
}

void Scheduler::ForgetComputed(Sequence* seq) {
  ReleaseKv(seq);
  seq->num_computed = 0;
  // A scoring sequence is scored again from its start: what it has scored so far (never
  // reported before its end) would be counted twice.
  if (seq->is_score()) {
    seq->logprobs.clear();
    seq->top_logprobs.clear();
    seq->routing.clear();  // the routing of its scored rows, appended as they are applied
  }
}

void Scheduler::ReleaseKv(Sequence* seq) {
  std::vector<int32_t> own;
  for (size_t i = 0; i < seq->block_table.size(); ++i) {
    if (!PrefixCache::OwnsBlock(seq->cache_path, i, seq->block_table[i])) {
      own.push_back(seq->block_table[i]);
    }
  }
  blocks_->Release(&own);
  seq->block_table.clear();
  cache_->Unlock(&seq->cache_path);
}

bool Scheduler::Reserve(int64_t num_tokens, Sequence* seq) {
  const int64_t need =
      blocks_->BlocksFor(num_tokens) - static_cast<int64_t>(seq->block_table.size());
  if (need > blocks_->num_free()) {
    cache_->Evict(static_cast<int32_t>(need - blocks_->num_free()));
  }
  return blocks_->Grow(num_tokens, &seq->block_table);
}

void Scheduler::CachePages(Sequence* seq) {
  if (seq->kv_version != cache_version_) return;
  const int64_t page = blocks_->block_size();
  // A replayed routing (forced from the row at score_start - 1 on) makes KV that the tokens
  // alone do not determine: only the pages before it may be shared.
  const int64_t cacheable = seq->forced_routing.empty()
                                ? seq->num_computed
                                : std::min(seq->num_computed, seq->score_start - 1);
  while (static_cast<int64_t>(seq->cache_path.size() + 1) * page <= cacheable) {
    const size_t before = seq->cache_path.size();
    cache_->Extend(cache_version_, seq->tokens, seq->block_table[before], &seq->cache_path);
    if (seq->cache_path.size() == before) break;  // cache off, or the path was flushed
  }
}

int64_t Scheduler::MaxTokens(const Sequence& seq) const {
  const int64_t context = options_.max_context > 0
                              ? options_.max_context
                              : static_cast<int64_t>(blocks_->num_total()) * blocks_->block_size();
  if (seq.is_score()) return seq.num_tokens();
  const int64_t most = seq.prompt_len + std::max<int64_t>(seq.params.max_new_tokens, 0);
  return std::max(seq.num_tokens(), std::min(most, context));
}

int64_t Scheduler::FutureBlocks(const Sequence& seq, double ratio) const {
  int64_t tokens = MaxTokens(seq);
  if (options_.admission == AdmissionPolicy::kEstimate && MayStopEarly(seq)) {
    const int64_t to_come = std::min(tokens - seq.num_tokens(), kEstimateClipTokens);
    tokens =
        seq.num_tokens() + static_cast<int64_t>(std::ceil(static_cast<double>(to_come) * ratio));
  }
  return std::max<int64_t>(
      0, blocks_->BlocksFor(tokens) - static_cast<int64_t>(seq.block_table.size()));
}

bool Scheduler::MayStopEarly(const Sequence& seq) const {
  return !seq.params.stop_token_ids.empty() || (!seq.params.ignore_eos && options_.model_has_eos);
}

void Scheduler::RaiseNewTokenRatio() {
  int64_t progress = 0, most = 0;
  for (const Sequence* seq : running_) {
    progress += seq->num_generated() + kRetractHeadroomSteps;
    most += std::max<int64_t>(1, MaxTokens(*seq) - seq->prompt_len);
  }
  const double ratio = most > 0 ? static_cast<double>(progress) / static_cast<double>(most) : 1.0;
  new_token_ratio_ = std::clamp(std::max(ratio, new_token_ratio_), kMinNewTokenRatio, 1.0);
}

double Scheduler::NextNewTokenRatio() const {
  return options_.admission == AdmissionPolicy::kEstimate
             ? std::max(kMinNewTokenRatio, new_token_ratio_ - kNewTokenRatioDecay)
             : new_token_ratio_;
}

void Scheduler::AdvanceNewTokenRatio() { new_token_ratio_ = NextNewTokenRatio(); }

bool Scheduler::NextScheduleCouldAdmit() const {
  const Sequence* head = nullptr;
  for (const Sequence* seq : waiting_) {
    if (!seq->paused) {
      head = seq;
      break;
    }
  }
  if (head == nullptr || num_unpaused_running() >= options_.max_running) return false;
  if (blocks_->BlocksFor(head->num_tokens()) > RoomBlocks()) return false;
  if (options_.admission == AdmissionPolicy::kOptimistic) return true;
  const double ratio = NextNewTokenRatio();
  return FitsBesideRunning(FutureBlocks(*head, ratio), ratio);
}

int64_t Scheduler::RoomBlocks() const {
  return blocks_->num_free() + cache_->num_unlocked_blocks();
}

bool Scheduler::FitsBesideRunning(int64_t extra_blocks, double ratio) const {
  int64_t committed = extra_blocks;
  for (const Sequence* seq : running_) committed += FutureBlocks(*seq, ratio);
  return committed <= RoomBlocks();
}

void Scheduler::Take(Sequence* seq, int64_t end, std::vector<ScheduledChunk>* chunks) {
  const int64_t begin = seq->num_computed;
  num_recomputed_tokens_ += std::max<int64_t>(0, std::min(end, seq->max_computed) - begin);
  seq->max_computed = std::max(seq->max_computed, end);
  chunks->push_back({seq, begin, end});
}

bool Scheduler::WaitsForSharedPrefix(const Sequence& seq, int64_t cached_tokens) const {
  if (!cache_->enabled()) return false;
  const int64_t page = blocks_->block_size();
  for (const Sequence* other : running_) {
    if (other->kv_version != cache_version_) continue;  // its pages will not be cached
    if (other->paused) continue;  // its prefill does not advance until it resumes
    const int64_t limit =
        std::min<int64_t>(seq.max_prefix_tokens(), static_cast<int64_t>(other->tokens.size()));
    const auto differ =
        std::mismatch(seq.tokens.begin(), seq.tokens.begin() + limit, other->tokens.begin());
    const int64_t shared = (differ.first - seq.tokens.begin()) / page * page;
    if (shared > cached_tokens && other->num_computed < shared) return true;
  }
  return false;
}

bool Scheduler::Admit(Sequence* seq, int64_t budget, std::vector<ScheduledChunk>* chunks) {
  const int64_t page = blocks_->block_size();
  seq->cache_path = cache_->Match(cache_version_, seq->tokens, seq->max_prefix_tokens() / page,
                                  &seq->block_table);
  seq->num_computed = static_cast<int64_t>(seq->cache_path.size()) * page;
  seq->kv_version = cache_version_;
  if (WaitsForSharedPrefix(*seq, seq->num_computed)) {
    ReleaseKv(seq);
    seq->num_computed = 0;
    return false;
  }
  const int64_t end = ChunkEnd(*seq, budget);
  // kReserve counts what the sequence may still need against the room the running ones leave
  // (its matched pages are locked now, so they no longer count as room). Either policy takes
  // the KV of the whole known sequence up front, so an admitted prefill never waits midway.
  const bool fits = options_.admission == AdmissionPolicy::kOptimistic ||
                    FitsBesideRunning(FutureBlocks(*seq), new_token_ratio_);
  if (end <= seq->num_computed || !fits || !Reserve(seq->num_tokens(), seq)) {
    ReleaseKv(seq);
    seq->num_computed = 0;
    return false;
  }
  if (!seq->cached_prompt_tokens.has_value()) {
    seq->cached_prompt_tokens = std::min(seq->num_computed, seq->prompt_len);
    num_prompt_tokens_ += seq->prompt_len;
    num_cache_hit_tokens_ += *seq->cached_prompt_tokens;
  }
  Take(seq, end, chunks);
  return true;
}

void Scheduler::Preempt(Sequence* seq) {
  auto it = std::find(running_.begin(), running_.end(), seq);
  CHECK(it != running_.end());
  running_.erase(it);
  ForgetComputed(seq);
  InsertByArrival(seq, &waiting_);
  ++num_preemptions_;
  if (options_.admission == AdmissionPolicy::kEstimate) RaiseNewTokenRatio();
}

size_t Scheduler::VictimIndex(const std::vector<ScheduledChunk>& chunks) const {
  std::optional<size_t> victim;
  for (size_t i = 0; i < running_.size(); ++i) {
    bool scheduled = false;
    for (const ScheduledChunk& c : chunks) scheduled |= c.seq == running_[i];
    if (scheduled) continue;
    // running_ ascends by arrival, so <= prefers the later arrival on a tie.
    if (!victim.has_value() || running_[i]->num_computed <= running_[*victim]->num_computed) {
      victim = i;
    }
  }
  CHECK(victim.has_value()) << "no unscheduled running sequence to preempt";
  return *victim;
}

int64_t Scheduler::ChunkEnd(const Sequence& seq, int64_t budget) const {
  const int64_t remaining = seq.num_tokens() - seq.num_computed;
  if (remaining <= budget) return seq.num_tokens();
  const int64_t split = options_.split_size;
  return (seq.num_computed + budget) / split * split;
}

std::vector<ScheduledChunk> Scheduler::Schedule() {
  std::vector<ScheduledChunk> chunks;
  chunks.reserve(running_.size());
  int64_t budget = options_.max_batch_tokens;
  AdvanceNewTokenRatio();
  // Two passes over the running set: decoders (one token each) before prefills, so that long
  // prompts cannot stall the streams of sequences already generating. At most max_running
  // sequences take part: paused ones do not count against it, so more may be running once
  // they resume; the rest (prefills before decoders, later arrivals before earlier) then wait
  // for a place in a step, keeping their KV.
  int32_t taken = 0;
  for (bool decode_pass : {true, false}) {
    for (size_t i = 0; i < running_.size() && budget > 0 && taken < options_.max_running;) {
      Sequence* seq = running_[i];
      const bool decoding = seq->num_computed == seq->num_tokens() - 1;
      if (decoding != decode_pass || seq->paused) {
        ++i;
        continue;
      }
      const int64_t end = ChunkEnd(*seq, budget);
      if (end <= seq->num_computed) {
        ++i;
        continue;
      }
      if (!Reserve(end, seq)) {
        // A running sequence not already in this step gives way (seq itself, possibly).
        const size_t victim = VictimIndex(chunks);
        Preempt(running_[victim]);
        if (victim < i) --i;  // running_[i] is seq again
        continue;  // retry running_[i]: seq again, or its successor if seq was the victim
      }
      Take(seq, end, &chunks);
      budget -= end - seq->num_computed;
      ++taken;
      ++i;
    }
  }
  AdmitWaiting(&budget, &chunks);
  // Nothing runs and the queue waits for KV that paused sequences hold: they give it up, as in
  // a preemption (their pages stay cached; they are computed again when they resume, with the
  // same bits), or nothing would run until their streams end.
  while (chunks.empty() && PreemptPausedForTheQueue()) AdmitWaiting(&budget, &chunks);
  return chunks;
}

void Scheduler::AdmitWaiting(int64_t* budget, std::vector<ScheduledChunk>* chunks) {
  int32_t unpaused = num_unpaused_running();
  for (size_t w = 0; w < waiting_.size() && *budget > 0 && unpaused < options_.max_running;) {
    Sequence* seq = waiting_[w];
    if (seq->paused) {
      ++w;
      continue;
    }
    if (!Admit(seq, *budget, chunks)) break;
    waiting_.erase(waiting_.begin() + static_cast<std::ptrdiff_t>(w));
    InsertByArrival(seq, &running_);
    ++unpaused;
    *budget -= chunks->back().end - chunks->back().begin;
  }
}

bool Scheduler::PreemptPausedForTheQueue() {
  const bool queue_waits =
      std::any_of(waiting_.begin(), waiting_.end(), [](const Sequence* s) { return !s->paused; });
  if (!queue_waits) return false;
  // As VictimIndex: the one that loses least, the later arrival on a tie.
  Sequence* victim = nullptr;
  for (Sequence* seq : running_) {
    if (seq->paused && (victim == nullptr || seq->num_computed <= victim->num_computed)) {
      victim = seq;
    }
  }
  if (victim == nullptr) return false;
  Preempt(victim);
  return true;
}

int32_t Scheduler::num_unpaused_running() const {
  return static_cast<int32_t>(std::count_if(running_.begin(), running_.end(),
                                            [](const Sequence* s) { return !s->paused; }));
}

bool Scheduler::has_unpaused() const {
  for (const std::vector<Sequence*>* list : {&running_, &waiting_}) {
    for (const Sequence* seq : *list) {
      if (!seq->paused) return true;
    }
  }
  return false;
}

}  // namespace rollout
