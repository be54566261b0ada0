#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "engine/kv_block_manager.h"

namespace rollout {

// What a flush of the prefix cache did.
struct FlushResult {
  int32_t freed_blocks = 0;
  int32_t detached_blocks = 0;  // still locked by running sequences; freed on unlock
};

// A radix tree over token ids at page (KV block) granularity: the path to a node spells the
// tokens of a prefix, page by page, and the node owns the KV block of its last page. Pages of
// generated tokens are inserted as well, so a multi-turn prompt that repeats an earlier prompt
// + completion hits. Keyed by weight version: KV of one version never serves another.
//
// Sequences lock the nodes on their path (reference counts); only unlocked leaves are evicted,
// least recently used first, ties broken by creation order -- so eviction is deterministic.
// Whether a prefix hits never changes a result bit: a row's attention reads the same KV values
// wherever they came from. Engine thread only.
class PrefixCache {
 public:
  struct Node;

  // `blocks` is borrowed; the cache frees blocks of evicted nodes into it.
  explicit PrefixCache(KvBlockManager* blocks, bool enabled = true);
  ~PrefixCache();
  PrefixCache(const PrefixCache&) = delete;
  PrefixCache& operator=(const PrefixCache&) = delete;

  bool enabled() const { return enabled_; }

  // The longest cached prefix of `tokens` of at most `max_pages` whole pages under `version`.
  // Locks and returns the path (one node per page); `blocks` gets each node's KV block.
  std::vector<Node*> Match(const std::string& version, const std::vector<int32_t>& tokens,
                           int64_t max_pages, std::vector<int32_t>* blocks);

  // Records page `path->size()` of a sequence whose KV for it is computed in `block`. If the
  // tree has that page already, the sequence's own block stays its private copy; otherwise
  // the node takes ownership of `block`. Either way the node is locked and appended to `path`.
  // Returns whether `block` now belongs to the cache. Does nothing (returns false) once the
  // path was detached by Flush.
  bool Extend(const std::string& version, const std::vector<int32_t>& tokens, int32_t block,
              std::vector<Node*>* path);

  // Whether page `index` of a sequence with `path` is served by the cache's block `block`
  // (rather than a private block of the sequence).
  static bool OwnsBlock(const std::vector<Node*>& path, size_t index, int32_t block);

  // Unlocks a sequence's path and clears it.
  void Unlock(std::vector<Node*>* path);

  // Evicts unlocked leaves, LRU first, until `num_blocks` blocks were freed or none is left.
  // Returns how many were freed.
  int32_t Evict(int32_t num_blocks);

  // Forgets every prefix. Locked nodes stay valid for their sequences until unlocked.
  FlushResult Flush();

  int32_t num_cached_blocks() const { return static_cast<int32_t>(nodes_.size()); }
  // Cached blocks no sequence holds: every one can be evicted (a locked node's ancestors are
  // locked too, so an unlocked node has only unlocked descendants).
  int32_t num_unlocked_blocks() const { return unlocked_; }

 private:
  Node* Root(const std::string& version);
  void Touch(Node* node);
  void Reindex(Node* node);
  void Free(Node* node);

  KvBlockManager* const blocks_;
  const bool enabled_;
  int32_t page_size_;
  uint64_t clock_ = 0;                                  // LRU time: bumped on every lock and unlock
  uint64_t next_id_ = 0;                                // creation order: the stable tie-break
  std::map<std::string, std::unique_ptr<Node>> roots_;  // by weight version
  std::map<uint64_t, std::unique_ptr<Node>> nodes_;     // every node holding a block, by id
  // Unlocked leaves as (last use, id), the next victim first: Evict is O(log n) per block.
  std::set<std::pair<uint64_t, uint64_t>> evictable_;
  int32_t unlocked_ = 0;  // reachable nodes with refs == 0
};

}  // namespace rollout
