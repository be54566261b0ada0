#pragma once

// A ModelRunner that forwards what every runner must have to another one, for decorators that
// change a few calls: rollout-bench's TimedRunner (bench/timed_runner.h), the engine tests'
// fault, IPC, broadcast and memory runners (WrappingRunner, engine/engine_test_util.h).
#include <cstdint>
#include <vector>

#include "engine/model_runner.h"

namespace rollout {

// Forwards the pure virtuals of ModelRunner to `inner` (not owned; it must outlive this). The
// calls with defaults (LaunchStep, CollectStep, CanFeed, weight sync ports, memory release...)
// are not forwarded: a derived runner forwards those it wants, and the others run
// ModelRunner's defaults on top of this one's Forward and ProcessLogits.
class ForwardingRunner : public ModelRunner {
 public:
  explicit ForwardingRunner(ModelRunner* inner) : inner_(inner) {}
  const ModelConfig& config() const override { return inner_->config(); }
  const char* backend_name() const override { return inner_->backend_name(); }
  int32_t num_kv_blocks() const override { return inner_->num_kv_blocks(); }
  int32_t kv_block_size() const override { return inner_->kv_block_size(); }
  int32_t attention_split_size() const override { return inner_->attention_split_size(); }
  absl::Status Forward(const ForwardBatch& batch, std::vector<float>* logits) override {
    return inner_->Forward(batch, logits);
  }
  absl::Status ProcessLogits(const std::vector<LogitsRowTask>& tasks,
                             const std::vector<float>& logits,
                             std::vector<SampleResult>* results) override {
    return inner_->ProcessLogits(tasks, logits, results);
  }
  const std::vector<WeightSpec>& weight_specs() const override { return inner_->weight_specs(); }
  absl::Status UpdateWeights(const std::vector<HostTensorView>& tensors) override {
    return inner_->UpdateWeights(tensors);
  }

 protected:
  ModelRunner& inner() const { return *inner_; }

 private:
  ModelRunner* const inner_;
};

}  // namespace rollout
