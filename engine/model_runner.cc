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
