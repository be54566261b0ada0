// CudaModelRunner's MoE routing replay (engine/model_runner.h, ForwardWithRouting): the batch's
// forced routings checked, each slice's uploaded before it runs (EnqueueMoe hands them to the
// routing kernel), and every logits row's routing read back from the device after its slice.
#include <cuda_runtime.h>

#include <vector>

#include "absl/strings/str_format.h"
#include "common/cuda_status.h"
#include "common/status.h"
#include "runner/cuda/cuda_model_runner.h"
#include "runner/cuda/cuda_runner_state.h"

namespace rollout {

// The batch's routing replay: per token, its forced routing (ModelConfig::RoutingSize() ids,
// MoE layers ascending) or nullptr where it chooses; per logits row, its routing out.
struct CudaModelRunner::RoutingIo {
  std::vector<const std::vector<int32_t>*> forced;   // [batch tokens]
  std::vector<std::vector<int32_t>>* out = nullptr;  // [logit rows] when return_routing, or null
};

absl::Status CudaModelRunner::ForwardWithRouting(const ForwardBatch& batch,
                                                 std::vector<float>* logits,
                                                 std::vector<std::vector<int32_t>>* routing) {
  routing->clear();
  // logits: null leaves them on the GPU (ProcessLogits reads them); else they come to the host
  // as ForwardToHost's do.
  float* host_logits = nullptr;
  if (logits != nullptr) {
    logits->resize(batch.logit_rows.size() * static_cast<size_t>(config_.vocab_size));
    host_logits = logits->data();
  }
  if (!batch.asks_routing()) return FinishHostLogits(ForwardImpl(batch, host_logits), logits);
  const ModelConfig& c = config_;
  if (!c.is_moe()) {
    return absl::InvalidArgumentError(
        "routing replay (return_routing, routing) needs a mixture-of-experts model; this one "
        "is dense");
  }
  const size_t rows = batch.logit_rows.size();
  if (!batch.forced_routing.empty() && batch.forced_routing.size() != rows) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "forced routings for %d rows of a batch with %d logits rows: give one per row (empty "
        "where the row chooses)",
        batch.forced_routing.size(), rows));
  }
  const int32_t k = c.num_experts_per_tok;
  const size_t size = static_cast<size_t>(c.RoutingSize());
  RoutingIo io;
  io.forced.assign(batch.num_tokens(), nullptr);
  for (size_t r = 0; r < batch.forced_routing.size(); ++r) {
    const std::vector<int32_t>& ids = batch.forced_routing[r];
    if (ids.empty()) continue;
    if (batch.logit_rows[r] < 0 || batch.logit_rows[r] >= batch.num_tokens()) {
      return absl::InvalidArgumentError("logit_rows must be ascending token indices");
    }
    if (ids.size() != size) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "row %d's routing has %d expert ids; this model's is %d (%d MoE layers x %d experts "
          "per token)",
          r, ids.size(), size, c.NumMoeLayers(), k));
    }
    for (size_t i = 0; i < size; ++i) {
      if (ids[i] < 0 || ids[i] >= c.num_experts) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "row %d's routing: expert id %d at %d is not in [0, %d)", r, ids[i], i, c.num_experts));
      }
      for (size_t j = i / k * k; j < i; ++j) {
        if (ids[j] == ids[i]) {
          return absl::InvalidArgumentError(absl::StrFormat(
              "row %d's routing names expert %d twice in MoE layer %d", r, ids[i], i / k));
        }
      }
    }
    io.forced[batch.logit_rows[r]] = &ids;
  }
  if (batch.return_routing) {
    routing->assign(rows, {});
    io.out = routing;
  }
  return FinishHostLogits(ForwardImpl(batch, host_logits, /*async=*/false, &io), logits);
}

absl::Status CudaModelRunner::FinishHostLogits(absl::Status forward, std::vector<float>* logits) {
  if (!forward.ok() || logits == nullptr) return forward;
  // As ForwardToHost: rows that did not stay on the device are read from the host copy.
  if (!state_->last_on_device) state_->spill = *logits;
  return absl::OkStatus();
}

absl::StatusOr<bool> CudaModelRunner::UploadForcedRouting(const RoutingIo& routing, int64_t begin,
                                                          int64_t end) {
  const ModelConfig& c = config_;
  State& s = *state_;
  const int64_t n = end - begin, k = c.num_experts_per_tok, layers = c.NumMoeLayers();
  bool any = false;
  for (int64_t t = begin; t < end; ++t) any = any || routing.forced[t] != nullptr;
  if (!any) return false;
  // [n] flags and [moe layers, n, k] ids, the slice-local layout EnqueueMoe reads.
  std::vector<int32_t> rows(n, 0), ids(layers * n * k, 0);
  for (int64_t t = begin; t < end; ++t) {
    const std::vector<int32_t>* forced = routing.forced[t];
    if (forced == nullptr) continue;
    rows[t - begin] = 1;
    for (int64_t l = 0; l < layers; ++l) {
      for (int64_t j = 0; j < k; ++j) ids[(l * n + (t - begin)) * k + j] = (*forced)[l * k + j];
    }
  }
  cuda_runner_internal::RankState& rk = s.ranks[0];
  ROLLOUT_RETURN_IF_ERROR(CudaError(cudaMemcpyAsync(rk.moe_forced_rows.get(), rows.data(), n * 4,
                                                    cudaMemcpyHostToDevice, s.stream),
                                    "uploading forced routings"));
  ROLLOUT_RETURN_IF_ERROR(
      CudaError(cudaMemcpyAsync(rk.moe_forced_ids.get(), ids.data(), ids.size() * 4,
                                cudaMemcpyHostToDevice, s.stream),
                "uploading forced routings"));
  // From pageable memory the copies are staged before they return, but be explicit: the host
  // vectors die here.
  ROLLOUT_RETURN_IF_ERROR(CudaError(cudaStreamSynchronize(s.stream), "uploading forced routings"));
  return true;
}

absl::Status CudaModelRunner::DownloadRouting(const ForwardBatch& batch, int64_t begin, int64_t end,
                                              RoutingIo* routing) {
  if (routing->out == nullptr) return absl::OkStatus();
  const ModelConfig& c = config_;
  const int64_t n = end - begin, k = c.num_experts_per_tok, layers = c.NumMoeLayers();
  std::vector<int32_t> ids(layers * n * k);
  ROLLOUT_RETURN_IF_ERROR(CudaError(cudaMemcpy(ids.data(), state_->ranks[0].moe_ids.get(),
                                               ids.size() * 4, cudaMemcpyDeviceToHost),
                                    "downloading routings"));
  for (size_t r = 0; r < batch.logit_rows.size(); ++r) {
    const int64_t t = batch.logit_rows[r];
    if (t < begin || t >= end) continue;
    std::vector<int32_t>& out = (*routing->out)[r];
    out.resize(layers * k);
    for (int64_t l = 0; l < layers; ++l) {
      for (int64_t j = 0; j < k; ++j) out[l * k + j] = ids[(l * n + (t - begin)) * k + j];
    }
  }
  return absl::OkStatus();
}

}  // namespace rollout
