#include "model/tensor_parallel.h"

#include <algorithm>

#include "absl/strings/str_format.h"

namespace rollout {

RankShard ShardOf(const ModelConfig& c, int32_t tp, int32_t rank, int64_t vocab_rows) {
  RankShard shard;
  const int64_t nkv = c.num_key_value_heads;
  shard.heads = c.num_attention_heads / tp;
  shard.inter = c.intermediate_size / tp;
  shard.moe_inter = c.moe_intermediate_size / tp;
  if (nkv >= tp) {
    shard.kv_heads = nkv / tp;
    shard.kv_head_begin = rank * shard.kv_heads;
  } else {  // fewer KV heads than ranks: each rank holds the one its query heads read
    shard.kv_heads = 1;
    shard.kv_head_begin = rank / (tp / nkv);
  }
  shard.vocab_begin = std::min<int64_t>(c.vocab_size, rank * vocab_rows);
  shard.vocab_end = std::min<int64_t>(c.vocab_size, (rank + 1) * vocab_rows);
  return shard;
}

absl::Status CheckTensorParallel(const ModelConfig& c, int32_t tp) {
  if (tp != 1 && tp != 2 && tp != 4 && tp != 8) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "tensor-parallel degree %d: must be 1, 2, 4 or 8 (each rank owns a node of the "
        "canonical 8-segment reduction tree)",
        tp));
  }
  if (c.num_attention_heads % tp != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "tensor-parallel degree %d: the model's %d attention heads do not split evenly over %d "
        "ranks",
        tp, c.num_attention_heads, tp));
  }
  if (c.num_key_value_heads % tp != 0 && tp % c.num_key_value_heads != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "tensor-parallel degree %d: the model's %d KV heads neither split evenly over %d ranks "
        "nor replicate evenly across them",
        tp, c.num_key_value_heads, tp));
  }
  if (c.moe_intermediate_size % tp != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "tensor-parallel degree %d: the model's expert width (moe_intermediate_size) %d does not "
        "split evenly over %d ranks",
        tp, c.moe_intermediate_size, tp));
  }
  if (c.intermediate_size % tp != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "tensor-parallel degree %d: the model's intermediate size %d does not split evenly over "
        "%d ranks",
        tp, c.intermediate_size, tp));
  }
  return absl::OkStatus();
}

}  // namespace rollout
