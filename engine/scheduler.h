#pragma once

#include <cstdint>
#include <vector>

#include <string>

#include "engine/admission_policy.h"
#include "engine/kv_block_manager.h"
#include "engine/prefix_cache.h"
#include "engine/sequence.h"

namespace rollout {

struct SchedulerOptions {
  int32_t max_running = 64;        // sequences taking part in steps (paused ones aside)
  int32_t max_batch_tokens = 512;  // tokens computed in one step (decode + prefill chunks)
  int32_t split_size = 64;         // prefill chunks end at multiples of this, or at the prompt end
  AdmissionPolicy admission = AdmissionPolicy::kEstimate;
  // The most tokens a sequence can reach (the engine ends it there); 0: the whole pool.
  int64_t max_context = 0;
  // Whether the model has EOS ids (config.eos_token_ids): a sample that does not ignore them may
  // stop before max_new_tokens, which kEstimate's estimate counts on.
  bool model_has_eos = true;
};

// Tokens [begin, end) of one sequence to run this step.
struct ScheduledChunk {
  Sequence* seq;
  int64_t begin;
  int64_t end;
  bool wants_logits() const { return end == seq->num_tokens(); }
};

// Continuous batching with chunked prefill, FCFS by arrival; engine thread only. The schedule
// is a pure function of the arrival order and the outputs, so it is reproducible; no result
// bit depends on it (the model runner's rows are batch invariant).
class Scheduler {
 public:
  // `blocks` and `cache` are borrowed and must outlive the scheduler. `cache_version` keys
  // the prefix cache (the weight version).
  Scheduler(const SchedulerOptions& options, KvBlockManager* blocks, PrefixCache* cache,
            std::string cache_version);

  // Queues a sequence (it may be partly generated: its KV is recomputed).
  void Add(Sequence* seq);
  // Forgets a sequence wherever it is and releases its KV blocks.
  void Remove(Sequence* seq);
  // Every running sequence gives its KV blocks back and returns to the queue, as a preemption
  // does (its computed whole pages stay cached until a flush; it is recomputed from what the
  // cache then holds, with the same bits), but not counted as one: the engine's ReleaseMemory,
  // which needs every block free. Returns how many there were.
  int32_t RequeueRunning();
  // The running sequences that have computed KV but no generated token yet (a prompt partly or
  // wholly prefilled; a Score sequence, whatever it has scored) give their KV blocks back and
  // return to the queue, to be computed again from their start: the engine's CONTINUE update,
  // so that such a sample is wholly of the new weights, as its one version span says (its
  // prompt's KV of the old ones stayed). Not counted as preemptions. Returns how many.
  int32_t RestartUnstarted();

  // Adds the sequence's newly computed whole pages to the prefix cache (after a step), unless
  // its KV was computed by other weights than the current ones. A scoring sequence replaying a
  // routing adds only the pages before its first forced row.
  void CachePages(Sequence* seq);

  // The weight version new KV is computed with from now on (the prefix cache's key).
  void set_cache_version(std::string version) { cache_version_ = std::move(version); }

  // Grows the block table to hold `num_tokens`, evicting cached pages if needed; false (the
  // table as it was) when the blocks are short. (Schedule's own reservation;
  // the engine's lookahead reserves the next decode position with it.)
  bool Reserve(int64_t num_tokens, Sequence* seq);

  // Picks this step's work. Running decoders first (oldest first), then running prefills, then
  // new admissions in arrival order while the head of the queue fits under the admission policy
  // (strict FCFS); an admission first takes the longest cached prefix, and the head waits
  // while a running sequence is still computing pages of a longer prefix they share. When a block
  // is needed and none is free, unlocked cached pages are evicted (LRU); if that is not enough for
  // a running sequence (not under kReserve), the one that loses least gives way: the running
  // sequence not in this step with the fewest computed tokens (ties: the latest arrival). Its
  // blocks are freed, its computed whole pages stay cached (most recently used, so evicted
  // last), and it goes back to the queue, to be resumed from what the cache still holds.
  // Paused sequences (Sequence::paused) are left out: running ones keep their blocks (and,
  // under kReserve, what they may still take), waiting ones their place, and the queue's order
  // holds among the others; when nothing else can run and the queue's head waits for KV they
  // hold, they are preempted (fewest computed tokens first). They do not count against
  // max_running, so others are admitted in
  // their place; at most max_running running sequences take part in a step (decoders first, then
  // prefills, each by arrival), and none is admitted while that many are running unpaused.
  std::vector<ScheduledChunk> Schedule();

  // Whether the next Schedule() would admit a waiting sequence (the first one not paused) if
  // nothing but the step's own advance changed: under kReserve and kEstimate, whether its KV fits
  // beside every running sequence's (the estimate at the ratio the next Schedule() will use),
  // under kOptimistic whether its tokens' blocks are free or evictable. Its prefix-cache hit is
  // not counted (matched pages stop counting as room as they lower its need), nor the room a
  // sequence that stops on a sampled token will free. The engine's lookahead launches the next
  // decode step ahead of sequences that wait only while this is false.
  bool NextScheduleCouldAdmit() const;
  // One step's fall of the estimate's ratio (kEstimate; NextNewTokenRatio). Schedule() makes it,
  // and the engine for a step it launches without Schedule() (its decode lookahead), so that the
  // admission policy sees the same ratio step for step whether or not steps ran ahead.
  void AdvanceNewTokenRatio();

