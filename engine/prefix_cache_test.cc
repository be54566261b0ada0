#include "engine/prefix_cache.h"

#include <numeric>

#include "gtest/gtest.h"

namespace rollout {
namespace {

std::vector<int32_t> Tokens(int n, int base = 0) {
  std::vector<int32_t> t(n);
  std::iota(t.begin(), t.end(), base);
  return t;
}

// Inserts every whole page of `tokens` as a sequence would, with fresh blocks; returns the
// locked path.
std::vector<PrefixCache::Node*> InsertAll(PrefixCache* cache, KvBlockManager* blocks,
                                          const std::vector<int32_t>& tokens) {
  std::vector<PrefixCache::Node*> path;
  std::vector<int32_t> table;
  EXPECT_TRUE(blocks->Grow(static_cast<int64_t>(tokens.size()), &table));
  const size_t pages = tokens.size() / blocks->block_size();
  std::vector<int32_t> private_blocks;
  for (size_t p = 0; p < pages; ++p) {
    if (!cache->Extend("v", tokens, table[p], &path)) private_blocks.push_back(table[p]);
  }
  for (size_t p = pages; p < table.size(); ++p) private_blocks.push_back(table[p]);
  blocks->Release(&private_blocks);
  return path;
}

TEST(PrefixCacheTest, MatchFindsTheLongestCachedRunOfWholePages) {
  KvBlockManager blocks(16, 4);
  PrefixCache cache(&blocks);
  std::vector<PrefixCache::Node*> path = InsertAll(&cache, &blocks, Tokens(10));  // 2 pages
  cache.Unlock(&path);
  std::vector<int32_t> table;
  std::vector<int32_t> query = Tokens(10);
  query[5] = 99;  // second page differs
  std::vector<PrefixCache::Node*> hit = cache.Match("v", query, 2, &table);
  EXPECT_EQ(hit.size(), 1u);
  EXPECT_EQ(table.size(), 1u);
  cache.Unlock(&hit);
  table.clear();
  hit = cache.Match("v", Tokens(10), 1, &table);
  EXPECT_EQ(hit.size(), 1u) << "max_pages bounds the match";
  cache.Unlock(&hit);
  table.clear();
  hit = cache.Match("other-version", Tokens(10), 2, &table);
  EXPECT_TRUE(hit.empty()) << "KV of one weight version never serves another";
}

TEST(PrefixCacheTest, LockedPagesAreNeverEvictedAndLruGoesFirst) {
  KvBlockManager blocks(8, 2);
  PrefixCache cache(&blocks);
  std::vector<PrefixCache::Node*> a = InsertAll(&cache, &blocks, Tokens(2, 0));
  std::vector<PrefixCache::Node*> b = InsertAll(&cache, &blocks, Tokens(2, 10));
  std::vector<PrefixCache::Node*> c = InsertAll(&cache, &blocks, Tokens(2, 20));
  EXPECT_EQ(cache.num_cached_blocks(), 3);
  cache.Unlock(&b);  // released before a, so b is the least recently used
  cache.Unlock(&a);
  EXPECT_EQ(cache.Evict(1), 1);
  std::vector<int32_t> table;
  std::vector<PrefixCache::Node*> hit = cache.Match("v", Tokens(2, 10), 1, &table);
  EXPECT_TRUE(hit.empty()) << "b was released first, so it was least recently used";
  table.clear();
  hit = cache.Match("v", Tokens(2, 0), 1, &table);
  EXPECT_EQ(hit.size(), 1u);
  cache.Unlock(&hit);
  EXPECT_EQ(cache.Evict(10), 1) << "only a is unlocked; c is still held";
  EXPECT_EQ(cache.num_cached_blocks(), 1);
  cache.Unlock(&c);
  EXPECT_EQ(cache.Evict(10), 1);
  EXPECT_EQ(blocks.num_free(), 8);
}

TEST(PrefixCacheTest, EvictionTakesLeavesBeforeTheirParents) {
  KvBlockManager blocks(8, 2);
  PrefixCache cache(&blocks);
  std::vector<PrefixCache::Node*> path = InsertAll(&cache, &blocks, Tokens(6));  // 3 pages
  cache.Unlock(&path);
  EXPECT_EQ(cache.Evict(1), 1);
  std::vector<int32_t> table;
  std::vector<PrefixCache::Node*> hit = cache.Match("v", Tokens(6), 3, &table);
  EXPECT_EQ(hit.size(), 2u) << "the deepest page went first";
  cache.Unlock(&hit);
}

TEST(PrefixCacheTest, ExtendReusesAnExistingPageAndKeepsTheDuplicatePrivate) {
  KvBlockManager blocks(8, 2);
  PrefixCache cache(&blocks);
  std::vector<PrefixCache::Node*> first = InsertAll(&cache, &blocks, Tokens(4));
  std::vector<int32_t> table;
  ASSERT_TRUE(blocks.Grow(4, &table));
  std::vector<PrefixCache::Node*> second;
  EXPECT_FALSE(cache.Extend("v", Tokens(4), table[0], &second));
  EXPECT_FALSE(PrefixCache::OwnsBlock(second, 0, table[0]));
  EXPECT_EQ(second[0], first[0]);
  EXPECT_EQ(cache.num_cached_blocks(), 2);
  cache.Unlock(&first);
  cache.Unlock(&second);
  blocks.Release(&table);
}

TEST(PrefixCacheTest, FlushFreesUnlockedPagesAndDetachesLockedOnesUntilReleased) {
  KvBlockManager blocks(8, 2);
  PrefixCache cache(&blocks);
  std::vector<PrefixCache::Node*> held = InsertAll(&cache, &blocks, Tokens(4));      // 2 pages
  std::vector<PrefixCache::Node*> idle = InsertAll(&cache, &blocks, Tokens(4, 50));  // 2 pages
  cache.Unlock(&idle);
  FlushResult r = cache.Flush();
  EXPECT_EQ(r.freed_blocks, 2);
  EXPECT_EQ(r.detached_blocks, 2);
  std::vector<int32_t> table;
  EXPECT_TRUE(cache.Match("v", Tokens(4), 2, &table).empty()) << "flushed prefixes never hit";
  // The holder may keep extending nothing further, and its blocks stay valid until released.
  EXPECT_EQ(blocks.num_free(), 6);
  cache.Unlock(&held);
  EXPECT_EQ(cache.num_cached_blocks(), 0);
  EXPECT_EQ(blocks.num_free(), 8);
}

TEST(PrefixCacheTest, DisabledCacheMatchesAndKeepsNothing) {
  KvBlockManager blocks(8, 2);
  PrefixCache cache(&blocks, /*enabled=*/false);
  std::vector<PrefixCache::Node*> path;
  EXPECT_FALSE(cache.Extend("v", Tokens(2), 0, &path));
  EXPECT_TRUE(path.empty());
  std::vector<int32_t> table;
  EXPECT_TRUE(cache.Match("v", Tokens(2), 1, &table).empty());
}

}  // namespace
}  // namespace rollout
