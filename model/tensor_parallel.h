#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "model/model_config.h"

namespace rollout {

// Why `config` cannot be split `tensor_parallel` ways (INVALID_ARGUMENT naming the dimension),
// or OK.
absl::Status CheckTensorParallel(const ModelConfig& config, int32_t tensor_parallel);

// What rank `rank` of `tensor_parallel` holds (Megatron partitioning, both backends): its query
// heads, its KV heads from kv_head_begin (split, or the one its query heads read when there are
// fewer KV heads than ranks), its intermediate features (of the dense MLPs, and moe_inter of
// every expert of a MoE layer: each expert splits as a dense MLP does), and vocab rows
// [vocab_begin, vocab_end) of shards of `vocab_rows` rows.
// REQUIRES: CheckTensorParallel(config, tensor_parallel) is OK.
struct RankShard {
  int64_t heads = 0, kv_heads = 0, kv_head_begin = 0, inter = 0, moe_inter = 0;
  int64_t vocab_begin = 0, vocab_end = 0;
};
RankShard ShardOf(const ModelConfig& config, int32_t tensor_parallel, int32_t rank,
                  int64_t vocab_rows);

}  // namespace rollout