  size_t num_running() const { return running_.size(); }
  size_t num_waiting() const { return waiting_.size(); }
  bool idle() const { return running_.empty() && waiting_.empty(); }
  // Running sequences that are not paused: what max_running bounds (a paused one keeps its KV
  // but leaves its place in the steps to others).
  int32_t num_unpaused_running() const;
  // Whether a sequence that is not paused runs or waits (there may be a step to schedule).
  bool has_unpaused() const;
  uint64_t num_preemptions() const { return num_preemptions_; }
  // Tokens computed again after a preemption (prefix-cache hits excluded).
  uint64_t num_recomputed_tokens() const { return num_recomputed_tokens_; }
  uint64_t num_prompt_tokens() const { return num_prompt_tokens_; }
  uint64_t num_cache_hit_tokens() const { return num_cache_hit_tokens_; }
  // kEstimate: the share of the tokens still to come that admission charges now.
  double new_token_ratio() const { return new_token_ratio_; }

  // kEstimate's constants (SGLang's defaults): the ratio's start, floor and fall per step, the
  // most tokens still to come charged per sequence, and the steps of headroom a preemption
  // adds to the running sequences' progress.
  static constexpr double kInitialNewTokenRatio = 0.7;
  static constexpr double kMinNewTokenRatio = 0.1;
  static constexpr double kNewTokenRatioDecay = 0.001;
  static constexpr int64_t kEstimateClipTokens = 4096;
  static constexpr int64_t kRetractHeadroomSteps = 20;

 private:
  // End of the next chunk of `seq` within `budget` tokens; <= num_computed when none fits.
  int64_t ChunkEnd(const Sequence& seq, int64_t budget) const;
  void Preempt(Sequence* seq);
  // Frees the sequence's private blocks and unlocks its cached pages.
  void ReleaseKv(Sequence* seq);
  // Drops seq's KV and what it computed (a Score sequence's partial logprobs too): it starts
  // again from its first token, after a preemption or a memory release.
  void ForgetComputed(Sequence* seq);
  // Takes the head of the queue into the running set with its cached prefix and a chunk
  // within `budget`; false (and no change) if it does not fit.
  bool Admit(Sequence* seq, int64_t budget, std::vector<ScheduledChunk>* chunks);
  // The most tokens `seq` can reach: the whole sequence when scoring, else its prompt plus
  // max_new_tokens, at most max_context.
  int64_t MaxTokens(const Sequence& seq) const;
  // Blocks `seq` may still take beyond the ones it holds: all it may reach under kReserve (and
  // under kEstimate when it cannot stop early), the estimate under kEstimate.
  int64_t FutureBlocks(const Sequence& seq) const { return FutureBlocks(seq, new_token_ratio_); }
  // The same at the estimate's ratio `ratio`.
  int64_t FutureBlocks(const Sequence& seq, double ratio) const;
  // Whether `seq` may end before max_new_tokens: on a stop token of its own, or on the model's
  // EOS when it does not ignore it. kEstimate charges one that cannot all it may still need, as
  // kReserve does: an estimate could only be short for it.
  bool MayStopEarly(const Sequence& seq) const;
  // Free blocks and unlocked cached pages: what admissions and growth can take.
  int64_t RoomBlocks() const;
  // kReserve, kEstimate: whether the pool can hold `extra_blocks` more beside every running
  // sequence's FutureBlocks at the estimate's ratio `ratio` (RoomBlocks count as room).
  bool FitsBesideRunning(int64_t extra_blocks, double ratio) const;
  // The estimate's ratio at the next Schedule() (kEstimate falls by kNewTokenRatioDecay a step,
  // down to kMinNewTokenRatio; the other policies do not use it).
  double NextNewTokenRatio() const;
  // kEstimate: the ratio after a preemption, from the running sequences' progress.
  void RaiseNewTokenRatio();
  // Whether `seq` should wait for a running sequence that is still computing whole pages of
  // a prefix they share (beyond the `cached_tokens` the cache serves `seq` now): admitted
  // after those pages are cached, it reads them instead of computing them again. This is what
  // lets the samples of one request (or equal prompts) share one prefill.
  bool WaitsForSharedPrefix(const Sequence& seq, int64_t cached_tokens) const;
  // Admits waiting sequences that are not paused, in arrival order, while the head fits (the
  // admission part of Schedule()).
  void AdmitWaiting(int64_t* budget, std::vector<ScheduledChunk>* chunks);
  // When a sequence that is not paused waits: preempts the paused running sequence that loses
  // least (fewest computed tokens; the later arrival on a tie). False if there is none.
  bool PreemptPausedForTheQueue();
  // Index in running_ of the preemption victim among those not in `chunks`.
  size_t VictimIndex(const std::vector<ScheduledChunk>& chunks) const;
  // Records the chunk and counts what of it is recomputation.
  void Take(Sequence* seq, int64_t end, std::vector<ScheduledChunk>* chunks);
  static void InsertByArrival(Sequence* seq, std::vector<Sequence*>* list);

  const SchedulerOptions options_;
  KvBlockManager* const blocks_;
  PrefixCache* const cache_;
  std::string cache_version_;
  std::vector<Sequence*> running_;  // ascending arrival
  std::vector<Sequence*> waiting_;  // ascending arrival
  uint64_t num_preemptions_ = 0;
  uint64_t num_recomputed_tokens_ = 0;
  uint64_t num_prompt_tokens_ = 0;     // at first admission
  uint64_t num_cache_hit_tokens_ = 0;  // of those, served from the cache
  double new_token_ratio_ = kInitialNewTokenRatio;
};

}  // namespace rollout
