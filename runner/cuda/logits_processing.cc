// CudaModelRunner's logits processing: sampling and scoring on the GPU (kernels/cuda/sampling.h),
// the host's SampleToken for rows with top-k / top-p / min-p, and which rows the device picks
// every token of (CanFeed).
#include <cuda_runtime.h>

#include <cfloat>
#include <cmath>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/cuda_status.h"
#include "common/status.h"
#include "engine/sampler.h"
#include "kernels/cuda/sampling.h"
#include "runner/cuda/cuda_model_runner.h"
#include "runner/cuda/cuda_runner_state.h"

namespace rollout {

namespace {

// engine/sampler.cc's logits / T as the device computes it (IEEE division, NaN -> -inf,
// +inf -> FLT_MAX): on the host for rows whose token the host picks.
float HostScaledLogit(float logit, float t) {
  const float x = logit / t;
  if (std::isnan(x)) return -INFINITY;
  if (x == INFINITY) return FLT_MAX;
  return x;
}

bool HostPicksToken(const LogitsRowTask& task, int32_t vocab) {
  const SamplingParams& p = *task.params;
  if (task.score_token.has_value() || !(p.temperature > 0.0f)) return false;
  return (p.top_k > 0 && p.top_k < vocab) || p.top_p < 1.0f || p.min_p > 0.0f;
}

}  // namespace

absl::Status CudaModelRunner::ProcessLogits(const std::vector<LogitsRowTask>& tasks,
                                            const std::vector<float>& logits,
                                            std::vector<SampleResult>* results) {
  State& s = *state_;
  const int64_t rows = static_cast<int64_t>(tasks.size());
  const int64_t vocab = config_.vocab_size;
  const bool from_caller = !logits.empty();
  if (from_caller && static_cast<int64_t>(logits.size()) != rows * vocab) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%d logits rows of %d expected, %d values given", rows, vocab, logits.size()));
  }
  if (!from_caller && rows != s.last_rows) {
    return absl::InternalError(
        absl::StrFormat("%d tasks for the %d logits rows of the last Forward", rows, s.last_rows));
  }
  for (const LogitsRowTask& task : tasks) {
    if (task.params == nullptr) return absl::InvalidArgumentError("task without params");
    if (task.params->top_logprobs > cuda::kMaxDeviceTopN) {
      return absl::InvalidArgumentError(
          absl::StrFormat("top_logprobs %d: at most %d on the CUDA backend",
                          task.params->top_logprobs, cuda::kMaxDeviceTopN));
    }
    if (task.score_token.has_value() && (*task.score_token < 0 || *task.score_token >= vocab)) {
      return absl::InvalidArgumentError(absl::StrCat("score token ", *task.score_token));
    }
  }
  ROLLOUT_RETURN_IF_ERROR(CudaError(cudaSetDevice(s.ranks[0].device), "cudaSetDevice"));
  results->assign(rows, SampleResult());
  const int64_t chunk = options_.max_logit_rows;
  for (int64_t first = 0; first < rows; first += chunk) {
    const int64_t count = std::min(chunk, rows - first);
    const float* source = nullptr;  // host rows to upload, or nullptr: already on the device
    if (from_caller) {
      source = logits.data() + first * vocab;
    } else if (!s.last_on_device) {
      source = s.spill.data() + first * vocab;
    }
    const float* device_rows = s.logits.get<float>() + (source == nullptr ? first * vocab : 0);
    if (source != nullptr) {
      ROLLOUT_RETURN_IF_ERROR(CudaError(cudaMemcpyAsync(s.logits.get(), source, count * vocab * 4,
                                                        cudaMemcpyHostToDevice, s.stream),
                                        "uploading logits"));
    }
    ROLLOUT_RETURN_IF_ERROR(ProcessDeviceRows(device_rows, tasks, first, count, results));
  }
  return absl::OkStatus();
}

