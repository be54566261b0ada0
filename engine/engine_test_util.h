#pragma once

// Helpers for tests that drive the Engine offline.
#include <condition_variable>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/engine.h"
#include "engine/forwarding_runner.h"
#include "engine/model_runner.h"
#include "gtest/gtest.h"
#include "model/safetensors.h"

namespace rollout {

// Collects one job's completions and waits for all of them.
class Collector {
 public:
  explicit Collector(size_t n) : completions_(n) {}
  EventSink Sink() {
    return [this](std::vector<SampleEvent> events) {
      std::lock_guard<std::mutex> lock(mu_);
      for (SampleEvent& e : events) {
        streamed_[e.sample_index].insert(streamed_[e.sample_index].end(), e.new_token_ids.begin(),
                                         e.new_token_ids.end());
        if (e.completion.has_value()) {
          completions_[e.sample_index] = *std::move(e.completion);
          ++done_;
        }
      }
      cv_.notify_all();
    };
  }
  // REQUIRES: every sample_index of the job is < n.
  std::vector<SampleCompletion> Wait() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return done_ == completions_.size(); });
    return completions_;
  }
  std::vector<int32_t> streamed(int i) {
    std::lock_guard<std::mutex> lock(mu_);
    return streamed_[i];
  }
  // Tokens streamed so far, over every sample.
  size_t num_streamed() {
    std::lock_guard<std::mutex> lock(mu_);
    size_t n = 0;
    for (const auto& [sample, tokens] : streamed_) n += tokens.size();
    return n;
  }
  size_t num_done() {
    std::lock_guard<std::mutex> lock(mu_);
    return done_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<SampleCompletion> completions_;
  std::map<int, std::vector<int32_t>> streamed_;
  size_t done_ = 0;
};

// A ForwardingRunner that owns the runner it forwards to: tests derive from it and override only
// what they change (faults, fake IPC or broadcast ports, released weights).
class WrappingRunner : public ForwardingRunner {
 public:
  explicit WrappingRunner(std::unique_ptr<ModelRunner> inner)
      : ForwardingRunner(inner.get()), owned_(std::move(inner)) {}

 private:
  std::unique_ptr<ModelRunner> owned_;
};

// Token ids, logprob bit patterns and finish reason: equal strings mean bitwise-equal samples.
inline std::string Bits(const SampleCompletion& c) {
  std::string out;
  for (int32_t t : c.token_ids) absl::StrAppend(&out, t, ",");
  for (float lp : c.logprobs) {
    uint32_t b;
    std::memcpy(&b, &lp, 4);
    absl::StrAppend(&out, b, ";");
  }
  absl::StrAppend(&out, static_cast<int>(c.finish_reason));
  return out;
}

// A bf16 tensor with each value times `scale` (rounded to bf16): a pushed weight that differs
// from the loaded one.
inline HostTensor ScaledBf16(HostTensor t, float scale) {
  for (size_t i = 0; i + 1 < t.bytes.size(); i += 2) {
    uint16_t v;
    std::memcpy(&v, &t.bytes[i], 2);
    v = F32ToBF16(BF16ToF32(v) * scale);
    std::memcpy(&t.bytes[i], &v, 2);
  }
  return t;
}

// Tensor `name` of the checkpoint at `dir`, copied; a test failure (and an empty tensor) when
// the checkpoint or the tensor is missing.
inline HostTensor ReadCheckpointTensor(const std::string& dir, const std::string& name) {
  auto checkpoint = Checkpoint::Open(dir);
  EXPECT_TRUE(checkpoint.ok()) << checkpoint.status();
  if (!checkpoint.ok()) return {};
  const TensorView* view = (*checkpoint)->Find(name);
  EXPECT_NE(view, nullptr) << name;
  if (view == nullptr) return {};
  return HostTensor{name, view->dtype, view->shape,
                    std::vector<uint8_t>(view->data, view->data + view->nbytes)};
}

// Checkpoint tensor `name` (bf16) of the model at `model_dir`, scaled (ScaledBf16).
inline HostTensor ScaledCheckpointTensor(const std::string& model_dir, const std::string& name,
                                         float scale) {
  return ScaledBf16(ReadCheckpointTensor(model_dir, name), scale);
}

}  // namespace rollout
