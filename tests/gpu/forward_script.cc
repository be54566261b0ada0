#include "tests/gpu/forward_script.h"

#include <random>

namespace rollout::gpu_test {

ForwardBatch MakeBatch(const std::vector<Seq>& seqs, const std::vector<Chunk>& chunks) {
  ForwardBatch b;
  for (const Chunk& c : chunks) {
    const int32_t index = static_cast<int32_t>(b.block_tables.size());
    b.block_tables.push_back(seqs[c.seq].blocks);
    for (int pos = c.begin; pos < c.end; ++pos) {
      if (c.all_logits || pos == c.end - 1) b.logit_rows.push_back(b.num_tokens());
      b.token_ids.push_back(seqs[c.seq].tokens[pos]);
      b.positions.push_back(pos);
      b.token_seq.push_back(index);
    }
  }
  return b;
}

std::vector<int32_t> RandomTokens(int n, int vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> t(n);
  for (int32_t& x : t) x = static_cast<int32_t>(rng() % vocab);
  return t;
}

}  // namespace rollout::gpu_test