absl::Status CudaModelRunner::EnqueueDeviceRows(const float* rows,
                                                const std::vector<LogitsRowTask>& tasks,
                                                int64_t first, int64_t count) {
  State& s = *state_;
  const int32_t vocab = config_.vocab_size;
  cuda::LogitsRowSpec* specs = s.staging().specs.get<cuda::LogitsRowSpec>();
  for (int64_t i = 0; i < count; ++i) {
    const LogitsRowTask& task = tasks[first + i];
    const SamplingParams& p = *task.params;
    cuda::LogitsRowSpec& spec = specs[i];
    spec = cuda::LogitsRowSpec();
    spec.seed = task.sample_seed;
    spec.position = task.position;
    spec.temperature = p.temperature > 0.0f ? p.temperature : 1.0f;
    spec.top_n = p.top_logprobs;
    if (task.score_token.has_value()) {
      spec.mode = cuda::kRowScore;
      spec.score_token = *task.score_token;
    } else if (!(p.temperature > 0.0f)) {
      spec.mode = cuda::kRowGreedy;
    } else if (HostPicksToken(task, vocab)) {
      spec.mode = cuda::kRowStats;
    } else {
      spec.mode = cuda::kRowSample;
    }
  }
  ROLLOUT_RETURN_IF_ERROR(
      CudaError(cudaMemcpyAsync(s.row_specs.get(), specs, count * sizeof(cuda::LogitsRowSpec),
                                cudaMemcpyHostToDevice, s.stream),
                "uploading sampling specs"));
  ROLLOUT_RETURN_IF_ERROR(
      CudaError(cuda::ProcessLogitsRows(rows, count, vocab, s.row_specs.get<cuda::LogitsRowSpec>(),
                                        s.row_results.get<cuda::LogitsRowResult>(), s.stream),
                "sampling kernel"));
  return CudaError(
      cudaMemcpyAsync(s.staging().results.get(), s.row_results.get(),
                      count * sizeof(cuda::LogitsRowResult), cudaMemcpyDeviceToHost, s.stream),
      "downloading sampling results");
}

void CudaModelRunner::ConvertDeviceRows(const void* host, int64_t first, int64_t count,
                                        std::vector<SampleResult>* results) {
  const cuda::LogitsRowResult* out = static_cast<const cuda::LogitsRowResult*>(host);
  for (int64_t i = 0; i < count; ++i) {
    const cuda::LogitsRowResult& o = out[i];
    SampleResult& result = (*results)[first + i];
    result.top.clear();
    for (int j = 0; j < o.top_n; ++j) result.top.push_back({o.top_ids[j], o.top_lps[j]});
    result.token = o.token;
    result.logprob = o.logprob;
    result.nonfinite = o.nonfinite != 0;
  }
}

// Rows [first, first + count) of `tasks`, their logits at `rows` on the device.
absl::Status CudaModelRunner::ProcessDeviceRows(const float* rows,
                                                const std::vector<LogitsRowTask>& tasks,
                                                int64_t first, int64_t count,
                                                std::vector<SampleResult>* results) {
  State& s = *state_;
  const int32_t vocab = config_.vocab_size;
  ROLLOUT_RETURN_IF_ERROR(EnqueueDeviceRows(rows, tasks, first, count));
  ROLLOUT_RETURN_IF_ERROR(s.Wait(s.stream, nullptr, "sampling"));
  ConvertDeviceRows(s.staging().results.get(), first, count, results);
  const cuda::LogitsRowSpec* specs = s.staging().specs.get<cuda::LogitsRowSpec>();
  const cuda::LogitsRowResult* out = s.staging().results.get<cuda::LogitsRowResult>();
  std::vector<float> row, scratch;
  for (int64_t i = 0; i < count; ++i) {
    const LogitsRowTask& task = tasks[first + i];
    const cuda::LogitsRowResult& o = out[i];
    SampleResult& result = (*results)[first + i];
    if (specs[i].mode != cuda::kRowStats) continue;
    // top-k / top-p / min-p: the host's SampleToken picks the token from the row; the logprob
    // is the device's formula on the device's max and log-sum.
    row.resize(vocab);
    ROLLOUT_RETURN_IF_ERROR(CudaError(cudaMemcpy(row.data(), rows + i * static_cast<int64_t>(vocab),
                                                 vocab * sizeof(float), cudaMemcpyDeviceToHost),
                                      "copying a filtered row"));
    SamplingParams params = *task.params;
    params.top_logprobs = 0;
    const SampleResult picked =
        SampleToken(row.data(), vocab, params, task.sample_seed, task.position, &scratch);
    result.token = picked.token;
    result.logprob =
        o.max == -INFINITY
            ? o.uniform_lp
            : (HostScaledLogit(row[picked.token], specs[i].temperature) - o.max) - o.log_sum;
  }
  return absl::OkStatus();
}

bool CudaModelRunner::CanFeed(const std::vector<LogitsRowTask>& tasks) const {
  const State& s = *state_;
  if (s.multi_device || s.profiler.on() ||
      static_cast<int64_t>(tasks.size()) > options_.max_logit_rows) {
    return false;
  }
  for (const LogitsRowTask& task : tasks) {
    if (task.params == nullptr || task.score_token.has_value() ||
        task.params->top_logprobs > cuda::kMaxDeviceTopN ||
        HostPicksToken(task, config_.vocab_size)) {
      return false;
    }
  }
  return true;
}

}  // namespace rollout
