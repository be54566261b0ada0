#pragma once

// Where each checkpoint tensor lives on the device, piece by piece across the tensor-parallel
// ranks. Internal to runner/cuda/ (weights.cc builds and writes through them). Host bookkeeping
// only: no CUDA header.
#include <cstdint>
#include <optional>
#include <vector>

namespace rollout {
namespace cuda_runner_internal {

// A piece of a checkpoint tensor on the device: the tensor seen as [rows, cols] (1-D: [n, 1]),
// rows [row_begin, row_begin + rows) x columns [col_begin, col_begin + cols) of it, stored
// row-major as [rows, cols] at ptr.
struct Piece {
  void* ptr = nullptr;
  int64_t row_begin = 0, rows = 0, col_begin = 0, cols = 0;
  // Ranks on several devices (CudaRunnerOptions::devices): the device ptr is on. None otherwise:
  // every piece is on the current device.
  std::optional<int> device = std::nullopt;
};

// Where a checkpoint tensor goes: its pieces in the ranks (one whole piece at tensor_parallel =
// 1, except the K segments of o/down with the canonical K tree). Loading and weight updates
// write through the same bindings.
struct Binding {
  bool f32 = false;            // fp32 (norms, biases) or bf16 (matrices)
  int64_t rows = 0, cols = 0;  // the full tensor
  std::vector<Piece> pieces;
  bool whole() const {
    return pieces.size() == 1 && pieces[0].rows == rows && pieces[0].cols == cols;
  }
};

}  // namespace cuda_runner_internal
}  // namespace rollout
