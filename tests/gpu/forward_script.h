#pragma once

#include <cstdint>
#include <vector>

#include "engine/model_runner.h"

// Building ForwardBatches by hand for the whole-model GPU tests (model_test.cc, tp_test.cc):
// sequences with their KV blocks, and the chunks of them one Forward runs.
namespace rollout::gpu_test {

// A sequence under test: its tokens and the KV blocks it owns.
struct Seq {
  std::vector<int32_t> tokens;
  std::vector<int32_t> blocks;
};

// Tokens [begin, end) of sequence `seq` in one Forward; logits for every token or the last.
struct Chunk {
  int seq;
  int begin, end;
  bool all_logits;
};

// One Forward over `chunks`, each chunk its own block table, in order.
ForwardBatch MakeBatch(const std::vector<Seq>& seqs, const std::vector<Chunk>& chunks);

// n token ids in [0, vocab), seeded.
std::vector<int32_t> RandomTokens(int n, int vocab, uint64_t seed);

}  // namespace rollout::gpu_test
