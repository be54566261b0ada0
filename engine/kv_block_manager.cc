#include "engine/kv_block_manager.h"

#include "glog/logging.h"

namespace rollout {

KvBlockManager::KvBlockManager(int32_t num_blocks, int32_t block_size)
    : num_total_(num_blocks), block_size_(block_size) {
  CHECK_GT(block_size, 0);
  free_.reserve(num_blocks);
  // Highest id at the bottom, so block 0 is handed out first.
  for (int32_t b = num_blocks - 1; b >= 0; --b) free_.push_back(b);
}

int32_t KvBlockManager::BlocksFor(int64_t num_tokens) const {
  return static_cast<int32_t>((num_tokens + block_size_ - 1) / block_size_);
}

bool KvBlockManager::Grow(int64_t num_tokens, std::vector<int32_t>* table) {
  const int64_t need = BlocksFor(num_tokens) - static_cast<int64_t>(table->size());
  if (need <= 0) return true;
  if (need > static_cast<int64_t>(free_.size())) return false;
  for (int64_t i = 0; i < need; ++i) {
    table->push_back(free_.back());
    free_.pop_back();
  }
  return true;
}

void KvBlockManager::Release(std::vector<int32_t>* table) {
  // Reverse order so that releasing right after Grow restores the free list exactly.
  for (auto it = table->rbegin(); it != table->rend(); ++it) free_.push_back(*it);
  table->clear();
}

}  // namespace rollout
