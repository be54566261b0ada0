#include "engine/prefix_cache.h"

#include <limits>
#include <utility>

#include "glog/logging.h"

namespace rollout {

struct PrefixCache::Node {
  uint64_t id = 0;
  Node* parent = nullptr;
  std::vector<int32_t> page;  // the page's tokens (the key under parent)
  int32_t block = 0;
  int32_t refs = 0;  // sequences whose path holds this node
  uint64_t last_use = 0;
  bool detached = false;  // flushed: unreachable, freed when refs drop to 0
  std::map<std::vector<int32_t>, Node*> children;
  bool evictable = false;  // in PrefixCache::evictable_ under (indexed_use, id)
  uint64_t indexed_use = 0;
};

PrefixCache::PrefixCache(KvBlockManager* blocks, bool enabled)
    : blocks_(blocks), enabled_(enabled), page_size_(blocks->block_size()) {}

PrefixCache::~PrefixCache() = default;

PrefixCache::Node* PrefixCache::Root(const std::string& version) {
  std::unique_ptr<Node>& root = roots_[version];
  if (root == nullptr) root = std::make_unique<Node>();
  return root.get();
}

void PrefixCache::Touch(Node* node) {
  node->last_use = ++clock_;
  Reindex(node);
}

// Keeps evictable_ equal to the set of unlocked, reachable leaves (roots excluded: they hold no
// block), keyed by (last use, creation order): the eviction order.
void PrefixCache::Reindex(Node* node) {
  if (node->evictable) {
    evictable_.erase({node->indexed_use, node->id});
    node->evictable = false;
  }
  if (node->refs == 0 && node->children.empty() && !node->detached && node->parent != nullptr) {
    evictable_.emplace(node->last_use, node->id);
    node->evictable = true;
    node->indexed_use = node->last_use;
  }
}

std::vector<PrefixCache::Node*> PrefixCache::Match(const std::string& version,
                                                   const std::vector<int32_t>& tokens,
                                                   int64_t max_pages,
                                                   std::vector<int32_t>* blocks) {
  std::vector<Node*> path;
  if (!enabled_) return path;
  Node* node = Root(version);
  std::vector<int32_t> key(page_size_);
  for (int64_t p = 0; p < max_pages; ++p) {
    key.assign(tokens.begin() + p * page_size_, tokens.begin() + (p + 1) * page_size_);
    auto it = node->children.find(key);
    if (it == node->children.end()) break;
    node = it->second;
    if (node->refs++ == 0) --unlocked_;
    Touch(node);
    path.push_back(node);
    blocks->push_back(node->block);
  }
  return path;
}

bool PrefixCache::Extend(const std::string& version, const std::vector<int32_t>& tokens,
                         int32_t block, std::vector<Node*>* path) {
  if (!enabled_) return false;
  Node* parent = path->empty() ? Root(version) : path->back();
  if (parent->detached) return false;
  const int64_t p = static_cast<int64_t>(path->size());
  std::vector<int32_t> key(tokens.begin() + p * page_size_, tokens.begin() + (p + 1) * page_size_);
  auto it = parent->children.find(key);
  bool owned = false;
  Node* node;
  if (it != parent->children.end()) {
    node = it->second;
  } else {
    auto fresh = std::make_unique<Node>();
    fresh->id = next_id_++;
    fresh->parent = parent;
    fresh->page = key;
    fresh->block = block;
    node = fresh.get();
    parent->children.emplace(std::move(key), node);
    nodes_.emplace(node->id, std::move(fresh));
    Reindex(parent);  // no longer a leaf
    owned = true;
  }
  if (node->refs++ == 0 && !owned) --unlocked_;
  Touch(node);
  path->push_back(node);
  return owned;
}

bool PrefixCache::OwnsBlock(const std::vector<Node*>& path, size_t index, int32_t block) {
  return index < path.size() && path[index]->block == block;
}

void PrefixCache::Free(Node* node) {
  CHECK_EQ(node->refs, 0);
  CHECK(node->children.empty());
  node->detached = true;
  Reindex(node);  // out of the index
  if (node->parent != nullptr) {
    node->parent->children.erase(node->page);
    Reindex(node->parent);  // may have become an evictable leaf
  }
  std::vector<int32_t> one = {node->block};
  blocks_->Release(&one);
  nodes_.erase(node->id);
}

void PrefixCache::Unlock(std::vector<Node*>* path) {
  // Deepest first, so that a detached child is freed before its detached parent is checked.
  for (auto it = path->rbegin(); it != path->rend(); ++it) {
    Node* node = *it;
    CHECK_GT(node->refs, 0);
    --node->refs;
    Touch(node);
    if (node->refs > 0) continue;
    if (node->detached) {
      if (node->children.empty()) Free(node);
    } else {
      ++unlocked_;
    }
  }
  path->clear();
}

int32_t PrefixCache::Evict(int32_t num_blocks) {
  int32_t freed = 0;
  while (freed < num_blocks && !evictable_.empty()) {
    Free(nodes_.at(evictable_.begin()->second).get());
    --unlocked_;
    ++freed;
  }
  return freed;
}

FlushResult PrefixCache::Flush() {
  FlushResult result;
  for (auto& [version, root] : roots_) {
    for (auto& [key, child] : root->children) child->parent = nullptr;
    root->children.clear();
  }
  // Detach everything, then free what no sequence holds, leaves upwards (ids grow with depth
  // along any path, so descending id order visits children before parents).
  for (auto& [id, node] : nodes_) {
    node->detached = true;
    node->evictable = false;
  }
  evictable_.clear();
  std::vector<Node*> order;
  for (auto it = nodes_.rbegin(); it != nodes_.rend(); ++it) order.push_back(it->second.get());
  for (Node* node : order) {
    if (node->refs == 0 && node->children.empty()) {
      if (node->parent != nullptr) node->parent->children.erase(node->page);
      std::vector<int32_t> one = {node->block};
      blocks_->Release(&one);
      nodes_.erase(node->id);
      ++result.freed_blocks;
    }
  }
  result.detached_blocks = static_cast<int32_t>(nodes_.size());
  unlocked_ = 0;  // what is left is locked (and detached)
  return result;
}

}  // namespace rollout
