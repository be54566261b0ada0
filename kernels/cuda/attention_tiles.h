#pragma once

// Where the tensor-core attention (attention_mma.cu) stages a K/V tile of kAttentionTile keys in
// shared memory, and which 16-byte copies a thread of a block issues for a tile that is one whole
// page. Host and device arithmetic, so that CI checks it (attention_tiles_test.cc); the kernels'
// bits and speed are proved on a GPU (rollout-attention-bench, tests/gpu/kernels_test.cc).
#include "kernels/cuda/ops.h"

namespace rollout::cuda {

// The element offset of 16-byte chunk c (8 bf16, dims 8 c .. 8 c + 7) of key j in a staged tile.
// kWgmma: the tile is two [kAttentionTile keys][64 dims] halves (dims 64 h .. 64 h + 63), rows of
// 128 bytes in the 128-byte swizzle that wgmma's descriptors name (chunk c' of row j at
// c' ^ (j % 8)); else one row of kHeadDim elements per key, its chunks XOR-swizzled by the key's
// low bits (c ^ (j & s), s = min(chunks, 8) - 1), so that the 8 rows one ldmatrix reads hit 8
// distinct bank groups.
// (SwizzledChunk: that position of chunk c in key j's row, which the ldmatrix reads name too.)
template <int kHeadDim>
ROLLOUT_HOST_DEVICE constexpr int SwizzledChunk(int j, int c) {
  constexpr int kChunks = kHeadDim / 8;
  return c ^ (j & ((kChunks < 8 ? kChunks : 8) - 1));
}
inline constexpr int kWgmmaHalfElems = kAttentionTile * 64;  // one half of a wgmma tile
template <int kHeadDim, bool kWgmma>
ROLLOUT_HOST_DEVICE constexpr int StagedChunkOffset(int j, int c) {
  static_assert(!kWgmma || kHeadDim == 128, "the wgmma layout is two 64-dim halves");
  if (kWgmma) return (c / 8) * kWgmmaHalfElems + j * 64 + ((c % 8) ^ (j % 8)) * 8;
  return j * kHeadDim + SwizzledChunk<kHeadDim>(j, c) * 8;
}

// One 16-byte copy of a page tile: key `key` of the tile, from element `src` past the page's
// first row at the block's kv head (the page's kAttentionTile rows are contiguous there), to
// element `dst` of the staged tile.
struct TileCopy {
  int key, src, dst;
};

// Copy r (0 .. kCopies - 1) of `thread` among kThreads: the tile's chunk i = thread + r kThreads
// (key i / chunks, chunk i % chunks), written with the thread's fixed chunk and its key stepping
// by kThreads / chunks, so that nothing is divided per copy.
template <int kHeadDim, int kThreads, bool kWgmma>
struct PageTileCopies {
  static constexpr int kChunks = kHeadDim / 8;
  static_assert(kThreads % kChunks == 0 && (kAttentionTile * kChunks) % kThreads == 0,
                "every thread copies the same chunk of keys kThreads / chunks apart");
  static constexpr int kCopies = kAttentionTile * kChunks / kThreads;
  ROLLOUT_HOST_DEVICE static constexpr TileCopy Copy(unsigned thread, int r) {
    const int c = static_cast<int>(thread % kChunks);
    const int key = static_cast<int>(thread / kChunks) + r * (kThreads / kChunks);
    return {key, (key * kChunks + c) * 8, StagedChunkOffset<kHeadDim, kWgmma>(key, c)};
  }
};

}  // namespace rollout::cuda
