#include "engine/model_runner.h"

#include <algorithm>

#include "absl/strings/str_format.h"

namespace rollout {

size_t WeightSpec::nbytes() const {
  size_t n = DTypeSize(dtype);
  for (int64_t d : shape) n *= static_cast<size_t>(d);
  return n;
}

const WeightSpec* FindWeightSpec(const std::vector<WeightSpec>& specs, const std::string& name) {
  auto it = std::lower_bound(specs.begin(), specs.end(), name,
                             [](const WeightSpec& s, const std::string& n) { return s.name < n; });
  return it != specs.end() && it->name == name ? &*it : nullptr;
}

absl::Status CheckTensorAgainstSpec(const std::vector<WeightSpec>& specs, const std::string& name,
                                    DType dtype, const std::vector<int64_t>& shape) {
  const WeightSpec* spec = FindWeightSpec(specs, name);
  if (spec == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrFormat("tensor '%s' is not a weight of the served model", name));
  }
  if (dtype != spec->dtype) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "tensor '%s': dtype %s given, the served tensor is %s", name, DTypeName(dtype),
        DTypeName(spec->dtype)));
  }
  if (shape != spec->shape) {
    return absl::InvalidArgumentError(absl::StrFormat("tensor '%s': shape %s given, expected %s",
                                                      name, ShapeToString(shape),
                                                      ShapeToString(spec->shape)));
  }
  return absl::OkStatus();
}

bool ModelRunner::HasFedTokens(const ForwardBatch& batch) {
  return std::any_of(batch.token_ids.begin(), batch.token_ids.end(),
                     [](int32_t id) { return id < 0; });
}

absl::Status ModelRunner::ResolveFedTokens(const std::vector<SampleResult>& fed_from,
                                           ForwardBatch* batch) {
  for (int32_t& id : batch->token_ids) {
    if (id >= 0) continue;
    const int64_t row = -1 - static_cast<int64_t>(id);
    if (row >= static_cast<int64_t>(fed_from.size())) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "fed token of row %d: the previous launched step has %d rows", row, fed_from.size()));
    }
    id = fed_from[row].token;
  }
  return absl::OkStatus();
}

absl::Status ModelRunner::LaunchStep(const ForwardBatch& batch,
                                     const std::vector<LogitsRowTask>& tasks) {
  if (launched_results_.size() >= 2) {
    return absl::FailedPreconditionError("two launched steps are not collected yet");
  }
  std::vector<float> logits;
  std::vector<SampleResult> results;
  if (HasFedTokens(batch)) {
    if (launched_results_.empty()) {
      return absl::InvalidArgumentError("fed tokens without a launched step to feed them");
    }
    ForwardBatch resolved = batch;
    if (absl::Status s = ResolveFedTokens(launched_results_.back(), &resolved); !s.ok()) return s;
    if (absl::Status s = Forward(resolved, &logits); !s.ok()) return s;
  } else {
    if (absl::Status s = Forward(batch, &logits); !s.ok()) return s;
  }
  if (absl::Status s = ProcessLogits(tasks, logits, &results); !s.ok()) return s;
  launched_results_.push_back(std::move(results));
  return absl::OkStatus();
}

absl::Status ModelRunner::CollectStep(std::vector<SampleResult>* results) {
  if (launched_results_.empty()) return absl::FailedPreconditionError("no launched step");
  *results = std::move(launched_results_.front());
  launched_results_.pop_front();
  return absl::OkStatus();
}

absl::Status ProcessLogitsOnHost(const std::vector<LogitsRowTask>& tasks,
                                 const std::vector<float>& logits, int32_t vocab_size,
                                 cpu::ThreadPool* pool, std::vector<SampleResult>* results) {
  const int64_t rows = static_cast<int64_t>(tasks.size());
  if (static_cast<int64_t>(logits.size()) != rows * vocab_size) {
    return absl::InternalError(absl::StrFormat("%d logits rows of %d expected, %d values given",
                                               rows, vocab_size, logits.size()));
  }
  results->assign(rows, SampleResult());
  pool->ParallelFor(rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(vocab_size);
    for (int64_t r = begin; r < end; ++r) {
      const LogitsRowTask& task = tasks[r];
      const float* row = logits.data() + r * vocab_size;
      SampleResult& out = (*results)[r];
      if (!task.score_token.has_value()) {
        out = SampleToken(row, vocab_size, *task.params, task.sample_seed, task.position,
                          &scratch);
        continue;
      }
      // Same definition as sampling: T = 0 scores like greedy generation, at T = 1.
      const float t = task.params->temperature > 0.0f ? task.params->temperature : 1.0f;
      LogSoftmax(row, vocab_size, t, scratch.data());
      out.token = *task.score_token;
      out.logprob = scratch[out.token];
      out.top = TopLogprobs(scratch.data(), vocab_size, task.params->top_logprobs);
    }
  });
  return absl::OkStatus();
}

}  // namespace rollout
