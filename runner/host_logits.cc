#include "runner/host_logits.h"

#include "absl/strings/str_format.h"

namespace rollout {

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
        out = SampleToken(row, vocab_size, *task.params, task.sample_seed, task.position, &scratch);
        continue;
      }
      // Same definition as sampling: T = 0 scores like greedy generation, at T = 1.
      const float t = task.params->temperature > 0.0f ? task.params->temperature : 1.0f;
      LogSoftmax(row, vocab_size, t, scratch.data());
      out.token = *task.score_token;
      out.logprob = scratch[out.token];
      out.nonfinite = !LogitsFinite(row, vocab_size);
      out.top = TopLogprobs(scratch.data(), vocab_size, task.params->top_logprobs);
    }
  });
  return absl::OkStatus();
}

}  // namespace rollout
