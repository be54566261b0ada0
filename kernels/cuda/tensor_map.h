#pragma once

// Tensor maps (TMA descriptors) for the hand-written Hopper kernels (small_m_gemm.cu), encoded on
// the host through the driver's cuTensorMapEncodeTiled, reached through the runtime (no link
// against libcuda), and kept once encoded.
#include <cuda.h>

#include <cstdint>

namespace rollout::cuda {

// K elements of a box row: 128 bytes of bf16, the row of the 128-byte swizzle.
inline constexpr uint32_t kTileMapBoxColumns = 64;

// Whether the driver offers cuTensorMapEncodeTiled (else no tile map can be made).
bool TensorMapsAvailable();

// A bf16 3-d tensor map of `base`: dims[0] (d0) contiguous, strides (bytes) of dims 1 and 2,
// boxes of kTileMapBoxColumns x box_rows x 1 elements, 128-byte swizzle, out-of-range elements
// read as zeros. The same arguments give back the map encoded before (thread-safe). False when
// the driver lacks the entry point or refuses the map.
bool EncodeBf16TileMap(CUtensorMap* map, const void* base, uint64_t d0, uint64_t d1, uint64_t d2,
                       uint64_t stride1, uint64_t stride2, uint32_t box_rows);

}  // namespace rollout::cuda
