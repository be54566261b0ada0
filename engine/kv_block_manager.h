#pragma once

#include <cstdint>
#include <vector>

namespace rollout {

// Hands out KV cache blocks by id. Engine thread only. Block ids never affect a result (the
// attention reads a sequence's blocks through its table), but allocation is still a
// deterministic LIFO of the free list so that a given schedule always uses the same blocks.
class KvBlockManager {
 public:
  KvBlockManager(int32_t num_blocks, int32_t block_size);

  int32_t num_total() const { return num_total_; }
  int32_t num_free() const { return static_cast<int32_t>(free_.size()); }
  int32_t block_size() const { return block_size_; }

  // Blocks needed to hold `num_tokens` tokens.
  int32_t BlocksFor(int64_t num_tokens) const;

  // Appends blocks to `table` until it holds `num_tokens` tokens. Returns false and changes
  // nothing when there are not enough free blocks.
  bool Grow(int64_t num_tokens, std::vector<int32_t>* table);

  // Returns every block of `table` to the pool and clears it.
  void Release(std::vector<int32_t>* table);

 private:
  const int32_t num_total_;
  const int32_t block_size_;
  std::vector<int32_t> free_;  // back() is handed out next
};

}  // namespace rollout
