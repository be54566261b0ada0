#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "common/thread_pool.h"
#include "engine/model_runner.h"
#include "engine/sampler.h"

namespace rollout {

// The host implementation of ModelRunner::ProcessLogits: SampleToken for sampling rows and
// LogSoftmax at T (0 means 1) for scoring rows, SampleResult::nonfinite set for both (a row
// with a NaN or +/-inf logit), rows split across `pool` (each row is one
// independent, fixed-order computation, so the split cannot change a bit). Used by both
// backends (the CUDA one for rows its device sampler does not take).
// logits: [tasks.size(), vocab_size].
absl::Status ProcessLogitsOnHost(const std::vector<LogitsRowTask>& tasks,
                                 const std::vector<float>& logits, int32_t vocab_size,
                                 cpu::ThreadPool* pool, std::vector<SampleResult>* results);

}  // namespace rollout
